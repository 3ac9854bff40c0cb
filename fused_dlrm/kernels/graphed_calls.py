"""A function of tensors that makes tensors, replayed as a CUDA graph once it repeats: the host's time of many
launches becomes one replay, plus a copy of each input.

`GraphedCalls(key, fn, inputs)` runs `fn(*inputs)`. The caller names a call by a key that determines everything
fn does besides the inputs' values: shapes, dtypes, and the addresses of the tensors fn reads that are not inputs
(parameters, buffers). The first call of a key runs fn; the second captures fn on the graph's own copies of the
inputs (`launch.capture_graph`, a memory pool of its own) and replays it; later calls copy their inputs into those
copies and replay. fn's outputs are then the graph's own tensors, rewritten by every replay of that key.

Outputs that must outlive the call (a training forward's, which its backward reads) are held by a `Lease` that
the caller keeps with them and releases once done with them. While a key's lease is held (not released, not
dropped), that key runs fn on new tensors instead: a second forward before the first one's backward (activation
recomputation, pipeline micro-batches) never overwrites what the first one's backward will read. `Lease.check`
raises if the outputs were rewritten anyway (a backward that comes again after a later replay, say).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Callable, Hashable

import torch

from fused_dlrm.kernels.launch import RecentKeys, capture_graph


class Lease:
    """A replay's outputs in use beyond the call (see the module docstring)."""

    def __init__(self, graph: _Graph | None = None):
        self.released = False
        self._graph, self._replay = graph, graph.replays if graph is not None else 0

    def check(self) -> None:
        """Raise if the graph has replayed since these outputs were made (they hold another call's values)."""
        if self._graph is not None and self._graph.replays != self._replay:
            raise RuntimeError("a CUDA graph's outputs were rewritten by a later call before this one's backward was "
                               "done (a backward run again after the layer's next forward?)")

    def release(self) -> None:
        self.released = True


def held(lease: weakref.ref | None) -> bool:
    """Whether the Lease behind this weak reference (None: none) is still held: neither released nor dropped."""
    lease = lease() if lease is not None else None
    return lease is not None and not lease.released


@dataclass
class _Graph:
    graph: Any  # torch.cuda.CUDAGraph
    inputs: tuple[torch.Tensor, ...]  # the graph's own copies
    outputs: Any
    replays: int = 0
    lease: weakref.ref | None = None  # the last replay's, if held

    def in_use(self) -> bool:
        return held(self.lease)


class GraphedCalls:
    """CUDA graphs of a function's calls by key (see the module docstring). At most `max_graphs` are kept, each
    holding its outputs' memory between calls (a training MoE layer's h and a13: activation memory that eager
    calls would hand back to the allocator after the backward); once they are, other keys run without a graph
    (dropping one for another would capture anew at every call when more keys take turns). `clear` drops them all
    (keys that cannot come again). Keys seen once are remembered up to 4 x max_graphs, the oldest forgotten."""

    def __init__(self, max_graphs: int = 4):
        self.max_graphs = max_graphs
        self._graphs: dict[Hashable, _Graph] = {}
        self._seen = RecentKeys(4 * max_graphs)

    def __call__(self, key: Hashable, fn: Callable[..., Any], inputs: tuple[torch.Tensor, ...], hold: bool = False
                 ) -> tuple[Any, Lease | None]:
        """fn(*inputs), or its graph's replay -> (outputs, a Lease on them if `hold`, else None). Inside a caller's
        own graph capture fn runs (and is captured into the caller's graph)."""
        if _capturing():
            return fn(*inputs), Lease() if hold else None
        graph = self._graphs.get(key)
        if graph is not None and graph.in_use():
            graph = None  # its outputs are still someone's: run on new tensors
        elif graph is not None:
            for own, given in zip(graph.inputs, inputs):
                own.copy_(given)
        elif key in self._seen and len(self._graphs) < self.max_graphs:
            graph = self._graphs[key] = _Graph(*_capture(fn, inputs))  # its copies hold these inputs already
        if graph is None:
            self._seen.add(key)
            return fn(*inputs), Lease() if hold else None
        graph.graph.replay()
        graph.replays += 1
        lease = Lease(graph) if hold else None
        graph.lease = weakref.ref(lease) if hold else None
        return graph.outputs, lease

    def clear(self) -> None:
        """Drop every graph (outputs still held stay valid: they keep their memory) and every key seen."""
        self._graphs.clear()
        self._seen.clear()

    def __len__(self) -> int:
        return len(self._graphs)


def _capturing() -> bool:
    """Whether this thread's current CUDA stream is being captured into a graph (never without CUDA)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _capture(fn: Callable[..., Any], inputs: tuple[torch.Tensor, ...]) -> tuple[Any, tuple[torch.Tensor, ...], Any]:
    """fn's work on copies of the inputs, captured (not run) into a graph of its own memory pool
    (launch.capture_graph) -> (graph, the copies, fn's outputs)."""
    own = tuple(t.clone() for t in inputs)
    outputs = []
    graph = capture_graph(lambda: outputs.append(fn(*own)))
    return graph, own, outputs[0]
