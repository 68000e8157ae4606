"""Reward learning measured without an RL run: does the reward model generalise, and which of its settings help?

An RL run costs an hour here; fitting the reward ensemble on fixed data costs seconds to minutes. This bench
draws labels from fixed replay buffers (saved once per env from `framework/sac.py` runs on the true reward), labels
them with sac_rlhf's SyntheticTeacher (a perfect oracle by default), fits the ensemble exactly as sac_rlhf.py does
(its RewardEnsemble, PreferenceBuffer, select_queries and train_reward_model with its Args) and measures it on data it
never saw:

- `acc`: agreement of the ensemble-mean preference with the true reward on 1,000 fresh random pairs of the same
  buffer (ties left out), the same pairs for every variant and seed;
- `acc_latest`: the same on 1,000 pairs from the latest policy's data (the last 10k transitions of the env's
  longest buffer), i.e. what the policy will be judged on after it has moved on;
- `r_step`/`rho_step`: Pearson/Spearman correlation of the learned reward (ensemble mean) with the true reward
  per transition (the whole training buffer); `r_seg`/`rho_seg`: the same per segment (returns of the 2,000
  segments of the fresh pairs); `*_latest` columns on the latest policy's data;
- `fit_cpu_s`: CPU seconds of all train_reward_model calls up to that budget; `adam_steps`: Adam steps in all.

A budget is drawn in sessions (`--session-size`, 25 labels), as a run does: the first session samples uniformly,
later ones with the strategy, scored by the model as it stands after the previous session; the ensemble is trained
after every session (continued, as sac_rlhf.py does, unless the variant re-initialises it) and measured after the
session that reaches each budget. Every label trains the model (nothing is held out: the fresh pairs measure it).
Each variant is compared side by side with `default` (sac_rlhf.Args' defaults) on the same seeds: `d_acc` is the
median over seeds of (variant's acc - default's acc), `d_acc_latest` the same for acc_latest. Figures are medians over
seeds.

    # the fixed replay buffers, once (bench/workdir/buffers/<env>/<steps>.npz, ignored by git): one sac.py run per env
    # of the longest stage, each stage the transitions of its first <steps> environment steps
    python bench/reward_learning.py buffers --envs Hopper-v5 dm_control/walker-walk-v0 --stages 10000 30000

    python bench/reward_learning.py variants            # what each variant changes
    python bench/reward_learning.py run --envs Hopper-v5 dm_control/walker-walk-v0 --stage 10000 \\
        --budgets 50 100 200 --strategies uniform disagree --variants default epochs50 surf-off reinit --seeds 1 2 3
    python bench/reward_learning.py run --envs dm_control/walker-walk-v0 --stage 30000 --budgets 25 50 100 200 500 \\
        --strategies uniform disagree entropy --variants default seg25 ens5 lr1e-3 --output bench/results/reward_learning/reward-learning/walker-walk-30k.json

Noisy teachers: `--teachers` labels with B-Pref's noise, `oracle` (the default), `mistake<eps>`
(--teacher-eps-mistake: a share eps of the labels flipped) or `beta<b>` (--teacher-beta: labels drawn from the
Bradley-Terry probability with temperature b, so that close pairs are the ones labelled wrong); accuracy is always
against the true reward. The variants `smooth`, `smooth0.3`, `rime` and `rime-nowarm` are PEBBLE's
variant files for noisy labels (sac_rlhf_mistake_aware.py, sac_rlhf_rime.py) (rime's warm start fits the k-NN state entropy of the training buffer, which here comes from a
sac.py run rather than from exploration). Rows add `label_error` (the labels' own error rate against the true reward)
and rime's shares of labels trusted/dropped/flipped in the last epoch; a second table gives, per teacher, every
variant's median acc over seeds with its range.

    python bench/reward_learning.py run --envs dm_control/walker-walk-v0 Hopper-v5 --stage 10000 --budgets 50 100 \
        --strategies disagree --teachers oracle mistake0.1 mistake0.2 mistake0.3 beta10 beta1 \
        --variants default smooth rime --seeds 1 2 3 --output bench/results/reward_learning/noisy-teachers/buffer-walker-walk-hopper-100.json

Replay (`replay`): a finished sac_rlhf.py run's own labels, the queries its online loop chose and its teacher's
answers, fitted again session by session (in the sessions and on the replay buffer as it stood when they came) with
the run's reward-model settings and each variant's defence (`default`: none), measured after every session on fresh
pairs of the run's final buffer. It asks whether a defence, rather than the queries, made a run's reward model:

    python bench/reward_learning.py replay --runs bench/workdir/models/<run>/latest --variants default rime rime-nowarm

Variants change sac_rlhf.Args fields passed to train_reward_model; the few the scripts have no setting for (ReLU,
weight decay, a step count proportional to the labels, a segment sampler that cuts segments at time limits) are BENCH-ONLY EXPERIMENTS, marked so
below: if one wins, it has to be written into sac_rlhf.py and pref_ppo.py before a run can use it. A run that is
interrupted keeps its finished trials in <output>.tmp; `--resume` continues from there, or adds trials (other
variants, strategies, seeds, envs) to a finished <output>.
"""

import argparse
import copy
import dataclasses
import functools
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
from common import REPO, defence_name, defence_of, machine_info, print_table, read_summary, results_path, start_script, wait_all, write_json
from scipy.stats import rankdata

import sac_rlhf
import sac_rlhf_mistake_aware
import sac_rlhf_rime
from cleanrlhf_utils.buffers import ReplayBuffer
from cleanrlhf_utils.feedback import SyntheticTeacher
from cleanrlhf_utils.networks import ensemble_mlp

WORKDIR = REPO / "bench" / "workdir"
BUFFERS = WORKDIR / "buffers"
ENVS = ["Hopper-v5", "dm_control/walker-walk-v0"]
EVAL_SEED = 20_251  # the fresh pairs: the same for every variant, strategy and seed


