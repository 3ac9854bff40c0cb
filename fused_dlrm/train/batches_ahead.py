"""Batches made ahead by a thread of their own, on the device the step runs on.

Making a batch costs the host milliseconds at paper scale (the synthetic generator launches a few dozen GPU ops
and waits once for its value count; a file batch is parsed and pinned), the same host that enqueues the training
step. A thread makes the next `depth` batches instead: torch releases the GIL inside its ops, so the two threads'
launches overlap. On GPUs the thread works on a stream of its own and each batch comes with an event that the
consumer's stream waits on; on the CPU the thread only runs ahead.

Batches come out in the order of the stream, whatever the timing: the data of a step does not change. An error
raised while making a batch (a missing file, a malformed line) is raised again by the `next()` that would have
returned that batch.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator

import torch
from torchrec.datasets.utils import Batch

from fused_dlrm.train.build import to_device

_END = object()


class BatchesAhead:
    """Iterator over (epoch, batch on `device`) from `batches` (host or device batches), made `depth` ahead."""

    def __init__(self, batches: Iterator[tuple[int, Batch]], device: torch.device, depth: int = 2):
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self.device = device
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._closed = threading.Event()
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        if self._stream is not None:  # once: the data set-up enqueued on the current stream is complete
            self._stream.wait_stream(torch.cuda.current_stream(device))
        self._thread = threading.Thread(target=self._produce, args=(batches,), name="batches-ahead", daemon=True)
        self._thread.start()

    def _produce(self, batches: Iterator[tuple[int, Batch]]) -> None:
        try:
            if self._stream is not None:
                torch.cuda.set_device(self.device)  # the current device is per thread ("cuda" means this one)
            with torch.cuda.stream(self._stream):  # torch.cuda.stream(None) does nothing
                for epoch, batch in batches:
                    batch, ready = to_device(batch, self.device), None
                    if self._stream is not None:
                        ready = torch.cuda.Event()
                        ready.record(self._stream)
                    if not self._put((epoch, batch, ready)):
                        return
        except BaseException as error:  # noqa: BLE001: handed to the consumer, raised there
            self._put(error)
            return
        self._put(_END)

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
        if ready is not None:
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(ready)
            batch.record_stream(stream)  # made on the thread's stream: its memory is not reused before this use
        return epoch, batch

    def close(self) -> None:
        """Stop the thread (it may be waiting to queue a batch) and drop the batches made ahead."""
        self._closed.set()
        self._thread.join()
        while not self._queue.empty():
            self._queue.get_nowait()

    def __enter__(self) -> BatchesAhead:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
