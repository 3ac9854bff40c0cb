"""load_checkpoint's refusals, on every rank: a rank that cannot resume must not leave the others in DCP's
collectives."""

from __future__ import annotations

import logging
import os
import re
import shutil
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from world import run_world

from torchrec import EmbeddingBagConfig

from fused_dlrm.dist.env import of_every_rank
from fused_dlrm.sparse import (EmbeddingOptimizerConfig, ShardedEmbeddingBagCollection, TableShardingPlan,
                                plan_sharding)
from fused_dlrm.sparse.plan import Shard
from fused_dlrm.sparse.sharded_ebc import shard_weight
from fused_dlrm.sparse.sharded_state import TablePieces
from fused_dlrm.train.checkpoint import NonFiniteLossError, load_checkpoint, save_checkpoint


def _model_and_optimizer(momentum_sgd: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 1))
    params = model.parameters()
    optimizer = torch.optim.SGD(params, lr=0.1, momentum=0.9) if momentum_sgd else torch.optim.Adam(params)
    model(torch.randn(3, 5)).sum().backward()
    optimizer.step()
    return model, optimizer


def _one_rank_cannot_resume(rank: int, world: int, root: str) -> None:
    save_checkpoint(root, 4, *_model_and_optimizer(momentum_sgd=False))
    # rank 1 resumes under another dense optimizer, rank 0 as saved: both raise the same error
    model, optimizer = _model_and_optimizer(momentum_sgd=rank == 1)
    expected = (r"step_4 holds no \['dense_optimizer\.state\..*momentum_buffer'.*loaded by rank\(s\) \[1\]\): it was "
                r"written with another dense optimizer")
    with pytest.raises(ValueError, match=expected):
        load_checkpoint(root, model, optimizer)


def test_a_rank_that_cannot_resume_stops_every_rank(tmp_path):
    run_world(2, _one_rank_cannot_resume, str(tmp_path), timeout=120)


class _Sharded(nn.Module):
    """A DLRM's parts a checkpoint holds: the tables (the shards this rank holds, and their optimizer's state), a
    dense layer; tables a (10 rows) and b (12 rows) of 4 columns, a whole on rank 0 unless `shards_of_a` says."""

    def __init__(self, shards_of_b: list[Shard], optimizer: str = "rowwise_adagrad",
                 shards_of_a: tuple[Shard, ...] = (Shard("a", 0, 0, 4, "a"),)):
        super().__init__()
        torch.manual_seed(0)
        tables = [EmbeddingBagConfig(name=name, embedding_dim=4, num_embeddings=rows, feature_names=[f"f{name}"])
                  for name, rows in (("a", 10), ("b", 12))]
        plan = TableShardingPlan(2, (*shards_of_a, *shards_of_b))
        self.sparse = ShardedEmbeddingBagCollection(tables, EmbeddingOptimizerConfig(optimizer), plan=plan)
        self.dense = nn.Linear(3, 2)


def _randomise(model: _Sharded, seed: int) -> None:
    """Weights and accumulators as after training: random, other on each rank."""
    gen = torch.Generator().manual_seed(seed)
    optimizer = model.sparse.lookup.optimizer
    for t in [*optimizer.weights.values(), *optimizer.momentum.values()]:
        t.copy_(torch.rand(t.shape, generator=gen))


def _whole(root: str, key: str, size: list[int], step: int = 4) -> torch.Tensor:
    """An entry of checkpoint step_<step> as one tensor, read by torch.distributed.checkpoint on this rank."""
    whole = {key: torch.full(size, float("nan"))}
    dcp.load(whole, checkpoint_id=Path(root, f"step_{step}"))
    return whole[key]


# b cut otherwise on rank 1 (two column shards), and a in row blocks over both ranks (uneven: 6 and 4 rows).
B_IN_COLUMNS = [Shard("b", 1, 0, 2, "b_cols_0_to_1"), Shard("b", 1, 2, 2, "b_cols_2_to_3")]
A_IN_ROWS = (Shard("a", 1, 0, 4, "a_rows_0_to_5", 0, 6), Shard("a", 0, 0, 4, "a_rows_6_to_9", 6, 4))


