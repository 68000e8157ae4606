# SAC on the environment's true reward (Haarnoja et al. 2018, as CleanRL's sac_continuous_action.py): the baseline
# every preference-based run is compared with. Read top to bottom: the settings, the networks and SACAgent's update,
# then `main`, the training loop. The SAC part is a deliberate copy of sac_rlhf.py's (one file = one algorithm, as
# CleanRL keeps it), held identical by tests/test_lockstep.py, so a comparison measures learning from preferences
# and nothing else; the replay buffer, evaluation and checkpoints are cleanrlhf_utils', shared by both.
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

from cleanrlhf_utils import envs as cleanrlhf_envs
from cleanrlhf_utils.buffers import ReplayBuffer
from cleanrlhf_utils.checkpoints import (
    ResumeArgs,
    earlier_wall_seconds,
    load_checkpoint,
    load_optimizer,
    load_training_state,
    save_checkpoint,
    training_state,
    validate_resume_args,
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
from cleanrlhf_utils.errors import need
from cleanrlhf_utils.evaluate import evaluate_and_log, success_summary
from cleanrlhf_utils.objectives import apply_objective, step_rewards
from cleanrlhf_utils.stopping import stop_between_steps, stop_here_if_requested
from cleanrlhf_utils.tracking import (
    AGENT_MEASURES,
    RecentMeans,
    announce_run,
    default_run_name,
    progress_bar,
    public_settings,
    start_logging,
    stop_logging,
    write_summary,
)
from cleanrlhf_utils.training import frozen, outputs_copied, seed_everything


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
# The baseline: SAC on the environment's reward
# ----------------------------------------------------------------------------------------
@dataclass
class Args(ResumeArgs, SACArgs):
    """SAC on the environment's true reward (the baseline of sac_rlhf.py), with checkpoints to resume from
    (cleanrlhf_utils.checkpoints.ResumeArgs)."""

    exp_name: str = "sac"
    """the name of this experiment (part of the run name)"""
    reward_objective: str = ""
    """train on this objective's reward instead of the env's (a --teacher-objective name or module:function): the
    ceiling of a preference run on that objective; evaluations log eval/objective_return beside the env's return"""


@dataclass
class LoopState:
    """Counters of the training loop that a checkpoint must carry."""

    global_step: int = 0
    episode_id: int = 0
    episode_return: float = 0.0
    episode_length: int = 0
    last_eval_return: float = float("nan")


def main(args: Args, on_evaluation: Callable[[int, float], None] | None = None) -> dict:
    """Train and return the run's summary. `on_evaluation(step, mean_return)`, if given, is called after every
    evaluation (a sweep uses it to report intermediate results and prune hopeless trials: what it raises ends the run)."""
    validate_sac_args(args)
    validate_resume_args(args)
    objective = apply_objective(args, field="reward_objective")  # sets what it needs, e.g. no unhealthy termination
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
    resume_state = load_checkpoint(Path(args.resume) / "checkpoint.pt") if args.resume else None
    run_name = args.run_name or (resume_state["run_name"] if resume_state else default_run_name(args))
    run_dir, model_dir, video_dir = Path("runs") / run_name, Path("models") / run_name, Path("videos") / run_name
    writer = start_logging(args, run_name, run_dir, resume_state["loop"]["global_step"] if resume_state else None)
    announce_run(run_name, args)
    try:  # closed however the run ends, e.g. when a sweep prunes it from on_evaluation
        device, rng = seed_everything(args)

        obs, _ = envs.reset(seed=args.seed)
        obs_dim = int(np.prod(envs.single_observation_space.shape))
        action_space = envs.single_action_space
        action_dim = int(np.prod(action_space.shape))
        agent = SACAgent(obs_dim, action_space, args, device)
        rb = ReplayBuffer(min(args.buffer_size, args.total_timesteps), obs_dim, action_dim, physics_state_size(envs.envs[0]))
        loop = LoopState()
        recent = RecentMeans(AGENT_MEASURES)  # summary.json's figures of the last updates

        def checkpoint(folder: Path) -> None:
            state = {"run_name": run_name, "args": public_settings(args), "loop": asdict(loop), "env": capture_env_state(envs, obs)}
            state["wall_seconds"] = earlier_wall + time.time() - start_time  # the whole run's, across resumes
            save_checkpoint(folder, state | training_state({"agent": agent}, rng), rb)

        if resume_state is not None:
            load_training_state({"agent": agent}, rng, resume_state)
            loop, obs = LoopState(**resume_state["loop"]), restore_env_state(envs, resume_state["env"])
            rb.load(Path(args.resume) / "replay_buffer.npz")
            print(f"resumed {run_name} at step {loop.global_step}")

        progress = progress_bar(args, args.total_timesteps, loop.global_step)
        start_time, start_step, interrupted = time.time(), loop.global_step, False
        earlier_wall = earlier_wall_seconds(resume_state)  # training seconds before the checkpoint this run resumes from
        try:
            with stop_between_steps():
                while loop.global_step < args.total_timesteps:
                    stop_here_if_requested()  # Ctrl-C, SIGTERM: stop here, between two steps, never inside one
                    step = loop.global_step
                    if step < args.learning_starts:
                        actions = rng.uniform(action_space.low, action_space.high, size=(1, action_dim)).astype(np.float32)
                    else:
                        actions = agent.act(obs)
                    physics_state = get_physics_state(envs.envs[0])
                    autoreset = bool(autoreset_pending(envs)[0])
                    next_obs, rewards, terminations, truncations, _ = envs.step(actions)
                    if not autoreset:  # next-step autoreset: the reset step is not a transition
                        if objective is not None:  # --reward-objective: the objective's reward of this step, not the env's
                            rewards = step_rewards(objective, obs, actions, physics_state[None])
                        rb.add(obs[0], next_obs[0], actions[0], rewards[0], terminations[0], loop.episode_id, physics_state)
                        loop.episode_return, loop.episode_length = loop.episode_return + float(rewards[0]), loop.episode_length + 1
                        if terminations[0] or truncations[0]:
                            writer.add_scalar("charts/episodic_return", loop.episode_return, step)
                            writer.add_scalar("charts/episodic_length", loop.episode_length, step)
                            if progress is not None:
                                progress.set_postfix(ret=f"{loop.episode_return:.0f}", eval=f"{loop.last_eval_return:.0f}", refresh=False)
                            loop.episode_id, loop.episode_return, loop.episode_length = loop.episode_id + 1, 0.0, 0
                    obs = next_obs
                    loop.global_step += 1

                    if step >= args.learning_starts:
                        idx = rb.sample_indices(args.batch_size, rng)
                        stats = agent.update(
                            torch.as_tensor(rb.obs[idx], device=device),
                            torch.as_tensor(rb.actions[idx], device=device),
                            torch.as_tensor(rb.true_rewards[idx], device=device),
                            torch.as_tensor(rb.next_obs[idx], device=device),
                            torch.as_tensor(rb.terminated[idx], device=device),
                            step,
                        )
                        if step % 100 == 0:
                            for name, value in stats.items():
                                writer.add_scalar(f"losses/{name}", float(value), step)
                            recent.add(stats)
                    if step % 100 == 0:
                        writer.add_scalar("charts/SPS", int((loop.global_step - start_step) / (time.time() - start_time)), step)
                        if progress is not None:
                            progress.update(loop.global_step - progress.n)

                    before_end = loop.global_step < args.total_timesteps
                    if args.evaluation_frequency and loop.global_step % args.evaluation_frequency == 0 and before_end:
                        loop.last_eval_return = evaluate_and_log(
                            agent.actor, args, writer, video_dir, device, loop.global_step, on_evaluation
                        )
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
        summary = {
            "run_name": run_name,
            "env_id": args.env_id,
            "global_step": loop.global_step,
            "final_eval_return": float(loop.last_eval_return),
            **success_summary(loop.last_eval_return),  # final_success_rate, on envs that report success (Meta-World)
            "wall_seconds": earlier_wall + wall,  # the whole run's, across resumes
            "sps": (loop.global_step - start_step) / wall,  # this process's
            "interrupted": interrupted,
            **recent.summary(),  # the last updates' Q-value, policy entropy, alpha
            "true_reward_mean": float(rb.true_rewards[: rb.size].mean()),  # the scale alpha weighs the entropy against
            "true_reward_std": float(rb.true_rewards[: rb.size].std()),
        }
        write_summary(run_dir, summary)
        if interrupted:
            raise RunInterrupted(model_dir / "latest")  # the command line says how to resume from it
        return summary
    finally:
        envs.close()
        stop_logging(args, writer)


if __name__ == "__main__":
    cli(Args, main)
