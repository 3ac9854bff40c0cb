"""AdamW that writes compute copies: the kernel against float64 and torch's AdamW, the optimizer's state and copies,
its fallbacks, and the copies' staleness check (on a GPU where there is one, else the CPU under the interpreter)."""

import pytest
import torch

from fused_dlrm.kernels.adamw import AdamWStep, adamw_reference, launch_adamw
from fused_dlrm.train import compute_copies
from fused_dlrm.train.adamw import AdamW
from fused_dlrm.train.compute_copies import compute_copy, compute_weight, want_compute_copy
from sm90 import compile_for_sm90

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # conftest: the interpreter without a GPU

HYPER = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.detach().double() - want.detach().double()).norm() / want.detach().double().norm())


def assert_rounded(copy: torch.Tensor, param: torch.Tensor) -> None:
    """The copy is param rounded to its dtype as torch rounds (to nearest even: the GPU's cvt.rn, which
    test_kernel_rounds_to_nearest_on_sm90 finds in the PTX). Triton's interpreter casts fp32 to bf16 by dropping
    the low bits (cast_impl passes no rounding mode), so there the copy may lie one bf16 step toward zero."""
    want = param.detach().to(copy.dtype)
    if copy.is_cuda or copy.dtype != torch.bfloat16:
        assert torch.equal(copy, want)
        return
    truncated = (param.detach().view(torch.int32) & ~0xFFFF).view(torch.float32).to(torch.bfloat16)
    assert torch.equal(copy, truncated)


@pytest.mark.parametrize("n", [1, 2047, 2 * 2048 + 5])
@pytest.mark.parametrize("copy_dtype", [None, torch.bfloat16, torch.float16])
def test_kernel_matches_float64_over_steps(n, copy_dtype):
    generator = torch.Generator().manual_seed(n)
    p, m = torch.randn(n, generator=generator), torch.randn(n, generator=generator) * 1e-2
    v = torch.rand(n, generator=generator) * 1e-4
    want = [t.double() for t in (p, m, v)]
    p, m, v = (t.to(DEVICE) for t in (p, m, v))
    copy = None if copy_dtype is None else torch.full((n,), float("nan"), dtype=copy_dtype, device=DEVICE)  # poison
    beta1, beta2 = HYPER["betas"]
    for step in range(1, 4):
        g = torch.randn(n, generator=generator)
        launch_adamw(g.to(DEVICE), AdamWStep(p, m, v, torch.tensor(float(step), device=DEVICE), HYPER["lr"], beta1,
                                             beta2, HYPER["eps"], HYPER["weight_decay"], copy))
        want = adamw_reference(*want[:1], g.double(), *want[1:], step, HYPER["lr"], beta1, beta2, HYPER["eps"],
                               HYPER["weight_decay"])
        for got, ref in zip((p, m, v), want):
            assert rel_err(got.cpu(), ref) < 1e-6
        if copy is not None:
            assert_rounded(copy, p)


@pytest.mark.parametrize("beta2", [0.999, 0.99999])
def test_first_steps_bias_corrections_keep_fp32_precision(beta2):
    """1 - beta2^step is small at the first steps (1e-3 for torch's default 0.999): from a beta2^step rounded to
    fp32 near 1 it keeps only a few bits, as many as the update then has. torch's fused AdamW computes it in double.
    The parameter starts at zero, so that it holds the update alone (not the update lost in p's rounding)."""
    generator = torch.Generator().manual_seed(17)
    n = 300
    g, m = torch.randn(n, generator=generator), torch.randn(n, generator=generator) * 1e-2
    v = torch.rand(n, generator=generator) * 1e-4
    for step in (1, 2, 5):
        p, m_got, v_got = torch.zeros(n, device=DEVICE), m.clone().to(DEVICE), v.clone().to(DEVICE)
        launch_adamw(g.to(DEVICE), AdamWStep(p, m_got, v_got, torch.tensor(float(step), device=DEVICE), 1e-3, 0.9,
                                             beta2, 1e-8, 0.0))
        want, _, _ = adamw_reference(torch.zeros(n, dtype=torch.float64), g.double(), m.double(), v.double(), step,
                                     1e-3, 0.9, beta2, 1e-8, 0.0)
        assert rel_err(p.cpu(), want) < 1e-6, (step, rel_err(p.cpu(), want))


def test_kernel_refuses_bad_operands():
    p = torch.randn(8, device=DEVICE)
    step = torch.tensor(1.0, device=DEVICE)
    with pytest.raises(ValueError, match="grad must be contiguous fp32"):
        launch_adamw(p.half(), AdamWStep(p, p.clone(), p.clone(), step, 1e-3, 0.9, 0.99, 1e-8, 0.0))
    with pytest.raises(ValueError, match="exp_avg_sq must be contiguous fp32"):
        AdamWStep(p, p.clone(), p[:4], step, 1e-3, 0.9, 0.99, 1e-8, 0.0)
    with pytest.raises(ValueError, match="the copy must be"):
        AdamWStep(p, p.clone(), p.clone(), step, 1e-3, 0.9, 0.99, 1e-8, 0.0, copy=p.clone())
    with pytest.raises(ValueError, match="step must be one element"):
        AdamWStep(p, p.clone(), p.clone(), p[:2], 1e-3, 0.9, 0.99, 1e-8, 0.0)
    with pytest.raises(ValueError, match="betas"):
        AdamWStep(p, p.clone(), p.clone(), step, 1e-3, 1.0, 0.99, 1e-8, 0.0)


