"""Benchmark of the expert-parallel MoE layer, bulk against fused, bf16 (not a test).

`torchrun --nproc_per_node=2 --standalone -m moe.bench [--quick] [--configs 1,3] [--fused rows tokens tokens+combine]
[--out FILE]`

Per config, on every rank: tokens/GPU random bf16 tokens, the layer's own router (skewed configs add a logit
bias that sends about half of the tokens to expert 0). Phases, each timed alone on prepared inputs:
  bulk:  dispatch = NCCL all-to-all of the permuted rows + regroup; experts = SwiGLU (torch._grouped_mm, both
         GEMMs); combine = NCCL all-to-all back + weighted unpermute
  fused: dispatch = FusedDispatch: the push into the owners' buffers + the first GEMM waiting per tile;
         combine = FusedCombine: the second GEMM storing into the sources' buffers + the flag-waiting unpermute
         (no separate experts phase); buffers sized for the config's tokens per GPU (max_tokens_per_rank: no
         host sync in the forward)
Totals time the whole layer (routing, permutation and counts exchange included), forward and forward+backward (the
fused backward moves both gradients the same way). The forward also with the GPUs lined up and a head start
(fused_dlrm/bench/timing.py, start="device": its device time once enqueued; a host sync inside a call, as in
bulk's split sizes, still shows), at two head starts (1 and 3 ms): where they agree the host was hidden. Ideal
overlap: communication (bulk dispatch + combine; twice that for forward+backward) hidden entirely under
everything else: ideal = max(bulk total - comm, comm); the table gives ideal / fused total in %. "fwd b2b" is the
forward's time per call over 20 calls back to back (no sync between them, as layers follow each other in a model):
the host's enqueue time counts there as it does in training, and it can differ from the synced figure either way.
The fused outputs are checked against bulk first (max relative error; above MAX_ERROR an error on every rank: a
wrong result is not timed), then their gradients (one forward+backward from the same tokens and upstream gradient:
x's, the router's and every expert weight's, by max relative error against MAX_GRAD_ERROR; the JSON keeps the
largest). The fused layers `--fused` picks are timed in the same run against the same bulk layer: dispatch and
combine by row "fused"; the dispatch by token "fused/tok"; and the combine by token as well "fused/tok+c"
(FusedMoEConfig.dispatch and .combine; by token in its backward too).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from fused_dlrm.bench import init_gpu_world, named_twice
from fused_dlrm.bench.checks import check_against_bulk, max_relative_error
from fused_dlrm.bench.timing import HEAD_START_CYCLES, per_call_us, time_ms
from fused_dlrm.dist.env import check_rank_0_can_write, of_every_rank, raise_on_every_rank
from fused_dlrm.report.render import environment
from moe.expert_layout import gather_counts_and_words
from moe.layer import REFUSAL_WORDS, FusedMoEConfig, MoELayer, _Alongside, _BulkRows
from moe.permute import permutation, permute, unpermute


@dataclass(frozen=True)
class Config:
    tokens: int  # per GPU
    d_model: int
    ffn: int
    experts: int
    top_k: int
    skewed: bool = False

    @property
    def name(self) -> str:
        skew = ", skewed" if self.skewed else ""
        return f"T={self.tokens} d={self.d_model} ffn={self.ffn} E={self.experts} k={self.top_k}{skew}"


CONFIGS = [Config(8192, 2048, 1408, 64, 6), Config(8192, 4096, 14336, 8, 2), Config(16384, 1024, 512, 64, 8),
           Config(8192, 2048, 1408, 64, 6, skewed=True)]
QUICK = [Config(2048, 512, 256, 8, 2), Config(2048, 512, 256, 8, 2, skewed=True)]
# bf16: the fused outputs measured 7.9e-3..1.2e-2 from bulk's (docs/benchmarks.md); a lost or misplaced row ~1
MAX_ERROR = 5e-2
# The gradients (bf16, not yet measured on GPUs): each GEMM rounds its fp32 sums once (2^-8 = 3.9e-3 relative), so
# the error does not grow with the rows summed; the forward's 7.9e-3..1.2e-2 are 2-3 such roundings, the backward
# adds its GEMMs' to the forward's. In fp16 in the interpreter (d=64..128, top 2 or 4 of 8 experts) the fused
# gradients were 1-1.7x as far from bulk's as the forward: ~2e-2 expected in bf16. A gradient of the wrong expert,
# doubled, or without its routing weight (< 1: 1/weight times too large) is ~1 off: 5e-2 stops them.
MAX_GRAD_ERROR = 5e-2


def skew_bias(layer: MoELayer, x: torch.Tensor, fraction: float = 0.5) -> torch.Tensor:
    """A logit bias on expert 0 such that about `fraction` of the tokens (all ranks' alike) choose it."""
    low, high = 0.0, 64.0
    bias = torch.zeros(layer.num_experts, device=x.device)
    for _ in range(30):
        bias[0] = (low + high) / 2
        chosen = (layer.router(x, bias).expert_ids == 0).any(dim=-1).float().mean()
        dist.all_reduce(chosen)
        if chosen.item() / dist.get_world_size() < fraction:
            low = bias[0].item()
        else:
            high = bias[0].item()
    return bias


def phases(layer: MoELayer, x: torch.Tensor, bias: torch.Tensor | None) -> dict[str, Callable[[], object]]:
    """The phases of one forward, each a function of prepared inputs."""
    rank, world, local = layer.rank, layer.world, layer.num_local_experts
    routing = layer.router(x, bias)
    kept = None if routing.capacity is None else routing.kept  # the layer's permutation, in both modes
    if layer.comm == "bulk":
        rows, perm = permute(x, routing.expert_ids, layer.num_experts, kept, routing.block_counts)
    else:  # the fused dispatch sends each row's routing weight
        perm = permutation(routing.expert_ids, layer.num_experts, kept, routing.weights, routing.block_counts)
    # the layer's all-gather: the counts, then every rank's refusal words (none here)
    gathered = gather_counts_and_words(perm.tokens_per_expert, perm.tokens_per_expert.new_zeros(REFUSAL_WORDS))
    counts = gathered[:, :layer.num_experts].contiguous()
    e = layer.experts
    if layer.comm == "bulk":
        send, recv = counts[rank].view(world, -1), counts[:, rank * local:(rank + 1) * local]
        exchange = _BulkRows(recv, torch.stack([send, recv]).cpu(), layer.group)
        received = exchange.to_owners(rows)
        sizes = exchange.tokens_per_local_expert
        expert_out = e(received, sizes)
        return {"dispatch": lambda: exchange.to_owners(rows), "experts": lambda: e(received, sizes),
                "combine": lambda: unpermute(exchange.to_sources(expert_out), perm, routing.weights)}

    def dispatch_and_gemm1():  # the layer's, as a forward without a backward runs it
        return layer._fused_dispatch(x, counts, gathered, perm, e.w13, keep_a13=False, overlap=_Alongside(None))[1]

    out = dispatch_and_gemm1()
    return {"dispatch": dispatch_and_gemm1,
            "combine": lambda: layer._fused_combine(out, e.w2, perm, routing.weights)[0]}


FUSED_PATHS = {  # --fused: the result's key (and the table's label) and the layer's FusedMoEConfig choices
    "rows": ("fused", dict(dispatch="rows")),
    "tokens": ("fused/tok", dict(dispatch="tokens", combine="rows")),
    "tokens+combine": ("fused/tok+c", dict(dispatch="tokens", combine="auto")),
}


def fused_errors(layers: dict[str, MoELayer], x: torch.Tensor, bias: torch.Tensor | None, want: torch.Tensor,
                 name: str) -> dict[str, float]:
    """Each fused layer's max relative error against `want`, the bulk layer's output, the largest of the ranks';
    one above MAX_ERROR on any rank raises on every rank."""
    errors = {}
    with torch.no_grad():
        for path, layer in layers.items():
            if path != "bulk":
                got, _ = layer(x, bias)
                error = check_against_bulk(f"{name}: {path}", got, want, MAX_ERROR, "the bulk layer",
                                           max_relative_error)
                errors[path] = max(of_every_rank(error))
    return errors


def gradients(layer: MoELayer, x: torch.Tensor, bias: torch.Tensor | None, grad: torch.Tensor,
              what: str) -> dict[str, torch.Tensor]:
    """One forward+backward of `layer` from `x` with the upstream gradient `grad` -> x's gradient ("input") and
    every parameter's (the router's, each expert weight's), by name; the layer's gradients are reset after. One
    missing on any rank raises on every rank."""
    x = x.detach().clone().requires_grad_()
    layer.zero_grad(set_to_none=True)
    y, _ = layer(x, bias)
    y.backward(grad)
    got = {"input": x.grad, **{name: p.grad for name, p in layer.named_parameters()}}
    layer.zero_grad(set_to_none=True)
    missing = [name for name, g in got.items() if g is None]
    raise_on_every_rank(AssertionError(f"{what}: no gradient of {', '.join(missing)}") if missing else None,
                        "missed a gradient")
    return got


def backward_errors(layers: dict[str, MoELayer], x: torch.Tensor, bias: torch.Tensor | None, grad: torch.Tensor,
                    name: str) -> dict[str, float]:
    """Each fused layer's largest max relative error over its gradients (`gradients`) against the bulk layer's,
    from the same inputs, weights and upstream gradient, the largest of the ranks'; one above MAX_GRAD_ERROR on
    any rank raises on every rank."""
    want = gradients(layers["bulk"], x, bias, grad, f"{name}: bulk")
    errors = {}
    for path, layer in layers.items():
        if path != "bulk":
            got = gradients(layer, x, bias, grad, f"{name}: {path}")
            worst = max(check_against_bulk(f"{name}: {path}: {what} gradient", got[what], bulk, MAX_GRAD_ERROR,
                                           "the bulk layer", max_relative_error) for what, bulk in want.items())
            errors[path] = max(of_every_rank(worst))
    return errors


def run_config(cfg: Config, iters: int, fused: tuple[str, ...] = ("rows",)) -> dict:
    rank = dist.get_rank()
    kw = dict(seed=1, dtype=torch.bfloat16, device="cuda")
    layers = {"bulk": MoELayer(cfg.d_model, cfg.ffn, cfg.experts, cfg.top_k, **kw)}
    for choice in fused:
        path, choices = FUSED_PATHS[choice]
        layers[path] = MoELayer(cfg.d_model, cfg.ffn, cfg.experts, cfg.top_k, comm="fused",
                                fused=FusedMoEConfig(max_tokens_per_rank=cfg.tokens, **choices), **kw)
    gen = torch.Generator(device="cuda").manual_seed(100 + rank)
    x = torch.randn(cfg.tokens, cfg.d_model, device="cuda", dtype=torch.bfloat16, generator=gen)
    grad = torch.randn(cfg.tokens, cfg.d_model, device="cuda", dtype=torch.bfloat16, generator=gen)
    result = {"config": asdict(cfg), "name": cfg.name, "fused_paths": list(layers)[1:]}
    with torch.no_grad():
        bias = skew_bias(layers["bulk"], x) if cfg.skewed else None
        want, aux = layers["bulk"](x, bias)
        busiest = aux["tokens_per_local_expert"].sum().float()
        dist.all_reduce(busiest, op=dist.ReduceOp.MAX)
    errors = fused_errors(layers, x, bias, want, cfg.name)
    grad_errors = backward_errors(layers, x, bias, grad, cfg.name)
    result["busiest_rank_rows"] = int(busiest.item())
    x_grad = x.clone().requires_grad_()
    for name, layer in layers.items():
        with torch.no_grad():
            row = {phase: time_ms(fn, warmup=3, iters=iters) for phase, fn in phases(layer, x, bias).items()}
            row["forward"] = time_ms(lambda: layer(x, bias), warmup=3, iters=iters)
            row["forward, back to back"] = per_call_us(lambda: layer(x, bias), warmup=1, iters=5) / 1e3
            for key, cycles in (("forward, GPUs lined up", HEAD_START_CYCLES),
                                ("forward, GPUs lined up, 3x head start", 3 * HEAD_START_CYCLES)):
                row[key] = time_ms(lambda: layer(x, bias), warmup=3, iters=iters, start="device",
                                   head_start_cycles=cycles)

        def forward_backward(layer=layer):
            layer.zero_grad(set_to_none=True)
            y, _ = layer(x_grad, bias)
            y.backward(grad)

        row["forward+backward"] = time_ms(forward_backward, warmup=3, iters=iters)
        result[name] = row
    comm = result["bulk"]["dispatch"] + result["bulk"]["combine"]
    for what, moved in (("forward", comm), ("forward+backward", 2 * comm)):
        result[f"ideal_{what}"] = max(result["bulk"][what] - moved, moved)
    for path in result["fused_paths"]:
        fused = result[path]
        for what in ("forward", "forward+backward"):
            fused[f"%_of_ideal_{what}"] = 100 * result[f"ideal_{what}"] / fused[what]
        for what in ("forward", "forward+backward", "forward, back to back", "forward, GPUs lined up"):
            fused[f"speedup_{what}"] = result["bulk"][what] / fused[what]
        fused["max_relative_error"] = errors[path]
        fused["max_relative_error_backward"] = grad_errors[path]
    return result


def table(results: list[dict]) -> str:
    head = (f"{'config':<44} {'path':<9} {'dispatch':>8} {'experts':>8} {'combine':>8} {'fwd':>8} {'fwd+bwd':>8}"
            f" {'fwd b2b':>8} {'fwd dev':>8} {'dev 3x':>8} {'%ideal f':>8} {'%ideal fb':>9}"
            f" {'speedup f/fb/b2b/dev':>22} {'rel err':>8}")
    lines = [head, "-" * len(head)]
    for r in results:
        for path in ("bulk", *r["fused_paths"]):
            t = r[path]
            experts = f"{t['experts']:.3f}" if "experts" in t else "-"
            line = (f"{r['name'] if path == 'bulk' else '':<44} {path:<9} {t['dispatch']:>8.3f} {experts:>8}"
                    f" {t['combine']:>8.3f} {t['forward']:>8.3f} {t['forward+backward']:>8.3f}"
                    f" {t['forward, back to back']:>8.3f} {t['forward, GPUs lined up']:>8.3f}"
                    f" {t['forward, GPUs lined up, 3x head start']:>8.3f}")
            if path != "bulk":
                line += (f" {t['%_of_ideal_forward']:>7.0f}% {t['%_of_ideal_forward+backward']:>8.0f}%"
                         f" {t['speedup_forward']:>6.2f}/{t['speedup_forward+backward']:.2f}"
                         f"/{t['speedup_forward, back to back']:.2f}/{t['speedup_forward, GPUs lined up']:<5.2f}"
                         f" {t['max_relative_error']:>8.1e}")
            lines.append(line)
    lines.append("ms, median of the slowest rank (fwd b2b: per call, 20 calls back to back; fwd dev: GPUs lined up, "
                 "the call enqueued during a 1 ms head start, dev 3x: 3 ms). bulk: experts = both GEMMs; fused: "
                 "dispatch includes GEMM 1 and combine GEMM 2; fused/tok: the dispatch by token; fused/tok+c: the "
                 "combine by token too, forward and backward.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m moe.bench")
    parser.add_argument("--quick", action="store_true", help="small configs only")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--configs", help="which of the configs, 1-based and comma-separated (default: all)")
    parser.add_argument("--fused", choices=list(FUSED_PATHS), nargs="+", default=list(FUSED_PATHS),
                        help="the fused layers (FusedMoEConfig.dispatch and .combine), each timed in the same run")
    parser.add_argument("--out", help="write every number as JSON here")
    args = parser.parse_args(argv)
    if args.iters < 1:  # else every layer's warm-up runs, then a median of no times fails
        parser.error(f"--iters {args.iters}: expected a count >= 1")
    if (twice := named_twice(args.fused)) is not None:  # each layer is kept under its path's name: built twice
        parser.error(f"--fused: {twice} named twice")
    configs = QUICK if args.quick else CONFIGS
    if args.configs:
        picked = args.configs.split(",")
        if not all(i.strip().isdigit() and 1 <= int(i) <= len(configs) for i in picked):
            parser.error(f"--configs {args.configs}: there are configs 1 to {len(configs)}")
        if (twice := named_twice([int(i) for i in picked])) is not None:
            parser.error(f"--configs {args.configs}: config {twice} named twice")
        configs = [configs[int(i) - 1] for i in picked]
    env = init_gpu_world("python -m moe.bench")
    if args.out:  # now, not after the timings
        check_rank_0_can_write(Path(args.out), f"--out {args.out}")
    results = [run_config(cfg, args.iters, tuple(args.fused)) for cfg in configs]
    if dist.get_rank() == 0:
        print(f"{dist.get_world_size()} x {torch.cuda.get_device_name()}, bf16, fused: {', '.join(args.fused)}")
        print(table(results))
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"environment": environment(env), "gpus": dist.get_world_size(),
                           "device": torch.cuda.get_device_name(),
                           "fused": args.fused, "results": results}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
