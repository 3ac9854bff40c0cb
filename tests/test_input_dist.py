"""The input dist's checks of the batch carried in its header (every rank raises when one rank's batch is bad, and
goes on with the next good one); its segment regroup: test_segment_gather_kernel.py."""

from __future__ import annotations

import os

import pytest
import torch
from torchrec import KeyedJaggedTensor

from fused_dlrm.data.batching import local_batch_bounds
from fused_dlrm.kernels import batch_header as bh
from fused_dlrm.sparse import EmbeddingOptimizerConfig, ShardedEmbeddingBagCollection, plan_sharding
from bags import global_batch, to_kjt
from test_sharded_ebc import SUM_TABLES, TABLES
from world import run_world


def _bad_batch_on_rank_1(rank: int, world: int, bad: str, row_shards) -> None:
    sharded = ShardedEmbeddingBagCollection(TABLES, EmbeddingOptimizerConfig(),
                                            plan=plan_sharding(TABLES, world, row_shards=row_shards))
    keys = [f for t in TABLES for f in t.feature_names]
    lengths, values, _ = global_batch(0, 6, TABLES, False)
    start, stop = local_batch_bounds(6, rank, world)
    good = sharded(to_kjt(keys, lengths, values, None, start, stop)).values().clone()
    kjt = to_kjt(keys, lengths, values, None, start, stop)
    if rank == 1 and bad == "index":
        values[2][-1] = 57  # f2 reads t1 (57 rows); the last bag belongs to rank 1's samples
        kjt = to_kjt(keys, lengths, values, None, start, stop)
    elif rank == 1 and bad == "keys":
        kjt = KeyedJaggedTensor(keys=keys[:-1] + ["nope"], values=kjt.values(), lengths=kjt.lengths())
    elif rank == 1 and bad == "values":  # one value more than the lengths account for
        kjt = KeyedJaggedTensor(keys=keys, values=torch.cat([kjt.values(), kjt.values()[:1]]),
                                lengths=kjt.lengths())
    elif rank == 1 and bad == "negative":  # a negative length, the lengths' sum still the value count
        cut = kjt.lengths().clone()
        cut[0] += cut[1] + 1
        cut[1] = -1
        kjt = KeyedJaggedTensor(keys=keys, values=kjt.values(), lengths=cut)
    elif rank == 1 and bad == "shape":  # one length short of keys x stride
        kjt = KeyedJaggedTensor(keys=keys, values=kjt.values(), lengths=kjt.lengths()[:-1], stride=kjt.stride())
    elif bad in ("short_weights", "long_weights"):  # every rank's KJT weighted, rank 1's one weight short or over
        extra = {"short_weights": -1, "long_weights": 1}[bad] if rank == 1 else 0
        kjt = KeyedJaggedTensor(keys=keys, values=kjt.values(), lengths=kjt.lengths(),
                                weights=torch.rand(kjt.values().numel() + extra))
    elif rank == 1 and bad == "column_values":  # the values as a column [N, 1]
        kjt = KeyedJaggedTensor(keys=keys, values=kjt.values()[:, None], lengths=kjt.lengths())
    elif bad == "column_weights":  # every rank's KJT weighted, rank 1's weights a column [N, 1]
        weights = torch.rand(kjt.values().numel())
        kjt = KeyedJaggedTensor(keys=keys, values=kjt.values(), lengths=kjt.lengths(),
                                weights=weights[:, None] if rank == 1 else weights)
    elif rank == 1 and bad == "variable_batch":  # torchrec's VBE: f0 with one sample less, every sample's output
        per_key = kjt.lengths().view(len(keys), -1)
        end, last = int(per_key[0].sum()), int(per_key[0, -1])
        kjt = KeyedJaggedTensor(keys=keys, values=torch.cat([kjt.values()[:end - last], kjt.values()[end:]]),
                                lengths=torch.cat([per_key[0, :-1], per_key[1:].reshape(-1)]),
                                stride_per_key_per_rank=[[2]] + [[3]] * (len(keys) - 1),
                                inverse_indices=(keys, torch.tensor([[0, 1, 1]] + [[0, 1, 2]] * (len(keys) - 1))))
    elif rank == 1 and bad == "device":  # the KJT on another device than the collection (the CPU's)
        kjt = kjt.to(torch.device("meta"))
    elif bad == "weights_device":  # every rank's KJT weighted, rank 1's weights alone on another device
        weights = torch.rand(kjt.values().numel())
        kjt = KeyedJaggedTensor(keys=keys, values=kjt.values(), lengths=kjt.lengths(),
                                weights=weights.to("meta") if rank == 1 else weights)
    error, mine, theirs = {
        "index": (IndexError, "rank 1: feature 'f2' has index 57, outside table 't1' of 57 rows",
                  r"rank 0: rank\(s\) \[1\] sent out-of-range indices"),
        "keys": (KeyError, r"rank 1: .*keys do not match the tables' features: unknown \['nope'\], missing \['f4'\]",
                 r"rank 0: rank\(s\) \[1\] sent KeyedJaggedTensors whose keys do not match"),
        "values": (ValueError, r"rank 1: the KeyedJaggedTensor has \d+ values but its lengths sum to \d+",
                   r"rank 0: rank\(s\) \[1\] sent KeyedJaggedTensors whose values, lengths or weights disagree"),
        "negative": (ValueError, "rank 1: feature 'f0' has a negative length -1 at sample 1",
                     r"rank 0: rank\(s\) \[1\] sent KeyedJaggedTensors whose values, lengths or weights disagree"),
        "shape": (ValueError, r"rank 1: the KeyedJaggedTensor has 14 lengths for 5 keys x stride 3",
                  r"rank 0: rank\(s\) \[1\] sent KeyedJaggedTensors whose values, lengths or weights disagree"),
        "column_values": (ValueError, r"rank 1: the KeyedJaggedTensor's values are of shape \[\d+, 1\], not one "
                          r"dimension", r"rank 0: rank\(s\) \[1\] sent KeyedJaggedTensors whose values, lengths or"),
        "column_weights": (ValueError, r"rank 1: the KeyedJaggedTensor's per-sample weights are of shape \[\d+, 1\], "
                           r"not one dimension", r"rank 0: rank\(s\) \[1\] sent KeyedJaggedTensors whose values,"),
        "variable_batch": (ValueError, r"rank 1: the KeyedJaggedTensor has a variable batch size per feature "
                           r"\(torchrec's variable batch, stride_per_key \[2, 3, 3, 3, 3\]\), which the sharded "
                           r"collection does not take",
                           r"rank 0: rank\(s\) \[1\] sent KeyedJaggedTensors whose values, lengths or weights"),
        "device": (ValueError, r"rank 1: the KeyedJaggedTensor's values are on meta, the sharded collection on "
                   r"cpu: move the batch to cpu", r"rank 0: rank\(s\) \[1\] sent KeyedJaggedTensors whose values,"),
        "weights_device": (ValueError, r"rank 1: the KeyedJaggedTensor's per-sample weights are on meta, the "
                           r"sharded collection on cpu", r"rank 0: rank\(s\) \[1\] sent KeyedJaggedTensors whose"),
    }.get(bad, (ValueError, r"rank 1: the KeyedJaggedTensor has (22|24) per-sample weights for 23 values",
                r"rank 0: rank\(s\) \[1\] sent KeyedJaggedTensors whose values, lengths or weights disagree"))
    with pytest.raises(error, match=mine if rank == 1 else theirs):
        sharded(kjt)
    # Nothing was lost: every rank goes on with the next good batch, pooled as before the bad one (nothing of the
    # bad batch stayed behind in the input dist).
    lengths, values, _ = global_batch(0, 6, TABLES, False)
    torch.testing.assert_close(sharded(to_kjt(keys, lengths, values, None, start, stop)).values(), good)


