"""Without a GPU, Triton kernels run in the interpreter (set before any kernel module is imported)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
