"""Where every routed row lives on its way to the experts and back: the contract of the fused dispatch and combine.

Every rank knows the whole count matrix C[s, g] (rows source rank s sends to global expert g; one all-gather),
so every rank computes the same buffer sizes (symmetric allocation is collective) and each side knows, without
asking, where its rows go:
- a source's permuted rows are grouped by global expert (moe.permute): expert g's rows start at
  sum(C[s, :g]);
- the owner d of experts d*L .. d*L+L-1 receives rows ordered (local expert, source rank, source row order),
  the order its grouped GEMM consumes; block (e, s) starts at recv_offsets[e * world + s].
Dispatch stores source row i at `send_dest_row[i]` of owner `send_dest_rank[i]`; combine stores the owner's
expert output row j back at row `recv_source_row[j]` of rank `recv_source_rank[j]`, the source's permuted order,
which `moe.permute.unpermute` consumes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from fused_dlrm.dist.host_copy import host_to_device


@dataclass
class ExpertLayout:
    counts: torch.Tensor  # int64 [world, num_experts], C[s, g]; the same on every rank
    host_counts: np.ndarray  # the same on the host: sizes and tile tables are derived from it without a sync
    rank: int
    world: int
    num_local_experts: int
    # this rank as a source: its permuted rows (grouped by global expert)
    send_dest_rank: torch.Tensor  # int64 [rows sent]
    send_dest_row: torch.Tensor  # int64 [rows sent]: row in the owner's receive buffer
    host_dest_block_start: np.ndarray  # int64 [num_experts]: where this rank's rows of expert g start in the
    # receive rows of g's owner
    # this rank as an owner: the rows its experts receive
    recv_offsets: np.ndarray  # int64 [num_local_experts * world + 1]: block (e, s) starts at [e * world + s] (the
    # host builds the owners' tile tables from it)
    recv_source_rank: torch.Tensor  # int64 [rows received]
    recv_source_row: torch.Tensor  # int64 [rows received]: row in the source's permuted rows
    tokens_per_local_expert: list[int]
    max_recv_rows: int  # over all ranks: receive buffers are sized by it (same on every rank)
    max_send_rows: int  # over all ranks: combine buffers are sized by it


def build_expert_layout(counts: torch.Tensor, rank: int, num_local_experts: int) -> ExpertLayout:
    """counts: int64 [world, num_experts] on any device; the layout's tensors live on that device. Reading the
    counts is the one host sync of a fused MoE layer: per-expert and per-block starts are computed on the host
    (numpy: see host_to_device) and sent in one copy, and the per-row tensors expand them on the device (sizes
    known: no further sync)."""
    world, num_experts = counts.shape
    if num_experts != world * num_local_experts:
        raise ValueError(f"counts has {num_experts} experts; expected {world} ranks x {num_local_experts}")
    c = counts.cpu().numpy()
    # owner_blocks[d]: [L, world] counts in receive order; offsets of every block in every owner's buffer.
    owner_blocks = c.reshape(world, world, num_local_experts).transpose(1, 2, 0).reshape(world, -1)
    block_starts = np.cumsum(owner_blocks, axis=1) - owner_blocks  # [owner, e * world + source]
    source_starts = np.cumsum(c, axis=1) - c  # [source, g]: first permuted row of expert g on the source

    # As a source: expert g's rows (starting at source_starts[rank, g]) go to its owner's block (g, rank).
    mine = c[rank]
    dest_of_expert, local_of_expert = np.divmod(np.arange(num_experts), num_local_experts)
    block_of_expert = block_starts[dest_of_expert, local_of_expert * world + rank]
    # As an owner: block (e, s) holds source s's rows of expert e, starting at recv_offsets[e * world + s].
    my_blocks = owner_blocks[rank]
    recv_offsets = np.concatenate([[0], np.cumsum(my_blocks)])
    sources = np.tile(np.arange(world), num_local_experts)
    experts = np.repeat(np.arange(num_local_experts), world) + rank * num_local_experts

    # Row i of a run (an expert's rows on the source side, a block on the owner side) that starts at row `first`
    # of its side maps to `start + (i - first)`. Both sides in one expansion: [rank, start - first] per run, then
    # the row index added (the owner side's rows are numbered after the source side's, which its shift undoes).
    # Three device ops: each is ~30 us of host time on the H200 hosts, and the GPU waits for them. Each side
    # starts on a 16-byte boundary (filler rows after each side, in runs of their own): Triton specialises
    # pointers on that alignment, and a changing one would compile kernels anew in the middle of training.
    num_sent, num_received = int(mine.sum()), int(my_blocks.sum())
    sent_span, span = _even(num_sent), _even(num_sent) + _even(num_received)
    runs = np.stack([np.concatenate([dest_of_expert, [0], sources, [0]]),
                     np.concatenate([block_of_expert - source_starts[rank], [0],
                                     source_starts[sources, experts] - recv_offsets[:-1] - sent_span, [0]])])
    sizes = np.concatenate([mine, [sent_span - num_sent], my_blocks, [span - sent_span - num_received]])
    runs, sizes = host_to_device([runs, sizes], counts.device)
    rows = torch.repeat_interleave(runs, sizes, dim=1, output_size=span)
    rows[1] += torch.arange(span, device=counts.device)
    send, recv = rows[:, :num_sent], rows[:, sent_span:sent_span + num_received]
    return ExpertLayout(
        counts=counts, host_counts=c, rank=rank, world=world, num_local_experts=num_local_experts,
        send_dest_rank=send[0], send_dest_row=send[1], host_dest_block_start=block_of_expert,
        recv_offsets=recv_offsets, recv_source_rank=recv[0], recv_source_row=recv[1],
        tokens_per_local_expert=my_blocks.reshape(num_local_experts, world).sum(axis=1).tolist(),
        max_recv_rows=int(owner_blocks.sum(axis=1).max()), max_send_rows=int(c.sum(axis=1).max()))


def _even(n: int) -> int:
    """n rounded up to a multiple of 2: int64 rows of that many end on a 16-byte boundary."""
    return n + n % 2


def expert_row_tiles(sizes: np.ndarray, block_m: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The row tiles of a grouped GEMM over contiguous experts of `sizes` rows (int64, on the host): tiles of
    block_m rows that never straddle two experts, numbered expert by expert. Returns (expert, first row, end
    row of the tile's expert) per tile; a tile's rows are first .. min(first + block_m, end) - 1."""
    sizes = np.asarray(sizes, dtype=np.int64)
    per_expert = (sizes + block_m - 1) // block_m
    expert = np.repeat(np.arange(sizes.size), per_expert)
    first_tile = np.cumsum(per_expert) - per_expert
    first_row = np.cumsum(sizes) - sizes
    begin = first_row[expert] + (np.arange(expert.size) - first_tile[expert]) * block_m
    return expert, begin, (first_row + sizes)[expert]


def gather_counts(tokens_per_expert: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """This rank's rows per global expert -> C [world, num_experts] (an all-gather; itself in one process)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return tokens_per_expert.view(1, -1).clone()
    world = dist.get_world_size(group)
    out = tokens_per_expert.new_empty(world * tokens_per_expert.numel())  # flat: gloo checks the sizes
    dist.all_gather_into_tensor(out, tokens_per_expert.contiguous(), group=group)
    return out.view(world, -1)
