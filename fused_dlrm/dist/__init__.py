"""Process-group set-up and the collectives the bulk-synchronous paths use."""

from fused_dlrm.dist.alltoall import all_to_all_v, exchange_counts
from fused_dlrm.dist.env import DistEnv, all_reduce_sum, destroy_distributed, init_distributed

__all__ = ["DistEnv", "all_reduce_sum", "init_distributed", "destroy_distributed", "all_to_all_v", "exchange_counts"]
