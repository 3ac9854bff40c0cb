"""DLRM: torchrec's DenseArch / InteractionArch / OverArch around the project's ShardedEmbeddingBagCollection.

The sparse part is model-parallel (tables sharded table-wise); the dense part is data-parallel (DDP). Tables and
features are named `t_<feature>` / `<feature>`, one table per feature.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torchrec import DataType, EmbeddingBagConfig, PoolingType
from torchrec.models.dlrm import DLRM, InteractionArch

from fused_dlrm.sparse import EmbeddingOptimizerConfig, ShardedEmbeddingBagCollection
from fused_dlrm.sparse.fused_all_to_all import FusedCommConfig
from fused_dlrm.tp import QuantizedHookState, quantized_allreduce_hook


def make_tables(feature_names: Sequence[str], num_rows: int | Sequence[int], embedding_dim: int,
                pooling: str = "sum", data_type: str = "fp32") -> list[EmbeddingBagConfig]:
    rows = [num_rows] * len(feature_names) if isinstance(num_rows, int) else list(num_rows)
    if len(rows) != len(feature_names):
        raise ValueError(f"{len(rows)} table sizes for {len(feature_names)} features")
    return [EmbeddingBagConfig(name=f"t_{f}", embedding_dim=embedding_dim, num_embeddings=int(r), feature_names=[f],
                               pooling=PoolingType[pooling.upper()], data_type=DataType[data_type.upper()])
            for f, r in zip(feature_names, rows)]


class PairwiseInteractionArch(InteractionArch):
    """torchrec's InteractionArch, same output, with the upper-triangle pairs taken by `index_select` on the
    flattened [F + 1, F + 1] products: its backward is a scatter-add (each pair once), where the 2-D advanced
    index torchrec uses has a sort-based backward (4.2 ms of a 20 ms step at the paper config on H200)."""

    def __init__(self, num_sparse_features: int) -> None:
        super().__init__(num_sparse_features)
        rows, cols = self.triu_indices
        self.register_buffer("pair_index", rows * (self.F + 1) + cols, persistent=False)

    def forward(self, dense_features: torch.Tensor, sparse_features: torch.Tensor) -> torch.Tensor:
        if self.F <= 0:
            return dense_features
        combined = torch.cat((dense_features.unsqueeze(1), sparse_features), dim=1)
        products = torch.bmm(combined, combined.transpose(1, 2)).flatten(1)
        return torch.cat((dense_features, products.index_select(1, self.pair_index)), dim=1)


def build_dlrm(tables: list[EmbeddingBagConfig], dense_in_features: int, dense_arch: Sequence[int],
               over_arch: Sequence[int], embedding_optimizer: EmbeddingOptimizerConfig, device: torch.device,
               seed: int = 0, comm: FusedCommConfig | None = None) -> DLRM:
    """The DLRM of torchrec with sharded tables; call `data_parallel` on it when the world has several ranks."""
    if over_arch[-1] != 1:
        raise ValueError(f"the over arch must end in one logit, got layer sizes {list(over_arch)}")
    torch.manual_seed(seed)  # same dense init on every rank (DDP also broadcasts rank 0's)
    sparse = ShardedEmbeddingBagCollection(tables, embedding_optimizer, device=device, seed=seed, comm=comm)
    model = DLRM(embedding_bag_collection=sparse, dense_in_features=dense_in_features,
                 dense_arch_layer_sizes=list(dense_arch), over_arch_layer_sizes=list(over_arch), dense_device=device)
    model.inter_arch = PairwiseInteractionArch(model.inter_arch.F).to(device)
    return model


def data_parallel(model: DLRM, grad_allreduce: str = "nccl") -> nn.Module:
    """Wrap the dense arches in DDP: their gradients are averaged over ranks, the sharded tables are left alone.
    grad_allreduce other than "nccl" averages them with that codec's quantized all-reduce (fused_dlrm.tp)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return model
    device = next(model.dense_arch.parameters()).device
    ids = [device] if device.type == "cuda" else None
    model.dense_arch = DistributedDataParallel(model.dense_arch, device_ids=ids)
    model.over_arch = DistributedDataParallel(model.over_arch, device_ids=ids)
    if grad_allreduce != "nccl":
        for arch in (model.dense_arch, model.over_arch):
            arch.register_comm_hook(QuantizedHookState(grad_allreduce), quantized_allreduce_hook)
    return model
