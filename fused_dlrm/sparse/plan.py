"""Sharding plan: which rank holds which rows and columns of which table (table-wise, column-wise and row-wise, as in
torchrec).

A table is cut into column shards (one shard of all its columns: table-wise) or into row blocks (row-wise). Each
shard lives on one rank and is a table of its own there: its rows, its columns, its optimizer state (so row-wise
Adagrad keeps one accumulator per row and shard, as torchrec's column-wise sharding does). A rank may hold several
shards, of one table or of several.

Column shards: every rank holding a shard of a table receives the bags of that table's features, and its pooled
columns land at the shard's place in each sample's output row: `FeatureSlice`.

Row blocks: each index goes only to the block holding its row, rebased to the block's first row, as the feature
`<feature>@<block's shard name>` (`RowBlock`); each block pools its part of every bag, and a sample's pooled row is
the sum of its blocks' parts. The parts travel in a wider row: block 0's at the feature's place, the other blocks'
in columns after the real row (`RowWiseColumns`), summed after the output dist (sparse/row_wise.py). So the
output dists, bulk and fused, only ever move columns to one place each.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Mapping, Sequence

from torchrec import EmbeddingBagConfig, PoolingType

from fused_dlrm.config_checks import check_count

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Shard:
    """Columns [col, col + dim) and rows [row, row + rows) of `table`, held by `rank` as a table named `name`."""
    table: str
    rank: int
    col: int
    dim: int
    name: str  # the table's own name when the shard is the whole table, else "<table>_cols_<first>_to_<last>"
    # or "<table>_rows_<first>_to_<last>"
    row: int = 0
    rows: int | None = None  # None: every row; set only on the row blocks of a table cut into two or more

    def num_rows(self, table: EmbeddingBagConfig) -> int:
        return table.num_embeddings if self.rows is None else self.rows

    def feature(self, feature: str) -> str:
        """The name under which this shard receives `feature`'s bags: the feature's own, or its row block's."""
        return feature if self.rows is None else f"{feature}@{self.name}"


@dataclass(frozen=True)
class RowBlock:
    """One row block's share of a feature: indices from `row` up to the next block's first row, sent as feature
    `feature` rebased to 0."""
    feature: str
    row: int


@dataclass(frozen=True)
class RowWiseColumns:
    """Where the parts of a row-wise feature's pooled row travel: block b's at `block_cols[b]` of the wide row
    (block 0's at `col`, its place in the real row); their sum belongs at `col`, divided by the bag size when
    `mean`."""
    feature: str
    col: int
    dim: int
    block_cols: tuple[int, ...]
    mean: bool


@dataclass(frozen=True)
class FeatureSlice:
    """What one rank's lookup pools for one feature: `dim` columns of shard table `table`, which belong at column
    `col` of the output row [all feature dims, in the collection's feature order], or, for a row block after a
    table's first, of the wide row's columns after it (`TableShardingPlan.row_wise_columns`)."""
    feature: str
    table: str
    col: int
    dim: int


def shard_name(table: EmbeddingBagConfig, col: int, dim: int, row: int = 0, rows: int | None = None) -> str:
    if rows is not None:
        return f"{table.name}_rows_{row}_to_{row + rows - 1}"
    if (col, dim) == (0, table.embedding_dim):
        return table.name
    return f"{table.name}_cols_{col}_to_{col + dim - 1}"


