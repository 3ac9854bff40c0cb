"""The SwiGLU experts: the torch._grouped_mm probe (its tolerance, and the probe itself where the CPU runs
torch._grouped_mm: the GPU answers the same question with the same code), the torch._grouped_mm path's outputs and
gradients against float64 (on the CPU in the interpreter, and on a GPU), the seeded weights."""

from __future__ import annotations

import os

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


# The torch._grouped_mm path's backward launches Triton kernels (SwiGLU's backward, the weight gradients): on CPU
# tensors only the interpreter runs them.
cpu_grouped_mm_path = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                         reason="CPU tensors: Triton runs them in its interpreter")


def _cpu_grouped_mm() -> bool:
    try:
        torch._grouped_mm(torch.ones(2, 16, dtype=torch.bfloat16), torch.ones(1, 16, 16, dtype=torch.bfloat16),
                          offs=torch.tensor([2], dtype=torch.int32))
    except (RuntimeError, AttributeError):
        return False
    return True


@cpu_grouped_mm_path
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


def test_negative_row_counts_are_refused():
    """torch._grouped_mm (the GPU's path) takes the group ends as given: counts that sum to the rows but hold a
    negative one gave an output of mixed-up experts without an error."""
    layer = SwiGLUExperts(2, 8, 6)
    with pytest.raises(ValueError, match="tokens_per_expert"):
        layer(torch.randn(6, 8), [-1, 7])


def experts_case(rows_dtype, param_dtype, counts, d_model=32, ffn=24, seed=0):
    """Rows, parameters (leaves) and an output gradient; the float64 loop's output and gradients from the same
    rounded inputs (the weights as the experts compute with them: cast to the rows' dtype)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(counts), d_model, generator=gen).to(rows_dtype).requires_grad_()
    params = [(torch.randn(len(counts), a, b, generator=gen) / a ** 0.5).to(param_dtype).requires_grad_()
              for a, b in ((d_model, 2 * ffn), (ffn, d_model))]
    grad = torch.randn(sum(counts), d_model, generator=gen).to(rows_dtype)
    inputs = [t.detach().to(rows_dtype).double().requires_grad_() for t in (x, *params)]
    _swiglu_loop(inputs[0], counts, *inputs[1:]).backward(grad.double())
    want = [_swiglu_loop(*(t.detach() for t in inputs[:1]), counts, *(t.detach() for t in inputs[1:]))]
    return x, params, grad, want + [t.grad for t in inputs]


@cpu_grouped_mm_path
@pytest.mark.skipif(not _cpu_grouped_mm(), reason="this torch has no torch._grouped_mm on the CPU")
@pytest.mark.parametrize("rows_dtype,param_dtype,tol", [
    (torch.float16, torch.float32, 1e-2),  # mixed precision (fp16: the interpreter's dots cannot take bf16)
    (torch.bfloat16, torch.bfloat16, 2e-2),  # torch._grouped_mm's weight gradients
    (torch.float32, torch.float32, 1e-4)])
def test_grouped_experts_match_float64_with_gradients_in_the_parameters_dtype(rows_dtype, param_dtype, tol):
    """The bulk experts' torch._grouped_mm path (the CPU runs it here; the GPU the same code), its backward one
    SwiGLU kernel and the weight-gradient GEMMs: outputs and every gradient against the float64 loop, uneven
    experts and one without rows; the weight gradients come out in the parameters' dtype, unrounded."""
    counts = [5, 0, 11, 3]
    x, params, grad, want = experts_case(rows_dtype, param_dtype, counts)
    out = experts._swiglu_grouped(x, counts, *params)
    out.backward(grad)
    got = [out, x.grad, *(p.grad for p in params)]
    assert [t.dtype for t in got] == [rows_dtype, rows_dtype, param_dtype, param_dtype]
    for g, w in zip(got, want):
        assert matches_reference(g, w, tol)
    assert not params[0].grad[1].any() and not params[1].grad[1].any()  # the expert without rows
    if param_dtype != rows_dtype:  # stored by the GEMM in fp32, not a bf16 result cast back
        assert not torch.equal(params[1].grad, params[1].grad.to(rows_dtype).to(param_dtype))


@cpu_grouped_mm_path
@pytest.mark.skipif(not _cpu_grouped_mm(), reason="this torch has no torch._grouped_mm on the CPU")
def test_grouped_experts_compute_only_the_gradients_asked_for():
    """Frozen experts still pass the rows' gradient; rows outside the graph still give the weights theirs."""
    counts = [5, 0, 11, 3]
    x, params, grad, want = experts_case(torch.float32, torch.float32, counts, seed=1)
    frozen = [p.detach() for p in params]
    experts._swiglu_grouped(x, counts, *frozen).backward(grad)
    assert matches_reference(x.grad, want[1], 1e-4)
    rows = x.detach()
    experts._swiglu_grouped(rows, counts, params[0], params[1].detach()).backward(grad)
    assert rows.grad is None and params[1].grad is None
    assert matches_reference(params[0].grad, want[2], 1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_experts_on_gpu_take_grouped_mm_with_fp32_weight_gradients():
    counts = [700, 0, 1, 257, 3000, 64, 0, 129]  # skewed, two experts without rows
    x, params, grad, want = experts_case(torch.bfloat16, torch.float32, counts, d_model=256, ffn=192)
    layer = SwiGLUExperts(len(counts), 256, 192, device="cuda")
    with torch.no_grad():
        layer.w13.copy_(params[0]), layer.w2.copy_(params[1])
    x = x.detach().cuda().requires_grad_()
    out = layer(x, counts)
    out.backward(grad.cuda())
    assert experts._grouped_mm_works(x.device, torch.bfloat16, 256, 192)
    for g, w in zip([out, x.grad, layer.w13.grad, layer.w2.grad], want):
        assert matches_reference(g.cpu(), w, 2e-2)
    assert layer.w2.grad.dtype == torch.float32
    assert not torch.equal(layer.w2.grad, layer.w2.grad.bfloat16().float())
