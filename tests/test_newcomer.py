"""What a newcomer meets first: the outputs README commands make stay out of git, a resumed run's summary counts the
whole run."""

import json
import subprocess
import sys
import time
from pathlib import Path

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
