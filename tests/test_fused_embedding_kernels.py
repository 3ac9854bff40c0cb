"""The fused embedding all-to-all on a simulated world: every rank's kernels in one process (interpreter on CPU).

Each rank owns some tables (or column shards of tables); its producer kernel stores pooled tiles into every rank's symmetric output, the wait
kernels check the flags, and the outputs must equal the pure-torch pooled lookup of the whole global batch sliced
per rank. Backward pushes gradient columns to the owners, whose tables must end up as the bulk path's.
"""

from __future__ import annotations

import gc
import os
import weakref

import pytest
import torch
from torchrec import EmbeddingBagConfig, PoolingType

from fused_dlrm.dist.symmetric import SimulatedWorld
from fused_dlrm.kernels.pairwise_interaction import (launch_backward, num_pairs, offered_gradient_push,
                                                     pairwise_interaction, pairwise_interaction_reference, push_block)
from fused_dlrm.kernels.peer_flags import PeerWaitTimeout
from fused_dlrm.kernels.peer_tiles import plan_peer_tiles
from fused_dlrm.kernels.pooled_embedding import FeatureTable, PooledEmbeddingLaunch, pooled_embedding_reference
from fused_dlrm.sparse.fused_all_to_all import FusedPooledAllToAll, GradientPush
from fused_dlrm.sparse.input_dist import OwnedBags
from fused_dlrm.sparse.lookup import PooledEmbeddingLookup, init_table
from fused_dlrm.sparse.optimizer import EmbeddingOptimizerConfig
from fused_dlrm.sparse.plan import plan_sharding
from fused_dlrm.sparse.row_wise import RowBlockSum, RowBuckets
from fused_dlrm.sparse.sharded_ebc import shard_weight
from sm90 import compile_for_sm90
from world import run_world

# The simulated world is CPU tensors: it needs the interpreter (set by conftest.py where there is no GPU).
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs in the Triton interpreter")

DTYPES = {"fp32": (torch.float32, 1e-5), "fp16": (torch.float16, 1e-3), "bf16": (torch.bfloat16, 1e-2)}


def make_tables(dims, rows, mean_every=3):
    return [EmbeddingBagConfig(name=f"t{i}", embedding_dim=d, num_embeddings=r, feature_names=[f"f{i}"],
                               pooling=PoolingType.MEAN if i % mean_every == 2 else PoolingType.SUM)
            for i, (d, r) in enumerate(zip(dims, rows))]


def random_bags(tables, batch_sizes, weighted, gen):
    """Per feature: lengths over the global batch (empty bags and one long, skewed bag) and Zipf-ish values."""
    g = sum(batch_sizes)
    lengths = torch.randint(0, 4, (len(tables), g), generator=gen)
    lengths[:, 0] = 0
    lengths[0, g - 1] = 13
    values = [(torch.rand(int(l.sum()), generator=gen) ** 3 * t.num_embeddings).long() for t, l in zip(tables, lengths)]
    weights = [torch.rand(v.numel(), generator=gen) for v in values] if weighted else None
    return lengths, values, weights


