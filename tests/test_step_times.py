"""scripts/step_times.py: per-step times of a run from its metrics.jsonl."""
import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "step_times.py"


def _run(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True)


def test_median_mean_and_the_slowest_step_past_warm_up(tmp_path):
    times = {step: 130.0 + step % 3 for step in range(1, 41)}
    times[1], times[21] = 19_000.0, 666.0  # compilation (not counted), one slow step (counted)
    lines = [{"step": s, "loss": 3.0, "step_ms": ms} for s, ms in times.items()] + [{"step": 40, "eval_loss": 3.1}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    counted = [ms for s, ms in times.items() if s >= 11]
    out = _run(tmp_path).stdout
    assert "30 intervals (30 steps) from step 11" in out and "median 131.0" in out
    assert f"mean {sum(counted) / len(counted):.1f}" in out and "slowest 666.0 (step 21)" in out
    assert "2 intervals (2 steps) from step 39: step_ms median 130.5" in _run(tmp_path, "--from", 39).stdout  # 130, 131


def test_a_missing_run_is_an_error_that_names_the_file(tmp_path):
    result = _run(tmp_path / "nowhere")
    assert result.returncode != 0 and "nowhere/metrics.jsonl: no such file" in result.stderr


def test_a_broken_line_is_an_error_that_names_file_and_line(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "step_ms": 130.0}\n{"step": 2, "step_')
    result = _run(tmp_path)
    assert result.returncode != 0 and "metrics.jsonl, line 2: not JSON" in result.stderr


def test_an_interval_that_starts_before_from_is_not_counted(tmp_path):
    """trainer.log_every=20 (the default): the interval ending at step 20 holds steps 1..20, the compilation among
    them, so --from 11 starts at the next one; an interval ended early by a checkpoint (25) starts after the last.
    The median is over steps: 131.0 (25's 5 steps) and 130.0 (40's 15) are below it, 132.0 (80's 20) holds it."""
    times = {20: 950.0, 25: 131.0, 40: 130.0, 60: 133.0, 80: 132.0}
    lines = [{"step": s, "loss": 3.0, "step_ms": ms} for s, ms in times.items()]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = _run(tmp_path).stdout
    assert "4 intervals (60 steps) from step 11: step_ms median 132.0" in out and "slowest 133.0 (step 60)" in out
    # 40's interval: steps 26..40
    assert "3 intervals (55 steps) from step 26: step_ms median 132.0" in _run(tmp_path, "--from", 26).stdout
    assert "2 intervals (40 steps) from step 27: step_ms median 132.5" in _run(tmp_path, "--from", 27).stdout
    assert "5 intervals (80 steps) from step 1:" in _run(tmp_path, "--from", 1).stdout


def test_intervals_of_unequal_length_weigh_by_their_steps(tmp_path):
    """An interval's step_ms is the mean of its steps: the run's mean and median are over steps, each interval
    counting as many times as it holds steps (trainer.max_steps=150, log_every=40: the last interval holds 30; a
    checkpoint every 25 with log_every=20 cuts intervals of 5 and 15), not one per interval."""
    times = {40: 900.0, 45: 400.0, 80: 100.0, 120: 104.0, 125: 300.0, 150: 102.0}  # 5 steps each at 400 and 300
    lines = [{"step": s, "loss": 3.0, "step_ms": ms} for s, ms in times.items()]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    steps = {45: 5, 80: 35, 120: 40, 125: 5, 150: 25}
    mean = sum(times[s] * n for s, n in steps.items()) / sum(steps.values())
    out = _run(tmp_path, "--from", 41).stdout
    assert "5 intervals (110 steps) from step 41" in out, out
    assert f"median 102.0 mean {mean:.1f}" in out and "slowest 400.0 (step 45)" in out, out  # per interval: 300, 199.8


def test_a_file_holding_two_runs_reports_the_last(tmp_path):
    """A second run into the same directory (gpu_check.sh again with the same OUT, a resume) appends its lines:
    where the steps go back a run starts, and only the last is reported (its steps were keys over the first's: the
    first run's later intervals stayed, mixed with the second's)."""
    first = [{"step": s, "loss": 3.0, "step_ms": 100.0 + s / 20} for s in (20, 40, 60, 80)]
    second = [{"step": s, "loss": 3.0, "step_ms": 200.0 + s / 20} for s in (20, 40, 60)]
    lines = first + [{"step": 80, "eval_loss": 3.1}] + second
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = _run(tmp_path).stdout
    assert "the last of 2 runs in metrics.jsonl" in out and "2 intervals (40 steps) from step 11" in out, out
    assert "median 202.5 mean 202.5 slowest 203.0 (step 60)" in out, out


def test_intervals_recorded_with_their_steps_count_from_their_own_start(tmp_path):
    """The loop records each interval's steps: a run resumed at step 1000 into a fresh directory logs 1020 first,
    an interval of 20 steps, not of 1020 from step 1 (it weighed as 1020 steps and held the median at its compile).
    Files of older runs, without `steps`, are read as before."""
    times = {1020: 9000.0, 1040: 130.0, 1060: 131.0, 1080: 130.0, 1100: 132.0}
    lines = [{"step": s, "steps": 20, "loss": 3.0, "step_ms": ms} for s, ms in times.items()]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = _run(tmp_path, "--from", 1).stdout
    assert "5 intervals (100 steps) from step 1: step_ms median 131.0" in out, out
    assert "4 intervals (80 steps) from step 1002: step_ms median 130.5" in _run(tmp_path, "--from", 1002).stdout
