"""FusedEmbeddingBagCollectionSharder under torchrec's DistributedModelParallel, against stock torchrec.

Two (once three, once four) gloo processes on the CPU. Each rank gets its slice of the same global batches. Three
models start from the same weights:
  * ours:      DMP + FusedEmbeddingBagCollectionSharder, plan from torchrec's planner (the sharder's default offer:
               whole tables here) or one given (column-wise, row-wise, mixed);
  * stock:     DMP + torchrec's EmbeddingBagCollectionSharder under the same plan, fbgemm's CPU TBE with the
               optimizer from apply_optimizer_in_backward (EXACT_ROWWISE_ADAGRAD / EXACT_SGD);
  * reference: the unsharded EBC on the whole global batch, with torchrec.optim's RowWiseAdagrad / torch SGD, its
               gradient divided by the world size when torchrec's gradient division is on (its default). (Column
               shards keep a row-wise Adagrad accumulator each, in torchrec as in ours: there only stock compares;
               row blocks keep the table's per-row accumulators.)
Forward outputs (by key: stock torchrec orders its output by sharding, ours keeps the EBC's order) and the owned
tables after every step must agree, as must the fused optimizers' state. A last run checks TrainPipelineSparseDist
(input dist one batch ahead) against a plain loop.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed._shard.sharding_spec import EnumerableShardingSpec, ShardMetadata
from torchrec import (EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig,
                      KeyedJaggedTensor, KeyedTensor, PoolingType)
from torchrec.datasets.utils import Batch
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.comm_ops import set_gradient_division
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.sharding_plan import column_wise, construct_module_sharding_plan, row_wise, table_wise
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
from torchrec.distributed.types import (BoundsCheckMode, CacheParams, ParameterSharding, ShardingEnv,
                                        ShardingPlan)
from torchrec.modules.embedding_configs import DataType
from torchrec.modules.feature_processor_ import PositionWeightedModuleCollection
from torchrec.modules.fp_embedding_modules import FeatureProcessedEmbeddingBagCollection
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

from fused_dlrm.data.batching import local_batch_bounds
from fused_dlrm.sparse import EmbeddingOptimizerConfig, plan_sharding
from fused_dlrm.sparse import torchrec_sharder
from fused_dlrm.sparse.fused_all_to_all import FusedCommConfig
from fused_dlrm.sparse.sharded_ebc import ShardedEmbeddingBagCollection, shard_weight
from fused_dlrm.sparse.torchrec_sharder import (OFFERED_BY_DEFAULT, SHARDING_TYPES, FusedEmbeddingBagCollectionSharder,
                                                FusedShardedEBC, plan_from_torchrec, torchrec_in_backward_optimizer)
from bags import global_batch, to_kjt
from world import run_world

CPU = torch.device("cpu")
LR, EPS = 0.05, 1e-8

# Uneven rows and dims, a table read by two features, a mean-pooled table.
TABLES = [
    EmbeddingBagConfig(name="t0", embedding_dim=4, num_embeddings=10, feature_names=["f0", "f1"]),
    EmbeddingBagConfig(name="t1", embedding_dim=8, num_embeddings=57, feature_names=["f2"], pooling=PoolingType.MEAN),
    EmbeddingBagConfig(name="t2", embedding_dim=16, num_embeddings=7, feature_names=["f3"]),
    EmbeddingBagConfig(name="t3", embedding_dim=12, num_embeddings=300, feature_names=["f4"]),
]
# The unsharded reference (nn.EmbeddingBag) takes per-sample weights with SUM pooling only.
SUM_TABLES = [EmbeddingBagConfig(name=t.name, embedding_dim=t.embedding_dim, num_embeddings=t.num_embeddings,
                                 feature_names=t.feature_names) for t in TABLES]
# One table more than 4 ranks: some rank owns two.
FIFTH = EmbeddingBagConfig(name="t4", embedding_dim=8, num_embeddings=40, feature_names=["f5"])
# One row: torchrec's row-wise cut over two ranks leaves the second block empty, so ours holds the table whole.
ONE_ROW = EmbeddingBagConfig(name="t5", embedding_dim=4, num_embeddings=1, feature_names=["f6"])


def keys_of(tables) -> list[str]:
    return [f for t in tables for f in t.feature_names]


class SparseModel(nn.Module):
    def __init__(self, ebc: EmbeddingBagCollection):
        super().__init__()
        self.ebc = ebc

    def forward(self, kjt: KeyedJaggedTensor) -> KeyedTensor:
        return self.ebc(kjt)


def dot_by_key(kt: KeyedTensor, grads: dict[str, torch.Tensor]) -> torch.Tensor:
    """sum(kt * grad), matched by key: stock torchrec's sharded output is not in the EBC's feature order."""
    return sum((v * grads[k]).sum() for k, v in kt.to_dict().items())


def local_shard(sharded_tensor, offsets: list[int]) -> torch.Tensor:
    """This rank's shard of a torchrec ShardedTensor that starts at `offsets` ([row, column] of a table)."""
    found = [s.tensor for s in sharded_tensor.local_shards() if list(s.metadata.shard_offsets) == offsets]
    assert len(found) == 1, (offsets, [s.metadata for s in sharded_tensor.local_shards()])
    return found[0]


@dataclasses.dataclass(frozen=True)
class OptimizerSetup:
    """How a torchrec user sets the embedding optimizer: the sharder's fused_params, and apply_optimizer_in_backward's
    (class, kwargs) on some tables' weights (by table name)."""

    fused_params: dict | None = None
    in_backward: dict = dataclasses.field(default_factory=dict)

    @staticmethod
    def every_table(config: EmbeddingOptimizerConfig, tables) -> OptimizerSetup:
        """apply_optimizer_in_backward on every table, with what makes stock torchrec run `config`."""
        return OptimizerSetup(in_backward={t.name: torchrec_in_backward_optimizer(config) for t in tables})

    def model(self, reference: EmbeddingBagCollection) -> SparseModel:
        """A copy of `reference` set up so."""
        model = SparseModel(copy.deepcopy(reference))
        for table, (optimizer_class, kwargs) in self.in_backward.items():
            apply_optimizer_in_backward(optimizer_class, [model.ebc.embedding_bags[table].weight], dict(kwargs))
        return model


def stock_torchrec(reference: EmbeddingBagCollection, module_plan, setup: OptimizerSetup) -> DistributedModelParallel:
    """torchrec's own sharding of the same tables under the same plan (FUSED kernels), its optimizer set up so."""
    dmp = DistributedModelParallel(setup.model(reference),
                                   sharders=[EmbeddingBagCollectionSharder(fused_params=setup.fused_params)],
                                   device=CPU, plan=ShardingPlan({"ebc": module_plan}))
    # On the CPU torchrec re-initialises the sharded tables instead of copying the unsharded ones: copy them.
    with torch.no_grad():
        for key, value in dmp.state_dict().items():
            for shard in value.local_shards():
                (row, col), (rows, dim) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
                shard.tensor.copy_(reference.embedding_bags[key.split(".")[2]].weight[row:row + rows, col:col + dim])
    return dmp


def explicit_plan(tables, generators: dict, world: int, sharder, local_size: int | None = None) -> dict:
    """torchrec's module plan from sharding_plan's generators (table_wise(rank=..), column_wise(ranks=..),
    row_wise()), for the generators of `tables`; local_size: ranks per host (all of them: one host)."""
    return construct_module_sharding_plan(EmbeddingBagCollection(tables, device=torch.device("meta")),
                                          {t.name: generators[t.name] for t in tables}, sharder=sharder,
                                          local_size=local_size or world, world_size=world, device_type="cpu")


