"""Human feedback end to end: sac_rlhf.py in human mode against a real feedback server, answered by a
scripted labeller over HTTP; then file mode trains from the labels that run saved."""

import json
import socket
import sqlite3
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from test_end_to_end import small_args

import sac_rlhf
from cleanrlhf_utils.feedback import CHOICE_LABELS

requests = pytest.importorskip("requests")
CHOICES = ["left", "right", "tie", "skip"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_token() -> str | None:
    """The token a run in the current folder made for the server it started (runs/<run>/feedback_token; the newest if
    several runs did), or None before any did."""
    files = sorted(Path("runs").glob("*/feedback_token"), key=lambda path: path.stat().st_mtime)
    return files[-1].read_text().strip() if files else None


class ScriptedLabeller(threading.Thread):
    """Answers every query it is given, cycling left / right / tie / skip by query id, with the token the run made for
    its server (run_token); first checks that the server refuses a request without it."""

    def __init__(self, base: str):
        super().__init__(daemon=True)
        self.base, self.given, self.stop = base, {}, threading.Event()
        self.refused_without_token = None

    def run(self):
        http = requests.Session()
        while not self.stop.is_set():
            try:
                if "X-Feedback-Token" not in http.headers:
                    if run_token() is None:  # the trainer has not made its token yet
                        raise requests.ConnectionError
                    self.refused_without_token = requests.get(f"{self.base}/api/next", params={"annotator": "x"}, timeout=5).status_code
                    http.headers["X-Feedback-Token"] = run_token()
                query = http.get(f"{self.base}/api/next", params={"annotator": "bot"}, timeout=5).json()
            except requests.ConnectionError:  # the trainer has not started the server yet
                time.sleep(0.1)
                continue
            if query.get("waiting"):
                time.sleep(0.1)
                continue
            for side in ("left_url", "right_url"):  # the clips are served and are mp4s
                assert http.get(self.base + query[side], timeout=5).content[4:8] == b"ftyp"
            choice = CHOICES[len(self.given) % 4]  # left, right, tie, skip in turn
            reply = http.post(f"{self.base}/api/queries/{query['query_id']}/label", json={"choice": choice, "annotator": "bot"}, timeout=5)
            assert reply.status_code == 201, reply.text
            self.given[query["query_id"]] = choice


def test_human_mode_receives_exactly_the_labels_given_and_file_mode_reuses_them(chdir_tmp):
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    labeller = ScriptedLabeller(base)
    labeller.start()
    args = small_args(
        "human",
        total_timesteps=800,
        teacher_feedback_mode="human",
        feedback_server_url=base,
        feedback_server_autostart=True,
        feedback_check_clips=2,
        teacher_feedback_total_queries=12,
        teacher_feedback_num_queries_per_session=6,
        teacher_feedback_schedule="linear",
        segment_length=10,
        max_augmentation_offset=3,
        min_augmentation_offset=1,
        clip_width=96,  # small clips: rendering is most of this test's time
        clip_height=72,
    )
    try:
        summary = sac_rlhf.main(args)
    finally:
        labeller.stop.set()
    labeller.join(timeout=10)

    # Two sessions of 6 queries; the labeller answered all 12 (the check's clips, also up as a query to reorder, are
    # never handed out), skips are not labels.
    shown = [json.loads(line) for line in Path("runs/human/shown_pairs.jsonl").read_text().splitlines()]
    assert sorted(labeller.given) == [pair["query_id"] for pair in shown] and len(shown) == 12
    expected = [CHOICE_LABELS[labeller.given[q]] for q in sorted(labeller.given) if labeller.given[q] != "skip"]
    assert summary["labels_obtained"] == len(expected) == 9 and summary["queries_skipped"] == 3
    checkpoint = torch.load("models/human/latest/checkpoint.pt", weights_only=False)
    np.testing.assert_array_equal(checkpoint["preference_buffer"]["labels"], np.array(expected, dtype=np.float32))
    assert checkpoint["teacher"]["cursor"] >= 12

    # Each uploaded pair is logged with its query id and segments' env returns (no objective: none of its returns).
    assert [(pair["session"], pair["pair"]) for pair in shown] == [(s, i) for s in (1, 2) for i in range(6)]
    assert all("left_objective_return" not in pair and pair["left_env_return"] != pair["right_env_return"] for pair in shown)

    # The server was started by the trainer with a token of its own (no token was given): kept for a resume in the
    # run's folder, readable by its owner only, never in args.json or the server's log; the server refused the labeller
    # until it sent it.
    token = Path("runs/human/feedback_token").read_text().strip()
    assert len(token) >= 32 and Path("runs/human/feedback_token").stat().st_mode & 0o777 == 0o600
    assert labeller.refused_without_token == 401
    assert token not in Path("runs/human/args.json").read_text() and token not in Path("runs/human/feedback_server.log").read_text()
    # The server was started by the trainer, logged to the run and stopped at the end.
    assert Path("runs/human/feedback_server.log").is_file()
    with pytest.raises(requests.ConnectionError):
        requests.get(base + "/api/config", timeout=2)

    # After each reward update, 2 clips with the reward model's predicted return (the check view).
    with sqlite3.connect("runs/human/feedback_data/feedback.sqlite3") as db:  # the autostarted server's data: the run's own
        checks = db.execute("SELECT clip, predicted_return, step FROM evaluations WHERE kind = 'check' ORDER BY id").fetchall()
        agent = db.execute("SELECT clip, step FROM evaluations WHERE kind = 'agent'").fetchall()
    assert [step for _, _, step in checks] == [400, 400, 700, 700]
    assert all(Path("runs/human/feedback_data/clips").rglob(clip) for clip, _, _ in checks)
    assert len({round(value, 6) for _, value, _ in checks}) > 1
    # and the start of the final evaluation's episode: what the agent does now, beside the pairs
    assert agent == [("run1_eval_800.mp4", 800)]

    # The labels with their segments are in runs/human/labels.sqlite ...
    with sqlite3.connect("runs/human/labels.sqlite") as db:
        assert [row[0] for row in db.execute("SELECT label FROM labels ORDER BY id")] == expected
    # ... and a new run trains from them without asking anyone.
    sac_rlhf.main(
        small_args(
            "replay",
            total_timesteps=800,
            teacher_feedback_mode="file",
            feedback_file="runs/human/labels.sqlite",
            teacher_feedback_total_queries=12,
            teacher_feedback_num_queries_per_session=6,
            segment_length=10,
            max_augmentation_offset=3,
            min_augmentation_offset=1,
        )
    )
    replayed = torch.load("models/replay/latest/checkpoint.pt", weights_only=False)["preference_buffer"]
    np.testing.assert_array_equal(replayed["labels"], checkpoint["preference_buffer"]["labels"])
    np.testing.assert_array_equal(replayed["obs_actions"], checkpoint["preference_buffer"]["obs_actions"])
