"""Table-wise sharding plan: every table lives whole on one rank, tables balanced by rows x dim."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Sequence

from torchrec import EmbeddingBagConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TableWisePlan:
    world_size: int
    owner: dict[str, int]  # table name -> rank

    def tables_of(self, rank: int) -> list[str]:
        """Tables of `rank`, in the order they were configured (dict order)."""
        return [name for name, r in self.owner.items() if r == rank]


def plan_table_wise(tables: Sequence[EmbeddingBagConfig], world_size: int) -> TableWisePlan:
    """Greedy longest-processing-time placement: biggest table first, onto the least loaded rank.

    Deterministic (ties go to the lower rank), so every rank computes the same plan without communicating.
    A world larger than the table count is allowed: the extra ranks own nothing and only send and receive.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    names = [t.name for t in tables]
    if len(set(names)) != len(names):
        raise ValueError(f"table names must be unique, got {names}")
    if world_size > len(tables):
        log.warning("%d ranks for %d tables: ranks %d..%d own no table", world_size, len(tables), len(tables),
                    world_size - 1)
    load = [0] * world_size
    placed: dict[str, int] = {}
    for t in sorted(tables, key=lambda t: (-t.num_embeddings * t.embedding_dim, names.index(t.name))):
        rank = min(range(world_size), key=lambda r: (load[r], r))
        placed[t.name] = rank
        load[rank] += t.num_embeddings * t.embedding_dim
    return TableWisePlan(world_size=world_size, owner={name: placed[name] for name in names})
