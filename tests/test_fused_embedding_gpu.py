"""GPU check of the fused embedding all-to-all against the bulk path (2 GPUs, NCCL; skipped without them; the
p2p checks also with two ranks sharing one GPU).

CI has no GPU: this runs on the device machine (docs/benchmarks.md says when it last ran there).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torchrec import DataType, EmbeddingBagConfig, KeyedJaggedTensor, PoolingType

from fused_dlrm.data.batching import local_batch_bounds
from fused_dlrm.kernels.peer_flags import PeerWaitTimeout
from fused_dlrm.sparse import EmbeddingOptimizerConfig, ShardedEmbeddingBagCollection, plan_sharding
from fused_dlrm.sparse.fused_all_to_all import FusedCommConfig
from world import TWO_GPUS, TWO_RANK_BACKENDS, run_world


DIMS = [8, 16, 32, 64, 8, 128, 24, 256]
ROWS = [1000, 50, 7, 3000, 100, 500, 20, 2000]


def tables(data_type=DataType.FP32):
    return [EmbeddingBagConfig(name=f"t{i}", embedding_dim=d, num_embeddings=r, feature_names=[f"f{i}"],
                               pooling=PoolingType.MEAN if i == 2 else PoolingType.SUM, data_type=data_type)
            for i, (d, r) in enumerate(zip(DIMS, ROWS))]


def local_kjt(step: int, global_batch: int, rank: int, world: int, device) -> KeyedJaggedTensor:
    gen = torch.Generator().manual_seed(step)
    lengths = torch.randint(0, 6, (len(DIMS), global_batch), generator=gen)
    lengths[1, :3] = 0
    lengths[0, -1] = 60  # one long bag
    start, stop = local_batch_bounds(global_batch, rank, world)
    values, weights = [], []
    for f, rows in enumerate(ROWS):
        v = (torch.rand(int(lengths[f].sum()), generator=gen) ** 2 * rows).long()
        w = torch.rand(v.numel(), generator=gen)
        o = torch.cat([torch.zeros(1, dtype=torch.long), lengths[f].cumsum(0)])
        values.append(v[o[start]:o[stop]])
        weights.append(w[o[start]:o[stop]])
    return KeyedJaggedTensor.from_lengths_sync([f"f{i}" for i in range(len(DIMS))], torch.cat(values).to(device),
                                               lengths[:, start:stop].reshape(-1).to(device),
                                               torch.cat(weights).to(device))


def _fused_equals_bulk(rank: int, world: int, steps: int, column_shards=1, row_shards=1) -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    opt = EmbeddingOptimizerConfig("rowwise_adagrad", lr=0.05)
    plan = plan_sharding(tables(), world, column_shards, row_shards)
    bulk = ShardedEmbeddingBagCollection(tables(), opt, device=device, seed=0, plan=plan)
    fused = ShardedEmbeddingBagCollection(tables(), opt, device=device, seed=0, plan=plan,
                                          comm=FusedCommConfig(wait_timeout_spins=2_000_000, allocation_timeout_s=45.0))
    exchange = fused.fused
    assert exchange.ws.allocation_timeout_s == 45.0  # the configured bound, not the default
    for step in range(steps):
        kjt = local_kjt(step, 37, rank, world, device)  # uneven local batches: 19 and 18
        check = step < 5 or step % 100 == 0 or step == steps - 1
        if check:  # poison this step's half of the output; nobody writes it before the barrier
            dist.barrier()
            half = 19 * exchange.row_len
            buf = exchange.ws.buffer("pooled", 2 * half, torch.float32).local
            buf[((exchange.ws._epochs.get("pooled", 0) + 1) % 2) * half:][:half].fill_(float("nan"))
            torch.cuda.synchronize()
            dist.barrier()
        a, b = bulk(kjt), fused(kjt)
        grad = torch.randn(a.values().shape, device=device, generator=torch.Generator(device).manual_seed(step))
        if check:
            torch.testing.assert_close(b.values(), a.values(), rtol=1e-5, atol=1e-6)
        a.values().backward(grad)
        b.values().backward(grad)
        if check:
            for name in bulk.shard_weights:
                torch.testing.assert_close(fused.shard_weights[name], bulk.shard_weights[name],
                                           rtol=1e-5, atol=1e-6)
    exchange.errors.check(block=True)

    _lone_rank_times_out(fused, rank, world, device, steps + 1)


@pytest.mark.parametrize("backend", TWO_RANK_BACKENDS)
def test_fused_forward_backward_equal_bulk_for_1000_steps_and_timeout_raises(backend):
    run_world(2, _fused_equals_bulk, 1000, backend=backend)


@pytest.mark.parametrize("backend", TWO_RANK_BACKENDS)
def test_column_shards_fused_equal_bulk(backend):
    # t5 (128 columns) in 4 shards, two on each rank (its bags arrive twice), t7 (256) and t3 (64) in 2.
    run_world(2, _fused_equals_bulk, 200, {"t5": 4, "t7": 2, "t3": 2}, backend=backend)


@pytest.mark.parametrize("backend", TWO_RANK_BACKENDS)
def test_row_blocks_fused_equal_bulk(backend):
    # t0 (1000 rows) in 3 row blocks, two on one rank; t2 (mean-pooled, 7 rows) and t7 (2000) in 2: the wide row's
    # later blocks' columns poisoned too, the parts summed after either exchange.
    run_world(2, _fused_equals_bulk, 200, 1, {"t0": 3, "t2": 2, "t7": 2}, backend=backend)


def _nvshmem_equals_bulk(rank: int, world: int, steps: int) -> None:
    """The nvshmem transport, forward and backward, equals bulk in back-to-back steps (no barrier between them:
    the ack guard alone protects the double buffers); every producer flag holds exactly the last epoch at the end
    (NVSHMEM's SIGNAL_SET: 0, the value torch's docstring gives, adds instead, and the waits passed early); a lone
    rank times out. Mismatches are collected and asserted at the end, so a failing rank cannot leave its peer
    waiting in a collective."""
    device = torch.device("cuda", rank)
    opt = EmbeddingOptimizerConfig("rowwise_adagrad", lr=0.05)
    bulk = ShardedEmbeddingBagCollection(tables(), opt, device=device, seed=0)
    fused = ShardedEmbeddingBagCollection(tables(), opt, device=device, seed=0,
                                          comm=FusedCommConfig(transport="nvshmem", wait_timeout_spins=2_000_000))
    exchange = fused.fused
    wrong = {"output": [], "weights": []}
    for step in range(steps):
        kjt = local_kjt(step, 37, rank, world, device)  # uneven local batches: 19 and 18
        a, b = bulk(kjt), fused(kjt)
        if not torch.allclose(b.values(), a.values(), rtol=1e-5, atol=1e-6):
            wrong["output"].append(step)
        grad = torch.randn(a.values().shape, device=device, generator=torch.Generator(device).manual_seed(step))
        a.values().backward(grad)
        b.values().backward(grad)
        if not all(torch.allclose(fused.shard_weights[n], bulk.shard_weights[n], rtol=1e-5,
                                  atol=1e-6) for n in bulk.shard_weights):
            wrong["weights"].append(step)
    torch.cuda.synchronize()
    dist.barrier()
    exchange.errors.check(block=True)
    peer = 1 - rank
    flags = {}
    for name in ("pooled", "grad"):
        ready, _ = exchange._flags(name)
        slots = ready.local[peer * exchange.num_programs:(peer + 1) * exchange.num_programs]
        flags[name] = sorted(set(slots.tolist()))
    _lone_rank_times_out(fused, rank, world, device, steps + 1)
    assert not wrong["output"] and not wrong["weights"], f"rank {rank}: differs from bulk at steps {wrong}"
    assert flags == {"pooled": [steps], "grad": [steps]}, f"rank {rank}: rank {peer}'s flags hold {flags}"


def _lone_rank_times_out(fused, rank: int, world: int, device, epoch: int) -> None:
    """A peer that never arrives: rank 0 runs one more exchange alone and must get an error, not a hang."""
    exchange = fused.fused
    bags = fused.input_dist(local_kjt(0, 37, rank, world, device))
    dist.barrier()
    try:
        if rank == 0:  # its waits give up after the module's comm.wait_timeout_spins (2,000,000 polls here)
            with torch.no_grad():
                exchange.finish(bags, exchange.start(bags))
            with pytest.raises(PeerWaitTimeout, match=rf"rank 0 timed out at step {epoch} waiting for rank 1, slice"):
                exchange.errors.check(block=True)
    finally:  # a failure on rank 0 must not leave rank 1 waiting here for ever
        dist.barrier()


@TWO_GPUS
def test_nvshmem_transport_forward_backward_equal_bulk_and_timeout_raises():
    run_world(2, _nvshmem_equals_bulk, 300, backend="nccl")


def _half_precision_tables(rank: int, world: int) -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    for data_type, tol in ((DataType.FP16, 1e-3), (DataType.BF16, 1e-2)):
        opt = EmbeddingOptimizerConfig("sgd", lr=0.05)
        bulk = ShardedEmbeddingBagCollection(tables(data_type), opt, device=device, seed=1)
        fused = ShardedEmbeddingBagCollection(tables(data_type), opt, device=device, seed=1, comm=FusedCommConfig())
        for step in range(3):
            kjt = local_kjt(step, 40, rank, world, device)
            a, b = bulk(kjt), fused(kjt)
            torch.testing.assert_close(b.values(), a.values(), rtol=tol, atol=tol)
            a.values().sum().backward()
            b.values().sum().backward()


@pytest.mark.parametrize("backend", TWO_RANK_BACKENDS)
def test_fp16_and_bf16_tables(backend):
    run_world(2, _half_precision_tables, backend=backend)


def _host_batch_on_rank_1(rank: int, world: int) -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    for comm in (None, FusedCommConfig()):
        ebc = ShardedEmbeddingBagCollection(tables(), EmbeddingOptimizerConfig("sgd", lr=0.05), device=device,
                                            seed=1, comm=comm)
        kjt = local_kjt(0, 37, rank, world, device)
        mine = r"rank 1: the KeyedJaggedTensor's values are on cpu, the sharded collection on cuda:\d: move the batch"
        theirs = r"rank 0: rank\(s\) \[1\] sent KeyedJaggedTensors whose values,"
        with pytest.raises(ValueError, match=mine if rank == 1 else theirs):
            ebc(kjt.to("cpu") if rank == 1 else kjt)
        pooled = ebc(kjt)  # the next batch, on the collection's device, as before
        assert pooled.values().device == device and pooled.values().isfinite().all()


@pytest.mark.parametrize("backend", TWO_RANK_BACKENDS)
def test_a_host_batch_for_a_gpu_collection_raises_on_every_rank(backend):
    """A KJT left on the host (one rank's) is refused on every rank, naming both devices: its header was made on
    the host, where NCCL cannot send it, or its bags reached the GPU lookup."""
    run_world(2, _host_batch_on_rank_1, backend=backend, timeout=240)
