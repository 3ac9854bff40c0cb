"""A small decoder-only Mixture-of-Experts Transformer over bytes.

Block: x + attn(rmsnorm(x)), then + ffn(rmsnorm(.)). Attention is causal self-attention with rotary position
embedding (F.scaled_dot_product_attention, is_causal=True). The FFN is the project's expert-parallel MoELayer in
every `moe_every`-th layer (layers moe_every-1, 2*moe_every-1, ...) and a dense SwiGLU in the others; with
`shared_expert` a dense SwiGLU runs on every token beside the routed experts and is added to their output.
The output head is tied to the byte embedding (logits = h @ embedding.weight.T).

Activations are rows, one per token of the batch in [B, S] order ([B * S, d]).

Tensor parallelism (`tp_group` of tp_size ranks, fused_dlrm.tp.linear): attention's qkv projection is
column-parallel with the heads split over the group and its output projection row-parallel; the dense SwiGLU
FFNs and the shared expert have w13 (w1 and w3 as one) column-parallel and w2 row-parallel. tp_size 1 (no
tp_group) runs the same layers without communication. Between the projections the rows are either
- replicated inside a TP group (Megatron's f / g all-reduces; the MoE layers run expert parallelism over
  `group`, the data-parallel group, whose ranks hold different tokens), or
- with `sequence_parallel`, cut over the TP group: each rank holds a contiguous 1/tp_size of the rows
  (`local_tokens`) through the embedding, the norms, the residual stream, the MoE layers and the loss; the qkv
  and w13 projections all-gather the rows before their GEMM and the row-parallel ones reduce-scatter after it
  (Megatron's sequence parallelism; the same bytes as the all-reduce, a tp_size-th of the norms' work and
  activations). Every rank of the world then holds different tokens, so the MoE layers' experts are split over
  the whole world (expert parallelism over TP x DP, as Megatron's "parallel folding" with expert TP 1). The
  load-balancing loss counts the expert choices of the TP group (moe.routing's statistics_group), as Megatron's
  does, so the objective is that of the replicated rows.

Initialisation is a function of the seed only: the projections draw their full weight from a seed derived from
(seed, layer, name) and keep their shard, so any tp_size gives the tp_size = 1 model; the other replicated
parameters are drawn from one generator in a fixed order (identical on every rank, whatever the world size);
the experts are seeded per global expert by MoELayer, so a rank holding a slice of the experts has exactly the
weights a one-process model has for them.
"""

from __future__ import annotations

import hashlib
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from fused_dlrm.dist.alltoall import world_size
from fused_dlrm.dist.env import of_every_rank
from fused_dlrm.dist.symmetric import ALLOCATION_TIMEOUT_S
from fused_dlrm.tp.linear import ColumnParallelLinear, RowParallelLinear, TPLinear
from fused_dlrm.train.compute_copies import want_compute_copy
from moe.experts import SwiGLUExperts
from moe.kernels.rotary import rotary_qkv
from moe.layer import BATCH_NOT_CUT, TOKEN_OUT_OF_VOCABULARY, MoELayer


def derive_seed(*parts: object) -> int:
    """A 40-bit seed from a stable hash of `parts` (small enough for MoELayer's per-expert seeds)."""
    digest = hashlib.blake2b("/".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 40) - 1)


class TPLayout:
    """What every tensor-parallel projection of the model shares: the group, its comm (and the fused comm's
    allocation bound), whether the rows between the projections are cut over the group (sequence parallelism) and
    the seeds."""

    def __init__(self, group: dist.ProcessGroup | None, comm: str, sequence_parallel: bool, seed: int,
                 num_layers: int, allocation_timeout_s: float = ALLOCATION_TIMEOUT_S):
        self.group, self.comm, self.seed, self.allocation_timeout_s = group, comm, seed, allocation_timeout_s
        self.size = dist.get_world_size(group) if group is not None else 1
        self.sequence_parallel = sequence_parallel and self.size > 1
        self.residual_std = 0.02 / math.sqrt(2 * num_layers)  # projections that write into the residual stream

    def column(self, d_in: int, d_out: int, *name: object, parts: int = 1,
               part_names: tuple[str, ...] = ()) -> ColumnParallelLinear:
        """part_names: each part drawn from a seed of its own name (layers fused into one keep their init)."""
        seed = tuple(derive_seed(self.seed, *name, p) for p in part_names) or derive_seed(self.seed, *name)
        return ColumnParallelLinear(d_in, d_out, self.group, self.comm, seed, 0.02, parts,
                                    sequence_sharded=self.sequence_parallel,
                                    allocation_timeout_s=self.allocation_timeout_s)

    def row(self, d_in: int, d_out: int, *name: object) -> RowParallelLinear:
        return RowParallelLinear(d_in, d_out, self.group, self.comm, derive_seed(self.seed, *name), self.residual_std,
                                 sequence_sharded=self.sequence_parallel,
                                 allocation_timeout_s=self.allocation_timeout_s)


