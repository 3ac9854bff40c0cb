"""The MoE Transformer's training loop: read it top to bottom (it follows fused_dlrm/train/loop.py).

One step: this rank's slice of the global batch -> MoETransformer forward (the dispatch / combine all-to-alls
inside every MoE layer) -> loss = cross-entropy + aux_coeff * load balancing + z_coeff * z loss -> backward ->
`sync_gradients` (replicated parameters' gradients summed over ranks) -> with model.clip_grad, `clip_gradients` (by
the whole model's norm) -> optimizer step -> the lr scheduler's step (model.lr_schedule: `lr_schedule`, a function
of the step alone, so a resumed run continues it; a decay over trainer.max_steps only if those are the checkpoint's
run's, else the resume is refused). With model.tp_size > 1 the world is split into tensor-parallel
groups of consecutive ranks (the attention and dense FFN projections sharded over each, activations replicated
inside it, or with model.sequence_parallel cut over it) and data-parallel groups across them: the batch is split
over the data-parallel ranks (a TP group shares one slice, which under sequence parallelism the model cuts again:
MoETransformer.local_tokens), and gradients are summed over the ranks holding different tokens
(MoETransformer.gradient_groups).
Every `log_every` steps the steps' losses (and pre-clip gradient norms) are reduced over ranks and checked for
NaN/inf (naming the first step that held one), and tokens/s, the lr and the expert load are logged; every
`eval_every` steps the eval loss is measured (NaN / inf: weights that diverged after the loss check, the run stops);
every `checkpoint_every` steps a checkpoint is written (only after the loss was checked). Only trainer.max_steps
is supported (no epochs). The step itself is `train_step` (also timed by fused_dlrm/report/moe.py); the
bookkeeping around it is a `TrainingRun`
(fused_dlrm/train/schedule.py, shared with the DLRM loop). Host syncs of a step on GPUs: each MoE layer's counts
(they size its exchanges; with a capacity factor also its kept rows) and, every log_every steps, the loss check; none
for the batch (a pinned, non-blocking copy); none for clipping (the norm stays on the device: a NaN / inf one stops
the run at the interval's check, TrainingRun).
"""

from __future__ import annotations

import hashlib
import logging
import math
import platform
from functools import partial
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from hydra.utils import instantiate
from omegaconf import DictConfig

from fused_dlrm.config_checks import check_comm_mode, check_count, check_seed, is_finite_at_least_zero
from fused_dlrm.data.batching import local_batch_bounds
from fused_dlrm.dist import DistEnv, all_reduce_sum
from fused_dlrm.dist.alltoall import world_size
from fused_dlrm.dist.env import check_same_on_every_rank, raise_on_every_rank
from fused_dlrm.dist.host_copy import host_to_device
from fused_dlrm.dist.symmetric import check_allocation_timeout
from fused_dlrm.train.checkpoint import NonFiniteLossError, load_checkpoint, save_checkpoint
from fused_dlrm.train.config_keys import check_config_keys
from fused_dlrm.train.lr_schedule import scheduled
from fused_dlrm.train.schedule import Interval, TrainingRun, TrainResult, check_trainer
from fused_dlrm.tp import flat_buffer, quantized_all_reduce
from fused_dlrm.tp.linear import COMMS, check_tp_size, tp_groups
from fused_dlrm.tp.quantized_allreduce import check_grad_allreduce
from moe.data import ByteWindows, load_corpus
from moe.layer import FusedMoEConfig
from moe.routing import check_capacity_factor, check_drop_policy, check_top_k
from moe.transformer import MoETransformer

log = logging.getLogger(__name__)


