"""The tensor-parallel kernels and the DLRM interaction's gradient push as compiled for a GPU, checked on ONE GPU
(skipped without one).

A simulated world of ranks keeps every rank's buffers on that one GPU, and each kernel phase is launched for every
rank in turn, as the interpreter tests do on the CPU (producers before consumers, so no launch waits on one that
has not started). What the interpreter never runs (compiled layouts, vector widths, software pipelining, the
codecs' launches without fp fusion, the production tile configurations) meets the same references, on any machine
with a single GPU; the 2-GPU tests (test_*_gpu.py) add the real transport and the one-launch form. Outputs and
buffers start poisoned (NaN) so unwritten elements show.
"""

from __future__ import annotations

import re

import pytest
import torch

from fused_dlrm.dist.symmetric import SimulatedWorld
from fused_dlrm.kernels.allgather_gemm import AllGatherMatmul, GemmConfig, all_gather_matmul_reference
from fused_dlrm.kernels.gemm_allreduce import (PRODUCE, REDUCE, WAIT, GemmAllReduce, gemm_allreduce_reference,
                                               gemm_reduce_scatter_reference)
from fused_dlrm.kernels.launch import resident_programs_per_sm
from fused_dlrm.kernels.peer_flags import PeerCallMismatch, PeerRefusedInput
from fused_dlrm.kernels.quant_codecs import CODECS
from fused_dlrm.kernels.quantized_allreduce import (FusedQuantizedAllReduce, max_programs_for,
                                                    quantized_all_reduce_reference)
from test_allgather_kernels import (GATHER_REFUSALS, MATMUL_DIFFERENCES, MATMUL_REFUSALS, MATMUL_SHAPELESS_REFUSALS,
                                    check_gather_refused, check_matmul_calls_that_differ,
                                    check_matmul_refused_on_every_rank, check_matmul_refused_on_one_rank,
                                    check_matmul_refused_without_an_exchange)
from test_fused_embedding_kernels import INTERACTION_PUSH_CASES, check_interaction_push
from test_gemm_allreduce_kernel import (CALL_FORMS, DIFFERENCES, GRID_SHAPES, LATE_BY_TWO, assert_all_reduced,
                                        assert_reduce_scattered, check_calls_that_differ, check_late_by_two_calls,
                                        check_refused_on_some_ranks, poison)
from test_quantized_allreduce_gpu import world_inputs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


@pytest.mark.parametrize("world_size", [2, 4])
def test_quantized_all_reduce_equals_the_reference_bit_for_bit(world_size):
    """Every codec, fp32 and bf16, sum and mean, sizes that are no multiple of world * 32, up to 4M values, and no
    values (an empty call); the reference (the bulk twin's arithmetic) runs on the CPU. The ops keep their flags
    over all calls."""
    world = SimulatedWorld(world_size, "cuda")
    ops = [FusedQuantizedAllReduce(ws, max_programs_for(torch.device("cuda"))) for ws in world.workspaces()]
    for i, n in enumerate([45, 0, 4099, 1_000_003, 2**22 + 17]):
        mean = i % 2 == 1
        for dtype in (torch.float32, torch.bfloat16):
            xs = world_inputs(n, world_size, dtype, seed=n)
            for codec in CODECS:
                outs = [torch.full_like(x, float("nan")) for x in xs]
                calls = [op.start(x, codec, mean, out=out) for op, x, out in zip(ops, xs, outs)]
                for phase in range(3):
                    for op, call in zip(ops, calls):
                        op.run(call, phase, phase)
                expected = quantized_all_reduce_reference([x.cpu() for x in xs], codec, mean)
                for op, call in zip(ops, calls):
                    assert torch.equal(op.finish(call).cpu(), expected), (n, dtype, codec, mean)


