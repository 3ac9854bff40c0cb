"""One GPU, world of 1: the MoE layer bulk against fused (a simulated one-rank workspace, so the fused kernels run
with nothing to exchange) at the per-rank GEMM work of issue 4's first config on 2 GPUs (default: 8192 tokens,
d=2048, ffn=1408, 32 experts, top-6: 49,152 rows) or, with `--config second`, of its second (8192 tokens, d=4096,
ffn=14336, 4 experts, top-2: 16,384 rows) or `--config third` (16,384 tokens, d=1024, ffn=512, 32 experts, top-8:
131,072 rows) or `--config quick` (moe.bench --quick's: 2048 tokens, d=512, ffn=256, 8 experts, top-2), bf16.
Prints the fused gradients' error against bulk, the GPU's span per forward and forward+backward and the 12 longest
kernels in it (torch profiler, 10 calls after warm-up; concurrent launches of a
kernel counted once; the share of the span the GPU sat idle), for bulk and two fused layers ("fused": buffers
grown to the rows seen, the forward reads the counts on the host; "bounded": sized for the config's tokens,
FusedMoEConfig.max_tokens_per_rank, no host sync in the forward), the wall time per call (20 calls back to back; host
time inside the calls; one call between CUDA events), where the host's time goes in a forward and in a forward +
backward (cProfile), and the timeline of one forward and of one forward + backward in a back-to-back run: every
top-level host op and GPU kernel with its start, length and the GPU's idle gap before it; `repeat`: 1,000 fused
forward+backward calls on the same input, each bit-equal to the first (every GEMM tile computed exactly once,
whichever program takes it); `grow`: a new fused layer whose second call's rows outgrow its first call's receive
capacity, against bulk.

    PYTHONPATH=. python scripts/one_gpu/moe_layer.py [--config first|second|third] [errors] [grow] [kernels] [wall]
        [host] [timeline] [repeat]   (default: all)

(docs/benchmarks.md, ninth session: calls G8-G10 ran the profile and the wall timing as two scratch scripts, the
wall timing without zeroing the gradients between calls.)
"""
import argparse
import cProfile
import itertools
import pstats
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from fused_dlrm.dist.symmetric import SimulatedWorld
from moe import MoELayer
from moe.layer import FusedMoEConfig

CONFIGS = {"first": (8192, 2048, 1408, 32, 6), "second": (8192, 4096, 14336, 4, 2),  # tokens, d, ffn, experts, k
           "third": (16384, 1024, 512, 32, 8), "quick": (2048, 512, 256, 8, 2)}  # quick: moe.bench --quick's
parser = argparse.ArgumentParser(prog="scripts/one_gpu/moe_layer.py")
parser.add_argument("--config", choices=CONFIGS, default="first")
parser.add_argument("sections", nargs="*", help="errors grow kernels wall host timeline repeat (default: all)")
args = parser.parse_args()
T, D, F, E, K = CONFIGS[args.config]
torch.manual_seed(0)  # the same data in every run: errors comparable from run to run
x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
g = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)

def fused_layer(max_tokens: int | None = None) -> MoELayer:
    return MoELayer(D, F, E, K, seed=1, dtype=torch.bfloat16, device="cuda", comm="fused",
                    fused=FusedMoEConfig(max_tokens_per_rank=max_tokens),
                    workspace=SimulatedWorld(1, "cuda").workspaces()[0])


# "fused": buffers grown to the rows seen (the forward reads the counts on the host); "bounded": sized for T tokens
# (max_tokens_per_rank: no host sync in the forward)
layers = {"bulk": MoELayer(D, F, E, K, seed=1, dtype=torch.bfloat16, device="cuda"), "fused": fused_layer(),
          "bounded": fused_layer(T)}


def fwd(layer):
    with torch.no_grad():
        layer(x)


def fwd_bwd(layer, tokens: int = T) -> dict[str, torch.Tensor]:
    """One forward+backward of the first `tokens` tokens from zero gradients: the output, x's gradient and the
    parameters', by name (the layer's gradients are None again afterwards)."""
    layer.zero_grad(set_to_none=True)
    xx = x[:tokens].detach().requires_grad_()
    y, _ = layer(xx)
    y.backward(g[:tokens])
    out = {"y": y.detach(), "x": xx.grad, **{n: p.grad for n, p in layer.named_parameters()}}
    layer.zero_grad(set_to_none=True)
    return out


