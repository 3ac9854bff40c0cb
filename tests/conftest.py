"""Without a GPU, Triton kernels run in the interpreter (set before any kernel module is imported), with float
arguments typed as on GPUs (interpreter_floats; world.py's ranks import it too)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import interpreter_floats  # noqa: E402,F401  (after TRITON_INTERPRET: it patches the interpreter only)
