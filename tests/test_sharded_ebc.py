"""ShardedEmbeddingBagCollection against torchrec's unsharded EmbeddingBagCollection.

Every rank builds the same torchrec EBC and the same global batches; the sharded module sees only the rank's
slice of each batch and owns only its tables. Forward outputs, and the owned tables after several steps of SGD
and of row-wise Adagrad, must match the unsharded module run on the whole global batch.
"""

from __future__ import annotations

import pytest
import torch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, PoolingType
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

from fused_dlrm.data.batching import local_batch_bounds
from fused_dlrm.sparse import EmbeddingOptimizerConfig, ShardedEmbeddingBagCollection, plan_sharding
from fused_dlrm.sparse.sharded_ebc import shard_weight
from bags import global_batch, to_kjt
from world import run_world

# Uneven rows and dims, a table read by two features, a mean-pooled table.
TABLES = [
    EmbeddingBagConfig(name="t0", embedding_dim=4, num_embeddings=10, feature_names=["f0", "f1"]),
    EmbeddingBagConfig(name="t1", embedding_dim=8, num_embeddings=57, feature_names=["f2"], pooling=PoolingType.MEAN),
    EmbeddingBagConfig(name="t2", embedding_dim=16, num_embeddings=7, feature_names=["f3"]),
    EmbeddingBagConfig(name="t3", embedding_dim=3, num_embeddings=300, feature_names=["f4"]),
]

# torchrec's reference (nn.EmbeddingBag) takes per-sample weights with SUM pooling only.
SUM_TABLES = [EmbeddingBagConfig(name=t.name, embedding_dim=t.embedding_dim, num_embeddings=t.num_embeddings,
                                 feature_names=t.feature_names) for t in TABLES]


