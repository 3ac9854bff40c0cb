"""All-gather primitives and AllGather + GEMM on simulated worlds of 2, 4 and 8 ranks (interpreter on the CPU).

Every rank's producer runs before any rank's consumer (one process); buffers and outputs start poisoned (NaN) so
unwritten elements show; results are compared with pure-torch references (torch.cat, float64 matmul).
"""

from __future__ import annotations

import dataclasses
import os
import re

import pytest
import torch

from fused_dlrm.dist.symmetric import AllocationRefused, SimulatedWorld
from fused_dlrm.kernels import peer_flags
from fused_dlrm.kernels.allgather import PRODUCERS, SymmetricAllGather, all_gather_reference
from fused_dlrm.kernels.allgather_gemm import (CALLS, GemmConfig, all_gather_matmul, all_gather_matmul_bulk,
                                               all_gather_matmul_reference, lead_rounds, op_for, refused_call, tile_map)

from fused_dlrm.kernels.peer_flags import PeerCallMismatch, PeerRefusedInput, PeerWaitTimeout
from sm90 import compile_for_sm90
from world import run_world

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs in the Triton interpreter")


def gathers(world_size, rows, cols, dtype, chunk_rows, device="cpu", **kw):
    ops = [SymmetricAllGather(ws, rows, cols, dtype, chunk_rows, spin_limit=50, block_rows=4, block_cols=8, **kw)
           for ws in SimulatedWorld(world_size, device).workspaces()]
    for op in ops:
        op.data.local.fill_(float("nan"))
    return ops


def run_gather(ops, shards, producers):
    epochs = [op.start(s, p) for op, s, p in zip(ops, shards, producers)]  # every producer first
    return [op.finish(e, p).clone() for op, e, p in zip(ops, epochs, producers)]


@pytest.mark.parametrize("world_size", [2, 4, 8])
@pytest.mark.parametrize("producer", PRODUCERS)
def test_all_gather_matches_cat(world_size, producer):
    rows, cols = 7, 13  # chunks of 3 rows: the last chunk has 1
    gen = torch.Generator().manual_seed(world_size)
    ops = gathers(world_size, rows, cols, torch.float16, chunk_rows=3, num_programs=3)
    for _ in range(3):
        shards = [torch.randn(rows, cols, generator=gen).to(torch.float16) for _ in range(world_size)]
        for got in run_gather(ops, shards, [producer] * world_size):
            torch.testing.assert_close(got, all_gather_reference(shards), rtol=0, atol=0)


def test_many_epochs_on_the_same_flags_with_producers_changing_between_calls():
    world_size, rows, cols = 2, 5, 6
    gen = torch.Generator().manual_seed(7)
    ops = gathers(world_size, rows, cols, torch.bfloat16, chunk_rows=2)
    for step in range(30):
        shards = [(torch.randn(rows, cols, generator=gen) * (step + 1)).to(torch.bfloat16) for _ in ops]
        producers = [PRODUCERS[step % len(PRODUCERS)]] * world_size  # every rank uses the same one per call
        for got in run_gather(ops, shards, producers):
            torch.testing.assert_close(got, all_gather_reference(shards), rtol=0, atol=0)
    assert ops[0].next_epoch() == 31


def test_a_missing_peer_times_out_naming_rank_and_chunk():
    ops = gathers(2, 4, 3, torch.float32, chunk_rows=2)
    shard = torch.randn(4, 3)
    epoch = ops[0].start(shard, "device")  # rank 1 never produces
    with pytest.raises(PeerWaitTimeout, match=r"rank 0 timed out at step 1 waiting for rank 1, slice [01]"):
        ops[0].finish(epoch, "device")


def test_a_producer_waits_for_the_peer_to_release_its_half():
    ops = gathers(2, 4, 3, torch.float32, chunk_rows=4)
    shards = [torch.randn(4, 3) for _ in ops]
    run_gather(ops, shards, ["copy_engine"] * 2)
    ops[0].start(shards[0], "copy_engine")  # epoch 2: rank 1 has acknowledged epoch 1, so this may go ahead
    ops[0].errors.after_wait()
    ops[0].start(shards[0], "copy_engine")  # epoch 3 would overwrite epoch 1's half: rank 1 never took epoch 2
    with pytest.raises(PeerWaitTimeout, match=r"rank 0 timed out at step 3 waiting for rank 1 to release"):
        ops[0].errors.after_wait()


@pytest.mark.parametrize("calls_late", [1, 2])
def test_a_late_peer_finishes_its_calls_exactly_and_the_next_call_is_exact(calls_late):
    """Rank 1 comes late to call 2 (and 3), the device push: rank 0's wait gives up and acknowledges call 2 all the
    same (its call is over), so rank 1 finishes call 2 exactly. Two calls late, rank 0's push of call 3 gives up
    waiting for rank 1's release: it stores nothing and raises no flag, so rank 1 times out naming rank 0 instead
    of taking its half's chunks of call 1. Then every call is exact. (Once, the wait acknowledged only what arrived:
    the late peer's next push gave up, and raised its flags over chunks it never stored: rank 0 returned call 1's
    chunks as call 3's, without an error.)"""
    ops = gathers(2, 4, 3, torch.float32, chunk_rows=2)
    gen = torch.Generator().manual_seed(3)
    calls = [[torch.randn(4, 3, generator=gen) for _ in ops] for _ in range(1 + calls_late + 2)]
    for got in run_gather(ops, calls[0], ["device"] * 2):
        torch.testing.assert_close(got, all_gather_reference(calls[0]), rtol=0, atol=0)
    for step, waited in zip(range(2, 2 + calls_late), ["rank 1, slice", "rank 1 to release"]):  # rank 0 alone
        epoch = ops[0].start(calls[step - 1][0], "device")
        with pytest.raises(PeerWaitTimeout, match=rf"rank 0 timed out at step {step} waiting for {waited}"):
            ops[0].finish(epoch, "device")
    epoch = ops[1].start(calls[1][1], "device")  # rank 1's call 2
    torch.testing.assert_close(ops[1].finish(epoch, "device"), all_gather_reference(calls[1]), rtol=0, atol=0)
    if calls_late == 2:
        epoch = ops[1].start(calls[2][1], "device")
        with pytest.raises(PeerWaitTimeout, match=r"rank 1 timed out at step 3 waiting for rank 0, slice"):
            ops[1].finish(epoch, "device")
    for shards in calls[-2:]:
        for got in run_gather(ops, shards, ["device"] * 2):
            torch.testing.assert_close(got, all_gather_reference(shards), rtol=0, atol=0)


@pytest.mark.parametrize("producer", PRODUCERS)
def test_an_all_gather_of_empty_shards_is_a_call(producer):
    """Shards of 0 rows on every rank, between calls of rows on the same workspaces: a [0, cols] result, and a
    call all the same (one flag of no rows per rank): a rank whose peer never makes it times out naming them."""
    gen = torch.Generator().manual_seed(5)
    workspaces = SimulatedWorld(2).workspaces()
    ops = {rows: [SymmetricAllGather(ws, rows, 3, torch.float32, 2, spin_limit=50) for ws in workspaces]
           for rows in (4, 0)}
    for rows in (4, 0, 0, 4):
        shards = [torch.randn(rows, 3, generator=gen) for _ in workspaces]
        for got in run_gather(ops[rows], shards, [producer] * 2):
            assert torch.equal(got, all_gather_reference(shards))
    epoch = ops[0][0].start(torch.empty(0, 3), producer)  # rank 1 never makes this call
    with pytest.raises(PeerWaitTimeout, match=r"rank 0 timed out at step 3 waiting for rank 1, slice 0"):
        ops[0][0].finish(epoch, producer)


# A shard that rank 1 refuses (the exchange: [7, 5] float16, chunks of 3 rows) or its producer, made on a device;
# the error it raises itself, what its peers say of it.
GATHER_REFUSALS = {
    "more rows": (lambda d: (torch.randn(8, 5, device=d).half(), "device"),
                  r"shard \(8, 5\) torch.float16 on \S+: expected \(7, 5\) torch.float16 on",
                  r"its shard \[8, 5\] float16 is not the exchange's \[7, 5\] float16 on its device"),
    "other cols": (lambda d: (torch.randn(7, 4, device=d).half(), "pull"), r"shard \(7, 4\)",
                   r"its shard \[7, 4\] float16 is"),
    "other dtype": (lambda d: (torch.randn(7, 5, device=d), "copy_engine"), r"shard \(7, 5\) torch.float32",
                    r"its shard \[7, 5\] float32 is not"),
    "3-D": (lambda d: (torch.randn(7, 5, 1, device=d).half(), "device"), r"shard \(7, 5, 1\)",
            r"its shard \[7, 5, 1\] float16"),
    "other device": (lambda d: (torch.empty(7, 5, dtype=torch.float16, device="meta"), "device"),
                     r"shard \(7, 5\) torch.float16 on meta",
                     r"its shard \[7, 5\] float16 on another device is not the exchange's"),
    "unknown producer": (lambda d: (torch.randn(7, 5, device=d).half(), "nvlink"), "unknown producer 'nvlink'",
                         r"its producer is not one of \('device', 'copy_engine', 'pull'\)"),
}


