"""A person's walk through the real page of a real human-mode run, in headless Chromium, with and without
--feedback-async: they answer each pair, and right after the last pair of the first session they press Backspace,
see their earlier answer and that a new one counts, and answer the other way. At the run's end the trainer's labels
are the server's (toolbox/labels.py check), the corrected pair with the second answer."""

import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cleanrlhf_utils.feedback import CHOICE_LABELS, FeedbackClient, FeedbackServerUnreachable
from cleanrlhf_utils.protocol import TOKEN_ENV

CHROMIUM = Path("/usr/bin/chromium")
if not CHROMIUM.exists():
    pytest.skip("/usr/bin/chromium is missing (bash dev/install_test_deps.sh)", allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is missing (pip install playwright)")
from test_human_feedback import free_port  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TOKEN = "walk-test-token"
# the query id of the pair on screen, once it differs from `last`
SHOWN_PAIR = "last => { const id = document.querySelector('#pairs').dataset.queryId; return id && id !== last ? id : null; }"
FLAGS = (
    "--env-id Hopper-v5 --total-timesteps 800 --learning-starts 200 --total-explore-steps 400 "
    "--teacher-feedback-total-queries 8 --teacher-feedback-num-queries-per-session 4 --teacher-feedback-frequency 300 "
    "--teacher-feedback-schedule linear --segment-length 10 --max-augmentation-offset 3 --min-augmentation-offset 1 "
    "--batch-size 64 --actor-hidden-dim 64 --critic-hidden-dim 64 --reward-net-hidden-dim 64 --reward-net-epochs 5 "
    "--explore-knn-sample-size 500 --evaluation-frequency 0 --checkpoint-frequency 0 --no-progress-bar --torch-threads 1 "
    "--teacher-feedback-mode human --feedback-server-autostart --clip-width 64 --clip-height 48"
).split()


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_a_person_answers_undoes_and_answers_again_and_the_run_keeps_the_new_answer(tmp_path, asynchronous):
    base, run = f"http://127.0.0.1:{free_port()}", "walk"
    env = {**os.environ, TOKEN_ENV: TOKEN, "MUJOCO_GL": "egl", "WANDB_MODE": "offline"}
    command = [sys.executable, str(REPO / "framework" / "sac_rlhf.py"), *FLAGS, "--run-name", run, "--feedback-server-url", base]
    # with --feedback-async the run does not wait for a session before its last step: steps enough for two sessions
    command += ["--feedback-async", "--feedback-async-poll-steps", "10", "--total-timesteps", "5000"] if asynchronous else []
    log = tmp_path / "trainer.log"
    trainer = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    answers, undo_notice, corrected = {}, None, None
    try:
        with sync_api.sync_playwright() as p:
            browser = p.chromium.launch(
                executable_path=str(CHROMIUM), headless=True, args=["--no-sandbox", "--disable-gpu", "--disable-background-networking"]
            )
            page = browser.new_page()
            errors = []
            page.on("pageerror", lambda error: errors.append(str(error)))
            client = FeedbackClient(base, TOKEN, retry_seconds=0, timeout=5)
            while True:  # the trainer starts the server; the person logs in with a one-time link
                assert trainer.poll() is None, log.read_text()[-3000:]
                try:
                    page.goto(client.login_link()[0], timeout=5000)
                    page.wait_for_url(f"{base}/", timeout=5000)
                    break
                except (FeedbackServerUnreachable, sync_api.Error):
                    time.sleep(0.3)
            page.fill("#annotator-input", "walker")
            page.click("#name-save")
            last = ""
            while trainer.poll() is None:
                try:
                    query_id = page.wait_for_function(SHOWN_PAIR, arg=last, timeout=1000, polling=50).json_value()
                except sync_api.TimeoutError:
                    continue
                choice = "left" if len(answers) % 2 == 0 else "right"
                page.click(f"button.choice[data-choice={choice}]")
                answers[int(query_id)] = choice
                last = query_id
                if len(answers) == 4 and corrected is None:  # the last pair of session 1: take it back at once
                    page.wait_for_function("() => !document.querySelector('#undo').disabled", timeout=10_000)
                    page.keyboard.press("Backspace")
                    page.wait_for_function("() => document.querySelector('#notice').textContent.startsWith('Undone')", timeout=10_000)
                    assert page.get_attribute("#pairs", "data-query-id") == query_id  # the pair is back on screen
                    undo_notice = page.text_content("#notice")
                    earlier = page.get_attribute(f"button.choice[data-choice={choice}]", "class")
                    assert "earlier" in earlier, earlier
                    other = "left" if choice == "right" else "right"
                    page.click(f"button.choice[data-choice={other}]")
                    answers[int(query_id)], corrected = other, int(query_id)
            assert not errors, errors
            browser.close()
    finally:
        if trainer.poll() is None:
            trainer.kill()
    assert trainer.wait() == 0, log.read_text()[-3000:]

    assert f"Undone: pair #{corrected} is back. Your earlier answer was" in undo_notice
    assert "choose again: the agent learns from your new answer" in undo_notice
    assert len(answers) == 8
    done = subprocess.run(
        [sys.executable, str(REPO / "toolbox" / "labels.py"), "check", str(tmp_path / "runs" / run)], capture_output=True, text=True
    )
    assert done.returncode == 0 and "the run keeps every label as the server has it" in done.stdout, done.stdout + done.stderr
    with sqlite3.connect(tmp_path / "runs" / run / "labels.sqlite") as db:
        kept = dict(db.execute("SELECT query_id, label FROM labels"))
    assert kept == {query: CHOICE_LABELS[choice] for query, choice in answers.items()}
    assert "labels: the run keeps 8 labels, each as the feedback server has it" in log.read_text()
