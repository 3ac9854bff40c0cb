"""The expert-parallel MoELayer against a one-process dense reference MoE.

Every rank builds the reference with all experts from the same seed and runs it on the global batch; the
expert-parallel layer sees the rank's slice of the batch and holds its slice of the experts. Outputs, input
gradients, the local experts' weight gradients, the (all-reduced) router gradient and the per-rank auxiliary
losses must match. The reference routes each rank's slice on its own (capacity and auxiliary losses are per
local batch) with the loop router of test_moe_routing and runs every expert on every token, weighting by the
dense routing weights: no permutation, no all-to-all.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from moe import MoELayer, SwiGLUExperts, TopKRouter
from moe.layer import MoEStatistics
from test_moe_routing import reference_route
from world import run_world

D_MODEL, FFN, TOP_K, SEED = 8, 12, 2, 7
NEVER = -30.0  # a logit bias that keeps an expert out of every token's top k


@dataclass
class Scenario:
    name: str
    tokens_per_rank: list[int]
    num_experts: int
    logit_bias: list[float] | None = None
    capacity_factor: float | None = None


def reference_moe(xs: list[torch.Tensor], router: TopKRouter, experts: SwiGLUExperts, bias, capacity_factor):
    """xs: each rank's tokens. Returns (y of the whole batch, [(aux, z) per rank])."""
    dense, losses = [], []
    for x in xs:
        logits = x @ router.weight + (0 if bias is None else bias)
        weights, aux, z, _ = reference_route(logits, TOP_K, capacity_factor=capacity_factor)
        dense.append(weights)
        losses.append((aux, z))
    x, dense = torch.cat(xs), torch.cat(dense).to(xs[0].dtype)
    y = torch.zeros_like(x)
    for e in range(experts.num_experts):
        w1, w3 = experts.w13[e].chunk(2, dim=1)
        out = (F.silu(x @ w1) * (x @ w3)) @ experts.w2[e]
        y = y + dense[:, e:e + 1] * out
    return y, losses


def compare_with_reference(rank: int, world: int, scenarios: list[Scenario], dtype: torch.dtype, rtol: float) -> None:
    for case in scenarios:
        assert len(case.tokens_per_rank) == world
        generator = torch.Generator().manual_seed(len(case.name))
        total = sum(case.tokens_per_rank)
        global_x = torch.randn(total, D_MODEL, generator=generator, dtype=torch.float64)
        grad_out = torch.randn(total, D_MODEL, generator=generator, dtype=torch.float64)
        bounds = torch.tensor([0] + case.tokens_per_rank).cumsum(0).tolist()
        start, stop = bounds[rank], bounds[rank + 1]
        bias = None if case.logit_bias is None else torch.tensor(case.logit_bias, dtype=dtype)

        layer = MoELayer(D_MODEL, FFN, case.num_experts, TOP_K, capacity_factor=case.capacity_factor, seed=SEED,
                         dtype=dtype)
        x = global_x[start:stop].to(dtype).requires_grad_()
        y, aux = layer(x, bias)
        (y * grad_out[start:stop].to(dtype)).sum().backward()

        # The reference in float64, from the same seed.
        router = TopKRouter(D_MODEL, case.num_experts, TOP_K, seed=SEED, dtype=torch.float64)
        experts = SwiGLUExperts(case.num_experts, D_MODEL, FFN, seed=SEED, dtype=torch.float64)
        ref_x = global_x.to(dtype).double().requires_grad_()
        ref_bias = None if bias is None else bias.double()
        ref_y, ref_losses = reference_moe([ref_x[bounds[r]:bounds[r + 1]] for r in range(world)], router, experts,
                                          ref_bias, case.capacity_factor)
        (ref_y * grad_out).sum().backward()

        local = slice(rank * layer.num_local_experts, (rank + 1) * layer.num_local_experts)
        torch.testing.assert_close(layer.router.weight.double(), router.weight.to(dtype).double(), rtol=0, atol=0)
        for name in ("w13", "w2"):
            torch.testing.assert_close(getattr(layer.experts, name).double(),
                                       getattr(experts, name)[local].to(dtype).double(), rtol=0, atol=0)

        def close(got, want, what):
            # Relative to the largest element, so entries that nearly cancel do not demand a tighter bound.
            scale = want.abs().max().item() if want.numel() else 0.0
            torch.testing.assert_close(got.double(), want, rtol=rtol, atol=rtol * scale,
                                       msg=lambda m: f"{case.name}, rank {rank}, {what}: {m}")

        close(y, ref_y[start:stop].detach(), "output")
        close(x.grad, ref_x.grad[start:stop], "input gradient")
        for name in ("w13", "w2"):
            close(getattr(layer.experts, name).grad, getattr(experts, name).grad[local], f"{name} gradient")
        # The router is replicated: its gradient summed over the ranks is the reference's.
        router_grad = layer.router.weight.grad.clone()
        counts = aux["tokens_per_expert"].clone()
        if world > 1:
            dist.all_reduce(router_grad)
            dist.all_reduce(counts)
        # With no token in the whole batch the reference's routing weights never read the router weight.
        ref_router_grad = torch.zeros_like(router.weight) if total == 0 else router.weight.grad
        close(router_grad, ref_router_grad, "router gradient")
        close(aux["load_balancing_loss"], ref_losses[rank][0].detach(), "load-balancing loss")
        close(aux["z_loss"], ref_losses[rank][1].detach(), "z-loss")

        # The scenario did what its name says.
        received = aux["tokens_per_local_expert"]
        assert received.tolist() == counts[local].tolist()
        if case.name == "skewed":
            assert counts.max() >= 0.9 * total, counts
        if case.name.startswith("expert 2 idle"):
            assert counts[2] == 0, counts
        if case.name == "last rank idle" and rank == world - 1:
            assert received.sum() == 0
        if case.capacity_factor is not None:
            dropped = aux["dropped"].clone()
            if world > 1:
                dist.all_reduce(dropped)
            assert dropped > 0


