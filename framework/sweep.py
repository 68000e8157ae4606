# Hyperparameter sweeps of the training scripts (sac_rlhf.py, pref_ppo.py, sac.py, ppo.py).
#
# One sweep file format, W&B's (sweep_config/*.yaml), two backends:
#   - optuna (default, no account): the study lives in a SQLite database or a journal file, so a laptop needs
#     nothing else, and SLURM array tasks on a shared filesystem all join the same study;
#   - wandb: a W&B sweep (created here, or joined with --sweep-id), run by `wandb.agent`.
# Every trial calls the script's own `main(args, on_evaluation)` in this process, with the sampled values
# applied to the script's Args; intermediate evaluations feed Optuna's pruner.
#
#   python framework/sweep.py --config-filename sweep_config/hopper.yaml --sweep-count 20
#   python framework/sweep.py --config-filename sweep_config/hopper.yaml --sweep-count 20 -- --total-timesteps 200000
#   python framework/sweep.py --config-filename sweep_config/hopper.yaml --backend wandb --project-name P --entity E
#   python framework/sweep.py --export-best --storage sqlite:///sweeps.db --study-name hopper__sac-rlhf --out scripts/Hopper-v5.sh
#
# Flags after `--` go to the training script and are parsed by its own Args (they override the config's fixed
# `value`s; a swept parameter cannot be set there).
import difflib
import importlib
import math
import os
import re
import shlex
import sys
import time
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any, Literal

import yaml

from cleanrlhf_utils import presets
from cleanrlhf_utils.arguments import parse_args
from cleanrlhf_utils.errors import ConfigError
from cleanrlhf_utils.tracking import public_settings


@dataclass
class Args:
    """Tunes the hyperparameters of a training script with a sweep in W&B's format (sweep_config/*.yaml), on Optuna
    (local, no account) or W&B. Flags after `--` go to the training script, e.g. `-- --total-timesteps 100000`."""

    config_filename: str | None = None
    """the sweep, in W&B's sweep format (sweep_config/*.yaml); needed except with --export-best"""
    algorithm: Literal["sac-rlhf", "pref-ppo", "sac", "ppo"] | None = None
    """the script whose hyperparameters are tuned; default: the config's `program`, else sac-rlhf"""
    sweep_count: int = 20
    """trials this process runs (with SLURM: per array task)"""
    backend: Literal["optuna", "wandb"] | None = None
    """`optuna`: no account needed, the study lives in --storage; `wandb`: a W&B sweep (needs an account). Default:
    wandb where a W&B flag (--project-name, --entity, --sweep-id) is given, else optuna"""

    # --- optuna ---
    storage: str = "sqlite:///sweeps.db"
    """where the Optuna study lives: sqlite:///path.db (or another SQLAlchemy URL), or a journal file
    journal:///abs/path.log, journal://relative/path.log (the safer choice for many workers on NFS)"""
    study_name: str | None = None
    """the Optuna study (created, or joined if it exists); default: the config's `name`, else <config stem>__<algorithm>"""
    seed: int = 0
    """seed of the sampler; SLURM array task i adds i, so that parallel workers do not draw the same values"""
    pruner: Literal["median", "hyperband", "threshold", "none"] = "median"
    """stops hopeless trials early from their periodic evaluations (only when the metric is the evaluation return or success rate)"""
    pruner_threshold: float | None = None
    """--pruner threshold: prune as soon as an evaluation is below this value (above it when the goal is minimize)"""
    pruner_warmup_steps: int | None = None
    """never prune before this environment step; default: the end of unsupervised exploration (0 without it)"""

    # --- wandb ---
    project_name: str | None = None
    """the W&B project of the sweep (default CleanRLHF)"""
    entity: str | None = None
    """the W&B entity (team or user) of the sweep"""
    sweep_id: str | None = None
    """join this W&B sweep instead of creating one (what every SLURM array task does)"""

    # --- creating only, exporting ---
    create_only: bool = False
    """create (or join) the study / W&B sweep, check the config, print the study name / sweep id and exit"""
    export_best: bool = False
    """write the best trial of --study-name in --storage as a run script (scripts/<ENV>.sh format)"""
    out: str | None = None
    """--export-best: the file to write, e.g. scripts/Hopper-v5.sh; None prints the script"""


WANDB_PROJECT = "CleanRLHF"
"""the W&B project a sweep goes to unless --project-name names another"""


def backend(args: Args) -> str:
    """--backend, or where it is not given: wandb when a W&B flag is (--project-name, --entity, --sweep-id: the seed
    project's sweep commands give them and no backend), else optuna."""
    if args.backend is not None:
        return args.backend
    return "wandb" if any(value is not None for value in (args.project_name, args.entity, args.sweep_id)) else "optuna"


class SweepError(ValueError):
    """Bad sweep input: printed as one `error:` line, exit code 2, before any trial runs."""


