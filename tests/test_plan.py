"""The sharding plan: table-wise, column-wise and row-wise placement, the slices every rank pools, and its errors."""

from __future__ import annotations

import dataclasses

import pytest
from torchrec import EmbeddingBagConfig

from fused_dlrm.sparse.plan import (FeatureSlice, RowBlock, RowWiseColumns, Shard, TableShardingPlan, plan_sharding,
                                   row_block_bounds)

TABLES = [
    EmbeddingBagConfig(name="a", embedding_dim=8, num_embeddings=100, feature_names=["fa", "fa2"]),
    EmbeddingBagConfig(name="b", embedding_dim=4, num_embeddings=1000, feature_names=["fb"]),
    EmbeddingBagConfig(name="c", embedding_dim=16, num_embeddings=10, feature_names=["fc"]),
]


def placed(plan: TableShardingPlan) -> list[tuple]:
    return [(s.table, s.rank, s.col, s.dim, s.name) for s in plan.shards]


def test_table_wise_balances_rows_times_dims():
    # Loads: b 4000, a 800, c 160: b alone on rank 0, a and c on rank 1.
    plan = plan_sharding(TABLES, 2)
    assert placed(plan) == [("a", 1, 0, 8, "a"), ("b", 0, 0, 4, "b"), ("c", 1, 0, 16, "c")]
    assert [s.name for s in plan.shards_of(1)] == ["a", "c"]  # config order: the lookup's column order
    assert plan_sharding(TABLES, 2) == plan  # every rank computes the same plan


def test_column_shards_spread_over_ranks_and_place_columns():
    plan = plan_sharding(TABLES, 3, {"a": 2, "c": 4})
    assert placed(plan) == [
        ("a", 1, 0, 4, "a_cols_0_to_3"), ("a", 2, 4, 4, "a_cols_4_to_7"),
        ("b", 0, 0, 4, "b"),
        ("c", 1, 0, 4, "c_cols_0_to_3"), ("c", 2, 4, 4, "c_cols_4_to_7"),
        ("c", 0, 8, 4, "c_cols_8_to_11"),  # rank 0, the most loaded, is the one left that holds no shard of c
        ("c", 1, 12, 4, "c_cols_12_to_15")]  # every rank holds one: the least loaded
    # The output row: fa [0, 8), fa2 [8, 16), fb [16, 20), fc [20, 36). A table's features share its shards.
    assert plan.feature_slices(TABLES)[2] == [
        FeatureSlice("fa", "a_cols_4_to_7", 4, 4), FeatureSlice("fa2", "a_cols_4_to_7", 12, 4),
        FeatureSlice("fc", "c_cols_4_to_7", 24, 4)]
    configs = plan.shard_configs(TABLES, 1)
    assert [(c.name, c.embedding_dim, c.num_embeddings, c.feature_names) for c in configs] == [
        ("a_cols_0_to_3", 4, 100, ["fa", "fa2"]), ("c_cols_0_to_3", 4, 10, ["fc"]), ("c_cols_12_to_15", 4, 10, ["fc"])]
    slices = [s for mine in plan.feature_slices(TABLES) for s in mine]
    covered = sorted(c for s in slices for c in range(s.col, s.col + s.dim))
    assert covered == list(range(36))  # every output column exactly once


def test_an_int_cuts_every_table_and_a_small_world_holds_several_shards():
    plan = plan_sharding(TABLES, 1, 2)
    assert [s.rank for s in plan.shards] == [0] * 6 and len(plan.feature_slices(TABLES)[0]) == 8


def test_planning_errors():
    with pytest.raises(ValueError, match="table 'b': 4 columns do not split into 3 equal column shards"):
        plan_sharding(TABLES, 2, {"b": 3})
    with pytest.raises(ValueError, match=r"names tables the collection does not have: \['z'\]"):
        plan_sharding(TABLES, 2, {"z": 2})
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        plan_sharding(TABLES, 0)
    with pytest.raises(ValueError, match="table names must be unique"):
        plan_sharding(TABLES + TABLES[:1], 2)
    for plan in ({}, {"row_shards": 2}):  # row blocks planned a table of no columns without a word
        with pytest.raises(ValueError, match="table 'b': 1000 rows x 0 columns: a table needs at least one of each"):
            plan_sharding([TABLES[0], dataclasses.replace(TABLES[1], embedding_dim=0)], 2, **plan)