# ----------------------------------------------------------------------------------------
# Variants: what differs from sac_rlhf.Args' defaults
# ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Variant:
    description: str
    args: dict = field(default_factory=dict)  # sac_rlhf.Args fields, as their flags would set them
    reinit: bool = False  # a fresh ensemble and optimiser before every session's training
    epochs_per_label: float = 0.0  # > 0: BENCH-ONLY, a fixed ceil(k x labels / batch) Adam steps per session, no stop
    activation: type[nn.Module] = nn.LeakyReLU  # BENCH-ONLY when not LeakyReLU (RewardEnsemble's)
    weight_decay: float = 0.0  # BENCH-ONLY: Adam's L2 weight decay (the scripts have none)
    dropout: float = 0.0  # BENCH-ONLY: dropout while the reward model trains (RewardEnsemble's `dropout`; the scripts use none)
    cut_segments: bool = False  # BENCH-ONLY: queries and SURF's pairs start anywhere, cut at time limits, as before


NO_STOP = {"reward_net_target_accuracy": 2.0}  # training accuracy never reaches it: every epoch runs

QPA_MODEL = {"reward_ensemble_size": 1, "surf": False, "qpa_augmentations": 20, "reward_net_normalize_inputs": True}
VARIANTS = {
    "default": Variant("sac_rlhf.Args defaults: continue the model, stop at 97 % training accuracy (<= 100 epochs), SURF"),
    # segment length (SURF's crops scaled with it)
    "seg25": Variant(
        "segments of 25 steps (crops keep 20-23)", {"segment_length": 25, "max_augmentation_offset": 5, "min_augmentation_offset": 2}
    ),
    "seg100": Variant(
        "segments of 100 steps (crops keep 80-90)", {"segment_length": 100, "max_augmentation_offset": 20, "min_augmentation_offset": 10}
    ),
    # ensemble size
    "ens1": Variant("one member (its disagreement is zero: `disagree` then picks uniformly)", {"reward_ensemble_size": 1}),
    "ens5": Variant("five members", {"reward_ensemble_size": 5}),
    # epochs and the stop rule
    "epochs10": Variant("10 epochs every session, no accuracy stop", {"reward_net_epochs": 10, **NO_STOP}),
    "epochs50": Variant(
        "50 epochs every session, no accuracy stop (50: the cap of B-Pref's DMC configs, reward_update)",
        {"reward_net_epochs": 50, **NO_STOP},
    ),
    "epochs200": Variant("200 epochs every session, no accuracy stop (B-Pref's default cap)", {"reward_net_epochs": 200, **NO_STOP}),
    "stop99": Variant("stop at 99 % training accuracy instead of 97 % (<= 100 epochs)", {"reward_net_target_accuracy": 0.99}),
    "steps100": Variant("BENCH-ONLY: ceil(100 x labels / batch) Adam steps every session, no stop", epochs_per_label=100),
    "steps1000": Variant("BENCH-ONLY: ceil(1000 x labels / batch) Adam steps every session, no stop (SURF's count)", epochs_per_label=1000),
    # learning rate and regularisation
    "lr1e-4": Variant("reward-model learning rate 1e-4", {"reward_net_lr": 1e-4}),
    "lr1e-3": Variant("reward-model learning rate 1e-3", {"reward_net_lr": 1e-3}),
    "wd1e-4": Variant("BENCH-ONLY: Adam weight decay 1e-4", weight_decay=1e-4),
    "dropout0.1": Variant("dropout 0.1 while training", dropout=0.1),
    # SURF
    "surf-off": Variant("no SURF (no crops, no pseudo-labels)", {"surf": False}),
    "surf-paper": Variant(
        "SURF's paper settings: weight 1, 4 unlabelled pairs per label, tau 0.99",
        {"lambda_ssl": 1.0, "unlabeled_batch_ratio": 4, "surf_tau": 0.99},
    ),
    # the model across sessions
    "reinit": Variant("re-initialise the ensemble and its optimiser before every session", reinit=True),
    # inputs and activation
    "norm": Variant(
        "(obs, action) standardised with the buffer's mean and std (--reward-net-normalize-inputs)", {"reward_net_normalize_inputs": True}
    ),
    "raw-inputs": Variant("(obs, action) not standardised (--no-reward-net-normalize-inputs)", {"reward_net_normalize_inputs": False}),
    "relu": Variant("BENCH-ONLY: ReLU instead of LeakyReLU", activation=nn.ReLU),
    # where segments start
    "cut-segments": Variant(
        "BENCH-ONLY: the sampler before whole segments: starts anywhere, segments cut by time limits and the newest step",
        cut_segments=True,
    ),
    # noisy teachers (--robust-labels)
    "smooth": Variant("mistake-aware Bradley-Terry expecting 10 % flipped labels (sac_rlhf_mistake_aware.py)", {"robust_labels": "smooth"}),
    "smooth0.3": Variant(
        "mistake-aware Bradley-Terry expecting 30 % flipped labels", {"robust_labels": "smooth", "robust_label_epsilon": 0.3}
    ),
    "rime": Variant(
        "RIME's selection and warm start (sac_rlhf_rime.py --rime-warm-start-steps 1000); the warm start fits the k-NN state entropy of the training buffer",
        {"robust_labels": "rime", "rime_warm_start_steps": 1000},
    ),
    "rime-nowarm": Variant(
        "RIME's selection without its warm start (--robust-labels rime, the scripts' default)",
        {"robust_labels": "rime", "rime_warm_start_steps": 0},
    ),
    "rime-noflip": Variant(
        "RIME's selection and warm start, (almost) no flipping: a flip needs a probability below 1e-40",
        {"robust_labels": "rime", "rime_flip_tau": 1e-40, "rime_warm_start_steps": 1000},
    ),
    "rime-alpha1": Variant(
        "RIME with its warm start and alpha 1 (its code's default config): a more lenient trust threshold",
        {"robust_labels": "rime", "rime_alpha": 1.0, "rime_warm_start_steps": 1000},
    ),
    # QPA's reward model (bench/feedback_efficiency.py --variant qpa on DMC; use with --strategies uniform and a
    # --session-size of 10 as a 100-label run asks): one member, 20 cropped copies of each label, inputs standardised
    "qpa": Variant("QPA's reward model: one member, no SURF, 20 cropped copies per label, standardised inputs", QPA_MODEL),
    "qpa-rime": Variant(
        "QPA's reward model with RIME and its warm start", QPA_MODEL | {"robust_labels": "rime", "rime_warm_start_steps": 1000}
    ),
    "qpa-rime-noflip": Variant(
        "QPA's reward model with RIME's selection but (almost) no flipping: a flip needs a probability below 1e-40",
        QPA_MODEL | {"robust_labels": "rime", "rime_flip_tau": 1e-40, "rime_warm_start_steps": 1000},
    ),
    "qpa-rime-ens3": Variant(
        "QPA's reward model with three members, with RIME and its warm start",
        QPA_MODEL | {"robust_labels": "rime", "reward_ensemble_size": 3, "rime_warm_start_steps": 1000},
    ),
}

