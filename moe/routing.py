"""Top-k softmax router (Megatron / Switch semantics): expert choice, routing weights, auxiliary losses, capacity.

Everything here is computed on the tokens of one rank: the load-balancing loss, the z-loss and the capacity
are per local batch, as in Megatron's router (which routes before the dispatch all-to-all). One exception, as in
Megatron under sequence parallelism: given a `statistics_group` (the ranks that share one batch slice between
them), the load-balancing loss counts the expert choices of the whole group (an all-reduce of the counts, on the
device), so that cutting a slice over ranks leaves the objective and its gradient as they were.

Megatron-Core's TopKRouter (softmax scores, load-balancing type "aux_loss") computes the same weights, losses and
gradients (tests/test_moe_routing.py, test_route_is_megatrons_router: against its definitions in float64), but
for these deliberate differences:
- top-1 weighs its expert by the softmax probability (Megatron's --moe-router-pre-softmax) unless told otherwise:
  Megatron's default, softmax after top-k, weighs it 1 (`renormalizes`). For k > 1 the default is Megatron's: the
  chosen probabilities renormalised, which is its softmax over the k logits (renormalize=False: pre-softmax).
- A capacity keeps, unpadded (without --moe-pad-expert-input-to-capacity), each expert's `capacity` assignments
  chosen by the drop policy, Megatron's --moe-token-drop-policy: "probs" (its default) the most probable, by their
  routing weight, "position" the first in the order of the rank's tokens. Ties go to the earlier token (Megatron
  leaves them to torch.topk, which for "position" is every choice among the expert's assignments). The order is
  the caller's: the MoE Transformer's rows are [batch, seq], so under "position" a rank's later samples drop
  first, where Megatron's [seq, batch] rows drop the later positions. As in Megatron a dropped assignment weighs
  0, the token's others keep their weights, and the load-balancing counts are those before the drops.
- With a statistics_group of n ranks each rank's load-balancing loss is n times Megatron's (whose ranks' losses
  sum to the slice's, their router gradients summed over the group) and its z-loss the mean over its own tokens
  (Megatron divides its coefficient by n): here the mean over the group's ranks is the slice's loss, as
  moe.train averages every rank's share. The gradients are the same.
- A rank without tokens has losses 0 (Megatron: 0 / 0); the routing weights are fp32 (float64 logits: float64)
  whatever the logits' dtype, where Megatron casts them to it; the experts are chosen by logit, ties to the lower
  expert and a NaN first (torch.topk leaves both open); the losses are computed without grad too (Megatron skips
  them there).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist
import triton
import triton.language as tl
from torch import nn

from fused_dlrm.config_checks import is_finite_at_least_zero
from fused_dlrm.kernels import TL_DTYPES
from moe.permute import count_per_expert, expert_order, tokens_per_program


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
    # [blocks, num_experts] int32: the assignments to each expert per block of `tokens_per_program` tokens, which
    # the router's kernel counts on the way (the permutation's first pass: `permutation(block_counts=...)`); None
    # from the torch reference and when a capacity dropped assignments
    block_counts: torch.Tensor | None = None


def expert_capacity(num_tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """Megatron's capacity: the balanced share of assignments per expert, scaled by the capacity factor."""
    return math.ceil(num_tokens * top_k / num_experts * capacity_factor)


def renormalizes(top_k: int, renormalize: bool | None) -> bool:
    """Whether the chosen experts' weights are renormalised to sum to 1. None: where top_k > 1 (Megatron's default,
    softmax after top-k); top-1 weighs by the softmax probability (Switch; Megatron's --moe-router-pre-softmax):
    renormalised, every weight would be 1 and the model's loss would send the router no gradient (Megatron-LM
    issue 894), so top_k=1 with renormalize=True is refused."""
    if top_k == 1 and renormalize:
        raise ValueError("top_k=1 with renormalize=True weighs every token's expert 1: the router would learn from "
                         "the auxiliary losses alone; use renormalize=False (the softmax probability)")
    return top_k > 1 if renormalize is None else renormalize


