"""The fused one-launch quantized all-reduce on simulated worlds of 2 and 4 ranks (Triton interpreter): equal bit
for bit to the bulk twin's arithmetic on every rank, within the documented two-shot bound of the fp64 sum, every
element written, many consecutive calls on the same flags, timeouts that name rank, peer and slice, and calls that
differ between ranks, or that one rank refuses, raising on every rank without touching the output (the next call
exact); a NaN or inf on one rank non-finite in every rank's output, and NaN kept by the output's rounding. Compiled
for sm_90 (no GPU): every payload word moves in a 128-bit (q6: 64-bit) vector access."""

from __future__ import annotations

import os
import re

import pytest
import torch
import triton
import triton.language as tl

from fused_dlrm.dist.symmetric import SimulatedWorld
from fused_dlrm.kernels.peer_flags import PeerCallMismatch, PeerRefusedInput, PeerWaitTimeout
from fused_dlrm.kernels.quant_codecs import CODECS
from fused_dlrm.kernels.quantized_allreduce import (FusedQuantizedAllReduce, _round_to,
                                                    quantized_all_reduce_reference, two_shot_error_bound)
from sm90 import compile_for_sm90
from test_quant_codecs import INF, NAN_BITS, NEG_INF, data, floats_of, max_min, same_values, with_nonfinite

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs in the Triton interpreter")


def world_of(size: int, max_programs: int = 2, spin_limit: int = 50) -> list[FusedQuantizedAllReduce]:
    """Tiles of 32 blocks (the default): small inputs still cover many tiles per program."""
    return [FusedQuantizedAllReduce(ws, max_programs, spin_limit) for ws in SimulatedWorld(size).workspaces()]


def poison(call) -> None:
    """NaN output, NaN-coding slots (0xFF bytes: fp16 NaN values, bf16 NaN scales): unwritten elements show."""
    call.out.fill_(float("nan"))
    call.plan.recv.local.fill_(255)
    call.plan.gather.local.fill_(255)


def all_reduce(world, xs, codec, mean=False, ranks=None, phases=(0, 1, 2)):
    """Every rank's call, each phase run on every rank (in `ranks`) before the next: one program at a time cannot
    wait for a later one."""
    calls = [ar.start(x, codec, mean) for ar, x in zip(world, xs)]
    for call in calls:
        poison(call)
    for phase in phases:
        for r in ranks or range(len(world)):
            world[r].run(calls[r], phase, phase)
    return [ar.finish(call) for ar, call in zip(world, calls)]


def inputs(world: int, n: int, kind: str, seed: int = 0) -> list[torch.Tensor]:
    return [data(kind, n, seed + 7 * r) for r in range(world)]


@pytest.mark.parametrize("world_size,n", [(2, 4171), (4, 1100)])  # 2: 3 tiles per chunk on 2 programs
@pytest.mark.parametrize("codec", list(CODECS))
@pytest.mark.parametrize("kind", ["normal", "student_t", "cauchy"])
def test_equals_bulk_arithmetic_and_meets_bound(world_size, n, codec, kind):
    xs = inputs(world_size, n, kind)
    if kind == "cauchy":  # the fp16 line's range: |sum| <= 65504
        xs = [x.clamp(-1e4 / world_size, 1e4 / world_size) for x in xs]
    mean = kind == "student_t"
    got = all_reduce(world_of(world_size), xs, codec, mean)
    want = quantized_all_reduce_reference(xs, codec, mean)
    for y in got:
        assert torch.equal(y, want)  # bit-identical on every rank, and the bulk twin's arithmetic
    exact = sum(x.double() for x in xs) / (world_size if mean else 1)
    err = (want.double() - exact).abs()
    bound = two_shot_error_bound(xs, codec, mean).double()
    assert (err <= bound).all(), (err / bound).max()


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs_keep_their_dtype(world_size, dtype):
    """The result in x's dtype, and within the two-shot bound of the fp64 sum: the bound includes that rounding
    (a bf16 result of the fp16 codec was off by up to 4.5 times the bound of its fp32 values)."""
    xs = [x.view(11, 21).to(dtype) for x in inputs(world_size, 231, "student_t", seed=3)]
    exact = sum(x.double() for x in xs) / world_size
    for codec in ("fp16", "q8", "q4"):
        got = all_reduce(world_of(world_size, max_programs=3), xs, codec, mean=True)
        want = quantized_all_reduce_reference(xs, codec, mean=True)
        assert want.dtype == dtype and want.shape == (11, 21)
        assert all(torch.equal(y, want) for y in got)
        err = (want.double() - exact).abs()
        bound = two_shot_error_bound(xs, codec, mean=True).double()
        assert bound.shape == want.shape and (err <= bound).all(), (codec, (err / bound).max())


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_tiny_and_skewed_sizes(world_size):
    """No values (a call all the same: one chunk block of padding per rank, its flags raised and waited for, so
    the calls after it stay exact), fewer values than ranks, one block, and sizes whose last chunk is mostly
    padding."""
    world = world_of(world_size, max_programs=4)
    for n in (1, 0, 3, 33, 32 * world_size + 1, 1024 * world_size + 5):
        xs = inputs(world_size, n, "normal", seed=n)
        got = all_reduce(world, xs, "q8")
        assert all(torch.equal(y, quantized_all_reduce_reference(xs, "q8")) for y in got), n


