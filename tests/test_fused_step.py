"""trainer.fused_step on the CPU: which models the written-out step refuses, and why (it needs the fused exchange
and graphed arch nodes: GPUs, tests/test_fused_step_gpu.py); the loop then takes the autograd step."""

from __future__ import annotations

import pytest

from fused_dlrm.train.build import build_model
from fused_dlrm.train.fused_step import FusedDLRMStep, fused_step_refusal
from test_training import CPU, SMALL, config


def test_a_bulk_model_is_refused_with_its_reason():
    model = build_model(config(*SMALL), CPU)
    assert "comm=bulk" in fused_step_refusal(model)
    with pytest.raises(ValueError, match="comm=bulk"):
        FusedDLRMStep(model, lambda: None, 1)
