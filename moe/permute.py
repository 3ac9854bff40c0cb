"""Token permutation: group the (token, expert) assignments so that each expert's rows are contiguous, and back.

Assignment a = t * k + j is token t's j-th choice. Both directions are autograd Functions whose backward is the
other direction's gather: autograd of plain indexing (x[idx]) would run index_put_ with accumulate=True, torch's
sort-based `indexing_backward_kernel`, on the [A, d] gradients. Gathers need no sort and no atomics, and sum each
token's k rows in a fixed order: deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl


@dataclass
class Permutation:
    order: torch.Tensor  # [A] assignment index of each permuted row: by expert, token order within an expert
    inverse: torch.Tensor  # [T * k] permuted row of each assignment; A (one past the last row) where dropped
    tokens_per_expert: torch.Tensor  # [num_experts] int64, rows of each expert
    offsets: torch.Tensor  # [num_experts + 1] int64, expert e's rows are offsets[e] : offsets[e + 1]
    top_k: int
    token_of_row: torch.Tensor | None = None  # [A] int64: the token of each row (order // top_k where not given)
    row_weights: torch.Tensor | None = None  # [A] fp32: each row's routing weight, where `permutation` had them

    def __post_init__(self):
        if self.token_of_row is None:
            self.token_of_row = self.order // self.top_k


def permute(x: torch.Tensor, expert_ids: torch.Tensor, num_experts: int, kept: torch.Tensor | None = None,
            block_counts: torch.Tensor | None = None) -> tuple[torch.Tensor, Permutation]:
    """x [T, d], expert_ids [T, k] -> (rows [A, d] grouped by expert, Permutation); A = kept assignments.
    block_counts: as for `permutation`."""
    perm = permutation(expert_ids, num_experts, kept, block_counts=block_counts)
    return _Permute.apply(x, perm), perm


def permutation(expert_ids: torch.Tensor, num_experts: int, kept: torch.Tensor | None = None,
                weights: torch.Tensor | None = None, block_counts: torch.Tensor | None = None) -> Permutation:
    """expert_ids [T, k] -> the Permutation that groups the kept assignments by expert (the fused layer moves the
    rows itself). kept None: every assignment is kept (dropless routing; no host sync). weights [T, k] (the
    routing weights), if given: the rows' weights in fp32 (Permutation.row_weights), gathered by the same kernel.
    block_counts: every assignment's counts per block of tokens, if the router made them (Routing.block_counts:
    the CUDA kernels' first pass); dropless only (they count no drops)."""
    if kept is not None and block_counts is not None:
        raise ValueError("block_counts count every assignment: they cannot order a routing that drops some (kept)")
    top_k = expert_ids.shape[1]
    keys = expert_ids.reshape(-1)
    if kept is not None:
        # Dropped assignments sort after every expert (key num_experts) and are cut off.
        keys = torch.where(kept.reshape(-1), keys, num_experts)
    flat_weights = None if weights is None else weights.reshape(-1)
    order, inverse, tokens_per_expert, offsets, token_of_row, row_weights = expert_order(
        keys, num_experts, top_k, flat_weights, block_counts)
    # Without drops every assignment is a row; with them, the one host sync: the rows' count sizes them.
    num_rows = keys.numel() if kept is None else int(offsets[-1])
    return Permutation(order[:num_rows], inverse, tokens_per_expert, offsets, top_k, token_of_row[:num_rows],
                       None if row_weights is None else row_weights[:num_rows])


class ExpertOrder(NamedTuple):
    """`expert_order`'s result: int64 but for row_weights; [T * k] of rows, of which only the first A (the kept
    assignments) are meaningful, where not said otherwise."""

    order: torch.Tensor  # the assignment of each row: grouped by expert, in assignment order within one
    inverse: torch.Tensor  # [T * k] each assignment's row, A where dropped
    tokens_per_expert: torch.Tensor  # [E]
    offsets: torch.Tensor  # [E + 1]
    token_of_row: torch.Tensor  # order // top_k
    row_weights: torch.Tensor | None  # fp32: the given weights [T * k] by row (None without them)


