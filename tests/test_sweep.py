"""framework/sweep.py: W&B-format configs translated for Optuna and checked against the scripts' own Args, tiny
Optuna sweeps of sac.py and sac_rlhf.py into a SQLite file, pruning, exporting the best trial as a run script,
and one W&B trial (offline) through the function wandb.agent calls."""

import json
import math
import re
import shlex
import struct
import subprocess
import sys
from dataclasses import asdict, replace
from pathlib import Path

import optuna
import pytest
import tyro
import yaml
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.trial import TrialState
from test_repo import last_feedback_step

import sweep

REPO = Path(__file__).resolve().parents[1]
CONFIGS = sorted((REPO / "sweep_config").glob("*.yaml"))

# Tiny but valid settings (see tests/test_end_to_end.py small_args): a trial takes a couple of seconds.
TINY_SAC = {
    "env_id": "Hopper-v5",
    "total_timesteps": 300,
    "learning_starts": 100,
    "batch_size": 32,
    "actor_hidden_dim": 32,
    "critic_hidden_dim": 32,
    "evaluation_frequency": 0,
    "evaluation_episodes": 1,
}
TINY_PEBBLE = {
    **TINY_SAC,
    "total_timesteps": 400,
    "total_explore_steps": 100,
    "teacher_feedback_total_queries": 10,
    "teacher_feedback_num_queries_per_session": 5,
    "teacher_feedback_frequency": 100,
    "max_augmentation_offset": 5,
    "min_augmentation_offset": 2,
    "reward_net_hidden_dim": 32,
    "reward_net_epochs": 3,
    "explore_knn_sample_size": 100,
    "checkpoint_frequency": 0,
}


def write_config(path: Path, program: str, fixed: dict, swept: dict, method: str = "random", metric: str = "eval/mean_return") -> str:
    config = {
        "program": program,
        "method": method,
        "metric": {"name": metric, "goal": "maximize"},
        "parameters": {**{name: {"value": value} for name, value in fixed.items()}, **swept},
    }
    path.write_text(yaml.safe_dump(config))
    return str(path)


def parse(config: dict, algorithm: str = "sac-rlhf") -> sweep.Sweep:
    return sweep.parse_sweep(config, sweep.load_script(algorithm), "test.yaml", "test")


def config_with(parameters: dict, method: str = "bayes") -> dict:
    return {"method": method, "metric": {"name": "eval/mean_return", "goal": "maximize"}, "parameters": parameters}


# ----------------------------------------------------------------------------------------
# Config translation
# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_configs_load_and_validate_against_their_scripts_args(path):
    script, parsed, base = sweep.prepare(sweep.Args(config_filename=str(path)))
    assert script.algorithm == "sac-rlhf"
    assert parsed.params, "a sweep sweeps something"
    assert base.env_id == parsed.fixed["env_id"]
    distributions = sweep.optuna_distributions(parsed)
    assert set(distributions) == set(parsed.params)
    if parsed.method == "grid":
        assert isinstance(sweep.make_sampler(parsed, 0), optuna.samplers.GridSampler)
    if path.name == "human.yaml":
        assert base.teacher_feedback_mode == "human" and parsed.metric == "heldout_accuracy"
        assert sweep.grid_search_space(parsed) == {"seed": [1, 2, 3]}
    else:
        metric = "final_success_rate" if path.name.startswith("metaworld") else "eval/mean_return"  # Meta-World's papers report success
        assert parsed.metric == metric and parsed.goal == "maximize"
        for knob in ("reward_net_lr", "segment_length", "teacher_feedback_num_queries_per_session", "preference_sampling", "surf", "rune"):
            assert knob in parsed.params, f"{path.name} sweeps {knob}"
        for per_session in parsed.params["teacher_feedback_num_queries_per_session"].values:
            last = last_feedback_step(script.module, base, per_session)
            assert last < base.total_timesteps, f"{path.name}: with {per_session} per session the last labels come at {last}"


