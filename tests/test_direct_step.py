"""trainer.direct_step on the CPU: a model the direct step refuses, and why (it needs the dense arches graphed:
GPUs, tests/test_direct_step_gpu.py); the loop then takes the autograd step."""

from __future__ import annotations

import pytest

from fused_dlrm.train.build import build_model
from fused_dlrm.train.direct_step import DirectDLRMStep, direct_step_refusal
from test_training import CPU, SMALL, config


def test_a_model_without_graphed_arches_is_refused_with_its_reason():
    model = build_model(config(*SMALL), CPU)
    assert "not graphed arch nodes" in direct_step_refusal(model)
    with pytest.raises(ValueError, match="not graphed arch nodes"):
        DirectDLRMStep(model, lambda: None, 1)
