"""Batches made ahead by a thread of their own, on the device the step runs on.

Making a batch costs the host milliseconds at paper scale (the synthetic generator launches a few dozen GPU ops
and waits once for its value count; a file batch is parsed and pinned), the same host that enqueues the training
step. A thread makes the next `depth` batches instead: torch releases the GIL inside its ops, so the two threads'
launches overlap. On GPUs the thread works on a stream of its own and each batch comes with an event that the
consumer's stream waits on; on the CPU the thread only runs ahead.

Batches come out in the order of the stream, whatever the timing: the data of a step does not change. An error
raised while making a batch (a missing file, a malformed line) is raised again by the `next()` that would have
returned that batch.

`prepare(batch)`, when given, runs on the thread after the batch is on the device (the DLRM loop distributes the
batch's input there: ShardedEmbeddingBagCollection.input_dist_on_thread). It may hold collectives, which every
rank must run on the same batches: `close()` lets the thread run on, unqueued, to a batch count that is the same
on every rank closed at the same step (see close). Making a batch (pulling it from `batches`) may fail on one rank
alone, as each rank makes its own slice (a malformed line in this rank's); the peers' `prepare` of that batch
would then wait in collectives that this rank never joins. So `prepare_failed(error)`, when given, runs in that
batch's place before the error ends the thread: the DLRM loop's tells the same input dist that this rank has no
batch, and the `prepare` of that batch raises on every rank (here the error itself, re-raised by the input dist).
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Callable, Iterator

import torch
from torchrec.datasets.utils import Batch

from fused_dlrm.dist.env import input_stream
from fused_dlrm.train.build import to_device

_END = object()


class BatchesAhead:
    """Iterator over (epoch, batch on `device`) from `batches` (host or device batches), made `depth` ahead."""

    def __init__(self, batches: Iterator[tuple[int, Batch]], device: torch.device, depth: int = 2,
                 prepare: Callable[[Batch], None] | None = None,
                 prepare_failed: Callable[[Exception], None] | None = None):
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        if device.type == "cuda" and device.index is None:  # "cuda": the caller's GPU, which the thread must set
            device = torch.device("cuda", torch.cuda.current_device())  # by index (set_device refuses "cuda")
        self.device = device
        self.depth = depth
        self._prepare, self._prepare_failed = prepare, prepare_failed
        self._made = 0  # batches made (and prepared) by the thread
        self._consumed = 0  # batches handed out by next()
        self._made_by_close = 0  # set by close(): the thread makes this many in all before it ends
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._closed = threading.Event()
        self._stream = input_stream(device) if device.type == "cuda" else None
        if self._stream is not None:  # once: the data set-up enqueued on the current stream is complete
            self._stream.wait_stream(torch.cuda.current_stream(device))
        self._thread = threading.Thread(target=self._produce, args=(batches,), name="batches-ahead", daemon=True)
        self._thread.start()

    def _produce(self, batches: Iterator[tuple[int, Batch]]) -> None:
        try:
            if self._stream is not None:
                torch.cuda.set_device(self.device)  # the current device is per thread
            with torch.cuda.stream(self._stream):  # torch.cuda.stream(None) does nothing
                batches = self._pulled(batches)
                for epoch, batch in batches:
                    if not self._put(self._make(epoch, batch)):
                        break
                else:
                    self._put(_END)
                    return
                # Closed: with `prepare`, make (unqueued) up to the count every rank's thread reaches (close()).
                for epoch, batch in itertools.islice(batches, max(0, self._made_by_close - self._made)):
                    self._make(epoch, batch)
        except BaseException as error:  # noqa: BLE001: handed to the consumer, raised there (dropped once closed)
            self._put(error)

    def _pulled(self, batches: Iterator[tuple[int, Batch]]) -> Iterator[tuple[int, Batch]]:
        """`batches` on the device; where making one raises here (pulling it, or its copy to the device: a malformed
        line, memory), `prepare_failed` first runs in its place."""
        while True:
            try:
                epoch, batch = next(batches)
                made = epoch, to_device(batch, self.device)
            except StopIteration:
                return
            except Exception as error:
                if self._prepare_failed is not None:
                    self._prepare_failed(error)
                raise
            yield made

    def _make(self, epoch: int, batch: Batch) -> tuple[int, Batch, torch.cuda.Event | None]:
        ready = None
        if self._prepare is not None:
            self._prepare(batch)
        self._made += 1
        if self._stream is not None:
            ready = torch.cuda.Event()
            ready.record(self._stream)
        return epoch, batch, ready

    def _put(self, item) -> bool:
        """Queue `item` unless closed meanwhile (then False): a full queue must not keep the thread alive."""
        while not self._closed.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self) -> BatchesAhead:
        return self

    def __next__(self) -> tuple[int, Batch]:
        item = self._queue.get()
        if item is _END:
            self._queue.put(_END)  # every later next() ends too
            raise StopIteration
        if isinstance(item, BaseException):
            self._queue.put(item)  # the thread has ended: every later next() raises it too
            raise item
        epoch, batch, ready = item
        self._consumed += 1
        if ready is not None:
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(ready)
            batch.record_stream(stream)  # made on the thread's stream: its memory is not reused before this use
        return epoch, batch

    def close(self) -> None:
        """Stop the thread (it may be waiting to queue a batch) and drop the batches made ahead.

        With `prepare`, the thread first makes batches up to `consumed + depth + 1` in all (or the stream's end):
        it never makes more than that (it makes a batch only after queueing the one before, into a queue of
        `depth`), and ranks closed after the same number of steps reach the same count, so every collective that
        one rank's `prepare` started is matched on the others instead of waiting for them forever. A batch that this
        rank could not make counts as made (`prepare_failed` ran the collectives in its place); the thread ends at
        it, and so do the peers' (their `prepare` of it raised)."""
        self._made_by_close = self._consumed + self.depth + 1 if self._prepare is not None else 0
        self._closed.set()
        self._thread.join()
        while not self._queue.empty():
            self._queue.get_nowait()

    def __enter__(self) -> BatchesAhead:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
