"""FusedCombine on simulated worlds of 2, 4 and 8 ranks (Triton interpreter): expert GEMM 2 stored into the sources'
combine buffers with per-tile flags, then each source's weighted unpermute, against a float64 reference."""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass

import pytest
import torch

from fused_dlrm.dist.symmetric import SimulatedWorld
from fused_dlrm.kernels.peer_flags import PeerWaitTimeout
from moe.expert_layout import build_expert_layout, dispatch_tables, send_slots
from moe.kernels.fused_combine import (FusedCombine, fused_combine_backward_reference, fused_combine_reference,
                                      routing_weights_grad_reference)
from moe.permute import permutation
from sm90 import compile_for_sm90

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs in the Triton interpreter")

D_MODEL, FFN, LOCAL = 40, 20, 2  # d_model spans 3 column blocks of 16, the last one partial
NEVER = -30.0
OWNER_TILE_ROWS = 16  # the dispatch's backward tiles: unused here
TOP_K = 3  # the combine by token's bound on a token's experts: the most of any case


@dataclass
class Case:
    tokens: list[int]  # per rank
    top_k: int = 2
    bias: dict[int, float] | None = None  # expert -> logit bias
    keep: float = 1.0  # fraction of assignments kept (the rest dropped, as by a capacity)


class World:
    def __init__(self, world_size: int, num_programs: int = 3, spin_limit: int = 100, max_tokens: int = 16):
        self.world_size = world_size
        self.num_experts = world_size * LOCAL
        self.combines = [FusedCombine(ws, D_MODEL, LOCAL, num_programs, spin_limit, max_tokens, TOP_K)
                         for ws in SimulatedWorld(world_size).workspaces()]

    def route(self, case: Case, gen: torch.Generator):
        """Every rank's permutation and routing weights for random logits (plus the case's bias), and layouts."""
        perms, weights = [], []
        for t in case.tokens:
            logits = torch.randn(t, self.num_experts, generator=gen, dtype=torch.float64)
            for e, b in (case.bias or {}).items():
                logits[:, e] += b
            top, ids = torch.topk(torch.softmax(logits, -1), case.top_k, dim=-1)
            kept = torch.rand(ids.shape, generator=gen) < case.keep
            weights.append(top * kept)
            perms.append(permutation(ids, self.num_experts, kept, weights[-1]))
        counts = torch.stack([p.tokens_per_expert for p in perms])
        return perms, weights, [build_expert_layout(counts, r, LOCAL, self.combines[0].blocks.block_m,
                                                    OWNER_TILE_ROWS) for r in range(self.world_size)], counts

    def tables(self, counts: torch.Tensor, perms, capacity: int):
        """Every rank's forward tables at a receive capacity (made on the device, as the layer does before the
        host sees the counts), the combines reserved for the counts."""
        for c in self.combines:
            c.reserve(int(counts.sum(dim=1).max()), send_slots(counts.numpy(), c.blocks.block_m))
        return [dispatch_tables(counts, r, LOCAL, self.combines[0].blocks.block_m, OWNER_TILE_ROWS,
                                p.order.numel(), capacity) for r, p in enumerate(perms)]

    def step(self, case: Case, gen: torch.Generator, dtype=torch.float32, starting=None, spare_rows=5):
        """One epoch on every rank (those in `starting`, default all, run start), forward and, when every rank
        started, backward. The GEMM's input holds `spare_rows` rows past the most any owner receives, NaN (a tile
        past the listed ones would show). Returns (outputs, expected outputs, counts)."""
        perms, weights, layouts, counts = self.route(case, gen)
        capacity = layouts[0].max_recv_rows + spare_rows
        tables = self.tables(counts, perms, capacity)
        hs = [torch.randn(sum(lay.tokens_per_local_expert), FFN, generator=gen).to(dtype) for lay in layouts]
        padded = [torch.cat([h, torch.full((capacity - h.shape[0], FFN), float("nan"), dtype=dtype)]) for h in hs]
        w2s = [torch.randn(LOCAL, FFN, D_MODEL, generator=gen).to(dtype) for _ in layouts]
        starting = range(self.world_size) if starting is None else starting
        epochs = {r: self.combines[r].start(padded[r], w2s[r], tables[r]) for r in starting}  # every producer first
        rows_out = [torch.full((w.numel(), D_MODEL), float("nan"), dtype=dtype) for w in weights]
        outs = [c.finish(epochs[r] if r in epochs else c.ws.next_epoch("combine"), tables[r], perms[r], weights[r],
                         rows_out=rows_out[r])
                for r, c in enumerate(self.combines)]
        expected = fused_combine_reference(hs, w2s, layouts, perms, weights)
        for rows, perm, w, want in zip(rows_out, perms, weights, expected):  # every assignment's row, in order
            assert not rows.isnan().any()
            assert rows[perm.inverse == perm.order.numel()].eq(0).all()  # dropped: zeros
            weighted = (rows.double().view(*w.shape, D_MODEL) * w.double().unsqueeze(2)).sum(dim=1)
            assert_close(weighted, want, 1e-2 if dtype == torch.float16 else 1e-5)
        tol = 1e-2 if dtype == torch.float16 else 1e-5
        if len(starting) == self.world_size:  # backward: the output gradient to the owners, GEMM 2's gradients
            grad_ys = [torch.randn(t, D_MODEL, generator=gen).to(dtype) for t in case.tokens]
            epochs = [c.start_backward(g, p, lay) for c, g, p, lay in zip(self.combines, grad_ys, perms, layouts)]
            grads = [c.finish_backward(e, lay, h, w2) for c, e, lay, h, w2 in zip(self.combines, epochs, layouts, hs,
                                                                                     w2s)]
            expected_grads = fused_combine_backward_reference(grad_ys, perms, weights, hs, w2s, layouts)
            for (grad_h, grad_w2), (want_h, want_w2) in zip(grads, expected_grads):
                assert_close(grad_h, want_h, tol)
                assert_close(grad_w2, want_w2, tol)
        for c in self.combines:  # poison: rows the next epoch does not write would show as NaN
            c.ws.buffer("combine_rows", 0, dtype).local.fill_(float("nan"))
            if len(starting) == self.world_size:
                c.ws.buffer("combine_grad_rows", 0, dtype).local.fill_(float("nan"))
        return outs, expected, counts


    def step_by_token(self, case: Case, gen: torch.Generator, dtype=torch.float32, starting=None, backward=True):
        """One epoch of the combine by token on every rank (those in `starting` run start_by_token); each owner
        gets what the dispatch by token would have pushed (`pushed_rows`). The parts buffers are NaN before: a part
        read that no owner stored shows. Returns (outputs, expected outputs, counts); keeps what a backward reads
        (`forward`: perms, weights, layouts, hs, w2s, owners), which runs unless backward=False."""
        perms, weights, layouts, counts = self.route(case, gen)
        capacity = layouts[0].max_recv_rows + 5
        tables = self.tables(counts, perms, capacity)
        hs = [torch.randn(sum(lay.tokens_per_local_expert), FFN, generator=gen).to(dtype) for lay in layouts]
        padded = [torch.cat([h, torch.full((capacity - h.shape[0], FFN), float("nan"), dtype=dtype)]) for h in hs]
        w2s = [torch.randn(LOCAL, FFN, D_MODEL, generator=gen).to(dtype) for _ in layouts]
        for c in self.combines:
            c._token_buffers(dtype)[0].local.fill_(float("nan"))  # made at full size first
        starting = range(self.world_size) if starting is None else starting
        epochs = {}
        for owner in starting:  # every producer first
            epochs[owner] = self.combines[owner].start_by_token(padded[owner], w2s[owner], tables[owner],
                                                                self.pushed_rows(owner, perms, counts), perms[owner])
        finished = [c.finish_by_token(epochs[r] if r in epochs else c.ws.next_epoch("combine"), tables[r], perms[r])
                    for r, c in enumerate(self.combines)]
        self.forward = (perms, weights, layouts, hs, w2s, [owner for _, owner in finished])
        if backward and len(starting) == self.world_size:
            self.backward_by_token(case, gen, dtype, *self.forward)
        return [out for out, _ in finished], fused_combine_reference(hs, w2s, layouts, perms, weights), counts

    def pushed_rows(self, owner: int, perms, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What the dispatch by token would have pushed to `owner`: the peers' rows' tokens and weights [world,
        max_rows], garbage elsewhere (a row read that the owner does not own would show)."""
        max_tokens = self.combines[0].max_tokens
        row_tokens = torch.full((self.world_size, max_tokens * TOP_K), max_tokens - 1, dtype=torch.int32)
        source_weights = torch.full(row_tokens.shape, float("nan"))
        for source, perm in enumerate(perms):
            if source != owner:  # the dispatch pushes the rows of the owner's experts
                lo = int(counts[source, :owner * LOCAL].sum())
                hi = lo + int(counts[source, owner * LOCAL:(owner + 1) * LOCAL].sum())
                row_tokens[source, lo:hi] = perm.token_of_row[lo:hi].int()
                source_weights[source, lo:hi] = perm.row_weights[lo:hi]
        return row_tokens, source_weights

    def backward_by_token(self, case: Case, gen: torch.Generator, dtype, perms, weights, layouts, hs, w2s, owners):
        """The backward of a combine by token on every rank: each source's output gradient to the owners of its
        tokens' experts (the gradient token buffers NaN before: a read of a token not pushed shows), the owners'
        GEMM 2 gradients, the routing weights' gradients back at the sources; all against float64."""
        for c in self.combines:
            c._token_gradient_buffers(dtype)[0].local.fill_(float("nan"))
        grad_ys = [torch.randn(t, D_MODEL, generator=gen).to(dtype) for t in case.tokens]
        epochs = [c.start_backward_by_token(g, p, lay) for c, g, p, lay in zip(self.combines, grad_ys, perms,
                                                                               layouts)]
        grads = [c.finish_backward_by_token(e, lay, h, w2, owner)
                 for c, e, lay, h, w2, owner in zip(self.combines, epochs, layouts, hs, w2s, owners)]
        weight_grads = [c.routing_weights_grad_by_token(e, p) for c, e, p in zip(self.combines, epochs, perms)]
        tol = 1e-2 if dtype == torch.float16 else 1e-5
        for (grad_h, grad_w2), (want_h, want_w2) in zip(
                grads, fused_combine_backward_reference(grad_ys, perms, weights, hs, w2s, layouts)):
            assert grad_h.dtype == dtype
            assert_close(grad_h, want_h, tol)
            assert_close(grad_w2, want_w2, tol)
        for got, want in zip(weight_grads, routing_weights_grad_reference(grad_ys, hs, w2s, layouts, perms)):
            assert got.dtype == torch.float32
            assert_close(got, want, tol)


def assert_close(got, want, tol, what=""):
    """Max error within tol of want's largest element (NaN fails); `what` names the tensor in the message."""
    assert got.shape == want.shape, f"{what} shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    scale = max(want.abs().max().item(), 1e-12) if want.numel() else 1.0
    err = (got.double() - want).abs().max().item() if want.numel() else 0.0
    assert err <= tol * scale, f"{what} max error {err} relative {err / scale}"


def make_case(name: str, world_size: int) -> Case:
    tokens = [9, 7, 8, 6, 10, 5, 7, 4][:world_size]  # uneven; the first 2 or 4 for the smaller worlds
    last_rank = range((world_size - 1) * LOCAL, world_size * LOCAL)
    return {
        "balanced": Case(tokens),
        # about half of all assignments to expert 1
        "skewed": Case([12, 10, 11, 9, 14, 6, 8, 5][:world_size], bias={1: 8.0}),
        "idle expert": Case(tokens, top_k=3, bias={2: NEVER}),
        "rank without tokens": Case([11, 0, 9, 6, 12, 3, 7, 8][:world_size]),
        "dropped": Case(tokens, keep=0.6),
        "last rank receives nothing": Case(tokens, bias={e: NEVER for e in last_rank}),
    }[name]


NAMES = ["balanced", "skewed", "idle expert", "rank without tokens", "dropped", "last rank receives nothing"]


# Every scenario at 2 and 4 ranks; at 8 (the interpreter's slowest: ~19 s each) the two most uneven loads.
WORLDS_AND_NAMES = [(w, n) for w in (2, 4) for n in NAMES] + [(8, "skewed"), (8, "rank without tokens")]


@pytest.mark.parametrize("world_size,name", WORLDS_AND_NAMES, ids=[f"{n}-{w}" for w, n in WORLDS_AND_NAMES])
def test_matches_reference(world_size, name):
    case = make_case(name, world_size)
    world = World(world_size)
    gen = torch.Generator().manual_seed(world_size * 100 + len(name))
    outs, expected, counts = world.step(case, gen)
    for got, want in zip(outs, expected):
        assert_close(got, want, 1e-5)
    # The scenario did what its name says.
    if name == "skewed":
        assert counts[:, 1].sum() >= 0.4 * counts.sum()
    if name == "idle expert":
        assert counts[:, 2].sum() == 0
    if name == "rank without tokens":
        assert counts[1].sum() == 0 and outs[1].shape == (0, D_MODEL)
    if name == "dropped":
        assert counts.sum() < sum(case.tokens) * case.top_k
    if name == "last rank receives nothing":
        assert counts[:, -LOCAL:].sum() == 0


@pytest.mark.parametrize("world_size", [2, 4])  # 8 ranks: test_matches_reference (one step); here 70 s
def test_consecutive_epochs_on_the_same_flags(world_size):
    """Changing loads (buffers grow, flag slots move between owners), fp16 and fp32, one workspace."""
    world = World(world_size, num_programs=2)
    gen = torch.Generator().manual_seed(5)
    for step in range(4):
        tokens = [int(t) for t in torch.randint(0, 8 + 4 * step, (world_size,), generator=gen)]
        bias = {step % (world_size * LOCAL): 4.0 if step % 2 else 0.0}
        dtype, tol = (torch.float16, 2e-3) if step % 3 == 2 else (torch.float32, 1e-5)
        outs, expected, _ = world.step(Case(tokens, top_k=2, bias=bias), gen, dtype)
        for got, want in zip(outs, expected):
            assert got.dtype == dtype
            assert_close(got, want, tol)
    assert world.combines[0].ws.next_epoch("combine") == 5


def test_deterministic():
    world = World(2)
    runs = []
    for _ in range(2):
        outs, _, _ = world.step(Case([13, 11], top_k=3), torch.Generator().manual_seed(9))
        runs.append(outs)
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("name", NAMES)
def test_by_token_matches_reference(world_size, name):
    """The combine by token (each owner sums a token's rows before one part crosses) against float64."""
    world = World(world_size)
    gen = torch.Generator().manual_seed(world_size * 10 + len(name))
    outs, expected, _ = world.step_by_token(make_case(name, world_size), gen)
    for got, want in zip(outs, expected):
        assert_close(got, want, 1e-5)


def test_by_token_consecutive_epochs_mixed_with_the_combine_by_row():
    """Routing changes every epoch (a token's rows of the last epoch must not linger), fp16 and fp32, and epochs
    by row in between: both count the same epochs and share the acks."""
    world = World(4, num_programs=2)
    gen = torch.Generator().manual_seed(15)
    for step in range(5):
        tokens = [int(t) for t in torch.randint(0, 16, (4,), generator=gen)]
        case = Case(tokens, top_k=3, bias={step % 8: 3.0})
        dtype, tol = (torch.float16, 2e-3) if step % 2 else (torch.float32, 1e-5)
        outs, expected, _ = (world.step(case, gen, dtype) if step == 2 else world.step_by_token(case, gen, dtype))
        for got, want in zip(outs, expected):
            assert got.dtype == dtype
            assert_close(got, want, tol)


def test_by_token_one_part_crosses_per_token_and_owner_it_chose():
    """Each source's parts buffer holds, at [owner, token], the owner's weighted sum of that token's rows there,
    for exactly the tokens that chose one of the owner's experts: NaN (the poison) everywhere else; and so,
    in the backward, does each owner's gradient token buffer with the sources' output gradients."""
    world = World(4)
    case = Case([13, 0, 16, 9], top_k=3, bias={2: 3.0})
    outs, _, counts = world.step_by_token(case, torch.Generator().manual_seed(17))
    perms, _, _, _ = world.route(case, torch.Generator().manual_seed(17))  # the step's routing again
    for source, (combine, perm) in enumerate(zip(world.combines, perms)):
        parts = combine.ws.buffer("combine_parts", 0, torch.float32).local
        parts = parts[:4 * combine.max_tokens * D_MODEL].view(4, combine.max_tokens, D_MODEL)
        owner_of_row = torch.repeat_interleave(torch.arange(4 * LOCAL) // LOCAL, perm.tokens_per_expert)
        for owner in range(4):
            chose = torch.zeros(combine.max_tokens, dtype=torch.bool)
            chose[perm.token_of_row[owner_of_row == owner]] = True
            assert not parts[owner][chose].isnan().any()
            assert parts[owner][~chose].isnan().all()
        if case.tokens[source]:  # the parts add up to the output
            stored = torch.nan_to_num(parts[:, :case.tokens[source]]).sum(dim=0)
            torch.testing.assert_close(stored, outs[source], rtol=1e-6, atol=1e-6)
    # The backward the same way reversed: each owner's gradient token buffer holds, at [source, token], the
    # source's output gradient for exactly the tokens that chose one of the owner's experts (its own tokens too).
    for owner, combine in enumerate(world.combines):
        grads = combine.ws.buffer("combine_grad_tokens", 0, torch.float32).local
        grads = grads[:4 * combine.max_tokens * D_MODEL].view(4, combine.max_tokens, D_MODEL)
        for source, perm in enumerate(perms):
            owner_of_row = torch.repeat_interleave(torch.arange(4 * LOCAL) // LOCAL, perm.tokens_per_expert)
            chose = torch.zeros(combine.max_tokens, dtype=torch.bool)
            chose[perm.token_of_row[owner_of_row == owner]] = True
            assert not grads[source][chose].isnan().any()
            assert grads[source][~chose].isnan().all()


def test_by_token_deterministic():
    world = World(2)
    runs = [world.step_by_token(Case([13, 11], top_k=3), torch.Generator().manual_seed(9))[0] for _ in range(2)]
    for a, b in zip(*runs):
        assert torch.equal(a, b)


BY_TOKEN = pytest.mark.parametrize("by_token", [False, True], ids=["by row", "by token"])


@BY_TOKEN
def test_rows_past_the_receive_capacity_are_neither_read_nor_stored(by_token):
    """The fused layer's receive capacity under max_tokens_per_rank, world x max_tokens x min(top_k, local
    experts), holds every routing of distinct experts per token. The router's kernel once sent each of a NaN row's
    k rows to the last expert: here every token's 3 rows go to expert 3, 96 rows for owner 1's 64. GEMM 2 and the
    combine by token stop at the capacity as GEMM 1 does: every combine tile ends there, no row of h past it is
    read (NaN behind h), and by row each token gets its rows below it (those past it count as dropped; by token a
    token's rows at one expert share one slot, so only the reads are checked)."""
    world = World(2)
    tokens, top_k = 16, 3
    capacity = 2 * tokens * min(top_k, LOCAL)
    gen = torch.Generator().manual_seed(21)
    weights = [torch.rand(tokens, top_k, generator=gen) for _ in range(2)]
    perms = [permutation(torch.full((tokens, top_k), 2 * LOCAL - 1), 2 * LOCAL, None, w) for w in weights]
    counts = torch.stack([p.tokens_per_expert for p in perms])
    tables = world.tables(counts, perms, capacity)
    for tab in tables:
        first, rows = tab.combine_tiles[:2, :tab.combine_row_tiles.item()]
        assert ((first + rows <= capacity) & (rows > 0)).all()  # no tile reaches past it
    behind = [torch.cat([torch.randn(capacity, FFN, generator=gen), torch.full((64, FFN), float("nan"))])
              for _ in range(2)]
    hs = [h[:capacity] for h in behind]  # the kernels' h; a read past it meets NaN
    w2s = [torch.randn(LOCAL, FFN, D_MODEL, generator=gen) for _ in range(2)]
    if by_token:
        epochs = [c.start_by_token(h, w2, tab, world.pushed_rows(r, perms, counts), p)
                  for r, (c, h, w2, tab, p) in enumerate(zip(world.combines, hs, w2s, tables, perms))]
        outs = [c.finish_by_token(e, tab, p)[0] for c, e, tab, p in zip(world.combines, epochs, tables, perms)]
    else:
        for c in world.combines:  # NaN where no owner stores: a row past the capacity read by its source shows
            c._buffers(torch.float32)[0].local.fill_(float("nan"))
        epochs = [c.start(h, w2, tab) for c, h, w2, tab in zip(world.combines, hs, w2s, tables)]
        outs = [c.finish(e, tab, p, w) for c, e, tab, p, w in zip(world.combines, epochs, tables, perms, weights)]
    for tab, perm, w, out in zip(tables, perms, weights, outs):
        at_owner = tab.send_dest_row[perm.inverse].view(tokens, top_k)  # every assignment's row at owner 1
        rows = hs[1].double()[at_owner.clamp(max=capacity - 1)] @ w2s[1][LOCAL - 1].double()
        want = (rows * (w.double() * (at_owner < capacity)).unsqueeze(2)).sum(dim=1)
        assert not out.isnan().any()
        if not by_token:
            assert_close(out, want, 1e-5)
    assert (tables[1].send_dest_row >= capacity).any()  # source 1's last rows did not fit


@BY_TOKEN
def test_rows_below_the_capacity_are_combined_however_many_rows_lie_past_it(by_token):
    """Owner 0 walks rank 1's blocks first: expert 0's 16 rows (receive rows 0-15), then expert 1's 160 (rows 32-191,
    all but 32 past the capacity of 64); rank 0's own 16 rows of expert 1 (rows 16-31) come last. The combine's tile
    table holds the tiles of `capacity` rows (plus a partial one per block): tiles past the capacity must not take
    its columns from those below it, or rank 0's own rows are never computed (by row its consumer then waits for
    a flag that never comes; by token the rows are left out of the sum)."""
    world = World(2, spin_limit=50, max_tokens=176)
    capacity = 64
    expert_ids = [torch.ones(16, 1, dtype=torch.int64), torch.tensor([0] * 16 + [1] * 160).view(-1, 1)]
    gen = torch.Generator().manual_seed(23)
    weights = [torch.rand(ids.shape, generator=gen) for ids in expert_ids]
    perms = [permutation(ids, 2 * LOCAL, None, w) for ids, w in zip(expert_ids, weights)]
    counts = torch.stack([p.tokens_per_expert for p in perms])
    tables = world.tables(counts, perms, capacity)
    hs = [torch.randn(capacity, FFN, generator=gen) for _ in range(2)]
    w2s = [torch.randn(LOCAL, FFN, D_MODEL, generator=gen) for _ in range(2)]
    if by_token:
        epochs = [c.start_by_token(h, w2, tab, world.pushed_rows(r, perms, counts), p)
                  for r, (c, h, w2, tab, p) in enumerate(zip(world.combines, hs, w2s, tables, perms))]
        out = world.combines[0].finish_by_token(epochs[0], tables[0], perms[0])[0]
    else:
        epochs = [c.start(h, w2, tab) for c, h, w2, tab in zip(world.combines, hs, w2s, tables)]
        out = world.combines[0].finish(epochs[0], tables[0], perms[0], weights[0])
    rows = tables[0].send_dest_row  # rank 0's rows: 16-31 at owner 0
    assert rows.tolist() == list(range(16, 32))
    assert_close(out, (hs[0][rows].double() @ w2s[0][1].double()) * weights[0].double(), 1e-5)


@BY_TOKEN
def test_owner_that_never_starts_times_out_naming_rank_and_slice(by_token):
    world = World(2, spin_limit=20)
    step = world.step_by_token if by_token else world.step
    with pytest.raises(PeerWaitTimeout, match=r"fused MoE combine: rank 0 timed out at step 1 waiting for rank 1, "
                                              r"slice \d+"):
        step(Case([6, 5]), torch.Generator().manual_seed(3), starting=[0])


@BY_TOKEN
def test_source_that_never_acknowledges_blocks_its_owners_with_an_error(by_token):
    """Rank 1's acknowledgement of epoch 1 is lost: at epoch 2 rank 0 must not overwrite rank 1's rows, and says so."""
    world = World(2, spin_limit=20)
    step = world.step_by_token if by_token else world.step
    gen = torch.Generator().manual_seed(4)
    step(Case([6, 5]), gen)
    world.combines[0].ws.buffer("combine_ack", 2, torch.int32).local[1] = 0
    with pytest.raises(PeerWaitTimeout, match="rank 0 timed out at step 2 waiting for rank 1 to release its buffer"):
        step(Case([6, 5]), gen)


def after_one_epoch(by_token: bool, seed: int) -> tuple[World, Case, torch.Generator]:
    """Two ranks (waits of 20 polls) after one whole epoch, forward and backward, by token or by row; the case of
    their next calls and the generator."""
    world, case, gen = World(2, spin_limit=20), Case([7, 9]), torch.Generator().manual_seed(seed)
    (world.step_by_token if by_token else world.step)(case, gen)
    return world, case, gen


def test_backward_by_token_peers_that_never_start_or_finish_time_out_naming_rank_and_slice():
    """Rank 1 never pushes its output gradient: rank 0's GEMM names rank 1 and a flag slot. Rank 1's GEMM never
    runs either: rank 0's routing weights' gradient names rank 1 and the row whose word never came."""
    world, case, gen = after_one_epoch(by_token=True, seed=8)
    perms, _, layouts, counts = world.route(case, gen)
    assert counts[1, :LOCAL].sum() > 0 and counts[0, LOCAL:].sum() > 0  # rows both ways
    tables = world.tables(counts, perms, layouts[0].max_recv_rows)
    combine = world.combines[0]
    h = torch.randn(tables[0].capacity, FFN, generator=gen)
    w2 = torch.randn(LOCAL, FFN, D_MODEL, generator=gen)
    sources = (torch.zeros(2, combine.max_tokens * TOP_K, dtype=torch.int32),
               torch.zeros(2, combine.max_tokens * TOP_K))
    combine._sum_token_rows = lambda *a: None  # the forward's parts are not this test's concern
    combine.start_by_token(h, w2, tables[0], sources, perms[0])
    owner = combine._token_sum.owner
    epoch = combine.start_backward_by_token(torch.randn(7, D_MODEL, generator=gen), perms[0], layouts[0])
    received = sum(layouts[0].tokens_per_local_expert)
    with pytest.raises(PeerWaitTimeout, match=r"fused MoE combine: rank 0 timed out at step 2 waiting for rank 1, "
                                              r"slice \d+"):
        combine.finish_backward_by_token(epoch, layouts[0], h[:received], w2, owner)
    rows_of_rank_1 = range(int(counts[0, :LOCAL].sum()), int(counts[0].sum()))
    with pytest.raises(PeerWaitTimeout, match=r"fused MoE combine: rank 0 timed out at step 2 waiting for rank 1, "
                                              r"slice (\d+)") as raised:
        combine.routing_weights_grad_by_token(epoch, perms[0])
    assert int(re.search(r"slice (\d+)", str(raised.value)).group(1)) in rows_of_rank_1


def test_backward_by_token_a_late_source_times_out_rather_than_take_a_weight_gradient_never_computed():
    """Rank 1 comes late to the backward by token: rank 0's GEMM gives up waiting for rank 1's output gradient, so
    what it would send back for rank 1's rows (each routing weight's gradient, in a word that carries the epoch:
    its own flag) was never computed. It must not store those words: rank 1, arriving, finishes its GEMM exactly
    (rank 0's gradient is there) and times out on them, naming rank 0, instead of taking them as this epoch's
    (once, it returned them, NaN here, without an error). The next epoch is exact on both ranks."""
    world, case, gen = after_one_epoch(by_token=True, seed=8)
    _, _, counts = world.step_by_token(case, gen, backward=False)
    assert counts[1, :LOCAL].sum() > 0 and counts[0, LOCAL:].sum() > 0  # rows both ways
    perms, weights, layouts, hs, w2s, owners = world.forward
    for c in world.combines:
        c._token_gradient_buffers(torch.float32)[0].local.fill_(float("nan"))
    grad_ys = [torch.randn(t, D_MODEL, generator=gen) for t in case.tokens]
    epochs = [None, None]

    def backward(rank: int):
        c = world.combines[rank]
        epochs[rank] = c.start_backward_by_token(grad_ys[rank], perms[rank], layouts[rank])
        return c.finish_backward_by_token(epochs[rank], layouts[rank], hs[rank], w2s[rank], owners[rank])

    with pytest.raises(PeerWaitTimeout, match=r"rank 0 timed out at step 2 waiting for rank 1, slice"):
        backward(0)  # rank 1 has not pushed its output gradient
    with pytest.raises(PeerWaitTimeout, match=r"rank 0 timed out at step 2 waiting for rank 1, slice"):
        world.combines[0].routing_weights_grad_by_token(epochs[0], perms[0])
    grad_h, grad_w2 = backward(1)
    want_h, want_w2 = fused_combine_backward_reference(grad_ys, perms, weights, hs, w2s, layouts)[1]
    assert_close(grad_h, want_h, 1e-5)
    assert_close(grad_w2, want_w2, 1e-5)
    with pytest.raises(PeerWaitTimeout, match=r"rank 1 timed out at step 2 waiting for rank 0, slice"):
        world.combines[1].routing_weights_grad_by_token(epochs[1], perms[1])
    world.step_by_token(case, gen)  # forward and backward, against float64


def test_backward_a_peer_late_by_two_calls_times_out_rather_than_take_rows_never_stored():
    """Rank 1 comes late to backward calls 2 and 3: rank 0's GEMM of call 2 gives up waiting for its rows (and
    acknowledges the call all the same), so rank 1 finishes call 2 exactly. Rank 0's push of call 3 gives up
    waiting for rank 1 to release its gradient buffer: it stores nothing and raises no flag there, so rank 1's GEMM
    of call 3 times out naming rank 0 instead of reading rank 0's rows of call 2 as call 3's (once, it did, without
    an error). The next epoch is exact on both ranks."""
    world, case, gen = after_one_epoch(by_token=False, seed=9)
    perms, weights, layouts, counts = world.route(case, gen)
    assert counts[1, :LOCAL].sum() > 0 and counts[0, LOCAL:].sum() > 0  # rows both ways
    hs = [torch.randn(sum(lay.tokens_per_local_expert), FFN, generator=gen) for lay in layouts]
    w2s = [torch.randn(LOCAL, FFN, D_MODEL, generator=gen) for _ in layouts]
    calls = {step: [torch.randn(t, D_MODEL, generator=gen) for t in case.tokens] for step in (2, 3)}

    def backward(rank: int, step: int):
        c = world.combines[rank]
        epoch = c.start_backward(calls[step][rank], perms[rank], layouts[rank])
        return c.finish_backward(epoch, layouts[rank], hs[rank], w2s[rank])

    with pytest.raises(PeerWaitTimeout, match=r"rank 0 timed out at step 2 waiting for rank 1, slice"):
        backward(0, 2)
    with pytest.raises(PeerWaitTimeout, match=r"rank 0 timed out at step 3 waiting for rank 1 to release"):
        backward(0, 3)
    want = fused_combine_backward_reference(calls[2], perms, weights, hs, w2s, layouts)[1]
    for got, expected in zip(backward(1, 2), want):
        assert_close(got, expected, 1e-5)
    with pytest.raises(PeerWaitTimeout, match=r"rank 1 timed out at step 3 waiting for rank 0, slice"):
        backward(1, 3)
    world.step(case, gen)  # forward and backward, against float64


def test_backward_source_that_never_starts_times_out_naming_rank_and_slice():
    world = World(2, spin_limit=20)
    gen = torch.Generator().manual_seed(6)
    perms, weights, layouts, counts = world.route(Case([7, 9]), gen)
    assert counts[1, :LOCAL].sum() > 0  # rank 1 has rows for rank 0's experts
    h = torch.randn(sum(layouts[0].tokens_per_local_expert), FFN, generator=gen)
    combine = world.combines[0]
    epoch = combine.start_backward(torch.randn(7, D_MODEL, generator=gen), perms[0], layouts[0])
    with pytest.raises(PeerWaitTimeout, match=r"fused MoE combine: rank 0 timed out at step 1 waiting for rank 1, "
                                              r"slice \d+"):
        combine.finish_backward(epoch, layouts[0], h, torch.randn(LOCAL, FFN, D_MODEL, generator=gen))


@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_a_late_peer_costs_one_bounded_wait_not_one_per_program(monkeypatch, phase):
    """Rank 1 never starts: every program of rank 0's consumer (the weighted unpermute; the backward's grad_h GEMM)
    waits for its tiles. Once the first wait has recorded the timeout, the others look once (peer_flags: their
    results are lost anyway), or a lost peer costs each of the launch's programs the whole bound (~54 s on GPUs).
    Counted in atomic operations: the interpreter runs the polls one by one."""
    from triton.runtime.interpreter import InterpreterBuilder
    spin_limit = 300
    world = World(2, spin_limit=spin_limit)
    gen = torch.Generator().manual_seed(6)
    perms, weights, layouts, counts = world.route(Case([20, 9]), gen)
    assert counts[1, :LOCAL].sum() > 0 and counts[0, LOCAL:].sum() > 0  # rows both ways
    combine = world.combines[0]
    atomics = []
    rmw = InterpreterBuilder.create_atomic_rmw
    monkeypatch.setattr(InterpreterBuilder, "create_atomic_rmw", lambda *a, **k: atomics.append(1) or rmw(*a, **k))
    if phase == "forward":  # 3 token blocks x 3 column blocks
        tables = world.tables(counts, perms, layouts[0].max_recv_rows)
        h = torch.randn(tables[0].capacity, FFN, generator=gen)
        epoch = combine.start(h, torch.randn(LOCAL, FFN, D_MODEL, generator=gen), tables[0])
        atomics.clear()
        run = lambda: combine.finish(epoch, tables[0], perms[0], weights[0])  # noqa: E731
    else:  # row tiles x 2 ffn blocks
        h = torch.randn(sum(layouts[0].tokens_per_local_expert), FFN, generator=gen)
        epoch = combine.start_backward(torch.randn(20, D_MODEL, generator=gen), perms[0], layouts[0])
        atomics.clear()
        run = lambda: combine.finish_backward(epoch, layouts[0], h,  # noqa: E731
                                              torch.randn(LOCAL, FFN, D_MODEL, generator=gen))
    with pytest.raises(PeerWaitTimeout, match="waiting for rank 1, slice"):
        run()
    assert spin_limit < len(atomics) < 2 * spin_limit, f"{len(atomics)} atomics: more than one wait spun its bound"


def test_inputs_that_do_not_fit_the_permutation_are_refused():
    """The kernels index the routing weights, the output gradient and the peers' token buffers by the permutation's
    tokens and top_k: a tensor of another shape read past its end (or missed assignments) without a word. Refused
    before anything is launched (the epoch is not counted)."""
    world = World(2)
    gen = torch.Generator().manual_seed(8)
    perms, weights, layouts, counts = world.route(Case([7, 9]), gen)
    combine = world.combines[0]
    tables = world.tables(counts, perms, layouts[0].max_recv_rows)[0]
    epoch = combine.start(torch.randn(tables.capacity, FFN, generator=gen),
                          torch.randn(LOCAL, FFN, D_MODEL, generator=gen), tables)
    for bad in (weights[0][:, :1], weights[0][1:], weights[0].reshape(-1)):
        with pytest.raises(ValueError, match=r"weights .*: expected \[7, 2\] \(the permutation's tokens"):
            combine.finish(epoch, tables, perms[0], bad)
    for bad in (torch.randn(7, D_MODEL // 2), torch.randn(6, D_MODEL)):
        for start in (combine.start_backward, combine.start_backward_by_token):
            with pytest.raises(ValueError, match=rf"grad_y .*: expected \[7, {D_MODEL}\]"):
                start(bad, perms[0], layouts[0])
    assert combine.ws.next_epoch("combine_grad") == 1  # no backward epoch was counted
    more = FusedCombine(SimulatedWorld(2).workspaces()[0], D_MODEL, LOCAL, 2, 100, max_tokens=16, top_k=1)
    more.reserve(1, 1)
    sources = (torch.zeros(2, 16, dtype=torch.int32), torch.zeros(2, 16))
    with pytest.raises(ValueError, match="top_k=2: this combine was made for 1"):  # rows past the peers' id buffers
        more.start_by_token(torch.randn(tables.capacity, FFN), torch.randn(LOCAL, FFN, D_MODEL), tables, sources,
                            perms[0])


COMPILE_FOR_SM90 = """
import torch
from moe.kernels import fused_combine as fc

flags = {n: "*i32" for n in ("ack_ptr", "error_ptr", "ready_ptr")}
tables = {n: "*i64" for n in ("tiles_ptr", "tile_count_ptr", "out_ptrs", "ready_ptrs", "rows_ptrs", "inverse_ptr",
                              "tile_of_row_ptr", "owner_of_row_ptr", "token_ptr", "dest_rank_ptr", "dest_row_ptr",
                              "source_rank_ptr", "source_row_ptr")}
b = fc.combine_blocks(torch.device("cuda"))  # the blocks FusedCombine launches on GPUs
shape = dict(D_MODEL=2048, BLOCK_N=b.block_n)
for dtype in ("bf16", "fp16", "fp32"):
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    block_k, stages = fc._gemm_steps(b, torch_dtype, True)
    data = {n: "*" + dtype for n in ("h_ptr", "w2_ptr", "rows_ptr", "out_ptr", "copy_ptr", "grad_ptr", "g_ptr")}
    ptrs = {**flags, **tables, **data, "weights_ptr": "*fp32", "weight_ptr": "*fp32"}
    out = getattr(tl, {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[dtype])
    gemm = dict(FFN=1408, BLOCK_M=b.block_m, BLOCK_K=block_k, PRECISION="ieee" if dtype == "fp32" else None, **shape)
    for local in (False, True):
        build(fc._expert_down_kernel, {**ptrs, "y_ptr": "*" + dtype}, dict(OUT_DTYPE=out, STORE_LOCAL=local, **gemm),
              b.gemm_warps, stages)
    w2 = {"w2_desc": f"tensordesc<{dtype}[1, {b.block_n}, {block_k}]>"}  # TMA (moe.kernels.weight_tiles)
    build(fc._gradient_gemm_kernel, {**ptrs, **w2}, dict(BLOCK_R=b.block_rows, **gemm), b.gemm_warps, stages)
    build(fc._weighted_unpermute_kernel, ptrs, dict(TOP_K=6, K_P2=8, BLOCK_T=b.block_tokens, OUT_DTYPE=out,
                                                    COPY_ROWS=True, **shape), b.consumer_warps, 3)
    build(fc._push_gradient_kernel, ptrs, dict(D_MODEL=2048, WORLD=2, BLOCK_R=b.block_rows, BLOCK_D=b.block_d,
                                               OUT_DTYPE=out), 4, 3)
    by_token = {"dest_order_ptr": "*i32", "tokens_ptrs": "*i64", "tokens_ptr": "*" + dtype, "y_ptr": "*" + dtype,
                "weight_of_row_ptr": "*fp32", "token_of_row_ptr": "*i32", "g_out_ptr": "*" + dtype,
                "weight_grad_ptrs": "*i64"}
    build(fc._push_token_gradients_kernel, {**ptrs, **by_token},
          dict(D_MODEL=2048, MAX_TOKENS=8192, TOP_K=6, K_P2=8, WORLD=2, BLOCK_T=b.part_tokens, BLOCK_D=b.block_d),
          4, 3)
    build(fc._gradient_gemm_by_token_kernel, {**ptrs, **w2, **by_token},
          dict(MAX_TOKENS=8192, BLOCK_T=b.part_tokens, **gemm), b.gemm_warps, stages)
    for first, sources in ((0, 2), (0, 1), (1, 1)):  # one launch; a simulated world's two
        build(fc._sum_token_rows_kernel, {**ptrs, "y_ptr": "*" + dtype, "rows_of_token_ptr": "*i32",
                                          "weight_of_row_ptr": "*fp32", "source_order_ptr": "*i32",
                                          "parts_ptrs": "*i64", "ack_ptrs": "*i64", "counters_ptr": "*i32"},
              dict(MAX_TOKENS=8192, WORLD=2, L=32, L_P2=32, ROWS=6, TOP_K=6, K_P2=8, BLOCK_T=b.part_tokens,
                   OUT_DTYPE=out, FIRST=first, SOURCES=sources, ACK=first + sources == 2, **shape),
              b.consumer_warps, 3)
build(fc._rows_of_tokens_kernel, {**tables, "row_tokens_ptr": "*i32", "row_weights_ptr": "*fp32",
                                  "own_weight_ptr": "*fp32", "rows_of_token_ptr": "*i32", "weight_of_row_ptr": "*fp32",
                                  "own_token_ptr": "*i64", "token_of_row_ptr": "*i32"},
      dict(BLOCK_M=b.block_m, MAX_TOKENS=8192, MAX_ROWS=8192 * 6, L=32), 4, 3)
build(fc._routing_weight_grads_kernel, {**tables, "words_ptr": "*i64", "out_ptr": "*fp32", "error_ptr": "*i32"},
      dict(TOP_K=6, K_P2=8, BLOCK_T=b.part_tokens), 4, 3)
build(fc._acknowledge_kernel, {"ack_ptrs": "*i64"}, dict(WORLD=4), 4, 3)
"""


def test_kernels_compile_for_sm90():
    """What only the GPU compiler enforces (types, tl.dot shapes and dtypes, shared memory of the launch
    configurations), checked without a GPU: compile for sm_90 in a process without the interpreter."""
    compile_for_sm90(COMPILE_FOR_SM90)


def test_dot_precision_follows_torch_tf32_setting():
    """fp32 products go through TF32 in the fused kernels exactly where torch's own fp32 GEMMs do (trainer.tf32):
    the bulk twin and the fused path then round alike."""
    from fused_dlrm.kernels import dot_precision
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    before = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = True
        assert dot_precision(torch.float32, cuda) == "tf32"
        assert dot_precision(torch.float32, cpu) == "ieee"  # the interpreter: exact
        torch.backends.cuda.matmul.allow_tf32 = False
        assert dot_precision(torch.float32, cuda) == "ieee"
        assert dot_precision(torch.bfloat16, cuda) is None
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


COUNTS = torch.tensor([[3, 1, 4, 1], [5, 9, 2, 6]])


def _refused(combine: FusedCombine, ffn: int, tile_rows: int, reserved: int = 9) -> None:
    """start on rank 0's tables of COUNTS at 20 receive rows, after reserving `reserved` rows per source."""
    tables = dispatch_tables(COUNTS, 0, LOCAL, tile_rows, OWNER_TILE_ROWS, 9, 20)
    combine.reserve(reserved, send_slots(COUNTS.numpy(), combine.blocks.block_m))
    combine.start(torch.randn(20, ffn), torch.randn(LOCAL, ffn, combine.d_model), tables)


def test_a_w2_the_backward_cannot_read_is_refused_in_the_forward():
    """w2 rows of 6 fp32 (24 bytes): TMA, which the backward's grad_h GEMM reads w2 through, needs multiples of 16."""
    combine = FusedCombine(SimulatedWorld(2).workspaces()[0], 6, LOCAL, 2, 1000)
    with pytest.raises(ValueError, match="w2 .* through TMA"):
        _refused(combine, 8, combine.blocks.block_m)


def test_tables_cut_into_other_tiles_are_refused():
    """The combine's flag slots number its own tiles (DispatchTables.send_tile): tables cut for another tile size
    would make the consumers wait on the wrong flags."""
    combine = FusedCombine(SimulatedWorld(2).workspaces()[0], D_MODEL, LOCAL, 2, 1000)
    with pytest.raises(ValueError, match="tiles of"):
        _refused(combine, FFN, 2 * combine.blocks.block_m)


def test_rows_past_the_reserved_ones_are_refused():
    """Rank 0 sends 9 rows; a combine buffer reserved for 8 per source cannot hold them."""
    combine = FusedCombine(SimulatedWorld(2).workspaces()[0], D_MODEL, LOCAL, 2, 1000)
    with pytest.raises(ValueError, match="9 rows to combine; 8 reserved"):
        _refused(combine, FFN, combine.blocks.block_m, reserved=8)


def test_a_permutation_without_routing_weights_is_refused():
    """The backward (and the combine by token) scale each row by perm.row_weights: a permutation made without the
    weights has none, and no kernel may run on a missing operand."""
    world = World(2)
    gen = torch.Generator().manual_seed(8)
    perms, _, layouts, counts = world.route(Case([7, 9]), gen)
    unweighted = dataclasses.replace(perms[0], row_weights=None)
    combine = world.combines[0]
    with pytest.raises(ValueError, match="start_backward needs the rows' routing weights"):
        combine.start_backward(torch.randn(7, D_MODEL, generator=gen), unweighted, layouts[0])
    received = sum(layouts[0].tokens_per_local_expert)
    tables = world.tables(counts, perms, received)[0]
    h = torch.randn(received, FFN, generator=gen)
    sources = (torch.zeros(2, combine.max_tokens * TOP_K, dtype=torch.int32),
               torch.zeros(2, combine.max_tokens * TOP_K))
    with pytest.raises(ValueError, match="start_by_token needs the rows' routing weights"):
        combine.start_by_token(h, torch.randn(LOCAL, FFN, D_MODEL, generator=gen), tables, sources, unweighted)
