"""What a newcomer meets first: the outputs README commands make stay out of git."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "toolbox"))

import compare  # noqa: E402
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
