"""What a benchmark checks before it times a fused op: its result against its bulk twin's, on every rank (and a
training step's: its update of each embedding table against the bulk step's)."""

from __future__ import annotations

from typing import Callable

import torch

from fused_dlrm.dist.env import raise_on_every_rank


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| (Frobenius, in fp32); NaN or inf where got holds one. Not elementwise: entries
    near zero carry the absolute rounding error of their large neighbours."""
    return float(torch.linalg.vector_norm(got.float() - want.float()) / torch.linalg.vector_norm(want.float()))


def max_relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want| (in fp32); NaN where got holds one. One wrong entry among many counts in full
    (the norm of relative_error spreads it over them)."""
    return float((got.float() - want.float()).abs().max() / want.float().abs().max())


def different_elements(got: torch.Tensor, want: torch.Tensor) -> float:
    """How many elements differ bit for bit (a zero of the other sign and NaN payloads too): 0 for a result meant
    to equal its reference exactly."""
    as_int = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[got.element_size()]
    return float((got.contiguous().view(as_int) != want.contiguous().view(as_int)).sum())


def check_against_bulk(what: str, got: torch.Tensor, bulk: torch.Tensor, tolerance: float,
                       reference: str = "the bulk twin",
                       metric: Callable[[torch.Tensor, torch.Tensor], float] = relative_error) -> float:
    """Raise on every rank unless `got` is `bulk` (the bulk twin's result, or another `reference`'s), of its shape
    and within `tolerance` by `metric` (relative_error, max_relative_error or different_elements), on every rank:
    a wrong fused result must stop the bench, not be timed (a rank raising alone would leave its peers in the next
    collective).
    Returns this rank's error, for the bench's table."""
    problem, error = None, float("nan")
    if got.shape != bulk.shape:  # else broadcast into agreement, or torch's size error on this rank alone
        problem = AssertionError(f"{what}: shape {list(got.shape)} against {reference}'s {list(bulk.shape)}")
    elif not (error := metric(got, bulk)) <= tolerance:  # NaN compares False
        problem = AssertionError(f"{what}: {metric.__name__.replace('_', ' ')} {error:.3g} against {reference} "
                                 f"(tolerance {tolerance:g})")
    raise_on_every_rank(problem, f"saw a result unlike {reference}'s")
    return error


def check_table_updates(what: str, tables: dict[str, torch.Tensor], step: Callable[[], object],
                        bulk_step: Callable[[], object], tolerance: float) -> None:
    """Raise on every rank unless one `step` (a forward+backward) updates each of `tables` as one `bulk_step` does
    from the same values, by relative_error within `tolerance` over the whole table (a row no bag touches must
    stay as it was: its update is 0). Table by table, two steps each, each table put back after each step: the
    extra memory is one table's copy and its bulk update, not every table's. The other tables change meanwhile,
    which changes no table's update: an embedding table's gradient does not depend on its values (SGD: no state).
    Every rank must hold as many tables (each step is a collective)."""
    for name, table in tables.items():
        start = table.clone()
        bulk_step()
        bulk_update = table - start
        table.copy_(start)
        step()
        check_against_bulk(f"{what} of table {name}", table.sub_(start), bulk_update, tolerance)
        table.copy_(start)