def compare_with_stock_torchrec(rank: int, world: int, cases) -> None:
    """cases: (optimizer, weighted, global batch, tables, gradient division, plans: a function of the world size
    giving sharding_plan's generators per table, or None for the planner's plan (DMP's own, the sharder's default
offer: table-wise here), stock: whether stock
    torchrec runs the case too; without it the unsharded reference must update as the shards do)."""
    for optimizer, weighted, batch, tables, divide, plans, with_stock in cases:
        # torchrec divides the pooled gradient by the world size by default (tables see the mean over ranks of
        # the per-rank gradients); off, they see the sum. Our sharded module follows the same switch.
        set_gradient_division(divide)
        torch.manual_seed(0)
        reference = EmbeddingBagCollection(tables, is_weighted=weighted)
        # Offered row-wise only where a plan asks for it (the planner's default offer: table- and column-wise).
        sharder = FusedEmbeddingBagCollectionSharder(EmbeddingOptimizerConfig(optimizer, lr=LR, eps=EPS),
                                                     sharding_types=OFFERED_BY_DEFAULT if plans is None
                                                     else SHARDING_TYPES)
        plan = None if plans is None else ShardingPlan({"ebc": explicit_plan(tables, plans(world), world, sharder)})
        ours = DistributedModelParallel(SparseModel(copy.deepcopy(reference)), sharders=[sharder], device=CPU,
                                        plan=plan)
        sharded = ours.module.ebc
        assert isinstance(sharded, FusedShardedEBC)
        module_plan = ours.plan.get_plan_for_module("ebc")
        if plans is None:  # the planner spread the tables, whole
            assert {ps.sharding_type for ps in module_plan.values()} == {"table_wise"}
            assert len({ps.ranks[0] for ps in module_plan.values()}) == min(world, len(tables))
        mine = sharded.plan.shards_of(rank)
        # torchrec's keys: every table on every rank, a ShardedTensor of the whole table over this rank's shards
        assert sorted(ours.state_dict()) == sorted(f"ebc.embedding_bags.{t.name}.weight" for t in tables)
        # No column shards, or SGD: the unsharded reference updates the rows as the shards do.
        same_updates = optimizer == "sgd" or all(ps.sharding_type != "column_wise" for ps in module_plan.values())
        assert same_updates or with_stock, "nothing to compare the updates with"
        stock = (stock_torchrec(reference, module_plan,
                                OptimizerSetup.every_table(EmbeddingOptimizerConfig(optimizer, lr=LR, eps=EPS), tables))
                 if with_stock else None)

        ref_opt = (torch.optim.SGD(reference.parameters(), lr=LR) if optimizer == "sgd"
                   else RowWiseAdagrad(reference.parameters(), lr=LR, eps=EPS))
        keys, dims = keys_of(tables), [t.embedding_dim for t in tables for _ in t.feature_names]
        start, stop = local_batch_bounds(batch, rank, world)
        for step in range(3):
            lengths, values, weights = global_batch(step, batch, tables, weighted)
            expected = reference(to_kjt(keys, lengths, values, weights, 0, batch))
            got = ours(to_kjt(keys, lengths, values, weights, start, stop))
            assert got.keys() == keys and got.length_per_key() == dims  # the EBC's order, as unsharded
            if same_updates or step == 0:
                torch.testing.assert_close(got.values(), expected.values()[start:stop], rtol=1e-5, atol=1e-6)
            if stock is not None:
                got_stock = stock(to_kjt(keys, lengths, values, weights, start, stop))
                assert sorted(got_stock.keys()) == sorted(keys)
                for key, value in got_stock.to_dict().items():
                    torch.testing.assert_close(got.to_dict()[key], value, rtol=1e-5, atol=1e-6)

            grad = torch.randn(expected.values().shape, generator=torch.Generator().manual_seed(step))
            ref_opt.zero_grad()
            (expected.values() * grad).sum().div(world if divide else 1).backward()
            ref_opt.step()
            local_grads = dict(zip(keys, torch.split(grad[start:stop], dims, dim=1)))
            dot_by_key(got, local_grads).backward()
            ours.fused_optimizer.step()
            if stock is not None:
                dot_by_key(got_stock, local_grads).backward()
                stock.fused_optimizer.step()

            if same_updates:
                for s in mine:
                    torch.testing.assert_close(sharded.shard_weights[s.name],
                                               shard_weight(reference.embedding_bags[s.table].weight, s),
                                               rtol=1e-5, atol=1e-6)
            if stock is not None:
                assert_tables_match_stock(sharded, stock, rank)

        our_state = ours.fused_optimizer.state_dict()["state"]
        assert sorted(our_state) == sorted({f"ebc.embedding_bags.{s.table}.weight" for s in mine})
        if stock is not None:
            assert_optimizer_state_matches_stock(ours, stock)


def assert_tables_match_stock(sharded: FusedShardedEBC, stock: DistributedModelParallel, rank: int) -> None:
    """This rank's tables, column shards and row blocks hold what stock torchrec's hold there."""
    stock_state = stock.state_dict()
    for s in sharded.plan.shards_of(rank):
        torch.testing.assert_close(sharded.shard_weights[s.name],
                                   local_shard(stock_state[f"ebc.embedding_bags.{s.table}.weight"], [s.row, s.col]),
                                   rtol=1e-5, atol=1e-6)


def assert_same_state(a, b, rtol: float = 1e-5, atol: float = 1e-7) -> None:
    """Two states of the same keys and values: a ShardedTensor (torchrec's tables and their accumulators) of the same
    global shape and the same local shards, a tensor alike."""
    assert sorted(a) == sorted(b)
    for key, value in a.items():
        if isinstance(value, dict):
            assert_same_state(value, b[key], rtol, atol)
        elif isinstance(value, ShardedTensor):
            assert isinstance(b[key], ShardedTensor) and value.size() == b[key].size(), key
            theirs = {tuple(s.metadata.shard_offsets): s.tensor for s in b[key].local_shards()}
            assert sorted(theirs) == sorted(tuple(s.metadata.shard_offsets) for s in value.local_shards()), key
            for shard in value.local_shards():
                torch.testing.assert_close(shard.tensor, theirs[tuple(shard.metadata.shard_offsets)], rtol=rtol,
                                           atol=atol)
        else:
            torch.testing.assert_close(value, b[key], rtol=rtol, atol=atol)


def assert_optimizer_state_matches_stock(ours: DistributedModelParallel, stock: DistributedModelParallel) -> None:
    """The fused optimizer's state: torchrec's keys, layout (a column shard's accumulators at k * rows of the
    table's [rows x column shards]) and row-wise Adagrad accumulators (none under SGD)."""
    assert_same_state(ours.fused_optimizer.state_dict()["state"], stock.fused_optimizer.state_dict()["state"])


def test_two_ranks_match_stock_torchrec_and_unsharded():
    run_world(2, compare_with_stock_torchrec, [
        # Global batch 7 over 2 ranks: local batches 4 and 3.
        ("rowwise_adagrad", False, 7, TABLES, True, None, True),
        ("sgd", True, 8, SUM_TABLES, True, None, True),
        ("sgd", False, 7, TABLES, False, None, True),
    ])


def test_three_ranks_one_owns_nothing():
    # 3 ranks, 2 tables: the third rank owns no table but still sends its inputs and receives its outputs.
    run_world(3, compare_with_stock_torchrec, [("rowwise_adagrad", False, 9, TABLES[:2], True, None, True)])


def test_four_ranks_five_tables():
    # 5 tables spread over 4 ranks (checked): one rank owns two. Global batch 10: local batches 3, 3, 2, 2.
    run_world(4, compare_with_stock_torchrec, [("rowwise_adagrad", False, 10, TABLES + [FIFTH], True, None, True),
                                               ("sgd", True, 11, SUM_TABLES + [FIFTH], False, None, True)])


def column_wise_plans(world: int) -> dict:
    """t2 (16 columns) in 4 shards, two or three of them on one rank; t3 (12) in 3; the rest whole."""
    return {"t0": table_wise(rank=world - 1, compute_kernel="fused"),
            "t1": table_wise(rank=0, compute_kernel="fused"),
            "t2": column_wise(ranks=[1, 0, 1, world - 1], compute_kernel="fused"),
            "t3": column_wise(ranks=[world - 1, 0, world - 1], compute_kernel="fused")}


def test_column_wise_plans_match_stock_torchrec():
    # torchrec's sharding_plan.column_wise: each shard's rank receives its table's bags (rank 1 twice for t2),
    # pools its columns into their place, and updates them with an accumulator of its own (row-wise Adagrad).
    run_world(2, compare_with_stock_torchrec, [("rowwise_adagrad", False, 7, TABLES, True, column_wise_plans, True),
                                               ("sgd", True, 8, SUM_TABLES, False, column_wise_plans, True)])
    run_world(3, compare_with_stock_torchrec, [("rowwise_adagrad", False, 9, TABLES, True, column_wise_plans, True)])


def row_wise_plans(world: int) -> dict:
    """Every table in row blocks, one per rank (torchrec's cut: t2's 7 rows in 4 and 3 over two ranks, 3, 3, 1 over
    three)."""
    return {t.name: row_wise(compute_kernel="fused") for t in TABLES + [FIFTH, ONE_ROW]}


def mixed_plans(world: int) -> dict:
    """t0 and t3 in row blocks next to a table-wise t1 (mean-pooled) and a column-wise t2."""
    return {"t0": row_wise(compute_kernel="fused"), "t1": table_wise(rank=world - 1, compute_kernel="fused"),
            "t2": column_wise(ranks=[1, 0, 1, world - 1], compute_kernel="fused"),
            "t3": row_wise(compute_kernel="fused")}


def mean_row_wise_plans(world: int) -> dict:
    """The mean-pooled t1 in row blocks next to table-wise t0 and t2; t3 and the one-row t5 in row blocks."""
    return {"t0": table_wise(rank=world - 1, compute_kernel="fused"), "t1": row_wise(compute_kernel="fused"),
            "t2": table_wise(rank=0, compute_kernel="fused"), "t3": row_wise(compute_kernel="fused"),
            "t5": row_wise(compute_kernel="fused")}


def test_row_wise_plans_match_stock_torchrec():
    """torchrec's sharding_plan.row_wise: each index reaches only its block's rank, and a sample's blocks' parts
    are summed (a mean-pooled table's divided by its bag size); row blocks keep the table's per-row Adagrad
    accumulators, so the unsharded reference compares too.

    Stock torchrec's CPU row-wise (fbgemm's block_bucketize, gloo) runs here, but not in three cases, which compare
    with the unsharded EBC alone: unequal local batches fail in its reduce-scatter (gloo's all-gather refuses
    unequal sizes); a mean-pooled row-wise table next to table-wise ones gives those table-wise tables wrong
    outputs (akin to torchrec issue #2808, mean and sum pooling mixed under row-wise sharding); and the empty block
    of a table with fewer rows than ranks fails in its backward ("CPU exact rowwise adagrad ... more than 2B rows",
    under SGD too).
    """
    run_world(2, compare_with_stock_torchrec, [
        ("rowwise_adagrad", False, 8, TABLES, True, row_wise_plans, True),
        ("sgd", True, 8, SUM_TABLES, False, row_wise_plans, True),
        ("rowwise_adagrad", False, 8, TABLES, True, mixed_plans, True),
        ("rowwise_adagrad", False, 7, TABLES + [ONE_ROW], True, mean_row_wise_plans, False),
        ("sgd", True, 7, SUM_TABLES, True, mixed_plans, False),  # local batches 4 and 3
    ])
    run_world(3, compare_with_stock_torchrec, [("rowwise_adagrad", False, 9, TABLES, True, row_wise_plans, True)])


