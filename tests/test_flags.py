"""The flags in use keep working, and every flag has a use. Every `--flag` that a run script, a SLURM file, a docs page,
the README or an example gives a framework script is one that script's parser takes (the settings come in titled
groups, each flag keeping its name); every parameter a sweep config sets and every field a preset sets is a setting of
its script; and each flag of the two algorithm scripts is set by a run script, a preset, a sweep or a SLURM file, or
described on a hand-written docs page, or justified in JUSTIFIED."""

import functools
import importlib
import re
import shlex
from pathlib import Path

import pytest
import tyro
import yaml

from cleanrlhf_utils import presets
from cleanrlhf_utils.arguments import grouped_view

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = [
    *("sac_rlhf", "pref_ppo", "sac_rlhf_rime", "sac_rlhf_mistake_aware", "sac_rlhf_agent_reset", "sac", "ppo"),
    *("evaluation", "sweep", "list_envs"),
]
SOURCES = [
    *sorted((REPO / "scripts").rglob("*.sh")),
    *sorted(path for path in (REPO / "slurm").glob("*") if path.is_file()),
    *sorted(path for path in (REPO / "docs").rglob("*.md") if "reference" not in path.parts),
    REPO / "README.md",
    *sorted((REPO / "examples").rglob("*.py")),
]
JUSTIFIED: dict[str, str] = {}
"""flag -> why it stays though nothing above sets or describes it"""


@functools.cache
def parser_flags(script: str) -> frozenset[str]:
    """Every option string the script's parser takes (--x, --no-x, aliases), as the command line parses it."""
    args_class = importlib.import_module(script).Args
    parser = tyro.extras.get_parser(grouped_view(args_class) or args_class)
    return frozenset(parser._option_string_actions)


def invocations(text: str) -> list[tuple[str, list[str]]]:
    """(script, its tokens) of every framework script a text runs: `python framework/x.py ...` or `python x.py ...` (as
    from framework/), continued lines joined, up to a shell operator; a sweep's flags after `--` left out."""
    found = []
    text = text.replace("\\\n", " ")
    for match in re.finditer(r"(?:framework/|python3? )(\w+)\.py\b([^\n`|;&>#]*)", text):
        if match.group(1) not in SCRIPTS:
            continue
        try:
            tokens = shlex.split(match.group(2))
        except ValueError:  # an unbalanced quote in prose: no command
            continue
        found.append((match.group(1), tokens[: tokens.index("--")] if "--" in tokens else tokens))
    return found


def test_the_scanner_finds_commands_and_their_flags():
    text = "run `python framework/sac_rlhf.py --env-id X \\\n  --no-surf | tee log`, or python3 sweep.py --algorithm a -- --seed 1"
    assert invocations(text) == [("sac_rlhf", ["--env-id", "X", "--no-surf"]), ("sweep", ["--algorithm", "a"])]
    assert {"--env-id", "--no-surf", "--surf", "--preset", "-h"} <= parser_flags("sac_rlhf")


@pytest.mark.parametrize("source", SOURCES, ids=lambda path: str(path.relative_to(REPO)))
def test_every_flag_a_script_is_given_where_it_is_shown_is_one_it_takes(source):
    for script, tokens in invocations(source.read_text()):
        flags = [token.split("=", 1)[0] for token in tokens if token.startswith("-") and not token.startswith("-<")]
        unknown = [flag for flag in flags if flag not in parser_flags(script) and not re.fullmatch(r"-\d.*", flag)]
        assert not unknown, f"{source.relative_to(REPO)}: {script}.py does not take {unknown}"


def test_every_sweep_and_preset_sets_settings_its_script_has():
    import sweep

    for config in sorted((REPO / "sweep_config").glob("*.yaml")):
        values = yaml.safe_load(config.read_text())
        script = sweep.load_script(sweep.algorithm_of(None, values, str(config)))
        fields = set(script.field_types())
        assert set(values["parameters"]) <= fields, (config.name, set(values["parameters"]) - fields)
    import pref_ppo
    import sac_rlhf

    for name in presets.PRESETS:
        usable = [script for script in (sac_rlhf, pref_ppo) if name in presets.usable(script.Args)]
        assert usable, f"preset {name} sets a field no algorithm script has"


@pytest.mark.parametrize("script", ["sac_rlhf", "pref_ppo"])
def test_every_flag_of_an_algorithm_script_has_a_use_or_a_reason(script):
    import dataclasses

    used = "\n".join(path.read_text() for path in SOURCES) + "\n".join(
        path.read_text() for path in sorted((REPO / "sweep_config").glob("*.yaml"))
    )
    preset_fields = {field for preset in presets.PRESETS.values() for field in preset.values}
    words = set(re.findall(r"--[a-z0-9][a-z0-9-]*|\b[a-z][a-z0-9_]*\b", used))  # flags and field names
    unused = []
    for field in dataclasses.fields(importlib.import_module(script).Args):
        flag = "--" + field.name.replace("_", "-")
        named = {flag, "--no-" + flag[2:], field.name} & words
        if not named and field.name not in preset_fields and flag not in JUSTIFIED:
            unused.append(flag)
    assert not unused, f"{script}.py: no script, preset, sweep or docs page uses {unused}: remove them or justify them"


def test_a_script_edited_after_its_flags_were_read_is_read_again(tmp_path):
    """The Args sources are parsed once a process while they stay as they were: a script edited in between (a flag
    added, a docstring changed) is read anew, by the flag check and by --help's groups alike."""
    from cleanrlhf_utils.args_source import help_groups, source_flags

    script = tmp_path / "framework" / "tiny.py"
    script.parent.mkdir()
    script.write_text('class Args:\n    steps: int = 3\n    """steps to take"""\n')
    assert source_flags(script) == ["--steps"]
    assert [field.doc for field in help_groups(tmp_path, script)[0][2]] == ["steps to take"]
    script.write_text('class Args:\n    steps: int = 3\n    """steps of the run"""\n    seed: int = 1\n')
    assert source_flags(script) == ["--steps", "--seed"]
    assert [field.doc for field in help_groups(tmp_path, script)[0][2]] == ["steps of the run", ""]
