"""PEBBLE with SAC's learned reward shifted to be nonnegative: sac_rlhf.py exactly as it runs, except that SAC learns the
learned reward plus minus its lowest value over the replay buffer, set at every relabel (then --learned-reward-std's
scale, if asked). No step then costs and staying in an episode pays, as the env's own healthy reward makes it pay: an
experiment on the episode-end constant, where a learned reward below zero on the states the agent reaches makes the
shortest episode the best one (an Ant that tips itself over at once):

    python bench/nonnegative_reward.py --env-id Ant-v5 --seed 1 --total-timesteps 100000 [more sac_rlhf.py flags]
    python bench/feedback_efficiency.py --variant norm-reset-std1-nonneg --env-id Ant-v5 ...   # against SAC

docs/benchmarks/findings/gym-mujoco.md has what it did. Runs are named nonnegative_reward (their exp_name)."""

from dataclasses import dataclass

import numpy as np

import sac_rlhf
from cleanrlhf_utils.buffers import ReplayBuffer
from cleanrlhf_utils.cli import cli


@dataclass
class Args(sac_rlhf.Args):
    exp_name: str = "nonnegative_reward"
    """the name of this experiment (part of the run name)"""


@dataclass
class ShiftedLoopState(sac_rlhf.LoopState):
    reward_shift: float = 0.0  # added to SAC's learned rewards before the scale; checkpointed with the loop's counters


def lowest_reward_shift(rb: ReplayBuffer) -> float:
    """Minus the lowest learned reward in the buffer's filled rows (0 for an empty buffer)."""
    return -float(rb.learned_rewards[: rb.size].min()) if rb.size else 0.0


def shift_learned_rewards() -> None:
    """sac_rlhf's relabel sets the shift beside the scale, and SAC's batches add it. The relabel's scale is computed where
    the buffer is at hand and the critic reset that follows it in the same unit has the loop, so the shift goes into
    the loop there, before any checkpoint: a resumed run continues with the shift it had."""
    new_shift: list[float] = []
    scale_of, reset_after, batch_rewards = sac_rlhf.sac_reward_scale, sac_rlhf.reset_after_session, sac_rlhf.learned_rewards

    def sac_reward_scale(rb: ReplayBuffer, args: Args) -> float:
        new_shift[:] = [lowest_reward_shift(rb)]
        return scale_of(rb, args)

    def reset_after_session(agent, loop: ShiftedLoopState, labels: int, args: Args) -> None:
        if new_shift:
            loop.reward_shift = new_shift.pop()
        reset_after(agent, loop, labels, args)

    def learned_rewards(rb: ReplayBuffer, idx: np.ndarray, args: Args, step: int, device, loop: ShiftedLoopState):
        return batch_rewards(rb, idx, args, step, device, loop) + loop.reward_shift * loop.reward_scale

    sac_rlhf.LoopState, sac_rlhf.sac_reward_scale = ShiftedLoopState, sac_reward_scale
    sac_rlhf.reset_after_session, sac_rlhf.learned_rewards = reset_after_session, learned_rewards


def main(args: Args) -> dict:
    shift_learned_rewards()
    return sac_rlhf.main(args)


if __name__ == "__main__":
    cli(Args, main)