def test_the_gpus_tile_sizes():
    world = [FusedQuantizedAllReduce(ws, 2, 50) for ws in SimulatedWorld(2).workspaces()]
    for n in (3 * 2 * 4096 + 99, 4000):  # 4 tiles of 128 blocks per chunk on 2 programs; 2 tiles of 32 blocks
        xs = inputs(2, n, "student_t", seed=5)
        got = all_reduce(world, xs, "q6", mean=True)
        assert all(torch.equal(y, quantized_all_reduce_reference(xs, "q6", mean=True)) for y in got)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the timed-out call decodes never-written slots
def test_many_consecutive_calls_on_the_same_flags():
    """Sizes and codecs change from call to call (buffers grow, program counts change): every call still
    equals its reference, which a stale slot or an early flag would break."""
    world = world_of(2, max_programs=3)
    codecs = list(CODECS)
    for step in range(40):
        n = [40, 700, 2100][step % 3]
        codec = codecs[step % len(codecs)]
        xs = inputs(2, n, "normal", seed=step)
        got = all_reduce(world, xs, codec, mean=step % 3 == 0)
        want = quantized_all_reduce_reference(xs, codec, mean=step % 3 == 0)
        assert torch.equal(got[0], want) and torch.equal(got[1], want), step
    # The flags still hold epoch 40: call 41 must not take them for its own when rank 1 never starts it.
    call = world[0].start(inputs(2, 700, "normal")[0], "q8")
    world[0].run(call)
    with pytest.raises(PeerWaitTimeout, match="rank 0 timed out at step 41 waiting for rank 1"):
        world[0].finish(call)


def test_an_op_refuses_the_call_past_its_int32_epochs():
    """The kernel numbers calls in int32 on the device: at 2**31 - 1 calls a wrapped epoch would take the peers'
    old flags for its own; the op refuses that call on every rank instead, before anything runs."""
    world = world_of(2)
    xs = inputs(2, 700, "normal")
    all_reduce(world, xs, "q8")
    for ar in world:
        ar.calls = 2**31 - 2  # as after that many calls
    all_reduce(world, xs, "q8")  # the last one the epochs count
    for rank, ar in enumerate(world):
        with pytest.raises(RuntimeError, match=rf"rank {rank}: this op has made 2147483647 calls, as many as its "
                                               r"int32 epochs count"):
            ar.start(xs[rank], "q8")


def test_the_epoch_slots_follow_calls_of_any_grid():
    """The epoch lives on the device, one slot per program: calls whose grids grow and shrink (1, 4, 2, 3, 4
    programs of at most 4) each read the epoch of the call before, whoever wrote its slot."""
    world = [FusedQuantizedAllReduce(ws, 4, 50, tile_blocks=1) for ws in SimulatedWorld(2).workspaces()]
    for step, blocks in enumerate([1, 4, 2, 3, 4], start=1):  # chunk blocks = tiles = programs
        xs = inputs(2, 2 * 32 * blocks, "normal", seed=step)
        got = all_reduce(world, xs, "q8")
        assert all(torch.equal(y, quantized_all_reduce_reference(xs, "q8")) for y in got), step
        assert all(ar.step.tolist() == [step] * 4 for ar in world), step


