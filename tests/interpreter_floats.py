"""Under the Triton interpreter, a Python float kernel argument reaches the kernel as fp32, as on GPUs (Triton types
a Python float so). The interpreter keeps the double: there `1.0 - beta2` came out of 0.999 exact, while a GPU's
is 1.3e-5 off (the AdamW kernel's, found on a GPU only). Imported by conftest and by world.py (its ranks do not
run conftest). Patched whatever TRITON_INTERPRET says (Triton reads it as a boolean: 1, true, on, ...): only the
interpreter calls the patched function."""

import numpy as np
import triton.language as tl
from triton.runtime import interpreter

_implicit_cvt = interpreter._implicit_cvt  # a private function of Triton's: a rename fails this import loudly


def _gpu_typed(arg):
    if isinstance(arg, float):
        return tl.tensor(interpreter.TensorHandle(np.array([arg], dtype=np.float32), tl.float32), tl.float32)
    return _implicit_cvt(arg)


interpreter._implicit_cvt = _gpu_typed
