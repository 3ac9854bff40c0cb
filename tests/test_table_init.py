"""A table's initialisation drawn in chunks of rows (lookup.init_block): any block of rows and columns equals that
block of the whole table, a table of one chunk is drawn as before chunks existed, and a sharded collection's shards
start as their blocks of their tables."""

from __future__ import annotations

import pytest
import torch
from torchrec import DataType, EmbeddingBagConfig

from fused_dlrm.sparse import EmbeddingOptimizerConfig, ShardedEmbeddingBagCollection, plan_sharding
from fused_dlrm.sparse import lookup
from fused_dlrm.sparse.lookup import init_block, init_chunk_seed, init_table
from fused_dlrm.sparse.sharded_ebc import table_seeds

CPU = torch.device("cpu")


def table(rows: int, dim: int, name: str = "t", **kwargs) -> EmbeddingBagConfig:
    return EmbeddingBagConfig(name=name, embedding_dim=dim, num_embeddings=rows, feature_names=[f"f_{name}"],
                              **kwargs)


def whole_draw(rows: int, dim: int, seed: int) -> torch.Tensor:
    """init_table before chunks: the whole table in one draw from a generator seeded `seed`."""
    bound = (1.0 / rows) ** 0.5
    return torch.empty(rows, dim).uniform_(-bound, bound, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("rows, dim", [(20000, 16), (100000, 256), (1 << 18, 4)])  # dlrm, dlrm_paper, one chunk
def test_a_table_of_one_chunk_is_drawn_as_before(rows, dim):
    assert lookup.INIT_CHUNK_ROWS == 1 << 18
    assert torch.equal(init_table(table(rows, dim), 7, CPU), whole_draw(rows, dim, 7))


@pytest.fixture
def chunks_of_8(monkeypatch):
    monkeypatch.setattr(lookup, "INIT_CHUNK_ROWS", 8)


def test_chunk_0_is_the_tables_seed_and_later_chunks_are_new_draws(chunks_of_8):
    rows, dim = 20, 6  # 2.5 chunks
    whole = init_table(table(rows, dim), 3, CPU)
    assert whole.shape == (rows, dim)
    assert torch.equal(whole[:8], whole_draw(rows, dim, 3)[:8])  # chunk 0: the table's seed, as before
    # Every chunk of tables seeded 0..5 (table_seeds' neighbours) is a draw of its own: no chunk repeats another
    # one of its table, nor one of a neighbouring table (a chunk seeded seed + c would repeat table seed + c's first).
    firsts = torch.stack([init_table(table(rows, dim), seed, CPU)[c * 8] for seed in range(6) for c in range(3)])
    assert len(set(map(tuple, firsts.tolist()))) == len(firsts)
    assert whole.abs().max() <= (1.0 / rows) ** 0.5


def test_any_block_equals_that_block_of_the_whole_table(chunks_of_8):
    rows, dim = 20, 6  # 2.5 chunks
    config = table(rows, dim)
    whole = init_table(config, 11, CPU)
    for row in range(rows + 1):
        for count in range(rows - row + 1):
            for col, width in ((0, dim), (2, 3), (5, 1), (0, 0)):
                block = init_block(config, 11, CPU, row, count, col, width)
                assert block.shape == (count, width)
                assert torch.equal(block, whole[row:row + count, col:col + width]), (row, count, col, width)
    assert torch.equal(init_block(config, 11, CPU, 13), whole[13:])  # rows and columns to the table's end
    assert torch.equal(init_block(config, 11, CPU, col=4), whole[:, 4:])
    for bad in ((-1, 2, 0, 6), (19, 2, 0, 6), (0, 20, 1, 6), (0, 20, -1, 2)):
        with pytest.raises(ValueError, match="has no rows"):
            init_block(config, 11, CPU, *bad)


def test_only_the_chunks_a_block_overlaps_are_drawn(chunks_of_8, monkeypatch):
    """Each of them full width, the last one only as long as the table."""
    seeds, shapes = [], []
    seed_of, uniform = lookup.init_chunk_seed, torch.Tensor.uniform_
    monkeypatch.setattr(lookup, "init_chunk_seed", lambda seed, c: seeds.append(c) or seed_of(seed, c))
    monkeypatch.setattr(torch.Tensor, "uniform_",
                        lambda t, *a, **k: shapes.append(tuple(t.shape)) or uniform(t, *a, **k))
    config = table(20, 6)
    for row, count, chunks in ((9, 3, [1]), (7, 2, [0, 1]), (16, 4, [2]), (3, 17, [0, 1, 2]), (8, 8, [1]),
                               (0, 16, [0, 1]), (17, 0, [])):
        seeds.clear(), shapes.clear()
        init_block(config, 5, CPU, row, count, 2, 3)
        assert seeds == chunks and shapes == [(min(8, 20 - 8 * c), 6) for c in chunks], (row, count)


def test_chunk_seeds_stay_apart_on_the_cpus_32_bits():
    """The comment on _CHUNK_SEED_STEP: (c' - c) * step (mod 2^32) stays >= 170034 away from 0 for chunk numbers
    below 16384, so tables whose seeds differ by less than that never share a chunk's generator."""
    low = [init_chunk_seed(0, k) % 2**32 for k in range(1, 16384)]
    assert min(min(v, 2**32 - v) for v in low) >= 170034
    assert init_chunk_seed(12345, 0) == 12345


@pytest.mark.parametrize("data_type", [DataType.FP32, DataType.FP16])
def test_shards_start_as_their_blocks_of_the_tables_init(monkeypatch, data_type):
    """Row blocks across chunk boundaries and column shards of one collection (world 1 holds every shard) against
    init_table; each shard owns only its own memory."""
    monkeypatch.setattr(lookup, "INIT_CHUNK_ROWS", 16)
    tables = [table(300, 3, "rows_a", data_type=data_type), table(57, 8, "cols", data_type=data_type),
              table(40, 4, "rows_b", data_type=data_type), table(7, 2, "whole", data_type=data_type)]
    plan = plan_sharding(tables, 1, column_shards={"cols": 4}, row_shards={"rows_a": 3, "rows_b": 4})
    ebc = ShardedEmbeddingBagCollection(tables, EmbeddingOptimizerConfig("sgd", lr=0.1), plan=plan, seed=2)
    seeds = table_seeds(tables, 2)
    by_name = {t.name: t for t in tables}
    assert len(ebc.shard_weights) == 3 + 4 + 4 + 1
    for s in plan.shards_of(0):
        whole = init_table(by_name[s.table], seeds[s.table], CPU).to(torch.float16 if data_type == DataType.FP16
                                                                     else torch.float32)
        weight = ebc.shard_weights[s.name]
        assert torch.equal(weight, whole[s.row:s.row + s.num_rows(by_name[s.table]), s.col:s.col + s.dim]), s
        assert weight.untyped_storage().nbytes() == weight.nbytes


def test_the_configs_own_init_torchrec_draws_it_with(chunks_of_8):
    """torchrec initialises a table by its config's init_fn: by default U(weight_init_min, weight_init_max) (each
    +-sqrt(1/rows) when not set), drawn here in chunks as ever (any block equals that block of the whole table); any
    other init_fn is applied to the block, as stock torchrec applies it to its shards."""
    bounded = table(20, 6, weight_init_min=0.5, weight_init_max=0.75)
    whole = init_table(bounded, 4, CPU)
    assert 0.5 <= whole.min() and whole.max() <= 0.75 and whole.max() > 0.7  # the whole range, not +-sqrt(1/20)
    assert torch.equal(init_block(bounded, 4, CPU, 5, 9, 1, 4), whole[5:14, 1:5])
    above = init_table(table(20, 6, weight_init_min=0.0), 4, CPU)  # the max stays +-sqrt(1/rows)'s
    assert 0.0 <= above.min() and above.max() <= (1.0 / 20) ** 0.5

    constant = table(20, 6, init_fn=lambda w: torch.nn.init.constant_(w, 0.25))
    assert torch.equal(init_block(constant, 4, CPU, 3, 7, 2, 3), torch.full((7, 3), 0.25))
    torch.manual_seed(0)
    normal = init_table(table(300, 64, init_fn=lambda w: torch.nn.init.normal_(w, std=0.01)), 4, CPU)
    assert normal.shape == (300, 64) and 0.009 < float(normal.std()) < 0.011