def check_top_k(top_k: int, num_experts: int, prefix: str = "") -> None:
    """k distinct experts per token: k in [1, num_experts]. Past num_experts the torch path would return fewer
    than k per token (the losses scaled by the k asked) and the kernels would pick expert 0 again; k = 0 routes
    nothing (a layer silently off). prefix: the settings' config group in the error (moe/train.py: "model.")."""
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"{prefix}top_k must be in [1, {prefix}num_experts={num_experts}], got {top_k}")


DROP_POLICIES = ("probs", "position")  # Megatron's --moe-token-drop-policy values (the module docstring)


def check_drop_policy(drop_policy: str, prefix: str = "") -> None:
    if drop_policy not in DROP_POLICIES:
        raise ValueError(f"{prefix}drop_policy must be one of {DROP_POLICIES}, got {drop_policy!r}")


def check_capacity_factor(capacity_factor: float | None, zero_allowed: bool = True, prefix: str = "") -> None:
    """None (dropless) or a finite number >= 0. A negative factor made the kept counts negative, inf and NaN failed
    in math.ceil naming no setting, and True (YAML's true) routed at 1. 0 keeps nothing: route's defined edge;
    TopKRouter refuses it (zero_allowed=False): a layer silently off, while the load-balancing loss still pulls on
    its router. prefix: as check_top_k's."""
    if capacity_factor is None:
        return
    if not (is_finite_at_least_zero(capacity_factor) and (zero_allowed or capacity_factor)):
        raise ValueError(f"{prefix}capacity_factor must be {'>= 0' if zero_allowed else '> 0'} and finite (None: "
                         f"dropless), got {capacity_factor}")


def route(logits: torch.Tensor, top_k: int, renormalize: bool | None = None,
          capacity_factor: float | None = None, statistics_group: dist.ProcessGroup | None = None,
          drop_policy: str = "probs") -> Routing:
    """Route tokens given their router logits [T, num_experts] (top_k: `check_top_k`; renormalize: `renormalizes`;
    capacity_factor: `check_capacity_factor`; drop_policy: which assignments a capacity keeps, the module
    docstring; statistics_group: see the module docstring)."""
    num_tokens, num_experts = logits.shape
    check_top_k(top_k, num_experts)
    check_capacity_factor(capacity_factor)
    check_drop_policy(drop_policy)
    choice = top_k_softmax(logits, top_k, renormalizes(top_k, renormalize), statistics_group)
    expert_ids, weights, wanted_per_expert = choice.expert_ids, choice.weights, choice.tokens_per_expert
    capacity = None
    kept = torch.ones_like(expert_ids, dtype=torch.bool)
    tokens_per_expert = wanted_per_expert
    if capacity_factor is not None:
        capacity = expert_capacity(num_tokens, top_k, num_experts, capacity_factor)
        kept = (rank_in_expert(expert_ids, weights, num_experts, drop_policy) < capacity).view(num_tokens, top_k)
        weights = weights * kept
        tokens_per_expert = wanted_per_expert.clamp(max=capacity)
    block_counts = choice.block_counts if capacity is None else None
    return Routing(expert_ids, weights, kept, choice.aux_loss, choice.z_loss, tokens_per_expert, capacity,
                   block_counts)


def rank_in_expert(expert_ids: torch.Tensor, weights: torch.Tensor, num_experts: int, drop_policy: str
                   ) -> torch.Tensor:
    """[T * k]: each assignment's place among its expert's assignments, best first by the drop policy ("position":
    token order; "probs": weight, descending, ties in token order). A stable sort by expert of the assignments in
    that order (token order: token t's k assignments are t*k .. t*k+k-1); the place is the sorted index minus the
    expert's first. No host sync."""
    flat = expert_ids.reshape(-1)
    if drop_policy == "position":
        order = torch.arange(flat.numel(), device=flat.device)
    else:
        order = torch.sort(weights.reshape(-1), descending=True, stable=True).indices
    ordered = expert_order(flat[order], num_experts, expert_ids.shape[1])
    rank = torch.empty_like(flat)
    rank[order] = ordered.inverse - ordered.offsets[flat[order]]
    return rank


