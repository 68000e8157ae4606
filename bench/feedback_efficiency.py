"""Feedback efficiency: PEBBLE (sac_rlhf.py) with an oracle teacher and a fixed label budget vs SAC
(sac.py) on the true reward, same seeds and steps, run side by side with one torch thread each.
With --algorithm ppo: PrefPPO (pref_ppo.py) vs PPO (ppo.py), same label budget and seeds.

    python bench/feedback_efficiency.py                      # Hopper-v5, 100k steps, 200 labels, seed 1
    python bench/feedback_efficiency.py --steps 20000 --seeds 1 2
    python bench/feedback_efficiency.py --env-id dm_control/walker-walk-v0 --labels 100 \\
        --output bench/results/feedback_efficiency/walker-walk/defaults-seed1.json   # PEBBLE's DMC setting, 100 labels
    python bench/feedback_efficiency.py --env-id metaworld/door-open-v3 --steps 20000 --seeds 1 2   # and success rates
    python bench/feedback_efficiency.py --env-id dm_control/walker-walk-v0 --labels 100 --variant tuned --seeds 1 2 \\
        --baseline-from bench/results/feedback_efficiency/walker-walk/defaults-seed1.json bench/results/feedback_efficiency/walker-walk/defaults-seed2.json
        # --variant: pebble (the defaults), tuned (the README's recommendation), qpa (and qpa-no-hybrid, qpa-no-crops);
        # --baseline-from reuses SAC's runs
    python bench/feedback_efficiency.py --steps 50000 --seeds 1 2 3 --teacher-eps-mistake 0.2 --robust-labels rime \\
        --baseline-from bench/results/feedback_efficiency/noisy-teachers/hopper-50k-oracle.json \\
        --oracle-from bench/results/feedback_efficiency/noisy-teachers/hopper-50k-oracle.json
        # a noisy teacher (B-Pref's flags) and a defence; oracle_ratio: against the oracle teacher's runs of the same
        # setting at the same step (longer runs are read at this invocation's last evaluation)
    python bench/feedback_efficiency.py --env-id ant_without_contact_forces:AntWithoutContactForces-v5 \\
        --no-terminate-when-unhealthy --variant norm-reset-std1-linear --labels 500 --sessions 16 \\
        --teacher-objective ant_without_contact_forces:walking
        # a teacher who labels by an objective (what a person sees of the task); both runs measured on the env's reward
    python bench/feedback_efficiency.py --algorithm ppo --env-id CartPole-v1 --steps 100000 --explore-steps 0 \\
        --feedback-frequency 5000 --evaluation-frequency 5000 --seeds 1 2 3 --target-return 400

Reports per seed and as medians: final evaluation return of each, their ratio, the same for the mean of
the last three evaluations (`last_ratio`; every evaluation is kept in the JSON), the reward model's
held-out accuracy, and the Pearson correlation of learned and true reward on recent transitions; on
Meta-World also the final success rate of each;
with --target-return, the first evaluation step at which each run reached that mean return; with --oracle-from, the
return against the oracle teacher's (oracle_ratio, oracle_last_ratio). --reuse-finished reads runs in --workdir that
finished with exactly the flags this invocation would start them with, or with them but more steps (read at this
invocation's last evaluation, finished or not). --resume-unfinished continues runs of this invocation's flags that
stopped before their end from their last checkpoint (every --checkpoint-frequency steps): a 100k-step walker-walk run
takes about an hour here, and the seeds of a setting take longer than one sitting.
Targets: ratio >= 0.9, accuracy >= 0.9, correlation >= 0.8.
"""

import argparse
import functools
import json
import os
import statistics
import time
from pathlib import Path

from common import (
    DEFENCE_SCRIPTS,
    REPO,
    acts_only_with,
    add_resume_arguments,
    earlier_run,
    inert,
    longer_runs,
    machine_info,
    print_table,
    read_summary,
    results_path,
    resumed_flags,
    run_pool,
    spread,
    start_script,
    task_name,
    write_json,
)

from cleanrlhf_utils.errors import ConfigError
from cleanrlhf_utils.objectives import load_objective

# (preference-based script, its short name, baseline script, its short name) per --algorithm.
ALGORITHMS = {"sac": ("sac_rlhf.py", "pebble", "sac.py", "sac"), "ppo": ("pref_ppo.py", "pref_ppo", "ppo.py", "ppo")}
# PPO's defaults are CleanRL's MuJoCo settings; classic-control envs get CleanRL's classic-control ones (both runs).
# SAC's own settings per task, for the SAC baseline and the preference-based run alike, as the task's run script sets
# them: Swimmer's reward is a slow drift that a 0.99 horizon barely sees (scripts/Swimmer-v5.sh: RL Zoo's tuned SAC).
SAC_ENV_FLAGS = {"Swimmer-v5": ["--gamma", "0.9999"]}
PPO_ENV_FLAGS = {
    "CartPole-v1": [
        "--num-envs", "4", "--num-steps", "128", "--num-minibatches", "4", "--update-epochs", "4",
        "--ent-coef", "0.01", "--learning-rate", "2.5e-4",
    ],
}  # fmt: skip
# PrefPPO on CartPole: every step is worth 1, so equally long segments are ties (not arbitrary labels), and
# segments are shorter than the early episodes.
PREFERENCE_ENV_FLAGS = {
    "CartPole-v1": [
        "--teacher-eps-equal",
        "0.01",
        "--segment-length",
        "25",
        "--max-augmentation-offset",
        "5",
        "--min-augmentation-offset",
        "2",
    ],
}


