"""moe.routing and moe.permute against straightforward per-token reference code.

The reference helpers here are also the routing half of the one-process MoE that tests/test_moe_layer.py
compares the expert-parallel layer with.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from moe import TopKRouter, permute, route, unpermute
from moe.permute import count_per_expert
from moe import routing as routing_module
from moe.routing import renormalizes, top_k_softmax_kernels, top_k_softmax_reference
from sm90 import compile_for_sm90

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # of the kernels' tensors (CPU: interpreter)


def reference_route(logits: torch.Tensor, top_k: int, renormalize: bool = True,
                    capacity_factor: float | None = None, drop_policy: str = "probs"):
    """Loop version of the router: returns (dense weights [T, E] with dropped assignments at 0, aux loss, z-loss,
    kept assignments as a set of (token, expert))."""
    logits = logits.double()
    num_tokens, num_experts = logits.shape
    probs = torch.softmax(logits, dim=-1)
    dense = torch.zeros(num_tokens, num_experts, dtype=torch.float64)
    wanted = [0] * num_experts
    capacity = math.inf if capacity_factor is None else math.ceil(num_tokens * top_k / num_experts * capacity_factor)
    assigned = [[] for _ in range(num_experts)]  # per expert: (token, weight), the weight in autograd
    for t in range(num_tokens):
        chosen = sorted(range(num_experts), key=lambda e: -probs[t, e].item())[:top_k]
        total = sum(probs[t, e] for e in chosen) if renormalize else 1.0
        for e in chosen:
            wanted[e] += 1
            assigned[e].append((t, probs[t, e] / total))
    kept = set()
    for e, pairs in enumerate(assigned):  # an expert keeps its first `capacity` by token, or its most probable
        if drop_policy == "probs":
            pairs = sorted(pairs, key=lambda pair: (-pair[1].item(), pair[0]))
        for t, weight in pairs[:min(capacity, len(pairs))]:
            dense[t, e] = weight
            kept.add((t, e))
    aux = num_experts * sum(wanted[e] / max(num_tokens * top_k, 1) * probs[:, e].sum() / max(num_tokens, 1)
                            for e in range(num_experts))
    z = sum(torch.logsumexp(logits[t], dim=0) ** 2 for t in range(num_tokens)) / max(num_tokens, 1)
    return dense, torch.as_tensor(aux, dtype=torch.float64), torch.as_tensor(z, dtype=torch.float64), kept


def megatron_aux_loss(logits: torch.Tensor, tokens_per_expert: torch.Tensor, total_num_tokens: int,
                      top_k: int) -> torch.Tensor:
    """Megatron-Core's switch_load_balancing_loss_func (coefficient 1): this rank's softmax probabilities, the
    counts and the token total of the level asked (under sequence parallelism: the TP group's)."""
    probs = torch.softmax(logits, dim=-1)
    return (probs.sum(dim=0) * tokens_per_expert).sum() * logits.shape[1] / (top_k * total_num_tokens ** 2)


def megatron_route(logits: torch.Tensor, top_k: int, pre_softmax: bool, capacity_factor: float | None,
                   drop_policy: str):
    """Megatron-Core's softmax router as its moe_utils defines it (topk_softmax_with_capacity without padding;
    switch_load_balancing_loss_func; z_loss_func), float64, vectorised: (dense weights [T, E], kept map [T, E],
    aux loss, z-loss). Its default (post-softmax) weights are a softmax over the k chosen logits, not renormalised
    probabilities as `reference_route` has them."""
    num_tokens, num_experts = logits.shape
    if pre_softmax:
        probs, top = torch.softmax(logits, dim=-1).topk(top_k, dim=1)
    else:
        top_logits, top = logits.topk(top_k, dim=1)
        probs = torch.softmax(top_logits, dim=-1)
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, top, True)
    weights = torch.zeros_like(logits).scatter(1, top, probs)
    tokens_per_expert = routing_map.sum(dim=0)  # the load-balancing counts: before the drops
    if capacity_factor is not None:
        capacity = math.ceil(num_tokens * top_k / num_experts * capacity_factor)  # get_capacity(T * k, E, c)
        if drop_policy == "probs":  # each expert's `capacity` most probable (topk of the masked weights by token)
            best = weights.detach().topk(min(capacity, num_tokens), dim=0).indices
            routing_map = routing_map & torch.zeros_like(routing_map).scatter(0, best, True)
        else:  # "position": each expert's earliest (Megatron leaves the choice among them to torch.topk)
            routing_map = routing_map & (routing_map.cumsum(dim=0) <= capacity)
        weights = weights * routing_map
    z = torch.logsumexp(logits, dim=-1).square().mean()
    return weights, routing_map, megatron_aux_loss(logits, tokens_per_expert, num_tokens, top_k), z


