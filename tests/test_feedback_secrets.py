"""The feedback server's token: where it must not end up (the command line of a server the trainer autostarts, visible
to every user in ps; the run's saved settings: args.json, TensorBoard, W&B config), and where it must be: a server the
trainer starts always has one (made by the run when none is given), a resumed run's server has the same, and the
server refuses requests without it or addressed to a name it is not reached by (DNS rebinding)."""

from __future__ import annotations

import json
import socket
from dataclasses import dataclass
from pathlib import Path

import pytest

requests = pytest.importorskip("requests", reason="requests is missing (pip install requests)")

TOKEN = "tok-8d21f0b94c6e"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_autostarted_server_gets_the_token_outside_its_command_line(tmp_path):
    from cleanrlhf_utils.feedback import FeedbackClient, start_feedback_server

    url = f"http://127.0.0.1:{free_port()}"
    log_path = tmp_path / "feedback_server.log"
    process = start_feedback_server(url, log_path, TOKEN)
    try:
        cmdline = Path(f"/proc/{process.pid}/cmdline").read_bytes()
        assert b"humanFeedback.feedback_server" in cmdline and TOKEN.encode() not in cmdline
        assert requests.get(url + "/api/config", timeout=5).status_code == 401  # the server did get the token
        client = FeedbackClient(url, TOKEN)
        assert client.create_run("autostart", "Hopper-v5", {}) >= 1
        link, seconds = client.login_link()
        assert seconds == 15 * 60 and TOKEN not in link
        assert requests.get(link, timeout=5).status_code == 200
    finally:
        process.terminate()
        process.wait(timeout=15)
    assert TOKEN not in log_path.read_text()


def test_run_settings_keep_the_token_key_without_its_value(tmp_path):
    from cleanrlhf_utils.feedback import FeedbackArgs
    from cleanrlhf_utils.tracking import start_logging, stop_logging

    @dataclass
    class Args(FeedbackArgs):
        track: bool = False
        wandb_project_name: str = "cleanrlhf"
        wandb_entity: str | None = None

    args = Args(teacher_feedback_mode="human", feedback_server_token=TOKEN)
    writer = start_logging(args, "run", tmp_path / "run")
    stop_logging(args, writer)
    saved = json.loads((tmp_path / "run" / "args.json").read_text())
    assert "feedback_server_token" in saved and saved["feedback_server_token"] is None
    assert saved["teacher_feedback_mode"] == "human"
    for path in (tmp_path / "run").rglob("*"):  # args.json and the TensorBoard hyperparameter table
        if path.is_file():
            assert TOKEN.encode() not in path.read_bytes(), path
    assert args.feedback_server_token == TOKEN  # the run itself still has it


def test_checkpoints_and_sweep_trials_keep_no_token(chdir_tmp):
    """A real (simulated-teacher) PEBBLE run given a token: no file it writes holds it."""
    import sac_rlhf

    args = sac_rlhf.Args(
        run_name="secret", total_timesteps=300, learning_starts=100, total_explore_steps=200, teacher_feedback_total_queries=5,
        teacher_feedback_num_queries_per_session=5, teacher_feedback_frequency=100, segment_length=10, max_augmentation_offset=3,
        min_augmentation_offset=1, batch_size=32, actor_hidden_dim=32, critic_hidden_dim=32, reward_net_hidden_dim=32,
        reward_net_epochs=2, explore_knn_sample_size=50, evaluation_frequency=0, evaluation_episodes=1, progress_bar=False,
        feedback_server_token=TOKEN,
    )  # fmt: skip
    sac_rlhf.main(args)
    written = [path for path in Path(".").rglob("*") if path.is_file()]
    assert any(path.name == "checkpoint.pt" for path in written) and any(path.name == "args.json" for path in written)
    for path in written:
        assert TOKEN.encode() not in path.read_bytes(), path
    import torch

    assert torch.load("models/secret/latest/checkpoint.pt", weights_only=False)["args"]["feedback_server_token"] is None


