"""Triton kernels; each file holds a kernel, its pure-torch reference and its launcher."""

import torch
import triton.language as tl

TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}  # torch -> Triton
# The dtypes that ranks name to each other as integers (`dtype_code`: call signatures, the input dist's header).
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16,
          torch.int8, torch.uint8, torch.bool)


def dtype_code(dtype: torch.dtype | None) -> int:
    """A dtype as an integer ranks can send or compare: 1 + its index in DTYPES; 0 for None (none: no tensor, no
    autocast), -1 for a dtype not in DTYPES."""
    if dtype is None:
        return 0
    return DTYPES.index(dtype) + 1 if dtype in DTYPES else -1


def dtype_name(code: int) -> str:
    """A `dtype_code` in words: "bfloat16", "none" (0), "another dtype" (-1, or a code of no dtype)."""
    if code == 0:
        return "none"
    return str(DTYPES[code - 1]).removeprefix("torch.") if 0 < code <= len(DTYPES) else "another dtype"


def dot_precision(dtype: torch.dtype, device: torch.device) -> str | None:
    """tl.dot's input precision: fp32 operands through TF32 where torch's own fp32 GEMMs use it (on GPUs with
    torch.backends.cuda.matmul.allow_tf32, which trainer.tf32 sets), exact ("ieee") otherwise; None (Triton's
    default) for fp16 / bf16."""
    if dtype != torch.float32:
        return None
    return "tf32" if device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32 else "ieee"