def _another_plan(rank: int, world: int, root: str) -> None:
    model = _Sharded([Shard("b", 1, 0, 4, "b")], "sgd")
    _randomise(model, rank)
    save_checkpoint(root, 4, model, torch.optim.Adam(model.dense.parameters()), model.sparse.fused_optimizer)
    # SGD: no state but the tables', which reshard: b in column shards, a in row blocks on other ranks
    other = _Sharded(B_IN_COLUMNS, "sgd", A_IN_ROWS)
    assert load_checkpoint(root, other, torch.optim.Adam(other.dense.parameters()), other.sparse.fused_optimizer) == 4
    tables = {"a": _whole(root, "model.sparse.embedding_bags.a.weight", [10, 4]),
              "b": _whole(root, "model.sparse.embedding_bags.b.weight", [12, 4])}
    for s in other.sparse.plan.shards_of(rank):
        assert torch.equal(other.sparse.shard_weights[s.name], shard_weight(tables[s.table], s)), s
    assert {s.table for s in model.sparse.plan.shards_of(rank)} == {"ab"[rank]}  # what each rank saved: its own
    assert torch.equal(tables["ab"[rank]], model.sparse.shard_weights["ab"[rank]])

    # Row-wise Adagrad: a's accumulators (per row) reshard into a's row blocks; b's (one per row of each column
    # shard) do not go to column shards: every rank says so, alike
    model = _Sharded([Shard("b", 1, 0, 4, "b")])
    _randomise(model, rank)
    save_checkpoint(root, 4, model, torch.optim.Adam(model.dense.parameters()), model.sparse.fused_optimizer)
    rows_only = _Sharded([Shard("b", 0, 0, 4, "b")], shards_of_a=A_IN_ROWS)
    load_checkpoint(root, rows_only, torch.optim.Adam(rows_only.dense.parameters()), rows_only.sparse.fused_optimizer)
    momentum = {t: _whole(root, f"embedding_optimizer.state.embedding_bags.{t}.weight.{t}.momentum1", [rows])
                for t, rows in (("a", 10), ("b", 12))}
    for s in rows_only.sparse.plan.shards_of(rank):
        end = None if s.rows is None else s.row + s.rows  # b whole: all its rows
        assert torch.equal(rows_only.sparse.lookup.optimizer.momentum[s.name], momentum[s.table][s.row:end]), s
    columns = _Sharded(B_IN_COLUMNS)
    with pytest.raises(ValueError) as raised:
        load_checkpoint(root, columns, torch.optim.Adam(columns.dense.parameters()), columns.sparse.fused_optimizer)
    messages = of_every_rank(str(raised.value))
    assert messages[0] == messages[1], messages  # not "rank(s) [1] cannot resume" on rank 0
    assert re.fullmatch(r"checkpoint \S+step_4 holds \['embedding_optimizer\.state\.embedding_bags\.b\.weight\.b\."
                        r"momentum1 \[12\] \(this run: \[24\]\)'\]: row-wise Adagrad state written for other column "
                        r"shards of these tables .* resume with the checkpoint's column shards \(DLRM: "
                        r"model\.column_shards; .*", messages[0]), messages[0]


def test_a_checkpoint_reshards_but_row_wise_adagrad_keeps_its_column_shards(tmp_path):
    """The tables' entries are torchrec's global ShardedTensors: a checkpoint of one plan loads under another (rows
    and columns cut otherwise, on other ranks), each shard bit for bit. Row-wise Adagrad's accumulators reshard by
    rows; written for a whole table, they do not load into its column shards (an accumulator per column shard):
    every rank raises the same error, naming them."""
    run_world(2, _another_plan, str(tmp_path), timeout=300)


# Each table its own optimizer: a in row blocks (row-wise Adagrad), b whole on rank 1 (SGD: no state), c in column
# shards (row-wise Adagrad at its own lr and eps).
PER_TABLE = {"a": EmbeddingOptimizerConfig("rowwise_adagrad", lr=0.1), "b": EmbeddingOptimizerConfig("sgd", lr=0.3),
             "c": EmbeddingOptimizerConfig("rowwise_adagrad", lr=0.02, eps=1e-3)}


