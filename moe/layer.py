"""Expert-parallel MoE layer: route, permute, dispatch, local experts, combine, unpermute (Megatron's alltoall token
dispatcher), bulk-synchronous (`comm="bulk"`) or with the exchanges fused into the expert GEMMs (`comm="fused"`).

Experts are split evenly over the ranks of `group`: expert e lives on rank e // (num_experts / world size). The
router is replicated (its gradient, like any replicated parameter's, is the caller's to all-reduce); the
tokens are the rank's own. Without a process group (or a world of 1) the collectives are identities.

comm="fused" (CUDA symmetric memory, under torchrun): every rank all-gathers the count matrix and derives the
address of every row (moe.expert_layout). Each source pushes its routed rows into the owners' buffers and the
owner's first expert GEMM waits per tile for just the rows it reads (moe.kernels.fused_dispatch); the second
expert GEMM stores its output tiles straight into the sources' buffers and each source's weighted unpermute
consumes them as their flags arrive (moe.kernels.fused_combine). Every table of the forward's kernels is made from
the counts on the GPU, for a receive capacity chosen before the counts are seen, so the host launches the forward
without waiting for them. With FusedMoEConfig.max_tokens_per_rank that capacity is a bound no routing can exceed and
the host never reads the counts in the forward (the backward's layout reads them, long after their copy ended);
without it the capacity is that of earlier calls, and the host reads the counts once the first GEMM is queued,
to dispatch again should the rows have outgrown it (`_fused_dispatch`). On GPUs the dispatch's launches are
replayed as a CUDA graph once a call repeats (`_dispatch_at_capacity`). Backward: see _FusedExperts.

Refused inputs (a rank with more tokens than max_tokens_per_rank; the caller's `refused`, such as the Transformer's
token ids outside its vocabulary) raise on every rank: a rank raising alone would leave its peers waiting in the
next exchange. Each rank's refusal words ([code, value, limit], code 0: none) ride in the counts' exchange that
every call makes anyway (the bulk all-to-all, the fused all-gather: 3 words more per rank), and every rank raises
where the host reads the counts: bulk and fused without max_tokens_per_rank in the forward; with it, on gloo (whose
collectives return done) at once. Elsewhere (NCCL) no forward reads them: every rank records them in its dispatch's
error word (`FusedDispatch.record_refused`: one one-program kernel behind the dispatch; in training too, where a
backward may never come: an evaluation without no_grad, a loss dropped) and raises PeerRefusedInput from there: in
the backward, which reads the counts anyway, else at the layer's next call, which reads the words the call before
it left unread (their copy ended long before) ahead of its own exchanges, or `dispatch.errors.check(block=True)`;
on the CPU at the call's end. So every rank raises at the same call: the error word's own reading, at whichever
call each rank's GPU has copied it by, differs between ranks, and a rank raising there would leave its peers in
that call's exchange. Raising takes the refusal out of the error word (`errors.check(block=True)`), so no later call
raises it again (the word is the layer's: where several layers refused one forward, as every layer does with a rank
over max_tokens_per_rank, the backward raises the last one's and the others' raise at their next call). Until then
a rank over max_tokens_per_rank sends none of its tokens (no buffer is overrun) and its output is NaN.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch
import torch.distributed as dist
import triton
from torch import nn

from fused_dlrm.config_checks import check_count
from fused_dlrm.dist import all_to_all_v, exchange_counts
from fused_dlrm.dist.alltoall import world_size
from fused_dlrm.dist.host_copy import PendingHostCopy
from fused_dlrm.dist.reorder import inverse_permutation, reorder
from fused_dlrm.dist.symmetric import ALLOCATION_TIMEOUT_S, _Workspace, cuda_workspace
from fused_dlrm.kernels.graphed_calls import GraphedCalls, Lease
from fused_dlrm.kernels.peer_flags import DEFAULT_SPIN_LIMIT, check_spin_limit
from fused_dlrm.train.compute_copies import compute_copy, compute_weight, refresh_compute_copy
from moe.expert_layout import (DispatchTables, ExpertLayout, build_expert_layout, dispatch_tables,
                               gather_counts_and_words, send_slots)
from moe.experts import SwiGLUExperts
from moe.kernels.fused_combine import FusedCombine, OwnerRows
from moe.kernels.fused_dispatch import FusedDispatch, gemm_config
from moe.permute import Permutation, permutation, permute, routing_weights_grad, unpermute
from moe.routing import TopKRouter

log = logging.getLogger(__name__)

DISPATCH_PUSH_PROGRAMS = 64  # the push runs beside the first GEMM on the SMs that GEMM leaves free

# A rank's refusal words: [code, value, limit] int64 (code 0: nothing refused), exchanged with the routing counts.
REFUSAL_WORDS = 3
TOO_MANY_TOKENS = 1  # value: the rank's tokens, limit: max_tokens_per_rank
TOKEN_OUT_OF_VOCABULARY = 2  # value: a token id of the rank's batch, limit: the vocabulary size
BATCH_NOT_CUT = 3  # value: the tokens of the rank's batch, limit: the TP group size sequence parallelism cuts it into


def refused_message(rank: int, refused: int, words: list[int]) -> str:
    """What `rank` says of rank `refused`'s refused input (its refusal words)."""
    code, value, limit = words[:REFUSAL_WORDS]
    whose = "" if refused == rank else f"rank {refused} has "
    if code == TOO_MANY_TOKENS:
        what = (f"{value} tokens, more than max_tokens_per_rank={limit} (FusedMoEConfig), which sizes the fused "
                f"exchange's buffers")
    elif code == TOKEN_OUT_OF_VOCABULARY:
        what = f"token id {value} in its batch, outside the vocabulary [0, {limit})"
    elif code == BATCH_NOT_CUT:
        what = (f"a batch of {value} tokens, which model.sequence_parallel cannot cut into model.tp_size={limit} "
                f"equal parts")
    else:
        what = f"an input refused with code {code} (value {value}, limit {limit})"
    return f"rank {rank}: {whose}{what}"


