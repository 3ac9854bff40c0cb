"""capture_graph (kernels/launch.py) on ONE GPU (skipped without one): a capture may use memory that the caching
allocator's default pool holds unused, as the MoE Transformer's first evaluation needed on 80 GB H100s."""

from __future__ import annotations

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
