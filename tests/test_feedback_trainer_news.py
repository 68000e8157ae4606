"""The trainer's side of the feedback page: its progress reaches the page without ever
slowing or breaking training, the run's question and clips at the environment's real time and the page's size, and an
autostarted server keeps its data in the run's folder. Real server processes, real SQLite, real rendering."""

import socket
import sqlite3
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from cleanrlhf_utils.feedback import FeedbackArgs, FeedbackClient, HumanTeacher, connect_human_teacher, start_feedback_server

requests = pytest.importorskip("requests")
imageio_ffmpeg = pytest.importorskip("imageio_ffmpeg")
np = pytest.importorskip("numpy")
TOKEN = "news-test-token"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)
    return value


def test_trainer_reports_its_progress_rate_limited_and_never_waits_for_an_absent_server(tmp_path):
    url = f"http://127.0.0.1:{free_port()}"
    server = start_feedback_server(url, tmp_path / "server.log", TOKEN, data_dir=tmp_path / "data")
    http = requests.Session()
    http.headers["X-Feedback-Token"] = TOKEN
    try:
        client = FeedbackClient(url, TOKEN)
        run_id = client.create_run("news", "Hopper-v5", {})
        teacher = HumanTeacher(client, run_id, renderer=None, clip_dir=tmp_path, fps=30)
        teacher.total_steps, teacher.first_session_step, teacher.session_frequency = 100_000, 10_000, 5_000
        loop = SimpleNamespace(global_step=12_000, sessions_done=1)
        teacher.training_progress(loop.global_step, loop.sessions_done, 5)
        progress = wait_for(lambda: http.get(f"{url}/api/runs/{run_id}/progress", timeout=5).json()["progress"])
        assert (progress["step"], progress["phase"], progress["total_steps"]) == (12_000, "training", 100_000)
        assert (progress["sessions_done"], progress["sessions_total"], progress["next_session_step"]) == (1, 5, 15_000)
        assert progress["stale"] is False and "seconds_to_next_session" not in progress  # no speed measured yet
        teacher.reporter.join(timeout=5)

        loop.global_step = 12_500  # within progress_seconds: not sent
        teacher.training_progress(loop.global_step, loop.sessions_done, 5)
        assert teacher.reporter.is_alive() is False
        assert http.get(f"{url}/api/runs/{run_id}/progress", timeout=5).json()["progress"]["step"] == 12_000
        teacher.next_report = 0.0  # the next one is due: now with a measured speed and an estimate of the next session
        teacher.training_progress(loop.global_step, loop.sessions_done, 5)
        teacher.reporter.join(timeout=5)
        progress = http.get(f"{url}/api/runs/{run_id}/progress", timeout=5).json()["progress"]
        assert progress["step"] == 12_500 and progress["steps_per_second"] > 0
        assert progress["seconds_to_next_session"] == pytest.approx(2_500 / progress["steps_per_second"], abs=0.11)  # both rounded
    finally:
        server.terminate()
        server.wait(timeout=10)

    # The server is gone: a million steps of reports cost little and raise nothing; the sender gives up within 2 s.
    teacher.next_report = 0.0
    start = time.perf_counter()
    for step in range(1_000_000):
        loop.global_step = step
        teacher.training_progress(loop.global_step, loop.sessions_done, 5)
    elapsed = time.perf_counter() - start
    assert elapsed < 5.0, elapsed  # about 1 µs a step here, against milliseconds for a SAC update
    teacher.reporter.join(timeout=5)
    assert not teacher.reporter.is_alive()


def test_human_run_sends_its_question_renders_clips_at_real_time_and_page_size_and_keeps_its_server_data(chdir_tmp):
    tmp_path = chdir_tmp
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    args = SimpleNamespace(
        **vars(FeedbackArgs(feedback_server_url=url, feedback_server_autostart=True, feedback_instructions=" Which one hops further? ")),
        env_id="Hopper-v5",
        seed=3,
        rating_scale=0,
        segment_length=50,
        total_timesteps=20_000,
        teacher_feedback_frequency=5_000,
        unsupervised_exploration=True,
        total_explore_steps=2_000,
    )
    run_dir = tmp_path / "runs" / "hop"
    teacher = connect_human_teacher(args, "hop", run_dir, tmp_path / "clips")
    http = requests.Session()  # with the token the run made for the server it started, kept in the run's folder
    http.headers["X-Feedback-Token"] = (run_dir / "feedback_token").read_text().strip()
    try:
        # item 16: the autostarted server's database is the run's own
        assert (run_dir / "feedback_data" / "feedback.sqlite3").is_file()
        run = http.get(f"{url}/api/runs/{teacher.run_id}", timeout=5).json()
        # item 15: the question, and clips at the environment's real time (Hopper: dt = 0.008 s, 125 steps a second)
        assert run["meta"]["instructions"] == "Which one hops further?"
        assert run["meta"]["clip_fps"] == pytest.approx(125.0) and run["meta"]["clip_seconds"] == pytest.approx(0.4)
        assert teacher.first_session_step == 2_000 and teacher.session_frequency == 5_000

        env = teacher.renderer.env
        from cleanrlhf_utils.envs import get_physics_state

        states = np.repeat(get_physics_state(env)[None], 50, axis=0)
        clip = teacher.render_clip("one.mp4", states, np.ones(50, dtype=bool))
        reader = imageio_ffmpeg.read_frames(str(clip))
        meta = next(reader)
        frames, seconds = imageio_ffmpeg.count_frames_and_secs(str(clip))
        reader.close()
        assert tuple(meta["size"]) == (576, 432)  # the width of one of the page's two columns at its widest
        assert frames == 50 and seconds == pytest.approx(0.4, abs=0.01)

        # item 12: a session declares its size before its first pair uploads (also with --feedback-async's start)
        segments = {
            "segment_ids": np.array([[0, 10], [1, 11], [2, 12]]),
            "physics_states": np.repeat(states[None, None, :3], 3, 0).repeat(2, 1),
        }
        segments["masks"] = np.ones((3, 2, 3), dtype=bool)
        query_ids = teacher.start(segments, 1)
        progress = http.get(f"{url}/api/runs/{teacher.run_id}/progress", timeout=5).json()["progress"]
        assert (progress["phase"], progress["session"], progress["session_size"]) == ("labelling", 1, 3)
        wait_for(lambda: all(q is not None for q in query_ids), timeout=60)
        lease = http.get(f"{url}/api/next", params={"annotator": "a"}, timeout=5).json()
        assert lease["progress"]["session_total"] == 3 and lease["instructions"] == "Which one hops further?"
        teacher.finish()
    finally:
        teacher.close()
    with sqlite3.connect(run_dir / "feedback_data" / "feedback.sqlite3") as db:  # its last news: stopped before the end
        (report,) = db.execute("SELECT report FROM run_progress").fetchone()
    assert '"phase": "stopped"' in report
    assert not Path("feedback_data").exists()  # nothing in the working directory
