"""The torchrec swap-in with comm="fused" on 2 GPUs: DistributedModelParallel + FusedEmbeddingBagCollectionSharder
(fused kernels, NCCL for the input dist) against the same sharder with comm="bulk", plain loop and
TrainPipelineSparseDist. Skipped without 2 GPUs (the fused-against-bulk check also runs with two ranks sharing one
GPU: world.ONE_GPU); CI has none (docs/benchmarks.md says when it ran).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, PoolingType
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.sharding_plan import column_wise, construct_module_sharding_plan, row_wise, table_wise
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
from torchrec.distributed.types import ShardingPlan

from fused_dlrm.data.batching import local_batch_bounds
from fused_dlrm.sparse import EmbeddingOptimizerConfig
from fused_dlrm.sparse.torchrec_sharder import OFFERED_BY_DEFAULT, SHARDING_TYPES, FusedEmbeddingBagCollectionSharder
from bags import global_batch, to_kjt
from world import TWO_GPUS, TWO_RANK_BACKENDS, run_world

TABLES = [
    EmbeddingBagConfig(name="t0", embedding_dim=16, num_embeddings=100, feature_names=["f0", "f1"]),
    EmbeddingBagConfig(name="t1", embedding_dim=32, num_embeddings=570, feature_names=["f2"], pooling=PoolingType.MEAN),
    EmbeddingBagConfig(name="t2", embedding_dim=64, num_embeddings=70, feature_names=["f3"]),
    EmbeddingBagConfig(name="t3", embedding_dim=8, num_embeddings=3000, feature_names=["f4"]),
]
KEYS = [f for t in TABLES for f in t.feature_names]


class Sparse(torch.nn.Module):
    def __init__(self, ebc):
        super().__init__()
        self.ebc = ebc

    def forward(self, kjt):
        return self.ebc(kjt).values()


FUSED = "fused"
PLANS = {  # sharding_plan's generators per table, or None: the planner's plan
    "planner": None,
    # t1 in 4 column shards (two on each rank), t2 in 2
    "columns": {"t0": table_wise(rank=0, compute_kernel=FUSED),
                "t1": column_wise(ranks=[0, 1, 1, 0], compute_kernel=FUSED),
                "t2": column_wise(ranks=[1, 0], compute_kernel=FUSED), "t3": table_wise(rank=1, compute_kernel=FUSED)},
    # t0 (read by two features), t1 (mean-pooled) and t3 in row blocks, one on each rank
    "rows": {"t0": row_wise(compute_kernel=FUSED), "t1": row_wise(compute_kernel=FUSED),
             "t2": table_wise(rank=1, compute_kernel=FUSED), "t3": row_wise(compute_kernel=FUSED)},
}


# Each table its own optimizer (the column shards' and row blocks' plans): SGD for t1 and t3, row-wise Adagrad at
# other lrs and eps for t0 and t2.
PER_TABLE = {"t0": EmbeddingOptimizerConfig("rowwise_adagrad", lr=0.05), "t1": EmbeddingOptimizerConfig("sgd", lr=0.1),
             "t2": EmbeddingOptimizerConfig("rowwise_adagrad", lr=0.02, eps=1e-3),
             "t3": EmbeddingOptimizerConfig("sgd", lr=0.05)}


def dmp(reference, comm: str, device, plan: str = "planner") -> DistributedModelParallel:
    """plan: a key of PLANS (the planner's: with the sharder's default offer, row-wise Adagrad for every table;
    the others with PER_TABLE)."""
    generators = PLANS[plan]
    optimizer = EmbeddingOptimizerConfig("rowwise_adagrad", lr=0.05) if generators is None else PER_TABLE
    sharder = FusedEmbeddingBagCollectionSharder(optimizer, comm=comm,
                                                 sharding_types=OFFERED_BY_DEFAULT if generators is None
                                                 else SHARDING_TYPES)
    sharding = None if generators is None else ShardingPlan({"ebc": construct_module_sharding_plan(
        reference, generators, sharder=sharder, local_size=2, world_size=2, device_type="cuda")})
    return DistributedModelParallel(Sparse(copy.deepcopy(reference)), sharders=[sharder], device=device, plan=sharding)


def _fused_equals_bulk(rank: int, world: int, plan: str) -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    reference = EmbeddingBagCollection(TABLES)
    fused, bulk = dmp(reference, "fused", device, plan), dmp(reference, "bulk", device, plan)
    start, stop = local_batch_bounds(37, rank, world)
    for step in range(20):
        lengths, values, _ = global_batch(step, 37, TABLES, False)
        kjt = to_kjt(KEYS, lengths, values, None, start, stop).to(device)
        out_f, out_b = fused(kjt), bulk(kjt)
        torch.testing.assert_close(out_f, out_b, rtol=1e-5, atol=1e-6)
        grad = torch.randn(out_b.shape, generator=torch.Generator().manual_seed(step)).to(device)
        (out_f * grad).sum().backward()
        (out_b * grad).sum().backward()
    state_f, state_b = fused.state_dict(), bulk.state_dict()
    assert sorted(state_f) == sorted(state_b) and state_f
    for stage in ("compute", "output_dist"):  # the fused kernel runs them as one: apart they are refused
        with pytest.raises(RuntimeError, match=rf"^{stage}: with comm=fused the lookup and its output dist are one"):
            getattr(fused.module.ebc, stage)(None, None)
    for key in state_f:  # torchrec's ShardedTensors of the tables: this rank's shards
        shards_f, shards_b = state_f[key].local_shards(), state_b[key].local_shards()
        assert [s.metadata for s in shards_f] == [s.metadata for s in shards_b], key
        for f, b in zip(shards_f, shards_b):
            torch.testing.assert_close(f.tensor, b.tensor, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", TWO_RANK_BACKENDS)
@pytest.mark.parametrize("plan", list(PLANS))
def test_fused_sharder_equals_bulk_sharder_on_gpus(plan, backend):
    run_world(2, _fused_equals_bulk, plan, backend=backend)


class WithLoss(torch.nn.Module):
    def __init__(self, ebc):
        super().__init__()
        self.ebc = ebc

    def forward(self, kjt):
        out = self.ebc(kjt).values()
        loss = (out ** 2).mean()
        # A copy: the fused module's output lives in its double-buffered symmetric memory (valid for two steps).
        return loss, out.detach().clone()


def _pipeline_with_fused(rank: int, world: int) -> None:
    device = torch.device("cuda", rank)
    torch.manual_seed(0)
    reference = EmbeddingBagCollection(TABLES)
    start, stop = local_batch_bounds(40, rank, world)
    batches = []
    for step in range(6):
        lengths, values, _ = global_batch(step, 40, TABLES, False)
        batches.append(to_kjt(KEYS, lengths, values, None, start, stop))
    results = {}
    for comm in ("bulk", "fused"):
        sharder = FusedEmbeddingBagCollectionSharder(EmbeddingOptimizerConfig("rowwise_adagrad", lr=0.05), comm=comm)
        model = DistributedModelParallel(WithLoss(copy.deepcopy(reference)), sharders=[sharder], device=device)
        opt = model.fused_optimizer  # no dense parameters: the tables' optimizer runs inside backward
        if comm == "bulk":
            outs = []
            for kjt in batches:
                opt.zero_grad()
                loss, out = model(kjt.to(device))
                loss.backward()
                opt.step()
                outs.append(out)
        else:
            pipeline = TrainPipelineSparseDist(model, opt, device)
            it = iter(batches)
            outs = [pipeline.progress(it) for _ in batches]
        results[comm] = outs
    for a, b in zip(results["bulk"], results["fused"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@TWO_GPUS
def test_fused_sharder_under_train_pipeline_sparse_dist_on_gpus():
    run_world(2, _pipeline_with_fused, backend="nccl")