def dense_weights(routing, num_experts: int) -> torch.Tensor:
    """The router's [T, k] decision as a dense [T, E] weight matrix (dropped assignments already weigh 0)."""
    dense = torch.zeros(routing.expert_ids.shape[0], num_experts, dtype=routing.weights.dtype)
    return dense.scatter_add(1, routing.expert_ids, routing.weights)


@pytest.mark.parametrize("top_k", [1, 2, 3])
@pytest.mark.parametrize("renormalize", [True, False])
def test_route_matches_reference(top_k, renormalize):
    generator = torch.Generator().manual_seed(top_k)
    logits = torch.randn(37, 6, generator=generator, dtype=torch.float64) * 2
    if top_k == 1 and renormalize:  # every weight 1: refused where routing is done, not only by TopKRouter
        with pytest.raises(ValueError, match="top_k=1 with renormalize=True weighs every token's expert 1"):
            route(logits, top_k, renormalize)
        return
    routing = route(logits, top_k, renormalize)
    dense, aux, z, _ = reference_route(logits, top_k, renormalize)
    torch.testing.assert_close(dense_weights(routing, 6), dense, rtol=1e-12, atol=0)
    torch.testing.assert_close(routing.aux_loss, aux, rtol=1e-12, atol=0)
    torch.testing.assert_close(routing.z_loss, z, rtol=1e-12, atol=0)
    assert routing.kept.all() and routing.capacity is None
    assert routing.tokens_per_expert.tolist() == (dense > 0).sum(dim=0).tolist()
    # Best first; renormalised weights sum to 1 per token.
    assert (routing.weights[:, :-1] >= routing.weights[:, 1:]).all()
    if renormalize:
        torch.testing.assert_close(routing.weights.sum(dim=1), torch.ones(37, dtype=torch.float64))


@pytest.mark.parametrize("path", ["torch", "kernels"])
@pytest.mark.parametrize("num_tokens, num_experts, top_k, renormalize, capacity_factor, drop_policy", [
    (37, 6, 2, None, None, "probs"), (37, 6, 2, None, 0.75, "probs"), (37, 6, 2, None, 0.75, "position"),
    (40, 6, 1, None, 1.0, "probs"), (33, 5, 3, False, 1.0, "position"), (33, 5, 3, False, 1.0, "probs"),
    (29, 4, 4, None, 0.5, "position"), (29, 4, 4, None, 0.5, "probs"), (45, 7, 3, True, None, "position")])
def test_route_is_megatrons_router(monkeypatch, path, num_tokens, num_experts, top_k, renormalize, capacity_factor,
                                   drop_policy):
    """Against Megatron-Core's definitions (megatron_route), renormalize None as Megatron's default for k > 1 and
    its pre-softmax for top-1 (the module docstring's difference): the weights, the kept assignments (by either
    drop policy), both losses and the logits' gradient through all three; torch in float64, the router's kernels
    (interpreter on the CPU) in fp32."""
    generator = torch.Generator().manual_seed(num_tokens + top_k)
    bias = torch.zeros(num_experts, dtype=torch.float64)
    bias[1] = 1.5  # an expert over its capacity
    logits = torch.randn(num_tokens, num_experts, generator=generator, dtype=torch.float64) * 2 + bias
    grad_weights = torch.randn(num_tokens, num_experts, generator=generator, dtype=torch.float64)
    if path == "kernels":
        monkeypatch.setattr(routing_module, "top_k_softmax", top_k_softmax_kernels)
        logits = logits.float()
    z = logits.to(DEVICE if path == "kernels" else "cpu", copy=True).requires_grad_()
    routing = route(z, top_k, renormalize, capacity_factor, drop_policy=drop_policy)
    routing = dataclasses.replace(routing, **{f: getattr(routing, f).cpu() for f in (
        "expert_ids", "weights", "kept", "tokens_per_expert", "aux_loss", "z_loss")})
    dense = dense_weights(routing, num_experts)
    ((dense.double() * grad_weights).sum() + 0.3 * routing.aux_loss + 0.7 * routing.z_loss).backward()

    want_z = logits.double().requires_grad_()
    pre_softmax = not renormalizes(top_k, renormalize)
    weights, kept, aux, z_loss = megatron_route(want_z, top_k, pre_softmax, capacity_factor, drop_policy)
    ((weights * grad_weights).sum() + 0.3 * aux + 0.7 * z_loss).backward()
    rtol = 1e-12 if path == "torch" else 1e-5
    kept_pairs = torch.zeros_like(kept).scatter(1, routing.expert_ids, routing.kept)
    assert torch.equal(kept_pairs, kept)
    if capacity_factor is not None:
        assert routing.capacity is not None and not kept_pairs.sum(dim=1).eq(top_k).all()  # something dropped
    assert routing.tokens_per_expert.tolist() == kept.sum(dim=0).tolist()
    torch.testing.assert_close(dense.double(), weights.detach(), rtol=rtol, atol=rtol)
    torch.testing.assert_close(routing.aux_loss.double(), aux.detach(), rtol=rtol, atol=0)
    torch.testing.assert_close(routing.z_loss.double(), z_loss.detach(), rtol=rtol, atol=0)
    torch.testing.assert_close(z.grad.double().cpu(), want_z.grad, rtol=10 * rtol, atol=10 * rtol)


