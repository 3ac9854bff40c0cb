"""Triton kernels; each file holds a kernel, its pure-torch reference and its launcher."""

import torch
import triton.language as tl

TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}  # torch -> Triton


def dot_precision(dtype: torch.dtype, device: torch.device) -> str | None:
    """tl.dot's input precision: fp32 operands through TF32 where torch's own fp32 GEMMs use it (on GPUs with
    torch.backends.cuda.matmul.allow_tf32, which trainer.tf32 sets), exact ("ieee") otherwise; None (Triton's
    default) for fp16 / bf16."""
    if dtype != torch.float32:
        return None
    return "tf32" if device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32 else "ieee"