# The training scripts: module in framework/ and the function that checks its Args (the same checks as its CLI).
SCRIPTS = {
    "sac-rlhf": ("sac_rlhf", "validate_args"),
    "sac-rlhf-rime": ("sac_rlhf_rime", "validate_args"),
    "sac-rlhf-mistake-aware": ("sac_rlhf_mistake_aware", "validate_args"),
    "sac-rlhf-agent-reset": ("sac_rlhf_agent_reset", "validate_args"),
    "pref-ppo": ("pref_ppo", "validate_args"),
    "sac": ("sac", "validate_sac_args"),
    "ppo": ("ppo", "validate_ppo_args"),
}
# Keys of W&B's sweep configuration (https://docs.wandb.ai/guides/sweeps/sweep-config-keys).
CONFIG_KEYS = (
    "method",
    "metric",
    "parameters",
    "name",
    "description",
    "program",
    "command",
    "early_terminate",
    "run_cap",
    "project",
    "entity",
)
PARAMETER_KEYS = ("value", "values", "distribution", "min", "max", "q", "probabilities", "mu", "sigma", "a", "b")
DISTRIBUTIONS = (
    "constant", "categorical", "int_uniform", "uniform", "q_uniform", "log_uniform", "log_uniform_values", "q_log_uniform",
    "q_log_uniform_values", "inv_log_uniform", "inv_log_uniform_values", "normal", "q_normal", "log_normal", "q_log_normal", "beta", "q_beta",
)  # fmt: skip
UNBOUNDED_DISTRIBUTIONS = ("normal", "q_normal", "log_normal", "q_log_normal", "beta", "q_beta")
# What the optuna backend can translate; the others are W&B-only.
OPTUNA_DISTRIBUTIONS = (
    "constant",
    "categorical",
    "int_uniform",
    "uniform",
    "q_uniform",
    "log_uniform",
    "log_uniform_values",
    "q_log_uniform_values",
)
# Metric names meaning the true evaluation return at the end of the run (the TensorBoard tag, the summary key).
EVAL_METRICS = ("eval/mean_return", "final_eval_return")
# The same for the success rate of Meta-World's evaluations, the metric its papers report.
SUCCESS_METRICS = ("eval/success_rate", "final_success_rate")


def evaluation_value(metric: str, value: float) -> float | None:
    """What an evaluation reports for the pruner: its mean return, its success rate (runs.EvalReturn carries it), or
    None when the metric is neither (nothing to compare mid-run)."""
    if metric in SUCCESS_METRICS:
        return getattr(value, "success_rate", None)
    return float(value) if metric in EVAL_METRICS else None


# ----------------------------------------------------------------------------------------
# The training script and its Args
# ----------------------------------------------------------------------------------------
@dataclass
class Script:
    algorithm: str
    module: types.ModuleType
    validate: Callable

    @property
    def path(self) -> str:
        return f"framework/{self.module.__name__}.py"

    @property
    def Args(self) -> type:  # noqa: N802 (the script's Args class)
        return self.module.Args

    def field_types(self) -> dict[str, Any]:
        return typing.get_type_hints(self.module.Args)


def load_script(algorithm: str) -> Script:
    if algorithm not in SCRIPTS:
        raise SweepError(f"--algorithm {algorithm} is not one of {', '.join(SCRIPTS)}")
    module_name, validate = SCRIPTS[algorithm]
    module = importlib.import_module(module_name)
    return Script(algorithm, module, getattr(module, validate))


def algorithm_of(requested: str | None, config: dict, source: str) -> str:
    """--algorithm, else the config's `program` (W&B's key for the training script), else sac-rlhf."""
    program = config.get("program")
    from_program = None
    if program is not None:
        stem = Path(str(program)).stem
        from_program = next((algo for algo, (module, _) in SCRIPTS.items() if module == stem), None)
        if from_program is None:
            raise SweepError(f"{source}: program {program} is not one of {', '.join(f'framework/{m}.py' for m, _ in SCRIPTS.values())}")
    if requested is not None and from_program is not None and requested != from_program:
        raise SweepError(f"--algorithm {requested} does not match the config's program {program} (--algorithm {from_program})")
    return requested or from_program or "sac-rlhf"


# ----------------------------------------------------------------------------------------
# The sweep configuration: W&B's format, checked against the script's Args
# ----------------------------------------------------------------------------------------
@dataclass
class Param:
    """One swept parameter, in the units and type of its Args field."""

    name: str
    distribution: str
    values: list | None = None  # categorical
    low: float | None = None  # ranges, as in the config (log_uniform: exponents)
    high: float | None = None
    q: float | None = None
    integer: bool = False
    probabilities: list | None = None  # W&B's weights of categorical values


@dataclass
class Sweep:
    name: str
    method: Literal["grid", "random", "bayes"]
    metric: str
    goal: Literal["maximize", "minimize"]
    fixed: dict[str, Any]  # `value` parameters
    params: dict[str, Param]  # swept parameters
    config: dict  # the W&B sweep config, parameter names in snake_case


def load_config(path: str) -> dict:
    try:
        config = yaml.safe_load(Path(path).read_text())
    except FileNotFoundError:
        raise SweepError(f"--config-filename {path} does not exist (see sweep_config/*.yaml)") from None
    except yaml.YAMLError as error:
        raise SweepError(f"{path} is not valid YAML: {' '.join(str(error).split())}") from None
    if not isinstance(config, dict):
        raise SweepError(f"{path} must be a mapping with method, metric and parameters (W&B's sweep format)")
    return config


