"""The fused MoE dispatch + first expert GEMM on a simulated world (every rank in one process, interpreter on CPU).

Each rank routes its own tokens (random logits, optionally biased to skew the routing), permutes them, and the
all-gathered counts give every rank its ExpertLayout. Every rank pushes its rows (start), then every owner runs
the grouped GEMM (finish); the received rows and h must equal the bulk path's all-to-all + regroup and
silu(x @ w1[e]) * (x @ w3[e]) computed in float64, w1 and w3 the column halves of each rank's w13.
"""

from __future__ import annotations

import os

import pytest
import torch
import triton
import triton.language as tl

from fused_dlrm.dist.symmetric import SimulatedWorld
from fused_dlrm.kernels.peer_flags import PeerWaitTimeout
from moe.expert_layout import build_expert_layout, dispatch_tables, expert_rows_reference
from moe.kernels import fused_dispatch as fd
from moe.kernels.fused_dispatch import FusedDispatch, dispatch_reference, gated_gemm_reference, gemm_config
from moe.permute import permutation, unpermute
from moe.routing import route
from sm90 import compile_for_sm90

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs in the Triton interpreter")

D_MODEL, FFN = 40, 24  # neither a multiple of the 16-wide interpreter blocks: masked k and n edges
NEVER = -30.0  # a logit bias that keeps an expert out of every token's top k


