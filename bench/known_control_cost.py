"""PEBBLE with a known cost added to what SAC learns from: sac_rlhf.py exactly as it runs, except that SAC's reward is
the learned reward (at --learned-reward-std's scale) less --known-control-cost-weight x the squared action, summed over
the action's components. The control cost is the part of a locomotion task's reward anyone can write down, and the
part no clip shows; a teacher who judges what a clip shows (forward progress, staying up) then leaves it to this term,
and the labels need carry only the rest. The cost is in the learned reward's units at std 1: where the teacher's
objective has a per-step std of s over the replay buffer, a weight w prices torque against it as the weight w s does in
the objective's own units (the Ant's walking objective: s 0.33 to 0.55, so Ant-v5's own 0.5 is a weight of about 1):

    python bench/known_control_cost.py --env-id Ant-v5 --learned-reward-std 1 [more sac_rlhf.py flags]
    python bench/feedback_efficiency.py --variant norm-reset-std1-linear-ctrl --teacher-objective MODULE:FN ...  # 0.5
    python bench/feedback_efficiency.py --variant norm-reset-std1-linear-ctrl1 --teacher-objective MODULE:FN ...  # 1

docs/benchmarks/findings/gym-mujoco.md has what it did. Runs are named known_control_cost (their exp_name)."""

from dataclasses import dataclass

import numpy as np
import torch

import sac_rlhf
from cleanrlhf_utils.buffers import ReplayBuffer
from cleanrlhf_utils.cli import cli
from cleanrlhf_utils.errors import check_ranges


@dataclass
class Args(sac_rlhf.Args):
    exp_name: str = "known_control_cost"
    """the name of this experiment (part of the run name)"""
    known_control_cost_weight: float = 0.5
    """SAC's reward less this x the action's squared components, summed (Ant-v5's ctrl_cost_weight by default), in the
    learned reward's units after --learned-reward-std's scale"""


def control_cost(rb: ReplayBuffer, idx: np.ndarray, weight: float, device) -> torch.Tensor:
    """weight x the sum of the squared action of each of the batch's transitions."""
    actions = torch.as_tensor(rb.actions[idx], device=device)
    return weight * actions.square().sum(dim=1)


def add_known_control_cost() -> None:
    """sac_rlhf's SAC batches take the learned reward less the known control cost; everything else is sac_rlhf's."""
    batch_rewards = sac_rlhf.learned_rewards

    def learned_rewards(rb: ReplayBuffer, idx: np.ndarray, args: Args, step: int, device, loop) -> torch.Tensor:
        cost = control_cost(rb, idx, args.known_control_cost_weight, device)
        return batch_rewards(rb, idx, args, step, device, loop) - cost

    sac_rlhf.learned_rewards = learned_rewards


def main(args: Args) -> dict:
    check_ranges(args, {"known_control_cost_weight": ">= 0"})
    add_known_control_cost()
    return sac_rlhf.main(args)


if __name__ == "__main__":
    cli(Args, main)