def test_quantized_all_reduce_in_one_launch_per_rank_on_two_streams():
    """The GPU form, one launch per call with real waits on the peer's flags: the two ranks on two streams of the
    one GPU, each with at most 2 programs per SM (so both grids are resident at once), every codec three times
    on the same flags, bit-equal to the CPU reference."""
    world = SimulatedWorld(2, "cuda")
    programs = 2 * torch.cuda.get_device_properties(0).multi_processor_count
    ops = [FusedQuantizedAllReduce(ws, programs) for ws in world.workspaces()]
    streams = [torch.cuda.Stream() for _ in ops]
    for n in [4099, 2**22 + 17]:
        xs = world_inputs(n, 2, torch.bfloat16, seed=n)
        for codec in [*CODECS] * 3:
            outs = [torch.full_like(x, float("nan")) for x in xs]
            calls = [op.start(x, codec, out=out) for op, x, out in zip(ops, xs, outs)]  # plans and compiles
            torch.cuda.synchronize()
            for op, call, stream in zip(ops, calls, streams):
                with torch.cuda.stream(stream):
                    op.run(call)
            torch.cuda.synchronize()
            expected = quantized_all_reduce_reference([x.cpu() for x in xs], codec, False)
            for op, call in zip(ops, calls):
                assert torch.equal(op.finish(call).cpu(), expected), (n, codec)
    for op in ops:
        op.errors.check(block=True)


def test_quantized_all_reduce_replays_its_graph_on_two_streams():
    """Calls on the same x and out replay a CUDA graph from their second call on (the kernel reads its epoch from
    the device): new data at every call, real waits on the peer's flags (two streams, as above), bit-equal to
    the CPU reference at every call, including the one that captures."""
    world = SimulatedWorld(2, "cuda")
    programs = 2 * torch.cuda.get_device_properties(0).multi_processor_count
    ops = [FusedQuantizedAllReduce(ws, programs) for ws in world.workspaces()]
    streams = [torch.cuda.Stream() for _ in ops]
    xs = [torch.empty(4099, dtype=torch.bfloat16, device="cuda") for _ in ops]
    outs = [torch.empty_like(x) for x in xs]
    for step in range(6):
        for x, new in zip(xs, world_inputs(4099, 2, torch.bfloat16, seed=step)):
            x.copy_(new)
        for out in outs:
            out.fill_(float("nan"))
        calls = [op.start(x, "q8", out=out) for op, x, out in zip(ops, xs, outs)]
        torch.cuda.synchronize()
        for op, call, stream in zip(ops, calls, streams):
            with torch.cuda.stream(stream):
                op.run(call)
        torch.cuda.synchronize()
        expected = quantized_all_reduce_reference([x.cpu() for x in xs], "q8", False)
        for op, call in zip(ops, calls):
            assert torch.equal(op.finish(call).cpu(), expected), step
            assert len(call.plan.replays) == (step >= 1)  # captured at the second call
    for op in ops:
        op.errors.check(block=True)


@pytest.mark.parametrize("algorithm", ["auto", "two_shot"])
@pytest.mark.parametrize("world_size", [2, 3])
def test_gemm_all_reduce_matches_the_float64_sum(world_size, algorithm):
    """The default plans (grid, split over K, stages) of a GEMV at issue 5's size, of odd shapes and of a training
    step's rows (MANY_ROWS's tiles); every rank's output identical (fixed reduction order); both halves of the
    double buffers. "auto" runs the shapes of up to 64 rows one-shot."""
    world = SimulatedWorld(world_size, "cuda")
    ops = [GemmAllReduce(ws, algorithm=algorithm) for ws in world.workspaces()]
    gen = torch.Generator(device="cuda").manual_seed(0)
    for m, k, n in [(1, 4096, 8192), (5, 1000, 3000), (64, 2048, 1234), (16, 512, 28672), (1, 4096, 8192),
                    (1000, 1024, 2000), (4096, 704, 2048)]:
        xs = [torch.randn(m, k, device="cuda", generator=gen).bfloat16() for _ in range(world_size)]
        ws = [(torch.randn(k, n, device="cuda", generator=gen) / k ** 0.5).bfloat16() for _ in range(world_size)]
        poison(world)
        epochs = [op.next_epoch() for op in ops]
        for phase in (PRODUCE, REDUCE, WAIT):
            plans = [op.launch(x, w, e, phase) for op, x, w, e in zip(ops, xs, ws, epochs)]
        outs = [op.output(e, plan) for op, e, plan in zip(ops, epochs, plans)]
        expected = gemm_allreduce_reference(xs, ws)
        err = float((outs[0].double() - expected).abs().max() / expected.abs().max())
        assert not outs[0].isnan().any() and err < 1e-2, (m, k, n, err)
        assert all(torch.equal(out, outs[0]) for out in outs)
        if m <= 64:  # the training step's rows take either algorithm under "auto", by their bytes
            assert plans[0].one_shot == (algorithm == "auto")