def test_distributions_map_to_optuna():
    parsed = parse(
        config_with(
            {
                "reward_net_lr": {"distribution": "log_uniform_values", "min": 1e-4, "max": 1e-3},
                "segment_length": {"distribution": "int_uniform", "min": 20, "max": 60},
                "preference-sampling": {"values": ["uniform", "disagree"]},  # kebab-case flag name
                "tau": {"distribution": "uniform", "min": 0.001, "max": 0.01},
                "batch_size": {"distribution": "q_uniform", "min": 64, "max": 256, "q": 64},
                "alpha": {"distribution": "log_uniform", "min": -3, "max": 0},
                "reward_net_hidden_layers": {"min": 1, "max": 4},  # W&B infers int_uniform
                "q_lr": {"values": ["3e-4", 1e-3]},  # YAML reads 3e-4 as a string
                "surf": {"values": [True, False]},
                "env_id": {"value": "Walker2d-v5"},
            }
        )
    )
    d = sweep.optuna_distributions(parsed)
    assert d["reward_net_lr"] == FloatDistribution(1e-4, 1e-3, log=True)
    assert d["segment_length"] == IntDistribution(20, 60)
    assert d["preference_sampling"] == CategoricalDistribution(["uniform", "disagree"])
    assert d["tau"] == FloatDistribution(0.001, 0.01)
    assert d["batch_size"] == IntDistribution(64, 256, step=64)
    assert d["alpha"] == FloatDistribution(math.exp(-3), 1.0, log=True)
    assert d["reward_net_hidden_layers"] == IntDistribution(1, 4)
    assert d["q_lr"] == CategoricalDistribution([3e-4, 1e-3])
    assert d["surf"] == CategoricalDistribution([True, False])
    assert parsed.fixed == {"env_id": "Walker2d-v5"}
    wandb_parameters = parsed.config["parameters"]  # for W&B: Args field names, typed values, inferred distributions
    assert wandb_parameters["preference_sampling"] == {"values": ["uniform", "disagree"]}
    assert wandb_parameters["q_lr"] == {"values": [3e-4, 1e-3]} and wandb_parameters["env_id"] == {"value": "Walker2d-v5"}
    assert wandb_parameters["reward_net_hidden_layers"] == {"distribution": "int_uniform", "min": 1, "max": 4}
    assert isinstance(sweep.make_sampler(parsed, 0), optuna.samplers.TPESampler)
    assert isinstance(sweep.make_sampler(replace(parsed, method="random"), 0), optuna.samplers.RandomSampler)


def test_grid_is_the_product_of_the_values():
    parsed = parse(
        config_with(
            {
                "segment_length": {"values": [25, 50]},
                "preference_sampling": {"values": ["uniform", "disagree", "entropy"]},
                "seed": {"value": 3},
            },
            method="grid",
        )
    )
    sampler = sweep.make_sampler(parsed, seed=0)
    assert isinstance(sampler, optuna.samplers.GridSampler)
    space = sweep.grid_search_space(parsed)
    assert space == {"segment_length": [25, 50], "preference_sampling": ["uniform", "disagree", "entropy"]}
    study = optuna.create_study(sampler=sampler)
    study.optimize(
        lambda t: (
            len(t.suggest_categorical("preference_sampling", space["preference_sampling"]))
            + t.suggest_categorical("segment_length", space["segment_length"])
        ),
        n_trials=20,
    )
    assert sorted((t.params["segment_length"], t.params["preference_sampling"]) for t in study.trials) == sorted(
        (s, p) for s in (25, 50) for p in ("uniform", "disagree", "entropy")
    ), "the grid ends after its 6 combinations"
    with pytest.raises(sweep.SweepError, match="grid needs values"):
        sweep.grid_search_space(parse(config_with({"reward_net_lr": {"min": 0.1, "max": 0.2}}, method="grid")))