@pytest.mark.parametrize("bad", ["index", "keys", "values", "negative", "shape", "short_weights", "long_weights",
                                 "column_values", "column_weights", "variable_batch", "device", "weights_device"])
@pytest.mark.parametrize("row_shards", [1, {"t1": 2, "t3": 3}], ids=["whole", "row_blocks"])
def test_a_bad_batch_raises_on_every_rank(bad, row_shards):
    """With row blocks (t1, which f2 reads, in two) the checks are of the batch as sent, before its cut: the
    error names the feature, the index and the table as the user knows them. Per-sample weights more or fewer
    than the values (the weights' regroups and all-to-all are sized by the values) raise on every rank too, and so
    do values or weights of another shape than one dimension (a column [N, 1] broadcast in the header's checks, and
    failed in the lookups of its owners alone), torchrec's variable batch per feature (VBE), named as such, and a
    KJT (or its weights alone) on another device than the collection (the header left from that device: on the CPU
    a meta KJT failed copying its header on that rank alone; the GPU case, a host KJT for a GPU collection, not
    run here)."""
    run_world(2, _bad_batch_on_rank_1, bad, row_shards, timeout=120)


def _unmade_batch(rank: int, world: int, failing: list[int]) -> None:
    sharded = ShardedEmbeddingBagCollection(TABLES, EmbeddingOptimizerConfig())
    keys = [f for t in TABLES for f in t.feature_names]
    start, stop = local_batch_bounds(6, rank, world)
    lengths, values, _ = global_batch(0, 6, TABLES, False)
    kjt = to_kjt(keys, lengths, values, None, start, stop)
    good = sharded.input_dist(kjt)
    unmade = ValueError(f"day_{rank}.tsv:{10 + rank}: malformed Criteo line: label must be 0 or 1, got '2'")
    # The header a step ahead, as the loop may exchange it: a good batch's bags come in between, then the failure.
    pending = (sharded.input_dist.start_failed(unmade) if rank in failing
               else sharded.input_dist.start(kjt))
    torch.testing.assert_close(sharded.input_dist(kjt).values, good.values, rtol=0, atol=0)
    if rank in failing:  # its own error, the very one (file and line)
        with pytest.raises(ValueError, match=f"day_{rank}.tsv:{10 + rank}: malformed") as raised:
            sharded.input_dist.finish(pending)
        assert raised.value is unmade
    else:
        with pytest.raises(RuntimeError, match=r"rank 0: rank\(s\) \[1\] could not make their batch \(their error"):
            sharded.input_dist.finish(pending)
    # Nothing stayed behind: the next batch travels as before.
    torch.testing.assert_close(sharded.input_dist(kjt).values, good.values, rtol=0, atol=0)


