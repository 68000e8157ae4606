# PrefPPO: PPO trained only from preferences (Christiano et al. 2017, https://arxiv.org/abs/1706.03741, as B-Pref's
# PrefPPO), with PEBBLE's exploration, SURF, QPA's policy-aligned queries and RUNE, in CleanRL's single-file style.
#
# Read top to bottom: the settings, PPO (agent, rollouts, GAE, the clipped update), preference learning (the reward
# ensemble and its Bradley-Terry loss, query selection, the preference buffer, the schedule, reward training with SURF,
# the k-NN state entropy, RUNE) and `main`. Every iteration:
#   1. a rollout, copied into the replay buffer (where query segments come from, with their simulator states);
#   2. when a session is due: select pairs, ask the teacher, fit the reward model, relabel, reset the critic after
#      exploration (before the first session, PPO learns the k-NN state entropy);
#   3. the rollout's rewards from the reward model (plus RUNE's bonus), GAE, the PPO update.
# The preference-learning part is a deliberate copy of sac_rlhf.py's (tests/test_lockstep.py holds them identical);
# teachers, environments, buffers, checkpoints and logging live in cleanrlhf_utils.
import contextlib
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, Literal

from cleanrlhf_utils.arguments import refuse_unknown_flags

if __name__ == "__main__":
    refuse_unknown_flags(__file__)  # a mistyped flag: one line at once, not after the seconds torch takes to import

import gymnasium as gym
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from cleanrlhf_utils import envs as cleanrlhf_envs
from cleanrlhf_utils.buffers import ReplayBuffer
from cleanrlhf_utils.checkpoints import CheckpointArgs, validate_checkpoint_args
from cleanrlhf_utils.cli import cli
from cleanrlhf_utils.diagnostics import reward_diagnostics
from cleanrlhf_utils.envs import autoreset_pending, get_physics_state, physics_state_size
from cleanrlhf_utils.errors import ConfigError, check_ranges, need  # noqa: F401 (callers catch pref_ppo.ConfigError)
from cleanrlhf_utils.feedback import (
    FeedbackArgs,
    FeedbackSession,
    LabelLog,
    check_query_kind,
    check_teacher_objective,
    make_teacher,
    record_labels,
    show_reward_model,
    validate_feedback_args,
)
from cleanrlhf_utils.networks import ensemble_mlp
from cleanrlhf_utils.objectives import check_objective_settings, episode_end, load_objective
from cleanrlhf_utils.presets import PresetArgs
from cleanrlhf_utils.rankings import CLIPS_PER_QUERY_RANGE, clip_pairs, orders, pair_labels
from cleanrlhf_utils.ratings import clip_ratings
from cleanrlhf_utils.run import IterationStart, Run, RunArgs
from cleanrlhf_utils.speed import kth_nearest_distance
from cleanrlhf_utils.tracking import log_feedback_session, log_update
from cleanrlhf_utils.training import (
    EpisodeTracker,
    NormalizedPolicy,
    ObservationNormalizer,
    ReturnNormalizer,
    RunningMoments,
    crossed,
    seed_everything,
)


@dataclass
class PPOArgs(RunArgs):
    """PPO and the environments it acts in (shared with the true-reward baseline ppo.py)."""

    help_group: ClassVar[str] = "PPO"

    env_id: str = "Hopper-v5"
    """Gymnasium MuJoCo, dm_control/<domain>-<task>-v0 or classic control (CartPole-v1, ...)
    (docs/reference/working-envs.md; python framework/list_envs.py checks one)"""
    terminate_when_unhealthy: bool = True
    """end an episode when the robot falls (Hopper, Walker2d, Ant, Humanoid)"""
    terminate_when_tilted: bool = True
    """with --terminate-when-unhealthy, also end it when the torso tilts past Gymnasium's healthy angle"""
    total_timesteps: int = 1_000_000
    """total environment steps (whole iterations of num_envs x num_steps: the remainder is not run)"""
    learning_rate: float = 3e-4
    """the learning rate of the optimizer"""
    num_envs: int = 1
    """the number of parallel environments (gym.vector.SyncVectorEnv)"""
    num_steps: int = 2048
    """the number of steps to run in each environment per policy rollout"""
    anneal_lr: bool = True
    """anneal the learning rate linearly to 0"""
    gamma: float = 0.99
    """the discount factor gamma"""
    gae_lambda: float = 0.95
    """the lambda of generalised advantage estimation"""
    num_minibatches: int = 32
    """the number of mini-batches"""
    update_epochs: int = 10
    """the K epochs to update the policy"""
    norm_adv: bool = True
    """normalise the advantages"""
    clip_coef: float = 0.2
    """the surrogate clipping coefficient"""
    clip_vloss: bool = True
    """clip the value loss, as PPO's paper does"""
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
    """normalise the policy's observations by their running mean and std (saved in checkpoints, applied by
    evaluation)"""
    normalize_reward: bool = True
    """divide the rewards PPO learns from by the running std of the discounted return (CleanRL's NormalizeReward)"""


@dataclass
class PreferenceArgs:
    """Preference learning: exploration, the reward model, the label schedule, query selection, SURF, QPA and RUNE
    (identical in sac_rlhf.py and pref_ppo.py)."""

    help_group: ClassVar[str] = "preference learning"

    unsupervised_exploration: bool = True
    """before the first feedback session, learn on PEBBLE's k-NN state-entropy reward"""
    total_explore_steps: int = 10_000
    """environment steps of exploration before the first feedback session"""
    explore_knn_k: int = 5
    """k of the k-nearest-neighbour state-entropy estimate"""
    explore_knn_sample_size: int = 2048
    """buffer states the k-NN distances are measured against"""
    reward_ensemble_size: int = 3
    """members of the reward-model ensemble"""
    reward_net_hidden_dim: int = 256
    """width of the reward networks' hidden layers"""
    reward_net_hidden_layers: int = 3
    """hidden layers of each reward network"""
    reward_net_normalize_inputs: bool = False
    """standardise the reward model's (obs, action) inputs with the replay buffer's statistics (the DMC presets do)"""
    reward_net_lr: float = 3e-4
    """learning rate of the reward model"""
    reward_net_batch_size: int = 128
    """labelled pairs per reward-model batch"""
    reward_net_epochs: int = 100
    """most epochs of reward-model training per feedback session"""
    reward_net_target_accuracy: float = 0.97
    """stop a session's reward training once its accuracy on the labels reaches this"""
    reward_net_heldout_fraction: float = 0.1
    """human and file mode: share of the labels held out to measure accuracy (a synthetic teacher's: fresh pairs)"""
    teacher_feedback_schedule: Literal["linear", "exponential"] = "exponential"
    """`linear`: every session asks as many queries; `exponential`: earlier sessions ask more"""
    teacher_feedback_total_queries: int = 1000
    """total queries over the run (human mode, unless given: 100)"""
    teacher_feedback_num_queries_per_session: int = 100
    """queries per session, on average (human mode, unless given: 10)"""
    teacher_feedback_exponential_decay: float = 0.8
    """ratio of consecutive sessions' query counts under the exponential schedule"""
    teacher_feedback_frequency: int = 10_000
    """environment steps between feedback sessions"""
    segment_length: int = 50
    """steps per segment shown to the teacher"""
    clips_per_query: int = 2
    """clips in each query: 2 asks which of a pair is better; 3 to 6 ask for a ranking of that many clips, learned with
    the Plackett-Luce likelihood (the synthetic teacher or --teacher-feedback-mode file; docs/pebble.md)"""
    rating_scale: int = 0
    """0: a query's clips are compared or ranked; 2 to 10: the teacher rates each clip from 1 (worst) to this, learned
    with the ordered-logit likelihood on the same segment returns (docs/pebble.md)"""
    preference_sampling: Literal["uniform", "disagree", "entropy"] = "disagree"
    """how pairs are chosen from the candidate pool"""
    preference_sampling_pool_factor: int = 10
    """candidate pool size = factor x queries (disagree, entropy)"""
    surf: bool = True
    """SURF: pseudo-labelled pairs and temporal crops in reward training"""
    surf_sampling_strategy: Literal["uniform", "disagree", "entropy"] = "uniform"
    """SURF: how the unlabelled pairs are drawn (as --preference-sampling draws queries; SURF's: uniform)"""
    unlabeled_batch_ratio: int = 1
    """SURF: pseudo-labelled pairs per labelled pair in a batch"""
    surf_tau: float = 0.999
    """SURF: the ensemble-mean preference a pseudo-label needs (or 1 - tau)"""
    lambda_ssl: float = 0.1
    """SURF: weight of the pseudo-label loss"""
    max_augmentation_offset: int = 10
    """crops keep at least segment_length - max_augmentation_offset steps"""
    min_augmentation_offset: int = 5
    """crops keep at most segment_length - min_augmentation_offset steps"""
    qpa_query_episodes: int = 0
    """QPA: draw query segments from the last N episodes only (0: the whole buffer; QPA: 10)"""
    qpa_augmentations: int = 0
    """QPA: each label also trains as this many random crops per epoch (QPA: 20)"""
    rune: bool = False
    """RUNE: add beta_t x the ensemble's reward std as an exploration bonus"""
    rune_beta: float = 0.05
    """RUNE: the bonus's initial weight beta_0"""
    rune_beta_decay: float = 0.0001
    """RUNE: beta_t = beta_0 (1 - decay)^t, t the environment step"""


