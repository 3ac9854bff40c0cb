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
