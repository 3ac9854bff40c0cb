"""What a benchmark checks before it times a fused op: its result against its bulk twin's, on every rank."""

from __future__ import annotations

import torch

from fused_dlrm.dist.env import raise_on_every_rank


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| (Frobenius, in fp32); NaN or inf where got holds one. Not elementwise: entries
    near zero carry the absolute rounding error of their large neighbours."""
    return float(torch.linalg.vector_norm(got.float() - want.float()) / torch.linalg.vector_norm(want.float()))


def check_against_bulk(what: str, got: torch.Tensor, bulk: torch.Tensor, tolerance: float,
                       reference: str = "the bulk twin") -> None:
    """Raise on every rank unless `got` is `bulk` (the bulk twin's result, or another `reference`'s), of its shape
    and within `tolerance` in relative error, on every rank: a wrong fused result must stop the bench, not be timed
    (a rank raising alone would leave its peers in the next collective)."""
    problem = None
    if got.shape != bulk.shape:  # else broadcast into agreement, or torch's size error on this rank alone
        problem = AssertionError(f"{what}: shape {list(got.shape)} against {reference}'s {list(bulk.shape)}")
    elif not (error := relative_error(got, bulk)) <= tolerance:  # NaN compares False
        problem = AssertionError(f"{what}: relative error {error:.3g} against {reference} (tolerance {tolerance:g})")
    raise_on_every_rank(problem, f"saw a result unlike {reference}'s")
