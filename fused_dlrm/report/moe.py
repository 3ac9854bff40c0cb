"""The communicating layers of the MoE Transformer a config trains, with its real shapes, in both modes.

The MoE layers (route, dispatch all-to-all, experts, combine all-to-all) all share one shape, so one of them is
timed and counted num_moe_layers times; the replicated gradients' all-reduce (plain against the configured
comm.grad_allreduce codec); and the whole training step. Whether a fused MoE model exists on this machine is
decided in one place, `fused_moe_model`.
"""

from __future__ import annotations

from pathlib import Path

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig
from torch import nn

from fused_dlrm.dist import DistEnv, all_reduce_sum
from fused_dlrm.report.layers import (STEP, CommLayer, Mode, forward_backward, fused_or_reason,
                                      grad_allreduce_layer, no_fused_path, no_grad)
from moe.layer import MoELayer
from moe.train import build_data, build_model, sync_gradients, token_cross_entropy_sum
from moe.transformer import expert_parameters


def fused_moe_model(cfg: DictConfig, env: DistEnv) -> nn.Module | str:
    """The MoE Transformer with fused dispatch and combine, or why there is none here. Extend this function when
    moe/layer.py gains a fused mode: build the model with it; the report then times its first MoE layer and its
    training step as the fused column."""
    return no_fused_path(env) or "no fused MoE dispatch / combine yet (moe/layer.py is bulk only)"


class _Run:
    """One model of the report, its optimizer, the first training batch and one MoE layer's real input."""

    def __init__(self, cfg: DictConfig, env: DistEnv, model: nn.Module, run_dir: Path, grad_allreduce: str):
        self.cfg, self.env, self.model, self.grad_allreduce = cfg, env, model, grad_allreduce
        self.optimizer = instantiate(cfg.model.optimizer, params=model.parameters())
        train_data, _ = build_data(cfg, env, run_dir)
        self.inputs, self.targets = (t.to(env.device) for t in train_data.batch(0))
        self.layer = next(m for m in model.modules() if isinstance(m, MoELayer))
        generator = torch.Generator(device=env.device).manual_seed(1000 + env.rank)
        self.x = torch.randn(self.inputs.numel(), cfg.model.d_model, device=env.device, generator=generator)
        self.grad = torch.randn_like(self.x)

    def layer_modes(self) -> Mode:
        forward = lambda: self.layer(self.x)[0]
        return {"fwd": no_grad(forward), "fwd_bwd": forward_backward(forward, self.grad)}

    def step(self) -> None:
        """One training step as moe/train.py takes it."""
        m, world = self.cfg.model, self.env.world_size
        logits, aux = self.model(self.inputs)
        global_tokens = all_reduce_sum(torch.tensor(float(self.targets.numel()), device=self.env.device))
        ce = token_cross_entropy_sum(logits, self.targets) * world / global_tokens
        loss = ce + m.aux_coeff * aux["load_balancing_loss"] + m.z_coeff * aux["z_loss"]
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        sync_gradients(self.model, world, self.grad_allreduce)
        self.optimizer.step()

    def step_modes(self) -> Mode:
        return {"fwd": no_grad(lambda: self.model(self.inputs)), "fwd_bwd": self.step}


def moe_layers(cfg: DictConfig, env: DistEnv, run_dir: Path) -> list[CommLayer]:
    m = cfg.model
    bulk = _Run(cfg, env, build_model(cfg, env), run_dir, "nccl")
    fused_model = fused_moe_model(cfg, env)
    fused = None if isinstance(fused_model, str) else _Run(cfg, env, fused_model, run_dir, cfg.comm.grad_allreduce)
    reason = fused_model if isinstance(fused_model, str) else None
    layer, x = bulk.layer, bulk.x

    # Rows routed to experts of other ranks leave in the dispatch and come back in the combine; backward the same.
    with torch.no_grad():
        per_expert = layer(x)[1]["tokens_per_expert"]
    owner = torch.arange(layer.num_experts, device=x.device) // layer.num_local_experts
    remote_rows = int(per_expert[owner != env.rank].sum())
    forward_bytes = 2 * remote_rows * m.d_model * x.element_size()
    num_moe = sum(1 for module in bulk.model.modules() if isinstance(module, MoELayer))
    moe_layer = CommLayer(
        "MoE layer (route, dispatch all-to-all, experts, combine all-to-all)",
        f"{x.shape[0]} tokens x d={m.d_model} {str(x.dtype).removeprefix('torch.')}, {m.num_experts} experts "
        f"({layer.num_local_experts} here) top-{m.top_k}, ffn {m.ffn}",
        {"fwd": forward_bytes, "fwd_bwd": 2 * forward_bytes},
        bulk.layer_modes(), fused_or_reason(reason, lambda: fused.layer_modes()), count=num_moe)
    moe_layer.notes.append("input: random hidden states of the real shape (the routing is that of random tokens)")

    experts = {id(p) for p in expert_parameters(bulk.model)}
    num_replicated = sum(p.numel() for p in bulk.model.parameters() if id(p) not in experts)
    allreduce = grad_allreduce_layer(num_replicated, cfg.comm.grad_allreduce, env, reason)

    step = CommLayer(
        STEP,
        f"{cfg.data.global_batch_size} x {cfg.data.seq_len} tokens over {env.world_size} rank(s), "
        f"{m.num_layers} layers",
        {"fwd": num_moe * forward_bytes,
         "fwd_bwd": num_moe * 2 * forward_bytes + allreduce.bytes_sent["fwd_bwd"]},
        bulk.step_modes(), fused_or_reason(reason, lambda: fused.step_modes()))
    return [moe_layer, allreduce, step]
