"""The README's "What fusion buys" table as a picture: one bar per row, the ratio the row states (bulk time /
fused time; above 1: fused is faster), labelled with the row's operator, date, commit and shape (a long label
shortened, never its date, commit and machine: a row without them is refused). The table is the one source of the
figures (each of them recorded in docs/benchmarks.md); rerun this after editing it:

    python scripts/plot_fusion_table.py [--readme README.md] [--out docs/what_fusion_buys.png]
"""

from __future__ import annotations

import argparse
import re
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HEADER = "| operator (date, commit) | shape | bulk | fused | fused vs bulk |"
UNITS = {"ms": 1e-3, "µs": 1e-6, "us": 1e-6}


def seconds(cell: str) -> float:
    """The leading time of a cell ("12.93 ms (torchrec)" -> 0.01293)."""
    match = re.match(r"\s*([0-9.]+)\s*(ms|µs|us)\b", cell)
    if match is None:
        raise ValueError(f"no time in table cell {cell!r}")
    return float(match.group(1)) * UNITS[match.group(2)]


def label(operator: str, shape: str, width: int = 140) -> str:
    """A bar's label: "<operator> (<date, commit, machine>): <shape>" in about `width` characters, the shape
    shortened first, then the operator's description, never its closing (date, commit, machine) group."""
    dated = re.fullmatch(r"(.*?)\s*(\(\d\d-\d\d[^()]*\))", operator)
    if dated is None:
        raise ValueError(f"the table row {operator!r} does not end in its (date, commit[, machine])")
    what, when = dated.groups()
    room = width - len(when) - 3
    shape = textwrap.shorten(shape, max(room - len(what), room // 3), placeholder=" ...")
    what = textwrap.shorten(what, max(room - len(shape), 20), placeholder=" ...")
    return f"{what} {when}: {shape}"


def table_rows(readme: str) -> list[tuple[str, float, float]]:
    """(its label; the ratio the row states; bulk / fused from its time cells) of every row of the table."""
    lines = readme.splitlines()
    if HEADER not in lines:
        raise ValueError(f"the README has no table headed {HEADER!r}")
    rows = []
    for line in lines[lines.index(HEADER) + 2:]:
        if not line.startswith("|"):
            break
        operator, shape, bulk, fused, ratio = [cell.strip() for cell in line.strip("|").split("|")]
        stated = re.match(r"([0-9.]+)×", ratio)
        if stated is None:
            raise ValueError(f"no ratio at the start of table cell {ratio!r}")
        rows.append((label(operator, shape), float(stated.group(1)), seconds(bulk) / seconds(fused)))
    if not rows:
        raise ValueError("the README's table has no rows")
    return rows


def plot(rows: list[tuple[str, float, float]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    fig, ax = plt.subplots(figsize=(12, 0.55 * len(rows) + 1.2))
    labels = [label for label, _, _ in rows][::-1]
    ratios = [stated for _, stated, _ in rows][::-1]
    ax.barh(range(len(rows)), ratios, color=["tab:blue" if r >= 1 else "tab:gray" for r in ratios])
    for i, ratio in enumerate(ratios):
        ax.text(ratio, i, f" {ratio:.2f}x", va="center", fontsize=7)
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_yticks(range(len(rows)), [textwrap.fill(label, 70) for label in labels], fontsize=6.5)
    ax.set_xlabel("bulk time / fused time (above 1: fused is faster)")
    ax.set_xlim(0, max(ratios) * 1.15)
    ax.set_title("What fusion buys: the README's table, 2 GPUs per row (2×H200 unless the row says otherwise)",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python scripts/plot_fusion_table.py")
    parser.add_argument("--readme", type=Path, default=ROOT / "README.md")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "what_fusion_buys.png")
    args = parser.parse_args()
    plot(table_rows(args.readme.read_text()), args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