# A feature no table of the collection reads (another module's, in a KJT that feeds both): its indices fit no table.
OTHER_MODULES = EmbeddingBagConfig(name="elsewhere", embedding_dim=4, num_embeddings=1000, feature_names=["zz"])


def keys_in_another_order_and_one_no_table_reads(rank: int, world: int) -> None:
    """torchrec's EmbeddingBagCollection, sharded or not, takes a KJT whose keys come in any order and reads only its
    own features (stock torchrec's sharded one permutes the others away): so must the swap-in. Row blocks, column
    shards and whole tables; the KJT's keys reversed with the foreign one in the middle, a negative index in it."""
    set_gradient_division(True)
    torch.manual_seed(0)
    reference = EmbeddingBagCollection(TABLES)
    sharder = FusedEmbeddingBagCollectionSharder(EmbeddingOptimizerConfig("sgd", lr=LR), sharding_types=SHARDING_TYPES)
    plan = ShardingPlan({"ebc": explicit_plan(TABLES, mixed_plans(world), world, sharder)})
    ours = DistributedModelParallel(SparseModel(copy.deepcopy(reference)), sharders=[sharder], device=CPU, plan=plan)
    keys, dims = keys_of(TABLES), [t.embedding_dim for t in TABLES for _ in t.feature_names]
    order = [5, 4, 3, 2, 1, 0]  # feature 5 is zz: between f4 and f3 once reversed
    order.insert(2, order.pop(0))
    batch = 8
    start, stop = local_batch_bounds(batch, rank, world)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=LR)
    for step in range(2):
        lengths, values, _ = global_batch(step, batch, TABLES + [OTHER_MODULES], False)
        values[5][0] = -3  # read by no table: never checked against one
        shuffled = ([keys_of(TABLES + [OTHER_MODULES])[i] for i in order], lengths[order], [values[i] for i in order])
        expected = reference(to_kjt(*shuffled, None, 0, batch))
        got = ours(to_kjt(*shuffled, None, start, stop))
        assert got.keys() == keys
        torch.testing.assert_close(got.values(), expected.values()[start:stop], rtol=1e-5, atol=1e-6)
        grad = torch.randn(expected.values().shape, generator=torch.Generator().manual_seed(step))
        ref_opt.zero_grad()
        (expected.values() * grad).sum().div(world).backward()
        ref_opt.step()
        dot_by_key(got, dict(zip(keys, torch.split(grad[start:stop], dims, dim=1)))).backward()
        for s in ours.module.ebc.plan.shards_of(rank):
            torch.testing.assert_close(ours.module.ebc.shard_weights[s.name],
                                       shard_weight(reference.embedding_bags[s.table].weight, s), rtol=1e-5, atol=1e-6)


def test_keys_in_another_order_and_one_no_table_reads():
    run_world(2, keys_in_another_order_and_one_no_table_reads, timeout=300)


# Mean-pooled tables of a weighted EBC, whose bags torchrec's unsharded EBC (nn.EmbeddingBag) does not pool.
WEIGHTED_MEAN = [
    EmbeddingBagConfig(name="m0", embedding_dim=8, num_embeddings=20, feature_names=["g0", "g1"],
                       pooling=PoolingType.MEAN),
    EmbeddingBagConfig(name="m1", embedding_dim=4, num_embeddings=9, feature_names=["g2"], pooling=PoolingType.MEAN),
]
WEIGHTED_MEAN_PLANS = [
    lambda world: {"m0": table_wise(rank=1, compute_kernel="fused"), "m1": table_wise(rank=0, compute_kernel="fused")},
    lambda world: {"m0": column_wise(ranks=[1, 0], compute_kernel="fused"),
                   "m1": table_wise(rank=1, compute_kernel="fused")},
    lambda world: {t.name: row_wise(compute_kernel="fused") for t in WEIGHTED_MEAN},
]


def weighted_means(tables: dict[str, torch.Tensor], lengths, values, weights) -> torch.Tensor:
    """[batch, all dims]: each bag's sum(weight * row) / its size (0 when empty), in the tables' dtype."""
    pooled = []
    for f, t in enumerate(t for t in WEIGHTED_MEAN for _ in t.feature_names):
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths[f].cumsum(0)])
        sums = F.embedding_bag(values[f], tables[t.name], offsets, mode="sum", include_last_offset=True,
                               per_sample_weights=weights[f].to(tables[t.name].dtype))
        pooled.append(sums / lengths[f].clamp(min=1).unsqueeze(1))
    return torch.cat(pooled, dim=1)


def weighted_mean_pooling_and_its_gradient(rank: int, world: int) -> None:
    """Under every plan, the bag sum(weight * row) / size and, with exact SGD, the tables moved by the gradient of
    that (weight * g / size per occurrence), against float64 autograd on the whole global batch."""
    set_gradient_division(True)
    keys, batch = keys_of(WEIGHTED_MEAN), 7  # local batches 4 and 3
    start, stop = local_batch_bounds(batch, rank, world)
    for plans in WEIGHTED_MEAN_PLANS:
        torch.manual_seed(0)
        ebc = EmbeddingBagCollection(WEIGHTED_MEAN, is_weighted=True)
        sharder = FusedEmbeddingBagCollectionSharder(EmbeddingOptimizerConfig("sgd", lr=LR),
                                                     sharding_types=SHARDING_TYPES)
        plan = ShardingPlan({"ebc": explicit_plan(WEIGHTED_MEAN, plans(world), world, sharder)})
        ours = DistributedModelParallel(SparseModel(copy.deepcopy(ebc)), sharders=[sharder], device=CPU, plan=plan)
        tables = {t.name: ebc.embedding_bags[t.name].weight.detach().double().requires_grad_() for t in WEIGHTED_MEAN}
        for step in range(2):
            lengths, values, weights = global_batch(step, batch, WEIGHTED_MEAN, True)
            expected = weighted_means(tables, lengths, values, weights)
            got = ours(to_kjt(keys, lengths, values, weights, start, stop)).values()
            torch.testing.assert_close(got, expected[start:stop].float(), rtol=1e-5, atol=1e-6)
            grad = torch.randn(expected.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(step))
            (expected * grad).sum().div(world).backward()
            with torch.no_grad():
                for table in tables.values():
                    table -= LR * table.grad
                    table.grad = None
            (got * grad[start:stop].float()).sum().backward()
            for s in ours.module.ebc.plan.shards_of(rank):
                torch.testing.assert_close(ours.module.ebc.shard_weights[s.name],
                                           shard_weight(tables[s.table].detach().float(), s), rtol=1e-5, atol=1e-6)


def test_weighted_mean_pooling_and_its_gradient_under_every_plan():
    """Not against stock torchrec: its CPU tables (fbgemm's CPU TBE) pool the same bags but move by weight * g,
    without the / size (a backward that does not match its forward)."""
    run_world(2, weighted_mean_pooling_and_its_gradient, timeout=300)


# ------------------------------------------------------------------------------------------------------------
# TrainPipelineSparseDist

PIPE_TABLES = [
    EmbeddingBagConfig(name="a", embedding_dim=4, num_embeddings=20, feature_names=["fa"]),
    EmbeddingBagConfig(name="b", embedding_dim=8, num_embeddings=30, feature_names=["fb", "fc"]),
]
DENSE_IN = 3


class TinyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.ebc = EmbeddingBagCollection(PIPE_TABLES)
        self.over = nn.Linear(DENSE_IN + 4 + 8 + 8, 1)

    def forward(self, batch: Batch):
        kt = self.ebc(batch.sparse_features)
        logits = self.over(torch.cat([batch.dense_features, kt.values()], dim=1)).squeeze(-1)
        loss = F.binary_cross_entropy_with_logits(logits, batch.labels)
        return loss, (loss.detach(), logits.detach())


def tiny_dmp() -> tuple[DistributedModelParallel, CombinedOptimizer]:
    torch.manual_seed(0)
    sharder = FusedEmbeddingBagCollectionSharder(EmbeddingOptimizerConfig("rowwise_adagrad", lr=0.1))
    dmp = DistributedModelParallel(TinyModel(), sharders=[sharder], device=CPU)
    # Dense parameters only: the tables carry _in_backward_optimizers, as torchrec's fused tables do.
    dense = dict(in_backward_optimizer_filter(dmp.named_parameters()))
    assert sorted(dense) == ["over.bias", "over.weight"]
    dense_opt = KeyedOptimizerWrapper(dense, lambda params: torch.optim.SGD(params, lr=0.1))
    return dmp, CombinedOptimizer([dmp.fused_optimizer, dense_opt])


def tiny_batches(rank: int, world: int, steps: int, batch: int = 6) -> list[Batch]:
    start, stop = local_batch_bounds(batch, rank, world)
    out = []
    for step in range(steps):
        lengths, values, _ = global_batch(step, batch, PIPE_TABLES, False)
        gen = torch.Generator().manual_seed(step)
        dense, labels = torch.randn(batch, DENSE_IN, generator=gen), torch.randint(0, 2, (batch,), generator=gen)
        out.append(Batch(dense_features=dense[start:stop],
                         sparse_features=to_kjt(keys_of(PIPE_TABLES), lengths, values, None, start, stop),
                         labels=labels[start:stop].float()))
    return out


