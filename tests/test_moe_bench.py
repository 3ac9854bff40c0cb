"""moe.bench's phases (the benchmark runs on GPUs only, under torchrun) on one simulated rank in the Triton
interpreter: each phase runs on the layer's current API, and the last one gives the layer's forward."""

from __future__ import annotations

import os

import pytest
import torch

from fused_dlrm.dist.symmetric import SimulatedWorld
from moe import MoELayer
from moe.bench import fused_errors, phases
from moe.layer import FusedMoEConfig

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
