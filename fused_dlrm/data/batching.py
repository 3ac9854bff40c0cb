"""Splitting a global batch across data-parallel ranks."""

from __future__ import annotations

import numbers


def local_batch_bounds(global_batch_size: int, rank: int, world_size: int) -> tuple[int, int]:
    """Return ``(start, stop)`` of ``rank``'s slice of a global batch.

    The batch is split as evenly as possible: every rank gets
    ``global_batch_size // world_size`` samples and the first
    ``global_batch_size % world_size`` ranks get one more. The slices of ranks
    ``0 .. world_size - 1`` are consecutive and cover ``[0, global_batch_size)``.
    """
    for name, value in (("global_batch_size", global_batch_size), ("rank", rank), ("world_size", world_size)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):  # YAML's true would count as 1
            raise ValueError(f"{name} must be an integer, got {value!r}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    if global_batch_size < world_size:
        # A rank with zero samples would break collectives that expect every rank to hold data.
        raise ValueError(
            f"global_batch_size ({global_batch_size}) must be >= world_size ({world_size}) "
            "so that every rank gets at least one sample"
        )
    base, extra = divmod(int(global_batch_size), int(world_size))
    rank = int(rank)
    start = rank * base + min(rank, extra)
    stop = start + base + (1 if rank < extra else 0)
    return start, stop