@dataclass
class Args(CheckpointArgs, FeedbackArgs, PreferenceArgs, PPOArgs, PresetArgs):
    """PrefPPO's settings: PPO's, preference learning's, the teacher's, checkpoints' and the --preset they start
    from."""

    help_group: ClassVar[str] = "PrefPPO"
    first_flags: ClassVar[str] = (
        "env_id total_timesteps preset seed teacher_feedback_mode teacher_feedback_total_queries teacher_objective "
        "feedback_server_autostart capture_video track run_name resume"
    )
    """the flags a newcomer sets, shown first by --help"""

    exp_name: str = "pref_ppo"
    """the name of this experiment (part of the run name)"""

    buffer_size: int = 100_000
    """recent transitions kept (with their simulator states) to draw query segments from (capped at total_timesteps)"""


def check_ppo_actions(env_id: str, space: gym.Space) -> None:
    kind = type(space).__name__
    needed = "PPO here needs a continuous (Box) or Discrete one"
    supported = isinstance(space, (gym.spaces.Box, gym.spaces.Discrete))
    need(supported, f"--env-id {env_id} has a {kind} action space; {needed}")


def make_env(env_id: str, seed: int, render_mode=None, width=320, height=240, **settings):
    """cleanrlhf_utils' environment, refused unless PPO can act in it (settings: terminate_when_unhealthy,
    terminate_when_tilted, ends_episode, task_seed: the Meta-World layout, default seed's)."""
    settings["check_actions"] = check_ppo_actions
    return cleanrlhf_envs.make_env(env_id, seed, render_mode, width, height, **settings)


def make_vector_env(args: PPOArgs) -> gym.vector.SyncVectorEnv:
    """num_envs copies with Gymnasium's next-step autoreset, all on the Meta-World layout of the run's seed."""
    ends = {"terminate_when_unhealthy": args.terminate_when_unhealthy, "ends_episode": episode_end(args)}
    ends |= {"terminate_when_tilted": args.terminate_when_tilted, "task_seed": args.seed}
    size = (args.video_width, args.video_height)
    copies = [make_env(args.env_id, args.seed + i, None, *size, **ends) for i in range(args.num_envs)]
    return gym.vector.SyncVectorEnv(copies, autoreset_mode=gym.vector.AutoresetMode.NEXT_STEP)


# ----------------------------------------------------------------------------------------
# PPO: CleanRL's agent, rollouts, normalisation, GAE and the clipped update (shared with ppo.py)
# ----------------------------------------------------------------------------------------
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
        action_space,
        actor_hidden_dim=64,
        actor_hidden_layers=2,
        critic_hidden_dim=64,
        critic_hidden_layers=2,
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


class RolloutBuffer:
    """One iteration's num_steps x num_envs steps, overwritten every iteration (preferences copy their segments
    out of the replay buffer, never point into this). `valid` is False on the steps where Gymnasium's next-step
    autoreset only resets an env: they are not transitions and nothing is learned from them."""

    def __init__(self, num_steps: int, num_envs: int, obs_dim: int, action_shape: tuple, action_input_dim, state_dim):
        shape = (num_steps, num_envs)
        self.num_steps, self.num_envs = num_steps, num_envs
        self.obs = np.zeros((*shape, obs_dim), dtype=np.float32)  # normalised: what the policy saw
        self.next_obs = np.zeros((*shape, obs_dim), dtype=np.float32)  # normalised with the same statistics
        self.raw_obs = np.zeros((*shape, obs_dim), dtype=np.float32)  # the reward model's and the replay buffer's
        self.raw_next_obs = np.zeros((*shape, obs_dim), dtype=np.float32)  # at an episode end: the final observation
        self.actions = np.zeros((*shape, *action_shape), dtype=np.float32)  # as sampled (Box: before clipping)
        self.reward_actions = np.zeros((*shape, action_input_dim), dtype=np.float32)  # as sent (clipped / one-hot)
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


def collect_rollout(envs, agent: Agent, obs_rms: ObservationNormalizer, rollout: RolloutBuffer, obs, episodes, device):
    """Runs the policy for num_steps vector steps from `obs`, filling `rollout`. Returns the observation to
    continue from and the episodes that ended, as (step within the rollout, env, return, length)."""
    action_space = envs.single_action_space
    finished = []
    for t in range(rollout.num_steps):
        if rollout.physics_states.shape[-1]:
            for i, env in enumerate(envs.envs):
                rollout.physics_states[t, i] = get_physics_state(env)
        valid = ~autoreset_pending(envs)  # with next-step autoreset, the step after an episode end only resets
        policy_obs = obs_rms.normalize(obs)
        with torch.no_grad():
            dist = agent.distribution(torch.as_tensor(policy_obs, device=device))
            action = dist.sample()
            logprob = dist.log_prob(action) if agent.discrete else dist.log_prob(action).sum(-1)
        action = action.cpu().numpy()
        sent = env_actions(action, action_space)
        next_obs, rewards, terminated, truncated, _ = envs.step(sent)
        rollout.obs[t], rollout.raw_obs[t], rollout.actions[t] = policy_obs, obs, action
        rollout.logprobs[t] = logprob.cpu().numpy()
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
    shape, width = rollout.valid.shape, rollout.obs.shape[-1]
    with torch.no_grad():
        values = agent.get_value(torch.as_tensor(rollout.obs.reshape(-1, width), device=device))
        next_values = agent.get_value(torch.as_tensor(rollout.next_obs.reshape(-1, width), device=device))
    return values.cpu().numpy().reshape(shape), next_values.cpu().numpy().reshape(shape)


