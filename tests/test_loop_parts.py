"""scripts/loop_parts.py: train.py's DLRM loop timed in its parts, on the CPU (one rank, a small model)."""
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _run(tmp_path, *overrides: str, **env: str) -> subprocess.CompletedProcess:
    # trainer.device=cpu: on a GPU machine the loop would take the direct step, which has no forward or backward
    # of its own to time (nan)
    args = ["trainer.device=cpu", "model.num_rows=2000", "data.num_sparse=8", "data.global_batch_size=64", "trainer.progress=false",
            "trainer.eval_every=0", "trainer.checkpoint_every=0", f"hydra.run.dir={tmp_path}", *overrides]
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "loop_parts.py"), *args], capture_output=True,
                          text=True, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1", **env}, timeout=300)


def _report(stdout: str) -> dict[str, float]:
    line = next(l for l in stdout.splitlines() if l.startswith("== rank 0, ms per step"))
    names = {"wall": r"wall ([\d.]+)", "train_step": r"train_step ([\d.]+)", "forward": r"forward ([\d.]+)",
             "backward": r"backward ([\d.]+) with", "embedding_backward": r"embedding backward ([\d.]+)",
             "rest": r"rest (-?[\d.]+)", "outside": r"outside ([\d.]+)", "header_start": r"header start ([\d.]+)",
             "pull": r"made and copied ([\d.]+)", "pull_cpu": r"made and copied [\d.]+ \(CPU ([\d.]+)\)",
             "batch": r"then prepared ([\d.]+)", "batch_cpu": r"then prepared [\d.]+ \(CPU ([\d.]+)\)"}
    return {k: float(re.search(pattern, line).group(1)) for k, pattern in names.items()}


def test_the_step_is_split_into_its_parts(tmp_path):
    run = _run(tmp_path, "trainer.max_steps=20", PARTS_START="5", PARTS_STEPS="10")
    assert run.returncode == 0, run.stderr[-2000:]
    ms = _report(run.stdout)
    assert all(v > 0 for k, v in ms.items() if k != "rest"), ms
    # medians of parts, each inside the one before (medians need not add up exactly)
    assert ms["embedding_backward"] < ms["backward"] < ms["train_step"] < ms["wall"]
    assert ms["forward"] < ms["train_step"]


def test_too_short_a_run_says_so(tmp_path):
    run = _run(tmp_path, "trainer.max_steps=8", PARTS_START="5", PARTS_STEPS="10")
    assert run.returncode != 0 and "fewer than PARTS_START + PARTS_STEPS" in run.stderr


def test_a_bad_count_in_the_environment_is_refused_naming_it(tmp_path):
    """PARTS_STEPS=0 trained to step PARTS_START and printed a report of nan medians (on GPUs: failed there, in a
    median of no events); a count that is no number failed in int(), naming no variable."""
    for name, value, least in (("PARTS_STEPS", "0", 1), ("PARTS_START", "-5", 0), ("PARTS_PROFILE", "two", 0)):
        run = _run(tmp_path, "trainer.max_steps=12", **{"PARTS_START": "5", "PARTS_STEPS": "5", name: value})
        assert run.returncode != 0 and f"loop_parts: {name}={value!r}: expected a whole number >= {least}" \
            in run.stderr, (name, run.stderr[-1000:])