# The teacher's noise (sac_rlhf.Args' B-Pref flags): `oracle`, `mistake<eps>` (--teacher-eps-mistake), `beta<b>` (--teacher-beta)
TEACHER_PREFIXES = {"mistake": "teacher_eps_mistake", "beta": "teacher_beta"}


def teacher_settings(name: str) -> dict:
    """sac_rlhf.Args fields of a teacher named `oracle`, `mistake0.2` or `beta10`."""
    if name == "oracle":
        return {}
    for prefix, field_name in TEACHER_PREFIXES.items():
        if name.startswith(prefix):
            try:
                return {field_name: float(name[len(prefix) :])}
            except ValueError:
                break
    raise SystemExit(f"unknown teacher {name!r}: oracle, mistake<eps> (e.g. mistake0.2) or beta<b> (e.g. beta10)")


DEFENCE_FIELDS = ("robust_labels", "robust_label_epsilon")
"""Variant.args keys that choose the label-noise defence, not settings of sac_rlhf.Args: `robust_labels` none, smooth
(sac_rlhf_mistake_aware.py, expecting robust_label_epsilon flipped labels) or rime (sac_rlhf_rime.py; its rime_* settings
are fields of sac_rlhf_rime.Args, which holds PEBBLE's too)"""


def variant_args(variant: Variant, **settings) -> sac_rlhf_rime.Args:
    """The run's settings for a variant: PEBBLE's and RIME's (sac_rlhf_rime.Args carries both)."""
    fields = {name: value for name, value in variant.args.items() if name not in DEFENCE_FIELDS}
    return sac_rlhf_rime.Args(**fields | settings)


def reward_training(variant: Variant, args: sac_rlhf_rime.Args):
    """What the variant's run passes to sac_rlhf.main as reward_training: PEBBLE's, the mistake-aware loss's or RIME's
    (whose state carries across sessions, as a run's)."""
    defence = variant.args.get("robust_labels", "none")
    if defence == "rime":
        return sac_rlhf_rime.RimeTraining(args)
    if defence == "smooth":
        loss = functools.partial(sac_rlhf_mistake_aware.mistake_aware_loss, epsilon=variant.args.get("robust_label_epsilon", 0.1))
        return functools.partial(sac_rlhf.train_reward_model, loss_fn=loss)
    return sac_rlhf.train_reward_model


def new_model(variant: Variant, args: sac_rlhf.Args, rb: ReplayBuffer) -> tuple[sac_rlhf.RewardEnsemble, torch.optim.Optimizer]:
    """The ensemble and optimiser as sac_rlhf.main builds them, with the variant's bench-only changes."""
    input_dim = rb.obs.shape[1] + rb.actions.shape[1]
    sizes = (args.reward_ensemble_size, args.reward_net_hidden_dim, args.reward_net_hidden_layers, variant.dropout)
    model = sac_rlhf.RewardEnsemble(input_dim, *sizes)
    if variant.activation is not nn.LeakyReLU:
        model.net = ensemble_mlp(
            args.reward_ensemble_size, input_dim, args.reward_net_hidden_dim, args.reward_net_hidden_layers, 1,
            activation=variant.activation, dropout=variant.dropout,
        )  # fmt: skip
    optimizer = torch.optim.Adam(model.parameters(), lr=args.reward_net_lr, weight_decay=variant.weight_decay, fused=True)
    return model, optimizer


# ----------------------------------------------------------------------------------------
# Fixed replay buffers
# ----------------------------------------------------------------------------------------
def env_folder(env_id: str) -> str:
    return env_id.replace("/", "_")


def load_buffer(path: Path) -> ReplayBuffer:
    with np.load(path) as data:
        rb = ReplayBuffer(len(data["obs"]), data["obs"].shape[1], data["actions"].shape[1], data["physics_states"].shape[1])
        rb.load_state_dict(data)
    return rb


def slice_buffer(rb: ReplayBuffer, rows: slice) -> ReplayBuffer:
    """A buffer holding rb's rows (chronological, never wrapped: sac.py's capacity is its run length)."""
    state = {name: getattr(rb, name)[: rb.size][rows] for name in ReplayBuffer.FIELDS}
    n = len(state["obs"])
    part = ReplayBuffer(n, rb.obs.shape[1], rb.actions.shape[1], rb.physics_states.shape[1])
    part.load_state_dict({**state, "pos": np.array(n), "full": np.array(False), "capacity": np.array(rb.capacity)})
    return part


def rows_before_step(rb: ReplayBuffer, steps: int) -> int:
    """How many stored transitions the first `steps` environment steps produced: each finished episode costs one
    step that is not stored (the autoreset step), so row i was taken at step i + (episodes finished before it)."""
    ids = rb.episode_ids[: rb.size]
    return int(np.sum(np.arange(rb.size) + ids - ids[0] < steps))


