"""A group of SwiGLU experts applied to permuted rows (each expert's rows contiguous)."""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

from fused_dlrm.dist.host_copy import host_to_device
from fused_dlrm.train.compute_copies import compute_weight
from moe.kernels.grouped_weight_grad import grouped_weight_grad_reference, launch_grouped_weight_grad
from moe.kernels.swiglu_backward import swiglu_backward


def swiglu(a13: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, from [rows, 2 * ffn] = x @ w13[e]: gate columns first, then up."""
    gate, up = a13.chunk(2, dim=-1)
    return F.silu(gate) * up


def _swiglu_loop(x: torch.Tensor, counts: list[int], w13, w2) -> torch.Tensor:
    """One matmul chain per expert: the CPU path and the fallback. Experts with no rows still take part, so their
    weights get a zero gradient rather than none."""
    return torch.cat([swiglu(rows @ w13[e]) @ w2[e] for e, rows in enumerate(torch.split(x, counts))])


class _GroupedSwiGLU(torch.autograd.Function):
    """The experts through torch._grouped_mm (the bulk path on GPUs): two GEMMs for all experts, gate and up in
    one. The weights come in as the parameters and are cast to the rows' dtype here, so that the weight gradients
    are stored in the parameters' dtype by their GEMM (`_weight_grad`), with no cast pass for autograd to add:
    the same arithmetic as the fused layer's backward (moe/layer.py, _FusedExperts), so that bulk against fused
    times the communication, not a difference in compute. SwiGLU's backward is one kernel, as there."""

    @staticmethod
    def forward(ctx, x, w13_param, w2_param, counts: list[int]):
        offs = group_ends(counts, x.device)
        # the parameters themselves when of x's dtype; their compute copies, which the optimizer writes, if any
        w13, w2 = compute_weight(w13_param, x.dtype), compute_weight(w2_param, x.dtype)
        a13 = torch._grouped_mm(x, w13, offs=offs)
        h = swiglu(a13)
        ctx.counts, ctx.weight_dtype = counts, w13_param.dtype
        ctx.save_for_backward(x, a13, h, w13, w2, offs)
        return torch._grouped_mm(h, w2, offs=offs)

    @staticmethod
    def backward(ctx, grad):
        x, a13, h, w13, w2, offs = ctx.saved_tensors
        needs_x, needs_w13, needs_w2, _ = ctx.needs_input_grad  # frozen experts, or rows of no graph: skipped
        grad = grad.contiguous()  # e.g. out.sum()'s gradient is expanded (stride 0)
        grad_w2 = _weight_grad(h, grad, offs, ctx.counts, ctx.weight_dtype) if needs_w2 else None
        if not (needs_x or needs_w13):
            return None, None, grad_w2, None
        da13 = swiglu_backward(a13, torch._grouped_mm(grad, w2.transpose(1, 2), offs=offs))
        grad_x = torch._grouped_mm(da13, w13.transpose(1, 2), offs=offs) if needs_x else None
        grad_w13 = _weight_grad(x, da13, offs, ctx.counts, ctx.weight_dtype) if needs_w13 else None
        return grad_x, grad_w13, grad_w2, None


def _swiglu_grouped(x: torch.Tensor, counts: list[int], w13, w2) -> torch.Tensor:
    """The experts through torch._grouped_mm (weights of any dtype: they are cast to x's)."""
    return _GroupedSwiGLU.apply(x, w13, w2, counts)


def _weight_grad(x: torch.Tensor, grad: torch.Tensor, offs: torch.Tensor, counts: list[int],
                 out_dtype: torch.dtype) -> torch.Tensor:
    """x_e^T @ grad_e per group (offs: group ends on x's device) in out_dtype, where torch._grouped_mm runs:
    torch._grouped_mm when it stores that dtype (it was ~1.2x faster than the kernel, M3), the kernel otherwise
    (mixed precision's fp32 gradients from bf16 rows)."""
    if out_dtype != x.dtype:
        return launch_grouped_weight_grad(x.contiguous(), grad.contiguous(), offs, out_dtype)
    if not x.shape[0]:
        return x.new_zeros(len(counts), x.shape[1], grad.shape[1])
    out = torch._grouped_mm(x.t(), grad, offs=offs)
    for e in (e for e, n in enumerate(counts) if n == 0):  # torch._grouped_mm leaves these unwritten
        out[e].zero_()
    return out


def grouped_weight_grad(x: torch.Tensor, grad: torch.Tensor, counts: list[int], out_dtype: torch.dtype | None = None
                        ) -> torch.Tensor:
    """[groups, x cols, grad cols] of out_dtype (None: x's): x_e^T @ grad_e per group of `counts` rows (zero for a
    group without rows). On GPUs as the bulk experts' backward takes it (`_weight_grad`), the kernel where
    torch._grouped_mm does not run; the float64 reference elsewhere (the tests' CPU path)."""
    out_dtype = out_dtype or x.dtype
    if not x.is_cuda:
        return grouped_weight_grad_reference(x, grad, counts).to(out_dtype)
    offs = group_ends(counts, x.device)
    if _grouped_mm_works(x.device, x.dtype, x.shape[1], grad.shape[1]):
        return _weight_grad(x, grad, offs, counts, out_dtype)
    return launch_grouped_weight_grad(x.contiguous(), grad.contiguous(), offs, out_dtype)


def group_ends(counts: list[int], device: torch.device) -> torch.Tensor:
    """torch._grouped_mm's `offs`: int32 end row of each group, sent from the host without waiting for the GPU."""
    return host_to_device([torch.tensor(counts, dtype=torch.int32).cumsum(0, dtype=torch.int32)], device)[0]


def probe_tolerance(dtype: torch.dtype, device: torch.device) -> float:
    """The relative error a right result of `dtype` GEMMs stays below: 1e-2 for a few roundings to the 8- or
    11-bit mantissas of bf16 / fp16, and to TF32's 10 bits (fp32 on GPUs that allow it, read when probed); 1e-4
    for fp32 proper."""
    tf32 = dtype == torch.float32 and device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32
    return 1e-2 if dtype in (torch.bfloat16, torch.float16) or tf32 else 1e-4


def matches_reference(got: torch.Tensor, want: torch.Tensor, tolerance: float) -> bool:
    """Whether `got` is `want` (computed in float64 from the same rounded inputs) within `tolerance` in relative
    Frobenius error; False for any NaN or inf. Not elementwise: with d_model in the thousands, entries near zero
    carry the absolute rounding error of their large neighbours."""
    error = torch.linalg.vector_norm(got.double() - want.double())
    return bool(error <= tolerance * torch.linalg.vector_norm(want.double()))  # NaN compares False


@functools.cache
def _grouped_mm_works(device: torch.device, dtype: torch.dtype, d_model: int, ffn: int) -> bool:
    """Whether torch._grouped_mm runs forward and backward for this device, dtype and shape (it requires recent
    GPUs, some dtypes only and aligned strides) and is right: probed once on a small problem, the output and
    every gradient compared with the loop in float64 on the same inputs."""
    generator = torch.Generator().manual_seed(0)
    x, grad = (torch.randn(6, d_model, generator=generator).to(device, dtype) for _ in range(2))
    w13, w2 = (torch.randn(2, a, b, generator=generator).div(math.sqrt(a)).to(device, dtype)
               for a, b in ((d_model, 2 * ffn), (ffn, d_model)))

    def run(experts, dtype):
        # The first call may come under no_grad (an eval forward) or inside a backward: either would make the
        # probe's own backward fail and cache False, i.e. the slow loop for good. Under autocast (mixed
        # precision) too: the probe computes in the dtypes it names.
        with torch.enable_grad(), torch.autocast(device.type, enabled=False):
            inputs = [t.detach().to(dtype).requires_grad_() for t in (x, w13, w2)]
            out = experts(inputs[0], [4, 2], *inputs[1:])
            out.backward(grad.to(dtype))
        return [out.detach()] + [t.grad for t in inputs]

    try:
        got = run(_swiglu_grouped, dtype)
    except RuntimeError:
        return False
    tolerance = probe_tolerance(dtype, device)
    return all(matches_reference(g, w, tolerance) for g, w in zip(got, run(_swiglu_loop, torch.float64)))


class SwiGLUExperts(nn.Module):
    """Experts first_expert .. first_expert + num_experts - 1 of a model:
    out = (silu(x @ w1[e]) * (x @ w3[e])) @ w2[e], stored as w13 = [w1 | w3]: [E, d_model, 2 * ffn] (gate columns
    first, then up: one GEMM for both, as Megatron's fc1) and w2: [E, ffn, d_model].

    Each expert's weights come from its own generator, seeded by (seed, global expert index), drawn w1, w3, w2: a
    rank holding a slice of the experts gets exactly the weights a one-process model with all experts has for them.
    """

    def __init__(self, num_experts: int, d_model: int, ffn: int, first_expert: int = 0, seed: int = 0,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None):
        super().__init__()
        self.num_experts = num_experts
        self.first_expert = first_expert
        w13, w2 = [], []
        for e in range(first_expert, first_expert + num_experts):
            generator = torch.Generator().manual_seed(expert_seed(seed, e))
            w1 = torch.randn(d_model, ffn, generator=generator, dtype=torch.float64) / math.sqrt(d_model)
            w3 = torch.randn(d_model, ffn, generator=generator, dtype=torch.float64) / math.sqrt(d_model)
            w13.append(torch.cat([w1, w3], dim=1))
            w2.append(torch.randn(ffn, d_model, generator=generator, dtype=torch.float64) / math.sqrt(ffn))
        self.w13 = nn.Parameter(torch.stack(w13).to(dtype=dtype, device=device))
        self.w2 = nn.Parameter(torch.stack(w2).to(dtype=dtype, device=device))

    def forward(self, x: torch.Tensor, tokens_per_expert: list[int]) -> torch.Tensor:
        """x: [sum(tokens_per_expert), d_model], expert e's rows contiguous and in expert order. The experts
        compute in x's dtype (the weights are cast to it: mixed precision keeps them fp32)."""
        # torch._grouped_mm takes the group ends as they come: a negative count would mix experts' rows silently
        if (len(tokens_per_expert) != self.num_experts or sum(tokens_per_expert) != x.shape[0]
                or min(tokens_per_expert, default=0) < 0):
            raise ValueError(f"tokens_per_expert {tokens_per_expert} does not describe {self.num_experts} experts "
                             f"and {x.shape[0]} rows")
        if x.is_cuda and _grouped_mm_works(x.device, x.dtype, self.w13.shape[1], self.w2.shape[1]):
            return _swiglu_grouped(x, tokens_per_expert, self.w13, self.w2)
        # autograd casts the gradients back to the parameters' dtype
        return _swiglu_loop(x, tokens_per_expert, self.w13.to(x.dtype), self.w2.to(x.dtype))


def expert_seed(seed: int, expert: int) -> int:
    """Seed of one expert's generator: distinct for every (seed, expert) pair, and never `seed` itself (the
    router's)."""
    if not 0 <= expert < (1 << 20) - 1:
        raise ValueError(f"expert index {expert} out of range")
    return (seed << 20) + expert + 1
