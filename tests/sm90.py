"""Compile Triton kernels for sm_90 without a GPU: what only the GPU compiler enforces (types, integer arguments
equal to 1 arriving as constexprs, tl.dot shapes and dtypes, shared memory) is checked on CI's CPUs.

`compile_for_sm90(script)` runs the script in a fresh process without the interpreter; the script calls
`build(fn, types, constants, num_warps=4, num_stages=3)`: `types` maps argument names to Triton types (pointers
"*fp16", ...; others default to "i32"), `constants` the constexpr arguments, `divisible` the integer arguments a launch passes as multiples of 16
(Triton specialises those, which enables e.g. software pipelining of loops over them); it returns the compiled kernel (its
`asm` holds the TTGIR and PTX).
"""

from __future__ import annotations

import os
import subprocess
import sys

PREAMBLE = '''
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

def build(fn, types, constants, num_warps=4, num_stages=3, divisible=()):
    names = fn.arg_names
    signature = {n: "constexpr" if n in constants else types.get(n, "i32") for n in names}
    aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
               if types.get(n, "").startswith("*") or n in divisible}
    kernel = triton.compile(ASTSource(fn, signature, {(names.index(n),): v for n, v in constants.items()}, aligned),
                            target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, "num_stages": num_stages})
    assert kernel.metadata.shared <= 227 * 1024, (fn.__name__, kernel.metadata.shared)
    return kernel
'''


def compile_for_sm90(script: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-c", PREAMBLE + script], cwd=root, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
