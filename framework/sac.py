# SAC on the environment's true reward (Haarnoja et al. 2018, as CleanRL's sac_continuous_action.py): the baseline
# every preference-based run is compared with. Read top to bottom: the settings, the networks and SACAgent's update,
# then `main`, the training loop. The SAC part is a deliberate copy of sac_rlhf.py's (one file = one algorithm, as
# CleanRL keeps it), held identical by tests/test_lockstep.py, so a comparison measures learning from preferences
# and nothing else; the replay buffer, evaluation and checkpoints are cleanrlhf_utils', shared by both.
import contextlib
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

from cleanrlhf_utils import envs as cleanrlhf_envs
from cleanrlhf_utils.buffers import ReplayBuffer
from cleanrlhf_utils.checkpoints import ResumeArgs, load_optimizer, validate_resume_args
from cleanrlhf_utils.cli import cli
from cleanrlhf_utils.envs import autoreset_pending, get_physics_state, physics_state_size
from cleanrlhf_utils.errors import check_ranges, need
from cleanrlhf_utils.networks import ensemble_mlp
from cleanrlhf_utils.objectives import Objective, check_objective_settings, episode_end, step_rewards
from cleanrlhf_utils.run import Run, RunArgs
from cleanrlhf_utils.speed import adam, compiled_steps
from cleanrlhf_utils.tracking import AGENT_MEASURES, RecentMeans, log_update
from cleanrlhf_utils.training import frozen, seed_everything


@dataclass
class SACArgs(RunArgs):
    """SAC and the environment it acts in (shared with the true-reward baseline sac.py)."""

    help_group: ClassVar[str] = "SAC"

    compile: bool = False
    """torch.compile the SAC update and acting (for a GPU; the first updates wait about a minute for the compiler)"""
    cudagraphs: bool = False
    """replay the compiled update and acting as CUDA graphs (a CUDA GPU only; implies --compile)"""
    env_id: str = "Hopper-v5"
    """a Gymnasium MuJoCo id, dm_control/<domain>-<task>-v0, metaworld/<task>-v3 or module:Id
    (docs/reference/working-envs.md; python framework/list_envs.py checks one)"""
    render_mode: Literal["human"] | None = None
    """`human`: watch training live in a window (MuJoCo envs; needs a display, e.g. xvfb-run on a server)"""
    terminate_when_unhealthy: bool = True
    """end an episode when the robot falls (Hopper, Walker2d, Ant, Humanoid)"""
    terminate_when_tilted: bool = True
    """with --terminate-when-unhealthy, also end it when the torso tilts past Gymnasium's healthy angle"""
    total_timesteps: int = 1_000_000
    """total environment steps"""
    buffer_size: int = 1_000_000
    """the replay buffer's size (capped at total_timesteps)"""
    gamma: float = 0.99
    """the discount factor"""
    tau: float = 0.005
    """target smoothing coefficient"""
    batch_size: int = 256
    """transitions per SAC update"""
    learning_starts: int = 1000
    """steps of uniformly random actions before SAC starts updating"""
    policy_lr: float = 3e-4
    """the actor's learning rate"""
    q_lr: float = 1e-3
    """the critics' learning rate"""
    policy_frequency: int = 2
    """update the actor every this many steps (that many times)"""
    target_network_frequency: int = 1
    """update the target critics every this many steps"""
    alpha: float = 0.2
    """entropy coefficient (its initial value with --autotune)"""
    autotune: bool = True
    """tune the entropy coefficient automatically"""
    actor_hidden_dim: int = 256
    """width of the actor's hidden layers"""
    actor_hidden_layers: int = 2
    """number of hidden layers of the actor"""
    critic_hidden_dim: int = 256
    """width of the critics' hidden layers"""
    critic_hidden_layers: int = 2
    """number of hidden layers of the critics"""


SAC_RANGES = {
    "total_timesteps": "> 0",
    "buffer_size": ">= 1",
    "learning_starts": ">= 1",
    "evaluation_frequency": ">= 0",
    "evaluation_episodes": ">= 1",
}


def validate_sac_args(args: SACArgs) -> None:
    check_ranges(args, SAC_RANGES)
    need(
        not args.cudagraphs or (args.cuda and torch.cuda.is_available()),
        "--cudagraphs needs a CUDA GPU, and torch sees none here (or --no-cuda was given): drop --cudagraphs",
    )
    cleanrlhf_envs.check_env_id(args.env_id)
    cleanrlhf_envs.check_render_mode(args.env_id, args.render_mode)


def check_sac_actions(env_id: str, space: gym.Space) -> None:
    """SAC squashes a Gaussian into the action bounds: it needs a continuous (Box), bounded action space."""
    need(
        isinstance(space, gym.spaces.Box),
        f"--env-id {env_id} has a {type(space).__name__} action space; SAC needs a continuous (Box) one",
    )
    bounds = np.abs(np.concatenate([space.low.ravel(), space.high.ravel()]))
    bounded, why = bool(np.all(bounds < 1e6)), "SAC squashes actions into finite bounds"
    need(bounded, f"--env-id {env_id} has unbounded actions (bounds up to {bounds.max():.0e}); {why}")