def expect_uneven_split_error(rank: int, world: int) -> None:
    with pytest.raises(ValueError, match="multiple of the expert-parallel world size"):
        MoELayer(D_MODEL, FFN, 3, TOP_K)


TWO_RANKS = [
    Scenario("balanced", [11, 9], 4),
    Scenario("skewed", [12, 10], 4, logit_bias=[0, 6, 0, 0]),
    Scenario("rank without tokens", [13, 0], 4),
    Scenario("expert 2 idle", [9, 12], 4, logit_bias=[0, 0, NEVER, 0]),
    Scenario("last rank idle", [10, 11], 4, logit_bias=[0, 0, NEVER, NEVER]),
    Scenario("capacity, skewed", [14, 9], 4, logit_bias=[0, 3, 0, 0], capacity_factor=1.0),
    Scenario("balanced, 2 experts", [7, 8], 2),  # one expert per rank
]


def two_rank_world(rank: int, world: int) -> None:
    compare_with_reference(rank, world, TWO_RANKS, torch.float64, 1e-10)
    expect_uneven_split_error(rank, world)


def test_two_ranks_match_reference():
    run_world(2, two_rank_world)


def test_four_ranks_match_reference():
    scenarios = [
        Scenario("last rank idle", [10, 0, 7, 12], 8, logit_bias=[0, 0, 0, 0, 0, 5, NEVER, NEVER]),
        Scenario("expert 2 idle, capacity", [9, 11, 0, 6], 8, logit_bias=[0, 0, NEVER, 0, 0, 3, 0, 0],
                 capacity_factor=1.0),
    ]
    run_world(4, compare_with_reference, scenarios, torch.float64, 1e-10)


@pytest.mark.parametrize("dtype, rtol", [(torch.float64, 1e-10), (torch.float32, 1e-4)])
def test_one_process_matches_reference(dtype, rtol):
    scenarios = [
        Scenario("balanced", [17], 4),
        Scenario("skewed", [15], 4, logit_bias=[0, 6, 0, 0]),
        Scenario("expert 2 idle, capacity", [16], 4, logit_bias=[0, 3, NEVER, 0], capacity_factor=1.0),
        Scenario("no tokens", [0], 4),
    ]
    compare_with_reference(0, 1, scenarios, dtype, rtol)


def test_autocast_runs_rows_and_experts_in_bf16_with_fp32_weights():
    """Mixed precision (model.precision=bf16): under autocast the layer computes exactly what its bf16 copy
    computes on bf16 input, while its weights and their gradients stay fp32."""
    import copy
    layer = MoELayer(32, 24, 4, 2, seed=3)
    reference = copy.deepcopy(layer).to(torch.bfloat16)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(40, 32, generator=gen).requires_grad_()
    grad = torch.randn(40, 32, generator=gen)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, _ = layer(x)
    (y.float() * grad).sum().backward()
    x_ref = x.detach().to(torch.bfloat16).requires_grad_()
    y_ref, _ = reference(x_ref)
    (y_ref.float() * grad).sum().backward()
    assert y.dtype == torch.bfloat16 and torch.equal(y, y_ref)
    for (name, p), q in zip(layer.named_parameters(), reference.parameters()):
        assert p.dtype == p.grad.dtype == torch.float32, name
        torch.testing.assert_close(p.grad, q.grad.float(), rtol=0, atol=0, msg=name)
    # x's gradient sums the router's and the experts' parts in fp32 here, in bf16 in the reference
    torch.testing.assert_close(x.grad, x_ref.grad.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("x, bias, message", [
    (torch.randn(5, 8), None, r"floating-point \[tokens, d_model=16\], got \[5, 8\]"),
    (torch.randn(2, 5, 16), None, r"got \[2, 5, 16\]"),
    (torch.ones(5, 16, dtype=torch.int64), None, r"got \[5, 16\] torch.int64"),
    (torch.randn(5, 16), torch.zeros(3), r"logit_bias must be \[num_experts=4\], got \[3\]"),
])
def test_bad_input_is_named(x, bias, message):
    with pytest.raises(ValueError, match=message):
        MoELayer(16, 24, 4, 2)(x, bias)


def test_statistics_derived_when_first_read():
    """aux's derived statistics (dropped, tokens_per_local_expert) run their reductions only when read, once."""
    calls = []
    stats = MoEStatistics({"a": torch.tensor(1)}, derived={"b": lambda: calls.append("b") or torch.tensor(2)})
    assert list(stats) == ["a", "b"] and len(stats) == 2 and "b" in stats and not calls
    assert stats["b"] == 2 and stats["b"] == 2 and calls == ["b"]
    assert list(stats) == ["a", "b"]
    with pytest.raises(KeyError):
        stats["c"]
    _, aux = MoELayer(16, 24, 4, 2)(torch.randn(5, 16))
    assert aux["dropped"] == 0 and aux["tokens_per_local_expert"].sum() == 10
