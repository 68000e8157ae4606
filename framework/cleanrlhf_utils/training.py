"""Pieces of a training loop that are not the algorithm: threads and seeds, running moments, frozen weights, and
whether a step crossed a period."""

import contextlib
import functools
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
    """Sets torch's threads (--torch-threads), seeds Python and torch; returns the device and the numpy generator of the run."""
    set_torch_threads(args.torch_threads)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.backends.cudnn.deterministic = args.torch_deterministic
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


def outputs_copied(step):
    """`step` (a function returning a dict of tensors) with its outputs copied as they come out. A CUDA graph
    (--cudagraphs) returns tensors in its static memory, which the next replay of any of the run's graphs overwrites,
    and an update's stats are read later (logging), after more replays."""

    @functools.wraps(step)
    def copied(*args):
        return {name: value.clone() for name, value in step(*args).items()}

    return copied


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
