"""Pieces of a training loop that are not the algorithm: threads and seeds, running moments and the normalisers and
episode bookkeeping PPO builds on them, frozen weights, and whether a step crossed a period."""

import contextlib
import random

import numpy as np
import torch


def set_torch_threads(threads: int) -> None:
    """torch's intra-op CPU threads (0: torch's default). For networks of a few 256-wide layers one thread is
    fastest: more threads mostly wait for each other, and on a busy machine for other processes (measured 10x slower
    with torch's default on 2 busy cores). Called before any tensor work."""
    if threads > 0:
        torch.set_num_threads(threads)


def seed_everything(args) -> tuple[torch.device, np.random.Generator]:
    """Sets torch's threads (--torch-threads), seeds Python and torch, and asks cuDNN for deterministic kernels (same
    seed, same numbers); returns the device and the numpy generator of the run."""
    set_torch_threads(args.torch_threads)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.backends.cudnn.deterministic = True
    device = torch.device("cuda" if torch.cuda.is_available() and args.cuda else "cpu")
    return device, np.random.default_rng(args.seed)


class RunningMoments:
    """Running mean and variance of arrays of one shape (parallel algorithm of Chan et al.), in float64: of PEBBLE's
    k-NN distances (the intrinsic reward is divided by their std), of PPO's observations and returns."""

    def __init__(self, shape: tuple | int = ()):
        self.mean, self.var, self.count = np.zeros(shape), np.ones(shape), 1e-4

    def update(self, x: np.ndarray | torch.Tensor) -> None:
        """x: (B, *shape)."""
        x = np.asarray(x.detach().cpu() if isinstance(x, torch.Tensor) else x, dtype=np.float64)
        if len(x) == 0:
            return
        batch_mean, batch_var, batch_count = x.mean(0), x.var(0), len(x)
        delta, total = batch_mean - self.mean, self.count + batch_count
        self.mean = self.mean + delta * batch_count / total
        m2 = self.var * self.count + batch_var * batch_count + delta**2 * self.count * batch_count / total
        self.var, self.count = m2 / total, total

    @property
    def std(self) -> np.ndarray:
        return np.sqrt(self.var)

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


class NormalizedPolicy(torch.nn.Module):
    """What evaluation runs of a PPO agent: a raw observation, normalised with the training statistics, to the agent's
    deterministic action. The statistics are a copy: evaluation never updates them."""

    def __init__(self, agent: torch.nn.Module, normalizer: ObservationNormalizer):
        super().__init__()
        self.agent, self.discrete = agent, agent.discrete
        self.normalize_obs, self.clip, self.epsilon = normalizer.enabled, normalizer.clip, normalizer.epsilon
        device = next(agent.parameters()).device  # the agent's: observations are moved to it (a GPU run's evaluation)
        self.register_buffer("obs_mean", torch.tensor(normalizer.mean, dtype=torch.float64, device=device))
        self.register_buffer("obs_var", torch.tensor(normalizer.var, dtype=torch.float64, device=device))

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        """The same arithmetic as ObservationNormalizer.normalize (float64, then float32)."""
        if not self.normalize_obs:
            return x.float()
        return ((x.double() - self.obs_mean) / torch.sqrt(self.obs_var + self.epsilon)).clamp(-self.clip, self.clip).float()

    def deterministic_action(self, x: torch.Tensor) -> torch.Tensor:
        return self.agent.deterministic_action(self.normalize(x.to(self.obs_mean.device)))


@contextlib.contextmanager
def frozen(module: torch.nn.Module):
    """The module's weights take no gradient inside the block: a loss still back-propagates through it (into its
    inputs) but autograd skips the weight-gradient matmuls, a third of the module's backward pass."""
    module.requires_grad_(False)
    try:
        yield
    finally:
        module.requires_grad_(True)


def crossed(every: int, before: int, after: int) -> bool:
    """Whether the steps (before, after] contain a multiple of `every` (0: never)."""
    return every > 0 and before // every < after // every
