"""Top-k softmax router (Megatron / Switch semantics): expert choice, routing weights, auxiliary losses, capacity.

Everything here is computed on the tokens of one rank: the load-balancing loss, the z-loss and the capacity
are per local batch, as in Megatron's router (which routes before the dispatch all-to-all).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class Routing:
    """The router's decision for T tokens and k experts per token."""

    expert_ids: torch.Tensor  # [T, k] int64, global expert index of each assignment, best first
    weights: torch.Tensor  # [T, k] routing weight of each assignment (fp32 or wider); 0 where dropped
    kept: torch.Tensor  # [T, k] bool, False for assignments dropped by the capacity
    aux_loss: torch.Tensor  # scalar, load-balancing loss num_experts * sum_e f_e * P_e
    z_loss: torch.Tensor  # scalar, mean over tokens of logsumexp(logits)^2
    tokens_per_expert: torch.Tensor  # [num_experts] int64, kept assignments per expert
    capacity: int | None  # assignments an expert keeps, None when dropless


def expert_capacity(num_tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """Megatron's capacity: the balanced share of assignments per expert, scaled by the capacity factor."""
    return math.ceil(num_tokens * top_k / num_experts * capacity_factor)


def route(logits: torch.Tensor, top_k: int, renormalize: bool = True,
          capacity_factor: float | None = None) -> Routing:
    """Route tokens given their router logits [T, num_experts]."""
    num_tokens, num_experts = logits.shape
    # Softmax, log-sum-exp and the losses in fp32 at least: bf16 logits would make near-equal probabilities tie.
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    probs = torch.softmax(logits, dim=-1)
    weights, expert_ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)

    flat = expert_ids.reshape(-1)  # token order: token t's k assignments are t*k .. t*k+k-1
    wanted_per_expert = count_per_expert(flat, num_experts)

    # Load balancing: f_e is the fraction of assignments (before dropping: what the router asked for) that went
    # to e and carries no gradient; P_e is the mean router probability of e. max(., 1) makes a rank without
    # tokens contribute 0 instead of NaN.
    f = wanted_per_expert.to(probs.dtype) / max(num_tokens * top_k, 1)
    p = probs.sum(dim=0) / max(num_tokens, 1)
    aux_loss = num_experts * (f * p).sum()
    z_loss = torch.logsumexp(logits, dim=-1).square().sum() / max(num_tokens, 1)

    capacity = None
    kept = torch.ones_like(expert_ids, dtype=torch.bool)
    tokens_per_expert = wanted_per_expert
    if capacity_factor is not None:
        capacity = expert_capacity(num_tokens, top_k, num_experts, capacity_factor)
        # Position of each assignment among its expert's assignments, in token order (a stable sort lines them
        # up expert by expert): the first `capacity` stay.
        keys, order = torch.sort(flat, stable=True)
        first = torch.cumsum(wanted_per_expert, 0) - wanted_per_expert
        position = torch.empty_like(flat)
        position[order] = torch.arange(flat.numel(), device=flat.device) - first[keys]
        kept = (position < capacity).view(num_tokens, top_k)
        weights = weights * kept
        tokens_per_expert = wanted_per_expert.clamp(max=capacity)
    return Routing(expert_ids, weights, kept, aux_loss, z_loss, tokens_per_expert, capacity)


def count_per_expert(ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """int64 [num_experts]: how often each index in [0, num_experts) occurs in the 1-d `ids`. A scatter-add of
    ones (exact in integers, so deterministic): torch.bincount on CUDA reads the ids' min and max back to the host,
    two syncs."""
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device)
    return counts.scatter_add_(0, ids, torch.ones_like(ids))


class TopKRouter(nn.Module):
    """logits = x @ weight ([d_model, num_experts]), then `route`. The weight is replicated on every rank."""

    def __init__(self, d_model: int, num_experts: int, top_k: int, renormalize: bool = True,
                 capacity_factor: float | None = None, seed: int = 0, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None):
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be in [1, num_experts={num_experts}], got {top_k}")
        self.num_experts = num_experts
        self.top_k = top_k
        self.renormalize = renormalize
        self.capacity_factor = capacity_factor
        generator = torch.Generator().manual_seed(seed)
        weight = torch.randn(d_model, num_experts, generator=generator, dtype=torch.float64) / math.sqrt(d_model)
        self.weight = nn.Parameter(weight.to(dtype=dtype, device=device))

    def forward(self, x: torch.Tensor, logit_bias: torch.Tensor | None = None) -> Routing:
        """x: [T, d_model]. `logit_bias` ([num_experts], added to the logits) lets tests force a routing (skewed,
        an expert or a rank left without tokens) while every rank still computes the same function."""
        logits = x @ self.weight
        if logit_bias is not None:
            logits = logits + logit_bias
        return route(logits, self.top_k, self.renormalize, self.capacity_factor)
