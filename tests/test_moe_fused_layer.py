"""MoELayer(comm="fused") against comm="bulk" on the CPU: a one-rank simulated world runs the fused combine kernels
in the Triton interpreter, and the autograd node around them must give the bulk layer's outputs and gradients
(tokens, routing weights through the router, every expert weight). Multi-rank exchanges of the same kernels are
tested in test_moe_fused_combine.py (2 and 4 ranks) and on GPUs in test_moe_fused_gpu.py: the layer's own
collectives (counts, bulk dispatch) need one process per rank."""

from __future__ import annotations

import os

import pytest
import torch

from fused_dlrm.dist.symmetric import SimulatedWorld
from moe import MoELayer

D_MODEL, FFN, EXPERTS, TOP_K, SEED = 16, 24, 4, 2, 3
NEVER = -30.0

interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs in the Triton interpreter")


def run(layer, x, bias, grad):
    x = x.clone().requires_grad_()
    y, aux = layer(x, bias)
    (y * grad).sum().backward()
    return y.detach(), x.grad, aux


@interpreter
@pytest.mark.parametrize("tokens,bias,capacity", [
    (13, None, None),
    (17, [0.0, 6.0, 0.0, 0.0], None),  # skewed
    (11, [0.0, 0.0, NEVER, 0.0], None),  # an expert without rows
    (15, [0.0, 3.0, 0.0, 0.0], 1.0),  # dropped assignments
    (0, None, None),  # no tokens
])
def test_fused_layer_matches_bulk(tokens, bias, capacity):
    workspace = SimulatedWorld(1).workspaces()[0]
    fused = MoELayer(D_MODEL, FFN, EXPERTS, TOP_K, capacity_factor=capacity, seed=SEED, comm="fused",
                     workspace=workspace)
    bulk = MoELayer(D_MODEL, FFN, EXPERTS, TOP_K, capacity_factor=capacity, seed=SEED)
    gen = torch.Generator().manual_seed(tokens)
    bias = None if bias is None else torch.tensor(bias)
    for step in range(2):  # the second step reuses the workspace's flags and buffers
        x = torch.randn(tokens, D_MODEL, generator=gen)
        grad = torch.randn(tokens, D_MODEL, generator=gen)
        for layer in (fused, bulk):
            layer.zero_grad()
        y, gx, aux = run(fused, x, bias, grad)
        want_y, want_gx, want_aux = run(bulk, x, bias, grad)
        scale = max(want_y.abs().max().item(), 1.0) if tokens else 1.0
        torch.testing.assert_close(y, want_y, rtol=1e-5, atol=1e-5 * scale)
        torch.testing.assert_close(gx, want_gx, rtol=1e-5, atol=1e-5)
        for (name, p), q in zip(fused.named_parameters(), bulk.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")
        assert torch.equal(aux["tokens_per_local_expert"], want_aux["tokens_per_local_expert"])
        assert aux["dropped"] == want_aux["dropped"]
    if capacity is not None:
        assert aux["dropped"] > 0
    assert workspace.next_epoch("combine") == 3


def test_fused_needs_cuda_under_torchrun():
    with pytest.raises(RuntimeError, match="comm=fused needs CUDA GPUs under torchrun"):
        MoELayer(D_MODEL, FFN, EXPERTS, TOP_K, comm="fused")
    with pytest.raises(ValueError, match="expected 'bulk' or 'fused'"):
        MoELayer(D_MODEL, FFN, EXPERTS, TOP_K, comm="nccl")
