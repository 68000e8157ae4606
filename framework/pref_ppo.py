# PrefPPO: PPO trained only from preferences (Christiano et al. 2017, https://arxiv.org/abs/1706.03741, as the
# PrefPPO baseline of B-Pref, Lee et al. 2021, https://arxiv.org/abs/2111.03026), with PEBBLE's unsupervised
# exploration, SURF (Park et al. 2022) and RUNE (Liang et al. 2022), in CleanRL's single-file style.
#
# Read top to bottom: configuration, environment helpers, the PPO agent, the replay buffer (recent transitions
# with their simulator states: where query segments come from) and the rollout buffer (what PPO learns from,
# overwritten every iteration), observation and return normalisation, the reward model and how it is trained,
# query selection, the synthetic teacher, the feedback schedule, GAE and the PPO update, evaluation,
# checkpoints, and finally `main`. Every iteration:
#   1. collect a rollout (num_envs x num_steps steps) and copy its transitions into the replay buffer,
#   2. when a feedback session is due: select pairs of segments from the replay buffer, ask the teacher,
#      fit the reward model, relabel the replay buffer (before the first session: unsupervised exploration,
#      PPO on the k-NN state-entropy reward),
#   3. predict the rollout's rewards with the reward model (plus RUNE's bonus), GAE, the PPO update.
#
# The reward model, teacher, samplers, schedule, SURF, RUNE, k-NN, replay and preference buffers and the
# human-feedback client are deliberate copies of sac_rlhf.py's (one file = one algorithm):
# tests/test_components.py runs against both copies.
import json
import math
import os
import random
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import gymnasium as gym
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import tyro


@dataclass
class PPOArgs:
    """Settings shared with the true-reward baseline ppo.py (experiment, environment, PPO, evaluation)."""

    # --- experiment ---
    exp_name: str = "pref_ppo"
    """the name of this experiment (part of the run name)"""
    run_name: str | None = None
    """outputs go to runs/, models/ and videos/<run_name>; default: <env>__<exp>__<seed>__<time>"""
    seed: int = 1
    """seed of the experiment (environments seed, seed+1, ...; networks; sampling; a synthetic teacher uses seed+1)"""
    torch_deterministic: bool = True
    """if toggled, `torch.backends.cudnn.deterministic=True`"""
    cuda: bool = True
    """if toggled, cuda will be used when available"""
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
    """render the first training environment live (`human`); cannot be combined with --capture-video"""
    video_width: int = 320
    """width of rendered frames of MuJoCo environments (videos and re-rendered segments)"""
    video_height: int = 240
    """height of rendered frames of MuJoCo environments (videos and re-rendered segments)"""

    # --- environment and PPO (CleanRL's ppo_continuous_action defaults) ---
    env_id: str = "Hopper-v5"
    """the id of the environment: Gymnasium MuJoCo, dm_control/<domain>-<task>-v0, or classic control (CartPole-v1, ...);
    framework/working_envs.md lists the MuJoCo and DMC ones"""
    terminate_when_unhealthy: bool = True
    """end an episode when the robot falls (Hopper, Walker2d, Ant, Humanoid); --no-terminate-when-unhealthy keeps it
    running so a person can teach what the default termination forbids (a salto, raising one leg)"""
    total_timesteps: int = 1_000_000
    """total environment steps (whole iterations of num_envs x num_steps: the remainder is not run)"""
    learning_rate: float = 3e-4
    """the learning rate of the optimizer"""
    num_envs: int = 1
    """the number of parallel game environments (gym.vector.SyncVectorEnv)"""
    num_steps: int = 2048
    """the number of steps to run in each environment per policy rollout"""
    anneal_lr: bool = True
    """toggle learning rate annealing for policy and value networks"""
    gamma: float = 0.99
    """the discount factor gamma"""
    gae_lambda: float = 0.95
    """the lambda for the general advantage estimation"""
    num_minibatches: int = 32
    """the number of mini-batches"""
    update_epochs: int = 10
    """the K epochs to update the policy"""
    norm_adv: bool = True
    """toggles advantages normalization"""
    clip_coef: float = 0.2
    """the surrogate clipping coefficient"""
    clip_vloss: bool = True
    """toggles whether or not to use a clipped loss for the value function, as per the paper"""
    ent_coef: float = 0.0
    """coefficient of the entropy"""
    vf_coef: float = 0.5
    """coefficient of the value function"""
    max_grad_norm: float = 0.5
    """the maximum norm for the gradient clipping"""
    target_kl: float | None = None
    """the target KL divergence threshold"""
    actor_hidden_dim: int = 64
    """width of the actor's hidden layers"""
    actor_hidden_layers: int = 2
    """number of hidden layers of the actor"""
    critic_hidden_dim: int = 64
    """width of the critic's hidden layers"""
    critic_hidden_layers: int = 2
    """number of hidden layers of the critic"""
    normalize_obs: bool = True
    """normalise the policy's observations by their running mean and std (saved in checkpoints, applied by evaluation)"""
    normalize_reward: bool = True
    """divide the rewards PPO learns from by the running std of the discounted return (CleanRL's NormalizeReward)"""

    # --- evaluation ---
    evaluation_frequency: int = 10_000
    """environment steps between evaluations, checked after each iteration (0: only at the end)"""
    evaluation_episodes: int = 5
    """episodes per evaluation (deterministic actions, distinct seeds)"""


@dataclass
class Args(PPOArgs):
    # --- unsupervised exploration (PEBBLE, run as PPO on the intrinsic reward) ---
    unsupervised_exploration: bool = True
    """pre-train with the state-entropy intrinsic reward before asking for feedback"""
    total_explore_steps: int = 10_000
    """environment steps of exploration; the first feedback session follows the first iteration after them"""
    explore_knn_k: int = 5
    """k of the k-nearest-neighbour state-entropy estimate"""
    explore_knn_sample_size: int = 2048
    """number of buffer states the k-NN distances are measured against"""
    exploration_load: bool = False
    """skip exploration: load the agent and replay buffer saved after a previous exploration"""
    path_to_replay_buffer: str | None = None
    """replay buffer file of an exploration checkpoint (models/<run>/<explore_steps>/replay_buffer.npz)"""
    path_to_model: str | None = None
    """model file of an exploration checkpoint (models/<run>/<explore_steps>/checkpoint.pt)"""
    buffer_size: int = 100_000
    """recent transitions kept (with their simulator states) to draw query segments from (capped at total_timesteps)"""

    # --- reward model ---
    reward_ensemble_size: int = 3
    """number of members of the reward-model ensemble"""
    reward_net_hidden_dim: int = 256
    """width of the reward networks' hidden layers"""
    reward_net_hidden_layers: int = 3
    """number of hidden layers of each reward network"""
    reward_net_dropout: float = 0.0
    """dropout during reward-model training (predictions always run in eval mode)"""
    reward_net_lr: float = 3e-4
    """learning rate of the reward model"""
    reward_net_batch_size: int = 128
    """labelled pairs per reward-model batch"""
    reward_net_epochs: int = 100
    """maximum epochs of reward-model training per feedback session"""
    reward_net_target_accuracy: float = 0.97
    """stop a session's reward training once training accuracy reaches this"""
    reward_net_heldout_fraction: float = 0.1
    """fraction of labels held out (never trained on) to measure validation accuracy"""
    relabel_chunk_size: int = 65_536
    """transitions per chunk when relabelling the replay buffer or predicting a rollout's rewards"""

    # --- feedback ---
    teacher_feedback_mode: Literal["simulated", "human", "file"] = "simulated"
    """who labels: `simulated` (synthetic teacher on the true reward), `human` (people in the browser, through
    the feedback server), `file` (the labels an earlier run saved, --feedback-file)"""
    feedback_server_url: str = "http://localhost:5001"
    """address of the feedback server (human mode)"""
    feedback_server_autostart: bool = False
    """start the feedback server as a child process if none answers at --feedback-server-url"""
    feedback_server_token: str | None = None
    """shared secret of the feedback server, if it was started with --token"""
    feedback_file: str | None = None
    """labels.sqlite of an earlier run (runs/<run>/labels.sqlite) to train from in file mode"""
    feedback_poll_seconds: float = 1.0
    """how often the trainer asks the server for new answers while a session is open"""
    feedback_check_clips: int = 5
    """human mode: clips with the reward model's predicted return uploaded after each reward update"""
    clip_fps: int = 30
    """frame rate of the clips shown to people (one frame per environment step)"""
    clip_shadows: bool = False
    """render shadows and reflections in the clips (about 3x slower with software rendering)"""
    teacher_feedback_schedule: Literal["linear", "exponential"] = "exponential"
    """`linear`: every session asks the same number of queries; `exponential`: earlier sessions ask more"""
    teacher_feedback_total_queries: int = 1000
    """total number of queries over the run"""
    teacher_feedback_num_queries_per_session: int = 100
    """queries per session (the average under the exponential schedule)"""
    teacher_feedback_exponential_decay: float = 0.8
    """ratio between consecutive sessions' query counts under the exponential schedule"""
    teacher_feedback_frequency: int = 10_000
    """environment steps between feedback sessions (a session runs after the rollout that reaches its step)"""
    segment_length: int = 50
    """steps per segment shown to the teacher"""
    preference_sampling: Literal["uniform", "disagree", "entropy"] = "disagree"
    """how pairs are selected from the candidate pool"""
    preference_sampling_pool_factor: int = 10
    """candidate pool size = factor x queries (disagree/entropy)"""
    teacher_beta: float = -1.0
    """rationality: >= 0 draws the label from the Bradley-Terry probability with this temperature; < 0 is perfectly rational"""
    teacher_gamma: float = 1.0
    """myopic discount: step t of a segment of length L weighs gamma^(L-1-t)"""
    teacher_eps_mistake: float = 0.0
    """probability of flipping a (non-tie) label"""
    teacher_eps_skip: float = 0.0
    """skip a pair when neither return exceeds this fraction of the average segment return"""
    teacher_eps_equal: float = 0.0
    """label a tie when the returns differ by less than this fraction of the average segment return"""

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

    # --- RUNE ---
    rune: bool = False
    """add RUNE's exploration bonus: beta_t x std of the ensemble's reward"""
    rune_beta: float = 0.05
    """initial weight beta_0 of the RUNE bonus"""
    rune_beta_decay: float = 0.0001
    """beta_t = beta_0 (1 - decay)^t, t = environment step at the start of the rollout"""

    # --- checkpoints ---
    checkpoint_frequency: int = 100_000
    """environment steps between checkpoints to models/<run>/latest, checked after each iteration (0: only at the end)"""
    resume: str | None = None
    """continue a run from a checkpoint folder (models/<run>/latest)"""


class ConfigError(ValueError):
    """Bad command-line input: printed as one line, exit code 2, before any training."""


