# PEBBLE: SAC trained only from preferences (Lee et al. 2021, https://arxiv.org/abs/2106.05091)
# with SURF (Park et al. 2022) and RUNE (Liang et al. 2022), in CleanRL's single-file style.
#
# Read top to bottom: the settings, SAC (networks and update), the preference-learning block (reward
# ensemble, query selection, preference buffer, synthetic teacher, feedback schedule, reward training, SURF,
# k-NN exploration, RUNE) and finally `main`, which is PEBBLE's algorithm box:
#   1. random steps, then unsupervised exploration with a state-entropy reward,
#   2. at every feedback session: select pairs of segments, ask the teacher, fit the reward model,
#      relabel the replay buffer, reset the critic after exploration,
#   3. SAC on the learned reward (plus RUNE's uncertainty bonus) between sessions.
#
# Environments, the replay buffer, the feedback-server client, checkpoints and logging are infrastructure,
# imported from cleanrlhf_utils. The preference-learning block is a deliberate copy of pref_ppo.py's (one
# file = one algorithm); tests/test_lockstep.py fails when one copy changes without the other.
import contextlib
import functools
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

import gymnasium as gym
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from cleanrlhf_utils import envs as cleanrlhf_envs
from cleanrlhf_utils.buffers import PendingRewards, ReplayBuffer
from cleanrlhf_utils.checkpoints import (
    CheckpointArgs,
    checkpoint_file,
    earlier_wall_seconds,
    load_checkpoint,
    load_optimizer,
    load_training_state,
    save_checkpoint,
    training_state,
    validate_checkpoint_args,
)
from cleanrlhf_utils.cli import RunInterrupted, cli
from cleanrlhf_utils.envs import (
    autoreset_pending,
    capture_env_state,
    check_env_id,
    get_physics_state,
    physics_state_size,
    restore_env_state,
)
from cleanrlhf_utils.errors import (
    ConfigError,  # noqa: F401 (callers catch sac_rlhf.ConfigError)
    need,
    need_flag,
)
from cleanrlhf_utils.evaluate import evaluate_and_log
from cleanrlhf_utils.feedback import (
    FeedbackArgs,
    FeedbackSession,
    FileTeacher,
    LabelLog,
    Teacher,
    connect_human_teacher,
    need_no_teacher,
    record_labels,
    validate_feedback_args,
)
from cleanrlhf_utils.objectives import Objective, apply_objective, check_objective, load_objective, segment_rewards, step_rewards
from cleanrlhf_utils.presets import PresetArgs
from cleanrlhf_utils.stopping import stop_between_steps, stop_here_if_requested
from cleanrlhf_utils.tracking import (
    AGENT_MEASURES,
    RecentMeans,
    announce_run,
    default_run_name,
    log_feedback_session,
    progress_bar,
    public_settings,
    run_summary,
    start_logging,
    stop_logging,
    write_summary,
)
from cleanrlhf_utils.training import RunningMoments, frozen, outputs_copied, seed_everything


@dataclass
class SACArgs:
    """Settings shared with the true-reward baseline sac.py (experiment, SAC, evaluation)."""

    # --- experiment ---
    exp_name: str = "sac_rlhf"
    """the name of this experiment (part of the run name)"""
    run_name: str | None = None
    """outputs go to runs/, models/ and videos/<run_name>; default: <env>__<exp>__<seed>__<time>"""
    seed: int = 1
    """seed of the experiment (environments, networks, buffer sampling; a synthetic teacher uses seed+1)"""
    torch_deterministic: bool = True
    """if toggled, `torch.backends.cudnn.deterministic=True`"""
    cuda: bool = True
    """if toggled, cuda will be used when available"""
    torch_threads: int = 1
    """torch's intra-op threads on the CPU: one is fastest for these network sizes, most of all on a shared machine
    (measured: 10x faster than torch's default on 2 busy cores); 0 keeps torch's default"""
    compile: bool = False
    """torch.compile the SAC update and acting (the first updates wait about a minute for the compiler); results
    equal eager's up to floating-point rounding. For a GPU: on a CPU it measured 40 % slower than eager (torch 2.13)"""
    cudagraphs: bool = False
    """replay the compiled update and acting as CUDA graphs (a CUDA GPU only; implies --compile)"""
    track: bool = False
    """if toggled, this experiment will be tracked with Weights and Biases"""
    wandb_project_name: str = "CleanRLHF"
    """the wandb's project name"""
    wandb_entity: str | None = None
    """the entity (team) of wandb's project"""
    progress_bar: bool = True
    """show a progress bar over the environment steps"""
    capture_video: bool = False
    """write mp4 videos of evaluation episodes to videos/<run_name>/"""
    render_mode: Literal["human", "rgb_array"] | None = None
    """render the training environment live (`human`); cannot be combined with --capture-video"""
    video_width: int = 320
    """width of rendered frames (videos and re-rendered segments)"""
    video_height: int = 240
    """height of rendered frames (videos and re-rendered segments)"""

    # --- environment and SAC (CleanRL's defaults) ---
    env_id: str = "Hopper-v5"
    """the id of the environment (any Gymnasium MuJoCo id or dm_control/<domain>-<task>-v0; framework/working_envs.md lists them)"""
    terminate_when_unhealthy: bool = True
    """end an episode when the robot falls (Hopper, Walker2d, Ant, Humanoid); --no-terminate-when-unhealthy keeps it
    running so a person can teach what the default termination forbids (a salto, raising one leg)"""
    terminate_when_tilted: bool = True
    """with --terminate-when-unhealthy, also end an episode when the torso tilts past Gymnasium's healthy angle (Hopper
    0.2 rad, Walker2d 1 rad); --no-terminate-when-tilted ends it on a fall (torso height) only, so a flip goes on"""
    total_timesteps: int = 1_000_000
    """total environment steps"""
    buffer_size: int = 1_000_000
    """the replay memory buffer size (capped at total_timesteps)"""
    gamma: float = 0.99
    """the discount factor gamma"""
    tau: float = 0.005
    """target smoothing coefficient"""
    batch_size: int = 256
    """the batch size of sample from the replay memory"""
    learning_starts: int = 1000
    """steps of uniformly random actions before SAC starts updating"""
    policy_lr: float = 3e-4
    """the learning rate of the policy network optimizer"""
    q_lr: float = 1e-3
    """the learning rate of the Q network optimizer"""
    policy_frequency: int = 2
    """the frequency of training policy (delayed)"""
    target_network_frequency: int = 1
    """the frequency of updates for the target networks"""
    alpha: float = 0.2
    """entropy regularization coefficient (initial value when autotuned)"""
    autotune: bool = True
    """automatic tuning of the entropy coefficient"""
    actor_hidden_dim: int = 256
    """width of the actor's hidden layers"""
    actor_hidden_layers: int = 2
    """number of hidden layers of the actor"""
    critic_hidden_dim: int = 256
    """width of the critics' hidden layers"""
    critic_hidden_layers: int = 2
    """number of hidden layers of the critics"""

    # --- evaluation and checkpoints ---
    evaluation_frequency: int = 10_000
    """environment steps between evaluations (0: only at the end)"""
    evaluation_episodes: int = 5
    """episodes per evaluation (deterministic actions, distinct seeds)"""


@dataclass
class PreferenceArgs:
    """Settings of preference learning (identical in sac_rlhf.py and pref_ppo.py)."""

    # --- unsupervised exploration (PEBBLE) ---
    unsupervised_exploration: bool = True
    """pre-train with the state-entropy intrinsic reward before asking for feedback"""
    total_explore_steps: int = 10_000
    """environment steps of exploration before the first feedback session (PrefPPO: the first iteration that reaches it)"""
    explore_knn_k: int = 5
    """k of the k-nearest-neighbour state-entropy estimate"""
    explore_knn_sample_size: int = 2048
    """number of buffer states the k-NN distances are measured against"""

    # --- reward model ---
    reward_ensemble_size: int = 3
    """number of members of the reward-model ensemble"""
    reward_net_hidden_dim: int = 256
    """width of the reward networks' hidden layers"""
    reward_net_hidden_layers: int = 3
    """number of hidden layers of each reward network"""
    reward_net_dropout: float = 0.0
    """dropout during reward-model training (predictions always run in eval mode)"""
    reward_net_normalize_inputs: bool = False
    """standardise (obs, action) with the replay buffer's mean and std, refreshed before every session's training
    (the DMC run scripts turn it on: it helped on walker-walk and hurt on Hopper, bench/reward_learning.py)"""
    reward_net_lr: float = 3e-4
    """learning rate of the reward model"""
    reward_net_batch_size: int = 128
    """labelled pairs per reward-model batch"""
    reward_net_epochs: int = 100
    """maximum epochs of reward-model training per feedback session"""
    reward_net_target_accuracy: float = 0.97
    """stop a session's reward training once training accuracy reaches this"""
    reward_net_heldout_fraction: float = 0.1
    """human and file mode: fraction of the labels held out (never trained on) to measure validation accuracy; it
    costs labels. A synthetic teacher's labels all train the model (see --heldout-fresh-pairs)"""
    heldout_fresh_pairs: int = 1000
    """synthetic teacher: held-out accuracy is measured on this many fresh pairs of the current replay buffer labelled
    by the true reward, which cost no label of the budget"""
    relabel_chunk_size: int = 1024
    """transitions per chunk when relabelling the replay buffer (or predicting a PrefPPO rollout's rewards); 1024 keeps
    the activations in cache: 10.5 CPU-s per million transitions against 19.1 at 65536 (bench/relabel.py)"""
    reward_standardize: bool = False
    """standardise the learned reward the agent trains on: after every relabel (each feedback session), the mean and
    std of the replay buffer's relabelled rewards are measured and every learned reward (and RUNE's std) is divided
    into that scale, zero mean and unit std, until the next session refits them (checkpointed: a resume continues
    exactly). The reward model's own scale is set by nothing but the labels (tanh outputs summed over segments), so
    without it SAC's temperature and the critic meet a different scale after every session (bench/reward_gap.py).
    Centring also removes the learned reward's offset, which in an env that ends episodes on a fall pays for staying
    alive: on Walker2d-v5 it lowered every seed (docs/benchmarks/findings.md)"""
    reward_standardize_center: bool = True
    """with --reward-standardize: subtract the mean as well as divide by the std. --no-reward-standardize-center
    divides by the std only and keeps the learned reward's mean (its offset, in units of its spread), so that only the
    scale changes: on Walker2d-v5 it lengthened the episodes and left the median at 0.30 x SAC (docs/benchmarks/findings.md)"""

    # --- feedback ---
    teacher_feedback_schedule: Literal["linear", "exponential"] = "exponential"
    """`linear`: every session asks the same number of queries; `exponential`: earlier sessions ask more"""
    teacher_feedback_total_queries: int = 1000
    """total number of queries over the run (human mode, unless given: 100)"""
    teacher_feedback_num_queries_per_session: int = 100
    """queries per session (the average under the exponential schedule; human mode, unless given: 10)"""
    teacher_feedback_exponential_decay: float = 0.8
    """ratio between consecutive sessions' query counts under the exponential schedule"""
    teacher_feedback_frequency: int = 10_000
    """environment steps between feedback sessions (PrefPPO: a session runs after the rollout that reaches its step)"""
    segment_length: int = 50
    """steps per segment shown to the teacher"""
    preference_sampling: Literal["uniform", "disagree", "entropy"] = "disagree"
    """how pairs are selected from the candidate pool"""
    preference_sampling_pool_factor: int = 10
    """candidate pool size = factor x queries (disagree/entropy)"""
    teacher_beta: float = -1.0
    """rationality: >= 0 draws the label from the Bradley-Terry probability with this temperature; < 0 is perfectly
    rational (two segments worth exactly the same: a tie, 0.5)"""
    teacher_gamma: float = 1.0
    """myopic discount: step t of a segment of length L weighs gamma^(L-1-t)"""
    teacher_eps_mistake: float = 0.0
    """probability of flipping a (non-tie) label"""
    teacher_eps_skip: float = 0.0
    """skip a pair when neither return exceeds this fraction of the average segment return"""
    teacher_eps_equal: float = 0.0
    """label a tie when the returns differ by less than this fraction of the average segment return"""
    teacher_objective: str = ""
    """what the synthetic teacher prefers instead of the env's reward: a built-in objective (hopper-backflip,
    ant-raise-leg, halfcheetah-backward, windmill-clockwise, windmill-counterclockwise) or your own `module:function`
    (cleanrlhf_utils/objectives.py documents the signature); evaluations log eval/objective_return beside the env's
    return. Human and file mode only measure it (human: people's agreement with it per session as
    feedback/objective_agreement, each pair's objective returns in runs/<run>/shown_pairs.jsonl). Empty: the env's reward"""

    # --- SURF ---
    surf: bool = True
    """semi-supervised reward learning with temporal cropping (SURF)"""
    unlabeled_batch_ratio: int = 1
    """unlabelled (pseudo-labelled) pairs per labelled pair in a batch"""
    surf_sampling_strategy: Literal["uniform", "disagree", "entropy"] = "uniform"
    """how unlabelled pairs are drawn from the replay buffer"""
    surf_tau: float = 0.999
    """confidence threshold of the ensemble-mean preference for a pseudo-label"""
    lambda_ssl: float = 0.1
    """weight of the pseudo-label loss"""
    max_augmentation_offset: int = 10
    """cropped segments are at least segment_length - max_augmentation_offset long"""
    min_augmentation_offset: int = 5
    """cropped segments are at most segment_length - min_augmentation_offset long"""

    # --- QPA (Hu et al. 2024): queries aligned with the current policy ---
    qpa_query_episodes: int = 0
    """policy-aligned queries: draw query segments from the last N episodes only (0: the whole buffer; QPA: 10)"""
    qpa_hybrid_ratio: float = 0.0
    """hybrid experience replay (SAC): this share of every batch comes from the last --qpa-query-episodes episodes
    while feedback sessions remain (QPA: 0.5)"""
    qpa_augmentations: int = 0
    """each labelled pair also trains as this many random sub-crops per epoch, one window length for both segments
    of a pair, inside them (QPA: 20)"""

    # --- RUNE ---
    rune: bool = False
    """add RUNE's exploration bonus: beta_t x std of the ensemble's reward"""
    rune_beta: float = 0.05
    """initial weight beta_0 of the RUNE bonus"""
    rune_beta_decay: float = 0.0001
    """beta_t = beta_0 (1 - decay)^t, t = environment step (PrefPPO: at the start of the rollout)"""

    # --- noisy teachers: robust reward learning ---
    robust_labels: Literal["none", "smooth", "rime"] = "none"
    """how reward learning treats labels that may be wrong: `none`, the plain Bradley-Terry loss; `smooth`, a
    mistake-aware likelihood that expects --robust-label-epsilon of the labels flipped; `rime`, RIME's sample
    selection (Cheng et al. 2024): every epoch the labels the ensemble finds plausible train as given, implausible
    ones train flipped, the rest sit the epoch out (RIME's warm start on the exploration reward: --rime-warm-start-steps)"""
    robust_label_epsilon: float = 0.1
    """`smooth`: the share of flipped labels the loss expects, in [0, 0.5): P(label) = (1 - eps) sigmoid(R1 - R0) +
    eps sigmoid(R0 - R1); 0 is the plain loss"""
    rime_alpha: float = 0.5
    """`rime`: a label trains as given while its loss is below -ln(rho) + alpha rho + min(beta_t s, 3), rho and s the
    running maximum and std of the trusted labels' loss (RIME's bound on a corrupted label's loss: alpha = 0.5)"""
    rime_beta_max: float = 3.0
    """`rime`: beta_t of the trust threshold's uncertainty term at the first epoch, falling linearly to
    --rime-beta-min over --rime-beta-decay-epochs reward-model epochs (all sessions together)"""
    rime_beta_min: float = 1.0
    """`rime`: beta_t once --rime-beta-decay-epochs epochs have trained"""
    rime_beta_decay_epochs: int = 60
    """`rime`: reward-model epochs over which beta_t falls from --rime-beta-max to --rime-beta-min (RIME, DMC: 60)"""
    rime_flip_tau: float = 0.001
    """`rime`: a label trains flipped when the ensemble gives it a probability below this (its loss above -ln tau)"""
    rime_warm_start_steps: int = 0
    """`rime`: Adam steps (256 transitions per member each) fitting the reward model to the k-NN state-entropy reward
    of the replay buffer before the first session's labels train it. 0 (none) by default; RIME's is 1000, which on
    walker-walk made the first selections flip correct labels (docs/benchmarks/findings.md, noisy teachers)"""