@pytest.mark.parametrize("world_size", [2, 3])
def test_gemm_reduce_scatter_matches_the_float64_sum(world_size):
    """The reduce-scatter form's default plans: each rank's band of rows of the float64 sum (bands of 2 rows, and
    of 334 and 501: MANY_ROWS's tiles)."""
    world = SimulatedWorld(world_size, "cuda")
    ops = [GemmAllReduce(ws) for ws in world.workspaces()]
    gen = torch.Generator(device="cuda").manual_seed(1)
    for m, k, n in [(6, 1000, 3000), (1002, 1024, 2000), (6, 1000, 3000)]:
        xs = [torch.randn(m, k, device="cuda", generator=gen).bfloat16() for _ in range(world_size)]
        ws = [(torch.randn(k, n, device="cuda", generator=gen) / k ** 0.5).bfloat16() for _ in range(world_size)]
        poison(world)
        epochs = [op.next_epoch() for op in ops]
        for phase in (PRODUCE, REDUCE, WAIT):
            plans = [op.launch(x, w, e, phase, scatter=True) for op, x, w, e in zip(ops, xs, ws, epochs)]
        outs = [op.output(e, plan) for op, e, plan in zip(ops, epochs, plans)]
        for out, expected in zip(outs, gemm_reduce_scatter_reference(xs, ws), strict=True):
            err = float((out.double() - expected).abs().max() / expected.abs().max())
            assert out.shape == expected.shape and not out.isnan().any() and err < 1e-2, (m, k, n, err)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("difference", list(DIFFERENCES))
def test_gemm_all_reduce_calls_that_differ_raise_on_every_rank(world_size, difference):
    """The interpreter test's calls that differ between ranks (test_gemm_allreduce_kernel.check_calls_that_differ:
    shapes, dtype, form, tiles, K split, algorithm, grid), as compiled: every rank raises naming both calls (at
    `check(block=True)`: on GPUs the error word is read without stalling), and the next call is exact."""
    check_calls_that_differ(world_size, difference, "cuda")


@pytest.mark.parametrize("form", list(CALL_FORMS))
@pytest.mark.parametrize("refusal", ["3-D x", "fp32 x", "too large", "w on another device"])
def test_gemm_all_reduce_call_refused_on_one_rank_raises_on_every_rank(refusal, form):
    """The interpreter test's refusals (test_gemm_allreduce_kernel.check_refused_on_some_ranks), as compiled: rank 1
    raises its ValueError, rank 0 PeerRefusedInput naming rank 1 and why (at `check(block=True)`), and the next
    call is exact."""
    check_refused_on_some_ranks(2, (1,), refusal, form, "cuda")


@pytest.mark.parametrize("then", LATE_BY_TWO)
@pytest.mark.parametrize("form", list(CALL_FORMS))
def test_gemm_all_reduce_peer_late_by_two_calls(form, then):
    """The interpreter test's peer late by two calls (test_gemm_allreduce_kernel.check_late_by_two_calls), as
    compiled: rank 0's call after next stores nothing into rank 1, which has not reduced the call before; rank 1's
    late call is exact, the timeouts name the rank and step, and the calls after are exact."""
    check_late_by_two_calls(form, then, "cuda")


