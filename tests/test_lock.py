"""The lock (uv.lock) and the pip constraints exported from it (requirements/constraints.txt) stay in step with
pyproject.toml: a dependency changed without re-locking fails here, so what CI installs is what a new user gets."""

import importlib.util
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CONSTRAINTS = Path("requirements") / "constraints.txt"


@pytest.fixture(scope="module")
def uv() -> str:
    found = shutil.which("uv")
    if found is None:
        pytest.skip("uv is not installed here (the dev extra installs it: pip install -e '.[dev]')")
    return found


def export_command(uv: str) -> list[str]:
    """The one export command: the first line of the committed constraints file records it, so it is read from there
    (dev/update_lock.sh runs the same line)."""
    header = (REPO / CONSTRAINTS).read_text().splitlines()[1]
    words = header.lstrip("#").split()
    assert words[:2] == ["uv", "export"] and "--frozen" in words, header
    return [uv, *words[1:]]


def project_copy(tmp_path: Path) -> Path:
    """What uv reads to lock and export, copied, so a test can change it without touching the checkout."""
    copy = tmp_path / "project"
    (copy / "requirements").mkdir(parents=True)
    for name in ("pyproject.toml", "uv.lock", "README.md", str(CONSTRAINTS)):
        shutil.copy(REPO / name, copy / name)
    return copy


def test_the_lock_matches_pyproject(uv):
    result = subprocess.run([uv, "lock", "--check", "--offline"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_a_dependency_added_without_relocking_fails_the_check(uv, tmp_path):
    project = project_copy(tmp_path)
    pyproject = project / "pyproject.toml"
    text = pyproject.read_text()
    assert '    "rich>=13",\n' in text
    pyproject.write_text(text.replace('    "rich>=13",\n', '    "rich>=13",\n    "six>=1.16",\n'))
    # Online: re-resolving the changed requirements may need metadata uv's cache does not hold on a new machine.
    result = subprocess.run([uv, "lock", "--check"], cwd=project, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert "needs to be updated" in result.stderr


def test_the_constraints_file_is_the_locks_export(uv, tmp_path):
    project = project_copy(tmp_path)
    (project / CONSTRAINTS).unlink()
    subprocess.run(export_command(uv), cwd=project, capture_output=True, text=True, timeout=120, check=True)
    assert (project / CONSTRAINTS).read_text() == (REPO / CONSTRAINTS).read_text(), (
        "requirements/constraints.txt is stale: run dev/update_lock.sh"
    )


def test_the_constraints_pin_every_package_exactly():
    """pip reads the file as constraints: each line one package at one version (a marker may follow), the CPU torch
    CI installs among them."""
    pins = [line for line in (REPO / CONSTRAINTS).read_text().splitlines() if line and not line.lstrip().startswith("#")]
    assert len(pins) > 100
    for line in pins:
        requirement = line.split(";")[0].strip()
        name, _, version = requirement.partition("==")
        assert name and version and " " not in requirement, line
    assert "torch==2.13.0" in pins


# ------------------------------------------------------------------------------------------------------------------
# poetry.lock follows uv.lock
# ------------------------------------------------------------------------------------------------------------------
_spec = importlib.util.spec_from_file_location("lock_poetry", REPO / "dev" / "lock_poetry.py")
lock_poetry = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lock_poetry)


def test_poetry_lock_holds_uv_locks_versions():
    """Every package of poetry.lock at uv.lock's versions, and every package of uv.lock there but the CUDA packages
    that only Linux's torch needs (Poetry leaves Linux's torch to pip)."""
    assert lock_poetry.disagreements(REPO / "uv.lock", REPO / "poetry.lock") == [], "run dev/update_lock.sh"
    poetry = lock_poetry.locked_versions(REPO / "poetry.lock")
    left_out = set(lock_poetry.locked_versions(REPO / "uv.lock")) - set(poetry)
    assert "triton" in left_out and "nvidia-cudnn-cu13" in left_out and not left_out & {"numpy", "sympy", "mujoco"}
    assert [str(version) for version in poetry["torch"]] == ["2.13.0"]


def test_the_agreement_check_names_a_package_at_another_version_and_one_that_is_missing(tmp_path):
    text = (REPO / "poetry.lock").read_text()
    assert '\nname = "rich"\nversion = "15.0.0"\n' in text and '\nname = "tyro"\n' in text
    changed = text.replace('\nname = "rich"\nversion = "15.0.0"\n', '\nname = "rich"\nversion = "14.0.0"\n')
    changed = changed.replace('\nname = "tyro"\n', '\nname = "tyro-renamed"\n')
    (tmp_path / "poetry.lock").write_text(changed)
    problems = lock_poetry.disagreements(REPO / "uv.lock", tmp_path / "poetry.lock")
    assert "rich: poetry.lock 14.0.0, uv.lock 15.0.0" in problems
    assert "tyro: poetry.lock missing, uv.lock 1.0.17" in problems
    assert any(problem.startswith("tyro-renamed: poetry.lock holds") for problem in problems)
    assert len(problems) == 3


@pytest.fixture(scope="module")
def poetry() -> str:
    found = shutil.which("poetry")
    if found is None:
        pytest.skip("poetry is not installed here (bash dev/install_test_deps.sh installs it)")
    return found


def poetry_check_lock(poetry: str, folder: Path) -> subprocess.CompletedProcess:
    return subprocess.run([poetry, "check", "--lock"], cwd=folder, capture_output=True, text=True, timeout=120)


def test_poetry_lock_is_current_for_pyproject(poetry):
    result = poetry_check_lock(poetry, REPO)
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_dependency_added_without_relocking_poetry_fails_its_check(poetry, tmp_path):
    for name in ("pyproject.toml", "poetry.lock", "README.md"):
        shutil.copy(REPO / name, tmp_path / name)
    text = (tmp_path / "pyproject.toml").read_text()
    assert '    "rich>=13",\n' in text
    (tmp_path / "pyproject.toml").write_text(text.replace('    "rich>=13",\n', '    "rich>=13",\n    "six>=1.16",\n'))
    result = poetry_check_lock(poetry, tmp_path)
    assert result.returncode != 0
    assert "poetry lock" in result.stdout + result.stderr
