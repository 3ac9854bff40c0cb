"""The training loop: read it top to bottom.

One step: batch -> DLRM forward (sparse all-to-alls inside) -> loss -> backward (embedding optimizer fused
into it, dense gradients set and averaged over ranks by the arch nodes, models/arch_nodes.py: no zero_grad) ->
dense optimizer step (`train_step`) -> with model.lr_schedule, the next step's lr (MLPerf's warm-up and decay, one
factor for the dense and the embedding lrs: train/lr_schedule.py). On GPUs the dense arches and the dense
optimizer's step replay CUDA graphs (`trainer.cuda_graphs`: captured by build_model, and by graphed_step; a step
whose lr is new runs eagerly, graphed_step's key), and the same step is called directly
(`trainer.direct_step`, train/direct_step.py: no autograd around the dense part, the over arch and the loss one
CUDA graph; `make_train_step` picks it).
Every `log_every` steps the steps' losses are reduced over ranks and checked for NaN/inf (naming the first step
that held one); every `eval_every` steps AUC and log loss are measured on held-out data; every `checkpoint_every`
steps a checkpoint is written (only after the loss was checked).

Batches are made `trainer.batches_ahead` ahead by a thread (`BatchesAhead`: generation, or pinning and the
host-to-device copy, on a stream of its own on GPUs), and with `trainer.input_dist_on_thread` that thread runs
their input dist too (its all-to-alls, the wait for their sizes and the host time of it all leave the thread
that enqueues the steps; a communicator of its own; not where a rank's GPU has one hardware queue:
`dist.env.ranks_with_one_hardware_queue`). Otherwise the next batch's input all-to-all runs ahead on a
side stream (`next_batch`; the input dist has a communicator of its own). The host waits for the GPU inside a step
only where a size must be known on the host: once for the input all-to-all's header (sizes and the checks of the
batch; on the batch thread, or on the side stream behind the batch only when prefetching; with
`trainer.header_ahead` exchanged a step earlier still, so that the wait has passed when the host reads it); then
every `log_every` steps the loss reduction (the embedding backward's segment count stays on the GPU: its kernel is
persistent). A step launched while the previous
one still runs is otherwise free of host syncs.

Each rank makes its own slice of a global batch, so making one can fail on one rank alone (a malformed line, a read
error) while the others already wait in that batch's input dist. The error then takes the batch's place
(`pull_batch`): the input dist sends a header saying this rank has no batch, and every rank raises at that batch
(this one its error, the others one naming it): on the batch thread (BatchesAhead's prepare_failed), in
prefetch_header / prefetch, or, prefetch off and in `evaluate`, where the forward would distribute the batch; in each
mode after the step before it ended as any step does (its loss check, checkpoint and evaluation: nothing lost). So
that a rank without the batch knows as its peers do whether the run goes on to it, the run's end is decided before
a batch is fetched (max_steps; trainer.epochs ends the batch stream: batch_stream).

The bookkeeping around the step (counters, loss check, metrics.jsonl, cadence) is a `TrainingRun` (schedule.py),
shared with the MoE loop; what is DLRM's own comes in as callbacks: the log fields, evaluation and checkpoint.
"""

from __future__ import annotations

import logging
import os
from contextlib import nullcontext
from pathlib import Path
from typing import Callable, Iterator

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig
from torchrec.datasets.utils import Batch

from fused_dlrm.config_checks import check_count, check_seed
from fused_dlrm.dist import DistEnv
from fused_dlrm.dist.env import input_stream, ranks_with_one_hardware_queue
from fused_dlrm.models.arch_nodes import sets_every_gradient
from fused_dlrm.models.dlrm import dlrm_loss
from fused_dlrm.sparse.input_dist import raised_on_every_rank
from fused_dlrm.sparse.sharded_ebc import FeaturesOrError
from fused_dlrm.train.batches_ahead import BatchesAhead
from fused_dlrm.train.build import batch_stream, build_dataset, build_model, dense_parameters, fused_comm, to_device
from fused_dlrm.train.checkpoint import load_checkpoint, save_checkpoint
from fused_dlrm.train.config_keys import check_config_keys
from fused_dlrm.train.direct_step import DirectDLRMStep, direct_step_refusal
from fused_dlrm.train.graphed_step import dense_step
from fused_dlrm.train.lr_schedule import DLRMLRSchedule, dlrm_lr_factor
from fused_dlrm.train.metrics import CTRMetrics
from fused_dlrm.train.schedule import Interval, TrainingRun, TrainResult, check_trainer

log = logging.getLogger(__name__)


