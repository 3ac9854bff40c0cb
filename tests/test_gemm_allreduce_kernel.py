"""The fused GEMM + all-reduce kernel on simulated worlds of 2 and 4 ranks (interpreter on CPU).

Every rank's phase runs before any rank's next phase (the interpreter runs programs one after another, so the
one-launch form of a GPU would wait forever on programs that have not started). Outputs are compared with the
float64 sum of the ranks' products; buffers are poisoned with NaN before each call so any unwritten output
element or unwritten partial tile shows.
"""

from __future__ import annotations

import functools
import os
import re
from dataclasses import replace

import pytest
import torch

from fused_dlrm.dist.symmetric import SimulatedWorld
from fused_dlrm.kernels import gemm_allreduce
from fused_dlrm.kernels.gemm_allreduce import (PRODUCE, REDUCE, WAIT, GemmAllReduce, default_split_k,
                                               gemm_allreduce_reference, gemm_reduce_scatter_reference)
from fused_dlrm.kernels.peer_flags import PeerCallMismatch, PeerRefusedInput, PeerWaitTimeout
from sm90 import compile_for_sm90

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs in the Triton interpreter")

TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 2e-3}  # relative to the largest |output|: one output rounding


ALGORITHMS = ("one_shot", "two_shot")


class World:
    def __init__(self, world_size: int, num_programs: int = 3, split_k: int | None = None,
                 algorithm: str = "two_shot", device: str = "cpu", spin_limit: int = 50):
        self.shared = SimulatedWorld(world_size, device)
        self.ops = [small_op(ws, num_programs=num_programs, split_k=split_k, algorithm=algorithm,
                             spin_limit=spin_limit) for ws in self.shared.workspaces()]

    def poison(self, xs, ws, scatter: bool = False) -> None:
        """NaN into the world's partials and outputs, after the ops have made their buffers for calls like (xs, ws)
        (an op makes them on its first call of a shape: poisoned before that, nothing would be)."""
        for op, x, w in zip(self.ops, xs, ws):
            for phase in (PRODUCE, REDUCE, WAIT):
                op.prepare(x, w, phase, scatter)
        poison(self.shared)

    def __call__(self, xs, ws, scatter: bool = False) -> list[torch.Tensor]:
        """Every rank's output of one call; scatter: the reduce-scatter form."""
        return [output().clone() for output in self.launch(self.ops, xs, ws, [scatter] * len(xs))]

    @staticmethod
    def launch(ops, xs, ws, scatters) -> list:
        """Launch one call of every rank's op (its own form, scatter or not), phase by phase; returns each rank's
        `output` (which raises the rank's error)."""
        epochs = [op.next_epoch() for op in ops]
        for phase in (PRODUCE, REDUCE, WAIT):
            plans = [op.launch(x, w, e, phase, s) for op, x, w, e, s in zip(ops, xs, ws, epochs, scatters)]
        return [functools.partial(op.output, e, plan) for op, e, plan in zip(ops, epochs, plans)]


def poison(world: SimulatedWorld) -> None:
    """NaN into every data buffer of a simulated world: the floating ones, and bytes (the GEMM + all-reduce's outputs:
    0xFFFF is NaN in fp16 and bf16)."""
    for tensors in world.buffers.values():
        for t in tensors:
            if t.is_floating_point():
                t.fill_(float("nan"))
            elif t.dtype == torch.uint8:
                t.fill_(255)


def small_op(ws, grid: int | None = None, **kwargs) -> GemmAllReduce:
    """An op of small tiles (N and K by 16) on 3 programs, two-shot, with short waits; but for `kwargs`. grid: its
    grid, on the flags of `num_programs` (as the grid rule would give on a GPU of other SMs)."""
    op = GemmAllReduce(ws, **{**dict(num_programs=3, spin_limit=50, block_n=16, block_k=16, algorithm="two_shot"),
                              **kwargs})
    op.given_programs = grid or op.given_programs
    return op


def random_inputs(world_size, m, k, n, dtype, gen, device="cpu"):
    xs = [torch.randn(m, k, generator=gen).to(device, dtype) for _ in range(world_size)]
    ws = [(torch.randn(k, n, generator=gen) / k ** 0.5).to(device, dtype) for _ in range(world_size)]
    return xs, ws


def assert_all_reduced(outs, xs, ws):
    expected = gemm_allreduce_reference(xs, ws)
    for got in outs:
        assert got.shape == expected.shape and not got.isnan().any()
        err = (got.double() - expected).abs().max() / expected.abs().max()
        assert err < TOLERANCE[got.dtype], f"relative error {err:.2e}"
        assert torch.equal(got, outs[0])  # the fixed reduction order makes every rank's copy identical


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("m", [1, 5, 64, 150])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_matches_reference(world_size, m, dtype, algorithm):
    """N = 50: four tiles of 16, the last one partial; at 4 ranks one tile per rank. K = 40: a partial K tile.
    M = 150: MANY_ROWS's two rows of tiles of 128, the second one partial (22 rows)."""
    world = World(world_size, algorithm=algorithm)
    gen = torch.Generator().manual_seed(m)
    for _ in range(2):  # both halves of the double buffers
        xs, ws = random_inputs(world_size, m, 40, 50, dtype, gen)
        world.poison(xs, ws)
        assert_all_reduced(world(xs, ws), xs, ws)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("world_size,m,n", [(4, 3, 20), (2, 3, 7), (4, 3, 130), (8, 3, 130), (4, 150, 40),
                                            (8, 65, 7)])
def test_skewed_shapes(world_size, m, n, algorithm):
    """Ranks owning no tile (N = 20 is two tiles for 4 ranks; N = 7 one partial tile) and more tiles than
    programs (N = 130 at 3 programs; at 8 ranks a partial tile on the last owner). Many rows (tiles of 128
    rows): M = 150 and N = 40 are 2 x 3 tiles over 4 ranks, so rank 1's two tiles lie in both rows of tiles and
    rank 3 owns none; M = 65 and N = 7: one tile of 65 rows over 8 ranks."""
    world = World(world_size, algorithm=algorithm)
    gen = torch.Generator().manual_seed(n)
    xs, ws = random_inputs(world_size, m, 24, n, torch.bfloat16, gen)
    world.poison(xs, ws)
    assert_all_reduced(world(xs, ws), xs, ws)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("split_k,m,k", [(3, 2, 100), (None, 1, 1024)])
