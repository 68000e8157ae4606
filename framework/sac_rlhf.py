# PEBBLE: SAC trained only from preferences (Lee et al. 2021, https://arxiv.org/abs/2106.05091), with SURF (Park et
# al. 2022), QPA (Hu et al. 2024) and RUNE (Liang et al. 2022), in CleanRL's single-file style.
#
# Read top to bottom: the settings, SAC, preference learning (the preference model, the reward ensemble, query
# selection, the preference buffer, the schedule, SURF's crops and pseudo-labels, reward training, the k-NN state
# entropy, RUNE), the settings checks, and `main`, PEBBLE's algorithm box:
#   1. random steps, then SAC on the k-NN state-entropy reward (unsupervised exploration);
#   2. at every feedback session: choose pairs, the teacher answers, the labels enter the preference buffer, fit the
#      reward model, relabel the replay buffer, reset the critic once exploration is over, count the session;
#   3. SAC on the learned reward (plus RUNE's bonus) between sessions.
# The preference-learning part is a deliberate copy of pref_ppo.py's (tests/test_lockstep.py holds them identical);
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
from cleanrlhf_utils.buffers import PendingRewards, ReplayBuffer
from cleanrlhf_utils.checkpoints import CheckpointArgs, load_optimizer, validate_checkpoint_args
from cleanrlhf_utils.cli import cli
from cleanrlhf_utils.diagnostics import reward_diagnostics
from cleanrlhf_utils.envs import autoreset_pending, get_physics_state, physics_state_size
from cleanrlhf_utils.errors import ConfigError, check_ranges, need  # noqa: F401 (callers catch sac_rlhf.ConfigError)
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
from cleanrlhf_utils.run import Run, RunArgs
from cleanrlhf_utils.speed import adam, compiled_steps, kth_nearest_distance
from cleanrlhf_utils.tracking import AGENT_MEASURES, RecentMeans, log_feedback_session, log_update
from cleanrlhf_utils.training import RunningMoments, frozen, seed_everything


# ----------------------------------------------------------------------------------------
# Settings. --help shows them in titled groups: first `first_flags`, then one group per class (`help_group`).
# ----------------------------------------------------------------------------------------
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
class Args(CheckpointArgs, FeedbackArgs, PreferenceArgs, SACArgs, PresetArgs):
    """PEBBLE's settings: SAC's, preference learning's, the teacher's, checkpoints' and the --preset they start from."""

    help_group: ClassVar[str] = "PEBBLE"

    first_flags: ClassVar[str] = (
        "env_id total_timesteps preset seed teacher_feedback_mode teacher_feedback_total_queries teacher_objective "
        "feedback_server_autostart capture_video track run_name resume"
    )
    """the flags a newcomer sets, shown first by --help"""

    exp_name: str = "sac_rlhf"
    """the name of this experiment (part of the run name)"""
    qpa_hybrid_ratio: float = 0.0
    """QPA: this share of every SAC batch comes from the last --qpa-query-episodes episodes while sessions remain
    (QPA: 0.5)"""
    reset_actor_after_exploration: bool = False
    """start SAC's actor afresh with the critic when the first labels end exploration: keep exploration's data, not
    its policy (on HalfCheetah the state-entropy policy rolls onto its back, and SAC on the learned reward ran on it)"""
    learned_reward_std: float = 0.0
    """SAC learns the learned reward rescaled, uncentred, to this standard deviation over the replay buffer, set at
    every relabel (0: as the model gives it). A reward model's scale is whatever fits the labels (about 0.3 on
    HalfCheetah, ten times smaller than the env's), and SAC learned the true reward scaled that small as slowly"""


# ----------------------------------------------------------------------------------------
# SAC. The twin critics are one 2-member batched network (cleanrlhf_utils.networks).
# ----------------------------------------------------------------------------------------
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


