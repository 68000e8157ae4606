"""The trainer's side of the feedback server's guard, with the real training script: it proves the server holds its
token before it sends it (a squatter on the port, or a server with another token, never sees it and is refused in one
line), a human run whose server is not there says so at once, names --feedback-server-autostart and stops cleanly, the
resume line leaves the token out however it was spelt, a stop during a session counts the labels the run stored, and a
resumed run tells the page its real step and prints no new login link unless asked."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from test_feedback_hardening import Server, browser  # noqa: F401 (a fixture)
from test_feedback_resume import human_args
from test_human_feedback import free_port, run_token

import sac_rlhf
from cleanrlhf_utils import cli, protocol

requests = pytest.importorskip("requests")
REPO = Path(__file__).resolve().parents[1]


class Squatter(threading.Thread):
    """Something else listening on the port: an HTTP server that answers every request 200 with an empty JSON object
    (the most agreeable impostor), keeping every byte it receives."""

    def __init__(self):
        super().__init__(daemon=True)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port, self.received = self.listener.getsockname()[1], b""

    def run(self):
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(2)
                try:
                    self.received += conn.recv(65536)
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}")
                except OSError:
                    pass


def human_run(folder: Path, url: str, *flags: str) -> subprocess.Popen:
    """sac_rlhf.py in human mode from the command line, in `folder`, with its output in pipes."""
    command = [sys.executable, str(REPO / "framework" / "sac_rlhf.py"), "--env-id", "Hopper-v5", "--teacher-feedback-mode", "human"]
    command += ["--feedback-server-url", url, "--total-timesteps", "1000", "--run-name", "guarded", "--no-progress-bar", *flags]
    env = {**os.environ, "MUJOCO_GL": "egl"}
    env.pop(protocol.TOKEN_ENV, None)
    return subprocess.Popen(command, cwd=folder, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def test_a_squatter_on_the_port_or_a_server_with_another_token_never_sees_the_token(tmp_path):
    squatter = Squatter()
    squatter.start()
    (tmp_path / "a").mkdir()
    other = Server(tmp_path / "a", "--token", "someone-elses-token")  # a real feedback server, not this run's
    started = len(other.log.read_text())
    runs = {}
    try:
        for name, port in (("squatter", squatter.port), ("other", other.port)):
            (tmp_path / name).mkdir()
            runs[name] = human_run(tmp_path / name, f"http://127.0.0.1:{port}", "--feedback-server-autostart")
        done = {name: run.communicate(timeout=120) for name, run in runs.items()}
    finally:
        for run in runs.values():
            run.kill()
        squatter.listener.close()
        log = other.stop()[started:]
    for name, (out, err) in done.items():
        token = (tmp_path / name / "runs" / "guarded" / "feedback_token").read_text().strip()
        assert runs[name].returncode == 1, (name, out, err)
        assert err.strip().count("\n") == 0 and "cannot prove it holds this run's token" in err and "was not sent" in err, err
        assert "Traceback" not in out + err, out + err
        seen = squatter.received.decode("latin-1") if name == "squatter" else log
        assert token not in seen and protocol.TOKEN_HEADER.lower() not in seen.lower(), seen[-2000:]
    assert squatter.received.startswith(b"GET /api/proof?nonce=")  # it was asked, and failed to answer
    assert "GET /api/proof HTTP/1.1" in log and "/api/config" not in log  # asked for its proof, and nothing else


def test_a_human_run_without_a_server_says_so_at_once_names_autostart_and_stops_cleanly(tmp_path):
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    started = time.monotonic()
    run = human_run(tmp_path, url, "--feedback-server-token", "t0ken")
    said_at = None
    for line in run.stdout:
        if line.startswith("feedback server: nothing answers at"):
            said_at = time.monotonic() - started
            assert "--feedback-server-autostart" in line and url in line, line
            break
    out, err = run.communicate(timeout=180)
    stopped_at = time.monotonic() - started
    assert said_at is not None and run.returncode == 1, (out, err)
    # the wait is short (10 s; the rest is the interpreter's exit on a loaded machine), not the 10 minutes a server that went
    # away mid-run is waited for: then one line, and the run is over
    assert stopped_at - said_at <= 90, (said_at, stopped_at)
    assert err.strip().count("\n") == 0 and "--feedback-server-autostart" in err and url in err, err
    assert "Traceback" not in out + err and "EGL" not in out + err, out + err


def test_the_resume_line_leaves_the_token_out_however_it_is_spelt():
    base = ["framework/sac_rlhf.py", "--env-id", "Hopper-v5", "--teacher-feedback-mode", "human"]
    for spelling in (
        ["--feedback_server_token", "s3cret-1"],
        ["--feedback_server_token=s3cret-1"],
        ["--feedback-server-token", "s3cret-1"],
        ["--feedback-server-token=s3cret-1"],
    ):
        line = cli.resume_command([*base, *spelling, "--seed", "3"], Path("models/r/latest"))
        assert "s3cret-1" not in line and "token" not in line, line
        assert line.endswith("--env-id Hopper-v5 --teacher-feedback-mode human --seed 3 --resume models/r/latest"), line
    # the parser takes the underscore spelling (so the line must leave it out)
    args = cli.command_line_args(sac_rlhf.Args, ["--teacher-feedback-mode", "human", "--feedback_server_token", "s3cret-1"])
    assert args.feedback_server_token == "s3cret-1"


def person_answers(base: str, answers: int, then=None):
    """A person who answers `answers` pairs of the run's server as they come, then calls `then()`."""

    def answer():
        http, given = requests.Session(), 0
        while given < answers:
            try:
                if protocol.TOKEN_HEADER not in http.headers:
                    if run_token() is None:
                        raise requests.ConnectionError
                    http.headers[protocol.TOKEN_HEADER] = run_token()
                query = http.get(f"{base}/api/next", params={"annotator": "ann"}, timeout=5).json()
            except requests.ConnectionError:
                time.sleep(0.05)
                continue
            if query.get("waiting"):
                time.sleep(0.05)
                continue
            reply = http.post(f"{base}/api/queries/{query['query_id']}/label", json={"choice": "left", "annotator": "ann"}, timeout=5)
            assert reply.status_code == 201, reply.text
            given += 1
        if then is not None:
            then()

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    return thread