@pytest.mark.parametrize("top_k", [0, 7])
def test_top_k_outside_one_to_num_experts_is_refused_where_routing_is_done(top_k):
    """route (public) refuses k outside [1, num_experts] as TopKRouter does: the torch path returned fewer than k
    experts per token (k > num_experts; the losses scaled by the k asked) or none (k = 0: a layer silently off),
    and the kernels picked expert 0 again with an infinite weight."""
    logits = torch.randn(5, 6, generator=torch.Generator().manual_seed(top_k))
    message = rf"top_k must be in \[1, num_experts=6\], got {top_k}"
    with pytest.raises(ValueError, match=message):
        route(logits, top_k)
    with pytest.raises(ValueError, match=message):
        route(logits, top_k, capacity_factor=1.0)
    with pytest.raises(ValueError, match=message):
        TopKRouter(8, 6, top_k)


def zipf_logits(num_tokens: int, num_experts: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random logits with a Zipf-like bias: a few experts take most tokens, the last ones almost none."""
    generator = torch.Generator().manual_seed(seed)
    bias = -torch.log(torch.arange(1, num_experts + 1, dtype=torch.float64)) * 2
    return (torch.randn(num_tokens, num_experts, generator=generator, dtype=torch.float64) + bias).to(dtype)


@pytest.mark.parametrize("num_tokens, num_experts, top_k, renormalize", [
    (37, 6, 2, True), (300, 64, 6, True), (130, 33, 3, False), (5, 4, 4, True), (70, 1, 1, False), (0, 8, 2, True),
    (1100, 128, 2, True)])
def test_top_k_softmax_kernels_match_the_torch_reference(num_tokens, num_experts, top_k, renormalize):
    """The router's kernels (interpreter) against torch: choice, weights, counts, both losses, and the logits'
    gradient through all of them (each output given a random gradient); 1100 tokens of 128 experts: more blocks
    than the totals kernel sums at once."""
    logits = zipf_logits(num_tokens, num_experts, torch.float32, seed=num_tokens)
    generator = torch.Generator().manual_seed(1)
    grads = [torch.randn(num_tokens, top_k, generator=generator), torch.randn((), generator=generator),
             torch.randn((), generator=generator)]
    results = []
    for fn, device in ((top_k_softmax_kernels, DEVICE), (top_k_softmax_reference, "cpu")):
        z = logits.to(device).requires_grad_()
        choice = fn(z, top_k, renormalize)
        outputs = (choice.weights, choice.aux_loss, choice.z_loss)
        sum((out * g.to(device)).sum() for out, g in zip(outputs, grads)).backward()
        results.append((choice._replace(**{f: getattr(choice, f).cpu() for f in choice._fields
                                           if getattr(choice, f) is not None}), z.grad.cpu()))
    (got, got_grad), (want, want_grad) = results
    assert torch.equal(got.expert_ids, want.expert_ids)
    assert torch.equal(got.tokens_per_expert, want.tokens_per_expert) and got.tokens_per_expert.dtype == torch.int64
    for name in ("weights", "aux_loss", "z_loss"):
        torch.testing.assert_close(getattr(got, name), getattr(want, name), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("used", ["weights", "aux_loss", "z_loss"])
def test_top_k_softmax_kernels_with_one_output_used(used):
    """Outputs that take no part in the loss send no gradient (the kernel's absent-gradient branches)."""
    logits = zipf_logits(50, 8, torch.float32, seed=3)
    grads = []
    for fn, device in ((top_k_softmax_kernels, DEVICE), (top_k_softmax_reference, "cpu")):
        z = logits.to(device).requires_grad_()
        getattr(fn(z, 2, True), used).sum().backward()
        grads.append(z.grad.cpu())
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-4, atol=1e-6)


def test_top_k_softmax_kernels_take_bf16_logits():
    logits = zipf_logits(40, 16, torch.bfloat16, seed=4).to(DEVICE).requires_grad_()
    choice = top_k_softmax_kernels(logits, 3, True)
    want = top_k_softmax_reference(logits.cpu(), 3, True)  # fp32 arithmetic on the same bf16 values
    assert torch.equal(choice.expert_ids.cpu(), want.expert_ids) and choice.weights.dtype == torch.float32
    choice.weights.sum().backward()
    assert logits.grad.dtype == torch.bfloat16


@pytest.mark.parametrize("num_experts, top_k", [(4, 2), (6, 3), (5, 5), (8, 1)])
def test_nan_and_infinite_logits_pick_distinct_experts_as_the_reference_does(num_experts, top_k):
    """A diverging run's logits: a row with a NaN or an infinite logit has NaN probabilities only. The kernel ranks
    NaN above every logit and ties to the lower index, as the reference's stable sort does: k distinct
    experts in range, the reference's, NaN weights and losses (the training loop's NaN stop). Its picks once matched
    nothing in such a row and all fell to the last expert: k rows of one token to one expert, past the fused
    layer's receive capacity."""
    nan, inf = float("nan"), float("inf")
    logits = zipf_logits(9, num_experts, torch.float32, seed=5)
    logits[0] = nan
    logits[1, 1] = nan
    logits[2, 0] = inf
    logits[3] = -inf
    logits[4, :2] = inf
    logits[5, -1] = -inf  # one expert never chosen: a finite row
    logits[6] = 0.0  # every expert tied
    got = top_k_softmax_kernels(logits.to(DEVICE), top_k, True)
    want = top_k_softmax_reference(logits, top_k, True)
    ids = got.expert_ids.cpu()
    assert torch.equal(ids, want.expert_ids)
    assert (ids.sort(dim=1).values.diff(dim=1) > 0).all() and ((ids >= 0) & (ids < num_experts)).all()
    assert ids[6].tolist() == list(range(top_k))
    assert torch.equal(got.tokens_per_expert.cpu(), want.tokens_per_expert)
    weights = got.weights.cpu()
    torch.testing.assert_close(weights, want.weights, equal_nan=True)
    assert weights[:5].isnan().all() and not weights[5:].isnan().any()
    assert got.aux_loss.isnan() and got.z_loss.isnan()


@pytest.mark.parametrize("path", ["torch", "kernels"])
def test_experts_whose_probabilities_underflow_are_ranked_by_their_logits(path):
    """A token's fp32 probabilities of logits ~104 below its best are 0 (~88 where exp flushes subnormals), all
    tied: its next choices must still be its next best logits, as in float64 (and Megatron's top-k of the logits),
    not the lowest indices, which sent its rows to the experts the router ranks last and counted them there (the
    load-balancing loss)."""
    generator = torch.Generator().manual_seed(9)
    logits = torch.randn(40, 8, generator=generator)
    logits[::2, 5] += 150.0  # every other token: one expert far ahead, every other probability 0 in fp32
    fn = top_k_softmax_kernels if path == "kernels" else top_k_softmax_reference
    got = fn(logits.to(DEVICE), 3, True)
    want = top_k_softmax_reference(logits.double(), 3, True)
    assert torch.equal(got.expert_ids.cpu(), want.expert_ids)
    assert torch.equal(got.tokens_per_expert.cpu(), want.tokens_per_expert)
    torch.testing.assert_close(got.weights.cpu().double(), want.weights, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(got.aux_loss.cpu().double(), want.aux_loss, rtol=1e-5, atol=0)


def test_hand_computed_losses():
    # Router weight = identity, so logits = x. Tokens 0, 1: logits (ln 3, 0) -> probs (3/4, 1/4), expert 0;
    # token 2: (0, ln 3) -> (1/4, 3/4), expert 1. f = (2/3, 1/3), P = (1.75/3, 1.25/3):
    # aux = 2 * (2/3 * 1.75/3 + 1/3 * 1.25/3) = 19/18. Every logsumexp is ln 4: z = (ln 4)^2.
    router = TopKRouter(2, 2, top_k=1, renormalize=False, dtype=torch.float64)
    with torch.no_grad():
        router.weight.copy_(torch.eye(2, dtype=torch.float64))
    ln3 = math.log(3)
    routing = router(torch.tensor([[ln3, 0.0], [ln3, 0.0], [0.0, ln3]], dtype=torch.float64))
    assert routing.expert_ids.tolist() == [[0], [0], [1]]
    torch.testing.assert_close(routing.weights, torch.tensor([[0.75], [0.75], [0.75]], dtype=torch.float64))
    torch.testing.assert_close(routing.aux_loss, torch.tensor(19 / 18, dtype=torch.float64))
    torch.testing.assert_close(routing.z_loss, torch.tensor(math.log(4) ** 2, dtype=torch.float64))


def test_losses_have_router_gradients_and_low_precision_logits_route_in_fp32():
    generator = torch.Generator().manual_seed(1)
    router = TopKRouter(8, 4, top_k=2, dtype=torch.bfloat16)
    x = torch.randn(20, 8, generator=generator).bfloat16()
    routing = router(x)
    assert routing.weights.dtype == torch.float32 and routing.aux_loss.dtype == torch.float32
    (routing.aux_loss + routing.z_loss).backward()
    assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0


def test_top_1_weighs_its_expert_by_the_softmax_probability():
    """Renormalised over one expert every routing weight is 1, so the model's loss sends the router no gradient
    (it learns from the auxiliary losses alone: Megatron-LM issue 894, softmax before top-k there). A top-1
    router weighs by the softmax probability (Switch) unless told otherwise; renormalising it is refused."""
    generator = torch.Generator().manual_seed(8)
    router = TopKRouter(8, 4, top_k=1, dtype=torch.float64)
    x = torch.randn(10, 8, generator=generator, dtype=torch.float64)
    routing = router(x)
    probs = torch.softmax(x @ router.weight, dim=-1)
    torch.testing.assert_close(routing.weights[:, 0], probs.max(dim=-1).values)
    routing.weights.sum().backward()
    assert router.weight.grad.abs().max() > 1e-3
    assert TopKRouter(8, 4, top_k=2).renormalize and not router.renormalize
    with pytest.raises(ValueError, match="top_k=1 with renormalize=True weighs every token's expert 1"):
        TopKRouter(8, 4, top_k=1, renormalize=True)


def _group_statistics_match_the_whole_slice(rank: int, world: int) -> None:
    import torch.distributed as dist

    group = dist.new_group(list(range(world)))
    generator = torch.Generator().manual_seed(5)  # the same slice on every rank; each takes its part
    logits = torch.randn(12 * world, 6, generator=generator, dtype=torch.float64)
    logits[:, 0] += 1.0  # a skewed routing: the load-balancing loss is far from its minimum
    whole = logits.clone().requires_grad_()
    expected = top_k_softmax_reference(whole, 2, True)
    expected.aux_loss.backward()
    for fn in (top_k_softmax_reference, top_k_softmax_kernels):
        mine = logits[12 * rank:12 * (rank + 1)].float().to(DEVICE).requires_grad_()
        choice = fn(mine, 2, True, group)
        # counts stay this rank's (they size its exchanges); the loss is the group's
        torch.testing.assert_close(choice.tokens_per_expert.cpu(), expected.tokens_per_expert.new_tensor(
            count_per_expert(expected.expert_ids[12 * rank:12 * (rank + 1)].reshape(-1), 6)))
        # world times Megatron's rank loss (the module docstring): its ranks' losses sum to the slice's
        megatron = megatron_aux_loss(logits[12 * rank:12 * (rank + 1)], expected.tokens_per_expert, 12 * world, 2)
        torch.testing.assert_close(choice.aux_loss.double().cpu(), world * megatron, rtol=1e-5, atol=1e-7)
        mean = choice.aux_loss.detach().clone()
        dist.all_reduce(mean, group=group)
        torch.testing.assert_close(mean.double().cpu() / world, expected.aux_loss.detach(), rtol=1e-5, atol=1e-7)
        (choice.aux_loss / world).backward()  # each rank its share: the gradient of the slice's loss
        torch.testing.assert_close(mine.grad.double().cpu(), whole.grad[12 * rank:12 * (rank + 1)], rtol=1e-4,
                                   atol=1e-7)


def test_load_balancing_over_a_statistics_group_is_the_whole_slices():
    """Sequence parallelism cuts a batch slice over ranks: with the group's counts, the mean of the ranks'
    load-balancing losses is the slice's, and each rank's gradient is the slice loss's for its tokens (torch
    reference and kernels, 2 gloo ranks; on a GPU machine both ranks' kernels on the one GPU)."""
    from world import ONE_GPU, run_world

    run_world(2, _group_statistics_match_the_whole_slice, backend=ONE_GPU if DEVICE.type == "cuda" else "gloo")


@pytest.mark.parametrize("drop_policy", ["probs", "position"])
@pytest.mark.parametrize("capacity_factor", [0.5, 1.0, 1.5])
def test_capacity_keeps_each_experts_assignments_chosen_by_the_drop_policy(capacity_factor, drop_policy):
    generator = torch.Generator().manual_seed(2)
    # A bias on expert 0 overloads it, so the capacity bites.
    logits = torch.randn(29, 4, generator=generator, dtype=torch.float64) + torch.tensor([2.0, 0, 0, 0],
                                                                                           dtype=torch.float64)
    routing = route(logits, 2, capacity_factor=capacity_factor, drop_policy=drop_policy)
    dense, aux, z, kept = reference_route(logits, 2, capacity_factor=capacity_factor, drop_policy=drop_policy)
    assert routing.capacity == math.ceil(29 * 2 / 4 * capacity_factor)
    assert {(t, e) for t, e in zip(*torch.nonzero(dense_weights(routing, 4)).T.tolist())} == kept
    kept_pairs = {(t, routing.expert_ids[t, j].item()) for t, j in zip(*torch.nonzero(routing.kept).T.tolist())}
    assert kept_pairs == kept
    torch.testing.assert_close(dense_weights(routing, 4), dense, rtol=1e-12, atol=0)
    torch.testing.assert_close(routing.aux_loss, aux, rtol=1e-12, atol=0)
    assert routing.tokens_per_expert.tolist() == [sum(1 for _, e in kept if e == x) for x in range(4)]
    assert routing.tokens_per_expert.max() <= routing.capacity
    assert routing.tokens_per_expert.sum() == len(kept) < 29 * 2  # something was dropped


def test_the_probs_policy_keeps_each_experts_most_probable_assignments_ties_by_token():
    """Weights tied in fives (logits in steps): within an expert no dropped assignment outweighs a kept one, and
    among equal weights the earlier tokens stay."""
    logits = torch.randint(0, 3, (40, 5), generator=torch.Generator().manual_seed(4)).double()
    logits[:, 0] += 3  # expert 0 overloaded
    routing = route(logits, 2, capacity_factor=0.7)
    weights, ids, kept = (routing.weights.reshape(-1), routing.expert_ids.reshape(-1), routing.kept.reshape(-1))
    wanted = torch.softmax(logits, -1).gather(1, routing.expert_ids)
    wanted = (wanted / wanted.sum(1, keepdim=True)).reshape(-1)
    token = torch.arange(40).repeat_interleave(2)
    assert (~kept).any()
    for e in range(5):
        mine = ids == e
        assert int(kept[mine].sum()) == min(int(mine.sum()), routing.capacity)
        for a in torch.nonzero(mine & kept).flatten().tolist():
            for b in torch.nonzero(mine & ~kept).flatten().tolist():
                assert wanted[a] > wanted[b] or (wanted[a] == wanted[b] and token[a] < token[b])
    torch.testing.assert_close(weights, wanted * kept, rtol=0, atol=0)


def test_an_unknown_drop_policy_is_refused():
    message = r"drop_policy must be one of \('probs', 'position'\), got 'random'"
    with pytest.raises(ValueError, match=message):
        route(torch.randn(5, 4), 2, capacity_factor=1.0, drop_policy="random")
    with pytest.raises(ValueError, match=message):
        TopKRouter(8, 4, 2, capacity_factor=1.0, drop_policy="random")


def test_zero_capacity_drops_everything():
    routing = route(torch.randn(9, 4, generator=torch.Generator().manual_seed(5)), 2, capacity_factor=0.0)
    assert routing.capacity == 0 and not routing.kept.any() and (routing.weights == 0).all()
    assert routing.tokens_per_expert.tolist() == [0, 0, 0, 0]


@pytest.mark.parametrize("capacity_factor", [-0.5, float("inf"), float("nan"), True])
def test_a_capacity_factor_not_a_finite_number_at_least_0_is_refused_where_routing_is_done(capacity_factor):
    """route kept every assignment's count at a negative capacity (tokens_per_expert -4 per expert, returned as the
    kept counts); inf and NaN failed in math.ceil naming no setting; True (YAML's true) routed at 1. TopKRouter,
    which also refuses 0 (test_zero_capacity_drops_everything: route's defined edge), took inf and True."""
    logits = torch.randn(9, 4, generator=torch.Generator().manual_seed(5))
    with pytest.raises(ValueError, match=rf"capacity_factor must be >= 0 and finite \(None: dropless\), "
                                         rf"got {capacity_factor}"):
        route(logits, 2, capacity_factor=capacity_factor)
    with pytest.raises(ValueError, match=rf"capacity_factor must be > 0 and finite \(None: dropless\), got "
                                         rf"{capacity_factor}"):
        TopKRouter(8, 4, 2, capacity_factor=capacity_factor)


def test_count_per_expert_is_bincount():
    ids = torch.randint(0, 7, (300,), generator=torch.Generator().manual_seed(6))
    assert count_per_expert(ids, 7).tolist() == torch.bincount(ids, minlength=7).tolist()
    assert count_per_expert(ids, 9).tolist() == torch.bincount(ids, minlength=9).tolist()  # trailing empty bins
    assert count_per_expert(ids[:0], 3).tolist() == [0, 0, 0]


def test_no_tokens():
    routing = route(torch.randn(0, 4), 2, capacity_factor=1.0)
    assert routing.expert_ids.shape == (0, 2) and routing.tokens_per_expert.tolist() == [0, 0, 0, 0]
    assert routing.aux_loss.item() == 0 and routing.z_loss.item() == 0


@pytest.mark.parametrize("with_drops", [False, True])
def test_permute_groups_by_expert_and_unpermute_is_the_weighted_sum(with_drops):
    generator = torch.Generator().manual_seed(3)
    num_tokens, num_experts, top_k, d = 23, 5, 2, 7
    x = torch.randn(num_tokens, d, generator=generator, dtype=torch.float64, requires_grad=True)
    expert_ids = torch.stack([torch.randperm(num_experts, generator=generator)[:top_k] for _ in range(num_tokens)])
    weights = torch.rand(num_tokens, top_k, generator=generator, dtype=torch.float64, requires_grad=True)
    kept = torch.rand(num_tokens, top_k, generator=generator) > 0.3 if with_drops else None
    rows, perm = permute(x, expert_ids, num_experts, kept)

    # Reference: for each expert in turn, its (kept) assignments in token order.
    expected_rows, expected_counts = [], []
    for e in range(num_experts):
        tokens = [t for t in range(num_tokens) for j in range(top_k)
                  if expert_ids[t, j] == e and (kept is None or kept[t, j])]
        expected_rows += [x[t] for t in tokens]
        expected_counts.append(len(tokens))
    assert perm.tokens_per_expert.tolist() == expected_counts
    assert perm.offsets.tolist() == [0] + torch.tensor(expected_counts).cumsum(0).tolist()
    torch.testing.assert_close(rows, torch.stack(expected_rows), rtol=0, atol=0)

    # Round trip: unpermute(permute(x)) with weights w is sum_j w[t, j] * x[t] over the kept assignments.
    y = unpermute(rows * 3, perm, weights)
    keep = torch.ones(num_tokens, top_k, dtype=torch.bool) if kept is None else kept
    expected = 3 * x * (weights * keep).sum(dim=1, keepdim=True)
    torch.testing.assert_close(y, expected, rtol=1e-12, atol=1e-12)

    # Gradients through both directions equal those of the reference expression.
    g = torch.randn(num_tokens, d, generator=generator, dtype=torch.float64)
    got = torch.autograd.grad((y * g).sum(), (x, weights))
    want = torch.autograd.grad((expected * g).sum(), (x, weights))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_dropped_assignments_add_exact_zeros_whatever_the_row_they_read_holds():
    generator = torch.Generator().manual_seed(4)
    num_tokens, num_experts, top_k, d = 17, 4, 2, 5
    x = torch.randn(num_tokens, d, generator=generator, dtype=torch.float64)
    expert_ids = torch.stack([torch.randperm(num_experts, generator=generator)[:top_k] for _ in range(num_tokens)])
    kept = torch.rand(num_tokens, top_k, generator=generator) > 0.4
    weights = torch.rand(num_tokens, top_k, generator=generator, dtype=torch.float64)
    rows, perm = permute(x, expert_ids, num_experts, kept)
    assert (perm.inverse == rows.shape[0]).any()
    for bad in (float("nan"), float("inf")):
        poisoned = rows.clone()
        poisoned[-1] = bad  # the row that dropped assignments read (clamped index)
        y = unpermute(poisoned, perm, weights)
        owner = perm.order[-1] // top_k  # the token whose kept assignment row A - 1 is
        others = torch.arange(num_tokens) != owner
        expected = x * (weights * kept).sum(dim=1, keepdim=True)
        torch.testing.assert_close(y[others], expected[others], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("num_tokens", [0, 6])
def test_unpermute_without_any_row_has_zero_output_and_gradients(num_tokens):
    """No token (T = 0), or every assignment dropped (A = 0 < T * k): zeros, and autograd still reaches the rows'
    producer and the weights (zero gradients, not none)."""
    generator = torch.Generator().manual_seed(num_tokens)
    x = torch.randn(num_tokens, 3, generator=generator, dtype=torch.float64, requires_grad=True)
    weights = torch.rand(num_tokens, 2, generator=generator, dtype=torch.float64, requires_grad=True)
    expert_ids = torch.zeros(num_tokens, 2, dtype=torch.int64)
    expert_ids[:, 1] = 1
    rows, perm = permute(x, expert_ids, 2, torch.zeros(num_tokens, 2, dtype=torch.bool))
    assert rows.shape == (0, 3)
    y = unpermute(rows * 2, perm, weights)
    assert y.shape == (num_tokens, 3) and not y.any()
    y.sum().backward()
    assert x.grad is not None and not x.grad.any() and weights.grad is not None and not weights.grad.any()


def test_router_kernels_compile_for_sm90():
    """The routing kernels as GPUs launch them: bf16 logits, 64 experts top-6 and 8 experts top-2, both
    directions; renormalised or not; every gradient present or none but the weights'."""
    compile_for_sm90("""
from moe.permute import tokens_per_program
from moe.routing import _router_totals_kernel, _top_k_softmax_backward_kernel, _top_k_softmax_kernel
scales = dict(aux_scale="fp32", z_scale="fp32")
for experts, k in ((64, 6), (8, 2)):
    e_p2 = triton.next_power_of_2(experts)
    shape = dict(E=experts, E_P2=e_p2, TOP_K=k, BLOCK_T=tokens_per_program(experts))
    build(_router_totals_kernel, dict(block_counts_ptr="*i32", block_probs_ptr="*fp32", block_lse_squares_ptr="*fp32",
                                      counts_ptr="*i64", aux_ptr="*fp32", z_ptr="*fp32", **scales),
          dict(E=experts, E_P2=e_p2, BLOCKS_P2=256, CHUNK=4096 // e_p2))
    for renormalize in (True, False):
        build(_top_k_softmax_kernel, dict(logits_ptr="*bf16", weights_ptr="*fp32", ids_ptr="*i64", lse_ptr="*fp32",
                                          block_counts_ptr="*i32", block_probs_ptr="*fp32",
                                          block_lse_squares_ptr="*fp32"),
              dict(shape, K_P2=triton.next_power_of_2(k), RENORMALIZE=renormalize))
        for present in (True, False):
            build(_top_k_softmax_backward_kernel,
                  {**{n: "*i64" if n in ("ids_ptr", "counts_ptr") else "*bf16" if "logits" in n else "*fp32"
                      for n in _top_k_softmax_backward_kernel.arg_names if n.endswith("_ptr")}, **scales},
                  dict(shape, RENORMALIZE=renormalize, HAS_GRAD_WEIGHTS=True, HAS_GRAD_AUX=present,
                       HAS_GRAD_Z=present, OUT_DTYPE=tl.bfloat16))
""")
