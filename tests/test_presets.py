"""--preset (framework/cleanrlhf_utils/presets.py): the run scripts resolve exactly the settings their old flag lists
did, the precedence command line > preset > default (and human-sized budgets only where neither sets one), the one-line
refusals, --help and args.json, and the same path through sweep.py."""

import re
import shlex
import subprocess
import sys
from dataclasses import asdict, fields
from pathlib import Path

import pytest
import tyro

import pref_ppo
import sac_rlhf
import sweep
from cleanrlhf_utils import presets
from cleanrlhf_utils.cli import command_line_args
from cleanrlhf_utils.errors import ConfigError
from cleanrlhf_utils.presets import HUMAN_LABEL_DEFAULTS
from cleanrlhf_utils.tracking import public_settings

REPO = Path(__file__).resolve().parents[1]

# Each run script's settings as one flag list, which plain tyro parses onto the dataclass defaults (the scripts' own
# lists before the presets, git show 24a7afa:scripts/..., with the settings the findings gave Swimmer and Ant since).
# A script must still resolve exactly these settings: a preset value that drifts, or a script flag dropped, fails here.
# (Written out, not read from git: the test needs no history and keeps failing after a rebase.)
OLD_FLAGS = {
    "Ant-v5.sh": "--env-id cleanrlhf_utils.example_envs.ant_without_contact_forces:AntWithoutContactForces-v5 "
    "--no-terminate-when-unhealthy --total-timesteps 1000000 --total-explore-steps 10000 --teacher-feedback-total-queries 500 "
    "--teacher-feedback-num-queries-per-session 31 --teacher-feedback-frequency 5000 --teacher-feedback-schedule linear "
    "--preference-sampling disagree --segment-length 50 --surf --reward-net-normalize-inputs --reset-actor-after-exploration "
    "--learned-reward-std 1",
    "HalfCheetah-v5.sh": "--env-id HalfCheetah-v5 --total-timesteps 1000000 --total-explore-steps 10000 --teacher-feedback-total-queries 500 "
    "--teacher-feedback-num-queries-per-session 50 --teacher-feedback-frequency 9000 --teacher-feedback-schedule exponential "
    "--preference-sampling disagree --segment-length 50 --surf --reward-net-normalize-inputs --reset-actor-after-exploration "
    "--learned-reward-std 1",
    "Hopper-v5-demo.sh": "--env-id Hopper-v5 --exp-name demo --total-timesteps 40000 --learning-starts 1000 --total-explore-steps 5000 "
    "--teacher-feedback-total-queries 100 --teacher-feedback-num-queries-per-session 20 --teacher-feedback-frequency 5000 "
    "--evaluation-frequency 5000 --evaluation-episodes 5",
    "Hopper-v5.sh": "--env-id Hopper-v5 --total-timesteps 1000000 --total-explore-steps 10000 --teacher-feedback-total-queries 200 "
    "--teacher-feedback-num-queries-per-session 20 --teacher-feedback-frequency 5000 --teacher-feedback-schedule exponential "
    "--preference-sampling disagree --segment-length 50",
    "Swimmer-v5.sh": "--env-id Swimmer-v5 --total-timesteps 1000000 --gamma 0.9999 --total-explore-steps 10000 "
    "--teacher-feedback-total-queries 500 --teacher-feedback-num-queries-per-session 50 --teacher-feedback-frequency 5000 "
    "--teacher-feedback-schedule exponential --preference-sampling disagree --segment-length 50 --surf "
    "--reward-net-normalize-inputs --reset-actor-after-exploration --learned-reward-std 1",
    "Walker2d-v5.sh": "--env-id Walker2d-v5 --total-timesteps 1000000 --total-explore-steps 10000 --teacher-feedback-total-queries 500 "
    "--teacher-feedback-num-queries-per-session 50 --teacher-feedback-frequency 9000 --teacher-feedback-schedule exponential "
    "--preference-sampling disagree --segment-length 50 --surf --reward-net-normalize-inputs --reset-actor-after-exploration "
    "--learned-reward-std 1",
    "dm_control/cheetah-run-v0.sh": "--env-id dm_control/cheetah-run-v0 --total-timesteps 500000 --actor-hidden-dim 1024 "
    "--critic-hidden-dim 1024 --batch-size 1024 --policy-lr 0.0005 --q-lr 0.0005 --alpha 0.1 --policy-frequency 1 "
    "--target-network-frequency 2 --total-explore-steps 10000 --teacher-feedback-total-queries 100 "
    "--teacher-feedback-num-queries-per-session 10 --teacher-feedback-frequency 20000 --teacher-feedback-schedule linear "
    "--preference-sampling disagree --segment-length 50 --reward-net-epochs 50 --surf --reward-net-normalize-inputs",
    "dm_control/cheetah-run-v0_qpa.sh": "--env-id dm_control/cheetah-run-v0 --exp-name qpa --total-timesteps 1000000 "
    "--actor-hidden-dim 1024 --critic-hidden-dim 1024 --batch-size 1024 --policy-lr 0.0005 --q-lr 0.0005 --alpha 0.1 "
    "--policy-frequency 1 --target-network-frequency 2 --total-explore-steps 10000 --teacher-feedback-total-queries 250 "
    "--teacher-feedback-num-queries-per-session 10 --teacher-feedback-frequency 20000 --teacher-feedback-schedule linear "
    "--preference-sampling uniform --segment-length 50 --reward-ensemble-size 1 --reward-net-epochs 50 --no-surf "
    "--reward-net-normalize-inputs --qpa-query-episodes 10 --qpa-hybrid-ratio 0.5 --qpa-augmentations 20",
    "dm_control/quadruped-walk-v0.sh": "--env-id dm_control/quadruped-walk-v0 --total-timesteps 1000000 --actor-hidden-dim 1024 "
    "--critic-hidden-dim 1024 --batch-size 1024 --policy-lr 0.0001 --q-lr 0.0001 --alpha 0.1 --policy-frequency 1 "
    "--target-network-frequency 2 --total-explore-steps 10000 --teacher-feedback-total-queries 1000 "
    "--teacher-feedback-num-queries-per-session 100 --teacher-feedback-frequency 30000 --teacher-feedback-schedule linear "
    "--preference-sampling disagree --segment-length 50 --reward-net-epochs 50 --surf --reward-net-normalize-inputs",
    "dm_control/quadruped-walk-v0_qpa.sh": "--env-id dm_control/quadruped-walk-v0 --exp-name qpa --total-timesteps 1000000 "
    "--actor-hidden-dim 1024 --critic-hidden-dim 1024 --batch-size 1024 --policy-lr 0.0001 --q-lr 0.0001 --alpha 0.1 "
    "--policy-frequency 1 --target-network-frequency 2 --total-explore-steps 10000 --teacher-feedback-total-queries 1000 "
    "--teacher-feedback-num-queries-per-session 100 --teacher-feedback-frequency 30000 --teacher-feedback-schedule linear "
    "--preference-sampling uniform --segment-length 50 --reward-ensemble-size 1 --reward-net-epochs 50 --no-surf "
    "--reward-net-normalize-inputs --qpa-query-episodes 10 --qpa-hybrid-ratio 0.5 --qpa-augmentations 20",
    "dm_control/walker-walk-v0.sh": "--env-id dm_control/walker-walk-v0 --total-timesteps 500000 --actor-hidden-dim 1024 "
    "--critic-hidden-dim 1024 --batch-size 1024 --policy-lr 0.0005 --q-lr 0.0005 --alpha 0.1 --policy-frequency 1 "
    "--target-network-frequency 2 --total-explore-steps 10000 --teacher-feedback-total-queries 100 "
    "--teacher-feedback-num-queries-per-session 10 --teacher-feedback-frequency 20000 --teacher-feedback-schedule linear "
    "--preference-sampling disagree --segment-length 50 --reward-net-epochs 50 --surf --reward-net-normalize-inputs",
    "dm_control/walker-walk-v0_qpa.sh": "--env-id dm_control/walker-walk-v0 --exp-name qpa --total-timesteps 500000 "
    "--actor-hidden-dim 1024 --critic-hidden-dim 1024 --batch-size 1024 --policy-lr 0.0005 --q-lr 0.0005 --alpha 0.1 "
    "--policy-frequency 1 --target-network-frequency 2 --total-explore-steps 10000 --teacher-feedback-total-queries 100 "
    "--teacher-feedback-num-queries-per-session 10 --teacher-feedback-frequency 20000 --teacher-feedback-schedule linear "
    "--preference-sampling uniform --segment-length 50 --reward-ensemble-size 1 --reward-net-epochs 50 --no-surf "
    "--reward-net-normalize-inputs --qpa-query-episodes 10 --qpa-hybrid-ratio 0.5 --qpa-augmentations 20",
    **{
        f"metaworld/{task}-v3.sh": f"--env-id metaworld/{task}-v3 --total-timesteps 1000000 --actor-hidden-dim 256 "
        "--actor-hidden-layers 3 --critic-hidden-dim 256 --critic-hidden-layers 3 --batch-size 512 --policy-lr 0.0003 --q-lr 0.0003 "
        "--alpha 0.1 --tau 0.005 --gamma 0.99 --policy-frequency 1 --target-network-frequency 2 --learning-starts 1000 "
        f"--total-explore-steps 10000 --teacher-feedback-total-queries {labels} --teacher-feedback-num-queries-per-session 50 "
        "--teacher-feedback-frequency 5000 --teacher-feedback-schedule linear --preference-sampling disagree --segment-length 50 "
        "--reward-ensemble-size 3 --reward-net-lr 0.0003 --reward-net-epochs 10 --evaluation-frequency 10000 "
        "--evaluation-episodes 10 --surf"
        for task, labels in [("button-press", 20000), ("door-open", 4000), ("sweep-into", 10000)]
    },
}
# The preset each script names now (None: the demo, all its flags its own).
SCRIPT_PRESET = {
    **{f"{env}-v5.sh": "gym-mujoco" for env in ["Ant", "HalfCheetah", "Hopper", "Swimmer", "Walker2d"]},
    "Hopper-v5-demo.sh": None,
    **{f"dm_control/{task}-v0.sh": "dmc" for task in ["cheetah-run", "quadruped-walk", "walker-walk"]},
    **{f"dm_control/{task}-v0_qpa.sh": "dmc-qpa" for task in ["cheetah-run", "quadruped-walk", "walker-walk"]},
    **{f"metaworld/{task}-v3.sh": "metaworld" for task in ["button-press", "door-open", "sweep-into"]},
}
SCRIPTS = sorted((REPO / "scripts").rglob("*.sh"))


