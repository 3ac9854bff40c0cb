"""BatchesAhead: the thread that makes batches ahead keeps their order, hands errors on and stops when closed."""

from __future__ import annotations

import threading

import pytest
import torch
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from fused_dlrm.train.batches_ahead import BatchesAhead

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
