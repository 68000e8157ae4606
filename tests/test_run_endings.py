"""How a run begins and ends as a person sees it: every failure is one line naming the bad value (a damaged checkpoint
with the run's other checkpoints offered, a run name that would write elsewhere, a folder that cannot be written, an
env id that cannot run here, an objective of the wrong shape) before anything is written; a finished run says in one
closing line what it reached; an interrupted run's summary is the checkpoint's it resumes from."""

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from test_end_to_end import small_args

import sac_rlhf
from cleanrlhf_utils.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]


def one_line_failure(tmp_path: Path, *flags: str) -> str:
    """Runs sac_rlhf.py with `flags` in tmp_path; asserts exit code 2, a single stderr line and nothing written."""
    before = sorted(tmp_path.rglob("*"))
    result = subprocess.run(
        [sys.executable, str(REPO / "framework/sac_rlhf.py"), *flags], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1, result.stderr[-3000:]
    assert sorted(tmp_path.rglob("*")) == before  # nothing written
    return lines[0]


@pytest.mark.parametrize("name", ["../outside", "/tmp/absolute", "a/b", ".."])
def test_a_run_name_that_would_write_outside_its_folders_is_refused(tmp_path, name):
    line = one_line_failure(tmp_path, "--run-name", name)
    assert line.startswith(f"error: --run-name {name!r} must be a plain folder name")
    assert not (tmp_path.parent / "outside").exists()


def test_a_folder_that_cannot_be_written_is_refused_in_one_line(tmp_path):
    if os.geteuid() == 0:  # root writes anywhere: a read-only folder it cannot write is a read-only mount, made here so
        pytest.skip("root ignores a folder's permissions; the check reads them (os.access), which a test cannot show as root")
    tmp_path.chmod(0o555)
    try:
        line = one_line_failure(tmp_path)
    finally:
        tmp_path.chmod(0o755)
    assert line.startswith(f"error: cannot write {tmp_path}") and "start it in a folder you can write to" in line


def test_the_writability_check_names_the_folder(tmp_path, monkeypatch):
    """The same check as a non-root user meets it: os.access says the folder cannot be written."""
    from cleanrlhf_utils.run import check_writable

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(os, "access", lambda path, mode: Path(path) != tmp_path)
    with pytest.raises(ConfigError, match=f"^cannot write {tmp_path}: "):
        check_writable(("runs", "models"))
    (tmp_path / "runs").mkdir()  # an existing folder is checked itself
    monkeypatch.setattr(os, "access", lambda path, mode: Path(path).name != "runs")
    with pytest.raises(ConfigError, match=f"^cannot write {tmp_path / 'runs'}: "):
        check_writable(("runs", "models"))


@pytest.mark.parametrize(
    ("env_id", "expected"),
    [
        (
            "Hoper-v5",
            "error: --env-id Hoper-v5 is not a registered Gymnasium environment (similar ids that run here: Hopper-v5, Hopper-v4)",
        ),
        ("Hopper-v3", "error: --env-id Hopper-v3 does not run here: The mujoco v2 and v3 based environments have been moved"),
        (
            "NotAnEnv-v0",
            "error: --env-id NotAnEnv-v0 is not a registered Gymnasium environment; python framework/list_envs.py --only "
            "<name> checks which ids run here (docs/reference/working-envs.md lists them)",
        ),
    ],
)
def test_an_env_id_that_cannot_run_here_is_one_line_and_suggests_only_ids_that_do(tmp_path, env_id, expected):
    line = one_line_failure(tmp_path, "--env-id", env_id)
    assert line.startswith(expected), line
    assert "Hopper-v3" not in line.split("similar ids that run here")[-1] and "Hopper-v2" not in line


def wrong_shape_objective(obs, actions, states):
    """A --teacher-objective (test_run_endings:wrong_shape_objective) that returns one value per segment, not per step."""
    return obs.sum(axis=(1, 2))


def test_an_objective_of_the_wrong_shape_is_refused_before_the_run_writes_anything(chdir_tmp):
    with pytest.raises(ConfigError, match=r"must return per-step rewards of shape \[n, L\] = \[2, 3\], got \[2\]"):
        sac_rlhf.main(small_args("wrong", teacher_objective="test_run_endings:wrong_shape_objective"))
    assert list(chdir_tmp.iterdir()) == []


def cut_short(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def test_a_damaged_checkpoint_is_one_line_naming_it_and_the_runs_other_checkpoints(chdir_tmp):
    sac_rlhf.main(small_args("r", total_timesteps=500))  # exploration's checkpoint at 400 and latest at 500
    cut_short(Path("models/r/latest/checkpoint.pt"))
    with pytest.raises(ConfigError) as error:
        sac_rlhf.main(small_args("r", resume="models/r/latest", total_timesteps=600))
    assert str(error.value).startswith("models/r/latest/checkpoint.pt cannot be read (RuntimeError: PytorchStreamReader failed")
    assert str(error.value).endswith("another checkpoint of the run may be whole: --resume models/r/400")
    torch.save(torch.load("models/r/400/checkpoint.pt", weights_only=False), "models/r/latest/checkpoint.pt")
    written = {path: path.read_bytes() for path in Path("runs/r").rglob("*") if path.is_file()}
    cut_short(Path("models/r/latest/replay_buffer.npz"))
    with pytest.raises(ConfigError, match=r"^models/r/latest/replay_buffer.npz cannot be read \(BadZipFile: "):
        sac_rlhf.main(small_args("r", resume="models/r/latest", total_timesteps=600))
    with pytest.raises(ConfigError, match=r"the saved replay buffer holds \d+ transitions, more than this run.s capacity 300"):
        sac_rlhf.main(small_args("r", resume="models/r/400", total_timesteps=600, buffer_size=300))
    # refused before anything is written: args.json, the event files and the label log as they were
    assert {path: path.read_bytes() for path in Path("runs/r").rglob("*") if path.is_file()} == written
    summary = sac_rlhf.main(small_args("r", resume="models/r/400", total_timesteps=600))  # the one offered is whole
    assert summary["global_step"] == 600


def test_a_run_says_at_its_start_which_feedback_sessions_it_will_hold(chdir_tmp, capsys):
    """A run shorter than its exploration says so before it trains, instead of ending with 0 labels unexplained; one
    that holds its sessions says when and how many labels; one cut short says what comes after its end."""
    summary = sac_rlhf.main(small_args("short", total_timesteps=250, evaluation_episodes=1))  # exploration until 400
    out = capsys.readouterr().out
    assert "feedback: none: the run ends before its first feedback session at step 400, so it asks no label" in out
    assert summary["labels_obtained"] == 0
    run = sac_rlhf.Run(small_args("cut"), "sac_rlhf")
    run.say_feedback_plan(400, 300, [10, 10, 10], 1200)  # small_args' sessions
    assert capsys.readouterr().out == "feedback: 3 sessions, 30 labels, at steps 400 to 1000\n"
    run.say_feedback_plan(400, 300, [10, 10, 10], 800)
    assert (
        capsys.readouterr().out
        == "feedback: 2 sessions, 20 labels, at steps 400 to 700; the last 1 sessions (10 labels) come after its end\n"
    )
    run.say_feedback_plan(1, 1000, [10, 10], 2049, step=1024)  # PrefPPO: after the rollouts that pass the steps
    assert capsys.readouterr().out == "feedback: 2 sessions, 20 labels, at steps 1024 to 2048\n"


def test_a_finished_run_says_what_it_reached_in_one_closing_line(chdir_tmp, capsys):
    summary = sac_rlhf.main(small_args("done", total_timesteps=500))
    lines = capsys.readouterr().out.strip().splitlines()
    closing = f"run done done at step 500: evaluation return {summary['final_eval_return']:.1f}, 12 labels, "  # the first session's
    assert lines[-1].startswith(closing) and lines[-1].endswith("of training; summary in runs/done/summary.json"), lines[-1]
    assert "trainer_idle_seconds" not in summary and "people_idle_seconds" not in summary  # no person in a simulated run


def test_the_progress_bar_shows_the_last_evaluation_once_there_is_one(chdir_tmp, capsys):
    sac_rlhf.main(small_args("bar", total_timesteps=500, evaluation_frequency=300, progress_bar=True))
    bar = capsys.readouterr().err.replace("\r", "\n")
    assert "eval=-" in bar and "eval=nan" not in bar  # before the first evaluation
    assert any("eval=" in line and "eval=-" not in line for line in bar.splitlines())  # after it, its return


def test_an_interrupted_runs_summary_is_the_checkpoint_it_resumes_from(chdir_tmp, monkeypatch):
    """Ctrl-C inside a reward update: the checkpoint holds the state from before the update (the resume redoes it), and
    so does the summary: the labels and sessions the resume will say it has."""
    real_train, calls = sac_rlhf.train_reward_model, []

    def train(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real_train(*args, **kwargs)

    with pytest.raises(KeyboardInterrupt):
        sac_rlhf.main(small_args("cut"), reward_training=train)
    saved = torch.load("models/cut/latest/checkpoint.pt", weights_only=False)["loop"]
    summary = json.loads(Path("runs/cut/summary.json").read_text())
    assert summary["interrupted"] and saved["sessions_done"] == 1 and saved["labels_obtained"] == 12  # 12, 10, 8 labels
    assert (summary["labels_obtained"], summary["feedback_sessions"]) == (saved["labels_obtained"], saved["sessions_done"])
    assert np.isfinite(summary["global_step"])
    resumed = sac_rlhf.main(replace(small_args("cut"), resume="models/cut/latest"))
    assert resumed["labels_obtained"] == 30 and resumed["feedback_sessions"] == 3