class World:
    """W ranks of the fused exchange, sharing one SimulatedWorld; column_shards and row_shards as plan_sharding
    takes them. With row blocks, `forward` returns each rank's real rows (the blocks' parts summed by
    RowBlockSum, as ShardedEmbeddingBagCollection does) and `backward` takes their gradients."""

    def __init__(self, tables, world_size, dtype=torch.float32, optimizer="rowwise_adagrad", num_programs=3,
                 column_shards=1, device="cpu", row_shards=1):
        """device: "cpu" (the interpreter) or "cuda" (every rank's kernels compiled, on one GPU)."""
        self.tables, self.world_size, self.optimizer = tables, world_size, optimizer
        self.column_shards, self.device = column_shards, torch.device(device)
        self.plan = plan_sharding(tables, world_size, column_shards, row_shards)
        slices = self.plan.feature_slices(tables)
        self.features_of_rank = [[s.feature for s in mine] for mine in slices]
        self.keys = [f for t in tables for f in t.feature_names]
        columns = self.plan.row_wise_columns(tables)
        self.buckets = RowBuckets.of(self.keys, self.plan.row_blocks(tables), [c.feature for c in columns if c.mean],
                                     torch.device("cpu")) if columns else None
        self.row_sum = RowBlockSum(sum(t.embedding_dim * len(t.feature_names) for t in tables), columns) \
            if columns else None
        self.weights = {t.name: init_table(t, i, torch.device("cpu")).to(dtype).to(self.device)
                        for i, t in enumerate(tables)}
        self.shards = {s.name: shard_weight(self.weights[s.table], s) for s in self.plan.shards}
        cfg = EmbeddingOptimizerConfig(optimizer, lr=0.1)
        self.lookups, self.exchanges = [], []
        for ws in SimulatedWorld(world_size, self.device).workspaces():
            owned = self.plan.shard_configs(tables, ws.rank)
            lookup = PooledEmbeddingLookup(owned, {t.name: self.shards[t.name] for t in owned}, cfg, ws.device)
            self.lookups.append(lookup)
            self.exchanges.append(FusedPooledAllToAll(lookup, slices, ws, num_programs=num_programs, spin_limit=50))
        self._wide = None  # the last forward's wide rows and real rows, for backward (row blocks)

    def table(self, name):
        """A table as trained: its shards' columns side by side, or its row blocks one under the other."""
        mine = [s for s in self.plan.shards if s.table == name]
        return torch.cat([self.shards[s.name] for s in mine], dim=0 if mine[0].rows is not None else 1)

    def owned_bags(self, rank, lengths, values, weights, batch_sizes) -> OwnedBags:
        keys, uncut = self.keys, lengths
        if self.buckets is not None:  # the global batch cut by row block: each block's bags over all samples
            cut_values, cut_lengths, cut_weights = self.buckets.cut(
                torch.cat(values), lengths, None if weights is None else torch.cat(weights))
            ends = torch.cumsum(cut_lengths.sum(1), 0).tolist()
            values = list(cut_values.tensor_split(ends[:-1]))
            weights = None if weights is None else list(cut_weights.tensor_split(ends[:-1]))
            lengths, keys = cut_lengths, self.buckets.keys
        idx = [keys.index(f) for f in self.features_of_rank[rank]]
        vals = [values[i] for i in idx]
        offsets = [0]
        for v in vals:
            offsets.append(offsets[-1] + v.numel())
        on = lambda t: t.to(self.device)
        bags = OwnedBags(features=self.features_of_rank[rank], values=on(torch.cat(vals) if vals else torch.zeros(0, dtype=torch.long)),
                         lengths=on(lengths[idx].reshape(len(idx), lengths.shape[1])),
                         weights=None if weights is None else on(torch.cat([weights[i] for i in idx]) if idx else torch.zeros(0)),
                         feature_value_offsets=offsets, batch_sizes=list(batch_sizes))
        if self.buckets is not None:  # rank's own samples' bag sizes (uncut lengths)
            start = sum(batch_sizes[:rank])
            divisors = self.buckets.pooling_divisors(uncut[:, start:start + batch_sizes[rank]])
            bags.pooling_divisors = None if divisors is None else on(divisors)
        return bags

    def forward(self, bags):
        epochs = [ex.start(b) for ex, b in zip(self.exchanges, bags)]  # every producer first
        outs = [ex.finish(b, e).clone() for ex, b, e in zip(self.exchanges, bags, epochs)]
        if self.row_sum is None:
            return outs
        wide = [o.requires_grad_() for o in outs]
        real = [self.row_sum(w, b.pooling_divisors) for w, b in zip(wide, bags)]
        self._wide = (wide, real)
        return [r.detach() for r in real]

    def backward(self, bags, grads, scale=1.0):
        if self.row_sum is not None:  # each block's part receives its sample's gradient (a mean's divided)
            wide, real = self._wide
            grads = torch.autograd.grad(real, wide, grads)
        epochs = [ex.start_backward(b, g, scale) for ex, b, g in zip(self.exchanges, bags, grads)]
        for ex, b, e in zip(self.exchanges, bags, epochs):
            ex.finish_backward(b, e)


def expected_outputs(world, lengths, values, weights, batch_sizes):
    full = torch.cat([pooled_embedding_reference(world.table(t.name), values[i], lengths[i],
                                                 None if weights is None else weights[i],
                                                 t.pooling == PoolingType.MEAN)
                      for i, t in enumerate(world.tables)], dim=1)
    starts = [sum(batch_sizes[:r]) for r in range(len(batch_sizes) + 1)]
    return [full[starts[r]:starts[r + 1]] for r in range(len(batch_sizes))]


@pytest.mark.parametrize("world_size,batch_sizes", [(2, [5, 3]), (3, [4, 0, 6])])
@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("weighted", [False, True])
def test_forward_matches_reference(world_size, batch_sizes, dtype, weighted):
    torch_dtype, tol = DTYPES[dtype]
    tables = make_tables([4, 8, 3, 16, 5], [10, 50, 7, 200, 33])  # uneven dims; f2 mean-pooled
    world = World(tables, world_size, torch_dtype)
    gen = torch.Generator().manual_seed(0)
    for _ in range(2):
        lengths, values, weights = random_bags(tables, batch_sizes, weighted, gen)
        bags = [world.owned_bags(r, lengths, values, weights, batch_sizes) for r in range(world_size)]
        for ex in world.exchanges:  # poison: any element the kernels do not write stays NaN
            ex.ws.buffer("pooled", 2 * max(batch_sizes) * ex.row_len, torch.float32).local.fill_(float("nan"))
        got = world.forward(bags)
        for g, e in zip(got, expected_outputs(world, lengths, values, weights, batch_sizes)):
            torch.testing.assert_close(g, e, rtol=tol, atol=tol)