def test_split_k(world_size, split_k, m, k, algorithm):
    """K in chunks over 5 programs (3 given for N = 70, five tiles; 2 by default_split_k for a GEMV with K = 1024
    and N = 20, two tiles): each tile's units come from several programs of every source."""
    if split_k is None:
        assert default_split_k(m, k, 2, 5, 16) == 2  # units within one per program (K / (16 BLOCK_K) allows 4)
        assert default_split_k(m, k, 5, 5, 16) == 1  # as many tiles as programs: no split
        assert default_split_k(m, 200, 2, 5, 16) == 1  # K = 200: chunks of 16 BLOCK_K tiles leave one
    world = World(world_size, num_programs=5, split_k=split_k, algorithm=algorithm)
    gen = torch.Generator().manual_seed(3)
    for _ in range(2):
        xs, ws = random_inputs(world_size, m, k, 70 if split_k else 20, torch.float16, gen)
        world.poison(xs, ws)
        assert_all_reduced(world(xs, ws), xs, ws)
    assert all(plan.split_k == (split_k or 2) for plan in world.ops[0]._plans.values())


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_one_launch_in_a_world_of_one(algorithm):
    """The GPU form (all phases in one launch) where the interpreter can run it: one rank, one program."""
    op = GemmAllReduce(SimulatedWorld(1).workspaces()[0], num_programs=1, spin_limit=50, block_n=16, block_k=16,
                       algorithm=algorithm)
    gen = torch.Generator().manual_seed(4)
    xs, ws = random_inputs(1, 5, 40, 50, torch.bfloat16, gen)
    assert_all_reduced([op(xs[0], ws[0])], xs, ws)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_many_consecutive_calls_on_the_same_flags(algorithm):
    world = World(2, num_programs=2, algorithm=algorithm)
    gen = torch.Generator().manual_seed(5)
    calls = 20  # each half of the double buffers 10 times (a call: ~0.2 s of CPU in the interpreter, 0.8 s on CI)
    for step in range(calls):
        xs, ws = random_inputs(2, 2, 16, 20, torch.bfloat16, gen)
        outs = world(xs, ws)
        assert_all_reduced(outs, xs, ws)
    assert world.ops[0].ws.next_epoch("gemm_allreduce") == calls + 1
    # One-shot raises no output flags (no rank stores into another's output); two-shot raised all of them.
    done = torch.stack(world.ops[0].ws.peer_tensors(world.ops[0].done))
    assert done.eq(0).all() if algorithm == "one_shot" else done.eq(calls).all()


def test_grids_that_change_with_the_shape_share_the_flags():
    """FEW_ROWS's grid rule (one program per SM for shapes of at most one tile per SM, else PROGRAMS_PER_SM)
    with 3 "SMs": N = 20 (2 tiles) runs on 3 programs, N = 70 (5 tiles) on 6, alternating, on flags laid out for
    6 programs (a flag slot keeps its meaning whatever the grid). The interpreter runs the phases one after
    another, so this checks the grid choice and the results, not the timing of the flags."""
    world = World(2, num_programs=6)
    for op in world.ops:
        op.given_programs, op.sm_count = None, 3
    for n, plan in alternating_calls(world, 1, seed=6):
        assert plan.num_programs == (3 if n == 20 else 6)


def alternating_calls(world: World, m: int, seed: int):
    """Calls alternating N = 20 and N = 70 (20, 70, 70, 20, twice) on one world's flags and double buffers, each
    checked; yields N and rank 0's plan of each call."""
    gen = torch.Generator().manual_seed(seed)
    for step in range(8):
        n = (20, 70, 70, 20)[step % 4]
        xs, ws = random_inputs(2, m, 40, n, torch.bfloat16, gen)
        world.poison(xs, ws)
        assert_all_reduced(world(xs, ws), xs, ws)
        yield n, world.ops[0]._plans[world.ops[0]._key(xs[0], ws[0], WAIT, False)]


def test_auto_alternates_algorithms_on_the_same_flags(monkeypatch):
    """algorithm="auto" by the bytes a rank pushes: with the bound at 512, M=4 fp32 partials of N=20 (320 bytes)
    run one-shot and of N=70 (1,120 bytes) two-shot, alternating on one op's flags and double buffers (a one-shot
    call after a two-shot one, and back, in both halves)."""
    monkeypatch.setattr(gemm_allreduce, "ONE_SHOT_MAX_BYTES", 512)
    world = World(2, split_k=1, algorithm="auto")
    for n, plan in alternating_calls(world, 4, seed=7):
        assert plan.one_shot == (n == 20)


def test_prepare_plans_without_launching():
    """prepare() makes (on GPUs also compiles) the plan the next call of that shape uses, and launches nothing:
    no flag is raised."""
    world = World(2)
    gen = torch.Generator().manual_seed(8)
    xs, ws = random_inputs(2, 3, 40, 50, torch.bfloat16, gen)
    plans = [op.prepare(x, w, PRODUCE) for op, x, w in zip(world.ops, xs, ws)]  # the simulated launches' keys
    flags = world.ops[0].ws.peer_tensors(world.ops[0].ready)  # every rank's, shared by the ops
    assert all(f.eq(0).all() for f in flags)
    assert_all_reduced(world(xs, ws), xs, ws)
    assert all(f.eq(1).any() for f in flags)  # the call raised them
    assert all(op._plans[op._key(x, w, PRODUCE, False)] is plan for op, x, w, plan in zip(world.ops, xs, ws, plans))


def test_calls_of_either_dtype_share_the_output_buffer():
    """fp16 and bf16 calls in turn, each checked, keep the output buffer (its bytes) and every plan: a typed buffer
    was allocated anew at each change of dtype (on GPUs a collective that synchronises the device)."""
    world = World(2)
    gen = torch.Generator().manual_seed(11)
    for step in range(4):
        xs, ws = random_inputs(2, 3, 24, 40, (torch.bfloat16, torch.float16)[step % 2], gen)
        world.poison(xs, ws)
        assert_all_reduced(world(xs, ws), xs, ws)
        if step == 0:
            out = world.ops[0].ws._buffers["gemm_allreduce_out"]
    assert world.ops[0].ws._buffers["gemm_allreduce_out"] is out
    assert len(world.ops[0]._plans) == 2 * 3  # both dtypes' plans of every phase, none dropped


