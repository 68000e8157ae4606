"""A feedback server that goes away mid-session: the trainer says so on the terminal within seconds; a server the run
started is started again on the same data and the session goes on; one it did not start is asked again for a while,
then the run stops as at Ctrl-C, with its checkpoint, its summary and its resume line, and the resumed run finishes the
session. Real components: the training script's main (and its command line), a real feedback server killed with
SIGKILL, a person posting over HTTP from a thread."""

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_feedback_corrections import Person, ctrl_c_raises_keyboard_interrupt, labels_check  # noqa: F401 (fixture)
from test_feedback_resume import human_args
from test_human_feedback import free_port

import sac_rlhf
from cleanrlhf_utils.cli import cli
from cleanrlhf_utils.feedback import FeedbackClient
from cleanrlhf_utils.protocol import TOKEN_ENV

requests = pytest.importorskip("requests")
SERVER = Path(__file__).resolve().parents[1] / "humanFeedback" / "feedback_server.py"
TOKEN = "outage-test-token"


def server_pid(port: int) -> int:
    """The process of the feedback server listening on `port` (started by the trainer: the test does not hold it)."""
    for entry in Path("/proc").iterdir():
        try:
            command = (entry / "cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        if b"humanFeedback.feedback_server" in command and str(port).encode() in command:
            return int(entry.name)
    raise AssertionError(f"no feedback server on port {port}")


def test_a_server_the_run_started_is_started_again_and_the_session_goes_on(chdir_tmp, capsys):
    base = f"http://127.0.0.1:{free_port()}"
    port = int(base.rsplit(":", 1)[1])
    timings = {}

    def script(person: Person):
        for choice in ("left", "right"):
            person.label(person.wait_for_pair(1)["query_id"], choice)
        os.kill(server_pid(port), signal.SIGKILL)
        killed = time.monotonic()
        while True:  # the same token, the same port: the page works again once the trainer started it
            try:
                if person.http.get(f"{base}/api/config", timeout=1).status_code == 200:
                    break
            except requests.ConnectionError:
                time.sleep(0.1)
        timings["back_after"] = time.monotonic() - killed
        while len(person.choices) < 8:
            person.label(person.wait_for_pair()["query_id"], "tie" if len(person.choices) % 2 else "left")

    person = Person(base, script)
    person.start()
    args = human_args("restart", base, teacher_feedback_total_queries=8, teacher_feedback_num_queries_per_session=4)
    summary = sac_rlhf.main(args)
    person.join(timeout=30)
    assert person.failure is None, person.failure

    out = capsys.readouterr().out
    assert "feedback server: the server this run started stopped (exit code -9); starting it again" in out
    assert f"feedback server: answering again at {base}/; labels given so far are kept" in out
    assert timings["back_after"] < 20
    # every answer, before and after the restart, once
    assert summary["labels_obtained"] == 8 and labels_check(Path("runs/restart")).returncode == 0


def start_server(data_dir: Path, port: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, str(SERVER), "--port", str(port), "--data-dir", str(data_dir), "--token", TOKEN])
    while True:
        try:
            requests.get(f"http://127.0.0.1:{port}/api/config", headers={"X-Feedback-Token": TOKEN}, timeout=1)
            return proc
        except requests.ConnectionError:
            assert proc.poll() is None, "the feedback server did not start"
            time.sleep(0.1)


def test_a_server_that_stays_away_stops_the_run_with_its_summary_and_resume_line(chdir_tmp, monkeypatch, capsys):
    """The run's server is someone else's (started by hand): the trainer waits for it FeedbackClient.RETRY_SECONDS
    (10 minutes; 6 s here), saying at once that it is away, then stops resumable, and the resumed run gets the rest."""
    monkeypatch.setattr(FeedbackClient, "RETRY_SECONDS", 6.0)
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    server = start_server(chdir_tmp / "server", port)
    flags = (
        "--env-id Hopper-v5 --run-name away --total-timesteps 800 --learning-starts 200 --total-explore-steps 400 "
        "--teacher-feedback-total-queries 8 --teacher-feedback-num-queries-per-session 4 --teacher-feedback-frequency 300 "
        "--teacher-feedback-schedule linear --segment-length 10 --max-augmentation-offset 3 --min-augmentation-offset 1 "
        "--batch-size 64 --actor-hidden-dim 64 --critic-hidden-dim 64 --reward-net-hidden-dim 64 --reward-net-epochs 5 "
        "--explore-knn-sample-size 500 --evaluation-frequency 0 --checkpoint-frequency 0 --no-progress-bar "
        f"--teacher-feedback-mode human --feedback-server-url {base} --feedback-check-clips 0 --clip-width 64 --clip-height 48"
    )

    def answer_two_then_kill(person: Person):
        person.http.headers["X-Feedback-Token"] = TOKEN
        for choice in ("left", "right"):
            person.label(person.wait_for_pair(1)["query_id"], choice)
        server.kill()

    person = Person(base, answer_two_then_kill)
    person.start()
    monkeypatch.setattr(sys, "argv", ["framework/sac_rlhf.py", *shlex.split(flags)])
    started = time.monotonic()
    with pytest.raises(SystemExit) as stopped:
        cli(sac_rlhf.Args, sac_rlhf.main)
    person.join(timeout=30)
    assert person.failure is None and stopped.value.code == 1 and time.monotonic() - started < 120
    out, err = capsys.readouterr()
    assert f"feedback server: {base} does not answer" in out
    assert f"error: feedback server {base} unreachable" in err
    resume = next(line for line in out.splitlines() if line.startswith("to resume: "))
    assert resume.endswith("--resume models/away/latest") and TOKEN not in out + err
    assert Path("runs/away/summary.json").is_file() and Path("models/away/latest/checkpoint.pt").is_file()

    # The server is back (its data kept the two answers): the resumed run asks the same session and gets the rest.
    server = start_server(chdir_tmp / "server", port)
    try:

        def answer_the_rest(person: Person):
            person.http.headers["X-Feedback-Token"] = TOKEN
            while len(person.choices) < 6:
                person.label(person.wait_for_pair()["query_id"], "left")

        person = Person(base, answer_the_rest)
        person.start()
        monkeypatch.setattr(sys, "argv", ["framework/sac_rlhf.py", *shlex.split(resume.removeprefix("to resume: "))[2:]])
        cli(sac_rlhf.Args, sac_rlhf.main)
        person.join(timeout=30)
        assert person.failure is None
    finally:
        server.kill()
    summary = json.loads(Path("runs/away/summary.json").read_text())
    assert summary["labels_obtained"] == 8 and summary["feedback_sessions"] == 2
