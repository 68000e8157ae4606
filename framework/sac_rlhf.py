# PEBBLE: SAC trained only from preferences (Lee et al. 2021, https://arxiv.org/abs/2106.05091)
# with SURF (Park et al. 2022) and RUNE (Liang et al. 2022), in CleanRL's single-file style.
#
# Read top to bottom: configuration, environment helpers, SAC, the replay buffer, the
# reward model and how it is trained, query selection, the synthetic teacher, the feedback
# schedule, checkpoints, evaluation, and finally `main`, which is PEBBLE's algorithm box:
#   1. random steps, then unsupervised exploration with a state-entropy reward,
#   2. at every feedback session: select pairs of segments, ask the teacher, fit the reward
#      model, relabel the replay buffer,
#   3. SAC on the learned reward (plus RUNE's uncertainty bonus) between sessions.
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
class Args(SACArgs):
    # --- unsupervised exploration (PEBBLE) ---
    unsupervised_exploration: bool = True
    """pre-train with the state-entropy intrinsic reward before asking for feedback"""
    total_explore_steps: int = 10_000
    """environment steps (random steps included) before the first feedback session"""
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
    """transitions per chunk when relabelling the replay buffer"""

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
    """environment steps between feedback sessions"""
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
    """beta_t = beta_0 (1 - decay)^t, t = environment step"""

    # --- checkpoints ---
    checkpoint_frequency: int = 100_000
    """environment steps between checkpoints to models/<run>/latest (0: only at the end)"""
    resume: str | None = None
    """continue a run from a checkpoint folder (models/<run>/latest)"""


class ConfigError(ValueError):
    """Bad command-line input: printed as one line, exit code 2, before any training."""


