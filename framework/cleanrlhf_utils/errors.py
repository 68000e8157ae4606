"""Bad input, refused in one line: the error every check raises, and the two helpers the checks are written with."""

from collections.abc import Callable
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