def raise_refused(words: list[list[int]], rank: int) -> None:
    """Raise ValueError if a rank's input was refused (words: every rank's refusal words, on the host, the same on
    every rank), naming this rank's refusal if it has one, else the first refused rank's."""
    refused = [r for r, w in enumerate(words) if w[0]]
    if refused:
        r = rank if rank in refused else refused[0]
        raise ValueError(refused_message(rank, r, words[r]))


@dataclass(frozen=True)
class FusedMoEConfig:
    """Settings of comm="fused"."""

    num_programs: int | None = None  # persistent programs of the dispatch push and of the combine GEMM; None:
    # DISPATCH_PUSH_PROGRAMS and one per SM
    wait_timeout_spins: int = DEFAULT_SPIN_LIMIT  # polls of a flag before a wait gives up and names rank and slice
    allocation_timeout_s: float = ALLOCATION_TIMEOUT_S  # how long a rank waits for its peers at an allocation of
    # the `cuda_workspace` the layer makes (dist.symmetric.agree_on_allocation)
    cuda_graphs: bool = True  # GPUs: the dispatch's launches before the counts' host sync replayed as CUDA graphs
    # (less host time per forward; each graph keeps its h, a13 and tables allocated between calls)
    max_tokens_per_rank: int | None = None  # the most tokens any rank passes to one forward. With it the forward
    # never waits for the counts on the host: the buffers hold the most rows any routing of that many tokens can
    # bring (an owner receives at most world x max_tokens_per_rank x min(top_k, local experts) rows: at world > 1
    # up to world times what balanced routing needs), and a call with more tokens is refused. None: the buffers
    # grow to the rows seen, and each forward reads the counts on the host (one sync).
    dispatch: str = "auto"  # "rows": every routed row is pushed to its expert's owner; "tokens" (needs
    # max_tokens_per_rank): each token once per owner rank whatever number of its experts that rank holds, GEMM 1
    # reading the rows through token ids and storing `received` for the backward (moe.kernels.fused_dispatch); at
    # top_k >= world, world x fewer bytes, and no copy of the receive buffer for the backward. "auto": tokens with
    # max_tokens_per_rank, else rows (2x H200, 2026-11-26: the fine-grained MoE step 107.0 ms by token, 109.7 by
    # row; docs/benchmarks.md).
    combine: str = "auto"  # "rows": every routed row's expert output goes back to its source, which sums a
    # token's k rows (and, training, keeps each for the routing weights' gradient); "auto": with the dispatch by
    # token, the owner sums each token's rows on its experts, weighted, and one row per (token, owner) crosses;
    # its backward sends the output gradient once per (token, owner) and the owner, which kept its rows, returns
    # each row's routing weight gradient (4 bytes) (moe.kernels.fused_combine); else rows.

    def __post_init__(self):
        """Bad settings refused here, before anything is built, with or without a GPU (training's and the
        report's configs)."""
        check_spin_limit(self.wait_timeout_spins, "comm.wait_timeout_spins")
        if self.num_programs is not None:  # 0 was taken as None
            check_count("comm.num_programs", self.num_programs, 1,
                        "a whole number >= 1 or null (the dispatch push's default, one per SM for the combine)")
        if self.dispatch not in ("auto", "rows", "tokens"):
            raise ValueError(f"FusedMoEConfig.dispatch={self.dispatch!r}: expected 'auto', 'rows' or 'tokens'")
        if self.combine not in ("auto", "rows"):
            raise ValueError(f"FusedMoEConfig.combine={self.combine!r}: expected 'auto' or 'rows'")
        if self.dispatch == "tokens" and self.max_tokens_per_rank is None:
            raise ValueError("FusedMoEConfig.dispatch='tokens' sizes its buffers by max_tokens_per_rank: set it")
        if self.max_tokens_per_rank is not None and self.max_tokens_per_rank < 1:
            raise ValueError(f"max_tokens_per_rank={self.max_tokens_per_rank} must be positive")

    @property
    def dispatches_by_token(self) -> bool:
        """Whether the dispatch goes by token: "tokens", or "auto" with max_tokens_per_rank."""
        return self.dispatch != "rows" and self.max_tokens_per_rank is not None

    @property
    def combines_by_token(self) -> bool:
        """Whether the combine (and its backward) goes by token: "auto" with the dispatch by token."""
        return self.combine == "auto" and self.dispatches_by_token