def _pool_rows_past_2_31_elements(rank: int, world: int, index_dtype: torch.dtype) -> None:
    rows, dim = 17_000_001, 128  # rows x dim > 2**31: 4.35 GB of address space, only the rows written are touched
    table = torch.empty(rows, dim, dtype=torch.bfloat16)
    table[rows - 2], table[5] = 1.0, 3.0
    features = FeatureTable([table], [0], [False], torch.device("cpu"))
    plan = plan_peer_tiles(0, [(0, 2)], [(0, 1)], features.block_rows, 2, torch.device("cpu"))
    launch = PooledEmbeddingLaunch(features, plan, 2, torch.zeros(1, dtype=torch.int64), dim)
    out = torch.full((2, dim), float("nan"))
    launch(torch.tensor([rows - 2, 5, rows - 2], dtype=index_dtype), torch.tensor([0, 1, 3]), None,
           torch.tensor([out.data_ptr()]))
    torch.testing.assert_close(out, torch.tensor([[1.0], [4.0]]).expand(2, dim))


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_rows_past_2_31_elements_of_a_table_with_int32_indices(index_dtype):
    """A row's address is index x dim in 64 bits whatever the indices' dtype: with int32 indices the product wrapped
    past 2**31 elements (a 17M x 128 table) and the lookup read before the table (a crash here, another allocation
    on a GPU). In a process of its own, where a bad read kills only that process."""
    run_world(1, _pool_rows_past_2_31_elements, index_dtype, timeout=300)



@pytest.mark.parametrize("optimizer,scale", [("sgd", 1.0), ("rowwise_adagrad", 1.0), ("sgd", 1 / 3),
                                             ("rowwise_adagrad", 1 / 3)])
def test_backward_updates_tables_like_the_bulk_path(optimizer, scale):
    """scale 1/3: torchrec's division of the gradient by the world size, applied by the push."""
    tables = make_tables([4, 8, 3, 6], [10, 20, 7, 9])
    world = World(tables, 3, optimizer=optimizer)
    train_like_one_owner(world, [3, 4, 2], steps=3, gen=torch.Generator().manual_seed(1), check_outputs=False,
                         scale=scale)


def train_like_one_owner(world, batch_sizes, steps, gen, check_outputs, scale=1.0):
    """`steps` forward + backward steps of `world` and of one rank owning every table (the bulk lookup) on the
    same bags and gradients (pushed times `scale`); outputs against the reference if asked, and the tables must
    end up equal."""
    # One rank holding every table, cut as in `world` (row-wise Adagrad keeps one accumulator per shard and row).
    reference = World(world.tables, 1, optimizer=world.optimizer, column_shards=world.column_shards)
    for _ in range(steps):
        lengths, values, weights = random_bags(world.tables, batch_sizes, True, gen)
        bags = [world.owned_bags(r, lengths, values, weights, batch_sizes) for r in range(world.world_size)]
        outs = world.forward(bags)
        if check_outputs:
            for g, e in zip(outs, expected_outputs(world, lengths, values, weights, batch_sizes)):
                torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)
        grads = [torch.randn(o.shape, generator=gen) for o in outs]
        world.backward(bags, grads, scale)
        ref_bags = reference.owned_bags(0, lengths, values, weights, [sum(batch_sizes)])
        reference.lookups[0].apply_gradient(ref_bags, torch.cat(grads) * scale)
    for t in world.tables:
        torch.testing.assert_close(world.table(t.name), reference.table(t.name), rtol=1e-5, atol=1e-6)


def test_batch_sizes_that_change_between_steps():
    """Plans are made per tuple of batch sizes and point into the symmetric buffers: a larger batch grows the
    buffers (no plan may store into the old ones), a smaller or an earlier one is served again. Outputs against
    the reference on poisoned buffers, tables against the one-rank bulk lookup after every step."""
    tables = make_tables([4, 8, 3, 6], [10, 20, 7, 9])
    world, reference = World(tables, 2, num_programs=2), World(tables, 1)
    gen = torch.Generator().manual_seed(4)
    for batch_sizes in ([2, 1], [5, 4], [2, 1], [1, 3], [5, 4]):
        lengths, values, weights = random_bags(tables, batch_sizes, True, gen)
        bags = [world.owned_bags(r, lengths, values, weights, batch_sizes) for r in range(2)]
        for ex in world.exchanges:  # any element a step does not write stays NaN
            ex.ws.buffer("pooled", 2 * max(batch_sizes) * ex.row_len, torch.float32).local.fill_(float("nan"))
            ex.ws.buffer("grad", 2 * sum(batch_sizes) * max(ex.owned_dim), torch.float32).local.fill_(float("nan"))
        outs = world.forward(bags)
        for got, expected in zip(outs, expected_outputs(world, lengths, values, weights, batch_sizes)):
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        grads = [torch.randn(o.shape, generator=gen) for o in outs]
        world.backward(bags, grads)
        reference.lookups[0].apply_gradient(reference.owned_bags(0, lengths, values, weights, [sum(batch_sizes)]),
                                            torch.cat(grads))
        for t in tables:
            torch.testing.assert_close(world.table(t.name), reference.table(t.name), rtol=1e-5, atol=1e-6)


