"""A small decoder-only Mixture-of-Experts Transformer over bytes.

Block: x + attn(rmsnorm(x)), then + ffn(rmsnorm(.)). Attention is causal self-attention with rotary position
embedding (F.scaled_dot_product_attention, is_causal=True). The FFN is the project's expert-parallel MoELayer in
every `moe_every`-th layer (layers moe_every-1, 2*moe_every-1, ...) and a dense SwiGLU in the others; with
`shared_expert` a dense SwiGLU runs on every token beside the routed experts and is added to their output.
The output head is tied to the byte embedding (logits = h @ embedding.weight.T).

Initialisation is a function of the seed only: the replicated parameters are drawn from one generator in a fixed
order (identical on every rank, whatever the world size); the experts are seeded per global expert by MoELayer,
so a rank holding a slice of the experts has exactly the weights a one-process model has for them.
"""

from __future__ import annotations

import hashlib
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from moe.experts import SwiGLUExperts
from moe.layer import MoELayer


def derive_seed(*parts: object) -> int:
    """A 40-bit seed from a stable hash of `parts` (small enough for MoELayer's per-expert seeds)."""
    digest = hashlib.blake2b("/".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 40) - 1)


class SwiGLU(nn.Module):
    """Dense FFN: (silu(x W1) * (x W3)) W2."""

    def __init__(self, d_model: int, ffn: int):
        super().__init__()
        self.w1 = nn.Linear(d_model, ffn, bias=False)
        self.w3 = nn.Linear(d_model, ffn, bias=False)
        self.w2 = nn.Linear(ffn, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


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


def rotary(x: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotary position embedding of x [B, heads, S, head_dim] (rotate-half form, positions 0..S-1)."""
    seq, dim = x.shape[-2], x.shape[-1]
    inv_freq = 1.0 / base ** (torch.arange(0, dim, 2, device=x.device, dtype=torch.float32) / dim)
    angles = torch.arange(seq, device=x.device, dtype=torch.float32)[:, None] * inv_freq[None, :]
    cos, sin = torch.cat([angles, angles], -1).cos().to(x.dtype), torch.cat([angles, angles], -1).sin().to(x.dtype)
    x1, x2 = x[..., : dim // 2], x[..., dim // 2:]
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, num_heads: int):
        super().__init__()
        if d_model % num_heads or (d_model // num_heads) % 2:
            raise ValueError(f"d_model={d_model} must split into {num_heads} heads of an even size")
        self.num_heads = num_heads
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.out = nn.Linear(d_model, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.num_heads, d // self.num_heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(rotary(q), rotary(k), v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, s, d))


class Block(nn.Module):
    def __init__(self, d_model: int, num_heads: int, ffn: nn.Module, shared: nn.Module | None):
        super().__init__()
        self.attn_norm = nn.RMSNorm(d_model, eps=1e-6)
        self.attn = CausalSelfAttention(d_model, num_heads)
        self.ffn_norm = nn.RMSNorm(d_model, eps=1e-6)
        self.ffn = ffn
        self.shared_expert = shared

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, dict | None]:
        x = x + self.attn(self.attn_norm(x))
        h = self.ffn_norm(x)
        if isinstance(self.ffn, MoELayer):
            y, aux = self.ffn(h.reshape(-1, h.shape[-1]))
            y = y.view_as(h)
            if self.shared_expert is not None:
                y = y + self.shared_expert(h)
            return x + y, aux
        return x + self.ffn(h), None


class MoETransformer(nn.Module):
    def __init__(self, vocab_size: int = 256, d_model: int = 64, num_layers: int = 2, num_heads: int = 4,
                 ffn: int = 128, num_experts: int = 4, top_k: int = 2, moe_every: int = 1,
                 shared_expert: bool = False, capacity_factor: float | None = None, seed: int = 0,
                 group: dist.ProcessGroup | None = None):
        super().__init__()
        if moe_every not in (1, 2):
            raise ValueError(f"moe_every must be 1 or 2, got {moe_every}")
        self.embedding = nn.Embedding(vocab_size, d_model)
        blocks = []
        for i in range(num_layers):
            is_moe = (i + 1) % moe_every == 0
            if is_moe:
                ffn_module = ShardedMoELayer(d_model, ffn, num_experts, top_k, group=group,
                                             capacity_factor=capacity_factor, seed=derive_seed(seed, "moe", i))
            else:
                ffn_module = SwiGLU(d_model, ffn)
            blocks.append(Block(d_model, num_heads, ffn_module, SwiGLU(d_model, ffn) if is_moe and shared_expert
                                else None))
        self.blocks = nn.ModuleList(blocks)
        self.norm = nn.RMSNorm(d_model, eps=1e-6)
        self._init_replicated(seed, num_layers)

    def _init_replicated(self, seed: int, num_layers: int) -> None:
        """Normal(0, 0.02) for embeddings and projections (residual outputs scaled by 1/sqrt(2 layers)), ones
        for the norms, from one generator in parameter order; the MoE layers (router and experts) keep the
        initialisation MoELayer gave them from their seeds."""
        generator = torch.Generator().manual_seed(derive_seed(seed, "replicated"))
        moe_params = {id(p) for m in self.modules() if isinstance(m, MoELayer) for p in m.parameters()}
        with torch.no_grad():
            for name, p in self.named_parameters():
                if id(p) in moe_params:
                    continue
                if "norm" in name:
                    p.fill_(1.0)
                    continue
                std = 0.02 / math.sqrt(2 * num_layers) if name.endswith(("out.weight", "w2.weight")) else 0.02
                p.copy_(torch.randn(p.shape, generator=generator, dtype=torch.float64) * std)

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """tokens [B, S] int64 -> (logits [B, S, vocab], aux).

        aux: load_balancing_loss and z_loss summed over the MoE layers (this rank's tokens, unscaled), and
        tokens_per_expert: one [num_experts] tensor per MoE layer (this rank's kept assignments)."""
        x = self.embedding(tokens)
        lb = z = x.new_zeros(())
        tokens_per_expert = []
        for block in self.blocks:
            x, aux = block(x)
            if aux is not None:
                lb = lb + aux["load_balancing_loss"]
                z = z + aux["z_loss"]
                tokens_per_expert.append(aux["tokens_per_expert"])
        logits = self.norm(x) @ self.embedding.weight.t()
        return logits, {"load_balancing_loss": lb, "z_loss": z, "tokens_per_expert": tokens_per_expert}


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The experts' w1/w2/w3: each rank owns its own slice (not replicated)."""
    return [p for m in model.modules() if isinstance(m, SwiGLUExperts) for p in m.parameters()]