def make_buffers(opts) -> None:
    """One sac.py run per env of the longest stage; each stage saved as the transitions of its first N steps."""
    longest = max(opts.stages)
    for env_id in opts.envs:
        run_name = f"buffer__{env_folder(env_id)}__{longest}__s{opts.seed}"
        run_dir = WORKDIR / "reward_learning" / "sac"
        source = run_dir / "models" / run_name / "latest" / "replay_buffer.npz"
        if opts.force or not source.exists():
            flags = ["--env-id", env_id, "--total-timesteps", str(longest), "--seed", str(opts.seed), "--run-name", run_name]
            flags += ["--evaluation-frequency", "10000", "--evaluation-episodes", "3"]
            print(f"{env_id}: sac.py for {longest} steps (log: {run_dir / (run_name + '.log')})", flush=True)
            wait_all([start_script("sac.py", flags, run_dir, log=run_dir / f"{run_name}.log")], [run_name])
        full = load_buffer(source)
        summary = read_summary(run_dir, run_name)
        folder = BUFFERS / env_id
        folder.mkdir(parents=True, exist_ok=True)
        manifest = {
            "env_id": env_id,
            "source_run": run_name,
            "seed": opts.seed,
            "final_eval_return": summary["final_eval_return"],
            "stages": {},
        }
        for stage in sorted(opts.stages):
            part = slice_buffer(full, slice(0, rows_before_step(full, stage)))
            part.save(folder / f"{stage}.npz")
            true = part.true_rewards[: part.size]
            episodes = int(part.episode_ids[part.size - 1] - part.episode_ids[0] + 1)
            manifest["stages"][str(stage)] = {"transitions": part.size, "episodes": episodes, "true_reward_mean": float(true.mean())}
            print(f"  {folder / f'{stage}.npz'}: {part.size} transitions, {episodes} episodes, true reward {true.mean():.3f} per step")
        (folder / "manifest.json").write_text(json.dumps(manifest, indent=2))


def stage_buffers(env_id: str) -> dict[int, Path]:
    folder = BUFFERS / env_id
    return {int(p.stem): p for p in folder.glob("*.npz")} if folder.exists() else {}


# ----------------------------------------------------------------------------------------
# Measuring a model on fresh oracle-labelled data
# ----------------------------------------------------------------------------------------
@dataclass
class EvalSet:
    """All transitions of a buffer and a fixed set of random segment pairs in it (indices into those rows)."""

    rows: np.ndarray  # (N, D) obs-actions
    true_rewards: np.ndarray  # (N,)
    idx: np.ndarray  # (P, 2, L)
    mask: np.ndarray  # (P, 2, L)

    @classmethod
    def from_buffer(cls, rb: ReplayBuffer, pairs: int, length: int, seed) -> "EvalSet":
        idx, mask = rb.sample_segment_pairs(pairs, length, np.random.default_rng(seed))
        return cls(rb.obs_actions(np.arange(rb.size)), rb.true_rewards[: rb.size].copy(), idx, mask)


def correlations(predicted: np.ndarray, true: np.ndarray) -> tuple[float, float]:
    """Pearson and Spearman correlation (nan when either side is constant)."""
    if predicted.std() == 0 or true.std() == 0:
        return float("nan"), float("nan")
    return float(np.corrcoef(predicted, true)[0, 1]), float(np.corrcoef(rankdata(predicted), rankdata(true))[0, 1])


def measure(model: sac_rlhf.RewardEnsemble, data: EvalSet, chunk: int = 4096) -> dict:
    """Fresh-pair accuracy (ensemble-mean preference, as sac_rlhf.preference_accuracy) and correlations."""
    model.eval()
    with torch.no_grad():
        members = torch.cat([model(torch.as_tensor(data.rows[s : s + chunk])) for s in range(0, len(data.rows), chunk)], dim=1).numpy()
    model.train()
    predicted_returns = (members[:, data.idx] * data.mask).sum(-1)  # (E, P, 2)
    probability = 1 / (1 + np.exp(-(predicted_returns[..., 1] - predicted_returns[..., 0])))
    true_returns = (data.true_rewards[data.idx] * data.mask).sum(-1)  # (P, 2)
    decided = true_returns[:, 0] != true_returns[:, 1]
    correct = (probability.mean(0) > 0.5) == (true_returns[:, 1] > true_returns[:, 0])
    r_step, rho_step = correlations(members.mean(0), data.true_rewards)
    r_seg, rho_seg = correlations(predicted_returns.mean(0).ravel(), true_returns.ravel())
    return {"acc": float(correct[decided].mean()), "r_step": r_step, "rho_step": rho_step, "r_seg": r_seg, "rho_seg": rho_seg}


# ----------------------------------------------------------------------------------------
# One trial: an env's buffer, a strategy, a variant, a seed -> a row per budget
# ----------------------------------------------------------------------------------------
def session_sizes(budgets: list[int], session_size: int) -> list[int]:
    """Labels per session: sessions of `session_size`, cut so that every budget ends a session."""
    ends = sorted(set(range(session_size, max(budgets) + 1, session_size)) | set(budgets))
    return [b - a for a, b in zip([0, *ends], ends)]


def fit_session(
    model: sac_rlhf.RewardEnsemble,
    optimizer: torch.optim.Optimizer,
    prefs: sac_rlhf.PreferenceBuffer,
    rb: ReplayBuffer,
    args: sac_rlhf.Args,
    variant: Variant,
    rng: np.random.Generator,
    training,
    session: int,
) -> tuple[sac_rlhf.RewardEnsemble, torch.optim.Optimizer, sac_rlhf.Args, dict]:
    """The reward model's training after session `session` (0-based), as sac_rlhf.py trains it, with the variant's
    bench-only changes: (model, optimizer, args, train_reward_model's stats), the first three as the next session
    continues them."""
    if variant.reinit and session > 0:
        model, optimizer = new_model(variant, args, rb)
    if variant.epochs_per_label:  # BENCH-ONLY: a step count proportional to the labels, as SURF trains
        steps_per_epoch = math.ceil(len(prefs) / args.reward_net_batch_size)
        steps = math.ceil(variant.epochs_per_label * len(prefs) / args.reward_net_batch_size)
        args = dataclasses.replace(args, reward_net_epochs=math.ceil(steps / steps_per_epoch), **NO_STOP)
    stats = training(model, optimizer, prefs, rb, args, rng, "cpu")
    return model, optimizer, args, stats