@pytest.mark.parametrize(
    ("parameters", "algorithm", "expected"),
    [
        (
            {"reward_lr": {"values": [1]}, "bogus": {"value": 2}, "seed": {"value": 1}},
            "sac-rlhf",
            ["reward_lr", "did you mean reward_net_lr", "bogus", "--help"],
        ),
        ({"reward_net_lr": {"values": [1e-4]}}, "sac", ["reward_net_lr", "framework/sac.py"]),  # a PEBBLE knob is not the baseline's
        ({"preference_sampling": {"values": ["random"]}}, "sac-rlhf", ["preference_sampling", "'random'", "uniform, disagree, entropy"]),
        ({"segment_length": {"values": [50, 1]}}, "sac-rlhf", ["segment_length = 1", "--segment-length must be >= 2"]),
        ({"surf_tau": {"min": 0.9, "max": 1.5}}, "sac-rlhf", ["surf_tau = 1.5", "--surf-tau"]),
        ({"batch_size": {"distribution": "uniform", "min": 32, "max": 256}}, "sac-rlhf", ["batch_size", "int"]),
        ({"seed": {"distribution": "normal", "mu": 1, "sigma": 2}}, "sac-rlhf", ["seed", "normal", "no Optuna equivalent"]),
        ({"seed": {"values": [1], "extra": 3}}, "sac-rlhf", ["unknown key", "extra"]),
        ({"run_name": {"value": "x"}}, "sac-rlhf", ["run_name"]),
    ],
    ids=[
        "unknown-names",
        "other-script",
        "literal",
        "script-validation",
        "range-end",
        "float-on-int",
        "no-optuna-equivalent",
        "bad-key",
        "run-name",
    ],
)
def test_bad_parameters_fail_naming_them(parameters, algorithm, expected):
    with pytest.raises(sweep.SweepError) as error:
        script = sweep.load_script(algorithm)
        parsed = sweep.parse_sweep(config_with(parameters), script, "test.yaml", "test")
        sweep.check_sweep(parsed, sweep.base_args(script, parsed, []), script)
        sweep.optuna_distributions(parsed)
    message = str(error.value)
    assert "\n" not in message
    for part in expected:
        assert part in message, message


def test_config_level_errors():
    for config, expected in [
        ({"method": "anneal"}, "method anneal"),
        ({"method": "bayes", "metric": {"name": "eval/mean_return"}}, "goal"),
        ({"method": "bayes", "parameter": {}}, "unknown key(s) parameter"),
    ]:
        with pytest.raises(sweep.SweepError, match=expected.replace("(", r"\(").replace(")", r"\)")):
            parse(config)
    with pytest.raises(sweep.SweepError, match="does not match the config's program"):
        sweep.algorithm_of("pref-ppo", {"program": "framework/sac_rlhf.py"}, "x.yaml")
    assert sweep.algorithm_of(None, {"program": "framework/ppo.py"}, "x.yaml") == "ppo"
    with pytest.raises(sweep.SweepError, match="--storage"):
        sweep.make_storage("sweeps")


def test_flags_after_double_dash_override_fixed_values_through_the_scripts_parser():
    script = sweep.load_script("sac-rlhf")
    parsed = parse(config_with({"total_timesteps": {"value": 5000}, "surf": {"values": [True, False]}, "env_id": {"value": "Walker2d-v5"}}))
    base = sweep.base_args(script, parsed, ["--total-timesteps", "300", "--no-rune", "--teacher-feedback-mode", "file"])
    assert (base.total_timesteps, base.env_id, base.rune, base.teacher_feedback_mode) == (300, "Walker2d-v5", False, "file")
    with pytest.raises(sweep.SweepError, match="--surf is swept"):
        sweep.base_args(script, parsed, ["--no-surf"])
    assert sweep.split_argv(["--sweep-count", "3", "--", "--seed", "2"]) == (["--sweep-count", "3"], ["--seed", "2"])


