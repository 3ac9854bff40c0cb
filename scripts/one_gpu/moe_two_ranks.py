"""One GPU, a simulated world of 2 ranks: the fused MoE operators as compiled, forward and backward, against float64.

FusedDispatch (push + GEMM 1) and FusedCombine (GEMM 2 + weighted unpermute), then the combine's and the
dispatch's backward, every rank's producers launched before any consumer; then the combine by token (each owner's
sum of a token's rows, given the peers' token ids and weights the dispatch by token would have pushed) and its
backward (output gradients by token, the routing weights' gradient back at the sources). Six epochs on the same objects, each with
fresh routing: balanced, a rank without tokens, one hot expert, a rank that receives nothing, uneven, a hot expert
on the other rank. fp32 (IEEE dot products), d_model=256, ffn=1408, 4 experts per rank, top-2, 128-row tiles: the
tiles straddle sources, so the 2-rank walk orders (arrival, departure) are not trivial, and they are printed; in the
larger steps GEMM 1 has more tiles than the programs beside the push, so its helpers behind the push take some.
Errors are relative to the largest reference value; received rows must be exact. Exits 1 above 1e-4.

    PYTHONPATH=. python scripts/one_gpu/moe_two_ranks.py       (on the CPU: a small smoke run in the interpreter)

(docs/benchmarks.md, twelfth session: call F4.)
"""
import sys

import torch

from fused_dlrm.dist.symmetric import SimulatedWorld
from moe.expert_layout import build_expert_layout, dispatch_tables, send_slots
from moe.experts import swiglu
from moe.kernels.fused_combine import (FusedCombine, fused_combine_backward_reference, fused_combine_reference,
                                      routing_weights_grad_reference)
from moe.kernels.fused_dispatch import FusedDispatch, dispatch_reference, gated_gemm_reference, gemm_config
from moe.permute import Permutation, permutation
from moe.routing import route

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
SMALL = DEVICE.type == "cpu"  # TRITON_INTERPRET=1: a smoke run
W, L, D, F, K = (2, 4, 40, 24, 2) if SMALL else (2, 4, 256, 1408, 2)
E = W * L
SPINS = 10_000_000
CASES = [([700, 500], None), ([900, 0], None), ([600, 650], [0, 6, 0, 0, 0, 0, 0, 0]),
         ([800, 300], [-30, -30, -30, -30, 0, 0, 0, 0]), ([1000, 1200], None), ([333, 777], [0] * 7 + [5])]


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double().cpu() - want.double().cpu()).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def dispatch_backward_reference(received, dh, w13, lay, perms, tokens):
    """Float64 autograd through each owner's SwiGLU GEMM: (dw13 per owner, dx per source: each received row's
    gradient summed into its source's token)."""
    dw13s, dxs = [], [torch.zeros(t, D, dtype=torch.float64) for t in tokens]
    for r in range(W):
        x, sizes = received[r].cpu().double().requires_grad_(), lay[r].tokens_per_local_expert
        a13 = torch.cat([rows @ w13[r].cpu().double()[e] for e, rows in enumerate(torch.split(x, sizes))])
        a13.retain_grad()
        (swiglu(a13) * dh[r].cpu().double()).sum().backward()
        dw13s.append(torch.stack([rows.t() @ g for rows, g in zip(torch.split(x.detach(), sizes),
                                                                  torch.split(a13.grad, sizes))]))
        source, row = lay[r].recv_source_rank.cpu(), lay[r].recv_source_row.cpu()
        for s in range(W):
            mine = source == s
            dxs[s].index_add_(0, perms[s].token_of_row.cpu()[row[mine]], x.grad[mine])
    return dw13s, dxs