@pytest.fixture
def sigterm_stops_the_run():
    previous = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, previous)


def test_a_sigterm_during_a_session_counts_the_labels_the_run_stored(chdir_tmp, capsys, sigterm_stops_the_run):
    """One answer of session 1 is in when SIGTERM comes: the run keeps that label (labels.sqlite) and says so."""
    base = f"http://127.0.0.1:{free_port()}"
    person = person_answers(base, 1, then=lambda: (time.sleep(1.0), os.kill(os.getpid(), signal.SIGTERM)))
    with pytest.raises(KeyboardInterrupt):
        sac_rlhf.main(human_args("stopped", base))
    person.join(timeout=10)
    out = capsys.readouterr().out
    import sqlite3

    with sqlite3.connect("runs/stopped/labels.sqlite") as db:
        stored = db.execute("SELECT COUNT(*) FROM labels").fetchone()[0]
    assert stored == 1
    assert "labels: the run keeps 1 labels (1 of the open session, which --resume finishes)" in out, out


HUMAN_FLAGS = (
    "--total-timesteps 800 --learning-starts 200 --total-explore-steps 400 --teacher-feedback-total-queries 10 "
    "--teacher-feedback-num-queries-per-session 5 --teacher-feedback-frequency 300 --teacher-feedback-schedule linear "
    "--segment-length 10 --max-augmentation-offset 3 --min-augmentation-offset 1 --batch-size 64 --actor-hidden-dim 64 "
    "--critic-hidden-dim 64 --reward-net-hidden-dim 64 --reward-net-epochs 5 --explore-knn-sample-size 500 "
    "--evaluation-frequency 0 --evaluation-episodes 1 --checkpoint-frequency 0 --feedback-check-clips 0 --clip-width 64 "
    "--clip-height 48 --feedback-server-autostart"
).split()  # test_feedback_resume.human_args on the command line: sessions of 5 pairs at steps 400 and 700 of 800


def session_opened(base: str, session: int, timeout: float = 120) -> None:
    """Waits until the run's trainer reports it waits for the answers of `session`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            progress = requests.get(f"{base}/api/runs/1/progress", headers={protocol.TOKEN_HEADER: run_token()}, timeout=5).json()
            if (progress["progress"] or {}).get("phase") == "labelling" and progress["progress"].get("session") == session:
                return
        except (requests.ConnectionError, ValueError, KeyError, TypeError):
            pass
        time.sleep(0.1)
    raise TimeoutError(f"session {session} was not opened within {timeout} s")


def test_a_resumed_run_tells_the_page_its_step_and_prints_a_login_link_only_when_asked(chdir_tmp, request):
    """Stopped in session 2 (step 700) and resumed: the page says the run waits at step 700, not 0; the resumed run
    prints no new login link (browsers logged in before stay logged in) unless --feedback-login-link asks for one."""
    chromium = request.getfixturevalue("browser")  # test_feedback_hardening's fixture
    url = f"http://127.0.0.1:{free_port()}"
    outputs = []
    for attempt, extra in enumerate(
        ([], ["--resume", "models/guarded/latest"], ["--resume", "models/guarded/latest", "--feedback-login-link"])
    ):
        run = human_run(chdir_tmp, url, *HUMAN_FLAGS, *extra)
        try:
            if attempt == 0:  # session 1, and one answer of session 2
                person_answers(url, 6).join(timeout=300)
            session_opened(url, 2)
            if attempt == 1:  # what the page says while the resumed run waits
                token = {protocol.TOKEN_HEADER: run_token()}
                link = url + requests.post(url + protocol.LOGIN_CODES, json={}, headers=token, timeout=5).json()["url"]
                page = chromium.new_page()
                page.goto(link)
                page.fill("#annotator-input", "ann")
                page.click("#name-save")
                page.wait_for_function("() => document.querySelector('#run-state').textContent.includes('Waiting for you')", timeout=20_000)
                state = page.inner_text("#run-state")
                page.close()
                assert "paused at step 700 of 800" in state, state
            time.sleep(0.5)
            run.send_signal(signal.SIGTERM)
            out, err = run.communicate(timeout=120)
            assert run.returncode == 143, err
        finally:
            run.kill()
        outputs.append(out)
    assert outputs[0].count("feedback server: log in at") == 1
    assert "log in at" not in outputs[1] and "a new login link: --feedback-login-link" in outputs[1], outputs[1]
    assert outputs[2].count("feedback server: log in at") == 1 and "within 15 min" in outputs[2]