def make_env(env_id: str, seed: int, render_mode=None, width=320, height=240, **settings):
    """cleanrlhf_utils' environment, refused unless SAC can act in it (settings: terminate_when_unhealthy,
    terminate_when_tilted, ends_episode)."""
    settings["check_actions"] = check_sac_actions
    return cleanrlhf_envs.make_env(env_id, seed, render_mode, width, height, **settings)


def make_vector_env(args: SACArgs) -> gym.vector.SyncVectorEnv:
    """The training environment: one env, reset at the step after an episode ends, ended where the run's objective
    says (Objective.ends_episode), drawn in a window with --render-mode human."""
    ends = {"terminate_when_unhealthy": args.terminate_when_unhealthy, "ends_episode": episode_end(args)}
    ends["terminate_when_tilted"] = args.terminate_when_tilted
    env = make_env(args.env_id, args.seed, args.render_mode, args.video_width, args.video_height, **ends)
    return gym.vector.SyncVectorEnv([env], autoreset_mode=gym.vector.AutoresetMode.NEXT_STEP)


# ----------------------------------------------------------------------------------------
# SAC. The twin critics are one 2-member batched network (cleanrlhf_utils.networks).
# ----------------------------------------------------------------------------------------
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

    def __init__(self, obs_dim: int, low: np.ndarray, high: np.ndarray, hidden_dim: int = 256, hidden_layers: int = 2):
        super().__init__()
        layers, width = [], obs_dim
        for _ in range(hidden_layers):
            layers += [nn.Linear(width, hidden_dim), nn.ReLU()]
            width = hidden_dim
        self.trunk = nn.Sequential(*layers)
        action_dim = int(np.prod(low.shape))
        self.fc_mean = nn.Linear(width, action_dim)
        self.fc_logstd = nn.Linear(width, action_dim)
        self.register_buffer("action_scale", torch.tensor((high - low) / 2.0, dtype=torch.float32))
        self.register_buffer("action_bias", torch.tensor((high + low) / 2.0, dtype=torch.float32))

    def forward(self, x):
        x = self.trunk(x)
        mean = self.fc_mean(x)
        log_std = torch.tanh(self.fc_logstd(x))
        log_std = self.log_std_min + 0.5 * (self.log_std_max - self.log_std_min) * (log_std + 1)  # SpinUp / D. Yarats
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

    def __init__(self, obs_dim: int, action_space: gym.spaces.Box, args: SACArgs, device: torch.device):
        self.args, self.device = args, device
        self.obs_dim, self.action_dim = obs_dim, int(np.prod(action_space.shape))
        actor_size = (args.actor_hidden_dim, args.actor_hidden_layers)
        self.actor = Actor(obs_dim, action_space.low, action_space.high, *actor_size).to(device)
        self.actor_optimizer = adam(self.actor.parameters(), args.policy_lr, args)
        self.reset_critic()
        self.target_entropy = -float(self.action_dim)
        self.log_alpha = torch.full((1,), math.log(args.alpha), requires_grad=args.autotune, device=device)
        if args.autotune:
            self.alpha_optimizer = adam([self.log_alpha], args.q_lr, args)
        # What runs every step: compiled with --compile, replayed as CUDA graphs with --cudagraphs
        steps = (self._critic_step, self._actor_step, self.actor.get_action)
        self.critic_step, self.actor_step, self.policy = compiled_steps(args, *steps)

    def reset_critic(self) -> None:
        """PEBBLE re-initialises the critic after exploration: its values were for the intrinsic reward."""
        size = (self.args.critic_hidden_dim, self.args.critic_hidden_layers)
        self.qf = TwinQNetwork(self.obs_dim, self.action_dim, *size).to(self.device)
        self.qf_target = TwinQNetwork(self.obs_dim, self.action_dim, *size).to(self.device)
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

    NETWORKS, OPTIMIZERS = ("actor", "qf", "qf_target"), ("actor_optimizer", "q_optimizer", "alpha_optimizer")

    def state_dict(self) -> dict:
        parts = [*self.NETWORKS, *self.OPTIMIZERS[: 3 if self.args.autotune else 2]]
        state = {name: getattr(self, name).state_dict() for name in parts}
        return state | {"log_alpha": self.log_alpha.detach().clone()}

    def load_state_dict(self, state: dict) -> None:
        for name in self.NETWORKS:
            getattr(self, name).load_state_dict(state[name])
        for name in self.OPTIMIZERS[: 3 if self.args.autotune else 2]:
            load_optimizer(getattr(self, name), state[name])
        with torch.no_grad():
            self.log_alpha.copy_(state["log_alpha"])


