"""Sharded embedding-bag collection: sharding plan (table-wise, column-wise), input dist, lookup with fused
optimizer, output dist."""

from fused_dlrm.sparse.optimizer import EmbeddingOptimizerConfig
from fused_dlrm.sparse.plan import TableShardingPlan, plan_sharding
from fused_dlrm.sparse.sharded_ebc import ShardedEmbeddingBagCollection

__all__ = ["EmbeddingOptimizerConfig", "ShardedEmbeddingBagCollection", "TableShardingPlan", "plan_sharding"]
