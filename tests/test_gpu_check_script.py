"""scripts/gpu_check.sh runs every GPU test file: CI has no GPU, so a file missing from its list would never run
anywhere (tests/test_moe_graphs_gpu.py was, until 2026-11-26)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_gpu_test_file_is_a_step_of_gpu_check():
    script = (ROOT / "scripts" / "gpu_check.sh").read_text()
    listed = set(re.search(r'^GPU_TESTS="([^"]*)"', script, re.MULTILINE).group(1).split())
    files = {p.name[len("test_"):-len("_gpu.py")] for p in (ROOT / "tests").glob("test_*_gpu.py")}
    assert files, "no GPU test files found"
    assert files == listed, f"missing from GPU_TESTS: {sorted(files - listed)}; not a file: {sorted(listed - files)}"