# Published figures for context (other code, GPU-sized networks, more steps): not comparable one to one.
PUBLISHED = {
    "dm_control/walker-walk-v0": "100 labels at 500k steps: PEBBLE 453, SURF 661 (reported in the SURF paper, Park et al. 2022)",
    "metaworld/door-open-v3": "PEBBLE's Meta-World runs (Lee et al. 2021; door-open v2, 1M steps, thousands of labels, 10 seeds): "
    "success rate is the metric; 20k steps here is a small fraction of that scale",
}


# QPA (Hu et al. 2024) as scripts/dm_control/*_qpa.sh: queries from the last 10 episodes, half of every SAC batch from
# them (hybrid replay), 20 cropped copies of each label, one reward network, no SURF, even schedule.
QPA_BASE = [
    "--teacher-feedback-schedule", "linear", "--preference-sampling", "uniform", "--reward-ensemble-size", "1", "--no-surf",
    "--qpa-query-episodes", "10",
]  # fmt: skip
QPA_HYBRID, QPA_CROPS = ["--qpa-hybrid-ratio", "0.5"], ["--qpa-augmentations", "20"]

# Gymnasium MuJoCo's best setting (docs/benchmarks/findings/gym-mujoco.md): the reward model's inputs standardised,
# SAC's actor started afresh when exploration ends, the learned reward at std 1, the label budget spread evenly.
NORM_RESET_STD1_LINEAR = [
    "--reward-net-normalize-inputs", "--reset-actor-after-exploration", "--learned-reward-std", "1",
    "--teacher-feedback-schedule", "linear",
]  # fmt: skip