@pytest.mark.parametrize("failing", [[1], [0, 1]], ids=["rank_1", "both"])
def test_a_batch_a_rank_could_not_make_raises_on_every_rank(failing):
    """start_failed sends a header saying "no batch" in the batch's place: the rank that could not make it raises
    its own error (file and line), the others one naming it; where every rank failed, each raises its own."""
    run_world(2, _unmade_batch, failing, timeout=120)


def test_values_longer_than_lengths_one_process():
    sharded = ShardedEmbeddingBagCollection(TABLES, EmbeddingOptimizerConfig())
    keys = [f for t in TABLES for f in t.feature_names]
    lengths, values, _ = global_batch(0, 4, TABLES, False)
    kjt = to_kjt(keys, lengths, values, None, 0, 4)
    longer = KeyedJaggedTensor(keys=keys, values=torch.cat([kjt.values(), torch.tensor([10**9])]),
                               lengths=kjt.lengths())
    with pytest.raises(ValueError, match=r"rank 0: the KeyedJaggedTensor has \d+ values but its lengths sum to"):
        sharded(longer)


def _int32_values_like_int64(rank: int, world: int, row_shards) -> None:
    keys = [f for t in TABLES for f in t.feature_names]
    lengths, values, weights = global_batch(3, 9, TABLES, True)
    start, stop = local_batch_bounds(9, rank, world)
    kjt = to_kjt(keys, lengths, values, weights, start, stop)
    narrow = KeyedJaggedTensor(keys=keys, values=kjt.values().int(), lengths=kjt.lengths(), weights=kjt.weights())
    sharded = ShardedEmbeddingBagCollection(TABLES, EmbeddingOptimizerConfig(),
                                            plan=plan_sharding(TABLES, world, row_shards=row_shards))
    wide, small = sharded.input_dist(kjt), sharded.input_dist(narrow)
    assert small.values.dtype == torch.int32 and small.lengths.dtype == wide.lengths.dtype
    assert torch.equal(small.values.long(), wide.values) and torch.equal(small.lengths, wide.lengths)
    assert torch.equal(small.weights, wide.weights) and small.feature_value_offsets == wide.feature_value_offsets


