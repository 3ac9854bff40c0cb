"""Per-step times of a training run from its metrics.jsonl (train.py writes one line per logged interval): median,
mean and slowest `step_ms` over the intervals whose steps all lie at or after `--from` (default 11: past compilation
and warm-up; an interval starts after the previous one's last step). With `trainer.log_every=1` every step is its
own interval, so one slow step (a compile, a collective re-allocation) shows as the slowest instead of hiding in a
5-step mean.

    python scripts/step_times.py RUN_DIR [RUN_DIR ...] [--from 11]
"""
import argparse
import json
import statistics
from pathlib import Path


def step_times(run_dir: Path, first: int) -> dict[int, float]:
    """step -> step_ms of the intervals starting at step >= first (evaluation lines carry no step_ms): an interval
    starts after the previous one's last step; the file's first, or one whose steps go back (a run resumed into
    the same directory), at step 1 (its start is unknown, and it holds that run's compilation)."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        raise SystemExit(f"{path}: no such file (the run did not log, or its directory is another)")
    times, previous = {}, 0
    for number, line in enumerate(path.read_text().splitlines(), 1):
        try:
            row = json.loads(line) if line.strip() else {}
        except json.JSONDecodeError as error:  # e.g. a run killed while writing its last line
            raise SystemExit(f"{path}, line {number}: not JSON ({error})") from error
        if "step_ms" not in row:
            continue
        if (previous + 1 if row["step"] > previous else 1) >= first:
            times[row["step"]] = row["step_ms"]
        previous = row["step"]
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dirs", nargs="+", type=Path)
    parser.add_argument("--from", dest="first", type=int, default=11, help="first step counted")
    args = parser.parse_args()
    for run_dir in args.run_dirs:
        times = step_times(run_dir, args.first)
        if not times:
            print(f"{run_dir}: no logged interval starts at step >= {args.first}")
            continue
        slowest = max(times, key=times.get)
        median, mean = statistics.median(times.values()), statistics.mean(times.values())
        print(f"{run_dir}: {len(times)} intervals from step {args.first}: step_ms median {median:.1f} mean {mean:.1f}"
              f" slowest {times[slowest]:.1f} (step {slowest})")


if __name__ == "__main__":
    main()
