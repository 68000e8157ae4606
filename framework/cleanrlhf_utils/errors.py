"""Bad input, refused in one line: the error every check raises, and the two helpers the checks are written with."""

from collections.abc import Callable
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """Bad command-line input: printed as one line, exit code 2, before any training."""


def need(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def need_flag(args, name: str, ok: Callable[[Any], bool], rule: str) -> None:
    """One flag's range: `--name must be <rule>, got <value>`."""
    value = getattr(args, name)
    need(ok(value), f"--{name.replace('_', '-')} must be {rule}, got {value}")


def within(rule: str) -> Callable[[Any], bool]:
    """The test a range rule states: `>= 1`, `> 0`, or an interval `in [0, 1)` (brackets include their end)."""
    if rule.startswith("in "):
        low, high = (float(end) for end in rule[4:-1].split(","))
        closed_low, closed_high = rule[3] == "[", rule[-1] == "]"
        return lambda value: (low <= value if closed_low else low < value) and (value <= high if closed_high else value < high)
    operator, bound = rule.split()
    return (lambda value: value >= float(bound)) if operator == ">=" else (lambda value: value > float(bound))


def check_ranges(args, ranges: dict[str, str]) -> None:
    """Every setting named in `ranges` within its rule (see `within`), refused as need_flag refuses it."""
    for name, rule in ranges.items():
        need_flag(args, name, within(rule), rule)


def unreadable(path: Path, error: Exception) -> ConfigError:
    """One line for a checkpoint file that cannot be read (cut short by a full disk or a copy, say), naming the file and
    the other checkpoints of its run that could be resumed from instead."""
    reason = (str(error).strip().splitlines() or [type(error).__name__])[0].split(". ")[0]
    others = sorted(str(other.parent) for other in path.parent.parent.glob("*/checkpoint.pt") if other.parent != path.parent)
    offer = f"; another checkpoint of the run may be whole: --resume {' or --resume '.join(others)}" if others else ""
    return ConfigError(f"{path} cannot be read ({type(error).__name__}: {reason}){offer}")
