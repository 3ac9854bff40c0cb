"""GPU check of the fused MoE dispatch + first expert GEMM, forward and backward, against the bulk path (2 GPUs,
NCCL, bf16; skipped without them). CI has no GPU: this runs on the device machine.

Bulk: all_to_all_v of the permuted rows, regroup to (local expert, source rank), then silu(x @ w1[e]) * (x @ w3[e])
(w13 = [w1 | w3]) in fp32 from the same bf16 rows and weights; its gradients by autograd (through all_to_all_v's
backward).
1,000 consecutive steps with changing routing: token counts per rank change every step, some steps are skewed,
some leave an expert, a whole rank or every token of a rank idle.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from fused_dlrm.dist import all_to_all_v, exchange_counts
from fused_dlrm.dist.symmetric import CudaSymmetricWorkspace
from fused_dlrm.kernels.peer_flags import PeerWaitTimeout
from moe.expert_layout import build_expert_layout, dispatch_tables, gather_counts
from moe.kernels.fused_dispatch import FusedDispatch, gated_gemm_reference, gemm_config
from moe.permute import permute
from moe.routing import route
from world import TWO_GPUS, run_world

# The row tiles of the dispatch's backward GEMM, which the layouts number (the combine's are unused here).
BACKWARD_TILE_ROWS = gemm_config(torch.device("cuda"), torch.bfloat16, backward=True).block_m

pytestmark = TWO_GPUS

D_MODEL, FFN, EXPERTS, TOP_K = 512, 352, 8, 2  # ffn not a multiple of the 128-wide tiles


def step_batch(step: int, rank: int, world: int, device):
    """This rank's tokens and routing logits of one step (the same on every run)."""
    gen = torch.Generator().manual_seed(step * world + rank)
    tokens = int(torch.randint(0, 1500, (), generator=gen)) if step % 7 else 0 if rank == step % world else 700
    x = torch.randn(tokens, D_MODEL, generator=gen)
    logits = torch.randn(tokens, EXPERTS, generator=gen)
    kind = step % 5
    if kind == 1:  # skewed: about half of the rows to one expert
        logits[:, step % EXPERTS] += 3.0
    elif kind == 2:  # one expert idle
        logits[:, step % EXPERTS] = -30.0
    elif kind == 3:  # every expert of one rank idle: that rank receives nothing
        owner = (step // 5) % world
        logits[:, owner * EXPERTS // world:(owner + 1) * EXPERTS // world] = -30.0
    return x.to(device, torch.bfloat16), logits.to(device)


def bulk_dispatch(rows: torch.Tensor, tokens_per_expert: torch.Tensor, world: int, local: int) -> torch.Tensor:
    """The bulk layer's dispatch: all_to_all_v, then regroup (source, expert) -> (expert, source)."""
    send_counts = tokens_per_expert.view(world, local)
    recv_counts = exchange_counts(send_counts)
    received = all_to_all_v(rows, send_counts.sum(dim=1).tolist(), recv_counts.sum(dim=1).tolist())
    expert_of_row = torch.repeat_interleave(torch.arange(local, device=rows.device).repeat(world),
                                            recv_counts.reshape(-1))
    return received[torch.sort(expert_of_row, stable=True).indices]


def dispatch_at_layout(dispatch, x, token_of_row, layout, w13):
    """Push + GEMM 1 in buffers reserved for the layout -> (received, h) of the rows received."""
    dispatch.reserve(layout.max_recv_rows)
    tables = dispatch_tables(layout.counts, layout.rank, layout.num_local_experts, 128, BACKWARD_TILE_ROWS,
                             token_of_row.numel(), dispatch.capacity)
    received, h = dispatch.finish(dispatch.start(x, token_of_row, tables), w13)
    rows = sum(layout.tokens_per_local_expert)
    return received[:rows], h[:rows]


def _fused_equals_bulk(rank: int, world: int) -> None:
    device = torch.device("cuda", rank)
    local = EXPERTS // world
    gen = torch.Generator().manual_seed(100 + rank)
    w13 = (torch.randn(local, D_MODEL, 2 * FFN, generator=gen) / D_MODEL ** 0.5).to(device, torch.bfloat16)
    ws = CudaSymmetricWorkspace()
    dispatch = FusedDispatch(ws, D_MODEL, FFN, local, num_programs=64, spin_limit=2_000_000, block_m=64)
    idle_owner_seen = skewed_seen = 0
    for step in range(1000):
        x, logits = step_batch(step, rank, world, device)
        _, perm = permute(x, route(logits, TOP_K).expert_ids, EXPERTS)
        token_of_row = perm.order // TOP_K
        counts = gather_counts(perm.tokens_per_expert)
        layout = build_expert_layout(counts, rank, local, tile_rows=128, owner_tile_rows=BACKWARD_TILE_ROWS)
        if step % 10 == 0 and step:  # poison the receive and gradient rows; no peer writes them between barriers
            torch.cuda.synchronize()
            dist.barrier()
            for name in ("moe_dispatch_rows", "moe_dispatch_grad_rows"):
                ws.buffer(name, 0, torch.bfloat16).local.fill_(float("nan"))
            torch.cuda.synchronize()
            dist.barrier()
        received, h = dispatch_at_layout(dispatch, x, token_of_row, layout, w13)
        dh = torch.randn(h.shape, device=device, generator=torch.Generator(device).manual_seed(step)).bfloat16()
        epoch, dw13 = dispatch.start_backward(dh, received, layout, w13)
        dx = dispatch.finish_backward(epoch, layout, perm)

        want = bulk_dispatch(x[token_of_row], perm.tokens_per_expert, world, local)
        assert torch.equal(received, want), f"step {step}, rank {rank}: received rows differ"
        x32, w13_32 = (t.float().requires_grad_() for t in (x, w13))
        want_h = gated_gemm_reference(bulk_dispatch(x32[token_of_row], perm.tokens_per_expert, world, local),
                                      layout.tokens_per_local_expert, w13_32)
        (want_h * dh.float()).sum().backward()
        for got, ref, what in ((h, want_h.detach(), "h"), (dx, x32.grad, "dx"), (dw13, w13_32.grad, "dw13")):
            scale = ref.abs().max().item() if ref.numel() else 0.0
            torch.testing.assert_close(got.float(), ref, rtol=2e-2, atol=2e-2 * scale,
                                       msg=lambda m: f"step {step}, rank {rank}, {what}: {m}")
        received_per_rank = counts.view(world, world, local).sum(dim=(0, 2))
        idle_owner_seen += int((received_per_rank == 0).any())
        skewed_seen += int(counts.sum(dim=0).max() >= 0.4 * counts.sum())
        dispatch.errors.check()
    dispatch.errors.check(block=True)
    assert idle_owner_seen > 50 and skewed_seen > 50, (idle_owner_seen, skewed_seen)

    # A peer that never pushes: rank 0 runs one more step alone and must get an error, not a hang.
    x, logits = step_batch(0, rank, world, device)
    _, perm = permute(x, route(logits, TOP_K).expert_ids, EXPERTS)
    counts = gather_counts(perm.tokens_per_expert)
    layout = build_expert_layout(counts, rank, local, tile_rows=128, owner_tile_rows=BACKWARD_TILE_ROWS)
    assert counts[1, :local].sum() > 0  # rank 1 has rows for rank 0
    torch.cuda.synchronize()
    dist.barrier()
    if rank == 0:
        dispatch.spin_limit = 100_000
        dispatch_at_layout(dispatch, x, perm.order // TOP_K, layout, w13)
        with pytest.raises(PeerWaitTimeout, match=r"rank 0 timed out at step 1001 waiting for rank 1, slice"):
            dispatch.errors.check(block=True)
    torch.cuda.synchronize()
    dist.barrier()


def test_fused_dispatch_equals_bulk_for_1000_steps_and_timeout_raises():
    run_world(2, _fused_equals_bulk, backend="nccl")