@pytest.mark.parametrize("form", list(CALL_FORMS))
def test_gemm_all_reduce_refused_calls_in_one_launch_per_rank_on_two_streams(form):
    """The GPU form with real waits (two streams, half the SMs each): a call both ranks refuse (a 3-D x: each raises
    its own ValueError; it also loads the refused call's kernel before any launch spins on the peer's flags), a
    call alike, a call rank 1 alone refuses (rank 1 raises its ValueError, rank 0 PeerRefusedInput naming it, not a
    timeout after the wait's bound), and a call alike: the calls alike are exact."""
    algorithm, scatter = CALL_FORMS[form]
    world = SimulatedWorld(2, "cuda")
    programs = torch.cuda.get_device_properties(0).multi_processor_count // 2
    ops = [GemmAllReduce(ws, num_programs=programs, algorithm=algorithm) for ws in world.workspaces()]
    streams = [torch.cuda.Stream() for _ in ops]
    gen = torch.Generator(device="cuda").manual_seed(4)
    m, k, n = 64, 1000, 3000
    bad = torch.ones(2, m, k, device="cuda", dtype=torch.bfloat16)
    for step, refusing in enumerate([(0, 1), (), (1,), ()]):
        xs = [torch.randn(m, k, device="cuda", generator=gen).bfloat16() for _ in ops]
        ws = [(torch.randn(k, n, device="cuda", generator=gen) / k ** 0.5).bfloat16() for _ in ops]
        for op, x, w in zip(ops, xs, ws):
            op.prepare(x, w, scatter=scatter)  # compiled and loaded before a launch spins on the peer's flags
        poison(world)
        torch.cuda.synchronize()
        outs = []
        for rank, (op, stream, x, w) in enumerate(zip(ops, streams, xs, ws)):
            with torch.cuda.stream(stream):
                call = op.reduce_scatter if scatter else op
                if rank in refusing:
                    with pytest.raises(ValueError, match=r"expected x \[M, K\] and w \[K, N\]"):
                        call(bad, w)
                else:
                    outs.append(call(x, w))
        torch.cuda.synchronize()
        if refusing == (1,):
            with pytest.raises(PeerRefusedInput, match=rf"at step {step + 1}: rank 0: rank 1's call was refused: "
                                                       r"its x \[2, 64, 1000\] bfloat16 and w \[1000, 3000\]"):
                ops[0].errors.check(block=True)
        for op in ops:
            op.errors.check(block=True)  # nothing (else) recorded
        if not refusing:
            (assert_reduce_scattered if scatter else assert_all_reduced)([o.clone() for o in outs], xs, ws)


def test_gemm_all_reduce_plans_grids_fit_the_gpu_at_once():
    """The plans' own grids (up to two programs per SM) as compiled here: each binary fits its grid on the GPU at
    once (registers, shared memory), what test_gemm_allreduce_kernel's sm_90 build checks on the CPU."""
    op = GemmAllReduce(SimulatedWorld(2, "cuda").workspaces()[0])
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for m, n, k, scatter in GRID_SHAPES:
        x, w = torch.randn(m, k, device="cuda").bfloat16(), torch.randn(k, n, device="cuda").bfloat16()
        plan = op.prepare(x, w, scatter=scatter)
        binary = op._launches.compiled(plan.key, (plan.num_programs, 1, 1), plan.args(x, w, 0), plan.options)
        per_sm = resident_programs_per_sm(binary.n_regs, binary.metadata.num_warps, binary.metadata.shared)
        assert per_sm * sms >= plan.num_programs, (m, n, scatter, plan.num_programs, binary.n_regs, binary.n_spills)