def type_name(hint: Any) -> str:
    if typing.get_origin(hint) is Literal:
        return "one of " + ", ".join(map(str, typing.get_args(hint)))
    return " or ".join(t.__name__ if t is not type(None) else "None" for t in typing.get_args(hint)) or getattr(hint, "__name__", str(hint))


def coerce(name: str, value: Any, hint: Any) -> Any:
    """`value` (from YAML or W&B) as the type of the Args field `name`. YAML reads 3e-4 as a string: floats accept it."""
    origin, members = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in members:
            return None
        for member in members:
            if member is not type(None):
                try:
                    return coerce(name, value, member)
                except SweepError:
                    pass
    elif origin is Literal:
        if value in members:
            return value
    elif hint is bool:
        if isinstance(value, bool):
            return value
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, (float, str)) and not isinstance(value, bool):
            try:
                number = float(value)
            except ValueError:
                number = math.nan
            if number.is_integer():
                return int(number)
    elif hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
    elif hint is str:
        if isinstance(value, str):
            return value
    raise SweepError(f"parameter {name}: {value!r} is not {type_name(hint) if origin is Literal else 'a valid ' + type_name(hint)}")


def check_names(names: list[str], script: Script, source: str) -> None:
    """Unknown parameter names are an error naming them, with the closest Args fields as hints."""
    allowed = list(script.field_types())
    unknown = [name for name in names if name not in allowed]
    if unknown:
        described = []
        for name in unknown:
            close = difflib.get_close_matches(name, allowed, n=2, cutoff=0.6)
            described.append(f"{name} (did you mean {' or '.join(close)}?)" if close else name)
        raise SweepError(
            f"{source}: unknown parameter(s) {', '.join(described)}: parameters are the Args fields of {script.path}, "
            f"snake_case or kebab-case (python {script.path} --help lists them)"
        )


def parse_param(name: str, spec: Any, hint: Any, source: str) -> Param | Any:
    """A `parameters` entry: its fixed value, or a Param. Like W&B, min/max without a distribution mean
    int_uniform when both are integers, uniform otherwise."""
    where = f"{source}: parameter {name}"
    if not isinstance(spec, dict):
        raise SweepError(f"{where} must be a mapping with value, values or min/max (e.g. {name}: {{values: [1, 2]}})")
    unknown = [key for key in spec if key not in PARAMETER_KEYS]
    if unknown:
        raise SweepError(f"{where}: unknown key(s) {', '.join(map(str, unknown))} (allowed: {', '.join(PARAMETER_KEYS)})")
    distribution = spec.get("distribution")
    if distribution is not None and distribution not in DISTRIBUTIONS:
        raise SweepError(f"{where}: distribution {distribution} is not one of {', '.join(DISTRIBUTIONS)}")
    if "value" in spec or distribution == "constant":
        return coerce(name, spec.get("value"), hint)
    if "values" in spec or distribution == "categorical":
        values = spec.get("values")
        if not isinstance(values, list) or not values:
            raise SweepError(f"{where}: values must be a non-empty list")
        return Param(name, "categorical", values=[coerce(name, value, hint) for value in values], probabilities=spec.get("probabilities"))
    if distribution in UNBOUNDED_DISTRIBUTIONS:  # W&B-only (mu, sigma, a, b): nothing to check here
        return Param(name, distribution)
    if "min" not in spec or "max" not in spec:
        raise SweepError(f"{where} needs value, values, or min and max")
    kind = _number_kind(hint)
    if kind is None:
        raise SweepError(f"{where}: min/max needs an int or float parameter, {name} is {type_name(hint)} (use values)")
    if distribution is None:
        both_int = all(isinstance(spec[k], int) and not isinstance(spec[k], bool) for k in ("min", "max"))
        distribution = "int_uniform" if both_int else "uniform"
    if distribution == "int_uniform" and kind is not int:
        raise SweepError(f"{where}: int_uniform needs an int parameter, {name} is {type_name(hint)} (use uniform)")
    if distribution in ("uniform", "log_uniform", "inv_log_uniform", "inv_log_uniform_values") and kind is int:
        raise SweepError(f"{where}: {distribution} draws floats, {name} is int (use int_uniform, q_uniform or log_uniform_values)")
    # log_uniform's min/max are exponents (floats); everything else is in the field's own type.
    number = float if distribution in ("log_uniform", "q_log_uniform", "inv_log_uniform") else kind
    low, high = coerce(f"{name} (min)", spec["min"], number), coerce(f"{name} (max)", spec["max"], number)
    if not low < high:
        raise SweepError(f"{where}: min ({low}) must be smaller than max ({high})")
    if distribution.endswith("_values") and low <= 0:
        raise SweepError(f"{where}: {distribution} needs min > 0, got {low}")
    q = spec.get("q")
    if q is not None:
        q = coerce(f"{name} (q)", q, kind)
        if q <= 0:
            raise SweepError(f"{where}: q must be > 0, got {q}")
    return Param(name, distribution, low=low, high=high, q=q, integer=kind is int)


def _number_kind(hint: Any) -> type | None:
    """int or float for a (possibly optional) numeric Args field, else None."""
    members = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    return next((kind for kind in (float, int) if kind in members), None)


