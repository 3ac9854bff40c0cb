"""Triton kernels; each file holds a kernel, its pure-torch reference and its launcher."""

import torch
import triton.language as tl

TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}  # torch -> Triton