def peer_rows(owner: int, perms: list[Permutation], counts: torch.Tensor,
              max_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What the dispatch by token brings `owner` besides the rows: each peer's permuted rows' token ids and routing
    weights bound for its experts, at [source, source row] (sentinels elsewhere: a read the owner does not own
    would show)."""
    row_tokens = torch.full((W, max_tokens * K), max_tokens - 1, dtype=torch.int32, device=DEVICE)
    row_weights = torch.full((W, max_tokens * K), float("nan"), device=DEVICE)
    for source, perm in enumerate(perms):
        if source != owner:
            lo = int(counts[source, :owner * L].sum())
            hi = lo + int(counts[source, owner * L:(owner + 1) * L].sum())
            row_tokens[source, lo:hi] = perm.token_of_row[lo:hi].int()
            row_weights[source, lo:hi] = perm.row_weights[lo:hi]
    return row_tokens, row_weights


def main() -> int:
    torch.manual_seed(0)
    dispatch = [FusedDispatch(ws, D, F, L, 16, SPINS) for ws in SimulatedWorld(W, DEVICE).workspaces()]
    max_tokens = max(max(tokens) for tokens, _ in CASES)
    combine = [FusedCombine(ws, D, L, 32, SPINS, max_tokens=max_tokens, top_k=K)
               for ws in SimulatedWorld(W, DEVICE).workspaces()]
    w13 = [torch.randn(L, D, 2 * F, device=DEVICE) / D ** 0.5 for _ in range(W)]
    w2 = [torch.randn(L, F, D, device=DEVICE) / F ** 0.5 for _ in range(W)]
    tile_rows = combine[0].blocks.block_m, gemm_config(DEVICE, torch.float32, backward=True).block_m
    worst = 0.0
    for step, (tokens, bias) in enumerate(CASES[:2] if SMALL else CASES):
        tokens = [t // 40 for t in tokens] if SMALL else tokens
        xs = [torch.randn(t, D, device=DEVICE) for t in tokens]
        logit_bias = 0 if bias is None else torch.tensor(bias, device=DEVICE)
        routings = [route(torch.randn(t, E, device=DEVICE) + logit_bias, K) for t in tokens]
        perms = [permutation(r.expert_ids, E, weights=r.weights) for r in routings]
        cpu_perms = [Permutation(p.order.cpu(), p.inverse.cpu(), p.tokens_per_expert.cpu(), p.offsets.cpu(), K)
                     for p in perms]
        weights = [r.weights for r in routings]
        counts = torch.stack([p.tokens_per_expert for p in perms])
        lay = [build_expert_layout(counts, r, L, *tile_rows) for r in range(W)]
        errors = {}

        # Forward: every rank pushes, then every owner's GEMM 1; GEMM 2's stores, then every source's unpermute.
        for d in dispatch:
            d.reserve(lay[0].max_recv_rows)
        tables = [dispatch_tables(counts, r, L, *tile_rows, p.token_of_row.numel(), d.capacity)
                  for r, (d, p) in enumerate(zip(dispatch, perms))]
        epochs = [d.start(x, p.token_of_row, t) for d, x, p, t in zip(dispatch, xs, perms, tables)]
        a13s = [torch.full((d.capacity, 2 * F), float("nan"), device=DEVICE) for d in dispatch]
        out = [d.finish(e, w, a13_out=a) for d, e, w, a in zip(dispatch, epochs, w13, a13s)]
        rows = [sum(la.tokens_per_local_expert) for la in lay]
        received, hs = [o[0][:n].clone() for o, n in zip(out, rows)], [o[1][:n] for o, n in zip(out, rows)]
        a13s = [a[:n] for a, n in zip(a13s, rows)]
        for r in range(W):
            want = dispatch_reference(xs, [p.token_of_row for p in perms], counts, r, L)
            errors[f"rows{r}"] = (received[r] - want).abs().max().item() if want.numel() else 0.0
            if want.numel():
                errors[f"h{r}"] = relative(hs[r], gated_gemm_reference(want.double(), lay[r].tokens_per_local_expert,
                                                                       w13[r].double()))
        for c in combine:
            c.reserve(lay[0].max_send_rows, send_slots(lay[0].host_counts, tile_rows[0]))
        epochs = [c.start(o[1], w, t) for c, o, w, t in zip(combine, out, w2, tables)]  # h of capacity rows
        ys = [c.finish(e, t, p, w) for c, e, t, p, w in zip(combine, epochs, tables, perms, weights)]
        want_ys = fused_combine_reference([h.cpu() for h in hs], [w.cpu() for w in w2], lay, cpu_perms,
                                          [w.cpu() for w in weights])
        errors.update({f"y{r}": relative(ys[r], want_ys[r]) for r in range(W) if tokens[r]})

        # Backward: the output gradient to the owners (grad_h, grad_w2), then dx back to the sources (and dw13).
        grad_ys = [torch.randn(t, D, device=DEVICE) for t in tokens]
        epochs = [c.start_backward(g, p, la) for c, g, p, la in zip(combine, grad_ys, perms, lay)]
        grads = [c.finish_backward(e, la, h, w) for c, e, la, h, w in zip(combine, epochs, lay, hs, w2)]
        want_grads = fused_combine_backward_reference([g.cpu() for g in grad_ys], cpu_perms,
                                                      [w.cpu() for w in weights], [h.cpu() for h in hs],
                                                      [w.cpu() for w in w2], lay)
        for r, ((grad_h, grad_w2), (want_h, want_w2)) in enumerate(zip(grads, want_grads)):
            if want_h.numel():
                errors[f"grad_h{r}"], errors[f"grad_w2_{r}"] = relative(grad_h, want_h), relative(grad_w2, want_w2)
        dhs = [g[0] for g in grads]
        started = [d.start_backward(dh, rec, la, w, a) for d, dh, rec, la, w, a in
                   zip(dispatch, dhs, received, lay, w13, a13s)]
        dxs = [d.finish_backward(e, la, p) for d, (e, _), la, p in zip(dispatch, started, lay, perms)]
        want_dw13s, want_dxs = dispatch_backward_reference(received, dhs, w13, lay, perms, tokens)
        for r in range(W):
            if want_dw13s[r].abs().max() > 0:
                errors[f"dw13_{r}"] = relative(started[r][1], want_dw13s[r])
            if tokens[r]:
                errors[f"dx{r}"] = relative(dxs[r], want_dxs[r])
        # The combine by token and its backward, on the same GEMM 1 outputs.
        epochs = [c.start_by_token(o[1], w, t, peer_rows(r, perms, counts, max_tokens), p)
                  for r, (c, o, w, t, p) in enumerate(zip(combine, out, w2, tables, perms))]
        finished = [c.finish_by_token(e, t, p) for c, e, t, p in zip(combine, epochs, tables, perms)]
        errors.update({f"y_tok{r}": relative(finished[r][0], want_ys[r]) for r in range(W) if tokens[r]})
        epochs = [c.start_backward_by_token(g, p, la) for c, g, p, la in zip(combine, grad_ys, perms, lay)]
        grads = [c.finish_backward_by_token(e, la, h, w, owner)
                 for c, e, la, h, w, (_, owner) in zip(combine, epochs, lay, hs, w2, finished)]
        weight_grads = [c.routing_weights_grad_by_token(e, p) for c, e, p in zip(combine, epochs, perms)]
        want_weight_grads = routing_weights_grad_reference([g.cpu() for g in grad_ys], [h.cpu() for h in hs],
                                                           [w.cpu() for w in w2], lay, cpu_perms)
        for r, ((grad_h, grad_w2), (want_h, want_w2)) in enumerate(zip(grads, want_grads)):
            if want_h.numel():
                errors[f"grad_h_tok{r}"] = relative(grad_h, want_h)
                errors[f"grad_w2_tok{r}"] = relative(grad_w2, want_w2)
            if tokens[r]:
                errors[f"weight_grad_tok{r}"] = relative(weight_grads[r], want_weight_grads[r])
        for op in dispatch + combine:
            op.errors.check(block=True)
        worst = max(worst, *errors.values())
        print(f"step {step}, tokens {tokens}, counts {counts.tolist()}:")
        print("  " + ", ".join(f"{k} {v:.1e}" for k, v in errors.items()))
        print(f"  rank 0's GEMM tiles: arrival order {lay[0].gemm_tiles[3].tolist()}, departure order "
              f"{lay[0].gemm_tiles[4].tolist()}")
    print(f"worst relative error {worst:.2e}")
    return 0 if worst < 1e-4 else 1


if __name__ == "__main__":
    sys.exit(main())
