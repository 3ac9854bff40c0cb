"""Where a DLRM training step's wall time goes: `train.py`'s own loop, timed in its parts, without a profiler
(a profiler's host overhead turns this loop host-bound and hides what binds it).

    torchrun --nproc_per_node=2 scripts/loop_parts.py model=dlrm_paper comm=fused trainer.max_steps=150 ...

Every rank prints, as medians over steps PARTS_START .. PARTS_START + PARTS_STEPS (environment; 60 and 60):
- wall: host time per step, from the end of the step before to this one's end (outside + train_step: the loop's
  period, measured over the same steps as the parts, so that each part's median stays below it);
- host: inside train_step (enqueueing forward, backward, optimizer; split into the model's forward, loss.backward()
  with the embedding backward inside it (lookup.apply_gradient, on autograd's thread) and the rest: the loss,
  zero_grad and the optimizer step; or DirectDLRMStep.step, trainer.direct_step's, which calls no forward (nan) and,
  with comm=fused, no backward (nan)), and outside it: next() (waiting for the batch thread), the next batch's
  prefetch, the header of the one after it (`prefetch_header`, with trainer.header_ahead), after_step (log / eval
  cadence); and across those, the input dist's `start` (the header all-to-all enqueued) and its wait for the header
  on the host (the one host sync of a step; GPUs only) -- with trainer.input_dist_on_thread, the batch thread's
  (prefetch and prefetch_header then do not run: nan); and the batch thread's times per batch, each with its CPU
  time (a wait that spins, as cudaEventSynchronize on the header does, counts as CPU; the rest blocked: on the
  GIL, a queue): made and copied (the data set's batch, generated or parsed, copied to the device) and prepared
  (BatchesAhead._make: on the thread, its input dist and backward plan); their sum above the wall: the thread
  binds the loop;
- GPU (CUDA events on the main stream): from a step's first kernel to its last, and from there to the next step's
  first (the main stream idle between steps, waiting for the host or for the prefetch's side stream).
The wall is train_step + outside by construction; with the GPU's span below it and the main stream idle between
steps, the host binds the step; a wall spent in next() is the loop waiting for the batch thread (itself, or the GPU).
With PARTS_PROFILE=N (GPUs), the N steps after those are recorded by torch.profiler (CUDA activity only, to
keep its host overhead small) and each rank prints the GPU's busy time per step (the union of its kernels on all
streams: below the wall, the GPU waits for the host; also without NCCL's kernels and the ready waits, which may
spin for a peer) and the kernels taking the most of it; with PARTS_TRACE=DIR too, each rank writes those steps'
kernels as a Chrome trace, DIR/loop_rank<r>.json (to follow the critical path offline, without device time);
with PARTS_PROFILE_CPU=1 too, the host's torch ops and autograd nodes (every thread) are recorded as well, at
the cost of the host overhead that the CUDA-only default avoids (the steps' times are then not the loop's).
With PARTS_HOST_PROFILE=N, the N loop iterations after those run under cProfile (the main thread: the batch thread
is not profiled) and each rank prints the functions taking the most host time, cumulative, in ms per step (the
profiler's own overhead included: ~20% on the DLRM paper loop, docs/benchmarks.md 2026-11-28); with PARTS_HOST_DUMP=DIR
too, each rank also writes the profile as DIR/host_rank<r>.prof (pstats: callers and own times, offline).
The loop's functions are wrapped here (not changed): what runs is train.py's loop itself.
"""
import cProfile
import os
import pstats
import runpy
import statistics
import sys
import time

import torch

import fused_dlrm.train.loop as loop
from torchrec.models.dlrm import DLRM

from fused_dlrm.sparse.input_dist import BulkInputDist
from fused_dlrm.sparse.lookup import PooledEmbeddingLookup
from fused_dlrm.sparse.sharded_ebc import ShardedEmbeddingBagCollection
from fused_dlrm.train.batches_ahead import BatchesAhead
from fused_dlrm.train.direct_step import DirectDLRMStep
from fused_dlrm.train.schedule import TrainingRun


def count(name: str, default: int, least: int) -> int:
    """The environment's count `name`, refused before training unless a whole number >= least (PARTS_STEPS=0
    would report medians of nothing)."""
    value = os.environ.get(name, str(default))
    if not value.strip().isdigit() or int(value) < least:
        sys.exit(f"loop_parts: {name}={value!r}: expected a whole number >= {least}")
    return int(value)


START, STEPS = count("PARTS_START", 60, 0), count("PARTS_STEPS", 60, 1)
CUDA = torch.cuda.is_available()
profiled = count("PARTS_PROFILE", 0, 0)  # checked on the CPU too, where nothing is profiled
PROFILE_STEPS = profiled if CUDA else 0
ACTIVITIES = [torch.profiler.ProfilerActivity.CUDA] + (
    [torch.profiler.ProfilerActivity.CPU] if os.environ.get("PARTS_PROFILE_CPU") == "1" else [])
