"""moe.bench's phases and checks (the benchmark runs on GPUs only, under torchrun) on one simulated rank in the
Triton interpreter: each phase runs on the layer's current API, and the last one gives the layer's forward; a fused
layer whose output or gradients differ from the bulk layer's stops the bench before it is timed."""

from __future__ import annotations

import os
import re

import pytest
import torch

from fused_dlrm.dist.symmetric import SimulatedWorld
from moe import MoELayer
from moe.bench import FUSED_PATHS, MAX_GRAD_ERROR, backward_errors, fused_errors, phases
from moe.kernels import fused_combine
from moe.layer import FusedMoEConfig, _FusedExperts

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs in the Triton interpreter")

D_MODEL, FFN, EXPERTS, TOP_K, TOKENS = 16, 24, 4, 2, 19


def test_phases_run_and_the_combine_gives_the_forward():
    bulk = MoELayer(D_MODEL, FFN, EXPERTS, TOP_K, seed=3)
    fused = MoELayer(D_MODEL, FFN, EXPERTS, TOP_K, seed=3, comm="fused",
                     fused=FusedMoEConfig(max_tokens_per_rank=TOKENS), workspace=SimulatedWorld(1).workspaces()[0])
    x = torch.randn(TOKENS, D_MODEL, generator=torch.Generator().manual_seed(8))
    bias = torch.tensor([0.0, 4.0, 0.0, 0.0])  # skewed, as the benchmark's skewed configs
    with torch.no_grad():
        want = bulk(x, bias)[0]
        for layer, names in ((bulk, ["dispatch", "experts", "combine"]), (fused, ["dispatch", "combine"])):
            steps = phases(layer, x, bias)
            assert list(steps) == names
            results = {name: fn() for name, fn in steps.items()}
            torch.testing.assert_close(results["combine"], want, rtol=1e-5, atol=1e-5, msg=layer.comm)


def test_a_fused_result_unlike_bulk_stops_the_bench():
    """The fused layers' outputs are checked against bulk before anything is timed: a wrong one raises (its error
    was only written into the table, and the wrong layer timed)."""
    bulk = MoELayer(D_MODEL, FFN, EXPERTS, TOP_K, seed=3)
    x = torch.randn(TOKENS, D_MODEL, generator=torch.Generator().manual_seed(8))
    layers = {"bulk": bulk}
    for path, seed in (("fused", 3), ("fused/tok", 4)):  # seed 4: other weights, a wrong result
        layers[path] = MoELayer(D_MODEL, FFN, EXPERTS, TOP_K, seed=seed, comm="fused",
                                fused=FusedMoEConfig(max_tokens_per_rank=TOKENS),
                                workspace=SimulatedWorld(1).workspaces()[0])
    with torch.no_grad():
        want = bulk(x, None)[0]
    errors = fused_errors({p: layers[p] for p in ("bulk", "fused")}, x, None, want, "T=19")
    assert list(errors) == ["fused"] and errors["fused"] < 1e-5
    with pytest.raises(AssertionError, match=r"^T=19: fused/tok: max relative error .* against the bulk layer"):
        fused_errors(layers, x, None, want, "T=19")


def bench_layers(paths=tuple(FUSED_PATHS)) -> dict[str, MoELayer]:
    """The bench's layers, as run_config makes them, on one simulated rank in fp32."""
    layers = {"bulk": MoELayer(D_MODEL, FFN, EXPERTS, TOP_K, seed=3)}
    for choice in paths:
        path, choices = FUSED_PATHS[choice]
        layers[path] = MoELayer(D_MODEL, FFN, EXPERTS, TOP_K, seed=3, comm="fused",
                                fused=FusedMoEConfig(max_tokens_per_rank=TOKENS, **choices),
                                workspace=SimulatedWorld(1).workspaces()[0])
    return layers


def inputs(seed: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens and an upstream gradient, fresh."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(TOKENS, D_MODEL, generator=gen), torch.randn(TOKENS, D_MODEL, generator=gen)


SKEWED = torch.tensor([0.0, 4.0, 0.0, 0.0])


@pytest.mark.parametrize("bias", [None, SKEWED], ids=["balanced", "skewed"])
def test_the_fused_layers_gradients_pass_the_backward_check(bias):
    """Every fused path's gradients (the input's, the router's, both expert weights') are the bulk layer's; the
    check leaves no gradient behind (the timed forward+backward starts from none, as before)."""
    layers = bench_layers()
    x, grad = inputs()
    errors = backward_errors(layers, x, bias, grad, "T=19")
    assert list(errors) == [FUSED_PATHS[choice][0] for choice in FUSED_PATHS]
    assert all(error < 1e-5 for error in errors.values()), errors
    assert all(p.grad is None for layer in layers.values() for p in layer.parameters())


def _doubled(index):
    def change(grads):
        grads[index] = grads[index] * 2
        return grads
    return change


def _next_experts(index):  # expert e given expert e - 1's gradient
    def change(grads):
        grads[index] = grads[index].roll(1, dims=0)
        return grads
    return change


def _no_router_gradient(grads):
    grads[1] = None
    return grads


@pytest.mark.parametrize("change,what", [
    (_doubled(0), "input gradient: max relative error"),
    # the routing weights' gradient: x's through the router is checked (and off) first, the router's is 2x
    (_doubled(1), "input gradient: max relative error"),
    (_next_experts(2), "experts.w13 gradient: max relative error"),
    (_doubled(3), "experts.w2 gradient: max relative error"),
    (_no_router_gradient, "no gradient of router.weight"),
], ids=["input doubled", "routing weights' doubled", "w13 of the wrong expert", "w2 doubled", "router's missing"])
def test_a_wrong_gradient_stops_the_bench(monkeypatch, change, what):
    """The fused layer's backward (its autograd node's gradients) made wrong one way at a time: the check raises,
    naming the config, the path and the gradient (the forward alone was checked: a wrong backward was timed)."""
    real = _FusedExperts.backward

    def backward(ctx, grad_y):
        return tuple(change(list(real(ctx, grad_y))))

    monkeypatch.setattr(_FusedExperts, "backward", staticmethod(backward))
    x, grad = inputs()
    with pytest.raises(AssertionError, match=rf"^T=19: fused: {what}"):
        backward_errors(bench_layers(("rows",)), x, SKEWED, grad, "T=19")


def test_a_backward_without_the_routing_weights_stops_the_bench(monkeypatch):
    """The combine's backward pushes each row's output gradient times its routing weight; without the weight the
    input gradient is off by the weights (between 0 and 1: here ~2x), far outside MAX_GRAD_ERROR."""
    real = fused_combine._row_weights

    def row_weights(perm, caller):
        weights = real(perm, caller)
        return torch.ones_like(weights) if caller == "start_backward" else weights

    monkeypatch.setattr(fused_combine, "_row_weights", row_weights)
    x, grad = inputs()
    with pytest.raises(AssertionError, match=r"^T=19: fused: input gradient: max relative error") as raised:
        backward_errors(bench_layers(("rows",)), x, None, grad, "T=19")
    assert float(re.search(r"error (\S+) ", str(raised.value)).group(1)) > 10 * MAX_GRAD_ERROR