@pytest.mark.parametrize("algorithm", ["one_shot", "two_shot"])
def test_gemm_all_reduce_in_one_launch_per_rank_on_two_streams(algorithm):
    """The GPU form, one launch per call with real waits on the peer's flags: the two ranks on two streams of the
    one GPU, each on half of the SMs (so both grids are resident at once), 60 calls back to back on the same
    flags, every 10th checked."""
    world = SimulatedWorld(2, "cuda")
    programs = torch.cuda.get_device_properties(0).multi_processor_count // 2
    ops = [GemmAllReduce(ws, num_programs=programs, algorithm=algorithm) for ws in world.workspaces()]
    streams = [torch.cuda.Stream() for _ in ops]
    gen = torch.Generator(device="cuda").manual_seed(2)
    for m, k, n in [(1, 4096, 8192), (64, 1000, 3000), (1000, 1024, 2000)]:
        xs = [torch.randn(m, k, device="cuda", generator=gen).bfloat16() for _ in ops]
        ws = [(torch.randn(k, n, device="cuda", generator=gen) / k ** 0.5).bfloat16() for _ in ops]
        for op, x, w in zip(ops, xs, ws):
            op.prepare(x, w)  # compiled and loaded before rank 0's first launch spins on rank 1's flags
        poison(world)
        torch.cuda.synchronize()
        for call in range(60):
            scale = 1.0 + call % 7
            outs = []
            for op, stream, x, w in zip(ops, streams, xs, ws):
                with torch.cuda.stream(stream):
                    outs.append(op(x * scale, w))
            if call % 10 == 9:
                torch.cuda.synchronize()
                expected = gemm_allreduce_reference([x * scale for x in xs], ws)
                err = float((outs[0].double() - expected).abs().max() / expected.abs().max())
                assert not outs[0].isnan().any() and err < 1e-2, (m, k, n, call, err)
                assert torch.equal(outs[0], outs[1])
    for op in ops:
        op.errors.check(block=True)


@pytest.mark.parametrize("difference", ["rows", "no rows", "dtype", "form"])
def test_gemm_all_reduce_calls_that_differ_in_one_launch_per_rank_on_two_streams(difference):
    """The GPU form with real waits (two streams, half the SMs each, the default tiles): rank 1's call has other rows,
    none (an empty batch), another dtype, or is a reduce-scatter; both ranks raise naming both calls, and the next
    calls, alike, are exact."""
    world = SimulatedWorld(2, "cuda")
    programs = torch.cuda.get_device_properties(0).multi_processor_count // 2
    ops = [GemmAllReduce(ws, num_programs=programs) for ws in world.workspaces()]
    streams = [torch.cuda.Stream() for _ in ops]
    gen = torch.Generator(device="cuda").manual_seed(3)
    shapes = [(64, torch.bfloat16, False), {"rows": (48, torch.bfloat16, False), "no rows": (0, torch.bfloat16, False),
                                            "dtype": (64, torch.float16, False),
                                            "form": (64, torch.bfloat16, True)}[difference]]
    said = [f"x [{m}, 1000] @ w [1000, 3000] {str(dtype).removeprefix('torch.')}, "
            f"{'reduce-scatter' if scatter else 'all-reduce, one-shot'}" for m, dtype, scatter in shapes]
    for step in range(3):  # alike, rank 1's call unlike rank 0's, alike
        calls = [shapes[0], shapes[step == 1]]
        xs = [torch.randn(m, 1000, device="cuda", generator=gen).to(dtype) for m, dtype, _ in calls]
        ws = [(torch.randn(1000, 3000, device="cuda", generator=gen) / 1000 ** 0.5).to(dtype) for _, dtype, _ in calls]
        for op, x, w, (_, _, scatter) in zip(ops, xs, ws, calls):
            op.prepare(x, w, scatter=scatter)  # compiled and loaded before a launch spins on the peer's flags
        poison(world)
        torch.cuda.synchronize()
        outs = []
        for op, stream, x, w, (_, _, scatter) in zip(ops, streams, xs, ws, calls):
            with torch.cuda.stream(stream):
                outs.append(op.reduce_scatter(x, w) if scatter else op(x, w))
        torch.cuda.synchronize()
        if step == 1:
            for rank, op in enumerate(ops):
                mine, theirs = (said[1], said[0]) if rank == 1 else (said[0], said[1])
                with pytest.raises(PeerCallMismatch, match=rf"rank {rank} at step 2: peer {1 - rank} called it with "
                                                           rf"{re.escape(theirs)}.*; this rank with {re.escape(mine)}"):
                    op.errors.check(block=True)
            continue
        expected = gemm_allreduce_reference(xs, ws)
        err = float((outs[0].double() - expected).abs().max() / expected.abs().max())
        assert not outs[0].isnan().any() and err < 1e-2 and torch.equal(outs[0], outs[1]), (step, err)
        for op in ops:
            op.errors.check(block=True)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("chunk_rows", [256, 192])
