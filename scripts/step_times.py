"""Per-step times of a training run from its metrics.jsonl (train.py writes one line per logged interval): median,
mean and slowest `step_ms` over the intervals whose steps all lie at or after `--from` (default 11: past compilation
and warm-up; an interval starts after the previous one's last step). An interval's step_ms is the mean of its steps,
so the median and mean are over steps (an interval counts as many times as it holds steps: a checkpoint or the
run's end cuts short ones); the slowest is an interval's. With `trainer.log_every=1` every step is its own interval,
so one slow step (a compile, a collective re-allocation) shows as the slowest instead of hiding in a 5-step mean.
A file that holds several runs (a second run into the same directory appends; its steps go back) reports the last;
a resume from the last run's last step looks like its continuation (the file marks no run's start): give --from
past its first interval, which holds its compilation. Each interval counts from its own first step (the loop
records its `steps`; older files: from the step after the previous interval's, a run's first from step 1).

    python scripts/step_times.py RUN_DIR [RUN_DIR ...] [--from 11]
"""
import argparse
import json
import statistics
from pathlib import Path


def step_times(run_dir: Path, first: int) -> tuple[dict[int, tuple[float, int]], int]:
    """({last step: (step_ms, steps)} of the last run's intervals starting at step >= first, the runs in the file).
    Evaluation lines carry no step_ms. An interval holds its recorded `steps`; in files without them it starts
    after the previous one's last step, a run's first at step 1 (the file's first, or one whose steps go back)."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        raise SystemExit(f"{path}: no such file (the run did not log, or its directory is another)")
    times, previous, runs = {}, 0, 1
    for number, line in enumerate(path.read_text().splitlines(), 1):
        try:
            row = json.loads(line) if line.strip() else {}
        except json.JSONDecodeError as error:  # e.g. a run killed while writing its last line
            raise SystemExit(f"{path}, line {number}: not JSON ({error})") from error
        if "step_ms" not in row:
            continue
        if row["step"] <= previous:  # another run: the earlier ones' times are dropped
            times, previous, runs = {}, 0, runs + 1
        steps = row.get("steps", row["step"] - previous)  # recorded since 2026-12-06; before, known but for a resume
        if row["step"] - steps + 1 >= first:
            times[row["step"]] = (row["step_ms"], steps)
        previous = row["step"]
    return times, runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dirs", nargs="+", type=Path)
    parser.add_argument("--from", dest="first", type=int, default=11, help="first step counted")
    args = parser.parse_args()
    for run_dir in args.run_dirs:
        times, runs = step_times(run_dir, args.first)
        which = f" (the last of {runs} runs in metrics.jsonl)" if runs > 1 else ""
        if not times:
            print(f"{run_dir}{which}: no logged interval starts at step >= {args.first}")
            continue
        per_step = [ms for ms, steps in times.values() for _ in range(steps)]
        slowest = max(times, key=lambda step: times[step][0])
        print(f"{run_dir}{which}: {len(times)} intervals ({len(per_step)} steps) from step {args.first}: step_ms "
              f"median {statistics.median(per_step):.1f} mean {statistics.mean(per_step):.1f} slowest "
              f"{times[slowest][0]:.1f} (step {slowest})")


if __name__ == "__main__":
    main()
