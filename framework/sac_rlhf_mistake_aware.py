# PEBBLE with a mistake-aware Bradley-Terry likelihood, for a teacher who flips a known share of the labels.
#
# The difference from PEBBLE (sac_rlhf.py) is the reward model's loss: a label is taken to be right with probability
# 1 - eps, so P(label) = (1 - eps) P(label | R) + eps P(other label | R), P the preference model's (sac_rlhf.py's
# PREFERENCE_MODEL: Bradley-Terry, P(segment 1 preferred) = sigmoid(R1 - R0)). A pair the model is sure of then costs at
# most -ln(eps) when its label is wrong, where the plain loss grows without bound and drags the model towards the
# mistake. eps = 0 is PEBBLE's loss. Everything else is PEBBLE's, run by sac_rlhf.main.
#
#   python framework/sac_rlhf_mistake_aware.py --env-id Hopper-v5 --teacher-eps-mistake 0.1 --label-mistake-rate 0.1
import functools
import math
from dataclasses import dataclass
from typing import ClassVar

from cleanrlhf_utils.arguments import refuse_unknown_flags

if __name__ == "__main__":
    refuse_unknown_flags(__file__)  # a mistyped flag: one line at once, not after the seconds torch takes to import

import torch

import sac_rlhf
from cleanrlhf_utils.cli import cli
from cleanrlhf_utils.errors import check_ranges, need


@dataclass
class Args(sac_rlhf.Args):
    """PEBBLE's settings and the share of wrong labels the loss expects."""

    help_group: ClassVar[str] = "mistake-aware loss"

    exp_name: str = "sac_rlhf_mistake_aware"
    """the name of this experiment (part of the run name)"""
    label_mistake_rate: float = 0.1
    """eps, the share of flipped labels the loss expects, in [0, 0.5)"""


def mistake_aware_loss(returns: torch.Tensor, labels: torch.Tensor, epsilon: float) -> torch.Tensor:
    """The preference model's loss (sac_rlhf.PREFERENCE_MODEL, Bradley-Terry) for a teacher who flips a share
    `epsilon` of the labels: the negative log of P = eps + (1 - 2 eps) P_model(label), computed in log space from the
    model's log-probabilities of each outcome."""
    model = sac_rlhf.PREFERENCE_MODEL
    if epsilon == 0:
        return model.loss(returns, labels)
    log_first, log_second = model.log_probabilities(returns).unbind(-1)
    floor, scale = math.log(epsilon), math.log1p(-2 * epsilon)
    log_second = torch.logaddexp(torch.full_like(log_second, floor), scale + log_second)
    log_first = torch.logaddexp(torch.full_like(log_first, floor), scale + log_first)
    return -(labels * log_second + (1 - labels) * log_first).mean()


def validate_mistake_args(args: Args) -> None:
    """The mistake rate, and pairs: a flip is the other of a pair's two labels."""
    check_ranges(args, {"label_mistake_rate": "in [0, 0.5)"})
    clips = args.clips_per_query
    need(clips == 2, f"the mistake-aware loss flips a pair's label: --clips-per-query must be 2, got {clips}")
    scale = args.rating_scale
    need(scale == 0, f"the mistake-aware loss flips a pair's label: it learns no ratings, got --rating-scale {scale}")


def validate_args(args: Args) -> None:
    """PEBBLE's settings and the mistake rate (what a sweep checks before its trials)."""
    validate_mistake_args(args)
    sac_rlhf.validate_args(args)


def main(args: Args, on_evaluation=None) -> dict:
    validate_mistake_args(args)
    loss = functools.partial(mistake_aware_loss, epsilon=args.label_mistake_rate)
    training = functools.partial(sac_rlhf.train_reward_model, loss_fn=loss)
    return sac_rlhf.main(args, on_evaluation, reward_training=training)


if __name__ == "__main__":
    cli(Args, main)
