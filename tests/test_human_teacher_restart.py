"""The trainer's side of human feedback survives the feedback server dying: HumanTeacher.label keeps
waiting (its client retries), the server is restarted on the same port and data dir, and the session
ends with exactly the labels people gave before and after the restart. Plus FeedbackClient's errors:
an unreachable server and a 4xx answer."""

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

import sac_rlhf
from cleanrlhf_utils.envs import SegmentRenderer, get_physics_state
from cleanrlhf_utils.feedback import CHOICE_LABELS, FeedbackClient, FeedbackServerError, HumanTeacher

SERVER = Path(__file__).resolve().parents[1] / "humanFeedback" / "feedback_server.py"
ENV_ID = "Hopper-v5"
TOKEN = "restart-test-token"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int, data_dir: Path, log: Path) -> subprocess.Popen:
    with open(log, "ab") as out:
        process = subprocess.Popen(
            [sys.executable, str(SERVER), "--port", str(port), "--data-dir", str(data_dir)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "FEEDBACK_SERVER_TOKEN": TOKEN},
        )
    probe = FeedbackClient(f"http://127.0.0.1:{port}", TOKEN, retry_seconds=0, timeout=2)
    deadline = time.monotonic() + 20
    while not probe.alive():
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            process.wait()
            pytest.fail(f"the feedback server did not start on port {port}:\n{log.read_text()}")
        time.sleep(0.05)
    return process


def tiny_segments(num_pairs: int, length: int) -> tuple[dict, np.ndarray]:
    """Segment pairs from a small replay buffer of real random-action Hopper transitions."""
    env = sac_rlhf.make_env(ENV_ID, seed=0)()
    obs, _ = env.reset(seed=0)
    rb = sac_rlhf.ReplayBuffer(60, obs.shape[0], env.action_space.shape[0], sac_rlhf.physics_state_size(env))
    episode = 0
    for _ in range(60):
        state = get_physics_state(env)
        action = env.action_space.sample()
        next_obs, reward, terminated, truncated, _ = env.step(action)
        rb.add(obs, next_obs, action, reward, terminated, episode, state)
        obs = next_obs
        if terminated or truncated:
            episode, (obs, _) = episode + 1, env.reset()
    env.close()
    idx, mask = rb.sample_segment_pairs(num_pairs, length, np.random.default_rng(0))
    return rb.gather_segments(idx, mask), idx[:, :, 0]


