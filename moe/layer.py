"""Expert-parallel MoE layer, bulk-synchronous: route, permute, all-to-all dispatch, local experts, all-to-all
combine, unpermute (Megatron's alltoall token dispatcher).

Experts are split evenly over the ranks of `group`: expert e lives on rank e // (num_experts / world size). The
router is replicated (its gradient, like any replicated parameter's, is the caller's to all-reduce); the
tokens are the rank's own. Without a process group (or a world of 1) the collectives are identities.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from fused_dlrm.dist import all_to_all_v, exchange_counts
from fused_dlrm.dist.alltoall import world_size
from moe.experts import SwiGLUExperts
from moe.permute import permute, unpermute
from moe.routing import TopKRouter


class MoELayer(nn.Module):
    def __init__(self, d_model: int, ffn: int, num_experts: int, top_k: int, group: dist.ProcessGroup | None = None,
                 capacity_factor: float | None = None, renormalize: bool = True, seed: int = 0,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None):
        super().__init__()
        self.group = group
        self.world = world_size(group)
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        if num_experts % self.world != 0:
            raise ValueError(f"num_experts={num_experts} must be a multiple of the expert-parallel world size "
                             f"{self.world}")
        self.num_experts = num_experts
        self.num_local_experts = num_experts // self.world
        self.router = TopKRouter(d_model, num_experts, top_k, renormalize, capacity_factor, seed, dtype, device)
        self.experts = SwiGLUExperts(self.num_local_experts, d_model, ffn, self.rank * self.num_local_experts,
                                     seed, dtype, device)

    def forward(self, x: torch.Tensor, logit_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
        """x: [tokens, d_model] (this rank's tokens, possibly none) -> (y [tokens, d_model], aux).

        aux: load_balancing_loss and z_loss (scalars over this rank's tokens, unscaled: the caller applies its
        coefficients), tokens_per_expert ([num_experts], this rank's kept assignments), dropped (assignments
        dropped by the capacity) and tokens_per_local_expert ([num_local_experts], rows this rank's experts ran).
        `logit_bias` is passed to the router (tests force skewed routings with it).
        """
        routing = self.router(x, logit_bias)
        rows, perm = permute(x, routing.expert_ids, self.num_experts, routing.kept)

        # Rows are grouped by global expert, hence by destination rank. Row r of send_counts: rows per expert of
        # rank r; after the exchange, row s of recv_counts: rows that rank s sends to each local expert.
        send_counts = perm.tokens_per_expert.view(self.world, self.num_local_experts)
        recv_counts = exchange_counts(send_counts, self.group)
        send_splits = send_counts.sum(dim=1).tolist()
        recv_splits = recv_counts.sum(dim=1).tolist()
        received = all_to_all_v(rows, send_splits, recv_splits, self.group)

        # Received rows are ordered (source rank, local expert, token); the experts need (local expert, source
        # rank, token). A stable sort by local expert does that regrouping, and its inverse undoes it.
        local_expert_of_row = torch.repeat_interleave(
            torch.arange(self.num_local_experts, device=x.device).repeat(self.world), recv_counts.reshape(-1))
        regroup = torch.sort(local_expert_of_row, stable=True).indices
        undo_regroup = torch.empty_like(regroup)
        undo_regroup[regroup] = torch.arange(regroup.numel(), device=x.device)
        tokens_per_local_expert = recv_counts.sum(dim=0)
        expert_out = self.experts(received[regroup], tokens_per_local_expert.tolist())

        combined = all_to_all_v(expert_out[undo_regroup], recv_splits, send_splits, self.group)
        y = unpermute(combined, perm, routing.weights)
        aux = {
            "load_balancing_loss": routing.aux_loss,
            "z_loss": routing.z_loss,
            "tokens_per_expert": routing.tokens_per_expert,
            "dropped": int((~routing.kept).sum()),
            "tokens_per_local_expert": tokens_per_local_expert,
        }
        return y, aux