# --variant: what the preference-based run adds to its flags (the SAC baseline is the same for all).
VARIANTS = {
    "pebble": [],  # sac_rlhf.py's defaults: exponential schedule, disagreement sampling, SURF
    # The README's recommendation from bench/reward_learning.py and B-Pref: the label budget spread evenly over the
    # sessions (B-Pref asks the same number every session, deep into the run), the rest as the defaults.
    "tuned": ["--teacher-feedback-schedule", "linear"],  # and on DMC the reward model's inputs standardised (TUNED_BY_SUITE)
    "qpa": [*QPA_BASE, *QPA_HYBRID, *QPA_CROPS],
    # QPA less one of its parts, to see which does the work (its query alignment cannot go alone: the hybrid replay
    # draws from the same last episodes).
    "qpa-no-hybrid": [*QPA_BASE, *QPA_CROPS],  # every SAC batch uniform over the buffer
    "qpa-no-crops": [*QPA_BASE, *QPA_HYBRID],  # each label trains once per epoch, uncropped
    # Gymnasium MuJoCo, one cause at a time (docs/benchmarks/findings/gym-mujoco.md): the reward model's inputs
    # standardised; and with it SAC's actor started afresh when exploration ends (its state-entropy policy's habits).
    "norm": ["--reward-net-normalize-inputs"],
    "norm-reset": ["--reward-net-normalize-inputs", "--reset-actor-after-exploration"],
    "norm-reset-std1": ["--reward-net-normalize-inputs", "--reset-actor-after-exploration", "--learned-reward-std", "1"],
    # and the budget spread evenly over the sessions, so that the last ones, on the agent's later states, are as large
    # as the first (the Ant's late exponential sessions bring 15-23 labels; --sessions sets how far into the run)
    "norm-reset-std1-linear": NORM_RESET_STD1_LINEAR,
    # and every session's pairs drawn from the agent's last 10 episodes (QPA's queries), so that the labels price the
    # states the agent reaches now: the Ant's final models overpaid their own agents' states over doing nothing
    "norm-reset-std1-linear-recent": [*NORM_RESET_STD1_LINEAR, "--qpa-query-episodes", "10"],
    # and no state-entropy exploration first: SAC learns the learned reward from the first labels at step 1000, since
    # PEBBLE's loop on Ant-v5's own reward reached 0.44 x and 0.11 x SAC with its 10k exploring steps, 0.80 x and
    # 0.36 x without them (docs/benchmarks/findings/gym-mujoco.md)
    "norm-reset-std1-linear-recent-noexplore": [
        *NORM_RESET_STD1_LINEAR,
        "--qpa-query-episodes",
        "10",
        "--no-unsupervised-exploration",
    ],
    # and the exploring steps kept for the queries and out of SAC's batches once the first labels end exploration:
    # with no exploration phase the Ant's labels fell to 0.35 x SAC, where the loop on its own reward rose to 0.80 x
    # (bench/exploration_for_queries.py, VARIANT_SCRIPTS)
    "norm-reset-std1-linear-recent-explorequeries": [*NORM_RESET_STD1_LINEAR, "--qpa-query-episodes", "10"],
    # and RUNE's optimism, strong and slow to decay: the Ant's models pay forward-moving states less than the rest and
    # disagree there twice as much; beta 5 makes the bonus spread 0.5 to 0.7 times as widely as the learned reward
    "norm-reset-std1-linear-rune": [*NORM_RESET_STD1_LINEAR, "--rune", "--rune-beta", "5", "--rune-beta-decay", "1e-5"],
    # and the learned reward shifted to be >= 0, so that staying in an episode pays where a fall ends it (the Ant
    # flipped): bench/nonnegative_reward.py, VARIANT_SCRIPTS
    "norm-reset-std1-nonneg": ["--reward-net-normalize-inputs", "--reset-actor-after-exploration", "--learned-reward-std", "1"],
    # the even schedule's setting with the action's known control cost added to SAC's learned reward, for a teacher
    # who judges what a clip shows and leaves the torque out (--teacher-objective): bench/known_control_cost.py
    "norm-reset-std1-linear-ctrl": NORM_RESET_STD1_LINEAR,
    # the same with the cost weighed twice: the walking objective's std over those runs' buffers is 0.33 to 0.55, so a
    # learned reward at std 1 is about twice its scale and 1 prices torque against progress about as Ant-v5's 0.5 does
    "norm-reset-std1-linear-ctrl1": [*NORM_RESET_STD1_LINEAR, "--known-control-cost-weight", "1"],
    # the even schedule's setting with each session's pairs those at the ensemble mean's decision boundary, from a pool
    # 50 times the session's size: the control cost alone decides 88 % to 90 % of the Ant's labels, so only near-ties
    # in torque price forward progress, and its models pay progress 0.24 to 0.70 times what Ant-v5 does against torque
    "norm-reset-std1-linear-entropy": [
        *NORM_RESET_STD1_LINEAR,
        "--preference-sampling",
        "entropy",
        "--preference-sampling-pool-factor",
        "50",
    ],
    # the even schedule's setting with clips of 25 steps (1.25 s): a pair's difference in forward progress varies about
    # as the clips' length, in torque as its square, so over 25 steps progress moves the labels twice as much as over 50
    "norm-reset-std1-linear-short": [*NORM_RESET_STD1_LINEAR, "--segment-length", "25"],
    # the even schedule's setting with each session's reward training run until the model reproduces every label (or
    # for its 100 epochs): stopped at 97 %, the Ant's models reproduced 97.0 % to 97.8 %, the control cost alone decides
    # 88 % to 90 % of the labels, and the rest of the reward, forward progress, decides most of the labels left wrong
    "norm-reset-std1-linear-fit": [*NORM_RESET_STD1_LINEAR, "--reward-net-target-accuracy", "1"],
    # the even schedule's setting with a reward network of one hidden layer of 64 units (three of 256 by default): the
    # Ant's models that reproduce every label still pay progress 0.15 to 0.51 times what Ant-v5 does against torque, so
    # they fit the labels progress decides by other features; a small network has to share what it learns across pairs
    "norm-reset-std1-linear-small": [
        *NORM_RESET_STD1_LINEAR,
        "--reward-net-hidden-layers",
        "1",
        "--reward-net-hidden-dim",
        "64",
    ],
    # the recent-queries setting with the reward model trained on inputs moved by half their std: the Ant's standing
    # seeds' models pay their own agent's exact pose most and slow walks away from it below doing nothing
    # (bench/reward_input_noise.py, VARIANT_SCRIPTS)
    "norm-reset-std1-linear-recent-noise": [*NORM_RESET_STD1_LINEAR, "--qpa-query-episodes", "10"],
    # the same with noise of one std: at half a std one standing seed of three walked and two still stood
    "norm-reset-std1-linear-recent-noise1": [
        *NORM_RESET_STD1_LINEAR,
        "--qpa-query-episodes",
        "10",
        "--reward-input-noise",
        "1",
    ],
}
# A variant that changes the algorithm rather than its settings runs an experiment's script, sac_rlhf.py changed by it.
VARIANT_SCRIPTS = {
    "norm-reset-std1-nonneg": str(REPO / "bench" / "nonnegative_reward.py"),
    "norm-reset-std1-linear-ctrl": str(REPO / "bench" / "known_control_cost.py"),
    "norm-reset-std1-linear-ctrl1": str(REPO / "bench" / "known_control_cost.py"),
    "norm-reset-std1-linear-recent-explorequeries": str(REPO / "bench" / "exploration_for_queries.py"),
    "norm-reset-std1-linear-recent-noise": str(REPO / "bench" / "reward_input_noise.py"),
    "norm-reset-std1-linear-recent-noise1": str(REPO / "bench" / "reward_input_noise.py"),
}


# What `tuned` and `qpa` add per suite, as the README recommends (and the suite's run scripts do): bench/reward_learning.py found
# standardised reward-model inputs better on walker-walk and worse on Hopper-v5.
TUNED_BY_SUITE = {"dm_control/": ["--reward-net-normalize-inputs"]}


def variant_flags(variant: str, env_id: str) -> list[str]:
    # QPA keeps the suite's tuned reward-model inputs: its changes are to what is asked and replayed, not to the inputs.
    tuned = variant == "tuned" or variant.startswith("qpa")
    suite = [flags for prefix, flags in TUNED_BY_SUITE.items() if env_id.startswith(prefix)] if tuned else []
    return [*VARIANTS[variant], *(flag for flags in suite for flag in flags)]