def label_error(prefs: sac_rlhf.PreferenceBuffer) -> float:
    """The labels' own error rate against the true reward (sac_rlhf_rime.teacher_mistakes; ties, of the returns or of
    the labels, left out of the count)."""
    true_returns = (prefs.true_rewards * prefs.masks).sum(-1)
    decided = (true_returns[:, 0] != true_returns[:, 1]) & (prefs.labels != 0.5)
    return float(sac_rlhf_rime.teacher_mistakes(prefs, np.arange(len(prefs)), None, prefs.obs_actions.shape[-1])[decided].mean())


def selection_stats(stats: dict) -> dict:
    """--robust-labels rime's selection in a fit's stats: the shares trusted, dropped and flipped, and the share of the
    teacher's mistakes in all and in each (labels_wrong, labels_flipped_wrong, ...); nothing for other defences."""
    return {name: value for name, value in stats.items() if name.startswith("labels_")}


def run_trial(
    rb: ReplayBuffer, evals: dict[str, EvalSet], strategy: str, variant: Variant, seed: int, opts, teacher_name: str = "oracle"
) -> list[dict]:
    args = variant_args(variant, **teacher_settings(teacher_name), seed=seed, preference_sampling=strategy)
    training = reward_training(variant, args)  # RIME's state carries across sessions, as the run's
    torch.manual_seed(seed)  # ensemble initialisation and train_reward_model's shuffles
    rng = np.random.default_rng(seed)  # query sampling and SURF's unlabelled pairs, as the run's rng
    teacher = SyntheticTeacher(
        args.teacher_beta, args.teacher_gamma, args.teacher_eps_mistake, args.teacher_eps_skip, args.teacher_eps_equal, seed=seed + 1, rb=rb
    )
    model, optimizer = new_model(variant, args, rb)
    if variant.cut_segments:  # the same arrays, sampled as before ReplayBuffer.whole_segments (the fresh pairs are whole)
        rb = copy.copy(rb)
        rb.WHOLE_SEGMENT_DRAWS = 0
    prefs = sac_rlhf.PreferenceBuffer(args.segment_length, rb.obs.shape[1] + rb.actions.shape[1], rb.physics_states.shape[1])
    rows, fit_cpu, fit_wall, adam_steps, asked = [], 0.0, 0.0, 0, 0
    for session, count in enumerate(session_sizes(opts.budgets, opts.session_size)):
        asked += count
        # The first session samples uniformly (an untrained ensemble's disagreement carries no information), as the run does.
        idx, mask = sac_rlhf.select_queries(
            "uniform" if session == 0 else strategy, model, rb, count, args.segment_length, args.preference_sampling_pool_factor, rng, "cpu"
        )
        segments = rb.gather_segments(idx, mask)
        labels, _ = teacher.label(segments, session + 1)
        answered = ~np.isnan(labels)
        arrays = [segments[name][answered] for name in ("obs_actions", "masks", "true_rewards", "physics_states")]
        prefs.add(*arrays, labels[answered], np.zeros(int(answered.sum()), dtype=bool), session)
        cpu, wall = time.process_time(), time.perf_counter()
        model, optimizer, args, stats = fit_session(model, optimizer, prefs, rb, args, variant, rng, training, session)
        fit_cpu, fit_wall = fit_cpu + time.process_time() - cpu, fit_wall + time.perf_counter() - wall
        adam_steps += stats["epochs"] * math.ceil(len(prefs) / args.reward_net_batch_size)
        if asked in opts.budgets:  # measured after the session that reaches a budget
            row = {
                "labels": asked,
                "answered": len(prefs),
                "sessions": session + 1,
                "epochs": stats["epochs"],
                "adam_steps": adam_steps,
            }
            row |= {"fit_cpu_s": fit_cpu, "fit_wall_s": fit_wall, "pseudo_labels": stats["pseudo_labels"]}
            row["label_error"] = label_error(prefs)
            row |= selection_stats(stats)
            row["train_acc"] = sac_rlhf.preference_accuracy(model, prefs, np.arange(len(prefs)), "cpu")
            for name, data in evals.items():
                suffix = "" if name == "same" else "_latest"
                row |= {f"{key}{suffix}": value for key, value in measure(model, data).items()}
            rows.append(row)
    return rows


# ----------------------------------------------------------------------------------------
# The benchmark
# ----------------------------------------------------------------------------------------
METRICS = ["acc", "acc_latest", "r_step", "rho_step", "r_seg", "rho_seg", "r_step_latest", "rho_seg_latest", "train_acc"]
METRICS += ["label_error", "labels_trusted", "labels_dropped", "labels_flipped"]
COSTS = ["epochs", "adam_steps", "fit_cpu_s"]
COLUMNS = ["env", "stage", "sess", "strategy", "teacher", "variant", "labels", "seeds", "acc", "acc_min", "acc_max", "d_acc", "acc_latest", "d_acc_latest", "r_step"]  # fmt: skip
COLUMNS += [
    "rho_step",
    "r_seg",
    "rho_seg",
    "r_step_latest",
    "train_acc",
    "label_error",
    "labels_trusted",
    "labels_dropped",
    "labels_flipped",
]
COLUMNS += ["epochs", "adam_steps", "fit_cpu_s"]


def median(values: list[float]) -> float:
    values = [v for v in values if v is not None and not math.isnan(v)]
    return statistics.median(values) if values else float("nan")