def pull_batch(batches: Iterator[tuple[int, Batch]], device: torch.device | None) -> Batch | Exception | None:
    """The next batch of `batches` (copied to `device` unless None); None at their end; or the error raised making
    it. Making a batch can fail on one rank alone (each rank makes its own slice of the global batch: a malformed
    line in this rank's; or its copy runs out of memory), and the others would then wait for it in the input dist's
    all-to-alls: the error goes to the input dist in the batch's place instead (sharded_ebc.FeaturesOrError), which
    raises it here and an error naming this rank on the others."""
    try:
        batch = next(batches)[1]
        return batch if device is None else to_device(batch, device)
    except StopIteration:
        return None
    except Exception as error:  # noqa: BLE001: raised by the input dist, on every rank
        return error


def features_of(batch: Batch | Exception) -> FeaturesOrError:
    """What the input dist takes of a batch: its sparse features, or the error raised making it (`pull_batch`)."""
    return batch if isinstance(batch, Exception) else batch.sparse_features


def evaluate(model, dataset, num_batches: int, env: DistEnv, step: int) -> dict[str, float]:
    """AUC and log loss over `num_batches` of every rank's evaluation data, after training step `step`."""
    sparse = model.sparse_arch.embedding_bag_collection
    metrics = CTRMetrics(env.device)
    model.eval()
    batches = batch_stream(dataset, 0, None, epochs=1)  # a file's batches once: none of its samples counted twice
    with torch.no_grad():  # the arches themselves, not their nodes (models/arch_nodes.py): no gradient to average
        for made in range(num_batches):
            batch = pull_batch(batches, env.device)
            if batch is None:  # the same batch on every rank: each reads every global batch of the file
                log.warning("the evaluation data holds %d global batches, fewer than data.eval_batches=%d: "
                            "evaluated on those", made, num_batches)
                break
            if isinstance(batch, Exception):  # where the forward would distribute it: raises on every rank
                sparse.bags_of(batch)
            logits = model(batch.dense_features, batch.sparse_features).squeeze(-1)
            metrics.update(logits, batch.labels)
    model.train()
    return metrics.compute(step)


def train_step(model, optimizer, batch, world_size: int, step: Callable[[], None] | None = None,
               zero_grad: bool = True) -> torch.Tensor:
    """One step on a batch already on the device: forward (sparse all-to-alls inside), loss, backward (embedding
    optimizer fused into it, dense gradients averaged over ranks by the arch nodes), dense optimizer step (`step`,
    by default optimizer.step; graphed_step.dense_step's replays a CUDA graph of it). zero_grad=False when the
    backward sets every gradient the optimizer reads (arch_nodes.sets_every_gradient). Returns the detached loss."""
    logits = model(batch.dense_features, batch.sparse_features).squeeze(-1)
    # The global batch is known on the host since the input dist's header (every rank's batch size): no collective.
    global_batch = model.sparse_arch.embedding_bag_collection.global_batch_size
    loss = dlrm_loss(logits, batch.labels, world_size / global_batch)
    if zero_grad:
        optimizer.zero_grad(set_to_none=True)
    loss.backward()
    (step or optimizer.step)()
    return loss.detach()


def make_train_step(model, optimizer, step: Callable[[], None], world_size: int, direct_step: bool
                    ) -> Callable[[Batch], torch.Tensor]:
    """The loop's step on a batch: with `direct_step` (trainer.direct_step), DirectDLRMStep where it can run this
    model and the batch fits its graphs; else train_step (without zero_grad when the arch nodes set every dense
    gradient). Make it before a thread that makes batches starts: the direct step captures a CUDA graph."""
    zero_grad = not sets_every_gradient(model, dense_parameters(model))
    direct = None
    if direct_step:
        reason = direct_step_refusal(model)
        if not reason:
            direct = DirectDLRMStep(model, step, world_size)
        elif next(model.parameters()).is_cuda:
            log.info("trainer.direct_step: the autograd step runs instead (%s)", reason)

    def run(batch: Batch) -> torch.Tensor:
        if direct is not None and direct.takes(batch):
            return direct.step(batch)
        return train_step(model, optimizer, batch, world_size, step, zero_grad)
    return run


