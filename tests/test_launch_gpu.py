"""capture_graph (kernels/launch.py) on ONE GPU (skipped without one): a capture may use memory that the caching
allocator's default pool holds unused, as the MoE Transformer's first evaluation needed on 80 GB H100s; no garbage
collection runs inside a capture."""

from __future__ import annotations

import gc

import pytest
import torch

from fused_dlrm.kernels.launch import capture_graph

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


def test_a_capture_takes_memory_the_default_pool_caches():
    torch.cuda.empty_cache()
    free = torch.cuda.mem_get_info()[0]
    cached = torch.empty(int(free * 0.8) // 4, device="cuda")  # freed below: kept by the default pool, unused
    del cached
    assert torch.cuda.memory_reserved() >= int(free * 0.8) // 4 * 4  # the pool holds it
    outputs = []
    graph = capture_graph(lambda: outputs.append(torch.full((int(free * 0.5) // 4,), 3.0, device="cuda")))
    graph.replay()  # a graph's pool holds more than the device had free with the cache held
    assert outputs[0].eq(3.0).all()


class _Cycle:
    """Garbage that only a collection frees: it refers to itself."""

    def __init__(self, graph: torch.cuda.CUDAGraph):
        self.self, self.graph = self, graph


def test_no_collection_destroys_a_graph_inside_a_capture():
    """A CUDA graph held only by a reference cycle (an earlier run's ArchNode and ArchGraph hold each other) is
    garbage; destroying it while a stream captures is not permitted and invalidates the capture. The captured work
    here makes such garbage, then allocates with a collection due at every allocation: the capture still succeeds
    and replays its work."""
    x = torch.ones(4, device="cuda")
    earlier = [capture_graph(lambda: x.mul_(2))]

    kept = []

    def launch() -> None:
        _Cycle(earlier.pop())  # garbage from here on, the graph with it
        for _ in range(100):
            x.add_(1)
            kept.append([])  # an allocation kept: each is due a collection

    threshold = gc.get_threshold()
    gc.set_threshold(1)
    try:
        graph = capture_graph(launch)
    finally:
        gc.set_threshold(*threshold)
    assert x.eq(1).all()  # captured, not run
    graph.replay()
    assert x.eq(101).all()
