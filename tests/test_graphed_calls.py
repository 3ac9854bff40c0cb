"""fused_dlrm.kernels.graphed_calls on the CPU, with a stand-in graph (tests/graph_stand_in.py): when a key is
captured and replayed, that inputs reach the replay, and that a held Lease keeps a graph's outputs from being
rewritten. The real capture runs on GPUs in test_moe_graphs_gpu.py."""

from __future__ import annotations

import gc

import pytest
import torch

from fused_dlrm.kernels import graphed_calls
from fused_dlrm.kernels.graphed_calls import GraphedCalls
from graph_stand_in import stand_in_capture


@pytest.fixture
def log(monkeypatch):
    log = []
    monkeypatch.setattr(graphed_calls, "_capture", stand_in_capture(log))
    monkeypatch.setattr(graphed_calls, "_capturing", lambda: False)
    return log


def double(x):
    return x * 2


def test_a_key_runs_then_is_captured_and_replayed_on_new_inputs(log):
    calls = GraphedCalls()
    outs = []
    for step in range(4):
        x = torch.randn(5, generator=torch.Generator().manual_seed(step))
        out, lease = calls("k", double, (x,))
        assert lease is None
        torch.testing.assert_close(out, x * 2, rtol=0, atol=0)  # this call's inputs, not the captured ones
        outs.append(out)
    assert log == ["capture", "replay", "replay", "replay"]  # the first call ran fn itself
    assert outs[1] is outs[2] is outs[3] and outs[0] is not outs[1]  # a graph's outputs are its own tensors
    assert len(calls) == 1


def test_a_held_lease_keeps_its_outputs_and_the_key_runs_anew(log):
    calls = GraphedCalls()
    x = torch.arange(3.0)
    calls("k", double, (x,))
    first, lease = calls("k", double, (x,), hold=True)  # captured and replayed: the graph's outputs, held
    second, lease2 = calls("k", double, (x + 10,), hold=True)
    assert second is not first and torch.equal(first, x * 2) and torch.equal(second, (x + 10) * 2)
    lease.check()  # not rewritten
    lease.release()
    third, _ = calls("k", double, (x + 20,))
    assert third is first and torch.equal(third, (x + 20) * 2)
    with pytest.raises(RuntimeError, match="rewritten by a later call"):
        lease.check()
    lease2.check()  # its outputs were new tensors: never rewritten
    assert log == ["capture", "replay", "replay"]


def test_a_dropped_lease_holds_nothing(log):
    calls = GraphedCalls()
    x = torch.arange(3.0)
    calls("k", double, (x,))
    out, lease = calls("k", double, (x,), hold=True)
    del lease  # its holder went (an autograd graph freed without a backward)
    gc.collect()
    again, _ = calls("k", double, (x + 1,))
    assert again is out and log == ["capture", "replay", "replay"]


def test_at_most_max_graphs_then_other_keys_run_without_one(log):
    calls = GraphedCalls(max_graphs=2)
    x = torch.arange(3.0)
    for step, key in enumerate(("a", "a", "b", "b", "c", "c", "c")):
        out, _ = calls(key, double, (x + step,))
        torch.testing.assert_close(out, (x + step) * 2, rtol=0, atol=0)
    assert log == ["capture", "replay", "capture", "replay"] and len(calls) == 2
    calls.clear()  # e.g. the keys' buffers were replaced
    assert len(calls) == 0
    calls("c", double, (x,))
    calls("c", double, (x,))
    assert log[-2:] == ["capture", "replay"]


def test_inside_a_callers_capture_fn_runs(log, monkeypatch):
    calls = GraphedCalls()
    x = torch.arange(3.0)
    calls("k", double, (x,))
    monkeypatch.setattr(graphed_calls, "_capturing", lambda: True)  # the caller's graph takes it
    out, _ = calls("k", double, (x + 1,))
    assert torch.equal(out, (x + 1) * 2) and log == [] and len(calls) == 0
