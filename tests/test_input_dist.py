"""The input dist's device-side pieces: the segment regroup, and the index range check carried in its header."""

from __future__ import annotations

import pytest
import torch

from fused_dlrm.data.batching import local_batch_bounds
from fused_dlrm.sparse import EmbeddingOptimizerConfig, ShardedEmbeddingBagCollection
from fused_dlrm.sparse.input_dist import segment_gather_index
from bags import global_batch, to_kjt
from test_sharded_ebc import TABLES
from world import run_world


@pytest.mark.parametrize("seed", range(4))
def test_segment_gather_index_matches_split_and_cat(seed):
    gen = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, 5, (17,), generator=gen)
    counts[3] = 0  # empty segments, first and last included
    counts[0] = 0
    counts[-1] = 0
    x = torch.randn(int(counts.sum()), generator=gen)
    order = torch.randperm(counts.numel(), generator=gen)
    chunks = torch.split(x, counts.tolist())
    expected = torch.cat([chunks[i] for i in order.tolist()])
    torch.testing.assert_close(x[segment_gather_index(counts, order, x.numel())], expected, rtol=0, atol=0)


def test_segment_gather_index_of_nothing():
    counts = torch.zeros(3, dtype=torch.long)
    assert segment_gather_index(counts, torch.tensor([2, 0, 1]), 0).numel() == 0


def _out_of_range_on_rank_1(rank: int, world: int) -> None:
    sharded = ShardedEmbeddingBagCollection(TABLES, EmbeddingOptimizerConfig())
    keys = [f for t in TABLES for f in t.feature_names]
    lengths, values, _ = global_batch(0, 6, TABLES, False)
    start, stop = local_batch_bounds(6, rank, world)
    good = sharded(to_kjt(keys, lengths, values, None, start, stop)).values().clone()
    values[2][-1] = 57  # f2 reads t1 (57 rows); the last bag belongs to rank 1's samples
    expected = ("rank 1: feature 'f2' has index 57, outside table 't1' of 57 rows" if rank == 1
                else r"rank 0: rank\(s\) \[1\] sent out-of-range indices")
    with pytest.raises(IndexError, match=expected):
        sharded(to_kjt(keys, lengths, values, None, start, stop))
    # Nothing was lost: every rank goes on with the next good batch, and the tables were not touched.
    values[2][-1] = 0
    lengths, values, _ = global_batch(0, 6, TABLES, False)
    torch.testing.assert_close(sharded(to_kjt(keys, lengths, values, None, start, stop)).values(), good)


def test_out_of_range_index_raises_on_every_rank():
    run_world(2, _out_of_range_on_rank_1)