def test_errors_name_the_callers_keys():
    """prefix: the config group of the cuts (train/build.py: "model."), as moe/routing's checks take it; a per-table
    cut is named by its table's entry."""
    cases = [
        (dict(row_shards=0), r"^model.row_shards=0: expected a whole number >= 1 \(1: table-wise\)$"),
        (dict(column_shards=True), r"^model.column_shards=True: expected a whole number >= 1"),
        (dict(row_shards={"b": 2.5}), r"^model.row_shards\['b'\]=2.5: expected a whole number >= 1"),
        (dict(column_shards={"b": 3}), r"^model.column_shards\['b'\]=3: table 'b': 4 columns do not split into 3 "
                                       r"equal column shards$"),
        (dict(column_shards=3), r"^model.column_shards=3: table 'a': 8 columns do not split into 3 equal column "
                                r"shards$"),
        (dict(column_shards=2, row_shards={"a": 2}), r"^model.row_shards\['a'\]=2 with model.column_shards=2: a "
                                                     r"table is cut into row blocks or into column shards, not both$"),
        (dict(row_shards={"z": 2}), r"^model.row_shards names tables the collection does not have: \['z'\]$"),
    ]
    for cuts, error in cases:
        with pytest.raises(ValueError, match=error):
            plan_sharding(TABLES, 2, **cuts, prefix="model.")
        with pytest.raises(ValueError, match=error.replace("model.", "")):  # a library caller's: its arguments
            plan_sharding(TABLES, 2, **cuts)


def edited(plan: TableShardingPlan, name: str, **change) -> TableShardingPlan:
    """The plan with shard `name`'s fields changed."""
    return TableShardingPlan(plan.world_size, tuple(dataclasses.replace(s, **change) if s.name == name else s
                                                    for s in plan.shards))


def test_check_refuses_plans_that_do_not_fit_the_tables():
    plan = plan_sharding(TABLES, 2, {"c": 2})
    with pytest.raises(ValueError, match=r"the plan shards tables \['a', 'b', 'c'\], the collection has \['a', 'b'\]"):
        plan.check(TABLES[:2])
    with pytest.raises(ValueError, match=r"table 'c': column shards \[\(0, 8\), \(9, 8\)\].*16 columns once"):
        edited(plan, "c_cols_8_to_15", col=9).check(TABLES)
    with pytest.raises(ValueError, match="table 'b': shard on rank 5, outside a world of 2"):
        edited(plan, "b", rank=5).check(TABLES)
    twin = plan.shards + (Shard("c", 0, 16, 0, "c"),)
    with pytest.raises(ValueError, match="table 'c': column shards"):
        TableShardingPlan(2, twin).check(TABLES)
    with pytest.raises(ValueError, match="table names must be unique"):  # was accepted: the last one won
        plan.check(TABLES + TABLES[:1])
    renamed = tuple(dataclasses.replace(s, name="a") if s.table == "b" else s for s in plan.shards)
    with pytest.raises(ValueError, match=r"shard table names collide: \['a'\]"):
        TableShardingPlan(2, renamed).check(TABLES)