def test_all_gather_matmul_device_push(dtype, chunk_rows):
    """The production GEMM configuration (GemmConfig's tiles and stages) on a partial last N tile; chunks of 192
    rows make 128-row tiles straddle two chunks. Every rank's push first, then every rank's GEMM."""
    world_size, rows, k, n = 2, 640, 1024, 1000
    config = GemmConfig(chunk_rows=chunk_rows)
    world = SimulatedWorld(world_size, "cuda")
    ops = [AllGatherMatmul(ws, rows, k, dtype, config) for ws in world.workspaces()]
    gen = torch.Generator(device="cuda").manual_seed(1)
    weight = (torch.randn(k, n, device="cuda", generator=gen) / k ** 0.5).to(dtype)
    for _ in range(3):  # both halves of the double buffer, and back
        shards = [torch.randn(rows, k, device="cuda", generator=gen).to(dtype) for _ in range(world_size)]
        poison(world)
        epochs = [op.start(shard, "device") for op, shard in zip(ops, shards)]
        outs = [op.finish(e, shard, weight, "device") for op, e, shard in zip(ops, epochs, shards)]
        expected = all_gather_matmul_reference(shards, weight)
        for out in outs:
            err = float((out.double() - expected).norm() / expected.norm())
            assert not out.isnan().any() and err < 2e-3, err


@pytest.mark.parametrize("weight_layout", ["linear", "contiguous"])
def test_all_gather_matmul_waits_for_a_producer_running_alongside(weight_layout):
    """Rank 1's push runs on another stream behind a sleep while rank 0's GEMM (the production tiles, with SMs to
    spare for the push) already waits for its chunks in a poisoned buffer: the tiles of rank 1's rows must read
    them only after their flags (on one GPU this checks the waits against a concurrent producer, not the ordering
    across NVLink)."""
    rows, k, n = 1024, 512, 1000
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    config = GemmConfig(chunk_rows=192, num_programs=sms - 16)
    world = SimulatedWorld(2, "cuda")
    ops = [AllGatherMatmul(ws, rows, k, torch.float16, config) for ws in world.workspaces()]
    gen = torch.Generator(device="cuda").manual_seed(2)
    weight = (torch.randn(n, k, device="cuda", generator=gen) / k ** 0.5).half()
    weight = weight.t() if weight_layout == "linear" else weight.t().contiguous()
    side = torch.cuda.Stream()
    for _ in range(3):  # both halves of the double buffer, and back
        shards = [torch.randn(rows, k, device="cuda", generator=gen).half() for _ in range(2)]
        poison(world)
        torch.cuda.synchronize()
        with torch.cuda.stream(side):
            torch.cuda._sleep(20_000_000)  # ~10 ms: rank 0's GEMM has long started when rank 1 pushes
            epoch1 = ops[1].start(shards[1], "device")
        out = ops[0].finish(ops[0].start(shards[0], "device"), shards[0], weight, "device")
        torch.cuda.synchronize()
        expected = all_gather_matmul_reference(shards, weight)
        err = float((out.double() - expected).norm() / expected.norm())
        assert not out.isnan().any() and err < 2e-3, err
        ops[1].finish(epoch1, shards[1], weight, "device")  # its ack lets rank 0 push into it next time
    for op in ops:
        op.errors.check(block=True)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("difference", list(MATMUL_DIFFERENCES))