def row_block_bounds(rows: int, blocks: int) -> list[tuple[int, int]]:
    """torchrec's row-wise cut: blocks of ceil(rows / blocks) rows, the last one shorter; (first row, rows) of
    each, the empty ones dropped (a table smaller than its block count has fewer)."""
    size = -(-rows // blocks)
    return [(first, min(size, rows - first)) for first in range(0, rows, size)]


@dataclass(frozen=True)
class TableShardingPlan:
    world_size: int
    shards: tuple[Shard, ...]  # in the tables' config order, each table's shards by column (row blocks by row)

    def shards_of(self, rank: int) -> list[Shard]:
        """The shards `rank` holds, in plan order: the order of its lookup's tables and output columns."""
        return [s for s in self.shards if s.rank == rank]

    def check(self, tables: Sequence[EmbeddingBagConfig]) -> None:
        """Raise unless the plan cuts exactly these tables into shards that cover each table's columns (or, row
        blocks, its rows) once, in order, on ranks of the world."""
        _check_unique_names(tables)
        by_name = {t.name: t for t in tables}
        planned = list(dict.fromkeys(s.table for s in self.shards))
        if planned != list(by_name):
            raise ValueError(f"the plan shards tables {planned}, the collection has {list(by_name)} (in that order)")
        for s in self.shards:
            if not 0 <= s.rank < self.world_size:
                raise ValueError(f"table {s.table!r}: shard on rank {s.rank}, outside a world of {self.world_size}")
        for t in tables:
            mine = [s for s in self.shards if s.table == t.name]
            if any(s.rows is not None for s in mine):
                _check_row_blocks(t, mine)
                continue
            cuts = [(s.col, s.dim) for s in mine]
            ends = [0] + [col + dim for col, dim in cuts]
            if [col for col, _ in cuts] != ends[:-1] or ends[-1] != t.embedding_dim or min(d for _, d in cuts) < 1:
                raise ValueError(f"table {t.name!r}: column shards {cuts} (col, dim) do not cover its "
                                 f"{t.embedding_dim} columns once, in order")
        names = [s.name for s in self.shards]
        if len(set(names)) != len(names):
            raise ValueError(f"shard table names collide: {sorted({n for n in names if names.count(n) > 1})}")

    def shard_configs(self, tables: Sequence[EmbeddingBagConfig], rank: int) -> list[EmbeddingBagConfig]:
        """The tables `rank`'s lookup owns: one config per shard (its name, columns and rows; pooling, dtype and
        features of its table). A row block pools its part of each bag by SUM (the mean divides the blocks' sum)
        and reads its row-block features."""
        by_name = {t.name: t for t in tables}
        configs = []
        for s in self.shards_of(rank):
            t = by_name[s.table]
            row_wise = {} if s.rows is None else {"pooling": PoolingType.SUM}
            configs.append(dataclasses.replace(t, name=s.name, embedding_dim=s.dim, num_embeddings=s.num_rows(t),
                                               feature_names=[s.feature(f) for f in t.feature_names], **row_wise))
        return configs

    def feature_slices(self, tables: Sequence[EmbeddingBagConfig]) -> list[list[FeatureSlice]]:
        """Per rank, the slices its lookup pools, in its output column order (shards in plan order, each shard's
        features in config order), at their columns of the wide row (`row_wise_columns`; the real row when no
        table is row-wise). A feature appears once per shard of its table."""
        by_name = {t.name: t for t in tables}
        start = self._feature_starts(tables)
        block_col = {(c.feature, b): col for c in self.row_wise_columns(tables) for b, col in enumerate(c.block_cols)}
        block_of = {s.name: sum(o.table == s.table and o.row < s.row for o in self.shards) for s in self.shards}
        return [[FeatureSlice(s.feature(f), s.name,
                              start[f] + s.col if s.rows is None else block_col[f, block_of[s.name]], s.dim)
                 for s in self.shards_of(r) for f in by_name[s.table].feature_names] for r in range(self.world_size)]

    def row_blocks(self, tables: Sequence[EmbeddingBagConfig]) -> dict[str, list[RowBlock]]:
        """For every feature of a row-wise table, its row blocks in row order (what the input dist cuts its
        bags into); empty when no table is row-wise."""
        blocks = {}
        for t in tables:
            mine = sorted((s for s in self.shards if s.table == t.name and s.rows is not None), key=lambda s: s.row)
            for f in t.feature_names:
                if mine:
                    blocks[f] = [RowBlock(s.feature(f), s.row) for s in mine]
        return blocks

    def row_wise_columns(self, tables: Sequence[EmbeddingBagConfig]) -> list[RowWiseColumns]:
        """Every row-wise feature's columns in the wide row: the real row (all features, config order), then
        the parts of blocks 1, 2, ... of each row-wise feature, in config order."""
        start = self._feature_starts(tables)
        extra = sum(t.embedding_dim * len(t.feature_names) for t in tables)
        columns = []
        for t in tables:
            blocks = sum(s.table == t.name and s.rows is not None for s in self.shards)
            if not blocks:
                continue
            for f in t.feature_names:
                cols = (start[f],) + tuple(extra + t.embedding_dim * b for b in range(blocks - 1))
                extra += t.embedding_dim * (blocks - 1)
                columns.append(RowWiseColumns(f, start[f], t.embedding_dim, cols, t.pooling == PoolingType.MEAN))
        return columns

    @staticmethod
    def _feature_starts(tables: Sequence[EmbeddingBagConfig]) -> dict[str, int]:
        """Each feature's first column in the real output row (config order)."""
        start, offset = {}, 0
        for t in tables:
            for f in t.feature_names:
                start[f], offset = offset, offset + t.embedding_dim
        return start


def _check_unique_names(tables: Sequence[EmbeddingBagConfig]) -> None:
    """Tables are found by name (in a plan, in the optimizers' state): two of one name would be one table."""
    names = [t.name for t in tables]
    if len(set(names)) != len(names):
        raise ValueError(f"table names must be unique, got {names}")


def _check_row_blocks(table: EmbeddingBagConfig, shards: list[Shard]) -> None:
    """Raise unless a row-wise table's shards are two or more blocks of all its columns covering its rows once,
    in order."""
    if any(s.rows is None or (s.col, s.dim) != (0, table.embedding_dim) for s in shards):
        raise ValueError(f"table {table.name!r}: a table is cut into row blocks or into column shards, not both")
    cuts = [(s.row, s.rows) for s in shards]
    ends = [0] + [row + rows for row, rows in cuts]
    if (len(cuts) < 2 or [row for row, _ in cuts] != ends[:-1] or ends[-1] != table.num_embeddings
            or min(rows for _, rows in cuts) < 1):
        raise ValueError(f"table {table.name!r}: row blocks {cuts} (row, rows) are not two or more that cover its "
                         f"{table.num_embeddings} rows once, in order")


def plan_sharding(tables: Sequence[EmbeddingBagConfig], world_size: int,
                  column_shards: int | Mapping[str, int] = 1,
                  row_shards: int | Mapping[str, int] = 1, prefix: str = "") -> TableShardingPlan:
    """Greedy longest-processing-time placement: each table cut into `column_shards` equal column blocks or into
    `row_shards` row blocks (torchrec's: `row_block_bounds`); each an int for every table, or per table name;
    1 and 1: table-wise. Biggest block (rows x columns) first, onto the least loaded rank that holds no other
    block of its table when there is one. prefix: the cuts' config group in the errors (train/build.py: "model."),
    as moe/routing's checks take it.

    Deterministic (ties go to the lower rank), so every rank computes the same plan without communicating.
    A world larger than the shard count is allowed: the extra ranks own nothing and only send and receive.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    _check_unique_names(tables)
    names = [t.name for t in tables]
    for what, cuts in (("column_shards", column_shards), ("row_shards", row_shards)):
        unknown = sorted(set(cuts) - set(names)) if isinstance(cuts, Mapping) else []
        if unknown:
            raise ValueError(f"{prefix}{what} names tables the collection does not have: {unknown}")

    def cut(what: str, cuts: int | Mapping[str, int], table: str) -> tuple[int, str]:
        """The table's cut, and its name in the errors: the argument's, or its entry's (cuts per table)."""
        if isinstance(cuts, Mapping):
            return cuts.get(table, 1), f"{prefix}{what}[{table!r}]"
        return cuts, f"{prefix}{what}"

    blocks = []  # (table, col, dim, row, rows): rows None for every row
    for t in tables:
        (n, n_key), (m, m_key) = cut("column_shards", column_shards, t.name), cut("row_shards", row_shards, t.name)
        for key, value in ((n_key, n), (m_key, m)):
            check_count(key, value, 1, "a whole number >= 1 (1: table-wise)")
        if t.embedding_dim < 1 or t.num_embeddings < 1:  # a plan of such a table would not say so
            raise ValueError(f"table {t.name!r}: {t.num_embeddings} rows x {t.embedding_dim} columns: a table needs "
                             f"at least one of each")
        if t.embedding_dim % n:
            raise ValueError(f"{n_key}={n}: table {t.name!r}: {t.embedding_dim} columns do not split into {n} equal "
                             f"column shards")
        if m > 1 and n > 1:
            raise ValueError(f"{m_key}={m} with {n_key}={n}: a table is cut into row blocks or into column shards, "
                             f"not both")
        rows = row_block_bounds(t.num_embeddings, m)
        if len(rows) > 1:
            blocks += [(t, 0, t.embedding_dim, row, count) for row, count in rows]
        else:
            blocks += [(t, i * t.embedding_dim // n, t.embedding_dim // n, 0, None) for i in range(n)]
    if world_size > len(blocks):
        log.warning("%d ranks for %d table shards: ranks %d..%d own none", world_size, len(blocks), len(blocks),
                    world_size - 1)
    load = [0] * world_size
    holders: dict[str, set[int]] = {name: set() for name in names}
    placed: dict[tuple[str, int, int], int] = {}
    size = lambda b: (b[4] if b[4] is not None else b[0].num_embeddings) * b[2]
    for t, col, dim, row, rows in sorted(blocks, key=lambda b: (-size(b), names.index(b[0].name), b[1], b[3])):
        rank = min(range(world_size), key=lambda r: (r in holders[t.name], load[r], r))
        placed[t.name, col, row] = rank
        holders[t.name].add(rank)
        load[rank] += size((t, col, dim, row, rows))
    plan = TableShardingPlan(world_size, tuple(
        Shard(t.name, placed[t.name, col, row], col, dim, shard_name(t, col, dim, row, rows), row, rows)
        for t, col, dim, row, rows in blocks))
    plan.check(tables)
    return plan
