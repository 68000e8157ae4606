"""PEBBLE's loop on the true reward: sac_rlhf.py exactly as it runs (exploration, the teacher's sessions, the reward
model's fits, the critic reset when the first labels come), except that SAC learns from the env's own reward times
--reward-scale wherever it would learn from the reward model. It separates what the loop costs (exploration's policy and
data, the critic reset, a reward that changes at every session) from what the learned reward's shape and scale cost:

    python bench/oracle_loop.py --env-id HalfCheetah-v5 --seed 1 --total-timesteps 100000 [more sac_rlhf.py flags]
    python bench/oracle_loop.py --reward-scale 0.24 ...   # the true reward at the learned reward's scale

SAC on the true reward (sac.py) against this with scale 1 is the loop's cost; this against a sac_rlhf.py run of the same
settings is the learned reward's. Runs are named oracle_loop (their exp_name); evaluations are the env's return."""

from dataclasses import dataclass

import numpy as np

import sac_rlhf
from cleanrlhf_utils.buffers import PendingRewards, ReplayBuffer
from cleanrlhf_utils.cli import cli


@dataclass
class Args(sac_rlhf.Args):
    exp_name: str = "oracle_loop"
    """the name of this experiment (part of the run name)"""
    reward_scale: float = 1.0
    """SAC learns from the env's reward times this wherever sac_rlhf.py would use the reward model's"""


def true_rewards_in_place_of_learned(scale: float) -> None:
    """sac_rlhf's relabel and its pending rows copy the env's reward (times `scale`) instead of predicting it."""

    def relabel(model, rb: ReplayBuffer, device) -> None:
        rb.learned_rewards[: rb.size] = scale * rb.true_rewards[: rb.size]
        rb.reward_std[: rb.size] = 0.0

    class PendingTrueRewards(PendingRewards):
        def fill(self, predict, rb: ReplayBuffer) -> None:
            rows = self.waiting_rows(rb)
            rb.learned_rewards[rows], rb.reward_std[rows] = scale * rb.true_rewards[rows], np.zeros(len(rows))
            self.count = 0

    sac_rlhf.relabel_replay_buffer, sac_rlhf.PendingRewards = relabel, PendingTrueRewards


def main(args: Args) -> dict:
    true_rewards_in_place_of_learned(args.reward_scale)
    return sac_rlhf.main(args)


if __name__ == "__main__":
    cli(Args, main)