# The teacher's noise (B-Pref's mistake and beta-rational models) and the label-noise defence, passed to the preference
# run as they are: a noisy teacher's cost is the return against the same setting with the oracle (the defaults, which
# are the scripts' own: tests/test_bench.py holds them equal). --rime-flip-tau 1e-40: rime that drops and never flips;
# --rime-warm-start-steps 1000: rime with RIME's warm start (0, no warm start, is the scripts' default).
TEACHER_FLAGS = {
    "teacher_eps_mistake": 0.0, "teacher_beta": -1.0, "robust_labels": "none", "rime_flip_tau": 0.001, "rime_warm_start_steps": 0,
}  # fmt: skip


def default_output(args) -> Path:
    """Where an invocation without --output writes (bench/common.py's layout): PrefPPO's under pref-ppo, a teacher that
    makes mistakes under noisy-teachers (named by its labels and defence), any other under its task, by variant."""
    task = task_name(args.env_id) + ("" if args.terminate_when_unhealthy else "-no-fall-end")
    if args.algorithm == "ppo":
        return results_path("feedback_efficiency", "pref-ppo", task)
    if objective_flags(args):
        return results_path("feedback_efficiency", task, f"{args.variant}-teacher-{objective_stem(args.teacher_objective)}")
    if teacher_flags(args):
        return results_path("feedback_efficiency", "noisy-teachers", f"{task}-{args.variant}-{args.labels}-{args.robust_labels}")
    return results_path("feedback_efficiency", task, args.variant)


def objective_stem(objective: str) -> str:
    """A teacher objective's name in a file name: `walking` of ant_without_contact_forces:walking."""
    return objective.rpartition(":")[2].replace("_", "-")


def objective_flags(args) -> list[str]:
    """--teacher-objective: the preference run's teacher labels by it; both runs are still measured on the env's reward."""
    objective = getattr(args, "teacher_objective", "")  # benchmarks that share pebble_flags may not offer it
    return ["--teacher-objective", objective] if objective else []


def teacher_flags(args) -> list[str]:
    """The flags of TEACHER_FLAGS whose value differs from the oracle's, for the preference run (the defence itself is
    the script it runs: DEFENCE_SCRIPTS)."""
    changed = [(name, getattr(args, name, default)) for name, default in TEACHER_FLAGS.items() if name != "robust_labels"]
    return [token for name, value in changed if value != TEACHER_FLAGS[name] for token in (f"--{name.replace('_', '-')}", str(value))]


def termination_flags(args) -> list[str]:
    """--no-terminate-when-unhealthy: both runs on the task with no end on a fall, as Christiano et al. (2017) ran
    Hopper, Walker2d and Ant, so that a learned reward's constant cannot make ending the episode pay."""
    return [] if args.terminate_when_unhealthy else ["--no-terminate-when-unhealthy"]


def run_tag(env_id: str, seed: int, stamp: str) -> str:
    """The part of a run's name after bench_<script>_: a file name (a module:Id env by its id, no slashes)."""
    return f"{env_id.rsplit(':', 1)[-1].replace('/', '_')}_{seed}_{stamp}"