def test_kept_outputs_outlive_the_next_step_whatever_its_batch_sizes():
    """The double buffers across plans, ranks in step: a step's output (kept without a clone) is intact after the
    next step, forward and backward, and the gradient an owner applies is not overwritten by the next step's
    producers (which only wait for the ack of the step before theirs), whatever batch sizes the next step has.
    Regression: each plan split the buffers by its own sizes, so after [5, 4] -> [1, 1] -> [1, 1] -> [5, 4] the
    fourth step's even half covered the third's odd one. [7, 3] grows both buffers midway: the outputs before it
    stay in the old ones."""
    tables = make_tables([4, 8, 3, 6], [10, 20, 7, 9])
    world = World(tables, 2, num_programs=2, optimizer="sgd")
    gen = torch.Generator().manual_seed(10)
    kept = None  # the previous step's outputs and what they must hold; its gradients' views and what they held
    for batch_sizes in ([2, 1], [5, 4], [1, 1], [1, 1], [5, 4], [7, 3], [1, 2], [1, 2], [7, 3]):
        lengths, values, weights = random_bags(tables, batch_sizes, True, gen)
        bags = [world.owned_bags(r, lengths, values, weights, batch_sizes) for r in range(2)]
        expected = expected_outputs(world, lengths, values, weights, batch_sizes)  # before this step's update
        epochs = [ex.start(b) for ex, b in zip(world.exchanges, bags)]  # every producer first
        outs = [ex.finish(b, e) for ex, b, e in zip(world.exchanges, bags, epochs)]  # no clone
        for got, want in zip(outs, expected):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        grads = [torch.randn(o.shape, generator=gen) for o in outs]
        epochs = [ex.start_backward(b, g) for ex, b, g in zip(world.exchanges, bags, grads)]  # every push
        if kept is not None:  # the previous step's gradients, read by their owners until this step's wait
            for view, held in zip(kept[2], kept[3]):
                assert torch.equal(view, held), f"{batch_sizes}: the previous step's gradient was overwritten"
        for ex, b, e in zip(world.exchanges, bags, epochs):
            ex.finish_backward(b, e)
        if kept is not None:  # valid until the call after next
            for got, want in zip(kept[0], kept[1]):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5,
                                           msg=f"{batch_sizes}: the previous step's output was overwritten")
        grad_views = [ex._plan(b.batch_sizes).grad[e % 2] for ex, b, e in zip(world.exchanges, bags, epochs)]
        kept = (outs, expected, grad_views, [g.clone() for g in grad_views])


def test_a_peer_running_ahead_stores_its_call_after_next_once_this_rank_made_its_next():
    """What an output's life is when the ranks do not move in lockstep: a producer of call e waits only for each
    consumer's ack of call e - 1, given when that consumer's call e - 1 has its output. So once rank 0 has made
    calls 1 and 2 (forward only, as in evaluation), rank 1 running ahead into call 3 stores into the half that
    holds rank 0's output of call 1, although rank 0 has not made call 3: an output is valid until the module's
    next call, and is to be cloned to be kept longer. Rank 0's latest output is intact."""
    tables = make_tables([4, 8, 3, 6], [10, 20, 7, 9])
    world = World(tables, 2, num_programs=2)
    gen = torch.Generator().manual_seed(13)
    batches = [random_bags(tables, [3, 2], True, gen) for _ in range(3)]  # no update in between: one expectation
    bags = [[world.owned_bags(r, *batch, [3, 2]) for r in range(2)] for batch in batches]
    rank_0 = [expected_outputs(world, *batch, [3, 2])[0] for batch in batches]
    kept = []  # rank 0's outputs of calls 1 and 2, as returned (no clone)
    for call in bags[:2]:
        epochs = [ex.start(b) for ex, b in zip(world.exchanges, call)]
        kept.append([ex.finish(b, e) for ex, b, e in zip(world.exchanges, call, epochs)][0])
    world.exchanges[1].start(bags[2][1])  # rank 1's call 3; rank 0 makes none
    torch.testing.assert_close(kept[1], rank_0[1], rtol=1e-5, atol=1e-5)  # the next call's output: intact
    rank_1_columns = [s.col + c for s in world.exchanges[0].slices_of_rank[1] for c in range(s.dim)]
    torch.testing.assert_close(kept[0][:, rank_1_columns], rank_0[2][:, rank_1_columns], rtol=1e-5,
                               atol=1e-5)  # call 1's output now holds rank 1's columns of call 3


def test_a_backward_after_the_call_after_next_raises_instead_of_reading_an_overwritten_output():
    """A step's backward may read its output until the call after next: one reading it later (three forwards in
    flight, as in gradient accumulation over three micro-batches) raises on every rank, before the consumer's
    gradient push; the forward before the latest is still live."""
    tables = make_tables([4, 8], [10, 20])
    world = World(tables, 2, num_programs=2)
    gen = torch.Generator().manual_seed(12)
    forwards = []
    for _ in range(3):
        lengths, values, weights = random_bags(tables, [3, 2], False, gen)
        bags = [world.owned_bags(r, lengths, values, weights, [3, 2]) for r in range(2)]
        epochs = [ex.start(b) for ex, b in zip(world.exchanges, bags)]
        outs = [ex.finish(b, e) for ex, b, e in zip(world.exchanges, bags, epochs)]
        forwards.append((bags, epochs, outs))
    (first_bags, first, first_outs), (_, second, _) = forwards[0], forwards[1]
    for rank, ex in enumerate(world.exchanges):
        ex.check_output_live(second[rank])
        with pytest.raises(RuntimeError, match=rf"rank {rank}: the backward of forward call 1 runs after call 3, "
                                               r"and call 3 overwrote that call's output"):
            ex.check_output_live(first[rank])
        push = GradientPush(ex, first_bags[rank], 1.0, first_outs[rank], first[rank])
        with pytest.raises(RuntimeError, match="call 3 overwrote that call's output"):
            push.begin(4, 4)
        assert push.epoch is None  # no destinations taken: no gradient epoch spent


