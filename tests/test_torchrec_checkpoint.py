"""Checkpoints of the fused sharded EBC and of stock torchrec's, through torch.distributed.checkpoint, both ways.

Two gloo processes on the CPU (unless said below); the tables' rows are not divisible by the world size (TABLES:
10, 57, 7, 300 rows).
A torchrec user's save and load: `dcp.save({"model": dmp.state_dict(), "optimizer":
dmp.fused_optimizer.state_dict()})`, and for a load the same states of the loading model, `dcp.load` into them, then
its load_state_dict. Stock torchrec (its EmbeddingBagCollectionSharder, fbgemm's CPU TBEs, row-wise Adagrad) runs
table-wise and column-wise plans here; ours loads its checkpoint under column-wise and row-wise plans, and stock
torchrec loads ours back. Each shard must hold the checkpoint's rows and columns bit for bit (the checkpoint read
whole by DCP on each rank), and the forward must equal the other model's (float32; a row-wise table sums its
blocks' parts in another order, hence not bit for bit). Row-wise Adagrad's accumulators are per column shard in
torchrec's layout too: they load where the column cuts are the same (here table-wise into row blocks and back).

Stock torchrec's row-wise and table-row-wise plans run on the CPU too (with equal local batches: ROW_BATCH): its
row blocks (uneven: 57 rows in 29 + 28) with their accumulators load into our whole tables, ours into its row blocks
(world 2), into its table_row_wise over two hosts of two ranks (world 4), and that back into our row blocks (world
3). The stock model loading the same checkpoint then trains alike.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torchrec import EmbeddingBagCollection
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.sharding_plan import table_row_wise, table_wise
from torchrec.distributed.types import ShardingPlan

from fused_dlrm.data.batching import local_batch_bounds
from fused_dlrm.sparse import EmbeddingOptimizerConfig
from fused_dlrm.sparse.sharded_ebc import shard_weight
from fused_dlrm.sparse.torchrec_sharder import SHARDING_TYPES, FusedEmbeddingBagCollectionSharder, FusedShardedEBC
from bags import global_batch, to_kjt
from test_torchrec_sharder import (CPU, EPS, LR, TABLES, OptimizerSetup, SparseModel, assert_same_state,
                                   column_wise_plans, dot_by_key, explicit_plan, keys_of, row_wise_plans,
                                   stock_torchrec)
from world import run_world

ADAGRAD = EmbeddingOptimizerConfig("rowwise_adagrad", lr=LR, eps=EPS)
BATCH = 7  # local batches of 4 and 3
HOST = 2  # ranks per host of table_row_wise_plans


def table_wise_plans(world: int) -> dict:
    """Whole tables, spread over the ranks (t0 on rank 0, t1 on rank 1, ...)."""
    return {t.name: table_wise(rank=i % world, compute_kernel="fused") for i, t in enumerate(TABLES)}


def table_row_wise_plans(world: int) -> dict:
    """torchrec's table_row_wise over hosts of HOST ranks: t0 and t2 in row blocks over host 0's, t1 and t3 over
    host 1's (on a single host, all in row blocks over its ranks), with the FUSED kernel (its generator takes none,
    and picks DENSE for a weight without an in-backward optimizer, as explicit_plan's meta collection's)."""
    def fused(host: int):
        generator = table_row_wise(host_index=host)
        return lambda *args: dataclasses.replace(generator(*args), compute_kernel="fused")

    return {t.name: fused(i % max(1, world // HOST)) for i, t in enumerate(TABLES)}


def stock(reference: EmbeddingBagCollection, plans, world: int, local_size: int | None = None
          ) -> DistributedModelParallel:
    """Stock torchrec under `plans` (sharding_plan's generators per table), row-wise Adagrad, tables as reference's;
    local_size: ranks per host (explicit_plan's)."""
    module_plan = explicit_plan(TABLES, plans(world), world, EmbeddingBagCollectionSharder(), local_size)
    return stock_torchrec(reference, module_plan, OptimizerSetup.every_table(ADAGRAD, TABLES))


def ours(reference: EmbeddingBagCollection, plans, world: int) -> DistributedModelParallel:
    sharder = FusedEmbeddingBagCollectionSharder(ADAGRAD, sharding_types=SHARDING_TYPES)
    plan = ShardingPlan({"ebc": explicit_plan(TABLES, plans(world), world, sharder)})
    return DistributedModelParallel(SparseModel(copy.deepcopy(reference)), sharders=[sharder], device=CPU, plan=plan)


def kjt(rank: int, world: int, step: int, batch: int):
    lengths, values, _ = global_batch(step, batch, TABLES, False)
    start, stop = local_batch_bounds(batch, rank, world)
    return to_kjt(keys_of(TABLES), lengths, values, None, start, stop)


def train(model: DistributedModelParallel, rank: int, world: int, steps: range, batch: int = BATCH) -> None:
    """Steps of a random loss (global batch `batch`): the tables and their accumulators move away from their start."""
    dims = [t.embedding_dim for t in TABLES for _ in t.feature_names]
    start, stop = local_batch_bounds(batch, rank, world)
    for step in steps:
        grad = torch.randn((batch, sum(dims)), generator=torch.Generator().manual_seed(100 + step))[start:stop]
        grads = dict(zip(keys_of(TABLES), torch.split(grad, dims, dim=1)))
        dot_by_key(model(kjt(rank, world, step, batch)), grads).backward()
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


def assert_same_forward(a: DistributedModelParallel, b: DistributedModelParallel, rank: int, world: int,
                        batch: int = BATCH) -> None:
    with torch.no_grad():
        got, want = a(kjt(rank, world, 50, batch)).to_dict(), b(kjt(rank, world, 50, batch)).to_dict()
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
    """Stock torchrec's shards hold their rows and columns of `tables` bit for bit, and its whole tables' and row
    blocks' accumulators their rows of `accumulators`."""
    for key, value in model.state_dict().items():
        for shard in value.local_shards():
            (row, col), (rows, dim) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
            assert torch.equal(shard.tensor, tables[key.split(".")[2]][row:row + rows, col:col + dim]), key
    held = 0
    for key, value in model.fused_optimizer.state_dict()["state"].items() if accumulators is not None else ():
        table = key.split(".")[2]
        for shard in value[f"{table}.momentum1"].local_shards():
            (row,), (rows,) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
            assert torch.equal(shard.tensor, accumulators[table][row:row + rows]), key
            held += rows
    assert accumulators is None or held > 0  # this rank compared some


def continue_alike(a: DistributedModelParallel, b: DistributedModelParallel, rank: int, world: int,
                   batch: int = BATCH) -> None:
    """Two models of the same tables and accumulators: equal forwards, and again after two more steps of each."""
    assert_same_forward(a, b, rank, world, batch)
    for model in (a, b):
        train(model, rank, world, range(2, 4), batch)
    assert_same_forward(a, b, rank, world, batch)


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


# Stock torchrec's row-wise sharding (fbgemm's block_bucketize over gloo) needs equal local batches: its
# reduce-scatter's gloo all-gather refuses unequal sizes.
ROW_BATCH = {2: 8, 3: 9, 4: 8}


def _stock_row_blocks_and_ours(rank: int, world: int, root: str) -> None:
    """World 2: stock torchrec's row blocks (57 and 7 rows: 29 + 28, 4 + 3) into our whole tables (with the
    accumulators, then trained on) and column shards (the tables); ours whole tables back into stock row blocks."""
    batch = ROW_BATCH[world]
    torch.manual_seed(0)
    reference, start = EmbeddingBagCollection(TABLES), EmbeddingBagCollection(TABLES)  # random, other weights
    theirs = stock(reference, row_wise_plans, world)
    train(theirs, rank, world, range(2), batch)
    path = Path(root, "stock_row_wise")
    save(theirs, path)
    tables, accumulators = saved_tables(path), saved_accumulators(path)
    mine = ours(start, column_wise_plans, world)
    load(mine, path, False)
    assert_ours_hold(mine, rank, tables, None)
    assert_same_forward(mine, theirs, rank, world, batch)
    mine = ours(start, table_wise_plans, world)
    load(mine, path, True)
    assert_ours_hold(mine, rank, tables, accumulators)
    continue_alike(mine, theirs, rank, world, batch)

    path = Path(root, "ours_table_wise")
    save(mine, path)
    tables, accumulators = saved_tables(path), saved_accumulators(path)
    theirs = stock(reference, row_wise_plans, world)
    load(theirs, path, True)
    assert_stock_holds(theirs, tables, accumulators)
    continue_alike(theirs, mine, rank, world, batch)


def _stock_table_row_wise(rank: int, world: int, root: str) -> None:
    """World 4, two hosts of two: stock torchrec's table_row_wise loads ours of world 2 (whole tables into row
    blocks over one host's ranks, with the accumulators), trains on and saves."""
    os.environ.update(LOCAL_WORLD_SIZE=str(HOST), LOCAL_RANK=str(rank % HOST))  # torchrec's hosts: its local groups
    torch.manual_seed(0)
    theirs = stock(EmbeddingBagCollection(TABLES), table_row_wise_plans, world, HOST)
    hosts = {key.split(".")[2]: sorted(m.placement.rank() for m in value.metadata().shards_metadata)
             for key, value in theirs.state_dict().items()}
    assert hosts == {"t0": [0, 1], "t1": [2, 3], "t2": [0, 1], "t3": [2, 3]}  # each table on one host's ranks
    path = Path(root, "ours_table_wise")
    load(theirs, path, True)
    assert_stock_holds(theirs, saved_tables(path), saved_accumulators(path))
    train(theirs, rank, world, range(4, 6), ROW_BATCH[world])
    save(theirs, Path(root, "stock_table_row_wise"))


def _ours_from_stock_table_row_wise(rank: int, world: int, root: str) -> None:
    """World 3: ours in row blocks of its own (10 rows: 4 + 4 + 2; 7: 3 + 3 + 1) loads stock torchrec's
    table_row_wise of world 4 with the accumulators, as stock torchrec's row-wise does; both train on alike."""
    torch.manual_seed(1)
    reference = EmbeddingBagCollection(TABLES)  # random: other weights than the checkpoint's
    path = Path(root, "stock_table_row_wise")
    tables, accumulators = saved_tables(path), saved_accumulators(path)
    mine = ours(reference, row_wise_plans, world)
    load(mine, path, True)
    assert_ours_hold(mine, rank, tables, accumulators)
    theirs = stock(reference, row_wise_plans, world)
    load(theirs, path, True)
    continue_alike(mine, theirs, rank, world, ROW_BATCH[world])


def test_row_wise_checkpoints_move_between_stock_torchrec_and_ours(tmp_path):
    """Stock torchrec's row-wise and table-row-wise checkpoints (row blocks of uneven rows, row-wise Adagrad's
    accumulators by row) load into ours under other plans and world sizes, and ours into them."""
    run_world(2, _stock_row_blocks_and_ours, str(tmp_path), timeout=900)
    run_world(4, _stock_table_row_wise, str(tmp_path), timeout=900)
    run_world(3, _ours_from_stock_table_row_wise, str(tmp_path), timeout=900)