def check_config(cfg: DictConfig) -> None:
    """The settings `train` refuses before it builds anything, the same on every rank (the config is): the report
    (fused_dlrm/report/moe.py), which times the step a config trains, runs them too. The model's sizes are
    `build_model`'s checks and the lr schedule's `build_optimizer`'s, which both paths call."""
    check_config_keys(cfg)  # `+trainer.<typo>=...` would be added and never read, `trainer.progress=no` be true
    t, m = cfg.trainer, cfg.model
    if t.max_steps is None or t.epochs is not None:  # not silently ignored: its windows are drawn, not passed over
        raise ValueError(f"the MoE Transformer trains for trainer.max_steps steps (got max_steps={t.max_steps}); "
                         f"trainer.epochs is not supported (got {t.epochs})")
    check_trainer(t)
    check_seed(cfg.seed)
    # the loss of no batch would be 0 / 0, and every run ends with an evaluation
    check_count("data.eval_batches", cfg.data.eval_batches, 1, "a count >= 1: the evaluation needs at least one batch")
    check_comm_mode(cfg.comm.mode)
    if m.tp_comm not in COMMS:  # else "comm must be one of", at the first projection built
        raise ValueError(f"model.tp_comm={m.tp_comm!r}: expected one of {COMMS}")
    if m.tp_comm == "fused" and m.tp_size == 1:  # else accepted, and nothing fused (the report sets it per column)
        raise ValueError("model.tp_comm=fused with model.tp_size=1: there is no tensor-parallel projection to fuse "
                         "(Megatron refuses --tp-comm-overlap without tensor parallelism too); set model.tp_size > 1 "
                         "or model.tp_comm=bulk")
    check_grad_allreduce(cfg.comm.grad_allreduce)
    # NaN; YAML's true (a clip at 1); inf is a norm: measured and logged, nothing clipped
    if m.clip_grad is not None and not (is_finite_at_least_zero(m.clip_grad) or m.clip_grad == math.inf):
        raise ValueError(f"model.clip_grad={m.clip_grad!r}: expected a norm >= 0 (null or 0: no clipping)")
    for key in ("aux_coeff", "z_coeff"):
        # NaN stopped the run as a divergence, null failed in the first step, a negative weight rewarded imbalance
        # (or large logits), YAML's true weighed 1
        if not is_finite_at_least_zero(m[key]):
            raise ValueError(f"model.{key}={m[key]!r}: expected a finite number >= 0 (0: no such loss term)")
    # by their keys: the router's own refusals name its arguments, as a library layer's
    check_capacity_factor(m.capacity_factor, zero_allowed=False, prefix="model.")
    check_drop_policy(m.drop_policy, prefix="model.")
    if cfg.comm.mode == "fused" and cfg.comm.get("transport", "p2p") != "p2p":
        raise ValueError(f"comm.transport={cfg.comm.transport}: the MoE layers' fused dispatch and combine have the "
                         "p2p transport only")