def set_lr(opt: CombinedOptimizer, lr: float) -> None:
    for group in opt.param_groups:  # what an LR scheduler does; the fused tables pick it up at zero_grad/step
        group["lr"] = lr


def pipeline_matches_plain_loop(rank: int, world: int, steps: int) -> None:
    batches = tiny_batches(rank, world, steps)

    plain, plain_opt = tiny_dmp()
    plain_out = []
    for step, batch in enumerate(batches):
        if step == 2:
            set_lr(plain_opt, 0.05)
        plain_opt.zero_grad()
        loss, out = plain(batch)
        loss.backward()
        plain_opt.step()
        plain_out.append(out)

    piped, piped_opt = tiny_dmp()
    pipeline = TrainPipelineSparseDist(piped, piped_opt, CPU)
    it = iter(batches)
    piped_out = []
    for step in range(steps):
        if step == 2:
            set_lr(piped_opt, 0.05)
        piped_out.append(pipeline.progress(it))
    with pytest.raises(StopIteration):
        pipeline.progress(it)
    assert [type(m) for m in pipeline._pipelined_modules] == [FusedShardedEBC]  # it did pipeline our module

    for (loss_a, logits_a), (loss_b, logits_b) in zip(plain_out, piped_out):
        torch.testing.assert_close(loss_a, loss_b)
        torch.testing.assert_close(logits_a, logits_b)
    assert plain_out[0][0] != plain_out[-1][0]  # it trained
    a, b = plain.state_dict(), piped.state_dict()
    assert any(k.startswith("ebc.embedding_bags.") for k in a)
    assert_same_state(a, b, rtol=1.3e-6, atol=1e-5)  # assert_close's float32 defaults
    assert piped.fused_optimizer.param_groups[0]["lr"] == 0.05


def test_train_pipeline_sparse_dist_matches_plain_loop():
    run_world(2, pipeline_matches_plain_loop, 5)


# ------------------------------------------------------------------------------------------------------------
# The embedding optimizer as a torchrec user sets it: fused_params, apply_optimizer_in_backward, neither.

ROWWISE_ADAGRAD, EXACT_SGD = EmbOptimType.EXACT_ROWWISE_ADAGRAD, EmbOptimType.EXACT_SGD

# (set-up, the sharder's optimizer= besides it: None, or the same update)
SETUPS = [
    # RowWiseAdagrad's own default eps (1e-10) is not what stock torchrec runs: fbgemm's (1e-8), where none is given.
    (OptimizerSetup(in_backward={t.name: (RowWiseAdagrad, {"lr": LR}) for t in TABLES}), None),
    # Each table's apply_optimizer_in_backward over the sharder's fused_params: its lr wins, their eps stays.
    (OptimizerSetup(fused_params={"optimizer": ROWWISE_ADAGRAD, "learning_rate": 0.3, "eps": 1e-2},
                    in_backward={t.name: (RowWiseAdagrad, {"lr": LR}) for t in TABLES}),
     EmbeddingOptimizerConfig("rowwise_adagrad", lr=LR, eps=1e-2)),
    (OptimizerSetup(fused_params={"optimizer": EXACT_SGD, "learning_rate": LR, "weight_decay": 0.0}), None),
    (OptimizerSetup(in_backward={t.name: (torch.optim.SGD, {"lr": LR}) for t in TABLES}), None),
    # Nothing said: stock torchrec's FUSED kernel runs fbgemm's defaults (exact SGD, lr 0.01).
    (OptimizerSetup(), None),
    # Each table its own (stock torchrec: a TBE per setting): row-wise Adagrad for the row blocks of t0 and the
    # column shards of t2 (at its own lr and eps), SGD for the table-wise t1 and, through fused_params, t3's blocks.
    (OptimizerSetup(fused_params={"optimizer": EXACT_SGD, "learning_rate": 0.02},
                    in_backward={"t0": (RowWiseAdagrad, {"lr": LR}), "t1": (torch.optim.SGD, {"lr": 0.2}),
                                 "t2": (RowWiseAdagrad, {"lr": 0.1, "eps": 1e-2})}), None),
    # Only t3 set (row-wise Adagrad), the others fbgemm's default; ours given per table besides, the same.
    (OptimizerSetup(in_backward={"t3": (RowWiseAdagrad, {"lr": 0.1})}),
     {**{t.name: EmbeddingOptimizerConfig("sgd", lr=0.01) for t in TABLES},
      "t3": EmbeddingOptimizerConfig("rowwise_adagrad", lr=0.1)}),
]


def optimizer_setups_match_stock_torchrec(rank: int, world: int) -> None:
    """Each set-up trains ours as it trains stock torchrec (table-wise, column-wise and row-wise tables), through
    what torchrec users do with DMP's fused_optimizer: an LR scheduler over it (LambdaLR), one step's hyper-parameter
    set through update_hyper_parameters; outputs, tables after every step, optimizer state and the param groups'
    lrs agree to fp32's rounding (rtol 1e-5, atol 1e-6: both update in fp32, stock torchrec's lr an fp32
    tensor)."""
    set_gradient_division(True)
    keys, dims = keys_of(TABLES), [t.embedding_dim for t in TABLES for _ in t.feature_names]
    batch = 8  # stock torchrec's CPU row-wise needs equal local batches on gloo
    start, stop = local_batch_bounds(batch, rank, world)
    for setup, optimizer in SETUPS:
        torch.manual_seed(0)
        reference = EmbeddingBagCollection(TABLES)
        sharder = FusedEmbeddingBagCollectionSharder(optimizer, sharding_types=SHARDING_TYPES,
                                                     fused_params=setup.fused_params)
        module_plan = explicit_plan(TABLES, mixed_plans(world), world, sharder)
        ours = DistributedModelParallel(setup.model(reference), sharders=[sharder], device=CPU,
                                        plan=ShardingPlan({"ebc": module_plan}))
        stock = stock_torchrec(reference, module_plan, setup)
        models = (ours, stock)
        schedulers = [torch.optim.lr_scheduler.LambdaLR(m.fused_optimizer, lambda step: 0.5 ** step) for m in models]
        for step in range(3):
            if step == 1:  # this step's backward only: the next step() puts param_groups' lr back, as fbgemm's does
                for m in models:
                    m.fused_optimizer.update_hyper_parameters({"lr": 4 * LR})
            lengths, values, _ = global_batch(step, batch, TABLES, False)
            got, got_stock = (m(to_kjt(keys, lengths, values, None, start, stop)) for m in models)
            for key, value in got_stock.to_dict().items():
                torch.testing.assert_close(got.to_dict()[key], value, rtol=1e-5, atol=1e-6)
            grad = torch.randn((batch, sum(dims)), generator=torch.Generator().manual_seed(step))[start:stop]
            for m, out in zip(models, (got, got_stock)):
                dot_by_key(out, dict(zip(keys, torch.split(grad, dims, dim=1)))).backward()
                m.fused_optimizer.step()
            for scheduler in schedulers:
                scheduler.step()
            assert_tables_match_stock(ours.module.ebc, stock, rank)
        assert_optimizer_state_matches_stock(ours, stock)
        # A param group per setting (stock torchrec: per setting and sharding type), each group's lr scheduled.
        lrs = [sorted({g["lr"] for g in m.fused_optimizer.param_groups}) for m in models]
        assert len(lrs[0]) == len(lrs[1]) == len({c.lr for c in ours.module.ebc._lookup.optimizer.configs.values()})
        torch.testing.assert_close(lrs[0], lrs[1])


def test_torchrec_optimizer_setups_match_stock_torchrec():
    run_world(2, optimizer_setups_match_stock_torchrec, timeout=600)


def shard_one_rank(sharder: FusedEmbeddingBagCollectionSharder, ebc: EmbeddingBagCollection) -> FusedShardedEBC:
    return sharder.shard(ebc, {t.name: tw(0) for t in ebc.embedding_bag_configs()}, ShardingEnv.from_local(1, 0), CPU)


def every_table(config: EmbeddingOptimizerConfig) -> dict[str, EmbeddingOptimizerConfig]:
    return {t.name: config for t in TABLES}


