"""The MoE Transformer's training loop: read it top to bottom (it follows fused_dlrm/train/loop.py).

One step: this rank's slice of the global batch -> MoETransformer forward (the dispatch / combine all-to-alls
inside every MoE layer) -> loss = cross-entropy + aux_coeff * load balancing + z_coeff * z loss -> backward ->
`sync_gradients` (replicated parameters averaged over ranks) -> optimizer step. With model.tp_size > 1 the
world is split into tensor-parallel groups of consecutive ranks (the attention and dense FFN projections sharded
over each, activations replicated inside it) and data-parallel groups across them: the batch is split over the
data-parallel ranks (a TP group shares one slice), and gradients are averaged over the data-parallel group.
Every `log_every` steps the losses are reduced over ranks and checked for NaN/inf, and tokens/s and the expert
load are logged; every `eval_every` steps the eval loss is measured; every `checkpoint_every` steps a checkpoint
is written (only after the loss was checked). Only trainer.max_steps is supported (no epochs).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from hydra.utils import instantiate
from omegaconf import DictConfig
from torch import nn
from tqdm import tqdm

from fused_dlrm.dist import DistEnv, all_reduce_sum
from fused_dlrm.train.checkpoint import load_checkpoint, save_checkpoint
from fused_dlrm.train.loop import TrainResult
from fused_dlrm.train.schedule import MetricsLog, after_step, at_end, stop_if_nonfinite
from fused_dlrm.tp import quantized_all_reduce
from fused_dlrm.tp.linear import tp_groups
from moe.data import ByteWindows, load_corpus
from moe.transformer import MoETransformer, expert_parameters

log = logging.getLogger(__name__)


def build_model(cfg: DictConfig, env: DistEnv) -> MoETransformer:
    """The model on this rank; with model.tp_size > 1 it creates the TP and data-parallel groups (collective).
    `model.group` is the data-parallel group (None: the world)."""
    m = cfg.model
    if cfg.comm.mode == "fused" and cfg.comm.get("transport", "p2p") != "p2p":
        raise ValueError(f"comm.transport={cfg.comm.transport}: the MoE layers' fused dispatch and combine have the "
                         "p2p transport only")
    tp_group, dp_group = tp_groups(m.tp_size)
    model = MoETransformer(vocab_size=m.vocab_size, d_model=m.d_model, num_layers=m.num_layers,
                           num_heads=m.num_heads, ffn=m.ffn, num_experts=m.num_experts, top_k=m.top_k,
                           moe_every=m.moe_every, shared_expert=m.shared_expert,
                           capacity_factor=m.capacity_factor, seed=cfg.seed, group=dp_group, tp_group=tp_group,
                           tp_comm=m.tp_comm, moe_comm=cfg.comm.mode, moe_fused=cfg.comm)
    return model.to(env.device)


def build_data(cfg: DictConfig, env: DistEnv, run_dir: Path) -> tuple[ByteWindows, ByteWindows]:
    """This rank's slices of the batches: one slice per data-parallel rank (rank // tp_size of world // tp_size)."""
    d, tp_size = cfg.data, cfg.model.tp_size
    corpus = load_corpus(d.path, d.cache or run_dir / "corpus.txt", d.size_bytes)
    return tuple(ByteWindows(corpus, split, d.seq_len, d.global_batch_size, env.rank // tp_size,
                             env.world_size // tp_size, cfg.seed, d.eval_fraction) for split in ("train", "eval"))


def sum_over(t: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """In-place sum over the group's ranks (None: the world; nothing to do in one process)."""
    if dist.is_initialized():
        dist.all_reduce(t, group=group)
    return t


def sync_gradients(model: nn.Module, world_size: int, grad_allreduce: str = "nccl",
                   group: dist.ProcessGroup | None = None) -> None:
    """After backward: make every gradient that of the global-batch mean loss.

    world_size ranks of the data-parallel `group` (None: the world). Inside a TP group every rank already holds
    the complete gradient of its parameters (the TP linears' collectives), identical for the replicated ones.
    The loss each rank differentiates is its local sum times world / global tokens (DDP's convention), so:
    data-parallel replicas (everything but the experts' w1/w2/w3) are all-reduce-averaged, in one flat buffer;
    the experts' gradients are already complete on their owner (all_to_all_v's backward brought every rank's
    share home) but carry that factor of world size, which is divided out (torchrec's gradient division).
    grad_allreduce other than "nccl" averages the replicated ones with that codec (fused_dlrm.tp).
    """
    if world_size == 1:
        return
    experts = {id(p) for p in expert_parameters(model)}
    replicated = [p for p in model.parameters() if id(p) not in experts]
    for p in replicated:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    flat = torch.cat([p.grad.reshape(-1) for p in replicated])
    if grad_allreduce == "nccl":
        dist.all_reduce(flat, group=group)
        flat.div_(world_size)
    else:
        flat = quantized_all_reduce(flat, grad_allreduce, group=group, mean=True)
    offset = 0
    for p in replicated:
        p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
        offset += p.numel()
    for p in expert_parameters(model):
        if p.grad is not None:
            p.grad.div_(world_size)


def token_cross_entropy_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum")


def evaluate(model: nn.Module, dataset: ByteWindows, num_batches: int, env: DistEnv) -> float:
    """Mean cross-entropy per byte over `num_batches` eval batches of the global batch (a collective)."""
    total = torch.zeros(2, device=env.device)
    model.eval()
    with torch.no_grad():
        for step in range(num_batches):
            inputs, targets = (t.to(env.device) for t in dataset.batch(step))
            logits, _ = model(inputs)
            total[0] += token_cross_entropy_sum(logits, targets)
            total[1] += targets.numel()
    model.train()
    total = all_reduce_sum(total)
    return float(total[0] / total[1])


def train(cfg: DictConfig, env: DistEnv, run_dir: Path) -> TrainResult:
    t, m = cfg.trainer, cfg.model
    if t.max_steps is None:
        raise ValueError("the MoE Transformer trains for trainer.max_steps steps (trainer.epochs is not supported)")
    model = build_model(cfg, env)
    dp_size = env.world_size // m.tp_size
    optimizer = instantiate(m.optimizer, params=model.parameters())
    train_data, eval_data = build_data(cfg, env, run_dir)
    checkpoint_dir = Path(t.checkpoint_dir) if t.checkpoint_dir else run_dir / "checkpoints"

    step = 0
    if t.resume_from:
        step = load_checkpoint(t.resume_from, model, optimizer)
    result = TrainResult(step=step)
    metrics = MetricsLog(run_dir, env.is_main)
    bar = tqdm(total=t.max_steps, initial=step, disable=not (env.is_main and t.progress), desc="train")
    num_moe_layers = sum(1 for i in range(m.num_layers) if (i + 1) % m.moe_every == 0)
    # [sum of cross-entropy, of load-balancing loss, of z loss, count of non-finite total losses] per interval,
    # and the kept assignments per (MoE layer, expert)
    loss_sum = torch.zeros(4, device=env.device)
    expert_load = torch.zeros(num_moe_layers, m.num_experts, dtype=torch.int64, device=env.device)
    interval_start, interval_steps = time.perf_counter(), 0

    def check_loss() -> float:
        """Reduce the interval's losses and expert load over ranks; stop the run on NaN/inf (before any
        checkpoint is written)."""
        nonlocal interval_start, interval_steps
        total = all_reduce_sum(loss_sum.clone()).tolist()
        stop_if_nonfinite(total[3], step - interval_steps + 1, step, checkpoint_dir)
        load = sum_over(expert_load.clone(), model.group).double()  # a TP group's ranks route the same tokens
        samples = max(interval_steps * env.world_size, 1)
        ce, lb, z = (v / samples for v in total[:3])
        rate = interval_steps * cfg.data.global_batch_size * cfg.data.seq_len / (time.perf_counter() - interval_start)
        # max / mean tokens per expert of each MoE layer, over all ranks (1.0: perfectly balanced)
        imbalance = (load.max(dim=1).values / load.mean(dim=1).clamp(min=1e-9)).tolist()
        loss_sum.zero_()
        expert_load.zero_()
        interval_start, interval_steps = time.perf_counter(), 0
        result.losses.append((step, ce))
        metrics.record({"step": step, "loss": ce, "load_balancing_loss": lb, "z_loss": z, "tokens_per_s": rate,
                "expert_load_max_over_mean": imbalance, "tokens_per_expert": load.long().tolist()})
        bar.set_postfix(loss=f"{ce:.4f}", tokens_s=f"{rate:,.0f}")
        log.info("step %d loss %.5f lb %.4f z %.4f tokens/s %.0f expert max/mean %s", step, ce, lb, z, rate,
                 " ".join(f"{x:.2f}" for x in imbalance))
        return ce

    def run_eval() -> None:
        result.evals.append({"step": step, "eval_loss": evaluate(model, eval_data, cfg.data.eval_batches, env)})
        metrics.record(result.evals[-1])
        log.info("step %d eval loss %.4f", step, result.evals[-1]["eval_loss"])

    def checkpoint() -> None:
        nonlocal saved_step
        save_checkpoint(checkpoint_dir, step, model, optimizer, None, t.keep_checkpoints)
        saved_step = step

    saved_step = step
    while step < t.max_steps:
        inputs, targets = (x.to(env.device) for x in train_data.batch(step))
        logits, aux = model(inputs)
        # Sum over the local tokens / global tokens, times the data-parallel world size: averaging the replicated
        # gradients over the data-parallel ranks (sync_gradients) then gives the gradient of the global-batch
        # mean, uneven local batches weighted correctly. The auxiliary losses are per rank (over its tokens, as
        # Megatron's router computes them).
        global_tokens = sum_over(torch.tensor(float(targets.numel()), device=env.device), model.group)
        ce = token_cross_entropy_sum(logits, targets) * dp_size / global_tokens
        loss = ce + m.aux_coeff * aux["load_balancing_loss"] + m.z_coeff * aux["z_loss"]
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        sync_gradients(model, dp_size, cfg.comm.grad_allreduce, model.group)
        optimizer.step()
        loss_sum += torch.stack([ce.detach(), aux["load_balancing_loss"].detach(), aux["z_loss"].detach(),
                                 (~torch.isfinite(loss.detach())).float()])
        if num_moe_layers:
            expert_load += torch.stack(aux["tokens_per_expert"])
        step += 1
        interval_steps += 1
        bar.update(1)

        after_step(step, t, check_loss, checkpoint, run_eval)

    at_end(step, t, interval_steps, result.evals[-1]["step"] if result.evals else None, saved_step,
           check_loss, checkpoint, run_eval)
    bar.close()
    result.step = step
    return result
