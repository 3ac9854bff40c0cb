"""The whole fused MoE pipeline across simulated ranks (Triton interpreter), against an independent dense model.

The other CPU tests check one half each: test_moe_fused_dispatch the push + GEMM 1 (and their backward) against the
bulk path, test_moe_fused_combine GEMM 2 + the combine fed made-up expert activations, test_moe_fused_layer the
composed layer at one rank (no exchange); only test_moe_fused_gpu composes them across ranks, on GPUs, against the
bulk layer. Here dispatch + GEMM 1 + GEMM 2 + combine run forward and backward on 2 and 3 ranks in the order
moe/layer.py's _FusedExperts runs them, each kernel fed the one before's outputs (h into GEMM 2, grad_h into the
dispatch's backward), by row and by token, against float64 autograd of the dense model: each token's output is the
sum over its kept top-k assignments of its routing weight times its expert's SwiGLU, (silu(x w1) * x w3) w2.
Checked on every rank: y, dx, the routing weights' gradient, dw13 and dw2. Every symmetric buffer is NaN before
the phase that writes it, as is every tensor torch.empty & co. allocate, so a row no kernel wrote shows.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from moe.expert_layout import send_slots
from moe.kernels.fused_combine import FusedCombine
from moe.permute import routing_weights_grad
from test_moe_fused_combine import assert_close
from test_moe_fused_dispatch import D_MODEL, FFN, NEVER, World, check_scenario
from test_sorted_segments_kernel import poison_allocations

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs in the Triton interpreter")

NAN = float("nan")


class Pipeline(World):
    """test_moe_fused_dispatch's World (a FusedDispatch and w13 per rank, the routing) with a FusedCombine on each
    rank's workspace and each rank's w2: both halves of the fused layer."""

    def __init__(self, world: int, local: int, max_tokens: int | None, top_k: int):
        super().__init__(world, local, max_tokens=max_tokens, top_k=top_k, seed=world)
        gen = torch.Generator().manual_seed(100 + world)
        self.w2 = [torch.randn(local, FFN, D_MODEL, generator=gen) / FFN ** 0.5 for _ in range(world)]
        self.combines = [FusedCombine(d.ws, D_MODEL, local, num_programs=3, spin_limit=50, max_tokens=max_tokens,
                                      top_k=top_k) for d in self.dispatch]

    def run(self, xs, token_of_rows, layouts, grad_ys):
        """Forward and backward as _FusedExperts runs them -> per rank (y, dx, routing weights' gradient, dw13,
        dw2), every buffer NaN before the phase that writes it."""
        by_token = self.dispatch[0].by_token
        weights = [r.weights for r in self.routings]
        self.tables(token_of_rows, layouts)  # the receive capacity, for the buffers poisoned here
        self.poison()
        tables, epochs, dispatched = self.launch(xs, token_of_rows, layouts)
        for c, lay in zip(self.combines, layouts):
            c.reserve(lay.max_send_rows, send_slots(lay.host_counts, lay.tile_rows), lay.total_rows)
            (c._token_buffers if by_token else c._buffers)(torch.float32)[0].local.fill_(NAN)
        hs = [h for _, h, _ in dispatched]
        if by_token:  # the owners keep their rows (y, weight, token) for the backward
            started = [c.start_by_token(h, w2, tab, d.rows_by_source(e), p) for c, h, w2, tab, d, e, p in zip(
                self.combines, hs, self.w2, tables, self.dispatch, epochs, self.perms)]
            ys, kept = zip(*[c.finish_by_token(e, tab, p)
                             for c, e, tab, p in zip(self.combines, started, tables, self.perms)])
        else:  # the sources keep each assignment's row, for the routing weights' gradient
            started = [c.start(h, w2, tab) for c, h, w2, tab in zip(self.combines, hs, self.w2, tables)]
            kept = [torch.full((w.numel(), D_MODEL), NAN) for w in weights]
            ys = [c.finish(e, tab, p, w, rows_out=rows) for c, e, tab, p, w, rows in zip(
                self.combines, started, tables, self.perms, weights, kept)]

        received_rows = [sum(lay.tokens_per_local_expert) for lay in layouts]  # the first rows of h, a13
        for c, d, lay in zip(self.combines, self.dispatch, layouts):
            buffer = c._token_gradient_buffers(torch.float32) if by_token else c._gradient_buffers(lay, torch.float32)
            buffer[0].local.fill_(NAN)
            d._grad_buffers(lay, torch.float32)[0].local.fill_(NAN)
        if by_token:
            started = [c.start_backward_by_token(g, p, lay)
                       for c, g, p, lay in zip(self.combines, grad_ys, self.perms, layouts)]
            combined = [c.finish_backward_by_token(e, lay, h[:n], w2, owner, torch.float32) for c, e, lay, h, n, w2,
                        owner in zip(self.combines, started, layouts, hs, received_rows, self.w2, kept)]
        else:
            grad_weights = [routing_weights_grad(r, g, w) for r, g, w in zip(kept, grad_ys, weights)]
            started = [c.start_backward(g, p, lay) for c, g, p, lay in zip(self.combines, grad_ys, self.perms, layouts)]
            combined = [c.finish_backward(e, lay, h[:n], w2, torch.float32)
                        for c, e, lay, h, n, w2 in zip(self.combines, started, layouts, hs, received_rows, self.w2)]
        dispatch_started = [d.start_backward(grad_h, received[:n], lay, w13, a13[:n], torch.float32)
                            for d, (grad_h, _), (received, _, a13), n, lay, w13 in zip(
                                self.dispatch, combined, dispatched, received_rows, layouts, self.w13)]
        dxs = [d.finish_backward(e, lay, p) for d, (e, _), lay, p in zip(self.dispatch, dispatch_started, layouts,
                                                                        self.perms)]
        if by_token:  # last, as the layer reads it: the owners' words have long arrived
            grad_weights = [c.routing_weights_grad_by_token(e, p) for c, e, p in zip(self.combines, started,
                                                                                     self.perms)]
        return [(y, dx, gw, dw13, dw2) for y, dx, gw, (_, dw13), (_, dw2) in zip(
            ys, dxs, grad_weights, dispatch_started, combined)]


def dense_reference(xs, routings, w13s, w2s, grad_ys):
    """float64 autograd of sum(y * grad_y), y per token the sum over its kept assignments (expert e = rank x local
    + local expert) of weight x (silu(x w1[e]) * x w3[e]) w2[e] -> per rank (y, dx, routing weights' gradient, its
    experts' dw13, dw2)."""
    w13, w2 = torch.cat(w13s).double().requires_grad_(), torch.cat(w2s).double().requires_grad_()
    xs = [x.double().requires_grad_() for x in xs]
    weights = [r.weights.double().requires_grad_() for r in routings]
    ys = []
    for x, w, r in zip(xs, weights, routings):
        y = torch.zeros_like(x)
        for e in range(w13.shape[0]):
            for j in range(w.shape[1]):
                chose = (r.expert_ids[:, j] == e) & r.kept[:, j]
                a = x[chose] @ w13[e]
                out = (F.silu(a[:, :FFN]) * a[:, FFN:]) @ w2[e]
                y = y.index_add(0, chose.nonzero()[:, 0], w[chose, j:j + 1] * out)
        ys.append(y)
    loss = sum((y * g.double()).sum() for y, g in zip(ys, grad_ys))
    grads = torch.autograd.grad(loss, [*xs, *weights, w13, w2], allow_unused=True, materialize_grads=True)
    world = len(xs)
    dxs, dweights, (dw13, dw2) = grads[:world], grads[world:2 * world], grads[2 * world:]
    return [(y.detach(), dx, dw, a, b)
            for y, dx, dw, a, b in zip(ys, dxs, dweights, dw13.chunk(world), dw2.chunk(world))]


# name (check_scenario reads it), world, local experts, tokens per rank, top k, logit bias (by global expert),
# capacity factor. d_model 40 and ffn 24 (test_moe_fused_dispatch's) are no multiple of the interpreter's 16-wide
# tiles.
CASES = [
    ("2 ranks, skewed, expert 2 idle, capacity drops", 2, 2, [14, 9], 2, [0, 6, NEVER, 0], 1.5),
    ("3 ranks, rank 1 without tokens, rank 2 receives nothing, capacity drops", 3, 2, [11, 0, 7], 3,
     [0, 0, 0, 0, NEVER, NEVER], 1.0),
]


@pytest.mark.parametrize("by_token", [False, True], ids=["by row", "by token"])
@pytest.mark.parametrize("name,world,local,tokens,top_k,bias,capacity", CASES, ids=[c[0] for c in CASES])
def test_forward_and_backward_match_the_dense_model(monkeypatch, name, world, local, tokens, top_k, bias, capacity,
                                                    by_token):
    poison_allocations(monkeypatch)  # before the kernels' objects make their tensors
    pipeline = Pipeline(world, local, max_tokens=max(tokens) + 3 if by_token else None, top_k=top_k)
    gen = torch.Generator().manual_seed(len(name))
    for step in range(2):  # both halves of the double buffers; the flags of the epoch before
        xs, token_of_rows, counts, layouts = pipeline.routed_batch(tokens, top_k, bias, gen, capacity)
        grad_ys = [torch.randn(t, D_MODEL, generator=gen) for t in tokens]
        got = pipeline.run(xs, token_of_rows, layouts, grad_ys)
        want = dense_reference(xs, pipeline.routings, pipeline.w13, pipeline.w2, grad_ys)
        for rank, (got_rank, want_rank) in enumerate(zip(got, want)):
            for what, g, w in zip(("y", "dx", "routing weights' gradient", "dw13", "dw2"), got_rank, want_rank):
                assert_close(g, w, 1e-5, f"step {step} rank {rank} {what}:")
        check_scenario(name, counts, world, local, pipeline.perms)