def test_the_optimizer_torchrec_settings_give():
    """fused_params and apply_optimizer_in_backward (this one wins per table) become each table's config; an
    optimizer= (for all tables or per table) that runs the same update may be given besides; neither: fbgemm's
    defaults, as stock torchrec."""
    def optimizer_of(setup: OptimizerSetup, optimizer=None) -> dict[str, EmbeddingOptimizerConfig]:
        sharder = FusedEmbeddingBagCollectionSharder(optimizer, fused_params=setup.fused_params)
        return dict(shard_one_rank(sharder, setup.model(EmbeddingBagCollection(TABLES)).ebc)._lookup.optimizer.configs)

    every = {t.name: (RowWiseAdagrad, {"lr": 0.2}) for t in TABLES}
    assert optimizer_of(OptimizerSetup()) == every_table(EmbeddingOptimizerConfig("sgd", lr=0.01, eps=1e-8))
    assert optimizer_of(OptimizerSetup(in_backward=every)) == every_table(
        EmbeddingOptimizerConfig("rowwise_adagrad", lr=0.2))
    # stochastic_rounding=False: fbgemm's fp16 rows rounded to nearest, as ours are
    assert optimizer_of(OptimizerSetup(fused_params={"optimizer": ROWWISE_ADAGRAD, "eps": 0.5, "learning_rate": 0.7,
                                                     "stochastic_rounding": False},
                                       in_backward=every)) == every_table(
        EmbeddingOptimizerConfig("rowwise_adagrad", 0.2, 0.5))
    sgd = EmbeddingOptimizerConfig("sgd", lr=0.3, eps=0.25)  # SGD has no eps: any agrees
    torch_sgd = OptimizerSetup(in_backward={t.name: (torch.optim.SGD, {"lr": 0.3, "momentum": 0.0}) for t in TABLES})
    assert optimizer_of(torch_sgd, sgd) == every_table(sgd)
    ours = EmbeddingOptimizerConfig("rowwise_adagrad", lr=0.05)
    assert optimizer_of(OptimizerSetup(), ours) == every_table(ours)  # torchrec's settings say nothing: ours as it is
    # fused_params of settings at no effect alone (fp16 rows rounded to nearest, ...) say nothing of the update either
    neutral = OptimizerSetup(fused_params={"stochastic_rounding": False, "weight_decay": 0.0,
                                           "output_dtype": DataType.FP32})
    assert optimizer_of(neutral, ours) == every_table(ours)

    # Tables of their own: t0 row-wise Adagrad, t2 torch's SGD, the others fused_params' (exact SGD at lr 0.4).
    per_table = OptimizerSetup(fused_params={"learning_rate": 0.4},
                               in_backward={"t0": (RowWiseAdagrad, {"lr": 0.2}), "t2": (torch.optim.SGD, {"lr": 0.1})})
    expected = {"t0": EmbeddingOptimizerConfig("rowwise_adagrad", lr=0.2), "t1": EmbeddingOptimizerConfig("sgd", 0.4),
                "t2": EmbeddingOptimizerConfig("sgd", lr=0.1), "t3": EmbeddingOptimizerConfig("sgd", lr=0.4)}
    assert optimizer_of(per_table) == expected
    assert optimizer_of(per_table, expected) == expected
    # Only t1 set: the others take ours where given, else fbgemm's default.
    t1 = OptimizerSetup(in_backward={"t1": (RowWiseAdagrad, {"lr": 0.3, "eps": 0.1})})
    adagrad = EmbeddingOptimizerConfig("rowwise_adagrad", lr=0.3, eps=0.1)
    assert optimizer_of(t1) == {**every_table(EmbeddingOptimizerConfig("sgd", lr=0.01)), "t1": adagrad}
    assert optimizer_of(t1, {**every_table(ours), "t1": adagrad}) == {**every_table(ours), "t1": adagrad}


def test_optimizer_settings_we_do_not_run_are_refused():
    """Another optimizer, a setting that changes the update, or ours and torchrec's disagreeing: a ValueError naming
    the table and the setting, never another optimizer in their place."""
    def refused(setup: OptimizerSetup, match: str, optimizer=None) -> None:
        with pytest.raises(ValueError, match=match):
            shard_one_rank(FusedEmbeddingBagCollectionSharder(optimizer, fused_params=setup.fused_params),
                           setup.model(EmbeddingBagCollection(TABLES)).ebc)

    rowwise = (RowWiseAdagrad, {"lr": 0.2})
    refused(OptimizerSetup(in_backward={"t1": (torch.optim.Adam, {"lr": 0.1})}),
            r"table 't1': optimizer settings .*: optimizer <EmbOptimType.ADAM: 'adam'> is not supported: "
            r"FusedEmbeddingBagCollectionSharder runs EmbOptimType.EXACT_SGD")
    refused(OptimizerSetup(in_backward={"t2": (torch.optim.AdamW, {"lr": 0.1})}),
            r"table 't2': apply_optimizer_in_backward\(torch.optim.adamw.AdamW\) is not supported")
    refused(OptimizerSetup(in_backward={t.name: (torch.optim.Adagrad, {"lr": 0.1}) for t in TABLES}),
            r"table 't0': .*optimizer <EmbOptimType.EXACT_ADAGRAD: 'exact_adagrad'> is not supported")
    refused(OptimizerSetup(in_backward={"t3": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})}),
            r"table 't3': optimizer settings .*: momentum=0.9 not supported")
    refused(OptimizerSetup(in_backward={"t0": (RowWiseAdagrad, {"lr": 0.1, "weight_decay": 1e-4})}),
            r"table 't0': .*: weight_decay=0.0001 not supported")
    refused(OptimizerSetup(fused_params={"stochastic_rounding": True}),  # fbgemm's default: not what we run
            r"stochastic_rounding=True not supported")
    refused(OptimizerSetup(fused_params={"learning_rate": -0.1}),  # lr 0 is taken, as torch and fbgemm take it
            r"fused_params .*: embedding optimizer lr must be >= 0, got -0.1")
    refused(OptimizerSetup(in_backward={t.name: rowwise for t in TABLES}),
            r"optimizer differs from .*: optimizer=exact SGD \(lr=0.2\) for \['t0', 't1', 't2', 't3'\], theirs: "
            r"exact row-wise Adagrad \(lr=0.2, eps=1e-08\)", EmbeddingOptimizerConfig("sgd", lr=0.2))
    refused(OptimizerSetup(fused_params={"learning_rate": 0.2}),  # fbgemm's default optimizer: exact SGD
            r"optimizer=exact row-wise Adagrad \(lr=0.2, eps=1e-08\) for .*, theirs: exact SGD \(lr=0.2\)",
            EmbeddingOptimizerConfig("rowwise_adagrad", lr=0.2))
    # Per table: only where torchrec's settings say something (t0), and each table named with its own.
    ours = {t.name: EmbeddingOptimizerConfig("sgd", lr=0.2) for t in TABLES}
    refused(OptimizerSetup(in_backward={"t0": rowwise, "t1": (torch.optim.SGD, {"lr": 0.3})}),
            r"optimizer=exact SGD \(lr=0.2\) for \['t0'\], theirs: exact row-wise Adagrad \(lr=0.2, eps=1e-08\); "
            r"optimizer=exact SGD \(lr=0.2\) for \['t1'\], theirs: exact SGD \(lr=0.3\): give one", ours)
    refused(OptimizerSetup(), r"per-table embedding optimizers: no entry for tables \['t3'\] \(the tables",
            {**{k: v for k, v in ours.items() if k != "t3"}, "t9": ours["t0"]})
    with pytest.raises(TypeError, match="optimizer must be an EmbeddingOptimizerConfig, a mapping of table names"):
        FusedEmbeddingBagCollectionSharder({"t0": "sgd"})

    twice = EmbeddingBagCollection(TABLES)
    for _ in range(2):
        apply_optimizer_in_backward(RowWiseAdagrad, [twice.embedding_bags["t2"].weight], {"lr": 0.1})
    with pytest.raises(ValueError, match=r"table 't2': apply_optimizer_in_backward was applied 2 times "
                                         r"\(\['RowWiseAdagrad', 'RowWiseAdagrad'\]\): a table takes one optimizer"):
        shard_one_rank(FusedEmbeddingBagCollectionSharder(), twice)

    # The sharder's fused_params: refused at construction, before any planning.
    with pytest.raises(ValueError, match=r"fused_params .*: optimizer <EmbOptimType.ADAM: 'adam'> is not supported"):
        FusedEmbeddingBagCollectionSharder(fused_params={"optimizer": EmbOptimType.ADAM})
    with pytest.raises(ValueError, match=r"fused_params .*: cache_load_factor=0.2 not supported"):
        FusedEmbeddingBagCollectionSharder(fused_params={"optimizer": EXACT_SGD, "cache_load_factor": 0.2})


def shard_as_planned(constraints: dict, optimizer=None) -> FusedShardedEBC:
    """A one-rank EBC of TABLES sharded by the plan torchrec's planner makes under `constraints`."""
    ebc = EmbeddingBagCollection(TABLES)
    sharder = FusedEmbeddingBagCollectionSharder(optimizer)
    planner = EmbeddingShardingPlanner(topology=Topology(world_size=1, compute_device="cpu"), constraints=constraints)
    return sharder.shard(ebc, planner.plan(ebc, [sharder]).get_plan_for_module(""), ShardingEnv.from_local(1, 0), CPU)


def test_settings_the_plan_carries_are_read_as_stock_torchrec_reads_them():
    """The planner's ParameterConstraints put fbgemm settings into the plan's entries (output_dtype,
    stochastic_rounding, cache_params, bounds_check_mode, ...), which stock torchrec adds to each table's settings
    over the sharder's fused_params and apply_optimizer_in_backward's: what we do not run is refused naming the
    table and the setting, never ignored (an fp16 output asked for and fp32 given); the neutral values are taken,
    and say nothing about the optimizer (ours stands beside them)."""
    refused = [({"t1": ParameterConstraints(output_dtype=DataType.FP16)},
                r"table 't1': .*: output_dtype=<DataType.FP16: 'FP16'> not supported"),
               ({"t2": ParameterConstraints(stochastic_rounding=True)}, r"table 't2': .*: stochastic_rounding=True"),
               ({"t3": ParameterConstraints(cache_params=CacheParams(load_factor=0.2))},
                r"table 't3': .*: cache_load_factor=0.2 not supported"),
               ({"t0": ParameterConstraints(bounds_check_mode=BoundsCheckMode.NONE)},
                r"table 't0': .*: bounds_check_mode=<BoundsCheckMode.NONE: 3> not supported")]
    for constraints, match in refused:
        with pytest.raises(ValueError, match=r"^EmbeddingBagCollection: " + match):
            shard_as_planned(constraints)
    ours = EmbeddingOptimizerConfig("rowwise_adagrad", lr=0.05)
    neutral = {t.name: ParameterConstraints(output_dtype=DataType.FP32, stochastic_rounding=False) for t in TABLES}
    assert dict(shard_as_planned(neutral, ours)._lookup.optimizer.configs) == every_table(ours)


