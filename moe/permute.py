"""Token permutation: group the (token, expert) assignments so that each expert's rows are contiguous, and back.

Assignment a = t * k + j is token t's j-th choice. Pure torch indexing, so autograd goes through both ways.
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
    """x [T, d], expert_ids [T, k] -> (rows [A, d] grouped by expert, Permutation); A = kept assignments."""
    top_k = expert_ids.shape[1]
    flat = expert_ids.reshape(-1)
    if kept is not None:
        # Dropped assignments sort after every expert (key num_experts) and are cut off.
        flat = torch.where(kept.reshape(-1), flat, num_experts)
    # Stable, so that within an expert the rows keep token order.
    keys, order = torch.sort(flat, stable=True)
    tokens_per_expert = count_per_expert(keys, num_experts + 1)[:num_experts]
    num_rows = int(tokens_per_expert.sum())  # the one host sync: the rows' count sizes them
    order = order[:num_rows]
    inverse = torch.full_like(flat, num_rows)
    inverse[order] = torch.arange(num_rows, device=flat.device)
    offsets = torch.zeros(num_experts + 1, dtype=torch.int64, device=flat.device)
    offsets[1:] = tokens_per_expert.cumsum(0)
    rows = x[order // top_k]
    return rows, Permutation(order, inverse, tokens_per_expert, offsets, top_k)


def unpermute(rows: torch.Tensor, perm: Permutation, weights: torch.Tensor) -> torch.Tensor:
    """rows [A, d] in permuted order -> [T, d]: sum over each token's k assignments of weight * row.

    A gather, then one batched [1, k] x [k, d] product per token (not a scatter-add): the sum order is fixed,
    deterministic on GPUs too. Dropped assignments (inverse = A) read a clamped row that is then zeroed: they add
    exactly 0, whatever that row holds (inf, NaN).
    """
    num_rows, d = rows.shape
    if num_rows == perm.inverse.numel():  # dropless: every assignment has its row
        gathered = rows[perm.inverse]
    else:
        dropped = perm.inverse == num_rows
        if num_rows == 0:  # every assignment dropped: one zero row to read (a copy of nothing; keeps the graph)
            rows = torch.cat([rows, rows.new_zeros(1, d)])
        gathered = rows[perm.inverse.clamp(max=rows.shape[0] - 1)].masked_fill_(dropped[:, None], 0)
    products = torch.bmm(weights.to(rows.dtype).reshape(-1, 1, perm.top_k), gathered.view(-1, perm.top_k, d))
    return products.view(-1, d)
