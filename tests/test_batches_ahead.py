"""BatchesAhead: the thread that makes batches ahead keeps their order, hands errors on and stops when closed."""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.distributed as dist
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from fused_dlrm.train import batches_ahead
from fused_dlrm.train.batches_ahead import BatchesAhead
from world import run_world

CPU = torch.device("cpu")


def batch(step: int) -> Batch:
    kjt = KeyedJaggedTensor(keys=["f"], values=torch.tensor([step]), lengths=torch.tensor([1]))
    return Batch(dense_features=torch.full((1, 1), float(step)), sparse_features=kjt, labels=torch.zeros(1))


def test_order_and_end_of_stream():
    stream = ((s // 3, batch(s)) for s in range(7))
    with BatchesAhead(stream, CPU, depth=2) as ahead:
        got = [(epoch, int(b.dense_features)) for epoch, b in ahead]
        assert got == [(s // 3, s) for s in range(7)]
        with pytest.raises(StopIteration):  # and again: the end is sticky
            next(ahead)


def test_an_error_reaches_the_consumer_at_its_batch():
    def stream():
        yield 0, batch(0)
        raise FileNotFoundError("no such file: part-1.tsv")

    with BatchesAhead(stream(), CPU) as ahead:
        assert int(next(ahead)[1].dense_features) == 0
        for _ in range(2):  # the thread has ended: every later next() raises it again, none hangs
            with pytest.raises(FileNotFoundError, match="part-1.tsv"):
                next(ahead)


def test_close_stops_a_thread_waiting_on_a_full_queue():
    made = []

    def endless():
        step = 0
        while True:
            made.append(step)
            yield 0, batch(step)
            step += 1

    ahead = BatchesAhead(endless(), CPU, depth=2)
    assert int(next(ahead)[1].dense_features) == 0
    ahead.close()
    assert not any(t.name == "batches-ahead" and t.is_alive() for t in threading.enumerate())
    assert len(made) <= 4  # depth ahead of the consumer, not the whole stream


def test_depth_must_be_positive():
    with pytest.raises(ValueError, match="depth must be >= 1"):
        BatchesAhead(iter([]), CPU, depth=0)


def test_prepare_runs_on_the_thread_before_its_batch_is_handed_out():
    prepared = []

    def prepare(b: Batch) -> None:
        assert threading.current_thread().name == "batches-ahead"
        prepared.append(int(b.dense_features))

    with BatchesAhead(((0, batch(s)) for s in range(5)), CPU, depth=2, prepare=prepare) as ahead:
        for step in range(5):
            _, b = next(ahead)
            assert int(b.dense_features) == step and step in prepared
    assert prepared == list(range(5))


def test_an_error_in_prepare_reaches_the_consumer_at_its_batch():
    def prepare(b: Batch) -> None:
        if int(b.dense_features) == 1:
            raise IndexError("rank 0: feature 'f' has index 7, outside table 't' of 5 rows")

    with BatchesAhead(((0, batch(s)) for s in range(4)), CPU, prepare=prepare) as ahead:
        assert int(next(ahead)[1].dense_features) == 0
        with pytest.raises(IndexError, match="index 7"):
            next(ahead)


def _close_matches_collectives(rank: int, world: int) -> None:
    """Each rank's prepare runs a collective, at its own pace; both close after 3 batches: no rank is left waiting
    in a collective that the other never joins, and both made the same number of batches."""
    made = []

    def prepare(b: Batch) -> None:
        time.sleep(0.05 * rank)  # rank 1's thread lags: at close it has made fewer batches than rank 0's
        total = b.dense_features.clone()
        dist.all_reduce(total)
        assert float(total) == world * float(b.dense_features)  # the same batch on both ranks
        made.append(int(b.dense_features))

    stream = ((0, batch(s)) for s in range(100))
    ahead = BatchesAhead(stream, CPU, depth=2, prepare=prepare)
    for step in range(3):
        assert int(next(ahead)[1].dense_features) == step
    if rank == 0:
        time.sleep(0.5)  # rank 0's thread has filled its queue and waits to queue one more
    ahead.close()
    assert made == list(range(3 + 2 + 1))


def test_close_runs_prepare_to_the_same_batch_on_every_rank():
    run_world(2, _close_matches_collectives)


def _failure_matches_collectives(rank: int, world: int) -> None:
    """As the input dist: prepare's collective carries "I have a batch", prepare_failed's "I have none" in its
    place, and a prepare that hears of a peer without a batch raises."""
    calls = []

    def prepare(b: Batch) -> None:
        have = torch.ones(1)
        dist.all_reduce(have)
        calls.append(int(b.dense_features))
        if int(have) < world:
            raise RuntimeError(f"rank {rank}: a peer could not make batch {int(b.dense_features)}")

    def prepare_failed(error: Exception) -> None:
        assert threading.current_thread().name == "batches-ahead"
        dist.all_reduce(torch.zeros(1))
        calls.append(error)
        raise error

    def stream():  # rank 1 cannot make batch 4
        for s in range(100):
            if rank == 1 and s == 4:
                raise ValueError("part-0.tsv:77: malformed Criteo line")
            yield 0, batch(s)

    # Consumed to the batch rank 1 could not make: both raise there, each its own error.
    with BatchesAhead(stream(), CPU, depth=2, prepare=prepare, prepare_failed=prepare_failed) as ahead:
        assert [int(next(ahead)[1].dense_features) for _ in range(4)] == [0, 1, 2, 3]
        with pytest.raises(ValueError if rank == 1 else RuntimeError, match="part-0.tsv:77" if rank == 1 else
                           "rank 0: a peer could not make batch 4"):
            next(ahead)
    assert calls[:4] == [0, 1, 2, 3] and len(calls) == 5
    assert calls[4] == 4 if rank == 0 else isinstance(calls[4], ValueError)  # prepared, or failed in its place
    # Closed after 3 batches: the thread runs on to 3 + 2 + 1, past batch 4, which it reaches on both ranks alike.
    calls.clear()
    ahead = BatchesAhead(stream(), CPU, depth=2, prepare=prepare, prepare_failed=prepare_failed)
    for step in range(3):
        assert int(next(ahead)[1].dense_features) == step
    ahead.close()
    assert calls[:4] == [0, 1, 2, 3] and len(calls) == 5


def test_a_batch_one_rank_could_not_make_runs_prepare_failed_in_its_place():
    run_world(2, _failure_matches_collectives, timeout=120)


def test_a_failed_copy_to_the_device_runs_prepare_failed_in_its_place(monkeypatch):
    """The copy to the device is part of making a batch: where it fails (memory), the peers' prepare of that batch
    must not wait for this rank either."""
    copy = batches_ahead.to_device

    def failing_copy(b: Batch, device: torch.device) -> Batch:
        if int(b.dense_features) == 2:
            raise RuntimeError("CUDA out of memory (pinning batch 2)")
        return copy(b, device)

    monkeypatch.setattr(batches_ahead, "to_device", failing_copy)
    prepared, failed = [], []
    with BatchesAhead(((0, batch(s)) for s in range(5)), CPU, depth=2,
                      prepare=lambda b: prepared.append(int(b.dense_features)), prepare_failed=failed.append) as ahead:
        assert [int(next(ahead)[1].dense_features) for _ in range(2)] == [0, 1]
        with pytest.raises(RuntimeError, match="pinning batch 2"):
            next(ahead)
    assert prepared == [0, 1] and [str(e) for e in failed] == ["CUDA out of memory (pinning batch 2)"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_gpus_the_batches_are_made_on_a_high_priority_stream():
    """The input side's stream outranks the step's (dist/env.py input_stream), and the batches still arrive whole;
    an unindexed "cuda" is the caller's GPU (the thread sets it by index)."""
    device = torch.device("cuda")
    with BatchesAhead(((0, batch(s)) for s in range(3)), device) as ahead:
        assert ahead._stream.priority < torch.cuda.current_stream(device).priority
        assert [int(b.dense_features) for _, b in ahead] == [0, 1, 2]