class _PerTable(nn.Module):
    def __init__(self, optimizers: dict[str, EmbeddingOptimizerConfig]):
        super().__init__()
        tables = [EmbeddingBagConfig(name=name, embedding_dim=4, num_embeddings=rows, feature_names=[f"f{name}"])
                  for name, rows in (("a", 10), ("b", 12), ("c", 9))]
        plan = TableShardingPlan(2, (Shard("a", 0, 0, 4, "a_rows_0_to_4", 0, 5),
                                     Shard("a", 1, 0, 4, "a_rows_5_to_9", 5, 5), Shard("b", 1, 0, 4, "b"),
                                     Shard("c", 0, 0, 2, "c_cols_0_to_1"), Shard("c", 1, 2, 2, "c_cols_2_to_3")))
        self.sparse = ShardedEmbeddingBagCollection(tables, optimizers, plan=plan)
        self.dense = nn.Linear(3, 2)


def _per_table_state_round_trip(rank: int, world: int, root: str) -> None:
    model = _PerTable(PER_TABLE)
    optimizer = model.sparse.lookup.optimizer
    assert sorted(optimizer.momentum) == [["a_rows_0_to_4", "c_cols_0_to_1"], ["a_rows_5_to_9", "c_cols_2_to_3"]][rank]
    gen = torch.Generator().manual_seed(rank)
    for t in [*optimizer.weights.values(), *optimizer.momentum.values()]:  # as after training
        t.copy_(torch.rand(t.shape, generator=gen))
    save_checkpoint(root, 3, model, torch.optim.Adam(model.dense.parameters()), model.sparse.fused_optimizer)
    other = _PerTable(PER_TABLE)
    assert load_checkpoint(root, other, torch.optim.Adam(other.dense.parameters()), other.sparse.fused_optimizer) == 3
    for name, w in optimizer.weights.items():
        assert torch.equal(other.sparse.lookup.optimizer.weights[name], w), name
    for name, m in optimizer.momentum.items():
        assert torch.equal(other.sparse.lookup.optimizer.momentum[name], m), name
    # b under row-wise Adagrad: its state is not in the checkpoint, which every rank says
    changed = _PerTable({**PER_TABLE, "b": EmbeddingOptimizerConfig("rowwise_adagrad")})
    with pytest.raises(ValueError, match=r"step_3 holds no \['embedding_optimizer\.state\.embedding_bags\.b\.weight\.b\."
                                         r"momentum1'\] \(1 of the embedding optimizer's 3 entries, loaded by rank\(s\) "
                                         r"\[1\]\): it was written with another embedding optimizer"):
        load_checkpoint(root, changed, torch.optim.Adam(changed.dense.parameters()), changed.sparse.fused_optimizer)


def test_per_table_optimizer_state_round_trips(tmp_path):
    """Per-table optimizers over row blocks and column shards: the Adagrad tables' state (and only theirs) is saved
    and restored on each rank; a resume that gives a table another optimizer raises on every rank."""
    run_world(2, _per_table_state_round_trip, str(tmp_path), timeout=120)


# A world of one's cut tables (a in row blocks of 5 and 5 rows, c in column shards, b whole), and a plan of two ranks
# for its checkpoint: a in row blocks of 7 and 3 rows on swapped ranks, b in row blocks, c's column shards (row-wise
# Adagrad's: the same cuts) on swapped ranks.
ROWS = {"a": 10, "b": 12, "c": 9}
TWO_RANKS = TableShardingPlan(2, (
    Shard("a", 1, 0, 4, "a_rows_0_to_6", 0, 7), Shard("a", 0, 0, 4, "a_rows_7_to_9", 7, 3),
    Shard("b", 0, 0, 4, "b_rows_0_to_6", 0, 7), Shard("b", 1, 0, 4, "b_rows_7_to_11", 7, 5),
    Shard("c", 1, 0, 2, "c_cols_0_to_1"), Shard("c", 0, 2, 2, "c_cols_2_to_3")))