def expert_order(keys: torch.Tensor, num_experts: int, top_k: int, weights: torch.Tensor | None = None,
                 block_counts: torch.Tensor | None = None) -> ExpertOrder:
    """keys [T * k]: each assignment's expert, num_experts where dropped (weights [T * k]: theirs, optional) ->
    the rows grouped by expert, without a host sync. CUDA: two kernels (`expert_order_kernels`; torch's stable
    sort alone is ~16 launches), one where the keys' block counts are given; elsewhere the torch reference."""
    if keys.is_cuda and keys.numel():
        return expert_order_kernels(keys, num_experts, top_k, weights, block_counts)
    order, inverse, tokens_per_expert, offsets = expert_order_reference(keys, num_experts)
    row_weights = None if weights is None else weights.float()[order]
    return ExpertOrder(order, inverse, tokens_per_expert, offsets, order // top_k, row_weights)


def count_per_expert(ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """int64 [num_experts]: how often each index in [0, num_experts) occurs in the 1-d `ids`. A scatter-add of
    ones (exact in integers, so deterministic): torch.bincount on CUDA reads the ids' min and max back to the host,
    two syncs."""
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device)
    return counts.scatter_add_(0, ids, torch.ones_like(ids))


def tokens_per_program(num_experts: int) -> int:
    """Tokens per program of the permutation's and the router's kernels: [tokens, experts] tiles of up to 4096
    values."""
    return max(16, min(128, 4096 // triton.next_power_of_2(num_experts)))


def expert_order_reference(keys: torch.Tensor, num_experts: int
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    sorted_keys, order = torch.sort(keys, stable=True)  # stable: token order within an expert
    tokens_per_expert = count_per_expert(sorted_keys, num_experts + 1)[:num_experts]
    offsets = torch.zeros(num_experts + 1, dtype=torch.int64, device=keys.device)
    offsets[1:] = tokens_per_expert.cumsum(0)
    inverse = torch.empty_like(keys)
    inverse[order] = torch.arange(keys.numel(), device=keys.device)
    return order, torch.minimum(inverse, offsets[-1]), tokens_per_expert, offsets


@triton.jit(do_not_specialize=["num_tokens"])
def _expert_block_counts_kernel(keys_ptr, block_counts_ptr, num_tokens, E: tl.constexpr, E_P2: tl.constexpr,
                                TOP_K: tl.constexpr, BLOCK_T: tl.constexpr):
    """block_counts[b, e]: assignments to expert e among the tokens of block b."""
    pid = tl.program_id(0)
    t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    e = tl.arange(0, E_P2)
    counts = tl.zeros((E_P2,), tl.int32)
    for i in tl.static_range(TOP_K):
        key = tl.load(keys_ptr + t * TOP_K + i, mask=t < num_tokens, other=E)
        counts += tl.sum((key[:, None] == e[None, :]).to(tl.int32), axis=0)
    tl.store(block_counts_ptr + pid * E + e, counts, mask=e < E)


@triton.jit(do_not_specialize=["num_tokens", "num_blocks"])
def _expert_order_kernel(keys_ptr, block_counts_ptr, order_ptr, inverse_ptr, tokens_per_expert_ptr, offsets_ptr,
                         token_of_row_ptr, weights_ptr, row_weights_ptr, num_tokens, num_blocks, E: tl.constexpr,
                         E_P2: tl.constexpr, TOP_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCKS_P2: tl.constexpr,
                         CHUNK: tl.constexpr, WEIGHTS: tl.constexpr):
    """A counting sort: the row of assignment (t, i) to expert e is e's first row, plus e's assignments in
    earlier blocks (every program sums the block counts itself), in earlier tokens of this block, and earlier in
    this token (a repeated expert). Each row's token too, and with WEIGHTS its weight (fp32): two gathers by the
    order fewer."""
    pid = tl.program_id(0)
    e = tl.arange(0, E_P2)
    expert = e < E
    total = tl.zeros((E_P2,), tl.int32)
    before = tl.zeros((E_P2,), tl.int32)
    for b0 in range(0, BLOCKS_P2, CHUNK):
        b = b0 + tl.arange(0, CHUNK)
        c = tl.load(block_counts_ptr + b[:, None] * E + e[None, :], mask=(b < num_blocks)[:, None] & expert[None, :],
                    other=0)
        total += tl.sum(c, axis=0)
        before += tl.sum(tl.where((b < pid)[:, None], c, 0), axis=0)
    first = tl.cumsum(total, axis=0) - total
    num_rows = tl.sum(total, axis=0)
    if pid == 0:
        tl.store(tokens_per_expert_ptr + e, total.to(tl.int64), mask=expert)
        tl.store(offsets_ptr + e, first.to(tl.int64), mask=expert)
        tl.store(offsets_ptr + E, num_rows.to(tl.int64))
    t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    token = t < num_tokens
    per_token = tl.zeros((BLOCK_T, E_P2), tl.int32)
    for i in tl.static_range(TOP_K):
        key = tl.load(keys_ptr + t * TOP_K + i, mask=token, other=E)
        per_token += (key[:, None] == e[None, :]).to(tl.int32)
    row_of = (first + before)[None, :] + tl.cumsum(per_token, axis=0) - per_token  # [token, expert]: next row
    for i in tl.static_range(TOP_K):
        key = tl.load(keys_ptr + t * TOP_K + i, mask=token, other=E)
        hit = key[:, None] == e[None, :]
        row = tl.sum(tl.where(hit, row_of, 0), axis=1)
        row_of += hit.to(tl.int32)
        kept = key < E
        a = t * TOP_K + i
        tl.store(order_ptr + row, a.to(tl.int64), mask=token & kept)
        tl.store(inverse_ptr + a, tl.where(kept, row, num_rows).to(tl.int64), mask=token)
        tl.store(token_of_row_ptr + row, t.to(tl.int64), mask=token & kept)
        if WEIGHTS:
            weight = tl.load(weights_ptr + a, mask=token & kept, other=0.0).to(tl.float32)
            tl.store(row_weights_ptr + row, weight, mask=token & kept)


def expert_order_kernels(keys: torch.Tensor, num_experts: int, top_k: int, weights: torch.Tensor | None = None,
                         block_counts: torch.Tensor | None = None) -> ExpertOrder:
    """`expert_order` through its two kernels (also on the CPU, in Triton's interpreter); keys not empty.
    block_counts ([blocks of tokens_per_program(num_experts) tokens, num_experts] int32), if given, are the
    first kernel's result."""
    num_tokens = keys.numel() // top_k
    block = tokens_per_program(num_experts)
    blocks = triton.cdiv(num_tokens, block)
    e_p2, blocks_p2 = triton.next_power_of_2(num_experts), triton.next_power_of_2(blocks)
    order, inverse, token_of_row = torch.empty_like(keys), torch.empty_like(keys), torch.empty_like(keys)
    row_weights = None if weights is None else torch.empty(keys.numel(), dtype=torch.float32, device=keys.device)
    tokens_per_expert = torch.empty(num_experts, dtype=torch.int64, device=keys.device)
    offsets = torch.empty(num_experts + 1, dtype=torch.int64, device=keys.device)
    warps = 4 if keys.is_cuda else 1
    keys = keys.contiguous()
    if block_counts is None:
        block_counts = torch.empty(blocks, num_experts, dtype=torch.int32, device=keys.device)
        _expert_block_counts_kernel[(blocks,)](keys, block_counts, num_tokens, E=num_experts, E_P2=e_p2,
                                               TOP_K=top_k, BLOCK_T=block, num_warps=warps)
    elif block_counts.shape != (blocks, num_experts) or block_counts.dtype != torch.int32:
        raise ValueError(f"block_counts must be int32 [{blocks}, {num_experts}] (blocks of {block} tokens), got "
                         f"{list(block_counts.shape)} {block_counts.dtype}")
    gathered = (order, order) if weights is None else (weights.contiguous(), row_weights)  # (unused: any tensor)
    _expert_order_kernel[(blocks,)](
        keys, block_counts, order, inverse, tokens_per_expert, offsets, token_of_row, *gathered, num_tokens, blocks,
        E=num_experts, E_P2=e_p2, TOP_K=top_k, BLOCK_T=block, BLOCKS_P2=blocks_p2,
        CHUNK=max(1, min(blocks_p2, 4096 // e_p2)), WEIGHTS=weights is not None, num_warps=warps)
    return ExpertOrder(order, inverse, tokens_per_expert, offsets, token_of_row, row_weights)


def unpermute(rows: torch.Tensor, perm: Permutation, weights: torch.Tensor) -> torch.Tensor:
    """rows [A, d] in permuted order -> [T, d]: sum over each token's k assignments of weight * row (weights [T, k]
    cast to the rows' dtype; their gradient comes back in their own dtype).

    A gather, then one batched [1, k] x [k, d] product per token (not a scatter-add): the sum order is fixed,
    deterministic on GPUs too. Dropped assignments add exactly 0, whatever the rows hold (inf, NaN).
    """
    return _Unpermute.apply(rows, weights, perm)


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
        return x.index_select(0, perm.token_of_row)

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
            grad_rows = grad_y.index_select(0, perm.token_of_row) * row_weights[:, None]
        if ctx.needs_input_grad[1]:
            grad_weights = routing_weights_grad(_gather(rows, perm.inverse), grad_y, weights)
        return grad_rows, grad_weights, None


def routing_weights_grad(assignment_rows: torch.Tensor, grad_y: torch.Tensor,
                         weights: torch.Tensor) -> torch.Tensor:
    """The gradient of y[t] = sum_j weights[t, j] * row(t, j) with respect to the weights [T, k]:
    <grad_y[t], row(t, j)>, from the rows in assignment order ([T * k, d], token t's j-th at t * k + j; zeros for
    a dropped assignment), one batched [k, d] x [d, 1] product per token in the rows' dtype, cast to the weights'.
    The bulk layer and the fused one combining by row take it from here: the same arithmetic (combining by token,
    the owner's backward GEMM computes it in fp32 from the rows it kept: moe.kernels.fused_combine)."""
    num_tokens, top_k = weights.shape
    per_token = assignment_rows.view(num_tokens, top_k, assignment_rows.shape[1])
    return torch.bmm(per_token, grad_y.to(assignment_rows.dtype).unsqueeze(2)).view_as(weights).to(weights.dtype)