profiler = torch.profiler.profile(activities=ACTIVITIES) if PROFILE_STEPS else None
HOST_PROFILE_STEPS = count("PARTS_HOST_PROFILE", 0, 0)
HOST_FIRST = START + STEPS + PROFILE_STEPS
host_profiler = cProfile.Profile() if HOST_PROFILE_STEPS else None
host = {k: [] for k in ("wall", "train_step", "forward", "backward", "embedding_backward", "outside", "next",
                        "prefetch", "header_start", "header_wait", "prefetch_header", "after_step", "pull",
                        "pull_cpu", "batch", "batch_cpu")}
events = []  # (main-stream event at a step's start, at its end)
state = {"step": 0, "last_end": None}


def measuring() -> bool:
    return START <= state["step"] < START + STEPS


def timed(key, function):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        result = function(*args, **kwargs)
        if measuring():
            host[key].append(time.perf_counter() - start)
        return result
    return wrapper


def on_thread(key, function):
    """`function`'s time per call on the batch thread, and the thread's CPU time in it (key, key + "_cpu")."""
    def wrapper(*args):
        begin, cpu = time.perf_counter(), time.thread_time()
        result = function(*args)
        if measuring():
            host[key].append(time.perf_counter() - begin)
            host[key + "_cpu"].append(time.thread_time() - cpu)
        return result
    return wrapper


def pulled(self, batches):
    """BatchesAhead._pulled, each batch timed: made by the data set (a synthetic batch generated, a file's parsed
    or received from its workers) and copied to the device, on the batch thread."""
    made = original_pulled(self, batches)
    pull = on_thread("pull", lambda: next(made, None))
    while (item := pull()) is not None:
        yield item


def start(self, kjt):
    """A batch's header all-to-all enqueued (with trainer.header_ahead, a step before its prefetch)."""
    return timed("header_start", original_start)(self, kjt)


def finish(self, pending):
    """The rest of a batch's input dist, after waiting for its header on the host (the event of `start`)."""
    if pending.both.ready is not None and measuring():
        begin = time.perf_counter()
        pending.both.ready.synchronize()
        host["header_wait"].append(time.perf_counter() - begin)
    return original_finish(self, pending)


def timed_step(original):
    """A step function (train_step, DirectDLRMStep.step) timed as the step, with the parts' cadence around it."""
    def step(*args, **kwargs):
        start = time.perf_counter()
        if measuring() and state["last_end"] is not None:
            host["outside"].append(start - state["last_end"])
        began = ended = None
        if CUDA:
            began, ended = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            began.record()
        loss = original(*args, **kwargs)
        if measuring():
            end = time.perf_counter()
            host["train_step"].append(end - start)
            if state["last_end"] is not None:
                host["wall"].append(end - state["last_end"])
            if CUDA:
                ended.record()
                events.append((began, ended))
        state["step"] += 1
        if state["step"] == START + STEPS:
            report()
            if profiler is not None:
                torch.cuda.synchronize()
                profiler.start()
        if profiler is not None and state["step"] == START + STEPS + PROFILE_STEPS:
            torch.cuda.synchronize()
            profiler.stop()
            report_kernels()
        if host_profiler is not None and state["step"] == HOST_FIRST:
            host_profiler.enable()
        if host_profiler is not None and state["step"] == HOST_FIRST + HOST_PROFILE_STEPS:
            host_profiler.disable()
            report_host()
        state["last_end"] = time.perf_counter()
        return loss
    return step


def report() -> None:
    ms = {k: statistics.median(v) * 1e3 if v else float("nan") for k, v in host.items()}
    gpu = ""
    if CUDA:
        torch.cuda.synchronize()
        span = statistics.median(b.elapsed_time(e) for b, e in events)
        idle = statistics.median(events[i][1].elapsed_time(events[i + 1][0]) for i in range(len(events) - 1))
        gpu = f" | GPU main stream: step span {span:.2f}, idle to the next step {idle:.2f}"
    rest = ms["train_step"] - ms["forward"] - ms["backward"]
    print(f"== rank {os.environ.get('RANK', 0)}, ms per step: wall {ms['wall']:.2f} | host: train_step "
          f"{ms['train_step']:.2f} (forward {ms['forward']:.2f}, backward {ms['backward']:.2f} with the embedding "
          f"backward {ms['embedding_backward']:.2f}, rest {rest:.2f}), outside {ms['outside']:.2f} (next() "
          f"{ms['next']:.2f}, prefetch {ms['prefetch']:.2f}"
          f", prefetch_header {ms['prefetch_header']:.2f}, after_step {ms['after_step']:.2f}); input dist: header "
          f"start {ms['header_start']:.2f}, wait for the header {ms['header_wait']:.2f} | batch thread per batch: made "
          f"and copied {ms['pull']:.2f} (CPU {ms['pull_cpu']:.2f}), then prepared {ms['batch']:.2f} (CPU "
          f"{ms['batch_cpu']:.2f}){gpu}", flush=True)