def need(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def validate_ppo_args(args: PPOArgs) -> None:
    need(args.total_timesteps > 0, f"--total-timesteps must be positive, got {args.total_timesteps}")
    need(args.num_envs >= 1, f"--num-envs must be >= 1, got {args.num_envs}")
    need(args.num_steps >= 1, f"--num-steps must be >= 1, got {args.num_steps}")
    need(
        args.total_timesteps >= args.num_envs * args.num_steps,
        f"--total-timesteps ({args.total_timesteps}) must hold at least one rollout of --num-envs x --num-steps = {args.num_envs * args.num_steps} steps",
    )
    need(args.learning_rate > 0, f"--learning-rate must be > 0, got {args.learning_rate}")
    need(args.num_minibatches >= 1, f"--num-minibatches must be >= 1, got {args.num_minibatches}")
    need(args.update_epochs >= 1, f"--update-epochs must be >= 1, got {args.update_epochs}")
    need(0 <= args.gamma <= 1, f"--gamma must be in [0, 1], got {args.gamma}")
    need(0 <= args.gae_lambda <= 1, f"--gae-lambda must be in [0, 1], got {args.gae_lambda}")
    need(args.clip_coef > 0, f"--clip-coef must be > 0, got {args.clip_coef}")
    need(args.max_grad_norm > 0, f"--max-grad-norm must be > 0, got {args.max_grad_norm}")
    need(args.target_kl is None or args.target_kl > 0, f"--target-kl must be > 0, got {args.target_kl}")
    need(args.actor_hidden_layers >= 0 and args.critic_hidden_layers >= 0, "--actor-hidden-layers and --critic-hidden-layers must be >= 0")
    need(
        args.evaluation_frequency >= 0 and args.evaluation_episodes >= 1,
        f"--evaluation-frequency must be >= 0 and --evaluation-episodes >= 1, got {args.evaluation_frequency} and {args.evaluation_episodes}",
    )
    need(
        not (args.capture_video and args.render_mode == "human"),
        "--capture-video cannot be combined with --render-mode human (choose one)",
    )
    check_env_id(args.env_id)
    if args.capture_video:
        check_can_render(args.env_id, "--capture-video")
    if args.render_mode is not None:
        check_can_render(args.env_id, f"--render-mode {args.render_mode}")


def validate_args(args: Args) -> None:
    validate_ppo_args(args)
    need(args.buffer_size >= 1, f"--buffer-size must be >= 1, got {args.buffer_size}")
    need(
        args.teacher_feedback_total_queries >= 0,
        f"--teacher-feedback-total-queries must be >= 0, got {args.teacher_feedback_total_queries}",
    )
    need(
        args.teacher_feedback_num_queries_per_session > 0,
        f"--teacher-feedback-num-queries-per-session must be > 0, got {args.teacher_feedback_num_queries_per_session}",
    )
    need(args.teacher_feedback_frequency > 0, f"--teacher-feedback-frequency must be > 0, got {args.teacher_feedback_frequency}")
    need(
        0 < args.teacher_feedback_exponential_decay <= 1,
        f"--teacher-feedback-exponential-decay must be in (0, 1], got {args.teacher_feedback_exponential_decay}",
    )
    need(args.segment_length >= 2, f"--segment-length must be >= 2, got {args.segment_length}")
    need(
        args.preference_sampling_pool_factor >= 1,
        f"--preference-sampling-pool-factor must be >= 1, got {args.preference_sampling_pool_factor}",
    )
    need(args.reward_ensemble_size >= 1, f"--reward-ensemble-size must be >= 1, got {args.reward_ensemble_size}")
    need(0 <= args.reward_net_dropout < 1, f"--reward-net-dropout must be in [0, 1), got {args.reward_net_dropout}")
    need(
        0 <= args.reward_net_heldout_fraction < 1,
        f"--reward-net-heldout-fraction must be in [0, 1), got {args.reward_net_heldout_fraction}",
    )
    need(args.relabel_chunk_size >= 1, f"--relabel-chunk-size must be >= 1, got {args.relabel_chunk_size}")
    for name in ("teacher_eps_mistake", "teacher_eps_skip", "teacher_eps_equal"):
        value = getattr(args, name)
        need(0 <= value <= 1, f"--{name.replace('_', '-')} must be in [0, 1], got {value}")
    need(0 <= args.teacher_gamma <= 1, f"--teacher-gamma must be in [0, 1], got {args.teacher_gamma}")
    need(
        0 <= args.min_augmentation_offset <= args.max_augmentation_offset,
        f"--min-augmentation-offset ({args.min_augmentation_offset}) must be >= 0 and <= --max-augmentation-offset ({args.max_augmentation_offset})",
    )
    need(
        args.max_augmentation_offset < args.segment_length,
        f"--max-augmentation-offset ({args.max_augmentation_offset}) must be smaller than --segment-length ({args.segment_length})",
    )
    need(0.5 < args.surf_tau < 1, f"--surf-tau must be in (0.5, 1), got {args.surf_tau}")
    need(args.unlabeled_batch_ratio >= 0, f"--unlabeled-batch-ratio must be >= 0, got {args.unlabeled_batch_ratio}")
    need(args.explore_knn_k >= 1, f"--explore-knn-k must be >= 1, got {args.explore_knn_k}")
    need(args.explore_knn_sample_size >= 1, f"--explore-knn-sample-size must be >= 1, got {args.explore_knn_sample_size}")
    need(args.total_explore_steps >= 0, f"--total-explore-steps must be >= 0, got {args.total_explore_steps}")
    need(
        args.rune_beta >= 0 and 0 <= args.rune_beta_decay < 1,
        f"--rune-beta must be >= 0 and --rune-beta-decay in [0, 1), got {args.rune_beta} and {args.rune_beta_decay}",
    )
    need(args.checkpoint_frequency >= 0, f"--checkpoint-frequency must be >= 0, got {args.checkpoint_frequency}")
    if args.exploration_load:
        for flag, path in (("--path-to-replay-buffer", args.path_to_replay_buffer), ("--path-to-model", args.path_to_model)):
            need(path is not None, f"--exploration-load needs {flag}")
            need(Path(path).is_file(), f"{flag} {path} does not exist")
    if args.teacher_feedback_mode == "file":
        need(args.feedback_file is not None, "--teacher-feedback-mode file needs --feedback-file PATH (a runs/<run>/labels.sqlite)")
        need(Path(args.feedback_file).is_file(), f"--feedback-file {args.feedback_file} does not exist")
    if args.teacher_feedback_mode == "human":
        check_can_render(args.env_id, "--teacher-feedback-mode human")
    need(args.feedback_poll_seconds > 0, f"--feedback-poll-seconds must be > 0, got {args.feedback_poll_seconds}")
    need(args.feedback_check_clips >= 0, f"--feedback-check-clips must be >= 0, got {args.feedback_check_clips}")
    need(args.clip_fps > 0, f"--clip-fps must be > 0, got {args.clip_fps}")
    need(
        args.feedback_server_url.startswith(("http://", "https://")),
        f"--feedback-server-url {args.feedback_server_url} must start with http:// or https://",
    )
    if args.resume is not None:
        need((Path(args.resume) / "checkpoint.pt").is_file(), f"--resume {args.resume}: no checkpoint.pt in that folder")


# ----------------------------------------------------------------------------------------
# Environments: Gymnasium MuJoCo, the DeepMind Control Suite (through shimmy) and classic control
# ----------------------------------------------------------------------------------------
def check_env_id(env_id: str) -> None:
    if env_id.startswith("dm_control/") or env_id not in gym.registry:  # shimmy registers dm_control/<domain>-<task>-v0
        import shimmy

        gym.register_envs(shimmy)
    if env_id not in gym.registry:
        import difflib

        close = difflib.get_close_matches(env_id, list(gym.registry), n=5, cutoff=0.6)
        hint = f" (similar: {', '.join(close)})" if close else ""
        raise ConfigError(f"--env-id {env_id} is not a registered Gymnasium environment{hint}")


def accepts_terminate_when_unhealthy(env_id: str) -> bool:
    """Whether the env's constructor takes terminate_when_unhealthy (Gymnasium's Hopper, Walker2d, Ant, Humanoid)."""
    import inspect

    entry_point = gym.spec(env_id).entry_point
    creator = gym.envs.registration.load_env_creator(entry_point) if isinstance(entry_point, str) else entry_point
    try:
        return "terminate_when_unhealthy" in inspect.signature(creator).parameters
    except (TypeError, ValueError):
        return False


def env_kwargs(env_id: str, terminate_when_unhealthy: bool = True) -> dict:
    """Keyword arguments for gym.make beyond rendering; a request the env cannot honour is an error, never ignored."""
    if terminate_when_unhealthy:
        return {}
    if not accepts_terminate_when_unhealthy(env_id):
        having = [name for name in gym.registry if name.endswith("-v5") and accepts_terminate_when_unhealthy(name)]
        raise ConfigError(
            f"--no-terminate-when-unhealthy: {env_id} has no unhealthy termination to turn off (envs that have it: {', '.join(having)})"
        )
    return {"terminate_when_unhealthy": False}


def image_observation_keys(space: gym.Space) -> list[str]:
    """Keys of a Dict observation that hold camera images: these scripts learn from state vectors."""
    if not isinstance(space, gym.spaces.Dict):
        return []
    return [key for key, sub in space.spaces.items() if isinstance(sub, gym.spaces.Box) and sub.dtype == np.uint8 and len(sub.shape) >= 2]


def is_mujoco_env(env_id: str) -> bool:
    return env_id.startswith("dm_control/") or "mujoco" in str(gym.spec(env_id).entry_point)


def check_can_render(env_id: str, feature: str) -> None:
    """Classic-control environments draw with pygame, an optional dependency of Gymnasium."""
    if is_mujoco_env(env_id):
        return
    import importlib.util

    need(
        importlib.util.find_spec("pygame") is not None,
        f"{feature} renders --env-id {env_id} with pygame, which is not installed (pip install 'gymnasium[classic-control]')",
    )


def make_env(
    env_id: str, seed: int, render_mode: str | None = None, width: int = 320, height: int = 240, terminate_when_unhealthy: bool = True
):
    def thunk():
        check_env_id(env_id)
        kwargs = env_kwargs(env_id, terminate_when_unhealthy)
        if render_mode == "rgb_array" and env_id.startswith("dm_control/"):
            kwargs |= {"render_kwargs": {"width": width, "height": height, "camera_id": 0}}
        elif render_mode == "rgb_array" and is_mujoco_env(env_id):  # classic control draws at its own size
            kwargs |= {"width": width, "height": height}
        env = gym.make(env_id, render_mode=render_mode, **kwargs)
        images = image_observation_keys(env.observation_space)
        if images:
            env.close()
            raise ConfigError(f"--env-id {env_id} observes camera images ({', '.join(images)}); these scripts need state observations")
        if isinstance(env.observation_space, gym.spaces.Dict):  # dm_control: one vector, keys in a fixed order
            env = gym.wrappers.FlattenObservation(env)
        if not isinstance(env.action_space, (gym.spaces.Box, gym.spaces.Discrete)):
            env.close()
            raise ConfigError(
                f"--env-id {env_id} has a {type(env.action_space).__name__} action space; PPO here needs a continuous (Box) or Discrete one"
            )
        lower_shadow_quality(env)
        env.action_space.seed(seed)
        return env

    return thunk


def make_vector_env(args: PPOArgs) -> gym.vector.SyncVectorEnv:
    """num_envs copies with Gymnasium's next-step autoreset; only the first renders with --render-mode."""
    return gym.vector.SyncVectorEnv(
        [
            make_env(
                args.env_id,
                args.seed + i,
                args.render_mode if i == 0 else None,
                args.video_width,
                args.video_height,
                args.terminate_when_unhealthy,
            )
            for i in range(args.num_envs)
        ],
        autoreset_mode=gym.vector.AutoresetMode.NEXT_STEP,
    )


def lower_shadow_quality(env: gym.Env) -> None:
    # Offscreen software rendering (llvmpipe) spends most of its time on the shadow map.
    model, _ = raw_mujoco(env)
    if model is not None:
        model.vis.quality.shadowsize = 1024


def get_physics_state(env: gym.Env) -> np.ndarray:
    """The simulator state behind the current observation, enough to re-render it exactly: MuJoCo's full
    physics state, dm_control's physics state, or a classic-control env's `state` (CartPole, Pendulum, ...)."""
    unwrapped = env.unwrapped
    if hasattr(unwrapped, "physics"):
        return unwrapped.physics.get_state().copy()
    if hasattr(unwrapped, "model") and hasattr(unwrapped, "data"):
        import mujoco

        model, data = unwrapped.model, unwrapped.data
        state = np.empty(mujoco.mj_stateSize(model, mujoco.mjtState.mjSTATE_FULLPHYSICS), dtype=np.float64)
        mujoco.mj_getState(model, data, state, mujoco.mjtState.mjSTATE_FULLPHYSICS)
        return state
    if getattr(unwrapped, "state", None) is not None:  # classic control keeps its whole state in `state`
        return np.array(unwrapped.state, dtype=np.float64).ravel()
    name = unwrapped.spec.id if unwrapped.spec is not None else type(unwrapped).__name__
    raise ConfigError(
        f"--env-id {name} exposes no simulator state (MuJoCo, dm_control or a classic-control `state`) to store segments with"
    )


def set_physics_state(env: gym.Env, state: np.ndarray) -> None:
    unwrapped = env.unwrapped
    if hasattr(unwrapped, "physics"):
        with unwrapped.physics.reset_context():
            unwrapped.physics.set_state(state)
        return
    if hasattr(unwrapped, "model") and hasattr(unwrapped, "data"):
        import mujoco

        mujoco.mj_setState(unwrapped.model, unwrapped.data, state, mujoco.mjtState.mjSTATE_FULLPHYSICS)
        mujoco.mj_forward(unwrapped.model, unwrapped.data)
        return
    unwrapped.state = np.array(state, dtype=np.float64)
    if hasattr(unwrapped, "steps_beyond_terminated"):  # CartPole: a stored state is never past its episode's end
        unwrapped.steps_beyond_terminated = None


def physics_state_size(env: gym.Env) -> int:
    return get_physics_state(env).shape[0]


class SegmentRenderer:
    """Re-renders stored simulator states with one reused offscreen renderer.

    Every GL call runs on one dedicated thread: dm_control's EGL context is bound to the thread that first
    renders with it, while clips are rendered from a background thread that differs between sessions."""

    def __init__(self, env_id: str, width: int = 320, height: int = 240, shadows: bool = True):
        from concurrent.futures import ThreadPoolExecutor

        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="segment-renderer")
        self.executor.submit(self._open, env_id, width, height, shadows).result()

    def _open(self, env_id: str, width: int, height: int, shadows: bool) -> None:
        self.env = make_env(env_id, seed=0, render_mode="rgb_array", width=width, height=height)()
        self.env.reset(seed=0)
        self.fps = self.env.metadata.get("render_fps", 30)
        import mujoco

        self.physics = getattr(self.env.unwrapped, "physics", None)
        if self.physics is not None:  # dm_control: a plain MuJoCo renderer on the task's first camera
            self.mj_renderer = mujoco.Renderer(self.physics.model._model, height, width)
            scene = self.mj_renderer.scene
        else:  # Gymnasium MuJoCo: the env's own renderer, which knows its tracking camera
            scene = self.env.unwrapped.mujoco_renderer._get_viewer("rgb_array").scn
        if not shadows:
            # Shadows and reflections are most of llvmpipe's work: without them clips render about 3x faster.
            scene.flags[mujoco.mjtRndFlag.mjRND_SHADOW] = scene.flags[mujoco.mjtRndFlag.mjRND_REFLECTION] = 0
        self._render(get_physics_state(self.env)[None])  # create the GL context now, not when the first clip is due

    def _render(self, states: np.ndarray) -> np.ndarray:
        frames = []
        for state in states:
            set_physics_state(self.env, state)
            if self.physics is not None:
                self.mj_renderer.update_scene(self.physics.data._data, camera=0)
                frames.append(self.mj_renderer.render())
            else:
                frames.append(self.env.render())
        return np.stack(frames)

    def render_states(self, states: np.ndarray) -> np.ndarray:
        return self.executor.submit(self._render, states).result()

    def close(self) -> None:
        try:
            if self.physics is not None:
                self.executor.submit(self.mj_renderer.close).result()
            self.executor.submit(self.env.close).result()
        finally:
            self.executor.shutdown()


