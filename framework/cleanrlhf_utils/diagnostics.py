"""How the learned reward compares with the reward the teacher judges by: the reward model's accuracy on fresh pairs,
per-step and per-segment correlation, and the scale of both. Logged with every feedback session (reward_model/...) and
kept in summary.json, where the benchmarks read them; none of it feeds back into training."""

from collections.abc import Callable

import numpy as np
import torch

from .buffers import ReplayBuffer
from .objectives import Objective, step_rewards

FRESH_PAIRS = 1000
"""pairs of the replay buffer that measure the model against the judged reward (accuracy, segment correlation)"""


def judged_rewards(rb: ReplayBuffer, objective: Objective | None) -> np.ndarray:
    """The per-step reward the teacher judges by, for every slot of the replay buffer: the env's, or with
    --teacher-objective the objective's (each step alone, as sac.py --reward-objective trains on it). A backflip's
    labels say nothing of Hopper's forward reward, and the windmill's is 0 everywhere."""
    if objective is None:
        return rb.true_rewards
    judged = np.zeros_like(rb.true_rewards)
    judged[: rb.size] = step_rewards(objective, rb.obs[: rb.size], rb.actions[: rb.size], rb.physics_states[: rb.size])
    return judged


def reward_correlation(rb: ReplayBuffer, truth: np.ndarray, recent: int = 10_000) -> float:
    """Pearson correlation of the learned and the judged reward (`truth`, per buffer slot) over the most recent steps."""
    n = min(recent, rb.size)
    idx = (rb.pos - 1 - np.arange(n)) % rb.capacity
    learned, true = rb.learned_rewards[idx], truth[idx]
    if n < 2 or learned.std() == 0 or true.std() == 0:
        return float("nan")
    return float(np.corrcoef(learned, true)[0, 1])


def segment_correlation(rb: ReplayBuffer, truth: np.ndarray, pairs: int, length: int, rng: np.random.Generator) -> float:
    """Pearson correlation of learned and judged returns of 2 x `pairs` random segments drawn as query pairs are: what
    the labels constrain, where reward_correlation compares single steps (a model can rank segments well and still
    spread the reward over their steps in another shape)."""
    if rb.size < 2:
        return float("nan")
    idx, mask = rb.sample_segment_pairs(pairs, length, rng)
    learned, true = (rb.learned_rewards[idx] * mask).sum(-1).ravel(), (truth[idx] * mask).sum(-1).ravel()
    if learned.std() == 0 or true.std() == 0:
        return float("nan")
    return float(np.corrcoef(learned, true)[0, 1])


def reward_scale(rb: ReplayBuffer, truth: np.ndarray) -> dict:
    """Mean and std of the learned and the judged reward over the buffer: the scale SAC's temperature weighs the
    policy's entropy against."""
    names = ("learned_reward_mean", "learned_reward_std", "true_reward_mean", "true_reward_std")
    if rb.size == 0:
        return dict.fromkeys(names, float("nan"))
    learned, true = rb.learned_rewards[: rb.size], truth[: rb.size]
    return dict(zip(names, map(float, (learned.mean(), learned.std(), true.mean(), true.std())), strict=True))


def fresh_pair_accuracy(probabilities: Callable, rb: ReplayBuffer, truth: np.ndarray, num_pairs: int, length: int, rng, device) -> float:
    """Agreement of the ensemble-mean preference (`probabilities(segments, masks)` -> (E, N)) with the judged reward
    (`truth`, per buffer slot) on fresh random pairs of the replay buffer, ties left out: how well the model
    generalises, without spending a label."""
    idx, mask = rb.sample_segment_pairs(num_pairs, length, rng)
    returns = (truth[idx] * mask).sum(-1)
    decided = returns[:, 0] != returns[:, 1]
    if not decided.any():
        return float("nan")
    segments = torch.as_tensor(rb.obs_actions(idx[decided]), device=device)
    probs = probabilities(segments, torch.as_tensor(mask[decided], device=device, dtype=torch.float32)).mean(0)
    return float(((probs.cpu().numpy() > 0.5) == (returns[decided, 1] > returns[decided, 0])).mean())


def reward_diagnostics(
    rb: ReplayBuffer, objective: Objective | None, probabilities: Callable, length: int, seed, fresh: bool, device
) -> dict:
    """The learned reward of the buffer against the judged one (judged_rewards): reward_correlation,
    segment_correlation, reward_scale and, with `fresh`, the model's heldout_accuracy on fresh pairs. Each draws from
    its own generator seeded by `seed` (a tuple), so that measuring leaves a run's random numbers alone."""
    truth = judged_rewards(rb, objective)
    measured = {}
    if fresh:
        measured["heldout_accuracy"] = fresh_pair_accuracy(
            probabilities, rb, truth, FRESH_PAIRS, length, np.random.default_rng(seed), device
        )
    segments = segment_correlation(rb, truth, FRESH_PAIRS, length, np.random.default_rng((*seed, 1)))
    return measured | {"reward_correlation": reward_correlation(rb, truth), "segment_correlation": segments, **reward_scale(rb, truth)}
