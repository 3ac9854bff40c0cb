"""AdamW's update of one fp32 parameter in one pass that also writes its low-precision compute copy.

Mixed precision keeps fp32 weights and computes in bf16: every forward cast the MoE experts' weights to bf16, a pass
that reads 4 and writes 2 bytes per weight (~6% of the fine-grained MoE Transformer's step at world 1,
docs/benchmarks.md), right after the optimizer's own pass over the same weights. This kernel is that optimizer
pass (reads p, g, m, v; writes p, m, v) storing the updated weight's bf16 / fp16 copy too: 2 more bytes per weight
instead of a pass of 6. The arithmetic is torch's fused AdamW's (decoupled weight decay, bias corrections from
the step count on the device), in fp32.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

BLOCK = 2048


def adamw_reference(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                    step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One AdamW step as torch ops in the inputs' dtype (the tests: float64), `step` counting this one (1 for the
    first): new (param, exp_avg, exp_avg_sq)."""
    param = param * (1 - lr * weight_decay)
    exp_avg = beta1 * exp_avg + (1 - beta1) * grad
    exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * grad * grad
    denom = (exp_avg_sq.sqrt() / math.sqrt(1 - beta2 ** step)) + eps
    return param - (lr / (1 - beta1 ** step)) * exp_avg / denom, exp_avg, exp_avg_sq


@triton.jit
def _adamw_kernel(param_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, copy_ptr, step_ptr, n, lr, beta1, beta2,
                  log2_beta1, log2_beta2, eps, weight_decay, HAS_COPY: tl.constexpr, BLOCK: tl.constexpr):
    """Program i: elements [i BLOCK, (i + 1) BLOCK) of the flat fp32 param, grad and moments, updated in place;
    the step count (this step's, already counted) read from step_ptr, so the launch needs no host value of it."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    step = tl.load(step_ptr).to(tl.float32)
    bias_correction1 = 1.0 - tl.exp2(step * log2_beta1)  # 1 - beta1^step
    bias_correction2_sqrt = tl.sqrt(1.0 - tl.exp2(step * log2_beta2))
    p = tl.load(param_ptr + offsets, mask=mask)
    g = tl.load(grad_ptr + offsets, mask=mask)
    m = tl.load(exp_avg_ptr + offsets, mask=mask)
    v = tl.load(exp_avg_sq_ptr + offsets, mask=mask)
    p -= lr * weight_decay * p
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    p -= (lr / bias_correction1) * m / (tl.sqrt(v) / bias_correction2_sqrt + eps)
    tl.store(param_ptr + offsets, p, mask=mask)
    tl.store(exp_avg_ptr + offsets, m, mask=mask)
    tl.store(exp_avg_sq_ptr + offsets, v, mask=mask)
    if HAS_COPY:
        tl.store(copy_ptr + offsets, p.to(copy_ptr.dtype.element_ty), mask=mask)


def launch_adamw(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                 step: torch.Tensor, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                 copy: torch.Tensor | None = None) -> None:
    """One AdamW step of `param` in place (fp32, contiguous, as grad and both moments), step: the count including
    this step, a one-element tensor on param's device; `copy` (bf16 / fp16, param's shape) receives the updated
    weight rounded to its dtype."""
    tensors = {"param": param, "grad": grad, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    for name, t in tensors.items():
        if t.dtype != torch.float32 or not t.is_contiguous() or t.shape != param.shape or t.device != param.device:
            raise ValueError(f"AdamW kernel: {name} must be contiguous fp32 of param's shape {tuple(param.shape)} "
                             f"on {param.device}, got {t.dtype} {tuple(t.shape)} on {t.device}")
    if copy is not None and (copy.dtype not in (torch.bfloat16, torch.float16) or not copy.is_contiguous()
                             or copy.shape != param.shape or copy.device != param.device):
        raise ValueError(f"AdamW kernel: the copy must be contiguous bf16 / fp16 of param's shape "
                         f"{tuple(param.shape)} on {param.device}, got {copy.dtype} {tuple(copy.shape)}")
    if step.numel() != 1 or step.device != param.device:
        raise ValueError(f"AdamW kernel: step must be one element on {param.device}, got {tuple(step.shape)} on "
                         f"{step.device}")
    if not 0.0 <= beta1 < 1.0 or not 0.0 <= beta2 < 1.0:
        raise ValueError(f"AdamW kernel: betas must lie in [0, 1), got ({beta1}, {beta2})")
    n = param.numel()
    if n:
        _adamw_kernel[(triton.cdiv(n, BLOCK),)](
            param, grad, exp_avg, exp_avg_sq, param if copy is None else copy, step, n, lr, beta1, beta2,
            _log2(beta1), _log2(beta2), eps, weight_decay, HAS_COPY=copy is not None, BLOCK=BLOCK,
            num_warps=8)


def _log2(beta: float) -> float:
    """log2(beta) for beta^step = exp2(step log2(beta)); -inf for 0 (then beta^step is 0: step >= 1)."""
    return math.log2(beta) if beta > 0 else -math.inf
