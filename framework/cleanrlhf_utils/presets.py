"""Where a run's defaults come from, in one place: the dataclass defaults, the named presets (`--preset dmc-qpa`)
that several run scripts share, what a --teacher-objective needs, and the human-sized label budget of human mode.
`settings_defaults` stacks them into the defaults a command line is parsed onto, for every script, sweep.py and the
tests alike; nothing else rewrites a setting, and validation only checks.

Precedence (one rule):
    the dataclass default < the preset < the objective's needs and defaults < a sweep config's fixed values
    < a flag given on the command line (always wins)
and in human mode the human-sized label budget (HUMAN_LABEL_DEFAULTS) fills only the budget flags that neither the
command line nor the preset nor the sweep config sets. A command line that contradicts what the objective needs is
refused by the script's validation (objectives.check_objective_settings).

PRESETS below (name -> one-line description and {Args field: value}) is the presets' one owner; the flag's --help,
the refusals and the scripts all read this table. One table for both algorithm scripts: a preset applies to a script
when every field it sets is one of that script's Args fields, checked when it is asked for. A preset naming a field
the script lacks is refused with one line (exit 2), e.g. `--preset dmc` with pref_ppo.py (it has no
--actor-hidden-dim). The chosen preset is itself a setting (the `preset` field), so runs/<run>/args.json records its
name beside every resolved value. Light on imports (no torch): the CLI reads it before anything else."""

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import tyro

from .arguments import UsageError, given_fields, given_value
from .objectives import objective_settings


@dataclass(frozen=True)
class Preset:
    description: str
    """one line: where the settings come from"""
    values: dict[str, Any]
    """Args field -> value, as the field's type holds it"""


# PEBBLE's public DMC configuration (the SAC of its DMC runs, 1000 random + 9000 exploration steps, constant schedule,
# 50-step segments, at most 50 reward-model epochs), SURF on, reward-model inputs standardised (bench/reward_learning.py).
_DMC = {
    "actor_hidden_dim": 1024,
    "critic_hidden_dim": 1024,
    "batch_size": 1024,
    "alpha": 0.1,
    "policy_frequency": 1,
    "target_network_frequency": 2,
    "total_explore_steps": 10_000,
    "teacher_feedback_schedule": "linear",
    "preference_sampling": "disagree",
    "segment_length": 50,
    "reward_net_epochs": 50,
    "surf": True,
    "reward_net_normalize_inputs": True,
}

PRESETS: dict[str, Preset] = {
    "gym-mujoco": Preset(
        "PEBBLE on Gymnasium MuJoCo as benchmarked on Hopper-v5 (with CleanRL's SAC, the defaults): 1M steps, 10k "
        "exploration steps, exponential schedule, disagreement sampling, 50-step segments, SURF",
        {
            "total_timesteps": 1_000_000,
            "total_explore_steps": 10_000,
            "teacher_feedback_schedule": "exponential",
            "preference_sampling": "disagree",
            "segment_length": 50,
            "surf": True,
        },
    ),
    "dmc": Preset(
        "PEBBLE on dm_control with PEBBLE's public DMC SAC (2 x 1024 units, batch 1024, temperature 0.1, actor every "
        "step, target every 2), linear schedule, disagreement sampling, SURF, standardised reward-model inputs",
        _DMC,
    ),
    "dmc-qpa": Preset(
        "QPA (Hu et al. 2024) on dm_control: the dmc preset with uniform queries from the last 10 episodes, half of each "
        "SAC batch from them, 20 crops per label, one reward network, no SURF; runs named qpa",
        {
            **_DMC,
            "exp_name": "qpa",
            "preference_sampling": "uniform",
            "reward_ensemble_size": 1,
            "surf": False,
            "qpa_query_episodes": 10,
            "qpa_hybrid_ratio": 0.5,
            "qpa_augmentations": 20,
        },
    ),
    "metaworld": Preset(
        "PEBBLE on Meta-World as B-Pref runs it: SAC 3 x 256, batch 512, lr 3e-4, temperature 0.1, 1M steps; 50 labels "
        "every 5000 steps (linear), disagreement sampling, 3 reward nets at most 10 epochs, SURF; 10 evaluation episodes",
        {
            "total_timesteps": 1_000_000,
            "actor_hidden_dim": 256,
            "actor_hidden_layers": 3,
            "critic_hidden_dim": 256,
            "critic_hidden_layers": 3,
            "batch_size": 512,
            "policy_lr": 0.0003,
            "q_lr": 0.0003,
            "alpha": 0.1,
            "tau": 0.005,
            "gamma": 0.99,
            "policy_frequency": 1,
            "target_network_frequency": 2,
            "learning_starts": 1000,
            "total_explore_steps": 10_000,
            "teacher_feedback_num_queries_per_session": 50,
            "teacher_feedback_frequency": 5000,
            "teacher_feedback_schedule": "linear",
            "preference_sampling": "disagree",
            "segment_length": 50,
            "reward_ensemble_size": 3,
            "reward_net_lr": 0.0003,
            "reward_net_epochs": 10,
            "evaluation_frequency": 10_000,
            "evaluation_episodes": 10,
            "surf": True,
        },
    ),
}


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def spelled(name: str, value: Any) -> str:
    """A preset value as the command line would give it: --surf / --no-surf, --batch-size 1024."""
    if isinstance(value, bool):
        return flag(name) if value else f"--no-{name.replace('_', '-')}"
    return f"{flag(name)} {value}"


