"""Variable-split all-to-all with autograd: the collective of every bulk-synchronous twin.

In one process (no process group) both functions are the identity.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def world_size(group: dist.ProcessGroup | None = None) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def exchange_counts(send_counts: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Row r of `send_counts` ([world, k] int64) goes to rank r; row s of the result came from rank s."""
    if world_size(group) == 1:
        return send_counts.clone()
    recv = torch.empty_like(send_counts)
    dist.all_to_all_single(recv, send_counts.contiguous(), group=group)
    return recv


def _all_to_all(x: torch.Tensor, send_splits: list[int], recv_splits: list[int], group) -> torch.Tensor:
    out = x.new_empty((sum(recv_splits),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), recv_splits, send_splits, group=group)
    return out


class _AllToAllV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, send_splits, recv_splits, group):
        ctx.splits = (send_splits, recv_splits)
        ctx.group = group
        return _all_to_all(x, send_splits, recv_splits, group)

    @staticmethod
    def backward(ctx, grad):
        send_splits, recv_splits = ctx.splits
        # The gradient travels back along the same edges: what was received is sent home. Through the Function
        # itself, so that a gradient made with create_graph=True differentiates again (its backward: this exchange).
        return _AllToAllV.apply(grad, recv_splits, send_splits, ctx.group), None, None, None


def all_to_all_v(
    x: torch.Tensor, send_splits: list[int], recv_splits: list[int], group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Send x[sum(send_splits[:r]) : ...] (rows of dim 0) to rank r; return the received rows, ordered by source."""
    if world_size(group) == 1:
        return x
    return _AllToAllV.apply(x, list(send_splits), list(recv_splits), group)
