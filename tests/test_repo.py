"""The README's commands, CI and the run scripts stay in step with the code."""

import re
import shlex
from pathlib import Path

import pytest
import tyro

import sac_rlhf

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()


def test_ci_runs_the_readme_test_command_verbatim():
    quick_start = README.split("## Quick start", 1)[1].split("## Installing", 1)[0]
    commands = re.findall(r"```bash\n(.*?)```", quick_start, re.S)
    assert "python framework/sac_rlhf.py --env-id Hopper-v5" in commands[0]
    test_command = commands[1].strip()
    assert test_command == "python -m pytest -q"
    ci_lines = [line.strip() for line in (REPO / ".ci/run").read_text().splitlines()]
    assert test_command in ci_lines
    assert "python -m pip install torch==2.13.0" in ci_lines, "CI pins the CPU torch wheel before anything else"


@pytest.mark.parametrize("script", sorted((REPO / "scripts").glob("*.sh")), ids=lambda p: p.name)
def test_run_scripts_parse_with_the_scripts_own_args(script):
    command = script.read_text().replace("\\\n", " ")
    line = next(line for line in command.splitlines() if "framework/sac_rlhf.py" in line)
    tokens = shlex.split(line.replace('"$@"', ""))
    flags = tokens[tokens.index("framework/sac_rlhf.py") + 1 :]
    args = tyro.cli(sac_rlhf.Args, args=flags)  # an unknown flag exits with a usage error
    sac_rlhf.validate_args(args)
    assert args.env_id == script.stem