def help_text() -> str:
    """--preset's help: every preset, what it is, and the flags it sets."""
    lines = [
        "a named group of defaults (cleanrlhf_utils/presets.py): flags given on the command line win over it, it wins over "
        "the defaults below; args.json records its name. Presets:"
    ]
    for name, preset in PRESETS.items():
        lines.append(f"{name}: {preset.description}. Sets {' '.join(spelled(k, v) for k, v in preset.values.items())}.")
    return "\n\n".join(lines)


PresetName = Literal[tuple(PRESETS)]  # type: ignore[valid-type]


@dataclass
class PresetArgs:
    """The preset a run starts from (both algorithm scripts)."""

    preset: Annotated[PresetName | None, tyro.conf.arg(help=help_text())] = None
    """gym-mujoco, dmc, dmc-qpa or metaworld: a named group of defaults that several run scripts share (--help and
    cleanrlhf_utils/presets.py show the flags each sets); a flag given on the command line wins over it, it wins over the
    defaults; args.json records its name"""


class PresetError(UsageError):
    """A preset that does not exist, or that sets a field the script lacks (one line)."""


def chosen(argv: Sequence[str]) -> str | None:
    """The preset a command line asks for (`--preset NAME` or `--preset=NAME`, the last one wins; None: none)."""
    name = given_value(list(argv), ["--preset"])
    return None if name in (None, "None") else name


def usable(args_class: type) -> list[str]:
    """The presets whose every field is a field of args_class."""
    names = {field.name for field in dataclasses.fields(args_class)}
    return [name for name, preset in PRESETS.items() if set(preset.values) <= names]


def preset_values(args_class: type, name: str, script: str = "this script") -> dict[str, Any]:
    """The settings preset `name` gives args_class (and preset=name); PresetError: unknown, or a field args_class lacks."""
    if name not in PRESETS:
        raise PresetError(f"--preset {name!r} is not one of: {', '.join(usable(args_class)) or '(none for ' + script + ')'}")
    names = {field.name for field in dataclasses.fields(args_class)}
    missing = [field for field in PRESETS[name].values if field not in names]
    if missing:
        raise PresetError(
            f"--preset {name!r} sets {', '.join(flag(field) for field in missing)}, which {script} does not have "
            f"(presets for it: {', '.join(usable(args_class)) or 'none'})"
        )
    return {**PRESETS[name].values, "preset": name}


HUMAN_LABEL_DEFAULTS = {"teacher_feedback_total_queries": 100, "teacher_feedback_num_queries_per_session": 10}
"""The label budget of --teacher-feedback-mode human where nothing else sets one: 100 labels in 10 sessions, 22 pairs in
the first under the default exponential schedule (a few minutes of a person's time, at a few seconds a pair), instead
of the synthetic teacher's 1000 in sessions from 224 pairs down; the human sweep (sweep_config/human.yaml) uses the
same budget."""

OBJECTIVE_FIELDS = ("teacher_objective", "reward_objective")
"""the settings that name a run's objective (PEBBLE's and PrefPPO's teacher, sac.py's reward)"""


def settings_defaults(args_class: type, argv: Sequence[str], fixed: dict | None = None, script: str = "this script", swept=()):
    """(the instance a command line `argv` is parsed onto, the budget fields human mode sized): args_class's defaults
    with, in turn, the --preset's values, the objective's needs and defaults, `fixed` (a sweep config's fixed values)
    and, in human mode, HUMAN_LABEL_DEFAULTS for the budget fields none of these, argv nor `swept` (the names a sweep
    samples) sets. PresetError, or a ConfigError for an objective that does not load, in one line."""
    argv, fixed = list(argv), dict(fixed or {})
    name = chosen(argv) or fixed.get("preset")
    fixed.pop("preset", None)
    base = args_class()
    preset = preset_values(args_class, name, script) if name is not None else {}
    layers = dict(preset)
    for field in OBJECTIVE_FIELDS:
        if hasattr(base, field):
            objective = given_value(argv, [flag(field)]) or fixed.get(field, layers.get(field, getattr(base, field)))
            layers |= objective_settings(args_class, objective)
    layers |= fixed
    mode = given_value(argv, ["--teacher-feedback-mode"]) or layers.get("teacher_feedback_mode")
    mode = mode or getattr(base, "teacher_feedback_mode", None)
    taken = set(preset) | set(fixed) | set(swept) | given_fields(argv, args_class)
    human = {key: value for key, value in HUMAN_LABEL_DEFAULTS.items() if key not in taken and hasattr(base, key)}
    human = human if mode == "human" else {}
    return dataclasses.replace(base, **layers, **human), set(human)


def say_human_defaults(args, sized: set[str], schedule=None) -> None:
    """The one line that says human mode sized the label budget (`sized`: the fields it set), and what the first
    session asks. `schedule`: the script's feedback_schedule."""
    if not sized:
        return
    flags = " ".join(f"{flag(name)} {getattr(args, name)}" for name in HUMAN_LABEL_DEFAULTS if name in sized)
    total, per_session = args.teacher_feedback_total_queries, args.teacher_feedback_num_queries_per_session
    kind, decay = args.teacher_feedback_schedule, args.teacher_feedback_exponential_decay
    sessions = schedule(total, per_session, kind, decay) if schedule else []
    plan = f"{sum(sessions)} labels over {len(sessions)} sessions, {sessions[0]} in the first" if sessions else f"{total} labels"
    print(f"human mode: {plan} (human-sized defaults {flags}; give these flags to choose otherwise)")