def check_config(cfg: DictConfig) -> None:
    """The settings `train` refuses before it builds anything, the same on every rank (the config is): the report
    (fused_dlrm/report/dlrm.py), which times the step a config trains, and the benchmark dlrm_step, which shapes its
    model and batches by it, run them too. The data's settings are `build_data`'s checks and the model's (its
    embedding optimizers' too) build_model's, which both paths call."""
    check_config_keys(cfg)  # `+trainer.<typo>=...` would be added and never read, `trainer.progress=no` be true
    t = cfg.trainer
    if t.max_steps is None and t.epochs is None:
        raise ValueError("set trainer.max_steps or trainer.epochs")
    check_trainer(t)
    check_seed(cfg.seed)
    if t.epochs is not None:  # 0: no step, without a word
        check_count("trainer.epochs", t.epochs, 1, "a count >= 1, or null (trainer.max_steps ends the run)")
    check_count("trainer.batches_ahead", t.batches_ahead, 0, "a count >= 0 (0: batches made in the loop)")
    check_count("data.eval_batches", cfg.data.eval_batches, 1, "a count >= 1: the evaluation needs at least one batch")
    dlrm_lr_factor(cfg.model.lr_schedule)
    # comm.mode and the fused settings: the report sets the mode of each of its models itself, and builds no fused
    # one without GPUs
    fused_comm(cfg.comm)


def build_train_data(cfg: DictConfig, env: DistEnv):
    """The train dataset (`build_dataset`), data.steps_per_epoch checked against its kind: epochs of step-indexed
    data are counted in it, of file-backed data in passes over the files (batch_stream reads it: the benchmark
    dlrm_step, which makes its batches so, calls this too)."""
    train_data = build_dataset(cfg, "train", env)
    steps_per_epoch, indexed = cfg.data.get("steps_per_epoch"), hasattr(train_data, "batch")
    if not indexed and steps_per_epoch:
        raise ValueError(f"data.steps_per_epoch={steps_per_epoch}: an epoch of file-backed data is one pass over its "
                         f"files; set it to null (trainer.max_steps ends a run mid-epoch)")
    if indexed and steps_per_epoch is not None:  # 0: with trainer.epochs the run would end at step 0, without a word
        check_count("data.steps_per_epoch", steps_per_epoch, 1, "a step count >= 1, or null (every step of epoch 0; "
                    "trainer.max_steps ends the run)")
    return train_data


def check_same_teacher(train_data, eval_data) -> None:
    """Synthetic evaluation data labelled by another hidden teacher than the training data (data.eval.seed=3 for
    other samples) scores an AUC near 0.5 whatever the model learned: refused."""
    if not (hasattr(train_data, "teacher_settings") and hasattr(eval_data, "teacher_settings")):
        return
    train_settings, eval_settings = train_data.teacher_settings(), eval_data.teacher_settings()

    def shown(value):  # a per-feature list of one value: that value, as the config gives it
        return value[0] if isinstance(value, list) and len(set(value)) == 1 else value
    differ = [f"data.eval.{key}={shown(value)}, data.train's {shown(train_settings[key])}"
              for key, value in eval_settings.items() if value != train_settings[key]]
    if differ:
        raise ValueError(f"{'; '.join(differ)}: its samples would be labelled by another hidden teacher, so its AUC "
                         f"would not measure what the model learned; give data.eval the {', '.join(eval_settings)} "
                         f"of data.train (data.eval.split already makes its samples its own)")


def check_own_eval_samples(train_data, eval_data) -> None:
    """Synthetic evaluation data of the training data's split draws the training samples (a batch is a function of
    seed, split, step and rank): its AUC would score the first training batches, not what the model learned.
    Refused. Evaluation files that are training files (by any name) score trained samples the same way, but are
    only warned about: a Criteo Kaggle download holds one labelled file."""
    if getattr(eval_data, "split", None) is not None and eval_data.split == getattr(train_data, "split", None):
        raise ValueError(f"data.eval.split={eval_data.split} is data.train's: the evaluation would score the first "
                         "data.eval_batches training batches; give data.eval a split of its own (eval)")
    train_paths = getattr(train_data, "paths", [])
    for path in getattr(eval_data, "paths", []):
        if any(os.path.samefile(path, trained) for trained in train_paths):
            log.warning("data.eval.paths shares %s with data.train.paths: the evaluation scores samples the model "
                        "trained on, not what it learned; give data.eval files of their own (a later day, or the last "
                        "lines of a file split off)", path)


