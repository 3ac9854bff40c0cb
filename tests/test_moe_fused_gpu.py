"""MoELayer(comm="fused") against comm="bulk" on 2 GPUs (NCCL, torch SymmetricMemory), bf16 (and fp32 layers
under bf16 autocast); all but the 1,000 steps also with two ranks sharing one GPU (gloo, CUDA IPC).

Both layers are built from the same seed, so they hold the same router and expert weights; they see the same
tokens and output gradient. Outputs, input gradients, router and expert-weight gradients must agree within
TOL relative to the largest element (bf16: both paths round products and sums to bf16 in different places;
the fused combine sums in fp32); so must the fused output under no_grad (by token: the combine by token). Then
1,000 consecutive fused steps with changing loads (checked against bulk every 100, an evaluation forward every 10),
a peer that never starts an exchange, forward or backward (a bounded wait that raises), and a rank's refused call
(more tokens than max_tokens_per_rank, the caller's refusal words), raised on every rank.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from fused_dlrm.dist.symmetric import cuda_workspace
from fused_dlrm.kernels.peer_flags import PeerWaitTimeout
from moe.expert_layout import build_expert_layout, dispatch_tables, gather_counts, send_slots
from moe.kernels.fused_combine import FusedCombine
from moe.layer import TOKEN_OUT_OF_VOCABULARY, FusedMoEConfig, MoELayer
from moe.permute import permutation
from world import TWO_GPUS, TWO_RANK_BACKENDS, run_world

BACKENDS = pytest.mark.parametrize("backend", TWO_RANK_BACKENDS)

D_MODEL, FFN, EXPERTS, TOP_K, SEED = 256, 192, 8, 2, 11
TOL = 3e-2
NEVER = -30.0


def layers(capacity_factor=None, max_tokens=None, dispatch="rows"):
    """(fused, bulk); max_tokens: the fused layer's max_tokens_per_rank (None: buffers grown to the rows seen);
    dispatch: FusedMoEConfig.dispatch."""
    kw = dict(capacity_factor=capacity_factor, seed=SEED, dtype=torch.bfloat16, device="cuda")
    config = FusedMoEConfig(wait_timeout_spins=1 << 26, max_tokens_per_rank=max_tokens, dispatch=dispatch,
                            allocation_timeout_s=45.0)
    fused = MoELayer(D_MODEL, FFN, EXPERTS, TOP_K, comm="fused", fused=config, **kw)
    assert fused.dispatch.ws.allocation_timeout_s == 45.0  # the configured bound, not the default
    return fused, MoELayer(D_MODEL, FFN, EXPERTS, TOP_K, **kw)


def run(layer, x, bias, grad):
    layer.zero_grad()
    x = x.clone().requires_grad_()
    y, aux = layer(x, bias)
    (y.float() * grad).sum().backward()
    return y.detach(), x.grad, aux


def close(got, want, what):
    if want.numel() == 0:
        assert got.numel() == 0, what
        return
    err = (got.float() - want.float()).abs().max().item()
    scale = want.float().abs().max().item()
    assert err <= TOL * max(scale, 1e-6), f"{what}: max error {err}, largest element {scale}"


def compare(fused, bulk, tokens, bias, gen, what):
    x = torch.randn(tokens, D_MODEL, generator=gen).to("cuda", torch.bfloat16)
    grad = torch.randn(tokens, D_MODEL, generator=gen).cuda()
    bias = None if bias is None else torch.tensor(bias, device="cuda")
    y, gx, aux = run(fused, x, bias, grad)
    want_y, want_gx, want_aux = run(bulk, x, bias, grad)
    close(y, want_y, f"{what}: output")
    with torch.no_grad():  # a forward that keeps nothing for a backward
        close(fused(x, bias)[0], want_y, f"{what}: output under no_grad")
    close(gx, want_gx, f"{what}: input gradient")
    for (name, p), q in zip(fused.named_parameters(), bulk.parameters()):
        close(p.grad, q.grad, f"{what}: {name} gradient")
    assert torch.equal(aux["tokens_per_local_expert"], want_aux["tokens_per_local_expert"]), what
    return aux


def scenarios(rank, world, max_tokens, dispatch):
    gen = torch.Generator().manual_seed(rank)
    fused, bulk = layers(max_tokens=max_tokens, dispatch=dispatch)
    aux = compare(fused, bulk, 512, None, gen, "balanced")
    aux = compare(fused, bulk, 512, [0, 8.0] + [0] * (EXPERTS - 2), gen, "skewed")
    counts = aux["tokens_per_expert"].clone()
    dist.all_reduce(counts)
    assert counts[1] >= 0.4 * counts.sum(), counts  # about half of all assignments to expert 1
    compare(fused, bulk, 0 if rank == 1 else 384, None, gen, "rank 1 without tokens")
    aux = compare(fused, bulk, 300, [0] * (EXPERTS // 2) + [NEVER] * (EXPERTS // 2), gen, "rank 1 receives nothing")
    assert rank == 0 or aux["tokens_per_local_expert"].sum() == 0
    fused, bulk = layers(capacity_factor=1.0, max_tokens=max_tokens, dispatch=dispatch)
    aux = compare(fused, bulk, 256, [0, 3.0] + [0] * (EXPERTS - 2), gen, "capacity, skewed")
    assert aux["dropped"] > 0


def many_steps(rank, world, max_tokens, dispatch):
    gen = torch.Generator().manual_seed(100 + rank)
    fused, bulk = layers(max_tokens=max_tokens, dispatch=dispatch)
    for step in range(1000):
        tokens = 64 + (step * 37 + rank * 101) % 448  # uneven, changing: buffers grow, flag slots move
        bias = [0.0] * EXPERTS
        bias[step % EXPERTS] = 4.0 * (step % 3)
        if step % 100 == 99:
            compare(fused, bulk, tokens, bias, gen, f"step {step}")
        else:
            x = torch.randn(tokens, D_MODEL, generator=gen).to("cuda", torch.bfloat16)
            run(fused, x, torch.tensor(bias, device="cuda"), torch.randn(tokens, D_MODEL, generator=gen).cuda())
            if step % 10 == 5:  # an evaluation forward in between (by token: the combine by token)
                with torch.no_grad():
                    fused(x, torch.tensor(bias, device="cuda"))
    fused.combine.errors.check(block=True)
    fused.dispatch.errors.check(block=True)


def mixed_precision(rank, world):
    """fp32 layers under bf16 autocast (model.precision=bf16): the fused kernels get bf16 rows and bf16 copies of
    the experts, as the bulk GEMMs do; outputs and gradients agree, and the fp32 weights get fp32 gradients."""
    gen = torch.Generator().manual_seed(200 + rank)
    kw = dict(seed=SEED, dtype=torch.float32, device="cuda")
    fused = MoELayer(D_MODEL, FFN, EXPERTS, TOP_K, comm="fused", fused=FusedMoEConfig(wait_timeout_spins=1 << 26),
                     **kw)
    bulk = MoELayer(D_MODEL, FFN, EXPERTS, TOP_K, **kw)
    for step in range(3):  # the second and third reuse the buffers and flags
        x = torch.randn(256 + 64 * step, D_MODEL, generator=gen).cuda()
        grad = torch.randn(x.shape, generator=gen).cuda()
        results = []
        for layer in (fused, bulk):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                results.append(run(layer, x, None, grad))
        (y, gx, _), (want_y, want_gx, _) = results
        assert y.dtype == want_y.dtype == torch.bfloat16
        close(y, want_y, f"autocast step {step}: output")
        close(gx, want_gx, f"autocast step {step}: input gradient")
        for (name, p), q in zip(fused.named_parameters(), bulk.parameters()):
            assert p.grad.dtype == torch.float32, name
            close(p.grad, q.grad, f"autocast step {step}: {name} gradient")


def peer_never_starts(rank, world, backward):
    """Epoch 1 runs on both ranks; at epoch 2 rank 1 never starts (the forward exchange, or the backward one):
    rank 0's wait gives up and names rank 1."""
    workspace = cuda_workspace()
    # Epoch 1 compiles the kernels, and the ranks may be seconds apart: a long limit there, a short one at epoch 2.
    combine = FusedCombine(workspace, D_MODEL, 2, num_programs=8, spin_limit=20_000_000)
    gen = torch.Generator().manual_seed(rank)
    ids = torch.randint(0, 2 * world, (64, TOP_K), generator=gen).cuda()
    weights = torch.rand(64, TOP_K, generator=gen).cuda()
    perm = permutation(ids, 2 * world, weights=weights)
    counts = gather_counts(perm.tokens_per_expert)
    layout = build_expert_layout(counts, rank, 2, combine.blocks.block_m, owner_tile_rows=128)  # 128: unused here
    received = sum(layout.tokens_per_local_expert)
    tables = dispatch_tables(counts, rank, 2, combine.blocks.block_m, 128, perm.order.numel(), received)
    combine.reserve(layout.max_send_rows, send_slots(layout.host_counts, combine.blocks.block_m))
    h = torch.randn(received, FFN, generator=gen).to("cuda", torch.bfloat16)
    w2 = torch.randn(2, FFN, D_MODEL, generator=gen).to("cuda", torch.bfloat16)
    grad_y = torch.randn(64, D_MODEL, generator=gen).to("cuda", torch.bfloat16)

    def step():
        if backward:
            combine.finish_backward(combine.start_backward(grad_y, perm, layout), layout, h, w2)
        else:
            combine.finish(combine.start(h, w2, tables), tables, perm, weights)

    step()
    combine.errors.check(block=True)
    dist.barrier()
    combine.spin_limit = 20_000
    if rank == 0:
        step()
        with pytest.raises(PeerWaitTimeout, match=r"rank 0 timed out at step 2 waiting for rank 1, slice \d+"):
            combine.errors.check(block=True)
    dist.barrier()


