"""torch's AdamW whose step also writes the parameters' low-precision compute copies (fused_dlrm.train.compute_copies).

A parameter the model marks for a copy is stepped by one Triton pass (fused_dlrm.kernels.adamw) that updates the
weight and both moments and stores the bf16 / fp16 copy the next forward computes with; torch's own step takes
every other parameter. The state (a step count on the device, exp_avg, exp_avg_sq) and the state_dict are those of
torch's fused AdamW, so checkpoints move between the two.
"""

from __future__ import annotations

import torch

from fused_dlrm.kernels.adamw import AdamWStep, launch_adamw
from fused_dlrm.kernels.launch import interpreting
from fused_dlrm.train import compute_copies


class AdamW(torch.optim.AdamW):
    """torch.optim.AdamW (same arguments) that writes compute copies in its step.

    The kernel takes a parameter when it is marked for a copy, fp32 and contiguous on a device Triton runs on (CUDA;
    the interpreter's CPU in the tests) with a dense fp32 gradient of the same layout, in a `fused=True` group (the
    step count lives on the device) without amsgrad, maximize or a tensor lr. Any other parameter steps through
    torch and gets no copy (the model casts it at each use, as without copies); a copy an earlier step wrote is
    rewritten at its next use."""

    def __init__(self, params, *args, **kwargs):
        super().__init__(params, *args, **kwargs)
        # GradScaler then unscales the gradients before step() (the kernel takes no grad_scale / found_inf)
        self._step_supports_amp_scaling = False

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        ours = [[p for p in group["params"] if _kernel_steps(p, group)] for group in self.param_groups]
        hidden = [(p, p.grad) for params in ours for p in params]
        for p, _ in hidden:  # torch's step skips parameters without a gradient
            p.grad = None
        try:
            _torch_step(self)
            for p in (p for group in self.param_groups for p in group["params"] if p.grad is not None):
                compute_copies.written_unseen(p)  # torch stepped it; its fused step leaves the version counter
        finally:
            for p, grad in hidden:
                p.grad = grad
        for group, params in zip(self.param_groups, ours):
            if params:
                self._step_with_copies(group, params)
        return loss

    def _step_with_copies(self, group: dict, params: list[torch.nn.Parameter]) -> None:
        states = [self._state(p) for p in params]
        torch._foreach_add_([s["step"] for s in states], 1)  # one launch for all counts, as torch's fused step
        beta1, beta2 = group["betas"]
        for p, state in zip(params, states):
            launch_adamw(p.grad, AdamWStep(p, state["exp_avg"], state["exp_avg_sq"], state["step"], group["lr"], beta1,
                                           beta2, group["eps"], group["weight_decay"], compute_copies.copy_to_write(p)))
            compute_copies.written(p)

    def _state(self, p: torch.nn.Parameter) -> dict:
        """p's state, made as torch's fused AdamW makes it at p's first step."""
        state = self.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state


def _torch_step(optimizer: AdamW) -> None:
    """torch.optim.AdamW's step without the step hooks: once torch has made an AdamW of its own, it wraps that
    class's step with them (Optimizer._patch_step_function), and ours, wrapped the same way, has run them already."""
    step = torch.optim.AdamW.step
    if getattr(step, "hooked", False):
        step = step.__wrapped__
    step(optimizer)


def _kernel_steps(p: torch.nn.Parameter, group: dict) -> bool:
    """Whether the copy-writing kernel steps p (see AdamW)."""
    grad = p.grad
    return (compute_copies.wanted_dtype(p) is not None and grad is not None and (p.is_cuda or interpreting())
            and p.dtype == torch.float32 and grad.dtype == torch.float32 and not grad.is_sparse
            and p.is_contiguous() and grad.is_contiguous() and group["fused"] and not group["amsgrad"]
            and not group["maximize"] and not torch.is_tensor(group["lr"]))