def _params(seed: int) -> list[torch.nn.Parameter]:
    """A weight marked for a bf16 copy (uneven size: a partial last block), one unmarked, one marked but frozen."""
    generator = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(shape, generator=generator).to(DEVICE))
              for shape in ((3, 37, 50), (64,), (9,))]
    want_compute_copy(params[0], torch.bfloat16)
    want_compute_copy(params[2], torch.bfloat16)
    params[2].requires_grad_(False)
    return params


def _step_both(ours: AdamW, theirs: torch.optim.AdamW, mine, reference, generator) -> None:
    for a, b in zip(mine[:2], reference[:2]):
        a.grad = torch.randn(a.shape, generator=generator).to(DEVICE)
        b.grad = a.grad.clone()
    ours.step()
    theirs.step()


def test_optimizer_follows_torch_fused_adamw_and_writes_the_copies():
    mine, reference = _params(0), _params(0)
    ours, theirs = AdamW(mine, fused=True, **HYPER), torch.optim.AdamW(reference, fused=True, **HYPER)
    generator = torch.Generator().manual_seed(1)
    for _ in range(4):
        _step_both(ours, theirs, mine, reference, generator)
        assert rel_err(mine[0], reference[0]) < 1e-6
        assert torch.equal(mine[1], reference[1])  # unmarked: torch's own step
        assert torch.equal(mine[0].grad, reference[0].grad)  # the gradient hidden from torch's step is back
        assert_rounded(compute_copies.copy_to_write(mine[0]), mine[0])
        assert compute_weight(mine[0], torch.bfloat16) is mine[0].compute_copy.tensor
    assert torch.equal(mine[2], reference[2]) and compute_copy(mine[2], torch.bfloat16) is None  # no gradient
    assert compute_copy(mine[1], torch.bfloat16) is None
    state, want = ours.state[mine[0]], theirs.state[reference[0]]
    assert state.keys() == want.keys() and float(state["step"]) == float(want["step"]) == 4.0
    assert state["step"].dtype == want["step"].dtype and state["step"].device == want["step"].device
    for key in ("exp_avg", "exp_avg_sq"):
        assert rel_err(state[key], want[key]) < 1e-6


def test_state_dict_moves_between_torch_adamw_and_ours():
    mine, reference = _params(2), _params(2)
    ours, theirs = AdamW(mine, fused=True, **HYPER), torch.optim.AdamW(reference, fused=True, **HYPER)
    generator = torch.Generator().manual_seed(3)
    _step_both(ours, theirs, mine, reference, generator)
    # each resumes from the other's state dict, then both go on alike
    ours_state, theirs_state = ours.state_dict(), theirs.state_dict()
    ours.load_state_dict(theirs_state)
    theirs.load_state_dict(ours_state)
    with torch.no_grad():
        for a, b in zip(mine, reference):
            a.copy_(b)  # a torch in-place write: mine[0]'s copy is stale and must be rewritten at its next use
    assert torch.equal(compute_weight(mine[0], torch.bfloat16), reference[0].detach().to(torch.bfloat16))
    for _ in range(2):
        _step_both(ours, theirs, mine, reference, generator)
    assert rel_err(mine[0], reference[0]) < 1e-6
    assert float(ours.state[mine[0]]["step"]) == 3.0


@pytest.mark.parametrize("option", [dict(amsgrad=True), dict(maximize=True), dict(fused=False)])
def test_groups_the_kernel_does_not_take_step_through_torch_without_copies(option):
    mine, reference = _params(4), _params(4)
    settings = {"fused": True, **HYPER, **option}
    ours, theirs = AdamW(mine, **settings), torch.optim.AdamW(reference, **settings)
    generator = torch.Generator().manual_seed(5)
    for _ in range(2):
        _step_both(ours, theirs, mine, reference, generator)
    assert all(torch.equal(a, b) for a, b in zip(mine, reference))
    assert compute_copy(mine[0], torch.bfloat16) is None
    assert torch.equal(compute_weight(mine[0], torch.bfloat16), mine[0].detach().to(torch.bfloat16))


def test_compute_weight_casts_without_a_copy_and_marks_only_fp32_weights():
    p = torch.nn.Parameter(torch.randn(5, device=DEVICE))
    assert compute_weight(p, torch.float32) is p
    want_compute_copy(p, torch.bfloat16)
    assert compute_weight(p, torch.bfloat16).grad_fn is not None  # a cast, in autograd's graph
    with pytest.raises(ValueError, match="bf16 / fp16 copies of fp32 parameters"):
        want_compute_copy(torch.nn.Parameter(torch.randn(5, dtype=torch.float16)), torch.bfloat16)
    with pytest.raises(ValueError, match="bf16 / fp16 copies of fp32 parameters"):
        want_compute_copy(p, torch.float32)