def validate_preference_args(args) -> None:
    """The settings of preference learning (the PreferenceArgs both algorithm scripts carry), the teacher's and
    the checkpoints'."""
    at_least = {
        "buffer_size": 1, "teacher_feedback_total_queries": 0, "teacher_feedback_num_queries_per_session": 1,
        "teacher_feedback_frequency": 1, "segment_length": 2, "preference_sampling_pool_factor": 1, "reward_ensemble_size": 1,
        "relabel_chunk_size": 1, "unlabeled_batch_ratio": 0, "explore_knn_k": 1, "heldout_fresh_pairs": 1,
        "qpa_query_episodes": 0, "qpa_augmentations": 0,
    }  # fmt: skip
    for name, low in at_least.items():
        need_flag(args, name, lambda value, low=low: value >= low, f">= {low}")
    need_flag(args, "teacher_feedback_exponential_decay", lambda value: 0 < value <= 1, "in (0, 1]")
    for name in ("reward_net_dropout", "reward_net_heldout_fraction"):
        need_flag(args, name, lambda value: 0 <= value < 1, "in [0, 1)")
    for name in ("teacher_eps_mistake", "teacher_eps_skip", "teacher_eps_equal", "teacher_gamma"):
        need_flag(args, name, lambda value: 0 <= value <= 1, "in [0, 1]")
    need_flag(args, "surf_tau", lambda value: 0.5 < value < 1, "in (0.5, 1)")
    need_flag(args, "qpa_hybrid_ratio", lambda value: 0 <= value <= 1, "in [0, 1]")
    need(
        args.reward_standardize or args.reward_standardize_center,
        "--no-reward-standardize-center acts only with --reward-standardize: add --reward-standardize or drop it",
    )
    need_flag(args, "robust_label_epsilon", lambda value: 0 <= value < 0.5, "in [0, 0.5)")
    need_flag(args, "rime_flip_tau", lambda value: 0 < value < 0.5, "in (0, 0.5)")
    for name in ("rime_alpha", "rime_beta_min", "rime_warm_start_steps"):
        need_flag(args, name, lambda value: value >= 0, ">= 0")
    need_flag(args, "rime_beta_decay_epochs", lambda value: value >= 1, ">= 1")
    need(
        args.rime_beta_min <= args.rime_beta_max,
        f"--rime-beta-min ({args.rime_beta_min}) must be <= --rime-beta-max ({args.rime_beta_max})",
    )
    need(
        args.qpa_hybrid_ratio == 0 or args.qpa_query_episodes > 0,
        f"--qpa-hybrid-ratio {args.qpa_hybrid_ratio} needs --qpa-query-episodes N (the episodes it replays), got 0",
    )
    need(
        0 <= args.min_augmentation_offset <= args.max_augmentation_offset,
        f"--min-augmentation-offset ({args.min_augmentation_offset}) must be >= 0 and <= --max-augmentation-offset ({args.max_augmentation_offset})",
    )
    need(
        args.max_augmentation_offset < args.segment_length,
        f"--max-augmentation-offset ({args.max_augmentation_offset}) must be smaller than --segment-length ({args.segment_length})",
    )
    need(
        args.rune_beta >= 0 and 0 <= args.rune_beta_decay < 1,
        f"--rune-beta must be >= 0 and --rune-beta-decay in [0, 1), got {args.rune_beta} and {args.rune_beta_decay}",
    )
    apply_objective(args)  # sets what the objective needs (e.g. no unhealthy termination), refuses what contradicts it
    validate_feedback_args(args)
    validate_checkpoint_args(args)


@dataclass
class FrozenRewardArgs:
    """SAC on another run's learned reward, frozen: the middle run of bench/reward_gap.py's decomposition (sac_rlhf.py
    only: PrefPPO learns on-policy, and has no such comparison to make)."""

    reward_model_from: str | None = None
    """SAC on a frozen learned reward: load the reward model of another run's checkpoint (models/<run>/latest or its
    checkpoint.pt; same env, same observation and action sizes) and train on it alone, never updating it and asking no
    teacher (no feedback sessions; the label flags are ignored). Exploration is skipped: like sac.py, the run takes
    --learning-starts random steps, then SAC learns from the first step's reward, so that it differs from sac.py in
    the reward only (bench/reward_gap.py). Evaluations are on the true return, and log the model's reward_model/
    metrics on this run's buffer"""


@dataclass
class AgentResetArgs:
    """Starting SAC afresh when a feedback session changes the learned reward a lot (sac_rlhf.py only: PrefPPO keeps
    no replay buffer whose rewards a session could be compared on)."""

    reset_agent_below_correlation: float = -1.0
    """after each feedback session past the first, re-initialise the actor, the critics and the temperature (with
    fresh optimisers) when the replay buffer's learned rewards after the session's relabel correlate (Pearson) below
    this with the same transitions' rewards before it. An agent settled on what an early reward model paid for can
    stay there once the model changes its mind (the primacy bias, Nikishin et al. 2022); a fresh one learns the new
    reward from the whole buffer. Every session logs the correlation as feedback/reward_change_correlation and the
    resets so far as feedback/agent_resets; -1 (default): never reset"""


@dataclass
class Args(AgentResetArgs, FrozenRewardArgs, CheckpointArgs, FeedbackArgs, PreferenceArgs, SACArgs, PresetArgs):
    """PEBBLE's settings: SAC's, preference learning's, the teacher's (cleanrlhf_utils.feedback.FeedbackArgs),
    checkpoints' (cleanrlhf_utils.checkpoints.CheckpointArgs), the --preset they start from (cleanrlhf_utils.presets), a
    frozen reward's (FrozenRewardArgs) and when to start SAC afresh (AgentResetArgs)."""


def validate_sac_args(args: SACArgs) -> None:
    need(args.total_timesteps > 0, f"--total-timesteps must be positive, got {args.total_timesteps}")
    need(args.learning_starts >= 1, f"--learning-starts must be >= 1, got {args.learning_starts}")
    need(
        args.evaluation_frequency >= 0 and args.evaluation_episodes >= 1,
        f"--evaluation-frequency must be >= 0 and --evaluation-episodes >= 1, got {args.evaluation_frequency} and {args.evaluation_episodes}",
    )
    need(
        not (args.capture_video and args.render_mode == "human"),
        "--capture-video cannot be combined with --render-mode human (choose one)",
    )
    need(
        not args.cudagraphs or (args.cuda and torch.cuda.is_available()),
        "--cudagraphs needs a CUDA GPU, and torch sees none here (or --no-cuda was given): drop --cudagraphs",
    )
    check_env_id(args.env_id)


def validate_args(args: Args) -> None:
    validate_sac_args(args)
    validate_preference_args(args)
    need_flag(args, "reset_agent_below_correlation", lambda value: -1 <= value <= 1, "in [-1, 1] (-1: never reset)")
    need(
        args.explore_knn_sample_size >= args.explore_knn_k,
        f"--explore-knn-sample-size must be >= --explore-knn-k ({args.explore_knn_k}), got {args.explore_knn_sample_size}",
    )
    if args.reward_model_from is not None:
        checkpoint_file(args.reward_model_from, "--reward-model-from")
        need_no_teacher(args, "--reward-model-from", "trains on a frozen reward")
        need(not args.exploration_load, "--reward-model-from skips exploration: drop --exploration-load")
        need(not args.reward_standardize, "--reward-standardize refits at feedback sessions, which a frozen reward has none of")
        need(
            args.reset_agent_below_correlation == -1.0,
            "--reset-agent-below-correlation compares the rewards of feedback sessions, which a frozen reward has none of",
        )
    elif args.unsupervised_exploration:
        need(
            args.total_explore_steps >= args.learning_starts,
            f"--total-explore-steps ({args.total_explore_steps}) must be >= --learning-starts ({args.learning_starts})",
        )