def build_model(cfg: DictConfig, env: DistEnv) -> MoETransformer:
    """The model on this rank; with model.tp_size > 1 it creates the TP and data-parallel groups (collective).
    The model's `group` holds the ranks with different tokens: the data-parallel group, or under sequence
    parallelism the world (None). A model.tp_size that does not divide the world, a batch of fewer samples than
    data-parallel ranks, or one sequence parallelism cannot cut, is refused here, on every rank alike."""
    m = cfg.model
    for key in ("vocab_size", "d_model", "num_layers", "num_heads", "ffn", "num_experts", "top_k", "moe_every"):
        # a float failed deep in torch, YAML's true (an int) was 1, ffn=0 trained FFNs of nothing
        check_count(f"model.{key}", m[key], 1, "a whole number >= 1")
    check_top_k(m.top_k, m.num_experts, prefix="model.")  # by its keys, as the router names its arguments
    check_tp_size(m.tp_size, env.world_size, "model.tp_size")  # before the checks below divide by it
    if m.vocab_size < 256:  # else the first byte above it fails in the embedding, at whatever step draws it
        raise ValueError(f"model.vocab_size={m.vocab_size}: the data are raw bytes, so it must be at least 256")
    shares = env.world_size // m.tp_size  # the data-parallel ranks: a TP group shares one slice of the batch
    sequence_parallel = m.get("sequence_parallel", False) and m.tp_size > 1
    # the ranks the experts are split over (the model's `group`)
    experts_over, why = ((env.world_size, f"world size {env.world_size}: model.sequence_parallel splits them over "
                                          f"the world") if sequence_parallel
                         else (shares, f"world size {env.world_size} / model.tp_size={m.tp_size}"))
    if m.num_experts % experts_over:  # else refused by the MoE layer, naming its argument, after the groups' making
        raise ValueError(f"model.num_experts={m.num_experts}: expected a multiple of the {experts_over} "
                         f"expert-parallel ranks ({why})")
    check_count("data.global_batch_size", cfg.data.global_batch_size, shares,
                f"a whole number of samples >= the {shares} data-parallel ranks (world size {env.world_size} / "
                f"model.tp_size={m.tp_size}): each takes a slice of the batch")  # else named as a world of `shares`
    if sequence_parallel:
        for start, stop in (local_batch_bounds(cfg.data.global_batch_size, r, shares) for r in range(shares)):
            if (stop - start) * cfg.data.seq_len % m.tp_size:
                raise ValueError(f"model.sequence_parallel cuts each data-parallel rank's tokens into model.tp_size="
                                 f"{m.tp_size} equal parts: {stop - start} samples x data.seq_len="
                                 f"{cfg.data.seq_len} do not split")
    check_allocation_timeout(cfg.comm.allocation_timeout_s)
    tp_group, dp_group = tp_groups(m.tp_size)
    model = MoETransformer(vocab_size=m.vocab_size, d_model=m.d_model, num_layers=m.num_layers,
                           num_heads=m.num_heads, ffn=m.ffn, num_experts=m.num_experts, top_k=m.top_k,
                           moe_every=m.moe_every, shared_expert=m.shared_expert,
                           capacity_factor=m.capacity_factor, drop_policy=m.drop_policy, seed=cfg.seed,
                           group=dp_group, tp_group=tp_group,
                           tp_comm=m.tp_comm, sequence_parallel=m.get("sequence_parallel", False),
                           moe_comm=cfg.comm.mode, moe_fused=fused_moe_config(cfg, env),
                           compute_dtype=compute_dtype(m.get("precision", "fp32")),
                           allocation_timeout_s=cfg.comm.allocation_timeout_s)
    return model.to(env.device)


