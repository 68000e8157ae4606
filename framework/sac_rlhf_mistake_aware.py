# PEBBLE with a mistake-aware Bradley-Terry likelihood, for a teacher who flips a known share of the labels.
#
# The difference from PEBBLE (sac_rlhf.py) is the reward model's loss: a label is taken to be right with probability
# 1 - eps, so P(label) = (1 - eps) sigmoid(R1 - R0) + eps sigmoid(R0 - R1). A pair the model is sure of then costs at
# most -ln(eps) when its label is wrong, where the plain loss grows without bound and drags the model towards the
# mistake. eps = 0 is PEBBLE's loss. Everything else is PEBBLE's, run by sac_rlhf.main.
#
#   python framework/sac_rlhf_mistake_aware.py --env-id Hopper-v5 --teacher-eps-mistake 0.1 --label-mistake-rate 0.1
import functools
import math
from dataclasses import dataclass

from cleanrlhf_utils.arguments import refuse_unknown_flags

if __name__ == "__main__":
    refuse_unknown_flags(__file__)  # a mistyped flag: one line at once, not after the seconds torch takes to import

import torch
import torch.nn.functional as F

import sac_rlhf
from cleanrlhf_utils.cli import cli
from cleanrlhf_utils.errors import check_ranges


@dataclass
class Args(sac_rlhf.Args):
    """PEBBLE's settings and the share of wrong labels the loss expects."""

    exp_name: str = "sac_rlhf_mistake_aware"
    """the name of this experiment (part of the run name)"""
    label_mistake_rate: float = 0.1
    """eps, the share of flipped labels the loss expects, in [0, 0.5)"""


def mistake_aware_loss(returns: torch.Tensor, labels: torch.Tensor, epsilon: float) -> torch.Tensor:
    """sac_rlhf.bradley_terry_loss for a teacher who flips a share `epsilon` of the labels: the negative log of
    P = eps + (1 - 2 eps) sigmoid(R1 - R0) for label 1 (and of its mirror for label 0), computed in log space."""
    if epsilon == 0:
        return sac_rlhf.bradley_terry_loss(returns, labels)
    logits = returns[..., 1] - returns[..., 0]
    floor, scale = math.log(epsilon), math.log1p(-2 * epsilon)
    log_second = torch.logaddexp(torch.full_like(logits, floor), scale + F.logsigmoid(logits))
    log_first = torch.logaddexp(torch.full_like(logits, floor), scale + F.logsigmoid(-logits))
    return -(labels * log_second + (1 - labels) * log_first).mean()


def validate_args(args: Args) -> None:
    """PEBBLE's settings and the mistake rate (what a sweep checks before its trials)."""
    check_ranges(args, {"label_mistake_rate": "in [0, 0.5)"})
    sac_rlhf.validate_args(args)


def main(args: Args, on_evaluation=None) -> dict:
    check_ranges(args, {"label_mistake_rate": "in [0, 0.5)"})
    loss = functools.partial(mistake_aware_loss, epsilon=args.label_mistake_rate)
    return sac_rlhf.main(args, on_evaluation, reward_training=functools.partial(sac_rlhf.train_reward_model, loss_fn=loss))


if __name__ == "__main__":
    cli(Args, main)
