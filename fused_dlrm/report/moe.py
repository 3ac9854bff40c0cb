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
from fused_dlrm.train.compute_copies import mirror_compute_copy
from moe.expert_layout import gather_counts
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
            mirror_compute_copy(mine, theirs)  # the experts' bf16 copies, where the layer computes with them
    return fused, build_model(fused_cfg, env)


# Per-row metadata of the exchanges by token (moe/kernels/fused_dispatch.py, fused_combine.py): the dispatch sends
# each row's token id (int32) and routing weight (fp32); the combine's backward returns each row's routing weight
# gradient as one int64 word (epoch << 32 | fp32 bits: the word is its own flag).
ID_AND_WEIGHT_BYTES = 8
WEIGHT_GRAD_WORD_BYTES = 8


def routes_per_owner(expert_ids: torch.Tensor, kept: torch.Tensor, num_local_experts: int,
                     world: int) -> torch.Tensor:
    """One rank's routing (expert_ids, kept: [tokens, top_k], moe.routing.Routing) -> [2, world]: its tokens with a
    kept assignment to an expert of each rank, and its kept assignments (rows) to each rank."""
    chose = torch.nn.functional.one_hot(expert_ids // num_local_experts, world).bool() & kept[..., None]
    return torch.stack([chose.any(dim=1).sum(dim=0), chose.sum(dim=(0, 1))])


def moe_bytes_sent(routes: torch.Tensor, rank: int, row_bytes: int, dispatch_by_token: bool,
                   combine_by_token: bool) -> dict[str, int]:
    """The bytes `rank` sends to other ranks in one MoE layer's forward and forward+backward, from every rank's
    `routes_per_owner` ([source, 2, owner]); row_bytes: a row of d_model in the rows' dtype. Flags and
    acknowledgements are left out.

    By row (the bulk all-to-alls, and the fused layer's exchanges by row): each row routed to another rank goes out
    and each row another rank routed here comes back, forward; the same again backward (their gradients).
    Dispatch by token: each token once per other rank holding one of its experts, with each row's token id and
    routing weight. Combine by token: the owner returns one summed row per (token of another rank, this rank); its
    backward sends the output gradient once per (token, other owner) and returns each received row's routing weight
    gradient. The dispatch's backward returns each received row's input gradient in either mode."""
    tokens, rows = routes[:, 0], routes[:, 1]
    others = torch.arange(routes.shape[0], device=routes.device) != rank
    tokens_out, rows_out = int(tokens[rank, others].sum()), int(rows[rank, others].sum())
    tokens_in, rows_in = int(tokens[others, rank].sum()), int(rows[others, rank].sum())
    dispatch = tokens_out * row_bytes + rows_out * ID_AND_WEIGHT_BYTES if dispatch_by_token else rows_out * row_bytes
    combine = tokens_in * row_bytes if combine_by_token else rows_in * row_bytes
    combine_grad = (tokens_out * row_bytes + rows_in * WEIGHT_GRAD_WORD_BYTES if combine_by_token
                    else rows_out * row_bytes)
    dispatch_grad = rows_in * row_bytes
    return {"fwd": dispatch + combine, "fwd_bwd": dispatch + combine + combine_grad + dispatch_grad}


def fused_bytes_note(config: FusedMoEConfig) -> str:
    """What the fused column's bytes count, for the exchanges `config` makes."""
    if not config.dispatches_by_token:
        return ("bytes: fused (what its % of speed of light counts): the dispatch and combine by row move the bulk "
                "all-to-alls' rows (flags left out)")
    combine = ("combine by token: one summed row per (token of another rank, this rank) back; backward the output "
               "gradient once per (token, other owner), and per received row its input gradient and its routing "
               "weight's gradient (an 8-byte word)" if config.combines_by_token else
               "combine by row: one row per row dispatched to this rank's experts back; backward one row per row "
               "out and one per row received")
    return (f"bytes: fused (what its % of speed of light counts): dispatch by token: one row per (token, other rank "
            f"holding one of its experts) out, with each row's token id and routing weight (8 bytes); {combine} "
            f"(flags left out)")


def layer_modes(layer: MoELayer, x: torch.Tensor, grad: torch.Tensor, compute_dtype: torch.dtype | None) -> Mode:
    """The layer as the model runs it: under autocast to its compute dtype when it trains in mixed precision."""
    def forward():
        with torch.autocast(x.device.type, dtype=compute_dtype, enabled=compute_dtype is not None):
            return layer(x)[0]
    return {"fwd": no_grad(forward), "fwd_bwd": forward_backward(forward, grad)}


class _Run:
    """One model of the report, its optimizer, the first training batch and one MoE layer's real input; stepped
    once, as training's later steps find it."""

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
        # one training step before anything is timed: training's forwards from its second step on compute with the
        # experts' bf16 copies its optimizer writes (model.precision=bf16), a model never stepped casts them in each
        self.step()

    def step(self) -> None:
        """One training step: moe/train.py's own."""
        m = self.cfg.model
        train_step(self.model, self.optimizer, self.inputs, self.targets, m.aux_coeff, m.z_coeff, self.grad_allreduce,
                   m.clip_grad)

    def step_modes(self) -> Mode:
        return {"fwd": no_grad(lambda: self.model(self.inputs)), "fwd_bwd": self.step}


def moe_layers(cfg: DictConfig, env: DistEnv, run_dir: Path) -> list[CommLayer]:
    check_config(cfg)  # what training refuses is not timed
    # the fused column's settings, refused as training's, built or not; they say how its exchanges go (bytes)
    fused_config = fused_moe_config(with_modes(cfg, "fused"), env)
    m = cfg.model
    bulk_cfg = with_modes(cfg, "bulk")
    bulk = _Run(bulk_cfg, env, build_model(bulk_cfg, env), run_dir, "nccl")
    layer, x = bulk.layer, bulk.x
    fused_layer, fused_model = fused_moe(cfg, env, layer)
    fused = None if isinstance(fused_model, str) else _Run(cfg, env, fused_model, run_dir, cfg.comm.grad_allreduce)

    # This rank sends, in the dispatch, its rows routed to experts of other ranks, and in the combine, back, the rows
    # other ranks routed to its experts (as many again the other way in the backward): uneven routing makes the two
    # differ, and the ranks' sums too. The fused exchanges by token send fewer rows (moe_bytes_sent). The routing is
    # the timed forward's: under autocast to the compute dtype where the model trains in mixed precision.
    compute_dtype = bulk.model.compute_dtype  # None: fp32 throughout
    with torch.no_grad(), torch.autocast(x.device.type, dtype=compute_dtype, enabled=compute_dtype is not None):
        routing = layer.router(x)
    routes = gather_counts(routes_per_owner(routing.expert_ids, routing.kept, layer.num_local_experts,
                                            layer.world).flatten(), layer.group).view(layer.world, 2, layer.world)
    rows_dtype = compute_dtype or x.dtype  # what the dispatch and combine move
    row_bytes = m.d_model * rows_dtype.itemsize
    bulk_bytes = moe_bytes_sent(routes, layer.rank, row_bytes, dispatch_by_token=False, combine_by_token=False)
    fused_bytes = moe_bytes_sent(routes, layer.rank, row_bytes, fused_config.dispatches_by_token,
                                 fused_config.combines_by_token)
    num_moe = sum(1 for module in bulk.model.modules() if isinstance(module, MoELayer))
    moe_layer = CommLayer(
        "MoE layer (route, dispatch all-to-all, experts, combine all-to-all)",
        f"{x.shape[0]} tokens x d={m.d_model} {str(rows_dtype).removeprefix('torch.')}, "
        f"{counted(m.num_experts, 'expert', 'experts')} ({layer.num_local_experts} here) top-{m.top_k}, ffn {m.ffn}",
        bulk_bytes, layer_modes(layer, x, bulk.grad, compute_dtype),
        fused_layer if isinstance(fused_layer, str) else layer_modes(fused_layer, x, bulk.grad, compute_dtype),
        count=num_moe)
    moe_layer.notes.append("input: random hidden states of the real shape (the routing is that of random tokens)")
    moe_layer.notes.append("bytes: bulk: the all-to-alls' rows, one per (token, expert of another rank) out and one "
                           "per row dispatched to this rank's experts back, forward, as many backward")
    if not isinstance(fused_layer, str):
        moe_layer.fused_bytes_sent = fused_bytes
        moe_layer.notes.append(fused_bytes_note(fused_config))

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
        return {p: sum(bytes_of(layer, mode).get(p, 0) * layer.count
                       for layer in [moe_layer, *projections, *allreduces])
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