def _cut(plan: TableShardingPlan | None = None, rows: dict[str, int] = ROWS, dim: int = 4,
         device: str = "cpu") -> nn.Module:
    """Tables a, b, c of `rows` and `dim` columns (row-wise Adagrad) under `plan`; None: a world of one's, a in two
    row blocks and c in two column shards."""
    tables = [EmbeddingBagConfig(name=name, embedding_dim=dim, num_embeddings=n, feature_names=[f"f{name}"])
              for name, n in rows.items()]
    model = nn.Module()
    model.sparse = ShardedEmbeddingBagCollection(tables, EmbeddingOptimizerConfig("rowwise_adagrad", lr=0.1),
                                                 plan=plan or plan_sharding(tables, 1, column_shards={"c": 2},
                                                                            row_shards={"a": 2}), device=device)
    model.dense = nn.Linear(3, 2)
    return model


def _save(root, step: int, model: nn.Module) -> None:
    save_checkpoint(root, step, model, torch.optim.Adam(model.dense.parameters()), model.sparse.fused_optimizer)


def _load(root, model: nn.Module) -> int:
    return load_checkpoint(root, model, torch.optim.Adam(model.dense.parameters()), model.sparse.fused_optimizer)


class _Made(TorchDispatchMode):
    """Records the shape of every tensor that the ops run under it make, those of a tensor subclass's own
    dispatch too (an op on a subclass goes to it first: its ops then run under this mode)."""

    def __init__(self):
        super().__init__()
        self.shapes: list[list[int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(t is not torch.Tensor for t in types):
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        self.shapes += [list(t.shape) for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        return out


def _assert_holds(model: nn.Module, rank: int, root: str, step: int) -> None:
    """Each of `model`'s shards on this rank holds its rows and columns of checkpoint step_<step> (each entry read
    whole by DCP, on every rank alike) bit for bit, and its accumulators theirs (torchrec's layout: by row, or a
    column shard's rows at its place in column order)."""
    plan, momentum = model.sparse.plan, model.sparse.lookup.optimizer.momentum
    for table, rows in ROWS.items():
        cuts = [c for c in plan.shards if c.table == table]
        columns = len(cuts) if cuts[0].rows is None else 1
        weight = _whole(root, f"model.sparse.embedding_bags.{table}.weight", [rows, 4], step)
        saved = _whole(root, f"embedding_optimizer.state.embedding_bags.{table}.weight.{table}.momentum1",
                       [rows * columns], step)
        for s in (c for c in cuts if c.rank == rank):
            assert torch.equal(model.sparse.shard_weights[s.name], shard_weight(weight, s)), s
            start = s.row if columns == 1 else cuts.index(s) * rows
            assert torch.equal(momentum[s.name], saved[start:start + momentum[s.name].numel()]), s


def _two_ranks_load_and_save(rank: int, world: int, root: str) -> None:
    model = _cut(TWO_RANKS)
    assert _load(root, model) == 3
    _assert_holds(model, rank, root, 3)
    _randomise(model, 10 + rank)
    _save(root, 5, model)
    _assert_holds(model, rank, root, 5)  # what it saved: its own


def test_a_world_of_one_keeps_no_copy_of_its_cut_tables(tmp_path):
    """Without a process group a cut table's entry is the whole table's, yet no copy of it: the fused optimizer's
    keys are held for the whole run (a one-GPU run of the paper's tables in row blocks would hold every table
    twice), and a checkpoint's save and load must not make one either (a table's memory again, per cut table, on
    its GPU). Its checkpoint resumes in a world of one and under two ranks' plan, and theirs in a world of one."""
    model = _cut()
    storage = {w.data_ptr() for w in model.sparse.shard_weights.values()}
    params = model.sparse.fused_optimizer.params
    assert sorted(params) == [f"embedding_bags.{t}.weight" for t in "abc"]
    held = [t for p in params.values() for t in (p.pieces.values() if isinstance(p, TablePieces) else [p])]
    assert len(held) == 5 and all(t.data_ptr() in storage for t in held), "a copy of a table held for the run"
    _randomise(model, 0)
    other = _cut()
    cut_tables = [[ROWS["a"], 4], [ROWS["c"], 4]]
    with _Made() as made:
        _save(tmp_path, 3, model)
        assert _load(tmp_path, other) == 3
    assert not [shape for shape in made.shapes if shape in cut_tables], "a copy of a cut table"
    _assert_holds(model, 0, tmp_path, 3)  # what it saved: its own
    _assert_holds(other, 0, tmp_path, 3)
    run_world(2, _two_ranks_load_and_save, str(tmp_path), timeout=300)
    with _Made() as made:
        assert _load(tmp_path, other) == 5
    assert not [shape for shape in made.shapes if shape in cut_tables], "a copy of a cut table"
    _assert_holds(other, 0, tmp_path, 5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_one_gpu_checkpoint_of_cut_tables_takes_no_gpu_memory_of_their_size(tmp_path):
    """On a GPU: saving and loading two cut tables of 256 MiB each (a in row blocks, c in column shards) allocates
    no GPU memory of a table's size (a copy of each there made the save's peak twice the cut tables before)."""
    rows = {"a": 1 << 20, "b": 12, "c": 1 << 20}
    model, other = _cut(rows=rows, dim=64, device="cuda"), _cut(rows=rows, dim=64, device="cuda")
    _randomise(model, 0)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    _save(tmp_path, 3, model)
    assert _load(tmp_path, other) == 3
    assert torch.cuda.max_memory_allocated() - before < (1 << 20) * 64 * 4 // 4
    for name, weight in model.sparse.shard_weights.items():
        assert torch.equal(other.sparse.shard_weights[name], weight), name
    for name, momentum in model.sparse.lookup.optimizer.momentum.items():
        assert torch.equal(other.sparse.lookup.optimizer.momentum[name], momentum), name


def _one_rank_lacks_the_checkpoint(rank: int, world: int, root: str) -> None:
    save_checkpoint(root, 4, *_model_and_optimizer(momentum_sgd=False))
    path = f"{root}/step_{4 if rank == 0 else 9}"  # as a path that one node's disk lacks
    expected = (r"rank 0: rank\(s\) \[1\] cannot resume from .*step_4: FileNotFoundError: no checkpoint at .*step_9"
                if rank == 0 else r"no checkpoint at .*step_9")
    with pytest.raises(ValueError if rank == 0 else FileNotFoundError, match=expected):
        load_checkpoint(path, *_model_and_optimizer(momentum_sgd=False))


def test_a_rank_without_the_checkpoint_stops_every_rank(tmp_path):
    run_world(2, _one_rank_lacks_the_checkpoint, str(tmp_path), timeout=120)


def test_resume_restores_model_and_optimizer_state(tmp_path):
    model, optimizer = _model_and_optimizer(momentum_sgd=False)
    save_checkpoint(tmp_path, 4, model, optimizer)
    other, other_optimizer = _model_and_optimizer(momentum_sgd=False)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn_like(p))
    assert load_checkpoint(tmp_path, other, other_optimizer) == 4
    for a, b in zip(model.parameters(), other.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
        state, loaded = optimizer.state[a], other_optimizer.state[b]
        torch.testing.assert_close(state["exp_avg_sq"], loaded["exp_avg_sq"], rtol=0, atol=0)


def _save_fails_on_rank_0(rank: int, world: int, root: str, stage: str) -> None:
    expected = rf"could not {stage} checkpoint .*step_4"
    with pytest.raises(OSError if rank == 0 else ValueError, match=None if rank == 0 else rf"rank\(s\) \[0\] {expected}"):
        save_checkpoint(root, 4, *_model_and_optimizer(momentum_sgd=False))


def test_a_save_that_fails_on_rank_0_stops_every_rank(tmp_path):
    (tmp_path / "root").write_text("")  # the checkpoint root is a file: its step_4.partial cannot be made
    run_world(2, _save_fails_on_rank_0, str(tmp_path / "root"), "start", timeout=120)
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "step_4").write_text("")  # a file where the finished checkpoint goes
    run_world(2, _save_fails_on_rank_0, str(tmp_path / "ckpt"), "finish", timeout=120)
    assert (tmp_path / "ckpt" / "step_4.partial" / ".metadata").exists()  # written, not lost


def test_rotation_keeps_stray_files(tmp_path):
    (tmp_path / "step_1").write_text("notes")  # not a checkpoint: neither pruned nor the latest
    save_checkpoint(tmp_path, 4, *_model_and_optimizer(momentum_sgd=False), keep_last=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_1", "step_4"]
    assert load_checkpoint(tmp_path, *_model_and_optimizer(momentum_sgd=False)) == 4


def test_a_save_removes_a_crash_s_partial_folders(tmp_path):
    for stale in ("step_2.partial", "step_9.partial"):  # a crashed save's leftovers
        (tmp_path / stale).mkdir()
        (tmp_path / stale / "__0_0.distcp").write_text("")
    save_checkpoint(tmp_path, 4, *_model_and_optimizer(momentum_sgd=False))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_4"]


def _a_root_rank_0_cannot_see(rank: int, world: int, root: str) -> None:
    model = _Sharded([Shard("b", 1, 0, 4, "b")])  # rank 1 writes table b
    _randomise(model, rank)
    _save(f"{root}/a", 2, model)
    # rank 1's root another folder: as a checkpoint_dir on each node's own disk, rank 1's files where rank 0's
    # finished checkpoint never sees them
    with pytest.raises(ValueError, match=r"step_4\.partial lacks \['__1_0\.distcp'\] .*: trainer\.checkpoint_dir "
                                         r"must be one folder that every rank sees"):
        _save(f"{root}/{'ab'[rank]}", 4, model)
    if rank == 0:  # not taken for a checkpoint, nor its pruning run: the last complete one stays the latest
        assert sorted(p.name for p in Path(root, "a").iterdir()) == ["step_2", "step_4.partial"]
    dist.barrier()
    assert _load(f"{root}/a", _Sharded([Shard("b", 1, 0, 4, "b")])) == 2


def test_a_checkpoint_with_files_rank_0_cannot_see_is_not_finished(tmp_path):
    """A checkpoint_dir that is not shared (each node's own disk): DCP writes every rank's files into that rank's
    view of step_N.partial and only rank 0's metadata names them all; the folder rank 0 renames must hold them."""
    run_world(2, _a_root_rank_0_cannot_see, str(tmp_path), timeout=120)


def _roots_that_differ(rank: int, world: int, root: str) -> None:
    model, optimizer = _model_and_optimizer(momentum_sgd=False)
    for step in (2, 4):
        save_checkpoint(f"{root}/a", step, model, optimizer)
    if rank == 0:  # as another node's copy of the root, lagging behind
        shutil.copytree(f"{root}/a", f"{root}/b")
        shutil.rmtree(f"{root}/b/step_4")
    dist.barrier()
    with pytest.raises(ValueError, match=r"different checkpoints under .*/[ab]: step_4 on rank\(s\) \[0\]; step_2 on "
                                         r"rank\(s\) \[1\]"):
        load_checkpoint(f"{root}/{'ab'[rank]}", *_model_and_optimizer(momentum_sgd=False))


def test_ranks_that_find_different_latest_checkpoints_stop(tmp_path):
    run_world(2, _roots_that_differ, str(tmp_path), timeout=120)


def _a_shard_is_truncated(rank: int, world: int, root: str) -> None:
    model, optimizer = _model_and_optimizer(momentum_sgd=False)
    for step in (2, 4):
        save_checkpoint(root, step, model, optimizer)
    if rank == 0:
        shard = max(Path(root, "step_4").glob("*.distcp"), key=lambda p: p.stat().st_size)
        os.truncate(shard, shard.stat().st_size // 2)
    dist.barrier()
    with pytest.raises(ValueError, match=r"checkpoint .*step_4 cannot be read \(rank \d: .*truncated or corrupt; "
                                         r"resume from an earlier checkpoint \(step_2 under "):
        load_checkpoint(root, *_model_and_optimizer(momentum_sgd=False))


def test_a_truncated_shard_names_the_checkpoint_on_every_rank(tmp_path):
    run_world(2, _a_shard_is_truncated, str(tmp_path), timeout=120)


def test_a_truncated_metadata_file_names_the_checkpoint(tmp_path):
    """A .metadata cut short (a copy of the folder interrupted) raised pickle's "pickle data was truncated", naming
    no checkpoint in a run of one process (its peers named it as rank 0's problem)."""
    model, optimizer = _model_and_optimizer(momentum_sgd=False)
    for step in (2, 4):
        save_checkpoint(tmp_path, step, model, optimizer)
    metadata = tmp_path / "step_4" / ".metadata"
    os.truncate(metadata, metadata.stat().st_size // 2)
    with pytest.raises(ValueError, match=r"checkpoint \S+step_4 cannot be read \(UnpicklingError: .*\): a file of "
                                         r"it is truncated or corrupt; resume from an earlier checkpoint \(step_2 "
                                         r"under "):
        load_checkpoint(tmp_path, *_model_and_optimizer(momentum_sgd=False))


def test_a_shard_cut_short_before_its_run_record_names_the_checkpoint(tmp_path):
    """A shard cut short before the run's record (read before the tables, to check the run) raised DCP's
    CheckpointException, a traceback of its reader ending in "EOFError: Ran out of input", naming no checkpoint."""
    model, optimizer = _model_and_optimizer(momentum_sgd=False)
    for step in (2, 4):
        save_checkpoint(tmp_path, step, model, optimizer, global_batch_size=8)
    for shard in (tmp_path / "step_4").glob("*.distcp"):
        os.truncate(shard, 16)
    with pytest.raises(ValueError, match=r"checkpoint \S+step_4 cannot be read \(\w+Error: .*\): a file of it is "
                                         r"truncated or corrupt; resume from an earlier checkpoint \(step_2 under "):
        load_checkpoint(tmp_path, *_model_and_optimizer(momentum_sgd=False), global_batch_size=8)


def _one_rank_diverged(rank: int, world: int, root: str) -> None:
    model, optimizer = _model_and_optimizer(momentum_sgd=True)
    save_checkpoint(root, 2, model, optimizer)
    expected = r"NaN or inf by step 4 .*without writing step_4\. Last good checkpoint: .*step_2"
    if rank == 1:  # the step's update diverged on one rank's momentum: every rank stops
        next(iter(optimizer.state.values()))["momentum_buffer"][0] = float("nan")
    with pytest.raises(NonFiniteLossError, match=expected):
        save_checkpoint(root, 4, model, optimizer, keep_last=1)
    model = _Sharded([Shard("b", 1, 0, 4, "b")])
    if rank == 1:  # one row of a table's row-wise Adagrad state, in a ShardedTensor
        model.sparse.lookup.optimizer.momentum["b"][3] = float("inf")
    with pytest.raises(NonFiniteLossError, match=expected):
        save_checkpoint(root, 4, model, torch.optim.Adam(model.dense.parameters()), model.sparse.fused_optimizer,
                        keep_last=1)
    assert sorted(p.name for p in Path(root).iterdir()) == ["step_2"]  # nothing written, nothing pruned


def test_a_diverged_update_stops_every_rank_before_the_checkpoint(tmp_path):
    run_world(2, _one_rank_diverged, str(tmp_path), timeout=120)


def test_resume_keeps_the_configured_dense_optimizer_options(tmp_path, caplog):
    model, optimizer = _model_and_optimizer(momentum_sgd=False)  # Adam, lr 0.001
    save_checkpoint(tmp_path, 4, model, optimizer)
    other = _model_and_optimizer(momentum_sgd=False)[0]
    other.zero_grad(set_to_none=True)  # as a new run's: get_state_dict then makes the optimizer's state
    resumed = torch.optim.Adam(other.parameters(), lr=0.01, weight_decay=0.1)  # this run's config
    with caplog.at_level(logging.INFO):
        load_checkpoint(tmp_path, other, resumed)
    assert {key: resumed.param_groups[0][key] for key in ("lr", "weight_decay")} == {"lr": 0.01, "weight_decay": 0.1}
    torch.testing.assert_close(resumed.state[next(other.parameters())]["exp_avg"],
                               optimizer.state[next(model.parameters())]["exp_avg"], rtol=0, atol=0)
    assert "keeps this run's lr=0.01 (checkpoint: 0.001), weight_decay=0.1 (checkpoint: 0)" in caplog.text
    other.zero_grad(set_to_none=True)
    with pytest.raises(ValueError, match=r"dense optimizer Adam, this run's is AdamW: it was written with another "
                                         r"dense optimizer"):
        load_checkpoint(tmp_path, other, torch.optim.AdamW(other.parameters()))


def test_a_scheduled_lr_resumes_as_its_configured_base(tmp_path, caplog):
    """A checkpoint written under an lr scheduler holds the last step's lr (here 0.001 x 0.5) and the configured
    base as initial_lr: a resume with the same config changed nothing (it said "keeps this run's lr=0.001
    (checkpoint: 0.0005)"), with another lr it names the two bases; the checkpoint's initial_lr is not kept (the
    resumed run's scheduler, made after loading, takes this run's lr as its base)."""
    model, optimizer = _model_and_optimizer(momentum_sgd=False)  # Adam, lr 0.001
    torch.optim.lr_scheduler.LambdaLR(optimizer, lambda done: 0.5)
    save_checkpoint(tmp_path, 4, model, optimizer)
    for lr, said in ((0.001, ""), (0.01, "keeps this run's lr=0.01 (checkpoint: 0.001)")):
        other = _model_and_optimizer(momentum_sgd=False)[0]
        other.zero_grad(set_to_none=True)
        resumed = torch.optim.Adam(other.parameters(), lr=lr)
        caplog.clear()
        with caplog.at_level(logging.INFO):
            load_checkpoint(tmp_path, other, resumed)
        assert said in caplog.text and ("keeps this run's" in caplog.text) == bool(said), caplog.text
        assert resumed.param_groups[0]["lr"] == lr and "initial_lr" not in resumed.param_groups[0]


def test_a_run_of_one_process_saves_and_resumes_without_a_launch_warning(tmp_path):
    """DCP warns "torch.distributed is disabled, unavailable or uninitialized, assuming the intent is to save in a
    single process" at each save and load without a process group, and at the run's record read by each rank
    alone (no_dist) in a run of two ranks too: meant, but it read as a launch gone wrong."""
    model, optimizer = _model_and_optimizer(momentum_sgd=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        save_checkpoint(tmp_path, 2, model, optimizer, global_batch_size=8)
        load_checkpoint(tmp_path, *_model_and_optimizer(momentum_sgd=False), global_batch_size=8)
    messages = [str(w.message) for w in caught]
    assert not [m for m in messages if "torch.distributed is disabled" in m], messages


def _filters_during_dcp_calls(rank: int, world: int, root: str) -> None:
    filters = warnings.filters
    seen = []
    for name in ("save", "load"):
        real = getattr(dcp, name)

        def spy(*args, real=real, name=name, **kwargs):
            seen.append((name, kwargs.get("no_dist", False), warnings.filters is filters))
            return real(*args, **kwargs)
        setattr(dcp, name, spy)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        filters = warnings.filters  # the list the spies compare with: catch_warnings swapped in this one
        save_checkpoint(root, 2, *_model_and_optimizer(momentum_sgd=False), global_batch_size=8)
        load_checkpoint(root, *_model_and_optimizer(momentum_sgd=False), global_batch_size=8)
    assert not [w for w in caught if "torch.distributed is disabled" in str(w.message)]
    # with a process group only the run record's read on each rank alone (no_dist) warns: only there are the
    # process-wide filters (every thread's) swapped
    assert seen == [("save", False, True), ("load", True, False), ("load", False, True)], seen


def test_a_run_of_two_ranks_filters_warnings_only_around_the_read_that_warns(tmp_path):
    run_world(2, _filters_during_dcp_calls, str(tmp_path), timeout=120)