def test_one_mapping_gives_the_tables_of_several_collections_theirs():
    """DMP hands every EmbeddingBagCollection of a model (a two-tower model's query and item towers) to the one
    sharder: its per-table mapping names the tables of all of them, each collection taking its own tables'."""
    query, item = TABLES[:2], TABLES[2:]
    configs = {t.name: EmbeddingOptimizerConfig("sgd" if t in query else "rowwise_adagrad", lr=0.1 * (i + 1))
               for i, t in enumerate(TABLES)}
    sharder = FusedEmbeddingBagCollectionSharder(configs)
    for tables in (query, item):
        sharded = shard_one_rank(sharder, EmbeddingBagCollection(tables))
        assert dict(sharded._lookup.optimizer.configs) == {t.name: configs[t.name] for t in tables}


def test_update_hyper_parameters_takes_lr_and_eps():
    """As fbgemm's TBEs under stock torchrec: lr and eps change every table's next update, param_groups (one per
    setting) stay, and each group's lr comes back to its tables at the next step(); names our optimizers lack are
    refused."""
    adagrad, sgd = EmbeddingOptimizerConfig("rowwise_adagrad", lr=0.1), EmbeddingOptimizerConfig("sgd", lr=0.3)
    sharded = shard_one_rank(FusedEmbeddingBagCollectionSharder({"t0": adagrad, "t1": sgd, "t2": adagrad, "t3": sgd}),
                             EmbeddingBagCollection(TABLES))
    fused, configs = sharded.fused_optimizer, sharded._lookup.optimizer.configs
    fused.update_hyper_parameters({"lr": 0.4, "eps": 0.5})
    assert set(configs.values()) == {EmbeddingOptimizerConfig("rowwise_adagrad", lr=0.4, eps=0.5),
                                     EmbeddingOptimizerConfig("sgd", lr=0.4, eps=0.5)}
    assert [g["lr"] for g in fused.param_groups] == [0.1, 0.3]
    fused.step()
    assert [configs[t].lr for t in ("t0", "t1", "t2", "t3")] == [0.1, 0.3, 0.1, 0.3]
    with pytest.raises(NotImplementedError, match=r"hyper-parameter\(s\) \['beta1'\] is not supported"):
        fused.update_hyper_parameters({"beta1": 0.9, "lr": 0.2})
    assert [configs[t].lr for t in ("t0", "t1", "t2", "t3")] == [0.1, 0.3, 0.1, 0.3]  # nothing set


def test_an_lr_scheduled_from_zero_trains_as_fbgemm_does():
    """An LR warm-up from 0 (LambdaLR) or a decay to 0 sets lr 0 in param_groups, which fbgemm's TBEs take (stock
    torchrec's set_learning_rate): at lr 0 the tables keep their rows (row-wise Adagrad's state still grows, as
    fbgemm's), and the next step's lr moves them. A negative lr is refused."""
    adagrad, sgd = EmbeddingOptimizerConfig("rowwise_adagrad", lr=0.1), EmbeddingOptimizerConfig("sgd", lr=0.3)
    sharded = shard_one_rank(FusedEmbeddingBagCollectionSharder({"t0": adagrad, "t1": sgd, "t2": adagrad, "t3": sgd}),
                             EmbeddingBagCollection(TABLES))
    fused, optimizer = sharded.fused_optimizer, sharded._lookup.optimizer
    scheduler = torch.optim.lr_scheduler.LambdaLR(fused, lambda step: min(1.0, step / 2))
    lengths, values, _ = global_batch(0, 5, TABLES, False)
    kjt = to_kjt(keys_of(TABLES), lengths, values, None, 0, 5)
    for step, factor in enumerate((0.0, 0.5, 1.0)):
        before = {n: t.weight.clone() for n, t in sharded.embedding_bags.items()}
        momentum = {n: m.clone() for n, m in optimizer.momentum.items()}
        fused.zero_grad()
        sharded(kjt).values().pow(2).sum().backward()
        fused.step()
        scheduler.step()
        assert [optimizer.configs[t].lr for t in ("t0", "t1")] == [0.1 * factor, 0.3 * factor]
        for name, table in sharded.embedding_bags.items():
            assert torch.equal(table.weight, before[name]) == (factor == 0.0), (step, name)
        assert all((optimizer.momentum[n] > momentum[n]).any() for n in momentum)
    with pytest.raises(ValueError, match="embedding optimizer lr must be >= 0, got -0.1"):
        fused.update_hyper_parameters({"lr": -0.1})


# ------------------------------------------------------------------------------------------------------------
# One process: sharder surface, plan conversion, errors (no process group: a world of one).


def test_sharder_offers_table_wise_column_wise_and_row_wise_when_asked():
    sharder = FusedEmbeddingBagCollectionSharder(EmbeddingOptimizerConfig())
    assert sharder.module_type is EmbeddingBagCollection
    assert sharder.sharding_types("cpu") == sharder.sharding_types("cuda") == ["table_wise", "column_wise"]
    assert sharder.compute_kernels("table_wise", "cpu") == sharder.compute_kernels("column_wise", "cuda") == ["fused"]
    assert sharder.compute_kernels("row_wise", "cpu") == sharder.compute_kernels("table_row_wise", "cuda") == []
    assert sorted(sharder.shardable_parameters(EmbeddingBagCollection(TABLES))) == ["t0", "t1", "t2", "t3"]
    every = FusedEmbeddingBagCollectionSharder(EmbeddingOptimizerConfig(), sharding_types=SHARDING_TYPES)
    assert every.sharding_types("cuda") == ["table_wise", "column_wise", "row_wise"]
    assert every.compute_kernels("row_wise", "cpu") == ["fused"]
    with pytest.raises(ValueError, match=r"sharding_types \['row_wise', 'data_parallel'\]: expected some of"):
        FusedEmbeddingBagCollectionSharder(EmbeddingOptimizerConfig(), sharding_types=["row_wise", "data_parallel"])


def test_an_embedding_collection_is_refused():
    sharder = FusedEmbeddingBagCollectionSharder(EmbeddingOptimizerConfig())
    ec = EmbeddingCollection([EmbeddingConfig(name="e", embedding_dim=4, num_embeddings=10, feature_names=["x"])])
    message = "shards torchrec's EmbeddingBagCollection only, not EmbeddingCollection: .*EmbeddingCollectionSharder"
    with pytest.raises(TypeError, match=message):
        sharder.shardable_parameters(ec)
    with pytest.raises(TypeError, match=message):
        sharder.shard(ec, {"e": tw(0)}, ShardingEnv.from_local(1, 0), CPU)


def test_tables_sharing_features_are_refused_naming_them():
    """torchrec lets tables share a feature list (output keys '<feature>@<table>'); ours gives a feature one table."""
    tables = [EmbeddingBagConfig(name="a", embedding_dim=4, num_embeddings=10, feature_names=["f0", "f1"]),
              EmbeddingBagConfig(name="b", embedding_dim=4, num_embeddings=20, feature_names=["f0", "f1"]),
              EmbeddingBagConfig(name="c", embedding_dim=4, num_embeddings=30, feature_names=["f2"])]
    with pytest.raises(ValueError, match=r"torchrec's shared features.*: 'f0' feeds tables \['a', 'b'\]; 'f1' feeds "
                                         r"tables \['a', 'b'\]$"):
        FusedEmbeddingBagCollectionSharder(EmbeddingOptimizerConfig()).shard(
            EmbeddingBagCollection(tables), {t.name: tw(0) for t in tables}, ShardingEnv.from_local(1, 0), CPU)


@pytest.mark.parametrize("setting", [{"use_virtual_table": True}, {"enable_embedding_update": True},
                                     {"num_embeddings_post_pruning": 7}, {"total_num_buckets": 2}])
def test_tables_that_are_not_plain_tables_are_refused(setting):
    """torchrec's virtual (key-value) tables, of ids in a virtual space, tables DMP.write() updates (its KV kernels),
    pruned tables (shards of num_embeddings_post_pruning rows, ids remapped) and bucketized ones: refused naming the
    table and the setting, never sharded as a plain table of num_embeddings rows."""
    tables = [TABLES[0], dataclasses.replace(TABLES[1], **setting)]
    name, value = next(iter(setting.items()))
    with pytest.raises(NotImplementedError, match=rf"table t1: {name}={value} is not supported"):
        shard_one_rank(FusedEmbeddingBagCollectionSharder(), EmbeddingBagCollection(tables))


def test_unknown_comm_is_refused():
    with pytest.raises(ValueError, match="comm='nccl' is unknown"):
        FusedEmbeddingBagCollectionSharder(EmbeddingOptimizerConfig(), comm="nccl")


@pytest.mark.parametrize("comm", ["bulk", "fused", FusedCommConfig(wait_timeout_spins=1000, allocation_timeout_s=45.0)])
def test_comm_settings_reach_the_sharded_collection(comm, monkeypatch):
    """comm="fused" builds the exchange with FusedCommConfig's defaults, a FusedCommConfig with its own settings (its
    transport, bounds on the waits); recorded here, then built bulk: the fused exchange needs CUDA."""
    given = []

    def recorded(*args, comm=None, **kwargs):
        given.append(comm)
        return ShardedEmbeddingBagCollection(*args, comm=None, **kwargs)

    monkeypatch.setattr(torchrec_sharder, "ShardedEmbeddingBagCollection", recorded)
    tables = [EmbeddingBagConfig(name="t0", embedding_dim=4, num_embeddings=10, feature_names=["f0"])]
    FusedEmbeddingBagCollectionSharder(EmbeddingOptimizerConfig(), comm=comm).shard(
        EmbeddingBagCollection(tables), {"t0": tw(0)}, ShardingEnv.from_local(1, 0), CPU)
    expected = comm if isinstance(comm, FusedCommConfig) else {"bulk": None, "fused": FusedCommConfig()}[comm]
    assert given == [expected]