def test_cli_unknown_parameter_exits_2_with_one_line(tmp_path):
    config = write_config(tmp_path / "bad.yaml", "framework/sac_rlhf.py", {"env_id": "Hopper-v5"}, {"reward_lr": {"values": [1e-4]}})
    result = subprocess.run(
        [sys.executable, str(REPO / "framework/sweep.py"), "--config-filename", config, "--storage", f"sqlite:///{tmp_path}/s.db"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "reward_lr" in lines[0] and "reward_net_lr" in lines[0], result.stderr
    assert not (tmp_path / "s.db").exists(), "nothing created before the config is checked"


# ----------------------------------------------------------------------------------------
# Optuna sweeps
# ----------------------------------------------------------------------------------------
def exported_args(script_text: str, script):
    """Parses an exported run script the way tests/test_repo.py parses scripts/*.sh."""
    command = script_text.replace("\\\n", " ")
    line = next(line for line in command.splitlines() if re.search(r"python framework/\w+\.py", line))
    tokens = shlex.split(line.replace('"$@"', ""))
    program = next(token for token in tokens if token.startswith("framework/"))
    assert program == script.path
    return tyro.cli(script.Args, args=tokens[tokens.index(program) + 1 :])


@pytest.mark.parametrize(
    ("algorithm", "program", "fixed", "swept"),
    [
        (
            "sac",
            "framework/sac.py",
            TINY_SAC,
            {"q_lr": {"distribution": "log_uniform_values", "min": 1e-4, "max": 1e-3}, "autotune": {"values": [True, False]}},
        ),
        (
            "sac-rlhf",
            "framework/sac_rlhf.py",
            TINY_PEBBLE,
            {
                "reward_net_lr": {"distribution": "log_uniform_values", "min": 1e-4, "max": 1e-3},
                "segment_length": {"values": [10, 20]},
                "preference_sampling": {"values": ["uniform", "disagree", "entropy"]},
            },
        ),
    ],
    ids=["sac", "sac-rlhf"],
)
def test_optuna_sweep_stores_three_trials_and_exports_the_best(chdir_tmp, algorithm, program, fixed, swept):
    config = write_config(chdir_tmp / "tiny.yaml", program, fixed, swept)
    storage = f"sqlite:///{chdir_tmp}/sweeps.db"
    sweep.main(sweep.Args(config_filename=config, storage=storage, sweep_count=3), ["--no-progress-bar"])

    study = optuna.load_study(study_name=f"tiny__{algorithm}", storage=storage)  # reopened from the file
    trials = study.trials
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 3
    assert len({t.user_attrs["run_name"] for t in trials}) == 3
    for t in trials:
        run_name = t.user_attrs["run_name"]
        assert run_name.startswith(f"tiny__{algorithm}__trial{t.number}__Hopper-v5__1__")
        summary = json.loads((chdir_tmp / "runs" / run_name / "summary.json").read_text())
        assert t.value == summary["final_eval_return"] == t.user_attrs["summary"]["final_eval_return"]
        assert set(t.params) == set(swept) and all(t.user_attrs["args"][k] == v for k, v in t.params.items())
    assert study.user_attrs["algorithm"] == algorithm

    out = chdir_tmp / "scripts" / "Hopper-v5.sh"
    text = sweep.main(sweep.Args(export_best=True, storage=storage, study_name=f"tiny__{algorithm}", out=str(out)))
    assert out.read_text() == text and text.startswith("#!/usr/bin/env bash\n#") and text.rstrip().endswith('"$@"')
    best = study.best_trial
    assert f"trial {best.number}" in text and f"tiny__{algorithm}" in text and "eval/mean_return" in text
    script = sweep.load_script(algorithm)
    parsed = exported_args(text, script)
    script.validate(parsed)
    assert asdict(parsed) == {**best.user_attrs["args"], "run_name": None}, "the script reproduces the trial's settings"
    assert "  --env-id Hopper-v5 \\\n" in text and "  --no-progress-bar \\\n" in text


def test_hopeless_trials_are_pruned_from_intermediate_evaluations(chdir_tmp):
    config = write_config(
        chdir_tmp / "prune.yaml", "framework/sac.py", {**TINY_SAC, "evaluation_frequency": 150}, {"q_lr": {"values": [1e-3]}}
    )
    storage = f"sqlite:///{chdir_tmp}/sweeps.db"
    args = sweep.Args(config_filename=config, storage=storage, sweep_count=1, pruner="threshold", pruner_threshold=1e9)
    study = sweep.main(args, ["--no-progress-bar"])
    (trial,) = study.trials
    assert trial.state == TrialState.PRUNED
    assert list(trial.intermediate_values) == [150], "pruned at the first evaluation, before the end of the run"
    assert not (chdir_tmp / "runs" / trial.user_attrs["run_name"] / "summary.json").exists()

    assert isinstance(sweep.make_pruner("median", "maximize", None, 10_000, 5000), optuna.pruners.MedianPruner)
    assert isinstance(sweep.make_pruner("hyperband", "maximize", None, 0, 5000), optuna.pruners.HyperbandPruner)
    assert isinstance(sweep.make_pruner("none", "maximize", None, 0, 5000), optuna.pruners.NopPruner)
    with pytest.raises(sweep.SweepError, match="--pruner-threshold"):
        sweep.make_pruner("threshold", "maximize", None, 0, 5000)
    # PEBBLE's evaluations during exploration say nothing about the labels: no pruning before it ends.
    assert sweep.warmup_steps(None, sweep.load_script("sac-rlhf").Args(total_explore_steps=7000)) == 7000


def test_metric_can_be_a_summary_key_or_a_tensorboard_tag(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(tmp_path))
    for step, value in [(1, 0.5), (2, 0.75)]:
        writer.add_scalar("reward_model/heldout_accuracy", value, step)
    writer.close()
    summary = {"final_eval_return": 12.5, "heldout_accuracy": 0.8}
    assert sweep.metric_value("eval/mean_return", summary, tmp_path) == 12.5
    assert sweep.metric_value("heldout_accuracy", summary, tmp_path) == 0.8
    assert sweep.metric_value("reward_model/heldout_accuracy", summary, tmp_path) == 0.75
    with pytest.raises(sweep.SweepError, match="neither a key"):
        sweep.metric_value("nope", summary, tmp_path)


def test_storage_accepts_sqlite_and_journal_files(tmp_path):
    for url in (f"sqlite:///{tmp_path}/a/s.db", f"journal://{tmp_path}/b/s.log", str(tmp_path / "c.journal")):
        storage = sweep.make_storage(url)
        optuna.create_study(study_name="x", storage=storage).optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=1)
        assert len(optuna.load_study(study_name="x", storage=sweep.make_storage(url)).trials) == 1, url


# ----------------------------------------------------------------------------------------
# W&B: one trial through the function wandb.agent calls, offline
# ----------------------------------------------------------------------------------------
def wandb_records(path: Path):
    """The records of an offline run's .wandb file (LevelDB-log framing: 32 KiB blocks, 7-byte chunk headers)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    position, block, pending = 7, 32768, b""
    while position + 7 <= len(data):
        if block - position % block < 7:  # a block's tail too short for a header is padding
            position += block - position % block
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + 7])
        if kind == 0 and length == 0:
            position += block - position % block
            continue
        pending += data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # FULL or LAST chunk
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def test_wandb_trial_logs_the_metric_to_its_offline_run(chdir_tmp, monkeypatch):
    import wandb

    # An earlier test's --track run leaves its W&B session (and directory) and its TensorBoard patch, which
    # would stream this trial's event files into the run: start from a fresh session, unpatched.
    wandb.teardown()
    wandb.tensorboard.unpatch()
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(chdir_tmp))
    fixed = {**TINY_SAC, "evaluation_frequency": 150}  # evaluations at 150 and 300 steps
    config = write_config(chdir_tmp / "tiny.yaml", "framework/sac.py", fixed, {"q_lr": {"values": [3e-4, 1e-3]}})
    script, parsed, base = sweep.prepare(sweep.Args(config_filename=config, backend="wandb"), ["--no-progress-bar"])
    assert parsed.config["parameters"]["q_lr"] == {"values": [3e-4, 1e-3]} and parsed.config["name"] == "tiny__sac"

    summary = sweep.run_wandb_trial({"q_lr": 1e-3}, script, parsed, base, project="cleanrlhf-test")

    # run.finish() can return before W&B's service process has written the run's last records (the summary among
    # them): seen once on a loaded CI machine. Shutting the service down flushes its writer; the exit record is last.
    wandb.teardown()
    (run_file,) = (chdir_tmp / "wandb").glob("offline-run-*/run-*.wandb")
    records = list(wandb_records(run_file))
    assert records[-1].WhichOneof("record_type") == "exit", [record.WhichOneof("record_type") for record in records]
    logged, config_items, evaluations = {}, {}, []
    for record in records:
        kind = record.WhichOneof("record_type")
        if kind == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            if "eval/mean_return" in row:
                evaluations.append((row["global_step"], row["eval/mean_return"]))
        if kind == "summary":
            logged.update({item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.summary.update})
        if kind in ("run", "config"):  # the initial config comes with the run record, updates on their own
            updates = record.run.config.update if kind == "run" else record.config.update
            config_items.update({item.key: json.loads(item.value_json) for item in updates})
    assert logged["eval/mean_return"] == summary["final_eval_return"], (logged, summary)
    assert [step for step, _ in evaluations] == [150, 300] and evaluations[-1][1] == summary["final_eval_return"], evaluations
    assert logged["trial/final_eval_return"] == pytest.approx(summary["final_eval_return"])
    assert config_items["q_lr"] == 1e-3 and config_items["cleanrlhf_args"]["q_lr"] == 1e-3
    assert config_items["cleanrlhf_args"]["track"] is False, "the script's own wandb.init stays off inside a W&B sweep"
    run_name = config_items["cleanrlhf_args"]["run_name"]
    assert run_name.startswith("tiny__sac__trial") and (chdir_tmp / "runs" / run_name / "summary.json").is_file()


def test_a_sweep_on_your_own_env_and_objective_ranks_trials_by_the_objective(chdir_tmp):
    """`--env-id module:Id` and `--teacher-objective` through a sweep: trials run on the zero-reward windmill, are ranked
    by the objective's summary figure (the env's return is 0 in every trial), and the exported script reproduces the
    best trial's env and objective."""
    windmill = "cleanrlhf_utils.example_envs.windmill:Windmill-v0"
    fixed = {**TINY_PEBBLE, "env_id": windmill, "teacher_objective": "windmill-clockwise", "evaluation_frequency": 400}
    config = write_config(
        chdir_tmp / "windmill.yaml",
        "framework/sac_rlhf.py",
        fixed,
        {"reward_net_lr": {"values": [3e-4, 1e-3]}},
        metric="final_objective_return",
    )
    storage = f"sqlite:///{chdir_tmp}/sweeps.db"
    study = sweep.main(sweep.Args(config_filename=config, storage=storage, sweep_count=2), ["--no-progress-bar"])
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 2
    for t in study.trials:
        summary = json.loads((chdir_tmp / "runs" / t.user_attrs["run_name"] / "summary.json").read_text())
        assert summary["env_id"] == windmill and summary["final_eval_return"] == 0.0
        assert t.value == summary["final_objective_return"] != 0.0
    out = chdir_tmp / "scripts" / "windmill.sh"
    text = sweep.main(sweep.Args(export_best=True, storage=storage, study_name=study.study_name, out=str(out)))
    parsed = exported_args(text, sweep.load_script("sac-rlhf"))
    assert (parsed.env_id, parsed.teacher_objective) == (windmill, "windmill-clockwise")
    assert parsed.reward_net_lr == study.best_trial.params["reward_net_lr"]
