"""Output distribution: each owner's pooled embeddings [global batch, its dims] -> each rank's [local batch, all dims].

Bulk-synchronous: one variable-split all-to-all (autograd sends the gradient back the same way), then one column
gather into the configured feature order (`reorder`: its backward gathers by the inverse order).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from fused_dlrm.dist.alltoall import all_to_all_v
from fused_dlrm.dist.reorder import inverse_permutation, reorder


class BulkOutputDist:
    def __init__(self, dims_of_rank: list[list[int]], column_order: list[int], group: dist.ProcessGroup | None = None):
        """dims_of_rank[r]: output dims of the features rank r owns (its lookup's column order);
        column_order: for each output column in config order, its column in the rank-grouped layout."""
        self.dims_of_rank = dims_of_rank
        self.group = group
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        if sorted(column_order) != list(range(sum(map(sum, dims_of_rank)))):
            raise ValueError(f"column_order must take every one of the ranks' {sum(map(sum, dims_of_rank))} columns "
                             f"once, got {len(column_order)} columns")
        self.column_order = column_order
        self._index: tuple[torch.Tensor, torch.Tensor] | None = None  # the order and its inverse, on the device

    def __call__(self, pooled: torch.Tensor, batch_sizes: list[int]) -> torch.Tensor:
        my_dim = sum(self.dims_of_rank[self.rank])
        my_batch = batch_sizes[self.rank]
        # pooled rows are ordered by source rank, so the rows bound for rank s are one contiguous block.
        send = [b * my_dim for b in batch_sizes]
        recv = [my_batch * sum(dims) for dims in self.dims_of_rank]
        received = all_to_all_v(pooled.reshape(-1), send, recv, self.group)
        blocks = [chunk.view(my_batch, sum(dims))
                  for chunk, dims in zip(torch.split(received, recv), self.dims_of_rank)]
        rank_grouped = blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=1)
        if self._index is None or self._index[0].device != rank_grouped.device:
            order = torch.tensor(self.column_order, dtype=torch.int64, device=rank_grouped.device)
            self._index = (order, inverse_permutation(order))
        return reorder(rank_grouped, 1, *self._index)