class World:
    """`world` ranks of FusedDispatch over one SimulatedWorld, with their local experts' w13 = [w1 | w3]."""

    def __init__(self, world: int, local: int, block_m: int = 8, num_programs: int = 3, spin_limit: int = 50,
                 seed: int = 0, backward_tile_rows: int = gemm_config(torch.device("cpu"), torch.float32,
                                                                      backward=True).block_m,
                 max_tokens: int | None = None, top_k: int = 1):
        """max_tokens: dispatch by token (each token once per peer), up to that many tokens per rank."""
        self.world, self.local, self.backward_tile_rows = world, local, backward_tile_rows
        gen = torch.Generator().manual_seed(seed)
        self.w13 = [torch.randn(local, D_MODEL, 2 * FFN, generator=gen) / D_MODEL ** 0.5 for _ in range(world)]
        self.dispatch = [FusedDispatch(ws, D_MODEL, FFN, local, num_programs, spin_limit, block_m, max_tokens, top_k)
                         for ws in SimulatedWorld(world).workspaces()]
        self.perms = []  # the last routed batch's permutations (dispatch by token reads their inverse)
        self.routings = []  # and routings (test_moe_fused_pipeline's dense reference reads them)
        self.row_weights = []  # and each permuted row's routing weight (which goes with its token id)

    def routed_batch(self, tokens: list[int], top_k: int, bias: list[float] | None, gen: torch.Generator,
                     capacity_factor: float | None = None, perms: list | None = None):
        """Each rank's tokens, permuted rows' tokens, all-gathered counts and layouts, from routing random logits
        (the permutations go to `perms` when given)."""
        experts = self.world * self.local
        xs, token_of_rows, per_expert, self.perms, self.routings, self.row_weights = [], [], [], [], [], []
        for n in tokens:
            x = torch.randn(n, D_MODEL, generator=gen)
            logits = torch.randn(n, experts, generator=gen) + (0 if bias is None else torch.tensor(bias))
            routing = route(logits, top_k, capacity_factor=capacity_factor)
            perm = permutation(routing.expert_ids, experts, routing.kept, routing.weights)
            xs.append(x)
            token_of_rows.append(perm.order // top_k)
            per_expert.append(perm.tokens_per_expert)
            if perms is not None:
                perms.append(perm)
            self.perms.append(perm)
            self.routings.append(routing)
            self.row_weights.append(routing.weights.reshape(-1)[perm.order].float())
        counts = torch.stack(per_expert)  # what gather_counts all-gathers
        layouts = [build_expert_layout(counts, r, self.local, tile_rows=16, owner_tile_rows=self.backward_tile_rows)
                   for r in range(self.world)]
        return xs, token_of_rows, counts, layouts

    def poison(self) -> None:
        """NaN in every receive row (by token: in every token slot, and another token's id in every id slot), so
        that a row nobody pushed shows in `received` and in h."""
        for d in self.dispatch:
            if d.by_token:
                tokens, ids, weights, _, _ = d._buffers(torch.float32)
                tokens.local.fill_(float("nan"))
                ids.local.fill_(d.max_tokens - 1)
                weights.local.fill_(float("nan"))
            else:
                d._buffers(torch.float32)[0].local.fill_(float("nan"))

    def tables(self, token_of_rows, layouts, capacity: int | None = None):
        """Every rank's DispatchTables, after reserving receive rows for these layouts (or `capacity`: the
        layer's way, which learns the rows after the launch)."""
        for d in self.dispatch:
            d.reserve(capacity or max(lay.max_recv_rows for lay in layouts))
        return [dispatch_tables(lay.counts, r, self.local, 16, self.backward_tile_rows, t.numel(), d.capacity)
                for r, (d, t, lay) in enumerate(zip(self.dispatch, token_of_rows, layouts))]

    def by_token_inputs(self, rank: int) -> dict:
        """What `start` takes besides the rows by token: the permutation's inverse and the rows' weights."""
        if not self.dispatch[0].by_token:
            return {}
        return dict(inverse=self.perms[rank].inverse, row_weights=self.row_weights[rank])

    def launch(self, xs, token_of_rows, layouts, capacity: int | None = None, own_rows: bool = True):
        """Every rank pushes, then every owner's GEMM -> (tables, epochs, [(received, h, a13)] per rank at the
        receive capacity); a13 (the products before the activation, kept for training) starts as NaN, so that a row
        the GEMM does not store shows."""
        tables = self.tables(token_of_rows, layouts, capacity)
        epochs = [d.start(x, t, tab, own_rows=own_rows, **self.by_token_inputs(r))
                  for r, (d, x, t, tab) in enumerate(zip(self.dispatch, xs, token_of_rows, tables))]
        a13s = [torch.full((d.capacity, w13.shape[2]), float("nan"), dtype=w13.dtype)
                for d, w13 in zip(self.dispatch, self.w13)]
        rows = [torch.full((d.capacity, D_MODEL), float("nan")) if d.by_token else None for d in self.dispatch]
        out = [(*d.finish(e, w13, a13_out=a13, rows_out=r), a13)
               for d, e, w13, a13, r in zip(self.dispatch, epochs, self.w13, a13s, rows)]
        return tables, epochs, out

    def step(self, xs, token_of_rows, layouts, capacity: int | None = None, own_rows: bool = True):
        """`launch`'s [(received, h, a13)] per rank, cut to the rows received."""
        _, _, out = self.launch(xs, token_of_rows, layouts, capacity, own_rows)
        return [tuple(t[:sum(lay.tokens_per_local_expert)] for t in o) for o, lay in zip(out, layouts)]


def check_step(world: World, tokens, top_k, bias, gen, poison=True):
    xs, token_of_rows, counts, layouts = world.routed_batch(tokens, top_k, bias, gen)
    if poison and world.dispatch[0].capacity:
        world.poison()
    got = world.step(xs, token_of_rows, layouts)
    for owner, (received, h, a13) in enumerate(got):
        want_rows = dispatch_reference(xs, token_of_rows, counts, owner, world.local)
        sizes = layouts[owner].tokens_per_local_expert
        assert received.shape == want_rows.shape
        torch.testing.assert_close(received, want_rows, rtol=0, atol=0, msg=lambda m: f"rank {owner} rows: {m}")
        check_h(world, owner, h, (xs, token_of_rows, counts, layouts))
        w13 = world.w13[owner].double()
        want_a13 = torch.cat([x @ w13[e] for e, x in enumerate(torch.split(want_rows.double(), sizes))])
        scale = want_a13.abs().max().item() if want_a13.numel() else 0.0
        torch.testing.assert_close(a13.double(), want_a13, rtol=1e-5, atol=1e-5 * scale,
                                   msg=lambda m: f"rank {owner} a13: {m}")
    # Every rank's epoch, on its host and its device, is the same (whatever each rank sent and received).
    assert len({n for d in world.dispatch for n in (d.ws.epoch("moe_dispatch"), int(d._epoch_done))}) == 1
    return counts


def check_h(world: World, owner: int, h: torch.Tensor, batch) -> None:
    """h of `owner` (its received rows) is silu(x @ w1[e]) * (x @ w3[e]) of the bulk dispatch's rows of `batch`
    (routed_batch's), computed in float64."""
    xs, token_of_rows, counts, layouts = batch
    want_rows = dispatch_reference(xs, token_of_rows, counts, owner, world.local)
    want_h = gated_gemm_reference(want_rows.double(), layouts[owner].tokens_per_local_expert,
                                  world.w13[owner].double())
    assert h.shape == want_h.shape
    scale = want_h.abs().max().item() if want_h.numel() else 0.0
    torch.testing.assert_close(h.double(), want_h, rtol=1e-5, atol=1e-5 * scale, msg=lambda m: f"rank {owner} h: {m}")


# name, world, local experts, tokens per rank, top k, logit bias (by global expert), rows per flag
SCENARIOS = [
    ("balanced", 2, 2, [13, 9], 2, None, 8),
    ("skewed: most rows to expert 1", 2, 2, [14, 11], 2, [0, 8, 0, 0], 16),
    ("rank 1 without tokens", 2, 3, [17, 0], 3, None, 8),
    ("rank 0 receives nothing", 2, 2, [10, 12], 2, [NEVER, NEVER, 0, 0], 8),
    ("4 ranks, expert 2 idle, uneven", 4, 2, [9, 0, 14, 6], 2, [0, 0, NEVER, 0, 0, 0, 0, 0], 8),
    ("4 ranks, skewed, rank 3 receives nothing", 4, 1, [12, 7, 0, 15], 2, [0, 6, 0, NEVER], 32),
    ("8 ranks, skewed, expert 2 idle, rank 1 without tokens", 8, 2, [13, 0, 9, 16, 7, 11, 5, 10], 2,
     [0, 6, NEVER] + [0] * 13, 8),
    ("8 ranks, rank 6 receives nothing, rank 3 without tokens", 8, 1, [5, 17, 9, 0, 12, 3, 8, 14], 3,
     [0] * 6 + [NEVER, 0], 16),
]


def check_scenario(name, counts, world, local, perms=()):
    """The scenario did what its name says (capacity drops: seen in the permutations `perms`)."""
    per_owner = counts.view(-1, world, local).sum(dim=(0, 2))
    if "skewed" in name:
        assert counts[:, 1].sum() >= 0.4 * counts.sum(), counts
    if "idle" in name:
        assert counts[:, 2].sum() == 0, counts
    if "receives nothing" in name:
        assert per_owner[int(name.split(" receives nothing")[0][-1])] == 0, counts
    if "without tokens" in name:
        assert counts[int(name.split(" without tokens")[0][-1])].sum() == 0, counts
    if "capacity drops" in name:
        assert sum(int((p.inverse == p.order.numel()).sum()) for p in perms) > 0  # some assignments dropped


@pytest.mark.parametrize("by_token", [False, True], ids=["by row", "by token"])
@pytest.mark.parametrize("name,world,local,tokens,top_k,bias,block_m", SCENARIOS, ids=[s[0] for s in SCENARIOS])
def test_received_rows_and_h_match_the_bulk_dispatch(name, world, local, tokens, top_k, bias, block_m, by_token):
    # by token: room for 3 tokens more than the largest rank has, so that slots past a rank's tokens stay unused
    w = World(world, local, block_m, max_tokens=max(tokens) + 3 if by_token else None, top_k=top_k)
    gen = torch.Generator().manual_seed(len(name))
    for _ in range(2):  # both halves of the double buffer
        counts = check_step(w, tokens, top_k, bias, gen)
    check_scenario(name, counts, world, local)


@pytest.mark.parametrize("world,tokens", [(4, [30, 25, 0, 40]), (8, [30, 25, 0, 40, 12, 33, 0, 21])],
                         ids=["4 ranks", "8 ranks"])
@pytest.mark.parametrize("remote_first", [False, True])
def test_gemm_tiles_cover_each_expert_in_the_order_the_rows_move(remote_first, world, tokens):
    rows = 4  # rows per tile
    w = World(world, 2, backward_tile_rows=rows)
    xs, token_of_rows, counts, layouts = w.routed_batch(tokens, 2, None, torch.Generator().manual_seed(4))
    for rank, lay in enumerate(layouts):
        expert, begin, end, arrival, departure = lay.gemm_tiles
        order = departure if remote_first else arrival
        ends = lay.recv_offsets[::world][1:].tolist()  # every local expert's end row
        covered = torch.cat([torch.arange(b, min(b + rows, e)) for b, e in zip(begin.tolist(), end.tolist())])
        assert torch.equal(covered, torch.arange(lay.recv_source_rank.numel()))  # tile ids: expert by expert
        assert end.tolist() == [ends[e] for e in expert.tolist()]
        assert sorted(order.tolist()) == list(range(order.numel()))
        # Forward: rows arrive from this rank at once, then rank - 1 (which pushes here first), ...
        # backward: rows leave for rank + 1 first, this rank's own last.
        rotated = ((lay.recv_source_rank - rank - 1) % world if remote_first
                   else (rank - lay.recv_source_rank) % world)
        key = [int(rotated[begin[i]:end[i]][:rows].max()) for i in order.tolist()]
        assert key == sorted(key) and len(set(key)) > 1, key

    # Backward: every source finds the owner's tile of each of its rows from C alone.
    for source, lay in enumerate(layouts):
        for row, (owner, at) in enumerate(zip(lay.send_dest_rank.tolist(), lay.send_dest_row.tolist())):
            _, begin, end, _, _ = layouts[owner].gemm_tiles
            tile = int(((begin <= at) & (at < torch.clamp(begin + rows, max=end))).nonzero())
            assert lay.send_owner_tile[row] == tile


@pytest.mark.parametrize("world", [4, 8])
def test_consecutive_epochs_on_the_same_flags_with_changing_routing(world):
    w = World(world, 1, block_m=8, num_programs=2)
    gen = torch.Generator().manual_seed(5 + world)
    capacities = set()
    # 6 epochs: each half of the double buffer 3 times (a step costs ~14 s of CPU at 8 ranks, whatever its tokens)
    for step in range(6):
        tokens = torch.randint(0, 4 + 2 * step, (world,), generator=gen).tolist()  # grows: so does the capacity
        bias = (torch.randn(world, generator=gen) * 3).tolist()
        check_step(w, tokens, 2, bias, gen, poison=step % 3 == 0)
        capacities.add(w.dispatch[0].capacity)
    assert w.dispatch[0].ws.next_epoch("moe_dispatch") == 7
    assert len(capacities) > 1  # the receive buffer grew on the way, with fresh flags


@pytest.mark.parametrize("world", [1, 3])
def test_without_own_rows_the_push_copies_only_the_peers_rows(world):
    """own_rows=False (a forward without a backward): GEMM 1 still reads every row and computes the same h, and
    the push leaves the rows a rank keeps out of its own buffer (they stay poisoned in `received`): at world 1 it
    copies nothing."""
    w = World(world, 2, block_m=8, num_programs=2)
    gen = torch.Generator().manual_seed(21 + world)
    xs, token_of_rows, counts, layouts = w.routed_batch([11, 0, 14][:world], 2, None, gen)
    want = [tuple(t.clone() for t in out) for out in w.step(xs, token_of_rows, layouts)]  # received: a view
    w.poison()
    got = w.step(xs, token_of_rows, layouts, own_rows=False)
    for owner, ((received, h, a13), (want_received, want_h, want_a13)) in enumerate(zip(got, want)):
        torch.testing.assert_close(h, want_h, rtol=0, atol=0)
        torch.testing.assert_close(a13, want_a13, rtol=0, atol=0)
        own = layouts[owner].recv_source_rank == owner
        assert received[own].isnan().all()
        torch.testing.assert_close(received[~own], want_received[~own], rtol=0, atol=0)
    assert sum(int(lay.recv_source_rank.eq(r).sum()) for r, lay in enumerate(layouts)) > 0  # some rows were kept


def test_rows_past_the_capacity_are_neither_pushed_nor_computed():
    """The layer launches the dispatch before the host has seen the counts, at the capacity of earlier calls. When
    this call's rows do not fit, the rows below the capacity are still right, those past it are left alone, and no
    wait times out (no flag is awaited for a chunk that was not pushed); the layer then dispatches again."""
    w = World(2, 2, block_m=8)
    gen = torch.Generator().manual_seed(12)
    xs, token_of_rows, counts, layouts = w.routed_batch([20, 18], 2, None, gen)
    assert min(lay.max_recv_rows for lay in layouts) > 16
    tables = w.tables(token_of_rows, layouts, capacity=16)
    assert all(d.capacity == 16 for d in w.dispatch)
    epochs = [d.start(x, t, tab) for d, x, t, tab in zip(w.dispatch, xs, token_of_rows, tables)]
    for owner, (d, e, w13) in enumerate(zip(w.dispatch, epochs, w.w13)):
        a13 = torch.full((16, 2 * FFN), float("nan"))
        received, h = d.finish(e, w13, a13_out=a13)
        rows = dispatch_reference(xs, token_of_rows, counts, owner, w.local).double()
        lay = layouts[owner]
        assert sum(lay.tokens_per_local_expert) > 16
        want_h = gated_gemm_reference(rows, lay.tokens_per_local_expert, w13.double())[:16]
        assert torch.equal(received, rows[:16].float())
        torch.testing.assert_close(h.double(), want_h, rtol=1e-5, atol=1e-5 * want_h.abs().max().item())
        assert not a13.isnan().any()
    # The next call at a capacity that fits, on the same flags' successors (a new capacity: fresh flags).
    check_step(w, [20, 18], 2, None, gen)


def test_fp16_rows():
    # fp16 stands for the half types here: the interpreter's tl.dot mishandles bf16 (the GPU test runs bf16).
    w = World(2, 2, block_m=16)
    w.w13 = [t.half() for t in w.w13]
    gen = torch.Generator().manual_seed(6)
    xs, token_of_rows, counts, layouts = w.routed_batch([11, 8], 2, None, gen)
    xs = [x.half() for x in xs]
    for owner, (received, h, _) in enumerate(w.step(xs, token_of_rows, layouts)):
        want_rows = dispatch_reference(xs, token_of_rows, counts, owner, 2)
        want_h = gated_gemm_reference(want_rows.double(), layouts[owner].tokens_per_local_expert,
                                      w.w13[owner].double())
        assert torch.equal(received, want_rows)
        torch.testing.assert_close(h.double(), want_h, rtol=2e-2, atol=2e-2 * want_h.abs().max().item())


BACKWARD = [
    ("2 ranks, skewed, rank 1 without tokens", 2, 2, [15, 0], 2, [0, 6, 0, 0], None),
    ("4 ranks, rank 3 receives nothing, capacity drops", 4, 1, [11, 6, 0, 13], 3, [0, 0, 0, NEVER], 1.0),
    ("8 ranks, expert 1 oversubscribed, expert 2 idle, rank 5 receives nothing, rank 2 without tokens, "
     "capacity drops", 8, 2, [9, 14, 0, 7, 11, 6, 13, 8], 2, [0, 5, NEVER] + [0] * 7 + [NEVER, NEVER] + [0] * 4,
     1.0),
]


@pytest.mark.parametrize("by_token", [False, True], ids=["by row", "by token"])
@pytest.mark.parametrize("name,world,local,tokens,top_k,bias,capacity", BACKWARD, ids=[b[0] for b in BACKWARD])
def test_backward_matches_autograd_of_the_bulk_path(name, world, local, tokens, top_k, bias, capacity, by_token):
    """By token the forward's `received` (which the weight gradient reads) is GEMM 1's copy of the rows."""
    w = World(world, local, block_m=8, max_tokens=max(tokens) + 2 if by_token else None, top_k=top_k)
    gen = torch.Generator().manual_seed(len(name))
    for keep_a13 in (False, True):  # GEMM 1 recomputed, then the forward's a13; the gradient buffer reused
        perms = []
        xs, token_of_rows, counts, layouts = w.routed_batch(tokens, top_k, bias, gen, capacity, perms)
        forward = w.step(xs, token_of_rows, layouts)
        dhs = [torch.randn(h.shape, generator=gen) for _, h, _ in forward]
        for d in w.dispatch:  # poison: a gradient row nobody stores shows as NaN in dx
            if d.ws.world.buffers:
                d._grad_buffers(layouts[d.rank], torch.float32)[0].local.fill_(float("nan"))
        started = [d.start_backward(dh, received, lay, w13, a13 if keep_a13 else None)
                   for d, dh, (received, _, a13), lay, w13 in zip(w.dispatch, dhs, forward, layouts, w.w13)]
        dxs = [d.finish_backward(e, lay, p) for d, (e, _), lay, p in zip(w.dispatch, started, layouts, perms)]
        check_backward(w, (xs, token_of_rows, counts, layouts), perms, dhs,
                       {r: (dxs[r], started[r][1]) for r in range(world)})
    check_scenario(name, counts, world, local, perms)


def check_backward(w: World, batch, perms, dhs, got: dict) -> None:
    """got: rank -> (dx, dw13) of the backward of `batch` (routed_batch's, with its permutations) given each owner's
    dh, against the reference in float64: autograd through the bulk dispatch and the gated GEMM to each source's
    permuted rows, whose gradients each token sums over its kept assignments (unpermute, unit weights)."""
    xs, token_of_rows, counts, layouts = batch
    rows = [x.double()[t].requires_grad_() for x, t in zip(xs, token_of_rows)]
    w64 = [w13.double().requires_grad_() for w13 in w.w13]
    identity = [torch.arange(r.shape[0]) for r in rows]
    total = sum((gated_gemm_reference(dispatch_reference(rows, identity, counts, d, w.local),
                                      layouts[d].tokens_per_local_expert, w64[d]) * dhs[d].double()).sum()
                for d in range(w.world))
    total.backward()
    for r, (dx, dw13) in got.items():
        want_dx = unpermute(rows[r].grad, perms[r], torch.ones(xs[r].shape[0], perms[r].top_k, dtype=torch.float64))
        for value, want, what in ((dx, want_dx, "dx"), (dw13, w64[r].grad, "dw13")):
            scale = want.abs().max().item() if want.numel() else 0.0
            torch.testing.assert_close(value.double(), want, rtol=1e-5, atol=1e-5 * scale,
                                       msg=lambda m: f"rank {r} {what}: {m}")


def test_a_backward_refused_on_every_rank_takes_no_epoch():
    """`start_backward` checks its inputs before it takes the epoch: an epoch no kernel ran is never acknowledged,
    and every later backward would wait for that acknowledgement (and time out). After the refusal the same
    backward again gives the same gradients."""
    w = World(2, 2, block_m=8)
    gen = torch.Generator().manual_seed(16)
    perms = []
    xs, token_of_rows, counts, layouts = w.routed_batch([10, 12], 2, None, gen, perms=perms)
    forward = w.step(xs, token_of_rows, layouts)
    dhs = [torch.randn(h.shape, generator=gen) for _, h, _ in forward]

    def backward(bad: dict | None = None):
        for d in w.dispatch:  # poison: a gradient row nobody stores shows as NaN in dx
            d._grad_buffers(layouts[d.rank], torch.float32)[0].local.fill_(float("nan"))
        started = []
        for d, dh, (received, _, a13), lay, w13 in zip(w.dispatch, dhs, forward, layouts, w.w13):
            args = dict(dh=dh, received=received, layout=lay, w13=w13, a13=a13)
            if bad is not None:
                with pytest.raises(ValueError):
                    d.start_backward(**{**args, **bad})
            started.append(d.start_backward(**args))
        return [(d.finish_backward(e, lay, p), dw13)
                for d, (e, dw13), lay, p in zip(w.dispatch, started, layouts, perms)]

    want = backward()
    for bad in (dict(w13=w.w13[0][:, :, :-2]), dict(dh=dhs[0][:, :-1]), dict(received=forward[0][0].double())):
        got = backward(bad)
        for (dx, dw13), (want_dx, want_dw13) in zip(got, want):
            assert not dx.isnan().any() and torch.equal(dx, want_dx) and torch.equal(dw13, want_dw13)
    assert [d.ws.epoch("moe_dispatch_grad") for d in w.dispatch] == [4, 4]


@pytest.mark.parametrize("by_token", [False, True], ids=["by row", "by token"])
def test_gemm_times_out_naming_the_peer_and_chunk_when_a_source_never_pushes(by_token):
    """By token the slice is the source's first unit that did not arrive: here 0."""
    w = World(2, 2, block_m=8, max_tokens=12 if by_token else None, top_k=2)
    gen = torch.Generator().manual_seed(7)
    xs, token_of_rows, counts, layouts = w.routed_batch([10, 12], 2, None, gen)
    assert counts[1, :2].sum() > 0  # rank 1 has rows for rank 0
    epoch = w.dispatch[0].start(xs[0], token_of_rows[0], w.tables(token_of_rows, layouts)[0],
                                **w.by_token_inputs(0))  # rank 1 never pushes
    slice_ = "0" if by_token else r"\d"
    with pytest.raises(PeerWaitTimeout, match=rf"rank 0 timed out at step 1 waiting for rank 1, slice {slice_}"):
        w.dispatch[0].finish(epoch, w.w13[0])


def test_gemm_waits_for_the_one_chunk_whose_flag_is_down_and_never_for_its_own_rows():
    w = World(4, 2, block_m=8)
    gen = torch.Generator().manual_seed(9)
    xs, token_of_rows, counts, layouts = w.routed_batch([20, 15, 18, 12], 2, None, gen)
    epochs = [d.start(x, t, tab) for d, x, t, tab in zip(w.dispatch, xs, token_of_rows, w.tables(token_of_rows,
                                                                                                  layouts))]
    owner = 1
    row = int((layouts[owner].recv_source_rank != owner).nonzero().max())  # the last row from another rank
    source = int(layouts[owner].recv_source_rank[row])
    ready = w.dispatch[owner]._buffers(xs[owner].dtype)[1]
    ready.local.view(4, -1)[owner] = 0  # its own rows: the GEMM reads them from x and never waits for them
    ready.local.view(4, -1)[source, row // 8] = 0  # as if that chunk had not arrived
    with pytest.raises(PeerWaitTimeout, match=rf"rank 1 timed out at step 1 waiting for rank {source}, slice "
                                              rf"{row // 8} "):
        w.dispatch[owner].finish(epochs[owner], w.w13[owner])


def test_by_token_the_gemm_waits_for_every_unit_of_a_source_and_never_for_its_own_rows():
    """A source's last unit flag down: the owner's GEMM times out naming that source and that unit; the owner's
    own flags (never raised: its rows come from x) are not waited for."""
    w = World(4, 2, block_m=8, max_tokens=20, top_k=2)
    gen = torch.Generator().manual_seed(9)
    xs, token_of_rows, counts, layouts = w.routed_batch([20, 15, 18, 12], 2, None, gen)
    tables = w.tables(token_of_rows, layouts)
    epochs = [d.start(x, t, tab, **w.by_token_inputs(r))
              for r, (d, x, t, tab) in enumerate(zip(w.dispatch, xs, token_of_rows, tables))]
    owner, d = 1, w.dispatch[1]
    source = int(layouts[owner].recv_source_rank[layouts[owner].recv_source_rank != owner][-1])
    ready = d._buffers(xs[owner].dtype)[3].local.view(4, d.units)
    assert (ready[owner] == 0).all() and (ready[source] == 1).all()  # epoch 1: every unit of the source
    ready[source, -1] = 0
    with pytest.raises(PeerWaitTimeout, match=rf"rank 1 timed out at step 1 waiting for rank {source}, slice "
                                              rf"{d.units - 1} "):
        d.finish(epochs[owner], w.w13[owner])


@pytest.mark.parametrize("by_token", [False, True], ids=["by row", "by token"])
def test_a_launch_refused_after_begin_pushes_nothing_and_takes_no_epoch(by_token):
    """`launch` (the layer's way: `begin`, then the launches, then `end`) refuses bad GEMM inputs before it pushes
    (a push counts in the peers: flags, arrival counts), and the refused call takes no epoch, on the host nor on
    the device: the next call, on every rank, reads this epoch's half of the double buffers (its `received`, by
    token the sources' token ids and weights), not the half of the epoch before."""
    w = World(2, 2, block_m=8, max_tokens=14 if by_token else None, top_k=2)
    gen = torch.Generator().manual_seed(13)
    check_step(w, [10, 12], 2, None, gen)  # epoch 1
    xs, token_of_rows, _, layouts = w.routed_batch([10, 12], 2, None, gen)
    tables = w.tables(token_of_rows, layouts)
    other_tiles = [dispatch_tables(lay.counts, r, w.local, 16, w.backward_tile_rows * 2, t.numel(), d.capacity)
                   for r, (d, t, lay) in enumerate(zip(w.dispatch, token_of_rows, layouts))]
    flags = [d._buffers(torch.float32)[3 if by_token else 1].local.clone() for d in w.dispatch]
    refusals = [(tables, dict(a13_out=torch.empty(3, 2 * FFN)), "a13_out must be a contiguous"),
                (other_tiles, {}, "the layout cuts the owner's row tiles of 32 rows; the GEMM's tiles have 16")]
    if by_token:
        refusals.append((tables, dict(a13_out=torch.empty(w.dispatch[0].capacity, 2 * FFN)),
                         "rows_out .* comes with a13_out, both or neither"))
    for r, d in enumerate(w.dispatch):  # every rank alike, as the layer's calls are
        for tabs, bad, match in refusals:
            assert d.begin(xs[r]) == 2
            with pytest.raises(ValueError, match=match):
                d.launch(xs[r], token_of_rows[r], tabs[r], w.w13[r], **bad, **w.by_token_inputs(r))
    for d, before in zip(w.dispatch, flags):
        assert torch.equal(d._buffers(torch.float32)[3 if by_token else 1].local, before)  # nothing was pushed
        assert int(d._epoch_done) == d.ws.epoch("moe_dispatch") == 1
    counts = check_step(w, [10, 12], 2, None, gen)  # epoch 2, exact (`received` by row)
    if by_token:
        for owner, d in enumerate(w.dispatch):
            ids, weights = d.rows_by_source(2)
            source = 1 - owner
            lo = int(counts[source, :owner * w.local].sum())
            hi = lo + int(counts[source, owner * w.local:(owner + 1) * w.local].sum())
            assert hi > lo
            assert torch.equal(ids[source][lo:hi], w.perms[source].token_of_row[lo:hi].int())
            assert torch.equal(weights[source][lo:hi], w.row_weights[source][lo:hi])


def test_a_refused_finish_can_be_finished_again_and_until_then_no_call_starts():
    """`finish` refuses bad GEMM inputs after `start` pushed (the peers hold the epoch's rows): the epoch stays
    in flight, a later `start` is refused saying so (instead of taking the epoch after it, whose flags and buffer
    half would no longer be the peers'), and `finish` with good inputs completes it exactly."""
    w = World(2, 2, block_m=8)
    gen = torch.Generator().manual_seed(14)
    xs, token_of_rows, counts, layouts = w.routed_batch([10, 12], 2, None, gen)
    tables = w.tables(token_of_rows, layouts)
    w.poison()
    epochs = [d.start(x, t, tab) for d, x, t, tab in zip(w.dispatch, xs, token_of_rows, tables)]
    for d, e, w13 in zip(w.dispatch, epochs, w.w13):
        with pytest.raises(ValueError, match="w13 must be a contiguous"):
            d.finish(e, w13.double())
        with pytest.raises(RuntimeError, match=rf"rank {d.rank}: step 1's push was launched and the step never "
                                               rf"ended"):
            d.start(xs[d.rank], token_of_rows[d.rank], tables[d.rank])
        with pytest.raises(RuntimeError, match=rf"rank {d.rank}: finish\(2\), but no step 2 was started here"):
            d.finish(2, w13)
    for owner, (d, e, w13) in enumerate(zip(w.dispatch, epochs, w.w13)):
        received, h = d.finish(e, w13)
        rows = dispatch_reference(xs, token_of_rows, counts, owner, w.local)
        n = rows.shape[0]
        want_h = gated_gemm_reference(rows.double(), layouts[owner].tokens_per_local_expert, w13.double())
        assert torch.equal(received[:n], rows)
        torch.testing.assert_close(h[:n].double(), want_h, rtol=1e-5, atol=1e-5 * want_h.abs().max().item())
    check_step(w, [9, 11], 2, None, gen)  # the next epoch, in step


def test_a_launch_that_fails_after_its_push_refuses_every_later_call(monkeypatch):
    """An error past every check (here GEMM 1's launch) after the push went out: the peers hold this epoch's rows
    and this rank's device never counts it. Every later call says so, instead of waiting for flags of the wrong
    epoch or reading stale rows."""
    w = World(2, 2, block_m=8)
    xs, token_of_rows, _, layouts = w.routed_batch([10, 12], 2, None, torch.Generator().manual_seed(15))
    tables = w.tables(token_of_rows, layouts)
    d = w.dispatch[0]

    def fails(*args, **kwargs):
        raise RuntimeError("GEMM 1's launch failed")

    monkeypatch.setattr(d, "_gemm", fails)
    epoch = d.begin(xs[0])
    with pytest.raises(RuntimeError, match="GEMM 1's launch failed"):
        d.launch(xs[0], token_of_rows[0], tables[0], w.w13[0])
    assert int(w.dispatch[1]._buffers(torch.float32)[1].local.max()) == epoch  # the push reached the peer
    for _ in range(2):
        with pytest.raises(RuntimeError, match=r"rank 0: step 1's push was launched and the step never ended .* "
                                               r"make a new dispatch"):
            d.begin(xs[0])


def test_by_token_each_token_crosses_once_per_peer_and_only_to_peers_it_chose():
    """The token buffer of every owner holds, at [source, token], exactly the tokens of that source that chose one
    of the owner's experts (NaN elsewhere: nothing else was stored), and its id buffer the token of each of the
    source's permuted rows bound there, with its routing weight; `rows_by_source` gives the owner both."""
    w = World(4, 2, block_m=8, max_tokens=24, top_k=3)
    gen = torch.Generator().manual_seed(12)
    xs, token_of_rows, counts, layouts = w.routed_batch([21, 0, 24, 9], 3, [0, 4, NEVER, 0, 0, 0, 0, 0], gen)
    w.tables(token_of_rows, layouts)
    w.poison()
    w.step(xs, token_of_rows, layouts)
    for owner, d in enumerate(w.dispatch):
        tokens = d._buffers(torch.float32)[0].local
        half = 1  # epoch 1's half of the double buffer
        tokens = tokens.view(2, w.world, d.max_tokens, D_MODEL)[half]
        ids, weights = d.rows_by_source(1)
        for source, (x, perm) in enumerate(zip(xs, w.perms)):
            if source == owner:
                assert tokens[source].isnan().all()  # own rows are read from x: never stored
                continue
            lo = int(counts[source, :owner * w.local].sum())
            hi = lo + int(counts[source, owner * w.local:(owner + 1) * w.local].sum())
            chose = torch.zeros(d.max_tokens, dtype=torch.bool)
            chose[token_of_rows[source][lo:hi]] = True
            assert torch.equal(tokens[source][:x.shape[0]][chose[:x.shape[0]]], x[chose[:x.shape[0]]])
            assert tokens[source][~chose].isnan().all()
            assert torch.equal(ids[source][lo:hi], token_of_rows[source][lo:hi].int())
            assert torch.equal(weights[source][lo:hi], w.row_weights[source][lo:hi])
            assert weights[source][:lo].isnan().all() and weights[source][hi:].isnan().all()


def test_push_times_out_when_the_owner_never_finished_the_previous_epoch():
    w = World(2, 2, block_m=8)
    gen = torch.Generator().manual_seed(8)
    xs, token_of_rows, _, layouts = w.routed_batch([10, 12], 2, None, gen)
    w.step(xs, token_of_rows, layouts)
    tables = w.tables(token_of_rows, layouts)
    w.dispatch[1].start(xs[1], token_of_rows[1], tables[1])  # epoch 2 of rank 1 is never finished
    w.dispatch[0].finish(w.dispatch[0].start(xs[0], token_of_rows[0], tables[0]), w.w13[0])
    epoch = w.dispatch[0].start(xs[0], token_of_rows[0], tables[0])  # rank 1 still holds epoch 2's rows
    with pytest.raises(PeerWaitTimeout, match=r"rank 0 timed out at step 3 waiting for rank 1 to release"):
        w.dispatch[0].finish(epoch, w.w13[0])


@pytest.mark.parametrize("calls_late", [1, 2])
@pytest.mark.parametrize("by_token", [False, True], ids=["by row", "by token"])
def test_a_late_peer_finishes_its_calls_exactly_and_the_next_call_is_exact(by_token, calls_late):
    """Rank 1 comes late to calls 2 (and 3): rank 0's GEMM 1 of call 2 gives up waiting for its rows, and rank 0
    acknowledges call 2 all the same (its reads are over). So rank 1, arriving, finishes call 2 exactly. Two calls
    late, rank 0's push of call 3 gives up waiting for rank 1 to release its buffer: it stores nothing and raises
    no flag, so rank 1's call 3 times out naming rank 0 instead of reading its buffer's rows of call 1 as rank 0's.
    Then every call is exact on every rank. (Once, a rank skipped its acknowledgement while an error was recorded:
    every later push into it timed out, and raised its flags all the same over rows it never stored: by token the
    owner returned rows of the call before last, silently, one call in two.)"""
    w = World(2, 2, block_m=8, max_tokens=14 if by_token else None, top_k=2)
    gen = torch.Generator().manual_seed(17)
    check_step(w, [10, 12], 2, None, gen)
    batches, inputs = [], []
    for _ in range(calls_late):
        batches.append(w.routed_batch([10, 12], 2, None, gen))
        inputs.append([w.by_token_inputs(r) for r in range(2)])
        counts = batches[-1][2]
        assert counts[0, 2:].sum() > 0 and counts[1, :2].sum() > 0  # each rank has rows for the other
    capacity = max(lay.max_recv_rows for batch in batches for lay in batch[3])  # one for all: rank 1 is behind
    calls = [(batch, w.tables(batch[1], batch[3], capacity), i) for batch, i in zip(batches, inputs)]
    w.poison()

    def call(rank: int, step: int) -> torch.Tensor:
        (xs, token_of_rows, _, _), tables, inputs = calls[step - 2]
        d = w.dispatch[rank]
        return d.finish(d.start(xs[rank], token_of_rows[rank], tables[rank], **inputs[rank]), w.w13[rank])[1]

    with pytest.raises(PeerWaitTimeout, match=r"rank 0 timed out at step 2 waiting for rank 1, slice"):
        call(0, 2)
    if calls_late == 2:
        with pytest.raises(PeerWaitTimeout, match=r"rank 0 timed out at step 3 waiting for rank 1 to release"):
            call(0, 3)
    batch = calls[0][0]
    check_h(w, 1, call(1, 2)[:sum(batch[3][1].tokens_per_local_expert)], batch)
    if calls_late == 2:
        with pytest.raises(PeerWaitTimeout, match=r"rank 1 timed out at step 3 waiting for rank 0, slice"):
            call(1, 3)
    for _ in range(2):
        check_step(w, [10, 12], 2, None, gen)


def test_backward_a_peer_late_by_two_calls_times_out_rather_than_take_rows_never_stored():
    """Rank 1 comes late to backward calls 2 and 3: rank 0's sum of call 2 gives up waiting for rank 1's rows (and
    acknowledges the call all the same), so rank 1 finishes call 2 exactly. Rank 0's GEMM of call 3 gives up
    waiting for rank 1 to release its gradient buffer: it stores nothing and raises no flag, so rank 1's sum of
    call 3 times out naming rank 0 instead of reading rank 0's rows of call 2 as call 3's. Then the next backward
    is exact on both ranks."""
    w = World(2, 2, block_m=8)
    gen = torch.Generator().manual_seed(19)
    perms = []
    batch = w.routed_batch([10, 12], 2, None, gen, perms=perms)
    counts, layouts = batch[2], batch[3]
    assert counts[0, 2:].sum() > 0 and counts[1, :2].sum() > 0  # rows both ways
    forward = w.step(*batch[:2], layouts)
    calls = {step: [torch.randn(h.shape, generator=gen) for _, h, _ in forward] for step in range(1, 5)}

    def start(rank: int, step: int):
        d, (received, _, a13) = w.dispatch[rank], forward[rank]
        return d.start_backward(calls[step][rank], received, layouts[rank], w.w13[rank], a13)

    def finish(rank: int, started):
        return w.dispatch[rank].finish_backward(started[0], layouts[rank], perms[rank]), started[1]

    def every_rank(step: int):
        started = [start(r, step) for r in range(2)]
        check_backward(w, batch, perms, calls[step], {r: finish(r, s) for r, s in enumerate(started)})

    every_rank(1)
    for step, waited in ((2, "rank 1, slice"), (3, "rank 1 to release")):  # rank 0 alone
        with pytest.raises(PeerWaitTimeout, match=rf"rank 0 timed out at step {step} waiting for {waited}"):
            finish(0, start(0, step))
    check_backward(w, batch, perms, calls[2], {1: finish(1, start(1, 2))})
    with pytest.raises(PeerWaitTimeout, match=r"rank 1 timed out at step 3 waiting for rank 0, slice"):
        finish(1, start(1, 3))
    every_rank(4)


def test_gemm_1_leaves_sms_to_the_push_and_the_backward_gemm_takes_them_all():
    """On GPUs (a push stream, 132 SMs): GEMM 1 waits for pushes, whose SMs it must leave free (or two GPUs could
    each wait on the other's push), and its helpers queue behind the push for them; the backward GEMM waits for
    none. Never more programs than tiles; no helpers without a push stream (the interpreter)."""
    d = World(2, 2, block_m=8).dispatch[0]
    assert d._helper_programs(10_000, 4) == 0
    d._push_stream, d._sms = object(), 132  # as on an H200
    assert d._gemm_programs(10_000, beside_push=True) == 132 - fd.PUSH_SMS
    assert d._helper_programs(10_000, 132 - fd.PUSH_SMS) == fd.PUSH_SMS
    assert d._helper_programs(120, 116) == 4 and d._helper_programs(50, 50) == 0
    assert d._gemm_programs(10_000, beside_push=False) == 132
    assert d._gemm_programs(40, beside_push=False) == 40


def test_the_receive_capacity_grows_with_room_to_spare_and_never_shrinks():
    """Steps of an eighth of a power of two (h and a13 are allocated at the capacity: a power of two could double
    them), a multiple of the chunk (8 rows here), never below it, never smaller than before. Given the call's
    total rows, a capacity that grows takes a quarter more than asked, up to that total, so a creeping maximum
    re-allocates rarely."""
    d = World(2, 2, block_m=8).dispatch[0]
    for rows, want in ((3, 8), (80, 80), (81, 88), (16_390, 18_432), (100, 18_432)):
        d.reserve(rows)
        assert d.capacity == want, rows
    d = World(2, 2, block_m=8).dispatch[0]
    for rows, total, want in ((80, 200, 104), (90, 200, 104), (104, 200, 104), (150, 200, 192), (199, 200, 208),
                              (210, 210, 224), (5, 5, 224)):
        d.reserve(rows, total)
        assert d.capacity == want, (rows, total)
        assert d.capacity % 8 == 0 and d.capacity >= rows


def test_weights_must_be_one_contiguous_w13():
    """Refused at `finish`, which may then be called again (the epoch stays in flight until it is finished)."""
    w = World(2, 2)
    xs, token_of_rows, _, layouts = w.routed_batch([6, 5], 2, None, torch.Generator().manual_seed(10))
    tables = w.tables(token_of_rows, layouts)[0]
    epoch = w.dispatch[0].start(xs[0], token_of_rows[0], tables)
    halves = torch.randn(2, D_MODEL, 4 * FFN)[:, :, :2 * FFN]  # the right shape, but every row strided
    for bad in (w.w13[0][:, :, :FFN], halves, w.w13[0].double()):
        with pytest.raises(ValueError, match="w13 must be a contiguous"):
            w.dispatch[0].finish(epoch, bad)
    # Contiguous and of the right shape, but starting 4 bytes off a 16-byte boundary: the backward's TMA could not
    # read it, so the forward refuses it.
    shifted = torch.empty(w.w13[0].numel() + 1)[1:].view(w.w13[0].shape).copy_(w.w13[0])
    with pytest.raises(ValueError, match="w13 .* through TMA"):
        w.dispatch[0].finish(epoch, shifted)


COMPILE_FOR_SM90 = """
from moe.kernels import fused_dispatch as fd

tables = {n: "*i64" for n in ("token_ptr", "dest_row_ptr", "counts_ptr", "rows_ptrs", "ready_ptrs", "tiles_ptr",
                              "row_tiles_ptr", "source_ptr", "source_row_ptr", "grad_ptrs", "inverse_ptr",
                              "tokens_ptrs", "ids_ptrs", "weights_ptrs", "x_address_ptr")}
tables["row_weight_ptr"] = "*fp32"
flags = {n: "*i32" for n in ("dest_order_ptr", "ack_ptr", "error_ptr", "ready_ptr", "next_ptr", "epoch_ptr",
                             "ids_ptr")}
by_row = dict(BY_TOKEN=False, WORLD=2, MAX_TOKENS=1, MAX_ROWS=1, UNITS_P2=1)
by_token = dict(BY_TOKEN=True, WORLD=2, MAX_TOKENS=8192, MAX_ROWS=49152, UNITS_P2=128)
import torch
cuda = torch.device("cuda")
for dtype, torch_dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16), ("fp32", torch.float32)):
    data = {n: "*" + dtype for n in ("rows_ptr", "w13_ptr", "h_ptr", "a13_ptr", "rows_out_ptr")}
    x_dtype = {"bf16": tl.bfloat16, "fp16": tl.float16, "fp32": tl.float32}[dtype]
    ptrs = {**tables, **flags, **data}
    precision = "tf32" if dtype == "fp32" else None  # as dot_precision gives them in training
    for backward in (False, True):  # as gemm_config gives them: shared memory must fit
        c = fd.gemm_config(cuda, torch_dtype, backward)
        gemm = dict(D=2048, FFN=1408, BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k, PRECISION=precision)
        if backward:  # its operands come through TMA descriptors (moe.kernels.weight_tiles)
            descriptors = {"da13_desc": f"tensordesc<{dtype}[{c.block_m}, {c.block_k}]>",
                           "w13_desc": f"tensordesc<{dtype}[1, {c.block_n}, {c.block_k}]>"}
            build(fd._gated_gemm_backward_kernel, {**ptrs, **descriptors}, dict(WORLD=2, **gemm), c.num_warps,
                  c.num_stages)
        else:
            for store_a13 in (False, True):
                for mode in (by_row, by_token):
                    build(fd._gated_gemm_kernel, ptrs, dict(CHUNK=64, STORE_A13=store_a13, **mode, **gemm),
                          c.num_warps, c.num_stages)
    for own_rows in (False, True):
        build(fd._push_rows_kernel, ptrs, dict(D=2048, CHUNK=64, BLOCK_D=128, WORLD=2, L=32, W_P2=2, L_P2=32, E_P2=64,
                                               OWN_ROWS=own_rows, X_DTYPE=x_dtype), 4, 3)
    build(fd._push_tokens_kernel, ptrs, dict(D=2048, MAX_TOKENS=8192, MAX_ROWS=49152, CHUNK=64, IDS=512, UNITS=128,
                                             BLOCK_D=128, WORLD=2, L=32, TOP_K=6, K_P2=8, E_P2=64, X_DTYPE=x_dtype),
          4, 3)
"""


def test_kernels_compile_for_sm90():
    """What only the GPU compiler enforces (types, tl.dot shapes and dtypes, shared memory of the launch
    configurations), checked without a GPU: compile for sm_90 in a process without the interpreter."""
    compile_for_sm90(COMPILE_FOR_SM90)


DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # of the kernel's tensors (CPU: interpreter)


@triton.jit
def _unit_rows_kernel(counts_ptr, out_ptr, rank, chunks, CHUNK: tl.constexpr, WORLD: tl.constexpr, L: tl.constexpr,
                      W_P2: tl.constexpr, L_P2: tl.constexpr, E_P2: tl.constexpr):
    """The push's `_unit_rows` of unit (owner program_id(0), chunk program_id(1)) into out[owner, chunk, 2]."""
    dest, c = tl.program_id(0), tl.program_id(1)
    lo, hi = fd._unit_rows(counts_ptr, rank, dest, c, CHUNK, WORLD, L, W_P2, L_P2, E_P2)
    tl.store(out_ptr + (dest * chunks + c) * 2, lo)
    tl.store(out_ptr + (dest * chunks + c) * 2 + 1, hi)


@pytest.mark.parametrize("world,local", [(1, 3), (2, 4), (3, 2), (4, 2)])
def test_push_units_count_the_rows_before_each_owner_and_chunk(world, local):
    """The push's units: unit (owner d, chunk c) is this rank's permuted rows from those for owners before d plus
    its rows for d below receive row c * chunk, to those below row (c + 1) * chunk, counted row by row here."""
    gen = torch.Generator().manual_seed(world * 10 + local)
    p2 = triton.next_power_of_2
    for trial in range(3):  # random, a rank without tokens, skewed; each with an expert without rows
        # Sizes give several chunks of 16 and 64 rows per owner while keeping the interpreter's grid small (every
        # program is simulated: counts of 300 and 3,000 took minutes; a hot expert of 600 rows per rank made most
        # of this test's programs).
        counts = torch.randint(0, 80, (world, world * local), generator=gen)
        counts[:, trial % (world * local)] = 0  # an expert without rows
        if trial == 1:
            counts[-1] = 0  # a rank without tokens
        if trial == 2:
            counts[:, 0] = 200  # skewed
        max_recv_rows = int(counts.view(world, world, local).sum(dim=(0, 2)).max())
        for rank in range(world):
            # Every permuted row's owner and receive row, from the layout's row-by-row reference.
            owner, row = (torch.tensor(t, dtype=torch.int64) for t in expert_rows_reference(counts, rank, local,
                                                                                           (16, 16))[:2])
            for chunk in (16, 64):
                chunks = -(-max_recv_rows // chunk)
                d, c = torch.arange(world)[:, None, None], torch.arange(chunks + 1)[None, :, None]
                before = ((owner < d) | ((owner == d) & (row < c * chunk))).sum(dim=2)
                got = torch.full((world, chunks, 2), -1, dtype=torch.int64, device=DEVICE)
                _unit_rows_kernel[(world, chunks)](counts.to(DEVICE), got, rank, chunks, CHUNK=chunk, WORLD=world,
                                                   L=local, W_P2=p2(world), L_P2=p2(local), E_P2=p2(world * local))
                assert torch.equal(got.cpu(), torch.stack([before[:, :-1], before[:, 1:]], dim=2))


def test_bad_rows_or_tables_are_refused_before_the_epoch_is_counted():
    """The device counts the forward's epochs as the host does; a refused call must count on neither, or every later
    call would wait for flags of the wrong epoch."""
    w = World(2, 2, block_m=8)
    gen = torch.Generator().manual_seed(12)
    xs, token_of_rows, _, layouts = w.routed_batch([6, 5], 2, None, gen)
    tables = w.tables(token_of_rows, layouts)
    d = w.dispatch[0]
    for x, tab, match in ((xs[0][:, :-1], tables[0], "x must be"), (xs[0].double(), tables[0], "x must be"),
                          (xs[0], tables[1], "do not describe this rank")):
        with pytest.raises(ValueError, match=match):
            d.start(x, token_of_rows[0], tab)
    assert int(d._epoch_done) == 0 and d.ws.next_epoch("moe_dispatch") == 1
    w = World(2, 2, block_m=8, max_tokens=8, top_k=2)  # by token: the permutation's inverse and the rows' weights
    xs, token_of_rows, _, layouts = w.routed_batch([6, 5], 2, None, gen)
    tables, d = w.tables(token_of_rows, layouts), w.dispatch[0]
    good = w.by_token_inputs(0)
    for bad, match in ((dict(good, inverse=None), "needs the permutation's inverse"),
                       (dict(good, row_weights=good["row_weights"].double()), "needs row_weights"),
                       (dict(good, row_weights=None), "needs row_weights")):
        with pytest.raises(ValueError, match=match):
            d.start(xs[0], token_of_rows[0], tables[0], **bad)
    assert int(d._epoch_done) == 0 and d.ws.next_epoch("moe_dispatch") == 1
