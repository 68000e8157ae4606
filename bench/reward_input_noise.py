"""PEBBLE with Gaussian noise on the reward model's inputs while it trains: sac_rlhf.py exactly as it runs, except that
in training mode every (observation, action) row the ensemble reads is moved by --reward-input-noise times the input's
standard deviation over the buffer (the statistics --reward-net-normalize-inputs standardises by), drawn afresh at each
pass. Predictions (the relabel, the queries, the accuracies) read the inputs as they are.

Why: the Ant's standing agents' final models pay their own agent's stance most, and another standing agent's stance of
the same true return far less (docs/benchmarks/findings/gym-mujoco.md): they price the exact pose the labels' preferred
segments share, and slow walks away from it below doing nothing. A model that cannot resolve a pose finer than the
noise has to price what varies more than that between a pair's segments (torque, speed) and is smooth around the
stance, so a step away from it is paid about as the stance is:

    python bench/reward_input_noise.py --env-id Ant-v5 --reward-net-normalize-inputs [more sac_rlhf.py flags]
    python bench/feedback_efficiency.py --variant norm-reset-std1-linear-recent-noise ...

Runs are named reward_input_noise (their exp_name)."""

from dataclasses import dataclass

import torch

import sac_rlhf
from cleanrlhf_utils.cli import cli
from cleanrlhf_utils.errors import check_ranges


@dataclass
class Args(sac_rlhf.Args):
    exp_name: str = "reward_input_noise"
    """the name of this experiment (part of the run name)"""
    reward_input_noise: float = 0.5
    """the std of the Gaussian noise added to each reward-model input while the model trains, in units of that input's
    std over the buffer (with --reward-net-normalize-inputs; without it the inputs' own units)"""


def noisy_while_training(forward, noise: float):
    """RewardEnsemble._forward reading, in training mode, its inputs moved by `noise` standard deviations."""

    def _forward(model: sac_rlhf.RewardEnsemble, x: torch.Tensor) -> torch.Tensor:
        if model.training and noise > 0:
            x = x + noise * model.input_std * torch.randn_like(x)
        return forward(model, x)

    return _forward


def main(args: Args) -> dict:
    check_ranges(args, {"reward_input_noise": ">= 0"})
    sac_rlhf.RewardEnsemble._forward = noisy_while_training(sac_rlhf.RewardEnsemble._forward, args.reward_input_noise)
    return sac_rlhf.main(args)


if __name__ == "__main__":
    cli(Args, main)
