"""Epochs end at int32's last value (dist.symmetric.MAX_EPOCH): a fused op's call at that epoch is exact, and the next
is refused on every rank before anything of it runs (interpreter, simulated worlds; counters and flags set as after
that many calls rather than making 2**31 calls). Past it the MoE dispatch's device epoch (int32) wrapped to -2**31,
which every flag satisfies: a rank whose peer never pushed returned its GEMM of stale rows without an error. The
ops whose epochs only the host counts ended in a timeout naming step -2**31 (a flag truncated to int32 that no wait
sees), or on GPUs in an OverflowError of Triton's launcher."""

from __future__ import annotations

import os

import pytest
import torch

from fused_dlrm.dist.symmetric import MAX_EPOCH, SimulatedWorld
from fused_dlrm.kernels.allgather import PRODUCERS, all_gather_reference
from fused_dlrm.kernels.peer_flags import PeerWaitTimeout
from test_allgather_kernels import gathers, run_gather
from test_fused_embedding_kernels import World as EmbeddingWorld, expected_outputs, make_tables, random_bags
from test_gemm_allreduce_kernel import World as GemmWorld, assert_all_reduced, random_inputs
from test_moe_fused_dispatch import World as MoEWorld, check_step

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs in the Triton interpreter")


def refused(rank: int, exchange: str) -> str:
    return (rf"^rank {rank}: the exchange '{exchange}' of this workspace has made {MAX_EPOCH} calls, as many as its "
            r"int32 epochs count")


def as_after_last_but_one(workspaces: list, exchange: str) -> None:
    """The ranks' epoch counters of `exchange`, and every flag and ack of their world, as after MAX_EPOCH - 1 calls."""
    for name, tensors in workspaces[0].world.buffers.items():
        if any(word in name for word in ("ready", "ack", "done")) and tensors[0].dtype == torch.int32:
            for t in tensors:
                t.fill_(MAX_EPOCH - 1)
    for ws in workspaces:
        ws._epochs[exchange] = MAX_EPOCH - 1


def test_a_workspace_refuses_the_epoch_past_int32():
    """Every rank alike, naming itself and the exchange; a refused call takes no epoch (it raises again)."""
    ranks = SimulatedWorld(2).workspaces()
    for ws in ranks:
        ws._epochs["pooled"] = MAX_EPOCH - 1
        assert ws.next_epoch("pooled") == MAX_EPOCH
        for _ in range(2):
            with pytest.raises(RuntimeError, match=refused(ws.rank, "pooled")):
                ws.next_epoch("pooled")
        assert ws.next_epoch("grad") == 1  # other exchanges count on


def test_gemm_allreduce():
    world = GemmWorld(2, num_programs=2)
    gen = torch.Generator().manual_seed(1)
    xs, ws = random_inputs(2, 5, 16, 20, torch.bfloat16, gen)
    assert_all_reduced(world(xs, ws), xs, ws)
    as_after_last_but_one([op.ws for op in world.ops], "gemm_allreduce")
    xs, ws = random_inputs(2, 5, 16, 20, torch.bfloat16, gen)
    assert_all_reduced(world(xs, ws), xs, ws)
    for op, x, w in zip(world.ops, xs, ws):
        with pytest.raises(RuntimeError, match=refused(op.rank, "gemm_allreduce")):
            op(x, w)


@pytest.mark.parametrize("producer", PRODUCERS)
def test_all_gather(producer):
    ops = gathers(2, 5, 6, torch.float16, chunk_rows=2)
    gen = torch.Generator().manual_seed(2)
    for step in range(2):
        if step:
            as_after_last_but_one([op.ws for op in ops], ops[0].exchange)
        shards = [torch.randn(5, 6, generator=gen).to(torch.float16) for _ in ops]
        for got in run_gather(ops, shards, [producer] * 2):
            torch.testing.assert_close(got, all_gather_reference(shards), rtol=0, atol=0)
    for op, shard in zip(ops, shards):
        with pytest.raises(RuntimeError, match=refused(op.rank, ops[0].exchange)):
            op.start(shard, producer)


def test_pooled_embedding_all_to_all():
    tables = make_tables([4, 2], [6, 5])
    world = EmbeddingWorld(tables, 2, num_programs=2)
    gen = torch.Generator().manual_seed(3)
    for step in range(2):
        if step:
            as_after_last_but_one([ex.ws for ex in world.exchanges], "pooled")
        lengths, values, _ = random_bags(tables, [2, 1], False, gen)
        bags = [world.owned_bags(r, lengths, values, None, [2, 1]) for r in range(2)]
        for got, want in zip(world.forward(bags), expected_outputs(world, lengths, values, None, [2, 1])):
            torch.testing.assert_close(got, want)
    for rank, (ex, b) in enumerate(zip(world.exchanges, bags)):
        with pytest.raises(RuntimeError, match=refused(rank, "pooled")):
            ex.start(b)


def moe_as_after_last_but_one(world: MoEWorld) -> None:
    """As after MAX_EPOCH - 1 dispatches: the host's epochs, the flags, and the device's epoch (int32)."""
    as_after_last_but_one([d.ws for d in world.dispatch], "moe_dispatch")
    for d in world.dispatch:
        d._epoch_done.fill_(MAX_EPOCH - 1)


def test_moe_dispatch():
    """At the last epoch a rank alone in its call still waits for its peer's rows (and times out), and a call of
    every rank is exact; the next call, whose device epoch would wrap, is refused on every rank."""
    world = MoEWorld(2, 2, 8, top_k=2)
    gen = torch.Generator().manual_seed(4)
    check_step(world, [13, 9], 2, None, gen)
    moe_as_after_last_but_one(world)
    xs, token_of_rows, _, layouts = world.routed_batch([13, 9], 2, None, gen)
    tables = world.tables(token_of_rows, layouts)
    epoch = world.dispatch[0].start(xs[0], token_of_rows[0], tables[0])  # rank 1 never pushes
    with pytest.raises(PeerWaitTimeout, match=f"rank 0 timed out at step {MAX_EPOCH} waiting for rank 1"):
        world.dispatch[0].finish(epoch, world.w13[0])
    moe_as_after_last_but_one(world)
    check_step(world, [13, 9], 2, None, gen)
    for rank, d in enumerate(world.dispatch):
        with pytest.raises(RuntimeError, match=refused(rank, "moe_dispatch")):
            d.start(xs[rank], token_of_rows[rank], tables[rank])
