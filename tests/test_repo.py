"""The README's commands, CI and the run scripts stay in step with the code."""

import re
import shlex
from pathlib import Path

import pytest

import sweep
from cleanrlhf_utils.cli import command_line_args

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()


def readme_section(heading: str) -> str:
    return README.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]


def test_ci_runs_the_readme_test_command_verbatim():
    commands = re.findall(r"```bash\n(.*?)```", readme_section("Quick start"), re.S)
    # First what a CPU-only user types (a venv, PyTorch's CPU build, the project at the locked versions), then PEBBLE.
    install = commands[0].splitlines()
    assert install[0] == "python -m venv .venv && . .venv/bin/activate"
    assert re.fullmatch(r"pip install torch==[\d.]+ --index-url https://download.pytorch.org/whl/cpu", install[1])
    assert install[2] == 'pip install -e ".[dev]" -c requirements/constraints.txt'
    assert any("python framework/sac_rlhf.py --env-id Hopper-v5" in block.splitlines() for block in commands[1:])
    # The tests: the first command under the README's "Tests" heading, which CI runs as written.
    test_command = re.findall(r"```bash\n(.*?)```", readme_section("Tests"), re.S)[0].strip()
    assert test_command == "python -m pytest -q"
    ci_lines = [line.strip() for line in (REPO / ".ci/run").read_text().splitlines()]
    assert test_command in ci_lines
    assert "python -m pip install torch==2.13.0 -c requirements/constraints.txt" in ci_lines, (
        "CI pins the CPU torch wheel before anything else"
    )
    # CI installs into a venv made as the README makes it, and runs the tests there (a suite that passes only outside
    # a venv, where the base Python's packages are the project's, would pass CI and fail the README's user).
    assert install[0] in ci_lines, "CI makes the README's venv"
    venv = ci_lines.index(install[0])
    assert venv < ci_lines.index("python -m pip install torch==2.13.0 -c requirements/constraints.txt") < ci_lines.index(test_command)
    assert not [line for line in ci_lines[venv:] if line.startswith("deactivate")], "the tests run in the venv"
    assert ci_lines.index("ruff check .") < ci_lines.index(test_command), "CI lints before the tests"
    assert ci_lines.index("ruff format --check .") < ci_lines.index(test_command)


SCRIPTS = sorted((REPO / "scripts").rglob("*.sh"))


def test_every_benchmarked_environment_has_a_run_script():
    env_ids = {str(script.relative_to(REPO / "scripts").with_suffix("")) for script in SCRIPTS}
    for env_id in ["Hopper-v5", "Walker2d-v5", "HalfCheetah-v5", "Ant-v5", "Swimmer-v5"]:
        assert env_id in env_ids
    for task in ["walker-walk", "cheetah-run", "quadruped-walk"]:
        assert f"dm_control/{task}-v0" in env_ids


def last_feedback_step(script, args, queries_per_session: int) -> int:
    """The step of a run's last feedback session (as sac_rlhf.py's loop schedules them), to check a shipped setting asks
    its whole label budget before the run ends: a frequency too large for the steps leaves labels silently unasked."""
    sessions = len(script.feedback_schedule(args.teacher_feedback_total_queries, queries_per_session,
                                            args.teacher_feedback_schedule, args.teacher_feedback_exponential_decay))  # fmt: skip
    first = args.total_explore_steps if args.unsupervised_exploration else args.learning_starts
    return first + (sessions - 1) * args.teacher_feedback_frequency


# A script that runs its task on a changed env: Ant-v5 less the contact forces its reward model misses the torque on.
SCRIPT_ENVS = {"Ant-v5.sh": "cleanrlhf_utils.example_envs.ant_without_contact_forces:AntWithoutContactForces-v5"}

# B-Pref's Meta-World budgets at its 50 labels every 5000 steps: more labels than 1M steps hold; the scripts say so.
BUDGET_OUTLASTS_THE_RUN = {"button-press-v3.sh", "sweep-into-v3.sh"}


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(REPO / "scripts")))
def test_run_scripts_parse_with_the_scripts_own_args(script):
    command = script.read_text().replace("\\\n", " ")
    line = next(line for line in command.splitlines() if re.search(r"python framework/\w+\.py", line))
    tokens = shlex.split(line.replace('"$@"', ""))
    program = next(token for token in tokens if token.startswith("framework/"))
    training_script = sweep.load_script(Path(program).stem.replace("_", "-"))  # the script's Args and its own checks
    flags = tokens[tokens.index(program) + 1 :]
    args = command_line_args(training_script.Args, flags)  # as the script reads it (--preset); an unknown flag exits 2
    training_script.validate(args)
    # scripts/<ENV_ID>.sh: the file's path is the env it runs (dm_control/<task>-v0 in a folder); <ENV_ID>-demo.sh
    # is the README's short run of it, <ENV_ID>_qpa.sh its QPA setting
    task = str(script.relative_to(REPO / "scripts").with_suffix("")).removesuffix("-demo").removesuffix("_qpa")
    assert args.env_id == SCRIPT_ENVS.get(script.name, task)
    if program == "framework/sac_rlhf.py" and script.name not in BUDGET_OUTLASTS_THE_RUN:
        last = last_feedback_step(training_script.module, args, args.teacher_feedback_num_queries_per_session)
        assert last < args.total_timesteps, f"{script.name}: its last labels are due at step {last}, after the run's end"
