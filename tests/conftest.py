"""Without a GPU, Triton kernels run in the interpreter (set before any kernel module is imported), with float
arguments typed as on GPUs."""

import os

import numpy as np
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

if os.environ.get("TRITON_INTERPRET") == "1":
    import triton.language as tl
    from triton.runtime import interpreter

    _implicit_cvt = interpreter._implicit_cvt

    def _gpu_typed(arg):
        """A float argument as a GPU's kernel receives it: fp32 (Triton types a Python float so). The interpreter
        keeps the double, so there `1.0 - beta2` came out of 0.999 exact, while a GPU's is 1.3e-5 off."""
        if isinstance(arg, float):
            return tl.tensor(interpreter.TensorHandle(np.array([arg], dtype=np.float32), tl.float32), tl.float32)
        return _implicit_cvt(arg)

    interpreter._implicit_cvt = _gpu_typed
