"""The graphed dense arches' dispatch (models/graphed_arches.py) without a GPU: which calls replay the graph and which
run the eager forward (stand-in callables: CI cannot capture CUDA graphs; tests/test_graphed_arches_gpu.py does)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fused_dlrm.models.graphed_arches import GraphedForward


def _forward(arch: nn.Module, sample: torch.Tensor):
    calls = []
    graphed = lambda x: calls.append("graphed") or x
    eager = lambda x: calls.append("eager") or x
    return GraphedForward(arch, graphed, eager, sample), calls


def test_training_calls_shaped_like_the_sample_replay():
    arch = nn.Linear(8, 4)
    forward, calls = _forward(arch, torch.randn(6, 8, requires_grad=True))
    forward(torch.randn(6, 8, requires_grad=True))
    assert calls == ["graphed"]


@pytest.mark.parametrize("change", ["rows", "dtype", "requires_grad", "eval", "no_grad"])
def test_every_other_call_runs_eagerly(change):
    arch = nn.Linear(8, 4)
    forward, calls = _forward(arch, torch.randn(6, 8, requires_grad=True))
    x = torch.randn(6, 8, requires_grad=True)
    if change == "rows":
        x = torch.randn(5, 8, requires_grad=True)
    elif change == "dtype":
        x = torch.randn(6, 8, dtype=torch.float64, requires_grad=True)
    elif change == "requires_grad":
        x = x.detach()
    elif change == "eval":
        arch.eval()
    with torch.no_grad() if change == "no_grad" else torch.enable_grad():
        forward(x)
    assert calls == ["eager"]