def tw(rank: int) -> ParameterSharding:
    return ParameterSharding(sharding_type="table_wise", compute_kernel="fused", ranks=[rank])


def test_plan_conversion_and_its_errors():
    plan = plan_from_torchrec(TABLES, {"t3": tw(0), "t2": tw(1), "t1": tw(1), "t0": tw(0)}, 2)
    assert [(s.table, s.rank, s.col, s.dim, s.name) for s in plan.shards_of(0)] == [("t0", 0, 0, 4, "t0"),
                                                                                   ("t3", 0, 0, 12, "t3")]
    cw = explicit_plan(TABLES, column_wise_plans(2), 2, FusedEmbeddingBagCollectionSharder(EmbeddingOptimizerConfig()))
    plan = plan_from_torchrec(TABLES, cw, 2)
    assert [(s.name, s.rank) for s in plan.shards if s.table == "t2"] == [
        ("t2_cols_0_to_3", 1), ("t2_cols_4_to_7", 0), ("t2_cols_8_to_11", 1), ("t2_cols_12_to_15", 1)]
    good = {t.name: tw(0) for t in TABLES}
    with pytest.raises(ValueError, match="table 't1': sharding type 'table_row_wise' is not supported.*'row_wise'"):
        plan_from_torchrec(TABLES, {**good, "t1": ParameterSharding("table_row_wise", "fused", [0, 1])}, 2)
    with pytest.raises(ValueError, match="table 't2': compute kernel 'dense' is not supported"):
        plan_from_torchrec(TABLES, {**good, "t2": ParameterSharding("table_wise", "dense", [0])}, 2)
    with pytest.raises(ValueError, match="no entry for table 't3'"):
        plan_from_torchrec(TABLES, {k: v for k, v in good.items() if k != "t3"}, 2)
    with pytest.raises(ValueError, match="rank 2 outside a world of 2"):
        plan_from_torchrec(TABLES, {**good, "t0": tw(2)}, 2)
    with pytest.raises(ValueError, match=r"does not have: \['zz'\]"):
        plan_from_torchrec(TABLES, {**good, "zz": tw(0)}, 2)
    with pytest.raises(ValueError, match="'t2': a column-wise entry needs one shard of its sharding_spec per rank"):
        plan_from_torchrec(TABLES, {**good, "t2": ParameterSharding("column_wise", "fused", [0, 1])}, 2)
    shards = cw["t2"].sharding_spec.shards  # columns 8-11 left out, 16-19 past the end
    gap = dataclasses.replace(cw["t2"], sharding_spec=EnumerableShardingSpec(
        [dataclasses.replace(m, shard_offsets=[0, 4 * (i + (i > 1))]) for i, m in enumerate(shards)]))
    with pytest.raises(ValueError, match=r"table 't2': column shards \[\(0, 4\), \(4, 4\), \(12, 4\), \(16, 4\)\]"):
        plan_from_torchrec(TABLES, {**cw, "t2": gap}, 2)


def rw(*blocks: tuple[int, int, int, int]) -> ParameterSharding:
    """A row-wise entry of blocks (rank, first row, rows, columns)."""
    return ParameterSharding("row_wise", "fused", [rank for rank, *_ in blocks], EnumerableShardingSpec(
        [ShardMetadata([row, 0], [rows, dim], f"rank:{rank}/cpu") for rank, row, rows, dim in blocks]))


def test_row_wise_plan_conversion_and_its_errors():
    # torchrec's cut over 4 ranks: t4's 5 rows in 2, 2, 1 and an empty block (dropped); t5's one row in one block
    # and three empty ones: the whole table, on the rank of its block.
    t4 = dataclasses.replace(FIFTH, num_embeddings=5)
    tables = TABLES + [t4, ONE_ROW]
    every = FusedEmbeddingBagCollectionSharder(EmbeddingOptimizerConfig(), sharding_types=SHARDING_TYPES)
    four = explicit_plan(tables, row_wise_plans(4), 4, every)
    assert [list(m.shard_sizes) for m in four["t4"].sharding_spec.shards] == [[2, 8], [2, 8], [1, 8], [0, 8]]
    plan = plan_from_torchrec(tables, four, 4)
    assert [(s.name, s.rank, s.col, s.dim, s.row, s.rows) for s in plan.shards if s.table in ("t4", "t5")] == [
        ("t4_rows_0_to_1", 0, 0, 8, 0, 2), ("t4_rows_2_to_3", 1, 0, 8, 2, 2), ("t4_rows_4_to_4", 2, 0, 8, 4, 1),
        ("t5", 0, 0, 4, 0, None)]
    # Blocks in row order whatever the ranks' order; next to table-wise and column-wise tables.
    cw = explicit_plan(TABLES, column_wise_plans(2), 2, FusedEmbeddingBagCollectionSharder(EmbeddingOptimizerConfig()))
    mixed = {**cw, "t3": rw((1, 150, 150, 12), (0, 0, 150, 12))}
    plan = plan_from_torchrec(TABLES, mixed, 2)
    assert [(s.name, s.rank, s.row, s.rows) for s in plan.shards if s.table == "t3"] == [
        ("t3_rows_0_to_149", 0, 0, 150), ("t3_rows_150_to_299", 1, 150, 150)]
    assert [s.name for s in plan.shards_of(1)] == ["t0", "t2_cols_0_to_3", "t2_cols_8_to_11", "t2_cols_12_to_15",
                                                   "t3_rows_150_to_299"]

    with pytest.raises(ValueError, match=r"table 't3': row blocks \[\(0, 150\), \(160, 140\)\] \(row, rows\) are not "
                                         "two or more that cover its 300 rows"):
        plan_from_torchrec(TABLES, {**cw, "t3": rw((0, 0, 150, 12), (1, 160, 140, 12))}, 2)
    with pytest.raises(ValueError, match=r"table 't3': row blocks \[\(0, 150\)\] \(row, rows\) are not two or more"):
        plan_from_torchrec(TABLES, {**cw, "t3": rw((0, 0, 150, 12), (1, 150, 0, 12))}, 2)
    with pytest.raises(ValueError, match="table 't3': row blocks must hold all 12 columns"):
        plan_from_torchrec(TABLES, {**cw, "t3": rw((0, 0, 150, 12), (1, 150, 150, 6))}, 2)
    with pytest.raises(ValueError, match="'t3': a row-wise entry needs one shard of its sharding_spec per rank"):
        plan_from_torchrec(TABLES, {**cw, "t3": ParameterSharding("row_wise", "fused", [0, 1])}, 2)
    with pytest.raises(ValueError, match="table 't3': rank 2 outside a world of 2"):
        plan_from_torchrec(TABLES, {**cw, "t3": rw((0, 0, 150, 12), (2, 150, 150, 12))}, 2)


def test_one_rank_module_copies_weights_and_matches_unsharded():
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(TABLES)
    sharder = FusedEmbeddingBagCollectionSharder(EmbeddingOptimizerConfig("rowwise_adagrad", lr=LR))
    sharded = sharder.shard(copy.deepcopy(ebc), {t.name: tw(0) for t in TABLES}, ShardingEnv.from_local(1, 0), CPU)
    assert list(sharded.state_dict()) == [f"embedding_bags.{t.name}.weight" for t in TABLES]
    for t in TABLES:
        assert torch.equal(sharded.state_dict()[f"embedding_bags.{t.name}.weight"], ebc.embedding_bags[t.name].weight)
    lengths, values, weights = global_batch(0, 5, TABLES, True)
    kjt = to_kjt(keys_of(TABLES), lengths, values, weights, 0, 5)  # weights: ignored by an unweighted EBC
    torch.testing.assert_close(sharded(kjt).values(), ebc(kjt).values())

    # lr set through the fused optimizer's param_groups reaches the update in backward.
    sharded.fused_optimizer.param_groups[0]["lr"] = 0.5
    sharded.fused_optimizer.zero_grad()
    before = sharded.embedding_bags["t2"].weight.clone()
    sharded(kjt).values().sum().backward()
    moved = (sharded.embedding_bags["t2"].weight - before).abs().max()
    torch.testing.assert_close(moved, torch.tensor(0.5), rtol=1e-4, atol=0)  # Adagrad's first step is ~lr

    with pytest.raises(ValueError, match="weighted .* has no weights"):
        weighted = sharder.shard(EmbeddingBagCollection(SUM_TABLES, is_weighted=True),
                                 {t.name: tw(0) for t in TABLES}, ShardingEnv.from_local(1, 0), CPU)
        weighted(to_kjt(keys_of(TABLES), lengths, values, None, 0, 5))