def weight_decay_groups(model: torch.nn.Module) -> list[dict]:
    """The optimizer's parameter groups, split as Megatron's default is: matrices (projections, experts, router,
    embedding) take the configured weight decay, 1-D parameters (norm gains, biases) none (decay pulls a gain
    towards 0, not towards its initial 1)."""
    params = list(model.parameters())
    groups = [{"params": [p for p in params if p.ndim >= 2]},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def build_optimizer(cfg: DictConfig, model: MoETransformer) -> tuple[torch.optim.Optimizer, Callable[[int], float]]:
    """model.optimizer over the model's `weight_decay_groups`, and its checked model.lr_schedule (`lr_schedule`)."""
    optimizer = instantiate(cfg.model.optimizer, _partial_=True)(weight_decay_groups(model))
    return optimizer, lr_schedule(cfg.model.lr_schedule, optimizer.defaults["lr"], cfg.trainer.max_steps)


def fused_moe_config(cfg: DictConfig, env: DistEnv) -> FusedMoEConfig | None:
    """The MoE layers' comm=fused settings (None for comm=bulk). Every batch has the same shape, so the exchanges'
    buffers are sized for the largest rank's share of one (its tokens: max_tokens_per_rank; under sequence
    parallelism a TP rank's part of its slice), and no forward waits for the routing's counts on the host."""
    if cfg.comm.mode != "fused":
        return None
    tp_size = cfg.model.tp_size
    start, stop = local_batch_bounds(cfg.data.global_batch_size, 0, env.world_size // tp_size)
    # rank 0's share: the first ranks take one sample more when the batch does not split evenly
    max_tokens = (stop - start) * cfg.data.seq_len
    if cfg.model.get("sequence_parallel", False) and tp_size > 1:
        max_tokens //= tp_size  # exactly: build_model refuses a batch whose shares do not split
    return FusedMoEConfig(num_programs=cfg.comm.num_programs, wait_timeout_spins=cfg.comm.wait_timeout_spins,
                          allocation_timeout_s=cfg.comm.allocation_timeout_s, cuda_graphs=cfg.trainer.cuda_graphs,
                          max_tokens_per_rank=max_tokens, dispatch=cfg.comm.moe_dispatch, combine=cfg.comm.moe_combine)


def compute_dtype(precision: str) -> torch.dtype | None:
    """model.precision -> MoETransformer's compute_dtype (None: the fp32 parameters' own)."""
    dtypes = {"fp32": None, "bf16": torch.bfloat16}
    if precision not in dtypes:
        raise ValueError(f"model.precision={precision!r}: expected one of {sorted(dtypes)}")
    return dtypes[precision]


def build_data(cfg: DictConfig, env: DistEnv, run_dir: Path) -> tuple[ByteWindows, ByteWindows]:
    """This rank's slices of the batches: one slice per data-parallel rank (rank // tp_size of world // tp_size)."""
    d, tp_size = cfg.data, cfg.model.tp_size
    try:  # on every rank: a corpus one node lacks fails there alone (the others would wait in the first collective)
        corpus = load_corpus(d.path, d.cache or run_dir / "corpus.txt", d.size_bytes)
        data, problem = tuple(ByteWindows(corpus, split, d.seq_len, d.global_batch_size, env.rank // tp_size,
                                          env.world_size // tp_size, cfg.seed, d.eval_fraction)
                              for split in ("train", "eval")), None
    except Exception as error:  # noqa: BLE001: raised here, and named on every other rank
        data, problem = None, error
    raise_on_every_rank(problem, "cannot make their data from the corpus")
    # ranks on other nodes read their own copies of data.path, or build the corpus from their own Python's standard
    # library, and each draws its slice of a batch's windows from its own bytes
    check_same_on_every_rank(f"{len(corpus)} bytes (blake2b {hashlib.blake2b(corpus, digest_size=8).hexdigest()})",
                             "the corpus differs",
                             str(d.path) if d.path else f"Python {platform.python_version()}'s standard library",
                             "every rank must train on the same bytes")
    return data


def sum_over(t: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """In-place sum over the group's ranks (None: the world; nothing to do in one process)."""
    if dist.is_initialized():
        dist.all_reduce(t, group=group)
    return t


def sync_gradients(model: MoETransformer, grad_allreduce: str = "nccl") -> None:
    """After backward: make every gradient that of the step's loss, given that each rank differentiated its share.

    Each rank differentiates its share of the loss (train_step: its local sum over the global token count, its
    auxiliary losses over the ranks holding different tokens), so the gradients of what several of those ranks
    hold (everything but the experts' w13/w2) are all-reduce-summed, in one flat buffer per group
    (MoETransformer.gradient_groups: inside a TP group the linears' collectives already made each shard's gradient
    complete for the group's tokens). The experts' gradients are complete on their owner as they are (the
    exchanges' backward brought every rank's share home): no pass over them, which on 2 x H200 would read and
    write the fine-grained config's 2.2B expert gradients (~4.3 ms per step, docs/benchmarks.md).
    grad_allreduce other than "nccl" sums them with that codec (fused_dlrm.tp; a fused one's workspace waits the
    model's allocation_timeout_s for the peers at an allocation), each parameter's gradient from a block boundary
    of the buffer (tp.flat_buffer: its own blocks' scales, not a larger neighbour's).
    """
    for _, params, group in model.gradient_groups():
        if world_size(group) == 1 or not params:
            continue
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = [p.grad for p in params]
        flat, views = flat_buffer(grads, grad_allreduce)  # a codec's: each gradient from a block boundary
        torch._foreach_copy_(views, grads)
        if grad_allreduce == "nccl":
            dist.all_reduce(flat, group=group)
        else:
            quantized_all_reduce(flat, grad_allreduce, group=group, out=flat,
                                 allocation_timeout_s=model.allocation_timeout_s)
        torch._foreach_copy_(grads, views)


def gradient_norm(model: MoETransformer) -> torch.Tensor:
    """After sync_gradients: the norm of the whole model's gradient as one vector, each value counted once, the same
    on every rank (a collective): each rank's sum of squares weights a parameter by 1 / its copies in the world
    (MoETransformer.gradient_copies), and the sums are summed over the world."""
    squares = [torch.nn.utils.get_total_norm(grads).square() / copies for params, copies in model.gradient_copies()
               if (grads := [p.grad for p in params if p.grad is not None])]
    return sum_over(torch.stack(squares).sum(), None).sqrt()


def clip_gradients(model: MoETransformer, clip_grad: float) -> torch.Tensor:
    """Scale every gradient by min(1, clip_grad / (norm + 1e-6)), norm the `gradient_norm` (Megatron's clip_grad,
    torch's clip_grad_norm_); returns that norm, on the device (no host sync). A NaN norm makes every gradient NaN,
    an inf one the finite gradients 0 and the inf ones NaN: either way the run stops at the interval's check
    (TrainingRun.end_step's grad_norm), before any checkpoint."""
    norm = gradient_norm(model)
    torch.nn.utils.clip_grads_with_norm_(model.parameters(), clip_grad, norm)
    return norm


def lr_schedule(schedule: DictConfig, lr: float, max_steps: int) -> Callable[[int], float]:
    """model.lr_schedule, checked, as LambdaLR's lr_lambda: the factor of the configured `lr` at the step after
    `done` steps, Megatron's schedule at num_steps = done: lr x done / warmup_steps up to done = warmup_steps (the
    first step's lr is 0), then `decay` (constant, linear or cosine) to min_lr at done = decay_steps (counted from 0,
    the warm-up included; null: trainer.max_steps), min_lr after."""
    warmup, decay = schedule.warmup_steps, schedule.decay
    decay_steps = lr_decay_steps(schedule, max_steps)
    check_count("model.lr_schedule.warmup_steps", warmup, 0, "a step count >= 0")
    if decay not in ("constant", "linear", "cosine"):
        raise ValueError(f"model.lr_schedule.decay={decay!r}: expected constant, linear or cosine")
    if decay != "constant":
        check_count("model.lr_schedule.decay_steps", decay_steps, warmup + 1,
                    f"a step count above warmup_steps={warmup} for a {decay} decay (null: trainer.max_steps)")
    if not (is_finite_at_least_zero(schedule.min_lr) and schedule.min_lr <= lr):  # null: a TypeError naming nothing
        raise ValueError(f"model.lr_schedule.min_lr={schedule.min_lr!r}: expected 0 <= min_lr <= the optimizer's "
                         f"lr {lr}")
    return partial(_lr_factor, warmup, decay, decay_steps, schedule.min_lr / lr if lr else 0.0)


def lr_decay_steps(schedule: DictConfig, max_steps: int) -> int | None:
    """The steps model.lr_schedule decays the lr over (decay_steps; null: trainer.max_steps); None: no decay."""
    if schedule.decay == "constant":
        return None
    return max_steps if schedule.decay_steps is None else schedule.decay_steps


def _lr_factor(warmup: int, decay: str, decay_steps: int, min_factor: float, done: int) -> float:
    """lr_schedule's factor (Megatron's OptimizerParamScheduler.get_lr over the configured lr)."""
    if warmup and done <= warmup:
        return done / warmup
    if decay == "constant":
        return 1.0
    ratio = min((done - warmup) / (decay_steps - warmup), 1.0)
    kept = 1 - ratio if decay == "linear" else 0.5 * (1 + math.cos(math.pi * ratio))
    return min_factor + kept * (1 - min_factor)


def token_cross_entropy_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum")


def evaluate(model: MoETransformer, dataset: ByteWindows, num_batches: int, env: DistEnv) -> float:
    """Mean cross-entropy per byte over `num_batches` eval batches of the global batch (a collective; a TP
    group's ranks count their tokens tp_size times, or under sequence parallelism each its own: the mean is the
    same)."""
    total = torch.zeros(2, device=env.device)
    model.eval()
    with torch.no_grad():
        for step in range(num_batches):
            inputs, targets = host_to_device(list(dataset.batch(step)), env.device)
            logits, _ = model(inputs)
            targets = model.local_tokens(targets)
            total[0] += token_cross_entropy_sum(logits, targets)
            total[1] += targets.numel()
    model.train()
    total = all_reduce_sum(total)
    return float(total[0] / total[1])


def train_step(model: MoETransformer, optimizer: torch.optim.Optimizer, inputs: torch.Tensor, targets: torch.Tensor,
               aux_coeff: float, z_coeff: float, grad_allreduce: str = "nccl", clip_grad: float | None = None,
               ) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor], torch.Tensor | None]:
    """One step on this rank's slice of the batch, already on the device: forward (dispatch / combine inside every
    MoE layer), loss = cross-entropy + aux_coeff * load balancing + z_coeff * z loss, backward, `sync_gradients`,
    with clip_grad (not None or 0) `clip_gradients`, optimizer step. Returns the detached total loss, its terms
    [cross-entropy, load balancing, z loss], the kept assignments per expert of each MoE layer and the gradient
    norm before clipping (None without clip_grad: not measured, a pass over every gradient that nothing needs)."""
    logits, aux = model(inputs)
    targets = model.local_tokens(targets)
    shares = world_size(model.group)  # the ranks holding different tokens
    # The step's loss: the global-batch mean cross-entropy as this rank estimates it (its local sum over the global
    # tokens, times the number of shares; the logged value), plus this rank's auxiliary losses (over its tokens, as
    # Megatron's router computes them; under sequence parallelism the load balancing from its TP group's counts).
    global_tokens = sum_over(torch.full((), float(targets.numel()), device=targets.device), model.group)  # no copy
    ce = token_cross_entropy_sum(logits, targets) * shares / global_tokens
    loss = ce + aux_coeff * aux["load_balancing_loss"] + z_coeff * aux["z_loss"]
    optimizer.zero_grad(set_to_none=True)
    # Each rank differentiates its share (1/shares) of the loss: summing the gradients over the ranks
    # (sync_gradients) then gives the gradient of the global-batch mean, uneven local batches weighted correctly,
    # and the experts' gradients need no rescaling.
    (loss / shares).backward()
    sync_gradients(model, grad_allreduce)
    grad_norm = clip_gradients(model, clip_grad) if clip_grad else None
    optimizer.step()
    terms = [ce.detach(), aux["load_balancing_loss"].detach(), aux["z_loss"].detach()]
    return loss.detach(), terms, aux["tokens_per_expert"], grad_norm


def train(cfg: DictConfig, env: DistEnv, run_dir: Path) -> TrainResult:
    check_config(cfg)
    t, m = cfg.trainer, cfg.model
    model = build_model(cfg, env)
    optimizer, lr_factor = build_optimizer(cfg, model)
    train_data, eval_data = build_data(cfg, env, run_dir)
    checkpoint_dir = Path(t.checkpoint_dir) if t.checkpoint_dir else run_dir / "checkpoints"

    step = 0
    decay_steps = lr_decay_steps(m.lr_schedule, t.max_steps)  # recorded in checkpoints
    if t.resume_from:  # a decay over trainer.max_steps must decay over the checkpoint's run's (else the lr jumps)
        step = load_checkpoint(t.resume_from, model, optimizer, lr_decay_over_max_steps=None
                               if m.lr_schedule.decay_steps is not None else decay_steps)
    scheduler = scheduled(optimizer, lr_factor, step)  # sets the lr of the step after `step` steps
    num_moe_layers = sum(1 for i in range(m.num_layers) if (i + 1) % m.moe_every == 0)
    # the kept assignments per (MoE layer, expert) over the log interval
    expert_load = torch.zeros(num_moe_layers, m.num_experts, dtype=torch.int64, device=env.device)

    def log_fields(interval: Interval) -> tuple[dict, str]:
        """The interval's losses, its last step's lr, its mean pre-clip gradient norm (with clipping), speed and
        expert load (reduced over ranks here: a collective)."""
        ce, lb, z = interval.losses
        lr = scheduler.base_lrs[0] * lr_factor(interval.step - 1)  # every group's base is the configured lr
        norm, norm_text = ({}, "") if interval.grad_norm is None else ({"grad_norm": interval.grad_norm},
                                                                       f" grad_norm {interval.grad_norm:.4f}")
        load = sum_over(expert_load.clone(), model.group).double()  # over the ranks routing different tokens
        expert_load.zero_()
        # max / mean tokens per expert of each MoE layer, over all ranks (1.0: perfectly balanced)
        imbalance = (load.max(dim=1).values / load.mean(dim=1).clamp(min=1e-9)).tolist()
        return ({"loss": ce, "load_balancing_loss": lb, "z_loss": z, "lr": lr, **norm, "step_ms": interval.step_ms,
                 "tokens_per_s": interval.rate, "expert_load_max_over_mean": imbalance,
                 "tokens_per_expert": load.long().tolist()},
                f"loss {ce:.5f} lb {lb:.4f} z {z:.4f} lr {lr:.4g}{norm_text} step_ms {interval.step_ms:.1f} "
                f"tokens/s {interval.rate:.0f} expert max/mean {' '.join(f'{x:.2f}' for x in imbalance)}")

    def run_eval(step: int) -> dict:
        eval_loss = evaluate(model, eval_data, cfg.data.eval_batches, env)
        log.info("step %d eval loss %.4f", step, eval_loss)
        if not math.isfinite(eval_loss):  # the same on every rank (reduced): weights diverged after the loss check
            raise NonFiniteLossError(f"eval loss became NaN or inf at step {step} (the parameters diverged after "
                                     f"the last loss check); stopping")  # the run adds the last good checkpoint
        return {"eval_loss": eval_loss}

    def checkpoint(step: int) -> None:
        save_checkpoint(checkpoint_dir, step, model, optimizer, None, t.keep_checkpoints, cfg.data.global_batch_size,
                        t.resume_from, decay_steps)

    run = TrainingRun(t, env, run_dir, checkpoint_dir, step, items="tokens", log=log, loss_terms=3,
                      items_per_step=cfg.data.global_batch_size * cfg.data.seq_len, log_fields=log_fields,
                      evaluate=run_eval, save=checkpoint)
    while run.step < t.max_steps:
        # Through pinned memory in one non-blocking copy: a pageable copy would make the host wait for the GPU
        # to finish the previous step first.
        inputs, targets = host_to_device(list(train_data.batch(run.step)), env.device)
        loss, terms, tokens_per_expert, grad_norm = train_step(model, optimizer, inputs, targets, m.aux_coeff,
                                                               m.z_coeff, cfg.comm.grad_allreduce, m.clip_grad)
        if num_moe_layers:
            expert_load += torch.stack(tokens_per_expert)
        run.end_step(loss, terms, grad_norm=grad_norm)  # step += 1; its losses (and norm) kept on the device
        run.after_step()  # on its cadence: loss check (NaN stop) and log, checkpoint, evaluation
        scheduler.step()  # the next step's lr
    return run.finish()  # the last loss check, evaluation and checkpoint