def check_gather_refused(world_size: int, rounds: list[dict[int, str]], producer: str, device: str = "cpu") -> None:
    """Calls 2, 3, ... of an exchange of uneven chunks, one per round: the ranks of the round refuse their shard or
    producer (GATHER_REFUSALS), the others call with `producer`: each refusing rank raises its own error, every
    other rank PeerRefusedInput naming the lowest refusing rank and why (a refused call still raises its flags and
    says why beside them). The calls around them, on both halves of the buffers (poisoned first), are exact."""
    gen = torch.Generator().manual_seed(world_size + len(rounds))
    ops = gathers(world_size, 7, 5, torch.float16, chunk_rows=3, num_programs=2, device=device)

    def exact():
        for op in ops:
            op.data.local.fill_(float("nan"))
        shards = [torch.randn(7, 5, generator=gen).to(device, torch.float16) for _ in ops]
        for got in run_gather(ops, shards, [producer] * world_size):
            assert torch.equal(got, all_gather_reference(shards))

    exact()
    for step, refusals in enumerate(rounds, start=2):
        epochs = {}
        for rank, op in enumerate(ops):  # every rank's producer first
            if rank in refusals:
                shard, refused_producer = GATHER_REFUSALS[refusals[rank]][0](device)
                with pytest.raises(ValueError, match=GATHER_REFUSALS[refusals[rank]][1]):
                    op.start(shard, refused_producer)
            else:
                epochs[rank] = op.start(torch.randn(7, 5, generator=gen).to(device, torch.float16), producer)
        first = min(refusals)
        for rank, epoch in epochs.items():
            with pytest.raises(PeerRefusedInput, match=rf"^all-gather at step {step}: rank {rank}: rank {first}'s "
                                                       rf"call was refused: {GATHER_REFUSALS[refusals[first]][2]}"):
                ops[rank].finish(epoch, producer)  # on the CPU
                ops[rank].errors.check(block=True)  # on GPUs
    for _ in range(3):
        exact()
    for op in ops:
        op.errors.check(block=True)


@pytest.mark.parametrize("producer", PRODUCERS)
@pytest.mark.parametrize("refusal", list(GATHER_REFUSALS))
def test_all_gather_refused_on_one_rank_raises_on_every_rank(refusal, producer):
    check_gather_refused(2, [{1: refusal}], producer)


@pytest.mark.parametrize("producer", PRODUCERS)
def test_all_gather_refused_on_two_ranks_of_three_names_the_lowest(producer):
    check_gather_refused(3, [{2: "other dtype", 1: "unknown producer"}], producer)


@pytest.mark.parametrize("producer", PRODUCERS)
def test_all_gather_refused_calls_in_a_row_keep_the_epochs_in_step(producer):
    """Refusals of one rank, then another's, then the first's again: both halves of the refusals' buffer."""
    check_gather_refused(3, [{1: "more rows"}, {0: "other cols"}, {1: "other device"}, {2: "3-D"}], producer)


SMALL = GemmConfig(block_m=16, block_n=16, block_k=16, group_m=2, chunk_rows=16, copy_rows=16, num_programs=3,
                   spin_limit=50)
STRADDLE = dataclasses.replace(SMALL, chunk_rows=24, copy_rows=24)
# 5 programs, 3 of them pushing (3 chunks of one peer): the 2 others take the first 2 (LEAD) or all 6 (LEAD_ALL)
# local tiles alone before the rest are dealt among all 5
LEAD = dataclasses.replace(SMALL, num_programs=5, push_rounds=1)
LEAD_ALL = dataclasses.replace(SMALL, num_programs=5, push_rounds=9)
TOL = {torch.float16: 2e-3, torch.bfloat16: 2e-2}


def matmul_world(world_size, device="cpu"):
    return SimulatedWorld(world_size, device).workspaces()


def run_matmul(workspaces, shards, weight, producer, return_gathered=False, config=SMALL):
    """Every rank's all_gather_matmul, producers first; outputs start as NaN."""
    ops = [op_for(ws, shards[0], config) for ws in workspaces]
    epochs = [op.start(s, producer) for op, s in zip(ops, shards)]
    outs = [torch.full((len(shards) * s.shape[0], weight.shape[1]), float("nan"), dtype=s.dtype, device=s.device)
            for s in shards]
    return [op.finish(e, s, weight, producer, return_gathered, out=o)
            for op, e, s, o in zip(ops, epochs, shards, outs)]


def relative_error(got, expected):
    return float((got.double() - expected).norm() / expected.norm())


@pytest.mark.parametrize("world_size,config,rows", [(2, SMALL, 41), (4, SMALL, 41), (8, SMALL, 20),
                                                    (2, STRADDLE, 41), (2, LEAD, 41), (2, LEAD_ALL, 41),
                                                    (3, LEAD, 20)])
