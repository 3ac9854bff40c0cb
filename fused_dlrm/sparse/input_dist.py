"""Input distribution: each rank's KeyedJaggedTensor (its local batch, every feature) -> each owner's bags.

After it, the owner of a table holds the bags of that table's features for every sample of the global batch, in
source-rank order (rank 0's samples first). Bulk-synchronous, with torch.distributed:
  1. a header all-to-all: local batch size and value count of each feature per destination (sizes must be known
     on the host);
  2. lengths all-to-all; 3. values all-to-all (4. per-sample weights, when the KJT has them).
Host syncs: the local value counts per feature (they split the values), and the received header.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torchrec import KeyedJaggedTensor

from fused_dlrm.dist.alltoall import all_to_all_v, exchange_counts
from fused_dlrm.dist.host_copy import host_to_device


@dataclass
class OwnedBags:
    """The bags of the features one rank owns, over the global batch (CSR, feature-major)."""

    features: list[str]
    values: torch.Tensor  # [N] int64: feature 0's bags for all samples, then feature 1's, ...
    lengths: torch.Tensor  # [num_features, global_batch] bag sizes
    weights: torch.Tensor | None  # [N] per-sample weights, or None
    feature_value_offsets: list[int]  # host: feature f's values are values[o[f]:o[f+1]]
    batch_sizes: list[int]  # local batch size of every source rank; their sum is the global batch
    _csr_offsets: torch.Tensor | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def global_batch(self) -> int:
        return sum(self.batch_sizes)

    def csr_offsets(self) -> torch.Tensor:
        """[num_features * global_batch + 1] start of every bag in `values` (feature-major), as kernels take it;
        computed once per batch (the forward and a re-run forward share it)."""
        if self._csr_offsets is None:
            offsets = torch.zeros(self.lengths.numel() + 1, dtype=torch.int64, device=self.values.device)
            torch.cumsum(self.lengths.reshape(-1), 0, out=offsets[1:])
            self._csr_offsets = offsets
        return self._csr_offsets

    def feature_bags(self, f: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(values, lengths, weights) of the f-th owned feature."""
        a, b = self.feature_value_offsets[f], self.feature_value_offsets[f + 1]
        weights = None if self.weights is None else self.weights[a:b]
        return self.values[a:b], self.lengths[f], weights


class BulkInputDist:
    """Table-wise input distribution with torch.distributed all-to-alls (gloo on CPU, NCCL on GPU)."""

    def __init__(self, features_of_rank: list[list[str]], group: dist.ProcessGroup | None = None):
        self.features_of_rank = features_of_rank
        self.group = group
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        self.send_order = [f for feats in features_of_rank for f in feats]  # rank-grouped feature order

    def __call__(self, kjt: KeyedJaggedTensor) -> OwnedBags:
        world, device = len(self.features_of_rank), kjt.values().device
        key_index = {k: i for i, k in enumerate(kjt.keys())}
        perm = [key_index[f] for f in self.send_order]
        local_batch = kjt.stride()
        lengths = kjt.lengths().view(len(key_index), local_batch).long()
        per_key_values = lengths.sum(dim=1).tolist()  # host sync: value splits must be known on the host

        # Regroup the key-major KJT so each destination's features are one contiguous run.
        value_chunks = torch.split(kjt.values(), per_key_values)
        send_values = torch.cat([value_chunks[i] for i in perm]) if perm else kjt.values()[:0]
        send_lengths = lengths[perm].reshape(-1)
        send_weights = None
        if kjt.weights_or_none() is not None:
            weight_chunks = torch.split(kjt.weights(), per_key_values)
            send_weights = torch.cat([weight_chunks[i] for i in perm]) if perm else kjt.weights()[:0]

        # Header to rank d: [local batch, value count of each of d's features (zero-padded)]. What comes back sizes
        # everything the owner receives, so the header exchange is the second and last host sync.
        width = 1 + max(len(feats) for feats in self.features_of_rank)
        header = [[local_batch] + [per_key_values[key_index[f]] for f in feats] + [0] * (width - 1 - len(feats))
                  for feats in self.features_of_rank]
        values_to = [sum(row[1:]) for row in header]
        header, = host_to_device([torch.tensor(header, dtype=torch.int64)], device)
        recv_header = exchange_counts(header, self.group).tolist()
        mine = self.features_of_rank[self.rank]
        batch_sizes = [row[0] for row in recv_header]
        counts = [row[1:1 + len(mine)] for row in recv_header]  # [source][feature]: values received
        values_from = [sum(row) for row in counts]

        send_length_splits = [len(feats) * local_batch for feats in self.features_of_rank]
        recv_length_splits = [len(mine) * b for b in batch_sizes]
        recv_lengths = all_to_all_v(send_lengths, send_length_splits, recv_length_splits, self.group)
        recv_values = all_to_all_v(send_values, values_to, values_from, self.group)
        recv_weights = None if send_weights is None else all_to_all_v(send_weights, values_to, values_from, self.group)

        # Received data is (source, feature)-major; the lookup wants (feature, source)-major.
        per_source_lengths = [chunk.view(len(mine), b) for chunk, b in
                              zip(torch.split(recv_lengths, recv_length_splits), batch_sizes)]
        owned_lengths = torch.cat(per_source_lengths, dim=1)
        order = [s * len(mine) + f for f in range(len(mine)) for s in range(world)]
        flat_counts = [c for row in counts for c in row]
        values = _regroup(recv_values, flat_counts, order)
        weights = None if recv_weights is None else _regroup(recv_weights, flat_counts, order)
        offsets = [0]
        for f in range(len(mine)):
            offsets.append(offsets[-1] + sum(counts[s][f] for s in range(world)))
        return OwnedBags(features=mine, values=values, lengths=owned_lengths, weights=weights,
                         feature_value_offsets=offsets, batch_sizes=batch_sizes)


def _regroup(x: torch.Tensor, chunk_sizes: list[int], order: list[int]) -> torch.Tensor:
    if not order:
        return x[:0]
    chunks = torch.split(x, chunk_sizes)
    return torch.cat([chunks[i] for i in order])
