"""Sharded embedding-bag collection: table-wise plan, input dist, lookup with fused optimizer, output dist."""

from fused_dlrm.sparse.optimizer import EmbeddingOptimizerConfig
from fused_dlrm.sparse.plan import TableWisePlan, plan_table_wise
from fused_dlrm.sparse.sharded_ebc import ShardedEmbeddingBagCollection

__all__ = ["EmbeddingOptimizerConfig", "ShardedEmbeddingBagCollection", "TableWisePlan", "plan_table_wise"]