def parse_sweep(config: dict, script: Script, source: str, name: str) -> Sweep:
    """The sweep of a config in W&B's format, its parameter names and values checked against the script's Args."""
    unknown = [key for key in config if key not in CONFIG_KEYS]
    if unknown:
        raise SweepError(f"{source}: unknown key(s) {', '.join(map(str, unknown))} (allowed: {', '.join(CONFIG_KEYS)})")
    method = config.get("method")
    if method not in ("grid", "random", "bayes"):
        raise SweepError(f"{source}: method {method} is not one of grid, random, bayes")
    metric = config.get("metric", {"name": "eval/mean_return", "goal": "maximize"})
    if not isinstance(metric, dict) or not isinstance(metric.get("name"), str):
        raise SweepError(f"{source}: metric must be a mapping with name and goal (e.g. {{name: eval/mean_return, goal: maximize}})")
    # W&B's default goal is minimize: a trap with returns, so the goal must be written out.
    if metric.get("goal") not in ("maximize", "minimize"):
        raise SweepError(f"{source}: metric goal {metric.get('goal')} is not one of maximize, minimize")
    parameters = config.get("parameters") or {}
    if not isinstance(parameters, dict):
        raise SweepError(f"{source}: parameters must be a mapping of Args field names to value/values/min-max")
    snake = {}
    for raw_name, spec in parameters.items():
        key = str(raw_name).replace("-", "_")
        if key in snake:
            raise SweepError(f"{source}: parameter {key} appears twice (as {key} and as {raw_name})")
        snake[key] = spec
    check_names(list(snake), script, source)
    if "run_name" in snake:
        raise SweepError(f"{source}: run_name cannot be a parameter: the sweep names every trial's run")
    hints = script.field_types()
    fixed, params = {}, {}
    for key, spec in snake.items():
        parsed = parse_param(key, spec, hints[key], source)
        (params if isinstance(parsed, Param) else fixed)[key] = parsed
    wandb_parameters = {key: wandb_parameter(snake[key], fixed.get(key), params.get(key)) for key in snake}
    wandb_config = {**config, "name": config.get("name", name), "parameters": wandb_parameters}
    return Sweep(name, method, metric["name"], metric["goal"], fixed, params, wandb_config)


def wandb_parameter(spec: dict, fixed: Any, param: Param | None) -> dict:
    """A parameter for W&B with the checked, typed values (YAML's "3e-4" strings become numbers)."""
    if param is None:
        return {"value": fixed}
    if param.values is not None:
        return {**spec, "values": list(param.values)}
    if param.low is None:  # W&B-only distributions (mu, sigma...): as written
        return dict(spec)
    bounds = {"distribution": param.distribution, "min": param.low, "max": param.high}
    return {**spec, **bounds, **({"q": param.q} if param.q is not None else {})}


def candidate_values(param: Param) -> list:
    """The values to validate a parameter with: every categorical value, both ends of a range."""
    if param.values is not None:
        return list(param.values)
    if param.distribution in UNBOUNDED_DISTRIBUTIONS or param.distribution.startswith("inv_"):
        return []  # W&B only: nothing to check up front
    ends = [param.low, param.high]
    if param.distribution in ("log_uniform", "q_log_uniform"):  # min/max are exponents
        ends = [math.exp(end) for end in ends]
    return [round(end) for end in ends] if param.integer else ends


def script_flag_names(flags: Sequence[str], script: Script) -> set[str]:
    """Args fields that flags set (--name value, --name=value, --no-name)."""
    names = set()
    known = script.field_types()
    for token in flags:
        if token.startswith("--"):
            name = token[2:].split("=", 1)[0].replace("-", "_")
            if name not in known and name.startswith("no_"):
                name = name[3:]
            names.add(name)
    return names


def base_args(script: Script, sweep: Sweep, flags: Sequence[str]):
    """The script's defaults, then the config's fixed values, then the flags after `--` (the script's own parser)."""
    swept = sorted(script_flag_names(flags, script) & set(sweep.params))
    if swept:
        raise SweepError(f"--{swept[0].replace('_', '-')} is swept by the config: it cannot also be set after --")
    if "run_name" in script_flag_names(flags, script):
        raise SweepError("--run-name cannot be set after --: the sweep names every trial's run")
    if "preset" in sweep.params:
        raise SweepError("preset cannot be swept: sweep the settings it sets (cleanrlhf_utils/presets.py), or fix it")
    # The preset (after --, else the config's fixed one) over the defaults, the config's fixed values over it, the flags
    # over all; in human mode a label budget set nowhere is human-sized (presets.settings_defaults, as every script).
    try:
        start, human_sized = presets.settings_defaults(script.Args, flags, sweep.fixed, script.path, set(sweep.params))
    except (presets.PresetError, ConfigError) as error:
        raise SweepError(str(error)) from None
    base = parse_args(script.Args, args=list(flags), default=start)
    presets.say_human_defaults(base, human_sized, getattr(script.module, "feedback_schedule", None))
    return base


def check_sweep(sweep: Sweep, base, script: Script) -> None:
    """Every value a trial can get passes the script's own validation (with the others at their base values)."""
    try:
        script.validate(base)
    except ConfigError as error:
        raise SweepError(f"fixed settings: {error}") from None
    for param in sweep.params.values():
        for value in candidate_values(param):
            try:
                script.validate(replace(base, **{param.name: value}))
            except ConfigError as error:
                raise SweepError(f"parameter {param.name} = {value!r}: {error}") from None


