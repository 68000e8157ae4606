# PPO on the environment's true reward (CleanRL's ppo_continuous_action.py, discrete actions too): the baseline PrefPPO
# (pref_ppo.py) is compared with. Read top to bottom: the settings, the agent, rollouts, observation and return
# normalisation, GAE and the clipped update, then `main`. The PPO part is a deliberate copy of pref_ppo.py's (one file =
# one algorithm, as CleanRL keeps it), held identical by tests/test_lockstep.py, so a comparison measures learning from
# preferences and nothing else; evaluation and checkpoints are cleanrlhf_utils', shared by both.
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import ClassVar

from cleanrlhf_utils.arguments import refuse_unknown_flags

if __name__ == "__main__":
    refuse_unknown_flags(__file__)  # a mistyped flag: one line at once, not after the seconds torch takes to import

import gymnasium as gym
import numpy as np
import torch
import torch.nn as nn

from cleanrlhf_utils import envs as cleanrlhf_envs
from cleanrlhf_utils.checkpoints import checkpoint_file, load_checkpoint, save_checkpoint
from cleanrlhf_utils.cli import cli
from cleanrlhf_utils.envs import autoreset_pending, check_env_id, get_physics_state
from cleanrlhf_utils.errors import ConfigError, check_ranges, need
from cleanrlhf_utils.evaluate import evaluate_and_log, success_summary
from cleanrlhf_utils.objectives import episode_end
from cleanrlhf_utils.run import RunArgs
from cleanrlhf_utils.tracking import (
    announce_run,
    default_run_name,
    progress_bar,
    start_logging,
    stop_logging,
    write_summary,
)
from cleanrlhf_utils.training import (
    EpisodeTracker,
    NormalizedPolicy,
    ObservationNormalizer,
    ReturnNormalizer,
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


def load_policy(path: str | Path, env_id: str | None = None) -> tuple[NormalizedPolicy, str]:
    """The evaluation policy of a pref_ppo.py or ppo.py checkpoint (file or folder), with its observation
    normalisation, and the env id to run it on (default: the one it was trained on)."""
    path = checkpoint_file(path)
    checkpoint = load_checkpoint(path)
    train_args = checkpoint["args"]
    env_id = env_id or train_args["env_id"]
    check_env_id(env_id)
    env = make_env(env_id, 0)()
    obs_dim, space = int(np.prod(env.observation_space.shape)), env.action_space
    env.close()
    names = ("actor_hidden_dim", "actor_hidden_layers", "critic_hidden_dim", "critic_hidden_layers")
    sizes = [train_args[name] for name in names]
    agent = Agent(obs_dim, space, *sizes)
    normalizer = ObservationNormalizer(obs_dim, enabled=train_args["normalize_obs"])
    try:
        agent.load_state_dict(checkpoint["agent"])
        normalizer.load_state_dict(checkpoint["obs_normalizer"])
        policy = NormalizedPolicy(agent, normalizer)
    except (RuntimeError, ValueError) as error:
        raise ConfigError(f"the model in {path} does not fit --env-id {env_id}: {str(error).splitlines()[0]}") from None
    return policy, env_id


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


@dataclass
class Args(PPOArgs):
    """PPO on the environment's true reward (the baseline of pref_ppo.py)."""

    help_group: ClassVar[str] = "PPO baseline"
    first_flags: ClassVar[str] = "env_id total_timesteps seed capture_video track run_name"
    """the flags a newcomer sets, shown first by --help"""

    exp_name: str = "ppo"
    """the name of this experiment (part of the run name)"""


def main(args: Args, on_evaluation: Callable[[int, float], None] | None = None) -> dict:
    """Train and return the run's summary. `on_evaluation(step, mean_return)`, if given, is called after every
    evaluation (a sweep uses it to report intermediate results and prune hopeless trials: what it raises ends the
    run)."""
    validate_ppo_args(args)
    envs = make_vector_env(args)
    run_name = args.run_name or default_run_name(args)
    run_dir, model_dir, video_dir = Path("runs") / run_name, Path("models") / run_name, Path("videos") / run_name
    writer = start_logging(args, run_name, run_dir)
    announce_run(run_name, args)
    try:  # closed however the run ends, e.g. when a sweep prunes it from on_evaluation
        device, rng = seed_everything(args)

        obs, _ = envs.reset(seed=args.seed)
        obs_dim = int(np.prod(envs.single_observation_space.shape))
        action_space = envs.single_action_space
        hidden = (args.actor_hidden_dim, args.actor_hidden_layers, args.critic_hidden_dim, args.critic_hidden_layers)
        agent = Agent(obs_dim, action_space, *hidden).to(device)
        optimizer = torch.optim.Adam(agent.parameters(), lr=args.learning_rate, eps=1e-5, fused=True)  # one kernel
        action_input_dim = reward_action_dim(action_space)
        rollout = RolloutBuffer(args.num_steps, args.num_envs, obs_dim, action_space.shape, action_input_dim, 0)
        obs_rms = ObservationNormalizer(obs_dim, enabled=args.normalize_obs)
        return_rms = ReturnNormalizer(args.num_envs, args.gamma, enabled=args.normalize_reward)
        episodes = EpisodeTracker(args.num_envs)
        batch_size = args.num_envs * args.num_steps
        num_iterations = args.total_timesteps // batch_size

        progress = progress_bar(args, num_iterations * batch_size)
        start_time, global_step, last_return, last_eval = time.time(), 0, float("nan"), float("nan")

        for iteration in range(1, num_iterations + 1):
            lr = set_learning_rate(optimizer, args, iteration, num_iterations)
            obs, finished = collect_rollout(envs, agent, obs_rms, rollout, obs, episodes, device)
            for t, _, episode_return, episode_length in finished:
                writer.add_scalar("charts/episodic_return", episode_return, global_step + (t + 1) * args.num_envs)
                writer.add_scalar("charts/episodic_length", episode_length, global_step + (t + 1) * args.num_envs)
                last_return = episode_return
            global_step += batch_size
            obs_rms.update(rollout.raw_obs[rollout.valid])  # for the next rollout: this one keeps its statistics

            rollout.rewards[:] = rollout.true_rewards
            rewards = return_rms.scale(rollout.rewards, rollout.terminated | rollout.truncated, rollout.valid)
            stats = train_on_rollout(agent, optimizer, rollout, rewards, args, rng, device)
            writer.add_scalar("charts/learning_rate", lr, global_step)
            for name, value in stats.items():
                writer.add_scalar(f"losses/{name}", value, global_step)
            writer.add_scalar("charts/SPS", int(global_step / (time.time() - start_time)), global_step)
            if progress is not None:
                progress.set_postfix(ret=f"{last_return:.0f}", eval=f"{last_eval:.0f}", refresh=False)
                progress.update(global_step - progress.n)
            if crossed(args.evaluation_frequency, global_step - batch_size, global_step) and iteration < num_iterations:
                policy = NormalizedPolicy(agent, obs_rms)
                last_eval = evaluate_and_log(policy, args, writer, video_dir, device, global_step, on_evaluation)

        if progress is not None:
            progress.close()
        wall = time.time() - start_time
        policy = NormalizedPolicy(agent, obs_rms)
        last_eval = evaluate_and_log(policy, args, writer, video_dir, device, global_step, on_evaluation)
        state = {
            "algorithm": "ppo",
            "run_name": run_name,
            "args": asdict(args),
            "agent": agent.state_dict(),
            "optimizer": optimizer.state_dict(),
            "obs_normalizer": obs_rms.state_dict(),
        }
        save_checkpoint(model_dir / "latest", state)
        summary = {
            "run_name": run_name,
            "algorithm": "ppo",
            "env_id": args.env_id,
            "global_step": global_step,
            "final_eval_return": float(last_eval),
            **success_summary(last_eval),  # final_success_rate, on envs that report success (Meta-World)
            "wall_seconds": wall,
            "sps": global_step / wall,
        }
        write_summary(run_dir, summary)
        return summary
    finally:
        envs.close()
        stop_logging(args, writer)


if __name__ == "__main__":
    cli(Args, main)