class SwiGLU(nn.Module):
    """Dense FFN: (silu(x W1) * (x W3)) W2; w1 and w3 as one column-parallel w13 (one GEMM, and under sequence
    parallelism one all-gather), w2 row-parallel."""

    def __init__(self, d_model: int, ffn: int, tp: TPLayout, *name: object):
        super().__init__()
        if ffn % tp.size:
            raise ValueError(f"model.ffn={ffn} must be a multiple of model.tp_size={tp.size}")
        self.w13 = tp.column(d_model, 2 * ffn, *name, parts=2, part_names=("w1", "w3"))
        self.w2 = tp.row(ffn, d_model, *name, "w2")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w13(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


class ShardedMoELayer(MoELayer):
    """MoELayer whose experts are registered as `experts_<first>_to_<last>` (global expert indices).

    Each rank holds different expert weights; a name shared by all ranks would make torch.distributed.checkpoint
    treat them as one replicated tensor (saved once, loaded everywhere). With the range in the name every rank's
    experts, and their optimizer state, are their own checkpoint entries (a checkpoint therefore resumes on the
    same world size only)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        experts = self._modules.pop("experts")
        first = experts.first_expert
        self._experts_name = f"experts_{first}_to_{first + experts.num_experts - 1}"
        self.add_module(self._experts_name, experts)

    @property
    def experts(self) -> SwiGLUExperts:
        return self._modules[self._experts_name]


class CausalSelfAttention(nn.Module):
    """Heads split over the TP group: qkv column-parallel in three parts (this rank's heads of q, k and v), the
    output projection row-parallel over the same heads."""

    def __init__(self, d_model: int, num_heads: int, tp: TPLayout, *name: object):
        super().__init__()
        if d_model % num_heads or (d_model // num_heads) % 2:
            raise ValueError(f"model.d_model={d_model} must split into model.num_heads={num_heads} heads of an even "
                             f"size")
        if num_heads % tp.size:
            raise ValueError(f"model.num_heads={num_heads} must be a multiple of model.tp_size={tp.size}")
        self.local_heads, self.head_dim = num_heads // tp.size, d_model // num_heads
        self.qkv = tp.column(d_model, 3 * d_model, *name, "qkv", parts=3)
        self.out = tp.row(d_model, d_model, *name, "out")

    def forward(self, x: torch.Tensor, batch_shape: tuple[int, int]) -> torch.Tensor:
        """x: this rank's rows [rows, d] of a batch of `batch_shape` (B, S); qkv holds all B * S rows (gathered
        under sequence parallelism), the output this rank's rows again."""
        b, s = batch_shape
        q, k, v = rotary_qkv(self.qkv(x).view(b, s, 3, self.local_heads, self.head_dim))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b * s, self.local_heads * self.head_dim))


class Block(nn.Module):
    def __init__(self, d_model: int, num_heads: int, ffn: nn.Module, shared: nn.Module | None, tp: TPLayout,
                 index: int):
        super().__init__()
        self.attn_norm = nn.RMSNorm(d_model, eps=1e-6)
        self.attn = CausalSelfAttention(d_model, num_heads, tp, "block", index, "attn")
        self.ffn_norm = nn.RMSNorm(d_model, eps=1e-6)
        self.ffn = ffn
        self.shared_expert = shared

    def forward(self, x: torch.Tensor, batch_shape: tuple[int, int], refused: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, dict | None]:
        """x: this rank's rows [rows, d] of a batch of `batch_shape` (B, S); refused: MoELayer's."""
        x = x + self.attn(self.attn_norm(x), batch_shape)
        h = self.ffn_norm(x)
        if isinstance(self.ffn, MoELayer):
            # The shared expert needs no routing: the layer runs it while its counts travel to the host.
            shared = None if self.shared_expert is None else lambda: self.shared_expert(h)
            y, aux = self.ffn(h, alongside=shared, refused=refused)
            return x + y, aux
        return x + self.ffn(h), None