class MoELayer(nn.Module):
    def __init__(self, d_model: int, ffn: int, num_experts: int, top_k: int, group: dist.ProcessGroup | None = None,
                 capacity_factor: float | None = None, renormalize: bool | None = None, seed: int = 0,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
                 comm: str = "bulk", fused: FusedMoEConfig | None = None, workspace: _Workspace | None = None,
                 statistics_group: dist.ProcessGroup | None = None, drop_policy: str = "probs"):
        """`workspace` (comm="fused"): the symmetric memory to use instead of `cuda_workspace` over
        `group` (tests pass a simulated one). `statistics_group`: the ranks sharing one batch slice (sequence
        parallelism), over which the load-balancing loss counts the expert choices (moe.routing). `renormalize`,
        `drop_policy`: TopKRouter's (None: the routing weights renormalised over the top k when top_k > 1; the
        assignments a capacity keeps: the most probable)."""
        super().__init__()
        self.group = group
        self.world = world_size(group)
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        if num_experts % self.world != 0:
            raise ValueError(f"num_experts={num_experts} must be a multiple of the expert-parallel world size "
                             f"{self.world}")
        if comm not in ("bulk", "fused"):
            raise ValueError(f"comm={comm!r}: expected 'bulk' or 'fused'")
        self.comm = comm
        self.d_model = d_model
        self.num_experts = num_experts
        self.num_local_experts = num_experts // self.world
        self.router = TopKRouter(d_model, num_experts, top_k, renormalize, capacity_factor, seed, dtype, device,
                                 statistics_group, drop_policy)
        self.experts = SwiGLUExperts(self.num_local_experts, d_model, ffn, self.rank * self.num_local_experts,
                                     seed, dtype, device)
        self.dispatch = self.combine = self._dispatch_graphs = self.max_tokens = None
        self._refuse_alone = self.world == 1  # a refused call raises at once: no peer waits for this rank
        self._refusals_read_at_once = False  # comm="fused" with max_tokens_per_rank: the gathered words read at once
        self._refusals_recorded = False  # ... or recorded in the dispatch's error word (no forward reads them)
        self._unread: _HostLayout | None = None  # then the last call's counts and words, read by the next call
        if comm == "fused":
            fused = fused or FusedMoEConfig()
            if workspace is None:
                on_cuda = torch.device(device).type == "cuda" if device is not None else torch.cuda.is_available()
                if not on_cuda or not dist.is_initialized():  # device None: a model moved to the GPU later
                    raise RuntimeError("comm=fused needs CUDA GPUs under torchrun (symmetric memory); use comm=bulk "
                                       "on the CPU")
                workspace = cuda_workspace(group, fused.allocation_timeout_s)
            spins = fused.wait_timeout_spins
            by_token = fused.max_tokens_per_rank if fused.dispatches_by_token else None
            self.dispatch = FusedDispatch(workspace, d_model, ffn, self.num_local_experts,
                                          fused.num_programs or DISPATCH_PUSH_PROGRAMS, spins, max_tokens=by_token,
                                          top_k=top_k, describe_refused=partial(refused_message, self.rank))
            self.combine = FusedCombine(workspace, d_model, self.num_local_experts,
                                        fused.num_programs or _combine_programs(workspace.device), spins,
                                        max_tokens=by_token if fused.combines_by_token else None, top_k=top_k)
            self._dispatch_graphs = GraphedCalls() if fused.cuda_graphs and workspace.device.type == "cuda" else None
            self.max_tokens = fused.max_tokens_per_rank
            if self.max_tokens is not None:
                most_received = self.world * self.max_tokens * min(top_k, self.num_local_experts)
                self.dispatch.reserve(most_received, most_received)  # never outgrown
                # A source's flag slots: one per tile of each expert's rows, at most one partial tile per expert.
                most_sent = self.max_tokens * top_k
                self.combine.reserve(most_sent, triton.cdiv(most_sent, self.combine.blocks.block_m)
                                     + min(num_experts, most_sent))
            # The forward reads no counts on the host (see the module docstring on refused inputs), except where
            # collectives return done (gloo): there the refusal words are read right after the all-gather.
            self._refusals_read_at_once = (self.max_tokens is not None and self.world > 1
                                           and dist.get_backend(group) == "gloo")
            self._refusals_recorded = self.max_tokens is not None and not self._refusals_read_at_once

    def forward(self, x: torch.Tensor, logit_bias: torch.Tensor | None = None,
                alongside: Callable[[], torch.Tensor] | None = None,
                refused: torch.Tensor | None = None) -> tuple[torch.Tensor, MoEStatistics]:
        """x: [tokens, d_model] (this rank's tokens, possibly none) -> (y [tokens, d_model], aux).

        aux (MoEStatistics): load_balancing_loss and z_loss (scalars over this rank's tokens, unscaled: the caller
        applies its coefficients), tokens_per_expert ([num_experts], this rank's kept assignments), dropped
        (assignments dropped by the capacity) and tokens_per_local_expert ([num_local_experts], rows this rank's
        experts ran; these two computed when first read), all tensors on x's device (reading them on the host
        waits for the GPU). Host syncs of a forward: the counts that size the exchanges (bulk; comm="fused" reads
        them once the first expert GEMM is queued, and with max_tokens_per_rank not at all: its backward does), and
        permute's row count when a capacity can drop assignments.
        `logit_bias` is passed to the router (tests force skewed routings with it).
        `alongside`: work that does not depend on the routing (the Transformer's shared expert), run once the counts
        are on their way to the host and before the host waits for them, so that the GPU runs it while the host
        syncs (Megatron overlaps its shared expert with the dispatch alike); its result [tokens, d_model] is added to
        the routed output: y = routed + alongside().
        `refused`: the refusal words ([code, value, limit] int64 on x's device, code 0: none) of a problem the caller
        found in this rank's inputs without reading them on the host (the Transformer's token ids): raised on every
        rank as this layer's own refusals are (see the module docstring).
        """
        self._check_inputs(x, logit_bias, refused)
        self._raise_unread_refusal()
        tokens = x.shape[0]
        words, x = self._refusal(x, refused)
        overlap = _Alongside(alongside)
        routing = self.router(x, logit_bias)  # under autocast: bf16 logits, routed in fp32 (moe.routing.route)
        if torch.is_autocast_enabled(x.device.type):  # mixed precision: the rows and the experts in its dtype
            x = x.to(torch.get_autocast_dtype(x.device.type))
        kept = None if routing.capacity is None else routing.kept  # dropless: no host sync in permute
        # Rows are grouped by global expert, hence by destination rank.
        if self.comm == "fused":
            perm = permutation(routing.expert_ids, self.num_experts, kept, routing.weights, routing.block_counts)
            gathered = gather_counts_and_words(perm.tokens_per_expert, words, self.group)  # [source, expert + word]
            if self._refusals_read_at_once:
                raise_refused(gathered[:, self.num_experts:].tolist(), self.rank)
            counts = gathered[:, :self.num_experts].contiguous()
            y = _FusedExperts.apply(x, routing.weights, self.experts.w13, self.experts.w2, self, counts, gathered,
                                    perm, torch.is_grad_enabled(), overlap)
            recv_counts = counts[:, self.rank * self.num_local_experts:(self.rank + 1) * self.num_local_experts]
        else:
            rows, perm = permute(x, routing.expert_ids, self.num_experts, kept, routing.block_counts)
            send_counts = perm.tokens_per_expert.view(self.world, self.num_local_experts)
            sent = torch.cat([send_counts, words.expand(self.world, -1)], dim=1)  # every peer gets the words
            received = exchange_counts(sent, self.group)
            on_host = PendingHostCopy(torch.stack([sent, received]))  # every size of the exchange
            overlap()
            host = on_host.get()  # the host sync
            raise_refused(host[1, :, self.num_local_experts:].tolist(), self.rank)
            recv_counts = received[:, :self.num_local_experts]
            exchange = _BulkRows(recv_counts, host[:, :, :self.num_local_experts], self.group)
            expert_out = self.experts(exchange.to_owners(rows), exchange.tokens_per_local_expert)
            y = unpermute(exchange.to_sources(expert_out), perm, routing.weights)
        if y.shape[0] != tokens:  # this rank's call was refused, its tokens not sent (`_refusal`)
            y = torch.cat([y, y.new_full((tokens, y.shape[1]), float("nan"))])
        y = overlap.added_to(y)
        kept = routing.kept
        aux = MoEStatistics({"load_balancing_loss": routing.aux_loss, "z_loss": routing.z_loss,
                             "tokens_per_expert": routing.tokens_per_expert},
                            derived={"dropped": lambda: (~kept).sum(),
                                     "tokens_per_local_expert": lambda: recv_counts.sum(dim=0)})
        return y, aux

    def _fused_dispatch(self, x: torch.Tensor, counts: torch.Tensor, gathered: torch.Tensor, perm: Permutation,
                        w13_param: torch.Tensor, keep_a13: bool, overlap: _Alongside
                        ) -> tuple[_HostLayout, _Dispatched]:
        """The fused dispatch and GEMM 1 -> (the call's layout, built when first asked for; what the dispatch made,
        at the receive capacity), with the combine's buffers reserved.

        The push and the GEMM are launched from tables the GPU makes from the counts. With max_tokens_per_rank
        their capacity is a bound no routing exceeds, and the host does not read the counts. Without it, the
        capacity is the one earlier calls reserved, and only then the host reads the counts (the layout), while the
        GEMM runs; when this call's rows did not fit (every rank sees it in the same counts) the dispatch runs
        again in buffers reserved for them. The first call has no capacity yet: it reads its counts first.
        `overlap` is queued behind GEMM 1, before the host waits for the counts. The dispatch by token sends each
        row's routing weight (perm.row_weights: `permutation` was given the weights) with its token id.
        `gathered`: the all-gathered counts, then every rank's refusal words; the layout raises a refusal where the
        host reads them, and where no forward does they are recorded in the dispatch's error word (see the module
        docstring)."""
        # enqueued before the dispatch: reading it waits for the counts only
        layout = _HostLayout(self, counts, PendingHostCopy(gathered), self._tile_rows(x))
        if not self.dispatch.capacity:
            self.dispatch.reserve(layout.get().max_recv_rows, layout.get().total_rows)
        out = self._dispatch_at_capacity(x, counts, perm, w13_param, keep_a13,
                                         gathered[:, self.num_experts:] if self._refusals_recorded else None)
        if self._refusals_recorded:  # the words: the backward's to read, else the next call's
            self._unread = layout
        overlap()
        if self.max_tokens is not None:
            return layout, out
        lay = layout.get(out.tables)  # the host sync, with GEMM 1 queued
        if lay.max_recv_rows > self.dispatch.capacity:
            if x.is_cuda:  # the first try's kernels end before its buffers go
                torch.cuda.current_stream(x.device).synchronize()
            old_capacity = self.dispatch.capacity
            self.dispatch.reserve(lay.max_recv_rows, lay.total_rows)
            if self._dispatch_graphs is not None:  # their keys name the old capacity: they cannot come again
                self._dispatch_graphs.clear()
            log.info("MoE dispatch: %d rows per owner outgrew the receive capacity %d: dispatched again at %d",
                     lay.max_recv_rows, old_capacity, self.dispatch.capacity)
            out = self._dispatch_at_capacity(x, counts, perm, w13_param, keep_a13)
        self.combine.reserve(lay.max_send_rows, send_slots(lay.host_counts, lay.tile_rows), lay.total_rows)
        return layout, out

    def _dispatch_at_capacity(self, x: torch.Tensor, counts: torch.Tensor, perm: Permutation,
                              w13_param: torch.Tensor, keep_a13: bool, refusals: torch.Tensor | None = None
                              ) -> _Dispatched:
        """Push + GEMM 1 over DispatchTables of the current capacity (capacity rows); `refusals` (every rank's
        refusal words), if given, recorded behind them in the dispatch's error word (FusedDispatch.record_refused).

        Their launches, and the tables' and the weights' cast before them, are kernels only, which read the epoch
        and x's address from the device (FusedDispatch.begin stores them): on GPUs they are replayed as a CUDA graph
        once a call repeats their key (shapes, dtypes, capacity, the weights' and the symmetric buffers'
        addresses), with the permutation and the counts copied into the graph's own tensors
        (fused_dlrm.kernels.graphed_calls); x is read in place. A training forward holds its outputs (h, a13, the
        tables) with a Lease until its backward is done."""
        dispatch = self.dispatch
        x = x.contiguous()
        if x.data_ptr() % 16:  # the kernels read x through its address, as 16-byte vectors
            x = x.clone()
        epoch = dispatch.begin(x)

        def launch(token_of_row: torch.Tensor, counts: torch.Tensor, inverse: torch.Tensor | None = None,
                   row_weights: torch.Tensor | None = None):  # x: this call's (a replay reads it at its address)
            w13 = compute_weight(w13_param, x.dtype)  # mixed precision: the rows' dtype (the copy, if any)
            tables = dispatch_tables(counts, self.rank, self.num_local_experts, *self._tile_rows(x),
                                     token_of_row.numel(), dispatch.capacity)
            # Training keeps GEMM 1's products (a13) for the SwiGLU gradient, as autograd keeps the bulk experts',
            # and every received row for the weight gradient: without it, this rank's own rows are not copied (GEMM
            # 1 reads them from x), which leaves the push only the peers' rows. By token GEMM 1 stores the rows.
            a13 = x.new_empty(dispatch.capacity, w13.shape[2]) if keep_a13 else None
            rows = x.new_empty(dispatch.capacity, x.shape[1]) if keep_a13 and dispatch.by_token else None
            h = dispatch.launch(x, token_of_row, tables, w13, a13_out=a13, own_rows=keep_a13, inverse=inverse,
                                rows_out=rows, row_weights=row_weights)
            return tables, h, a13, w13, rows

        inputs = (perm.token_of_row, counts) + ((perm.inverse, perm.row_weights) if dispatch.by_token else ())
        if self._dispatch_graphs is None:
            (tables, h, a13, w13, rows), lease = launch(*inputs), None
        else:
            refresh_compute_copy(w13_param)  # a replay runs no Python: the copy it reads must be current
            copy = compute_copy(w13_param, x.dtype)  # a copy made anew (dropped, then rewritten) is another key
            key = (x.shape, x.dtype, tuple((t.shape, t.stride(), t.dtype) for t in inputs), keep_a13,
                   dispatch.capacity, w13_param.data_ptr(), w13_param.dtype,
                   None if copy is None else copy.data_ptr(), dispatch.buffer_addresses(x.dtype))
            (tables, h, a13, w13, rows), lease = self._dispatch_graphs(key, launch, inputs, hold=keep_a13)
        if refusals is not None:  # behind the acknowledgement: this epoch's exchange completes as ever
            dispatch.record_refused(refusals, epoch)
        received = dispatch.end(epoch)  # by token None: `rows`, which GEMM 1 stored
        return _Dispatched(tables, rows if dispatch.by_token else received, h, a13, w13, lease, epoch)

    def _fused_combine(self, out: _Dispatched, w2: torch.Tensor, perm: Permutation, weights: torch.Tensor,
                       rows_out: torch.Tensor | None = None) -> tuple[torch.Tensor, OwnerRows | None]:
        """GEMM 2 and the combine of a dispatched call -> ([tokens, d_model], what the owner keeps for the backward
        by token): by token where the combine is made for it (FusedMoEConfig.combine), else by row (rows_out:
        each assignment's row, for the routing weights' gradient; None for the owner rows)."""
        if self.combine_by_token:
            epoch = self.combine.start_by_token(out.h, w2, out.tables, self.dispatch.rows_by_source(out.epoch), perm)
            return self.combine.finish_by_token(epoch, out.tables, perm)
        epoch = self.combine.start(out.h, w2, out.tables)
        return self.combine.finish(epoch, out.tables, perm, weights, rows_out=rows_out), None

    @property
    def combine_by_token(self) -> bool:
        """Whether the combine and its backward go by token (comm="fused", FusedMoEConfig.combine="auto" with the
        dispatch by token)."""
        return self.combine is not None and self.combine.max_tokens is not None

    def _tile_rows(self, x: torch.Tensor) -> tuple[int, int]:
        """Row tiles of the combine's GEMM and of the owner's (the dispatch's backward GEMM numbers its flags)."""
        return self.combine.blocks.block_m, gemm_config(x.device, x.dtype, backward=True).block_m

    def _check_inputs(self, x: torch.Tensor, logit_bias: torch.Tensor | None, refused: torch.Tensor | None) -> None:
        if x.dim() != 2 or x.shape[1] != self.d_model or not x.is_floating_point():
            raise ValueError(f"MoELayer takes x as floating-point [tokens, d_model={self.d_model}], got "
                             f"{list(x.shape)} {x.dtype}")
        if logit_bias is not None and logit_bias.shape != (self.num_experts,):
            raise ValueError(f"logit_bias must be [num_experts={self.num_experts}], got {list(logit_bias.shape)}")
        if refused is not None and (refused.shape != (REFUSAL_WORDS,) or refused.dtype != torch.int64
                                    or refused.device != x.device):
            raise ValueError(f"refused must be int64 [{REFUSAL_WORDS}] on {x.device}, got {list(refused.shape)} "
                             f"{refused.dtype} on {refused.device}")

    def _raise_unread_refusal(self) -> None:
        """Where forwards record refusals (see the module docstring): the previous call's refusal words, unless its
        backward read them, raised here, before this call's exchanges, on every rank alike."""
        earlier, self._unread = self._unread, None
        if earlier is not None and not earlier.words_read:
            earlier.raise_refusal(earlier.on_host.get(), unless_told=True)

    def _refusal(self, x: torch.Tensor, refused: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (this rank's refusal words, the tokens it routes). More tokens than max_tokens_per_rank: raised at
        once where no peer waits, else none of them routed (no buffer can hold them) until every rank raises."""
        if self.max_tokens is not None and x.shape[0] > self.max_tokens:
            words = [TOO_MANY_TOKENS, x.shape[0], self.max_tokens]
            if self._refuse_alone:
                raise ValueError(refused_message(self.rank, self.rank, words))
            return torch.tensor(words, device=x.device), x[:0]
        return torch.zeros(REFUSAL_WORDS, dtype=torch.int64, device=x.device) if refused is None else refused, x


class MoEStatistics(Mapping):
    """MoELayer.forward's aux: tensors, and statistics derived from the routing that are computed when first read
    (small reductions that a training step does not read: their kernels run only where someone asks)."""

    def __init__(self, values: dict[str, torch.Tensor], derived: dict[str, Callable[[], torch.Tensor]]):
        self._values, self._derived = dict(values), dict(derived)

    def __getitem__(self, key: str) -> torch.Tensor:
        if key in self._derived:
            self._values[key] = self._derived.pop(key)()
        return self._values[key]

    def __contains__(self, key: object) -> bool:  # without computing it (Mapping's would)
        return key in self._values or key in self._derived

    def __iter__(self):
        return iter([*self._values, *self._derived])

    def __len__(self) -> int:
        return len(self._values) + len(self._derived)


class _HostLayout:
    """A call's ExpertLayout, built from the counts' copy to the host when first asked for: in the forward without
    max_tokens_per_rank (the host sync), else in the backward, long after the copy ended (none under no_grad).
    The copy holds every rank's refusal words after the counts: a refused call raises here, on every rank (or, where
    no backward read them, at the layer's next call: `raise_refusal`); where the dispatch's error word holds the
    refusal too (MoELayer._refusals_recorded), from there, which clears it."""

    def __init__(self, layer: MoELayer, counts: torch.Tensor, on_host: PendingHostCopy, tile_rows: tuple[int, int]):
        self.layer, self.counts, self.on_host, self.tile_rows = layer, counts, on_host, tile_rows
        self._layout: ExpertLayout | None = None
        self.words_read = False  # the refusal words, by `raise_refusal`

    def raise_refusal(self, host: torch.Tensor, unless_told: bool = False) -> None:
        """Raise the call's refusal if any rank's input was refused (every rank alike: they hold the same words);
        host: the copy (on_host.get()); unless_told: not if errors.check(block=True) raised it already (the next
        call's reading; a backward cannot go on either way)."""
        self.words_read = True
        layer = self.layer
        words = host[:, layer.num_experts:].tolist()
        if layer._refusals_recorded and any(w[0] for w in words):
            # Raised from the error word (its first error: this refusal, or one before it), so that no later
            # call raises it again; raise_refused only if a check raised it already.
            layer.dispatch.errors.check(block=True)
            if unless_told:
                return
        raise_refused(words, layer.rank)

    def get(self, dispatched: DispatchTables | None = None) -> ExpertLayout:
        """`dispatched`: the call's tables, whose per-row tables the layout reuses when they hold every row."""
        if self._layout is None:
            layer, host = self.layer, self.on_host.get()
            self.raise_refusal(host)
            self._layout = build_expert_layout(self.counts, layer.rank, layer.num_local_experts, *self.tile_rows,
                                               dispatched=dispatched, host_counts=host[:, :layer.num_experts])
        return self._layout


@dataclass
class _Dispatched:
    """What the fused dispatch and GEMM 1 made: `capacity` rows, the received ones first (the backward cuts them to
    the layout's count)."""

    tables: DispatchTables
    received: torch.Tensor | None  # this rank's own rows among them only if the push copied them (training); by
    # token, GEMM 1's copy of every row it read (training; None otherwise)
    h: torch.Tensor
    a13: torch.Tensor | None  # training only
    w13: torch.Tensor  # the weights GEMM 1 read (cast to the rows' dtype)
    lease: Lease | None  # on h, a13, w13, the tables and (by token) `received`, when a CUDA graph's (training)
    epoch: int  # the dispatch's (by token: its rows' tokens and weights, FusedDispatch.rows_by_source)


class _Alongside:
    """MoELayer.forward's `alongside`, called by each path once, behind the dispatch (where it hides the host's sync
    when there is one); in the caller's grad mode (grad is off inside an autograd Function's forward; the result's
    own graph joins the caller's through its inputs)."""

    def __init__(self, fn: Callable[[], torch.Tensor] | None):
        self.fn, self.grad_enabled, self.result = fn, torch.is_grad_enabled(), None

    def __call__(self) -> None:
        if self.fn is not None:
            with torch.set_grad_enabled(self.grad_enabled):
                self.result = self.fn()

    def added_to(self, y: torch.Tensor) -> torch.Tensor:
        if self.fn is None:
            return y
        if not isinstance(self.result, torch.Tensor) or self.result.shape != y.shape:
            got = list(self.result.shape) if isinstance(self.result, torch.Tensor) else type(self.result).__name__
            raise ValueError(f"alongside returned {got}; the layer's output is {list(y.shape)}")
        return y + self.result


class _BulkRows:
    """The all-to-all of rows between sources (permuted order: by global expert, hence by owner) and owners
    (their experts' order: local expert, then source rank, then source order), with autograd."""

    def __init__(self, recv_counts: torch.Tensor, host_counts: torch.Tensor, group: dist.ProcessGroup | None):
        """recv_counts[s, e]: rows rank s sends to this rank's local expert e; host_counts: on the host, stacked,
        send_counts[r, e] (rows this rank sends to expert e of rank r) and recv_counts."""
        world, num_local_experts = recv_counts.shape
        self.recv_counts, self.group = recv_counts, group
        host_send, host_recv = host_counts
        self.send_splits = host_send.sum(dim=1).tolist()
        self.recv_splits = host_recv.sum(dim=1).tolist()
        self.tokens_per_local_expert = host_recv.sum(dim=0).tolist()
        # The all-to-all delivers (source, local expert, row); a stable sort by local expert regroups.
        device = recv_counts.device
        local_expert_of_row = torch.repeat_interleave(
            torch.arange(num_local_experts, device=device).repeat(world), recv_counts.reshape(-1),
            output_size=sum(self.recv_splits))
        self.regroup = torch.sort(local_expert_of_row, stable=True).indices
        self.undo_regroup = inverse_permutation(self.regroup)

    def to_owners(self, rows: torch.Tensor) -> torch.Tensor:
        received = all_to_all_v(rows, self.send_splits, self.recv_splits, self.group)
        return reorder(received, 0, self.regroup, self.undo_regroup)

    def to_sources(self, rows: torch.Tensor) -> torch.Tensor:
        return all_to_all_v(reorder(rows, 0, self.undo_regroup, self.regroup), self.recv_splits, self.send_splits,
                            self.group)


class _FusedExperts(torch.autograd.Function):
    """Fused dispatch + GEMM 1, fused GEMM 2 + combine, as one autograd node: tokens x, routing weights and the
    expert weights in, the combined tokens out.

    Backward, fused the same way in reverse: FusedCombine.start_backward pushes each row's output gradient
    (times its routing weight) into its owner's buffer and finish_backward's GEMM (grad_h = g @ w2^T) waits per
    tile for just those rows; FusedDispatch.start_backward stores the input-gradient tiles straight into the
    sources' buffers and finish_backward sums each token's rows as their flags arrive. The routing weights'
    gradient needs each row's expert output: by row the forward's consumer kept a copy. With the dispatch by token
    the combine is by token too (FusedMoEConfig.combine): the owner keeps its rows, its backward GEMM reads each
    row's output gradient through the row's token (pushed once per token and owner: start_backward_by_token) and
    sends the source each row's routing weight gradient.

    The expert weights come in as the parameters and are cast to the rows' dtype here (mixed precision), so that
    the weight-gradient GEMMs store their gradients in the parameters' dtype: no bf16 gradient for autograd to
    cast back to fp32 in a pass of its own.
    """

    @staticmethod
    def forward(ctx, x, weights, w13_param, w2_param, layer: MoELayer, counts: torch.Tensor, gathered: torch.Tensor,
                perm: Permutation, grad_enabled: bool, overlap: _Alongside):
        # Inside forward grad mode is always off, and needs_input_grad ignores the caller's: under no_grad the
        # parameters still "need" a gradient, and the copies below would be made for a backward that never comes.
        needs_grad = [grad_enabled and needs for needs in ctx.needs_input_grad]
        training = any(needs_grad)
        w2 = compute_weight(w2_param, x.dtype)  # the parameter itself when of x's dtype (w13's is the dispatch's)
        layout, out = layer._fused_dispatch(x, counts, gathered, perm, w13_param, training, overlap)
        # By row the routing weights' gradient reads each assignment's row (copied by the source, in assignment
        # order); by token the owners compute it from the rows they keep.
        rows = x.new_empty(weights.numel(), x.shape[1]) if needs_grad[1] and not layer.combine_by_token else None
        y, owner = layer._fused_combine(out, w2, perm, weights, rows)
        if training:
            ctx.layer, ctx.layout, ctx.tables, ctx.perm = layer, layout, out.tables, perm
            ctx.weight_dtype, ctx.lease, ctx.weights_dtype = w13_param.dtype, out.lease, weights.dtype
            # The receive buffer is the sources' again at the next call: kept as a copy. By token the rows are
            # GEMM 1's own (a new tensor, or the graph's under the lease, as h and a13).
            received = out.received if layer.dispatch.by_token else out.received.clone()
            kept = (owner.y, owner.weight, owner.token) if owner is not None else (rows, weights, None)
            ctx.save_for_backward(received, out.h, out.a13, out.w13, w2, *kept)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        if ctx.lease is not None:
            ctx.lease.check()
        received, h, a13, w13, w2, *kept = ctx.saved_tensors
        layer, layout, perm = ctx.layer, ctx.layout.get(ctx.tables), ctx.perm
        if layout.max_recv_rows > ctx.tables.capacity:
            # Only where max_tokens_per_rank's bound did not hold (it counts on a token's experts being distinct):
            # the forward's kernels stopped at the capacity (rows past it left out), and every rank, seeing the same
            # counts, stops here rather than let a backward kernel read past h.
            raise RuntimeError(f"fused MoE layer, rank {layer.rank}: an owner received {layout.max_recv_rows} rows, "
                               f"more than the {ctx.tables.capacity} its buffers hold (max_tokens_per_rank's bound); "
                               f"the forward left the rows past them out")
        n = sum(layout.tokens_per_local_expert)  # the rows received, of the capacity's
        received, h, a13 = received[:n], h[:n], a13[:n]
        grad_y = grad_y.contiguous().to(h.dtype)
        grad_weights = None
        if layer.combine_by_token:
            epoch = layer.combine.start_backward_by_token(grad_y, perm, layout)
            grad_h, grad_w2 = layer.combine.finish_backward_by_token(epoch, layout, h, w2, OwnerRows(*kept),
                                                                     ctx.weight_dtype)
        else:
            rows, weights, _ = kept
            grad_weights = routing_weights_grad(rows, grad_y, weights) if ctx.needs_input_grad[1] else None
            epoch = layer.combine.start_backward(grad_y, perm, layout)
            grad_h, grad_w2 = layer.combine.finish_backward(epoch, layout, h, w2, ctx.weight_dtype)
        dispatch_epoch, grad_w13 = layer.dispatch.start_backward(grad_h, received, layout, w13, a13,
                                                                 ctx.weight_dtype)
        grad_x = layer.dispatch.finish_backward(dispatch_epoch, layout, perm)
        if layer.combine_by_token and ctx.needs_input_grad[1]:  # late: the owners' words have long arrived
            grad_weights = layer.combine.routing_weights_grad_by_token(epoch, perm).to(ctx.weights_dtype)
        if ctx.lease is not None:  # the dispatch's graph may rewrite h, a13, w13 and the tables again
            ctx.lease.release()
        return grad_x, grad_weights, grad_w13, grad_w2, None, None, None, None, None, None


def _combine_programs(device: torch.device) -> int:
    """One persistent GEMM program per SM (with 128 x 256 tiles only one fits on an SM at a time). Two per SM, as
    before, ran the second half of the grid only as the first finished: at world 1 on one H200 one per SM took GEMM 2
    2-5% less time (docs/benchmarks.md, 2026-11-25). The interpreter runs programs one after another: a few
    suffice."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