def validate_args(args: Args) -> None:
    validate_sac_args(args)
    validate_preference_args(args)
    check_ranges(args, {"qpa_hybrid_ratio": "in [0, 1]", "learned_reward_std": ">= 0"})
    need(
        args.qpa_hybrid_ratio == 0 or args.qpa_query_episodes > 0,
        f"--qpa-hybrid-ratio {args.qpa_hybrid_ratio} needs --qpa-query-episodes N (the episodes it replays), got 0",
    )
    need(
        not args.unsupervised_exploration or args.total_explore_steps >= args.learning_starts,
        f"--total-explore-steps ({args.total_explore_steps}) must be >= --learning-starts ({args.learning_starts})",
    )


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
    reward_scale: float = 1.0  # --learned-reward-std: the factor SAC's learned rewards are multiplied by


def start_afresh(agent: SACAgent) -> None:
    """A fresh actor and critics, the initial temperature, fresh optimisers. The actor's layers are re-initialised in
    place, so a policy compiled from it (--compile) acts with the new weights."""
    for layer in agent.actor.modules():
        if isinstance(layer, nn.Linear):
            layer.reset_parameters()  # what nn.Linear's constructor does, as a fresh Actor gets
    agent.actor_optimizer = adam(agent.actor.parameters(), agent.args.policy_lr, agent.args)
    agent.reset_critic()
    with torch.no_grad():
        agent.log_alpha.fill_(math.log(agent.args.alpha))
    if agent.args.autotune:
        agent.alpha_optimizer = adam([agent.log_alpha], agent.args.q_lr, agent.args)


def reset_after_session(agent: SACAgent, loop: LoopState, labels: int, args: Args) -> None:
    """PEBBLE resets the critic when the first labels end exploration: its values were of the intrinsic reward (with
    --reset-actor-after-exploration the actor and temperature too)."""
    if labels > 0 and not loop.learning_from_preferences:
        if args.reset_actor_after_exploration:
            start_afresh(agent)
        else:
            agent.reset_critic()
        loop.learning_from_preferences = True