def check_sac_actions(env_id: str, space: gym.Space) -> None:
    """SAC squashes a Gaussian into the action bounds: it needs a continuous (Box), bounded action space."""
    need(
        isinstance(space, gym.spaces.Box),
        f"--env-id {env_id} has a {type(space).__name__} action space; SAC needs a continuous (Box) one",
    )
    bounds = np.abs(np.concatenate([space.low.ravel(), space.high.ravel()]))
    need(
        bool(np.all(bounds < 1e6)),
        f"--env-id {env_id} has unbounded actions (bounds up to {bounds.max():.0e}); SAC squashes actions into finite bounds",
    )


def make_env(
    env_id: str,
    seed: int,
    render_mode: str | None = None,
    width: int = 320,
    height: int = 240,
    terminate_when_unhealthy: bool = True,
    terminate_when_tilted: bool = True,
):
    """cleanrlhf_utils' environment, refused unless SAC can act in it."""
    return cleanrlhf_envs.make_env(
        env_id, seed, render_mode, width, height, terminate_when_unhealthy, check_sac_actions, terminate_when_tilted=terminate_when_tilted
    )


# ----------------------------------------------------------------------------------------
# Networks. Ensembles (twin critics, reward members) are one batched network.
# ----------------------------------------------------------------------------------------
class EnsembleLinear(nn.Module):
    """`members` independent linear layers evaluated with one batched matmul: (E, N, in) -> (E, N, out)."""

    def __init__(self, members: int, in_features: int, out_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(members, in_features, out_features))
        self.bias = nn.Parameter(torch.empty(members, 1, out_features))
        bound = 1 / math.sqrt(in_features)  # nn.Linear's default initialisation, per member
        nn.init.uniform_(self.weight, -bound, bound)
        nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.baddbmm(self.bias, x, self.weight)


def ensemble_mlp(members: int, in_dim: int, hidden_dim: int, hidden_layers: int, out_dim: int, activation=nn.ReLU, dropout: float = 0.0):
    layers, width = [], in_dim
    for _ in range(hidden_layers):
        layers += [EnsembleLinear(members, width, hidden_dim), activation()]
        if dropout > 0:
            layers.append(nn.Dropout(dropout))
        width = hidden_dim
    layers.append(EnsembleLinear(members, width, out_dim))
    return nn.Sequential(*layers)