def test_unknown_algorithm_is_an_error():
    with pytest.raises(ValueError, match="algorithm='three_shot'"):
        GemmAllReduce(SimulatedWorld(2).workspaces()[0], num_programs=1, algorithm="three_shot")


def assert_reduce_scattered(outs, xs, ws):
    for got, expected in zip(outs, gemm_reduce_scatter_reference(xs, ws), strict=True):
        assert got.shape == expected.shape and not got.isnan().any()
        err = (got.double() - expected).abs().max() / expected.abs().max()
        assert err < TOLERANCE[got.dtype], f"relative error {err:.2e}"


@pytest.mark.parametrize("world_size,m", [(2, 2), (2, 10), (2, 300), (4, 4), (4, 260)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reduce_scatter_matches_reference(world_size, m, dtype):
    """Each rank gets its band of M / world rows of the sum: bands of one row, of 5, of 150 (MANY_ROWS's tiles of
    128: the band's second row of tiles has 22 rows), of 65 (one tile of 65 rows). N = 50: four tiles of 16, the
    last one partial; K = 40: a partial K tile. Two calls: both halves of the double buffers."""
    world = World(world_size)
    gen = torch.Generator().manual_seed(m)
    for _ in range(2):
        xs, ws = random_inputs(world_size, m, 40, 50, dtype, gen)
        world.poison(xs, ws, scatter=True)
        assert_reduce_scattered(world(xs, ws, scatter=True), xs, ws)


def test_reduce_scatter_splits_k():
    """K in 3 chunks over 5 programs: each tile's units come from several programs of every source."""
    world = World(2, num_programs=5, split_k=3)
    gen = torch.Generator().manual_seed(8)
    xs, ws = random_inputs(2, 6, 100, 70, torch.float16, gen)
    world.poison(xs, ws, scatter=True)
    assert_reduce_scattered(world(xs, ws, scatter=True), xs, ws)
    assert all(plan.split_k == 3 for plan in world.ops[0]._plans.values())


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_reduce_scatter_and_all_reduce_alternate_on_the_same_flags(algorithm):
    """Calls of both forms in turn on one world's flags, epochs and double buffers, every output checked."""
    world = World(2, algorithm=algorithm)
    gen = torch.Generator().manual_seed(9)
    for step in range(6):
        scatter = step % 3 != 1
        xs, ws = random_inputs(2, 4 + 2 * step, 24, 40, torch.bfloat16, gen)
        outs = world(xs, ws, scatter=scatter)
        if scatter:
            assert_reduce_scattered(outs, xs, ws)
        else:
            assert_all_reduced(outs, xs, ws)


def test_a_call_needing_halves_of_2_31_elements_is_refused_before_allocating():
    """The halves' offsets are kernel arguments not in the plan key: a larger call would reuse an int32 binary."""
    op = GemmAllReduce(SimulatedWorld(2).workspaces()[0], num_programs=1)
    x, w = torch.empty(1 << 20, 8, dtype=torch.bfloat16), torch.empty(8, 1 << 12, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="needs buffers of 2\\^31 elements or more per half"):
        op.prepare(x, w)


@pytest.mark.parametrize("scatter", [False, True])
def test_an_empty_batch_is_a_call_of_its_own(scatter):
    """M = 0 on every rank (the bulk twins take it too): empty outputs, no data buffer asked for; the call still
    raises its flags and compares its peers' calls (a peer's call of rows raises: DIFFERENCES["no rows"]), so the
    calls around it stay exact."""
    world = World(3)
    gen = torch.Generator().manual_seed(12)
    for m in (6, 0, 0, 9):
        xs, ws = random_inputs(3, m, 40, 50, torch.bfloat16, gen)
        if m == 0:
            assert all(out.shape == (0, 50) for out in world(xs, ws, scatter))
            continue
        world.poison(xs, ws, scatter)
        outs = world(xs, ws, scatter)
        assert_reduce_scattered(outs, xs, ws) if scatter else assert_all_reduced(outs, xs, ws)
    assert all(op.ws._epochs["gemm_allreduce"] == 4 for op in world.ops)
    empty = SimulatedWorld(2).workspaces()[0]
    GemmAllReduce(empty, num_programs=1).prepare(torch.empty(0, 8, dtype=torch.bfloat16),
                                                 torch.ones(8, 4, dtype=torch.bfloat16))
    assert not [name for name in empty._buffers if name.endswith(("_recv", "_out"))]


@pytest.mark.parametrize("x_shape,w_shape", [((2, 3, 8), (8, 4)), ((3, 8), (8,)), ((3, 8), (8, 0)), ((3, 0), (0, 4)),
                                             ((3, 8), (6, 4))])
def test_operands_that_are_no_x_m_k_and_w_k_n_are_named(x_shape, w_shape):
    """A batch kept in 3 dims, a 1-D weight, N or K of 0 (a layer of no features per rank), K unlike w's."""
    op = GemmAllReduce(SimulatedWorld(2).workspaces()[0], num_programs=1)
    x, w = torch.ones(x_shape, dtype=torch.bfloat16), torch.ones(w_shape, dtype=torch.bfloat16)
    for scatter in (False, True):
        with pytest.raises(ValueError, match=r"expected x \[M, K\] and w \[K, N\] \(K, N >= 1\) of one dtype"):
            op.prepare(x, w, scatter=scatter)


# A rank's call refused while the others call x [M, 40] @ w [40, 50] bf16: its x's and w's shapes, dtype(s);
# what it raises itself and what its peers say of it. (Uneven bands: the reduce-scatter form's alone.)
BAD_OPERANDS = r"expected x \[M, K\] and w \[K, N\] \(K, N >= 1\) of one dtype, fp16 or bf16; got "
NOT_OPERANDS = r"are not x \[M, K\] and w \[K, N\] \(K, N >= 1\) of one dtype, fp16 or bf16"
REFUSALS = {
    "3-D x": ((2, 3, 40), (40, 50), torch.bfloat16, BAD_OPERANDS + r"\(2, 3, 40\) torch.bfloat16",
              r"its x \[2, 3, 40\] bfloat16 and w \[40, 50\] bfloat16 " + NOT_OPERANDS),
    "1-D w": ((6, 40), (40,), torch.bfloat16, BAD_OPERANDS + r"\(6, 40\) torch.bfloat16 and \(40,\)",
              r"its x \[6, 40\] bfloat16 and w \[40\] bfloat16 " + NOT_OPERANDS),
    "K unlike w's": ((6, 24), (40, 50), torch.bfloat16, BAD_OPERANDS + r"\(6, 24\)",
                     r"its x \[6, 24\] bfloat16 and w \[40, 50\] bfloat16 " + NOT_OPERANDS),
    "no columns": ((6, 40), (40, 0), torch.bfloat16, BAD_OPERANDS + r"\(6, 40\) torch.bfloat16 and \(40, 0\)",
                   r"its x \[6, 40\] bfloat16 and w \[40, 0\] bfloat16 " + NOT_OPERANDS),
    "fp32": ((6, 40), (40, 50), torch.float32, BAD_OPERANDS + r"\(6, 40\) torch.float32",
             r"its x \[6, 40\] float32 and w \[40, 50\] float32 " + NOT_OPERANDS),
    "fp32 x": ((6, 40), (40, 50), (torch.float32, torch.bfloat16), BAD_OPERANDS + r"\(6, 40\) torch.float32 and "
               r"\(40, 50\) torch.bfloat16", r"its x \[6, 40\] float32 and w \[40, 50\] bfloat16 " + NOT_OPERANDS),
    # no memory: expanded zeros; refused before any buffer is asked for
    "too large": ((1 << 20, 40), (40, 1 << 11), torch.bfloat16, r"needs buffers of 2\^31 elements or more per half",
                  r"its x \[1048576, 40\] @ w \[40, 2048\] needs buffers of 2\^31 elements or more per half"),
    "uneven bands": ((5, 40), (40, 50), torch.bfloat16, "cuts M=5 rows into 2 equal bands",
                     r"its reduce-scatter cuts M=5 rows into 2 equal bands \(M must be a multiple of the world size\)"),
    # on another device (meta): the kernel would read it through a pointer of that device; w's call is otherwise
    # the first call's on 2 ranks (x [12, 40]), whose plan the op keeps: the device is in the plan's key
    "x on another device": ((4, 40), (40, 50), torch.bfloat16, r"x \(4, 40\) torch.bfloat16 on meta: expected on",
                            r"its x \[4, 40\] bfloat16 is on another device than its workspace"),
    "w on another device": ((12, 40), (40, 50), torch.bfloat16, r"w \(40, 50\) torch.bfloat16 on meta: expected on",
                            r"its w \[40, 50\] bfloat16 is on another device than its workspace"),
}
CALL_FORMS = {"two-shot": ("two_shot", False), "one-shot": ("one_shot", False), "reduce-scatter": ("two_shot", True)}


def refused_operands(refusal: str, gen: torch.Generator, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    x_shape, w_shape, dtypes, _, _ = REFUSALS[refusal]
    x_dtype, w_dtype = dtypes if isinstance(dtypes, tuple) else (dtypes, dtypes)
    if refusal == "too large":
        x, w = torch.zeros(1, 40, dtype=x_dtype).expand(x_shape), torch.zeros(40, 1, dtype=w_dtype).expand(w_shape)
    else:
        x, w = torch.randn(x_shape, generator=gen).to(x_dtype), torch.randn(w_shape, generator=gen).to(w_dtype)
    x_device, w_device = {"x on another device": ("meta", device), "w on another device": (device, "meta")}.get(
        refusal, (device, device))
    return x.to(x_device), w.to(w_device)


def check_refused_on_some_ranks(world_size: int, refused: tuple[int, ...], refusal: str, form: str,
                                device: str = "cpu") -> None:
    """The ranks `refused` refuse their call (`REFUSALS`): each raises its own error, every other rank
    PeerRefusedInput naming the lowest of them and why, at the same call (a refusing rank still takes part in it:
    its signature says why, its flags rise); the next call, alike on every rank, is exact: the refused call took its
    epoch on every rank. The first call, alike, makes the buffers the second's valid calls use (a rank that grows
    them would wait in the allocation for the refusing ranks, which ask for nothing)."""
    algorithm, scatter = CALL_FORMS[form]
    world = World(world_size, algorithm=algorithm, device=device, spin_limit=50 if device == "cpu" else 1 << 22)
    check = assert_reduce_scattered if scatter else assert_all_reduced
    gen = torch.Generator().manual_seed(len(refused) * 10 + world_size)
    m = 6 * world_size  # the first call's (and the third's) rows: the second's fit in its buffers
    xs, ws = random_inputs(world_size, m, 40, 50, torch.bfloat16, gen, device)
    check(world(xs, ws, scatter), xs, ws)
    xs, ws = random_inputs(world_size, 2 * world_size, 40, 50, torch.bfloat16, gen, device)
    for r in refused:
        xs[r], ws[r] = refused_operands(refusal, gen, device)
    outputs = World.launch(world.ops, xs, ws, [scatter] * world_size)
    _, _, _, error, said = REFUSALS[refusal]
    for rank, output in enumerate(outputs):
        if rank in refused:
            with pytest.raises(ValueError, match=error):
                output()
            continue
        with pytest.raises(PeerRefusedInput, match=rf"^fused GEMM \+ all-reduce at step 2: rank {rank}: rank "
                                                   rf"{refused[0]}'s call was refused: {said}"):
            output()  # on the CPU
            world.ops[rank].errors.check(block=True)  # on GPUs
    assert all(op.ws._epochs["gemm_allreduce"] == 2 for op in world.ops)
    xs, ws = random_inputs(world_size, m, 40, 50, torch.bfloat16, gen, device)
    world.poison(xs, ws, scatter)
    check(world(xs, ws, scatter), xs, ws)
    for op in world.ops:
        op.errors.check(block=True)


@pytest.mark.parametrize("form,refusal", [(form, refusal) for form in CALL_FORMS for refusal in REFUSALS
                                          if refusal != "uneven bands" or form == "reduce-scatter"])
def test_a_call_refused_on_one_rank_raises_on_every_rank(form, refusal):
    check_refused_on_some_ranks(2, (1,), refusal, form)


@pytest.mark.parametrize("form", list(CALL_FORMS))
def test_the_lowest_refusing_rank_is_named_on_every_other_rank(form):
    """Ranks 1 and 2 of 4 refuse: each raises its own error, ranks 0 and 3 name rank 1."""
    check_refused_on_some_ranks(4, (1, 2), "3-D x", form)


def two_ranks(form: str, seed: int, device: str = "cpu"):
    """A World of 2 ranks making calls of `form` (CALL_FORMS): the world, whether its calls scatter, the check of
    their outputs and a generator."""
    algorithm, scatter = CALL_FORMS[form]
    return (World(2, algorithm=algorithm, device=device), scatter,
            assert_reduce_scattered if scatter else assert_all_reduced, torch.Generator().manual_seed(seed))


def refuse(op: GemmAllReduce, w: torch.Tensor, scatter: bool) -> None:
    """A call that op's rank refuses (a 3-D x), all its phases at once: it raises its own error."""
    epoch = op.next_epoch()
    for phase in (PRODUCE, REDUCE, WAIT):
        refused = op.launch(torch.ones(2, 4, 40, dtype=torch.bfloat16, device=w.device), w, epoch, phase, scatter)
    with pytest.raises(ValueError, match=r"expected x \[M, K\]"):
        op.output(epoch, refused)


@pytest.mark.parametrize("form", ["one-shot", "reduce-scatter"])  # two-shot's call 1 waits for rank 1's reduce
def test_a_refused_call_waits_until_every_peer_has_begun_it(form):
    """A refused call, every rank's here (a 3-D x), takes its epoch and ends only once every peer has begun that call
    (a flag of its epoch from each), as a call that runs does: the guard of the double buffers (partials,
    signatures). Rank 0 has finished call 1 once it has rank 1's partials (one-shot and reduce-scatter have no wait
    phase); rank 1 has not reduced them yet. Rank 0's refused call 2 then waits for rank 1's call 2; here (one program
    at a time) it times out, naming rank 1 and step 2 (raised at rank 0's next call, after its own error); on a GPU it
    holds rank 0's next call, which pushes into the half of call 1 that rank 1 still reduces, until rank 1 is done
    with it. The calls after that are exact."""
    world, scatter, check, gen = two_ranks(form, 13)
    ops = world.ops
    xs, ws = random_inputs(2, 4, 40, 50, torch.bfloat16, gen)
    world.poison(xs, ws, scatter)
    epochs = [op.next_epoch() for op in ops]
    plans = [op.launch(x, w, e, PRODUCE, scatter) for op, x, w, e in zip(ops, xs, ws, epochs)]
    outs = [None, None]
    for phase in (REDUCE, WAIT):  # rank 0's device finishes call 1; rank 1's has not reduced it yet
        ops[0].launch(xs[0], ws[0], epochs[0], phase, scatter)
    outs[0] = ops[0].output(epochs[0], plans[0]).clone()
    refuse(ops[0], ws[0], scatter)  # while rank 1 has not begun call 2: its wait times out
    for phase in (REDUCE, WAIT):
        ops[1].launch(xs[1], ws[1], epochs[1], phase, scatter)
    outs[1] = ops[1].output(epochs[1], plans[1]).clone()
    check(outs, xs, ws)
    refuse(ops[1], ws[0], scatter)
    assert [op.ws._epochs["gemm_allreduce"] for op in ops] == [2, 2]
    xs, ws = random_inputs(2, 4, 40, 50, torch.bfloat16, gen)
    outputs = World.launch(ops, xs, ws, [scatter] * 2)
    with pytest.raises(PeerWaitTimeout, match="rank 0 timed out at step 2 waiting for rank 1"):
        outputs[0]()
    outputs[1]()
    for _ in range(2):  # both halves of the double buffers
        xs, ws = random_inputs(2, 4, 40, 50, torch.bfloat16, gen)
        world.poison(xs, ws, scatter)
        check(world(xs, ws, scatter), xs, ws)


def test_reduce_scatter_needs_equal_bands():
    op = GemmAllReduce(SimulatedWorld(2).workspaces()[0], num_programs=1)
    x, w = torch.ones(5, 8, dtype=torch.bfloat16), torch.ones(8, 4, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="cuts M=5 rows into 2 equal bands"):
        op.prepare(x, w, scatter=True)


def test_reduce_scatter_timeout_names_rank_and_slice():
    """Rank 1 never launches: rank 0's reduce times out waiting for rank 1's partial of its band's first tile."""
    world = World(2)
    gen = torch.Generator().manual_seed(10)
    xs, ws = random_inputs(2, 4, 16, 40, torch.bfloat16, gen)
    op = world.ops[0]
    epoch = op.next_epoch()
    for phase in (PRODUCE, REDUCE, WAIT):
        plan = op.launch(xs[0], ws[0], epoch, phase, scatter=True)
    with pytest.raises(PeerWaitTimeout, match="rank 0 timed out at step 1 waiting for rank 1, slice 0"):
        op.output(epoch, plan)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_timeout_names_rank_and_slice(algorithm):
    """Rank 1 never launches: rank 0's reduce times out waiting for rank 1's partial of its first tile (tile 0 in
    both algorithms: rank 0 owns the first tiles)."""
    world = World(2, algorithm=algorithm)
    gen = torch.Generator().manual_seed(6)
    xs, ws = random_inputs(2, 1, 16, 40, torch.bfloat16, gen)
    op = world.ops[0]
    epoch = op.next_epoch()
    for phase in (PRODUCE, REDUCE, WAIT):
        plan = op.launch(xs[0], ws[0], epoch, phase)
    with pytest.raises(PeerWaitTimeout, match="rank 0 timed out at step 1 waiting for rank 1, slice 0"):
        op.output(epoch, plan)


@pytest.mark.parametrize("meanwhile", ["nothing", "a refused call"])
@pytest.mark.parametrize("form", list(CALL_FORMS))
def test_a_late_peer_times_out_rather_than_take_stale_tiles(form, meanwhile):
    """Rank 1 comes late to call 3: rank 0's reduce gives up waiting for its partials. Two-shot: rank 0 must then
    store no tile into rank 1's output (that half holds rank 1's call 1, valid until its call 3) and raise no output
    flag: rank 1, arriving, would take its output's tiles of rank 0's range, call 1's or never reduced, as call 3's
    (once, it returned them without an error). Nor may rank 0's next call, refused on rank 0 (its flags rise without
    tiles), stand in for them. So rank 1 times out naming rank 0 and the program whose tiles are missing. One-shot
    and reduce-scatter: rank 1 reduces its tiles itself, from rank 0's partials of call 3, there in time: exact.
    Once both ranks are past call 3 (nothing else meanwhile), the next call is exact."""
    world, scatter, check, gen = two_ranks(form, 14)
    ops = world.ops
    xs, ws = random_inputs(2, 4, 40, 50, torch.bfloat16, gen)
    world.poison(xs, ws, scatter)
    outs = [output() for output in World.launch(ops, xs, ws, [scatter] * 2)]  # call 1's, in the half of call 3's
    kept = [out.clone() for out in outs]
    check(kept, xs, ws)
    xs, ws = random_inputs(2, 4, 40, 50, torch.bfloat16, gen)
    check(world(xs, ws, scatter), xs, ws)  # call 2
    xs, ws = random_inputs(2, 4, 40, 50, torch.bfloat16, gen)
    epochs = [op.next_epoch() for op in ops]
    for phase in (PRODUCE, REDUCE, WAIT):
        plan = ops[0].launch(xs[0], ws[0], epochs[0], phase, scatter)
    with pytest.raises(PeerWaitTimeout, match="rank 0 timed out at step 3 waiting for rank 1, slice 0"):
        ops[0].output(epochs[0], plan)
    assert torch.equal(outs[1], kept[1])  # rank 1's call 1: it has not begun call 3
    for phase in (PRODUCE, REDUCE):
        ops[1].launch(xs[1], ws[1], epochs[1], phase, scatter)
    if meanwhile == "a refused call":
        refuse(ops[0], ws[0], scatter)
    plan = ops[1].launch(xs[1], ws[1], epochs[1], WAIT, scatter)
    if form == "two-shot":
        with pytest.raises(PeerWaitTimeout, match="rank 1 timed out at step 3 waiting for rank 0, slice 0"):
            ops[1].output(epochs[1], plan)
    else:
        expected = gemm_reduce_scatter_reference(xs, ws)[1] if scatter else gemm_allreduce_reference(xs, ws)
        got = ops[1].output(epochs[1], plan)
        assert (got.double() - expected).abs().max() / expected.abs().max() < TOLERANCE[got.dtype]
    if meanwhile == "nothing":
        xs, ws = random_inputs(2, 4, 40, 50, torch.bfloat16, gen)
        world.poison(xs, ws, scatter)
        check(world(xs, ws, scatter), xs, ws)


def call_of(op: GemmAllReduce, x, w, scatter: bool, phases=(PRODUCE, REDUCE, WAIT)):
    """One rank's whole call (or `phases` of it): its `output`, which raises the rank's error."""
    epoch = op.next_epoch()
    for phase in phases:
        plan = op.launch(x, w, epoch, phase, scatter)
    return functools.partial(op.output, epoch, plan)


def assert_close(got, expected):
    assert got.shape == expected.shape and not got.isnan().any()
    assert (got.double() - expected).abs().max() / expected.abs().max() < TOLERANCE[got.dtype]


def outcome(op: GemmAllReduce, output):
    """output(), then op's error word read (on GPUs `output` reads it only every few calls)."""
    got = output()
    op.errors.check(block=True)
    return got


LATE_BY_TWO = ["a call", "a refused call"]  # rank 0's call 4 (check_late_by_two_calls)


@pytest.mark.parametrize("then", LATE_BY_TWO)
@pytest.mark.parametrize("form", list(CALL_FORMS))
def test_a_late_peer_reduces_its_call_before_the_call_after_next_overwrites_its_partials(form, then):
    check_late_by_two_calls(form, then)


def check_late_by_two_calls(form: str, then: str, device: str = "cpu") -> None:
    """Rank 1 produces call 2, then stalls before its reduce. Rank 0 finishes call 2 (two-shot: its wait for rank 1's
    output tiles gives up), gives up on call 3 (rank 1's partials never come) and goes on to call 4, whose partials
    go into the half of call 2 (double buffers by epoch parity) that rank 1 has not reduced yet. They once did: rank
    1 then raised a call mismatch (rank 0's signature of step 4), or, having read the signature before it landed (a
    window of microseconds on GPUs, emulated here by putting call 2's back), reduced call 4's partials as call 2's
    and returned them without an error. A call 4 that rank 0 refuses would put its refusal there (rank 1 raising
    PeerRefusedInput for call 2). Now a program's partials go into a peer only once that peer is through with
    its reduce of the call before last: rank 0's call 4 gives up waiting for that, stores nothing into rank 1 and
    raises no flag there. So rank 1's call 2 is exact; its call 3 is exact where it reduces from rank 0's partials
    (one-shot, reduce-scatter), times out where rank 0's reduced tiles never came (two-shot); its call 4 times out
    naming rank 0. Then calls are exact (both halves). (A timeout names the slice of the first program whose wait
    gave up: on GPUs any of them.)"""
    world, scatter, check, gen = two_ranks(form, 15, device)
    ops = world.ops
    calls = [random_inputs(2, 4, 40, 50, torch.bfloat16, gen, device) for _ in range(6)]
    xs, ws = calls[0]
    world.poison(xs, ws, scatter)
    check(world(xs, ws, scatter), xs, ws)
    expected = [gemm_reduce_scatter_reference(*c)[1] if scatter else gemm_allreduce_reference(*c) for c in calls]
    xs, ws = calls[1]
    call_of(ops[1], xs[1], ws[1], scatter, (PRODUCE,))  # rank 1 produces call 2, then stalls
    epoch = ops[1].ws._epochs["gemm_allreduce"]
    output = call_of(ops[0], xs[0], ws[0], scatter)
    if form == "two-shot":
        with pytest.raises(PeerWaitTimeout, match=r"rank 0 timed out at step 2 waiting for rank 1, slice \d+"):
            outcome(ops[0], output)
    else:
        outcome(ops[0], output)
    with pytest.raises(PeerWaitTimeout, match=r"rank 0 timed out at step 3 waiting for rank 1, slice \d+"):
        outcome(ops[0], call_of(ops[0], *[t[0] for t in calls[2]], scatter))
    if then == "a call":
        signatures = ops[1].signatures.local
        kept = signatures.clone()
        output = call_of(ops[0], *[t[0] for t in calls[3]], scatter)
        signatures[:gemm_allreduce.SIGNATURE_WORDS.value] = kept[:gemm_allreduce.SIGNATURE_WORDS.value]  # the window
    else:
        refuse(ops[0], calls[3][1][0], scatter)  # raises its own error; its timeout then surfaces
        output = ops[0].errors.after_wait
    with pytest.raises(PeerWaitTimeout, match="rank 0 timed out at step 4 waiting for rank 1 to release its buffer "
                                              r"\(rank 1 never finished step 2\)"):
        outcome(ops[0], output)
    for phase in (REDUCE, WAIT):
        plan = ops[1].launch(xs[1], ws[1], epoch, phase, scatter)
    assert_close(outcome(ops[1], functools.partial(ops[1].output, epoch, plan)), expected[1])
    output = call_of(ops[1], *[t[1] for t in calls[2]], scatter)
    if form == "two-shot":
        with pytest.raises(PeerWaitTimeout, match=r"rank 1 timed out at step 3 waiting for rank 0, slice \d+"):
            outcome(ops[1], output)
    else:
        assert_close(outcome(ops[1], output), expected[2])
    with pytest.raises(PeerWaitTimeout, match="rank 1 timed out at step 4 waiting for rank 0, slice"):
        outcome(ops[1], call_of(ops[1], *[t[1] for t in calls[3]], scatter))
    for xs, ws in calls[4:]:
        world.poison(xs, ws, scatter)
        check(world(xs, ws, scatter), xs, ws)
    for op in ops:
        op.errors.check(block=True)


# Rank 1's call unlike the others' (x [6, 40] @ w [40, 50] bf16, two-shot all-reduce, World's ops): its shapes, dtype
# or form, or its op's (`small_op`'s arguments: the tiles, the K split, the algorithm, the grid); what the messages
# then say of the others' call and of rank 1's.
USUAL = "x [6, 40] @ w [40, 50] bfloat16, all-reduce, two-shot"
DIFFERENCES = {
    "rows": (dict(m=4), None, USUAL, "x [4, 40] @ w [40, 50] bfloat16, all-reduce, two-shot"),
    "no rows": (dict(m=0), None, USUAL, "x [0, 40] @ w [40, 50] bfloat16, all-reduce, two-shot"),
    "n": (dict(n=40), None, USUAL, "x [6, 40] @ w [40, 40] bfloat16, all-reduce, two-shot"),
    "k": (dict(k=24), None, USUAL, "x [6, 24] @ w [24, 50] bfloat16, all-reduce, two-shot"),
    "dtype": (dict(dtype=torch.float16), None, USUAL, "x [6, 40] @ w [40, 50] float16, all-reduce, two-shot"),
    "form": (dict(scatter=True), None, USUAL, "x [6, 40] @ w [40, 50] bfloat16, reduce-scatter"),
    "algorithm": ({}, dict(algorithm="one_shot"), USUAL, "x [6, 40] @ w [40, 50] bfloat16, all-reduce, one-shot"),
    "tiles": ({}, dict(block_n=32), USUAL + ", tiles of 16 columns", USUAL + ", tiles of 32 columns"),
    "split_k": ({}, dict(split_k=2), USUAL + ", K split in 1", USUAL + ", K split in 2"),
    "grid": ({}, dict(grid=2), USUAL + ", a grid of 3 programs", USUAL + ", a grid of 2 programs"),
}


def check_calls_that_differ(world_size: int, difference: str, device: str = "cpu") -> None:
    """Every rank raises, naming itself, the peer whose call it found unlike its own first and both calls (a program
    reads its peers' calls at its first tile, one without a tile, e.g. every one of rank 2 of 3, behind its peers'
    flags of the same program); the next call, alike on every rank, is exact. The first call, alike, leaves the
    buffers large enough for the second's calls: on GPUs a rank that grows a buffer alone waits in the allocation's
    collective before any kernel runs. On GPUs waits spin longer (~1 s): a program of the larger grid whose flag the
    other grid never raises must not give up before a peer program of its rank has recorded the mismatch."""
    call, op, usual, odd = DIFFERENCES[difference]
    spin_limit = 50 if device == "cpu" else 1 << 22
    world = World(world_size, device=device, spin_limit=spin_limit)
    gen = torch.Generator().manual_seed(world_size)
    xs, ws = random_inputs(world_size, 12, 40, 50, torch.bfloat16, gen, device)
    assert_all_reduced(world(xs, ws), xs, ws)
    shapes = [dict(m=6, k=40, n=50, dtype=torch.bfloat16, scatter=False) for _ in range(world_size)]
    shapes[1].update(call)
    inputs = [random_inputs(1, s["m"], s["k"], s["n"], s["dtype"], gen, device) for s in shapes]
    ops = list(world.ops)
    if op is not None:  # a second op of rank 1's, on the same workspace (flags, signatures and epochs by name)
        ops[1] = small_op(ops[1].ws, spin_limit=spin_limit, **op)
    outputs = World.launch(ops, [x[0] for x, _ in inputs], [w[0] for _, w in inputs], [s["scatter"] for s in shapes])
    for rank, output in enumerate(outputs):
        # a rank names the first peer it finds unlike itself: rank 1 its next rank, the others rank 1
        peer, mine, theirs = ((2 % world_size, odd, usual) if rank == 1 else (1, usual, odd))
        with pytest.raises(PeerCallMismatch, match=f"rank {rank} at step 2: peer {peer} called it with "
                                                   f"{re.escape(theirs)}; this rank with {re.escape(mine)} \\("):
            output()  # on the CPU
            ops[rank].errors.check(block=True)  # on GPUs
    xs, ws = random_inputs(world_size, 6, 40, 50, torch.bfloat16, gen, device)
    world.poison(xs, ws)
    assert_all_reduced(world(xs, ws), xs, ws)
    for op in ops:
        op.errors.check(block=True)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("difference", list(DIFFERENCES))
def test_calls_that_differ_between_ranks_raise_on_every_rank(world_size, difference):
    check_calls_that_differ(world_size, difference)


COMPILE_FOR_SM90 = r"""
from fused_dlrm.kernels import gemm_allreduce

types = {"x_ptr": "*bf16", "w_ptr": "*bf16", "error_ptr": "*i32", "reduced_ptr": "*i32", "M": "i32"}  # M as on GPUs
types.update({n: "*i64" for n in ("recv_ptrs", "out_ptrs", "ready_ptrs", "done_ptrs", "signature_ptrs",
                                  "released_ptrs")})
many = gemm_allreduce.MANY_ROWS
for one_shot, scatter in ((True, False), (False, False), (False, True)):
    # The plans' defaults: FEW_ROWS at 16 and 64 rows (two programs per SM), MANY_ROWS (one per SM).
    for m, block_m, block_n, block_k, stages, per_sm in ((16, 16, 64, 128, 5, 2), (64, 64, 64, 128, 3, 2),
                                                         (4096, many.block_m, many.block_n, many.block_k,
                                                          many.num_stages, many.programs_per_sm)):
        kernel = build(gemm_allreduce._gemm_allreduce_kernel, types, dict(
            N=8192, K=4096, WORLD=2, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
            K_TILES=4096 // block_k, OUT_DTYPE=gemm_allreduce.tl.bfloat16, DOT_FP32=False,
            PHASES=gemm_allreduce.ALL_PHASES, ONE_SHOT=one_shot, SCATTER=scatter), num_warps=8, num_stages=stages,
            divisible=("stride_xm", "stride_wk"))
        # per_sm programs on one SM: each within 1 / per_sm of its 227 KiB of shared memory.
        assert kernel.metadata.shared <= 227 * 1024 // per_sm, (one_shot, scatter, block_m, kernel.metadata.shared)
# a refused call's program (132 SMs of 2 programs: flags for 264), all phases in one launch
types = {"signature_ptr": "*i64", "error_ptr": "*i32"}
types.update({n: "*i64" for n in ("signature_ptrs", "ready_ptrs", "done_ptrs", "released_ptrs")})
build(gemm_allreduce._refused_call_kernel, types, dict(WORLD=2, SLOTS=512, PHASES=gemm_allreduce.ALL_PHASES))
"""


def test_kernel_compiles_for_sm90():
    """Both algorithms and the reduce-scatter form at the plans' default tiles compile for sm_90 within their
    programs per SM's shared memory; and a refused call's kernel."""
    compile_for_sm90(COMPILE_FOR_SM90)


# (M, N, K, reduce-scatter): FEW_ROWS at one and two programs per SM (N=8192: 128 tiles; 28672: 448), one-shot and
# reduce-scatter; MANY_ROWS
GRID_SHAPES = ((1, 8192, 4096, False), (1, 28672, 4096, False), (16, 28672, 8192, False), (64, 28672, 4096, False),
               (64, 8192, 4096, True), (2048, 8192, 4096, False))
PLANS_CO_RESIDENT_ON_SM90 = r"""
import types
import torch
torch.cuda.get_device_properties = lambda device: types.SimpleNamespace(multi_processor_count=132)  # H100 / H200
from fused_dlrm.dist.symmetric import SimulatedWorld
from fused_dlrm.kernels import gemm_allreduce
from fused_dlrm.kernels.launch import resident_programs_per_sm

op = gemm_allreduce.GemmAllReduce(SimulatedWorld(2).workspaces()[0])  # the plans' own grids: num_programs None
gen = torch.Generator().manual_seed(3)
for m, n, k, scatter in GRID_SHAPES:
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    w = torch.randn(k, n, generator=gen).to(torch.bfloat16)
    plan = op._plan_of(x, w, gemm_allreduce.ALL_PHASES, scatter)
    kernel = build_launch(gemm_allreduce._gemm_allreduce_kernel, plan.args(x, w, 3), plan.options, DOT_FP32=False)
    registers, stack = resources(kernel)
    per_sm = resident_programs_per_sm(registers, plan.options["num_warps"], kernel.metadata.shared)
    assert per_sm * 132 >= plan.num_programs, (m, n, scatter, plan.num_programs, registers, kernel.metadata.shared)
    # FEW_ROWS's bound spills at most 8 bytes (BLOCK_M 64: the released ranks' mask, live across the GEMM's loop;
    # nothing without it)
    assert m > 64 or stack <= 8, (m, n, scatter, registers, stack)
"""


def test_plans_grids_are_co_resident_on_sm90():
    """On 132 SMs each plan's grid fits the GPU at once (its programs wait for each other's flags): FEW_ROWS's
    grids of two programs per SM bound their registers (ptxas took 175-190 unbounded), spilling 8 bytes at most.
    Compiled as the launches specialise the kernel, registers counted in the sm_90 binary."""
    compile_for_sm90(f"GRID_SHAPES = {GRID_SHAPES!r}\n" + PLANS_CO_RESIDENT_ON_SM90)


def test_tiling_by_rows():
    """Up to 64 rows FEW_ROWS's tiles, more MANY_ROWS's; given fields replace both tilings' own."""
    op = GemmAllReduce(SimulatedWorld(1).workspaces()[0], num_programs=1, block_n=16)
    assert op._tiling(64) == replace(gemm_allreduce.FEW_ROWS, block_n=16)
    assert op._tiling(65) == replace(gemm_allreduce.MANY_ROWS, block_n=16)
    gen = torch.Generator().manual_seed(7)
    for m, block_m in ((5, 16), (64, 64), (65, 128), (300, 128)):
        xs, ws = random_inputs(1, m, 8, 20, torch.bfloat16, gen)
        args = op.prepare(xs[0], ws[0]).args(xs[0], ws[0], 0)
        assert args[gemm_allreduce._gemm_allreduce_kernel.arg_names.index("BLOCK_M")] == block_m
