# PEBBLE that starts SAC afresh after a feedback session that changed the learned reward a lot.
#
# An agent settled on what an earlier reward paid for can stay there when a later session's labels move the reward
# elsewhere (the primacy bias, Nikishin et al. 2022). After every session past the first, this variant measures how
# the session's relabel changed the rewards of the transitions that had one (their Pearson correlation before and
# after, which PEBBLE logs as feedback/reward_change_correlation) and, below --reset-agent-below-correlation,
# re-initialises the actor, the critics and the temperature, with fresh optimisers. Everything else is PEBBLE's, run
# by sac_rlhf.main; the backflip experiments of docs/benchmarks/backflip.md use it (bench/novel_behaviours.py runs
# this file when its --preference-flags set the flag).
#
#   python framework/sac_rlhf_agent_reset.py --env-id Hopper-v5 --teacher-objective hopper-backflip \
#       --reset-agent-below-correlation 0.9
from dataclasses import dataclass
from typing import ClassVar

from cleanrlhf_utils.arguments import refuse_unknown_flags

if __name__ == "__main__":
    refuse_unknown_flags(__file__)  # a mistyped flag: one line at once, not after the seconds torch takes to import


import sac_rlhf
from cleanrlhf_utils.cli import cli
from cleanrlhf_utils.errors import check_ranges


@dataclass
class Args(sac_rlhf.Args):
    """PEBBLE's settings and the reward change that starts SAC afresh."""

    help_group: ClassVar[str] = "agent reset"

    exp_name: str = "sac_rlhf_agent_reset"
    """the name of this experiment (part of the run name)"""
    reset_agent_below_correlation: float = -1.0
    """start SAC afresh after a session whose relabel correlates below this with the rewards before it (-1: never)"""


def validate_args(args: Args) -> None:
    """PEBBLE's settings and the threshold (what a sweep checks before its trials)."""
    sac_rlhf.validate_args(args)
    check_ranges(args, {"reset_agent_below_correlation": "in [-1, 1]"})


class AgentReset:
    """sac_rlhf.main's after_session: after a session past exploration's end whose relabel correlates below the
    threshold with the rewards before it, SAC starts afresh. Counts the resets (logged as feedback/agent_resets,
    summed in the summary, checkpointed with the run)."""

    def __init__(self, threshold: float):
        self.threshold, self.resets = threshold, 0

    def __call__(self, agent: sac_rlhf.SACAgent, loop, reward_change: float) -> dict:
        if loop.learning_from_preferences and reward_change < self.threshold:  # NaN (no learned reward yet): never
            sac_rlhf.start_afresh(agent)
            self.resets += 1
        return {"agent_resets": self.resets}

    def summary(self) -> dict:
        return {"agent_resets": self.resets}

    def state_dict(self) -> dict:
        return {"resets": self.resets}

    def load_state_dict(self, state: dict) -> None:
        self.resets = int(state["resets"])


def main(args: Args, on_evaluation=None) -> dict:
    check_ranges(args, {"reset_agent_below_correlation": "in [-1, 1]"})
    return sac_rlhf.main(args, on_evaluation, after_session=AgentReset(args.reset_agent_below_correlation))


if __name__ == "__main__":
    cli(Args, main)