@pytest.mark.parametrize("row_shards", [1, {"t0": 3, "t3": 2}], ids=["whole", "row_blocks"])
def test_int32_values_travel_with_the_lengths_as_int64_ones_do(row_shards):
    """Lengths and values share one all-to-all, the lengths in the values' dtype for the trip: int32 indices give
    the owners the same bags (lengths back in their own dtype), weights alongside, 3 ranks with uneven batches;
    and so do int32 indices cut by row block."""
    run_world(3, _int32_values_like_int64, row_shards)


def _weights_on_rank_0_only(rank: int, world: int, is_weighted: bool | None, row_shards) -> None:
    sharded = ShardedEmbeddingBagCollection(TABLES, EmbeddingOptimizerConfig(), is_weighted=is_weighted,
                                            plan=plan_sharding(TABLES, world, row_shards=row_shards))
    keys = [f for t in TABLES for f in t.feature_names]
    lengths, values, weights = global_batch(0, 6, TABLES, True)
    start, stop = local_batch_bounds(6, rank, world)
    agreed = to_kjt(keys, lengths, values, weights if is_weighted else None, start, stop)  # alike on every rank
    good = sharded(agreed).values().clone()
    mixed = to_kjt(keys, lengths, values, weights if rank == 0 else None, start, stop)
    if is_weighted is False:  # ignored, as by torchrec's unweighted EBC: none travel
        torch.testing.assert_close(sharded(mixed).values(), good)
        return
    if is_weighted:  # rank 1 lacks what the collection needs
        message = (r"rank 1: the EmbeddingBagCollection is weighted \(is_weighted=True\) but the KeyedJaggedTensor "
                   r"has no weights" if rank == 1 else
                   r"rank 0: rank\(s\) \[1\] sent KeyedJaggedTensors without per-sample weights, but the "
                   r"EmbeddingBagCollection is weighted \(is_weighted=True\)")
    else:  # no rank is wrong alone: each names both sides
        message = rf"rank {rank}: rank\(s\) \[0\] sent per-sample weights and rank\(s\) \[1\] did not"
    with pytest.raises(ValueError, match=message):
        sharded(mixed)
    torch.testing.assert_close(sharded(agreed).values(), good)  # nothing stayed behind


@pytest.mark.parametrize("is_weighted,row_shards", [(None, 1), (None, {"t1": 2, "t3": 3}), (True, 1), (False, 1)],
                         ids=["per_batch", "per_batch_row_blocks", "weighted", "unweighted"])
def test_weights_on_some_ranks_raise_on_every_rank(is_weighted, row_shards):
    """Weights travel in an all-to-all of their own: the header says whose KJT has them, and where the ranks
    disagree (or a weighted collection gets none) every rank raises before it, instead of a collective mismatch
    (gloo aborts the process; NCCL hangs or reads garbage)."""
    run_world(2, _weights_on_rank_0_only, is_weighted, row_shards, timeout=120)


