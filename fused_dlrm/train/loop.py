"""The training loop: read it top to bottom.

One step: batch -> DLRM forward (sparse all-to-alls inside) -> loss -> backward (embedding optimizer fused
into it, dense gradients averaged by DDP) -> dense optimizer step. Every `log_every` steps the loss is reduced
over ranks and checked for NaN/inf; every `eval_every` steps AUC and log loss are measured on held-out data;
every `checkpoint_every` steps a checkpoint is written (only after the loss was checked).

On GPUs the next batch's host-to-device copy and input all-to-all run ahead on side streams (`next_batch`). The
host waits for the GPU inside a step only where a size must be known on the host: the input all-to-all's value
counts and received sizes, and its index range check (on the side stream, behind the copy only, when
prefetching), and the embedding backward's grid size (`unique_consecutive`, one per step); then every `log_every`
steps the loss reduction. A step launched while the previous one still runs is otherwise free of host syncs.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from hydra.utils import instantiate
from omegaconf import DictConfig
from tqdm import tqdm

from fused_dlrm.dist import DistEnv, all_reduce_sum
from fused_dlrm.train.build import batch_stream, build_dataset, build_model, dense_parameters, to_device
from fused_dlrm.train.checkpoint import load_checkpoint, save_checkpoint
from fused_dlrm.train.metrics import CTRMetrics
from fused_dlrm.train.schedule import MetricsLog, after_step, at_end, stop_if_nonfinite

log = logging.getLogger(__name__)


@dataclass
class TrainResult:
    step: int = 0
    losses: list[tuple[int, float]] = field(default_factory=list)  # (step, mean loss over the log interval)
    evals: list[dict] = field(default_factory=list)


def evaluate(model, dataset, num_batches: int, env: DistEnv) -> dict[str, float]:
    metrics = CTRMetrics(env.device)
    model.eval()
    with torch.no_grad():
        for _, batch in zip(range(num_batches), batch_stream(dataset, 0, None)):
            batch = to_device(batch[1], env.device)
            logits = model(batch.dense_features, batch.sparse_features).squeeze(-1)
            metrics.update(logits, batch.labels)
    model.train()
    return metrics.compute()


def train_step(model, optimizer, batch, world_size: int) -> torch.Tensor:
    """One step on a batch already on the device: forward (sparse all-to-alls inside), loss, backward (embedding
    optimizer fused into it, dense gradients averaged by DDP), dense optimizer step. Returns the detached loss."""
    logits = model(batch.dense_features, batch.sparse_features).squeeze(-1)
    # Sum over the local batch / global batch, times world size: DDP's average over ranks (and the sparse
    # all-to-all's division by world size, as in torchrec) then give the gradient of the global-batch mean,
    # uneven local batches weighted correctly.
    global_batch = all_reduce_sum(torch.full((), float(logits.numel()), device=logits.device))  # no host copy
    loss = F.binary_cross_entropy_with_logits(logits, batch.labels, reduction="sum") * world_size / global_batch
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return loss.detach()


def train(cfg: DictConfig, env: DistEnv, run_dir: Path) -> TrainResult:
    t = cfg.trainer
    if t.max_steps is None and t.epochs is None:
        raise ValueError("set trainer.max_steps or trainer.epochs")
    model = build_model(cfg, env)
    sparse = model.sparse_arch.embedding_bag_collection
    optimizer = instantiate(t.dense_optimizer, params=dense_parameters(model))
    train_data, eval_data = build_dataset(cfg, "train", env), build_dataset(cfg, "eval", env)
    checkpoint_dir = Path(t.checkpoint_dir) if t.checkpoint_dir else run_dir / "checkpoints"

    step = 0
    if t.resume_from:
        step = load_checkpoint(t.resume_from, model, optimizer, sparse.lookup.optimizer)
    result = TrainResult(step=step)
    metrics = MetricsLog(run_dir, env.is_main)
    bar = tqdm(total=t.max_steps, initial=step, disable=not (env.is_main and t.progress), desc="train")
    loss_sum = torch.zeros(2, device=env.device)  # [sum of step losses, count of non-finite ones]
    interval_start, interval_steps = time.perf_counter(), 0

    def check_loss() -> float:
        """Reduce the interval's loss over ranks; stop the run on NaN/inf (before any checkpoint is written)."""
        nonlocal interval_start, interval_steps
        total = all_reduce_sum(loss_sum.clone()).tolist()
        stop_if_nonfinite(total[1], step - interval_steps + 1, step, checkpoint_dir)
        mean = total[0] / max(interval_steps * env.world_size, 1)
        rate = interval_steps * cfg.data.global_batch_size / (time.perf_counter() - interval_start)
        loss_sum.zero_()
        interval_start, interval_steps = time.perf_counter(), 0
        result.losses.append((step, mean))
        metrics.record({"step": step, "loss": mean, "samples_per_s": rate})
        bar.set_postfix(loss=f"{mean:.4f}", samples_s=f"{rate:,.0f}")
        log.info("step %d loss %.5f samples/s %.0f", step, mean, rate)
        return mean

    def run_eval() -> None:
        result.evals.append({"step": step, **evaluate(model, eval_data, cfg.data.eval_batches, env)})
        metrics.record(result.evals[-1])
        log.info("step %d eval auc %.4f log_loss %.4f", step, result.evals[-1]["auc"], result.evals[-1]["log_loss"])

    def checkpoint() -> None:
        nonlocal saved_step
        save_checkpoint(checkpoint_dir, step, model, optimizer, sparse.lookup.optimizer, t.keep_checkpoints)
        saved_step = step

    saved_step = step

    copy_stream = torch.cuda.Stream(env.device) if env.device.type == "cuda" else None

    def next_batch():
        """The next (epoch, batch) on the device, its input all-to-all already under way when prefetching.

        On GPUs the host batch is pinned and copied on a side stream, and the input all-to-all is issued behind
        that copy only (prefetch's stream waits on the stream current here): both run while the kernels of the
        step just enqueued still execute, and the host never waits for that step. The main stream waits for the
        copy from here on. On the CPU, or for a batch generated on the GPU, it is a plain call (torch.cuda.stream(None)
        does nothing).
        """
        epoch, batch = next(batches)
        ahead = copy_stream is not None and batch.labels.device.type == "cpu"  # else made on the main stream
        with torch.cuda.stream(copy_stream if ahead else None):
            batch = to_device(batch.pin_memory() if ahead else batch, env.device)
            if t.prefetch_input_dist and not done(epoch):
                sparse.prefetch(batch.sparse_features)
        if ahead:
            main = torch.cuda.current_stream()
            batch.record_stream(main)  # made on the copy stream, read on the main one
            main.wait_stream(copy_stream)
        return epoch, batch

    def done(epoch: int) -> bool:
        return (t.max_steps is not None and step >= t.max_steps) or (t.epochs is not None and epoch >= t.epochs)

    batches = batch_stream(train_data, step, cfg.data.get("steps_per_epoch"))
    epoch, batch = next_batch()
    while not done(epoch):
        loss = train_step(model, optimizer, batch, env.world_size)
        loss_sum += torch.stack([loss, (~torch.isfinite(loss)).float()])
        step += 1
        epoch, batch = next_batch()  # its input dist overlaps this step's tail on the GPU
        interval_steps += 1
        bar.update(1)

        after_step(step, t, check_loss, checkpoint, run_eval)

    at_end(step, t, interval_steps, result.evals[-1]["step"] if result.evals else None, saved_step,
           check_loss, checkpoint, run_eval)
    bar.close()
    result.step = step
    return result