def script_flags(script: Path) -> list[str]:
    """The flags a run script passes (as tests/test_repo.py reads its command)."""
    command = script.read_text().replace("\\\n", " ")
    line = next(line for line in command.splitlines() if re.search(r"python framework/\w+\.py", line))
    tokens = shlex.split(line.replace('"$@"', ""))
    assert tokens[:2] == ["python", "framework/sac_rlhf.py"], line
    return tokens[2:]


def test_every_run_script_is_listed():
    assert sorted(str(script.relative_to(REPO / "scripts")) for script in SCRIPTS) == sorted(OLD_FLAGS) == sorted(SCRIPT_PRESET)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(REPO / "scripts")))
def test_each_run_script_resolves_exactly_the_settings_of_its_old_flag_list(script):
    name = str(script.relative_to(REPO / "scripts"))
    now = command_line_args(sac_rlhf.Args, script_flags(script))
    before = tyro.cli(sac_rlhf.Args, args=shlex.split(OLD_FLAGS[name]))
    assert now.preset == SCRIPT_PRESET[name]
    assert {**asdict(now), "preset": None} == asdict(before)
    # One line plus what is specific to the task: no flag restates a value the preset already sets.
    given = " ".join(script_flags(script))
    values = presets.PRESETS[now.preset].values if now.preset else {}
    restated = [field for field, value in values.items() if re.search(rf"(^| ){re.escape(presets.spelled(field, value))}( |$)", given)]
    assert not restated, f"{name} restates what --preset {now.preset} sets"