def compute_gae(
    rewards, values, next_values, terminated, truncated, valid, gamma: float, gae_lambda: float
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


def ppo_update(agent: Agent, optimizer: torch.optim.Optimizer, batch: dict, args: PPOArgs, rng) -> dict:
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


def train_on_rollout(agent: Agent, optimizer, rollout: RolloutBuffer, rewards, args: PPOArgs, rng, device) -> dict:
    """Values, GAE on `rewards` (T, N), and the PPO update on the rollout's valid steps."""
    values, next_values = rollout_values(agent, rollout, device)
    advantages, returns = compute_gae(
        rewards, values, next_values, rollout.terminated, rollout.truncated, rollout.valid, args.gamma, args.gae_lambda
    )
    valid = rollout.valid
    batch = {"obs": rollout.obs, "actions": rollout.actions, "logprobs": rollout.logprobs}
    batch |= {"advantages": advantages, "returns": returns, "values": values}
    batch = {name: torch.as_tensor(value[valid], device=device) for name, value in batch.items()}
    if agent.discrete:
        batch["actions"] = batch["actions"].long()
    return ppo_update(agent, optimizer, batch, args, rng)


def set_learning_rate(optimizer: torch.optim.Optimizer, args: PPOArgs, iteration: int, num_iterations: int) -> float:
    """CleanRL's linear annealing: iteration 1 (of num_iterations) uses the full rate, the last 1/num_iterations of
    it."""
    lr = args.learning_rate * (1.0 - (iteration - 1.0) / num_iterations) if args.anneal_lr else args.learning_rate
    optimizer.param_groups[0]["lr"] = lr
    return lr


# ----------------------------------------------------------------------------------------
# Preference learning (a deliberate copy in sac_rlhf.py and pref_ppo.py: tests/test_lockstep.py)
# ----------------------------------------------------------------------------------------
class BradleyTerry:
    """The preference model: how a pair's predicted returns R (..., 2), each the summed reward of one segment, turn
    into a teacher's choice, P(segment 1 > segment 0) = sigmoid(R1 - R0), and the loss that fits it to labels (...):
    1 = segment 1 preferred, 0 = segment 0, 0.5 = a tie. The one place that states the model: reward training, SURF's
    confidence test and pseudo-label loss, query selection (disagreement, entropy), accuracy, RIME's selection and the
    mistake-aware loss all ask PREFERENCE_MODEL, so a model assigned there reaches every one of them. Bradley-Terry is
    Plackett-Luce for k = 2 clips: a model of rankings of k clips (returns (..., k)) or of ratings answers the same
    four questions."""

    def probability(self, returns: torch.Tensor) -> torch.Tensor:
        """P(segment 1 > segment 0) of each pair: (..., 2) -> (...)."""
        return torch.sigmoid(returns[..., 1] - returns[..., 0])

    def log_probabilities(self, returns: torch.Tensor) -> torch.Tensor:
        """log P(segment 0 preferred), log P(segment 1 preferred): (..., 2) -> (..., 2)."""
        margin = returns[..., 1] - returns[..., 0]
        return torch.stack([F.logsigmoid(-margin), F.logsigmoid(margin)], dim=-1)

    def loss(self, returns: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The labels' negative log-likelihood, averaged over pairs (and members): cross-entropy of sigmoid(R1 - R0)."""
        return F.binary_cross_entropy_with_logits(returns[..., 1] - returns[..., 0], labels)

    def label_losses(self, probability: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Each label's negative log-likelihood given the model's P(segment 1 > segment 0) of its pair (...)."""
        return F.binary_cross_entropy(probability.clamp(1e-7, 1 - 1e-7), labels, reduction="none")


class PlackettLuce(BradleyTerry):
    """Rankings of k clips (returns (..., k)), Plackett-Luce's model: the teacher picks the best clip with probability
    softmax(R), then the best of the others, and so on: P(order o) = prod_i exp(R_o_i) / sum_{j >= i} exp(R_o_j). A
    label is the order's index among the k! orders (cleanrlhf_utils.rankings). For k = 2 this is Bradley-Terry
    (tests/test_rankings.py checks it to float precision), and a pair is answered with Bradley-Terry's own expressions,
    so that pairs give the same numbers bit for bit. Of a ranking, `probability` gives each pair of its clips', P(clip j
    > clip i) = sigmoid(R_j - R_i) for i < j (the model's marginal), which query selection and accuracy ask; RIME's
    `label_losses` is the pairs' only."""

    def probability(self, returns: torch.Tensor) -> torch.Tensor:
        """P(segment 1 > segment 0) of each pair: (..., 2) -> (...); of each pair of clips: (..., k) -> (..., P), P = k
        (k - 1) / 2 in cleanrlhf_utils.rankings.clip_pairs order."""
        if returns.shape[-1] == 2:
            return super().probability(returns)
        first, second = (torch.as_tensor(clips, device=returns.device) for clips in clip_pairs(returns.shape[-1]))
        return torch.sigmoid(returns[..., second] - returns[..., first])

    def order_log_probabilities(self, returns: torch.Tensor) -> torch.Tensor:
        """log P of each of the k! orders, in label order: (..., k) -> (..., k!)."""
        ranked = returns[..., torch.as_tensor(orders(returns.shape[-1]), device=returns.device)]  # (..., k!, k)
        return ranked.sum(-1) - torch.logcumsumexp(ranked.flip(-1), dim=-1).sum(-1)

    def log_probabilities(self, returns: torch.Tensor) -> torch.Tensor:
        """log P of each label: a pair's two (..., 2) -> (..., 2), as Bradley-Terry; a ranking's k! (..., k!)."""
        return super().log_probabilities(returns) if returns.shape[-1] == 2 else self.order_log_probabilities(returns)

    def order_loss(self, returns: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The labels' negative log-likelihood, averaged: a label weighs each order by 1 - its distance from the label
        (all on its own order; a pair's tie, 0.5, half on each of the two)."""
        indices = torch.arange(math.factorial(returns.shape[-1]), device=returns.device)
        weights = torch.relu(1 - (labels[..., None] - indices).abs())
        return -(weights * self.order_log_probabilities(returns)).sum(-1).mean()

    def loss(self, returns: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The labels' negative log-likelihood, averaged over queries (and members): a pair's as Bradley-Terry."""
        return super().loss(returns, labels) if returns.shape[-1] == 2 else self.order_loss(returns, labels)


class OrderedLogit(PlackettLuce):
    """Comparisons and rankings as Plackett-Luce, and ratings of clips on a scale of n points by the ordered logit on
    the same segment returns: the teacher rates a clip of return R above point c with probability sigmoid(R - cut_c),
    where cut_1 < ... < cut_(n-1) are the reward model's own, learned with it (RewardEnsemble.rating_cuts). One model,
    two likelihoods on one return axis: a rating places a clip's return against the cuts, a comparison two returns
    against each other, and a loss over labels of both kinds is the sum of their negative log-likelihoods (a rating
    run's labelled ratings and SURF's pseudo-labelled pairs, say). A rating label holds its clips' ratings as digits
    (cleanrlhf_utils.ratings)."""

    def rating_probabilities(self, returns: torch.Tensor, cuts: torch.Tensor) -> torch.Tensor:
        """P(rating = c) of each clip, c = 0 .. n - 1: returns (E, ..., k), cuts (E, n - 1) -> (E, ..., k, n)."""
        cuts = cuts.reshape(cuts.shape[0], *[1] * (returns.dim() - 1), cuts.shape[-1])
        above = torch.sigmoid(returns[..., None] - cuts)  # P(rating > c), c = 0 .. n - 2
        ones = torch.ones_like(above[..., :1])
        return torch.cat([ones, above], dim=-1) - torch.cat([above, torch.zeros_like(ones)], dim=-1)

    def rating_loss(self, returns: torch.Tensor, labels: torch.Tensor, cuts: torch.Tensor) -> torch.Tensor:
        """The ratings' negative log-likelihood, summed over each query's clips and averaged over queries (and
        members): returns (E, b, k), labels (E, b) as cleanrlhf_utils.ratings writes them."""
        scale = cuts.shape[-1] + 1
        digits = scale ** torch.arange(returns.shape[-1], device=returns.device)
        ratings = labels.long()[..., None] // digits % scale  # (E, b, k)
        given = self.rating_probabilities(returns, cuts).gather(-1, ratings[..., None]).squeeze(-1)
        return -given.clamp_min(1e-7).log().sum(-1).mean()

    def loss(self, returns: torch.Tensor, labels: torch.Tensor, cuts: torch.Tensor | None = None) -> torch.Tensor:
        """The labels' negative log-likelihood, averaged over queries (and members): ratings' with the reward model's
        cuts (RewardEnsemble.rating_cuts), else comparisons' and rankings'."""
        return super().loss(returns, labels) if cuts is None else self.rating_loss(returns, labels, cuts)


PREFERENCE_MODEL = OrderedLogit()
"""the preference model every part of preference learning asks (looked up at each call)"""

RELABEL_CHUNK = 1024
"""transitions per forward pass when relabelling: 1024 keeps the activations in cache (bench/relabel.py)"""


class RewardEnsemble(nn.Module):
    """r_e(s, a) for every member e in one batched network; outputs lie in (-1, 1) (tanh, as PEBBLE)."""

    def __init__(self, input_dim: int, ensemble_size=3, hidden_dim=256, hidden_layers=3, dropout=0.0, rating_scale=0):
        super().__init__()
        self.ensemble_size, self.rating_scale = ensemble_size, rating_scale
        size = (hidden_dim, hidden_layers, 1)
        self.net = ensemble_mlp(ensemble_size, input_dim, *size, activation=nn.LeakyReLU, dropout=dropout)
        # Identity until set_input_statistics: raw inputs generalised worse to the policy's later data (reward_learning)
        self.register_buffer("input_mean", torch.zeros(input_dim))
        self.register_buffer("input_std", torch.ones(input_dim))
        if rating_scale:  # the ordered logit's cut points (rating_cuts), each member's: centred, a return apart
            first = torch.full((ensemble_size, 1), -(rating_scale - 2) / 2)
            gaps = torch.full((ensemble_size, rating_scale - 2), math.log(math.e - 1))  # softplus of it is 1
            self.rating_cut_parameters = nn.Parameter(torch.cat([first, gaps], dim=-1))

    @classmethod
    def from_args(cls, input_dim: int, args) -> "RewardEnsemble":
        """The reward model the settings describe: --reward-ensemble-size, --reward-net-hidden-dim and -layers, and
        --rating-scale's cut points."""
        sizes = (args.reward_ensemble_size, args.reward_net_hidden_dim, args.reward_net_hidden_layers)
        return cls(input_dim, *sizes, rating_scale=args.rating_scale)

    def rating_cuts(self) -> torch.Tensor | None:
        """The ordered logit's cut points on the segment-return axis, increasing: (E, n - 1); None without ratings."""
        if not self.rating_scale:
            return None
        first, gaps = self.rating_cut_parameters[:, :1], F.softplus(self.rating_cut_parameters[:, 1:])
        return torch.cat([first, first + gaps.cumsum(-1)], dim=-1)

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


def segment_returns(model: RewardEnsemble, segments, masks, chunk: int = 10) -> torch.Tensor:
    """Each member's predicted return of each clip: segments (N, k, L, D), masks (N, k, L) -> (E, N, k), in eval mode.
    Scored `chunk` queries at a time: a query pool in one pass held over 1 GB of activations at 1000 pairs, and about
    1000 rows a pass is also the fastest (bench/relabel.py)."""
    was_training = model.training
    model.eval()
    with torch.no_grad():
        queries = zip(segments.split(chunk), masks.split(chunk))
        returns = torch.cat([(model(s) * m).sum(-1) for s, m in queries], dim=1)
    model.train(was_training)
    return returns


def preference_probabilities(model: RewardEnsemble, segments, masks, chunk: int = 10) -> torch.Tensor:
    """P_e(segment 1 > segment 0) for each member: segments (N, 2, L, D), masks (N, 2, L) -> (E, N), in eval mode (of
    k clips, (N, k, L, D): each pair of them, (E, N, P), PREFERENCE_MODEL.probability)."""
    return PREFERENCE_MODEL.probability(segment_returns(model, segments, masks, chunk))


def disagreement_scores(probabilities: torch.Tensor) -> torch.Tensor:
    """Std across members of P(segment 1 > segment 0): (E, N) -> (N,); of k clips, its mean over their pairs: (E, N,
    P) -> (N,)."""
    spread = probabilities.std(0, unbiased=False)
    return spread if spread.ndim == 1 else spread.mean(-1)


def entropy_scores(probabilities: torch.Tensor) -> torch.Tensor:
    """Entropy of the ensemble-mean two-way preference: highest for pairs at the decision boundary (of k clips, its
    mean over their pairs)."""
    p = probabilities.mean(0).clamp(1e-7, 1 - 1e-7)
    entropy = -(p * p.log() + (1 - p) * (1 - p).log())
    return entropy if entropy.ndim == 1 else entropy.mean(-1)


def predict_rewards(model: RewardEnsemble, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Ensemble mean and std of r(s, a) for x (N, D), in eval mode (no dropout noise)."""
    was_training = model.training
    model.eval()
    with torch.no_grad():
        rewards = model(x)
    model.train(was_training)
    return rewards.mean(0), rewards.std(0, unbiased=False)


def predict_reward_arrays(model: RewardEnsemble, device, obs_actions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """predict_rewards of an array of (obs, action) rows, as arrays."""
    mean, std = predict_rewards(model, torch.as_tensor(obs_actions, device=device))
    return mean.cpu().numpy(), std.cpu().numpy()


def relabel_replay_buffer(model: RewardEnsemble, rb: ReplayBuffer, device: torch.device) -> None:
    """Recompute the learned reward (ensemble mean) and RUNE's std of every stored transition."""
    for start in range(0, rb.size, RELABEL_CHUNK):
        idx = np.arange(start, min(start + RELABEL_CHUNK, rb.size))
        mean, std = predict_rewards(model, torch.as_tensor(rb.obs_actions(idx), device=device))
        rb.learned_rewards[idx], rb.reward_std[idx] = mean.cpu().numpy(), std.cpu().numpy()


class PreferenceBuffer:
    """The labelled segments themselves (never indices into the replay buffer, which moves on): `clips` per query, 2 a
    pair; a ranking's label is its order's index (cleanrlhf_utils.rankings)."""

    FIELDS = ("obs_actions", "masks", "true_rewards", "physics_states", "labels", "heldout", "global_steps")

    def __init__(self, segment_length: int, input_dim: int, state_dim: int, clips: int = 2):
        self.obs_actions = np.zeros((0, clips, segment_length, input_dim), dtype=np.float32)
        self.masks = np.zeros((0, clips, segment_length), dtype=bool)
        self.true_rewards = np.zeros((0, clips, segment_length), dtype=np.float32)
        self.physics_states = np.zeros((0, clips, segment_length, state_dim), dtype=np.float64)
        self.labels = np.zeros(0, dtype=np.float32)  # 1 = segment 1 preferred, 0.5 = tie; a ranking: its order
        self.heldout = np.zeros(0, dtype=bool)  # validation split, never trained on
        self.global_steps = np.zeros(0, dtype=np.int64)  # when the label was obtained

    def __len__(self) -> int:
        return len(self.labels)

    def add(self, obs_actions, masks, true_rewards, physics_states, labels, heldout, global_step: int) -> None:
        steps = np.full(len(labels), global_step, dtype=np.int64)
        values = (obs_actions, masks, true_rewards, physics_states, labels, heldout, steps)
        for name, value in zip(self.FIELDS, values, strict=True):
            setattr(self, name, np.concatenate([getattr(self, name), value.astype(getattr(self, name).dtype)]))

    @property
    def clips(self) -> int:
        return self.masks.shape[1]

    def split(self, heldout: bool) -> np.ndarray:
        return np.flatnonzero(self.heldout == heldout)

    def state_dict(self) -> dict:
        return {name: getattr(self, name) for name in self.FIELDS}

    def load_state_dict(self, state: dict) -> None:
        for name in self.FIELDS:
            setattr(self, name, np.asarray(state[name]))


def rating_accuracy(model: RewardEnsemble, prefs: PreferenceBuffer, indices, device, chunk: int = 256) -> float:
    """The share of the rated clips at `indices` whose most likely rating under the ensemble-mean ordered logit is the
    one given."""
    correct, cuts = 0, model.rating_cuts().detach()
    for start in range(0, len(indices), chunk):
        batch = indices[start : start + chunk]
        segs = torch.as_tensor(prefs.obs_actions[batch], device=device)
        masks = torch.as_tensor(prefs.masks[batch], device=device, dtype=torch.float32)
        probabilities = PREFERENCE_MODEL.rating_probabilities(segment_returns(model, segs, masks), cuts).mean(0)
        given = clip_ratings(prefs.labels[batch], prefs.clips, model.rating_scale)
        correct += int((probabilities.argmax(-1).cpu().numpy() == given).sum())
    return correct / (len(indices) * prefs.clips) if len(indices) else float("nan")


def preference_accuracy(model: RewardEnsemble, prefs: PreferenceBuffer, indices, device, chunk: int = 256) -> float:
    """Agreement of the ensemble-mean preference with the non-tie labels at `indices` (of rankings: with every pair of
    their clips, cleanrlhf_utils.rankings.pair_labels; of ratings: rating_accuracy)."""
    if model.rating_scale:
        return rating_accuracy(model, prefs, indices, device, chunk)
    indices = indices[prefs.labels[indices] != 0.5]
    if len(indices) == 0:
        return float("nan")
    correct, pairs_per_query = 0, prefs.clips * (prefs.clips - 1) // 2
    for start in range(0, len(indices), chunk):
        batch = indices[start : start + chunk]
        segs = torch.as_tensor(prefs.obs_actions[batch], device=device)
        masks = torch.as_tensor(prefs.masks[batch], device=device, dtype=torch.float32)
        probs = preference_probabilities(model, segs, masks).mean(0).cpu().numpy()
        correct += int(((probs > 0.5) == (pair_labels(prefs.labels[batch], prefs.clips) > 0.5)).sum())
    return correct / (len(indices) * pairs_per_query)


# --- Query selection: uniform, disagreement, entropy ---
def select_queries(strategy, model, rb, num_queries: int, length: int, pool_factor, rng, device, recent=0, clips=2):
    """Indices (num_queries, clips, L) and masks of the queries to ask about, pairs or sets of `clips` clips to rank:
    `num_queries` of a pool `pool_factor` times as large with the highest disagreement or entropy (of a set: the mean
    over its pairs of clips), or simply drawn (`uniform`); from the last `recent` episodes only when it is set (QPA)."""
    pool = num_queries if strategy == "uniform" else num_queries * pool_factor
    idx, mask = rb.sample_segment_sets(pool, clips, length, rng, recent)
    if strategy == "uniform":
        return idx, mask
    segments = torch.as_tensor(rb.obs_actions(idx), device=device)
    probs = preference_probabilities(model, segments, torch.as_tensor(mask, device=device, dtype=torch.float32))
    scores = disagreement_scores(probs) if strategy == "disagree" else entropy_scores(probs)
    top = torch.topk(scores, num_queries).indices.cpu().numpy()
    return idx[top], mask[top]


def session_pairs(number: int, schedule: list[int], model: RewardEnsemble, rb: ReplayBuffer, args, rng, device) -> dict:
    """Feedback session `number`'s queries (rb.gather_segments), pairs or --clips-per-query clips, chosen by the reward
    model as it stands. The first session samples uniformly: an untrained ensemble's disagreement carries no
    information."""
    strategy = "uniform" if number == 1 else args.preference_sampling
    pool = (args.segment_length, args.preference_sampling_pool_factor)
    recent, clips = args.qpa_query_episodes, args.clips_per_query
    idx, mask = select_queries(strategy, model, rb, schedule[number - 1], *pool, rng, device, recent, clips)
    return rb.gather_segments(idx, mask)


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


# --- SURF: temporal crops and pseudo-labels ---
def crop_segments(segments, masks, min_offset: int, max_offset: int, cut_out: bool = True) -> tuple:
    """SURF's temporal crops of pairs, segments (..., 2, L, D) with masks (..., 2, L): each segment keeps a window at
    its own random start; both segments of a pair keep the same random length in [L - max_offset, L - min_offset],
    since comparing summed rewards over unequal lengths biases the label. `cut_out`: the window of L - min_offset
    steps that holds each crop, with the crop's mask (only those steps are computed); else the whole segments with
    the crops as their masks (the same draws, the same returns)."""
    shape, length = masks.shape[:-1], masks.shape[-1]
    crop_len = torch.randint(length - max_offset, length - min_offset + 1, shape[:-1])[..., None].expand(shape)
    start = (torch.rand(shape) * (length - crop_len + 1)).long()
    steps = torch.arange(length)
    crops = ((steps >= start[..., None]) & (steps < (start + crop_len)[..., None])).to(masks.device)
    if not cut_out:
        return segments, masks * crops
    width = length - min_offset
    steps = crops.float().argmax(-1, keepdim=True).clamp_max(length - width) + torch.arange(width, device=masks.device)
    return segments.take_along_dim(steps[..., None], dim=-2), (masks * crops).take_along_dim(steps, dim=-1)


def pseudo_labels(probabilities: torch.Tensor, tau: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Hard labels from the ensemble-mean preference and the mask of pairs confident beyond tau."""
    mean = probabilities.mean(0)
    confident = (mean > tau) | (mean < 1 - tau)
    return (mean > 0.5).float(), confident


def surf_loss(model: RewardEnsemble, rb: ReplayBuffer, num_pairs: int, args, rng, device) -> tuple[torch.Tensor, int]:
    """Pseudo-label loss on cropped unlabelled pairs (drawn as --surf-sampling-strategy says) whose ensemble-mean
    preference is beyond tau."""
    pool = (args.segment_length, args.preference_sampling_pool_factor)
    idx, mask = select_queries(args.surf_sampling_strategy, model, rb, num_pairs, *pool, rng, device)
    segments = torch.as_tensor(rb.obs_actions(idx), device=device)
    masks = torch.as_tensor(mask, device=device, dtype=torch.float32)
    segments, masks = crop_segments(segments, masks, args.min_augmentation_offset, args.max_augmentation_offset)
    with torch.no_grad():  # find the confident pairs first: only they take part in the backward pass
        returns = (model(segments) * masks).sum(-1)  # (E, n, 2)
        labels, confident = pseudo_labels(PREFERENCE_MODEL.probability(returns), args.surf_tau)
    if not confident.any():
        return torch.zeros((), device=device), 0
    ensemble = model.ensemble_size
    returns = (model(segments[confident]) * masks[confident]).sum(-1)
    loss = PREFERENCE_MODEL.loss(returns, labels[confident].expand(ensemble, -1)) * ensemble
    return loss, int(confident.sum())


# --- Reward-model training: the preference model's loss, with SURF's crops and pseudo-labels and QPA's crops ---
def labelled_loss(model: RewardEnsemble, returns: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """PREFERENCE_MODEL's loss of labelled queries, returns (E, b, clips) and labels (E, b): of ratings with the reward
    model's cut points, of comparisons and rankings without."""
    cuts = model.rating_cuts()
    return PREFERENCE_MODEL.loss(returns, labels) if cuts is None else PREFERENCE_MODEL.loss(returns, labels, cuts)


def reward_epoch(model: RewardEnsemble, optimizer, pairs: tuple, active, rb, args, rng, device, loss_fn=None) -> dict:
    """One epoch over the labelled pairs (segments, masks, labels) at `active`: every member sees its own shuffle, each
    pair once plus --qpa-augmentations cropped copies (all copies cropped with SURF), with SURF's pseudo-label loss.
    `loss_fn(returns, labels)`: the labelled pairs' loss (default: labelled_loss). A rated clip is never cropped."""
    loss_fn = loss_fn or functools.partial(labelled_loss, model)
    all_segments, all_masks, all_labels = pairs
    ensemble, labelled, copies = model.ensemble_size, len(active), 1 + args.qpa_augmentations
    offsets = (args.min_augmentation_offset, args.max_augmentation_offset)
    crop = not model.rating_scale  # a rating judges the whole clip: a crop's return lies elsewhere on its scale
    order = torch.argsort(torch.rand(ensemble, labelled * copies), dim=1)  # entries >= labelled are augmented copies
    losses, ssl_losses, pseudo = [], [], 0
    for start in range(0, labelled * copies, args.reward_net_batch_size):
        batch = order[:, start : start + args.reward_net_batch_size]  # (E, b)
        chosen = active[batch % labelled]
        segments, masks, labels = all_segments[chosen], all_masks[chosen], all_labels[chosen]
        cropped = batch >= labelled
        if args.surf and crop:  # every copy cropped: cut the crops out, the steps outside them are not computed
            segments, masks = crop_segments(segments, masks, *offsets)
        elif cropped.any() and crop:  # only QPA's copies: mask them, their batch mixes with whole segments
            _, crops = crop_segments(segments, masks, *offsets, cut_out=False)
            masks = torch.where(cropped[..., None, None].to(device), crops, masks)
        returns = (model.forward_members(segments) * masks).sum(-1)  # (E, b, clips)
        loss = loss_fn(returns, labels) * ensemble  # summed over members
        if args.surf and args.unlabeled_batch_ratio > 0:
            ssl_loss, confident = surf_loss(model, rb, batch.shape[1] * args.unlabeled_batch_ratio, args, rng, device)
            loss = loss + args.lambda_ssl * ssl_loss
            ssl_losses.append(ssl_loss.item())
            pseudo += confident
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item() / ensemble)
    ssl = float(np.mean(ssl_losses)) if ssl_losses else 0.0
    return {"train_loss": float(np.mean(losses)), "ssl_loss": ssl, "pseudo_labels": pseudo, "steps": len(losses)}


def train_reward_model(model: RewardEnsemble, optimizer, prefs, rb, args, rng, device, loss_fn=None) -> dict:
    """Fits the ensemble to the training split of the labels, epoch after epoch (reward_epoch, with `loss_fn`), until
    its accuracy on them reaches --reward-net-target-accuracy or --reward-net-epochs have run. Returns the last
    epoch's figures."""
    train_idx = prefs.split(heldout=False)
    stats = {"train_loss": float("nan"), "ssl_loss": 0.0, "pseudo_labels": 0, "epochs": 0, "steps": 0}
    if len(train_idx) == 0:
        return stats
    if args.reward_net_normalize_inputs:  # the statistics of all data so far, as the queries were drawn from it
        model.set_input_statistics(rb.obs_actions(slice(0, rb.size)))
    pairs = (
        torch.as_tensor(prefs.obs_actions[train_idx], device=device),
        torch.as_tensor(prefs.masks[train_idx], device=device, dtype=torch.float32),
        torch.as_tensor(prefs.labels[train_idx], device=device),
    )
    model.train()
    for epoch in range(args.reward_net_epochs):
        active = torch.arange(len(train_idx))
        epoch_stats = reward_epoch(model, optimizer, pairs, active, rb, args, rng, device, loss_fn)
        totals = {name: stats[name] + epoch_stats[name] for name in ("pseudo_labels", "steps")}
        stats |= epoch_stats | totals | {"epochs": epoch + 1}
        # Stop on the accuracy of the whole, uncropped training split: cropped-batch accuracy stops too early.
        if preference_accuracy(model, prefs, train_idx, device) >= args.reward_net_target_accuracy:
            break
    model.train()
    return stats


def reward_model_metrics(model: RewardEnsemble, prefs, rb, args, fresh: bool, step: int, device) -> dict:
    """Accuracy on the labels trained on and on held-out ones (with `fresh`: on fresh pairs labelled by the reward the
    teacher judges by, which cost no label), and the learned reward against that reward
    (cleanrlhf_utils.diagnostics)."""
    probabilities = functools.partial(preference_probabilities, model)
    objective, seed = load_objective(args.teacher_objective), (args.seed, step)
    measured = reward_diagnostics(rb, objective, probabilities, args.segment_length, seed, fresh, device)
    if not fresh:
        measured["heldout_accuracy"] = preference_accuracy(model, prefs, prefs.split(True), device)
    return {"train_accuracy": preference_accuracy(model, prefs, prefs.split(False), device)} | measured


# --- Unsupervised exploration: PEBBLE's k-NN state-entropy reward; RUNE's exploration bonus ---
def knn_state_entropy(states: torch.Tensor, reference: torch.Tensor, k: int) -> torch.Tensor:
    """PEBBLE's state-entropy estimate of each state (B, D): the distance to its k-th nearest neighbour among
    `reference` (M, D), k <= M (found by a grouped search, cleanrlhf_utils.speed)."""
    return kth_nearest_distance(states, reference, k)


def rune_beta(beta0: float, decay: float, step: int) -> float:
    """RUNE's exploration weight beta_t = beta_0 (1 - decay)^t."""
    return beta0 * (1.0 - decay) ** step


# ----------------------------------------------------------------------------------------
# Settings checks: every value is checked before anything is built or written
# ----------------------------------------------------------------------------------------
PREFERENCE_RANGES = {
    "total_explore_steps": ">= 0",
    "explore_knn_k": ">= 1",
    "reward_ensemble_size": ">= 1",
    "reward_net_heldout_fraction": "in [0, 1)",
    "teacher_feedback_total_queries": ">= 0",
    "teacher_feedback_num_queries_per_session": ">= 1",
    "teacher_feedback_exponential_decay": "in (0, 1]",
    "teacher_feedback_frequency": ">= 1",
    "segment_length": ">= 2",
    "clips_per_query": CLIPS_PER_QUERY_RANGE,
    "preference_sampling_pool_factor": ">= 1",
    "unlabeled_batch_ratio": ">= 0",
    "surf_tau": "in (0.5, 1)",
    "min_augmentation_offset": ">= 0",
    "qpa_query_episodes": ">= 0",
    "qpa_augmentations": ">= 0",
    "rune_beta": ">= 0",
    "rune_beta_decay": "in [0, 1)",
}


def validate_preference_args(args) -> None:
    """PreferenceArgs, the teacher's and the checkpoints' settings, and what --teacher-objective needs."""
    check_ranges(args, PREFERENCE_RANGES)
    low, high = args.min_augmentation_offset, args.max_augmentation_offset
    need(low <= high, f"--min-augmentation-offset ({low}) must be >= 0 and <= --max-augmentation-offset ({high})")
    need(
        high < args.segment_length,
        f"--max-augmentation-offset ({high}) must be smaller than --segment-length ({args.segment_length})",
    )
    sample = args.explore_knn_sample_size
    need(
        sample >= args.explore_knn_k,
        f"--explore-knn-sample-size must be >= --explore-knn-k ({args.explore_knn_k}), got {sample}",
    )
    check_objective_settings(args)  # the env it is for, and the settings it needs
    validate_feedback_args(args)
    check_query_kind(args)
    validate_checkpoint_args(args)


PPO_RANGES = {
    "total_timesteps": "> 0",
    "num_envs": ">= 1",
    "num_steps": ">= 1",
    "learning_rate": "> 0",
    "num_minibatches": ">= 1",
    "update_epochs": ">= 1",
    "gamma": "in [0, 1]",
    "gae_lambda": "in [0, 1]",
    "clip_coef": "> 0",
    "max_grad_norm": "> 0",
    "actor_hidden_layers": ">= 0",
    "critic_hidden_layers": ">= 0",
    "evaluation_frequency": ">= 0",
    "evaluation_episodes": ">= 1",
}


def validate_ppo_args(args: PPOArgs) -> None:
    check_ranges(args, PPO_RANGES)
    total, rollout = args.total_timesteps, args.num_envs * args.num_steps
    need(
        args.total_timesteps >= rollout,
        f"--total-timesteps ({total}) must hold at least one rollout: --num-envs x --num-steps = {rollout}",
    )
    need(args.target_kl is None or args.target_kl > 0, f"--target-kl must be > 0, got {args.target_kl}")
    cleanrlhf_envs.check_env_id(args.env_id)
    if args.capture_video:
        cleanrlhf_envs.check_can_render(args.env_id, "--capture-video")


def validate_args(args: Args) -> None:
    validate_ppo_args(args)
    validate_preference_args(args)
    need(args.buffer_size >= 1, f"--buffer-size must be >= 1, got {args.buffer_size}")


# ----------------------------------------------------------------------------------------
# PrefPPO: the rollout's rewards from the reward model or the k-NN state entropy; the replay buffer from rollouts
# ----------------------------------------------------------------------------------------
def relabel_rollout(model: RewardEnsemble, rollout: RolloutBuffer, device, beta: float = 0.0) -> None:
    """The rewards PPO learns from: the ensemble mean of r(obs, action) at every step of the rollout plus RUNE's
    beta x ensemble std, predicted in chunks, without gradients, in eval mode. Autoreset steps get 0."""
    x = rollout.obs_actions().reshape(-1, rollout.raw_obs.shape[-1] + rollout.reward_actions.shape[-1])
    mean, std = np.zeros(len(x), dtype=np.float32), np.zeros(len(x), dtype=np.float32)
    for start in range(0, len(x), RELABEL_CHUNK):
        rows = slice(start, start + RELABEL_CHUNK)
        chunk_mean, chunk_std = predict_rewards(model, torch.as_tensor(x[rows], device=device))
        mean[rows], std[rows] = chunk_mean.cpu().numpy(), chunk_std.cpu().numpy()
    valid = rollout.valid
    rollout.learned_rewards[:] = np.where(valid, mean.reshape(valid.shape), 0.0)
    rollout.reward_std[:] = np.where(valid, std.reshape(valid.shape), 0.0)
    rollout.rewards[:] = rollout.learned_rewards + np.float32(beta) * rollout.reward_std


def add_rollout_to_buffer(rb: ReplayBuffer, rollout: RolloutBuffer) -> None:
    """Copies the rollout's transitions (autoreset steps excluded) into the replay buffer env by env, so that
    consecutive slots are consecutive steps of one env and segments stay inside one episode (with several envs a
    segment also stops where one env's part of a rollout ends). Records each step's slot in rollout.rb_index."""
    rollout.rb_index[:] = -1
    env, t = np.nonzero(rollout.valid.T)  # env by env, each env's steps in order
    fields = (rollout.raw_obs, rollout.raw_next_obs, rollout.reward_actions, rollout.true_rewards, rollout.terminated)
    fields += (rollout.episode_ids, rollout.physics_states)
    rollout.rb_index[t, env] = rb.add_many(*(field[t, env] for field in fields))


def exploration_rewards(rollout: RolloutBuffer, rb: ReplayBuffer, intrinsic_rms, args, rng, device, chunk=4096) -> None:
    """PEBBLE's intrinsic reward for a rollout: the distance from each reached state to its k-th nearest neighbour
    among a random sample of replay-buffer states (this rollout's included), over its running std."""
    rollout.rewards[:] = 0.0
    states = torch.as_tensor(rollout.raw_next_obs[rollout.valid], device=device)
    if len(states) == 0:
        return
    sample = rb.sample_indices(min(args.explore_knn_sample_size, rb.size), rng)
    reference = torch.as_tensor(rb.next_obs[sample], device=device)
    k = min(args.explore_knn_k, len(reference))
    pieces = [knn_state_entropy(states[s : s + chunk], reference, k) for s in range(0, len(states), chunk)]
    distances = torch.cat(pieces)
    intrinsic_rms.update(distances)
    rollout.rewards[rollout.valid] = (distances / float(intrinsic_rms.std)).cpu().numpy()


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
    learning_from_preferences: bool = False  # labels exist (and after exploration, the critic was reset for them)
    last_eval_return: float = float("nan")


# What an iteration changes besides the networks and the labels: rewound when a run is interrupted mid-iteration.
REWOUND_PARTS = ("episodes", "obs_normalizer", "return_normalizer", "intrinsic_rms")


def log_episodes(writer, finished: list, rollout_start: int, num_envs: int, last_return: float) -> float:
    """The return and length of each episode a rollout finished (collect_rollout's (step, env, return, length)), at the
    step it ended; returns the last one's return (`last_return` where none ended)."""
    for t, _, episode_return, episode_length in finished:
        writer.add_scalar("charts/episodic_return", episode_return, rollout_start + (t + 1) * num_envs)
        writer.add_scalar("charts/episodic_length", episode_length, rollout_start + (t + 1) * num_envs)
        last_return = episode_return
    return last_return


def reset_after_session(agent: Agent, optimizer, return_rms: ReturnNormalizer, loop: LoopState, labels: int, args):
    """When the first labels end exploration, the critic and the return normaliser start afresh (they were fitted to
    the intrinsic reward)."""
    if labels > 0 and not loop.learning_from_preferences:
        if args.unsupervised_exploration:
            agent.reset_critic(optimizer)
            return_rms.reset()
        loop.learning_from_preferences = True


def sessions_due(step: int, explore_end: int, frequency: int, sessions: int) -> int:
    """How many of the run's `sessions` feedback sessions are due after the rollout that reaches `step`: the first
    after the rollout that ends exploration (`explore_end`), then one every `frequency` steps."""
    return 0 if step <= explore_end else min(sessions, math.ceil((step - explore_end) / frequency))


def main(args: Args, on_evaluation=None, reward_training: Callable | None = None) -> dict:
    """Train and return the run's summary. `on_evaluation(step, mean_return)` is called after every evaluation (a sweep
    reports and prunes with it). `reward_training(model, optimizer, prefs, rb, args, rng, device) -> stats` fits the
    reward model at every session (default train_reward_model, looked up at the call: a test may replace it); a variant
    passes its own (one with state_dict/load_state_dict is checkpointed)."""
    validate_args(args)
    reward_training = reward_training or train_reward_model
    run = Run(args, "pref_ppo", on_evaluation)
    with contextlib.ExitStack() as cleanup:  # closes what was opened however the run ends (a sweep may prune it)
        envs = cleanup.enter_context(contextlib.closing(make_vector_env(args)))  # a bad env fails before any write
        obs, _ = envs.reset(seed=args.seed)
        obs_dim, action_space = int(np.prod(envs.single_observation_space.shape)), envs.single_action_space
        state_dim, action_input_dim = physics_state_size(envs.envs[0]), reward_action_dim(action_space)
        check_teacher_objective(args, obs_dim, action_input_dim, state_dim)  # before anything is written
        writer = run.start_logging(cleanup)
        device, rng = seed_everything(args)  # rng: minibatches, segment and k-NN sampling, held-out split
        hidden = (args.actor_hidden_dim, args.actor_hidden_layers, args.critic_hidden_dim, args.critic_hidden_layers)
        agent = Agent(obs_dim, action_space, *hidden).to(device)
        optimizer = torch.optim.Adam(agent.parameters(), lr=args.learning_rate, eps=1e-5, fused=True)
        reward_model = RewardEnsemble.from_args(obs_dim + action_input_dim, args).to(device)
        reward_optimizer = torch.optim.Adam(reward_model.parameters(), lr=args.reward_net_lr, fused=True)
        rb = ReplayBuffer(min(args.buffer_size, args.total_timesteps), obs_dim, action_input_dim, state_dim)
        prefs = PreferenceBuffer(args.segment_length, obs_dim + action_input_dim, state_dim, args.clips_per_query)
        rollout = RolloutBuffer(args.num_steps, args.num_envs, obs_dim, action_space.shape, action_input_dim, state_dim)
        obs_rms = ObservationNormalizer(obs_dim, enabled=args.normalize_obs)
        return_rms = ReturnNormalizer(args.num_envs, args.gamma, enabled=args.normalize_reward)
        intrinsic_rms, episodes = RunningMoments(), EpisodeTracker(args.num_envs)
        teacher = cleanup.enter_context(contextlib.closing(make_teacher(args, rb, run.name, run.dir, run.video_dir)))
        label_log = cleanup.enter_context(contextlib.closing(LabelLog(run.dir / "labels.sqlite", args.rating_scale)))
        free = teacher.labels_are_free  # asking costs nothing: accuracy is measured on fresh pairs, no label held out
        heldout_fraction = 0.0 if free else args.reward_net_heldout_fraction
        budget = (args.teacher_feedback_total_queries, args.teacher_feedback_num_queries_per_session)
        schedule = feedback_schedule(*budget, args.teacher_feedback_schedule, args.teacher_feedback_exponential_decay)
        batch_size = args.num_envs * args.num_steps
        num_iterations = args.total_timesteps // batch_size
        # Exploration ends at the first iteration boundary at or after --total-explore-steps (0: no exploration).
        explore_end = batch_size * math.ceil(args.total_explore_steps / batch_size) * args.unsupervised_exploration
        sessions = (explore_end + 1, args.teacher_feedback_frequency, schedule)  # each after the rollout that passes it
        run.say_feedback_plan(*sessions, end=num_iterations * batch_size + 1, step=batch_size)
        session = FeedbackSession(teacher, label_log, args)  # the open session's pairs and answers
        parts = {"agent": agent, "optimizer": optimizer, "reward_model": reward_model, "teacher": teacher}
        parts |= {"reward_optimizer": reward_optimizer, "preference_buffer": prefs, "episodes": episodes}
        parts |= {"obs_normalizer": obs_rms, "return_normalizer": return_rms, "intrinsic_rms": intrinsic_rms}
        parts["session"] = session
        parts |= {"reward_training": reward_training} if hasattr(reward_training, "state_dict") else {}  # a variant's
        loop, obs = run.restore(parts, rng, rb, envs, obs, LoopState())
        start, last_return = None, float("nan")  # start: where the running iteration began (IterationStart)
        predict_learned_rewards = functools.partial(predict_reward_arrays, reward_model, device)

        def save(folder: str | int) -> None:  # in a reward update: the state before it (session.rollback)
            state = run.state(parts, rng, loop, envs, obs) | session.rollback()
            if start is not None:  # stopped mid-iteration: the interrupted rollout is collected again
                state = start.rewind(state, rb)
            run.save(folder, state, rb)

        def choose_pairs(number: int) -> dict:  # session `number`'s pairs, chosen by the reward model as it stands
            start.session_started = True  # the RNG runs on: the rollout is collected again, the session not asked again
            return session_pairs(number, schedule, reward_model, rb, args, rng, device)

        with run.training(loop, num_iterations * batch_size, lambda: save("latest")):
            for _ in run.iterations(loop, num_iterations):  # Ctrl-C, SIGTERM: stop between two iterations
                start = IterationStart.capture(loop, parts, REWOUND_PARTS, rng, envs, obs, rb)
                lr = set_learning_rate(optimizer, args, loop.iteration + 1, num_iterations)

                # --- a rollout, copied into the replay buffer ---
                rollout_start = loop.global_step
                obs, finished = collect_rollout(envs, agent, obs_rms, rollout, obs, episodes, device)
                loop.global_step += batch_size
                teacher.training_progress(loop.global_step, loop.sessions_done, len(schedule))  # the page's news
                loop.iteration += 1
                step = loop.global_step
                last_return = log_episodes(writer, finished, rollout_start, args.num_envs, last_return)
                add_rollout_to_buffer(rb, rollout)
                obs_rms.update(rollout.raw_obs[rollout.valid])  # for the next rollout: this one keeps its statistics

                # --- feedback session: choose pairs, the teacher answers, fit, relabel, reset the critic, count ---
                due = sessions_due(step, explore_end, args.teacher_feedback_frequency, len(schedule))
                if not session.open and loop.sessions_done < due:
                    number = loop.sessions_done + 1
                    session.start(session.take_staged(number) or choose_pairs(number), number)  # choose pairs
                last = loop.iteration == num_iterations
                if session.open and session.answers_in(step, last, due, choose_pairs):  # people: async, resumed
                    start.session_started = True  # the RNG runs on: the rollout is collected again, not the session
                    with session.update(parts, rng, loop):  # one unit: Ctrl-C inside it saves the state before it
                        complete = record_labels(prefs, label_log, session, loop, heldout_fraction, rng, teacher)
                        reward_stats = reward_training(reward_model, reward_optimizer, prefs, rb, args, rng, device)
                        relabel_replay_buffer(reward_model, rb, device)
                        reset_after_session(agent, optimizer, return_rms, loop, len(prefs), args)  # the critic
                        loop.sessions_done += complete
                        show_reward_model(teacher, session, prefs, rb, predict_learned_rewards, args, rng, step)
                        metrics = reward_model_metrics(reward_model, prefs, rb, args, free, step, device)
                        log_feedback_session(writer, loop, session, reward_stats, metrics, teacher.session_measures())

                # --- the rollout's rewards (learned + RUNE, or the state entropy while exploring), GAE, PPO update ---
                if loop.learning_from_preferences:
                    beta = rune_beta(args.rune_beta, args.rune_beta_decay, rollout_start) if args.rune else 0.0
                    relabel_rollout(reward_model, rollout, device, beta)
                    slots = rollout.rb_index[rollout.valid]
                    rb.learned_rewards[slots] = rollout.learned_rewards[rollout.valid]
                    rb.reward_std[slots] = rollout.reward_std[rollout.valid]
                    extra = {"rune/beta": beta} if args.rune else {}
                elif args.unsupervised_exploration:
                    exploration_rewards(rollout, rb, intrinsic_rms, args, rng, device)
                    extra = {"exploration/intrinsic_reward": float(rollout.rewards[rollout.valid].mean())}
                if loop.learning_from_preferences or args.unsupervised_exploration:  # else no labels yet: nothing
                    rewards = return_rms.scale(rollout.rewards, rollout.terminated | rollout.truncated, rollout.valid)
                    stats = train_on_rollout(agent, optimizer, rollout, rewards, args, rng, device)
                    log_update(writer, stats, step, extra | {"charts/learning_rate": lr})
                writer.add_scalar("charts/SPS", int((step - run.start_step) / run.elapsed()), step)
                session_ended, start = start.session_started, None  # the iteration is complete
                run.show_progress(loop, last_return)

                # --- evaluate, checkpoint ---
                if explore_end > 0 and step == explore_end and not args.exploration_from:
                    save(step)  # reusable: --exploration-from models/<run>/<step>
                before_end = loop.iteration < num_iterations
                if crossed(args.evaluation_frequency, step - batch_size, step) and before_end:
                    run.evaluate(NormalizedPolicy(agent, obs_rms), loop, device, teacher)
                people = session_ended and teacher.people_answer  # people's labels: what a killed run must not lose
                if (crossed(args.checkpoint_frequency, step - batch_size, step) or people) and before_end:
                    save("latest")

        if session.settle(teacher, prefs, label_log, loop, heldout_fraction, rng):  # people's later changes
            reward_training(reward_model, reward_optimizer, prefs, rb, args, rng, device)  # one more fit learns them
            save("latest")
        if not run.interrupted:
            run.evaluate(NormalizedPolicy(agent, obs_rms), loop, device, teacher)
        metrics = reward_model_metrics(reward_model, prefs, rb, args, free, loop.global_step, device)
        return run.finish(loop, metrics | session.idle_seconds())


if __name__ == "__main__":
    cli(Args, main)
