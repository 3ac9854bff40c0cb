"""Sharding plan: which rank holds which columns of which table (table-wise and column-wise, as in torchrec).

A table is cut into column shards (one shard of all its columns: table-wise). Each shard lives on one rank and
is a table of its own there: its rows, its columns, its optimizer state (so row-wise Adagrad keeps one
accumulator per row and shard, as torchrec's column-wise sharding does). A rank may hold several shards, of one
table or of several. Every rank holding a shard of a table receives the bags of that table's features, and its
pooled columns land at the shard's place in each sample's output row: `FeatureSlice`.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Mapping, Sequence

from torchrec import EmbeddingBagConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Shard:
    """Columns [col, col + dim) of `table`, held by `rank` as a table named `name`."""
    table: str
    rank: int
    col: int
    dim: int
    name: str  # the table's own name when the shard is the whole table, else "<table>_cols_<first>_to_<last>"


@dataclass(frozen=True)
class FeatureSlice:
    """What one rank's lookup pools for one feature: `dim` columns of shard table `table`, which belong at column
    `col` of the output row [all feature dims, in the collection's feature order]."""
    feature: str
    table: str
    col: int
    dim: int


def shard_name(table: EmbeddingBagConfig, col: int, dim: int) -> str:
    if (col, dim) == (0, table.embedding_dim):
        return table.name
    return f"{table.name}_cols_{col}_to_{col + dim - 1}"


@dataclass(frozen=True)
class TableShardingPlan:
    world_size: int
    shards: tuple[Shard, ...]  # in the tables' config order, each table's shards by column

    def shards_of(self, rank: int) -> list[Shard]:
        """The shards `rank` holds, in plan order: the order of its lookup's tables and output columns."""
        return [s for s in self.shards if s.rank == rank]

    def check(self, tables: Sequence[EmbeddingBagConfig]) -> None:
        """Raise unless the plan cuts exactly these tables into shards that cover each table's columns once, in
        order, on ranks of the world."""
        by_name = {t.name: t for t in tables}
        planned = list(dict.fromkeys(s.table for s in self.shards))
        if planned != list(by_name):
            raise ValueError(f"the plan shards tables {planned}, the collection has {list(by_name)} (in that order)")
        for s in self.shards:
            if not 0 <= s.rank < self.world_size:
                raise ValueError(f"table {s.table!r}: shard on rank {s.rank}, outside a world of {self.world_size}")
        for t in tables:
            cuts = [(s.col, s.dim) for s in self.shards if s.table == t.name]
            ends = [0] + [col + dim for col, dim in cuts]
            if [col for col, _ in cuts] != ends[:-1] or ends[-1] != t.embedding_dim or min(d for _, d in cuts) < 1:
                raise ValueError(f"table {t.name!r}: column shards {cuts} (col, dim) do not cover its "
                                 f"{t.embedding_dim} columns once, in order")
        names = [s.name for s in self.shards]
        if len(set(names)) != len(names):
            raise ValueError(f"shard table names collide: {sorted({n for n in names if names.count(n) > 1})}")

    def shard_configs(self, tables: Sequence[EmbeddingBagConfig], rank: int) -> list[EmbeddingBagConfig]:
        """The tables `rank`'s lookup owns: one config per shard (its name and columns; rows, pooling, dtype and
        features of its table)."""
        by_name = {t.name: t for t in tables}
        return [dataclasses.replace(by_name[s.table], name=s.name, embedding_dim=s.dim) for s in self.shards_of(rank)]

    def feature_slices(self, tables: Sequence[EmbeddingBagConfig]) -> list[list[FeatureSlice]]:
        """Per rank, the slices its lookup pools, in its output column order (shards in plan order, each shard's
        features in config order). A feature appears once per shard of its table."""
        by_name = {t.name: t for t in tables}
        start, offset = {}, 0
        for t in tables:
            for f in t.feature_names:
                start[f], offset = offset, offset + t.embedding_dim
        return [[FeatureSlice(f, s.name, start[f] + s.col, s.dim) for s in self.shards_of(r)
                 for f in by_name[s.table].feature_names] for r in range(self.world_size)]


def plan_sharding(tables: Sequence[EmbeddingBagConfig], world_size: int,
                  column_shards: int | Mapping[str, int] = 1) -> TableShardingPlan:
    """Greedy longest-processing-time placement: each table cut into `column_shards` equal column blocks (an int
    for every table, or per table name; 1: table-wise), biggest block first, onto the least loaded rank that holds
    no other block of its table when there is one.

    Deterministic (ties go to the lower rank), so every rank computes the same plan without communicating.
    A world larger than the shard count is allowed: the extra ranks own nothing and only send and receive.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    names = [t.name for t in tables]
    if len(set(names)) != len(names):
        raise ValueError(f"table names must be unique, got {names}")
    per_table = column_shards if isinstance(column_shards, Mapping) else dict.fromkeys(names, column_shards)
    unknown = sorted(set(per_table) - set(names))
    if unknown:
        raise ValueError(f"column_shards names tables the collection does not have: {unknown}")
    blocks = []  # (table, col, dim)
    for t in tables:
        n = per_table.get(t.name, 1)
        if n < 1 or t.embedding_dim % n:
            raise ValueError(f"table {t.name!r}: {t.embedding_dim} columns do not split into {n} equal column shards")
        blocks += [(t, i * t.embedding_dim // n, t.embedding_dim // n) for i in range(n)]
    if world_size > len(blocks):
        log.warning("%d ranks for %d table shards: ranks %d..%d own none", world_size, len(blocks), len(blocks),
                    world_size - 1)
    load = [0] * world_size
    holders: dict[str, set[int]] = {name: set() for name in names}
    placed: dict[tuple[str, int], int] = {}
    for t, col, dim in sorted(blocks, key=lambda b: (-b[0].num_embeddings * b[2], names.index(b[0].name), b[1])):
        rank = min(range(world_size), key=lambda r: (r in holders[t.name], load[r], r))
        placed[t.name, col] = rank
        holders[t.name].add(rank)
        load[rank] += t.num_embeddings * dim
    plan = TableShardingPlan(world_size, tuple(Shard(t.name, placed[t.name, col], col, dim, shard_name(t, col, dim))
                                          for t, col, dim in blocks))
    plan.check(tables)
    return plan