def test_precedence_command_line_over_preset_over_default():
    args = command_line_args(sac_rlhf.Args, ["--preset", "dmc-qpa", "--batch-size", "64", "--surf"])
    assert (args.preset, args.batch_size, args.surf) == ("dmc-qpa", 64, True)  # the command line wins, before or after --preset
    assert (args.actor_hidden_dim, args.qpa_query_episodes, args.exp_name) == (1024, 10, "qpa")  # the preset over the defaults
    assert args.tau == sac_rlhf.Args().tau  # what the preset does not set keeps its default
    args = command_line_args(sac_rlhf.Args, ["--batch-size", "64", "--preset=dmc"])
    assert (args.preset, args.batch_size, args.alpha) == ("dmc", 64, 0.1)
    assert command_line_args(sac_rlhf.Args, ["--preset", "dmc", "--preset", "metaworld"]).batch_size == 512  # the last one
    assert asdict(command_line_args(sac_rlhf.Args, [])) == asdict(sac_rlhf.Args())


def test_human_sized_budgets_fill_only_what_neither_the_command_line_nor_the_preset_sets(capsys):
    total, per_session = (
        HUMAN_LABEL_DEFAULTS["teacher_feedback_total_queries"],
        HUMAN_LABEL_DEFAULTS["teacher_feedback_num_queries_per_session"],
    )
    human = ["--teacher-feedback-mode", "human"]
    args = command_line_args(sac_rlhf.Args, ["--preset", "metaworld", *human])  # metaworld sets 50 a session, no total
    assert (args.teacher_feedback_total_queries, args.teacher_feedback_num_queries_per_session) == (total, 50)
    args = command_line_args(sac_rlhf.Args, ["--preset", "metaworld", *human, "--teacher-feedback-num-queries-per-session", "5"])
    assert (args.teacher_feedback_total_queries, args.teacher_feedback_num_queries_per_session) == (total, 5)
    args = command_line_args(sac_rlhf.Args, ["--preset", "dmc", *human])  # dmc sets no budget flag
    assert (args.teacher_feedback_total_queries, args.teacher_feedback_num_queries_per_session) == (total, per_session)
    assert "human-sized defaults" in capsys.readouterr().out