def test_timeout_in_the_reduce_names_rank_peer_and_slice():
    world = world_of(2, max_programs=2)
    xs = inputs(2, 3000, "normal")
    calls = [ar.start(x, "q8") for ar, x in zip(world, xs)]
    world[0].run(calls[0], 0, 2)  # rank 1 never starts: rank 0's reduce waits for rank 1's scatter
    with pytest.raises(PeerWaitTimeout, match="rank 0 timed out at step 1 waiting for rank 1, slice 0"):
        world[0].finish(calls[0])


def test_timeout_in_the_gather_names_rank_peer_and_slice():
    world = world_of(4, max_programs=2)
    xs = inputs(4, 3000, "normal")
    calls = [ar.start(x, "q4") for ar, x in zip(world, xs)]
    for phase in (0, 1, 2):
        for r in range(4):
            if not (r == 2 and phase > 0):  # rank 2 scatters, then stops: it never reduces its chunk
                world[r].run(calls[r], phase, phase)
    for r in (0, 1, 3):
        with pytest.raises(PeerWaitTimeout, match=f"rank {r} timed out at step 1 waiting for rank 2, slice 2"):
            world[r].finish(calls[r])


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the timed-out call decodes never-written slots
def test_a_late_peer_reduces_its_call_before_the_next_call_overwrites_its_tiles():
    """Rank 1 comes late to call 2's reduce: rank 0's gather gives up waiting for it and rank 0 goes on to call 3,
    whose scatter would overwrite the tiles of call 2 in rank 1's recv before rank 1 read them. Here the epoch in
    rank 0's signature gave it away (rank 1 raised a call mismatch); had rank 1 read that signature before the
    tiles of call 3 landed (a window of microseconds on GPUs), it would have reduced call 3's tiles as call 2's,
    silently. Now the scatter into a peer waits (bounded) until the last of its programs is through with the
    reduce of the call before: rank 1's call 2 is exact; rank 0's call 3, which gave up on that wait, stored
    nothing there and raised no flag, so rank 1's call 3 times out naming rank 0. Then calls are exact."""
    world = world_of(2, max_programs=2)
    calls = [inputs(2, 3000, "normal", seed=seed) for seed in range(1, 6)]
    for y in all_reduce(world, calls[0], "q8"):
        assert torch.equal(y, quantized_all_reduce_reference(calls[0], "q8"))
    second = [ar.start(x, "q8") for ar, x in zip(world, calls[1])]
    world[1].run(second[1], 0, 0)  # rank 1 scatters call 2, then stalls
    world[0].run(second[0])
    with pytest.raises(PeerWaitTimeout, match="rank 0 timed out at step 2 waiting for rank 1, slice 2"):
        world[0].finish(second[0])
    third = world[0].start(calls[2][0], "q8")
    world[0].run(third)
    with pytest.raises(PeerWaitTimeout, match="rank 0 timed out at step 3 waiting for rank 1 to release its buffer"):
        world[0].finish(third)
    world[1].run(second[1], 1, 2)
    assert torch.equal(world[1].finish(second[1]), quantized_all_reduce_reference(calls[1], "q8"))
    third = world[1].start(calls[2][1], "q8")
    world[1].run(third)
    with pytest.raises(PeerWaitTimeout, match="rank 1 timed out at step 3 waiting for rank 0, slice 0"):
        world[1].finish(third)
    for xs in calls[3:]:
        assert all(torch.equal(y, quantized_all_reduce_reference(xs, "q8")) for y in all_reduce(world, xs, "q8"))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the timed-out call decodes never-written slots