def test_nvshmem_plan_of_uneven_owners():
    """The nvshmem transport's plans: no p2p launches; the gradient in a buffer of its own, which holds the largest
    owner's [global batch, owned dims] in both halves (with one rank owning three of four tables, views over the
    pooled buffer would not fit), and a symmetric source for the gradient's puts. Plan building alone (NVSHMEM
    needs GPUs)."""
    tables = make_tables([64, 4, 4, 4], [100, 10, 10, 10])  # t0 alone on one rank, the three small on the other
    world = World(tables, 2)
    assert sorted(len(f) for f in world.features_of_rank) == [1, 3]
    for ex in world.exchanges:
        ex.nvshmem = True
        plan = ex._plan([3, 2])
        assert plan.push is None and plan.forward is None and len(plan.buffers) == 3
        pooled, grad, source = (b.local for b in plan.buffers)
        assert [g.shape for g in plan.grad] == [(5, ex.owned_dim[ex.rank])] * 2
        assert grad.numel() >= 2 * 5 * max(ex.owned_dim) and plan.grad_half == 5 * max(ex.owned_dim)
        assert source.numel() >= 3 * ex.row_len and plan.pooled[0].shape == (3 if ex.rank == 0 else 2, ex.row_len)


def test_many_consecutive_epochs_on_the_same_flags():
    tables = make_tables([4, 2], [6, 5])
    batch_sizes = [2, 1]
    world = World(tables, 2, num_programs=2)
    gen = torch.Generator().manual_seed(2)
    epochs = 60  # each half of the double buffer 30 times, every one checked (an epoch: ~0.15 s of CPU)
    for _ in range(epochs):
        lengths, values, _ = random_bags(tables, batch_sizes, False, gen)
        bags = [world.owned_bags(r, lengths, values, None, batch_sizes) for r in range(2)]
        got = world.forward(bags)
        for g, e in zip(got, expected_outputs(world, lengths, values, None, batch_sizes)):
            torch.testing.assert_close(g, e)
    assert world.exchanges[0].ws.next_epoch("pooled") == epochs + 1


def test_wait_times_out_with_rank_and_slice_instead_of_hanging():
    tables = make_tables([4, 2], [6, 5])
    world = World(tables, 2)
    gen = torch.Generator().manual_seed(3)
    lengths, values, _ = random_bags(tables, [2, 2], False, gen)
    bags = [world.owned_bags(r, lengths, values, None, [2, 2]) for r in range(2)]
    epoch = world.exchanges[0].start(bags[0])  # rank 1 never produces
    with pytest.raises(PeerWaitTimeout, match=r"rank 0 timed out at step 1 waiting for rank 1, slice \d"):
        world.exchanges[0].finish(bags[0], epoch)


@pytest.mark.parametrize("calls_late", [1, 2])
def test_a_late_peer_finishes_its_calls_exactly_and_the_next_call_is_exact(calls_late):
    """Rank 1 comes late to call 2 (and 3): rank 0's wait gives up and acknowledges call 2 all the same (its call is
    over), so rank 1 finishes call 2 exactly. Two calls late, rank 0's lookup of call 3 gives up waiting for rank
    1's release: it stores nothing there and raises no flag, so rank 1 times out naming rank 0 instead of taking its
    half's columns of call 1. Then every call is exact. (Once, the wait acknowledged only what arrived: the late
    peer's next lookup gave up, and raised its flags over tiles it never stored: rank 0 returned rank 1's columns
    of call 1 as call 3's, without an error.)"""
    tables = make_tables([4, 8, 3, 6], [10, 20, 7, 9])
    world = World(tables, 2, num_programs=2)
    gen = torch.Generator().manual_seed(5)
    calls = []
    for _ in range(1 + calls_late + 2):
        batch = random_bags(tables, [3, 2], True, gen)
        calls.append(([world.owned_bags(r, *batch, [3, 2]) for r in range(2)], expected_outputs(world, *batch, [3, 2])))

    def call(rank: int, step: int) -> torch.Tensor:
        bags = calls[step - 1][0]
        ex = world.exchanges[rank]
        return ex.finish(bags[rank], ex.start(bags[rank]))

    def check(outs, expected):
        for out, want in zip(outs, expected):
            torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)

    check(world.forward(calls[0][0]), calls[0][1])
    for step, waited in zip(range(2, 2 + calls_late), ["rank 1, slice", "rank 1 to release"]):  # rank 0 alone
        with pytest.raises(PeerWaitTimeout, match=rf"rank 0 timed out at step {step} waiting for {waited}"):
            call(0, step)
    check([call(1, 2)], calls[1][1][1:])
    if calls_late == 2:
        with pytest.raises(PeerWaitTimeout, match=r"rank 1 timed out at step 3 waiting for rank 0, slice"):
            call(1, 3)
    for bags, expected in calls[-2:]:
        check(world.forward(bags), expected)


def test_fewer_programs_than_ranks_is_a_clear_error():
    with pytest.raises(ValueError, match="num_programs=2 is below the world size 3"):
        World(make_tables([4, 8, 3], [10, 20, 7]), 3, num_programs=2)


