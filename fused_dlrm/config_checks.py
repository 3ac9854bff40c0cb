"""Checks of config values shared by the library's layers (sparse, tp) and the training loop: `check_count` refuses
a count (steps, batches, checkpoints, programs) that is no whole number (a switch that is no bool: the training's
train/config_keys.py); `ArgumentError` names a library class's refused argument, which the training names by its key."""

from __future__ import annotations

import math
import numbers


class ArgumentError(ValueError):
    """`<argument> <problem>`: a refused argument of a library class, by its name, which a caller that took it from
    a config names by its key instead (train/build.py's build_dataset: data.<split>.<argument>). Other errors keep
    their words: a message's first word is not taken for an argument's name."""

    def __init__(self, argument: str, problem: str) -> None:
        super().__init__(argument, problem)  # its args: a copy unpickled in another process is made the same way
        self.argument, self.problem = argument, problem

    def __str__(self) -> str:
        return f"{self.argument} {self.problem}"


def check_count(key: str, value: object, minimum: int, expected: str, maximum: int | None = None) -> None:
    """Raise `<key>=<value>: expected <expected>` unless value is a whole number >= minimum (and <= maximum, where
    given): YAML's `true` is a Python int (bool subclasses int) and would count as 1; a float would be compared and
    taken modulo as a step count (eval_every=2.5: every fifth step), or fail at its first use, maybe after training
    (range(1.5))."""
    if (isinstance(value, bool) or not isinstance(value, int) or value < minimum
            or (maximum is not None and value > maximum)):
        raise ValueError(f"{key}={value!r}: expected {expected}")


def check_seed(seed: object) -> None:
    """The config's seed, before anything is built: torch's generators take 64 bits, and the tables' seeds are
    seed x 100_003 + their index (sparse/sharded_ebc.table_seeds); else the model's initialisation failed, naming
    no key."""
    check_count("seed", seed, 0, "a whole number in [0, 2**32)", 2**32 - 1)


def check_comm_mode(mode: object) -> None:
    """comm.mode, before anything is built: the report sets it per column itself, so a typo it did not refuse would
    be timed as both modes."""
    if mode not in ("bulk", "fused"):
        raise ValueError(f"unknown comm.mode {mode!r}: expected bulk or fused")


def is_finite_at_least_zero(value: object) -> bool:
    """A real number (not YAML's true / false, which Python counts as 1 / 0), finite and >= 0: a coefficient or
    factor of the config (NaN compares false with everything, so `value >= 0` alone lets it through)."""
    return (isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
            and value >= 0)