def test_row_blocks_cut_like_torchrec_and_widen_the_row():
    assert row_block_bounds(10, 4) == [(0, 3), (3, 3), (6, 3), (9, 1)]
    assert row_block_bounds(5, 4) == [(0, 2), (2, 2), (4, 1)]  # torchrec's fourth block would be empty
    assert row_block_bounds(1, 3) == [(0, 1)]
    # b (1000 rows x 4) in 3 blocks of 334, 334, 332 rows; a (100 x 8) read by two features, in 2 blocks; c whole.
    plan = plan_sharding(TABLES, 2, row_shards={"a": 2, "b": 3})
    # Biggest first (rows x dims): b's blocks on ranks 0, 1, 0 (a tie), a's on the rank without one of its own.
    assert [(s.table, s.rank, s.row, s.rows, s.name) for s in plan.shards] == [
        ("a", 1, 0, 50, "a_rows_0_to_49"), ("a", 0, 50, 50, "a_rows_50_to_99"),
        ("b", 0, 0, 334, "b_rows_0_to_333"), ("b", 1, 334, 334, "b_rows_334_to_667"),
        ("b", 0, 668, 332, "b_rows_668_to_999"), ("c", 1, 0, None, "c")]
    # The real row: fa [0, 8), fa2 [8, 16), fb [16, 20), fc [20, 36); then the later blocks' parts: fa's second
    # block [36, 44), fa2's [44, 52), fb's second and third [52, 56), [56, 60).
    assert plan.row_wise_columns(TABLES) == [
        RowWiseColumns("fa", 0, 8, (0, 36), False), RowWiseColumns("fa2", 8, 8, (8, 44), False),
        RowWiseColumns("fb", 16, 4, (16, 52, 56), False)]
    assert plan.feature_slices(TABLES)[0] == [
        FeatureSlice("fa@a_rows_50_to_99", "a_rows_50_to_99", 36, 8),
        FeatureSlice("fa2@a_rows_50_to_99", "a_rows_50_to_99", 44, 8),
        FeatureSlice("fb@b_rows_0_to_333", "b_rows_0_to_333", 16, 4),
        FeatureSlice("fb@b_rows_668_to_999", "b_rows_668_to_999", 56, 4)]
    slices = [s for mine in plan.feature_slices(TABLES) for s in mine]
    assert sorted(c for s in slices for c in range(s.col, s.col + s.dim)) == list(range(60))  # each once
    assert plan.row_blocks(TABLES)["fb"] == [RowBlock("fb@b_rows_0_to_333", 0), RowBlock("fb@b_rows_334_to_667", 334),
                                             RowBlock("fb@b_rows_668_to_999", 668)]
    assert "fc" not in plan.row_blocks(TABLES)
    configs = plan.shard_configs(TABLES, 1)
    assert [(c.name, c.num_embeddings, c.embedding_dim, c.feature_names) for c in configs] == [
        ("a_rows_0_to_49", 50, 8, ["fa@a_rows_0_to_49", "fa2@a_rows_0_to_49"]),
        ("b_rows_334_to_667", 334, 4, ["fb@b_rows_334_to_667"]), ("c", 10, 16, ["fc"])]
    # A table smaller than its block count has fewer blocks; one block is the whole table.
    assert [s.name for s in plan_sharding(TABLES, 2, row_shards={"c": 20}).shards if s.table == "c"] == [
        f"c_rows_{r}_to_{r}" for r in range(10)]
    assert plan_sharding([dataclasses.replace(TABLES[2], num_embeddings=1)], 2, row_shards=4).shards[0].rows is None


def test_row_block_errors():
    with pytest.raises(ValueError, match="^row_shards=2 with column_shards=2: a table is cut into row"):
        plan_sharding(TABLES, 2, column_shards=2, row_shards=2)
    with pytest.raises(ValueError, match=r"^row_shards=0: expected a whole number >= 1 \(1: table-wise\)$"):
        plan_sharding(TABLES, 2, row_shards=0)
    with pytest.raises(ValueError, match=r"row_shards names tables the collection does not have: \['z'\]"):
        plan_sharding(TABLES, 2, row_shards={"z": 2})
    plan = plan_sharding(TABLES, 2, row_shards={"b": 2})
    with pytest.raises(ValueError, match=r"table 'b': row blocks \[\(0, 500\), \(501, 500\)\] \(row, rows\) are not"):
        edited(plan, "b_rows_500_to_999", row=501).check(TABLES)
    with pytest.raises(ValueError, match="table 'b': a table is cut into row blocks or into column shards, not both"):
        edited(plan, "b_rows_0_to_499", dim=2).check(TABLES)
    alone = tuple(s for s in plan.shards if s.name != "b_rows_500_to_999")
    with pytest.raises(ValueError, match=r"table 'b': row blocks \[\(0, 500\)\] \(row, rows\) are not two or more"):
        TableShardingPlan(2, alone).check(TABLES)
