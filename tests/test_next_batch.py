"""NextBatch: the worker makes the requested batch in order, hands errors on, and never outlives a failed run."""

from __future__ import annotations

import threading

import pytest
import torch
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from fused_dlrm.train.next_batch import NextBatch

CPU = torch.device("cpu")


def batch(step: int) -> Batch:
    kjt = KeyedJaggedTensor(keys=["f"], values=torch.tensor([step]), lengths=torch.tensor([1]))
    return Batch(dense_features=torch.full((1, 1), float(step)), sparse_features=kjt, labels=torch.zeros(1))


def test_batches_in_order_and_prepare_on_the_worker():
    prepared = []

    def prepare(epoch, b, used_at):
        prepared.append((int(b.dense_features), used_at, threading.current_thread().name))

    with NextBatch(((s // 3, batch(s)) for s in range(5)), CPU, prepare) as next_batch:
        got = []
        for step in range(5):
            next_batch.request(step + 10)
            epoch, b = next_batch.take()
            got.append((epoch, int(b.dense_features)))
    assert got == [(s // 3, s) for s in range(5)]
    assert prepared == [(s, s + 10, "next-batch") for s in range(5)]


def test_one_batch_at_a_time():
    with NextBatch(((0, batch(s)) for s in range(3)), CPU) as next_batch:
        with pytest.raises(RuntimeError, match="no batch was requested"):
            next_batch.take()
        next_batch.request()
        with pytest.raises(RuntimeError, match="the previous batch was not taken"):
            next_batch.request()
        assert int(next_batch.take()[1].dense_features) == 0


def test_errors_reach_the_training_thread_at_their_batch():
    def stream():
        yield 0, batch(0)
        raise FileNotFoundError("no such file: part-1.tsv")

    def prepare(epoch, b):
        if int(b.dense_features) == 0:
            raise IndexError("rank 0: feature 'f' has index 7, outside table 't' of 5 rows")

    with NextBatch(stream(), CPU, prepare) as next_batch:
        next_batch.request()
        with pytest.raises(IndexError, match="index 7"):
            next_batch.take()
        next_batch.request()  # the worker still serves
        with pytest.raises(FileNotFoundError, match="part-1.tsv"):
            next_batch.take()
        next_batch.request()  # the exhausted stream ends as such
        with pytest.raises(StopIteration):
            next_batch.take()


def test_a_failed_run_does_not_wait_for_a_stuck_worker():
    never = threading.Event()

    def stuck():  # as a worker waiting in a collective that a failed peer never joins
        never.wait()
        yield 0, batch(0)

    with pytest.raises(ValueError, match="NaN loss"):
        with NextBatch(stuck(), CPU) as next_batch:
            next_batch.request()
            raise ValueError("NaN loss at step 3")  # the with exits at once; the daemon worker is left behind
    never.set()