# ----------------------------------------------------------------------------------------
# Optuna: distributions, sampler, pruner, storage
# ----------------------------------------------------------------------------------------
def optuna_distribution(param: Param):
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    low, high, q = param.low, param.high, param.q
    match param.distribution:
        case "categorical" if param.probabilities is None:
            return CategoricalDistribution(param.values)
        case "int_uniform":
            return IntDistribution(low, high)
        case "uniform":
            return FloatDistribution(low, high)
        case "q_uniform":
            return IntDistribution(low, high, step=q or 1) if param.integer else FloatDistribution(low, high, step=q or 1.0)
        case "log_uniform_values":
            return IntDistribution(low, high, log=True) if param.integer else FloatDistribution(low, high, log=True)
        case "log_uniform":
            return FloatDistribution(math.exp(low), math.exp(high), log=True)
        case "q_log_uniform_values" if param.integer and (q or 1) == 1:
            return IntDistribution(low, high, log=True)
    if param.probabilities is not None:
        raise SweepError(f"parameter {param.name}: weighted values (probabilities) have no Optuna equivalent: use --backend wandb")
    raise SweepError(
        f"parameter {param.name}: distribution {param.distribution}{f' (q={q})' if q else ''} has no Optuna equivalent "
        f"(supported: {', '.join(OPTUNA_DISTRIBUTIONS)}; q_log_uniform_values only for ints with q 1): use --backend wandb"
    )


def optuna_distributions(sweep: Sweep) -> dict:
    return {name: optuna_distribution(param) for name, param in sweep.params.items()}


def grid_search_space(sweep: Sweep) -> dict[str, list]:
    """method grid: every parameter as its list of values (int_uniform and q_uniform ranges enumerated)."""
    space = {}
    for name, param in sweep.params.items():
        if param.values is not None:
            space[name] = list(param.values)
        elif param.distribution == "int_uniform" or (param.distribution == "q_uniform" and param.integer):
            space[name] = list(range(int(param.low), int(param.high) + 1, int(param.q or 1)))
        elif param.distribution == "q_uniform":
            count = int(math.floor((param.high - param.low) / param.q + 1e-9)) + 1
            space[name] = [round(param.low + i * param.q, 12) for i in range(count)]
        else:
            raise SweepError(f"method grid needs values (or int_uniform / q_uniform) for every parameter: {name} is {param.distribution}")
    return space


def make_sampler(sweep: Sweep, seed: int):
    """grid -> GridSampler (the product of the values), random -> RandomSampler, bayes -> TPESampler; all seeded."""
    import optuna

    if sweep.method == "grid":
        return optuna.samplers.GridSampler(grid_search_space(sweep), seed=seed)
    if sweep.method == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    # constant_liar: parallel workers see each other's running trials and spread out.
    return optuna.samplers.TPESampler(seed=seed, constant_liar=True)


def make_pruner(kind: str, goal: str, threshold: float | None, warmup_steps: int, min_resource: int):
    import optuna

    if kind == "none":
        return optuna.pruners.NopPruner()
    if kind == "median":
        return optuna.pruners.MedianPruner(n_warmup_steps=warmup_steps)
    if kind == "hyperband":
        return optuna.pruners.HyperbandPruner(min_resource=max(1, min_resource, warmup_steps))
    if threshold is None:
        raise SweepError("--pruner threshold needs --pruner-threshold VALUE")
    bound = {"lower": threshold} if goal == "maximize" else {"upper": threshold}
    return optuna.pruners.ThresholdPruner(**bound, n_warmup_steps=warmup_steps)


