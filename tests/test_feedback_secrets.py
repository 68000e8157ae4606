"""Where the trainer's feedback-server token must not end up (issue 14, item 8): the command line of a
server it autostarts (visible to every user in ps) and the run's saved settings (args.json, TensorBoard,
W&B config)."""

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
        assert requests.get(f"{url}/?token={TOKEN}", timeout=5).status_code == 200
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
