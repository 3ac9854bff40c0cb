"""The fused MoE layer's dispatch replayed as CUDA graphs (moe.layer._dispatch_at_capacity), on one GPU: a
one-rank simulated world, the layer with graphs against the same layer without them. Every kernel computes each
tile once in a fixed order, so the two must agree bit for bit: outputs, input and every parameter gradient, in
training (bf16, and fp32 weights under bf16 autocast: the weights' cast is in the graph) and under no_grad, with
the routing changing every step, a second forward before the first one's backward, and a capacity that grows.
CPU tests of the same logic (a stand-in graph): test_moe_fused_layer.py, test_graphed_calls.py."""

from __future__ import annotations

import pytest
import torch

from fused_dlrm.dist.symmetric import SimulatedWorld
from moe.layer import FusedMoEConfig, MoELayer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")

D_MODEL, FFN, EXPERTS, TOP_K, SEED = 256, 192, 8, 2, 5


def pair(dtype):
    return [MoELayer(D_MODEL, FFN, EXPERTS, TOP_K, seed=SEED, dtype=dtype, device="cuda", comm="fused",
                     fused=FusedMoEConfig(cuda_graphs=graphs), workspace=SimulatedWorld(1, "cuda").workspaces()[0])
            for graphs in (True, False)]


def step(layer, x, bias, grad, autocast):
    layer.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        y, _ = layer(x, bias)
    (y.float() * grad).sum().backward()
    return [y.detach(), x.grad] + [p.grad for p in layer.parameters()]


def replays(layer) -> int:
    return sum(g.replays for g in layer._dispatch_graphs._graphs.values())


@pytest.mark.parametrize("dtype,autocast", [(torch.bfloat16, False), (torch.float32, True)])
def test_graphed_dispatch_equals_eager(dtype, autocast):
    graphed, eager = pair(dtype)
    gen = torch.Generator().manual_seed(1)
    xs = []  # each step's x kept, so that every step's lies elsewhere: a replay reads x at its address
    for i, tokens in enumerate([300] * 6 + [900] * 4 + [300] * 3):  # 900 tokens outgrow the capacity once
        x = torch.randn(tokens, D_MODEL, generator=gen).to("cuda", dtype)
        xs.append(x)
        grad = torch.randn(tokens, D_MODEL, generator=gen).cuda()
        bias = (torch.randn(EXPERTS, generator=gen) * 2).cuda()  # another routing every step
        for got, want in zip(step(graphed, x, bias, grad, autocast), step(eager, x, bias, grad, autocast)):
            assert torch.equal(got, want), f"step {i}"
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            assert torch.equal(graphed(x, bias)[0], eager(x, bias)[0]), f"step {i}, no_grad"
    torch.cuda.synchronize()
    assert replays(graphed) >= 2 * 2  # since the capacity grew: training and no_grad, twice each at least
    assert int(graphed.dispatch._epoch_done) == graphed.dispatch.ws.next_epoch("moe_dispatch") - 1


def test_two_forwards_before_their_backwards():
    graphed, eager = pair(torch.bfloat16)
    gen = torch.Generator().manual_seed(2)
    xs = [torch.randn(200, D_MODEL, generator=gen).to("cuda", torch.bfloat16) for _ in range(3)]
    grads = [torch.randn(200, D_MODEL, generator=gen).cuda() for _ in range(3)]
    results = []
    for layer in (graphed, eager):
        for _ in range(2):  # the key seen, then captured
            step(layer, xs[0], None, grads[0], False)
        layer.zero_grad(set_to_none=True)
        x1, x2 = xs[1].clone().requires_grad_(), xs[2].clone().requires_grad_()
        y1, y2 = layer(x1)[0], layer(x2)[0]
        ((y2.float() * grads[2]).sum() + (y1.float() * grads[1]).sum()).backward()
        results.append([y1, y2, x1.grad, x2.grad] + [p.grad for p in layer.parameters()])
    for got, want in zip(*results):
        assert torch.equal(got, want)
