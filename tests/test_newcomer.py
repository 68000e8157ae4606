"""What a newcomer meets first: the outputs README commands make stay out of git, a resumed run's summary counts the
whole run."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cleanrlhf_utils.runs import command_line_args

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "toolbox"))

from test_end_to_end import small_args  # noqa: E402
from test_pref_ppo import hopper_args  # noqa: E402

import compare  # noqa: E402
import pref_ppo  # noqa: E402
import sac_rlhf  # noqa: E402
import sweep  # noqa: E402


def ignored(path: str) -> bool:
    """Whether git ignores `path` (relative to the repository root) by this checkout's .gitignore."""
    return subprocess.run(["git", "check-ignore", "-q", "--no-index", path], cwd=REPO).returncode == 0


def test_default_outputs_of_the_toolbox_and_the_sweeps_are_ignored():
    report = compare.Args(runs=[]).out
    storage = sweep.Args().storage
    assert storage.startswith("sqlite:///")
    database = storage.removeprefix("sqlite:///")
    for path in (f"{report}/index.html", f"{report}/videos/run/eval.mp4", database, f"{database}-journal"):
        assert ignored(path), f"{path} (made by a README command) is not in .gitignore"
    assert not ignored("framework/sac_rlhf.py")


# ----------------------------------------------------------------------------------------
# A resumed run's summary counts the whole run's wall time, not only the resumed part's
# ----------------------------------------------------------------------------------------
def run_in_two_parts(script, make_args, first_steps: int, total_steps: int) -> tuple[float, float, float]:
    """wall_seconds of the first part's summary, of the resumed run's, and the seconds the resume call took."""
    script.main(make_args("cut", total_timesteps=first_steps, torch_threads=1))
    first = json.loads(Path("runs/cut/summary.json").read_text())["wall_seconds"]
    started = time.time()
    script.main(make_args("cut", total_timesteps=total_steps, torch_threads=1, resume="models/cut/latest"))
    resume_seconds = time.time() - started
    whole = json.loads(Path("runs/cut/summary.json").read_text())["wall_seconds"]
    return first, whole, resume_seconds


def test_pebble_wall_seconds_after_resume_count_the_whole_run(chdir_tmp):
    # The first part (exploration and a feedback session, 700 steps) takes far longer than the resumed 100 steps.
    first, whole, resume_seconds = run_in_two_parts(sac_rlhf, small_args, 700, 800)
    assert first <= whole <= first + resume_seconds, (first, whole, resume_seconds)


def test_pref_ppo_wall_seconds_after_resume_count_the_whole_run(chdir_tmp):
    # Four iterations (two exploring, one feedback session), then one more.
    first, whole, resume_seconds = run_in_two_parts(pref_ppo, hopper_args, 2048, 2560)
    assert first <= whole <= first + resume_seconds, (first, whole, resume_seconds)


# ----------------------------------------------------------------------------------------
# Human mode asks a person for tens of labels a session, not hundreds, unless told otherwise
# ----------------------------------------------------------------------------------------
HUMAN_SESSION_CAP = 25  # pairs a person answers in a few minutes
HUMAN_RUN_CAP = 200


@pytest.mark.parametrize("script", [sac_rlhf, pref_ppo], ids=["sac_rlhf", "pref_ppo"])
def test_human_mode_defaults_ask_a_person_for_tens_of_labels_a_session(script, capsys):
    args = command_line_args(script.Args, ["--teacher-feedback-mode", "human"])
    sessions = feedback_sessions(script, args)
    assert sessions[0] <= HUMAN_SESSION_CAP and max(sessions) == sessions[0], sessions
    assert sum(sessions) <= HUMAN_RUN_CAP
    lines = capsys.readouterr().out.splitlines()
    said = [line for line in lines if line.startswith("human mode:")]
    assert len(said) == 1, lines
    assert f"{sum(sessions)} labels" in said[0] and f"{sessions[0]} in the first" in said[0]
    assert "--teacher-feedback-total-queries" in said[0] and "--teacher-feedback-num-queries-per-session" in said[0]


@pytest.mark.parametrize("script", [sac_rlhf, pref_ppo], ids=["sac_rlhf", "pref_ppo"])
def test_an_explicit_label_budget_wins_over_human_defaults(script, capsys):
    args = command_line_args(script.Args, ["--teacher-feedback-mode=human", "--teacher-feedback-total-queries", "1000"])
    assert args.teacher_feedback_total_queries == 1000  # the user's
    assert args.teacher_feedback_num_queries_per_session <= HUMAN_SESSION_CAP  # not given: human-sized
    capsys.readouterr()
    both = ["--teacher-feedback-num-queries-per-session=100", "--teacher-feedback-total-queries", "1000"]
    args = command_line_args(script.Args, ["--teacher-feedback-mode", "human", *both])
    assert feedback_sessions(script, args) == feedback_sessions(script, script.Args())  # the defaults' 224 first
    assert "human mode:" not in capsys.readouterr().out  # nothing was changed, nothing to say
    # Other teachers keep the defaults.
    assert command_line_args(script.Args, []) == script.Args()
    assert command_line_args(script.Args, ["--teacher-feedback-mode", "file"]) == script.Args(teacher_feedback_mode="file")


def feedback_sessions(script, args) -> list[int]:
    """The queries of each feedback session a run of `args` asks (its schedule)."""
    return script.feedback_schedule(
        args.teacher_feedback_total_queries, args.teacher_feedback_num_queries_per_session,
        args.teacher_feedback_schedule, args.teacher_feedback_exponential_decay,
    )  # fmt: skip


def test_the_script_applies_human_defaults_from_its_command_line(tmp_path):
    """Through the real CLI: the line is printed before the run starts (here refused for its env id, nothing written)."""
    command = [sys.executable, str(REPO / "framework/pref_ppo.py"), "--teacher-feedback-mode", "human", "--env-id", "Nope-v0"]
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=120, env=os.environ | {"WANDB_MODE": "offline"})
    assert done.returncode == 2
    assert done.stdout.splitlines()[0].startswith("human mode: 100 labels over 10 sessions, 22 in the first"), done.stdout
    assert done.stderr.splitlines()[-1].startswith("error: --env-id Nope-v0"), done.stderr