def make_storage(url: str):
    """sqlite:///x.db (or any SQLAlchemy URL) -> RDBStorage; journal:///abs/x.log, journal://rel/x.log or a path
    ending in .log/.journal -> a journal file (append-only, file-locked: fine on shared filesystems)."""
    import optuna
    from optuna.storages.journal import JournalFileBackend

    if url.startswith("journal://") or (("://" not in url) and url.endswith((".log", ".journal"))):
        path = Path(url.removeprefix("journal://"))
        if not str(path) or str(path) == ".":
            raise SweepError(f"--storage {url}: the journal needs a file path (journal:///abs/path.log)")
        path.parent.mkdir(parents=True, exist_ok=True)
        return optuna.storages.JournalStorage(JournalFileBackend(str(path)))
    if "://" not in url:
        raise SweepError(f"--storage {url} is neither sqlite:///path.db (or another SQLAlchemy URL) nor journal:///path.log")
    engine_kwargs = {}
    if url.startswith("sqlite:///"):
        Path(url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
        # Several processes write the same file: wait for its lock instead of failing with "database is locked".
        engine_kwargs = {"connect_args": {"timeout": 120}}
    return optuna.storages.RDBStorage(url, engine_kwargs=engine_kwargs)


def array_task_id() -> int:
    return int(os.environ.get("SLURM_ARRAY_TASK_ID", "0"))


def warmup_steps(requested: int | None, base) -> int:
    """Don't prune on evaluations during unsupervised exploration: the policy has not seen a label yet."""
    if requested is not None:
        return requested
    return getattr(base, "total_explore_steps", 0) if getattr(base, "unsupervised_exploration", False) else 0


# ----------------------------------------------------------------------------------------
# A trial (shared by both backends)
# ----------------------------------------------------------------------------------------
def trial_run_name(sweep_name: str, trial: int | str, args) -> str:
    name = f"{sweep_name}__trial{trial}__{args.env_id}__{args.seed}__{int(time.time())}"
    return re.sub(r"[^\w.+-]", "_", name)  # one directory under runs/: no `/` (dm_control/...)


def tensorboard_scalars(run_dir: Path) -> dict[str, float]:
    """The last value of every TensorBoard scalar of a run."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    accumulator.Reload()
    return {tag: accumulator.Scalars(tag)[-1].value for tag in accumulator.Tags()["scalars"]}


def metric_value(metric: str, summary: dict, run_dir: Path) -> float:
    """The trial's result: the final evaluation return, any key of the run's summary, or a TensorBoard tag's last value."""
    if metric in EVAL_METRICS:
        return float(summary["final_eval_return"])
    if metric in SUCCESS_METRICS:
        if "final_success_rate" not in summary:
            raise SweepError(f"metric {metric}: {summary['env_id']} reports no success (Meta-World's metaworld/<task> envs do)")
        return float(summary["final_success_rate"])
    if metric in summary:
        return float(summary[metric])
    scalars = tensorboard_scalars(run_dir)
    if metric in scalars:
        return float(scalars[metric])
    raise SweepError(
        f"metric {metric} is neither a key of the run's summary ({', '.join(summary)}) nor a TensorBoard scalar of {run_dir} "
        f"({', '.join(sorted(scalars)) or 'none'})"
    )


def run_trial(script: Script, args, metric: str, on_evaluation: Callable[[int, float], None]) -> tuple[dict, float]:
    """One training run in this process (`on_evaluation(step, return)` sees every evaluation); returns its summary and metric."""
    summary = script.module.main(args, on_evaluation)
    return summary, metric_value(metric, summary, Path("runs") / args.run_name)


def optuna_objective(script: Script, sweep: Sweep, base, distributions: dict):
    import optuna

    def objective(trial: optuna.Trial) -> float:
        sampled = {name: suggest(trial, name, distribution) for name, distribution in distributions.items()}
        args = replace(base, **sampled)
        args = replace(args, run_name=trial_run_name(trial.study.study_name, trial.number, args))
        trial.set_user_attr("run_name", args.run_name)
        trial.set_user_attr("args", public_settings(args))

        def report(step: int, value: float) -> None:
            value = evaluation_value(sweep.metric, value)
            if value is None:  # the pruner compares intermediate values of the metric itself
                return
            trial.report(value, step)
            if trial.should_prune():
                raise optuna.TrialPruned(f"evaluation {sweep.metric} {value:.2f} at step {step}")

        summary, value = run_trial(script, args, sweep.metric, report)
        trial.set_user_attr("summary", summary)
        return value

    return objective


def suggest(trial, name: str, distribution):
    from optuna.distributions import CategoricalDistribution, IntDistribution

    if isinstance(distribution, CategoricalDistribution):
        return trial.suggest_categorical(name, distribution.choices)
    if isinstance(distribution, IntDistribution):
        return trial.suggest_int(name, distribution.low, distribution.high, step=distribution.step, log=distribution.log)
    return trial.suggest_float(name, distribution.low, distribution.high, step=distribution.step, log=distribution.log)


def run_optuna(args: Args, script: Script, sweep: Sweep, base):
    import optuna

    distributions = optuna_distributions(sweep)
    if sweep.method == "grid":  # GridSampler replays the grid's values: suggest them as categoricals
        distributions = {name: optuna.distributions.CategoricalDistribution(values) for name, values in grid_search_space(sweep).items()}
    warmup = warmup_steps(args.pruner_warmup_steps, base)
    study = optuna.create_study(
        study_name=sweep.name,
        storage=make_storage(args.storage),
        sampler=make_sampler(sweep, args.seed + array_task_id()),
        pruner=make_pruner(args.pruner, sweep.goal, args.pruner_threshold, warmup, base.evaluation_frequency),
        direction=sweep.goal,
        load_if_exists=True,
    )
    for key, value in {"algorithm": script.algorithm, "metric": sweep.metric, "config_filename": args.config_filename}.items():
        if study.user_attrs.get(key) != value:
            study.set_user_attr(key, value)
    print(f"optuna study {sweep.name} in {args.storage}: {sweep.method} search over {', '.join(sweep.params) or 'nothing'}")
    if args.create_only:
        return study
    # An invalid combination of sampled values fails that trial only (the script's validation message is kept).
    study.optimize(
        optuna_objective(script, sweep, base, distributions), n_trials=args.sweep_count, catch=(ConfigError,), gc_after_trial=True
    )
    completed = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    if completed:
        best = study.best_trial
        print(f"best trial so far: {best.number}, {sweep.metric} = {best.value:.4g} ({best.user_attrs.get('run_name')}): {best.params}")
    return study


# ----------------------------------------------------------------------------------------
# W&B sweeps
# ----------------------------------------------------------------------------------------
def sampled_values(config: dict, sweep: Sweep, script: Script) -> dict:
    """The swept parameters' values from a W&B run config, typed like the Args fields."""
    hints = script.field_types()
    values = {str(key).replace("-", "_"): value for key, value in config.items()}
    missing = [name for name in sweep.params if name not in values]
    if missing:
        raise SweepError(f"the W&B run config lacks the swept parameter(s) {', '.join(missing)}: is --sweep-id a sweep of this config?")
    return {name: coerce(name, values[name], hints[name]) for name in sweep.params}


def run_wandb_trial(config: dict | None, script: Script, sweep: Sweep, base, project: str | None = None, entity: str | None = None) -> dict:
    """What wandb.agent calls (config None: the agent's run config holds the sampled values). The script's own W&B
    logging stays off: its wandb.init would replace the agent's run. This run gets every evaluation and the metric,
    logged here. (Not the TensorBoard stream: W&B can drop its last events when a run finishes and then keeps an
    earlier evaluation as eval/mean_return, the sweep's metric. The full curves are in runs/<run_name>/.)"""
    import wandb

    run = wandb.init(config=config, project=project, entity=entity)
    try:
        args = replace(base, **sampled_values(dict(run.config), sweep, script), track=False)
        args = replace(args, run_name=trial_run_name(sweep.name, run.id, args))
        run.name = args.run_name
        # --export-best with the wandb backend rebuilds the script from these two.
        run.config.update({"cleanrlhf_algorithm": script.algorithm, "cleanrlhf_args": public_settings(args)}, allow_val_change=True)

        def log_evaluation(step: int, value: float) -> None:
            rate = getattr(value, "success_rate", None)
            run.log({"eval/mean_return": float(value), "global_step": step} | ({} if rate is None else {"eval/success_rate": rate}))

        summary, value = run_trial(script, args, sweep.metric, log_evaluation)
        run.summary.update({**{f"trial/{key}": item for key, item in summary.items()}, sweep.metric: value})
        return summary
    finally:
        run.finish()


def run_wandb(args: Args, script: Script, sweep: Sweep, base) -> str:
    import wandb

    project = args.project_name or WANDB_PROJECT
    try:
        sweep_id = args.sweep_id or wandb.sweep(sweep=sweep.config, project=project, entity=args.entity)
    except wandb.errors.UsageError as error:  # no account here: `wandb login` first
        raise SweepError(f"the W&B backend needs a W&B account ({error}); the optuna backend needs none") from None
    print(f"W&B sweep id: {sweep_id}")
    if args.create_only:
        return sweep_id

    def trial() -> None:
        run_wandb_trial(None, script, sweep, base)

    wandb.agent(sweep_id, function=trial, count=args.sweep_count, project=project, entity=args.entity)
    return sweep_id


# ----------------------------------------------------------------------------------------
# Exporting the best trial as a run script (scripts/<ENV>.sh)
# ----------------------------------------------------------------------------------------
def flag_tokens(name: str, value: Any) -> str:
    """How the script's tyro parser spells a value: --surf / --no-surf, --target-kl None, --reward-net-lr 0.0003."""
    flag = "--" + name.replace("_", "-")
    if isinstance(value, bool):
        return flag if value else "--no-" + name.replace("_", "-")
    if value is None:
        return f"{flag} None"
    return f"{flag} {shlex.quote(repr(value) if isinstance(value, float) else str(value))}"


def run_script(script: Script, values: dict, header: list[str]) -> str:
    """A bash run script in the format of scripts/Hopper-v5.sh: the settings that differ from the script's defaults, or
    from its preset's values where the trial had one (env id always first, then --preset), one flag a line, then "$@"
    for more flags. The header must not contain `python framework/...`: tests/test_repo.py takes the first line that
    does for the command."""
    defaults = asdict(script.Args())
    if values.get("preset") in presets.usable(script.Args):  # --preset NAME, then what differs from the preset's values
        defaults.update(presets.preset_values(script.Args, values["preset"], script.path), preset=None)
    names = ["env_id"] + [f.name for f in fields(script.Args) if f.name != "env_id"]
    lines = [
        flag_tokens(name, values.get(name, defaults[name]))
        for name in names
        if name == "env_id" or (name != "run_name" and values.get(name, defaults[name]) != defaults[name])
    ]  # a field added to Args after the sweep keeps its default
    body = "".join(f"  {line} \\\n" for line in lines)
    comments = "".join(f"# {line}\n" for line in header)
    return f'#!/usr/bin/env bash\n{comments}set -euo pipefail\npython {script.path} \\\n{body}  "$@"\n'


def export_best(args: Args) -> str:
    if backend(args) == "wandb":
        return export_best_wandb(args)
    import optuna

    storage = make_storage(args.storage)
    names = optuna.get_all_study_names(storage)
    study_name = args.study_name or (names[0] if len(names) == 1 else None)
    if study_name not in names:
        raise SweepError(f"--study-name {args.study_name} is not a study in {args.storage} (studies: {', '.join(names) or 'none'})")
    study = optuna.load_study(study_name=study_name, storage=storage)
    completed = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    if not completed:
        raise SweepError(f"study {study_name} in {args.storage} has no completed trial yet")
    if "algorithm" not in study.user_attrs:
        raise SweepError(f"study {study_name} in {args.storage} was not created by framework/sweep.py (no algorithm attribute)")
    best = study.best_trial
    script = load_script(study.user_attrs["algorithm"])
    values = best.user_attrs["args"]
    metric = study.user_attrs.get("metric", "value")
    header = [
        f"{script.algorithm} on {values['env_id']}: the best trial of the sweep {study.user_attrs.get('config_filename')}",
        f"(Optuna study {study_name} in {args.storage}): trial {best.number}, {metric} = {best.value:.6g},",
        f"best of {len(completed)} completed trials (run {best.user_attrs.get('run_name')}). Swept: "
        + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in best.params.items()) + ".",
        "Flags: the settings that differ from the script's defaults. Written by framework/sweep.py --export-best.",
        f"Run from the repository root: bash {args.out or 'this_script.sh'} [more flags]",
    ]  # fmt: skip
    return write_script(run_script(script, values, header), args.out)


