"""Token permutation: group the (token, expert) assignments so that each expert's rows are contiguous, and back.

Assignment a = t * k + j is token t's j-th choice. Both directions are autograd Functions whose backward is the
other direction's gather: autograd of plain indexing (x[idx]) would run index_put_ with accumulate=True, torch's
sort-based `indexing_backward_kernel`, on the [A, d] gradients. Gathers need no sort and no atomics, and sum each
token's k rows in a fixed order: deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe.routing import count_per_expert


@dataclass
class Permutation:
    order: torch.Tensor  # [A] assignment index of each permuted row: by expert, token order within an expert
    inverse: torch.Tensor  # [T * k] permuted row of each assignment; A (one past the last row) where dropped
    tokens_per_expert: torch.Tensor  # [num_experts] int64, rows of each expert
    offsets: torch.Tensor  # [num_experts + 1] int64, expert e's rows are offsets[e] : offsets[e + 1]
    top_k: int


def permute(x: torch.Tensor, expert_ids: torch.Tensor, num_experts: int,
            kept: torch.Tensor | None = None) -> tuple[torch.Tensor, Permutation]:
    """x [T, d], expert_ids [T, k] -> (rows [A, d] grouped by expert, Permutation); A = kept assignments.
    kept None: every assignment is kept (dropless routing; no host sync)."""
    top_k = expert_ids.shape[1]
    flat = expert_ids.reshape(-1)
    if kept is not None:
        # Dropped assignments sort after every expert (key num_experts) and are cut off.
        flat = torch.where(kept.reshape(-1), flat, num_experts)
    # Stable, so that within an expert the rows keep token order.
    keys, order = torch.sort(flat, stable=True)
    tokens_per_expert = count_per_expert(keys, num_experts + 1)[:num_experts]
    # Without drops every assignment is a row; with them, the one host sync: the rows' count sizes them.
    num_rows = flat.numel() if kept is None else int(tokens_per_expert.sum())
    order = order[:num_rows]
    inverse = torch.full_like(flat, num_rows)
    inverse[order] = torch.arange(num_rows, device=flat.device)
    offsets = torch.zeros(num_experts + 1, dtype=torch.int64, device=flat.device)
    offsets[1:] = tokens_per_expert.cumsum(0)
    perm = Permutation(order, inverse, tokens_per_expert, offsets, top_k)
    return _Permute.apply(x, perm), perm


def unpermute(rows: torch.Tensor, perm: Permutation, weights: torch.Tensor) -> torch.Tensor:
    """rows [A, d] in permuted order -> [T, d]: sum over each token's k assignments of weight * row (weights [T, k]
    cast to the rows' dtype; their gradient comes back in their own dtype).

    A gather, then one batched [1, k] x [k, d] product per token (not a scatter-add): the sum order is fixed,
    deterministic on GPUs too. Dropped assignments add exactly 0, whatever the rows hold (inf, NaN).
    """
    return _Unpermute.apply(rows, weights, perm)


def reorder_rows(x: torch.Tensor, order: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """x[order] for a permutation `order` of x's rows (inverse: its inverse), whose backward is the gather
    grad[inverse] rather than the sort-based accumulate of x[order]'s."""
    return _ReorderRows.apply(x, order, inverse)


class _ReorderRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, order: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        return x.index_select(0, order)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        inverse, = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


def _gather(rows: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """[T * k, d]: rows[inverse], exact zeros for the dropped assignments (inverse = A). They read a clamped row
    that is then zeroed, so a NaN or inf there does not leak."""
    num_rows, d = rows.shape
    if num_rows == inverse.numel():  # dropless: every assignment has its row
        return rows.index_select(0, inverse)
    if num_rows == 0:  # every assignment dropped
        return rows.new_zeros(inverse.numel(), d)
    dropped = inverse == num_rows
    return rows.index_select(0, inverse.clamp(max=num_rows - 1)).masked_fill_(dropped[:, None], 0)


class _Permute(torch.autograd.Function):
    """rows[a] = x[order[a] // k]. Backward: grad_x[t] = sum over t's kept assignments of grad_rows (a gather by
    the inverse, summed over k), instead of the sort-based index_put_ accumulate of x[idx]'s backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, perm: Permutation) -> torch.Tensor:
        ctx.perm, ctx.num_tokens = perm, x.shape[0]
        return x.index_select(0, perm.order // perm.top_k)

    @staticmethod
    def backward(ctx, grad_rows: torch.Tensor):
        perm = ctx.perm
        return _gather(grad_rows, perm.inverse).view(ctx.num_tokens, perm.top_k, grad_rows.shape[1]).sum(dim=1), None


class _Unpermute(torch.autograd.Function):
    """y[t] = sum_j w[t, j] * rows[inverse[t * k + j]]. Backward: grad_rows[a] = w[order[a]] * grad_y[order[a] // k]
    (a gather by the order: each row is one assignment's, no accumulation) and grad_w[t, j] = <grad_y[t],
    rows[inverse[t * k + j]]> (0 where dropped), from the rows gathered again: the forward's [T * k, d] gather is
    not kept."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, weights: torch.Tensor, perm: Permutation) -> torch.Tensor:
        ctx.perm = perm
        ctx.save_for_backward(rows, weights)
        num_tokens, d = weights.shape[0], rows.shape[1]
        gathered = _gather(rows, perm.inverse).view(num_tokens, perm.top_k, d)
        return torch.bmm(weights.to(rows.dtype).reshape(num_tokens, 1, perm.top_k), gathered).view(num_tokens, d)

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):
        rows, weights = ctx.saved_tensors
        perm = ctx.perm
        grad_rows = grad_weights = None
        if ctx.needs_input_grad[0]:
            row_weights = weights.to(rows.dtype).reshape(-1).index_select(0, perm.order)
            grad_rows = grad_y.index_select(0, perm.order // perm.top_k) * row_weights[:, None]
        if ctx.needs_input_grad[1]:
            grad_weights = routing_weights_grad(_gather(rows, perm.inverse), grad_y, weights)
        return grad_rows, grad_weights, None


def routing_weights_grad(assignment_rows: torch.Tensor, grad_y: torch.Tensor,
                         weights: torch.Tensor) -> torch.Tensor:
    """The gradient of y[t] = sum_j weights[t, j] * row(t, j) with respect to the weights [T, k]:
    <grad_y[t], row(t, j)>, from the rows in assignment order ([T * k, d], token t's j-th at t * k + j; zeros for
    a dropped assignment), one batched [k, d] x [d, 1] product per token in the rows' dtype, cast to the weights'.
    The bulk and the fused layer both take it from here: the same arithmetic."""
    num_tokens, top_k = weights.shape
    per_token = assignment_rows.view(num_tokens, top_k, assignment_rows.shape[1])
    return torch.bmm(per_token, grad_y.to(assignment_rows.dtype).unsqueeze(2)).view_as(weights).to(weights.dtype)