def refused_on_one_rank(rank, world, max_tokens, dispatch):
    """Rank 1 passes one token more than max_tokens_per_rank, then rank 0 refusal words of its own (the
    Transformer's token ids). Every rank raises, naming the refused rank, once: on NCCL, whose bounded forward reads
    no counts, in the backward (which reads them, and clears the refusal from the dispatch's error word) or, where
    no backward follows (no_grad, or with grad: an evaluation that forgot no_grad), at errors.check(block=True)
    (the error word) or at the layer's next call, before its exchange, on both ranks; on gloo at the counts'
    all-gather; without max_tokens_per_rank where the forward reads the counts. The next step matches bulk (the
    exchanges stayed in step) and raises nothing."""
    gen = torch.Generator().manual_seed(rank)
    fused, bulk = layers(max_tokens=max_tokens, dispatch=dispatch)
    words = torch.tensor([TOKEN_OUT_OF_VOCABULARY, 300, 256] if rank == 0 else [0, 0, 0], device="cuda")
    whose = "" if rank == 0 else "rank 0 has "
    cases = [(64, words, whose + r"token id 300 in its batch, outside the vocabulary \[0, 256\)")]
    if max_tokens is not None:
        whose = "" if rank == 1 else "rank 1 has "
        cases.append((max_tokens + rank, None,
                      f"{whose}{max_tokens + 1} tokens, more than max_tokens_per_rank={max_tokens}"))
    for tokens, refused, what in cases:
        x = torch.randn(tokens, D_MODEL, generator=gen).to("cuda", torch.bfloat16)
        with pytest.raises(ValueError, match=f"rank {rank}: {what}"):
            y, _ = fused(x.clone().requires_grad_(), refused=refused)
            y.float().sum().backward()
        compare(fused, bulk, 512, None, gen, f"after {what}, raised in the backward")
        fused.dispatch.errors.check(block=True)
        for grad, read in ((False, "check"), (True, "check"), (False, "next call"), (True, "next call")):
            with pytest.raises(ValueError, match=f"rank {rank}: {what}"):  # no backward follows
                with torch.set_grad_enabled(grad):
                    fused(x.clone().requires_grad_(grad), refused=refused)
                if read == "check":
                    fused.dispatch.errors.check(block=True)
                else:
                    fused(x[:8].clone())
            compare(fused, bulk, 512, None, gen, f"after {what}, grad {grad}, read at the {read}")
            fused.dispatch.errors.check(block=True)


BUFFERS = pytest.mark.parametrize("max_tokens,dispatch", [(None, "rows"), (512, "rows"), (512, "tokens")],
                                  ids=["grown", "bounded", "bounded, by token"])


@BACKENDS
@BUFFERS
def test_fused_matches_bulk_forward_and_backward(max_tokens, dispatch, backend):
    run_world(2, scenarios, max_tokens, dispatch, backend=backend)


@BACKENDS
def test_fused_matches_bulk_under_bf16_autocast(backend):
    run_world(2, mixed_precision, backend=backend)


@TWO_GPUS
@BUFFERS
def test_thousand_consecutive_steps(max_tokens, dispatch):
    run_world(2, many_steps, max_tokens, dispatch, backend="nccl")


@BACKENDS
@pytest.mark.parametrize("backward", [False, True])
def test_peer_that_never_starts_raises(backward, backend):
    run_world(2, peer_never_starts, backward, backend=backend)


@BACKENDS
@BUFFERS
def test_a_refused_rank_stops_every_rank(max_tokens, dispatch, backend):
    run_world(2, refused_on_one_rank, max_tokens, dispatch, backend=backend, timeout=300)