def errors():
    """Outputs and gradients of one forward+backward, either fused layer against bulk."""
    want = fwd_bwd(layers["bulk"])
    for c in ("fused", "bounded"):
        print(f"== {c}")
        print_errors(fwd_bwd(layers[c]), want)


def print_errors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    for n, w in want.items():
        error = (got[n].float() - w.float()).abs().max() / w.float().abs().max()
        print(f"{n}: relative error fused vs bulk {float(error):.2e}")


def grow():
    """A new fused layer called on a quarter of the tokens, then all of them, then half: the second call's rows
    outgrow the receive capacity the first reserved, so it dispatches again in larger buffers (two dispatches);
    every call's output and gradients against bulk."""
    fused = fused_layer()
    workspace = fused.dispatch.ws
    for tokens in (T // 4, T, T // 2):
        print(f"== {tokens} tokens")
        print_errors(fwd_bwd(fused, tokens), fwd_bwd(layers["bulk"], tokens))
        print(f"receive capacity {fused.dispatch.capacity} rows, dispatches so far "
              f"{workspace._epochs['moe_dispatch']}")  # the exchange's epoch counter
    fused.dispatch.errors.check(block=True)


def kernels():
    """Per call (torch profiler, 10 calls after warm-up, each synced and apart): the GPU's span, the share of it the
    GPU sat idle, and the 12 longest kernels by the time covered by their launches in the call (the union of their
    intervals: concurrent launches of one kernel, such as GEMM 1's helpers, count once), medians over the calls."""
    for what, fn in (("fwd", fwd), ("fwd+bwd", fwd_bwd)):
        for c, layer in layers.items():
            for _ in range(3):
                fn(layer)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(10):
                    fn(layer)
                    torch.cuda.synchronize()
                    time.sleep(0.005)  # calls apart: a gap of more than 2 ms separates them below
            events = sorted((e for e in prof.events() if e.device_type.name == "CUDA"
                             and e.time_range.end > e.time_range.start), key=lambda e: e.time_range.start)
            calls = [[events[0]]]
            for e in events[1:]:
                if e.time_range.start - max(f.time_range.end for f in calls[-1]) > 2000:
                    calls.append([])
                calls[-1].append(e)
            spans, idle, by_name = [], [], {}
            for call in calls:
                begin, end = call[0].time_range.start, max(e.time_range.end for e in call)
                busy, last = 0, begin
                for e in call:  # the union of the kernels' intervals
                    busy += max(0, e.time_range.end - max(e.time_range.start, last))
                    last = max(last, e.time_range.end)
                spans.append(end - begin)
                idle.append(1 - busy / (end - begin))
                names = {}  # name -> (time in the union of its launches' intervals, last end, launches)
                for e in call:
                    covered, last_end, n = names.get(e.name, (0, 0, 0))
                    covered += max(0, e.time_range.end - max(e.time_range.start, last_end))
                    names[e.name] = (covered, max(last_end, e.time_range.end), n + 1)
                for name, (covered, _, n) in names.items():
                    by_name.setdefault(name, []).append((covered, n))
            print(f"== {what} {c}: {len(calls)} calls, GPU span per call {statistics.median(spans) / 1e3:.2f} ms, "
                  f"idle {100 * statistics.median(idle):.0f}% of it")
            rows = sorted(((statistics.median(s for s, _ in v), v[0][1], name) for name, v in by_name.items()),
                          reverse=True)
            for us, n, name in rows[:12]:
                print(f"  {us:8.1f} us  x{n:<3} {name[:100]}")


def wall():
    """Wall and host time per call back to back, and one call between CUDA events."""
    for what, fn in (("fwd", fwd), ("fwd+bwd", fwd_bwd)):
        for c, layer in layers.items():
            walls, hosts, synced = [], [], []
            for _ in range(3):  # warm-up (compiles on a first call)
                fn(layer)
            for _ in range(5):
                torch.cuda.synchronize()
                start, in_call = time.perf_counter(), 0.0
                for _ in range(20):
                    t = time.perf_counter()
                    fn(layer)
                    in_call += time.perf_counter() - t
                torch.cuda.synchronize()
                walls.append((time.perf_counter() - start) / 20 * 1e3)
                hosts.append(in_call / 20 * 1e3)
            for _ in range(10):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda.synchronize()
                a.record()
                fn(layer)
                b.record()
                torch.cuda.synchronize()
                synced.append(a.elapsed_time(b))
            print(f"{what:8} {c:6} wall per call back to back {statistics.median(walls):.2f} ms, host in the call "
                  f"{statistics.median(hosts):.2f} ms, one call synced {statistics.median(synced):.2f} ms")


def host():
    """Where the host's time goes in 20 forwards, and in 20 forwards + backwards (cProfile)."""
    for what, fn in (("forwards", fwd), ("forwards + backwards", fwd_bwd)):
        for c, layer in layers.items():
            for _ in range(3):
                fn(layer)
            torch.cuda.synchronize()
            profiler = cProfile.Profile()
            profiler.enable()
            for _ in range(20):
                fn(layer)
            torch.cuda.synchronize()
            profiler.disable()
            print(f"== host time of 20 {what}, {c} (cProfile): the project's functions, cumulative; then every "
                  f"function by its own time")
            stats = pstats.Stats(profiler)
            stats.sort_stats("cumulative").print_stats(r"moe/|fused_dlrm/", 25)
            stats.sort_stats("tottime").print_stats(25)


def timeline():
    """One forward, and one forward + backward, in a back-to-back run (the 3rd of 4 profiled calls), host ops (H:
    top-level ops, Triton's launches among them) and GPU work (G) merged by start time, in us from the call's
    start; for G the GPU's idle time since the previous kernel ended."""
    for (what, fn), (c, layer) in itertools.product((("forward", fwd), ("forward + backward", fwd_bwd)),
                                                    layers.items()):
        for _ in range(3):
            fn(layer)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for i in range(4):
                with torch.profiler.record_function(f"call {i}"):
                    fn(layer)
            torch.cuda.synchronize()
        events = prof.events()
        call = next(e for e in events if e.name == "call 2")
        begin, end = call.time_range.start, call.time_range.end
        next_call = next(e for e in events if e.name == "call 3").time_range.start
        host = [("H", e) for e in events if e.device_type.name == "CPU" and e.cpu_parent is call]
        gpu = sorted((e for e in events if e.device_type.name == "CUDA" and not e.name.startswith("call ")),
                     key=lambda e: e.time_range.start)  # (the record_function ranges appear on the GPU too)
        last_end = max((e.time_range.end for e in gpu if e.time_range.start < begin), default=begin)
        gpu = [("G", e) for e in gpu if begin <= e.time_range.start < next_call]
        print(f"== timeline of one {c} {what}: host call {(end - begin):.0f} us")
        for kind, e in sorted(host + gpu, key=lambda ke: ke[1].time_range.start):
            start, length = e.time_range.start - begin, e.time_range.end - e.time_range.start
            gap = ""
            if kind == "G":
                gap = f"  idle {max(0, e.time_range.start - last_end):6.0f}"
                last_end = max(last_end, e.time_range.end)
            print(f"  {kind} {start:8.0f} {length:7.0f}{gap}  {e.name[:90]}")


def repeat(calls: int = 1000):
    """The bounded fused layer's forward+backward, `calls` times on the same input: the output and every gradient
    must be bit-equal to the first call's, and no wait may time out."""
    layer = layers["bounded"]
    first = fwd_bwd(layer)
    differing = 0
    for i in range(1, calls):
        if not all(torch.equal(t, first[n]) for n, t in fwd_bwd(layer).items()):
            differing += 1
            print(f"call {i}: differs from the first")
    layer.dispatch.errors.check(block=True)
    layer.combine.errors.check(block=True)
    print(f"repeat: {calls} fused forward+backward calls, {differing} differing from the first")
    if differing:
        raise SystemExit(1)


SECTIONS = {"errors": errors, "grow": grow, "kernels": kernels, "wall": wall, "host": host, "timeline": timeline,
            "repeat": repeat}
unknown = [name for name in args.sections if name not in SECTIONS]
if unknown:
    parser.error(f"unknown sections {unknown}: expected some of {', '.join(SECTIONS)}")
for name in args.sections or SECTIONS:
    SECTIONS[name]()
