"""scripts/gpu_check.sh runs every GPU test: CI has no GPU, so a file missing from its list would never run
anywhere (tests/test_moe_graphs_gpu.py was, until 2026-11-26; four GPU tests inside CPU test files were, until
2026-11-28)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _listed(name: str) -> set[str]:
    script = (ROOT / "scripts" / "gpu_check.sh").read_text()
    return set(re.search(rf'^{name}="([^"]*)"', script, re.MULTILINE).group(1).split())


def test_every_gpu_test_file_is_a_step_of_gpu_check():
    listed = _listed("GPU_TESTS")
    files = {p.name[len("test_"):-len("_gpu.py")] for p in (ROOT / "tests").glob("test_*_gpu.py")}
    assert files, "no GPU test files found"
    assert files == listed, f"missing from GPU_TESTS: {sorted(files - listed)}; not a file: {sorted(listed - files)}"


def _gpu_only_tests(path: Path) -> list[str]:
    """The test functions of a file that a skipif on CUDA guards (CI skips them)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
            for decorator in node.decorator_list:
                text = ast.unparse(decorator)
                if "skipif" in text and "cuda" in text:
                    found.append(node.name)
    return found


def test_every_gpu_test_in_a_cpu_test_file_is_run_by_gpu_check():
    """CPU test files holding GPU tests are listed in GPU_CASES, whose step selects tests by "gpu" in the name."""
    cases = {}
    for path in (ROOT / "tests").glob("test_*.py"):
        if not path.name.endswith("_gpu.py") and (names := _gpu_only_tests(path)):
            cases[path.name[len("test_"):-len(".py")]] = names
    assert cases, "no GPU tests found in CPU test files (the scan is broken?)"
    assert set(cases) == _listed("GPU_CASES"), (sorted(cases), sorted(_listed("GPU_CASES")))
    unselected = [f"{f}: {n}" for f, names in cases.items() for n in names if "gpu" not in n]
    assert not unselected, f"not selected by -k gpu: {unselected}"