@pytest.mark.parametrize("meanwhile", ["nothing", "a refused call"])
def test_a_late_peer_times_out_rather_than_gather_stale_tiles(meanwhile):
    """Rank 1 comes late to call 2: rank 0's wait for its scatter gives up (no tile of rank 0 reduced). Rank 1,
    arriving, finds rank 0's flags of call 2 up to the reduce, but must not take them as rank 0's reduced tiles: its
    gather still holds call 1's (once, rank 1 returned call 1's chunk 0 as call 2's, silently). Nor may rank 0's
    next call, refused on rank 0 (its flags rise without data), stand in for them. Rank 1 times out naming rank 0
    and the all-gather's slice; the next call, once both ranks are past call 2, is exact."""
    world = world_of(2, max_programs=2)
    xs = inputs(2, 3000, "normal", seed=1)
    assert all(torch.equal(y, quantized_all_reduce_reference(xs, "q8")) for y in all_reduce(world, xs, "q8"))
    xs = inputs(2, 3000, "normal", seed=2)
    calls = [ar.start(x, "q8") for ar, x in zip(world, xs)]
    world[0].run(calls[0], 0, 2)
    with pytest.raises(PeerWaitTimeout, match="rank 0 timed out at step 2 waiting for rank 1, slice 0"):
        world[0].finish(calls[0])
    world[1].run(calls[1], 0, 1)  # scatter and reduce: rank 0's scatter of call 2 is there
    if meanwhile == "a refused call":
        refused = world[0].start(xs[0], "q7")
        world[0].run(refused)
        with pytest.raises(ValueError, match="unknown codec 'q7'"):
            world[0].finish(refused)
    world[1].run(calls[1], 2, 2)
    with pytest.raises(PeerWaitTimeout, match="rank 1 timed out at step 2 waiting for rank 0, slice 2"):
        world[1].finish(calls[1])
    if meanwhile == "nothing":
        xs = inputs(2, 3000, "normal", seed=3)
        assert all(torch.equal(y, quantized_all_reduce_reference(xs, "q8")) for y in all_reduce(world, xs, "q8"))


COMPILE_FOR_SM90 = """
import re
from fused_dlrm.kernels import quant_codecs, quantized_allreduce
from fused_dlrm.kernels.quant_codecs import CODECS, kernel_constants

# numel not divisible: x, out not vectors
types = {"x_ptr": "*bf16", "out_ptr": "*bf16", "error_ptr": "*i32", "step_ptr": "*i32", "reduced_ptr": "*i32"}
types.update({n: "*i64" for n in ("recv_ptrs", "gather_ptrs", "ready_ptrs", "done_ptrs", "signature_ptrs",
                                  "released_ptrs")})
world, rows = 2, 128
for name, c in CODECS.items():
    ptx = build(quantized_allreduce._quantized_all_reduce_kernel, types,
                dict(WORLD=world, MEAN=False, ROWS=quantized_allreduce.TILE_BLOCKS, **kernel_constants(c))).asm["ptx"]
    assert not re.search(r"(ld|st)\\.global\\.[bsu]8", ptx), name  # no byte accesses at the default tiles
    ptx = build(quantized_allreduce._quantized_all_reduce_kernel, types,
                dict(WORLD=world, MEAN=False, ROWS=rows, **kernel_constants(c))).asm["ptx"]
    assert not re.search(r"(ld|st)\\.global\\.[bsu]8", ptx), name
    # no scalar word loads (flags: ld.global.sys.acquire; the step counter: ld.volatile)
    assert not re.search(r"ld\\.global\\.b32", ptx), name
    vector = 2 if name == "q6" else 4  # q6's blocks are 24 bytes: 8-byte aligned
    expected = 2 * world * rows * c.words // (4 * 32 * vector)  # 2 x world tiles loaded, 2 x world stored
    for op in ("ld", "st"):  # 4 warps of 32 threads
        assert len(re.findall(rf"{op}\\.global\\.v{vector}\\.b32", ptx)) == expected, (name, op)
    for decode in (False, True):
        build(quant_codecs._codec_kernel, {"values_ptr": "*fp32", "payload_ptr": "*i32", "scale_ptr": "*bf16"},
              dict(DECODE=decode, ROWS=quant_codecs.BLOCKS_PER_PROGRAM, **kernel_constants(c)))
# a refused call's program (132 SMs of 12 programs: flags for 1584)
types = {"signature_ptr": "*i64", "step_ptr": "*i32", "error_ptr": "*i32"}
types.update({n: "*i64" for n in ("ready_ptrs", "done_ptrs", "signature_ptrs", "released_ptrs")})
build(quantized_allreduce._refused_call_kernel, types, dict(WORLD=world, SLOTS=2048))
"""


