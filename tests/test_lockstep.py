"""Deliberate copies (CleanRL's rule: one file = one algorithm you can read and hack): the preference-learning block
in sac_rlhf.py and pref_ppo.py, and each baseline's algorithm in its preference-learning script (SAC in sac.py and
sac_rlhf.py, PPO in ppo.py and pref_ppo.py). These tests hold the copies identical: a change to one copy fails here
until the other follows, and a definition two such scripts share must be listed as a copy or as algorithm-specific."""

import difflib
import importlib.util
import inspect
from pathlib import Path

import pytest

import ppo
import pref_ppo
import sac
import sac_rlhf

FRAMEWORK_DIR = Path(__file__).resolve().parents[1] / "framework"

# Definitions that must read the same, character for character, in both scripts.
LOCKSTEP = [
    "PreferenceArgs",
    "validate_preference_args",
    "BradleyTerry",
    "PlackettLuce",
    "OrderedLogit",
    "RewardEnsemble",
    "segment_returns",
    "preference_probabilities",
    "disagreement_scores",
    "entropy_scores",
    "predict_rewards",
    "predict_reward_arrays",
    "relabel_replay_buffer",
    "PreferenceBuffer",
    "rating_accuracy",
    "preference_accuracy",
    "select_queries",
    "session_pairs",
    "feedback_schedule",
    "labelled_loss",
    "reward_epoch",
    "train_reward_model",
    "crop_segments",
    "pseudo_labels",
    "surf_loss",
    "reward_model_metrics",
    "knn_state_entropy",
    "rune_beta",
]
# Module constants of the copied block, compared by value.
LOCKSTEP_CONSTANTS = ["PREFERENCE_RANGES", "RELABEL_CHUNK"]
# The preference model's instance, compared by its class's name (each script has its own class object).
LOCKSTEP_INSTANCES = ["PREFERENCE_MODEL"]
# Defined in both scripts under the same name, but each algorithm's own.
ALGORITHM_SPECIFIC = {
    *("Args", "LoopState", "main", "make_env", "make_vector_env", "validate_args", "exploration_rewards"),
    *("reset_after_session", "sessions_due"),
}

# SAC as the baseline sac.py and PEBBLE (sac_rlhf.py) both run it: a comparison measures preferences, nothing else.
SAC_COPY = [
    *("SACArgs", "validate_sac_args", "check_sac_actions", "make_env", "make_vector_env", "TwinQNetwork", "Actor"),
    "SACAgent",
]
# What each baseline and its preference-learning script define under one name but differently (the baseline's own).
BASELINE_SPECIFIC = {"sac": {"Args", "LoopState", "main"}, "ppo": {"Args", "main"}}
# PPO as the baseline ppo.py and PrefPPO (pref_ppo.py) both run it.
PPO_COPY = [
    *("PPOArgs", "validate_ppo_args", "check_ppo_actions", "make_env", "make_vector_env", "layer_init", "ppo_mlp"),
    *("Agent", "env_actions", "reward_action_dim", "encode_actions", "RolloutBuffer", "collect_rollout"),
    *("rollout_values", "compute_gae", "ppo_update", "train_on_rollout", "set_learning_rate"),
]
PAIRS = {"sac": (sac_rlhf, sac, SAC_COPY), "ppo": (pref_ppo, ppo, PPO_COPY)}


def own_definitions(module) -> dict:
    return {
        name: value
        for name, value in vars(module).items()
        if (inspect.isfunction(value) or inspect.isclass(value)) and value.__module__ == module.__name__
    }


def copies_differ(name: str, first, second) -> str:
    """The unified diff of the two copies of `name` ('' when identical)."""
    a, b = inspect.getsource(getattr(first, name)), inspect.getsource(getattr(second, name))
    return "".join(difflib.unified_diff(a.splitlines(True), b.splitlines(True), f"{first.__name__}.{name}", f"{second.__name__}.{name}"))


@pytest.mark.parametrize("name", LOCKSTEP)
def test_the_copies_in_both_scripts_are_identical(name):
    diff = copies_differ(name, sac_rlhf, pref_ppo)
    assert not diff, f"{name} differs between the scripts; change both copies:\n{diff}"


@pytest.mark.parametrize("name", LOCKSTEP_CONSTANTS)
def test_the_copied_constants_are_equal(name):
    assert getattr(sac_rlhf, name) == getattr(pref_ppo, name), f"{name} differs between the scripts; change both copies"


@pytest.mark.parametrize("name", LOCKSTEP_INSTANCES)
def test_the_copied_instances_are_of_the_copied_class(name):
    first, second = getattr(sac_rlhf, name), getattr(pref_ppo, name)
    assert type(first).__name__ == type(second).__name__ and type(first).__name__ in LOCKSTEP


@pytest.mark.parametrize(("baseline", "name"), [(b, name) for b, (_, _, names) in PAIRS.items() for name in names])
def test_each_baseline_runs_the_same_algorithm_as_its_preference_script(baseline, name):
    script, copy, _ = PAIRS[baseline]
    diff = copies_differ(name, script, copy)
    assert not diff, f"{name} differs between {script.__name__}.py and {copy.__name__}.py; change both copies:\n{diff}"


@pytest.mark.parametrize("baseline", PAIRS)
def test_every_definition_a_baseline_shares_is_a_copy_or_its_own(baseline):
    script, copy, names = PAIRS[baseline]
    shared = set(own_definitions(script)) & set(own_definitions(copy))
    assert shared == set(names) | BASELINE_SPECIFIC[baseline], f"list a new name {script.__name__}.py and {copy.__name__}.py share"


def test_every_definition_both_scripts_share_is_a_copy_or_algorithm_specific():
    shared = set(own_definitions(sac_rlhf)) & set(own_definitions(pref_ppo))
    assert shared == set(LOCKSTEP) | ALGORITHM_SPECIFIC, "list a new shared name in LOCKSTEP (or ALGORITHM_SPECIFIC if it differs)"


def test_editing_one_copy_alone_is_caught(tmp_path):
    """The check fails on a real edit: pref_ppo.py with one line of train_reward_model changed."""
    source = (FRAMEWORK_DIR / "pref_ppo.py").read_text()
    line = "    model.train()\n    return stats\n"  # the end of train_reward_model
    assert source.count(line) == 1
    edited = tmp_path / "pref_ppo_edited.py"
    edited.write_text(source.replace(line, "    model.eval()\n    return stats\n"))
    spec = importlib.util.spec_from_file_location("pref_ppo_edited", edited)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    diff = copies_differ("train_reward_model", sac_rlhf, module)
    assert "+    model.eval()" in diff
    assert not copies_differ("select_queries", sac_rlhf, module)