def human_args(url: str, **overrides):
    import sac_rlhf

    return sac_rlhf.Args(
        env_id="Hopper-v5", teacher_feedback_mode="human", feedback_server_autostart=True, feedback_server_url=url, **overrides
    )


def test_the_readmes_human_command_starts_a_server_that_refuses_strangers(tmp_path, monkeypatch, capsys):
    """`--teacher-feedback-mode human --feedback-server-autostart` and no token anywhere: the run makes one, and its
    server refuses a request without it, and one addressed to another name (a DNS-rebinding page) even with it; the
    run prints a one-time login link instead."""
    from cleanrlhf_utils import feedback, protocol

    monkeypatch.delenv(protocol.TOKEN_ENV, raising=False)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    teacher = feedback.connect_human_teacher(human_args(url), "r", tmp_path / "run", tmp_path / "clips")
    try:
        assert requests.get(url + "/api/config", timeout=5).status_code == 401
        assert requests.post(url + "/api/runs", json={"name": "x"}, timeout=5).status_code == 401
        token = (tmp_path / "run" / "feedback_token").read_text().strip()
        assert len(token) >= 32 and (tmp_path / "run" / "feedback_token").stat().st_mode & 0o777 == 0o600
        rebound = {"Host": f"evil.example:{port}", "Origin": f"http://evil.example:{port}", "X-Feedback-Token": token}
        assert requests.get(url + "/api/next", params={"annotator": "a"}, headers=rebound, timeout=5).status_code == 403
        assert requests.get(url + "/api/config", headers={"X-Feedback-Token": token}, timeout=5).status_code == 200
        (line,) = [line for line in capsys.readouterr().out.splitlines() if "log in at" in line]
        link = line.split("log in at ")[1].split()[0]
        assert link.startswith(f"{url}/login?code=") and token not in line
        browser = requests.Session()
        assert browser.get(link, timeout=5).status_code == 200 and browser.get(url + "/api/config", timeout=5).status_code == 200
        assert requests.get(link, timeout=5).status_code == 403  # once
    finally:
        teacher.close()
    assert token not in (tmp_path / "run" / "feedback_server.log").read_text()


def test_a_resumed_run_starts_its_server_with_the_token_it_started_with(tmp_path, monkeypatch):
    """The `to resume:` line leaves --feedback-server-token out: the resumed run takes the token from the run's folder
    (runs/<run>/feedback_token, mode 0600, never in args.json), so its server is no less protected, and browsers
    logged in before stay logged in."""
    from cleanrlhf_utils import feedback, protocol

    monkeypatch.delenv(protocol.TOKEN_ENV, raising=False)
    url = f"http://127.0.0.1:{free_port()}"
    run_dir = tmp_path / "run"
    first = feedback.connect_human_teacher(human_args(url, feedback_server_token=TOKEN), "r", run_dir, tmp_path / "clips")
    first.close()
    browser = requests.Session()
    for start in ("resumed", "resumed again"):  # no token given
        teacher = feedback.connect_human_teacher(human_args(url), "r", run_dir, tmp_path / "clips")
        try:
            assert requests.get(url + "/api/config", timeout=5).status_code == 401, start
            assert requests.get(url + "/api/config", headers={"X-Feedback-Token": TOKEN}, timeout=5).status_code == 200, start
            assert teacher.run_id == first.run_id
            if start == "resumed":  # a person logs in ...
                assert browser.get(teacher.client.login_link()[0], timeout=5).status_code == 200
            else:  # ... and is still logged in after the next resume
                assert browser.get(url + "/api/config", timeout=5).status_code == 200
        finally:
            teacher.close()
    assert (run_dir / "feedback_token").read_text().strip() == TOKEN and (run_dir / "feedback_token").stat().st_mode & 0o777 == 0o600
