"""Compile Triton kernels for sm_90 without a GPU: what only the GPU compiler enforces (types, integer arguments
equal to 1 arriving as constexprs, tl.dot shapes and dtypes, shared memory) is checked on CI's CPUs.

`compile_for_sm90(script)` runs the script in a fresh process without the interpreter; the script calls
`build(fn, types, constants, num_warps=4, num_stages=3)`: `types` maps argument names to Triton types (pointers
"*fp16", ...; others default to "i32"), `constants` the constexpr arguments, `divisible` the integer arguments a launch passes as multiples of 16
(Triton specialises those, which enables e.g. software pipelining of loops over them); it returns the compiled kernel (its
`asm` holds the TTGIR and PTX). `build_launch(fn, args, options)` compiles fn as a launch with those arguments
would (Triton's own binder specialises them); `resources(kernel)`: its registers and stack (spills) per thread.
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

def build_launch(fn, args, options, **constants):
    """fn compiled as a launch with `args` (every argument in order, constexprs included) and `options` compiles
    it: Triton's own binder and argument packing (its specialisation: ints equal to 1 constexprs, multiples of 16
    and 16-byte aligned tensors divisible, but for do_not_specialize arguments), for sm_90; `constants` replace
    constexprs (e.g. the interpreter's)."""
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature
    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    args = [constants.get(name, value) for name, value in zip(fn.arg_names, args)]
    bound, specialization, given = create_function_from_signature(fn.signature, fn.params, backend)(*args, **options)
    options, signature, fixed, aligned = fn._pack_args(backend, options, bound, specialization, given)
    return triton.compile(ASTSource(fn, signature, fixed, aligned), target=target, options=options.__dict__)

def resources(kernel):
    """(registers per thread, stack bytes per thread: spills) of a compiled kernel, read by Triton's cuobjdump."""
    import os, re, subprocess, tempfile
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True,
                               check=True).stdout
    return int(re.search(r"REG:(\d+)", usage).group(1)), int(re.search(r"STACK:(\d+)", usage).group(1))
'''


def compile_for_sm90(script: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-c", PREAMBLE + script], cwd=root, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