@pytest.mark.parametrize("world_size,batch_sizes", [(4, [3, 0, 5, 2]), (8, [2, 1, 0, 3, 1, 2, 0, 1])])
def test_larger_worlds_forward_and_backward(world_size, batch_sizes):
    """Worlds of 4 and 8 ranks (the remote-first rotation over more peers; ranks with no samples, ranks owning
    no table): outputs against the reference, tables against the one-rank bulk lookup."""
    tables = make_tables([4, 8, 3, 6, 5, 2], [10, 20, 7, 9, 30, 4])
    world = World(tables, world_size, num_programs=world_size + 3)  # an uneven split of programs over destinations
    train_like_one_owner(world, batch_sizes, steps=2, gen=torch.Generator().manual_seed(world_size),
                         check_outputs=True)


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad"])
@pytest.mark.parametrize("world_size,batch_sizes,column_shards", [(2, [3, 4], {"t1": 2, "t3": 4}),
                                                                   (3, [2, 0, 5], 2)])
def test_column_shards_forward_and_backward(optimizer, world_size, batch_sizes, column_shards):
    """Tables cut into column shards: every shard's rank receives its table's bags and stores its columns at
    their place in each sample's row; the gradient's columns return to each shard. With t3 in 4 shards over 2
    ranks, each rank holds two of them (the same feature twice in its bags)."""
    tables = make_tables([4, 8, 6, 16], [10, 20, 7, 9])  # t2 mean-pooled
    world = World(tables, world_size, optimizer=optimizer, num_programs=world_size + 2, column_shards=column_shards)
    shards = [(s.table, s.rank, s.col, s.dim) for s in world.plan.shards]
    if world_size == 2:
        assert sorted(r for t, r, _, _ in shards if t == "t3") == [0, 0, 1, 1]
        assert len([f for f in world.features_of_rank[0] if f == "f3"]) == 2
    assert len(shards) == 8
    train_like_one_owner(world, batch_sizes, steps=2, gen=torch.Generator().manual_seed(5), check_outputs=True)


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad"])
@pytest.mark.parametrize("world_size,batch_sizes,row_shards", [(2, [3, 4], {"t1": 2, "t2": 3}), (3, [2, 0, 5], 3)])
def test_row_blocks_forward_and_backward(optimizer, world_size, batch_sizes, row_shards):
    """Tables cut into row blocks: each block's rank pools its part of every bag into the wide row (poisoned: an
    unwritten element shows), the parts sum to the reference's pooled row (t2's mean divided by the bag size), and
    every block receives its samples' gradient; the tables end as one uncut owner's (row-wise Adagrad keeps the
    same accumulator per row). Every table in 3 blocks over 3 ranks, one rank with no samples."""
    tables = make_tables([4, 8, 6, 16], [10, 20, 7, 9])  # t2 mean-pooled
    world = World(tables, world_size, optimizer=optimizer, num_programs=world_size + 2, row_shards=row_shards)
    assert world.row_sum is not None and all(ex.row_len > 42 for ex in world.exchanges)  # 42: the real row
    for ex in world.exchanges:
        ex.ws.buffer("pooled", 2 * max(batch_sizes) * ex.row_len, torch.float32).local.fill_(float("nan"))
    train_like_one_owner(world, batch_sizes, steps=2, gen=torch.Generator().manual_seed(6), check_outputs=True)


# -- DLRM's interaction on the exchange's output: its backward stores d S into the owners' buffers itself --------

def interaction_reference_grads(dense, sparse, grad_out):
    """d dense and d sparse of the interaction, in float64 (torch autograd through the reference)."""
    d64, s64 = dense.double().requires_grad_(), sparse.detach().double().requires_grad_()
    pairwise_interaction_reference(d64, s64).backward(grad_out.double())
    return d64.grad, s64.grad


# (world size, batch sizes, column shards, row shards)
INTERACTION_PUSH_CASES = [(2, [3, 7], 1, 1), (3, [2, 0, 4], 1, 1), (2, [3, 4], {"t1": 2, "t3": 2}, 1),
                          (2, [3, 4], 1, {"t1": 2, "t2": 3}), (3, [2, 0, 5], 1, 3)]


@pytest.mark.parametrize("world_size,batch_sizes,column_shards,row_shards", INTERACTION_PUSH_CASES)
def test_interaction_backward_pushes_the_gradient_into_the_owners(world_size, batch_sizes, column_shards,
                                                                  row_shards):
    check_interaction_push(world_size, batch_sizes, column_shards, row_shards, "cpu")


