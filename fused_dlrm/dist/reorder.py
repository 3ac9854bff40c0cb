"""Reordering along one dim by a permutation, as the bulk exchanges do around their all-to-alls (the MoE layer's
rows by owner and expert, the pooled embeddings' columns into feature order).

The backward is the gather by the inverse permutation: each element is taken once, so nothing accumulates.
autograd's backward of index_select zero-fills and scatter-adds instead (0.96 ms against 0.43 ms for the gather at
[4096, 32768] fp32 on an H200), and that of x[order] sorts.
"""

from __future__ import annotations

import torch


def inverse_permutation(order: torch.Tensor) -> torch.Tensor:
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)  # a scatter, not a sort
    return inverse


def reorder(x: torch.Tensor, dim: int, order: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """x.index_select(dim, order) for a permutation `order` of that dim (inverse: its inverse)."""
    return _Reorder.apply(x, dim, order, inverse)


class _Reorder(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, order: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
        ctx.dim = dim
        ctx.save_for_backward(inverse)
        return x.index_select(dim, order)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        inverse, = ctx.saved_tensors
        return grad.index_select(ctx.dim, inverse), None, None, None
