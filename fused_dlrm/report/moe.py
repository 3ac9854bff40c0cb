"""The communicating layers of the MoE Transformer a config trains, with its real shapes, in both modes.

The MoE layers (route, dispatch all-to-all, experts, combine all-to-all) all share one shape, so one of them is
timed and counted num_moe_layers times; with model.tp_size > 1 each kind of tensor-parallel projection
(report/tp.py); the replicated gradients' all-reduce (plain against the configured comm.grad_allreduce codec); and
the whole training step. bulk: comm.mode=bulk and model.tp_comm=bulk; fused: comm.mode=fused (the configured fused
settings, or FusedMoEConfig's defaults when the run is bulk) and, in bf16 mixed precision, model.tp_comm=fused.
Whether a fused model exists on this machine is decided in one place, `fused_moe`. A config moe/train.py's train
refuses is refused here too, by the same checks (check_config, build_model, build_optimizer): the fused column is
p2p, the MoE layers' only transport, as in training.
"""

from __future__ import annotations

from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from fused_dlrm.dist import DistEnv
from fused_dlrm.report.layers import (STEP, CommLayer, Mode, bytes_of, counted, forward_backward,
                                      grad_allreduce_layer, no_fused_path, no_grad)
from fused_dlrm.report.tp import tp_layers
from moe.layer import FusedMoEConfig, MoELayer
from moe.train import build_data, build_model, build_optimizer, check_config, fused_moe_config, train_step


def with_modes(cfg: DictConfig, mode: str) -> DictConfig:
    """cfg with the MoE layers' comm and the TP projections' switched to `mode`, as the module docstring says."""
    c = OmegaConf.to_container(cfg, resolve=True)
    if mode == "bulk":
        c["comm"] = {**c["comm"], "mode": "bulk"}
        c["model"]["tp_comm"] = "bulk"
    else:
        defaults = {"num_programs": FusedMoEConfig.num_programs,
                    "wait_timeout_spins": FusedMoEConfig.wait_timeout_spins,
                    "moe_dispatch": FusedMoEConfig.dispatch, "moe_combine": FusedMoEConfig.combine}
        c["comm"] = {**defaults, **c["comm"], "mode": "fused"}  # the transport p2p: check_config refuses others
        c["model"]["tp_comm"] = "fused" if c["model"].get("precision", "fp32") == "bf16" else "bulk"
    return OmegaConf.create(c)


def fused_moe(cfg: DictConfig, env: DistEnv, layer: MoELayer) -> tuple[MoELayer | str, nn.Module | str]:
    """The fused twins of one MoE layer (same shapes and weights as `layer`) and of the whole model (the same
    config in the fused mode: the same seeded weights), or why there are none here."""
    reason = no_fused_path(env)
    if reason:
        return reason, reason
    m = cfg.model
    fused_cfg = with_modes(cfg, "fused")
    router = layer.router  # its routing settings, not the config's again: the twin routes as the bulk layer does
    fused = MoELayer(m.d_model, m.ffn, m.num_experts, m.top_k, group=layer.group,
                     capacity_factor=router.capacity_factor, renormalize=router.renormalize,
                     drop_policy=router.drop_policy, device=env.device, comm="fused",
                     fused=fused_moe_config(fused_cfg, env),
                     statistics_group=router.statistics_group)  # the same routing collectives as the bulk one
    with torch.no_grad():  # router then experts in both (the model's layer renames its experts module only)
        for mine, theirs in zip(fused.parameters(), layer.parameters(), strict=True):
            mine.copy_(theirs)
    return fused, build_model(fused_cfg, env)


def layer_modes(layer: MoELayer, x: torch.Tensor, grad: torch.Tensor, compute_dtype: torch.dtype | None) -> Mode:
    """The layer as the model runs it: under autocast to its compute dtype when it trains in mixed precision."""
    def forward():
        with torch.autocast(x.device.type, dtype=compute_dtype, enabled=compute_dtype is not None):
            return layer(x)[0]
    return {"fwd": no_grad(forward), "fwd_bwd": forward_backward(forward, grad)}


class _Run:
    """One model of the report, its optimizer, the first training batch and one MoE layer's real input."""

    def __init__(self, cfg: DictConfig, env: DistEnv, model: nn.Module, run_dir: Path, grad_allreduce: str):
        self.cfg, self.env, self.model, self.grad_allreduce = cfg, env, model, grad_allreduce
        self.optimizer, _ = build_optimizer(cfg, model)  # the lr schedule checked as training checks it
        train_data, _ = build_data(cfg, env, run_dir)
        self.inputs, self.targets = (t.to(env.device) for t in train_data.batch(0))
        self.layer = next(m for m in model.modules() if isinstance(m, MoELayer))
        generator = torch.Generator(device=env.device).manual_seed(1000 + env.rank)
        rows = model.local_tokens(self.inputs).numel()  # this rank's tokens (a part of them under sequence parallelism)
        # requiring a gradient, as a layer's input in the model does: its backward then returns the input gradient
        # through the dispatch's all-to-all (or fused push), which the timed forward+backward must include
        self.x = torch.randn(rows, cfg.model.d_model, device=env.device, generator=generator).requires_grad_()
        self.grad = torch.randn_like(self.x)

    def step(self) -> None:
        """One training step: moe/train.py's own."""
        m = self.cfg.model
        train_step(self.model, self.optimizer, self.inputs, self.targets, m.aux_coeff, m.z_coeff, self.grad_allreduce,
                   m.clip_grad)

    def step_modes(self) -> Mode:
        return {"fwd": no_grad(lambda: self.model(self.inputs)), "fwd_bwd": self.step}