def test_all_gather_matmul_calls_that_differ_raise_on_every_rank(world_size, difference):
    """The interpreter test's calls that differ between ranks (test_allgather_kernels.check_matmul_calls_that_differ:
    rows, K, dtype, producer, rows per chunk), as compiled: every rank raises naming both calls (at
    `check(block=True)`), the next call of the shape the mismatch left apart raises too, one of a new shape is
    exact."""
    check_matmul_calls_that_differ(world_size, difference, "cuda")


@pytest.mark.parametrize("producer", ["copy_engine", "device"])
@pytest.mark.parametrize("refusal", list(MATMUL_REFUSALS))
def test_all_gather_matmul_call_refused_on_one_rank_raises_on_every_rank(refusal, producer):
    """The interpreter test's refusals (test_allgather_kernels.check_matmul_refused_on_one_rank: a weight or out rank
    1 refuses), as compiled: rank 1 raises its ValueError, rank 0 PeerRefusedInput naming rank 1 and why (at
    `check(block=True)`), and the next call is exact."""
    check_matmul_refused_on_one_rank(2, refusal, producer, "cuda")


@pytest.mark.parametrize("producer", ["copy_engine", "device"])
@pytest.mark.parametrize("refusal", list(MATMUL_SHAPELESS_REFUSALS))
def test_all_gather_matmul_refused_without_an_exchange_raises_on_every_rank(refusal, producer):
    """The interpreter test's x_shard of no shape class or unknown producer on rank 1
    (test_allgather_kernels.check_matmul_refused_without_an_exchange), as compiled: every rank raises at that call,
    rank 1 catches up the peers' exchange (its epoch, its ack: the ack-only refused-call kernel), and the next two
    calls of that shape are exact."""
    check_matmul_refused_without_an_exchange(2, refusal, producer, "cuda")


@pytest.mark.parametrize("producer", ["copy_engine", "device"])
def test_all_gather_matmul_refused_without_an_exchange_by_ranks_of_three_in_a_row(producer):
    check_matmul_refused_without_an_exchange(3, "fp32 x_shard", producer, "cuda", refusing=(2, 1, 2))


@pytest.mark.parametrize("producer", ["copy_engine", "device"])
def test_all_gather_matmul_refused_on_every_rank_with_and_without_an_exchange(producer):
    """The interpreter test's call refused on every rank (test_allgather_kernels.check_matmul_refused_on_every_rank),
    as compiled: rank 0's x_shard of no shape class, rank 1's weight (a call of the exchange, which it describes):
    rank 0 catches that exchange up, and the next two calls of that shape are exact."""
    check_matmul_refused_on_every_rank(("fp32 x_shard", "weight of other dtype"), producer, "cuda")


@pytest.mark.parametrize("refusal", list(GATHER_REFUSALS))
def test_all_gather_refused_on_one_rank_raises_on_every_rank(refusal):
    """The interpreter test's refusals of the all-gather (test_allgather_kernels.check_gather_refused: a shard or
    producer rank 1 refuses) with the device push, as compiled: rank 1 raises its ValueError, rank 0
    PeerRefusedInput naming rank 1 and why (at `check(block=True)`), and the next calls are exact."""
    check_gather_refused(2, [{1: refusal}], "device", "cuda")


def test_all_gather_refused_calls_in_a_row_keep_the_epochs_in_step():
    check_gather_refused(3, [{1: "more rows"}, {0: "other cols"}, {1: "other device"}, {2: "3-D"}], "device", "cuda")


@pytest.mark.parametrize("world_size,batch_sizes,column_shards,row_shards,features,dim",
                         [(*case, 5, 64) for case in INTERACTION_PUSH_CASES] + [(2, [300, 257], 1, 1, 26, 16)])
def test_interaction_backward_pushes_into_the_owners(world_size, batch_sizes, column_shards, row_shards, features,
                                                     dim):
    """DLRM's interaction storing d S into the fused embedding exchange's owners, as compiled (the interpreter
    test's check, test_fused_embedding_kernels.py, row blocks included), and at Criteo's F = 26, D = 16 over 557
    samples."""
    check_interaction_push(world_size, batch_sizes, column_shards, row_shards, "cuda", dim, features)