class TopKSoftmax(NamedTuple):
    """The router's choice before any capacity: per token its k best experts and their weights; the counts and
    the two losses, which need the whole softmax."""

    weights: torch.Tensor  # [T, k] softmax probabilities of the chosen experts (renormalised if asked), fp32+
    expert_ids: torch.Tensor  # [T, k] int64, best first
    tokens_per_expert: torch.Tensor  # [num_experts] int64, assignments per expert
    aux_loss: torch.Tensor  # scalar: load balancing, num_experts * sum_e f_e * P_e (see `loss_scales`)
    z_loss: torch.Tensor  # scalar: mean over tokens of logsumexp(logits)^2
    block_counts: torch.Tensor | None = None  # [blocks, num_experts] int32 (the kernels'; see Routing)


def loss_scales(num_tokens: int, top_k: int, num_experts: int) -> tuple[float, float]:
    """(aux, z) such that aux_loss = aux * sum_e count_e * prob_sum_e and z_loss = z * sum_t lse_t^2.

    Load balancing: num_experts * sum_e f_e * P_e, where f_e is the fraction of assignments (before dropping:
    what the router asked for) that went to e and carries no gradient, P_e the mean router probability of e.
    max(., 1) makes a rank without tokens contribute 0 instead of NaN."""
    return num_experts / (max(num_tokens * top_k, 1) * max(num_tokens, 1)), 1 / max(num_tokens, 1)


def group_balance(counts: torch.Tensor, num_tokens: int, top_k: int, group: dist.ProcessGroup
                  ) -> tuple[torch.Tensor, float]:
    """The load-balancing loss over a group of n ranks holding equal parts of one batch slice: (the counts summed
    over the group, the aux scale). Each rank's loss is n * scale(n * num_tokens) * <group counts, its own
    probability sums>: their mean over the group is the loss of the whole slice, and each rank's gradient that
    loss's with respect to its own tokens."""
    total = counts.clone()
    dist.all_reduce(total, group=group)
    n = dist.get_world_size(group)
    return total, n * loss_scales(n * num_tokens, top_k, counts.shape[0])[0]


def top_k_softmax(logits: torch.Tensor, top_k: int, renormalize: bool,
                  statistics_group: dist.ProcessGroup | None = None) -> TopKSoftmax:
    """Softmax of the logits (fp32 at least: bf16 logits would make near-equal probabilities tie), the top k per
    token, the per-expert counts and the loss terms, with autograd to the logits. CUDA: two kernels forward, one
    backward (`top_k_softmax_kernels`; torch's ops for the same are ~30 launches, logsumexp alone a dozen kernels,
    on the host's critical path of every MoE layer); elsewhere, and for float64 logits, the torch reference."""
    if logits.is_cuda and logits.dtype in (torch.float32, torch.float16, torch.bfloat16):
        return top_k_softmax_kernels(logits, top_k, renormalize, statistics_group)
    return top_k_softmax_reference(logits, top_k, renormalize, statistics_group)


