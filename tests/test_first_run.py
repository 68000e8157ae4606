"""What a newcomer meets first: the install paths the README documents, a bad env id on a machine without a display,
and the summary.json a run leaves behind."""

import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

import sac_rlhf
from cleanrlhf_utils.headless import default_mujoco_gl

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
sys.path.insert(0, str(REPO / "toolbox"))

import compare  # noqa: E402


# ----------------------------------------------------------------------------------------------------------
# No display: the one-line error is all a user sees
# ----------------------------------------------------------------------------------------------------------
def test_unknown_env_id_without_a_display_prints_only_the_error_line(tmp_path):
    env = {key: value for key, value in os.environ.items() if key not in ("MUJOCO_GL", "PYOPENGL_PLATFORM", "DISPLAY", "WAYLAND_DISPLAY")}
    result = subprocess.run(
        [sys.executable, str(REPO / "framework" / "sac_rlhf.py"), "--env-id", "Nope-v0"],
        cwd=tmp_path,
        env=env | {"OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    output = (result.stdout + result.stderr).splitlines()
    assert result.returncode == 2
    assert len(output) == 1 and output[0].startswith("error: --env-id Nope-v0"), output  # no GLFW/X11 warning first
    assert not list(tmp_path.iterdir()), "nothing written"


@pytest.mark.parametrize(
    ("environ", "platform", "expected"),
    [
        ({}, "linux", "egl"),  # headless Linux: EGL (this machine has libEGL, as the tests' own MUJOCO_GL=egl needs)
        ({"MUJOCO_GL": "osmesa"}, "linux", "osmesa"),  # an explicit choice always wins
        ({"DISPLAY": ":0"}, "linux", None),  # a desktop keeps MuJoCo's own choice (GLFW windows for --render-mode human)
        ({"WAYLAND_DISPLAY": "wayland-0"}, "linux", None),
        ({}, "darwin", None),  # macOS has no DISPLAY and needs none
    ],
)
def test_headless_gl_default(environ, platform, expected):
    environ = dict(environ)
    default_mujoco_gl(environ, platform)
    assert environ.get("MUJOCO_GL") == expected


# ----------------------------------------------------------------------------------------------------------
# summary.json is strict JSON, and the toolbox reads its nulls
# ----------------------------------------------------------------------------------------------------------
def refuse_nan(constant: str):
    raise ValueError(f"summary.json holds the bare constant {constant}, which strict JSON readers refuse")


def test_summary_json_is_strict_json_and_the_toolbox_reads_its_nulls(chdir_tmp):
    """A short real PEBBLE run that explores only (no feedback session: no label to measure training accuracy on) and
    is stopped, as by Ctrl-C, during its first evaluation (no final return): both metrics are NaN in the summary."""
    args = sac_rlhf.Args(
        env_id="Hopper-v5",
        run_name="strict",
        total_timesteps=400,
        learning_starts=100,
        total_explore_steps=400,
        segment_length=20,
        max_augmentation_offset=5,
        min_augmentation_offset=2,
        batch_size=64,
        actor_hidden_dim=64,
        critic_hidden_dim=64,
        reward_net_hidden_dim=64,
        explore_knn_sample_size=100,
        evaluation_frequency=200,
        evaluation_episodes=1,
        checkpoint_frequency=0,
        progress_bar=False,
    )
    evaluations = []

    def stop_at_first_evaluation(step: int, mean_return: float) -> None:
        evaluations.append((step, mean_return))
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        sac_rlhf.main(args, stop_at_first_evaluation)

    path = chdir_tmp / "runs" / "strict" / "summary.json"
    summary = json.loads(path.read_text(), parse_constant=refuse_nan)
    assert summary["interrupted"] and summary["global_step"] == 200 and summary["labels_obtained"] == 0
    assert summary["final_eval_return"] is None and summary["train_accuracy"] is None
    assert all(value is None or not isinstance(value, float) or math.isfinite(value) for value in summary.values())

    # The toolbox takes the return from the curve when the summary's is null.
    (run,) = compare.load_runs([str(chdir_tmp / "runs" / "strict")])
    assert run.status == "interrupted" and run.labels == 0 and run.global_step == 200
    assert run.final_return == pytest.approx(evaluations[0][1], rel=1e-6)


def test_write_summary_keeps_the_dict_and_writes_null_for_any_non_finite_number(tmp_path):
    from cleanrlhf_utils.tracking import write_summary

    summary = {"a": math.nan, "b": [1.0, math.inf], "c": {"d": -math.inf}, "e": 2.5, "f": None, "g": "x"}
    write_summary(tmp_path, summary)
    assert json.loads((tmp_path / "summary.json").read_text(), parse_constant=refuse_nan) == {
        "a": None,
        "b": [1.0, None],
        "c": {"d": None},
        "e": 2.5,
        "f": None,
        "g": "x",
    }
    assert math.isnan(summary["a"]), "the caller's dict is left as it is"


# ----------------------------------------------------------------------------------------------------------
# Install paths
# ----------------------------------------------------------------------------------------------------------
INSTALLING = (REPO / "docs" / "installing.md").read_text()  # the one place the install and update commands live


def installing_section() -> str:
    return INSTALLING


def readme_quick_start() -> str:
    return README.split("\n## Quick start\n", 1)[1].split("\n## ", 1)[0]


def test_readme_install_lines_are_the_install_pages():
    """The README's quick start repeats the pip install lines of docs/installing.md, word for word."""
    readme_lines = re.findall(r"^pip install .*$", readme_quick_start(), re.M)
    assert len(readme_lines) == 2 and readme_lines == re.findall(r"^pip install .*$", installing_section(), re.M)
    assert "docs/installing.md" in readme_quick_start()


def test_cpu_torch_lines_agree_with_ci_and_the_slurm_venv():
    """The README's pytorch.org CPU command pins the torch version CI installs; slurm/setup_venv.sh follows it."""
    quick_start = readme_quick_start()
    cpu_index = "--index-url https://download.pytorch.org/whl/cpu"
    (readme_pin,) = set(re.findall(rf"pip install torch==([\d.]+) {re.escape(cpu_index)}", quick_start + installing_section()))
    ci = (REPO / ".ci/run").read_text()
    constraints = "-c requirements/constraints.txt"
    assert f"python -m pip install torch=={readme_pin} {constraints}\n" in ci
    assert f'python -m pip install -e ".[dev]" {constraints}\n' in ci
    assert f"\ntorch=={readme_pin}\n" in (REPO / "requirements/constraints.txt").read_text(), "the lock holds the same torch"
    setup_venv = (REPO / "slurm/setup_venv.sh").read_text()
    assert f"torch=={readme_pin}" in setup_venv and "https://download.pytorch.org/whl/cpu" in setup_venv
    assert '"$repo/requirements/constraints.txt"' in setup_venv


def test_readme_uv_lines_are_the_pip_lines():
    section = installing_section()
    pip_lines = re.findall(r"^pip install .*$", section, re.M)
    uv_lines = [line.removeprefix("uv ") for line in re.findall(r"^uv pip install .*$", section, re.M)]
    assert pip_lines and uv_lines[: len(pip_lines)] == pip_lines


@pytest.fixture(scope="module")
def poetry() -> str:
    found = shutil.which("poetry")
    if found is None:
        pytest.skip("poetry is not installed here (bash dev/install_test_deps.sh installs it)")
    return found


def poetry_section() -> str:
    return INSTALLING.split("\n## Poetry\n", 1)[1].split("\n## ", 1)[0]


# A thousand steps of PEBBLE, with two feedback sessions, on networks small enough for a shared CPU.
TINY_PEBBLE = [
    "--total-timesteps", "1000", "--learning-starts", "200", "--total-explore-steps", "400",
    "--teacher-feedback-total-queries", "20", "--teacher-feedback-num-queries-per-session", "10",
    "--teacher-feedback-frequency", "500", "--segment-length", "20", "--max-augmentation-offset", "5",
    "--min-augmentation-offset", "2", "--batch-size", "64", "--actor-hidden-dim", "64", "--critic-hidden-dim", "64",
    "--reward-net-hidden-dim", "64", "--reward-net-epochs", "5", "--explore-knn-sample-size", "500",
    "--evaluation-frequency", "0", "--evaluation-episodes", "1", "--checkpoint-frequency", "0", "--no-progress-bar",
]  # fmt: skip

INSTALLED = """
import importlib.metadata, json, platform
print(json.dumps({"python": platform.python_version(),
                  "versions": {d.metadata["Name"]: d.version for d in importlib.metadata.distributions()}}))
"""


def locked_pins(constraints: Path, python: str) -> dict[str, str]:
    """The version the constraints file pins for each package, on the given Python."""
    environment = {"python_full_version": python, "python_version": python.rsplit(".", 1)[0]}
    pins = {}
    for line in constraints.read_text().splitlines():
        if re.match(r"[A-Za-z0-9]", line):
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate(environment):
                pins[canonicalize_name(requirement.name)] = str(requirement.specifier).removeprefix("==")
    return pins


def clean_clone(destination: Path) -> Path:
    """A git clone of this checkout, with the checkout's uncommitted changes to tracked files copied over it (nothing
    untracked or ignored: no venv, no runs, no build output)."""
    subprocess.run(["git", "clone", "--quiet", str(REPO), str(destination)], check=True, timeout=300)
    changed = subprocess.run(["git", "diff", "--name-only", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    for name in changed.splitlines():
        if (REPO / name).is_file():
            shutil.copy(REPO / name, destination / name)
        else:
            (destination / name).unlink(missing_ok=True)
    return destination


def test_poetry_installs_a_clean_clone_at_the_locked_versions_and_trains(poetry, tmp_path):
    """docs/installing.md's Poetry commands, as written there, in a clone of this repository: `poetry install`, the
    pip line that puts the CPU torch into Poetry's venv, and a PEBBLE run through `poetry run`, cut to a few thousand
    steps. Every package in the venv is at the version uv.lock holds (requirements/constraints.txt is its export), torch
    is the CPU build, and no CUDA package came with it."""
    (install, torch_line, run) = re.findall(r"^poetry .*$", poetry_section(), re.M)
    assert install == "poetry install" and "torch==" in torch_line and "--extra-index-url" in torch_line
    assert run == "poetry run python framework/sac_rlhf.py --env-id Hopper-v5"
    clone = clean_clone(tmp_path / "cleanrlhf")
    # Poetry installs into the venv it finds active: this suite's own, unless told otherwise. Its venv goes in the
    # clone (.venv), so it goes away with it; its download cache is the user's, as for anyone who runs it twice.
    environment = {key: value for key, value in os.environ.items() if key not in ("VIRTUAL_ENV", "CONDA_PREFIX", "PYTHONPATH")}
    environment |= {"POETRY_VIRTUALENVS_IN_PROJECT": "true", "POETRY_NO_INTERACTION": "1", "OMP_NUM_THREADS": "1"}
    # PyTorch's index is not reachable from CI machines (pip's find-links serve the CPU wheel there): pip would retry it
    # for each package it looks up, about 8 s each, a minute of waiting that tests nothing. Once, then PyPI.
    environment["PIP_RETRIES"] = "0"

    def poetry_command(line: str, timeout: int, *extra: str) -> subprocess.CompletedProcess:
        command = [poetry, *shlex.split(line)[1:], *extra]
        return subprocess.run(command, cwd=clone, env=environment, capture_output=True, text=True, timeout=timeout)

    for line in (install, torch_line):
        done = poetry_command(line, 1800)
        assert done.returncode == 0, f"{line}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"

    done = subprocess.run(
        [poetry, "run", "python", "-c", INSTALLED], cwd=clone, env=environment, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    installed = json.loads(done.stdout)
    pinned = locked_pins(clone / "requirements/constraints.txt", installed["python"])
    versions = {canonicalize_name(name): version for name, version in installed["versions"].items()}
    assert Version(versions["torch"]).public == pinned["torch"] and Version(versions["torch"]).local == "cpu", versions["torch"]
    assert not [name for name in versions if name.startswith(("nvidia-", "cuda-")) or name == "triton"], "no CUDA package"
    off = {
        name: (version, pinned.get(name))
        for name, version in versions.items()
        if name not in ("torch", "pip") and (name not in pinned or Version(pinned[name]) != Version(version))
    }
    assert not off, f"installed at other versions than the lock's (installed, locked): {off}"

    done = poetry_command(run, 1200, *TINY_PEBBLE, "--run-name", "poetry")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((clone / "runs" / "poetry" / "summary.json").read_text())
    assert summary["global_step"] == 1000 and summary["labels_obtained"] == 20 and not summary["interrupted"]


def test_quick_start_demo_is_a_run_script():
    """The README's 15-minute demo is a scripts/*.sh (tests/test_repo.py parses its flags with sac_rlhf's Args)."""
    (demo,) = re.findall(r"^bash (scripts/\S+-demo\.sh)$", readme_quick_start(), re.M)
    assert (REPO / demo).is_file()


def test_the_demos_header_points_at_the_page_with_its_returns():
    """scripts/Hopper-v5-demo.sh says where its measured returns are: a page, and a section of it that shows the demo's
    command and its evaluation returns."""
    header = " ".join(line.lstrip("# ") for line in (REPO / "scripts/Hopper-v5-demo.sh").read_text().splitlines() if line.startswith("#"))
    ((page, heading),) = re.findall(r'(docs/[\w/-]+\.md) \("([^"]+)"\) has the returns', header)
    text = (REPO / page).read_text()
    assert f"\n## {heading}\n" in text, f"{page} has no section {heading!r}"
    section = text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    assert "\nbash scripts/Hopper-v5-demo.sh\n" in section and "\n| evaluation return |" in section
