"""The torch._grouped_mm probe of the SwiGLU experts: its tolerance, and the probe itself where the CPU runs
torch._grouped_mm (the GPU answers the same question with the same code)."""

from __future__ import annotations

import pytest
import torch

import moe.experts as experts
from moe.experts import SwiGLUExperts, _swiglu_loop, expert_seed, matches_reference, probe_tolerance

D_MODEL, FFN = 2048, 1408  # the shape whose bf16 rounding the old elementwise check rejected on H200


def bf16_case(seed: int = 0):
    """The old probe's problem (6 rows over 2 experts, unscaled weights): (bf16 loop, float64 loop of the same
    bf16 inputs, the inputs)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(6, D_MODEL, generator=gen).bfloat16()
    ws = [torch.randn(2, a, b, generator=gen).bfloat16() for a, b in ((D_MODEL, 2 * FFN), (FFN, D_MODEL))]
    return _swiglu_loop(x, [4, 2], *ws), _swiglu_loop(x.double(), [4, 2], *(w.double() for w in ws)), x, ws


def test_bf16_rounding_passes_where_the_elementwise_check_failed():
    got, want, _, _ = bf16_case()
    assert not torch.allclose(got.double(), want, rtol=2e-2, atol=2e-2)  # what sent H200 to the loop
    assert matches_reference(got, want, probe_tolerance(torch.bfloat16, torch.device("cpu")))


def test_tolerance_follows_the_precision_the_gemms_run_at(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    for dtype in (torch.bfloat16, torch.float16):
        assert probe_tolerance(dtype, cpu) == probe_tolerance(dtype, cuda) == 1e-2
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    assert probe_tolerance(torch.float32, cuda) == probe_tolerance(torch.float32, cpu) == 1e-4
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", True)  # trainer.tf32
    assert probe_tolerance(torch.float32, cuda) == 1e-2 and probe_tolerance(torch.float32, cpu) == 1e-4


def test_wrong_results_fail():
    got, want, x, ws = bf16_case()
    half, single = (probe_tolerance(dtype, torch.device("cpu")) for dtype in (torch.bfloat16, torch.float32))
    assert not matches_reference(_swiglu_loop(x, [2, 4], *ws), want, half)  # groups mixed up
    unwritten = got.clone()
    unwritten[4:] = 0  # one expert's rows never written
    assert not matches_reference(unwritten, want, half)
    for bad in (float("nan"), float("inf")):
        poisoned = got.clone()
        poisoned[0, 0] = bad
        assert not matches_reference(poisoned, want, half)
    # fp32 is held to fp32 rounding: bf16's error is far too large for it, fp32's own is fine.
    assert not matches_reference(got.float(), want, single)
    assert matches_reference(_swiglu_loop(x.float(), [4, 2], *(w.float() for w in ws)), want, single)


def _cpu_grouped_mm() -> bool:
    try:
        torch._grouped_mm(torch.ones(2, 16, dtype=torch.bfloat16), torch.ones(1, 16, 16, dtype=torch.bfloat16),
                          offs=torch.tensor([2], dtype=torch.int32))
    except (RuntimeError, AttributeError):
        return False
    return True


@pytest.mark.skipif(not _cpu_grouped_mm(), reason="this torch has no torch._grouped_mm on the CPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_probe_accepts_a_working_grouped_mm_and_rejects_a_wrong_or_failing_one(dtype, monkeypatch):
    probe = experts._grouped_mm_works.__wrapped__  # uncached
    cpu = torch.device("cpu")
    assert probe(cpu, dtype, D_MODEL, FFN)
    grouped = experts._swiglu_grouped
    monkeypatch.setattr(experts, "_swiglu_grouped", lambda x, counts, *ws: grouped(x, counts[::-1], *ws))
    assert not probe(cpu, dtype, D_MODEL, FFN)

    monkeypatch.undo()
    with torch.no_grad():  # an eval forward first: the probe still runs its backward
        assert probe(cpu, dtype, D_MODEL, FFN)

    def unsupported(*args):
        raise RuntimeError("grouped gemm is not supported here")

    monkeypatch.setattr(experts, "_swiglu_grouped", unsupported)
    assert not probe(cpu, dtype, D_MODEL, FFN)


def test_w13_holds_each_experts_seeded_w1_then_w3_and_a_slice_equals_the_whole():
    d_model, ffn = 8, 6
    whole = SwiGLUExperts(4, d_model, ffn, seed=5, dtype=torch.float64)
    part = SwiGLUExperts(2, d_model, ffn, first_expert=2, seed=5, dtype=torch.float64)
    assert whole.w13.shape == (4, d_model, 2 * ffn) and dict(whole.named_parameters()).keys() == {"w13", "w2"}
    for e in range(4):
        gen = torch.Generator().manual_seed(expert_seed(5, e))
        w1, w3 = (torch.randn(d_model, ffn, generator=gen, dtype=torch.float64) / d_model ** 0.5 for _ in range(2))
        w2 = torch.randn(ffn, d_model, generator=gen, dtype=torch.float64) / ffn ** 0.5
        assert torch.equal(whole.w13[e], torch.cat([w1, w3], dim=1)) and torch.equal(whole.w2[e], w2)
    assert torch.equal(part.w13, whole.w13[2:]) and torch.equal(part.w2, whole.w2[2:])