def write_mp4(path: str | Path, frames: np.ndarray, fps: float) -> None:
    """Writes H.264 mp4 with imageio-ffmpeg's own ffmpeg (TensorBoard's add_video is broken with moviepy 2)."""
    import imageio_ffmpeg

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    height, width = frames.shape[1:3]
    writer = imageio_ffmpeg.write_frames(
        str(path),
        (width, height),
        fps=fps,
        codec="libx264",
        pix_fmt_out="yuv420p",
        macro_block_size=1,
        quality=7,
        output_params=["-preset", "veryfast"],
    )
    writer.send(None)
    for frame in frames:
        writer.send(np.ascontiguousarray(frame))
    writer.close()


def _time_limit(env: gym.Env):
    while not isinstance(env, gym.wrappers.TimeLimit) and hasattr(env, "env"):
        env = env.env
    return env


def raw_mujoco(env: gym.Env):
    """The mujoco.MjModel and MjData behind a Gymnasium MuJoCo or dm_control env, or (None, None)."""
    unwrapped = env.unwrapped
    if hasattr(unwrapped, "physics"):  # dm_control through shimmy
        return unwrapped.physics.model._model, unwrapped.physics.data._data
    if hasattr(unwrapped, "data"):
        return unwrapped.model, unwrapped.data
    return None, None


def mujoco_integration_state(env: gym.Env) -> np.ndarray | None:
    """The full physics state plus what the next step depends on beyond it (the constraint solver's warm
    start, controls), so that a resumed run continues bit for bit."""
    import mujoco

    model, data = raw_mujoco(env)
    if model is None:
        return None
    state = np.empty(mujoco.mj_stateSize(model, mujoco.mjtState.mjSTATE_INTEGRATION), dtype=np.float64)
    mujoco.mj_getState(model, data, state, mujoco.mjtState.mjSTATE_INTEGRATION)
    return state


def set_mujoco_integration_state(env: gym.Env, state: np.ndarray) -> None:
    import mujoco

    model, data = raw_mujoco(env)
    mujoco.mj_setState(model, data, state, mujoco.mjtState.mjSTATE_INTEGRATION)


def rng_state(env: gym.Env):
    # dm_control tasks draw from a legacy np.random.RandomState, Gymnasium envs from a Generator.
    generator = env.unwrapped.np_random
    return generator.get_state() if isinstance(generator, np.random.RandomState) else generator.bit_generator.state


def episode_counters(env: gym.Env) -> dict:
    # dm_control keeps its own time limit: the suite counts steps inside its Environment, not in a TimeLimit wrapper.
    inner = getattr(env.unwrapped, "_env", None)
    return {key: getattr(inner, key) for key in ("_step_count", "_reset_next_step") if hasattr(inner, key)}


def set_episode_counters(env: gym.Env, counters: dict) -> None:
    for key, value in counters.items():
        setattr(env.unwrapped._env, key, value)


def set_rng_state(env: gym.Env, state) -> None:
    generator = env.unwrapped.np_random
    if isinstance(generator, np.random.RandomState):
        generator.set_state(state)
    else:
        generator.bit_generator.state = state


def capture_env_state(envs: gym.vector.SyncVectorEnv, obs: np.ndarray) -> dict:
    """Everything needed to continue the training environments mid-episode after a resume."""
    sub_envs = []
    for env in envs.envs:
        sub_envs.append(
            {
                "physics": get_physics_state(env),
                "integration": mujoco_integration_state(env),
                "elapsed_steps": getattr(_time_limit(env), "_elapsed_steps", None),
                "np_random": rng_state(env),
                "episode_counters": episode_counters(env),
                "steps_beyond_terminated": getattr(env.unwrapped, "steps_beyond_terminated", None),  # classic control
            }
        )
    return {"envs": sub_envs, "autoreset": envs._autoreset_envs.copy(), "obs": obs.copy()}  # next-step autoreset flags


def restore_env_state(envs: gym.vector.SyncVectorEnv, state: dict) -> np.ndarray:
    for env, saved in zip(envs.envs, state["envs"]):
        set_physics_state(env, saved["physics"])
        if saved.get("integration") is not None:
            set_mujoco_integration_state(env, saved["integration"])
        if saved["elapsed_steps"] is not None:
            _time_limit(env)._elapsed_steps = saved["elapsed_steps"]
        set_rng_state(env, saved["np_random"])
        set_episode_counters(env, saved.get("episode_counters", {}))
        if hasattr(env.unwrapped, "steps_beyond_terminated"):
            env.unwrapped.steps_beyond_terminated = saved["steps_beyond_terminated"]
    envs._autoreset_envs[:] = state["autoreset"]
    return state["obs"].copy()


# ----------------------------------------------------------------------------------------
# Networks: the reward ensemble is one batched network (as in sac_rlhf.py); PPO's actor and critic
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


def layer_init(layer: nn.Linear, std: float = np.sqrt(2), bias_const: float = 0.0) -> nn.Linear:
    torch.nn.init.orthogonal_(layer.weight, std)
    torch.nn.init.constant_(layer.bias, bias_const)
    return layer


def ppo_mlp(in_dim: int, hidden_dim: int, hidden_layers: int, out_dim: int, out_std: float) -> nn.Sequential:
    """CleanRL's PPO network: tanh hidden layers, orthogonal initialisation, a small last layer for the policy."""
    layers, width = [], in_dim
    for _ in range(hidden_layers):
        layers += [layer_init(nn.Linear(width, hidden_dim)), nn.Tanh()]
        width = hidden_dim
    layers.append(layer_init(nn.Linear(width, out_dim), std=out_std))
    return nn.Sequential(*layers)