def sessions_due(step: int, first_step: int, frequency: int, sessions: int) -> int:
    """How many of the run's `sessions` feedback sessions are due at `step`: the first at `first_step` (the end of
    exploration), then one every `frequency` steps."""
    return 0 if step < first_step else min(sessions, (step - first_step) // frequency + 1)


def exploration_rewards(rb: ReplayBuffer, next_obs, intrinsic_rms: RunningMoments, args, rng, device) -> torch.Tensor:
    """PEBBLE's intrinsic reward of a batch: the distance from each reached state to its k-th nearest neighbour among a
    random sample of the buffer's states, over the running std of those distances."""
    sample = rb.sample_indices(min(args.explore_knn_sample_size, rb.size), rng)
    reference = torch.as_tensor(rb.next_obs[sample], device=device)
    intrinsic = knn_state_entropy(next_obs, reference, min(args.explore_knn_k, len(reference)))
    intrinsic_rms.update(intrinsic)
    return intrinsic / float(intrinsic_rms.std)


def reward_change_correlation(before: np.ndarray, after: np.ndarray) -> float:
    """Pearson correlation of the same transitions' learned rewards before and after a session's relabel: near 1 when
    the session refined the reward, low when it now pays for something else; NaN when either side is constant."""
    if before.size < 2 or before.std() == 0 or after.std() == 0:
        return float("nan")
    return float(np.corrcoef(before, after)[0, 1])


def relabel(model: RewardEnsemble, rb: ReplayBuffer, pending: PendingRewards, device) -> float:
    """relabel_replay_buffer; returns how much the transitions that had a learned reward changed
    (reward_change_correlation)."""
    known = np.setdiff1d(np.arange(rb.size), pending.waiting_rows(rb))
    before = rb.learned_rewards[known]  # a copy (fancy indexing)
    relabel_replay_buffer(model, rb, device)
    pending.clear()
    return reward_change_correlation(before, rb.learned_rewards[known])


SAC_BATCH = ("obs", "actions", "next_obs", "terminated")
"""the replay buffer's arrays an SAC update reads (the reward comes apart: intrinsic, or learned plus RUNE's bonus)"""


def sample_batch(rb: ReplayBuffer, rng, args: Args, loop: LoopState, hybrid: bool, recent_slots, device) -> tuple:
    """A batch of transitions, with QPA's hybrid replay (`hybrid`): --qpa-hybrid-ratio of them from the last
    --qpa-query-episodes episodes, whose slots are renewed as an episode starts. Returns (the batch's slots, its obs,
    actions, next_obs and terminated as tensors, recent_slots)."""
    if hybrid and (recent_slots is None or loop.episode_length == 0):
        recent_slots = rb.recent_episode_slots(args.qpa_query_episodes)
    share = args.qpa_hybrid_ratio if hybrid else 0.0
    idx = rb.sample_indices(args.batch_size, rng, recent_slots, share)
    batch = {name: torch.as_tensor(getattr(rb, name)[idx], device=device) for name in SAC_BATCH}
    return idx, batch, recent_slots


def sac_reward_scale(rb: ReplayBuffer, args: Args) -> float:
    """--learned-reward-std over the standard deviation of the buffer's learned rewards (1: none asked, or a constant
    reward, whose float32 rounding would otherwise be blown up to the asked spread)."""
    std = float(rb.learned_rewards[: rb.size].std(dtype=np.float64)) if rb.size > 1 else 0.0
    return args.learned_reward_std / std if args.learned_reward_std > 0 and std > 1e-6 else 1.0


def learned_rewards(rb: ReplayBuffer, idx: np.ndarray, args: Args, step: int, device, loop: LoopState) -> torch.Tensor:
    """A batch's learned reward, plus RUNE's bonus beta_t x the ensemble's std: optimism where the reward model is
    unsure, decaying over the run; both times --learned-reward-std's scale (loop.reward_scale)."""
    rewards = torch.as_tensor(rb.learned_rewards[idx], device=device)
    if args.rune:
        bonus = torch.as_tensor(rb.reward_std[idx], device=device)
        rewards = rewards + rune_beta(args.rune_beta, args.rune_beta_decay, step) * bonus
    scale = loop.reward_scale
    return rewards * scale if scale != 1.0 else rewards  # bit for bit as before where no scale is asked


def main(args: Args, on_evaluation=None, reward_training: Callable | None = None, after_session=None) -> dict:
    """Train and return the run's summary. `on_evaluation(step, mean_return)` is called after every evaluation (a sweep
    reports and prunes with it). A variant file passes `reward_training(model, optimizer, prefs, rb, args, rng,
    device) -> stats`, which fits the reward model at every session (default train_reward_model, looked up at the
    call), or `after_session(agent, loop, reward_change) -> measures`, called after each session's relabel (its
    `summary()` joins the run's); either is checkpointed when it has state_dict and load_state_dict."""
    validate_args(args)
    reward_training = reward_training or train_reward_model
    run = Run(args, "sac_rlhf", on_evaluation)
    with contextlib.ExitStack() as cleanup:  # closes what was opened however the run ends (a sweep may prune it)
        envs = cleanup.enter_context(contextlib.closing(make_vector_env(args)))  # a bad env fails before any write
        obs, _ = envs.reset(seed=args.seed)
        obs_dim, state_dim = int(np.prod(envs.single_observation_space.shape)), physics_state_size(envs.envs[0])
        action_space, action_dim = envs.single_action_space, int(np.prod(envs.single_action_space.shape))
        check_teacher_objective(args, obs_dim, action_dim, state_dim)  # before anything is written
        writer = run.start_logging(cleanup)
        device, rng = seed_everything(args)  # rng: replay and segment sampling, random actions, held-out split
        agent = SACAgent(obs_dim, action_space, args, device)
        reward_model = RewardEnsemble.from_args(obs_dim + action_dim, args).to(device)
        reward_optimizer = torch.optim.Adam(reward_model.parameters(), lr=args.reward_net_lr, fused=True)
        rb = ReplayBuffer(min(args.buffer_size, args.total_timesteps), obs_dim, action_dim, state_dim)
        prefs = PreferenceBuffer(args.segment_length, obs_dim + action_dim, state_dim, args.clips_per_query)
        intrinsic_rms, pending, recent = RunningMoments(), PendingRewards(), RecentMeans(AGENT_MEASURES)
        teacher = cleanup.enter_context(contextlib.closing(make_teacher(args, rb, run.name, run.dir, run.video_dir)))
        label_log = cleanup.enter_context(contextlib.closing(LabelLog(run.dir / "labels.sqlite", args.rating_scale)))
        free = teacher.labels_are_free  # asking costs nothing: accuracy is measured on fresh pairs, no label held out
        heldout_fraction = 0.0 if free else args.reward_net_heldout_fraction
        budget = (args.teacher_feedback_total_queries, args.teacher_feedback_num_queries_per_session)
        schedule = feedback_schedule(*budget, args.teacher_feedback_schedule, args.teacher_feedback_exponential_decay)
        first_session = args.total_explore_steps if args.unsupervised_exploration else args.learning_starts
        run.say_feedback_plan(first_session, args.teacher_feedback_frequency, schedule, args.total_timesteps)
        session = FeedbackSession(teacher, label_log, args)  # the open session's pairs and answers
        parts = {"agent": agent, "reward_model": reward_model, "reward_optimizer": reward_optimizer}
        parts |= {"preference_buffer": prefs, "intrinsic_rms": intrinsic_rms, "teacher": teacher, "session": session}
        variant = {"reward_training": reward_training, "after_session": after_session}
        parts |= {name: part for name, part in variant.items() if hasattr(part, "state_dict")}  # a variant's state
        loop, obs = run.restore(parts, rng, rb, envs, obs, LoopState())
        predict_learned_rewards = functools.partial(predict_reward_arrays, reward_model, device)
        recent_slots = None  # QPA's hybrid replay: the slots of the last episodes

        def checkpoint(folder: str | int) -> None:  # in a reward update: the state before it (session.rollback)
            pending.fill(predict_learned_rewards, rb)  # the saved buffer is complete, with the values the run uses
            run.save(folder, run.state(parts, rng, loop, envs, obs) | session.rollback(), rb)

        def choose_pairs(number: int) -> dict:  # session `number`'s pairs, chosen by the reward model as it stands
            return session_pairs(number, schedule, reward_model, rb, args, rng, device)

        with run.training(loop, args.total_timesteps, save_last=lambda: checkpoint("latest")):
            for step in run.steps(loop, args.total_timesteps):  # Ctrl-C, SIGTERM: stop between two steps
                # --- feedback session: choose pairs, the teacher answers, fit, relabel, reset the critic, count ---
                due = sessions_due(step, first_session, args.teacher_feedback_frequency, len(schedule))
                if not session.open and loop.sessions_done < due:
                    number = loop.sessions_done + 1
                    session.start(session.take_staged(number) or choose_pairs(number), number)  # choose pairs
                last = step + 1 == args.total_timesteps
                if session.open and session.answers_in(step, last, due, choose_pairs):  # people: async, resumed
                    with session.update(parts, rng, loop):  # one unit: Ctrl-C inside it saves the state before it
                        complete = record_labels(prefs, label_log, session, loop, heldout_fraction, rng, teacher)
                        reward_stats = reward_training(reward_model, reward_optimizer, prefs, rb, args, rng, device)
                        reward_change = relabel(reward_model, rb, pending, device)
                        measures = after_session(agent, loop, reward_change) if after_session else {}
                        loop.reward_scale = sac_reward_scale(rb, args)
                        reset_after_session(agent, loop, len(prefs), args)  # the first labels: a fresh critic
                        loop.sessions_done += complete
                        show_reward_model(teacher, session, prefs, rb, predict_learned_rewards, args, rng, step)
                        metrics = reward_model_metrics(reward_model, prefs, rb, args, free, step, device)
                        measures |= teacher.session_measures() | {"reward_change_correlation": reward_change}
                        log_feedback_session(writer, loop, session, reward_stats, metrics, measures)
                    if teacher.people_answer:
                        checkpoint("latest")  # people's labels are what a killed run must not lose
                exploring = not loop.learning_from_preferences

                # --- act; store the transition with the simulator state behind its observation ---
                if step < args.learning_starts:
                    actions = rng.uniform(action_space.low, action_space.high, size=(1, action_dim)).astype(np.float32)
                else:
                    actions = agent.act(obs)
                physics_state = get_physics_state(envs.envs[0])
                autoreset = bool(autoreset_pending(envs)[0])
                next_obs, rewards, terminations, truncations, _ = envs.step(actions)
                if not autoreset:  # with next-step autoreset, the step after an episode end only resets: never stored
                    rb.add(obs[0], next_obs[0], actions[0], rewards[0], terminations[0], loop.episode_id, physics_state)
                    if not exploring:
                        pending.add(rb)  # its learned reward is predicted when a batch first needs it
                    run.track_episode(loop, rewards[0], terminations[0] or truncations[0], writer, step)
                obs = next_obs
                loop.global_step += 1
                teacher.training_progress(loop.global_step, loop.sessions_done, len(schedule))  # the page's news

                # --- learn: SAC on the state-entropy reward while exploring, then on the learned reward (+ RUNE) ---
                if step >= args.learning_starts and (args.unsupervised_exploration or not exploring):
                    hybrid = args.qpa_hybrid_ratio > 0 and not exploring and loop.sessions_done < len(schedule)
                    idx, batch, recent_slots = sample_batch(rb, rng, args, loop, hybrid, recent_slots, device)
                    if exploring:
                        batch_rewards = exploration_rewards(rb, batch["next_obs"], intrinsic_rms, args, rng, device)
                        extra = {"exploration/intrinsic_reward": float(batch_rewards.mean())}
                    else:
                        pending.fill_if_sampled(predict_learned_rewards, rb, idx)
                        batch_rewards = learned_rewards(rb, idx, args, step, device, loop)
                        beta = rune_beta(args.rune_beta, args.rune_beta_decay, step)
                        extra = {"rune/beta": beta} if args.rune else {}
                    stats = agent.update(**batch, rewards=batch_rewards, global_step=step)
                    if step % 100 == 0:
                        log_update(writer, stats, step, extra, recent)
                if step % 100 == 0:
                    writer.add_scalar("charts/SPS", int((loop.global_step - run.start_step) / run.elapsed()), step)
                    run.show_progress(loop)

                # --- evaluate, checkpoint ---
                explored = args.unsupervised_exploration and loop.global_step == args.total_explore_steps
                if explored and not args.exploration_from:
                    checkpoint(loop.global_step)  # reusable: --exploration-from models/<run>/<step>
                before_end = loop.global_step < args.total_timesteps
                if args.evaluation_frequency and loop.global_step % args.evaluation_frequency == 0 and before_end:
                    run.evaluate(agent.actor, loop, device, teacher)
                if args.checkpoint_frequency and loop.global_step % args.checkpoint_frequency == 0 and before_end:
                    checkpoint("latest")

        if session.settle(teacher, prefs, label_log, loop, heldout_fraction, rng):  # people's later changes
            reward_training(reward_model, reward_optimizer, prefs, rb, args, rng, device)  # one more fit learns them
            checkpoint("latest")
        if not run.interrupted:
            run.evaluate(agent.actor, loop, device, teacher)
        metrics = reward_model_metrics(reward_model, prefs, rb, args, free, loop.global_step, device)
        measures = metrics | session.idle_seconds() | recent.summary()
        return run.finish(loop, measures | (after_session.summary() if after_session else {}))


if __name__ == "__main__":
    cli(Args, main)
