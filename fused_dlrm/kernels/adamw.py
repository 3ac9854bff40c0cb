"""AdamW's update of one fp32 parameter in one pass that also writes its low-precision compute copy.

Mixed precision keeps fp32 weights and computes in bf16: every forward cast the MoE experts' weights to bf16, a pass
that reads 4 and writes 2 bytes per weight (~6% of the fine-grained MoE Transformer's step at world 1,
docs/benchmarks.md), right after the optimizer's own pass over the same weights. This kernel is that optimizer
pass (reads p, g, m, v; writes p, m, v) storing the updated weight's bf16 / fp16 copy too: 2 more bytes per weight
instead of a pass of 6. The arithmetic is torch's fused AdamW's (decoupled weight decay, bias corrections from
the step count on the device), in fp32 but for 1 - beta1 and 1 - beta2 and the bias corrections (in fp64, as torch
computes them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

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


@dataclass
class AdamWStep:
    """One fp32 parameter's AdamW step: the operands (contiguous fp32 of the parameter's shape on its device), the
    step count including this step (one element on that device: the kernel reads it, so no launch waits for a host
    value), the hyperparameters and the bf16 / fp16 copy to write (None: none)."""

    param: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    step: torch.Tensor
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    copy: torch.Tensor | None = None

    def __post_init__(self):
        param = self.param
        for name in ("param", "exp_avg", "exp_avg_sq"):
            _check(name, getattr(self, name), param, (torch.float32,), "fp32")
        if self.copy is not None:
            _check("the copy", self.copy, param, (torch.bfloat16, torch.float16), "bf16 / fp16")
        if self.step.numel() != 1 or self.step.device != param.device:
            raise ValueError(f"AdamW kernel: step must be one element on {param.device}, got "
                             f"{tuple(self.step.shape)} on {self.step.device}")
        if not 0.0 <= self.beta1 < 1.0 or not 0.0 <= self.beta2 < 1.0:
            raise ValueError(f"AdamW kernel: betas must lie in [0, 1), got ({self.beta1}, {self.beta2})")


def _check(name: str, t: torch.Tensor, param: torch.Tensor, dtypes: tuple, what: str) -> None:
    if t.dtype not in dtypes or not t.is_contiguous() or t.shape != param.shape or t.device != param.device:
        raise ValueError(f"AdamW kernel: {name} must be contiguous {what} of the parameter's shape "
                         f"{tuple(param.shape)} on {param.device}, got {t.dtype} {tuple(t.shape)} on {t.device}")


def _log2(beta: float) -> float:
    """log2(beta) for beta^step = exp2(step log2(beta)); -inf for 0 (then beta^step is 0: step >= 1)."""
    return math.log2(beta) if beta > 0 else -math.inf


@triton.jit
def _adamw_kernel(grad_ptr, param_ptr, exp_avg_ptr, exp_avg_sq_ptr, copy_ptr, step_ptr, n, lr, beta1, beta2,
                  one_minus_beta1, one_minus_beta2, log2_beta1, log2_beta2, eps, weight_decay, HAS_COPY: tl.constexpr,
                  BLOCK: tl.constexpr):
    """Program i: elements [i BLOCK, (i + 1) BLOCK) of the flat parameter, its moments and copy, stepped with their
    gradient: torch's fused AdamW's arithmetic, bias corrections from the step count at step_ptr (this step's)."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    # The bias corrections in fp64, as torch's fused AdamW (in double, then fp32): 1 - beta2^step is ~1e-3 at the
    # first steps (beta2 = 0.999), and from a beta2^step rounded to fp32 near 1 it would keep only ~13 bits.
    step = tl.load(step_ptr).to(tl.float64)
    bias_correction1 = (1.0 - tl.exp2(step * log2_beta1)).to(tl.float32)  # 1 - beta1^step
    bias_correction2_sqrt = tl.sqrt(1.0 - tl.exp2(step * log2_beta2)).to(tl.float32)
    g = tl.load(grad_ptr + offsets, mask=mask)
    p = tl.load(param_ptr + offsets, mask=mask)
    m = tl.load(exp_avg_ptr + offsets, mask=mask)
    v = tl.load(exp_avg_sq_ptr + offsets, mask=mask)
    p -= lr * weight_decay * p
    m = beta1 * m + one_minus_beta1 * g
    v = beta2 * v + one_minus_beta2 * g * g
    p -= (lr / bias_correction1) * m / (tl.sqrt(v) / bias_correction2_sqrt + eps)
    tl.store(param_ptr + offsets, p, mask=mask)
    tl.store(exp_avg_ptr + offsets, m, mask=mask)
    tl.store(exp_avg_sq_ptr + offsets, v, mask=mask)
    if HAS_COPY:
        tl.store(copy_ptr + offsets, p.to(copy_ptr.dtype.element_ty), mask=mask)


def launch_adamw(grad: torch.Tensor, step: AdamWStep) -> None:
    """Take `step` with `grad` (contiguous fp32 of the parameter's shape): the parameter and moments in place, the
    updated weight rounded into the copy (to nearest even)."""
    _check("grad", grad, step.param, (torch.float32,), "fp32")
    p, n = step.param, step.param.numel()
    if n:
        _adamw_kernel[(triton.cdiv(n, BLOCK),)](
            grad, p, step.exp_avg, step.exp_avg_sq, p if step.copy is None else step.copy, step.step, n, step.lr,
            # 1 - beta from the host's double: from an fp32 beta2 = 0.999 it is 1.3e-5 off (1.4e-3 at 0.99999),
            # a bias of half that in every update (torch's fused AdamW computes it in double)
            step.beta1, step.beta2, 1.0 - step.beta1, 1.0 - step.beta2, _log2(step.beta1), _log2(step.beta2),
            step.eps, step.weight_decay,
            HAS_COPY=step.copy is not None, BLOCK=BLOCK, num_warps=8)