def _another_dtype_on_rank_1(rank: int, world: int, what: str, other: torch.dtype, row_shards) -> None:
    """Rank 1's `what` ("weights" or "indices") in dtype `other`: every rank raises naming both dtypes, and the
    next batch, alike on every rank, gives the bags it gave before."""
    sharded = ShardedEmbeddingBagCollection(TABLES, EmbeddingOptimizerConfig(),
                                            plan=plan_sharding(TABLES, world, row_shards=row_shards))
    keys = [f for t in TABLES for f in t.feature_names]
    lengths, values, weights = global_batch(0, 6, TABLES, what == "weights")
    start, stop = local_batch_bounds(6, rank, world)
    good = sharded(to_kjt(keys, lengths, values, weights, start, stop)).values().clone()
    tensors, dtypes = (weights, bh.WEIGHT_DTYPES) if what == "weights" else (values, bh.INDEX_DTYPES)
    changed = [t.to(other) for t in tensors] if rank == 1 else tensors
    mixed = to_kjt(keys, lengths, *((values, changed) if what == "weights" else (changed, weights)), start, stop)
    names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
    theirs = f"{str(other).removeprefix('torch.')} {what}" if other in dtypes else f"{what} of a dtype other than"
    with pytest.raises(ValueError, match=rf"rank {rank}: {what} must be of one of {names}, the same on every rank "
                                         rf"\(rank 0: {str(dtypes[0]).removeprefix('torch.')} {what}, rank 1: "
                                         rf"{theirs}"):
        sharded(mixed)
    torch.testing.assert_close(sharded(to_kjt(keys, lengths, values, weights, start, stop)).values(), good)


@pytest.mark.parametrize("what,other,row_shards", [
    ("weights", torch.float16, 1), ("weights", torch.int64, 1), ("weights", torch.float16, {"t1": 2}),
    ("indices", torch.int32, 1), ("indices", torch.int16, 1), ("indices", torch.bool, {"t1": 2})],
    ids=["weights_float16", "weights_int64", "weights_float16_row_blocks", "indices_int32", "indices_int16",
         "indices_bool_row_blocks"])
def test_another_dtype_on_one_rank_raises_on_every_rank(what, other, row_shards):
    """The weights' all-to-all, and the one of lengths and values, size their buffers in each rank's own dtype:
    weights or indices of another dtype on one rank (int32 against int64 indices: gloo aborted the process, a peer
    read garbage offsets), or of no supported dtype, make every rank raise before them, naming each rank's dtype.
    Bool indices cut by row block: the cut's rebase subtracted from the bool tensor, which torch refuses, so rank 1
    raised alone in `start` and rank 0 waited in the header's all-to-all."""
    run_world(2, _another_dtype_on_rank_1, what, other, row_shards, timeout=120)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="CPU bags: the kernel in the interpreter")
def test_strided_weights_reach_the_kernels_packed():
    """The GPU kernels (pooled lookup, embedding backward, fused exchange) read a bag's weight i at weights_ptr + i.
    In a world of one with the KJT's keys in the tables' order the weights take no regroup and no all-to-all: a KJT's
    strided weights (a column of (weight, other) pairs) were the bags' own, and the kernel pooled with the other
    column's NaNs. The kernel (Triton's interpreter on the CPU) against the CPU lookup of the same bags."""
    sharded = ShardedEmbeddingBagCollection(SUM_TABLES, EmbeddingOptimizerConfig(), is_weighted=True)
    keys = [f for t in SUM_TABLES for f in t.feature_names]
    lengths, values, weights = global_batch(0, 5, SUM_TABLES, True)
    kjt = to_kjt(keys, lengths, values, weights, 0, 5)
    pairs = torch.stack([kjt.weights(), torch.full_like(kjt.weights(), float("nan"))], dim=1)
    bags = sharded.input_dist(KeyedJaggedTensor(keys=keys, values=kjt.values(), lengths=kjt.lengths(),
                                                weights=pairs[:, 0]))
    sharded.lookup.kernel_programs = 4  # (its default counts a GPU's SMs)
    with torch.no_grad():
        torch.testing.assert_close(sharded.lookup._pool_with_kernel(bags), sharded.lookup.pool(bags))
