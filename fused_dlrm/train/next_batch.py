"""The next batch, made by a worker thread while the training thread enqueues the current step.

Making a batch costs the host milliseconds at paper scale (the synthetic generator launches a few dozen GPU ops
and waits once for its value count; a file batch is parsed, pinned and copied), and so does its input all-to-all
(a few dozen launches and a wait for the sizes, which is also a wait for the slowest rank). The host that enqueues
the training step is the bound of a step at that scale, so both run on a thread of their own: torch releases the
GIL inside its ops and waits, and the two threads' launches overlap. On GPUs the worker uses a stream of its own;
the batch comes with an event that the consumer's stream waits on.

The worker makes a batch only when asked (`request`), one at a time, so every rank issues the same input
all-to-alls in the same order, and none is left half-issued when training stops. An error raised while making a
batch (a missing file, a malformed line, an out-of-range index) is raised by the `take()` that would have returned
that batch.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator

import torch
from torchrec.datasets.utils import Batch

from fused_dlrm.train.build import to_device


class NextBatch:
    """Batches of `batches` ((epoch, batch) on the host or the device) made on `device` by one worker thread.

    prepare(epoch, batch, *args) runs on the worker after the batch is made, with the worker's stream current
    (the loop issues the batch's input all-to-all there)."""

    def __init__(self, batches: Iterator[tuple[int, Batch]], device: torch.device,
                 prepare: Callable[..., None] = lambda epoch, batch: None):
        self.device, self._batches, self._prepare = device, batches, prepare
        self._stream = None
        if device.type == "cuda":
            self._stream = torch.cuda.Stream(device)
            self._stream.wait_stream(torch.cuda.current_stream(device))  # once: the set-up so far is complete
        self._requests: queue.Queue = queue.Queue()
        self._results: queue.Queue = queue.Queue()
        self._requested = False
        # A daemon thread: after an error elsewhere, a worker stuck in a collective that a failed rank never joins
        # must not keep the process from exiting.
        self._worker = threading.Thread(target=self._serve, name="next-batch", daemon=True)
        self._worker.start()

    def _serve(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # the current device is per thread: "cuda" must mean this rank's
        while (args := self._requests.get()) is not None:
            try:
                self._results.put((True, self._make(*args)))
            except BaseException as error:  # noqa: BLE001: handed to the training thread, raised there
                self._results.put((False, error))

    def request(self, *args) -> None:
        """Start making the next batch (prepare gets `args`); `take()` returns it."""
        if self._requested:
            raise RuntimeError("the previous batch was not taken: one batch is made at a time")
        if not self._worker.is_alive():
            raise RuntimeError("the batch worker was closed")
        self._requested = True
        self._requests.put(args)

    def _make(self, *args):
        with torch.cuda.stream(self._stream):  # torch.cuda.stream(None) does nothing
            epoch, batch = next(self._batches)
            batch = to_device(batch, self.device)
            self._prepare(epoch, batch, *args)
            ready = None
            if self._stream is not None:
                ready = torch.cuda.Event()
                ready.record()
        return epoch, batch, ready

    def take(self) -> tuple[int, Batch]:
        """The requested batch, once made (the worker's error, if it failed); the current stream waits for it."""
        if not self._requested:
            raise RuntimeError("no batch was requested")
        self._requested = False
        made, result = self._results.get()
        if not made:
            raise result
        epoch, batch, ready = result
        if ready is not None:
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(ready)
            batch.record_stream(stream)  # made on the worker's stream: its memory is not reused before this use
        return epoch, batch

    def close(self, wait: bool = True) -> None:
        """Stop the worker once a batch still being made is done (wait=True: its collectives complete on every
        rank that also requested it), or without waiting for it."""
        self._requests.put(None)
        if wait:
            self._worker.join()

    def __enter__(self) -> NextBatch:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.close(wait=exc_type is None)
