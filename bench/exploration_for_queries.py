"""PEBBLE with its exploring steps kept for the queries and out of SAC's learning: sac_rlhf.py exactly as it runs,
except that once the first labels end exploration, SAC's batches come only from the steps taken after it (from the
whole buffer, as PEBBLE's do, until there are --learning-starts of them). The state-entropy steps stay in the buffer,
so the first sessions' pairs (and, with --qpa-query-episodes, every pair until they leave the last episodes) are
drawn from them; SAC never learns from them again. An experiment on the Ant, where PEBBLE's loop on the env's own
reward did better without its exploring steps and the labels did worse:

    python bench/exploration_for_queries.py --env-id Ant-v5 --seed 1 --total-timesteps 100000 [more sac_rlhf.py flags]
    python bench/feedback_efficiency.py --variant norm-reset-std1-linear-recent-explorequeries --env-id Ant-v5 ...

docs/benchmarks/findings/gym-mujoco.md has what it did. Runs are named exploration_for_queries (their exp_name)."""

from dataclasses import dataclass

import numpy as np
import torch

import sac_rlhf
from cleanrlhf_utils.buffers import ReplayBuffer
from cleanrlhf_utils.cli import cli


@dataclass
class Args(sac_rlhf.Args):
    exp_name: str = "exploration_for_queries"
    """the name of this experiment (part of the run name)"""


@dataclass
class SplitLoopState(sac_rlhf.LoopState):
    first_learning_slot: int = 0  # the buffer's first slot after exploration; checkpointed with the loop's counters


def learning_phase_indices(rb: ReplayBuffer, first: int, batch_size: int, rng, recent: np.ndarray, share: float):
    """`batch_size` slots drawn uniformly from [first, rb.size), with round(share x batch_size) of them first drawn
    from those of the `recent` slots at or after `first` (QPA's hybrid replay, where it is on)."""
    recent = recent[recent >= first]
    on_policy = round(share * batch_size) if len(recent) else 0
    from_recent = recent[rng.integers(0, len(recent), size=on_policy)] if on_policy else np.empty(0, dtype=np.int64)
    return np.concatenate([from_recent, rng.integers(first, rb.size, size=batch_size - on_policy)])


def keep_exploration_out_of_sac() -> None:
    """sac_rlhf's relabel marks where exploration ended, and SAC's batches on the learned reward start there. The
    relabel's scale is computed where the buffer is at hand, and the critic reset that ends exploration in the same
    unit has the loop: the boundary goes into the loop there, before any checkpoint, so a resumed run keeps it."""
    size_at_relabel: list[int] = []
    scale_of, reset_after, plain_sample_batch = sac_rlhf.sac_reward_scale, sac_rlhf.reset_after_session, sac_rlhf.sample_batch

    def sac_reward_scale(rb: ReplayBuffer, args: Args) -> float:
        size_at_relabel[:] = [rb.size]
        return scale_of(rb, args)

    def reset_after_session(agent, loop: SplitLoopState, labels: int, args: Args) -> None:
        if labels > 0 and not loop.learning_from_preferences and size_at_relabel:
            loop.first_learning_slot = size_at_relabel.pop()
        reset_after(agent, loop, labels, args)

    def sample_batch(rb: ReplayBuffer, rng, args: Args, loop: SplitLoopState, hybrid: bool, recent_slots, device):
        first = loop.first_learning_slot
        if not loop.learning_from_preferences or rb.full or rb.size - first < args.learning_starts:
            return plain_sample_batch(rb, rng, args, loop, hybrid, recent_slots, device)
        if hybrid and (recent_slots is None or loop.episode_length == 0):
            recent_slots = rb.recent_episode_slots(args.qpa_query_episodes)
        recent, share = (recent_slots, args.qpa_hybrid_ratio) if hybrid else (np.empty(0, dtype=np.int64), 0.0)
        idx = learning_phase_indices(rb, first, args.batch_size, rng, recent, share)
        batch = {name: torch.as_tensor(getattr(rb, name)[idx], device=device) for name in sac_rlhf.SAC_BATCH}
        return idx, batch, recent_slots

    sac_rlhf.LoopState, sac_rlhf.sac_reward_scale = SplitLoopState, sac_reward_scale
    sac_rlhf.reset_after_session, sac_rlhf.sample_batch = reset_after_session, sample_batch


def main(args: Args) -> dict:
    keep_exploration_out_of_sac()
    return sac_rlhf.main(args)


if __name__ == "__main__":
    cli(Args, main)