def top_k_softmax_reference(logits: torch.Tensor, top_k: int, renormalize: bool,
                            statistics_group: dist.ProcessGroup | None = None) -> TopKSoftmax:
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    num_tokens, num_experts = logits.shape
    probs = torch.softmax(logits, dim=-1)
    # The kernel's order (`_top_k_softmax_kernel`): by logit, best first, NaN above every one, ties to the lower
    # index (torch.topk orders ties as it likes).
    ranking = torch.where(logits.isnan(), torch.inf, logits)
    expert_ids = torch.sort(ranking, dim=-1, descending=True, stable=True).indices[:, :top_k]
    weights = probs.gather(1, expert_ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    counts = count_per_expert(expert_ids.reshape(-1), num_experts)
    lse = torch.logsumexp(logits, dim=-1)
    aux_scale, z_scale = loss_scales(num_tokens, top_k, num_experts)
    aux_counts = counts
    if statistics_group is not None:
        aux_counts, aux_scale = group_balance(counts, num_tokens, top_k, statistics_group)
    aux_loss = torch.dot(aux_counts.to(probs.dtype), probs.sum(dim=0)) * aux_scale
    return TopKSoftmax(weights, expert_ids, counts, aux_loss, torch.dot(lse, lse) * z_scale)


@triton.jit(do_not_specialize=["num_tokens"])
def _top_k_softmax_kernel(logits_ptr, weights_ptr, ids_ptr, lse_ptr, block_counts_ptr, block_probs_ptr,
                          block_lse_squares_ptr, num_tokens, E: tl.constexpr, E_P2: tl.constexpr,
                          TOP_K: tl.constexpr, K_P2: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_T: tl.constexpr):
    """BLOCK_T tokens per program; per-block expert counts, probability sums and sums of lse^2 (summed over the
    blocks in a fixed order by `_router_totals_kernel`: deterministic, unlike float atomics)."""
    pid = tl.program_id(0)
    t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    e = tl.arange(0, E_P2)
    j = tl.arange(0, K_P2)
    token, expert = t < num_tokens, e < E
    z = tl.load(logits_ptr + t[:, None] * E + e[None, :], mask=token[:, None] & expert[None, :]).to(tl.float32)
    z = tl.where(expert[None, :], z, float("-inf"))
    z = tl.where(token[:, None], z, 0.0)  # rows past the end: any finite values (nothing of them is stored)
    most = tl.max(z, axis=1)
    p = tl.exp(z - most[:, None])
    total = tl.sum(p, axis=1)
    probs = p / total[:, None]
    # The ranking: by logit (the probabilities' order, without the ties their underflow makes: fp32 probabilities
    # of logits ~104 below a token's best (~88 where exp flushes subnormals) are all 0, and its next picks fell to
    # the lowest indices, the experts it ranks last), NaN above every logit, as torch sorts it, ties to the lowest
    # index, among the real experts not yet chosen. So a row's k picks are k distinct real experts whatever its
    # values: the fused layer's receive capacity counts on it (with k picks of one expert, a diverging run's NaN
    # rows overflowed it), and the loss is NaN as it should be (a NaN or infinite logit makes its row's
    # probabilities all NaN).
    key = tl.where(z == z, z, float("inf"))
    left = tl.broadcast_to(expert[None, :], (BLOCK_T, E_P2))  # the experts still to choose from
    top_w = tl.zeros((BLOCK_T, K_P2), tl.float32)
    top_e = tl.zeros((BLOCK_T, K_P2), tl.int32)
    for i in tl.static_range(TOP_K):
        best = tl.max(tl.where(left, key, float("-inf")), axis=1)
        pick = tl.min(tl.where(left & (key == best[:, None]), e[None, :], E_P2), axis=1)
        hit = e[None, :] == pick[:, None]
        top_w = tl.where(j[None, :] == i, tl.sum(tl.where(hit, probs, 0.0), axis=1)[:, None], top_w)
        top_e = tl.where(j[None, :] == i, pick[:, None], top_e)
        left &= ~hit
    chosen = (expert[None, :] & ~left).to(tl.int32)
    if RENORMALIZE:
        top_w = top_w / tl.sum(top_w, axis=1)[:, None]
    out = token[:, None] & (j[None, :] < TOP_K)
    tl.store(weights_ptr + t[:, None] * TOP_K + j[None, :], top_w, mask=out)
    tl.store(ids_ptr + t[:, None] * TOP_K + j[None, :], top_e.to(tl.int64), mask=out)
    lse = most + tl.log(total)
    tl.store(lse_ptr + t, lse, mask=token)
    tl.store(block_lse_squares_ptr + pid, tl.sum(tl.where(token, lse * lse, 0.0), axis=0))
    tl.store(block_counts_ptr + pid * E + e, tl.sum(tl.where(token[:, None], chosen, 0), axis=0), mask=expert)
    tl.store(block_probs_ptr + pid * E + e, tl.sum(tl.where(token[:, None], probs, 0.0), axis=0), mask=expert)


@triton.jit(do_not_specialize=["blocks"])
def _router_totals_kernel(block_counts_ptr, block_probs_ptr, block_lse_squares_ptr, counts_ptr, aux_ptr, z_ptr,
                          blocks, aux_scale, z_scale, E: tl.constexpr, E_P2: tl.constexpr, BLOCKS_P2: tl.constexpr,
                          CHUNK: tl.constexpr):
    """One program: the per-block counts, probability sums and lse^2 sums summed over the blocks, CHUNK blocks at
    a time (a fixed order: deterministic, unlike float atomics), then the losses: aux = aux_scale * <counts,
    prob sums>, z = z_scale * sum lse^2. The loop runs to BLOCKS_P2 (the interpreter cannot range() up to an
    argument)."""
    e = tl.arange(0, E_P2)
    counts = tl.zeros([E_P2], tl.int32)
    probs = tl.zeros([E_P2], tl.float32)
    squares = tl.zeros([CHUNK], tl.float32)
    for b0 in range(0, BLOCKS_P2, CHUNK):
        b = b0 + tl.arange(0, CHUNK)
        tile = (b < blocks)[:, None] & (e < E)[None, :]
        counts += tl.sum(tl.load(block_counts_ptr + b[:, None] * E + e[None, :], mask=tile, other=0), axis=0)
        probs += tl.sum(tl.load(block_probs_ptr + b[:, None] * E + e[None, :], mask=tile, other=0.0), axis=0)
        squares += tl.load(block_lse_squares_ptr + b, mask=b < blocks, other=0.0)
    tl.store(counts_ptr + e, counts.to(tl.int64), mask=e < E)
    tl.store(aux_ptr, tl.sum(counts.to(tl.float32) * probs, axis=0) * aux_scale)
    tl.store(z_ptr, tl.sum(squares, axis=0) * z_scale)


@triton.jit(do_not_specialize=["num_tokens"])
def _top_k_softmax_backward_kernel(logits_ptr, lse_ptr, ids_ptr, counts_ptr, grad_weights_ptr, grad_aux_ptr,
                                   grad_z_ptr, grad_logits_ptr, num_tokens, aux_scale, z_scale, E: tl.constexpr,
                                   E_P2: tl.constexpr, TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr,
                                   HAS_GRAD_WEIGHTS: tl.constexpr, HAS_GRAD_AUX: tl.constexpr,
                                   HAS_GRAD_Z: tl.constexpr, BLOCK_T: tl.constexpr, OUT_DTYPE: tl.constexpr):
    """d/dlogits of the weights and the two losses, the probabilities recomputed from the logits and the
    log-sum-exp: softmax'(z)^T g_p + p * g_lse, where g_p collects the weights' gradient at the chosen experts
    (through the renormalisation w = p / S: (g - <g, w>) / S) and the load-balancing loss's at every expert
    (g_aux * aux_scale * count_e), and g_lse = g_z * z_scale * 2 lse."""
    pid = tl.program_id(0)
    t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    e = tl.arange(0, E_P2)
    token, expert = t < num_tokens, e < E
    valid = token[:, None] & expert[None, :]
    z = tl.load(logits_ptr + t[:, None] * E + e[None, :], mask=valid).to(tl.float32)
    lse = tl.load(lse_ptr + t, mask=token, other=0.0)
    probs = tl.where(valid, tl.exp(z - lse[:, None]), 0.0)
    grad_p = tl.zeros((BLOCK_T, E_P2), tl.float32)
    if HAS_GRAD_AUX:
        counts = tl.load(counts_ptr + e, mask=expert, other=0).to(tl.float32)
        grad_p += (tl.load(grad_aux_ptr) * aux_scale * counts)[None, :]
    if HAS_GRAD_WEIGHTS:
        g = tl.zeros((BLOCK_T, E_P2), tl.float32)
        picked = tl.zeros((BLOCK_T, E_P2), tl.int32)
        for i in tl.static_range(TOP_K):
            pick = tl.load(ids_ptr + t * TOP_K + i, mask=token, other=E_P2)
            hit = e[None, :] == pick[:, None]
            g += tl.where(hit, tl.load(grad_weights_ptr + t * TOP_K + i, mask=token, other=0.0)[:, None], 0.0)
            picked += hit.to(tl.int32)
        picked = picked > 0
        if RENORMALIZE:
            chosen_sum = tl.where(token, tl.sum(tl.where(picked, probs, 0.0), axis=1), 1.0)  # 1: rows past the end
            weighted = tl.sum(g * probs, axis=1) / chosen_sum
            g = tl.where(picked, (g - weighted[:, None]) / chosen_sum[:, None], 0.0)
        grad_p += g
    grad_z = probs * (grad_p - tl.sum(grad_p * probs, axis=1)[:, None])
    if HAS_GRAD_Z:
        grad_z += (tl.load(grad_z_ptr) * z_scale * 2 * lse)[:, None] * probs
    tl.store(grad_logits_ptr + t[:, None] * E + e[None, :], grad_z.to(OUT_DTYPE), mask=valid)


class _TopKSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, top_k: int, renormalize: bool, statistics_group):
        logits = logits.contiguous()
        num_tokens, num_experts = logits.shape
        block = tokens_per_program(num_experts)
        blocks = triton.cdiv(num_tokens, block)
        e_p2 = triton.next_power_of_2(num_experts)
        warps = 4 if logits.is_cuda else 1
        weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=logits.device)
        expert_ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device=logits.device)
        lse = torch.empty(num_tokens, dtype=torch.float32, device=logits.device)
        block_counts = torch.empty(blocks, num_experts, dtype=torch.int32, device=logits.device)  # all written
        block_probs = torch.empty(blocks, num_experts, dtype=torch.float32, device=logits.device)
        block_lse_squares = torch.empty(blocks, dtype=torch.float32, device=logits.device)
        counts = torch.empty(num_experts, dtype=torch.int64, device=logits.device)
        aux_loss, z_loss = (torch.empty((), dtype=torch.float32, device=logits.device) for _ in range(2))
        if blocks:
            _top_k_softmax_kernel[(blocks,)](
                logits, weights, expert_ids, lse, block_counts, block_probs, block_lse_squares, num_tokens,
                E=num_experts, E_P2=e_p2, TOP_K=top_k, K_P2=triton.next_power_of_2(top_k), RENORMALIZE=renormalize,
                BLOCK_T=block, num_warps=warps)
        scales = loss_scales(num_tokens, top_k, num_experts)
        blocks_p2 = triton.next_power_of_2(max(blocks, 1))
        _router_totals_kernel[(1,)](block_counts, block_probs, block_lse_squares, counts, aux_loss, z_loss, blocks,
                                    *scales, E=num_experts, E_P2=e_p2, BLOCKS_P2=blocks_p2,
                                    CHUNK=max(1, min(blocks_p2, 4096 // e_p2)), num_warps=warps)
        aux_counts = counts
        if statistics_group is not None:  # the loss from the group's counts (its probability sums: this rank's)
            aux_counts, aux_scale = group_balance(counts, num_tokens, top_k, statistics_group)
            scales = (aux_scale, scales[1])
            aux_loss = torch.dot(aux_counts.float(), block_probs.sum(dim=0)) * aux_scale
        ctx.save_for_backward(logits, lse, expert_ids, aux_counts)
        ctx.renormalize, ctx.block, ctx.scales = renormalize, block, scales
        ctx.mark_non_differentiable(expert_ids, counts, block_counts)
        ctx.set_materialize_grads(False)  # unused outputs get no gradient kernel input
        return weights, expert_ids, counts, aux_loss, z_loss, block_counts

    @staticmethod
    def backward(ctx, grad_weights, _ids, _counts, grad_aux, grad_z, _block_counts):
        logits, lse, expert_ids, counts = ctx.saved_tensors
        num_tokens, num_experts = logits.shape
        grad_logits = torch.empty_like(logits)
        blocks = triton.cdiv(num_tokens, ctx.block)
        if blocks:
            # An absent gradient's pointer is never read (its HAS_ flag is off): any tensor will do.
            grads = [lse if g is None else g.contiguous() for g in (grad_weights, grad_aux, grad_z)]
            _top_k_softmax_backward_kernel[(blocks,)](
                logits, lse, expert_ids, counts, *grads, grad_logits, num_tokens, *ctx.scales,
                E=num_experts, E_P2=triton.next_power_of_2(num_experts), TOP_K=expert_ids.shape[1],
                RENORMALIZE=ctx.renormalize, HAS_GRAD_WEIGHTS=grad_weights is not None,
                HAS_GRAD_AUX=grad_aux is not None, HAS_GRAD_Z=grad_z is not None, BLOCK_T=ctx.block,
                OUT_DTYPE=TL_DTYPES[logits.dtype], num_warps=4 if logits.is_cuda else 1)
        return grad_logits, None, None, None


def top_k_softmax_kernels(logits: torch.Tensor, top_k: int, renormalize: bool,
                          statistics_group: dist.ProcessGroup | None = None) -> TopKSoftmax:
    """`top_k_softmax` through the kernels (fp32 / fp16 / bf16 logits; on the CPU in Triton's interpreter)."""
    return TopKSoftmax(*_TopKSoftmax.apply(logits, top_k, renormalize, statistics_group))


class TopKRouter(nn.Module):
    """logits = x @ weight ([d_model, num_experts]), then `route` (statistics_group: see the module docstring).
    The weight is replicated on every rank. renormalize, drop_policy: as `route` takes them."""

    def __init__(self, d_model: int, num_experts: int, top_k: int, renormalize: bool | None = None,
                 capacity_factor: float | None = None, seed: int = 0, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None, statistics_group: dist.ProcessGroup | None = None,
                 drop_policy: str = "probs"):
        super().__init__()
        self.statistics_group = statistics_group
        check_top_k(top_k, num_experts)  # refused at construction too, not at the first forward
        self.num_experts = num_experts
        self.top_k = top_k
        self.renormalize = renormalizes(top_k, renormalize)  # refused at construction, not at the first forward
        check_capacity_factor(capacity_factor, zero_allowed=False)  # at construction, not at the first forward
        self.capacity_factor = capacity_factor
        check_drop_policy(drop_policy)
        self.drop_policy = drop_policy
        generator = torch.Generator().manual_seed(seed)
        weight = torch.randn(d_model, num_experts, generator=generator, dtype=torch.float64) / math.sqrt(d_model)
        self.weight = nn.Parameter(weight.to(dtype=dtype, device=device))

    def forward(self, x: torch.Tensor, logit_bias: torch.Tensor | None = None) -> Routing:
        """x: [T, d_model]. `logit_bias` ([num_experts], added to the logits) lets tests force a routing (skewed,
        an expert or a rank left without tokens) while every rank still computes the same function."""
        logits = x @ self.weight
        if logit_bias is not None:
            logits = logits + logit_bias
        return route(logits, self.top_k, self.renormalize, self.capacity_factor, self.statistics_group,
                     self.drop_policy)