def test_kernels_compile_for_sm90_with_vector_payload_accesses():
    """No byte-wise accesses; with tiles of 128 blocks (a thread holds 4-16 payload words) the int32 words move in
    128-bit vectors (64-bit for q6); the default tiles of 32 blocks give a thread 1-4 words, in narrower accesses.
    Checked on CI's CPUs by compiling for sm_90 without the interpreter (and a refused call's kernel)."""
    compile_for_sm90(COMPILE_FOR_SM90)


@pytest.mark.parametrize("codec", ["fp16", "q4"])
def test_in_place_and_into_a_given_output(codec):
    """out=x (in place: every program reads its own tiles of x before it writes them) and out= a given tensor
    give the new-tensor result; every element of a NaN-poisoned given output is written."""
    world = world_of(2, max_programs=2)
    xs = inputs(2, 4171, "normal", seed=11)  # 3 tiles per chunk on 2 programs
    want = quantized_all_reduce_reference(xs, codec)
    for in_place in (True, False):
        targets = [x.clone() if in_place else torch.full_like(x, float("nan")) for x in xs]
        sources = targets if in_place else xs
        calls = [ar.start(x, codec, out=t) for ar, x, t in zip(world, sources, targets)]
        for phase in (0, 1, 2):
            for r in range(2):
                world[r].run(calls[r], phase, phase)
        got = [ar.finish(call) for ar, call in zip(world, calls)]
        assert all(y is t and torch.equal(y, want) for y, t in zip(got, targets)), in_place


def refused_call(refusal: str, n: int) -> tuple[dict, type, str, str]:
    """Rank 1's call arguments (an x of n float32 values, codec q8, in place otherwise) refused for `refusal`; the
    error it raises itself and what its peers say of it."""
    x = torch.randn(n)
    return {"int32 x": (dict(x=x.to(torch.int32), out=None), TypeError,
                        "takes fp32, fp16 or bf16 tensors, got torch.int32", "its x is int32, which no codec takes"),
            # the codecs would return its values rounded by block
            "float64 x": (dict(x=x.double(), out=None), TypeError, "got torch.float64",
                          "its x is float64, which no codec takes"),
            "codec": (dict(codec="q7"), ValueError, "unknown codec 'q7'", "its codec is none of the fused kernel's"),
            "out shape": (dict(out=torch.empty(n - 1)), ValueError, f"out must be contiguous torch.float32 \\[{n}\\]",
                          f"its out \\({n - 1} float32\\) cannot take the result of its x \\({n} float32\\)"),
            "out dtype": (dict(out=torch.empty(n, dtype=torch.float16)), ValueError, "got torch.float16",
                          f"its out \\({n} float16\\) cannot take"),
            "strided out": (dict(out=torch.empty(2 * n)[::2]), ValueError, "not contiguous",
                            f"its out \\({n} float32, not contiguous\\) cannot take"),
            # the kernel would read it through a pointer of that device (an out on x's: refused as unlike x)
            "x on another device": (dict(x=torch.empty(n, device="meta"), out=None), ValueError,
                                    f"x \\({n},\\) torch.float32 on meta: expected on",
                                    f"its x \\[{n}\\] float32 is on another device than its workspace"),
            # 2**31 values (no memory: an expanded scalar) encode to more bytes than the kernel's int32 offsets reach
            "too large": (dict(x=torch.zeros(1).expand(2**31), out=None), ValueError,
                          f"{2**31} values encode to 2281701376 bytes",
                          f"its {2**31} values encode to 2281701376 bytes, past the kernel's int32 offsets")}[refusal]


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the poisoned slots decode to NaN where the codecs read them
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("refusal", ["int32 x", "float64 x", "codec", "out shape", "out dtype", "strided out",
                                     "x on another device", "too large"])