WAITING_KERNELS = ("ncclDevKernel", "_wait_ready")  # they spin until a peer arrives: busy, but maybe only waiting


def busy_us(kernels) -> float:
    """The union of the kernels' intervals."""
    busy, end = 0.0, float("-inf")
    for e in sorted(kernels, key=lambda e: e.time_range.start):
        start, stop = max(e.time_range.start, end), e.time_range.end
        busy += max(0.0, stop - start)
        end = max(end, stop)
    return busy


def report_kernels() -> None:
    """GPU busy time per profiled step (union of kernel intervals, all streams; and without the kernels that may
    only wait for a peer: NCCL's and the ready wait) and the largest kernels."""
    trace_dir = os.environ.get("PARTS_TRACE")
    if trace_dir:
        os.makedirs(trace_dir, exist_ok=True)
        profiler.export_chrome_trace(os.path.join(trace_dir, f"loop_rank{os.environ.get('RANK', 0)}.json"))
    kernels = [e for e in profiler.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = busy_us(kernels)
    computing = busy_us([e for e in kernels if not any(w in e.name for w in WAITING_KERNELS)])
    by_name: dict[str, float] = {}
    for e in kernels:
        by_name[e.name] = by_name.get(e.name, 0.0) + e.time_range.elapsed_us()
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:12]
    per_step = ", ".join(f"{name[:60]} {us / PROFILE_STEPS / 1e3:.3f}" for name, us in top)
    print(f"== rank {os.environ.get('RANK', 0)}, profiled steps: GPU busy {busy / PROFILE_STEPS / 1e3:.2f} ms per step "
          f"(without NCCL and ready waits: {computing / PROFILE_STEPS / 1e3:.2f}; {len(kernels) / PROFILE_STEPS:.0f} "
          f"kernels); largest, ms per step: {per_step}", flush=True)


def report_host(top: int = 25) -> None:
    """The functions taking the most host time over the profiled iterations, cumulative, in ms per step."""
    dump_dir = os.environ.get("PARTS_HOST_DUMP")
    if dump_dir:
        os.makedirs(dump_dir, exist_ok=True)
        host_profiler.dump_stats(os.path.join(dump_dir, f"host_rank{os.environ.get('RANK', 0)}.prof"))
    stats = pstats.Stats(host_profiler).stats  # (file, line, name) -> (primitive calls, calls, own, cumulative, ..)
    rows = sorted(stats.items(), key=lambda kv: -kv[1][3])[:top]
    lines = "\n".join(f"  {ct / HOST_PROFILE_STEPS * 1e3:7.3f} cumulative {tt / HOST_PROFILE_STEPS * 1e3:7.3f} own "
                      f"{nc / HOST_PROFILE_STEPS:6.1f} calls  {os.path.basename(file)}:{line}({name})"
                      for (file, line, name), (_, nc, tt, ct, _) in rows)
    print(f"== rank {os.environ.get('RANK', 0)}, host profile, ms per step over {HOST_PROFILE_STEPS} steps:\n{lines}",
          flush=True)


loop.train_step = timed_step(loop.train_step)
DirectDLRMStep.step = timed_step(DirectDLRMStep.step)
DLRM.forward = timed("forward", DLRM.forward)
torch.Tensor.backward = timed("backward", torch.Tensor.backward)  # the loop's only backward: its loss's
PooledEmbeddingLookup.apply_gradient = timed("embedding_backward", PooledEmbeddingLookup.apply_gradient)
ShardedEmbeddingBagCollection.prefetch = timed("prefetch", ShardedEmbeddingBagCollection.prefetch)
ShardedEmbeddingBagCollection.prefetch_header = timed("prefetch_header", ShardedEmbeddingBagCollection.prefetch_header)
original_start, BulkInputDist.start = BulkInputDist.start, start
original_finish, BulkInputDist.finish = BulkInputDist.finish, finish
BatchesAhead.__next__ = timed("next", BatchesAhead.__next__)
original_make, BatchesAhead._make = BatchesAhead._make, on_thread("batch", BatchesAhead._make)
original_pulled, BatchesAhead._pulled = BatchesAhead._pulled, pulled
TrainingRun.after_step = timed("after_step", TrainingRun.after_step)
sys.argv = ["train.py"] + sys.argv[1:]
runpy.run_path(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "train.py"),
               run_name="__main__")
if state["step"] < HOST_FIRST + HOST_PROFILE_STEPS:  # a report not printed: say why rather than end silently
    sys.exit(f"loop_parts: the run took {state['step']} steps, fewer than PARTS_START + PARTS_STEPS (+ PARTS_PROFILE "
             f"+ PARTS_HOST_PROFILE) = {HOST_FIRST + HOST_PROFILE_STEPS}: raise trainer.max_steps or lower those")