def need(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


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
    check_env_id(args.env_id)


def validate_args(args: Args) -> None:
    validate_sac_args(args)
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
    need(
        args.explore_knn_sample_size >= args.explore_knn_k,
        f"--explore-knn-sample-size must be >= --explore-knn-k ({args.explore_knn_k}), got {args.explore_knn_sample_size}",
    )
    need(args.relabel_chunk_size >= 1, f"--relabel-chunk-size must be >= 1, got {args.relabel_chunk_size}")
    need(
        args.rune_beta >= 0 and 0 <= args.rune_beta_decay < 1,
        f"--rune-beta must be >= 0 and --rune-beta-decay in [0, 1), got {args.rune_beta} and {args.rune_beta_decay}",
    )
    need(args.checkpoint_frequency >= 0, f"--checkpoint-frequency must be >= 0, got {args.checkpoint_frequency}")
    if args.unsupervised_exploration:
        need(
            args.total_explore_steps >= args.learning_starts,
            f"--total-explore-steps ({args.total_explore_steps}) must be >= --learning-starts ({args.learning_starts})",
        )
    if args.exploration_load:
        for flag, path in (("--path-to-replay-buffer", args.path_to_replay_buffer), ("--path-to-model", args.path_to_model)):
            need(path is not None, f"--exploration-load needs {flag}")
            need(Path(path).is_file(), f"{flag} {path} does not exist")
    if args.teacher_feedback_mode == "file":
        need(args.feedback_file is not None, "--teacher-feedback-mode file needs --feedback-file PATH (a runs/<run>/labels.sqlite)")
        need(Path(args.feedback_file).is_file(), f"--feedback-file {args.feedback_file} does not exist")
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
# Environments: Gymnasium MuJoCo and the DeepMind Control Suite (through shimmy)
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


def make_env(
    env_id: str, seed: int, render_mode: str | None = None, width: int = 320, height: int = 240, terminate_when_unhealthy: bool = True
):
    def thunk():
        check_env_id(env_id)
        kwargs = env_kwargs(env_id, terminate_when_unhealthy)
        if render_mode == "rgb_array" and env_id.startswith("dm_control/"):
            kwargs |= {"render_kwargs": {"width": width, "height": height, "camera_id": 0}}
        elif render_mode == "rgb_array":
            kwargs |= {"width": width, "height": height}
        env = gym.make(env_id, render_mode=render_mode, **kwargs)
        images = image_observation_keys(env.observation_space)
        if images:
            env.close()
            raise ConfigError(f"--env-id {env_id} observes camera images ({', '.join(images)}); these scripts need state observations")
        if isinstance(env.observation_space, gym.spaces.Dict):  # dm_control: one vector, keys in a fixed order
            env = gym.wrappers.FlattenObservation(env)
        if not isinstance(env.action_space, gym.spaces.Box):
            env.close()
            raise ConfigError(f"--env-id {env_id} has a {type(env.action_space).__name__} action space; SAC needs a continuous (Box) one")
        bounds = np.abs(np.concatenate([env.action_space.low.ravel(), env.action_space.high.ravel()]))
        if not np.all(bounds < 1e6):
            env.close()
            raise ConfigError(
                f"--env-id {env_id} has unbounded actions (bounds up to {bounds.max():.0e}); SAC squashes actions into finite bounds"
            )
        if raw_mujoco(env)[0] is None:
            env.close()
            raise ConfigError(f"--env-id {env_id} is not simulated by MuJoCo, so its segments cannot be stored and re-rendered")
        lower_shadow_quality(env)
        env.action_space.seed(seed)
        return env

    return thunk


def lower_shadow_quality(env: gym.Env) -> None:
    # Offscreen software rendering (llvmpipe) spends most of its time on the shadow map.
    model, _ = raw_mujoco(env)
    if model is not None:
        model.vis.quality.shadowsize = 1024


def get_physics_state(env: gym.Env) -> np.ndarray:
    """The simulator state behind the current observation, enough to re-render it exactly."""
    import mujoco

    unwrapped = env.unwrapped
    if hasattr(unwrapped, "physics"):
        return unwrapped.physics.get_state().copy()
    model, data = unwrapped.model, unwrapped.data
    state = np.empty(mujoco.mj_stateSize(model, mujoco.mjtState.mjSTATE_FULLPHYSICS), dtype=np.float64)
    mujoco.mj_getState(model, data, state, mujoco.mjtState.mjSTATE_FULLPHYSICS)
    return state


def set_physics_state(env: gym.Env, state: np.ndarray) -> None:
    import mujoco

    unwrapped = env.unwrapped
    if hasattr(unwrapped, "physics"):
        with unwrapped.physics.reset_context():
            unwrapped.physics.set_state(state)
        return
    mujoco.mj_setState(unwrapped.model, unwrapped.data, state, mujoco.mjtState.mjSTATE_FULLPHYSICS)
    mujoco.mj_forward(unwrapped.model, unwrapped.data)


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
    """Everything needed to continue the training environment mid-episode after a resume."""
    env = envs.envs[0]
    time_limit = env
    while not isinstance(time_limit, gym.wrappers.TimeLimit) and hasattr(time_limit, "env"):
        time_limit = time_limit.env
    return {
        "physics": get_physics_state(env),
        "integration": mujoco_integration_state(env),
        "elapsed_steps": getattr(time_limit, "_elapsed_steps", None),
        "np_random": rng_state(env),
        "episode_counters": episode_counters(env),
        "autoreset": envs._autoreset_envs.copy(),  # Gymnasium's next-step autoreset flags
        "obs": obs.copy(),
    }


def restore_env_state(envs: gym.vector.SyncVectorEnv, state: dict) -> np.ndarray:
    env = envs.envs[0]
    set_physics_state(env, state["physics"])
    if state.get("integration") is not None:
        set_mujoco_integration_state(env, state["integration"])
    time_limit = env
    while not isinstance(time_limit, gym.wrappers.TimeLimit) and hasattr(time_limit, "env"):
        time_limit = time_limit.env
    if state["elapsed_steps"] is not None:
        time_limit._elapsed_steps = state["elapsed_steps"]
    set_rng_state(env, state["np_random"])
    set_episode_counters(env, state.get("episode_counters", {}))
    envs._autoreset_envs[:] = state["autoreset"]
    return state["obs"].copy()


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


LOG_STD_MAX = 2
LOG_STD_MIN = -5


class Actor(nn.Module):
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
        log_std = LOG_STD_MIN + 0.5 * (LOG_STD_MAX - LOG_STD_MIN) * (log_std + 1)  # From SpinUp / Denis Yarats
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


class SACAgent:
    """Actor, twin critics with targets, and the (autotuned) entropy coefficient."""

    def __init__(self, obs_dim: int, action_space: gym.spaces.Box, args: Args, device: torch.device):
        self.args, self.device = args, device
        self.obs_dim, self.action_dim = obs_dim, int(np.prod(action_space.shape))
        self.actor = Actor(obs_dim, action_space.low, action_space.high, args.actor_hidden_dim, args.actor_hidden_layers).to(device)
        self.actor_optimizer = torch.optim.Adam(self.actor.parameters(), lr=args.policy_lr)
        self.reset_critic()
        if args.autotune:
            self.target_entropy = -float(self.action_dim)
            self.log_alpha = torch.full((1,), math.log(args.alpha), requires_grad=True, device=device)
            self.alpha_optimizer = torch.optim.Adam([self.log_alpha], lr=args.q_lr)
        else:
            self.log_alpha = torch.full((1,), math.log(args.alpha), device=device)

    def reset_critic(self) -> None:
        """PEBBLE re-initialises the critic after exploration: its values were for the intrinsic reward."""
        self.qf = TwinQNetwork(self.obs_dim, self.action_dim, self.args.critic_hidden_dim, self.args.critic_hidden_layers).to(self.device)
        self.qf_target = TwinQNetwork(self.obs_dim, self.action_dim, self.args.critic_hidden_dim, self.args.critic_hidden_layers).to(
            self.device
        )
        self.qf_target.load_state_dict(self.qf.state_dict())
        self.q_optimizer = torch.optim.Adam(self.qf.parameters(), lr=self.args.q_lr)

    @property
    def alpha(self) -> torch.Tensor:
        return self.log_alpha.exp().detach()

    def update(self, obs, actions, rewards, next_obs, terminated, global_step: int) -> dict:
        args = self.args
        with torch.no_grad():
            next_actions, next_log_pi, _ = self.actor.get_action(next_obs)
            next_q = self.qf_target(next_obs, next_actions).min(0).values - self.alpha * next_log_pi.squeeze(1)
            target_q = rewards + (1 - terminated) * args.gamma * next_q
        q_values = self.qf(obs, actions)
        qf_losses = ((q_values - target_q.unsqueeze(0)) ** 2).mean(1)
        qf_loss = qf_losses.sum()
        self.q_optimizer.zero_grad()
        qf_loss.backward()
        self.q_optimizer.step()
        stats = {
            "qf1_values": q_values[0].mean(),
            "qf2_values": q_values[1].mean(),
            "qf1_loss": qf_losses[0],
            "qf2_loss": qf_losses[1],
            "qf_loss": qf_loss / 2.0,
        }

        if global_step % args.policy_frequency == 0:  # TD3-style delayed update, compensated
            for _ in range(args.policy_frequency):
                pi, log_pi, _ = self.actor.get_action(obs)
                min_q_pi = self.qf(obs, pi).min(0).values
                actor_loss = (self.alpha * log_pi.squeeze(1) - min_q_pi).mean()
                self.actor_optimizer.zero_grad()
                actor_loss.backward()
                self.actor_optimizer.step()
                if args.autotune:
                    with torch.no_grad():
                        _, log_pi, _ = self.actor.get_action(obs)
                    alpha_loss = (-self.log_alpha.exp() * (log_pi + self.target_entropy)).mean()
                    self.alpha_optimizer.zero_grad()
                    alpha_loss.backward()
                    self.alpha_optimizer.step()
                    stats["alpha_loss"] = alpha_loss
            stats["actor_loss"] = actor_loss
        if global_step % args.target_network_frequency == 0:
            with torch.no_grad():
                for param, target_param in zip(self.qf.parameters(), self.qf_target.parameters()):
                    target_param.lerp_(param, args.tau)
        stats["alpha"] = self.alpha
        return {name: value.detach() for name, value in stats.items()}

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
        self.actor_optimizer.load_state_dict(state["actor_optimizer"])
        self.q_optimizer.load_state_dict(state["q_optimizer"])
        with torch.no_grad():
            self.log_alpha.copy_(state["log_alpha"])
        if self.args.autotune:
            self.alpha_optimizer.load_state_dict(state["alpha_optimizer"])


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
# Evaluation
# ----------------------------------------------------------------------------------------
def evaluate_policy(
    actor: Actor,
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
    actor.eval()
    for episode in range(episodes):
        obs, _ = env.reset(seed=seed + episode)
        done, total = False, 0.0
        while not done:
            if video_path and episode == 0:
                frames.append(env.render())
            with torch.no_grad():
                action = actor.deterministic_action(torch.as_tensor(obs, dtype=torch.float32, device=device).unsqueeze(0))
            obs, reward, terminated, truncated, _ = env.step(action.squeeze(0).cpu().numpy())
            total += float(reward)
            done = terminated or truncated
        returns.append(total)
    actor.train()
    if video_path and frames:
        write_mp4(video_path, np.stack(frames), env.metadata.get("render_fps", 30))
    env.close()
    return returns


# ----------------------------------------------------------------------------------------
# Checkpoints
# ----------------------------------------------------------------------------------------
def save_checkpoint(folder: Path, state: dict, rb: ReplayBuffer) -> None:
    """checkpoint.pt (networks, optimisers, preference buffer, RNGs, counters) + replay_buffer.npz."""
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / "checkpoint.pt.tmp"
    torch.save(state, tmp)
    rb.save(folder / "replay_buffer.npz")
    os.replace(tmp, folder / "checkpoint.pt")


def load_checkpoint(path: str | Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=False)


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


def default_run_name(args: Args) -> str:
    return f"{args.env_id.replace('/', '_')}__{args.exp_name}__{args.seed}__{int(time.time())}"


def main(args: Args, on_evaluation: Callable[[int, float], None] | None = None) -> dict:
    """Train and return the run's summary. `on_evaluation(step, mean_return)`, if given, is called after every
    evaluation (a sweep uses it to report intermediate results and prune hopeless trials: what it raises ends the run)."""
    validate_args(args)
    resume_state = load_checkpoint(Path(args.resume) / "checkpoint.pt") if args.resume else None
    run_name = args.run_name or (resume_state["run_name"] if resume_state else default_run_name(args))
    run_dir, model_dir, video_dir = Path("runs") / run_name, Path("models") / run_name, Path("videos") / run_name

    # Built before anything is written, so a bad env id or action space fails cleanly.
    envs = gym.vector.SyncVectorEnv(
        [make_env(args.env_id, args.seed, args.render_mode, args.video_width, args.video_height, args.terminate_when_unhealthy)],
        autoreset_mode=gym.vector.AutoresetMode.NEXT_STEP,
    )

    writer = start_logging(args, run_name, run_dir)
    try:  # closed however the run ends, e.g. when a sweep prunes it from on_evaluation
        device, rng = seed_everything(args)  # rng: replay and segment sampling, random actions, held-out split

        obs, _ = envs.reset(seed=args.seed)
        obs_dim = int(np.prod(envs.single_observation_space.shape))
        action_space = envs.single_action_space
        action_dim = int(np.prod(action_space.shape))
        state_dim = physics_state_size(envs.envs[0])

        agent = SACAgent(obs_dim, action_space, args, device)
        reward_model = RewardEnsemble(
            obs_dim + action_dim,
            args.reward_ensemble_size,
            args.reward_net_hidden_dim,
            args.reward_net_hidden_layers,
            args.reward_net_dropout,
        ).to(device)
        reward_optimizer = torch.optim.Adam(reward_model.parameters(), lr=args.reward_net_lr)
        rb = ReplayBuffer(min(args.buffer_size, args.total_timesteps), obs_dim, action_dim, state_dim)
        prefs = PreferenceBuffer(args.segment_length, obs_dim + action_dim, state_dim)
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
        first_feedback_step = args.total_explore_steps if args.unsupervised_exploration else args.learning_starts
        intrinsic_rms = RunningMeanStd()
        loop = LoopState()

        def checkpoint_state() -> dict:
            return {
                "run_name": run_name, "args": asdict(args), "agent": agent.state_dict(),
                "reward_model": reward_model.state_dict(), "reward_optimizer": reward_optimizer.state_dict(),
                "preference_buffer": prefs.state_dict(), "loop": asdict(loop), "intrinsic_rms": intrinsic_rms.state_dict(),
                "teacher_rng": teacher.rng.bit_generator.state, "rng": rng.bit_generator.state,
                "torch_rng": torch.get_rng_state(), "env": capture_env_state(envs, obs),
            }  # fmt: skip

        def restore(state: dict) -> None:
            nonlocal obs, loop
            agent.load_state_dict(state["agent"])
            reward_model.load_state_dict(state["reward_model"])
            reward_optimizer.load_state_dict(state["reward_optimizer"])
            prefs.load_state_dict(state["preference_buffer"])
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
                agent.actor,
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

            progress = tqdm(total=args.total_timesteps, initial=loop.global_step, unit="step", dynamic_ncols=True)
        interrupted = False
        try:
            while loop.global_step < args.total_timesteps:
                step = loop.global_step
                # --- feedback session (the first ends exploration) ---
                if (
                    step >= first_feedback_step
                    and loop.sessions_done < len(schedule)
                    and (step - first_feedback_step) % args.teacher_feedback_frequency == 0
                ):
                    feedback_session(schedule[loop.sessions_done])
                if step >= first_feedback_step and not loop.critic_reset and len(prefs) > 0:
                    agent.reset_critic()  # Q-values of the intrinsic reward mean nothing for the learned one
                    loop.critic_reset = True

                # --- act ---
                if step < args.learning_starts:
                    actions = rng.uniform(action_space.low, action_space.high, size=(1, action_dim)).astype(np.float32)
                else:
                    with torch.no_grad():
                        actions, _, _ = agent.actor.get_action(torch.as_tensor(obs, dtype=torch.float32, device=device))
                    actions = actions.cpu().numpy()
                physics_state = get_physics_state(envs.envs[0])
                autoreset = bool(envs._autoreset_envs[0])
                next_obs, rewards, terminations, truncations, infos = envs.step(actions)

                # With next-step autoreset, the step after an episode end only resets: never store it.
                if not autoreset:
                    i = rb.add(obs[0], next_obs[0], actions[0], rewards[0], terminations[0], loop.episode_id, physics_state)
                    if len(prefs) > 0:
                        mean, std = predict_rewards(reward_model, torch.as_tensor(rb.obs_actions(np.array([i])), device=device))
                        rb.learned_rewards[i], rb.reward_std[i] = float(mean), float(std)
                    loop.episode_return += float(rewards[0])
                    loop.episode_length += 1
                    if terminations[0] or truncations[0]:
                        writer.add_scalar("charts/episodic_return", loop.episode_return, step)
                        writer.add_scalar("charts/episodic_length", loop.episode_length, step)
                        if progress is not None:
                            progress.set_postfix(
                                ret=f"{loop.episode_return:.0f}",
                                eval=f"{loop.last_eval_return:.0f}",
                                labels=loop.labels_obtained,
                                refresh=False,
                            )
                        loop.episode_id += 1
                        loop.episode_return, loop.episode_length = 0.0, 0
                obs = next_obs
                loop.global_step += 1

                # --- learn ---
                if step >= args.learning_starts and (len(prefs) > 0 or args.unsupervised_exploration):
                    idx = rb.sample_indices(args.batch_size, rng)
                    batch_obs = torch.as_tensor(rb.obs[idx], device=device)
                    batch_next_obs = torch.as_tensor(rb.next_obs[idx], device=device)
                    if len(prefs) == 0:  # unsupervised exploration: state entropy of the reached states
                        reference = torch.as_tensor(
                            rb.next_obs[rb.sample_indices(min(args.explore_knn_sample_size, rb.size), rng)], device=device
                        )
                        intrinsic = knn_state_entropy(batch_next_obs, reference, min(args.explore_knn_k, len(reference)))
                        intrinsic_rms.update(intrinsic)
                        batch_rewards = intrinsic / intrinsic_rms.std
                        if step % 100 == 0:
                            writer.add_scalar("exploration/intrinsic_reward", float(batch_rewards.mean()), step)
                    else:
                        batch_rewards = torch.as_tensor(rb.learned_rewards[idx], device=device)
                        if args.rune:
                            beta = rune_beta(args.rune_beta, args.rune_beta_decay, step)
                            batch_rewards = batch_rewards + beta * torch.as_tensor(rb.reward_std[idx], device=device)
                            if step % 100 == 0:
                                writer.add_scalar("rune/beta", beta, step)
                    stats = agent.update(
                        batch_obs,
                        torch.as_tensor(rb.actions[idx], device=device),
                        batch_rewards,
                        batch_next_obs,
                        torch.as_tensor(rb.terminated[idx], device=device),
                        step,
                    )
                    if step % 100 == 0:
                        for name, value in stats.items():
                            writer.add_scalar(f"losses/{name}", float(value), step)
                if step % 100 == 0:
                    sps = int((loop.global_step - start_step) / (time.time() - start_time))
                    writer.add_scalar("charts/SPS", sps, step)
                    if progress is not None:
                        progress.update(loop.global_step - progress.n)

                # --- evaluate, checkpoint ---
                if args.unsupervised_exploration and loop.global_step == args.total_explore_steps and not args.exploration_load:
                    save_checkpoint(model_dir / str(loop.global_step), checkpoint_state(), rb)  # reusable: --exploration-load
                if (
                    args.evaluation_frequency
                    and loop.global_step % args.evaluation_frequency == 0
                    and loop.global_step < args.total_timesteps
                ):
                    evaluate(loop.global_step)
                if (
                    args.checkpoint_frequency
                    and loop.global_step % args.checkpoint_frequency == 0
                    and loop.global_step < args.total_timesteps
                ):
                    save_checkpoint(model_dir / "latest", checkpoint_state(), rb)
        except KeyboardInterrupt:
            interrupted = True
            print(f"\ninterrupted at step {loop.global_step}: saving models/{run_name}/latest")
        finally:
            wall = time.time() - start_time  # training time: periodic evaluations included, the final one not
            save_checkpoint(model_dir / "latest", checkpoint_state(), rb)
            if progress is not None:
                progress.update(loop.global_step - progress.n)
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