class Agent(nn.Module):
    """CleanRL's PPO agent: separate actor and critic. Box actions: a Gaussian with a state-independent log std
    (actions are clipped to the bounds when they are sent to the env); Discrete actions: a categorical."""

    def __init__(
        self,
        obs_dim: int,
        action_space: gym.spaces.Space,
        actor_hidden_dim: int = 64,
        actor_hidden_layers: int = 2,
        critic_hidden_dim: int = 64,
        critic_hidden_layers: int = 2,
    ):
        super().__init__()
        self.discrete = isinstance(action_space, gym.spaces.Discrete)
        self.critic_shape = (obs_dim, critic_hidden_dim, critic_hidden_layers)
        self.critic = ppo_mlp(obs_dim, critic_hidden_dim, critic_hidden_layers, 1, 1.0)
        if self.discrete:
            self.actor = ppo_mlp(obs_dim, actor_hidden_dim, actor_hidden_layers, int(action_space.n), 0.01)
        else:
            action_dim = int(np.prod(action_space.shape))
            self.actor = ppo_mlp(obs_dim, actor_hidden_dim, actor_hidden_layers, action_dim, 0.01)
            self.actor_logstd = nn.Parameter(torch.zeros(1, action_dim))
            self.register_buffer("action_low", torch.as_tensor(action_space.low, dtype=torch.float32).reshape(-1))
            self.register_buffer("action_high", torch.as_tensor(action_space.high, dtype=torch.float32).reshape(-1))

    def get_value(self, x: torch.Tensor) -> torch.Tensor:
        return self.critic(x).squeeze(-1)

    def distribution(self, x: torch.Tensor) -> torch.distributions.Distribution:
        if self.discrete:
            return torch.distributions.Categorical(logits=self.actor(x))
        mean = self.actor(x)
        return torch.distributions.Normal(mean, self.actor_logstd.expand_as(mean).exp())

    def get_action_and_value(self, x: torch.Tensor, action: torch.Tensor | None = None):
        """(action, log-probability, entropy, value); samples an action when none is given."""
        dist = self.distribution(x)
        if action is None:
            action = dist.sample()
        log_prob, entropy = dist.log_prob(action), dist.entropy()
        if not self.discrete:
            log_prob, entropy = log_prob.sum(-1), entropy.sum(-1)
        return action, log_prob, entropy, self.get_value(x)

    def deterministic_action(self, x: torch.Tensor) -> torch.Tensor:
        """The most likely action (argmax, or the Gaussian mean clipped to the bounds); draws no random numbers."""
        if self.discrete:
            return self.actor(x).argmax(-1)
        return torch.maximum(torch.minimum(self.actor(x), self.action_high), self.action_low)

    def reset_critic(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        """PEBBLE re-initialises the critic after exploration: its values were for the intrinsic reward. The
        optimiser forgets the critic's moments (its parameters are re-initialised in place)."""
        fresh = ppo_mlp(*self.critic_shape, 1, 1.0).to(next(self.critic.parameters()).device)
        with torch.no_grad():
            for old, new in zip(self.critic.parameters(), fresh.parameters()):
                old.copy_(new)
                if optimizer is not None:
                    optimizer.state.pop(old, None)


def env_actions(actions: np.ndarray, action_space: gym.spaces.Space) -> np.ndarray:
    """What the envs are sent: Box actions clipped to the bounds (CleanRL's ClipAction), Discrete as integers."""
    if isinstance(action_space, gym.spaces.Discrete):
        return actions.astype(np.int64)
    return np.clip(actions, action_space.low, action_space.high).astype(np.float32)


def reward_action_dim(action_space: gym.spaces.Space) -> int:
    return int(action_space.n) if isinstance(action_space, gym.spaces.Discrete) else int(np.prod(action_space.shape))


def encode_actions(actions: np.ndarray, action_space: gym.spaces.Space) -> np.ndarray:
    """The reward model's action input: the env's (clipped) action, one-hot for Discrete action spaces."""
    if isinstance(action_space, gym.spaces.Discrete):
        return np.eye(int(action_space.n), dtype=np.float32)[actions.astype(np.int64)]
    return actions.reshape(*actions.shape[: actions.ndim - len(action_space.shape)], -1).astype(np.float32)


class PPOPolicy(nn.Module):
    """What evaluation runs: a raw observation, normalised with the training statistics, to the agent's
    deterministic action. The statistics are a copy: evaluation never updates them."""

    def __init__(self, agent: Agent, normalizer: "ObservationNormalizer"):
        super().__init__()
        self.agent, self.discrete = agent, agent.discrete
        self.normalize_obs, self.clip, self.epsilon = normalizer.enabled, normalizer.clip, normalizer.epsilon
        self.register_buffer("obs_mean", torch.as_tensor(normalizer.mean, dtype=torch.float64).clone())
        self.register_buffer("obs_var", torch.as_tensor(normalizer.var, dtype=torch.float64).clone())

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        """The same arithmetic as ObservationNormalizer.normalize (float64, then float32)."""
        if not self.normalize_obs:
            return x.float()
        return ((x.double() - self.obs_mean) / torch.sqrt(self.obs_var + self.epsilon)).clamp(-self.clip, self.clip).float()

    def deterministic_action(self, x: torch.Tensor) -> torch.Tensor:
        return self.agent.deterministic_action(self.normalize(x.to(self.obs_mean.device)))


# ----------------------------------------------------------------------------------------
# Replay buffer: preallocated numpy arrays, simulator states included
# ----------------------------------------------------------------------------------------
class ReplayBuffer:
    """Circular buffer of transitions. `episode_ids` lets segments stay inside one episode."""

    FIELDS = ("obs", "next_obs", "actions", "true_rewards", "learned_rewards", "reward_std", "terminated", "episode_ids", "physics_states")

    def __init__(self, capacity: int, obs_dim: int, action_dim: int, state_dim: int):
        self.capacity = capacity
        self.obs = np.zeros((capacity, obs_dim), dtype=np.float32)
        self.next_obs = np.zeros((capacity, obs_dim), dtype=np.float32)
        self.actions = np.zeros((capacity, action_dim), dtype=np.float32)
        self.true_rewards = np.zeros(capacity, dtype=np.float32)
        self.learned_rewards = np.zeros(capacity, dtype=np.float32)  # ensemble mean
        self.reward_std = np.zeros(capacity, dtype=np.float32)  # ensemble std, RUNE's bonus
        self.terminated = np.zeros(capacity, dtype=np.float32)  # truncation is not terminal
        self.episode_ids = np.full(capacity, -1, dtype=np.int64)
        self.physics_states = np.zeros((capacity, state_dim), dtype=np.float64)  # state behind `obs`
        self.pos = 0
        self.full = False

    @property
    def size(self) -> int:
        return self.capacity if self.full else self.pos

    def add(self, obs, next_obs, action, true_reward, terminated, episode_id, physics_state) -> int:
        i = self.pos
        self.obs[i], self.next_obs[i], self.actions[i] = obs, next_obs, action
        self.true_rewards[i], self.terminated[i] = true_reward, terminated
        self.learned_rewards[i] = self.reward_std[i] = 0.0
        self.episode_ids[i], self.physics_states[i] = episode_id, physics_state
        self.pos = (self.pos + 1) % self.capacity
        self.full = self.full or self.pos == 0
        return i

    def sample_indices(self, batch_size: int, rng: np.random.Generator) -> np.ndarray:
        return rng.integers(0, self.size, size=batch_size)

    def obs_actions(self, idx: np.ndarray) -> np.ndarray:
        return np.concatenate([self.obs[idx], self.actions[idx]], axis=-1)

    def segment_indices(self, starts: np.ndarray, length: int) -> tuple[np.ndarray, np.ndarray]:
        """Indices (.., length) of segments starting at `starts` and the mask of steps that belong to the
        start's episode. A segment cut short by the end of its episode keeps its valid prefix; the rest is
        masked out (an absorbing state with no reward), and never crosses into another episode."""
        idx = (starts[..., None] + np.arange(length)) % self.capacity
        mask = self.episode_ids[idx] == self.episode_ids[starts][..., None]
        mask &= np.cumprod(mask, axis=-1).astype(bool)  # stop at the first step of another episode
        oldest = self.pos if self.full else 0  # never run past the newest transition (into the oldest)
        mask &= ((starts[..., None] - oldest) % self.capacity + np.arange(length)) < self.size
        return idx, mask

    def sample_segment_pairs(self, num_pairs: int, length: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """Start indices (num_pairs, 2) of two distinct random segments, with their masks."""
        starts = rng.integers(0, self.size, size=(num_pairs, 2))
        clash = starts[:, 0] == starts[:, 1]
        starts[clash, 1] = (starts[clash, 1] + 1 + rng.integers(0, max(self.size - 1, 1), size=clash.sum())) % self.size
        return self.segment_indices(starts, length)

    def state_dict(self) -> dict:
        n = self.size
        arrays = {name: getattr(self, name)[:n] for name in self.FIELDS}
        return {**arrays, "pos": np.array(self.pos), "full": np.array(self.full), "capacity": np.array(self.capacity)}

    def load_state_dict(self, state) -> None:
        n, pos, full = len(state["obs"]), int(state["pos"]), bool(state["full"])
        if n > self.capacity:
            raise ConfigError(
                f"the saved replay buffer holds {n} transitions, more than this run's capacity {self.capacity} (--buffer-size / --total-timesteps)"
            )
        same_layout = int(state["capacity"]) == self.capacity
        for name in self.FIELDS:
            values = np.asarray(state[name])
            # A wrapped buffer of another capacity is unrolled oldest-first.
            getattr(self, name)[:n] = values if same_layout or not full else np.roll(values, -pos, axis=0)
        self.pos, self.full = (pos, full) if same_layout else (n % self.capacity, n == self.capacity)

    def save(self, path: Path) -> None:
        tmp = path.with_suffix(".tmp.npz")
        np.savez(tmp, **self.state_dict())
        os.replace(tmp, path)

    def load(self, path: str | Path) -> None:
        with np.load(path) as data:
            self.load_state_dict(data)


# ----------------------------------------------------------------------------------------
# Unsupervised exploration: PEBBLE's k-NN state-entropy reward
# ----------------------------------------------------------------------------------------
def knn_state_entropy(states: torch.Tensor, reference: torch.Tensor, k: int) -> torch.Tensor:
    """Distance from each state (B, D) to its k-th nearest neighbour among `reference` (M, D)."""
    # topk is several times faster than kthvalue or sort on CPU for small k.
    return torch.cdist(states, reference).topk(k, dim=1, largest=False).values[:, -1]


class RunningMeanStd:
    """Running mean/variance (parallel algorithm of Chan et al.); the intrinsic reward is divided by the std."""

    def __init__(self):
        self.mean, self.var, self.count = 0.0, 1.0, 1e-4

    def update(self, x: torch.Tensor) -> None:
        batch_mean, batch_var, batch_count = x.mean().item(), x.var(unbiased=False).item(), x.numel()
        delta, total = batch_mean - self.mean, self.count + batch_count
        self.mean += delta * batch_count / total
        m2 = self.var * self.count + batch_var * batch_count + delta**2 * self.count * batch_count / total
        self.var, self.count = m2 / total, total

    @property
    def std(self) -> float:
        return math.sqrt(self.var)

    def state_dict(self) -> dict:
        return {"mean": self.mean, "var": self.var, "count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.mean, self.var, self.count = state["mean"], state["var"], state["count"]


# ----------------------------------------------------------------------------------------
# Reward model: an ensemble of MLPs on (obs, action), trained with Bradley-Terry
# ----------------------------------------------------------------------------------------
class RewardEnsemble(nn.Module):
    """r_e(s, a) for every member e in one batched network; outputs lie in (-1, 1) (tanh, as PEBBLE)."""

    def __init__(self, input_dim: int, ensemble_size: int = 3, hidden_dim: int = 256, hidden_layers: int = 3, dropout: float = 0.0):
        super().__init__()
        self.ensemble_size = ensemble_size
        self.net = ensemble_mlp(ensemble_size, input_dim, hidden_dim, hidden_layers, 1, activation=nn.LeakyReLU, dropout=dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (..., D) shared by all members, or (E, ..., D) one input per member. Returns (E, ...)."""
        return self._forward(x.unsqueeze(0).expand(self.ensemble_size, *x.shape))

    def forward_members(self, x: torch.Tensor) -> torch.Tensor:
        """x: (E, ..., D), member e sees x[e]. Returns (E, ...)."""
        return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape[:-1]
        out = self.net(x.reshape(self.ensemble_size, -1, x.shape[-1]))
        return torch.tanh(out).reshape(shape)


def bradley_terry_loss(returns: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of P(segment 1 > segment 0) = sigmoid(R1 - R0) against labels in {0, 0.5, 1}.

    returns: (..., 2) summed predicted rewards; labels: (...) with 1 = segment 1 preferred, 0.5 = tie.
    Averaged over pairs (and members)."""
    return F.binary_cross_entropy_with_logits(returns[..., 1] - returns[..., 0], labels)


def preference_probabilities(model: RewardEnsemble, segments: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
    """P_e(segment 1 > segment 0) for each member: segments (N, 2, L, D), masks (N, 2, L) -> (E, N)."""
    with torch.no_grad():
        returns = (model(segments) * masks).sum(-1)
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


def relabel_replay_buffer(model: RewardEnsemble, rb: ReplayBuffer, device: torch.device, chunk_size: int = 65_536) -> None:
    """Recompute learned reward (ensemble mean) and RUNE's std for every stored transition."""
    for start in range(0, rb.size, chunk_size):
        idx = np.arange(start, min(start + chunk_size, rb.size))
        mean, std = predict_rewards(model, torch.as_tensor(rb.obs_actions(idx), device=device))
        rb.learned_rewards[idx], rb.reward_std[idx] = mean.cpu().numpy(), std.cpu().numpy()


def rune_beta(beta0: float, decay: float, step: int) -> float:
    """RUNE's exploration weight beta_t = beta_0 (1 - decay)^t."""
    return beta0 * (1.0 - decay) ** step


def reward_correlation(rb: ReplayBuffer, recent: int = 10_000) -> float:
    """Pearson correlation of learned and true reward over the most recent transitions."""
    n = min(recent, rb.size)
    idx = (rb.pos - 1 - np.arange(n)) % rb.capacity
    learned, true = rb.learned_rewards[idx], rb.true_rewards[idx]
    if n < 2 or learned.std() == 0 or true.std() == 0:
        return float("nan")
    return float(np.corrcoef(learned, true)[0, 1])


# ----------------------------------------------------------------------------------------
# Preference buffer: the labelled segments themselves, never indices into the replay buffer
# ----------------------------------------------------------------------------------------
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


def gather_segments(rb: ReplayBuffer, idx: np.ndarray, mask: np.ndarray) -> dict:
    """Copies the segments at replay-buffer indices idx (..., L) out of the buffer."""
    return {
        "obs_actions": rb.obs_actions(idx),
        "masks": mask,
        "true_rewards": rb.true_rewards[idx] * mask,
        "physics_states": rb.physics_states[idx],
    }


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


# ----------------------------------------------------------------------------------------
# SURF: temporal cropping and pseudo-labels
# ----------------------------------------------------------------------------------------
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


def pseudo_labels(probabilities: torch.Tensor, tau: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Hard labels from the ensemble-mean preference and the mask of pairs confident beyond tau."""
    mean = probabilities.mean(0)
    confident = (mean > tau) | (mean < 1 - tau)
    return (mean > 0.5).float(), confident


# ----------------------------------------------------------------------------------------
# Query selection: uniform, disagreement, entropy
# ----------------------------------------------------------------------------------------
def select_queries(
    strategy: str,
    model: RewardEnsemble,
    rb: ReplayBuffer,
    num_queries: int,
    segment_length: int,
    pool_factor: int,
    rng: np.random.Generator,
    device,
) -> tuple[np.ndarray, np.ndarray]:
    """Indices (num_queries, 2, L) and masks of the pairs to ask about."""
    pool = num_queries if strategy == "uniform" else num_queries * pool_factor
    idx, mask = rb.sample_segment_pairs(pool, segment_length, rng)
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


# ----------------------------------------------------------------------------------------
# Synthetic teacher (B-Pref, Lee et al. 2021)
# ----------------------------------------------------------------------------------------
class SyntheticTeacher:
    """Labels pairs from the true reward, with B-Pref's irrationalities. Its own seeded RNG."""

    def __init__(self, beta: float, gamma: float, eps_mistake: float, eps_skip: float, eps_equal: float, seed: int):
        self.beta, self.gamma = beta, gamma
        self.eps_mistake, self.eps_skip, self.eps_equal = eps_mistake, eps_skip, eps_equal
        self.rng = np.random.default_rng(seed)
        self.threshold_skip = self.threshold_equal = 0.0

    def set_margin(self, average_segment_return: float) -> None:
        """Thresholds are fractions of the average true return of a segment (segment length x mean reward)."""
        self.threshold_skip = self.eps_skip * average_segment_return
        self.threshold_equal = self.eps_equal * average_segment_return

    def label(self, true_rewards: np.ndarray) -> np.ndarray:
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
        else:
            labels = (diff > 0).astype(np.float32)
        flip = self.rng.random(len(labels)) < self.eps_mistake
        labels[flip] = 1.0 - labels[flip]
        if self.eps_equal > 0:
            labels[np.abs(returns[:, 1] - returns[:, 0]) < self.threshold_equal] = 0.5
        if self.eps_skip > 0:
            labels[returns.max(1) < self.threshold_skip] = np.nan
        return labels


# ----------------------------------------------------------------------------------------
# Human feedback: the trainer's side of humanFeedback/feedback_server.py
# ----------------------------------------------------------------------------------------
CHOICE_LABELS = {"left": 0.0, "right": 1.0, "tie": 0.5, "skip": float("nan")}  # left clip = segment 0


class FeedbackServerError(RuntimeError):
    """The feedback server refused a request (4xx) or stayed unreachable past the retry budget."""


def encode_multipart(fields: dict[str, str], files: dict[str, Path]) -> tuple[bytes, str]:
    boundary = f"----cleanrlhf{os.urandom(12).hex()}"
    parts = []
    for name, value in fields.items():
        parts.append(f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n{value}\r\n'.encode())
    for name, path in files.items():
        header = f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"; filename="{name}"\r\nContent-Type: video/mp4\r\n\r\n'
        parts.append(header.encode() + Path(path).read_bytes() + b"\r\n")
    parts.append(f"--{boundary}--\r\n".encode())
    return b"".join(parts), f"multipart/form-data; boundary={boundary}"


class FeedbackClient:
    """JSON/multipart client of the feedback server. Connection failures and 5xx answers are retried with
    exponential backoff (so the trainer survives a server restart); 4xx answers are errors at once."""

    def __init__(self, url: str, token: str | None = None, retry_seconds: float = 600.0, timeout: float = 30.0):
        self.url, self.token, self.retry_seconds, self.timeout = url.rstrip("/"), token, retry_seconds, timeout

    def request(self, method: str, path: str, json_body=None, fields=None, files=None, retry: bool = True) -> dict:
        import http.client
        import urllib.error
        import urllib.request

        headers = {"X-Feedback-Token": self.token} if self.token else {}
        data = None
        if json_body is not None:
            data, headers["Content-Type"] = json.dumps(json_body).encode(), "application/json"
        elif fields is not None or files is not None:
            data, headers["Content-Type"] = encode_multipart(fields or {}, files or {})
        deadline, delay = time.monotonic() + self.retry_seconds, 0.25
        while True:
            try:
                req = urllib.request.Request(self.url + path, data=data, headers=headers, method=method)
                with urllib.request.urlopen(req, timeout=self.timeout) as response:
                    return json.loads(response.read() or b"{}")
            except urllib.error.HTTPError as error:
                if error.code < 500:
                    try:
                        reason = json.loads(error.read()).get("error", "")
                    except ValueError:
                        reason = ""
                    raise FeedbackServerError(f"{method} {path}: HTTP {error.code} {reason}") from None
                failure = f"HTTP {error.code}"
            except (urllib.error.URLError, ConnectionError, TimeoutError, http.client.HTTPException, ValueError) as error:
                # ValueError: a reply cut short by a dying server; every request is idempotent, so re-send it.
                failure = str(getattr(error, "reason", error)) or type(error).__name__
            if not retry or time.monotonic() + delay > deadline:
                raise FeedbackServerError(f"feedback server {self.url} unreachable ({failure})")
            time.sleep(delay)
            delay = min(delay * 2, 10.0)

    def alive(self) -> bool:
        try:
            self.request("GET", "/api/config", retry=False)
            return True
        except FeedbackServerError as error:
            return "HTTP" in str(error) and "401" not in str(error) and "403" not in str(error)

    def create_run(self, name: str, env_id: str, meta: dict) -> int:
        return int(self.request("POST", "/api/runs", json_body={"name": name, "env_id": env_id, "meta": meta})["run_id"])

    def upload_queries(self, run_id: int, queries: list[dict], clips: dict[str, Path]) -> list[int]:
        return self.request("POST", f"/api/runs/{run_id}/queries", fields={"queries": json.dumps(queries)}, files=clips)["query_ids"]

    def answers(self, run_id: int, after: int) -> tuple[list[dict], int]:
        reply = self.request("GET", f"/api/runs/{run_id}/answers?after={after}")
        return reply["answers"], int(reply["cursor"])

    def upload_evaluations(self, run_id: int, evaluations: list[dict], clips: dict[str, Path]) -> None:
        self.request("POST", f"/api/runs/{run_id}/evaluations", fields={"evaluations": json.dumps(evaluations)}, files=clips)


def start_feedback_server(url: str, log_path: Path, token: str | None = None):
    """Starts humanFeedback/feedback_server.py on the URL's port unless a server already answers there."""
    import subprocess
    from urllib.parse import urlparse

    client = FeedbackClient(url, token)
    if client.alive():
        return None
    parsed = urlparse(url)
    server = Path(__file__).resolve().parent.parent / "humanFeedback" / "feedback_server.py"
    command = [sys.executable, str(server), "--host", parsed.hostname or "127.0.0.1", "--port", str(parsed.port or 5001)]
    if token:
        command += ["--token", token]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    process = subprocess.Popen(command, stdout=open(log_path, "a"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 30
    while not client.alive():
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise FeedbackServerError(f"the feedback server did not start on {url}; see {log_path}")
        time.sleep(0.2)
    return process


def segment_frames(renderer: SegmentRenderer, states: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Frames of a segment; after its episode ended the last frame is held, so both clips last as long."""
    valid = int(mask.sum())
    frames = renderer.render_states(states[:valid])
    return np.concatenate([frames, np.repeat(frames[-1:], len(states) - valid, axis=0)])


class HumanTeacher:
    """Asks people: renders each pair from its simulator states and uploads it as soon as it is encoded
    (a background thread stays ahead of the labeller), then waits for every answer of the session."""

    def __init__(
        self,
        client: FeedbackClient,
        run_id: int,
        renderer: SegmentRenderer,
        clip_dir: Path,
        fps: int,
        cursor: int = 0,
        poll_seconds: float = 1.0,
    ):
        self.client, self.run_id, self.renderer, self.clip_dir, self.fps = client, run_id, renderer, clip_dir, fps
        self.cursor, self.poll_seconds = cursor, poll_seconds
        self.answers: dict[int, dict] = {}  # query id -> latest answer; survives an interrupted session
        self.partial_labels: np.ndarray | None = None

    def render_clip(self, name: str, states: np.ndarray, mask: np.ndarray) -> Path:
        path = self.clip_dir / name
        write_mp4(path, segment_frames(self.renderer, states, mask), self.fps)
        return path

    def label(self, segments: dict, session: int, segment_ids: np.ndarray) -> tuple[np.ndarray, list[str]]:
        """Labels (N,) as the synthetic teacher's (nan = skipped) and each label's annotator."""
        import threading

        count = len(segment_ids)
        query_ids: list[int | None] = [None] * count
        upload_error: list[BaseException] = []
        stop = threading.Event()

        def render_and_upload() -> None:
            try:
                for i in range(count):
                    if stop.is_set():
                        return
                    stem = f"run{self.run_id}_s{session}_q{i}_{int(segment_ids[i, 0])}_{int(segment_ids[i, 1])}"
                    clips = {
                        side: self.render_clip(f"{stem}_{side}.mp4", segments["physics_states"][i, k], segments["masks"][i, k])
                        for k, side in enumerate(("left", "right"))
                    }
                    query = {
                        "left_clip": clips["left"].name,
                        "right_clip": clips["right"].name,
                        "left_segment_id": int(segment_ids[i, 0]),
                        "right_segment_id": int(segment_ids[i, 1]),
                        "session": session,
                    }
                    query_ids[i] = self.client.upload_queries(self.run_id, [query], {path.name: path for path in clips.values()})[0]
            except BaseException as error:  # reported by the waiting thread
                upload_error.append(error)

        worker = threading.Thread(target=render_and_upload, daemon=True)
        worker.start()
        labels = np.full(count, np.nan, dtype=np.float32)
        annotators = [""] * count
        try:
            while True:
                new, self.cursor = self.client.answers(self.run_id, self.cursor)
                for answer in new:
                    if answer["choice"] == "undone":
                        self.answers.pop(answer["query_id"], None)
                    else:
                        self.answers[answer["query_id"]] = answer
                answered = [qid is not None and qid in self.answers for qid in query_ids]
                print(
                    f"\rfeedback session {session}: {sum(answered)}/{count} answered, {sum(q is not None for q in query_ids)} uploaded",
                    end="",
                    flush=True,
                )
                if upload_error:
                    raise upload_error[0]
                if all(answered):
                    break
                time.sleep(self.poll_seconds)
        finally:
            stop.set()
            for i, qid in enumerate(query_ids):
                if qid is not None and qid in self.answers:
                    labels[i], annotators[i] = CHOICE_LABELS[self.answers[qid]["choice"]], self.answers[qid]["annotator"]
            self.partial_labels = labels
        print()
        return labels, annotators


class LabelLog:
    """Every label a run obtains, with its segments, in runs/<run>/labels.sqlite (one transaction per
    session), so a later run can train from it: --teacher-feedback-mode file --feedback-file PATH."""

    ARRAYS = ("obs_actions", "masks", "true_rewards", "physics_states")

    def __init__(self, path: Path):
        import sqlite3

        path.parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(path)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute(
            "CREATE TABLE IF NOT EXISTS labels (id INTEGER PRIMARY KEY, global_step INTEGER, session INTEGER, label REAL, annotator TEXT,"
            " obs_actions BLOB, masks BLOB, true_rewards BLOB, physics_states BLOB, shapes TEXT)"
        )
        self.db.commit()

    def append(self, segments: dict, labels: np.ndarray, annotators: list[str], session: int, global_step: int) -> None:
        rows = []
        for i in range(len(labels)):
            arrays = {name: np.ascontiguousarray(segments[name][i]) for name in self.ARRAYS}
            shapes = json.dumps({name: [list(a.shape), str(a.dtype)] for name, a in arrays.items()})
            rows.append((global_step, session, float(labels[i]), annotators[i], *(a.tobytes() for a in arrays.values()), shapes))
        with self.db:
            self.db.executemany(
                "INSERT INTO labels (global_step, session, label, annotator, obs_actions, masks, true_rewards, physics_states, shapes) VALUES (?,?,?,?,?,?,?,?,?)",
                rows,
            )

    def close(self) -> None:
        self.db.close()


def read_label_file(path: str | Path) -> tuple[dict, np.ndarray]:
    """Segments and labels of a labels.sqlite written by LabelLog, in the order they were obtained."""
    import sqlite3

    db = sqlite3.connect(f"file:{Path(path).resolve()}?mode=ro", uri=True)
    rows = db.execute("SELECT label, obs_actions, masks, true_rewards, physics_states, shapes FROM labels ORDER BY id").fetchall()
    db.close()
    segments = {name: [] for name in LabelLog.ARRAYS}
    for row in rows:
        shapes = json.loads(row[5])
        for name, blob in zip(LabelLog.ARRAYS, row[1:5]):
            shape, dtype = shapes[name]
            segments[name].append(np.frombuffer(blob, dtype=dtype).reshape(shape))
    stacked = {name: np.stack(values) if values else np.zeros(0) for name, values in segments.items()}
    return stacked, np.array([row[0] for row in rows], dtype=np.float32)


# ----------------------------------------------------------------------------------------
# Feedback schedule
# ----------------------------------------------------------------------------------------
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


# ----------------------------------------------------------------------------------------
# Reward-model training (Bradley-Terry, optionally SURF)
# ----------------------------------------------------------------------------------------
def train_reward_model(
    model: RewardEnsemble, optimizer, prefs: PreferenceBuffer, rb: ReplayBuffer, args: Args, rng: np.random.Generator, device
) -> dict:
    """Fits the ensemble on the training split; every member sees its own shuffle of the labels."""
    train_idx = prefs.split(heldout=False)
    stats = {"train_loss": float("nan"), "ssl_loss": 0.0, "pseudo_labels": 0, "epochs": 0}
    if len(train_idx) == 0:
        return stats
    ensemble, length = model.ensemble_size, args.segment_length
    all_segments = torch.as_tensor(prefs.obs_actions[train_idx], device=device)
    all_masks = torch.as_tensor(prefs.masks[train_idx], device=device, dtype=torch.float32)
    all_labels = torch.as_tensor(prefs.labels[train_idx], device=device)
    model.train()
    for epoch in range(args.reward_net_epochs):
        order = torch.argsort(torch.rand(ensemble, len(train_idx)), dim=1)
        losses, ssl_losses = [], []
        for start in range(0, len(train_idx), args.reward_net_batch_size):
            batch = order[:, start : start + args.reward_net_batch_size]  # (E, b)
            segments, masks, labels = all_segments[batch], all_masks[batch], all_labels[batch]
            if args.surf:
                masks = masks * temporal_crop_masks(
                    masks.shape[:-1], length, args.min_augmentation_offset, args.max_augmentation_offset
                ).to(device)
            returns = (model.forward_members(segments) * masks).sum(-1)  # (E, b, 2)
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
        stats["train_loss"], stats["epochs"] = float(np.mean(losses)), epoch + 1
        stats["ssl_loss"] = float(np.mean(ssl_losses)) if ssl_losses else 0.0
        # Stop on the accuracy of the whole, uncropped training split: cropped-batch accuracy stops too early.
        if preference_accuracy(model, prefs, train_idx, device) >= args.reward_net_target_accuracy:
            break
    model.train()
    return stats


def surf_loss(
    model: RewardEnsemble, rb: ReplayBuffer, num_pairs: int, args: Args, rng: np.random.Generator, device
) -> tuple[torch.Tensor, int]:
    """Pseudo-label loss on cropped unlabelled pairs whose ensemble-mean preference is beyond tau."""
    idx, mask = select_queries(
        args.surf_sampling_strategy, model, rb, num_pairs, args.segment_length, args.preference_sampling_pool_factor, rng, device
    )
    segments = torch.as_tensor(rb.obs_actions(idx), device=device)
    crop = temporal_crop_masks(mask.shape[:-1], args.segment_length, args.min_augmentation_offset, args.max_augmentation_offset)
    masks = torch.as_tensor(mask, device=device, dtype=torch.float32) * crop.to(device)
    with torch.no_grad():  # find the confident pairs first: only they take part in the backward pass
        returns = (model(segments) * masks).sum(-1)  # (E, n, 2)
        labels, confident = pseudo_labels(torch.sigmoid(returns[..., 1] - returns[..., 0]), args.surf_tau)
    if not confident.any():
        return torch.zeros((), device=device), 0
    ensemble = model.ensemble_size
    returns = (model(segments[confident]) * masks[confident]).sum(-1)
    loss = bradley_terry_loss(returns, labels[confident].expand(ensemble, -1)) * ensemble
    return loss, int(confident.sum())


# ----------------------------------------------------------------------------------------
# PrefPPO: the rollout's rewards from the reward model, and the replay buffer filled from rollouts
# ----------------------------------------------------------------------------------------
def relabel_rollout(model: RewardEnsemble, rollout: "RolloutBuffer", device, chunk_size: int = 65_536, beta: float = 0.0) -> None:
    """The rewards PPO learns from: the ensemble mean of r(obs, action) at every step of the rollout plus RUNE's
    beta x ensemble std, predicted in chunks, without gradients, in eval mode. Autoreset steps get 0."""
    x = rollout.obs_actions().reshape(-1, rollout.raw_obs.shape[-1] + rollout.reward_actions.shape[-1])
    mean, std = np.zeros(len(x), dtype=np.float32), np.zeros(len(x), dtype=np.float32)
    for start in range(0, len(x), chunk_size):
        chunk_mean, chunk_std = predict_rewards(model, torch.as_tensor(x[start : start + chunk_size], device=device))
        mean[start : start + chunk_size], std[start : start + chunk_size] = chunk_mean.cpu().numpy(), chunk_std.cpu().numpy()
    valid = rollout.valid
    rollout.learned_rewards[:] = np.where(valid, mean.reshape(valid.shape), 0.0)
    rollout.reward_std[:] = np.where(valid, std.reshape(valid.shape), 0.0)
    rollout.rewards[:] = rollout.learned_rewards + np.float32(beta) * rollout.reward_std


def add_rollout_to_buffer(rb: ReplayBuffer, rollout: "RolloutBuffer") -> None:
    """Copies the rollout's transitions (autoreset steps excluded) into the replay buffer env by env, so that
    consecutive slots are consecutive steps of one env and segments stay inside one episode (with several envs a
    segment also stops where one env's part of a rollout ends). Records each step's slot in rollout.rb_index."""
    rollout.rb_index[:] = -1
    for i in range(rollout.num_envs):
        for t in np.flatnonzero(rollout.valid[:, i]):
            rollout.rb_index[t, i] = rb.add(
                rollout.raw_obs[t, i],
                rollout.raw_next_obs[t, i],
                rollout.reward_actions[t, i],
                rollout.true_rewards[t, i],
                rollout.terminated[t, i],
                rollout.episode_ids[t, i],
                rollout.physics_states[t, i],
            )


def explore_rewards(
    rollout: "RolloutBuffer",
    rb: ReplayBuffer,
    intrinsic_rms: RunningMeanStd,
    args: Args,
    rng: np.random.Generator,
    device,
    chunk: int = 4096,
) -> None:
    """PEBBLE's intrinsic reward for a rollout: the distance from each reached state to its k-th nearest
    neighbour among a random sample of replay-buffer states (this rollout's included), over its running std."""
    rollout.rewards[:] = 0.0
    states = torch.as_tensor(rollout.raw_next_obs[rollout.valid], device=device)
    if len(states) == 0:
        return
    reference = torch.as_tensor(rb.next_obs[rb.sample_indices(min(args.explore_knn_sample_size, rb.size), rng)], device=device)
    k = min(args.explore_knn_k, len(reference))
    distances = torch.cat([knn_state_entropy(states[s : s + chunk], reference, k) for s in range(0, len(states), chunk)])
    intrinsic_rms.update(distances)
    rollout.rewards[rollout.valid] = (distances / intrinsic_rms.std).cpu().numpy()


# ----------------------------------------------------------------------------------------
# PPO: rollout buffer, normalisation, rollouts, GAE and the clipped update (shared with ppo.py)
# ----------------------------------------------------------------------------------------
class RolloutBuffer:
    """One iteration's num_steps x num_envs steps, overwritten every iteration (preferences copy their segments
    out of the replay buffer, never point into this). `valid` is False on the steps where Gymnasium's next-step
    autoreset only resets an env: they are not transitions and nothing is learned from them."""

    def __init__(self, num_steps: int, num_envs: int, obs_dim: int, action_shape: tuple, reward_action_dim: int, state_dim: int):
        shape = (num_steps, num_envs)
        self.num_steps, self.num_envs = num_steps, num_envs
        self.obs = np.zeros((*shape, obs_dim), dtype=np.float32)  # normalised: what the policy saw
        self.next_obs = np.zeros((*shape, obs_dim), dtype=np.float32)  # normalised with the same statistics
        self.raw_obs = np.zeros((*shape, obs_dim), dtype=np.float32)  # the reward model's and the replay buffer's
        self.raw_next_obs = np.zeros((*shape, obs_dim), dtype=np.float32)  # at an episode end: the final observation
        self.actions = np.zeros((*shape, *action_shape), dtype=np.float32)  # as sampled (Box: before clipping)
        self.reward_actions = np.zeros((*shape, reward_action_dim), dtype=np.float32)  # as sent (clipped / one-hot)
        self.logprobs = np.zeros(shape, dtype=np.float32)
        self.true_rewards = np.zeros(shape, dtype=np.float32)  # the environment's, never normalised
        self.learned_rewards = np.zeros(shape, dtype=np.float32)  # ensemble mean
        self.reward_std = np.zeros(shape, dtype=np.float32)  # ensemble std (RUNE)
        self.rewards = np.zeros(shape, dtype=np.float32)  # what PPO learns from (learned + RUNE, intrinsic, or true)
        self.terminated = np.zeros(shape, dtype=bool)
        self.truncated = np.zeros(shape, dtype=bool)
        self.valid = np.zeros(shape, dtype=bool)
        self.episode_ids = np.full(shape, -1, dtype=np.int64)
        self.physics_states = np.zeros((*shape, state_dim), dtype=np.float64)  # state behind raw_obs
        self.rb_index = np.full(shape, -1, dtype=np.int64)  # replay-buffer slot of each valid step

    def obs_actions(self) -> np.ndarray:
        return np.concatenate([self.raw_obs, self.reward_actions], axis=-1)


class RunningMoments:
    """Running mean and variance of arrays of one shape (parallel algorithm of Chan et al.), in float64."""

    def __init__(self, shape: tuple | int = ()):
        self.mean, self.var, self.count = np.zeros(shape), np.ones(shape), 1e-4

    def update(self, x: np.ndarray) -> None:
        """x: (B, *shape)."""
        x = np.asarray(x, dtype=np.float64)
        if len(x) == 0:
            return
        batch_mean, batch_var, batch_count = x.mean(0), x.var(0), len(x)
        delta, total = batch_mean - self.mean, self.count + batch_count
        self.mean = self.mean + delta * batch_count / total
        m2 = self.var * self.count + batch_var * batch_count + delta**2 * self.count * batch_count / total
        self.var, self.count = m2 / total, total

    def state_dict(self) -> dict:
        return {"mean": np.array(self.mean), "var": np.array(self.var), "count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.mean, self.var, self.count = np.array(state["mean"]), np.array(state["var"]), float(state["count"])


class ObservationNormalizer(RunningMoments):
    """CleanRL's NormalizeObservation, kept outside the env so that checkpoints carry it and evaluation applies it:
    (obs - mean) / sqrt(var + eps), clipped to +-clip. Updated between rollouts, so that all the steps of a
    rollout (and the values bootstrapped from them) are normalised alike."""

    def __init__(self, obs_dim: int, enabled: bool = True, clip: float = 10.0, epsilon: float = 1e-8):
        super().__init__(obs_dim)
        self.enabled, self.clip, self.epsilon = enabled, clip, epsilon

    def normalize(self, obs: np.ndarray) -> np.ndarray:
        obs = np.asarray(obs, dtype=np.float32)  # as evaluation sees it
        if not self.enabled:
            return obs
        return np.clip((obs - self.mean) / np.sqrt(self.var + self.epsilon), -self.clip, self.clip).astype(np.float32)


class ReturnNormalizer:
    """CleanRL's NormalizeReward outside the env: rewards are divided by the running std of every env's discounted
    return, which restarts at each episode end. Applied to the rewards PPO learns from only: the teacher and the
    reward model's bookkeeping keep the raw true reward."""

    def __init__(self, num_envs: int, gamma: float, enabled: bool = True, epsilon: float = 1e-8):
        self.num_envs, self.gamma, self.enabled, self.epsilon = num_envs, gamma, enabled, epsilon
        self.reset()

    def reset(self) -> None:
        self.returns, self.moments = np.zeros(self.num_envs), RunningMoments()

    def scale(self, rewards: np.ndarray, dones: np.ndarray, valid: np.ndarray) -> np.ndarray:
        if not self.enabled:
            return rewards.astype(np.float32, copy=True)
        seen = []
        for t in range(len(rewards)):
            self.returns = np.where(valid[t], self.returns * self.gamma + rewards[t], self.returns)
            seen.append(self.returns[valid[t]])
            self.returns = np.where(dones[t], 0.0, self.returns)
        self.moments.update(np.concatenate(seen))
        return (rewards / np.sqrt(self.moments.var + self.epsilon)).astype(np.float32)

    def state_dict(self) -> dict:
        return {"returns": self.returns.copy(), "moments": self.moments.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.returns = np.array(state["returns"])
        self.moments.load_state_dict(state["moments"])


class EpisodeTracker:
    """Return, length and id of every env's running episode. Ids are unique across envs, so that replay-buffer
    segments never join two episodes."""

    def __init__(self, num_envs: int):
        self.ids, self.next_id = np.arange(num_envs, dtype=np.int64), num_envs
        self.returns, self.lengths = np.zeros(num_envs), np.zeros(num_envs, dtype=np.int64)

    def step(self, rewards: np.ndarray, dones: np.ndarray, valid: np.ndarray) -> list[tuple[int, float, int]]:
        """Counts one vector step; returns (env, return, length) of the episodes that ended with it."""
        self.returns[valid] += rewards[valid]
        self.lengths[valid] += 1
        finished = []
        for i in np.flatnonzero(valid & dones):
            finished.append((int(i), float(self.returns[i]), int(self.lengths[i])))
            self.returns[i], self.lengths[i], self.ids[i] = 0.0, 0, self.next_id
            self.next_id += 1
        return finished

    def state_dict(self) -> dict:
        return {"ids": self.ids.copy(), "next_id": self.next_id, "returns": self.returns.copy(), "lengths": self.lengths.copy()}

    def load_state_dict(self, state: dict) -> None:
        self.ids, self.next_id = np.array(state["ids"]), int(state["next_id"])
        self.returns, self.lengths = np.array(state["returns"]), np.array(state["lengths"])


def collect_rollout(
    envs: gym.vector.SyncVectorEnv,
    agent: Agent,
    obs_rms: ObservationNormalizer,
    rollout: RolloutBuffer,
    obs: np.ndarray,
    episodes: EpisodeTracker,
    device,
) -> tuple[np.ndarray, list[tuple[int, int, float, int]]]:
    """Runs the policy for num_steps vector steps from `obs`, filling `rollout`. Returns the observation to
    continue from and the episodes that ended, as (step within the rollout, env, return, length)."""
    action_space = envs.single_action_space
    finished = []
    for t in range(rollout.num_steps):
        if rollout.physics_states.shape[-1]:
            for i, env in enumerate(envs.envs):
                rollout.physics_states[t, i] = get_physics_state(env)
        valid = ~envs._autoreset_envs  # with next-step autoreset, the step after an episode end only resets
        policy_obs = obs_rms.normalize(obs)
        with torch.no_grad():
            dist = agent.distribution(torch.as_tensor(policy_obs, device=device))
            action = dist.sample()
            logprob = dist.log_prob(action) if agent.discrete else dist.log_prob(action).sum(-1)
        action = action.cpu().numpy()
        sent = env_actions(action, action_space)
        next_obs, rewards, terminated, truncated, _ = envs.step(sent)
        rollout.obs[t], rollout.raw_obs[t], rollout.actions[t], rollout.logprobs[t] = policy_obs, obs, action, logprob.cpu().numpy()
        rollout.reward_actions[t] = encode_actions(sent, action_space)
        rollout.next_obs[t], rollout.raw_next_obs[t] = obs_rms.normalize(next_obs), next_obs
        rollout.true_rewards[t] = rewards
        rollout.terminated[t], rollout.truncated[t], rollout.valid[t] = terminated & valid, truncated & valid, valid
        rollout.episode_ids[t] = episodes.ids
        finished += [(t, *episode) for episode in episodes.step(rewards, terminated | truncated, valid)]
        obs = next_obs
    rollout.learned_rewards[:] = rollout.reward_std[:] = rollout.rewards[:] = 0.0
    rollout.rb_index[:] = -1
    return obs, finished


def rollout_values(agent: Agent, rollout: RolloutBuffer, device) -> tuple[np.ndarray, np.ndarray]:
    """V(obs) and V(next_obs) of every step, (T, N) each, with the current critic."""
    shape = rollout.valid.shape
    with torch.no_grad():
        values = agent.get_value(torch.as_tensor(rollout.obs.reshape(-1, rollout.obs.shape[-1]), device=device))
        next_values = agent.get_value(torch.as_tensor(rollout.next_obs.reshape(-1, rollout.obs.shape[-1]), device=device))
    return values.cpu().numpy().reshape(shape), next_values.cpu().numpy().reshape(shape)


def compute_gae(
    rewards: np.ndarray,
    values: np.ndarray,
    next_values: np.ndarray,
    terminated: np.ndarray,
    truncated: np.ndarray,
    valid: np.ndarray,
    gamma: float,
    gae_lambda: float,
) -> tuple[np.ndarray, np.ndarray]:
    """Generalised advantage estimation over a rollout, arrays (T, N), with Gymnasium's next-step autoreset.

    next_values[t] = V(next_obs[t]): within an episode that is V(obs[t+1]); at a truncated step it is the value of
    the episode's final observation (bootstrapped, the episode did not end by itself); at a terminated step it is
    ignored. An episode end stops the recursion, so nothing is bootstrapped across episodes, and the autoreset
    step after it (valid False) gets advantage 0. The last step bootstraps from V(next_obs), where the next
    rollout starts. Returns (advantages, returns = advantages + values)."""
    advantages = np.zeros(rewards.shape, dtype=np.float32)
    not_terminated = 1.0 - terminated.astype(np.float32)
    continues = 1.0 - (terminated | truncated).astype(np.float32)
    last = np.zeros(rewards.shape[1:], dtype=np.float32)
    for t in reversed(range(len(rewards))):
        delta = rewards[t] + gamma * next_values[t] * not_terminated[t] - values[t]
        last = (delta + gamma * gae_lambda * continues[t] * last) * valid[t]
        advantages[t] = last
    return advantages, advantages + values


def ppo_update(agent: Agent, optimizer: torch.optim.Optimizer, batch: dict, args: PPOArgs, rng: np.random.Generator) -> dict:
    """CleanRL's clipped PPO update. batch: obs, actions, logprobs, advantages, returns, values (tensors over the
    valid steps of a rollout); minibatches of ceil(size / num_minibatches) steps, shuffled with `rng`."""
    size = len(batch["obs"])
    minibatch_size = max(1, math.ceil(size / args.num_minibatches))
    clipfracs = []
    for _ in range(args.update_epochs):
        order = torch.as_tensor(rng.permutation(size), device=batch["obs"].device)
        for start in range(0, size, minibatch_size):
            mb = order[start : start + minibatch_size]
            _, newlogprob, entropy, newvalue = agent.get_action_and_value(batch["obs"][mb], batch["actions"][mb])
            logratio = newlogprob - batch["logprobs"][mb]
            ratio = logratio.exp()
            with torch.no_grad():
                old_approx_kl = (-logratio).mean()
                approx_kl = ((ratio - 1) - logratio).mean()
                clipfracs.append(((ratio - 1.0).abs() > args.clip_coef).float().mean().item())
            mb_advantages = batch["advantages"][mb]
            if args.norm_adv and len(mb) > 1:
                mb_advantages = (mb_advantages - mb_advantages.mean()) / (mb_advantages.std() + 1e-8)
            pg_loss1 = -mb_advantages * ratio
            pg_loss2 = -mb_advantages * torch.clamp(ratio, 1 - args.clip_coef, 1 + args.clip_coef)
            pg_loss = torch.max(pg_loss1, pg_loss2).mean()
            returns, values = batch["returns"][mb], batch["values"][mb]
            if args.clip_vloss:
                v_loss_unclipped = (newvalue - returns) ** 2
                v_clipped = values + torch.clamp(newvalue - values, -args.clip_coef, args.clip_coef)
                v_loss = 0.5 * torch.max(v_loss_unclipped, (v_clipped - returns) ** 2).mean()
            else:
                v_loss = 0.5 * ((newvalue - returns) ** 2).mean()
            entropy_loss = entropy.mean()
            loss = pg_loss - args.ent_coef * entropy_loss + v_loss * args.vf_coef
            optimizer.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)
            optimizer.step()
        if args.target_kl is not None and approx_kl > args.target_kl:
            break
    y_pred, y_true = batch["values"].cpu().numpy(), batch["returns"].cpu().numpy()
    var_y = np.var(y_true)
    return {
        "value_loss": v_loss.item(),
        "policy_loss": pg_loss.item(),
        "entropy": entropy_loss.item(),
        "old_approx_kl": old_approx_kl.item(),
        "approx_kl": approx_kl.item(),
        "clipfrac": float(np.mean(clipfracs)),
        "explained_variance": float("nan") if var_y == 0 else float(1 - np.var(y_true - y_pred) / var_y),
    }


def train_on_rollout(
    agent: Agent, optimizer, rollout: RolloutBuffer, rewards: np.ndarray, args: PPOArgs, rng: np.random.Generator, device
) -> dict:
    """Values, GAE on `rewards` (T, N), and the PPO update on the rollout's valid steps."""
    values, next_values = rollout_values(agent, rollout, device)
    advantages, returns = compute_gae(
        rewards, values, next_values, rollout.terminated, rollout.truncated, rollout.valid, args.gamma, args.gae_lambda
    )
    valid = rollout.valid
    batch = {
        "obs": rollout.obs[valid], "actions": rollout.actions[valid], "logprobs": rollout.logprobs[valid],
        "advantages": advantages[valid], "returns": returns[valid], "values": values[valid],
    }  # fmt: skip
    batch = {name: torch.as_tensor(value, device=device) for name, value in batch.items()}
    if agent.discrete:
        batch["actions"] = batch["actions"].long()
    return ppo_update(agent, optimizer, batch, args, rng)


def set_learning_rate(optimizer: torch.optim.Optimizer, args: PPOArgs, iteration: int, num_iterations: int) -> float:
    """CleanRL's linear annealing: iteration 1 (of num_iterations) uses the full rate, the last 1/num_iterations of it."""
    lr = args.learning_rate * (1.0 - (iteration - 1.0) / num_iterations) if args.anneal_lr else args.learning_rate
    optimizer.param_groups[0]["lr"] = lr
    return lr


def crossed(every: int, before: int, after: int) -> bool:
    """Whether the steps (before, after] contain a multiple of `every` (0: never)."""
    return every > 0 and before // every < after // every


# ----------------------------------------------------------------------------------------
# Evaluation
# ----------------------------------------------------------------------------------------
def evaluate_policy(
    policy: PPOPolicy,
    env_id: str,
    episodes: int,
    seed: int,
    device,
    video_path: str | Path | None = None,
    width: int = 320,
    height: int = 240,
    terminate_when_unhealthy: bool = True,
) -> list[float]:
    """True returns of deterministic-action episodes with seeds seed, seed+1, ...; optionally an mp4 of the first."""
    render_mode = "rgb_array" if video_path else None
    env = make_env(env_id, seed, render_mode, width, height, terminate_when_unhealthy)()
    returns, frames = [], []
    policy.eval()
    for episode in range(episodes):
        obs, _ = env.reset(seed=seed + episode)
        done, total = False, 0.0
        while not done:
            if video_path and episode == 0:
                frames.append(env.render())
            with torch.no_grad():
                action = policy.deterministic_action(torch.as_tensor(obs, dtype=torch.float32, device=device).unsqueeze(0))
            action = action.squeeze(0).cpu().numpy()
            obs, reward, terminated, truncated, _ = env.step(int(action) if policy.discrete else action)
            total += float(reward)
            done = terminated or truncated
        returns.append(total)
    policy.train()
    if video_path and frames:
        write_mp4(video_path, np.stack(frames), env.metadata.get("render_fps", 30))
    env.close()
    return returns


def load_policy(path: str | Path, env_id: str | None = None) -> tuple[PPOPolicy, str]:
    """The evaluation policy of a pref_ppo.py or ppo.py checkpoint (file or folder), with its observation
    normalisation, and the env id to run it on (default: the one it was trained on)."""
    path = Path(path)
    if path.is_dir():
        path = path / "checkpoint.pt"
    if not path.is_file():
        raise ConfigError(f"--path-to-model {path} does not exist")
    checkpoint = load_checkpoint(path)
    train_args = checkpoint["args"]
    env_id = env_id or train_args["env_id"]
    check_env_id(env_id)
    env = make_env(env_id, 0)()
    obs_dim, space = int(np.prod(env.observation_space.shape)), env.action_space
    env.close()
    sizes = [train_args[name] for name in ("actor_hidden_dim", "actor_hidden_layers", "critic_hidden_dim", "critic_hidden_layers")]
    agent = Agent(obs_dim, space, *sizes)
    normalizer = ObservationNormalizer(obs_dim, enabled=train_args["normalize_obs"])
    try:
        agent.load_state_dict(checkpoint["agent"])
        normalizer.load_state_dict(checkpoint["obs_normalizer"])
        policy = PPOPolicy(agent, normalizer)
    except (RuntimeError, ValueError) as error:
        raise ConfigError(f"the model in {path} does not fit --env-id {env_id}: {str(error).splitlines()[0]}") from None
    return policy, env_id


# ----------------------------------------------------------------------------------------
# Checkpoints
# ----------------------------------------------------------------------------------------
def save_checkpoint(folder: Path, state: dict, rb: ReplayBuffer | None = None) -> None:
    """checkpoint.pt (networks, optimisers, normalisers, preference buffer, RNGs, counters) + replay_buffer.npz."""
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / "checkpoint.pt.tmp"
    torch.save(state, tmp)
    if rb is not None:
        rb.save(folder / "replay_buffer.npz")
    os.replace(tmp, folder / "checkpoint.pt")


def load_checkpoint(path: str | Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=False)


# ----------------------------------------------------------------------------------------
# PrefPPO
# ----------------------------------------------------------------------------------------
@dataclass
class LoopState:
    """Counters of the training loop that a checkpoint must carry."""

    global_step: int = 0
    iteration: int = 0
    sessions_done: int = 0
    labels_obtained: int = 0
    queries_skipped: int = 0
    critic_reset: bool = False
    last_eval_return: float = float("nan")
    extra: dict = field(default_factory=dict)


def start_logging(args, run_name: str, run_dir: Path):
    """TensorBoard (plus W&B with --track) for a run; its settings also go to runs/<run>/args.json."""
    from torch.utils.tensorboard import SummaryWriter

    run_dir.mkdir(parents=True, exist_ok=True)
    if args.track:
        import wandb

        wandb.init(
            project=args.wandb_project_name,
            entity=args.wandb_entity,
            sync_tensorboard=True,
            config=vars(args),
            name=run_name,
            save_code=True,
            dir=str(run_dir),
        )
    writer = SummaryWriter(str(run_dir))
    table = "\n".join(f"|{key}|{value}|" for key, value in vars(args).items())
    writer.add_text("hyperparameters", f"|param|value|\n|-|-|\n{table}")
    (run_dir / "args.json").write_text(json.dumps(asdict(args), indent=2))
    return writer


def seed_everything(args) -> tuple[torch.device, np.random.Generator]:
    """Seeds Python and torch; returns the device and the numpy generator of the run."""
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.backends.cudnn.deterministic = args.torch_deterministic
    device = torch.device("cuda" if torch.cuda.is_available() and args.cuda else "cpu")
    return device, np.random.default_rng(args.seed)


def default_run_name(args: PPOArgs) -> str:
    return f"{args.env_id.replace('/', '_')}__{args.exp_name}__{args.seed}__{int(time.time())}"


def main(args: Args, on_evaluation: Callable[[int, float], None] | None = None) -> dict:
    """Train and return the run's summary. `on_evaluation(step, mean_return)`, if given, is called after every
    evaluation (a sweep uses it to report intermediate results and prune hopeless trials: what it raises ends the run)."""
    validate_args(args)
    resume_state = load_checkpoint(Path(args.resume) / "checkpoint.pt") if args.resume else None
    run_name = args.run_name or (resume_state["run_name"] if resume_state else default_run_name(args))
    run_dir, model_dir, video_dir = Path("runs") / run_name, Path("models") / run_name, Path("videos") / run_name

    # Built and reset before anything is written, so a bad env id, action space or simulator fails cleanly.
    envs = make_vector_env(args)
    obs, _ = envs.reset(seed=args.seed)
    obs_dim = int(np.prod(envs.single_observation_space.shape))
    action_space = envs.single_action_space
    try:
        state_dim = physics_state_size(envs.envs[0])
    except ConfigError:
        envs.close()
        raise
    action_input_dim = reward_action_dim(action_space)

    writer = start_logging(args, run_name, run_dir)
    try:  # closed however the run ends, e.g. when a sweep prunes it from on_evaluation
        device, rng = seed_everything(args)  # rng: minibatches, segment and k-NN sampling, held-out split

        agent = Agent(
            obs_dim, action_space, args.actor_hidden_dim, args.actor_hidden_layers, args.critic_hidden_dim, args.critic_hidden_layers
        )
        agent = agent.to(device)
        optimizer = torch.optim.Adam(agent.parameters(), lr=args.learning_rate, eps=1e-5)
        reward_model = RewardEnsemble(
            obs_dim + action_input_dim,
            args.reward_ensemble_size,
            args.reward_net_hidden_dim,
            args.reward_net_hidden_layers,
            args.reward_net_dropout,
        ).to(device)
        reward_optimizer = torch.optim.Adam(reward_model.parameters(), lr=args.reward_net_lr)
        rb = ReplayBuffer(min(args.buffer_size, args.total_timesteps), obs_dim, action_input_dim, state_dim)
        prefs = PreferenceBuffer(args.segment_length, obs_dim + action_input_dim, state_dim)
        rollout = RolloutBuffer(args.num_steps, args.num_envs, obs_dim, action_space.shape, action_input_dim, state_dim)
        teacher = SyntheticTeacher(
            args.teacher_beta,
            args.teacher_gamma,
            args.teacher_eps_mistake,
            args.teacher_eps_skip,
            args.teacher_eps_equal,
            seed=args.seed + 1,
        )
        schedule = feedback_schedule(
            args.teacher_feedback_total_queries,
            args.teacher_feedback_num_queries_per_session,
            args.teacher_feedback_schedule,
            args.teacher_feedback_exponential_decay,
        )
        obs_rms = ObservationNormalizer(obs_dim, enabled=args.normalize_obs)
        return_rms = ReturnNormalizer(args.num_envs, args.gamma, enabled=args.normalize_reward)
        intrinsic_rms = RunningMeanStd()
        episodes = EpisodeTracker(args.num_envs)
        batch_size = args.num_envs * args.num_steps
        num_iterations = args.total_timesteps // batch_size
        # Exploration ends at the first iteration boundary at or after --total-explore-steps.
        explore_end = math.ceil(args.total_explore_steps / batch_size) * batch_size if args.unsupervised_exploration else 0
        loop = LoopState()

        def checkpoint_state() -> dict:
            return {
                "algorithm": "pref_ppo", "run_name": run_name, "args": asdict(args),
                "agent": agent.state_dict(), "optimizer": optimizer.state_dict(),
                "reward_model": reward_model.state_dict(), "reward_optimizer": reward_optimizer.state_dict(),
                "preference_buffer": prefs.state_dict(), "loop": asdict(loop), "episodes": episodes.state_dict(),
                "obs_normalizer": obs_rms.state_dict(), "return_normalizer": return_rms.state_dict(),
                "intrinsic_rms": intrinsic_rms.state_dict(), "teacher_rng": teacher.rng.bit_generator.state,
                "rng": rng.bit_generator.state, "torch_rng": torch.get_rng_state(), "env": capture_env_state(envs, obs),
            }  # fmt: skip

        def iteration_snapshot() -> dict:
            """The state an iteration starts from. Interrupted mid-iteration, a run saves this (with the networks and
            labels as they are), so that the resumed run collects the interrupted rollout again: exactly so when the
            interruption came before the iteration's PPO update changed the agent and before a feedback session began
            (after that, the labels obtained are kept and the session is not asked again with the same pairs)."""
            return {
                "loop": {"global_step": loop.global_step, "iteration": loop.iteration}, "episodes": episodes.state_dict(),
                "obs_normalizer": obs_rms.state_dict(), "return_normalizer": return_rms.state_dict(),
                "intrinsic_rms": intrinsic_rms.state_dict(), "rng": rng.bit_generator.state, "torch_rng": torch.get_rng_state(),
                "env": capture_env_state(envs, obs), "rb_position": (rb.pos, rb.full),
            }  # fmt: skip

        def interrupted_state(snapshot: dict) -> dict:
            state = checkpoint_state()
            state["loop"].update(snapshot["loop"])
            for key in ("episodes", "obs_normalizer", "return_normalizer", "intrinsic_rms", "torch_rng", "env"):
                state[key] = snapshot[key]
            if not snapshot.get("session_started"):  # else new draws: the resumed session must not pick the same pairs
                state["rng"] = snapshot["rng"]
            rb.pos, rb.full = snapshot["rb_position"]  # the interrupted rollout's transitions are collected again
            return state

        def restore(state: dict) -> None:
            nonlocal obs, loop
            agent.load_state_dict(state["agent"])
            optimizer.load_state_dict(state["optimizer"])
            reward_model.load_state_dict(state["reward_model"])
            reward_optimizer.load_state_dict(state["reward_optimizer"])
            prefs.load_state_dict(state["preference_buffer"])
            episodes.load_state_dict(state["episodes"])
            obs_rms.load_state_dict(state["obs_normalizer"])
            return_rms.load_state_dict(state["return_normalizer"])
            intrinsic_rms.load_state_dict(state["intrinsic_rms"])
            teacher.rng.bit_generator.state = state["teacher_rng"]
            rng.bit_generator.state = state["rng"]
            torch.set_rng_state(state["torch_rng"])
            loop = LoopState(**state["loop"])
            obs = restore_env_state(envs, state["env"])

        if resume_state is not None:
            restore(resume_state)
            rb.load(Path(args.resume) / "replay_buffer.npz")
            print(f"resumed {run_name} at step {loop.global_step} with {loop.labels_obtained} labels")
        elif args.exploration_load:
            explored = load_checkpoint(args.path_to_model)
            restore(explored)
            rb.load(args.path_to_replay_buffer)
            print(f"loaded exploration checkpoint at step {loop.global_step}")

        label_log = LabelLog(run_dir / "labels.sqlite")
        server_process = human_teacher = renderer = None
        if args.teacher_feedback_mode == "human":
            if args.feedback_server_autostart:
                server_process = start_feedback_server(
                    args.feedback_server_url, run_dir / "feedback_server.log", args.feedback_server_token
                )
            client = FeedbackClient(args.feedback_server_url, args.feedback_server_token)
            feedback_run_id = client.create_run(run_name, args.env_id, {"seed": args.seed, "segment_length": args.segment_length})
            renderer = SegmentRenderer(args.env_id, args.video_width, args.video_height, shadows=args.clip_shadows)
            human_teacher = HumanTeacher(
                client,
                feedback_run_id,
                renderer,
                video_dir / "clips",
                args.clip_fps,
                loop.extra.get("feedback_cursor", 0),
                args.feedback_poll_seconds,
            )
            print(f"feedback server: label at {args.feedback_server_url}/ (run {feedback_run_id})")
        elif args.teacher_feedback_mode == "file":
            file_segments, file_labels = read_label_file(args.feedback_file)
            print(f"training from {len(file_labels)} labels in {args.feedback_file}")

        def record_labels(segments: dict, labels: np.ndarray, annotators: list[str]) -> None:
            answered = ~np.isnan(labels)
            heldout = rng.random(len(labels)) < args.reward_net_heldout_fraction
            prefs.add(
                *(segments[k][answered] for k in ("obs_actions", "masks", "true_rewards", "physics_states")),
                labels[answered],
                heldout[answered],
                loop.global_step,
            )
            label_log.append(
                {k: segments[k][answered] for k in LabelLog.ARRAYS},
                labels[answered],
                [a for a, ok in zip(annotators, answered) if ok],
                loop.sessions_done + 1,
                loop.global_step,
            )
            loop.labels_obtained += int(answered.sum())
            loop.queries_skipped += int((~answered).sum())

        def ask_for_labels(num_queries: int) -> tuple[dict, np.ndarray, list[str]]:
            """The session's segments and their labels, from the configured teacher."""
            if args.teacher_feedback_mode == "file":
                start = loop.extra.get("file_position", 0)
                stop = min(start + num_queries, len(file_labels))
                loop.extra["file_position"] = stop
                return {k: v[start:stop] for k, v in file_segments.items()}, file_labels[start:stop], ["file"] * (stop - start)
            # The first session uses uniform sampling: an untrained ensemble's disagreement carries no information.
            strategy = "uniform" if loop.sessions_done == 0 else args.preference_sampling
            idx, mask = select_queries(
                strategy, reward_model, rb, num_queries, args.segment_length, args.preference_sampling_pool_factor, rng, device
            )
            segments = gather_segments(rb, idx, mask)
            if args.teacher_feedback_mode == "simulated":
                teacher.set_margin(args.segment_length * float(rb.true_rewards[: rb.size].mean()))
                return segments, teacher.label(segments["true_rewards"]), ["synthetic"] * num_queries
            try:
                labels, annotators = human_teacher.label(segments, loop.sessions_done + 1, idx[:, :, 0])
            except KeyboardInterrupt:
                record_labels(segments, human_teacher.partial_labels, ["human"] * num_queries)  # keep what people gave
                raise
            finally:
                loop.extra["feedback_cursor"] = human_teacher.cursor
            return segments, labels, annotators

        def upload_reward_check_clips(step: int) -> None:
            """Seed 000's 'benchmark rewarder': a few clips ranked by predicted return, to compare with one's own."""
            idx, mask = rb.sample_segment_pairs(args.feedback_check_clips, args.segment_length, rng)
            idx, mask = idx[:, 0], mask[:, 0]
            mean, _ = predict_rewards(reward_model, torch.as_tensor(rb.obs_actions(idx), device=device))
            predicted = (mean.cpu().numpy() * mask).sum(-1)
            clips, evaluations = {}, []
            for i in range(len(idx)):
                path = human_teacher.render_clip(f"run{feedback_run_id}_check_{step}_{i}.mp4", rb.physics_states[idx[i]], mask[i])
                clips[path.name] = path
                evaluations.append({"clip": path.name, "predicted_return": float(predicted[i]), "step": step})
            human_teacher.client.upload_evaluations(feedback_run_id, evaluations, clips)

        def feedback_session(num_queries: int) -> None:
            """Select pairs, ask the teacher, fit the reward model, relabel the replay buffer."""
            session_start = time.time()
            if snapshot is not None:
                snapshot["session_started"] = True
            segments, labels, annotators = ask_for_labels(num_queries)
            record_labels(segments, labels, annotators)
            loop.sessions_done += 1
            stats = train_reward_model(reward_model, reward_optimizer, prefs, rb, args, rng, device)
            relabel_replay_buffer(reward_model, rb, device, args.relabel_chunk_size)
            step = loop.global_step
            if human_teacher is not None and args.feedback_check_clips > 0:
                upload_reward_check_clips(step)
            writer.add_scalar("feedback/labels_obtained", loop.labels_obtained, step)
            writer.add_scalar("feedback/queries_skipped", loop.queries_skipped, step)
            writer.add_scalar("feedback/sessions", loop.sessions_done, step)
            writer.add_scalar("feedback/session_seconds", time.time() - session_start, step)
            writer.add_scalar("reward_model/train_loss", stats["train_loss"], step)
            writer.add_scalar("reward_model/epochs", stats["epochs"], step)
            writer.add_scalar("reward_model/train_accuracy", preference_accuracy(reward_model, prefs, prefs.split(False), device), step)
            writer.add_scalar("reward_model/heldout_accuracy", preference_accuracy(reward_model, prefs, prefs.split(True), device), step)
            writer.add_scalar("reward_model/reward_correlation", reward_correlation(rb), step)
            if args.surf:
                writer.add_scalar("reward_model/ssl_loss", stats["ssl_loss"], step)
                writer.add_scalar("reward_model/pseudo_labels", stats["pseudo_labels"], step)

        def evaluate(step: int) -> None:
            video = video_dir / f"eval_step_{step}.mp4" if args.capture_video else None
            returns = evaluate_policy(
                PPOPolicy(agent, obs_rms),
                args.env_id,
                args.evaluation_episodes,
                args.seed + 100_000,
                device,
                video,
                args.video_width,
                args.video_height,
                args.terminate_when_unhealthy,
            )
            loop.last_eval_return = float(np.mean(returns))
            writer.add_scalar("eval/mean_return", loop.last_eval_return, step)
            writer.add_scalar("eval/std_return", float(np.std(returns)), step)
            if video is not None and args.track:
                import wandb

                wandb.log({"eval/video": wandb.Video(str(video), format="mp4")}, step=step)
            if on_evaluation is not None:
                on_evaluation(step, loop.last_eval_return)

        start_time, start_step = time.time(), loop.global_step
        progress = None
        if args.progress_bar:
            from tqdm import tqdm

            progress = tqdm(total=num_iterations * batch_size, initial=loop.global_step, unit="step", dynamic_ncols=True)
        interrupted, snapshot, last_return = False, None, float("nan")
        try:
            while loop.iteration < num_iterations:
                snapshot = iteration_snapshot()
                lr = set_learning_rate(optimizer, args, loop.iteration + 1, num_iterations)

                # --- 1. rollout, copied into the replay buffer ---
                rollout_start = loop.global_step
                obs, finished = collect_rollout(envs, agent, obs_rms, rollout, obs, episodes, device)
                loop.global_step += batch_size
                loop.iteration += 1
                step = loop.global_step
                for t, _, episode_return, episode_length in finished:
                    writer.add_scalar("charts/episodic_return", episode_return, rollout_start + (t + 1) * args.num_envs)
                    writer.add_scalar("charts/episodic_length", episode_length, rollout_start + (t + 1) * args.num_envs)
                    last_return = episode_return
                add_rollout_to_buffer(rb, rollout)
                obs_rms.update(rollout.raw_obs[rollout.valid])  # for the next rollout: this one keeps its statistics

                # --- 2. feedback session (the first ends exploration) ---
                if loop.sessions_done < len(schedule) and step > explore_end + loop.sessions_done * args.teacher_feedback_frequency:
                    feedback_session(schedule[loop.sessions_done])
                if len(prefs) > 0 and args.unsupervised_exploration and not loop.critic_reset:
                    agent.reset_critic(optimizer)  # values of the intrinsic reward mean nothing for the learned one
                    return_rms.reset()
                    loop.critic_reset = True

                # --- 3. the rollout's rewards, GAE, PPO update ---
                learn = True
                if len(prefs) > 0:
                    beta = rune_beta(args.rune_beta, args.rune_beta_decay, rollout_start) if args.rune else 0.0
                    relabel_rollout(reward_model, rollout, device, args.relabel_chunk_size, beta)
                    slots = rollout.rb_index[rollout.valid]
                    rb.learned_rewards[slots], rb.reward_std[slots] = (
                        rollout.learned_rewards[rollout.valid],
                        rollout.reward_std[rollout.valid],
                    )
                    if args.rune:
                        writer.add_scalar("rune/beta", beta, step)
                elif args.unsupervised_exploration:
                    explore_rewards(rollout, rb, intrinsic_rms, args, rng, device)
                    writer.add_scalar("exploration/intrinsic_reward", float(rollout.rewards[rollout.valid].mean()), step)
                else:
                    learn = False  # no labels yet (or none given): nothing to learn from
                if learn:
                    rewards = return_rms.scale(rollout.rewards, rollout.terminated | rollout.truncated, rollout.valid)
                    stats = train_on_rollout(agent, optimizer, rollout, rewards, args, rng, device)
                    writer.add_scalar("charts/learning_rate", lr, step)
                    for name, value in stats.items():
                        writer.add_scalar(f"losses/{name}", value, step)
                writer.add_scalar("charts/SPS", int((step - start_step) / (time.time() - start_time)), step)
                snapshot = None  # the iteration is complete
                if progress is not None:
                    progress.set_postfix(
                        ret=f"{last_return:.0f}", eval=f"{loop.last_eval_return:.0f}", labels=loop.labels_obtained, refresh=False
                    )
                    progress.update(step - progress.n)

                # --- evaluate, checkpoint ---
                if explore_end > 0 and step == explore_end and not args.exploration_load:
                    save_checkpoint(model_dir / str(step), checkpoint_state(), rb)  # reusable: --exploration-load
                if crossed(args.evaluation_frequency, step - batch_size, step) and loop.iteration < num_iterations:
                    evaluate(step)
                if crossed(args.checkpoint_frequency, step - batch_size, step) and loop.iteration < num_iterations:
                    save_checkpoint(model_dir / "latest", checkpoint_state(), rb)
        except KeyboardInterrupt:
            interrupted = True
            print(
                f"\ninterrupted at step {loop.global_step}: saving models/{run_name}/latest (from the iteration's start if mid-iteration)"
            )
        finally:
            wall = time.time() - start_time  # training time: periodic evaluations included, the final one not
            save_checkpoint(model_dir / "latest", checkpoint_state() if snapshot is None else interrupted_state(snapshot), rb)
            if progress is not None:
                progress.close()
            label_log.close()
            if renderer is not None:
                renderer.close()
            if server_process is not None:
                server_process.terminate()
                server_process.wait(timeout=10)

        if not interrupted:
            evaluate(loop.global_step)
        summary = {
            "run_name": run_name,
            "algorithm": "pref_ppo",
            "env_id": args.env_id,
            "teacher_feedback_mode": args.teacher_feedback_mode,
            "global_step": loop.global_step,
            "final_eval_return": loop.last_eval_return,
            "labels_obtained": loop.labels_obtained,
            "queries_skipped": loop.queries_skipped,
            "feedback_sessions": loop.sessions_done,
            "train_accuracy": preference_accuracy(reward_model, prefs, prefs.split(False), device),
            "heldout_accuracy": preference_accuracy(reward_model, prefs, prefs.split(True), device),
            "reward_correlation": reward_correlation(rb),
            "wall_seconds": wall,
            "sps": (loop.global_step - start_step) / wall,
            "interrupted": interrupted,
        }
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        if interrupted:
            raise KeyboardInterrupt
        return summary
    finally:
        envs.close()
        writer.close()
        if args.track:
            import wandb

            wandb.finish()


def cli() -> None:
    args = tyro.cli(Args)
    try:
        main(args)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    except FeedbackServerError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    cli()
