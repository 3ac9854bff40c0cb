"""Checkpoints of the fused sharded EBC and of stock torchrec's, through torch.distributed.checkpoint, both ways.

Two gloo processes on the CPU; the tables' rows are not divisible by the world size (TABLES: 10, 57, 7, 300 rows).
A torchrec user's save and load: `dcp.save({"model": dmp.state_dict(), "optimizer":
dmp.fused_optimizer.state_dict()})`, and for a load the same states of the loading model, `dcp.load` into them, then
its load_state_dict. Stock torchrec (its EmbeddingBagCollectionSharder, fbgemm's CPU TBEs, row-wise Adagrad) runs
table-wise and column-wise plans here; ours loads its checkpoint under column-wise and row-wise plans, and stock
torchrec loads ours back. Each shard must hold the checkpoint's rows and columns bit for bit (the checkpoint read
whole by DCP on each rank), and the forward must equal the other model's (float32; a row-wise table sums its
blocks' parts in another order, hence not bit for bit). Row-wise Adagrad's accumulators are per column shard in
torchrec's layout too: they load where the column cuts are the same (here table-wise into row blocks and back).
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torchrec import EmbeddingBagCollection
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.sharding_plan import table_wise
from torchrec.distributed.types import ShardingPlan

from fused_dlrm.data.batching import local_batch_bounds
from fused_dlrm.sparse import EmbeddingOptimizerConfig
from fused_dlrm.sparse.sharded_ebc import shard_weight
from fused_dlrm.sparse.torchrec_sharder import SHARDING_TYPES, FusedEmbeddingBagCollectionSharder, FusedShardedEBC
from bags import global_batch, to_kjt
from test_torchrec_sharder import (CPU, EPS, LR, TABLES, OptimizerSetup, SparseModel, assert_same_state,
                                   column_wise_plans, dot_by_key, explicit_plan, keys_of, local_shard, row_wise_plans,
                                   stock_torchrec)
from world import run_world

ADAGRAD = EmbeddingOptimizerConfig("rowwise_adagrad", lr=LR, eps=EPS)
BATCH = 7  # local batches of 4 and 3


def table_wise_plans(world: int) -> dict:
    """Whole tables, spread over the ranks (t0 on rank 0, t1 on rank 1, ...)."""
    return {t.name: table_wise(rank=i % world, compute_kernel="fused") for i, t in enumerate(TABLES)}


def stock(reference: EmbeddingBagCollection, plans, world: int) -> DistributedModelParallel:
    """Stock torchrec under `plans` (sharding_plan's generators per table), row-wise Adagrad, tables as reference's."""
    module_plan = explicit_plan(TABLES, plans(world), world, EmbeddingBagCollectionSharder())
    return stock_torchrec(reference, module_plan, OptimizerSetup.every_table(ADAGRAD, TABLES))


def ours(reference: EmbeddingBagCollection, plans, world: int) -> DistributedModelParallel:
    sharder = FusedEmbeddingBagCollectionSharder(ADAGRAD, sharding_types=SHARDING_TYPES)
    plan = ShardingPlan({"ebc": explicit_plan(TABLES, plans(world), world, sharder)})
    return DistributedModelParallel(SparseModel(copy.deepcopy(reference)), sharders=[sharder], device=CPU, plan=plan)


def kjt(rank: int, world: int, step: int):
    lengths, values, _ = global_batch(step, BATCH, TABLES, False)
    start, stop = local_batch_bounds(BATCH, rank, world)
    return to_kjt(keys_of(TABLES), lengths, values, None, start, stop)


def train(model: DistributedModelParallel, rank: int, world: int, steps: range) -> None:
    """Steps of a random loss: the tables and their accumulators move away from their start."""
    dims = [t.embedding_dim for t in TABLES for _ in t.feature_names]
    start, stop = local_batch_bounds(BATCH, rank, world)
    for step in steps:
        grad = torch.randn((BATCH, sum(dims)), generator=torch.Generator().manual_seed(100 + step))[start:stop]
        dot_by_key(model(kjt(rank, world, step)), dict(zip(keys_of(TABLES), torch.split(grad, dims, dim=1)))).backward()
        model.fused_optimizer.step()


def save(model: DistributedModelParallel, path: Path) -> None:
    dcp.save({"model": model.state_dict(), "optimizer": model.fused_optimizer.state_dict()}, checkpoint_id=path)


def load(model: DistributedModelParallel, path: Path, optimizer: bool) -> None:
    """The model's tables from `path`, and their accumulators where `optimizer`."""
    state = {"model": model.state_dict()}
    if optimizer:
        state["optimizer"] = model.fused_optimizer.state_dict()
    dcp.load(state, checkpoint_id=path)
    model.load_state_dict(state["model"])
    if optimizer:
        model.fused_optimizer.load_state_dict(state["optimizer"])


def whole(path: Path, key: str, size: list[int]) -> torch.Tensor:
    """An entry of the checkpoint at `path`, read whole by DCP on this rank."""
    state = {key: torch.full(size, float("nan"))}
    dcp.load(state, checkpoint_id=path)
    return state[key]


def saved_tables(path: Path) -> dict[str, torch.Tensor]:
    return {t.name: whole(path, f"model.ebc.embedding_bags.{t.name}.weight", [t.num_embeddings, t.embedding_dim])
            for t in TABLES}


def saved_accumulators(path: Path) -> dict[str, torch.Tensor]:
    """Each table's row-wise Adagrad accumulators of a checkpoint written table-wise or in row blocks."""
    return {t.name: whole(path, f"optimizer.state.ebc.embedding_bags.{t.name}.weight.{t.name}.momentum1",
                          [t.num_embeddings]) for t in TABLES}


def assert_same_forward(a: DistributedModelParallel, b: DistributedModelParallel, rank: int, world: int) -> None:
    with torch.no_grad():
        got, want = a(kjt(rank, world, 50)).to_dict(), b(kjt(rank, world, 50)).to_dict()
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-6)


