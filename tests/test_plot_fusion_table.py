"""scripts/plot_fusion_table.py against the README's own table: every row's stated ratio agrees with its bulk and
fused times (a typo in either shows), and the picture renders."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("plot_fusion_table", ROOT / "scripts" / "plot_fusion_table.py")
plot_fusion_table = importlib.util.module_from_spec(spec)
spec.loader.exec_module(plot_fusion_table)


def test_every_row_states_the_ratio_of_its_times():
    rows = plot_fusion_table.table_rows((ROOT / "README.md").read_text())
    assert len(rows) >= 10
    for label, stated, measured in rows:
        assert stated == pytest.approx(measured, rel=0.015), label


def test_the_picture_renders(tmp_path):
    out = tmp_path / "table.png"
    plot_fusion_table.plot(plot_fusion_table.table_rows((ROOT / "README.md").read_text()), out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_cell_without_a_time_is_refused():
    with pytest.raises(ValueError, match="no time"):
        plot_fusion_table.seconds("n/a")


def test_every_bar_keeps_its_rows_date_machine_and_commit_whole(tmp_path, monkeypatch):
    """Issue 6: each figure dated with its machine and commit. Every row's operator ends in its "(date, commit,
    ...)", and the picture's label keeps that whole where it shortens a long row (the shape goes first)."""
    import re
    from itertools import takewhile

    from matplotlib.axes import Axes

    drawn = []
    set_yticks = Axes.set_yticks
    monkeypatch.setattr(Axes, "set_yticks", lambda ax, ticks, labels, **kw: (drawn.extend(labels),
                                                                             set_yticks(ax, ticks, labels, **kw)))
    readme = (ROOT / "README.md").read_text()
    plot_fusion_table.plot(plot_fusion_table.table_rows(readme), tmp_path / "table.png")
    lines = readme.splitlines()
    table = takewhile(lambda line: line.startswith("|"), lines[lines.index(plot_fusion_table.HEADER) + 2:])
    operators = [line.strip("|").split("|")[0].strip() for line in table]
    labels = [label.replace("\n", " ") for label in drawn[::-1]]  # drawn bottom up, wrapped
    assert len(labels) == len(operators)
    for operator, label in zip(operators, labels):
        dated = re.search(r"\((\d\d-\d\d[^()]*)\)$", operator)
        assert dated is not None, f"no (date, commit) at the end of {operator!r}"
        assert " ".join(dated.group(0).split()) in " ".join(label.split()), (operator, label)


def test_a_row_without_its_date_and_commit_is_refused():
    table = (f"{plot_fusion_table.HEADER}\n| --- | --- | --- | --- | --- |\n"
             "| GEMV + all-reduce | N=8192 | 2 ms | 1 ms | 2.00× |\n")
    with pytest.raises(ValueError, match="does not end in its"):
        plot_fusion_table.table_rows(table)