class MoETransformer(nn.Module):
    def __init__(self, vocab_size: int = 256, d_model: int = 64, num_layers: int = 2, num_heads: int = 4,
                 ffn: int = 128, num_experts: int = 4, top_k: int = 2, moe_every: int = 1,
                 shared_expert: bool = False, capacity_factor: float | None = None, drop_policy: str = "probs",
                 seed: int = 0,
                 group: dist.ProcessGroup | None = None, tp_group: dist.ProcessGroup | None = None,
                 tp_comm: str = "bulk", sequence_parallel: bool = False, moe_comm: str = "bulk", moe_fused=None,
                 compute_dtype: torch.dtype | None = None, allocation_timeout_s: float = ALLOCATION_TIMEOUT_S):
        """The sizes are the config's model.<key>s (conf/model/moe_transformer.yaml), which its errors name.
        group: the data-parallel group (None: the world); tp_group: the tensor-parallel group (None: no tensor
        parallelism), the two tiling the world as fused_dlrm.tp.tp_groups makes them; tp_comm: bulk | fused;
        sequence_parallel: the rows cut over the TP group between its projections (no effect without one);
        moe_comm / moe_fused: the MoE layers' dispatch and combine (MoELayer's comm and fused);
        compute_dtype: torch.bfloat16 / float16 runs the forward under autocast to it (mixed precision: the
        parameters stay as they are, the logits come out in fp32; the experts' weights are marked for compute
        copies); None: the parameters' dtype; allocation_timeout_s: how long a rank waits for its peers at an
        allocation of the symmetric workspaces of the fused TP projections and of the gradients' quantized
        all-reduce (moe.train.sync_gradients; the MoE layers': moe_fused's)."""
        super().__init__()
        if moe_every not in (1, 2):
            raise ValueError(f"model.moe_every must be 1 or 2, got {moe_every}")
        if num_layers < moe_every:  # the first MoE layer's exchange carries a refused batch to every rank (forward)
            raise ValueError(f"model.num_layers={num_layers} with model.moe_every={moe_every} makes no MoE layer")
        if tp_group is not None and dist.is_initialized():
            _check_tiling(group, tp_group)
        if compute_dtype not in (torch.bfloat16, torch.float16) and tp_group is not None and tp_comm == "fused":
            raise ValueError("model.tp_comm=fused computes the tensor-parallel projections in bf16 or fp16 (the fused "
                             "kernels' dtypes): set model.precision=bf16, or use model.tp_comm=bulk")
        self.compute_dtype, self.allocation_timeout_s = compute_dtype, allocation_timeout_s
        tp = TPLayout(tp_group, tp_comm, sequence_parallel, seed, num_layers, allocation_timeout_s)
        self.tp_size, self.sequence_parallel = tp.size, tp.sequence_parallel
        self.tp_rank = dist.get_rank(tp_group) if tp_group is not None else 0
        self.data_parallel_group = group
        # The ranks holding different tokens: they split the experts, and sum the losses and the gradients of what
        # every rank holds whole (under sequence parallelism: every rank of the world).
        self.group = None if self.sequence_parallel else group
        self.embedding = nn.Embedding(vocab_size, d_model)
        blocks = []
        for i in range(num_layers):
            is_moe = (i + 1) % moe_every == 0
            if is_moe:
                ffn_module = ShardedMoELayer(d_model, ffn, num_experts, top_k, group=self.group,
                                             capacity_factor=capacity_factor, drop_policy=drop_policy,
                                             seed=derive_seed(seed, "moe", i),
                                             comm=moe_comm, fused=moe_fused,
                                             statistics_group=tp_group if self.sequence_parallel else None)
            else:
                ffn_module = SwiGLU(d_model, ffn, tp, "block", i, "ffn")
            shared = SwiGLU(d_model, ffn, tp, "block", i, "shared") if is_moe and shared_expert else None
            blocks.append(Block(d_model, num_heads, ffn_module, shared, tp, i))
        self.blocks = nn.ModuleList(blocks)
        self.norm = nn.RMSNorm(d_model, eps=1e-6)
        self._init_replicated(seed)
        if compute_dtype is not None and compute_dtype != torch.float32:
            # The experts' weights are most of the model: an optimizer that writes compute copies
            # (fused_dlrm.train.adamw.AdamW, the configs' default) saves each forward their cast.
            for experts in (m for m in self.modules() if isinstance(m, SwiGLUExperts)):
                want_compute_copy(experts.w13, compute_dtype)
                want_compute_copy(experts.w2, compute_dtype)

    def _init_replicated(self, seed: int) -> None:
        """Normal(0, 0.02) for the embedding, ones for the norms, from one generator in parameter order; the
        projections (TPLayout: Normal(0, 0.02), residual outputs scaled by 1/sqrt(2 layers)) and the MoE layers
        (router and experts) keep the initialisation they gave themselves from their seeds."""
        generator = torch.Generator().manual_seed(derive_seed(seed, "replicated"))
        own_init = {id(p) for m in self.modules() if isinstance(m, (MoELayer, TPLinear)) for p in m.parameters()}
        with torch.no_grad():
            for name, p in self.named_parameters():
                if id(p) in own_init:
                    continue
                if "norm" in name:
                    p.fill_(1.0)
                    continue
                p.copy_(torch.randn(p.shape, generator=generator, dtype=torch.float64) * 0.02)

    def local_tokens(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's rows of t [B, S, ...] (tokens, targets) flattened to [B * S, ...], those of `forward`'s
        logits: all of them, or under sequence parallelism its contiguous 1/tp_size (TP rank r: the r-th); of a
        batch that does not cut into tp_size equal parts, none: `forward` runs it empty and raises on every rank
        (`_not_cut`), and a step's loss over no targets reaches the backward, where that refusal is raised if the
        forward did not (MoELayer's refused inputs: the fused dispatch with max_tokens_per_rank on NCCL). Raising
        here would stop this TP group alone, the others left in the loss' all-reduce over the world."""
        rows = t.reshape(-1, *t.shape[2:])
        if not self.sequence_parallel:
            return rows
        if rows.shape[0] % self.tp_size:
            return rows[:0]
        per_rank = rows.shape[0] // self.tp_size
        return rows[self.tp_rank * per_rank:(self.tp_rank + 1) * per_rank]

    def gradient_groups(self) -> list[tuple[str, list[nn.Parameter], dist.ProcessGroup | None]]:
        """(what, parameters, group) of the gradients summed over ranks after backward (group None: the world):
        the TP projections' shards over the data-parallel group (a TP group's ranks each hold a different shard,
        whose gradient already covers the TP group's tokens); everything else but the experts (which are complete
        on their owner) over `group`. Without sequence parallelism the two groups are one."""
        experts, shards = self._expert_and_shard_ids()
        replicated = [p for p in self.parameters() if id(p) not in experts]
        if not self.sequence_parallel:
            return [("replicated", replicated, self.group)]
        return [("TP shards, data-parallel group", [p for p in replicated if id(p) in shards],
                 self.data_parallel_group),
                ("the rest, world", [p for p in replicated if id(p) not in shards], self.group)]

    def gradient_copies(self) -> list[tuple[list[nn.Parameter], int]]:
        """(parameters, copies): how many ranks of the world hold the same values of those parameters (after
        moe.train.sync_gradients, the same gradients too), for a norm of the whole model that counts every value
        once. An expert: the tp_size ranks of a TP group (they route the same tokens to the same slice of the
        experts; under sequence parallelism every rank's experts are its own: 1); a TP projection's shard: its
        data-parallel group (world / tp_size); everything else: every rank."""
        world = world_size()
        experts, shards = self._expert_and_shard_ids()
        kinds = [([], world // world_size(self.group)), ([], world // self.tp_size), ([], world)]
        for p in self.parameters():
            kinds[0 if id(p) in experts else 1 if id(p) in shards else 2][0].append(p)
        return kinds

    def _expert_and_shard_ids(self) -> tuple[set[int], set[int]]:
        """The ids of the experts' parameters and of the TP projections' shards."""
        return ({id(p) for p in expert_parameters(self)},
                {id(p) for m in self.modules() if isinstance(m, TPLinear) for p in m.parameters()})

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """tokens [B, S] int64 (the same on every rank of a TP group) -> (logits, aux): logits [B, S, vocab], or
        under sequence parallelism [this rank's rows, vocab] (`local_tokens`' rows); fp32, or float64 for a float64
        model.

        aux: load_balancing_loss and z_loss summed over the MoE layers (this rank's tokens, unscaled), and
        tokens_per_expert: one [num_experts] tensor per MoE layer (this rank's kept assignments).
        A token id outside [0, vocab_size) on any rank, or under sequence parallelism a batch of tokens that do not
        cut into tp_size equal parts, raises ValueError on every rank, where the first MoE layer reads its counts
        (`_in_vocabulary`, `_not_cut`; MoELayer's refused inputs)."""
        with torch.autocast(tokens.device.type, dtype=self.compute_dtype, enabled=self.compute_dtype is not None):
            logits, aux = self._forward(tokens)
        if not self.sequence_parallel:
            logits = logits.view(*tokens.shape, logits.shape[-1])  # not -1: a batch of no samples has no size to infer
        # fp32 at least: mixed precision's bf16 logits come out fp32, a float64 model's (the tests' references) stay
        return logits.to(torch.promote_types(logits.dtype, torch.float32)), aux

    def _forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, dict]:
        uncut = self._not_cut(tokens)
        if uncut is not None:
            tokens = tokens[:0]  # no sample: the TP group's collectives run alike up to the MoE layer that raises
        batch_shape = tuple(tokens.shape)
        ids, refused = self._in_vocabulary(self.local_tokens(tokens))
        refused = uncut if uncut is not None else refused
        x = self.embedding(ids)
        lb = z = x.new_zeros(())
        tokens_per_expert = []
        for block in self.blocks:
            x, aux = block(x, batch_shape, refused)
            if aux is not None:
                refused = None  # the first MoE layer's exchange carries it to every rank
                lb = lb + aux["load_balancing_loss"]
                z = z + aux["z_loss"]
                tokens_per_expert.append(aux["tokens_per_expert"])
        logits = self.norm(x) @ self.embedding.weight.t()
        return logits, {"load_balancing_loss": lb, "z_loss": z, "tokens_per_expert": tokens_per_expert}

    def _not_cut(self, tokens: torch.Tensor) -> torch.Tensor | None:
        """The refusal words of a batch that sequence parallelism cannot cut into tp_size equal parts (None: it
        can, or no sequence parallelism). Raised in this TP group alone, they would leave the other groups in the
        first MoE layer's exchange over the world; that exchange carries the words to every rank instead."""
        if not self.sequence_parallel or tokens.numel() % self.tp_size == 0:
            return None
        return torch.tensor([BATCH_NOT_CUT, tokens.numel(), self.tp_size], device=tokens.device)

    def _in_vocabulary(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """ids with those outside [0, vocab_size) clamped into it -> (those ids, the refusal words of a batch that
        held any: the largest id past the vocabulary, else the smallest below 0; None for no ids), on the ids'
        device without a host sync. Looked up as they are, such ids would stop this rank alone (an IndexError on
        the CPU, a device-side assert on GPUs), its peers left waiting in the next exchange; the first MoE layer
        carries the words in its counts' exchange instead, and every rank raises (MoELayer's `refused`)."""
        if not ids.numel():
            return ids, None
        vocab = self.embedding.num_embeddings
        low, high = ids.aminmax()
        code = ((low < 0) | (high >= vocab)).long() * TOKEN_OUT_OF_VOCABULARY
        words = torch.stack([code, torch.where(high >= vocab, high, low), torch.full_like(code, vocab)])
        return ids.clamp(0, vocab - 1), words


def _check_tiling(group: dist.ProcessGroup | None, tp_group: dist.ProcessGroup) -> None:
    """The data-parallel and TP groups must tile the world (as fused_dlrm.tp.tp_groups makes them): each
    data-parallel group holds one TP rank's shards, as many ranks as there are TP groups. A data-parallel group of
    the whole world (None, or given), or one that holds another TP rank (the TP group given as both, or groups
    crossed over the TP groups), would sum different TP shards' gradients, its MoE layers routing a batch twice.
    Every rank checks every rank's groups (one gather), so all raise alike."""
    every = of_every_rank([dist.get_process_group_ranks(g) for g in (group or dist.group.WORLD, tp_group)])
    world = len(every)
    for rank, (data, tp) in enumerate(every):
        if len(data) * len(tp) != world:
            raise ValueError(f"with a TP group, pass the data-parallel group too (fused_dlrm.tp.tp_groups makes "
                             f"both): rank {rank}'s group of {len(data)} ranks with TP groups of {len(tp)} does not "
                             f"tile the world of {world} (the whole world would sum different TP shards' gradients)")
        tp_ranks = sorted({every[other][1].index(other) for other in data})
        if len(tp_ranks) > 1:
            raise ValueError(f"rank {rank}: the data-parallel group {data} holds TP ranks {tp_ranks} (TP groups "
                             f"{sorted({tuple(every[other][1]) for other in data})}): each must hold one TP rank's "
                             f"shards, the groups tiling the world (fused_dlrm.tp.tp_groups makes both)")


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The experts' w13/w2: each rank owns its own slice (not replicated)."""
    return [p for m in model.modules() if isinstance(m, SwiGLUExperts) for p in m.parameters()]