def check_interaction_push(world_size, batch_sizes, column_shards, row_shards, device, dim=64, features=5):
    """The interaction's pushing backward kernel, rank by rank on a simulated world: d S times the scale lands
    in the owners' gradient buffers (poisoned: an unwritten element turns a table NaN) under the push's flags, so
    the owners' tables end as the one-rank bulk lookup's given the float64 reference gradient; d x against the
    reference. Two steps (both buffer halves), a rank with no samples, more samples than programs (rank 1 of
    [3, 7] over 4 programs), column shards (a feature's 64 columns split between owners in blocks of the
    kernel's 32), and row blocks (the kernel stores each feature's d S at every block's part of the wide row, t2's
    mean divided by the bag size; the tables end as one uncut owner's). Also on one GPU
    (test_simulated_world_gpu.py), the kernels as compiled."""
    tables = make_tables([dim] * features, [10 + (37 * i) % 50 for i in range(features)])  # f2, f5, ... mean
    # SGD: row-wise Adagrad's step would hardly change with the gradient's scale
    world = World(tables, world_size, optimizer="sgd", num_programs=4, column_shards=column_shards, device=device,
                  row_shards=row_shards)
    assert (world.row_sum is not None) == (row_shards != 1)
    reference = World(tables, 1, optimizer="sgd", column_shards=column_shards, device=device)
    block = push_block(torch.float32, dim)
    assert all(ex.push_blocks(dim, block) is not None for ex in world.exchanges)  # the kernel's precondition
    scale, gen = 1 / world_size, torch.Generator().manual_seed(7)
    for _ in range(2):
        lengths, values, weights = random_bags(tables, batch_sizes, True, gen)
        bags = [world.owned_bags(r, lengths, values, weights, batch_sizes) for r in range(world_size)]
        for ex in world.exchanges:
            ex.ws.buffer("grad", 2 * sum(batch_sizes) * max(ex.owned_dim), torch.float32).local.fill_(float("nan"))
        sparse = [o.view(-1, features, dim) for o in world.forward(bags)]
        dense = [torch.randn(b, dim, generator=gen).to(device) for b in batch_sizes]
        grad_out = [torch.randn(b, dim + features + num_pairs(features), generator=gen).to(device)
                    for b in batch_sizes]
        destinations = [ex.gradient_destinations(b, scale, dim, block) for ex, b in zip(world.exchanges, bags)]
        if world.row_sum is not None:
            destinations = [world.row_sum.fan_out(d, b.pooling_divisors, dim) for d, b in zip(destinations, bags)]
        grad_dense = [torch.full_like(d, float("nan")) for d in dense]
        for r in range(world_size):  # every producer before any owner waits
            launch_backward(grad_out[r], dense[r], sparse[r], grad_dense[r], None, destinations[r])
        for ex, b, d in zip(world.exchanges, bags, destinations):
            ex.finish_backward(b, d.epoch)
        wanted = [interaction_reference_grads(*args) for args in zip(dense, sparse, grad_out)]
        for got, (want, _) in zip(grad_dense, wanted):
            torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
        reference.lookups[0].apply_gradient(reference.owned_bags(0, lengths, values, weights, [sum(batch_sizes)]),
                                            torch.cat([g.flatten(1) for _, g in wanted]).float() * scale)
    for t in tables:
        torch.testing.assert_close(world.table(t.name), reference.table(t.name), rtol=1e-5, atol=1e-6)


def test_blocks_pushable_only_when_each_has_one_owner_contiguously():
    """t1 cut into 4 shards of 16 columns over 2 ranks: a block of 32 columns spans two owners, one of 16 does not;
    features of 6 columns start unaligned in the owners' rows."""
    world = World(make_tables([64] * 3, [10, 20, 7]), 2, column_shards={"t1": 4})
    assert sorted({s.rank for s in world.plan.shards if s.table == "t1"}) == [0, 1]
    for ex in world.exchanges:
        assert ex.push_blocks(64, 32) is None
        owner, first_col = ex.push_blocks(64, 16)  # [4 blocks, 3 features]: t1's four shards, one per block
        assert sorted(owner[:, 1].tolist()) == [0, 0, 1, 1] and owner[:, 1].tolist() == [
            next(s.rank for s in world.plan.shards if s.table == "t1" and s.col == 16 * k) for k in range(4)]
    for ex in World(make_tables([6] * 3, [10, 20, 7]), 2).exchanges:
        assert ex.push_blocks(6, 16) is None


@pytest.mark.parametrize("dim,pushed,row_shards", [(64, True, 1), (6, False, 1), (64, True, {"t1": 2, "t2": 3}),
                                                   (6, False, 2)])
def test_interaction_on_the_exchange_output_takes_its_gradient_push(dim, pushed, row_shards):
    """Through autograd (one rank): pairwise_interaction on a view of the exchange's training output finds the
    exchange's offer, its backward pushes, and the exchange's backward (given no gradient) only waits and applies:
    tables as the bulk lookup's with the reference gradient, two steps. With row blocks the offer comes through
    the blocks' sum of the output (RowBlockPush: each feature's gradient stored at every block's part, t2's mean
    divided by the bag size; the tables end as one uncut owner's). Features of 6 columns are not offered (the
    kernel's row blocks would start unaligned in the owner's row): the gradient then returns through autograd to
    the exchange's own push, with the same result. A second consumer of the output is a clear error, not a
    silently lost gradient. The exchange counts who pushed (backward_pushes)."""
    features, batch = 4, 5
    tables = make_tables([dim] * features, [10, 20, 7, 9])  # t2 mean-pooled
    world = World(tables, 1, optimizer="sgd", num_programs=3, row_shards=row_shards)
    reference = World(tables, 1, optimizer="sgd")
    exchange, gen = world.exchanges[0], torch.Generator().manual_seed(8)

    def real(wide, bags):  # the real row (row blocks: their parts summed)
        return wide if world.row_sum is None else world.row_sum(wide, bags.pooling_divisors)

    for _ in range(2):
        lengths, values, weights = random_bags(tables, [batch], True, gen)
        bags = world.owned_bags(0, lengths, values, weights, [batch])
        sparse = real(exchange(bags, 0.5), bags).view(batch, features, dim)
        assert (offered_gradient_push(sparse) is not None) == pushed
        dense = torch.randn(batch, dim, generator=gen).requires_grad_()
        grad_out = torch.randn(batch, dim + features + num_pairs(features), generator=gen)
        pairwise_interaction(dense, sparse).backward(grad_out)
        want_dense, want_sparse = interaction_reference_grads(dense.detach(), sparse, grad_out)
        torch.testing.assert_close(dense.grad.double(), want_dense, rtol=1e-5, atol=1e-5)
        reference.lookups[0].apply_gradient(reference.owned_bags(0, lengths, values, weights, [batch]),
                                            want_sparse.flatten(1).float() * 0.5)
        for t in tables:
            torch.testing.assert_close(world.table(t.name), reference.table(t.name), rtol=1e-5, atol=1e-6)
    assert exchange.backward_pushes == ({"consumer": 2, "exchange": 0} if pushed else {"consumer": 0, "exchange": 2})
    if not pushed:
        return
    out = real(exchange(bags, 1.0), bags)
    both = pairwise_interaction(torch.randn(batch, dim), out.view(batch, features, dim)).sum() + out.sum()
    with pytest.raises(RuntimeError, match="has a consumer besides the one that pushed its gradient"):
        both.backward()