def export_best_wandb(args: Args) -> str:
    """The best run of a W&B sweep (needs network and an account): the trial stored its Args in its config."""
    import wandb

    if args.sweep_id is None:
        raise SweepError("--export-best --backend wandb needs --sweep-id (and --project-name, --entity)")
    path = "/".join(part for part in (args.entity, args.project_name or WANDB_PROJECT, args.sweep_id) if part)
    sweep = wandb.Api().sweep(path)
    best = sweep.best_run()
    if best is None or "cleanrlhf_args" not in best.config:
        raise SweepError(f"W&B sweep {path} has no finished run of framework/sweep.py yet")
    script = load_script(best.config["cleanrlhf_algorithm"])
    metric = sweep.config.get("metric", {}).get("name", "")
    header = [
        f"{script.algorithm} on {best.config['cleanrlhf_args']['env_id']}: the best run of the W&B sweep {path}:",
        f"run {best.name}, {metric} = {best.summary.get(metric)}. Written by framework/sweep.py --export-best.",
        f"Run from the repository root: bash {args.out or 'this_script.sh'} [more flags]",
    ]
    return write_script(run_script(script, best.config["cleanrlhf_args"], header), args.out)


def write_script(text: str, out: str | None) -> str:
    if out is None:
        print(text, end="")
    else:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text)
        Path(out).chmod(0o755)
        print(f"wrote {out}")
    return text