def summarise(trials: list[dict]) -> list[dict]:
    """Medians over seeds per (env, stage, session size, strategy, teacher, variant, labels), with acc's range over
    seeds (acc_min, acc_max); d_acc and d_acc_latest pair each seed with default's under the same teacher."""
    groups: dict[tuple, list[dict]] = {}
    for trial in trials:
        teacher = trial.get("teacher", "oracle")  # trials from before the teacher axis: the oracle's
        for row in trial["rows"]:
            key = (trial["env"], trial["stage"], trial["session_size"], trial["strategy"], teacher, trial["variant"], row["labels"])
            groups.setdefault(key, []).append({**row, "seed": trial["seed"]})
    table = []
    for key, rows in groups.items():
        env, stage, session_size, strategy, teacher, variant, labels = key
        summary = {"env": env, "stage": stage, "sess": session_size, "strategy": strategy, "teacher": teacher, "variant": variant}
        summary |= {"labels": labels, "seeds": len(rows)}
        for name in METRICS + COSTS + ["fit_wall_s"]:
            summary[name] = median([r.get(name, float("nan")) for r in rows])
        summary["acc_min"], summary["acc_max"] = min(r["acc"] for r in rows), max(r["acc"] for r in rows)
        default = {r["seed"]: r for r in groups.get((env, stage, session_size, strategy, teacher, "default", labels), [])}
        for name in ("acc", "acc_latest"):
            summary[f"d_{name}"] = median([r[name] - default[r["seed"]][name] for r in rows if r["seed"] in default])
        table.append(summary)
    order = {name: i for i, name in enumerate(VARIANTS)}
    return sorted(
        table,
        key=lambda r: (
            r["env"],
            r["stage"],
            r["sess"],
            r["strategy"],
            r["labels"],
            teacher_order(r["teacher"]),
            order.get(r["variant"], 99),
        ),
    )


def teacher_order(name: str) -> tuple:
    """oracle, then mistake<eps> by eps, then beta<b> by decreasing b (less rational last)."""
    settings = teacher_settings(name)
    if not settings:
        return (0, 0.0)
    return (1, settings["teacher_eps_mistake"]) if "teacher_eps_mistake" in settings else (2, -settings["teacher_beta"])


def noise_table(table: list[dict]) -> list[dict]:
    """One row per (env, labels, teacher), one column per variant: its median acc over seeds with the range."""
    rows: dict[tuple, dict] = {}
    for r in table:
        row = rows.setdefault(
            (r["env"], r["strategy"], r["labels"], r["teacher"]), {"env": r["env"], "labels": r["labels"], "teacher": r["teacher"]}
        )
        row["label_error"] = r["label_error"] if r["variant"] == "default" else row.get("label_error", r["label_error"])
        row[r["variant"]] = f"{r['acc']:.3f} ({r['acc_min']:.3f}-{r['acc_max']:.3f})"
    return list(rows.values())


def trial_key(
    env_id: str, stage: int, strategy: str, variant: str, seed: int, session_size: int, budgets: list[int], teacher: str = "oracle"
) -> tuple:
    return env_id, stage, strategy, variant, seed, session_size, tuple(sorted(budgets)), teacher


