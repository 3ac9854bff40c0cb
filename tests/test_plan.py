"""The sharding plan: table-wise and column-wise placement, the slices every rank pools, and its errors."""

from __future__ import annotations

import dataclasses

import pytest
from torchrec import EmbeddingBagConfig

from fused_dlrm.sparse.plan import FeatureSlice, Shard, TableShardingPlan, plan_sharding

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


def test_check_refuses_plans_that_do_not_fit_the_tables():
    plan = plan_sharding(TABLES, 2, {"c": 2})
    with pytest.raises(ValueError, match=r"the plan shards tables \['a', 'b', 'c'\], the collection has \['a', 'b'\]"):
        plan.check(TABLES[:2])
    gap = tuple(dataclasses.replace(s, col=9) if s.name == "c_cols_8_to_15" else s for s in plan.shards)
    with pytest.raises(ValueError, match=r"table 'c': column shards \[\(0, 8\), \(9, 8\)\].*16 columns once"):
        TableShardingPlan(2, gap).check(TABLES)
    far = tuple(dataclasses.replace(s, rank=5) if s.table == "b" else s for s in plan.shards)
    with pytest.raises(ValueError, match="table 'b': shard on rank 5, outside a world of 2"):
        TableShardingPlan(2, far).check(TABLES)
    twin = plan.shards + (Shard("c", 0, 16, 0, "c"),)
    with pytest.raises(ValueError, match="table 'c': column shards"):
        TableShardingPlan(2, twin).check(TABLES)
    renamed = tuple(dataclasses.replace(s, name="a") if s.table == "b" else s for s in plan.shards)
    with pytest.raises(ValueError, match=r"shard table names collide: \['a'\]"):
        TableShardingPlan(2, renamed).check(TABLES)
