"""All-gather primitives and AllGather + GEMM on simulated worlds of 2 and 4 ranks (interpreter on the CPU).

Every rank's producer runs before any rank's consumer (one process); buffers and outputs start poisoned (NaN) so
unwritten elements show; results are compared with pure-torch references (torch.cat, float64 matmul).
"""

from __future__ import annotations

import os

import pytest
import torch

from fused_dlrm.dist.symmetric import SimulatedWorld
from fused_dlrm.kernels.allgather import PRODUCERS, SymmetricAllGather, all_gather_reference

from fused_dlrm.kernels.peer_flags import PeerWaitTimeout

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs in the Triton interpreter")


def gathers(world_size, rows, cols, dtype, chunk_rows, **kw):
    ops = [SymmetricAllGather(ws, rows, cols, dtype, chunk_rows, spin_limit=50, block_rows=4, block_cols=8, **kw)
           for ws in SimulatedWorld(world_size).workspaces()]
    for op in ops:
        op.data.local.fill_(float("nan"))
    return ops


def run_gather(ops, shards, producers):
    epochs = [op.start(s, p) for op, s, p in zip(ops, shards, producers)]  # every producer first
    return [op.finish(e, p, s).clone() for op, e, p, s in zip(ops, epochs, producers, shards)]


@pytest.mark.parametrize("world_size", [2, 4])
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
    for step in range(60):
        shards = [(torch.randn(rows, cols, generator=gen) * (step + 1)).to(torch.bfloat16) for _ in ops]
        producers = [PRODUCERS[step % len(PRODUCERS)]] * world_size  # every rank uses the same one per call
        for got in run_gather(ops, shards, producers):
            torch.testing.assert_close(got, all_gather_reference(shards), rtol=0, atol=0)
    assert ops[0].next_epoch() == 61


def test_a_missing_peer_times_out_naming_rank_and_chunk():
    ops = gathers(2, 4, 3, torch.float32, chunk_rows=2)
    shard = torch.randn(4, 3)
    epoch = ops[0].start(shard, "device")  # rank 1 never produces
    with pytest.raises(PeerWaitTimeout, match=r"rank 0 timed out at step 1 waiting for rank 1, slice [01]"):
        ops[0].finish(epoch, "device", shard)


def test_a_producer_waits_for_the_peer_to_release_its_half():
    ops = gathers(2, 4, 3, torch.float32, chunk_rows=4)
    shards = [torch.randn(4, 3) for _ in ops]
    run_gather(ops, shards, ["copy_engine"] * 2)
    ops[0].start(shards[0], "copy_engine")  # epoch 2: rank 1 has acknowledged epoch 1, so this may go ahead
    ops[0].errors.after_wait(2)
    ops[0].start(shards[0], "copy_engine")  # epoch 3 would overwrite epoch 1's half: rank 1 never took epoch 2
    with pytest.raises(PeerWaitTimeout, match=r"rank 0 timed out at step 3 waiting for rank 1 to release"):
        ops[0].errors.after_wait(3)