def test_the_row_blocks_sum_frees_its_output_without_the_garbage_collector():
    """The blocks' sum offers the exchange's push from its autograd node, which its output holds: the offer must not
    hold the output back (a cycle would keep every step's real row until Python's collector ran), neither before
    its backward (a forward whose backward never comes) nor after it."""
    features, batch, dim = 4, 5, 64
    tables = make_tables([dim] * features, [10, 20, 7, 9])
    world = World(tables, 1, optimizer="sgd", num_programs=3, row_shards=2)
    gen = torch.Generator().manual_seed(9)
    lengths, values, weights = random_bags(tables, [batch], True, gen)
    bags = world.owned_bags(0, lengths, values, weights, [batch])
    gc.disable()
    try:
        real = world.row_sum(world.exchanges[0](bags, 1.0), bags.pooling_divisors)
        freed = weakref.ref(real)
        del real
        assert freed() is None
        real = world.row_sum(world.exchanges[0](bags, 1.0), bags.pooling_divisors)
        freed = weakref.ref(real)
        pairwise_interaction(torch.randn(batch, dim), real.view(batch, features, dim)).sum().backward()
        assert world.exchanges[0].backward_pushes["consumer"] == 1  # the offer was taken
        del real
        assert freed() is None
    finally:
        gc.enable()


COMPILE_FOR_SM90 = """
from fused_dlrm.kernels import peer_flags, pooled_embedding, push_columns

tables = {n: "*i64" for n in ("values_ptr", "offsets_ptr", "table_ptrs", "cols_ptr", "row_begin_ptr", "row_end_ptr",
                              "out_ptrs", "out_row_base_ptr", "ready_ptrs", "src_cols_ptr", "dst_cols_ptr",
                              "out_row_len_ptr", "ack_ptrs")}
small = {n: "*i32" for n in ("dims_ptr", "mean_ptr", "dest_order_ptr", "tile_starts_ptr", "walk_starts_ptr",
                             "program_starts_ptr", "feature_begin_ptr", "ack_ptr", "error_ptr", "ready_ptr")}
types = {**tables, **small, "weights_ptr": "*fp32", "src_ptr": "*fp32", "global_batch": "i64", "out_row_len": "i64",
         "scale": "fp32",
         "src_row_len": "i64"}
for table_dtype in (tl.float32, tl.bfloat16):  # rank and epoch 1 arrive as constexprs
    for signal in (True, False):
        build(pooled_embedding._pooled_embedding_kernel, types, dict(
            rank=1, epoch=1, WORLD=2, WORLD_P2=2, BLOCK_B=1, BLOCK_L=4, BLOCK_D=256, TABLE_DTYPE=table_dtype,
            HAS_WEIGHTS=True, SIGNAL=signal), num_warps=1)
for weights in ("*fp16", "*bf16", "*fp64"):  # the input dist's other weight dtypes (batch_header.WEIGHT_DTYPES)
    build(pooled_embedding._pooled_embedding_kernel, {**types, "weights_ptr": weights}, dict(
        rank=1, epoch=1, WORLD=2, WORLD_P2=2, BLOCK_B=1, BLOCK_L=4, BLOCK_D=256, TABLE_DTYPE=tl.float32,
        HAS_WEIGHTS=True, SIGNAL=True), num_warps=1)
build(push_columns._push_columns_kernel, types, dict(rank=1, epoch=1, WORLD=3, WORLD_P2=4, BLOCK_R=16, BLOCK_D=128))
build(peer_flags._wait_ready_kernel, types, dict(rank=1, epoch=1, BLOCK=64))
"""


def test_kernels_compile_for_sm90():
    """The p2p kernels as the GPU compiles them (the nvshmem ones need NVSHMEM's device library to link); the lookup
    with per-sample weights of each dtype the input dist lets through (fp64 ones made its fp32 sum fp64: no
    compile)."""
    compile_for_sm90(COMPILE_FOR_SM90)
