"""Low-overhead launches (kernels/launch.py) without a GPU: the argument lists, the binary cache's bookkeeping (with
a stand-in kernel: CI cannot load binaries), the CUDA graph cache's policy (stand-in graphs), and the keys and
plans of the fused quantized all-reduce and GEMM + all-reduce (16-byte alignment and dtype in the key; plans
dropped when their buffers grow)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from fused_dlrm.dist.symmetric import SimulatedWorld
from fused_dlrm.kernels.gemm_allreduce import ALL_PHASES, GemmAllReduce
from fused_dlrm.kernels import launch
from fused_dlrm.kernels.launch import Arguments, CompiledLaunches, GraphReplays, aligned, resident_programs_per_sm
from fused_dlrm.kernels.quantized_allreduce import FusedQuantizedAllReduce, quantized_all_reduce_reference
from world import run_world

interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs in the Triton interpreter")


@triton.jit
def _one_minus_kernel(out_ptr, x):
    tl.store(out_ptr, 1.0 - x)


def test_float_arguments_reach_kernels_as_fp32_as_on_gpus():
    """A Python float argument is fp32 in the kernel (Triton types it so): 1 - 0.999 there is 1 - fp32(0.999),
    1.3e-5 off. The interpreter kept the double (conftest rounds it now), so CI missed such errors (the AdamW
    kernel's 1 - beta2)."""
    out = torch.zeros(1, dtype=torch.float64, device="cuda" if torch.cuda.is_available() else "cpu")
    _one_minus_kernel[(1,)](out, 0.999)
    assert float(out) == float(np.float32(1.0) - np.float32(0.999)) != float(np.float32(1.0 - 0.999))


def _float_argument_in_a_rank(rank: int, world_size: int) -> None:
    test_float_arguments_reach_kernels_as_fp32_as_on_gpus()


@interpreter
def test_a_worlds_ranks_get_float_arguments_as_fp32_too():
    """world.py's ranks do not run conftest: world.py imports interpreter_floats itself."""
    run_world(2, _float_argument_in_a_rank)


class StandInKernel:
    """What CompiledLaunches uses of a JITFunction: arg_names, warmup (compile) and kernel[grid](...) (launch)."""
    arg_names = ["x_ptr", "n", "epoch", "BLOCK"]

    def __init__(self):
        self.log = []

    def warmup(self, *args, grid, **options):
        self.log.append(("compile", args, options))
        return StandInBinary(self.log)

    def __getitem__(self, grid):
        return lambda *args, **options: self.log.append(("jit launch", grid, args))


class StandInBinary:
    def __init__(self, log):
        self.log = log

    def _init_handles(self):
        self.log.append(("load",))

    def __getitem__(self, grid):
        return lambda *args: self.log.append(("binary launch", grid, args))


def test_arguments_are_placed_by_name_and_filled_per_call():
    args = Arguments(StandInKernel, ("x_ptr", "epoch"), BLOCK=64, n=10)
    assert args("x", 7) == ("x", 10, 7, 64)
    assert args("y", 8) == ("y", 10, 8, 64)  # the template is not changed by a call
    with pytest.raises(TypeError):
        Arguments(StandInKernel, ("x_ptr",), n=10, BLOCK=64)  # epoch given nowhere
    with pytest.raises(TypeError):
        Arguments(StandInKernel, ("x_ptr", "epoch"), n=10, BLOCK=64, extra=1)


def test_a_key_compiles_once_then_launches_its_binary():
    kernel = StandInKernel()
    launches = CompiledLaunches(kernel)
    launches.interpret = False  # as on a GPU
    launches("a", (4, 1, 1), ("x", 10, 1, 64), {"num_warps": 4})
    launches("a", (4, 1, 1), ("x2", 10, 2, 64), {"num_warps": 4})
    launches("b", (2, 1, 1), ("x", 32, 3, 64), {"num_warps": 4})
    assert kernel.log == [("compile", ("x", 10, 1, 64), {"num_warps": 4}), ("load",),
                          ("binary launch", (4, 1, 1), ("x", 10, 1, 64)),
                          ("binary launch", (4, 1, 1), ("x2", 10, 2, 64)),  # no compile: the key's binary
                          ("compile", ("x", 32, 3, 64), {"num_warps": 4}), ("load",),
                          ("binary launch", (2, 1, 1), ("x", 32, 3, 64))]


def test_the_interpreter_always_launches_through_the_jit_function():
    kernel = StandInKernel()
    launches = CompiledLaunches(kernel)
    launches.interpret = True
    for epoch in (1, 2):
        launches("a", (4, 1, 1), ("x", 10, epoch, 64), {})
    assert launches.compiled("a", (4, 1, 1), ("x", 10, 1, 64), {}) is None
    assert kernel.log == [("jit launch", (4, 1, 1), ("x", 10, 1, 64)), ("jit launch", (4, 1, 1), ("x", 10, 2, 64))]


class StandInGraph:
    """What GraphReplays uses of a captured CUDA graph: replay(), which runs the captured work again."""
    def __init__(self, log, work):
        self.log, self.work = log, work

    def replay(self):
        self.log.append("replay")
        self.work()


def test_graphs_are_captured_on_a_key_second_call_and_kept(monkeypatch):
    log, capturing = [], [False]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    monkeypatch.setattr(launch, "capture_graph", lambda work: log.append("capture") or StandInGraph(log, work))
    replays = GraphReplays(max_graphs=2)
    for key in ("a", "a", "a", "b", "b", "c", "c", "c", "a"):
        replays(key, lambda key=key: log.append(key))
    assert log == ["a", "capture", "replay", "a", "replay", "a",
                   "b", "capture", "replay", "b",
                   "c", "c", "c",  # two graphs held: c launches directly, and no graph is dropped for it
                   "replay", "a"]
    assert len(replays) == 2
    log.clear()
    capturing[0] = True  # inside a caller's capture: launched, so that the caller's graph holds the kernel
    replays("a", lambda: log.append("a"))
    assert log == ["a"]


def test_keys_seen_once_are_forgotten_oldest_first(monkeypatch):
    log = []
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(launch, "capture_graph", lambda work: log.append("capture") or StandInGraph(log, work))
    replays = GraphReplays(max_graphs=1)  # remembers 4 keys seen once
    for key in ("a", "b", "c", "d", "e", "a", "e"):
        replays(key, lambda key=key: log.append(key))
    assert log == ["a", "b", "c", "d", "e", "a", "capture", "replay", "e"]  # a was forgotten when e came


def test_resident_programs_per_sm():
    """sm_90: 65,536 registers, 228 KiB of shared memory (1 KiB reserved per program), 2,048 threads per SM."""
    assert resident_programs_per_sm(32, 4, 8192) == 16  # threads: 16 x 128
    assert resident_programs_per_sm(126, 4, 2048) == 4  # 128 registers x 128 threads each
    assert resident_programs_per_sm(41, 4, 0) == 10  # 48 registers per thread (41 unrounded would fit 12)
    assert resident_programs_per_sm(64, 8, 0) == 4
    assert resident_programs_per_sm(32, 4, 113 * 1024) == 2
    assert resident_programs_per_sm(32, 4, 114 * 1024) == 1  # 2 x (114 + 1) KiB > 228 KiB
    assert resident_programs_per_sm(16, 1, 0) == 32  # at most 32 programs per SM


def test_alignment():
    base = torch.zeros(64, dtype=torch.bfloat16)
    assert aligned(base) and aligned(base[8:]) and not aligned(base[1:]) and not aligned(base[4:])


def test_quantized_all_reduce_key_follows_alignment_and_dtype_not_shape():
    key = FusedQuantizedAllReduce._key
    x = torch.zeros(1000, dtype=torch.bfloat16)
    out = torch.empty_like(x)
    assert key(x[:992], out, "q8", False) == key(x[8:], out, "q8", False) == key(x[:992].view(31, 32), out, "q8",
                                                                                  False)
    assert key(x[1:993], out, "q8", False) != key(x[:992], out, "q8", False)  # 2-byte offset: not aligned
    assert key(x[:992], out[1:993], "q8", False) != key(x[:992], out[:992], "q8", False)
    assert key(x[:992].float(), out, "q8", False) != key(x[:992], out, "q8", False)
    assert key(x, out, "q8", True) != key(x, out, "q4", True) != key(x, out, "q4", False)


def test_gemm_allreduce_key_follows_strides_alignment_dtype_and_form():
    def key(x, w, phases=ALL_PHASES, scatter=False):
        return GemmAllReduce._key(x, w, phases, scatter)

    x = torch.zeros(4, 48, dtype=torch.float16)
    w = torch.zeros(48, 32, dtype=torch.float16)
    assert key(x, w) == key(x.clone(), w.clone())
    assert key(x, w.t().contiguous().t()) != key(x, w)  # strides (K, 1) vs (1, K)
    flat = torch.zeros(4 * 48 + 1, dtype=torch.float16)
    assert key(flat[1:].view(4, 48), w) != key(flat[:-1].view(4, 48), w)
    assert key(x.bfloat16(), w.bfloat16()) != key(x, w)
    assert key(x, w) != key(x, w, 1)
    assert key(x, w) != key(x, w, scatter=True)


@interpreter
def test_quantized_all_reduce_plans_are_reused_and_dropped_when_buffers_grow():
    world = [FusedQuantizedAllReduce(ws, 2, 50) for ws in SimulatedWorld(2).workspaces()]

    def all_reduce(xs):
        calls = [op.start(x, "q8") for op, x in zip(world, xs)]
        for phase in (0, 1, 2):
            for op, call in zip(world, calls):
                op.run(call, phase, phase)
        for op, call in zip(world, calls):
            assert torch.equal(op.finish(call), quantized_all_reduce_reference(xs, "q8"))
        return calls[0].plan

    gen = torch.Generator().manual_seed(1)
    small = all_reduce([torch.randn(300, generator=gen) for _ in world])
    assert all_reduce([torch.randn(300, generator=gen) for _ in world]) is small
    unaligned = all_reduce([torch.randn(301, generator=gen)[1:] for _ in world])  # 4-byte offset
    assert unaligned is not small and unaligned.recv is small.recv
    large = all_reduce([torch.randn(5000, generator=gen) for _ in world])  # grows recv and gather
    assert large.recv is not small.recv
    again = all_reduce([torch.randn(300, generator=gen) for _ in world])
    assert again is not small and again.recv is large.recv  # planned anew, in the grown buffers


@interpreter
def test_gemm_allreduce_plans_are_reused_and_dropped_when_buffers_grow():
    op = GemmAllReduce(SimulatedWorld(1).workspaces()[0], num_programs=1, spin_limit=50, block_n=16, block_k=16)
    gen = torch.Generator().manual_seed(2)

    def call(m, k, n):
        x, w = torch.randn(m, k, generator=gen).half(), torch.randn(k, n, generator=gen).half()
        epoch = op.next_epoch()
        plan = op.launch(x, w, epoch, ALL_PHASES)
        torch.testing.assert_close(op.output(epoch, plan), (x.float() @ w.float()).half(), rtol=2e-3, atol=2e-3)
        return plan

    small = call(2, 32, 20)
    assert call(2, 32, 20) is small
    large = call(8, 32, 40)
    assert large.out is not small.out
    again = call(2, 32, 20)
    assert again is not small and again.out is large.out