def build_data(cfg: DictConfig, env: DistEnv) -> tuple:
    """The train dataset (`build_train_data`) and the eval one, labelled alike (`check_same_teacher`) and of samples
    of its own (`check_own_eval_samples`); trainer.epochs with step-indexed data needs data.steps_per_epoch."""
    train_data, eval_data = build_train_data(cfg, env), build_dataset(cfg, "eval", env)
    check_same_teacher(train_data, eval_data)
    check_own_eval_samples(train_data, eval_data)
    if cfg.trainer.max_steps is None and hasattr(train_data, "batch") and not cfg.data.get("steps_per_epoch"):
        raise ValueError("trainer.epochs with step-indexed (synthetic) data counts epochs of data.steps_per_epoch "
                         "steps: set it (>= 1), or trainer.max_steps; without it the run would never end")
    return train_data, eval_data


def train(cfg: DictConfig, env: DistEnv, run_dir: Path) -> TrainResult:
    check_config(cfg)
    t = cfg.trainer
    model = build_model(cfg, env)
    sparse = model.sparse_arch.embedding_bag_collection
    optimizer = instantiate(t.dense_optimizer, params=dense_parameters(model))
    train_data, eval_data = build_data(cfg, env)
    checkpoint_dir = Path(t.checkpoint_dir) if t.checkpoint_dir else run_dir / "checkpoints"

    step = 0
    if t.resume_from:
        files = not hasattr(train_data, "batch")  # resumed by skipping step count batches of the current size
        step = load_checkpoint(t.resume_from, model, optimizer, sparse.fused_optimizer,
                               cfg.data.global_batch_size if files else None)
    lr_factor = dlrm_lr_factor(cfg.model.lr_schedule)  # None: the configured lrs throughout
    # after loading (the configured lrs are its base), before the step is taken (LambdaLR wraps optimizer.step)
    schedule = DLRMLRSchedule(lr_factor, optimizer, sparse.fused_optimizer, step) if lr_factor else None
    step_optimizer = dense_step(optimizer, t.cuda_graphs, env.device)  # after loading: it sets the groups' options
    run_step = make_train_step(model, optimizer, step_optimizer, env.world_size, t.direct_step)

    def log_fields(interval: Interval) -> tuple[dict, str]:
        """The interval's loss and speed; with model.lr_schedule its last step's dense lr and the factor every
        table's configured embedding lr took with it."""
        loss = interval.losses[0]
        lr, lr_text = {}, ""
        if schedule:
            factor = lr_factor(interval.step - 1)
            lr = {"lr": schedule.dense_lr(interval.step - 1), "lr_factor": factor}
            lr_text = f" lr {lr['lr']:.4g} (x{factor:.4g})"
        return ({"loss": loss, **lr, "step_ms": interval.step_ms, "samples_per_s": interval.rate},
                f"loss {loss:.5f}{lr_text} step_ms {interval.step_ms:.1f} samples/s {interval.rate:.0f}")

    def run_eval(step: int) -> dict:
        scores = evaluate(model, eval_data, cfg.data.eval_batches, env, step)
        log.info("step %d eval auc %.4f log_loss %.4f", step, scores["auc"], scores["log_loss"])
        return scores

    def checkpoint(step: int) -> None:
        save_checkpoint(checkpoint_dir, step, model, optimizer, sparse.fused_optimizer, t.keep_checkpoints,
                        cfg.data.global_batch_size, t.resume_from)

    run = TrainingRun(t, env, run_dir, checkpoint_dir, step, items="samples", log=log,
                      items_per_step=cfg.data.global_batch_size, log_fields=log_fields, evaluate=run_eval,
                      save=checkpoint)

    # plain values: the loop reads them every step, and a DictConfig attribute costs ~10 us of host time
    max_steps, batches_ahead, prefetch = t.max_steps, t.batches_ahead, t.prefetch_input_dist
    header_ahead = t.header_ahead
    on_thread = prefetch and batches_ahead > 0 and t.input_dist_on_thread
    serialised = ranks_with_one_hardware_queue(env) if on_thread and env.world_size > 1 else []
    if serialised:  # the thread's all-to-alls and the step's collectives would queue in orders that differ by rank
        log.warning("trainer.input_dist_on_thread is off: CUDA_DEVICE_MAX_CONNECTIONS=1 on rank(s) %s puts every "
                    "stream's kernels in one queue, where the batch thread's all-to-alls and the step's collectives "
                    "could wait for each other across ranks; the next batch's input dist runs on the side stream "
                    "from the loop's thread instead", serialised)
        on_thread = False
    copy_stream = None  # next_batch's side stream (not used when the batch thread distributes)
    if env.device.type == "cuda" and not on_thread:
        copy_stream = input_stream(env.device)
        copy_stream.wait_stream(torch.cuda.current_stream())  # once: the model and data set-up are complete

    following = []  # with trainer.header_ahead: the batch after the next one, its header already exchanged

    def fetch() -> Batch | Exception | None:
        """`pull_batch`'s next batch, on the device (the BatchesAhead thread copies its batches there)."""
        return pull_batch(batches, None if batches_ahead else env.device)

    def next_batch() -> Batch | Exception | None:
        """The next batch on the device, its input all-to-all already under way when prefetching; None once the run
        is done (max_steps, or the end of trainer.epochs: batch_stream ends there).

        The batch was made (generated, or pinned and copied from the host) by the `BatchesAhead` thread, or made
        here when `trainer.batches_ahead=0`. On GPUs the input all-to-all is issued on a side stream behind the
        batch only (prefetch's stream waits on the stream current here, and the input dist has its own
        communicator): it runs while the kernels of the step just enqueued still execute. The forward makes the
        main stream wait for those bags (an event). With `trainer.header_ahead` the batch after it is fetched too
        and its header all-to-all (the sizes the host must know) starts now, so that next step's prefetch finds
        the sizes on the host instead of waiting for them while the GPU drains. On the CPU it is a plain call
        (torch.cuda.stream(None) does nothing).

        A batch this rank could not make is the error raised making it (`pull_batch`), which the input dist takes
        in the batch's place: the batch thread's prepare_failed, or prefetch_header / prefetch here, then raise on
        every rank at that batch; with prefetch off it is returned, and the step raises it where its forward would
        have distributed the batch. Whether the run is done is known before a batch is fetched, on every rank alike.
        """
        if done():
            return None
        if on_thread:  # distributed by the batch thread; the forward waits for its bags (an event)
            return next(batches, (None, None))[1]
        with torch.cuda.stream(copy_stream):
            batch = following.pop() if following else fetch()
            if batch is not None and prefetch:
                sparse.prefetch(features_of(batch))  # a batch this rank could not make raises here, on every rank
        if not isinstance(batch, Batch):  # the stream's end; or, prefetch off, a batch this rank could not make
            return batch
        if copy_stream is not None:
            main = torch.cuda.current_stream()
            batch.record_stream(main)  # made on another stream, read on the main one
            main.wait_stream(copy_stream)  # the work enqueued there so far: not the following batch's below
        if prefetch and header_ahead:
            with torch.cuda.stream(copy_stream):
                following.append(fetch())
                if following[0] is not None:
                    sparse.prefetch_header(features_of(following[0]))
        return batch

    def done() -> bool:
        return max_steps is not None and run.step >= max_steps

    batches = batch_stream(train_data, step, cfg.data.get("steps_per_epoch"), t.epochs)
    prepare = distribute = None
    if on_thread:
        distribute = sparse.input_dist_on_thread()  # a communicator of its own: on every rank, here
        prepare = lambda batch: distribute(batch.sparse_features)  # noqa: E731
    with (BatchesAhead(batches, env.device, batches_ahead, prepare, prepare_failed=distribute) if batches_ahead
          else nullcontext(batches) as batches):
        batch = next_batch()
        while batch is not None:
            if isinstance(batch, Exception):  # prefetch off: where the forward would distribute it, every rank raises
                sparse.bags_of(batch)
            loss = run_step(batch)
            run.end_step(loss, items=sparse.global_batch_size)  # step += 1; its loss kept on the device
            if schedule:
                schedule.step()  # the next step's lr, dense and embedding
            try:
                batch = next_batch()  # its input dist overlaps this step's tail on the GPU
            except Exception as error:
                if raised_on_every_rank(error):  # a bad batch distributed ahead: after this step's cadence, as
                    run.after_step()  # in-forward distribution raises it (its checkpoint kept); any other error
                raise  # may be this rank's alone, whose peers would not join the cadence's collectives
            run.after_step()  # on its cadence: loss check (NaN stop) and log, checkpoint, evaluation
    # the stream (ended only by trainer.epochs) ended before a step: said, as TrainingRun says a start at max_steps
    if run.step == step and not done():
        log.warning("the run starts at step %d, at or past the end of trainer.epochs=%d: it trains no step (only "
                    "evaluates); raise trainer.epochs to train on", step, t.epochs)
    sparse.drop_prefetched()  # batches distributed ahead that the run ends before
    if sparse.fused is not None:  # the exchange's own push is the slower fallback (an extra pass over d S)
        pushes = sparse.fused.backward_pushes
        log.info("comm=fused: the tables' gradient pushed to their owners by the interaction's backward kernel in "
                 "%d steps, by the exchange's push kernel in %d", pushes["consumer"], pushes["exchange"])
    return run.finish()  # the last loss check, evaluation and checkpoint