def refusal(argv, args_class=sac_rlhf.Args, capsys=None) -> str:
    with pytest.raises(SystemExit) as exit_:
        command_line_args(args_class, argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    return err.strip()


def test_an_unknown_preset_is_one_line_naming_the_choices(capsys):
    assert refusal(["--preset", "dmc_qpa"], capsys=capsys) == f"error: --preset 'dmc_qpa' is not one of: {', '.join(presets.PRESETS)}"
    assert refusal(["--env-id", "Hopper-v5", "--preset=x"], capsys=capsys).startswith("error: --preset 'x' is not one of: gym-mujoco, dmc")


def test_a_preset_setting_fields_a_script_lacks_is_refused_for_that_script(capsys):
    assert "gym-mujoco" in presets.usable(pref_ppo.Args)  # its fields are all preference settings, both scripts have them
    assert set(presets.usable(sac_rlhf.Args)) == set(presets.PRESETS)
    line = refusal(["--preset", "dmc"], pref_ppo.Args, capsys)
    assert line.startswith("error: --preset 'dmc' sets --batch-size") and "pref_ppo.py does not have" in line, line
    assert command_line_args(pref_ppo.Args, ["--preset", "gym-mujoco"]).segment_length == 50


def test_the_script_exits_2_with_one_line_on_an_unknown_preset():
    result = subprocess.run(
        [sys.executable, "framework/sac_rlhf.py", "--preset", "nope"], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2
    assert result.stderr == f"error: --preset 'nope' is not one of: {', '.join(presets.PRESETS)}\n"


def test_help_lists_every_preset_and_the_flags_it_sets(capsys):
    with pytest.raises(SystemExit):
        command_line_args(sac_rlhf.Args, ["--help"])
    text = " ".join(capsys.readouterr().out.replace("│", " ").split())
    for name, preset in presets.PRESETS.items():
        assert f"{name}: " in text
        for field, value in preset.values.items():
            assert presets.spelled(field, value) in text, (name, field)


def test_args_json_records_the_preset_and_every_resolved_value():
    args = command_line_args(sac_rlhf.Args, ["--preset", "dmc-qpa", "--env-id", "dm_control/walker-walk-v0"])
    settings = public_settings(args)  # what start_logging writes to runs/<run>/args.json
    assert settings["preset"] == "dmc-qpa"
    assert (
        settings["actor_hidden_dim"] == 1024 and settings["qpa_augmentations"] == 20 and settings["env_id"] == "dm_control/walker-walk-v0"
    )
    assert set(settings) == {field.name for field in fields(sac_rlhf.Args)}


def test_every_preset_resolves_to_valid_settings_of_the_types_its_fields_hold():
    hints = sweep.load_script("sac-rlhf").field_types()
    for name, preset in presets.PRESETS.items():
        for field, value in preset.values.items():
            assert sweep.coerce(field, value, hints[field]) == value and type(sweep.coerce(field, value, hints[field])) is type(value)
        sac_rlhf.validate_args(command_line_args(sac_rlhf.Args, ["--preset", name]))


def config_with(parameters: dict) -> dict:
    return {"method": "random", "metric": {"name": "eval/mean_return", "goal": "maximize"}, "parameters": parameters}


def test_sweep_applies_a_preset_between_the_defaults_and_the_configs_fixed_values():
    script = sweep.load_script("sac-rlhf")
    parsed = sweep.parse_sweep(config_with({"batch_size": {"value": 128}, "seed": {"values": [1, 2]}}), script, "t.yaml", "t")
    base = sweep.base_args(script, parsed, ["--preset", "dmc", "--alpha", "0.3"])
    assert (base.preset, base.actor_hidden_dim, base.batch_size, base.alpha) == ("dmc", 1024, 128, 0.3)
    fixed = sweep.parse_sweep(config_with({"preset": {"value": "metaworld"}, "seed": {"values": [1, 2]}}), script, "t.yaml", "t")
    base = sweep.base_args(script, fixed, [])
    assert (base.preset, base.batch_size, base.reward_net_epochs) == ("metaworld", 512, 10)
    assert sweep.base_args(script, fixed, ["--preset", "dmc"]).batch_size == 1024  # after -- wins over the config
    with pytest.raises(sweep.SweepError, match="preset cannot be swept"):
        sweep.base_args(script, sweep.parse_sweep(config_with({"preset": {"values": ["dmc", "metaworld"]}}), script, "t.yaml", "t"), [])
    with pytest.raises(sweep.SweepError, match="is not one of"):
        sweep.base_args(script, parsed, ["--preset", "nope"])
    with pytest.raises(sweep.SweepError, match="pref_ppo.py does not have"):
        ppo_script = sweep.load_script("pref-ppo")
        sweep.base_args(
            ppo_script, sweep.parse_sweep(config_with({"seed": {"values": [1, 2]}}), ppo_script, "t.yaml", "t"), ["--preset", "dmc"]
        )


def test_an_exported_run_script_names_the_preset_and_only_what_differs_from_it():
    script = sweep.load_script("sac-rlhf")
    values = asdict(command_line_args(sac_rlhf.Args, ["--preset", "dmc", "--env-id", "dm_control/walker-walk-v0", "--q-lr", "0.0005"]))
    text = sweep.run_script(script, values, ["header"])
    flags = script_flags_of(text)
    assert flags == ["--env-id", "dm_control/walker-walk-v0", "--preset", "dmc", "--q-lr", "0.0005"]
    assert asdict(command_line_args(sac_rlhf.Args, flags)) == values


def script_flags_of(text: str) -> list[str]:
    line = next(line for line in text.replace("\\\n", " ").splitlines() if line.startswith("python framework/"))
    return shlex.split(line.replace('"$@"', ""))[2:]


def test_the_flag_docstring_names_every_preset():
    """The docs' flag tables show the docstring (--help shows the help built from PRESETS): it names each preset."""
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(presets.PresetArgs))
    docstring = next(node.value.value for node in tree.body[0].body[2:] if isinstance(node, ast.Expr))
    assert re.split(r", | or ", docstring.split(":")[0]) == list(presets.PRESETS)


def test_the_bench_qpa_variant_is_the_dmc_qpa_presets_preference_settings(monkeypatch):
    """bench/feedback_efficiency.py --variant qpa (CleanRL's 256-unit SAC, so not --preset dmc-qpa itself) asks and
    replays as scripts/dm_control/*_qpa.sh do: QPA's preference settings as the preset has them."""
    monkeypatch.syspath_prepend(str(REPO / "bench"))  # as tests/test_bench.py imports it
    import feedback_efficiency

    env_id = "dm_control/walker-walk-v0"
    bench = tyro.cli(sac_rlhf.Args, args=["--env-id", env_id, *feedback_efficiency.variant_flags("qpa", env_id)])
    preset, dmc = presets.PRESETS["dmc-qpa"].values, presets.PRESETS["dmc"].values
    # What QPA changes from PEBBLE's DMC setting, and the schedule and inputs the bench's tuned variants share with it
    # (its reward-model epochs stay the script default, as with every variant).
    # (the hybrid batch ratio is a field of PEBBLE's Args itself: PrefPPO has no replay buffer to mix)
    preference = {field.name for field in fields(sac_rlhf.PreferenceArgs)} | {"qpa_hybrid_ratio"}
    qpa = [name for name in preset if preset[name] != dmc.get(name) and name in preference]
    shared = [*qpa, "teacher_feedback_schedule", "reward_net_normalize_inputs"]
    assert len(qpa) == 6
    assert {name: getattr(bench, name) for name in shared} == {name: preset[name] for name in shared}


@pytest.mark.parametrize(
    ("script", "flags"),
    [
        ("sac_rlhf", ["--env-id", "Hopper-v5", "--teacher-objective", "hopper-backflip", "--preset", "gym-mujoco"]),
        ("sac_rlhf", ["--env-id", "Hopper-v5", "--teacher-feedback-mode", "human", "--feedback-server-url", "localhost:5001"]),
        ("pref_ppo", ["--env-id", "Hopper-v5", "--teacher-objective", "hopper-backflip-upright"]),
        ("sac", ["--env-id", "Hopper-v5", "--reward-objective", "hopper-landed-backflip"]),
    ],
)
def test_defaults_come_in_before_the_parse_and_validation_changes_no_setting(script, flags):
    """What a preset, an objective and human mode set is in the settings the command line gives (one place:
    presets.settings_defaults); the script's validation then only checks them."""
    import importlib

    module = importlib.import_module(script)
    args = command_line_args(module.Args, flags)
    before = asdict(args)
    validate = getattr(module, "validate_args", None) or module.validate_sac_args
    try:
        validate(args)
    except ConfigError:
        pass  # a check may refuse (e.g. no feedback server file here): it still changes nothing
    assert asdict(args) == before
