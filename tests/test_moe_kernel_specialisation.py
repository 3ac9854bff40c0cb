"""No MoE kernel compiles again in the middle of training because an int argument changed.

Triton specialises an int argument on == 1 and on % 16 == 0 unless it is do_not_specialize; a row count, tile
count or grid that crosses such a value compiles another variant: 112 ms for the SwiGLU backward's first row count
that was a multiple of 16 on one H200, and the likely cause of a 666 ms step of the fine-grained MoE Transformer on
2 x H200 (2026-11-24, docs/benchmarks.md R5, R6). So every int argument is do_not_specialize but the rank, which is
fixed per process; floats are never specialised.
"""

import importlib
import inspect

import pytest
import triton.language as tl

MODULES = ["moe.expert_layout", "moe.permute", "moe.routing", "moe.kernels.fused_combine",
           "moe.kernels.fused_dispatch", "moe.kernels.grouped_weight_grad", "moe.kernels.swiglu_backward"]
FIXED_OR_FLOAT = {"rank", "aux_scale", "z_scale"}


def kernels():
    for module in MODULES:
        for name, kernel in vars(importlib.import_module(module)).items():
            if name.endswith("_kernel") and hasattr(kernel, "fn"):
                yield f"{module}.{name}", kernel


@pytest.mark.parametrize("name,kernel", list(kernels()), ids=lambda v: v if isinstance(v, str) else "")
def test_every_int_argument_that_changes_between_calls_is_not_specialised(name, kernel):
    # JITFunction, or the interpreter's wrapper of one (which keeps the decorator's arguments); a JITFunction has no
    # `kwargs`, so a kernel without do_not_specialize must not reach for them on GPUs
    decorator_kwargs = getattr(kernel, "kwargs", {})
    unspecialised = getattr(kernel, "do_not_specialize", None) or decorator_kwargs.get("do_not_specialize") or []
    values = [n for n, p in inspect.signature(kernel.fn).parameters.items()
              if p.annotation not in (tl.constexpr, "tl.constexpr") and not n.endswith(("_ptr", "_ptrs", "_desc"))]
    assert set(values) - FIXED_OR_FLOAT <= set(unspecialised), set(values) - FIXED_OR_FLOAT - set(unspecialised)


def test_the_modules_hold_the_kernels():
    assert len(list(kernels())) >= 15  # a renamed module would otherwise leave nothing to check