class TwinQNetwork(nn.Module):
    """SAC's two critics as one 2-member batched network; returns Q values of shape (2, B)."""

    def __init__(self, obs_dim: int, action_dim: int, hidden_dim: int = 256, hidden_layers: int = 2):
        super().__init__()
        self.net = ensemble_mlp(2, obs_dim + action_dim, hidden_dim, hidden_layers, 1)

    def forward(self, obs: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
        x = torch.cat([obs, action], dim=-1)
        return self.net(x.unsqueeze(0).expand(2, -1, -1)).squeeze(-1)


class Actor(nn.Module):
    log_std_min, log_std_max = -5, 2  # the policy's log standard deviation lies in this range

    def __init__(self, obs_dim: int, action_low: np.ndarray, action_high: np.ndarray, hidden_dim: int = 256, hidden_layers: int = 2):
        super().__init__()
        layers, width = [], obs_dim
        for _ in range(hidden_layers):
            layers += [nn.Linear(width, hidden_dim), nn.ReLU()]
            width = hidden_dim
        self.trunk = nn.Sequential(*layers)
        action_dim = int(np.prod(action_low.shape))
        self.fc_mean = nn.Linear(width, action_dim)
        self.fc_logstd = nn.Linear(width, action_dim)
        self.register_buffer("action_scale", torch.tensor((action_high - action_low) / 2.0, dtype=torch.float32))
        self.register_buffer("action_bias", torch.tensor((action_high + action_low) / 2.0, dtype=torch.float32))

    def forward(self, x):
        x = self.trunk(x)
        mean = self.fc_mean(x)
        log_std = torch.tanh(self.fc_logstd(x))
        log_std = self.log_std_min + 0.5 * (self.log_std_max - self.log_std_min) * (log_std + 1)  # From SpinUp / Denis Yarats
        return mean, log_std

    def get_action(self, x):
        mean, log_std = self(x)
        std = log_std.exp()
        normal = torch.distributions.Normal(mean, std)
        x_t = normal.rsample()  # reparameterisation trick
        y_t = torch.tanh(x_t)
        action = y_t * self.action_scale + self.action_bias
        log_prob = normal.log_prob(x_t)
        # Enforcing the action bound of the squashed Gaussian
        log_prob -= torch.log(self.action_scale * (1 - y_t.pow(2)) + 1e-6)
        log_prob = log_prob.sum(1, keepdim=True)
        mean = torch.tanh(mean) * self.action_scale + self.action_bias
        return action, log_prob, mean

    def deterministic_action(self, x):
        """The squashed mean action; draws no random numbers, so evaluation leaves training's RNG alone."""
        mean, _ = self(x)
        return torch.tanh(mean) * self.action_scale + self.action_bias


def adam(params, lr: float, args: SACArgs) -> torch.optim.Adam:
    """Adam on one fused kernel per tensor instead of a dozen element-wise ops (measured: 9 % of an update's CPU time
    at one thread). Compiled, inductor fuses the plain (foreach) Adam itself; CUDA graphs need its state on the GPU."""
    if args.compile or args.cudagraphs:
        return torch.optim.Adam(params, lr=lr, foreach=True, capturable=args.cudagraphs)
    return torch.optim.Adam(params, lr=lr, fused=True)


class SACAgent:
    """Actor, twin critics with targets, and the (autotuned) entropy coefficient."""

    def __init__(self, obs_dim: int, action_space: gym.spaces.Box, args: SACArgs, device: torch.device):
        self.args, self.device = args, device
        self.obs_dim, self.action_dim = obs_dim, int(np.prod(action_space.shape))
        self.actor = Actor(obs_dim, action_space.low, action_space.high, args.actor_hidden_dim, args.actor_hidden_layers).to(device)
        self.actor_optimizer = adam(self.actor.parameters(), args.policy_lr, args)
        self.reset_critic()
        self.target_entropy = -float(self.action_dim)
        self.log_alpha = torch.full((1,), math.log(args.alpha), requires_grad=args.autotune, device=device)
        if args.autotune:
            self.alpha_optimizer = adam([self.log_alpha], args.q_lr, args)
        # What runs every step, compiled with --compile (fused kernels) and replayed as CUDA graphs with --cudagraphs.
        self.critic_step, self.actor_step, self.policy = self._critic_step, self._actor_step, self.actor.get_action
        if args.compile or args.cudagraphs:
            torch._inductor.config.fallback_random = True  # eager's random numbers: compiling keeps a run's results
            mode = "reduce-overhead" if args.cudagraphs else None
            self.critic_step = torch.compile(self._critic_step, mode=mode)
            self.actor_step = torch.compile(self._actor_step, mode=mode)
            self.policy = torch.compile(self.actor.get_action, mode=mode)
        if args.cudagraphs:
            self.critic_step, self.actor_step = outputs_copied(self.critic_step), outputs_copied(self.actor_step)

    def reset_critic(self) -> None:
        """PEBBLE re-initialises the critic after exploration: its values were for the intrinsic reward."""
        self.qf = TwinQNetwork(self.obs_dim, self.action_dim, self.args.critic_hidden_dim, self.args.critic_hidden_layers).to(self.device)
        self.qf_target = TwinQNetwork(self.obs_dim, self.action_dim, self.args.critic_hidden_dim, self.args.critic_hidden_layers).to(
            self.device
        )
        self.qf_target.load_state_dict(self.qf.state_dict())
        self.q_optimizer = adam(self.qf.parameters(), self.args.q_lr, self.args)
        self.qf_params, self.qf_target_params = list(self.qf.parameters()), list(self.qf_target.parameters())

    @property
    def alpha(self) -> torch.Tensor:
        return self.log_alpha.exp().detach()

    def act(self, obs: np.ndarray) -> np.ndarray:
        """Actions sampled from the policy for a batch of observations."""
        with torch.no_grad():
            actions, _, _ = self.policy(torch.as_tensor(obs, dtype=torch.float32, device=self.device))
        return actions.cpu().numpy()

    def update(self, obs, actions, rewards, next_obs, terminated, global_step: int) -> dict:
        args = self.args
        stats = self.critic_step(obs, actions, rewards, next_obs, terminated)
        if global_step % args.policy_frequency == 0:  # TD3-style delayed update, compensated
            for _ in range(args.policy_frequency):
                stats |= self.actor_step(obs)
        if global_step % args.target_network_frequency == 0:
            with torch.no_grad():
                torch._foreach_lerp_(self.qf_target_params, self.qf_params, args.tau)
        stats["alpha"] = self.alpha
        return stats

    def _critic_step(self, obs, actions, rewards, next_obs, terminated) -> dict:
        with torch.no_grad():
            next_actions, next_log_pi, _ = self.actor.get_action(next_obs)
            next_q = self.qf_target(next_obs, next_actions).min(0).values - self.alpha * next_log_pi.squeeze(1)
            target_q = rewards + (1 - terminated) * self.args.gamma * next_q
        q_values = self.qf(obs, actions)
        qf_losses = ((q_values - target_q) ** 2).mean(1)
        qf_loss = qf_losses.sum()
        self.q_optimizer.zero_grad()
        qf_loss.backward()
        self.q_optimizer.step()
        return {
            "qf1_values": q_values[0].mean().detach(),
            "qf2_values": q_values[1].mean().detach(),
            "qf1_loss": qf_losses[0].detach(),
            "qf2_loss": qf_losses[1].detach(),
            "qf_loss": qf_loss.detach() / 2.0,
        }

    def _actor_step(self, obs) -> dict:
        pi, log_pi, _ = self.actor.get_action(obs)
        log_pi = log_pi.squeeze(1)
        with frozen(self.qf):  # the actor's gradient flows through the critics, whose own step is done
            min_q_pi = self.qf(obs, pi).min(0).values
        actor_loss = (self.alpha * log_pi - min_q_pi).mean()
        self.actor_optimizer.zero_grad()
        actor_loss.backward()
        self.actor_optimizer.step()
        stats = {"actor_loss": actor_loss.detach(), "policy_entropy": -log_pi.detach().mean()}  # over the batch
        if self.args.autotune:
            # The log-probabilities of this step's actions (before its update) stand in for a second actor forward
            # pass on fresh noise: the same estimate of the policy's entropy, for a third of the actor step's cost.
            alpha_loss = (-self.log_alpha.exp() * (log_pi.detach() + self.target_entropy)).mean()
            self.alpha_optimizer.zero_grad()
            alpha_loss.backward()
            self.alpha_optimizer.step()
            stats["alpha_loss"] = alpha_loss.detach()
        return stats

    def state_dict(self) -> dict:
        state = {
            "actor": self.actor.state_dict(),
            "qf": self.qf.state_dict(),
            "qf_target": self.qf_target.state_dict(),
            "actor_optimizer": self.actor_optimizer.state_dict(),
            "q_optimizer": self.q_optimizer.state_dict(),
            "log_alpha": self.log_alpha.detach().clone(),
        }
        if self.args.autotune:
            state["alpha_optimizer"] = self.alpha_optimizer.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        self.actor.load_state_dict(state["actor"])
        self.qf.load_state_dict(state["qf"])
        self.qf_target.load_state_dict(state["qf_target"])
        load_optimizer(self.actor_optimizer, state["actor_optimizer"])
        load_optimizer(self.q_optimizer, state["q_optimizer"])
        with torch.no_grad():
            self.log_alpha.copy_(state["log_alpha"])
        if self.args.autotune:
            load_optimizer(self.alpha_optimizer, state["alpha_optimizer"])


# ----------------------------------------------------------------------------------------
# Preference learning (a deliberate copy in sac_rlhf.py and pref_ppo.py: tests/test_lockstep.py)
# The reward model: an ensemble of MLPs on (obs, action), trained with Bradley-Terry
# ----------------------------------------------------------------------------------------
class RewardEnsemble(nn.Module):
    """r_e(s, a) for every member e in one batched network; outputs lie in (-1, 1) (tanh, as PEBBLE)."""

    def __init__(self, input_dim: int, ensemble_size: int = 3, hidden_dim: int = 256, hidden_layers: int = 3, dropout: float = 0.0):
        super().__init__()
        self.ensemble_size = ensemble_size
        self.net = ensemble_mlp(ensemble_size, input_dim, hidden_dim, hidden_layers, 1, activation=nn.LeakyReLU, dropout=dropout)
        # Identity until set_input_statistics: raw inputs generalised worse to the policy's later data (reward_learning bench)
        self.register_buffer("input_mean", torch.zeros(input_dim))
        self.register_buffer("input_std", torch.ones(input_dim))

    def set_input_statistics(self, rows: np.ndarray) -> None:
        """Standardise inputs with the mean and std of `rows` (N, D); constant columns are only centred."""
        std = rows.std(0)
        self.input_mean.copy_(torch.as_tensor(rows.mean(0)))
        self.input_std.copy_(torch.as_tensor(np.where(std > 1e-6, std, 1.0)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (..., D) shared by all members, or (E, ..., D) one input per member. Returns (E, ...)."""
        return self._forward(x.unsqueeze(0).expand(self.ensemble_size, *x.shape))

    def forward_members(self, x: torch.Tensor) -> torch.Tensor:
        """x: (E, ..., D), member e sees x[e]. Returns (E, ...)."""
        return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape[:-1]
        out = self.net(((x - self.input_mean) / self.input_std).reshape(self.ensemble_size, -1, x.shape[-1]))
        return torch.tanh(out).reshape(shape)


def bradley_terry_loss(returns: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of P(segment 1 > segment 0) = sigmoid(R1 - R0) against labels in {0, 0.5, 1}.

    returns: (..., 2) summed predicted rewards; labels: (...) with 1 = segment 1 preferred, 0.5 = tie.
    Averaged over pairs (and members)."""
    return F.binary_cross_entropy_with_logits(returns[..., 1] - returns[..., 0], labels)


def mistake_aware_loss(returns: torch.Tensor, labels: torch.Tensor, epsilon: float) -> torch.Tensor:
    """bradley_terry_loss for a teacher that flips a share `epsilon` of its labels (--robust-labels smooth): the
    label's likelihood is P = (1 - eps) sigmoid(R1 - R0) + eps sigmoid(R0 - R1), so that a pair the model is sure of
    costs at most -ln(eps) when its label is wrong. epsilon = 0 is bradley_terry_loss itself."""
    if epsilon == 0:
        return bradley_terry_loss(returns, labels)
    logits = returns[..., 1] - returns[..., 0]
    floor, scale = math.log(epsilon), math.log1p(-2 * epsilon)  # P = eps + (1 - 2 eps) sigmoid, in log space
    log_second = torch.logaddexp(torch.full_like(logits, floor), scale + F.logsigmoid(logits))
    log_first = torch.logaddexp(torch.full_like(logits, floor), scale + F.logsigmoid(-logits))
    return -(labels * log_second + (1 - labels) * log_first).mean()


def preference_probabilities(model: RewardEnsemble, segments: torch.Tensor, masks: torch.Tensor, chunk: int = 10) -> torch.Tensor:
    """P_e(segment 1 > segment 0) for each member: segments (N, 2, L, D), masks (N, 2, L) -> (E, N). Scored `chunk`
    pairs at a time: a query pool in one pass held (E, N*2*L, hidden) activations, over 1 GB at 1000 pairs, and
    about 1000 rows a pass is also the fastest (bench/relabel.py)."""
    with torch.no_grad():
        returns = torch.cat([(model(s) * m).sum(-1) for s, m in zip(segments.split(chunk), masks.split(chunk))], dim=1)
    return torch.sigmoid(returns[..., 1] - returns[..., 0])


def disagreement_scores(probabilities: torch.Tensor) -> torch.Tensor:
    """Std across members of P(segment 1 > segment 0): (E, N) -> (N,)."""
    return probabilities.std(0, unbiased=False)


def entropy_scores(probabilities: torch.Tensor) -> torch.Tensor:
    """Entropy of the ensemble-mean two-way preference: highest for pairs at the decision boundary."""
    p = probabilities.mean(0).clamp(1e-7, 1 - 1e-7)
    return -(p * p.log() + (1 - p) * (1 - p).log())


def predict_rewards(model: RewardEnsemble, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Ensemble mean and std of r(s, a) for x (N, D), in eval mode (no dropout noise)."""
    was_training = model.training
    model.eval()
    with torch.no_grad():
        rewards = model(x)
    model.train(was_training)
    return rewards.mean(0), rewards.std(0, unbiased=False)


def relabel_replay_buffer(model: RewardEnsemble, rb: ReplayBuffer, device: torch.device, chunk_size: int = 1024) -> None:
    """Recompute learned reward (ensemble mean) and RUNE's std for every stored transition."""
    for start in range(0, rb.size, chunk_size):
        idx = np.arange(start, min(start + chunk_size, rb.size))
        mean, std = predict_rewards(model, torch.as_tensor(rb.obs_actions(idx), device=device))
        rb.learned_rewards[idx], rb.reward_std[idx] = mean.cpu().numpy(), std.cpu().numpy()


class RewardStandardizer:
    """--reward-standardize: the learned reward in the scale the agent trains on, zero mean and unit std over the
    replay buffer's rewards as the last relabel gave them (with `center` off, unit std only: the mean stays, divided
    by the std). Refitted after every relabel; new transitions take the last fit until the next. Its two numbers are
    checkpointed, so a resumed run standardises as the uninterrupted one."""

    def __init__(self, center: bool = True):
        self.center = center
        self.mean, self.std = 0.0, 1.0

    def refit(self, rb: ReplayBuffer) -> None:
        """Fit to the buffer's freshly relabelled rewards (the model's own scale) and standardise them in place."""
        rewards = rb.learned_rewards[: rb.size].astype(np.float64)
        std = float(rewards.std())
        self.mean = float(rewards.mean()) if self.center else 0.0
        self.std = std if std > 1e-8 else 1.0  # a constant reward is not scaled
        rb.learned_rewards[: rb.size], rb.reward_std[: rb.size] = self(rb.learned_rewards[: rb.size], rb.reward_std[: rb.size])

    def __call__(self, mean: np.ndarray, std: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The ensemble's mean and std of r(s, a), as the model predicts them, in the standardised scale."""
        return ((mean - self.mean) / self.std).astype(np.float32), (std / self.std).astype(np.float32)

    def state_dict(self) -> dict:
        return {"mean": self.mean, "std": self.std}

    def load_state_dict(self, state: dict) -> None:
        self.mean, self.std = float(state["mean"]), float(state["std"])


def judged_rewards(rb: ReplayBuffer, objective: Objective | None) -> np.ndarray:
    """The per-step reward the teacher judges by, for every slot of the replay buffer: the env's, or with
    --teacher-objective the objective's (each step alone, as sac.py --reward-objective trains on it; in human mode the
    intent the people are measured against). The reward model's accuracy and correlations are measured against it: a
    backflip's labels say nothing of Hopper's forward reward, and the windmill's is 0 everywhere."""
    if objective is None:
        return rb.true_rewards
    judged = np.zeros_like(rb.true_rewards)
    judged[: rb.size] = step_rewards(objective, rb.obs[: rb.size], rb.actions[: rb.size], rb.physics_states[: rb.size])
    return judged


def reward_correlation(rb: ReplayBuffer, recent: int = 10_000, truth: np.ndarray | None = None) -> float:
    """Pearson correlation of learned and true reward (`truth`, per buffer slot: judged_rewards; default the env's)
    over the most recent transitions."""
    n = min(recent, rb.size)
    idx = (rb.pos - 1 - np.arange(n)) % rb.capacity
    learned, true = rb.learned_rewards[idx], (rb.true_rewards if truth is None else truth)[idx]
    if n < 2 or learned.std() == 0 or true.std() == 0:
        return float("nan")
    return float(np.corrcoef(learned, true)[0, 1])


def segment_correlation(rb: ReplayBuffer, pairs: int, length: int, rng: np.random.Generator, truth: np.ndarray | None = None) -> float:
    """Pearson correlation of learned and true returns of 2 x `pairs` random segments of `length` steps, drawn from the
    whole replay buffer as query pairs are: what the labels constrain, where reward_correlation compares single steps.
    A model that ranks segments well can still spread the reward over the steps inside them in another shape."""
    if rb.size < 2:
        return float("nan")
    idx, mask = rb.sample_segment_pairs(pairs, length, rng)
    true_rewards = rb.true_rewards if truth is None else truth
    learned, true = ((rb.learned_rewards[idx] * mask).sum(-1).ravel(), (true_rewards[idx] * mask).sum(-1).ravel())
    if learned.std() == 0 or true.std() == 0:
        return float("nan")
    return float(np.corrcoef(learned, true)[0, 1])


def reward_scale(rb: ReplayBuffer, truth: np.ndarray | None = None) -> dict:
    """Mean and std of the learned reward over the replay buffer as the agent trains on it (after --reward-standardize,
    0 and 1), and of the true reward: the scale SAC's temperature alpha weighs the policy's entropy against."""
    learned, true = rb.learned_rewards[: rb.size], (rb.true_rewards if truth is None else truth)[: rb.size]
    if rb.size == 0:
        return dict.fromkeys(("learned_reward_mean", "learned_reward_std", "true_reward_mean", "true_reward_std"), float("nan"))
    return {
        "learned_reward_mean": float(learned.mean()), "learned_reward_std": float(learned.std()),
        "true_reward_mean": float(true.mean()), "true_reward_std": float(true.std()),
    }  # fmt: skip


# --- Preference buffer: the labelled segments themselves, never indices into the replay buffer ---
class PreferenceBuffer:
    FIELDS = ("obs_actions", "masks", "true_rewards", "physics_states", "labels", "heldout", "global_steps")

    def __init__(self, segment_length: int, input_dim: int, state_dim: int):
        self.obs_actions = np.zeros((0, 2, segment_length, input_dim), dtype=np.float32)
        self.masks = np.zeros((0, 2, segment_length), dtype=bool)
        self.true_rewards = np.zeros((0, 2, segment_length), dtype=np.float32)
        self.physics_states = np.zeros((0, 2, segment_length, state_dim), dtype=np.float64)
        self.labels = np.zeros(0, dtype=np.float32)  # 1 = segment 1 preferred, 0.5 = tie
        self.heldout = np.zeros(0, dtype=bool)  # validation split, never trained on
        self.global_steps = np.zeros(0, dtype=np.int64)  # when the label was obtained

    def __len__(self) -> int:
        return len(self.labels)

    def add(self, obs_actions, masks, true_rewards, physics_states, labels, heldout, global_step: int) -> None:
        new = {
            "obs_actions": obs_actions, "masks": masks, "true_rewards": true_rewards, "physics_states": physics_states,
            "labels": labels, "heldout": heldout, "global_steps": np.full(len(labels), global_step, dtype=np.int64),
        }  # fmt: skip
        for name, values in new.items():
            setattr(self, name, np.concatenate([getattr(self, name), values.astype(getattr(self, name).dtype)]))

    def split(self, heldout: bool) -> np.ndarray:
        return np.flatnonzero(self.heldout == heldout)

    def state_dict(self) -> dict:
        return {name: getattr(self, name) for name in self.FIELDS}

    def load_state_dict(self, state: dict) -> None:
        for name in self.FIELDS:
            setattr(self, name, np.asarray(state[name]))


def preference_accuracy(model: RewardEnsemble, prefs: PreferenceBuffer, indices: np.ndarray, device, chunk: int = 256) -> float:
    """Agreement of the ensemble-mean preference with the non-tie labels at `indices`."""
    indices = indices[prefs.labels[indices] != 0.5]
    if len(indices) == 0:
        return float("nan")
    was_training = model.training
    model.eval()
    correct = 0
    for start in range(0, len(indices), chunk):
        batch = indices[start : start + chunk]
        segs = torch.as_tensor(prefs.obs_actions[batch], device=device)
        masks = torch.as_tensor(prefs.masks[batch], device=device, dtype=torch.float32)
        probs = preference_probabilities(model, segs, masks).mean(0).cpu().numpy()
        correct += int(((probs > 0.5) == (prefs.labels[batch] > 0.5)).sum())
    model.train(was_training)
    return correct / len(indices)


# --- Query selection: uniform, disagreement, entropy ---
def select_queries(
    strategy: str,
    model: RewardEnsemble,
    rb: ReplayBuffer,
    num_queries: int,
    segment_length: int,
    pool_factor: int,
    rng: np.random.Generator,
    device,
    recent_episodes: int = 0,
) -> tuple[np.ndarray, np.ndarray]:
    """Indices (num_queries, 2, L) and masks of the pairs to ask about, from the last `recent_episodes` episodes
    only when it is set (QPA)."""
    pool = num_queries if strategy == "uniform" else num_queries * pool_factor
    idx, mask = rb.sample_segment_pairs(pool, segment_length, rng, recent_episodes)
    if strategy == "uniform":
        return idx, mask
    was_training = model.training
    model.eval()
    segments = torch.as_tensor(rb.obs_actions(idx), device=device)
    probs = preference_probabilities(model, segments, torch.as_tensor(mask, device=device, dtype=torch.float32))
    model.train(was_training)
    scores = disagreement_scores(probs) if strategy == "disagree" else entropy_scores(probs)
    top = torch.topk(scores, num_queries).indices.cpu().numpy()
    return idx[top], mask[top]


def session_pairs(number: int, schedule: list[int], model: RewardEnsemble, rb: ReplayBuffer, args, rng, device) -> dict:
    """Feedback session `number`'s pairs (rb.gather_segments), chosen by the reward model as it stands. The first
    session samples uniformly: an untrained ensemble's disagreement carries no information."""
    strategy = "uniform" if number == 1 else args.preference_sampling
    idx, mask = select_queries(
        strategy, model, rb, schedule[number - 1], args.segment_length, args.preference_sampling_pool_factor, rng, device,
        args.qpa_query_episodes,
    )  # fmt: skip
    return rb.gather_segments(idx, mask)


# --- Teachers: synthetic (B-Pref, Lee et al. 2021), people in the browser, or an earlier run's labels ---
class SyntheticTeacher(Teacher):
    """Labels pairs from the true reward, with B-Pref's irrationalities. Its own seeded RNG. With a replay
    buffer, the skip and tie thresholds follow its average true reward, as B-Pref's do. With an `objective`
    (--teacher-objective), the objective's rewards of the pairs replace the true reward, thresholds following
    their average over the session's segments."""

    labels_are_free = True  # held-out accuracy is measured on fresh pairs, not on labels of the budget

    def __init__(
        self,
        beta: float,
        gamma: float,
        eps_mistake: float,
        eps_skip: float,
        eps_equal: float,
        seed: int,
        rb: ReplayBuffer | None = None,
        objective: Objective | None = None,
    ):
        self.objective = objective
        self.beta, self.gamma = beta, gamma
        self.eps_mistake, self.eps_skip, self.eps_equal = eps_mistake, eps_skip, eps_equal
        self.rng = np.random.default_rng(seed)
        self.threshold_skip = self.threshold_equal = 0.0
        self.rb = rb

    def set_margin(self, average_segment_return: float) -> None:
        """Thresholds are fractions of the average true return of a segment (segment length x mean reward)."""
        self.threshold_skip = self.eps_skip * average_segment_return
        self.threshold_equal = self.eps_equal * average_segment_return

    def label(self, segments: dict, session: int) -> tuple[np.ndarray, list[str]]:
        if self.objective is not None:  # one vectorised call over the session's segments
            true_rewards = segment_rewards(self.objective, segments, self.rb.obs.shape[-1])
            self.set_margin(true_rewards.shape[-1] * float(true_rewards.sum() / max(1, segments["masks"].sum())))
            return self.label_true_rewards(true_rewards), ["synthetic"] * len(true_rewards)
        true_rewards = segments["true_rewards"]
        if self.rb is not None:
            self.set_margin(true_rewards.shape[-1] * float(self.rb.true_rewards[: self.rb.size].mean()))
        return self.label_true_rewards(true_rewards), ["synthetic"] * len(true_rewards)

    def label_true_rewards(self, true_rewards: np.ndarray) -> np.ndarray:
        """true_rewards (N, 2, L), zero on masked steps -> labels (N,): 1 = segment 1 preferred,
        0 = segment 0, 0.5 = tie, nan = skipped."""
        returns = true_rewards.sum(-1)
        length = true_rewards.shape[-1]
        weights = self.gamma ** np.arange(length - 1, -1, -1)  # the last step weighs most
        discounted = (true_rewards * weights).sum(-1)
        diff = discounted[:, 1] - discounted[:, 0]
        if self.beta >= 0:
            p_second = 1.0 / (1.0 + np.exp(-self.beta * diff))
            labels = (self.rng.random(len(diff)) < p_second).astype(np.float32)
        else:  # a perfect teacher prefers neither of two segments worth the same: a tie, not "the first one"
            labels = np.where(diff == 0, 0.5, diff > 0).astype(np.float32)
        flip = self.rng.random(len(labels)) < self.eps_mistake
        labels[flip] = 1.0 - labels[flip]
        if self.eps_equal > 0:
            labels[np.abs(returns[:, 1] - returns[:, 0]) < self.threshold_equal] = 0.5
        if self.eps_skip > 0:
            labels[returns.max(1) < self.threshold_skip] = np.nan
        return labels

    def state_dict(self) -> dict:
        return {"rng": self.rng.bit_generator.state}

    def load_state_dict(self, state: dict) -> None:
        self.rng.bit_generator.state = state["rng"]


def make_teacher(args: Args, rb: ReplayBuffer, run_name: str, run_dir: Path, video_dir: Path):
    """The one place the feedback mode is read. Every teacher answers label(segments, session) -> (labels,
    annotators) and has state_dict/load_state_dict (for checkpoints) and close. --teacher-objective is checked on
    the run's shapes here; only the synthetic teacher labels by it (people and a file are only measured by it)."""
    objective = load_objective(args.teacher_objective)
    if objective is not None:
        check_objective(objective, rb.obs.shape[-1], rb.actions.shape[-1], rb.physics_states.shape[-1])
    if args.teacher_feedback_mode == "human":  # people's answers are only measured against the objective
        measure = None if objective is None else lambda segments: segment_rewards(objective, segments, rb.obs.shape[-1]).sum(-1)
        return connect_human_teacher(args, run_name, run_dir, video_dir / "clips", measure)
    if args.teacher_feedback_mode == "file":
        return FileTeacher(args.feedback_file)
    eps = (args.teacher_eps_mistake, args.teacher_eps_skip, args.teacher_eps_equal)
    return SyntheticTeacher(args.teacher_beta, args.teacher_gamma, *eps, seed=args.seed + 1, rb=rb, objective=objective)


def show_reward_model(teacher, model: RewardEnsemble, rb: ReplayBuffer, args: Args, rng: np.random.Generator, device, step: int) -> None:
    """Human mode: a few clips with the reward model's predicted return, which people see ranked on the page's
    reward view and can compare with their own ranking."""
    if not teacher.people_answer or args.feedback_check_clips == 0:
        return
    idx, mask = rb.sample_segment_pairs(args.feedback_check_clips, args.segment_length, rng)
    idx, mask = idx[:, 0], mask[:, 0]
    mean, _ = predict_rewards(model, torch.as_tensor(rb.obs_actions(idx), device=device))
    teacher.show_reward_check(rb.physics_states[idx], mask, (mean.cpu().numpy() * mask).sum(-1), step)


# --- Feedback schedule ---
def feedback_schedule(total_queries: int, queries_per_session: int, kind: str, decay: float = 0.8) -> list[int]:
    """Queries per session; the counts add up to total_queries exactly (largest-remainder rounding)."""
    if total_queries == 0:
        return []
    sessions = math.ceil(total_queries / queries_per_session)
    weights = np.ones(sessions) if kind == "linear" else decay ** np.arange(sessions)
    shares = weights / weights.sum() * total_queries
    counts = np.floor(shares).astype(int)
    remainder = total_queries - counts.sum()
    counts[np.argsort(-(shares - counts), kind="stable")[:remainder]] += 1
    return [int(c) for c in counts if c > 0]


# --- Noisy teachers: RIME's sample selection and warm start (Cheng et al. 2024) ---
class LabelFilter:
    """RIME's selection of the labels an epoch trains on (--robust-labels rime), with the state it carries across
    epochs and sessions. A label whose loss under the ensemble-mean preference is below the trust threshold
    -ln(rho) + alpha rho + min(beta_t s, 3) trains as given (RIME bounds a corrupted label's loss from below by
    -ln(rho) + rho / 2, rho the largest loss of a clean one); one whose loss is above -ln(tau) (the ensemble gives it
    a probability below tau) trains flipped; the rest sit the epoch out. rho and s are running estimates (rate 0.1)
    of the maximum and std of the trusted labels' loss; beta_t falls linearly with the epochs, so that the threshold
    is lenient while the model is young. rho starts at 0: the first epoch trusts every label it does not flip."""

    RATE = 0.1  # of the running estimates, as RIME's
    UNCERTAINTY_CAP = 3.0  # of beta_t s, as RIME's code

    def __init__(self):
        self.loss_max, self.loss_std, self.epochs, self.warm_started = 0.0, 0.0, 0, False

    def thresholds(self, args: Args) -> tuple[float, float]:
        """(trust below, flip above) for the next selection."""
        progress = min(1.0, self.epochs / args.rime_beta_decay_epochs)
        beta = args.rime_beta_max + (args.rime_beta_min - args.rime_beta_max) * progress
        uncertainty = min(beta * self.loss_std, self.UNCERTAINTY_CAP)
        return -math.log(self.loss_max + 1e-8) + args.rime_alpha * self.loss_max + uncertainty, -math.log(args.rime_flip_tau)

    def select(self, probabilities: torch.Tensor, labels: torch.Tensor, args: Args) -> tuple[torch.Tensor, torch.Tensor]:
        """Masks (trusted, flipped) of the labels (N,) given the ensemble-mean P(segment 1 > segment 0) (N,) of their
        pairs; updates the running estimates with the trusted labels' losses and counts the epoch."""
        losses = F.binary_cross_entropy(probabilities.clamp(1e-7, 1 - 1e-7), labels, reduction="none")
        trust_below, flip_above = self.thresholds(args)
        flipped = losses > flip_above
        trusted = (losses < trust_below) & ~flipped
        if trusted.any():
            kept = losses[trusted]
            self.loss_max += self.RATE * (float(kept.max()) - self.loss_max)
            self.loss_std += self.RATE * (float(kept.std(unbiased=False)) - self.loss_std)
        self.epochs += 1
        return trusted, flipped

    def state_dict(self) -> dict:
        return {"loss_max": self.loss_max, "loss_std": self.loss_std, "epochs": self.epochs, "warm_started": self.warm_started}

    def load_state_dict(self, state: dict) -> None:
        self.loss_max, self.loss_std, self.epochs = float(state["loss_max"]), float(state["loss_std"]), int(state["epochs"])
        self.warm_started = bool(state["warm_started"])


def mean_preference(model: RewardEnsemble, segments: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
    """Ensemble-mean P(segment 1 > segment 0) of pairs (N, 2, L, D), in eval mode: (N,)."""
    was_training = model.training
    model.eval()
    probabilities = preference_probabilities(model, segments, masks).mean(0)
    model.train(was_training)
    return probabilities


def warm_start_reward_model(
    model: RewardEnsemble, optimizer, rb: ReplayBuffer, args: Args, rng: np.random.Generator, device, batch_size: int = 256
) -> float:
    """RIME's warm start: before the first labels train it, every member fits (mean squared error) the exploration
    reward of up to 10,000 of the replay buffer's transitions, the k-NN state entropy of the state each reaches (as
    PEBBLE's exploration rewards it), standardised and scaled into [-1, 1], the model's range. The first selection
    then meets a model whose scale and features come from the data instead of a random one. Returns the last loss."""
    if args.rime_warm_start_steps == 0 or rb is None or rb.size < 2:
        return float("nan")
    rows = rb.sample_indices(min(rb.size, 10_000), rng)
    reference = torch.as_tensor(rb.next_obs[rb.sample_indices(min(args.explore_knn_sample_size, rb.size), rng)], device=device)
    states, k = torch.as_tensor(rb.next_obs[rows], device=device), min(args.explore_knn_k, len(reference))
    entropy = torch.cat([knn_state_entropy(chunk, reference, k) for chunk in states.split(4096)])
    target = (entropy - entropy.mean()) / entropy.std().clamp_min(1e-8)
    target = target / target.abs().max().clamp_min(1e-8)
    inputs, ensemble = torch.as_tensor(rb.obs_actions(rows), device=device), model.ensemble_size
    model.train()
    for _ in range(args.rime_warm_start_steps):
        batch = torch.as_tensor(rng.integers(0, len(rows), (ensemble, batch_size)), device=device)  # a batch per member
        loss = F.mse_loss(model.forward_members(inputs[batch]), target[batch]) * ensemble  # sum over members
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return loss.item() / ensemble


def teacher_mistakes(prefs: PreferenceBuffer, indices: np.ndarray, objective: Objective | None, obs_dim: int) -> np.ndarray:
    """Which labels of the pairs at `indices` (N,) contradict the reward the teacher judges by (judged_rewards: the
    env's, or --teacher-objective's): a decided label for the segment with the lower return. A tie, given or true, is
    no mistake. What rime's selection is measured against: with the synthetic teacher, exactly its noise."""
    pairs = {name: getattr(prefs, name)[indices] for name in ("obs_actions", "physics_states", "masks")}
    rewards = prefs.true_rewards[indices] if objective is None else segment_rewards(objective, pairs, obs_dim)
    returns = (rewards * pairs["masks"]).sum(-1)
    return np.sign(prefs.labels[indices] - 0.5) * np.sign(returns[:, 1] - returns[:, 0]) < 0


# --- Reward-model training (Bradley-Terry), with SURF's temporal crops and pseudo-labels ---
def train_reward_model(
    model: RewardEnsemble,
    optimizer,
    prefs: PreferenceBuffer,
    rb: ReplayBuffer,
    args: Args,
    rng: np.random.Generator,
    device,
    label_filter: LabelFilter | None = None,
) -> dict:
    """Fits the ensemble on the training split; every member sees its own shuffle of the labels, each label once per
    epoch plus --qpa-augmentations randomly cropped copies (all copies cropped with SURF). --robust-labels smooth
    trains with mistake_aware_loss; rime (with `label_filter`, its state across sessions) warm-starts the model at
    the first call, then trains every epoch on the labels the filter trusts or flips, and stops on the accuracy on
    those; the shares of the last epoch's selection come back in the stats, with the share of the labels the teacher
    got wrong (labels_wrong) and within each share (labels_flipped_wrong, ...: teacher_mistakes)."""
    train_idx = prefs.split(heldout=False)
    stats = {"train_loss": float("nan"), "ssl_loss": 0.0, "pseudo_labels": 0, "epochs": 0, "steps": 0}
    if len(train_idx) == 0:
        return stats
    if args.reward_net_normalize_inputs:  # the statistics of all data so far, as the queries were drawn from it
        model.set_input_statistics(rb.obs_actions(slice(0, rb.size)))
    ensemble, length = model.ensemble_size, args.segment_length
    all_segments = torch.as_tensor(prefs.obs_actions[train_idx], device=device)
    all_masks = torch.as_tensor(prefs.masks[train_idx], device=device, dtype=torch.float32)
    all_labels = given_labels = torch.as_tensor(prefs.labels[train_idx], device=device)
    rime = args.robust_labels == "rime" and label_filter is not None
    if rime:
        mistakes = teacher_mistakes(prefs, train_idx, load_objective(args.teacher_objective), rb.obs.shape[-1])
        mistakes = torch.as_tensor(mistakes, device=device)
        stats["labels_wrong"] = float(mistakes.float().mean())
    if rime and not label_filter.warm_started:
        stats["warm_start_loss"] = warm_start_reward_model(model, optimizer, rb, args, rng, device)
        label_filter.warm_started = True
    model.train()
    labelled, copies, active = len(train_idx), 1 + args.qpa_augmentations, torch.arange(len(train_idx))
    for epoch in range(args.reward_net_epochs):
        if rime:  # this epoch's labels: the trusted as given, the flipped flipped, the rest left out
            if epoch == 0:
                probabilities = mean_preference(model, all_segments, all_masks)
            trusted, flipped = label_filter.select(probabilities, given_labels, args)
            all_labels = torch.where(flipped, 1 - given_labels, given_labels)
            active, labelled = torch.nonzero(trusted | flipped).flatten().cpu(), int((trusted | flipped).sum())
            shares = {"trusted": trusted, "flipped": flipped, "dropped": ~(trusted | flipped)}
            stats |= {f"labels_{name}": float(mask.float().mean()) for name, mask in shares.items()}
            # and how many of each the teacher got wrong (NaN for none): a flip should fix a mistake, a trust keep a truth
            stats |= {f"labels_{name}_wrong": float(mistakes[mask].float().mean()) for name, mask in shares.items()}
            if labelled == 0:
                break
        order = torch.argsort(torch.rand(ensemble, labelled * copies), dim=1)  # entries >= labelled are augmented copies
        losses, ssl_losses = [], []
        for start in range(0, labelled * copies, args.reward_net_batch_size):
            batch = order[:, start : start + args.reward_net_batch_size]  # (E, b)
            pairs = active[batch % labelled]
            segments, masks, labels = all_segments[pairs], all_masks[pairs], all_labels[pairs]
            cropped = batch >= labelled
            if args.surf:  # every copy cropped: cut the crops out, the steps outside them are not computed
                segments, masks = crop_segments(segments, masks, args.min_augmentation_offset, args.max_augmentation_offset)
            elif cropped.any():  # only QPA's copies: mask them, their batch mixes with whole segments
                crops = temporal_crop_masks(masks.shape[:-1], length, args.min_augmentation_offset, args.max_augmentation_offset)
                masks = torch.where(cropped[..., None, None].to(device), masks * crops.to(device), masks)
            returns = (model.forward_members(segments) * masks).sum(-1)  # (E, b, 2)
            if args.robust_labels == "smooth":
                loss = mistake_aware_loss(returns, labels, args.robust_label_epsilon) * ensemble  # sum over members
            else:
                loss = bradley_terry_loss(returns, labels) * ensemble  # sum over members
            if args.surf and args.unlabeled_batch_ratio > 0:
                ssl_loss, confident_count = surf_loss(model, rb, batch.shape[1] * args.unlabeled_batch_ratio, args, rng, device)
                loss = loss + args.lambda_ssl * ssl_loss
                ssl_losses.append(ssl_loss.item())
                stats["pseudo_labels"] += confident_count
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item() / ensemble)
            stats["steps"] += 1
        stats["train_loss"], stats["epochs"] = float(np.mean(losses)), epoch + 1
        stats["ssl_loss"] = float(np.mean(ssl_losses)) if ssl_losses else 0.0
        # Stop on the accuracy of the whole, uncropped training split: cropped-batch accuracy stops too early.
        if rime:  # on the labels the epoch trained on, as it trained on them; the probabilities select the next epoch's
            probabilities = mean_preference(model, all_segments, all_masks)
            decided = active[(given_labels[active] != 0.5).cpu()]
            agree = (probabilities[decided] > 0.5) == (all_labels[decided] > 0.5)
            if len(decided) and float(agree.float().mean()) >= args.reward_net_target_accuracy:
                break
        elif preference_accuracy(model, prefs, train_idx, device) >= args.reward_net_target_accuracy:
            break
    model.train()
    return stats


def temporal_crop_masks(
    shape: tuple, length: int, min_offset: int, max_offset: int, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Masks (*shape, length) for pairs (shape[-1] == 2), as SURF's temporal cropping: each segment keeps a
    window at its own random start; both segments of a pair keep the same random length in
    [L - max_offset, L - min_offset], since comparing summed rewards over unequal lengths biases the label."""
    crop_len = torch.randint(length - max_offset, length - min_offset + 1, shape[:-1], generator=generator)
    crop_len = crop_len[..., None].expand(shape)
    start = (torch.rand(shape, generator=generator) * (length - crop_len + 1)).long()
    steps = torch.arange(length)
    return (steps >= start[..., None]) & (steps < (start + crop_len)[..., None])


def crop_segments(segments: torch.Tensor, masks: torch.Tensor, min_offset: int, max_offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    """temporal_crop_masks' crops cut out instead of masked: segments (..., 2, L, D) and masks (..., 2, L) -> the
    window of L - min_offset steps that holds each crop, with the crop's mask (the same draws, the same returns)."""
    length = masks.shape[-1]
    crops = temporal_crop_masks(masks.shape[:-1], length, min_offset, max_offset).to(masks.device)
    width = length - min_offset
    steps = crops.float().argmax(-1, keepdim=True).clamp_max(length - width) + torch.arange(width, device=masks.device)
    return segments.take_along_dim(steps[..., None], dim=-2), (masks * crops).take_along_dim(steps, dim=-1)


def pseudo_labels(probabilities: torch.Tensor, tau: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Hard labels from the ensemble-mean preference and the mask of pairs confident beyond tau."""
    mean = probabilities.mean(0)
    confident = (mean > tau) | (mean < 1 - tau)
    return (mean > 0.5).float(), confident


def surf_loss(
    model: RewardEnsemble, rb: ReplayBuffer, num_pairs: int, args: Args, rng: np.random.Generator, device
) -> tuple[torch.Tensor, int]:
    """Pseudo-label loss on cropped unlabelled pairs whose ensemble-mean preference is beyond tau."""
    idx, mask = select_queries(
        args.surf_sampling_strategy, model, rb, num_pairs, args.segment_length, args.preference_sampling_pool_factor, rng, device
    )
    segments, masks = torch.as_tensor(rb.obs_actions(idx), device=device), torch.as_tensor(mask, device=device, dtype=torch.float32)
    segments, masks = crop_segments(segments, masks, args.min_augmentation_offset, args.max_augmentation_offset)
    with torch.no_grad():  # find the confident pairs first: only they take part in the backward pass
        returns = (model(segments) * masks).sum(-1)  # (E, n, 2)
        labels, confident = pseudo_labels(torch.sigmoid(returns[..., 1] - returns[..., 0]), args.surf_tau)
    if not confident.any():
        return torch.zeros((), device=device), 0
    ensemble = model.ensemble_size
    returns = (model(segments[confident]) * masks[confident]).sum(-1)
    loss = bradley_terry_loss(returns, labels[confident].expand(ensemble, -1)) * ensemble
    return loss, int(confident.sum())


def fresh_pair_accuracy(
    model: RewardEnsemble, rb: ReplayBuffer, num_pairs: int, length: int, rng: np.random.Generator, device, truth: np.ndarray | None = None
) -> float:
    """Agreement of the ensemble-mean preference with the true reward (`truth`: judged_rewards; default the env's) on
    fresh random pairs of the replay buffer (ties left out): how well the model generalises, without spending a label."""
    idx, mask = rb.sample_segment_pairs(num_pairs, length, rng)
    returns = ((rb.true_rewards if truth is None else truth)[idx] * mask).sum(-1)
    decided = returns[:, 0] != returns[:, 1]
    if not decided.any():
        return float("nan")
    was_training = model.training
    model.eval()
    segments = torch.as_tensor(rb.obs_actions(idx[decided]), device=device)
    probs = preference_probabilities(model, segments, torch.as_tensor(mask[decided], device=device, dtype=torch.float32)).mean(0)
    model.train(was_training)
    return float(((probs.cpu().numpy() > 0.5) == (returns[decided, 1] > returns[decided, 0])).mean())


def reward_model_metrics(
    model: RewardEnsemble, prefs: PreferenceBuffer, rb: ReplayBuffer, args: Args, fresh: bool, step: int, device
) -> dict:
    """Agreement with the labels trained on and the held-out ones (with `fresh`: fresh oracle-labelled pairs instead),
    correlation with the true reward per step and per segment, and the scale of both rewards (reward_scale), the true
    reward being the one the teacher judges by (judged_rewards: --teacher-objective's where one is given). Fresh
    pairs and the segments draw from their own generators, seeded by the step, so that measuring leaves the run's
    random numbers alone."""
    truth = judged_rewards(rb, load_objective(args.teacher_objective))
    if fresh:
        rng = np.random.default_rng((args.seed, step))
        heldout = fresh_pair_accuracy(model, rb, args.heldout_fresh_pairs, args.segment_length, rng, device, truth)
    else:
        heldout = preference_accuracy(model, prefs, prefs.split(True), device)
    return {
        "train_accuracy": preference_accuracy(model, prefs, prefs.split(False), device),
        "heldout_accuracy": heldout,
        "reward_correlation": reward_correlation(rb, truth=truth),
        "segment_correlation": segment_correlation(
            rb, args.heldout_fresh_pairs, args.segment_length, np.random.default_rng((args.seed, step, 1)), truth
        ),
        **reward_scale(rb, truth),
    }


# --- Unsupervised exploration: PEBBLE's k-NN state-entropy reward; RUNE's exploration bonus ---
def knn_state_entropy(states: torch.Tensor, reference: torch.Tensor, k: int, group: int = 64) -> torch.Tensor:
    """Distance from each state (B, D) to its k-th nearest neighbour among `reference` (M, D), k <= M.

    A top-k over all M distances of every state was most of the cost. The distances are cut into groups of `group`
    instead: the k-th nearest neighbour lies in one of the k groups with the nearest minima (those minima are k
    distinct neighbours no farther than the k-th smallest minimum), so only those k x group candidates are ranked.
    Squared distances less |s|^2 come from one matmul; the root is taken of the k-th only (timed: bench/knn.py)."""
    partial = torch.addmm((reference * reference).sum(1), states, reference.T, alpha=-2)  # |r|^2 - 2 s.r
    if partial.shape[1] % group:
        partial = F.pad(partial, (0, -partial.shape[1] % group), value=float("inf"))
    groups = partial.unflatten(1, (-1, group))
    nearest_groups = groups.amin(2).topk(min(k, groups.shape[1]), dim=1, largest=False, sorted=False).indices
    candidates = groups[torch.arange(len(groups), device=groups.device)[:, None], nearest_groups].flatten(1)
    kth = candidates.topk(k, dim=1, largest=False, sorted=False).values.amax(1)
    return (kth + (states * states).sum(1)).clamp_min(0).sqrt()


def rune_beta(beta0: float, decay: float, step: int) -> float:
    """RUNE's exploration weight beta_t = beta_0 (1 - decay)^t."""
    return beta0 * (1.0 - decay) ** step


# ----------------------------------------------------------------------------------------
# PEBBLE
# ----------------------------------------------------------------------------------------
@dataclass
class LoopState:
    """Counters of the training loop that a checkpoint must carry."""

    global_step: int = 0
    episode_id: int = 0
    episode_return: float = 0.0
    episode_length: int = 0
    sessions_done: int = 0
    labels_obtained: int = 0
    queries_skipped: int = 0
    learning_from_preferences: bool = False  # PEBBLE's second phase: labels exist and the critic was reset for them
    last_eval_return: float = float("nan")
    agent_resets: int = 0  # --reset-agent-below-correlation: sessions after which SAC started afresh


def rows_with_learned_reward(rb: ReplayBuffer, pending: PendingRewards) -> np.ndarray:
    """Slots of the replay buffer whose learned reward has been predicted: all but the newest `pending.count`, which
    wait for a batch to reach them (PendingRewards)."""
    return np.setdiff1d(np.arange(rb.size), pending.waiting_rows(rb))


def reward_change_correlation(before: np.ndarray, after: np.ndarray) -> float:
    """Pearson correlation of the same transitions' learned rewards before and after a session's relabel: near 1 when
    the session refined the reward, low when it now pays for something else. Blind to the reward's scale and offset
    (--reward-standardize changes neither). NaN when either side is constant: before the first session the buffer
    holds no learned reward."""
    if before.size < 2 or before.std() == 0 or after.std() == 0:
        return float("nan")
    return float(np.corrcoef(before, after)[0, 1])


def reinitialise_agent(agent: SACAgent) -> None:
    """--reset-agent-below-correlation: fresh actor and critics, the initial temperature, fresh optimisers. The actor's
    layers are re-initialised in place, so a policy compiled from it (--compile) acts with the new weights."""
    for layer in agent.actor.modules():
        if isinstance(layer, nn.Linear):
            layer.reset_parameters()  # what nn.Linear's constructor does, as a fresh Actor gets
    agent.actor_optimizer = adam(agent.actor.parameters(), agent.args.policy_lr, agent.args)
    agent.reset_critic()
    with torch.no_grad():
        agent.log_alpha.fill_(math.log(agent.args.alpha))
    if agent.args.autotune:
        agent.alpha_optimizer = adam([agent.log_alpha], agent.args.q_lr, agent.args)


def track_episode(loop: LoopState, reward: float, done: bool, writer, progress, step: int) -> None:
    loop.episode_return += float(reward)
    loop.episode_length += 1
    if not done:
        return
    writer.add_scalar("charts/episodic_return", loop.episode_return, step)
    writer.add_scalar("charts/episodic_length", loop.episode_length, step)
    if progress is not None:
        progress.set_postfix(
            ret=f"{loop.episode_return:.0f}", eval=f"{loop.last_eval_return:.0f}", labels=loop.labels_obtained, refresh=False
        )
    loop.episode_id += 1
    loop.episode_return, loop.episode_length = 0.0, 0


def predict_reward_arrays(
    model: RewardEnsemble, device, obs_actions: np.ndarray, standardizer: RewardStandardizer | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """The learned reward (and RUNE's std) of new transitions, in the scale the agent trains on (--reward-standardize:
    the `standardizer`'s)."""
    mean, std = predict_rewards(model, torch.as_tensor(obs_actions, device=device))
    mean, std = mean.cpu().numpy(), std.cpu().numpy()
    return (mean, std) if standardizer is None else standardizer(mean, std)


def load_frozen_reward_model(path: str, env_id: str, input_dim: int) -> RewardEnsemble:
    """--reward-model-from: the reward model of another run's checkpoint, built as that run built it, in eval mode.
    Refused in one line when the checkpoint holds none, or comes from another env or other observation/action sizes."""
    saved = load_checkpoint(checkpoint_file(path, "--reward-model-from"))
    need("reward_model" in saved, f"--reward-model-from {path}: the checkpoint holds no reward model (a sac.py run's?)")
    settings = saved.get("args", {})
    need(
        settings.get("env_id") == env_id,
        f"--reward-model-from {path}: its reward model was learned on {settings.get('env_id')}, this run is on {env_id}",
    )
    saved_dim = int(saved["reward_model"]["input_mean"].shape[0])
    need(
        saved_dim == input_dim,
        f"--reward-model-from {path}: its reward model takes {saved_dim} inputs, this run's observation and action have {input_dim}",
    )
    net = ("reward_ensemble_size", "reward_net_hidden_dim", "reward_net_hidden_layers", "reward_net_dropout")
    model = RewardEnsemble(input_dim, *(settings.get(name, getattr(PreferenceArgs, name)) for name in net))
    model.load_state_dict(saved["reward_model"])
    return model.eval()


def exploration_rewards(rb: ReplayBuffer, next_obs: torch.Tensor, intrinsic_rms: RunningMoments, args: Args, rng, device) -> torch.Tensor:
    """PEBBLE's intrinsic reward of a batch: the distance from each reached state to its k-th nearest neighbour
    among a random sample of the buffer's states, over the running std of those distances."""
    reference = torch.as_tensor(rb.next_obs[rb.sample_indices(min(args.explore_knn_sample_size, rb.size), rng)], device=device)
    intrinsic = knn_state_entropy(next_obs, reference, min(args.explore_knn_k, len(reference)))
    intrinsic_rms.update(intrinsic)
    return intrinsic / float(intrinsic_rms.std)


def main(args: Args, on_evaluation: Callable[[int, float], None] | None = None) -> dict:
    """Train and return the run's summary. `on_evaluation(step, mean_return)`, if given, is called after every
    evaluation (a sweep uses it to report intermediate results and prune hopeless trials: what it raises ends the run)."""
    validate_args(args)
    resume_state = load_checkpoint(Path(args.resume) / "checkpoint.pt") if args.resume else None
    run_name = args.run_name or (resume_state["run_name"] if resume_state else default_run_name(args))
    run_dir, model_dir, video_dir = Path("runs") / run_name, Path("models") / run_name, Path("videos") / run_name

    with contextlib.ExitStack() as cleanup:  # closes what was opened however the run ends (a sweep may prune it)
        # Built before anything is written, so a bad env id, action space or simulator fails cleanly.
        envs = gym.vector.SyncVectorEnv(
            [
                make_env(
                    args.env_id,
                    args.seed,
                    args.render_mode,
                    args.video_width,
                    args.video_height,
                    args.terminate_when_unhealthy,
                    args.terminate_when_tilted,
                )
            ],
            autoreset_mode=gym.vector.AutoresetMode.NEXT_STEP,
        )
        cleanup.callback(envs.close)
        obs, _ = envs.reset(seed=args.seed)
        obs_dim, state_dim = int(np.prod(envs.single_observation_space.shape)), physics_state_size(envs.envs[0])
        action_space, action_dim = envs.single_action_space, int(np.prod(envs.single_action_space.shape))
        frozen = args.reward_model_from is not None  # SAC on another run's reward model: no exploration, no sessions
        frozen_model = load_frozen_reward_model(args.reward_model_from, args.env_id, obs_dim + action_dim) if frozen else None

        writer = start_logging(args, run_name, run_dir, resume_state["loop"]["global_step"] if resume_state else None)
        announce_run(run_name, args)
        cleanup.callback(stop_logging, args, writer)
        device, rng = seed_everything(args)  # rng: replay and segment sampling, random actions, held-out split
        agent = SACAgent(obs_dim, action_space, args, device)
        reward_net = (args.reward_ensemble_size, args.reward_net_hidden_dim, args.reward_net_hidden_layers, args.reward_net_dropout)
        reward_model = (frozen_model if frozen else RewardEnsemble(obs_dim + action_dim, *reward_net)).to(device)
        # --reward-standardize: the scale the agent trains on, refitted every session
        standardizer = RewardStandardizer(args.reward_standardize_center)
        predict_learned_rewards = functools.partial(
            predict_reward_arrays, reward_model, device, standardizer=standardizer if args.reward_standardize else None
        )
        reward_optimizer = torch.optim.Adam(reward_model.parameters(), lr=args.reward_net_lr, fused=True)  # one kernel: 2.5x faster steps
        rb = ReplayBuffer(min(args.buffer_size, args.total_timesteps), obs_dim, action_dim, state_dim)
        prefs = PreferenceBuffer(args.segment_length, obs_dim + action_dim, state_dim)
        intrinsic_rms = RunningMoments()
        pending = PendingRewards()
        teacher = make_teacher(args, rb, run_name, run_dir, video_dir)
        cleanup.callback(teacher.close)
        heldout_fraction = 0.0 if teacher.labels_are_free else args.reward_net_heldout_fraction  # free: measured on fresh pairs
        label_log = LabelLog(run_dir / "labels.sqlite")
        cleanup.callback(label_log.close)
        schedule = [] if frozen else feedback_schedule(
            args.teacher_feedback_total_queries, args.teacher_feedback_num_queries_per_session,
            args.teacher_feedback_schedule, args.teacher_feedback_exponential_decay,
        )  # fmt: skip
        first_feedback_step = args.total_explore_steps if args.unsupervised_exploration else args.learning_starts
        parts = {
            "agent": agent, "reward_model": reward_model, "reward_optimizer": reward_optimizer,
            "preference_buffer": prefs, "intrinsic_rms": intrinsic_rms, "teacher": teacher, "session": FeedbackSession(),
        }  # fmt: skip
        label_filter = LabelFilter()  # --robust-labels rime: its running thresholds are checkpointed with the rest
        if args.robust_labels == "rime":
            parts["label_filter"] = label_filter
        if args.reward_standardize:
            parts["reward_standardizer"] = standardizer
        loop, session = LoopState(), parts["session"]
        loop.learning_from_preferences = frozen  # a frozen reward is known from the first step: nothing to explore
        recent = RecentMeans(AGENT_MEASURES)  # summary.json's figures of the last updates

        def checkpoint(folder: Path) -> None:
            pending.fill(predict_learned_rewards, rb)  # the saved buffer is complete; the values are those the run would use
            state = {"run_name": run_name, "args": public_settings(args), "loop": asdict(loop), "env": capture_env_state(envs, obs)}
            state["wall_seconds"] = earlier_wall + time.time() - start_time  # the whole run's, across resumes
            save_checkpoint(folder, state | training_state(parts, rng) | session.rollback(), rb)  # in a reward update: the state before it

        if resume_state is not None or args.exploration_load:
            saved = resume_state or load_checkpoint(args.path_to_model)
            # An exploration checkpoint may come from a run with another teacher, which had not been asked anything yet.
            load_training_state(parts if resume_state else {k: v for k, v in parts.items() if k != "teacher"}, rng, saved)
            loop, obs = LoopState(**saved["loop"]), restore_env_state(envs, saved["env"])
            rb.load(Path(args.resume) / "replay_buffer.npz" if resume_state else args.path_to_replay_buffer)
            resumed = f"resumed {run_name} at step {loop.global_step} with {loop.labels_obtained} labels"
            print(resumed if resume_state else f"loaded exploration checkpoint at step {loop.global_step}")

        progress = progress_bar(args, args.total_timesteps, loop.global_step)
        start_time, start_step, interrupted, recent_slots = time.time(), loop.global_step, False, None
        earlier_wall = earlier_wall_seconds(resume_state)  # training seconds before the checkpoint this run resumes from
        try:
            with stop_between_steps():
                while loop.global_step < args.total_timesteps:
                    stop_here_if_requested()  # Ctrl-C, SIGTERM: stop here, between two steps, never inside one
                    step = loop.global_step
                    # --- feedback session: select_queries -> teacher.label -> prefs.add -> train reward -> relabel -> reset critic ---
                    session_due = step >= first_feedback_step + loop.sessions_done * args.teacher_feedback_frequency  # (async: or later)
                    if session_due and loop.sessions_done < len(schedule) and not session.open:
                        number = loop.sessions_done + 1  # checkpoints keep the open session's pairs
                        session.start(
                            session.take_staged(number) or session_pairs(number, schedule, reward_model, rb, args, rng, device), number
                        )
                    last = step + 1 == args.total_timesteps
                    if session.open and session.ask(teacher, label_log, args, step, last):
                        number, next_due = (
                            session.number + 1,
                            step >= first_feedback_step + session.number * args.teacher_feedback_frequency,
                        )
                        if session.stages_next(args, last) and number <= len(schedule) and next_due:
                            # --feedback-async: people label the next pairs, chosen by the model as it stands, during the update
                            session.stage(session_pairs(number, schedule, reward_model, rb, args, rng, device), number, teacher)
                        with session.update(parts, rng, loop):  # one unit: Ctrl-C inside it saves the state before it
                            record_labels(prefs, label_log, session, loop, heldout_fraction, rng)
                            reward_stats = train_reward_model(reward_model, reward_optimizer, prefs, rb, args, rng, device, label_filter)
                            known = rows_with_learned_reward(rb, pending)
                            earlier_rewards = rb.learned_rewards[known]  # a copy (fancy indexing): the reward before this session
                            relabel_replay_buffer(reward_model, rb, device, args.relabel_chunk_size)
                            pending.clear()
                            reward_change = reward_change_correlation(earlier_rewards, rb.learned_rewards[known])
                            if args.reward_standardize:
                                standardizer.refit(rb)
                            if len(prefs) > 0 and not loop.learning_from_preferences:
                                agent.reset_critic()  # Q-values of the intrinsic reward mean nothing for the learned one
                                loop.learning_from_preferences = True
                            elif loop.learning_from_preferences and reward_change < args.reset_agent_below_correlation:
                                reinitialise_agent(agent)  # what it settled on was paid by a reward this session replaced
                                loop.agent_resets += 1
                            show_reward_model(teacher, reward_model, rb, args, rng, device, step)
                            metrics = reward_model_metrics(reward_model, prefs, rb, args, teacher.labels_are_free, loop.global_step, device)
                            measures = {"reward_change_correlation": reward_change, "agent_resets": loop.agent_resets}
                            log_feedback_session(writer, loop, session, reward_stats, metrics, teacher.session_measures() | measures)
                        if teacher.people_answer:
                            checkpoint(model_dir / "latest")  # people's labels are what a killed run must not lose
                    exploring = not loop.learning_from_preferences

                    # --- act; store the transition with the simulator state behind its observation ---
                    if step < args.learning_starts:
                        actions = rng.uniform(action_space.low, action_space.high, size=(1, action_dim)).astype(np.float32)
                    else:
                        actions = agent.act(obs)
                    physics_state = get_physics_state(envs.envs[0])
                    autoreset = bool(autoreset_pending(envs)[0])
                    next_obs, rewards, terminations, truncations, _ = envs.step(actions)
                    if not autoreset:  # with next-step autoreset, the step after an episode end only resets: never store it
                        rb.add(obs[0], next_obs[0], actions[0], rewards[0], terminations[0], loop.episode_id, physics_state)
                        if not exploring:
                            pending.add(rb)  # its learned reward is predicted when a batch first needs it
                        track_episode(loop, rewards[0], terminations[0] or truncations[0], writer, progress, step)
                    obs = next_obs
                    loop.global_step += 1
                    # the page's news: best effort, never waits
                    teacher.training_progress(loop.global_step, loop.sessions_done, len(schedule))

                    # --- learn: SAC on the state-entropy reward while exploring, then on the learned reward (+ RUNE) ---
                    if step >= args.learning_starts and (args.unsupervised_exploration or not exploring):
                        hybrid = args.qpa_hybrid_ratio if not exploring and loop.sessions_done < len(schedule) else 0.0
                        if hybrid and (recent_slots is None or loop.episode_length == 0):  # QPA's last episodes, renewed as one ends
                            recent_slots = rb.recent_episode_slots(args.qpa_query_episodes)
                        idx = rb.sample_indices(args.batch_size, rng, recent_slots, hybrid)
                        batch_obs, batch_next_obs = (
                            torch.as_tensor(rb.obs[idx], device=device),
                            torch.as_tensor(rb.next_obs[idx], device=device),
                        )
                        if exploring:
                            batch_rewards = exploration_rewards(rb, batch_next_obs, intrinsic_rms, args, rng, device)
                        else:
                            pending.fill_if_sampled(predict_learned_rewards, rb, idx)
                            batch_rewards = torch.as_tensor(rb.learned_rewards[idx], device=device)
                            if args.rune:  # optimism in the reward model's uncertainty, decaying over the run
                                beta = rune_beta(args.rune_beta, args.rune_beta_decay, step)
                                batch_rewards = batch_rewards + beta * torch.as_tensor(rb.reward_std[idx], device=device)
                        batch_actions, batch_terminated = (
                            torch.as_tensor(array[idx], device=device) for array in (rb.actions, rb.terminated)
                        )
                        stats = agent.update(batch_obs, batch_actions, batch_rewards, batch_next_obs, batch_terminated, step)
                        if step % 100 == 0:
                            for name, value in stats.items():
                                writer.add_scalar(f"losses/{name}", float(value), step)
                            recent.add(stats)
                            if exploring:
                                writer.add_scalar("exploration/intrinsic_reward", float(batch_rewards.mean()), step)
                            elif args.rune:
                                writer.add_scalar("rune/beta", beta, step)
                    if step % 100 == 0:
                        writer.add_scalar("charts/SPS", int((loop.global_step - start_step) / (time.time() - start_time)), step)
                        if progress is not None:
                            progress.update(loop.global_step - progress.n)

                    # --- evaluate, checkpoint ---
                    exploration_ends = args.unsupervised_exploration and not frozen and loop.global_step == args.total_explore_steps
                    if exploration_ends and not args.exploration_load:
                        checkpoint(model_dir / str(loop.global_step))  # reusable: --exploration-load
                    before_end = loop.global_step < args.total_timesteps
                    if args.evaluation_frequency and loop.global_step % args.evaluation_frequency == 0 and before_end:
                        loop.last_eval_return = evaluate_and_log(
                            agent.actor, args, writer, video_dir, device, loop.global_step, on_evaluation
                        )
                        if frozen:  # no sessions log the frozen model's metrics: the evaluations do, on this run's buffer
                            pending.fill(predict_learned_rewards, rb)
                            frozen_metrics = reward_model_metrics(reward_model, prefs, rb, args, True, loop.global_step, device)
                            for name, value in frozen_metrics.items():
                                writer.add_scalar(f"reward_model/{name}", value, loop.global_step)
                    if args.checkpoint_frequency and loop.global_step % args.checkpoint_frequency == 0 and before_end:
                        checkpoint(model_dir / "latest")
        except KeyboardInterrupt:
            interrupted = True
            print(f"\ninterrupted at step {loop.global_step}: saving models/{run_name}/latest")
        finally:
            wall = time.time() - start_time  # training time: periodic evaluations included, the final one not
            checkpoint(model_dir / "latest")
            if progress is not None:
                progress.update(loop.global_step - progress.n)
                progress.close()

        if not interrupted:
            loop.last_eval_return = evaluate_and_log(agent.actor, args, writer, video_dir, device, loop.global_step, on_evaluation)
        metrics = reward_model_metrics(reward_model, prefs, rb, args, teacher.labels_are_free, loop.global_step, device)
        summary = run_summary(run_name, args, loop, metrics | session.idle_seconds(), wall, start_step, interrupted, earlier_wall)
        summary |= recent.summary() | {"reward_model_from": args.reward_model_from, "agent_resets": loop.agent_resets}
        if args.reward_standardize:  # the model's own scale at the last session
            summary |= {"standardize_mean": standardizer.mean, "standardize_std": standardizer.std}
        write_summary(run_dir, summary)
        if interrupted:
            raise RunInterrupted(model_dir / "latest")  # the command line says how to resume from it
        return summary


if __name__ == "__main__":
    cli(Args, main)
