"""Checks of config values shared by the library's layers (sparse, tp) and the training loop: `check_count` refuses
a count (steps, batches, checkpoints, programs) that is no whole number (a switch that is no bool: the training's
train/config_keys.py)."""

from __future__ import annotations


def check_count(key: str, value: object, minimum: int, expected: str) -> None:
    """Raise `<key>=<value>: expected <expected>` unless value is a whole number >= minimum: YAML's `true` is a
    Python int (bool subclasses int) and would count as 1; a float would be compared and taken modulo as a step count
    (eval_every=2.5: every fifth step), or fail at its first use, maybe after training (range(1.5))."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{key}={value!r}: expected {expected}")