# ----------------------------------------------------------------------------------------
# The baseline: SAC on the environment's reward
# ----------------------------------------------------------------------------------------
@dataclass
class Args(ResumeArgs, SACArgs):
    """SAC on the environment's true reward (the baseline of sac_rlhf.py), with checkpoints to resume from."""

    help_group: ClassVar[str] = "SAC baseline"
    first_flags: ClassVar[str] = "env_id total_timesteps seed reward_objective capture_video track run_name resume"
    """the flags a newcomer sets, shown first by --help"""

    exp_name: str = "sac"
    """the name of this experiment (part of the run name)"""
    reward_objective: str = ""
    """train on this objective's reward instead of the env's (a --teacher-objective name or module:function): the
    ceiling of a preference run on that objective"""


@dataclass
class LoopState:
    """Counters of the training loop that a checkpoint must carry."""

    global_step: int = 0
    episode_id: int = 0
    episode_return: float = 0.0
    episode_length: int = 0
    last_eval_return: float = float("nan")


def main(args: Args, on_evaluation: Callable[[int, float], None] | None = None, objective: Objective | None = None):
    """Train and return the run's summary. `on_evaluation(step, mean_return)` is called after every evaluation (a sweep
    reports and prunes with it). `objective`: a reward to train on in place of --reward-objective's (bench/reward_gap.py
    passes another run's learned reward, frozen)."""
    validate_sac_args(args)
    validate_resume_args(args)
    measured = check_objective_settings(args, "reward_objective")  # the env it is for, the settings it needs
    objective = objective or measured
    run = Run(args, "sac", on_evaluation)
    with contextlib.ExitStack() as cleanup:  # closes what was opened however the run ends (a sweep may prune it)
        envs = cleanup.enter_context(contextlib.closing(make_vector_env(args)))
        writer = run.start_logging(cleanup)
        device, rng = seed_everything(args)
        obs, _ = envs.reset(seed=args.seed)
        obs_dim, action_space = int(np.prod(envs.single_observation_space.shape)), envs.single_action_space
        action_dim = int(np.prod(action_space.shape))
        agent = SACAgent(obs_dim, action_space, args, device)
        state_dim = physics_state_size(envs.envs[0])
        rb = ReplayBuffer(min(args.buffer_size, args.total_timesteps), obs_dim, action_dim, state_dim)
        trained = rb.true_rewards if objective is None else rb.learned_rewards  # what SAC learns (true: the env's)
        recent = RecentMeans(AGENT_MEASURES)  # summary.json's figures of the last updates
        loop, obs = run.restore({"agent": agent}, rng, rb, envs, obs, LoopState())

        def checkpoint() -> None:
            run.save("latest", run.state({"agent": agent}, rng, loop, envs, obs), rb)

        with run.training(loop, args.total_timesteps, save_last=checkpoint):
            for step in run.steps(loop, args.total_timesteps):  # Ctrl-C, SIGTERM: stop between two steps
                if step < args.learning_starts:
                    actions = rng.uniform(action_space.low, action_space.high, size=(1, action_dim)).astype(np.float32)
                else:
                    actions = agent.act(obs)
                physics_state = get_physics_state(envs.envs[0])
                autoreset = bool(autoreset_pending(envs)[0])
                next_obs, rewards, terminations, truncations, _ = envs.step(actions)
                if not autoreset:  # next-step autoreset: the reset step is not a transition
                    transition = (obs[0], next_obs[0], actions[0], rewards[0], terminations[0], loop.episode_id)
                    slot = rb.add(*transition, physics_state)
                    if objective is not None:  # --reward-objective: SAC learns the objective's reward, not the env's
                        rewards = step_rewards(objective, obs, actions, physics_state[None])
                        rb.learned_rewards[slot] = rewards[0]
                    run.track_episode(loop, rewards[0], terminations[0] or truncations[0], writer, step)
                obs = next_obs
                loop.global_step += 1

                if step >= args.learning_starts:
                    idx = rb.sample_indices(args.batch_size, rng)
                    arrays = (rb.obs, rb.actions, trained, rb.next_obs, rb.terminated)
                    stats = agent.update(*(torch.as_tensor(array[idx], device=device) for array in arrays), step)
                    if step % 100 == 0:
                        log_update(writer, stats, step, {}, recent)
                if step % 100 == 0:
                    writer.add_scalar("charts/SPS", int((loop.global_step - run.start_step) / run.elapsed()), step)
                    run.show_progress(loop)

                before_end = loop.global_step < args.total_timesteps
                if args.evaluation_frequency and loop.global_step % args.evaluation_frequency == 0 and before_end:
                    run.evaluate(agent.actor, loop, device)
                if args.checkpoint_frequency and loop.global_step % args.checkpoint_frequency == 0 and before_end:
                    checkpoint()

        if not run.interrupted:
            run.evaluate(agent.actor, loop, device)
        rewards = trained[: rb.size]  # the scale alpha weighs the entropy against
        scale = {"true_reward_mean": float(rewards.mean()), "true_reward_std": float(rewards.std())}
        return run.finish(loop, recent.summary() | scale)


if __name__ == "__main__":
    cli(Args, main)