def compare_with_torchrec(rank: int, world: int, optimizer: str, weighted: bool, batch: int, tables,
                          column_shards=1, row_shards=1) -> None:
    """column_shards and row_shards as plan_sharding takes them. Column shards keep a row-wise Adagrad accumulator
    each, which the unsharded module does not: with them, compare SGD (row blocks keep the same accumulators)."""
    torch.manual_seed(0)
    reference = EmbeddingBagCollection(tables, is_weighted=weighted)
    lr = 0.05
    sharded = ShardedEmbeddingBagCollection(tables, EmbeddingOptimizerConfig(optimizer, lr=lr, eps=1e-8),
                                            plan=plan_sharding(tables, world, column_shards, row_shards))
    mine = sharded.plan.shards_of(rank)
    assert sorted(sharded.shard_weights) == sorted(s.name for s in mine)
    reference_columns = {s.name: lambda s=s: shard_weight(reference.embedding_bags[s.table].weight, s) for s in mine}
    for name, weight in sharded.shard_weights.items():
        weight.data.copy_(reference_columns[name]())
    ref_opt = (torch.optim.SGD(reference.parameters(), lr=lr) if optimizer == "sgd"
               else RowWiseAdagrad(reference.parameters(), lr=lr, eps=1e-8))
    keys = [f for t in tables for f in t.feature_names]
    start, stop = local_batch_bounds(batch, rank, world)
    for step in range(4):
        lengths, values, weights = global_batch(step, batch, tables, weighted)
        expected = reference(to_kjt(keys, lengths, values, weights, 0, batch))
        got = sharded(to_kjt(keys, lengths, values, weights, start, stop))
        assert got.keys() == expected.keys() and got.length_per_key() == expected.length_per_key()
        torch.testing.assert_close(got.values(), expected.values()[start:stop], rtol=1e-5, atol=1e-6)  # shapes too

        grad = torch.randn(expected.values().shape, generator=torch.Generator().manual_seed(step))
        ref_opt.zero_grad()
        (expected.values() * grad).sum().backward()
        ref_opt.step()
        # As in torchrec, the gradient returned to the owners is divided by the world size: undo it here.
        (got.values() * grad[start:stop] * world).sum().backward()
        for name, weight in sharded.shard_weights.items():
            torch.testing.assert_close(weight, reference_columns[name](), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad"])
@pytest.mark.parametrize("weighted", [False, True])
def test_one_process_matches_torchrec(optimizer, weighted):
    compare_with_torchrec(0, 1, optimizer, weighted, 6, SUM_TABLES if weighted else TABLES)


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad"])
def test_two_ranks_match_torchrec_uneven_batch(optimizer):
    # Global batch 7 over 2 ranks: local batches 4 and 3.
    run_world(2, compare_with_torchrec, optimizer, True, 7, SUM_TABLES)
    run_world(2, compare_with_torchrec, optimizer, False, 8, TABLES)


@pytest.mark.parametrize("weighted", [False, True])
def test_column_shards_match_torchrec(weighted):
    # t2 (16 columns) in 4 shards over 2 ranks (two on each), t1 in 2: a feature's bags go to every shard's rank
    # (twice to one rank), and each shard's columns land at their place in the output.
    tables = SUM_TABLES if weighted else TABLES
    run_world(2, compare_with_torchrec, "sgd", weighted, 7, tables, {"t1": 2, "t2": 4})
    run_world(3, compare_with_torchrec, "sgd", weighted, 8, tables, {"t0": 2, "t2": 2})


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad"])
@pytest.mark.parametrize("weighted", [False, True])
def test_row_blocks_match_torchrec(optimizer, weighted):
    # t3 (300 rows) in 3 blocks over 2 ranks (two on one), t1 (57 rows, mean-pooled unless weighted) in 2: each
    # index reaches only its block's rank, and a sample's blocks' parts are summed (a mean's divided by its bag's
    # size). Row blocks keep torchrec's row-wise Adagrad accumulators: both optimizers compare.
    tables = SUM_TABLES if weighted else TABLES
    run_world(2, compare_with_torchrec, optimizer, weighted, 7, tables, 1, {"t1": 2, "t3": 3})
    # Three ranks (local batches 2, 2, 1), t0 read by two features cut in 3 blocks, t2 cut in columns (with SGD:
    # column shards keep accumulators of their own).
    column_shards = {"t2": 2} if optimizer == "sgd" else 1
    run_world(3, compare_with_torchrec, optimizer, weighted, 5, tables, column_shards, {"t0": 3, "t1": 3})


def test_more_ranks_than_tables():
    # 3 ranks, 2 tables: rank 2 owns nothing but still sends its inputs and receives its outputs.
    run_world(3, compare_with_torchrec, "rowwise_adagrad", False, 9, TABLES[:2])


def test_out_of_range_index_names_feature_and_value():
    sharded = ShardedEmbeddingBagCollection(TABLES, EmbeddingOptimizerConfig())
    keys = [f for t in TABLES for f in t.feature_names]
    lengths, values, _ = global_batch(0, 4, TABLES, False)
    values[2][-1] = 57  # f2 reads t1, which has 57 rows
    with pytest.raises(IndexError, match=r"feature 'f2' has index 57, outside table 't1' of 57 rows"):
        sharded(to_kjt(keys, lengths, values, None, 0, 4))
    values[2][-1] = -3
    with pytest.raises(IndexError, match="feature 'f2' has index -3"):
        sharded(to_kjt(keys, lengths, values, None, 0, 4))


def test_unknown_and_missing_keys():
    sharded = ShardedEmbeddingBagCollection(TABLES, EmbeddingOptimizerConfig())
    keys = [f for t in TABLES for f in t.feature_names]
    lengths, values, _ = global_batch(0, 4, TABLES, False)
    bad_keys = keys[:-1] + ["nope"]
    with pytest.raises(KeyError, match=r"unknown \['nope'\], missing \['f4'\]"):
        sharded(to_kjt(bad_keys, lengths, values, None, 0, 4))


def test_keys_in_any_order():
    sharded = ShardedEmbeddingBagCollection(TABLES, EmbeddingOptimizerConfig()).eval()
    keys = [f for t in TABLES for f in t.feature_names]
    lengths, values, _ = global_batch(0, 5, TABLES, False)
    order = [3, 0, 4, 2, 1]
    shuffled = to_kjt([keys[i] for i in order], lengths[order], [values[i] for i in order], None, 0, 5)
    expected = sharded(to_kjt(keys, lengths, values, None, 0, 5))
    got = sharded(shuffled)
    assert got.keys() == keys
    torch.testing.assert_close(got.values(), expected.values())


def _agree_on_programs(rank: int, world: int) -> None:
    from fused_dlrm.sparse.fused_all_to_all import agreed_num_programs

    # as on GPUs of different SM counts: each rank's default differs, the flag layout needs one count
    assert agreed_num_programs([4224, 3456][rank], None, torch.device("cpu")) == 3456


def test_ranks_agree_on_the_fused_exchange_program_count():
    run_world(2, _agree_on_programs)


def test_fused_comm_is_refused_clearly_where_it_cannot_run():
    from fused_dlrm.sparse.fused_all_to_all import FusedCommConfig

    tables = [EmbeddingBagConfig(name="t0", embedding_dim=4, num_embeddings=10, feature_names=["f0"])]
    opt = EmbeddingOptimizerConfig("sgd", lr=0.1)
    with pytest.raises(ValueError, match="comm.transport='ib' is unknown; expected one of \\['p2p', 'nvshmem'\\]"):
        ShardedEmbeddingBagCollection(tables, opt, comm=FusedCommConfig(transport="ib"))
    for transport in ("p2p", "nvshmem"):
        with pytest.raises(RuntimeError, match="comm=fused needs CUDA GPUs under torchrun"):
            ShardedEmbeddingBagCollection(tables, opt, comm=FusedCommConfig(transport=transport))


@pytest.mark.parametrize("spins", [2**31, 3_000_000_000, 0, -1, float("nan")])
def test_a_wait_bound_the_kernels_cannot_count_is_refused(spins):
    """The waits count polls in 32 bits: from 2**31 on the count wraps before it reaches the bound, so a lost peer
    would hang the wait instead of raising; below 1 every wait gives up at its first look. Refused with the
    setting's name when the config is made, before anything is built (the same config on every rank)."""
    from fused_dlrm.sparse.fused_all_to_all import FusedCommConfig

    with pytest.raises(ValueError, match=r"comm.wait_timeout_spins=.* from 1 to 2\*\*31 - 1"):
        FusedCommConfig(wait_timeout_spins=spins)
    assert FusedCommConfig(wait_timeout_spins=2**31 - 1).wait_timeout_spins == 2**31 - 1


@pytest.mark.parametrize("programs", [0, -3, 2.5, True, "32"])
def test_a_program_count_that_is_no_whole_number_is_refused(programs):
    """comm.num_programs sizes the flags and the tile split (ranks agree on the smallest, as a tensor): a float
    would be truncated there, true taken as 1, 0 as the default. Refused with the setting's name when the config
    is made; null keeps the default (per SM)."""
    from fused_dlrm.sparse.fused_all_to_all import FusedCommConfig

    with pytest.raises(ValueError, match=r"comm.num_programs=.*: expected a whole number >= 1 or null"):
        FusedCommConfig(num_programs=programs)
    assert FusedCommConfig(num_programs=None).num_programs is None
    assert FusedCommConfig(num_programs=7).num_programs == 7


def test_a_gpu_plan_with_two_dtypes_on_one_rank_is_refused_on_every_rank():
    """Each rank checks every rank's tables (the plan is the same everywhere), before anything is made."""
    from torchrec.modules.embedding_configs import DataType

    from fused_dlrm.sparse.sharded_ebc import refuse_mixed_dtypes

    tables = [EmbeddingBagConfig(name="t0", embedding_dim=4, num_embeddings=10, feature_names=["f0"]),
              EmbeddingBagConfig(name="t1", embedding_dim=4, num_embeddings=20, feature_names=["f1"],
                                 data_type=DataType.FP16)]
    with pytest.raises(ValueError, match=r"tables of 2 dtypes on rank 0 \(t1: FP16, t0: FP32\)"):
        ShardedEmbeddingBagCollection(tables, EmbeddingOptimizerConfig(), device="cuda")
    refuse_mixed_dtypes(plan_sharding(tables, 2), tables)  # one table per rank: each launch has one dtype
    ShardedEmbeddingBagCollection(tables, EmbeddingOptimizerConfig())  # the CPU's lookup takes a mix


def _headers_exchanged_ahead(rank: int, world: int) -> None:
    sharded = ShardedEmbeddingBagCollection(TABLES, EmbeddingOptimizerConfig()).eval()
    keys = [f for t in TABLES for f in t.feature_names]
    start, stop = local_batch_bounds(6, rank, world)
    batches = [global_batch(step, 6, TABLES, False) for step in range(3)]
    kjts = [to_kjt(keys, lengths, values, None, start, stop) for lengths, values, _ in batches]
    expected = [sharded(kjt).values() for kjt in kjts]
    # The loop's order: prefetch batch i, start batch i + 1's header, forward batch i.
    sharded.prefetch(kjts[0])
    sharded.prefetch_header(kjts[1])
    torch.testing.assert_close(sharded(kjts[0]).values(), expected[0], rtol=0, atol=0)
    sharded.prefetch(kjts[1])  # its header went ahead
    sharded.prefetch_header(kjts[2])
    torch.testing.assert_close(sharded(kjts[1]).values(), expected[1], rtol=0, atol=0)
    sharded.prefetch(kjts[0])  # not the batch whose header went ahead: exchanged whole (batch 2's is dropped)
    torch.testing.assert_close(sharded(kjts[0]).values(), expected[0], rtol=0, atol=0)

    # A bad batch whose header went ahead raises at its prefetch, on every rank, and not before.
    lengths, values, _ = batches[2]
    values[2][-1] = 57  # f2 reads t1, which has 57 rows
    culprit = int(lengths[2].nonzero().max()) >= local_batch_bounds(6, 1, world)[0]  # the sample is rank 1's
    bad = to_kjt(keys, lengths, values, None, start, stop)
    sharded.prefetch_header(bad)
    message = "feature 'f2' has index 57" if rank == int(culprit) else r"rank\(s\) \[%d\] sent out-of-range" % culprit
    with pytest.raises(IndexError, match=message):
        sharded.prefetch(bad)


def test_headers_exchanged_a_step_ahead_give_the_same_bags_and_errors():
    run_world(2, _headers_exchanged_ahead)



def _distributed_on_the_batch_thread(rank: int, world: int, row_shards) -> None:
    from torchrec.datasets.utils import Batch

    from fused_dlrm.train.batches_ahead import BatchesAhead

    sharded = ShardedEmbeddingBagCollection(TABLES, EmbeddingOptimizerConfig(),
                                            plan=plan_sharding(TABLES, world, row_shards=row_shards)).eval()
    keys = [f for t in TABLES for f in t.feature_names]
    start, stop = local_batch_bounds(6, rank, world)
    batches = [global_batch(step, 6, TABLES, False) for step in range(4)]
    lengths, values, _ = batches[3]
    values[2][-1] = 57  # f2 reads t1, which has 57 rows: batch 3 is bad
    culprit = int(lengths[2].nonzero().max()) >= local_batch_bounds(6, 1, world)[0]  # the sample is rank 1's
    kjts = [to_kjt(keys, lengths, values, None, start, stop) for lengths, values, _ in batches]
    expected = [sharded(kjt).values() for kjt in kjts[:3]]  # inline, through the collection's own input dist
    stream = iter([(0, Batch(dense_features=torch.zeros(stop - start, 1), sparse_features=kjt,
                             labels=torch.zeros(stop - start))) for kjt in kjts])
    distribute = sharded.input_dist_on_thread()
    with BatchesAhead(stream, torch.device("cpu"), depth=2,
                      prepare=lambda batch: distribute(batch.sparse_features)) as ahead:
        for step in range(3):
            kjt = next(ahead)[1].sparse_features
            assert any(k is kjt for k, _, _ in sharded._from_thread)  # distributed by the thread
            torch.testing.assert_close(sharded(kjt).values(), expected[step], rtol=0, atol=0)
            assert not any(k is kjt for k, _, _ in sharded._from_thread)  # taken by that forward
            # an evaluation's forward (inline) while the thread distributes: its own communicator
            torch.testing.assert_close(sharded(kjts[0]).values(), expected[0], rtol=0, atol=0)
        message = ("feature 'f2' has index 57" if rank == int(culprit)
                   else r"rank\(s\) \[%d\] sent out-of-range" % culprit)
        with pytest.raises(IndexError, match=message):  # on every rank, at the bad batch
            next(ahead)
    sharded.drop_prefetched()
    assert not sharded._from_thread


@pytest.mark.parametrize("row_shards", [1, {"t1": 2, "t0": 2}], ids=["whole", "row_blocks"])
def test_the_batch_thread_distributes_with_the_same_bags_and_errors(row_shards):
    """The thread's input dist is the collection's, row blocks included (a mean-pooled one, t1, whose bag sizes
    the bags carry)."""
    run_world(2, _distributed_on_the_batch_thread, row_shards)


def _row_blocks_like_whole_tables(rank: int, world: int, optimizer: str) -> None:
    opt = EmbeddingOptimizerConfig(optimizer, lr=0.05, eps=1e-8)
    whole = ShardedEmbeddingBagCollection(TABLES, opt)
    cut = ShardedEmbeddingBagCollection(TABLES, opt, plan=plan_sharding(TABLES, world, row_shards={"t1": 3, "t3": 2}))
    for weight in cut.shard_weights.values():  # a block's memory: its rows only
        assert weight.untyped_storage().nbytes() == weight.nbytes
    keys = [f for t in TABLES for f in t.feature_names]
    order = [4, 2, 0, 3, 1]  # the KJT's keys in another order than the tables'
    start, stop = local_batch_bounds(9, rank, world)
    for step in range(3):
        lengths, values, weights = global_batch(step, 9, TABLES, True)  # weights on t1's mean too
        kjt = to_kjt([keys[i] for i in order], lengths[order], [values[i] for i in order],
                     [weights[i] for i in order], start, stop)
        cut.prefetch_header(kjt)  # the header a step ahead, then the rest
        cut.prefetch(kjt)
        got, want = cut(kjt).values(), whole(kjt).values()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        grad = torch.randn(want.shape, generator=torch.Generator().manual_seed(step))
        (got * grad).sum().backward()
        (want * grad).sum().backward()
    for s in cut.plan.shards_of(rank):
        if s.table in whole.shard_weights:
            torch.testing.assert_close(cut.shard_weights[s.name],
                                       shard_weight(whole.shard_weights[s.table], s), rtol=1e-5, atol=1e-6)
    lengths, values, weights = global_batch(0, 9, TABLES, True)
    values[2][0] = -1  # f2 reads t1, cut in 3 blocks: the uncut index is reported
    culprit = int(lengths[2].nonzero()[0]) >= local_batch_bounds(9, 1, world)[0]  # whose sample holds it
    message = "feature 'f2' has index -1, outside table 't1'" if rank == int(culprit) else "sent out-of-range"
    with pytest.raises(IndexError, match=message):
        cut(to_kjt(keys, lengths, values, weights, start, stop))


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad"])
def test_row_blocks_equal_whole_tables(optimizer):
    """A row-wise plan against the table-wise one of the same module, where torchrec cannot compare: weights on a
    mean-pooled table cut in 3 blocks, the KJT's keys in another order, the header sent a step ahead, a negative
    index; and each block owns only its rows' memory."""
    run_world(2, _row_blocks_like_whole_tables, optimizer)