def test_a_backward_in_eval_mode_updates_the_tables_as_in_training():
    """As stock torchrec's fused tables (fbgemm's TBE updates in its backward whatever the module's mode): eval()
    (dropout off while fine-tuning, say) does not stop the tables from training; no_grad does."""
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(TABLES)
    sharder = FusedEmbeddingBagCollectionSharder(EmbeddingOptimizerConfig("rowwise_adagrad", lr=LR))
    lengths, values, _ = global_batch(0, 5, TABLES, False)
    kjt = to_kjt(keys_of(TABLES), lengths, values, None, 0, 5)
    grad = torch.randn(5, sum(t.embedding_dim * len(t.feature_names) for t in TABLES))
    tables = []
    for training in (True, False):
        sharded = shard_one_rank(sharder, copy.deepcopy(ebc)).train(training)
        with torch.no_grad():
            sharded(kjt)
        (sharded(kjt).values() * grad).sum().backward()
        tables.append({name: bags.weight for name, bags in sharded.embedding_bags.items()})
    for t in TABLES:
        assert not torch.equal(tables[0][t.name], ebc.embedding_bags[t.name].weight), t.name  # training moved it
        torch.testing.assert_close(tables[1][t.name], tables[0][t.name], rtol=0, atol=0, msg=t.name)


def _bad_batch_on_rank_1(rank: int, world: int) -> None:
    ebc = EmbeddingBagCollection(SUM_TABLES, is_weighted=True)
    sharded = FusedShardedEBC(ebc, plan_sharding(SUM_TABLES, world),
                              ShardingEnv.from_process_group(dist.group.WORLD), EmbeddingOptimizerConfig("sgd"))
    keys = keys_of(SUM_TABLES)
    lengths, values, weights = global_batch(0, 6, SUM_TABLES, True)
    start, stop = local_batch_bounds(6, rank, world)
    kjt = to_kjt(keys, lengths, values, weights, start, stop)
    good = sharded(kjt).values().clone()

    no_weights = to_kjt(keys, lengths, values, weights if rank == 0 else None, start, stop)
    with pytest.raises(ValueError, match=r"rank 1: the EmbeddingBagCollection is weighted \(is_weighted=True\) but "
                       r"the KeyedJaggedTensor has no weights" if rank == 1 else
                       r"rank 0: rank\(s\) \[1\] sent KeyedJaggedTensors without per-sample weights"):
        sharded(no_weights)

    # A variable batch size per feature: key 0 without its last sample (and that bag's values).
    per_key = kjt.lengths().view(len(keys), -1)
    end, last = int(per_key[0].sum()), int(per_key[0, -1])
    variable = KeyedJaggedTensor(
        keys=keys, values=torch.cat([kjt.values()[:end - last], kjt.values()[end:]]),
        weights=torch.cat([kjt.weights()[:end - last], kjt.weights()[end:]]),
        lengths=torch.cat([per_key[0, :-1], per_key[1:].reshape(-1)]),
        stride_per_key_per_rank=[[per_key.shape[1] - 1]] + [[per_key.shape[1]]] * (len(keys) - 1))
    with pytest.raises(ValueError, match=r"rank 1: .*a variable batch size per feature" if rank == 1 else
                       r"rank 0: rank\(s\) \[1\] sent KeyedJaggedTensors whose values, lengths or weights disagree"):
        sharded(variable if rank == 1 else kjt)
    torch.testing.assert_close(sharded(kjt).values(), good)  # nothing stayed behind


def test_a_bad_batch_raises_on_every_rank():
    """The weighted EBC's check of its weights and the refusal of a variable batch size per feature ride in the
    input dist's header: every rank raises at that batch (none waits in the header's all-to-all for a rank that
    raised before it), and goes on with the next good one."""
    run_world(2, _bad_batch_on_rank_1, timeout=120)


class PositionWeighted(nn.Module):
    """A FeatureProcessedEmbeddingBagCollection: position weights (parameters) made into the KJT's per-sample
    weights before the weighted EBC."""

    def __init__(self):
        super().__init__()
        self.fp = FeatureProcessedEmbeddingBagCollection(
            EmbeddingBagCollection(SUM_TABLES, is_weighted=True),
            PositionWeightedModuleCollection({f: 10 for f in keys_of(SUM_TABLES)}))

    def forward(self, kjt: KeyedJaggedTensor) -> KeyedTensor:
        return self.fp(kjt)


def _feature_processor_under_our_sharder(rank: int, world: int) -> None:
    torch.manual_seed(0)
    reference = PositionWeighted()
    with torch.no_grad():  # positions weighted unlike each other
        for weight in reference.fp._feature_processors.position_weights.values():
            weight.uniform_(0.5, 1.5)
    # Given only our sharder, DMP shards the EBC inside the FeatureProcessedEmbeddingBagCollection with it.
    dmp = DistributedModelParallel(copy.deepcopy(reference), sharders=[FusedEmbeddingBagCollectionSharder(
        EmbeddingOptimizerConfig("sgd"))], device=CPU)
    assert isinstance(dmp.module.fp._embedding_bag_collection, FusedShardedEBC)
    lengths, values, _ = global_batch(0, 6, SUM_TABLES, False)
    keys, (start, stop) = keys_of(SUM_TABLES), local_batch_bounds(6, rank, world)
    # The position weights' gradient would be lost: refused on every rank, naming the cause.
    with pytest.raises(ValueError, match=rf"rank {rank}: the KeyedJaggedTensor's per-sample weights require grad "
                                         r"\(a feature processor's.*FeatureProcessedEmbeddingBagCollectionSharder"):
        dmp(to_kjt(keys, lengths, values, None, start, stop))
    with torch.no_grad():  # weights made without autograd: pooled as by the unsharded collection
        expected = reference(to_kjt(keys, lengths, values, None, 0, 6)).values()[start:stop]
        torch.testing.assert_close(dmp(to_kjt(keys, lengths, values, None, start, stop)).values(), expected)
    weighted = dmp.module.fp._feature_processors(to_kjt(keys, lengths, values, None, start, stop))
    assert weighted.weights().requires_grad
    with torch.no_grad():  # and weights that require grad where no gradient is made
        torch.testing.assert_close(dmp.module.fp._embedding_bag_collection(weighted).values(), expected)


def test_a_feature_processors_weights_that_need_a_gradient_are_refused():
    """Our lookup passes no gradient to the per-sample weights (stock torchrec's does: a feature processor's
    position weights train), so weights that require grad are refused on every rank, in the input dist's header,
    rather than left untrained."""
    run_world(2, _feature_processor_under_our_sharder, timeout=120)


def test_meta_device_collection_keeps_our_init():
    ebc = EmbeddingBagCollection(TABLES, device=torch.device("meta"))
    sharded = FusedEmbeddingBagCollectionSharder(EmbeddingOptimizerConfig()).shard(
        ebc, {t.name: tw(0) for t in TABLES}, ShardingEnv.from_local(1, 0), CPU)
    for t in TABLES:
        w = sharded.embedding_bags[t.name].weight
        assert w.device == CPU and bool(w.abs().max() <= (1.0 / t.num_embeddings) ** 0.5) and bool(w.abs().sum() > 0)


def test_meta_device_collection_takes_the_configs_init():
    """A meta-device EBC's tables start from their configs' init, as stock torchrec's: U(weight_init_min,
    weight_init_max), or the config's own init_fn."""
    tables = [dataclasses.replace(TABLES[3], weight_init_min=0.5, weight_init_max=0.75, init_fn=None),
              dataclasses.replace(TABLES[2], init_fn=lambda w: torch.nn.init.constant_(w, 0.25))]
    sharded = FusedEmbeddingBagCollectionSharder(EmbeddingOptimizerConfig()).shard(
        EmbeddingBagCollection(tables, device=torch.device("meta")), {t.name: tw(0) for t in tables},
        ShardingEnv.from_local(1, 0), CPU)
    bounded = sharded.embedding_bags["t3"].weight
    assert 0.5 <= bounded.min() and bounded.max() <= 0.75 and bounded.max() > 0.7
    assert torch.equal(sharded.embedding_bags["t2"].weight, torch.full((7, 16), 0.25))


def test_reset_parameters_draws_the_tables_from_their_configs_init_again():
    """As stock torchrec's sharded collection (DMP._reset_parameters calls every module's): the tables go back to
    their configs' init in place, whatever training did to them (the optimizer state stays, as stock's)."""
    tables = [dataclasses.replace(TABLES[3], weight_init_min=0.5, weight_init_max=0.75, init_fn=None),
              dataclasses.replace(TABLES[2], init_fn=lambda w: torch.nn.init.constant_(w, 0.25))]
    sharder = FusedEmbeddingBagCollectionSharder(EmbeddingOptimizerConfig("rowwise_adagrad", lr=LR))
    sharded = shard_one_rank(sharder, EmbeddingBagCollection(tables))
    lengths, values, _ = global_batch(0, 5, tables, False)
    sharded(to_kjt(keys_of(tables), lengths, values, None, 0, 5)).values().sum().backward()
    momentum = {name: m.clone() for name, m in sharded._lookup.optimizer.momentum.items()}
    storage = {name: bags.weight.data_ptr() for name, bags in sharded.embedding_bags.items()}
    DistributedModelParallel._reset_parameters(sharded)
    initialised = shard_one_rank(sharder, EmbeddingBagCollection(tables, device=torch.device("meta")))
    for t in tables:
        assert torch.equal(sharded.embedding_bags[t.name].weight, initialised.embedding_bags[t.name].weight), t.name
        assert sharded.embedding_bags[t.name].weight.data_ptr() == storage[t.name]  # in place: the lookup's tables
    assert torch.equal(sharded.embedding_bags["t2"].weight, torch.full((7, 16), 0.25))
    for name, m in sharded._lookup.optimizer.momentum.items():
        assert torch.equal(m, momentum[name]) and bool(m.sum() > 0)