# ----------------------------------------------------------------------------------------
# main
# ----------------------------------------------------------------------------------------
def wandb_sweep_config(args: Args) -> dict:
    """The configuration of the W&B sweep --sweep-id joins without --config-filename (as the seed project's command
    joins one), read from W&B: it needs network and an account."""
    import wandb

    path = "/".join(part for part in (args.entity, args.project_name or WANDB_PROJECT, args.sweep_id) if part)
    try:
        return dict(wandb.Api().sweep(path).config)
    except (wandb.errors.UsageError, wandb.errors.CommError, ValueError) as error:
        reason = " ".join(str(error).split())
        raise SweepError(f"--sweep-id {args.sweep_id}: its configuration is not readable from W&B ({reason})") from None


def prepare(args: Args, script_flags: Sequence[str] = ()) -> tuple[Script, Sweep, Any]:
    """The script, the sweep and the base Args of every trial, all checked: what every backend starts from."""
    joining = args.config_filename is None and args.sweep_id is not None and backend(args) == "wandb"
    if args.config_filename is None and not joining:
        raise SweepError("--config-filename is needed: a sweep in W&B's format, e.g. sweep_config/hopper.yaml")
    if args.sweep_count < 1 and not args.create_only:
        raise SweepError(f"--sweep-count must be >= 1, got {args.sweep_count}")
    if args.pruner == "threshold" and args.pruner_threshold is None:
        raise SweepError("--pruner threshold needs --pruner-threshold VALUE")
    source = f"W&B sweep {args.sweep_id}" if joining else args.config_filename
    config = wandb_sweep_config(args) if joining else load_config(args.config_filename)
    algorithm = algorithm_of(args.algorithm, config, source)
    script = load_script(algorithm)
    name = args.study_name or str(config.get("name") or f"{Path(source).stem}__{algorithm}")
    sweep = parse_sweep(config, script, source, name)
    base = base_args(script, sweep, script_flags)
    check_sweep(sweep, base, script)
    if backend(args) == "optuna":
        optuna_distributions(sweep)  # an untranslatable distribution fails here, before anything is created
        if sweep.method == "grid":
            grid_search_space(sweep)
    return script, sweep, base


def main(args: Args, script_flags: Sequence[str] = ()):
    """Runs --sweep-count trials of the sweep (or creates it, or exports its best trial); returns the Optuna study,
    the W&B sweep id, or the exported script."""
    if args.export_best:
        return export_best(args)
    script, sweep, base = prepare(args, script_flags)
    if backend(args) == "wandb":
        return run_wandb(args, script, sweep, base)
    return run_optuna(args, script, sweep, base)


def split_argv(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """sweep.py's own flags, and the training script's flags after `--`."""
    argv = list(argv)
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1 :]
    return argv, []


def cli() -> None:
    own, script_flags = split_argv(sys.argv[1:])
    args = parse_args(Args, args=own)
    try:
        main(args, script_flags)
    except SweepError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    cli()