def moe_layers(cfg: DictConfig, env: DistEnv, run_dir: Path) -> list[CommLayer]:
    check_config(cfg)  # what training refuses is not timed
    fused_moe_config(with_modes(cfg, "fused"), env)  # the fused column's settings, refused as training's, built or not
    m = cfg.model
    bulk_cfg = with_modes(cfg, "bulk")
    bulk = _Run(bulk_cfg, env, build_model(bulk_cfg, env), run_dir, "nccl")
    layer, x = bulk.layer, bulk.x
    fused_layer, fused_model = fused_moe(cfg, env, layer)
    fused = None if isinstance(fused_model, str) else _Run(cfg, env, fused_model, run_dir, cfg.comm.grad_allreduce)

    # This rank sends, in the dispatch, its rows routed to experts of other ranks, and in the combine, back, the rows
    # other ranks routed to its experts (as many again the other way in the backward): uneven routing makes the two
    # differ, and the ranks' sums too.
    with torch.no_grad():
        aux = layer(x)[1]
    per_expert = aux["tokens_per_expert"]  # this rank's rows per expert
    mine = torch.arange(layer.num_experts, device=x.device) // layer.num_local_experts == layer.rank
    from_others = aux["tokens_per_local_expert"].sum() - per_expert[mine].sum()
    sent_rows = int(per_expert[~mine].sum() + from_others)
    compute_dtype = bulk.model.compute_dtype  # None: fp32 throughout
    rows_dtype = compute_dtype or x.dtype  # what the dispatch and combine move
    forward_bytes = sent_rows * m.d_model * rows_dtype.itemsize
    num_moe = sum(1 for module in bulk.model.modules() if isinstance(module, MoELayer))
    moe_layer = CommLayer(
        "MoE layer (route, dispatch all-to-all, experts, combine all-to-all)",
        f"{x.shape[0]} tokens x d={m.d_model} {str(rows_dtype).removeprefix('torch.')}, "
        f"{counted(m.num_experts, 'expert', 'experts')} ({layer.num_local_experts} here) top-{m.top_k}, ffn {m.ffn}",
        {"fwd": forward_bytes, "fwd_bwd": 2 * forward_bytes},
        layer_modes(layer, x, bulk.grad, compute_dtype),
        fused_layer if isinstance(fused_layer, str) else layer_modes(fused_layer, x, bulk.grad, compute_dtype),
        count=num_moe)
    moe_layer.notes.append("input: random hidden states of the real shape (the routing is that of random tokens)")
    moe_layer.notes.append("bytes: the bulk all-to-alls' rows, one per (token, expert of another rank) out and one "
                           "per row dispatched to this rank's experts back; the fused dispatch and combine by token "
                           "move one per (token, other rank), fewer with top-k > 1, so the fused % of speed of light "
                           "is an upper bound")

    fused_tp = fused_model
    if not isinstance(fused_model, str) and m.get("precision", "fp32") != "bf16":
        fused_tp = "model.tp_comm=fused computes in bf16: set model.precision=bf16"
    projections = tp_layers(bulk.model, fused_tp, x.shape[0], compute_dtype)

    # the gradients summed after backward, one flat all-reduce per group (MoETransformer.gradient_groups)
    groups = bulk.model.gradient_groups()
    allreduces = [grad_allreduce_layer([p.numel() for p in params], cfg.comm.grad_allreduce, env,
                                       no_fused_path(env), cfg.comm.allocation_timeout_s, group,
                                       "gradient all-reduce" + ("" if len(groups) == 1 else f" ({what})"))
                  for what, params, group in groups]

    def step_bytes(mode: str) -> dict[str, int]:
        return {p: num_moe * forward_bytes * (2 if p == "fwd_bwd" else 1)
                + sum(bytes_of(layer, mode).get(p, 0) * layer.count for layer in [*projections, *allreduces])
                for p in ("fwd", "fwd_bwd")}

    step = CommLayer(
        STEP,
        f"{cfg.data.global_batch_size} x {cfg.data.seq_len} tokens over {env.world_size} rank(s), "
        f"{m.num_layers} layers",
        step_bytes("bulk"), bulk.step_modes(), fused_model if isinstance(fused_model, str) else fused.step_modes(),
        fused_bytes_sent=step_bytes("fused"))
    step.notes.append("bytes: each MoE layer counted as the timed one (the routing of random tokens, not the "
                      "batch's)")
    return [moe_layer, *projections, *allreduces, step]