class GatedRenderer(SegmentRenderer):
    """Renders the first `free_clips` clips at once; the next one waits for `gate`, so the upload thread
    is held back while the server is killed and then uploads into the outage."""

    def __init__(self, *args, free_clips: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.free_clips, self.rendered, self.gate = free_clips, 0, threading.Event()

    def render_states(self, states):
        if self.rendered >= self.free_clips:
            assert self.gate.wait(timeout=30), "the test never opened the gate"
        self.rendered += 1
        return super().render_states(states)


def answer_next(base: str, choice: str, timeout: float = 20.0) -> tuple[int, int]:
    """Like a person at the page: take the next pair, play both clips, answer. Returns (query id, pair index)."""
    client = FeedbackClient(base, TOKEN, retry_seconds=10, timeout=5)
    deadline = time.monotonic() + timeout
    while True:
        query = client.request("GET", "/api/next?annotator=bot")
        if not query.get("waiting"):
            break
        assert time.monotonic() < deadline, "no pair became available"
        time.sleep(0.05)
    for side in ("left_url", "right_url"):
        with urllib.request.urlopen(urllib.request.Request(base + query[side], headers={"X-Feedback-Token": TOKEN}), timeout=5) as response:
            assert response.read()[4:8] == b"ftyp"
    reply = client.request("POST", f"/api/queries/{query['query_id']}/label", json_body={"choice": choice, "annotator": "bot"})
    assert reply["choice"] == choice
    pair = int(re.search(r"_q(\d+)_", query["left_url"]).group(1))  # HumanTeacher names clips run<r>_s<s>_q<i>_...
    return query["query_id"], pair


def test_label_session_survives_a_server_restart(chdir_tmp):
    port, data_dir, log = free_port(), chdir_tmp / "feedback_data", chdir_tmp / "server.log"
    base = f"http://127.0.0.1:{port}"
    segments, segment_ids = tiny_segments(num_pairs=4, length=5)
    server = start_server(port, data_dir, log)
    renderer = GatedRenderer(ENV_ID, 64, 48, free_clips=4)  # pairs 0 and 1 before the crash
    result: dict = {}
    try:
        client = FeedbackClient(base, TOKEN, retry_seconds=60, timeout=5)
        run_id = client.create_run("restart", ENV_ID, {"segment_length": 5})
        teacher = HumanTeacher(client, run_id, renderer, chdir_tmp / "clips", fps=30, poll_seconds=0.05)
        upload_calls: list[float] = []
        upload_queries = client.upload_queries

        def recorded_upload(*args, **kwargs):  # notes when each upload starts, before its first attempt
            upload_calls.append(time.monotonic())
            return upload_queries(*args, **kwargs)

        client.upload_queries = recorded_upload

        def session():
            try:
                result["labels"], result["annotators"] = teacher.label(segments, 1)
            except BaseException as error:
                result["error"] = error

        worker = threading.Thread(target=session, daemon=True)
        worker.start()
        choices = ["left", "right", "tie", "skip"]
        given: dict[int, str] = {}  # pair index -> choice
        for choice in choices[:2]:
            _, pair = answer_next(base, choice)
            given[pair] = choice

        server.send_signal(signal.SIGKILL)
        server.wait()
        renderer.gate.set()  # pair 2 is rendered and its upload starts while nothing listens
        deadline = time.monotonic() + 20
        while len(upload_calls) < 3:
            assert time.monotonic() < deadline, "the upload of pair 2 never started"
            time.sleep(0.02)
        time.sleep(1.0)
        assert worker.is_alive(), result.get("error")
        server = start_server(port, data_dir, log)

        for choice in choices[2:]:
            _, pair = answer_next(base, choice)
            given[pair] = choice
        worker.join(timeout=30)
        assert not worker.is_alive(), "label() did not return after every pair was answered"
        assert "error" not in result, repr(result.get("error"))

        assert sorted(given) == [0, 1, 2, 3]
        expected = np.array([CHOICE_LABELS[given[i]] for i in range(4)], dtype=np.float32)
        np.testing.assert_array_equal(result["labels"], expected)  # nan (skip) where expected has nan
        assert result["annotators"] == ["bot"] * 4
        _, server_cursor = client.answers(run_id, 0)
        assert server_cursor == 4 and teacher.cursor == server_cursor
        status = client.request("GET", f"/api/runs/{run_id}/status")
        assert status["queries"] == 4 and status["labelled"] == 4  # no pair was uploaded twice
    finally:
        if server.poll() is None:
            server.kill()
        server.wait()
        renderer.gate.set()
        renderer.close()


def test_client_errors_unreachable_server_and_4xx(chdir_tmp):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    start = time.monotonic()
    with pytest.raises(FeedbackServerError, match=re.escape(url)):
        FeedbackClient(url, TOKEN, retry_seconds=1).request("GET", "/api/config")
    assert time.monotonic() - start < 3

    server = start_server(port, chdir_tmp / "feedback_data", chdir_tmp / "server.log")
    try:
        client = FeedbackClient(url, TOKEN, retry_seconds=60)
        start = time.monotonic()
        with pytest.raises(FeedbackServerError, match="HTTP 404") as error:
            client.answers(999, 0)
        assert time.monotonic() - start < 1.0  # a 4xx is not retried
        assert "Run 999 does not exist" in str(error.value)
    finally:
        server.kill()
        server.wait()