def test_a_call_refused_on_one_rank_raises_on_every_rank(world_size, refusal):
    """Rank 1 refuses its call: it raises its own error, every other rank PeerRefusedInput naming rank 1 and why, at
    the same call (rank 1 still takes part in it: its flags rise, its signature says why), without touching the
    output; the next call, alike on every rank, is exact: the refused call took its epoch on every rank."""
    world = world_of(world_size, max_programs=2)
    n = 2048 * world_size  # chunks of 64 blocks: 2 tiles, 2 programs
    xs = inputs(world_size, n, "normal", seed=3)
    assert all(torch.equal(y, quantized_all_reduce_reference(xs, "q8")) for y in all_reduce(world, xs, "q8"))
    xs = inputs(world_size, n, "normal", seed=4)
    kept = [x.clone() for x in xs]
    args = [dict(x=x, codec="q8", out=x) for x in xs]
    bad, error, mine, theirs = refused_call(refusal, n)
    args[1].update(bad)
    calls = [ar.start(**a) for ar, a in zip(world, args)]
    for phase in (0, 1, 2):
        for r in range(world_size):
            world[r].run(calls[r], phase, phase)
    with pytest.raises(error, match=mine):
        world[1].finish(calls[1])
    for r in range(world_size):
        if r != 1:
            with pytest.raises(PeerRefusedInput, match=rf"^fused quantized all-reduce \(slices >= 2: all-gather\) at "
                                                       rf"step 2: rank {r}: rank 1's call was refused: {theirs}"):
                world[r].finish(calls[r])
            assert torch.equal(xs[r], kept[r]), r  # in place: untouched
    assert [ar.calls for ar in world] == [2] * world_size
    xs = inputs(world_size, 3000, "normal", seed=17)
    got = all_reduce(world, xs, "q8")
    assert all(torch.equal(y, quantized_all_reduce_reference(xs, "q8")) for y in got)
    assert all(ar.step.tolist() == [3, 3] for ar in world)


def different_call(difference: str, world_size: int) -> tuple[int, tuple, str, str]:
    """The others' numel; rank 1's (numel, dtype, codec, mean), which differs from theirs (q8 fp32 sums) in one way;
    what the message says of the others' call and of rank 1's. Chunks of 64 blocks: 2 tiles, 2 programs (of 2);
    "grid": rank 1's chunks are of one tile, so it runs 1 program; "no values": rank 1's call is empty (chunks of
    one block of padding: 1 program too)."""
    n = 2048 * world_size
    odd = {"numel": (n + 4, torch.float32, "q8", False), "grid": (500 * world_size, torch.float32, "q8", False),
           "no values": (0, torch.float32, "q8", False), "codec": (n, torch.float32, "q4", False),
           "dtype": (n, torch.bfloat16, "q8", False), "mean": (n, torch.float32, "q8", True)}[difference]
    numel, dtype, codec, mean = odd
    one_program = difference in ("grid", "no values")
    grid = (", a grid of 2 programs", ", a grid of 1 programs") if one_program else ("", "")
    return (n, odd, f"{n} float32 elements, codec q8{grid[0]}",
            f"{numel} {str(dtype)[6:]} elements, codec {codec}{', mean' if mean else ''}{grid[1]}")


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the poisoned slots decode to NaN where the codecs read them
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("difference", ["numel", "grid", "no values", "codec", "dtype", "mean"])
def test_calls_that_differ_between_ranks_raise_on_every_rank(world_size, difference):
    """Every rank raises, naming itself, the peer whose signature it found first and both calls; nothing is stored
    into the output (x, reduced in place, keeps its values); the next call, alike on every rank, is exact."""
    n, (numel, dtype, codec, mean), usual, odd = different_call(difference, world_size)
    world = world_of(world_size, max_programs=2)
    # Step 1, alike on every rank, leaves slots large enough for step 2's calls: on GPUs a rank that grows a buffer
    # alone would wait in the allocation's collective before any kernel could compare calls.
    xs = inputs(world_size, 2 * n, "normal", seed=3)
    assert all(torch.equal(y, quantized_all_reduce_reference(xs, "q8")) for y in all_reduce(world, xs, "q8"))
    xs = [data("normal", n, seed=r) for r in range(world_size)]
    xs[1] = data("normal", numel, seed=1).to(dtype)
    kept = [x.clone() for x in xs]
    calls = [ar.start(x, codec if r == 1 else "q8", mean and r == 1, out=x) for r, (ar, x) in enumerate(zip(world, xs))]
    for call in calls:  # NaN-coding slots: a tile reduced from them would show in x
        call.plan.recv.local.fill_(255)
        call.plan.gather.local.fill_(255)
    for phase in (0, 1, 2):
        for r in range(world_size):
            world[r].run(calls[r], phase, phase)
    for r in range(world_size):
        # a rank names the first peer it checks whose call differs: rank 1 its next rank, the others rank 1
        peer, mine, theirs = ((2 % world_size, odd, usual) if r == 1 else (1, usual, odd))
        expected = (f"rank {r} at step 2: peer {peer} called it with {re.escape(theirs)}; this rank with "
                    f"{re.escape(mine)} \\(")
        with pytest.raises(PeerCallMismatch, match=expected):
            world[r].finish(calls[r])
        assert torch.equal(xs[r], kept[r]), r  # in place: untouched
    # The next call (fresh data, NaN-poisoned output and slots) finds flags and slots as after any call.
    xs = inputs(world_size, 3000, "normal", seed=17)
    got = all_reduce(world, xs, "q8")
    want = quantized_all_reduce_reference(xs, "q8")
    exact = sum(x.double() for x in xs)
    for y in got:
        assert torch.equal(y, want)
        assert (y.double() - exact).norm() / exact.norm() < 1e-2
    assert ((want.double() - exact).abs() <= two_shot_error_bound(xs, "q8").double()).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("codec", list(CODECS))