def test_kernel_rounds_to_nearest_on_sm90():
    compile_for_sm90('''
from fused_dlrm.kernels import adamw
types = {n: "*fp32" for n in ("grad_ptr", "param_ptr", "exp_avg_ptr", "exp_avg_sq_ptr", "step_ptr")}
types.update({n: "fp32" for n in ("lr", "beta1", "beta2", "one_minus_beta1", "one_minus_beta2", "log2_beta1",
                                 "log2_beta2", "eps", "weight_decay")})
kernel = adamw._adamw_kernel
ptx = build(kernel, {**types, "copy_ptr": "*bf16"}, dict(HAS_COPY=True, BLOCK=adamw.BLOCK), num_warps=8).asm["ptx"]
assert "cvt.rn.bf16x2.f32" in ptx or "cvt.rn.bf16.f32" in ptx, "the bf16 copy is not rounded to nearest"
build(kernel, {**types, "copy_ptr": "*fp32"}, dict(HAS_COPY=False, BLOCK=adamw.BLOCK), num_warps=8)
''')


def test_a_swapped_or_moved_weight_has_its_copy_rewritten_or_dropped():
    p = torch.nn.Parameter(torch.randn(3, 40, device=DEVICE))
    want_compute_copy(p, torch.bfloat16)
    p.grad = torch.randn_like(p)
    AdamW([p], fused=True, lr=1e-2).step()
    copy = compute_weight(p, torch.bfloat16)
    p.data = torch.randn(3, 40, device=DEVICE)  # a new tensor under the parameter: the version counter stays
    assert compute_weight(p, torch.bfloat16) is copy and torch.equal(copy, p.detach().to(torch.bfloat16))
    p.data = torch.randn(5, 40, device=DEVICE)  # another shape (as another device): the copy no longer fits
    assert compute_copy(p, torch.bfloat16) is None and not hasattr(p, "compute_copy")
    assert torch.equal(compute_weight(p, torch.bfloat16), p.detach().to(torch.bfloat16))
    p.grad = torch.randn_like(p)
    AdamW([p], fused=True, lr=1e-2).step()
    want_compute_copy(p, torch.float16)  # marked for another dtype: the bf16 copy goes, the next step writes fp16
    assert compute_copy(p, torch.bfloat16) is None


def test_step_hooks_run_once_per_step_beside_torchs_own_adamw():
    """torch wraps an optimizer class's step with the step hooks when it makes the class's first optimizer: ours
    calls torch.optim.AdamW's step inside its own, which must not run them again."""
    torch.optim.AdamW([torch.nn.Parameter(torch.randn(2, device=DEVICE))])  # torch.optim.AdamW.step now wrapped
    params = _params(8)
    ours = AdamW(params, fused=True, **HYPER)
    calls = []
    ours.register_step_pre_hook(lambda *args: calls.append("pre"))
    ours.register_step_post_hook(lambda *args: calls.append("post"))
    generator = torch.Generator().manual_seed(9)
    for p in params[:2]:
        p.grad = torch.randn(p.shape, generator=generator).to(DEVICE)
    ours.step()
    assert calls == ["pre", "post"]


@pytest.mark.parametrize("change", ["a non-contiguous gradient", "a tensor lr"])
def test_a_weight_with_a_copy_stepped_by_torch_has_its_copy_rewritten(change):
    """torch's fused step leaves the version counter as it is: a weight the kernel stepped before (so it has a copy)
    and torch steps now must not be computed with its old copy."""
    if change == "a non-contiguous gradient" and DEVICE.type == "cuda":  # as torch.optim.AdamW(fused=True) does
        pytest.skip("torch's fused CUDA step refuses a gradient strided unlike its parameter (the CPU's takes it)")
    p = torch.nn.Parameter(torch.randn(3, 40, device=DEVICE))
    want_compute_copy(p, torch.bfloat16)
    optimizer = AdamW([p], fused=True, **HYPER)
    generator = torch.Generator().manual_seed(10)
    p.grad = torch.randn(3, 40, generator=generator).to(DEVICE)
    optimizer.step()
    assert compute_copy(p, torch.bfloat16) is not None  # the kernel's step wrote it
    if change == "a tensor lr":
        p.grad = torch.randn(3, 40, generator=generator).to(DEVICE)
        optimizer.param_groups[0]["lr"] = torch.tensor(HYPER["lr"], device=DEVICE)
    else:
        p.grad = torch.randn(40, 3, generator=generator).to(DEVICE).t()
    before = p.detach().clone()
    optimizer.step()
    assert not torch.equal(p.detach(), before)  # torch stepped it
    assert torch.equal(compute_weight(p, torch.bfloat16), p.detach().to(torch.bfloat16))
