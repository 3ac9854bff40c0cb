"""DLRM: torchrec's DenseArch / InteractionArch / OverArch around the project's ShardedEmbeddingBagCollection.

The sparse part is model-parallel (tables sharded table-wise); the dense part is data-parallel
(models/arch_nodes.py). Tables and features are named `t_<feature>` / `<feature>`, one table per feature.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torchrec import DataType, EmbeddingBagConfig, PoolingType
from torchrec.models.dlrm import DLRM, InteractionArch, SparseArch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from fused_dlrm.config_checks import check_count
from fused_dlrm.kernels.pairwise_interaction import pairwise_interaction
from fused_dlrm.sparse import ShardedEmbeddingBagCollection, TableShardingPlan
from fused_dlrm.sparse.optimizer import TableOptimizers
from fused_dlrm.sparse.fused_all_to_all import FusedCommConfig


def make_tables(feature_names: Sequence[str], num_rows: int | Sequence[int], embedding_dim: int,
                pooling: str = "sum", data_type: str = "fp32") -> list[EmbeddingBagConfig]:
    rows = [num_rows] * len(feature_names) if isinstance(num_rows, int) else list(num_rows)
    if len(rows) != len(feature_names):
        raise ValueError(f"{len(rows)} table sizes for {len(feature_names)} features")
    if not all(isinstance(r, int) and not isinstance(r, bool) and r >= 1 for r in rows):
        raise ValueError(f"model.num_rows: every table needs a whole number of rows >= 1, got {num_rows}")
    check_count("model.embedding_dim", embedding_dim, 1, "a whole number of columns >= 1")
    for what, value, known in (("pooling", pooling, ("sum", "mean")),
                               ("data_type", data_type, ("fp32", "fp16", "bf16"))):
        if value.lower() not in known:  # torchrec's enums would say KeyError: 'MAX'
            raise ValueError(f"model.{what}={value!r}: expected one of {known}")
    return [EmbeddingBagConfig(name=f"t_{f}", embedding_dim=embedding_dim, num_embeddings=int(r), feature_names=[f],
                               pooling=PoolingType[pooling.upper()], data_type=DataType[data_type.upper()])
            for f, r in zip(feature_names, rows)]


class ViewSparseArch(SparseArch):
    """torchrec's SparseArch, same output, without its copies when it can: the collection's KeyedTensor already
    holds its features in the arch's order with one dim each, so [B, F * D] is [B, F, D] as a view. torchrec's
    split into features and `cat` copies the pooled output forward and its gradient backward (two passes over
    268 MB per step at the paper config). With comm=fused the view is of the exchange's symmetric output, valid
    until the next forward and, for this step's backward (for which the interaction saves it), until the forward
    after next."""

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        return pooled_features(self.embedding_bag_collection(features), self.sparse_feature_names, self.F, self.D)


def pooled_features(pooled: KeyedTensor, names: list[str], num_features: int, dim: int) -> torch.Tensor:
    """pooled [B, sum of dims] -> [B, F, D] in `names` order: a view where the KeyedTensor already is that."""
    values = pooled.values()
    if pooled.keys() == names and values.is_contiguous() and all(n == dim for n in pooled.length_per_key()):
        return values.view(-1, num_features, dim)
    sparse = pooled.to_dict()
    return torch.cat([sparse[name] for name in names], dim=1).reshape(-1, num_features, dim)


# torchrec's TrainPipelineSparseDist traces the model with torch.fx: these run as calls in its graph (the first
# branches on its input, the second on its device), which lets the pipeline run our arches.
torch.fx.wrap("pooled_features")
torch.fx.wrap("pairwise_interaction")


class PairwiseInteractionArch(InteractionArch):
    """torchrec's InteractionArch, same output: [dense, its dot with every sparse row, the sparse rows' pairwise
    dots]. torchrec concatenates [dense; sparse] (a copy), takes the full [F + 1, F + 1] products through an
    odd-sized (F + 1 = 129: unaligned, slow on GPUs) batched GEMM and indexes pairs with a 2-D advanced index
    whose backward sorts (4.2 ms of a 20 ms step at the paper config on H200). On GPUs one kernel per direction
    does it all (`fused_dlrm.kernels.pairwise_interaction`); elsewhere the same products as torch ops."""

    def forward(self, dense_features: torch.Tensor, sparse_features: torch.Tensor) -> torch.Tensor:
        if self.F <= 0:
            return dense_features
        return pairwise_interaction(dense_features, sparse_features)


def build_dlrm(tables: list[EmbeddingBagConfig], dense_in_features: int, dense_arch: Sequence[int],
               over_arch: Sequence[int], embedding_optimizer: TableOptimizers, device: torch.device,
               seed: int = 0, comm: FusedCommConfig | None = None, plan: TableShardingPlan | None = None) -> DLRM:
    """The DLRM of torchrec with sharded tables (plan: None for table-wise); `arch_nodes.dense_arch_nodes` makes its
    dense arches data-parallel."""
    if over_arch[-1] != 1:
        raise ValueError(f"the over arch must end in one logit, got layer sizes {list(over_arch)}")
    torch.manual_seed(seed)  # same dense init on every rank (the arch nodes also broadcast rank 0's)
    sparse = ShardedEmbeddingBagCollection(tables, embedding_optimizer, device=device, seed=seed, comm=comm,
                                           plan=plan)
    model = DLRM(embedding_bag_collection=sparse, dense_in_features=dense_in_features,
                 dense_arch_layer_sizes=list(dense_arch), over_arch_layer_sizes=list(over_arch), dense_device=device)
    return with_lean_arches(model)


def with_lean_arches(model: DLRM) -> DLRM:
    """torchrec's SparseArch and InteractionArch swapped for ViewSparseArch and PairwiseInteractionArch: the same
    outputs, less copying (also under torchrec's TrainPipelineSparseDist, whose fx tracing they pass). Another
    interaction (DLRM_DCN's cross net, DLRM_Projection's branches: other functions, with parameters) is kept."""
    model.sparse_arch = ViewSparseArch(model.sparse_arch.embedding_bag_collection)
    if isinstance(model.inter_arch, InteractionArch):  # (PairwiseInteractionArch is one too)
        dense_device = next(model.dense_arch.parameters()).device
        model.inter_arch = PairwiseInteractionArch(model.inter_arch.F).to(dense_device)
    return model


def dlrm_loss(logits: torch.Tensor, labels: torch.Tensor, scale: float | torch.Tensor) -> torch.Tensor:
    """The training loss: binary cross-entropy summed over the local batch, times `scale` (world size / global
    batch: the data-parallel average over ranks, and the sparse all-to-all's division by the world size, as in
    torchrec, then give the gradient of the global-batch mean, uneven local batches weighted correctly)."""
    return F.binary_cross_entropy_with_logits(logits, labels, reduction="sum") * scale