def test_nonfinite_inputs_stay_nonfinite_on_every_rank(codec, dtype, max_min):
    """NaN (of several patterns) and +-inf on one rank or both: every rank's output equals the reference (NaN
    where NaN), bit for bit alike on all ranks. Scaled codecs: every block that held one on any rank is all NaN
    (quant_codecs: a non-finite block decodes as NaN); fp16: NaN where a NaN or inf - inf was, inf with its sign
    where an inf was alone."""
    xs = inputs(2, 500, "normal")  # chunks of 8 blocks: rank 0 reduces blocks 0-7, rank 1 blocks 8-15
    xs = [with_nonfinite(xs[0], {3: NAN_BITS[0], 100: NAN_BITS[1], 290: NAN_BITS[2], 420: NAN_BITS[3], 161: INF,
                                 200: NEG_INF}).to(dtype),
          with_nonfinite(xs[1], {165: INF, 200: INF, 300: NEG_INF, 330: INF, 499: NEG_INF}).to(dtype)]
    got = all_reduce(world_of(2), xs, codec)
    want = quantized_all_reduce_reference(xs, codec)
    assert same_values(got[0].float(), want.float()) and torch.equal(got[0].view(torch.uint8), got[1].view(torch.uint8))
    y = want.float()
    if CODECS[codec].scaled:
        nan_blocks = torch.zeros(16, dtype=torch.bool)
        nan_blocks[[0, 3, 5, 6, 9, 10, 13, 15]] = True
        assert torch.equal(y.isnan(), nan_blocks.repeat_interleave(32)[:500])
    else:
        nan = torch.zeros(500, dtype=torch.bool)
        nan[[3, 100, 290, 420, 200]] = True
        assert torch.equal(y.isnan(), nan)
        assert y[[161, 165, 330]].tolist() == [float("inf")] * 3 and y[[300, 499]].tolist() == [float("-inf")] * 2
        assert y.isinf().sum() == 5


@triton.jit
def _round_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(out_ptr + i, _round_to(tl.load(x_ptr + i, mask=i < n), out_ptr.dtype.element_ty), mask=i < n)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_output_rounding_keeps_nan_and_rounds_as_torch(dtype):
    """The reduced fp32 values' rounding into a bf16 / fp16 output: torch's (nearest even) on ties, overflow, inf,
    and NaN of every pattern (bf16's bit arithmetic once carried 0x7FFFFFFF, the GPUs' NaN, into -0.0)."""
    x = floats_of(list(NAN_BITS) + [INF, NEG_INF, 0x3F808000, 0x3F818000, 0xBF808000, 0x7F7FFFFF, 0xFF7FFFFF,
                                    0x477FF000, 0x477FE000, 0x33000000, 0])
    out = torch.empty(x.numel(), dtype=dtype)
    _round_kernel[(1,)](x, out, x.numel(), BLOCK=32)
    assert same_values(out.float(), x.to(dtype).float())