@pytest.mark.parametrize("producer", ["copy_engine", "device"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_all_gather_matmul_matches_reference(world_size, config, rows, producer, dtype):
    k, n = 24, 19  # rows, K and N not multiples of the tiles (K a multiple of 8: TMA); SMALL: chunks of 16 rows,
    # the last has 9 (4 in the world of 8, given fewer rows: the interpreter's time grows with world x world x rows);
    # STRADDLE: chunks of 24 rows, so the 16-row tile of rows 16..31 reads two chunks
    gen = torch.Generator().manual_seed(11 * world_size)
    workspaces = matmul_world(world_size)
    for return_gathered in (False, True):  # two consecutive calls: both halves of the double buffer
        shards = [torch.randn(rows, k, generator=gen).to(dtype) for _ in range(world_size)]
        weight = torch.randn(n, k, generator=gen).to(dtype).t()  # a Linear's weight.t(): not contiguous
        expected = all_gather_matmul_reference(shards, weight)
        for got in run_matmul(workspaces, shards, weight, producer, return_gathered, config):
            out, gathered = got if return_gathered else (got, None)
            assert relative_error(out, expected) < TOL[dtype]
            if return_gathered:
                torch.testing.assert_close(gathered, all_gather_reference(shards), rtol=0, atol=0)


@pytest.mark.parametrize("world_size,rows,chunk_rows,block_m", [
    (2, 1000, 256, 128), (2, 1000, 200, 128), (4, 45, 24, 16), (2, 7, 3, 4), (3, 64, 64, 16), (2, 40, 100, 16),
    (8, 45, 24, 16), (8, 300, 100, 64)])
def test_every_tile_waits_for_every_chunk_it_reads(world_size, rows, chunk_rows, block_m):
    """The GEMM's own tile walk and chunk helpers: every (source, row, N-block) is computed exactly once, and each
    tile waits for exactly the chunks holding its rows (chunk_rows differing from block_m, tiles straddling chunks).
    A tile that read rows whose flag it did not wait for is the race the GPU shows when copies overlap the GEMM."""
    config = GemmConfig(block_m=block_m, block_n=16, group_m=3)
    n = 40  # 3 N-blocks, the last partial
    chunk_rows = min(chunk_rows, rows)  # as SymmetricAllGather clamps it
    for rank in range(world_size):
        tiles = tile_map(rank, world_size, rows, n, chunk_rows, config).tolist()
        seen = set()
        for t, (source, mb, nb, first, last) in enumerate(tiles):
            if t < len(tiles) // world_size:
                assert source == rank, "the local shard comes first"
            lo, hi = mb * block_m, min(mb * block_m + block_m, rows)  # the rows the tile reads
            assert 0 <= lo < hi <= rows and 0 <= nb < 3 and 0 <= source < world_size
            assert first == lo // chunk_rows and last == (hi - 1) // chunk_rows, (t, lo, hi, first, last)
            assert first * chunk_rows <= lo and hi <= (last + 1) * chunk_rows
            assert (source, mb, nb) not in seen
            seen.add((source, mb, nb))
        assert len(seen) == world_size * -(-rows // block_m) * 3


@pytest.mark.parametrize("producer", ["copy_engine", "device"])
def test_a_chunk_that_has_not_landed_is_reported_and_touches_only_its_rows(producer):
    """A simulated world where the GEMM runs before one chunk of rank 1 has landed (its data still poison, its flag
    down): rank 0 must report that chunk, and every output row outside it must be exact (no tile reads it unless it
    waited for it; STRADDLE's tiles of rows 16..31 read chunks 0 and 1)."""
    rows, k, n, missing = 45, 16, 24, 1
    gen = torch.Generator().manual_seed(13)
    workspaces = matmul_world(2)
    shards = [torch.randn(rows, k, generator=gen).to(torch.float16) for _ in range(2)]
    weight = torch.randn(k, n, generator=gen).to(torch.float16)
    ops = [op_for(ws, shards[0], STRADDLE) for ws in workspaces]
    epochs = [op.start(s, producer) for op, s in zip(ops, shards)]
    g0, g1 = ops[0].gather_for(producer), ops[1].gather_for(producer)
    lost = slice(missing * g0.chunk_rows, min((missing + 1) * g0.chunk_rows, rows))
    if producer == "copy_engine":  # rank 1 has not published that chunk: its own flag and slot
        g1.ready.local[1 * g1.chunks + missing] = epochs[1] - 1
        g1.gathered(epochs[1])[rows:2 * rows][lost] = float("nan")
    else:  # rank 1's push of that chunk has not reached rank 0
        g0.ready.local[1 * g0.chunks + missing] = epochs[0] - 1
        g0.gathered(epochs[0])[rows:2 * rows][lost] = float("nan")
    out = torch.full((2 * rows, n), float("nan"), dtype=torch.float16)
    with pytest.raises(PeerWaitTimeout, match=rf"rank 0 timed out at step 1 waiting for rank 1, slice {missing}"):
        ops[0].finish(epochs[0], shards[0], weight, producer, out=out)
    expected = all_gather_matmul_reference(shards, weight)
    keep = torch.ones(2 * rows, dtype=torch.bool)
    keep[rows + lost.start:rows + lost.stop] = False
    assert relative_error(out[keep], expected[keep]) < 2e-3


@pytest.mark.parametrize("producer", ["copy_engine", "device"])
def test_no_tile_reads_a_chunk_before_its_flag(monkeypatch, producer):
    """The GPU's overlap, simulated: when rank 0's GEMM starts, none of rank 1's chunks has landed in its buffer
    (poison, flags down); a chunk lands (data, then flag) only when a tile first waits for its flag. Tiles run in
    walk order (one program); STRADDLE's tile of rows 16..31 reads chunk 1 before any tile of rows 32.. waits for
    it, so a tile that read rows whose flag it did not wait for returns poison instead of the product."""
    rows, k, n = 45, 16, 24
    config = dataclasses.replace(STRADDLE, num_programs=1)
    gen = torch.Generator().manual_seed(19)
    shards = [torch.randn(rows, k, generator=gen).to(torch.float16) for _ in range(2)]
    weight = torch.randn(k, n, generator=gen).to(torch.float16)
    ops = [op_for(ws, shards[0], config) for ws in matmul_world(2)]
    for _ in range(2):  # both halves of the double buffer
        epochs = [op.start(s, producer) for op, s in zip(ops, shards)]
        ops[1].finish(epochs[1], shards[1], weight, producer)
        gather, in_flight = ops[0].gather_for(producer), {}
        launch, wait = ops[0]._launch, peer_flags.wait_at_least

        def launch_before_the_chunks_land(x, w, out, epoch, push, compute, pushers, exchange=None):
            if compute:
                theirs = gather.gathered(epoch)[rows:2 * rows]  # rank 1's rows in rank 0's buffer
                for chunk in range(gather.chunks):
                    index, part = gather.chunks + chunk, gather._chunk_rows(chunk)
                    in_flight[gather.ready.local[index:].data_ptr()] = (part, theirs[part].clone(), index, epoch)
                    theirs[part] = float("nan")
                    gather.ready.local[index] = epoch - 1
            launch(x, w, out, epoch, push, compute, pushers, exchange)

        def wait_then_land(flag, epoch, spin_limit):
            landing = in_flight.pop(int(flag.handle.data.reshape(-1)[0]), None)
            if landing is not None:
                part, data, index, value = landing
                gather.gathered(value)[rows:2 * rows][part] = data
                gather.ready.local[index] = value
            return wait(flag, epoch, spin_limit)

        monkeypatch.setattr(ops[0], "_launch", launch_before_the_chunks_land)
        monkeypatch.setattr(peer_flags, "wait_at_least", wait_then_land)  # under wait_or_record
        out = ops[0].finish(epochs[0], shards[0], weight, producer)
        monkeypatch.undo()
        assert not in_flight, "every chunk of rank 1 was waited for"
        assert relative_error(out, all_gather_matmul_reference(shards, weight)) < 2e-3


def test_two_tile_configs_on_one_shape_class_keep_acknowledging():
    """Two ops (tile configs) share one exchange (same shape class and chunk rows): each acknowledges its own
    launches, so the guard of the next epoch never waits on an ack that the other op's counter cannot reach."""
    gen = torch.Generator().manual_seed(17)
    workspaces = matmul_world(2)
    other = GemmConfig(block_m=16, block_n=32, block_k=16, group_m=1, chunk_rows=16, num_programs=2, spin_limit=50)
    for step in range(6):
        shards = [torch.randn(20, 16, generator=gen).to(torch.float16) for _ in range(2)]
        weight = torch.randn(16, 24, generator=gen).to(torch.float16)
        config = (SMALL, other)[step % 2]
        for out in run_matmul(workspaces, shards, weight, ["copy_engine", "device"][step // 2 % 2], config=config):
            assert relative_error(out, all_gather_matmul_reference(shards, weight)) < 2e-3


def test_all_gather_matmul_many_calls_alternating_producers():
    gen = torch.Generator().manual_seed(5)
    workspaces = matmul_world(2)
    for step in range(8):
        shards = [torch.randn(17, 16, generator=gen).to(torch.float16) for _ in range(2)]
        weight = torch.randn(16, 24, generator=gen).to(torch.float16)
        for out in run_matmul(workspaces, shards, weight, ["copy_engine", "device"][step % 2]):
            assert relative_error(out, all_gather_matmul_reference(shards, weight)) < 2e-3


@pytest.mark.parametrize("producer", ["copy_engine", "device"])
def test_all_gather_matmul_times_out_naming_the_rank_that_never_called(producer):
    ws = matmul_world(2)
    shard = torch.randn(40, 16).to(torch.float16)
    op = op_for(ws[0], shard, SMALL)
    epoch = op.start(shard, producer)  # rank 1 never calls
    with pytest.raises(PeerWaitTimeout, match=r"rank 0 timed out at step 1 waiting for rank 1 to start the call"):
        op.finish(epoch, shard, torch.randn(16, 16).to(torch.float16), producer)


# Rank 1's call unlike the others' (41 rows of K = 24, fp16, the device push in SMALL's chunks of 16 rows): its rows,
# K, dtype, producer (copy engines: SMALL's copies of 16 rows), or its config's rows per chunk (the device push's or
# the copy engines'); each rank's producer and config; what the messages say of the others' call and of rank 1's.
SHARD = "x_shard [41, 24] float16, device push in chunks of 16 rows"
MATMUL_DIFFERENCES = {
    "rows": (dict(rows=40), "x_shard [40, 24] float16, device push in chunks of 16 rows"),
    "no rows": (dict(rows=0), "x_shard [0, 24] float16, device push of nothing"),
    "k": (dict(k=16), "x_shard [41, 16] float16, device push in chunks of 16 rows"),
    "dtype": (dict(dtype=torch.bfloat16), "x_shard [41, 24] bfloat16, device push in chunks of 16 rows"),
    "producer": (dict(producer="copy_engine"), "x_shard [41, 24] float16, copy-engine pulls in chunks of 16 rows"),
    "chunk_rows": (dict(config=STRADDLE), "x_shard [41, 24] float16, device push in chunks of 24 rows"),
    "copy_rows": (dict(config=dataclasses.replace(SMALL, copy_rows=24), producer="copy_engine"),
                  "x_shard [41, 24] float16, copy-engine pulls in chunks of 24 rows"),
}


def check_matmul_calls_that_differ(world_size: int, difference: str, device: str = "cpu") -> None:
    """Every rank raises, naming itself, the peer whose call it found unlike its own first and both calls. Rank 1's
    call is of another shape class (or producer, or chunks), whose exchange its peers' calls never touch: the calls
    compare their signatures in a buffer of their own (the module docstring). That leaves the exchanges' epochs of
    the ranks apart, so the next call of the usual shape raises on every rank too (a mismatch, or a peer's buffer
    never released), never a silent wrong product; a call of a shape new to every rank is exact. Every rank
    allocates rank 1's exchange first, as GPUs need: a rank allocating alone would wait for its peers in the
    allocation (symmetric.agree_on_allocation: AllocationTimeout; the simulated world: AllocationMismatch)."""
    odd, said = MATMUL_DIFFERENCES[difference]
    gen = torch.Generator().manual_seed(world_size)
    workspaces = matmul_world(world_size, device)
    weight = torch.randn(19, 24, generator=gen).to(device, torch.float16).t()
    shards = [torch.randn(41, 24, generator=gen).to(device, torch.float16) for _ in range(world_size)]
    for out in run_matmul(workspaces, shards, weight, "device"):  # alike: every rank's exchange of the usual shape
        assert relative_error(out, all_gather_matmul_reference(shards, weight)) < 2e-3
    calls = [dict(rows=41, k=24, dtype=torch.float16, producer="device", config=SMALL) for _ in range(world_size)]
    calls[1].update(odd)
    shards = [torch.randn(c["rows"], c["k"], generator=gen).to(device, c["dtype"]) for c in calls]
    weights = [torch.randn(19, c["k"], generator=gen).to(device, c["dtype"]).t() for c in calls]  # Linear's w.t()
    for ws in workspaces:
        op_for(ws, shards[1], calls[1]["config"]).gather_for(calls[1]["producer"])
    ops = [op_for(ws, shard, c["config"]) for ws, shard, c in zip(workspaces, shards, calls)]
    epochs = [op.start(shard, c["producer"]) for op, shard, c in zip(ops, shards, calls)]
    usual, odd = (f"{call}, call {n} of that shape and producer" for call, n in ((SHARD, 2), (said, 1)))
    for rank, (op, epoch, shard, weight_r, c) in enumerate(zip(ops, epochs, shards, weights, calls)):
        # a rank names the first peer it finds unlike itself (sources in the order rank - 1, rank - 2, ...): rank 1
        # rank 0, the others rank 1; besides the calls, the count of calls of each one's shape (2 against 1)
        peer, mine, theirs = (0, odd, usual) if rank == 1 else (1, usual, odd)
        with pytest.raises(PeerCallMismatch, match=rf"all-gather \+ GEMM: rank {rank} at step 2: peer {peer} "
                                                   rf"called it with {re.escape(theirs)}; this rank with "
                                                   rf"{re.escape(mine)} \("):
            op.finish(epoch, shard, weight_r, c["producer"])  # on the CPU
            op.errors.check(block=True)  # on GPUs
    shards = [torch.randn(41, 24, generator=gen).to(device, torch.float16) for _ in range(world_size)]
    ops = [op_for(ws, shard, SMALL) for ws, shard in zip(workspaces, shards)]
    epochs = [op.start(shard, "device") for op, shard in zip(ops, shards)]
    for op, epoch, shard in zip(ops, epochs, shards):
        with pytest.raises((PeerCallMismatch, PeerWaitTimeout)):
            op.finish(epoch, shard, weight, "device")
            op.errors.check(block=True)
    shards = [torch.randn(9, 24, generator=gen).to(device, torch.float16) for _ in range(world_size)]
    for out in run_matmul(workspaces, shards, weight, "device"):
        assert relative_error(out, all_gather_matmul_reference(shards, weight)) < 2e-3
    for ws, shard in zip(workspaces, shards):
        op_for(ws, shard, SMALL).errors.check(block=True)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("difference", list(MATMUL_DIFFERENCES))
def test_all_gather_matmul_calls_that_differ_raise_on_every_rank(world_size, difference):
    check_matmul_calls_that_differ(world_size, difference)


# A rank's weight or out that it refuses while the others pass a Linear's weight.t() [24, 19] and no out (x_shard
# [41, 24] float16 everywhere: 82 rows gathered on 2 ranks), made on a device; the error it raises itself, what its
# peers say of it.
NOT_READ = r"is not one the GEMM reads: expected \[24, N\] float16"
MATMUL_REFUSALS = {
    "weight of other K": (lambda d: (torch.randn(19, 16, device=d).half().t(), None),
                          r"weight \(16, 19\) torch.float16: expected \(24, N\) torch.float16",
                          r"its weight \[16, 19\] float16 \(strides 1, 16\) " + NOT_READ),
    "weight of other dtype": (lambda d: (torch.randn(24, 19, device=d), None), r"weight \(24, 19\) torch.float32: "
                              "expected", r"its weight \[24, 19\] float32 \(strides 19, 1\) " + NOT_READ),
    "weight rows TMA cannot read": (lambda d: (torch.randn(24, 20, device=d).half(), None),
                                    r"weight \(as it lies\) \(24, 20\) torch.float16 with strides \(20, 1\): read "
                                    r"through TMA", r"its weight \[24, 20\] float16 \(strides 20, 1\) " + NOT_READ),
    "1-D weight": (lambda d: (torch.randn(24, device=d).half(), None), r"weight \(24,\) torch.float16: expected",
                   r"its weight \[24\] float16 \(strides 1\) " + NOT_READ),
    "out of other rows": (lambda d: (None, torch.empty(81, 19, device=d).half()),
                          r"out must be contiguous torch.float16 \[82, 19\]",
                          r"its out \[81, 19\] float16 cannot take its product: contiguous \[82, 19\] float16"),
    "strided out": (lambda d: (None, torch.empty(82, 38, device=d).half()[:, ::2]), r"\[82, 19\] on .*, not contiguous",
                    r"its out \[82, 19\] float16, not contiguous, cannot take its product"),
    "fp32 out": (lambda d: (None, torch.empty(82, 19, device=d)), r"got torch.float32 \[82, 19\]",
                 r"its out \[82, 19\] float32 cannot take its product"),
    # a tensor on another device: the kernels would read it (or store into it) through a pointer of that device
    "weight on another device": (lambda d: (torch.empty(19, 24, dtype=torch.float16, device="meta").t(), None),
                                 r"weight \(24, 19\) torch.float16 on meta: expected on",
                                 r"its weight \[24, 19\] float16 is on another device than its workspace"),
    "out on another device": (lambda d: (None, torch.empty(82, 19, dtype=torch.float16, device="meta")),
                              r"out \(82, 19\) torch.float16 on meta: expected on",
                              r"its out \[82, 19\] float16 is on another device than its workspace"),
    # the third: its x_shard (of the shape class: the op and its exchange are the peers')
    "x_shard on another device": (lambda d: (None, None, torch.empty(41, 24, dtype=torch.float16, device="meta")),
                                  r"x_shard \(41, 24\) torch.float16 on meta: expected on",
                                  r"its x_shard \[41, 24\] float16 is on another device than its workspace"),
}


def check_matmul_refused_on_one_rank(world_size: int, refusal: str, producer: str, device: str = "cpu") -> None:
    """Rank 1 refuses its call (its weight, out or x_shard of the peers' shape class, `MATMUL_REFUSALS`: what each
    rank's own tensors decide): it raises its own error, every other rank PeerRefusedInput naming rank 1 and why, at
    the same call (rank 1 still takes part in it: its call's number and exchange's epoch, a signature that says why,
    its acknowledgement of the exchange); the calls before and after it, alike on every rank, are exact."""
    gen = torch.Generator().manual_seed(world_size)
    workspaces = matmul_world(world_size, device)
    weight = torch.randn(19, 24, generator=gen).to(device, torch.float16).t()

    def shards_of_every_rank():
        return [torch.randn(41, 24, generator=gen).to(device, torch.float16) for _ in range(world_size)]

    def exact():
        shards = shards_of_every_rank()
        for out in run_matmul(workspaces, shards, weight, producer):
            assert relative_error(out, all_gather_matmul_reference(shards, weight)) < TOL[torch.float16]

    exact()
    bad, error, said = MATMUL_REFUSALS[refusal]
    shards, weights, outs = shards_of_every_rank(), [weight] * world_size, [None] * world_size
    bad_weight, outs[1], *bad_shard = bad(device)
    weights[1] = weight if bad_weight is None else bad_weight
    shards[1] = bad_shard[0] if bad_shard else shards[1]
    ops = [op_for(ws, shard, SMALL) for ws, shard in zip(workspaces, shards)]
    refused = [refused_call(shard, w, out, op, producer) for op, shard, w, out in zip(ops, shards, weights, outs)]
    assert [r is not None for r in refused] == [rank == 1 for rank in range(world_size)]
    epochs = [op.start(shard, producer, r) for op, shard, r in zip(ops, shards, refused)]  # every producer first
    for rank, (op, epoch, shard, w, out) in enumerate(zip(ops, epochs, shards, weights, outs)):
        if rank == 1:
            with pytest.raises(ValueError, match=error):
                op.finish(epoch, shard, w, producer, out=out)
            continue
        with pytest.raises(PeerRefusedInput, match=rf"^fused all-gather \+ GEMM at step 2: rank {rank}: rank 1's call "
                                                   rf"was refused: {said}"):
            op.finish(epoch, shard, w, producer, out=out)  # on the CPU
            op.errors.check(block=True)  # on GPUs
    exact()
    for op in ops:
        op.errors.check(block=True)


@pytest.mark.parametrize("producer", ["copy_engine", "device"])
@pytest.mark.parametrize("refusal", list(MATMUL_REFUSALS))
def test_all_gather_matmul_call_refused_on_one_rank_raises_on_every_rank(refusal, producer):
    check_matmul_refused_on_one_rank(2, refusal, producer)


@pytest.mark.parametrize("producer", ["copy_engine", "device"])
def test_all_gather_matmul_call_refused_on_one_rank_of_three_raises_on_every_rank(producer):
    check_matmul_refused_on_one_rank(3, "weight of other dtype", producer)


def test_a_device_push_grid_not_resident_at_once_is_refused_on_every_rank(monkeypatch):
    """Where the device push runs in the GEMM's own launch (a process group's GPUs), its programs wait for each
    other's chunks: a grid of more programs than are resident at once would wait out its bound. Rank 1's op gets
    the bound of a GPU of 2 SMs (`resident_programs`: one per SM) against SMALL's 3 programs: its device call is
    refused before any GEMM launch (its own ValueError; rank 0 PeerRefusedInput naming rank 1 and why). The copy
    engines' calls keep that grid (no wait inside their launch) and are exact, as is a device call on a grid of
    exactly the bound."""
    gen = torch.Generator().manual_seed(29)
    workspaces = matmul_world(2)
    weight = torch.randn(19, 24, generator=gen).to(torch.float16).t()
    shards = [torch.randn(41, 24, generator=gen).to(torch.float16) for _ in range(2)]
    ops = [op_for(ws, shard, SMALL) for ws, shard in zip(workspaces, shards)]
    ops[1].resident_programs = 2

    def no_gemm(*args, **kwargs):
        raise AssertionError("rank 1 launched the GEMM of a call it refused")

    monkeypatch.setattr(ops[1], "_launch", no_gemm)
    refused = [refused_call(shard, weight, None, op, "device") for op, shard in zip(ops, shards)]
    assert [r is not None for r in refused] == [False, True]
    epochs = [op.start(shard, "device", r) for op, shard, r in zip(ops, shards, refused)]
    with pytest.raises(PeerRefusedInput, match=r"^fused all-gather \+ GEMM at step 1: rank 0: rank 1's call was "
                                               r"refused: its device push's grid of 3 programs is more than its GPU "
                                               r"holds at once \(2: one per SM\)"):
        ops[0].finish(epochs[0], shards[0], weight, "device")  # on the CPU
        ops[0].errors.check(block=True)  # on GPUs
    with pytest.raises(ValueError, match=r"GemmConfig.num_programs=3: .* resident at once: at most 2 on this GPU "
                                         r"\(one per SM\)"):
        ops[1].finish(epochs[1], shards[1], weight, "device")
    monkeypatch.undo()
    for producer, bound in (("copy_engine", 2), ("device", 3)):
        ops[1].resident_programs = bound
        shards = [torch.randn(41, 24, generator=gen).to(torch.float16) for _ in range(2)]
        assert [refused_call(shard, weight, None, op, producer) for op, shard in zip(ops, shards)] == [None, None]
        for out in run_matmul(workspaces, shards, weight, producer):
            assert relative_error(out, all_gather_matmul_reference(shards, weight)) < TOL[torch.float16], producer
    for op in ops:
        op.errors.check(block=True)


# An x_shard that rank 1 refuses, of no shape class the op takes (the peers': [41, 24] float16), or its producer,
# made on a device; the error it raises itself, what its peers say of it.
TAKES = r"is not one the op takes: \[rows, K\] float16 or bfloat16, K a multiple of 8"
MATMUL_SHAPELESS_REFUSALS = {
    "fp32 x_shard": (lambda d: (torch.randn(41, 24, device=d), "device"), r"dtype torch.float32 \(expected fp16",
                     r"its x_shard \[41, 24\] float32 " + TAKES),
    "3-D x_shard": (lambda d: (torch.randn(41, 24, 1, device=d).half(), "device"), r"expected \[rows, K\]",
                    r"its x_shard \[41, 24, 1\] float16 " + TAKES),
    "K not a multiple of 8": (lambda d: (torch.randn(41, 20, device=d).half(), "device"), "K=20 is not a multiple",
                              r"its x_shard \[41, 20\] float16 " + TAKES),
    "unknown producer": (lambda d: (torch.randn(41, 24, device=d).half(), "nvlink"), "unknown producer 'nvlink'",
                         r"its producer is not one of \('copy_engine', 'device'\)"),
}


def check_matmul_refused_without_an_exchange(world_size: int, refusal: str, producer: str, device: str = "cpu",
                                             refusing: tuple[int, ...] = (1,), rows: int = 41) -> None:
    """Ranks `refusing` refuse one call each, in a row, for an x_shard of no shape class or an unknown producer
    (MATMUL_SHAPELESS_REFUSALS) while their peers call with x_shard [rows, 24] float16: a refusing rank cannot know
    which exchange its peers use, but its call still takes its number among the workspace's calls and tells every
    peer why, so it raises its own error and every other rank PeerRefusedInput naming it and why. It then reads
    the exchange and epoch its peers' calls used (their published signatures) and takes and acknowledges that
    epoch, so the next calls of that shape (both halves of the double buffers) are exact on every rank. (Without
    it the exchange stayed one epoch apart: every later call of that shape raised.) rows=0: an empty batch, whose
    calls count their epochs without an exchange."""
    gen = torch.Generator().manual_seed(world_size)
    workspaces = matmul_world(world_size, device)
    weight = torch.randn(19, 24, generator=gen).to(device, torch.float16).t()

    def shards_of_every_rank():
        return [torch.randn(rows, 24, generator=gen).to(device, torch.float16) for _ in range(world_size)]

    def exact():
        shards = shards_of_every_rank()
        for out in run_matmul(workspaces, shards, weight, producer):  # outputs poisoned (NaN)
            assert relative_error(out, all_gather_matmul_reference(shards, weight)) < TOL[torch.float16] if rows \
                else out.shape == (0, 19)

    exact()
    bad, error, said = MATMUL_SHAPELESS_REFUSALS[refusal]
    for step, refuser in enumerate(refusing, start=2):
        shards = shards_of_every_rank()
        ops = [op_for(ws, shard, SMALL) for ws, shard in zip(workspaces, shards)]
        peers = [rank for rank in range(world_size) if rank != refuser]
        epochs = {rank: ops[rank].start(shards[rank], producer) for rank in peers}
        with pytest.raises(ValueError, match=error):
            all_gather_matmul(*bad(device)[:1], weight, workspaces[refuser], bad(device)[1], config=SMALL)
        for rank in peers:
            with pytest.raises(PeerRefusedInput, match=rf"^fused all-gather \+ GEMM at step {step}: rank {rank}: rank "
                                                       rf"{refuser}'s call was refused: {said}"):
                ops[rank].finish(epochs[rank], shards[rank], weight, producer)  # on the CPU
                ops[rank].errors.check(block=True)  # on GPUs
    for _ in range(2):  # both halves
        exact()
    for ws in workspaces:
        op_for(ws, shards_of_every_rank()[0], SMALL).errors.check(block=True)


@pytest.mark.parametrize("producer", ["copy_engine", "device"])
@pytest.mark.parametrize("refusal", list(MATMUL_SHAPELESS_REFUSALS))
def test_all_gather_matmul_refused_without_an_exchange_raises_on_every_rank(refusal, producer):
    check_matmul_refused_without_an_exchange(2, refusal, producer)


@pytest.mark.parametrize("producer", ["copy_engine", "device"])
def test_all_gather_matmul_refused_without_an_exchange_by_ranks_of_three_in_a_row(producer):
    """Rank 2 refuses, then rank 1, then rank 2 again (both halves of the calls' buffer): each catches up."""
    check_matmul_refused_without_an_exchange(3, "fp32 x_shard", producer, refusing=(2, 1, 2))


def test_all_gather_matmul_refused_without_an_exchange_twice_by_rank_0():
    check_matmul_refused_without_an_exchange(2, "unknown producer", "device", refusing=(0, 0))


@pytest.mark.parametrize("producer", ["copy_engine", "device"])
def test_all_gather_matmul_refused_without_an_exchange_during_an_empty_batch(producer):
    check_matmul_refused_without_an_exchange(2, "3-D x_shard", producer, rows=0)


def test_all_gather_matmul_refused_with_and_without_an_exchange_in_one_call():
    """Of three ranks, rank 1 refuses its weight (a call of the peers' exchange: its epoch taken and acknowledged)
    and rank 2 its x_shard (no exchange): rank 2 catches up from rank 0's signature and rank 1's description of its
    exchange (beside its signature, which says why), so the next calls are exact."""
    gen = torch.Generator().manual_seed(31)
    workspaces = matmul_world(3)
    weight = torch.randn(19, 24, generator=gen).half().t()

    def shards_of_every_rank():
        return [torch.randn(41, 24, generator=gen).half() for _ in workspaces]

    for out in run_matmul(workspaces, (shards := shards_of_every_rank()), weight, "device"):
        assert relative_error(out, all_gather_matmul_reference(shards, weight)) < TOL[torch.float16]
    shards = shards_of_every_rank()
    ops = [op_for(ws, shard, SMALL) for ws, shard in zip(workspaces, shards)]
    refused = refused_call(shards[1], weight.float(), None, ops[1], "device")
    epochs = [op.start(shard, "device", r) for op, shard, r in zip(ops[:2], shards, (None, refused))]
    with pytest.raises(ValueError, match=r"dtype torch.float32 \(expected fp16"):
        all_gather_matmul(shards[2].float(), weight, workspaces[2], config=SMALL)
    with pytest.raises(PeerRefusedInput, match=r"at step 2: rank 0: rank [12]'s call was refused"):
        ops[0].finish(epochs[0], shards[0], weight, "device")
    with pytest.raises(ValueError, match=r"weight \(24, 19\) torch.float32"):
        ops[1].finish(epochs[1], shards[1], weight.float(), "device")
    for _ in range(2):  # both halves
        for out in run_matmul(workspaces, (shards := shards_of_every_rank()), weight, "device"):
            assert relative_error(out, all_gather_matmul_reference(shards, weight)) < TOL[torch.float16]


def check_matmul_refused_on_every_rank(refusals: tuple[str, ...], producer: str, device: str = "cpu",
                                       rows: int = 41) -> None:
    """Every rank refuses the same call, rank r for refusals[r]: an x_shard of no shape class or an unknown producer
    (MATMUL_SHAPELESS_REFUSALS: a call of no exchange; one rank at most here, whose wait finds every peer's call
    published only if it comes last) or its weight, out or x_shard's device (MATMUL_REFUSALS: a call of the peers'
    exchange, its epoch taken and acknowledged). Every rank raises its own error. A rank of no exchange catches up
    the exchange its refused peers took (their signatures name it beside why), so the next calls of that shape
    (both halves of the double buffers) are exact on every rank. (Without it the exchange stayed one epoch apart:
    every later call of that shape raised on every rank.) rows=0: an empty batch, whose calls count their epochs
    without an exchange."""
    world_size = len(refusals)
    gen = torch.Generator().manual_seed(41 + world_size)
    workspaces = matmul_world(world_size, device)
    weight = torch.randn(19, 24, generator=gen).to(device, torch.float16).t()

    def exact():
        shards = [torch.randn(rows, 24, generator=gen).to(device, torch.float16) for _ in workspaces]
        for out in run_matmul(workspaces, shards, weight, producer):  # outputs poisoned (NaN)
            assert relative_error(out, all_gather_matmul_reference(shards, weight)) < TOL[torch.float16] if rows \
                else out.shape == (0, 19)

    exact()
    shards = [torch.randn(rows, 24, generator=gen).to(device, torch.float16) for _ in workspaces]
    of_an_exchange = [rank for rank, refusal in enumerate(refusals) if refusal in MATMUL_REFUSALS]
    calls = {}  # rank: (op, epoch, shard, weight, out, its error) of a refused call of the exchange
    for rank in of_an_exchange:
        bad, error, _ = MATMUL_REFUSALS[refusals[rank]]
        bad_weight, out, *bad_shard = bad(device)
        shard, weight_r = (bad_shard or shards[rank:])[0], weight if bad_weight is None else bad_weight
        op = op_for(workspaces[rank], shard, SMALL)
        refused = refused_call(shard, weight_r, out, op, producer)
        assert refused is not None
        calls[rank] = (op, op.start(shard, producer, refused), shard, weight_r, out, error)
    for rank in set(range(world_size)) - set(of_an_exchange):  # a call of no exchange, after its peers' began
        bad, error, _ = MATMUL_SHAPELESS_REFUSALS[refusals[rank]]
        shard, producer_r = bad(device)
        with pytest.raises(ValueError, match=error):
            all_gather_matmul(shard, weight, workspaces[rank], producer_r, config=SMALL)
    for op, epoch, shard, weight_r, out, error in calls.values():
        with pytest.raises(ValueError, match=error):
            op.finish(epoch, shard, weight_r, producer, out=out)
    for _ in range(2):  # both halves
        exact()
    for ws in workspaces:
        op_for(ws, shards[0], SMALL).errors.check(block=True)


@pytest.mark.parametrize("producer", ["copy_engine", "device"])
@pytest.mark.parametrize("refusals", [("fp32 x_shard", "weight of other dtype"), ("out of other rows", "3-D x_shard"),
                                      ("unknown producer", "x_shard on another device")])
def test_all_gather_matmul_refused_on_every_rank_with_and_without_an_exchange(refusals, producer):
    check_matmul_refused_on_every_rank(refusals, producer)


def test_all_gather_matmul_refused_on_every_rank_of_three_with_and_without_an_exchange():
    check_matmul_refused_on_every_rank(("K not a multiple of 8", "fp32 out", "1-D weight"), "device")


@pytest.mark.parametrize("producer", ["copy_engine", "device"])
def test_all_gather_matmul_refused_on_every_rank_with_and_without_an_exchange_during_an_empty_batch(producer):
    check_matmul_refused_on_every_rank(("weight of other dtype", "fp32 x_shard"), producer, rows=0)


def test_all_gather_matmul_refused_on_every_rank_of_exchanges_that_differ_leaves_them_apart():
    """Both ranks refuse their weight, each a call of another exchange (x_shard [41, 24] and [40, 24]: a caller's
    bug, as calls that differ): each takes its own exchange's epoch and raises its own error; neither catches up
    (each took an exchange), so the next calls of either shape raise on every rank, and a call of a shape new to
    every rank is exact."""
    gen = torch.Generator().manual_seed(43)
    workspaces = matmul_world(2)
    weight = torch.randn(19, 24, generator=gen).half().t()
    rows = (41, 40)
    for n in rows:  # every rank holds both exchanges, alike (GPUs allocate in one order)
        for out in run_matmul(workspaces, (shards := [torch.randn(n, 24, generator=gen).half() for _ in workspaces]),
                              weight, "device"):
            assert relative_error(out, all_gather_matmul_reference(shards, weight)) < TOL[torch.float16]
    shards = [torch.randn(n, 24, generator=gen).half() for n in rows]
    ops = [op_for(ws, shard, SMALL) for ws, shard in zip(workspaces, shards)]
    refused = [refused_call(shard, weight.float(), None, op, "device") for op, shard in zip(ops, shards)]
    epochs = [op.start(shard, "device", r) for op, shard, r in zip(ops, shards, refused)]
    for op, epoch, shard in zip(ops, epochs, shards):
        with pytest.raises(ValueError, match=r"weight \(24, 19\) torch.float32"):
            op.finish(epoch, shard, weight.float(), "device")
    for n in rows:
        shards = [torch.randn(n, 24, generator=gen).half() for _ in workspaces]
        ops = [op_for(ws, shard, SMALL) for ws, shard in zip(workspaces, shards)]
        epochs = [op.start(shard, "device") for op, shard in zip(ops, shards)]
        for op, epoch, shard in zip(ops, epochs, shards):
            with pytest.raises((PeerCallMismatch, PeerWaitTimeout)):
                op.finish(epoch, shard, weight, "device")
    for out in run_matmul(workspaces, (shards := [torch.randn(9, 24, generator=gen).half() for _ in workspaces]),
                          weight, "device"):
        assert relative_error(out, all_gather_matmul_reference(shards, weight)) < TOL[torch.float16]


def test_all_gather_matmul_refused_without_an_exchange_allocates_none_to_catch_up():
    """Rank 1 refuses its x_shard while rank 0's call is the first of a new shape class ([9, 24]): rank 1 holds no
    such exchange, and its catch-up allocates none (on GPUs rank 0 could not have allocated it alone: its
    allocation times out naming rank 1, symmetric.agree_on_allocation; here it could): both raise at the call."""
    gen = torch.Generator().manual_seed(37)
    workspaces = matmul_world(2)
    weight = torch.randn(19, 24, generator=gen).half().t()
    for out in run_matmul(workspaces, (shards := [torch.randn(41, 24, generator=gen).half() for _ in workspaces]),
                          weight, "device"):
        assert relative_error(out, all_gather_matmul_reference(shards, weight)) < TOL[torch.float16]
    held = list(workspaces[1]._buffers)
    shard = torch.randn(9, 24, generator=gen).half()
    op = op_for(workspaces[0], shard, SMALL)
    epoch = op.start(shard, "device")
    with pytest.raises(ValueError, match=r"dtype torch.float32 \(expected fp16"):
        all_gather_matmul(shard.float(), weight, workspaces[1], config=SMALL)
    with pytest.raises(PeerRefusedInput, match=r"at step 2: rank 0: rank 1's call was refused"):
        op.finish(epoch, shard, weight, "device")
    assert list(workspaces[1]._buffers) == held


@pytest.mark.parametrize("world_size", [2, 3])
def test_all_gather_matmul_first_call_refused_without_an_exchange_raises_on_every_rank(world_size):
    """Rank 1's very first call has an x_shard of no shape class: it has no op (no calls' buffer) to refuse it
    through, but its peers' first call allocates that buffer first, so it refuses in that allocation's place: every
    peer raises AllocationRefused naming rank 1 and why, no buffer is made, and the next call, alike on every rank,
    is exact (it allocates on every rank)."""
    gen = torch.Generator().manual_seed(world_size)
    workspaces = matmul_world(world_size)
    weight = torch.randn(19, 24, generator=gen).half().t()
    shards = [torch.randn(41, 24, generator=gen).half() for _ in workspaces]
    with pytest.raises(ValueError, match=r"dtype torch.float32 \(expected fp16") as raised:
        all_gather_matmul(shards[1].float(), weight, workspaces[1], config=SMALL)
    assert not isinstance(raised.value, AllocationRefused)  # its own error
    for rank in (0, 2)[:world_size - 1]:
        with pytest.raises(AllocationRefused, match=rf"^rank {rank}: symmetric allocation #1 of the simulated world: "
                                                    rf"rank 1 refused its call, which would ask for "
                                                    rf"'{CALLS}' of \d+ x int64: all_gather_matmul: dtype "
                                                    rf"torch.float32 \(expected fp16"):
            all_gather_matmul(shards[rank], weight, workspaces[rank], config=SMALL)
    for _ in range(2):  # both halves
        shards = [torch.randn(41, 24, generator=gen).half() for _ in workspaces]
        for out in run_matmul(workspaces, shards, weight, "device"):
            assert relative_error(out, all_gather_matmul_reference(shards, weight)) < TOL[torch.float16]


def test_all_gather_matmul_refused_call_waits_until_every_peer_has_begun_it():
    """A refused call ends only once every peer has published its call, as the GEMM's programs wait for them: the
    guard of the signatures' halves. Rank 1, refusing, finishes before rank 0 has begun the call, so here (one
    program at a time) its wait times out, naming rank 0 (raised at rank 1's next call, after its own error); on a
    GPU it holds rank 1's next call, whose signature goes into the half that rank 0 may still read. The calls after
    that are exact."""
    gen = torch.Generator().manual_seed(29)
    workspaces = matmul_world(2)
    weight = torch.randn(19, 24, generator=gen).half().t()
    shards = [torch.randn(41, 24, generator=gen).half() for _ in workspaces]
    ops = [op_for(ws, shard, SMALL) for ws, shard in zip(workspaces, shards)]
    refused = refused_call(shards[1], torch.randn(24, 19), None, ops[1], "device")
    epoch = ops[1].start(shards[1], "device", refused)
    with pytest.raises(ValueError, match="weight"):
        ops[1].finish(epoch, shards[1], weight, "device")  # before rank 0 has begun the call
    epoch = ops[0].start(shards[0], "device")
    with pytest.raises(PeerRefusedInput, match="at step 1: rank 0: rank 1's call was refused: its weight"):
        ops[0].finish(epoch, shards[0], weight, "device")
    shards = [torch.randn(41, 24, generator=gen).half() for _ in workspaces]
    with pytest.raises(PeerWaitTimeout, match="rank 1 timed out at step 1 waiting for rank 0 to start the call"):
        run_matmul(workspaces, shards, weight, "device")
    for _ in range(2):  # both halves of the double buffers
        shards = [torch.randn(41, 24, generator=gen).half() for _ in workspaces]
        for out in run_matmul(workspaces, shards, weight, "device"):
            assert relative_error(out, all_gather_matmul_reference(shards, weight)) < TOL[torch.float16]


def test_all_gather_matmul_exchanges_hold_no_refusals_buffer():
    """AllGather + GEMM refuses its calls itself (its calls' signatures say why), so its exchanges (device push and
    copy engines) allocate no refusals' buffer; a shard that reached one all the same is a bug of the op, raised
    before the exchange's epoch is taken."""
    gen = torch.Generator().manual_seed(47)
    workspaces = matmul_world(2)
    weight = torch.randn(19, 24, generator=gen).half().t()
    for producer in ("device", "copy_engine"):
        shards = [torch.randn(41, 24, generator=gen).half() for _ in workspaces]
        for out in run_matmul(workspaces, shards, weight, producer):
            assert relative_error(out, all_gather_matmul_reference(shards, weight)) < TOL[torch.float16]
    for ws in workspaces:
        assert [name for name in ws._buffers if name.endswith(":refusals")] == []
    gather = op_for(workspaces[0], shards[0], SMALL).gather
    epoch = workspaces[0].epoch(gather.exchange)
    with pytest.raises(RuntimeError, match=r"a call that its owner refuses itself reached it: shard \(40, 24\)"):
        gather.start(shards[0][:40], "pull")
    assert workspaces[0].epoch(gather.exchange) == epoch


def test_all_gather_matmul_ranks_may_differ_in_n_and_tiles():
    """What is each rank's own: its weight (N) and the GEMM's tiles and grid (the exchange's chunks alike). Every
    rank's product is its own weight's, exact."""
    gen = torch.Generator().manual_seed(23)
    workspaces = matmul_world(2)
    configs = [SMALL, dataclasses.replace(SMALL, block_n=32, group_m=1, num_programs=2)]
    for _ in range(2):  # both halves of the double buffer
        shards = [torch.randn(41, 24, generator=gen).to(torch.float16) for _ in range(2)]
        weights = [torch.randn(n, 24, generator=gen).to(torch.float16).t() for n in (19, 40)]
        ops = [op_for(ws, shard, config) for ws, shard, config in zip(workspaces, shards, configs)]
        epochs = [op.start(shard, "device") for op, shard in zip(ops, shards)]
        for op, epoch, shard, weight in zip(ops, epochs, shards, weights):
            out = op.finish(epoch, shard, weight, "device")
            assert relative_error(out, all_gather_matmul_reference(shards, weight)) < 2e-3


def test_all_gather_matmul_on_one_rank_is_a_matmul():
    ws = matmul_world(1)[0]
    gen = torch.Generator().manual_seed(9)
    for _ in range(2):
        x = torch.randn(33, 24, generator=gen).to(torch.float16)
        weight = torch.randn(18, 24, generator=gen).to(torch.float16).t()
        out, gathered = all_gather_matmul(x, weight, ws, "device", return_gathered=True, config=SMALL)
        assert relative_error(out, all_gather_matmul_reference([x], weight)) < 2e-3
        torch.testing.assert_close(gathered, x, rtol=0, atol=0)


def test_all_gather_matmul_refuses_what_tma_cannot_read_before_any_work():
    """Rows of K not a multiple of 8 elements, or a weight whose lying rows are not, are refused with the reason,
    before any work; a refused weight is a call all the same, which takes its epoch (its peers' calls end: see
    test_all_gather_matmul_call_refused_on_one_rank_raises_on_every_rank), and the next call works."""
    ws = matmul_world(1)[0]
    with pytest.raises(ValueError, match="K=20 is not a multiple of 8"):
        all_gather_matmul(torch.randn(8, 20).half(), torch.randn(20, 16).half(), ws, "device", config=SMALL)
    x = torch.randn(8, 16).half()
    op = op_for(ws, x, SMALL)
    for bad in (torch.randn(16, 20).half(),  # N contiguous, rows of 40 bytes
                torch.randn(40, 16).half()[::2],  # neither dim contiguous
                torch.randn(16, 24).float()):  # another dtype
        with pytest.raises(ValueError, match="weight"):
            all_gather_matmul(x, bad, ws, "device", config=SMALL)
    assert op.gather.next_epoch() == 4, "every refused call took its epoch"
    weight = torch.randn(16, 24).half()
    assert relative_error(all_gather_matmul(x, weight, ws, "device", config=SMALL),
                          all_gather_matmul_reference([x], weight)) < 2e-3


def test_all_gather_matmul_refuses_an_output_it_cannot_store_into_before_any_work():
    """A given out must be [world * rows, N], x's dtype, contiguous: the kernel stores rows of N at out's start
    (an out of fewer rows was stored past its end, a strided one between its columns). A refused call takes its
    epoch and the next call works."""
    ws = matmul_world(1)[0]
    x, weight = torch.randn(24, 16).half(), torch.randn(20, 16).half().t()
    op = op_for(ws, x, SMALL)
    for bad in (torch.empty(24, 40).half()[:, ::2],  # strided
                torch.empty(23, 20).half(),  # a row short
                torch.empty(24, 20)):  # fp32
        with pytest.raises(ValueError, match=r"out must be contiguous torch.float16 \[24, 20\]"):
            all_gather_matmul(x, weight, ws, "device", out=bad, config=SMALL)
    assert op.gather.next_epoch() == 4, "every refused call took its epoch"
    out = torch.full((24, 20), float("nan")).half()
    assert all_gather_matmul(x, weight, ws, "device", out=out, config=SMALL) is out
    assert relative_error(out, all_gather_matmul_reference([x], weight)) < 2e-3


@pytest.mark.parametrize("producer", ["copy_engine", "device"])
def test_all_gather_matmul_copies_a_shard_whose_start_tma_cannot_read(producer):
    """A contiguous x_shard that starts off 16 bytes (a view into a flat buffer) is copied for the TMA reads, as a
    strided one is: refused after its call had taken an epoch (copy engines: and published the shard), it left the
    op waiting for an acknowledgement that never came."""
    gen = torch.Generator().manual_seed(5)
    workspaces, weight = matmul_world(2), torch.randn(20, 16, generator=gen).half().t()
    for _ in range(3):  # the calls after it too, on the same halves and flags
        shards = [torch.randn(24 * 16 + 1, generator=gen).half()[1:].view(24, 16) for _ in workspaces]
        assert all(s.is_contiguous() and s.data_ptr() % 16 for s in shards)
        for out, gathered in run_matmul(workspaces, shards, weight, producer, return_gathered=True):
            assert relative_error(out, all_gather_matmul_reference(shards, weight)) < TOL[torch.float16]
            assert torch.equal(gathered, torch.cat(shards))


@pytest.mark.parametrize("producer", ["copy_engine", "device"])
def test_all_gather_matmul_of_an_empty_batch_is_a_call_of_its_own(producer):
    """x_shard of 0 rows on every rank (a sequence-parallel layer's empty batch): [0, N] and [0, K] outputs, as
    the GEMM + all-reduce returns for M = 0, and no exchange (no buffer but the calls'); but a call, whose signature
    the peers compare (a peer's call of rows raises: MATMUL_DIFFERENCES["no rows"]), so the calls around it stay
    exact. A shard that is no [rows, K] matrix is named."""
    gen = torch.Generator().manual_seed(3)
    workspaces, weight = matmul_world(2), torch.randn(20, 16, generator=gen).half().t()
    for rows in (9, 0, 0, 9):
        shards = [torch.randn(rows, 16, generator=gen).half() for _ in workspaces]
        outs = run_matmul(workspaces, shards, weight, producer, return_gathered=True)
        for (out, gathered), ws in zip(outs, workspaces):
            assert relative_error(out, all_gather_matmul_reference(shards, weight)) < 2e-3 if rows else (
                out.shape == (0, 20) and gathered.shape == (0, 16) and out.dtype == gathered.dtype == torch.float16)
            assert torch.equal(gathered, torch.cat(shards))
    empty = matmul_world(2)[0]
    op_for(empty, torch.empty(0, 16).half(), SMALL)
    assert list(empty._buffers) == [CALLS]
    for bad in (torch.randn(16).half(), torch.randn(2, 4, 16).half()):
        with pytest.raises(ValueError, match=r"x_shard .* expected \[rows, K\]"):
            all_gather_matmul(bad, weight, matmul_world(1)[0], producer, config=SMALL)


COMPILE_FOR_SM90 = r"""
from fused_dlrm.kernels import allgather, allgather_gemm

for dtype in ("fp16", "bf16"):
    types = {n: "*" + dtype for n in ("x_ptr", "out_ptr")}
    types.update({n: "*i64" for n in ("data_ptrs", "ready_ptrs", "ack_ptrs", "counter_ptr", "calls_ptr", "call_ptrs")})
    types.update({n: "*i32" for n in ("ready_ptr", "ack_ptr", "error_ptr")}, half_offset="i64", ack_target="i64")
    for push, w_nk in ((True, True), (False, False)):  # rank 1 arrives as a constexpr
        types.update(x_desc=f"tensordesc<{dtype}[1, 64, 32]>", gathered_desc=f"tensordesc<{dtype}[1, 64, 32]>",
                     w_desc=f"tensordesc<{dtype}[64, 32]>" if w_nk else f"tensordesc<{dtype}[32, 64]>")
        build(allgather_gemm._all_gather_matmul_kernel, types, dict(
            rank=1, WORLD=2, PUSH=push, COMPUTE=True, BLOCK_M=64, BLOCK_N=64, BLOCK_K=32,
            K_TILES=4, GROUP_M=8, PUSH_R=16, PUSH_C=512, W_NK=w_nk, ON_GPU=True))
c = allgather_gemm.GemmConfig()  # as on the GPU (rank 0: not a constexpr), a Linear's weight.t() at K=512
types.update(x_desc=f"tensordesc<bf16[1, {c.block_m}, {c.block_k}]>",
             gathered_desc=f"tensordesc<bf16[1, {c.block_m}, {c.block_k}]>",
             w_desc=f"tensordesc<bf16[{c.block_n}, {c.block_k}]>")
kernel = build(allgather_gemm._all_gather_matmul_kernel, types, dict(
    WORLD=2, PUSH=True, COMPUTE=True, BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k,
    K_TILES=512 // c.block_k, GROUP_M=c.group_m, PUSH_R=16, PUSH_C=512, W_NK=True, ON_GPU=True),
    num_warps=c.num_warps, num_stages=c.num_stages, divisible=("K", "N", "chunk_rows", "half_offset"))
assert "fence.proxy.async.global" in kernel.asm["ptx"]  # between the flags' acquire and the TMA reads
# Both operands of a pipelined wgmma get one shared buffer per stage: with fewer for one of them (2 for A at 3
# stages when the tiles also stored A), the loads running ahead overwrote A under an in-flight wgmma.
import re
depths = re.findall(r"ttg.local_alloc : \(\) -> !ttg.memdesc<(\d+)x", kernel.asm["ttgir"])
assert depths and set(depths) == {str(c.num_stages)}, depths
# One program per SM: the grid of the device push's launch is bounded by the SM count (AllGatherMatmul's
# resident_programs), which these tiles' own residency (registers, shared memory) equals
from fused_dlrm.kernels.launch import resident_programs_per_sm
registers, shared = resources(kernel)[0], kernel.metadata.shared
assert resident_programs_per_sm(registers, c.num_warps, shared) == 1, (registers, shared)
types = {"x_ptr": "*fp16", "data_ptrs": "*i64", "ready_ptrs": "*i64", "ack_ptr": "*i32", "error_ptr": "*i32",
         "half_offset": "i64"}
build(allgather._push_kernel, types, dict(rank=1, chunks=1, WORLD=4, BLOCK_R=16, BLOCK_C=512))
build(allgather._guard_kernel, {"ack_ptr": "*i32", "error_ptr": "*i32"}, {})
build(allgather._wait_chunk_kernel, {"ready_ptrs": "*i64", "error_ptr": "*i32"}, dict(source=1))
build(allgather._wait_published_kernel, {"ready_ptrs": "*i64", "error_ptr": "*i32"}, dict(rank=1))
build(allgather._refused_call_kernel, {n: "*i64" for n in ("signature_ptr", "refusal_ptrs", "ready_ptrs", "ack_ptrs")}
      | {"ack_ptr": "*i32", "error_ptr": "*i32"}, dict(WORLD=4, SLOTS=4))
build(allgather._refused_sources_kernel, {"refusals_ptr": "*i64", "error_ptr": "*i32"}, dict(WORLD=4))
build(allgather_gemm._publish_call_kernel, {"call_ptrs": "*i64"}, dict(WORLD=4))
build(allgather_gemm._check_calls_kernel, {"calls_ptr": "*i64", "error_ptr": "*i32"}, dict(WORLD=4))
# a refused call's start (of empty shards: no ack), its finish, a call of no exchange, and its catch-up
for publish, describe, ack, wait in ((True, True, True, False), (True, True, False, False), (False, False, False, True),
                                     (True, False, False, True), (False, False, True, False)):
    build(allgather_gemm._refused_call_kernel, {n: "*i64" for n in ("signature_ptr", "call_ptrs", "calls_ptr",
                                                                     "ack_ptrs")} | {"error_ptr": "*i32"},
          dict(WORLD=4, PUBLISH=publish, DESCRIBE=describe, ACK=ack, WAIT=wait))
"""


def test_kernels_compile_for_sm90():
    """What only the GPU compiler enforces (types, constexpr arguments equal to 1, tl.dot shapes), checked without
    a GPU: compile for sm_90 in a process without the interpreter."""
    compile_for_sm90(COMPILE_FOR_SM90)


def _bulk_twin(rank: int, world: int) -> None:
    gen = torch.Generator().manual_seed(3)
    shards = [torch.randn(5, 12, generator=gen) for _ in range(world)]
    weight = torch.randn(12, 7, generator=gen)
    out, gathered = all_gather_matmul_bulk(shards[rank], weight)
    torch.testing.assert_close(gathered, all_gather_reference(shards), rtol=0, atol=0)
    assert relative_error(out, all_gather_matmul_reference(shards, weight)) < 1e-6


def test_bulk_twin_on_gloo():
    run_world(2, _bulk_twin)  # 2 ranks only: each spawned rank costs seconds of imports on CI's 2 cores


def test_pushing_programs_leave_the_first_local_tiles_to_the_others():
    """The deal that the LEAD cases above walk, and the estimate of the push's time in tiles at the benchmark's
    shapes over 2 ranks (M = 4096, 8192, 16384; the best rounds measured on 2×H200: 2-5, 3, 3-6)."""
    shard = torch.randn(41, 24).half()
    workspace = matmul_world(2)[0]
    assert op_for(workspace, shard, LEAD).lead(19) == (2, 2)  # 3 local M-blocks x 2 N-blocks: 6 tiles
    assert op_for(workspace, shard, LEAD_ALL).lead(19) == (2, 6)
    assert op_for(workspace, shard, dataclasses.replace(LEAD, num_programs=3)).lead(19) == (0, 0)  # all push
    assert op_for(workspace, shard, LEAD).lead(19, pushers=False) == (5, 0)  # copy engines: nobody pushes
    assert lead_rounds(2, 2048, 4096, 2, GemmConfig()) == 2
    assert lead_rounds(2, 4096, 4096, 2, GemmConfig()) == 3
    assert lead_rounds(2, 8192, 8192, 2, GemmConfig()) == 6
    assert lead_rounds(2, 8192, 8192, 2, GemmConfig(push_rounds=0)) == 0


def test_the_copy_engines_copy_each_peer_in_one_piece_by_default():
    """Every chunk of the copy-engine producer is a cudaMemcpyAsync and a stream_write_value32_ on the host (~15-20
    us each on GPUs); at 256-row chunks issue 5's shape took 16 + 16 of each per call and the op ran host-bound.
    By default (copy_rows=None) a rank publishes and pulls each shard in one copy, one flag, as torch's op."""
    from collections import Counter
    from torch.utils._python_dispatch import TorchDispatchMode

    class Copies(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.sizes = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket is torch.ops.aten.copy_ and args[0].dtype == torch.float16:  # data, not flags
                self.sizes[args[0].numel()] += 1
            return func(*args, **(kwargs or {}))

    rows, k = 1024, 16
    shards = [torch.randn(rows, k).half() for _ in range(2)]
    ops = [op_for(ws, shards[0], GemmConfig(chunk_rows=256, spin_limit=50)) for ws in matmul_world(2)]
    gathers = [op.gather_for("copy_engine") for op in ops]
    assert gathers[0].chunks == 1 and ops[0].gather.chunks == 4  # the device push keeps its 256-row chunks
    with Copies() as publish:
        epochs = [op.start(s, "copy_engine") for op, s in zip(ops, shards)]
    with Copies() as pull:
        for g, e in zip(gathers, epochs):
            g.pull_published(e)
    assert publish.sizes == {rows * k: 2} and pull.sizes == {rows * k: 2}  # one copy per rank and phase
    torch.testing.assert_close(gathers[0].gathered(epochs[0])[rows:], shards[1], rtol=0, atol=0)