def run_benchmark(opts) -> None:
    torch.set_num_threads(opts.threads)
    unknown = [v for v in opts.variants if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; `python bench/reward_learning.py variants` lists them")
    variants = opts.variants if "default" in opts.variants else ["default", *opts.variants]  # the reference, always
    output, tmp = Path(opts.output), Path(f"{opts.output}.tmp")
    output.parent.mkdir(parents=True, exist_ok=True)  # a new <benchmark>/<question>/ folder of bench/results
    earlier = json.loads((tmp if tmp.exists() else output).read_text()) if opts.resume and (tmp.exists() or output.exists()) else {}
    trials, commands = earlier.get("trials", []), earlier.get("commands", [])
    commands.append(" ".join(["python", "bench/reward_learning.py", *sys.argv[1:]]))
    done = {
        trial_key(t["env"], t["stage"], t["strategy"], t["variant"], t["seed"], t["session_size"], t["budgets"], t.get("teacher", "oracle"))
        for t in trials
    }
    for name in opts.teachers:
        teacher_settings(name)  # an unknown teacher fails before any trial
    buffers_info = {}
    for env_id in opts.envs:
        stages = stage_buffers(env_id)
        if opts.stage not in stages:
            raise SystemExit(
                f"no {opts.stage}-step buffer for {env_id}: python bench/reward_learning.py buffers --envs {env_id} --stages {opts.stage}"
            )
        rb = load_buffer(stages[opts.stage])
        latest_stage = max(stages)
        latest = load_buffer(stages[latest_stage])
        window = slice_buffer(latest, slice(max(0, latest.size - opts.latest_window), None))
        evals = {
            "same": EvalSet.from_buffer(rb, opts.eval_pairs, opts.eval_segment_length, (EVAL_SEED, opts.stage)),
            "latest": EvalSet.from_buffer(window, opts.eval_pairs, opts.eval_segment_length, (EVAL_SEED, latest_stage, 1)),
        }
        buffers_info[env_id] = {
            "train": {"path": str(stages[opts.stage].relative_to(REPO)), "transitions": rb.size, "true_reward_mean": float(rb.true_rewards[: rb.size].mean())},
            "latest": {"path": str(stages[latest_stage].relative_to(REPO)), "window": window.size, "true_reward_mean": float(window.true_rewards[: window.size].mean())},
        }  # fmt: skip
        for strategy, teacher in [(s, t) for s in opts.strategies for t in opts.teachers]:
            for seed in opts.seeds:  # every variant of a seed before the next seed: an interrupted run stays paired
                for variant in variants:
                    if trial_key(env_id, opts.stage, strategy, variant, seed, opts.session_size, opts.budgets, teacher) in done:
                        continue
                    start = time.perf_counter()
                    rows = run_trial(rb, evals, strategy, VARIANTS[variant], seed, opts, teacher)
                    trial = {"env": env_id, "stage": opts.stage, "strategy": strategy, "teacher": teacher, "variant": variant, "seed": seed}
                    trial |= {"session_size": opts.session_size, "budgets": sorted(opts.budgets), "wall_s": time.perf_counter() - start}
                    trials.append(trial | {"rows": rows})
                    accs = " ".join(f"{r['labels']}:{r['acc']:.3f}/{r['acc_latest']:.3f}" for r in rows)
                    print(
                        f"{env_id} {strategy} {teacher} {variant} seed {seed}: acc/acc_latest {accs} ({time.perf_counter() - start:.0f} s)",
                        flush=True,
                    )
                    tmp.parent.mkdir(parents=True, exist_ok=True)
                    tmp.write_text(json.dumps({"commands": commands, "buffers": buffers_info, "trials": trials}))
    table = summarise(trials)
    measured = [name for name in VARIANTS if any(t["variant"] == name for t in trials)]
    print()
    print_table(table, COLUMNS)
    if len({r["teacher"] for r in table}) > 1 or any(r["teacher"] != "oracle" for r in table):
        print("\nfresh-pair accuracy against the true reward, median over seeds (min-max); label_error: the labels' own error rate")
        pivot = noise_table(table)
        print_table(pivot, ["env", "labels", "teacher", "label_error", *[v for v in VARIANTS if any(v in r for r in pivot)]])
    settings = {k: v for k, v in vars(opts).items() if k != "func"}
    payload = {
        "benchmark": "reward_learning",
        "commands": commands,  # with --resume, every command that added trials
        "machine": machine_info(),
        "settings": settings | {"torch_threads": opts.threads, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS")},
        "args_defaults": dataclasses.asdict(sac_rlhf.Args()),
        "variants": {name: VARIANTS[name].description for name in measured},
        "variant_settings": {name: VARIANTS[name].args for name in measured},
        "buffers": earlier.get("buffers", {}) | buffers_info,
        "medians": table,
        "trials": trials,
    }
    write_json(output, payload)
    tmp.unlink(missing_ok=True)


# ----------------------------------------------------------------------------------------
# Replay: a finished run's own labels, session by session
# ----------------------------------------------------------------------------------------
def load_run(folder: Path) -> tuple[dict, ReplayBuffer]:
    """(checkpoint, replay buffer) of a sac_rlhf.py checkpoint folder (models/<run>/latest)."""
    checkpoint_file, buffer_file = folder / "checkpoint.pt", folder / "replay_buffer.npz"
    if not checkpoint_file.is_file() or not buffer_file.is_file():
        raise SystemExit(f"--runs {folder}: no checkpoint.pt and replay_buffer.npz there (a sac_rlhf.py run's models/<run>/latest)")
    checkpoint = torch.load(checkpoint_file, map_location="cpu", weights_only=False)
    if "preference_buffer" not in checkpoint:
        raise SystemExit(f"--runs {folder}: {checkpoint['args'].get('exp_name')} keeps no labels; replay needs a sac_rlhf.py run")
    return checkpoint, load_buffer(buffer_file)


def replay_trial(checkpoint: dict, full: ReplayBuffer, data: EvalSet, variant: Variant, seed: int) -> list[dict]:
    """The run's labels, in the sessions it got them (their global steps), each session fitted as sac_rlhf.py fits
    it with the run's reward-model settings, its defence replaced by the variant's, on the replay buffer as it stood
    then; after every session a row measured on `data` (fresh pairs of the run's final buffer)."""
    pebble = sac_rlhf.Args.__dataclass_fields__  # the run's own settings; its defence's are replaced by the variant's
    recorded = {name: value for name, value in checkpoint["args"].items() if name in pebble}
    args = variant_args(variant, **recorded | {"seed": seed})
    torch.manual_seed(seed)  # ensemble initialisation and train_reward_model's shuffles
    rng = np.random.default_rng(seed)  # SURF's unlabelled pairs and the warm start's rows
    model, optimizer = new_model(variant, args, full)
    training = reward_training(variant, args)
    stored = checkpoint["preference_buffer"]
    prefs = sac_rlhf.PreferenceBuffer(args.segment_length, full.obs.shape[1] + full.actions.shape[1], full.physics_states.shape[1])
    rows = []
    for session, step in enumerate(np.unique(stored["global_steps"])):
        new = stored["global_steps"] == step
        fields = ("obs_actions", "masks", "true_rewards", "physics_states", "labels", "heldout")
        prefs.add(*(np.asarray(stored[name])[new] for name in fields), int(step))
        then = slice_buffer(full, slice(0, rows_before_step(full, int(step))))
        model, optimizer, args, stats = fit_session(model, optimizer, prefs, then, args, variant, rng, training, session)
        row = {
            "session": session + 1,
            "step": int(step),
            "labels": len(prefs),
            "epochs": stats["epochs"],
            "label_error": label_error(prefs),
        }
        row |= selection_stats(stats)
        rows.append(row | measure(model, data))
    return rows


REPLAY_SELECTION = ("flipped", "flipped_wrong", "dropped_wrong", "trusted_wrong")
"""rime's last selection in a replay's table (medians over seeds): the share flipped, the teacher's error rate among
the labels flipped, dropped and trusted (labels_<name> in a fit's stats)"""


def replay_runs(opts) -> None:
    torch.set_num_threads(opts.threads)
    unknown = [v for v in opts.variants if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; `python bench/reward_learning.py variants` lists them")
    trials, runs_info, table = [], {}, []
    for folder in opts.runs:
        checkpoint, full = load_run(folder)
        data = EvalSet.from_buffer(full, opts.eval_pairs, opts.eval_segment_length, (EVAL_SEED, full.size))
        recorded = checkpoint["args"]
        run = checkpoint["run_name"]
        defence = defence_name(recorded, sac_rlhf_rime.Args.rime_flip_tau)
        runs_info[run] = {
            "folder": str(folder), "env_id": recorded["env_id"], "seed": recorded["seed"], "robust_labels": defence_of(recorded),
            "teacher_eps_mistake": recorded.get("teacher_eps_mistake"), "teacher_beta": recorded.get("teacher_beta"),
            "labels": int(len(checkpoint["preference_buffer"]["labels"])), "transitions": full.size,
        }  # fmt: skip
        for variant in opts.variants:
            per_seed = []
            for seed in opts.seeds:
                start = time.perf_counter()
                rows = replay_trial(checkpoint, full, data, VARIANTS[variant], seed)
                trials.append({"run": run, "variant": variant, "seed": seed, "wall_s": time.perf_counter() - start, "rows": rows})
                per_seed.append(rows)
                accuracies = " ".join(f"{row['acc']:.2f}" for row in rows)
                print(f"{run} {variant} seed {seed}: acc per session {accuracies}", flush=True)
            summary = {"run": run, "labels_of": f"{defence}, seed {recorded['seed']}", "variant": variant}
            for session_rows in zip(*per_seed):
                summary[f"s{session_rows[0]['session']}"] = round(median([row["acc"] for row in session_rows]), 3)
            last = [rows[-1] for rows in per_seed]
            summary |= {"acc_min": min(row["acc"] for row in last), "acc_max": max(row["acc"] for row in last)}
            summary |= {"r_step": median([row["r_step"] for row in last]), "epochs": median([row["epochs"] for row in last])}
            for name in REPLAY_SELECTION:
                summary[name] = median([row.get(f"labels_{name}", float("nan")) for row in last])
            table.append(summary)
    print("\nfresh-pair accuracy on each run's final buffer after every session (s1, s2, ...), median over seeds; the range,")
    print("the per-step correlation r_step and the epochs of the last session's fit; with rime, the share it flipped in that")
    print("fit's last epoch and the teacher's error rate among the labels it flipped, dropped and trusted\n")
    sessions = sorted({key for row in table for key in row if key[0] == "s" and key[1:].isdigit()}, key=lambda key: int(key[1:]))
    print_table(table, ["labels_of", "variant", *sessions, "acc_min", "acc_max", "r_step", "epochs", *REPLAY_SELECTION])
    payload = {
        "benchmark": "reward_learning_replay",
        "command": " ".join(["python", "bench/reward_learning.py", *sys.argv[1:]]),
        "machine": machine_info(),
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(opts).items() if k not in ("func", "runs")}
        | {"runs": [str(folder) for folder in opts.runs]},
        "runs": runs_info,
        "variants": {name: VARIANTS[name].description for name in opts.variants},
        "variant_settings": {name: VARIANTS[name].args for name in opts.variants},
        "medians": table,
        "trials": trials,
    }
    write_json(Path(opts.output), payload)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)

    buffers = commands.add_parser("buffers", help="create the fixed replay buffers (sac.py on the true reward)")
    buffers.add_argument("--envs", nargs="+", default=ENVS)
    buffers.add_argument("--stages", nargs="+", type=int, default=[10_000, 30_000], help="environment steps of each stage")
    buffers.add_argument("--seed", type=int, default=1)
    buffers.add_argument("--force", action="store_true", help="run sac.py again even when its buffer exists")
    buffers.set_defaults(func=make_buffers)

    listing = commands.add_parser("variants", help="list the variants")
    listing.set_defaults(func=lambda _: print("\n".join(f"{name:12} {v.description}" for name, v in VARIANTS.items())))

    run = commands.add_parser("run", help="fit and measure reward models")
    run.add_argument("--envs", nargs="+", default=ENVS)
    run.add_argument("--stage", type=int, default=10_000, help="the buffer to draw labels from (environment steps)")
    run.add_argument("--budgets", nargs="+", type=int, default=[25, 50, 100, 200])
    run.add_argument("--session-size", type=int, default=25, help="labels per session (budgets cut sessions short)")
    run.add_argument("--strategies", nargs="+", default=["uniform", "disagree"], choices=["uniform", "disagree", "entropy"])
    run.add_argument("--variants", nargs="+", default=["default", "epochs50", "surf-off", "reinit"], help="`default` always runs")
    run.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    run.add_argument(
        "--teachers", nargs="+", default=["oracle"],
        help="the synthetic teacher's noise: oracle, mistake<eps> (--teacher-eps-mistake eps), beta<b> (--teacher-beta b)",
    )  # fmt: skip
    run.add_argument("--eval-pairs", type=int, default=1000)
    run.add_argument("--eval-segment-length", type=int, default=50, help="fresh pairs' length, whatever the variant's")
    run.add_argument("--latest-window", type=int, default=10_000, help="the latest policy's data: last transitions of the longest buffer")
    run.add_argument("--threads", type=int, default=1, help="torch threads (the scripts' --torch-threads default)")
    run.add_argument("--output", default=str(results_path("reward_learning", "reward-learning", "fixed-buffers")))
    run.add_argument("--resume", action="store_true", help="keep the trials of <output>.tmp (or of a finished <output>) and add to them")
    run.set_defaults(func=run_benchmark)

    replay = commands.add_parser("replay", help="fit the variants on finished runs' own labels, session by session")
    replay.add_argument(
        "--runs", nargs="+", type=Path, required=True,
        help="sac_rlhf.py checkpoint folders (models/<run>/latest): their labels in the sessions they came, their replay buffer",
    )  # fmt: skip
    replay.add_argument("--variants", nargs="+", default=["default", "rime", "rime-nowarm"], help="`default`: no defence")
    replay.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    replay.add_argument("--eval-pairs", type=int, default=1000)
    replay.add_argument("--eval-segment-length", type=int, default=50)
    replay.add_argument("--threads", type=int, default=1, help="torch threads (the scripts' --torch-threads default)")
    replay.add_argument("--output", default=str(results_path("reward_learning", "reward-learning", "replay")))
    replay.set_defaults(func=replay_runs)

    opts = parser.parse_args()
    opts.func(opts)


if __name__ == "__main__":
    main()