def assert_ours_hold(model: DistributedModelParallel, rank: int, tables: dict, accumulators: dict | None) -> None:
    """Each shard of ours holds its rows and columns of `tables` bit for bit, and its accumulators those of
    `accumulators` (by row: row blocks and whole tables)."""
    sharded = model.module.ebc
    assert isinstance(sharded, FusedShardedEBC)
    for s in sharded.plan.shards_of(rank):
        assert torch.equal(sharded.shard_weights[s.name], shard_weight(tables[s.table], s)), s
        if accumulators is not None:
            end = None if s.rows is None else s.row + s.rows
            assert torch.equal(sharded._lookup.optimizer.momentum[s.name], accumulators[s.table][s.row:end]), s


def assert_stock_holds(model: DistributedModelParallel, tables: dict, accumulators: dict | None) -> None:
    """Stock torchrec's shards hold their rows and columns of `tables` bit for bit, and its table-wise tables'
    accumulators those of `accumulators`."""
    for key, value in model.state_dict().items():
        for shard in value.local_shards():
            (row, col), (rows, dim) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
            assert torch.equal(shard.tensor, tables[key.split(".")[2]][row:row + rows, col:col + dim]), key
    for key, value in model.fused_optimizer.state_dict()["state"].items() if accumulators is not None else ():
        table = key.split(".")[2]
        assert torch.equal(local_shard(value[f"{table}.momentum1"], [0]), accumulators[table]), key


def continue_alike(a: DistributedModelParallel, b: DistributedModelParallel, rank: int, world: int) -> None:
    """Two models of the same tables and accumulators: equal forwards, and again after two more steps of each."""
    assert_same_forward(a, b, rank, world)
    for model in (a, b):
        train(model, rank, world, range(2, 4))
    assert_same_forward(a, b, rank, world)


def _both_ways(rank: int, world: int, root: str) -> None:
    torch.manual_seed(0)
    reference, start = EmbeddingBagCollection(TABLES), EmbeddingBagCollection(TABLES)  # random, other weights
    # (a) stock torchrec, table-wise and column-wise, trained and saved; ours loads each under other plans: the
    # tables only, then (last: that run trains on) the accumulators too, where the column cuts are the same
    for stock_plans, our_plans in ((table_wise_plans, (column_wise_plans, row_wise_plans)),
                                   (column_wise_plans, (row_wise_plans, column_wise_plans))):
        theirs = stock(reference, stock_plans, world)
        train(theirs, rank, world, range(2))
        path = Path(root, f"stock_{stock_plans.__name__}")
        save(theirs, path)
        tables = saved_tables(path)
        for plans, optimizer in zip(our_plans, (False, True)):
            mine = ours(start, plans, world)
            load(mine, path, optimizer)
            if stock_plans is table_wise_plans:
                assert_ours_hold(mine, rank, tables, saved_accumulators(path) if optimizer else None)
            else:  # column shards' accumulators: torchrec's [rows x shards], compared as they are
                assert_ours_hold(mine, rank, tables, None)
                if optimizer:
                    assert_same_state(mine.fused_optimizer.state_dict(), theirs.fused_optimizer.state_dict(),
                                              rtol=0, atol=0)
            if optimizer:
                continue_alike(mine, theirs, rank, world)
            else:
                assert_same_forward(mine, theirs, rank, world)

    # (b) ours in row blocks, trained and saved; stock torchrec loads it column-wise (the tables) and table-wise
    # (the accumulators too: row blocks into whole tables)
    mine = ours(start, row_wise_plans, world)
    train(mine, rank, world, range(2))
    path = Path(root, "ours_row_wise")
    save(mine, path)
    tables, accumulators = saved_tables(path), saved_accumulators(path)
    assert_ours_hold(mine, rank, tables, accumulators)  # what it saved: its own shards
    theirs = stock(reference, column_wise_plans, world)
    load(theirs, path, False)
    assert_stock_holds(theirs, tables, None)
    assert_same_forward(theirs, mine, rank, world)
    theirs = stock(reference, table_wise_plans, world)
    load(theirs, path, True)
    assert_stock_holds(theirs, tables, accumulators)
    continue_alike(theirs, mine, rank, world)

    # In memory, without DCP: an unsharded collection's whole tables load into any plan; another plan's
    # ShardedTensors do not (their local shards are other rows and columns): an error, not a misread
    columns = ours(start, column_wise_plans, world)
    columns.load_state_dict({f"ebc.embedding_bags.{name}.weight": table for name, table in tables.items()})
    assert_ours_hold(columns, rank, tables, None)
    with pytest.raises(ValueError, match=r"embedding_bags\.t\d\.weight: the ShardedTensor holds no local shard "
                                         r"of \[\d+, \d+\] at \[\d+, \d+\] on this rank \(it is cut for another plan\)"):
        columns.load_state_dict(mine.state_dict())


def test_checkpoints_move_between_stock_torchrec_and_ours_under_other_plans(tmp_path):
    run_world(2, _both_ways, str(tmp_path), timeout=900)