def pebble_flags(args, seed: int, run_name: str) -> list[str]:
    per_session = max(1, args.labels // args.sessions)
    return [
        "--env-id", args.env_id, "--seed", str(seed), "--run-name", run_name,
        "--total-timesteps", str(args.steps), "--total-explore-steps", str(args.explore_steps),
        "--teacher-feedback-total-queries", str(args.labels),
        "--teacher-feedback-num-queries-per-session", str(per_session),
        "--teacher-feedback-frequency", str(args.feedback_frequency),
        "--evaluation-frequency", str(args.evaluation_frequency), "--evaluation-episodes", str(args.evaluation_episodes),
        "--checkpoint-frequency", str(args.checkpoint_frequency), *variant_flags(args.variant, args.env_id), *teacher_flags(args),
        *objective_flags(args),
        *(SAC_ENV_FLAGS.get(args.env_id, []) if args.algorithm == "sac" else []), *termination_flags(args),
    ]  # fmt: skip


# What a baseline run depends on (baseline_flags): a run from an earlier invocation is reused only where these agree.
# The preference-based run's exploration, label budget, schedule and variant are not among them.
BASELINE_SETTINGS = ("algorithm", "env_id", "steps", "evaluation_frequency", "evaluation_episodes", "terminate_when_unhealthy")


def baseline_flags(args, seed: int, run_name: str) -> list[str]:
    """sac.py's (or ppo.py's) flags: the true-reward run the preference-based one is compared with."""
    extra = (PPO_ENV_FLAGS if args.algorithm == "ppo" else SAC_ENV_FLAGS).get(args.env_id, [])
    # sac.py checkpoints and resumes (--resume-unfinished); ppo.py keeps no checkpoints, and a stopped PPO run restarts
    checkpoints = ["--checkpoint-frequency", str(args.checkpoint_frequency)] if args.algorithm == "sac" else []
    return [
        "--env-id", args.env_id, "--seed", str(seed), "--total-timesteps", str(args.steps),
        "--evaluation-frequency", str(args.evaluation_frequency), "--evaluation-episodes", str(args.evaluation_episodes),
        *checkpoints, *extra, *termination_flags(args), "--run-name", run_name,
    ]  # fmt: skip


def curve_until(curve: list[list[float]] | None, step: int) -> list[list[float]] | None:
    """The evaluations of a longer run up to `step`, where it evaluated at `step` (None otherwise): a run's first
    `step` steps do not depend on how many follow (no schedule here reads the total), so this is a shorter run's curve."""
    if not curve or not any(at == step for at, _ in curve):
        return None
    return [[at, value] for at, value in curve if at <= step]


# A setting's value in results written before they recorded it.
RECORDED_LATER = {"algorithm": "sac", "terminate_when_unhealthy": True}


def earlier_results(paths: list[Path], args, settings: tuple[str, ...], flag: str):
    """(path, result) of each earlier results JSON of this benchmark whose `settings` agree with this invocation's, the
    number of steps excepted where the earlier ran longer (its evaluations are read up to this invocation's steps); any
    other difference is one error line naming it."""
    for path in paths:
        result = json.loads(path.read_text())
        recorded = result["settings"]
        mismatch = [k for k in settings if k != "steps" and recorded.get(k, RECORDED_LATER.get(k)) != getattr(args, k)]
        if recorded["steps"] < args.steps:
            mismatch.append("steps")
        if mismatch:
            wanted = ", ".join(f"{k} {recorded.get(k, RECORDED_LATER.get(k))!r} (this invocation: {getattr(args, k)!r})" for k in mismatch)
            raise SystemExit(f"{flag} {path}: its {wanted} differ; its runs must match this invocation's (or run longer)")
        yield path, result


def earlier_baselines(paths: list[Path], args, base: str) -> dict[int, dict]:
    """Per seed, the baseline's summary figures from earlier results of this benchmark with the same baseline
    settings (a baseline run does not depend on the label budget, schedule or variant). A longer baseline is read at
    this invocation's last step, which needs its evaluation curve: a seed without one is left out (and run)."""
    found = {}
    for path, result in earlier_results(paths, args, BASELINE_SETTINGS, "--baseline-from"):
        for row in result["rows"]:
            figures = {"sps": row[f"{base}_sps"], "eval_curve": row.get(f"{base}_eval_curve"), "from": str(path)}
            if result["settings"]["steps"] == args.steps:
                figures |= {"final_eval_return": row[f"{base}_return"], "final_success_rate": row.get(f"{base}_success_rate")}
            elif (curve := curve_until(figures["eval_curve"], args.steps)) is not None:
                figures |= {"final_eval_return": curve[-1][1], "final_success_rate": None, "eval_curve": curve}
            else:
                continue
            found[row["seed"]] = figures
    return found


# What the oracle teacher's run depends on besides the teacher (--oracle-from): everything the preference run is started
# with from this benchmark's settings.
ORACLE_SETTINGS = (
    "algorithm", "env_id", "steps", "labels", "sessions", "feedback_frequency", "explore_steps",
    "evaluation_frequency", "evaluation_episodes", "variant",
)  # fmt: skip


def earlier_oracle_runs(paths: list[Path], args, rlhf: str) -> dict[int, dict]:
    """Per seed, the return of the same preference-based setting with the oracle teacher (earlier results of this
    benchmark, TEACHER_FLAGS at their defaults) at this invocation's last step: final evaluation and last-3 mean."""
    # rime's own flags act only with --robust-labels rime, so an oracle's say nothing (and their defaults have changed)
    oracle_teacher = {name: value for name, value in TEACHER_FLAGS.items() if not inert(name, TEACHER_FLAGS)}
    found = {}
    for path, result in earlier_results(paths, args, ORACLE_SETTINGS, "--oracle-from"):
        teacher = {name: result["settings"].get(name, default) for name, default in oracle_teacher.items()}
        if teacher != oracle_teacher:
            raise SystemExit(f"--oracle-from {path}: its teacher is not the oracle ({teacher}); it must be {oracle_teacher}")
        for row in result["rows"]:
            curve = curve_until(row.get(f"{rlhf}_eval_curve"), args.steps)
            if curve is None:
                raise SystemExit(f"--oracle-from {path}: seed {row['seed']} has no evaluation at step {args.steps}")
            found[row["seed"]] = {"return": curve[-1][1], "last_return": last_evaluations_mean(curve), "from": str(path)}
    return found


LAST_EVALUATIONS = 3


def eval_curve(workdir: Path, run_name: str, tag: str = "eval/mean_return") -> list[list[float]]:
    """[step, value] of every evaluation of a run, from its TensorBoard scalars: the mean return, or another eval/ tag
    (eval/objective_return, eval/objective_success)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(workdir / "runs" / run_name), size_guidance={"scalars": 0})
    accumulator.Reload()
    return [[e.step, e.value] for e in accumulator.Scalars(tag)]


def last_evaluations_mean(curve: list[list[float]] | None, count: int = LAST_EVALUATIONS) -> float | None:
    """Mean value of the last `count` evaluations (None without a curve or with fewer evaluations)."""
    if not curve or len(curve) < count:
        return None
    return sum(value for _, value in curve[-count:]) / count


# The summary's figures as a run's TensorBoard logs hold them at a step (figures_at): the last feedback session's.
SESSION_FIGURES = {
    "labels_obtained": "feedback/labels_obtained", "heldout_accuracy": "reward_model/heldout_accuracy",
    "train_accuracy": "reward_model/train_accuracy", "reward_correlation": "reward_model/reward_correlation",
}  # fmt: skip


def figures_at(workdir: Path, run_name: str, step: int) -> dict | None:
    """A longer run's summary figures as they stood at `step`, from its TensorBoard logs (None before it evaluated
    there): the evaluation at `step` and the curve up to it, the last feedback session's reward-model measurements
    and label count before it (a finished run's summary measures the model once more at its end), and its speed."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(workdir / "runs" / run_name), size_guidance={"scalars": 0})
    accumulator.Reload()
    logged = set(accumulator.Tags()["scalars"])

    def until(tag: str, last: int) -> list[list[float]]:
        return [[e.step, e.value] for e in accumulator.Scalars(tag) if e.step <= last] if tag in logged else []

    curve = until("eval/mean_return", step)
    if not curve or curve[-1][0] != step:
        return None
    figures = {"final_eval_return": curve[-1][1], "eval_curve": curve, "final_success_rate": None}
    # A session logged at `step` came after the evaluation there (and a run of `step` steps never holds it).
    for key, (tag, last) in ({k: (tag, step - 1) for k, tag in SESSION_FIGURES.items()} | {"sps": ("charts/SPS", step)}).items():
        values = until(tag, last)
        figures[key] = values[-1][1] if values else None
    figures["labels_obtained"] = int(figures["labels_obtained"] or 0)
    return figures


def run_figures(workdir: Path, run_name: str, longer: dict | None) -> dict:
    """A run's summary with its evaluation curve, or, for a longer run, its figures at this invocation's last step."""
    if longer is not None:
        return longer
    return read_summary(workdir, run_name) | {"eval_curve": eval_curve(workdir, run_name)}


def reused_run(workdir: Path, script: str, flags: list[str], steps: int) -> tuple[str, dict | None] | None:
    """--reuse-finished: (run directory name, None) of a run that finished with exactly `flags`, else (name, its
    figures at `steps`) of one started with them but more steps that has evaluated at `steps`; None: neither."""
    if (finished := earlier_run(workdir, script, flags, finished=True)) is not None:
        print(f"reusing {finished.name}: finished with the same flags")
        return finished.name, None
    for run in longer_runs(workdir, script, flags):
        if (figures := figures_at(workdir, run.name, steps)) is not None:
            print(f"reusing {run.name} at step {steps}: the same flags but more steps")
            return run.name, figures
    return None


def planned_run(args, script: str, flags: list[str]) -> tuple[str, dict | None, list[str] | None]:
    """(the run directory this invocation reads `script` with `flags` from, its figures at --steps where it is a longer
    run, the flags to start it with or None where it is only read): --reuse-finished reads one that finished (or a
    longer one, reused_run); --resume-unfinished continues one that stopped before its end from its last checkpoint,
    under its own name (resumed_flags); else the run starts as `flags` say."""
    if args.reuse_finished and (reuse := reused_run(args.workdir, script, flags, args.steps)) is not None:
        return (*reuse, None)
    if args.resume_unfinished and (resumed := resumed_flags(args.workdir, script, flags)) is not None:
        print(f"resuming {resumed[1]}: stopped before its end, started with the same flags")
        return resumed[1], None, resumed[0]
    return flags[flags.index("--run-name") + 1], None, flags


def first_step_reaching(curve: list[list[float]] | None, target: float) -> int | None:
    """The first evaluation step whose mean return is >= target (None: never or no curve)."""
    return next((step for step, value in curve or [] if value >= target), None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--algorithm", choices=sorted(ALGORITHMS), default="sac", help="sac: PEBBLE vs SAC; ppo: PrefPPO vs PPO")
    parser.add_argument("--env-id", default="Hopper-v5")
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--labels", type=int, default=200, help="label budget of the preference-based run")
    parser.add_argument("--sessions", type=int, default=10, help="feedback sessions the budget is spread over")
    parser.add_argument("--feedback-frequency", type=int, default=5000)
    parser.add_argument("--explore-steps", type=int, default=10_000)
    parser.add_argument("--evaluation-frequency", type=int, default=10_000)
    parser.add_argument("--evaluation-episodes", type=int, default=10)
    parser.add_argument("--target-return", type=float, default=None, help="also report the first evaluation step reaching this return")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1])
    parser.add_argument(
        "--terminate-when-unhealthy",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="--no-terminate-when-unhealthy: both runs, evaluations included, on the task with no end on a fall (Hopper, Walker2d, Ant)",
    )
    parser.add_argument("--variant", choices=sorted(VARIANTS), default="pebble", help="flags the preference-based run adds (VARIANTS)")
    parser.add_argument("--teacher-eps-mistake", type=float, default=0.0, help="the synthetic teacher flips this share of labels")
    parser.add_argument("--teacher-beta", type=float, default=-1.0, help="beta-rational teacher (Bradley-Terry sampling); -1: oracle")
    parser.add_argument(
        "--teacher-objective", default="",
        help="the synthetic teacher labels by this objective (a built-in name or module:function) instead of the env's reward; "
        "both runs are still measured on the env's reward",
    )  # fmt: skip
    parser.add_argument(
        "--robust-labels",
        choices=sorted(DEFENCE_SCRIPTS),
        default="none",
        help="the label-noise defence: the variant of PEBBLE the run uses",
    )
    parser.add_argument(
        "--rime-flip-tau", type=float, default=TEACHER_FLAGS["rime_flip_tau"],
        help="rime: a label trains flipped when the model gives it a probability below this (1e-40: never; it is only dropped)",
    )  # fmt: skip
    parser.add_argument(
        "--rime-warm-start-steps", type=int, default=TEACHER_FLAGS["rime_warm_start_steps"],
        help="rime: Adam steps fitting the reward model to the exploration reward before the first labels (0: no warm start)",
    )  # fmt: skip
    parser.add_argument(
        "--baseline-from", type=Path, nargs="+", default=None,
        help="earlier results JSON of this benchmark: reuse their baseline runs (same env and evaluation, as many steps or more) "
        "instead of running them; seeds they lack are run",
    )  # fmt: skip
    parser.add_argument(
        "--oracle-from", type=Path, nargs="+", default=None,
        help="earlier results JSON of this benchmark with the oracle teacher and this invocation's other settings (or more "
        "steps): report the return against theirs at this invocation's last step (oracle_ratio), the noisy teacher's cost",
    )  # fmt: skip
    parser.add_argument(
        "--reuse-finished", action="store_true",
        help="runs in --workdir that finished with exactly the flags this invocation would start them with are read, not rerun; "
        "so are runs started with them but more steps (finished or not) that evaluated at this invocation's last step, read there",
    )  # fmt: skip
    add_resume_arguments(parser, checkpoint_frequency=10_000)
    parser.add_argument(
        "--parallel", type=int, default=2, help="runs at once (one torch thread each; the next starts when any ends): the cores to use"
    )
    parser.add_argument("--workdir", type=Path, default=REPO / "bench" / "workdir")
    parser.add_argument(
        "--output",
        type=Path,
        default=None,
        help="default: bench/results/feedback_efficiency/<task>/<variant>.json; a teacher that errs: noisy-teachers/"
        "<task>-<variant>-<labels>-<defence>.json; PrefPPO: pref-ppo/<task>.json",
    )
    args = parser.parse_args()
    if args.algorithm == "ppo" and args.robust_labels != "none":
        parser.error(f"--robust-labels {args.robust_labels}: the label-noise defences are variants of PEBBLE (--algorithm sac)")
    for name, default in TEACHER_FLAGS.items():  # a defence's own setting, given without it, would be passed on and never act
        if getattr(args, name) != default and inert(name, vars(args)):
            flag, needed = "--" + name.replace("_", "-"), acts_only_with(name)
            parser.error(f"{flag} {getattr(args, name)} only acts with --robust-labels {needed}, got {args.robust_labels}")
    if args.teacher_objective:
        try:
            load_objective(args.teacher_objective)
        except ConfigError as error:
            parser.error(str(error))
    if args.output is None:
        args.output = default_output(args)
    rlhf_script, rlhf, base_script, base = ALGORITHMS[args.algorithm]
    if args.algorithm == "sac":  # a label-noise defence is a variant of PEBBLE in a file of its own
        rlhf_script = DEFENCE_SCRIPTS[args.robust_labels]
    if args.variant in VARIANT_SCRIPTS:
        if args.robust_labels != "none" or args.algorithm != "sac":
            parser.error(f"--variant {args.variant} runs its own script, {VARIANT_SCRIPTS[args.variant]}: PEBBLE's oracle only")
        rlhf_script = VARIANT_SCRIPTS[args.variant]
    extra = PPO_ENV_FLAGS.get(args.env_id, []) if args.algorithm == "ppo" else []  # SAC's per task: in pebble_flags
    rlhf_extra = PREFERENCE_ENV_FLAGS.get(args.env_id, []) if args.algorithm == "ppo" else []

    # The process id too: two invocations started in the same second (two variants side by side) would otherwise
    # share run directories and overwrite each other's runs.
    stamp, machine = f"{int(time.time())}_{os.getpid()}", machine_info()  # machine: also the commit the runs start from
    reused = earlier_baselines(args.baseline_from, args, base) if args.baseline_from else {}
    missing = [seed for seed in args.seeds if args.baseline_from and seed not in reused]
    if missing:
        print(f"--baseline-from has no {base} run for seeds {missing} at {args.steps} steps: running them")
    oracle = earlier_oracle_runs(args.oracle_from, args, rlhf) if args.oracle_from else {}
    if args.oracle_from and (lacking := [seed for seed in args.seeds if seed not in oracle]):
        raise SystemExit(f"--oracle-from has no oracle run for seeds {lacking}; it has seeds {sorted(oracle)}")
    jobs = []  # (seed, name, script, flags), started `parallel` at a time
    run_dirs = {}  # (seed, name) -> (the run directory its figures are read from, its figures at args.steps if longer)
    for seed in args.seeds:
        tag = run_tag(args.env_id, seed, stamp)
        wanted = [(rlhf, rlhf_script, [*pebble_flags(args, seed, f"bench_{rlhf}_{tag}"), *extra, *rlhf_extra])]
        if seed not in reused:
            wanted.append((base, base_script, baseline_flags(args, seed, f"bench_{base}_{tag}")))
        for name, script, flags in wanted:
            run_name, longer, start = planned_run(args, script, flags)
            if start is not None:
                jobs.append((seed, name, script, start))
            run_dirs[seed, name] = (run_name, longer)
    names = [flags[flags.index("--run-name") + 1] for *_, flags in jobs]
    run_pool(
        [
            functools.partial(start_script, script, flags, args.workdir, log=args.workdir / f"{name}.log")
            for (_, _, script, flags), name in zip(jobs, names)
        ],
        names,
        args.parallel,
    )

    rows = []
    for seed in args.seeds:
        preference = run_figures(args.workdir, *run_dirs[seed, rlhf])
        baseline = reused[seed] if seed in reused else run_figures(args.workdir, *run_dirs[seed, base])
        window = [last_evaluations_mean(run.get("eval_curve")) for run in (preference, baseline)]
        rows.append({
            "env_id": args.env_id, "variant": args.variant, "seed": seed, "steps": args.steps, "labels": preference["labels_obtained"],
            f"{rlhf}_return": preference["final_eval_return"], f"{base}_return": baseline["final_eval_return"],
            "ratio": preference["final_eval_return"] / baseline["final_eval_return"],
            "heldout_accuracy": preference["heldout_accuracy"], "train_accuracy": preference["train_accuracy"],
            "reward_correlation": preference["reward_correlation"], f"{rlhf}_sps": preference["sps"], f"{base}_sps": baseline["sps"],
            # Meta-World: the last evaluation's success rate, the metric its papers report (None on other envs)
            f"{rlhf}_success_rate": preference.get("final_success_rate"), f"{base}_success_rate": baseline.get("final_success_rate"),
            "baseline_from": reused[seed]["from"] if seed in reused else "this invocation",
            # The mean of the last LAST_EVALUATIONS evaluations: one checkpoint of Hopper or Walker2d swings by hundreds
            # between evaluations (for SAC too), so the final one alone ranks runs by luck.
            f"{rlhf}_last_return": window[0], f"{base}_last_return": window[1],
            "last_ratio": window[0] / window[1] if None not in window else None,
            f"{rlhf}_eval_curve": preference["eval_curve"], f"{base}_eval_curve": baseline.get("eval_curve"),
        })  # fmt: skip
        if seed in oracle:  # the noisy teacher's cost: this run against the same setting with the oracle teacher
            rows[-1] |= {
                "oracle_return": oracle[seed]["return"], "oracle_ratio": preference["final_eval_return"] / oracle[seed]["return"],
                "oracle_last_return": oracle[seed]["last_return"], "oracle_from": oracle[seed]["from"],
                "oracle_last_ratio": window[0] / oracle[seed]["last_return"] if None not in (window[0], oracle[seed]["last_return"]) else None,
            }  # fmt: skip
        if args.target_return is not None:
            for name in (rlhf, base):
                rows[-1][f"{name}_steps_to_target"] = first_step_reaching(rows[-1][f"{name}_eval_curve"], args.target_return)
    keys = [f"{rlhf}_return", f"{base}_return", "ratio", "heldout_accuracy", "reward_correlation", f"{rlhf}_sps", f"{base}_sps"]
    keys += [key for key in (f"{rlhf}_success_rate", f"{base}_success_rate") if all(row[key] is not None for row in rows)]
    # A reused baseline from before the curves were kept has no last evaluations: its seed drops out of that median only.
    keys += [key for key in (f"{rlhf}_last_return", f"{base}_last_return", "last_ratio") if any(row[key] is not None for row in rows)]
    if oracle:
        keys += [
            key
            for key in ("oracle_return", "oracle_ratio", "oracle_last_return", "oracle_last_ratio")
            if any(row[key] is not None for row in rows)
        ]
    median = {key: statistics.median(r[key] for r in rows if r[key] is not None) for key in keys}
    columns = ["env_id", "variant", "seed", "labels", *keys]
    if args.target_return is not None:
        columns += [f"{rlhf}_steps_to_target", f"{base}_steps_to_target"]
    print_table([*rows, {"env_id": "median", **median}], columns)
    if args.env_id in PUBLISHED:
        print(f"published, for context: {PUBLISHED[args.env_id]}")
    write_json(
        args.output,
        {
            "benchmark": "feedback_efficiency",
            "machine": machine,
            "settings": vars(args)
            | {"workdir": str(args.workdir), "output": str(args.output)}
            | {name: [str(p) for p in getattr(args, name) or []] for name in ("baseline_from", "oracle_from")},
            "rows": rows,
            "median": median,
            # the seeds' interquartile range beside each median: with Hopper's seed-to-seed swings, medians alone rank luck
            "spread": {key: spread([row[key] for row in rows]) for key in keys},
            "published": PUBLISHED.get(args.env_id),
        },
    )


if __name__ == "__main__":
    main()
