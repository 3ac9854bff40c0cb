"""A measured report written out: report.md (a table), report.json (everything, with machine, commit and versions,
the overrides and the config) and report.png (bulk against fused per layer, and the whole step)."""

from __future__ import annotations

import json
import math
import os
import platform
import socket
import subprocess
import textwrap
from pathlib import Path

import torch
import torchrec
import triton

from fused_dlrm.dist import DistEnv
from fused_dlrm.report.layers import PASSES, STEP, counted

REPO = Path(__file__).resolve().parents[2]
PASS_TITLES = {"fwd": "forward", "fwd_bwd": "forward+backward"}


def _run_git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def _git(*args: str) -> str | None:
    """git's answer about the checkout this package was loaded from, or None: no git, or the package is not at the top
    of a checkout (installed into site-packages, maybe inside another repository, whose commit is not this code's)."""
    top = _run_git("rev-parse", "--show-toplevel")
    return _run_git(*args) if top is not None and Path(top).resolve() == REPO else None


def environment(env: DistEnv) -> dict:
    """Machine, commit and versions the numbers were taken with."""
    status = _git("status", "--porcelain", "--untracked-files=no")
    device = torch.cuda.get_device_name(env.device) if env.device.type == "cuda" else platform.processor() or "cpu"
    return {"machine": {"host": socket.gethostname(), "platform": platform.platform(), "device": device,
                        "device_type": env.device.type, "cpu_count": os.cpu_count(), "world_size": env.world_size,
                        "backend": env.backend},
            "commit": _git("rev-parse", "HEAD"), "uncommitted_changes": bool(status) if status is not None else None,
            "versions": {"python": platform.python_version(), "torch": torch.__version__,
                         "triton": triton.__version__, "torchrec": torchrec.__version__}}


def _finite(value):
    """`value` with every non-finite float (a setting of inf: model.clip_grad=inf) as the string an override spells
    it with ("inf", "-inf", "nan"): JSON has no such numbers, and strict parsers refuse Python's Infinity / NaN."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def write_json(report: dict, path: Path) -> None:
    path.write_text(json.dumps(_finite(report), indent=1, allow_nan=False) + "\n")


def _bytes(n: int | None) -> str:
    if n is None:
        return "-"
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def _cell(mode: dict, p: str) -> str:
    if "unavailable" in mode:
        return mode["unavailable"]
    return f"{mode[f'{p}_ms']:.3f}" if f"{p}_ms" in mode else "-"


def _pct(entry: dict, p: str) -> str:
    values = [entry["pct_sol"][m].get(p) for m in ("bulk", "fused")]
    if all(v is None for v in values):
        return "n/a"
    return " / ".join("-" if v is None else f"{v:.0f}%" for v in values)


def markdown(report: dict) -> str:
    env, t = report["environment"], report["timing"]
    machine = env["machine"]
    bandwidth = report["peer_bandwidth_GBps"]
    lines = [
        f"# Communication report: {report['model']}",
        "",
        f"{machine['device']} x{machine['world_size']} ({machine['backend'] or 'one process'}), host "
        f"{machine['host']}; commit {env['commit'] or 'unknown'}"
        f"{' (with uncommitted changes)' if env['uncommitted_changes'] else ''}; torch {env['versions']['torch']}, "
        f"triton {env['versions']['triton']}, torchrec {env['versions']['torchrec']}.",
        f"Times in ms: the slowest rank's median of {counted(t['iters'], 'run', 'runs')} after "
        f"{counted(t['warmup'], 'warm-up run', 'warm-up runs')} "
        f"({t['method']}). "
        f"Bytes: sent by the busiest rank per run (the fused column's in parentheses where it sends others: a "
        f"codec's encoded messages). Shapes ('here', 'on this rank'): rank 0's. "
        f"Speed of light (SOL): those bytes at the peer write bandwidth "
        + (f"measured in this run ({bandwidth:.0f} GB/s), compute not counted." if bandwidth else
           "(n/a: not measurable on this machine)."),
        f"Modes: {report['modes']}",
        *([f"**Caveat: {t['caveat']}.**"] if "caveat" in t else []),
        "",
        "| layer | shapes | pass | bytes sent | bulk ms | fused ms | speedup | % SOL (bulk / fused) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for entry in report["layers"]:
        name = entry["name"] + (f" (x{entry['count']} in the model)" if entry["count"] > 1 else "")
        if all("unavailable" in entry[m] for m in ("bulk", "fused")):
            lines.append(f"| {name} | {entry['shapes']} | - | - | {_cell(entry['bulk'], '')} | "
                         f"{_cell(entry['fused'], '')} | - | n/a |")
        for p in PASSES:
            if not any(f"{p}_ms" in entry[m] for m in ("bulk", "fused")):
                continue
            speedup = entry["speedup"].get(p)
            fused_bytes = entry.get("fused_bytes_sent", {}).get(p)
            sent = _bytes(entry["bytes_sent"].get(p)) + (f" (fused {_bytes(fused_bytes)})" if fused_bytes else "")
            lines.append(f"| {name} | {entry['shapes']} | {PASS_TITLES[p]} | {sent} | "
                         f"{_cell(entry['bulk'], p)} | {_cell(entry['fused'], p)} | "
                         f"{f'{speedup:.2f}x' if speedup else '-'} | {_pct(entry, p)} |")
    notes = [f"- {entry['name']}: {note}" for entry in report["layers"] for note in entry["notes"]]
    if notes:
        lines += ["", "Notes:", *notes]
    return "\n".join(lines) + "\n"


def _short_names(entries: list[dict]) -> dict[str, str]:
    """Each layer's name for the picture: without its parenthesised detail ("sparse input dist (KJT all-to-all)" ->
    "sparse input dist"), but whole where the short one would name two layers alike (the DLRM's gradient
    all-reduces, one per dense arch)."""
    short = [e["name"].split(" (")[0] for e in entries]
    return {e["name"]: s if short.count(s) == 1 else e["name"] for e, s in zip(entries, short)}


def _missing(entries: list[dict], names: dict[str, str]) -> list[str]:
    """Why bars are n/a, in the md's words, with the layers each reason concerns: "fused n/a, no fused path on this
    machine (CPU): embedding lookup + output dist, training step"."""
    layers_of: dict[str, list[str]] = {}
    for entry in entries:
        reasons = {mode: entry[mode]["unavailable"] for mode in ("bulk", "fused") if "unavailable" in entry[mode]}
        if len(reasons) == 2 and len(set(reasons.values())) == 1:  # one reason for both: said once
            reasons = {"bulk and fused": reasons["bulk"]}
        for modes, reason in reasons.items():
            layers_of.setdefault(f"{modes} n/a, {reason}", []).append(names[entry["name"]])
    return [f"{why}: {', '.join(layers)}" for why, layers in layers_of.items()]


def write_png(report: dict, path: Path) -> str | None:
    """Bars of bulk and fused forward+backward time (forward where a layer has no backward) per layer, and the
    whole step beside them, with why a bar is missing written under them. Returns why no picture was drawn, or
    None."""
    try:
        import matplotlib
    except ModuleNotFoundError:
        return "matplotlib is not installed (python scripts/setup_env.py installs it)"
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt
    from matplotlib.patches import Patch

    colors = {"bulk": "tab:gray", "fused": "tab:blue"}
    names = _short_names(report["layers"])

    def bars(ax, entries, title):
        labels, width = [], 0.38
        for i, entry in enumerate(entries):
            p = "fwd_bwd" if "fwd_bwd" in entry["bytes_sent"] else "fwd"  # its passes: those it sends in, timed or not
            labels.append(f"{textwrap.fill(names[entry['name']], 28)}\n({PASS_TITLES[p]})")
            for offset, mode in ((-width / 2, "bulk"), (width / 2, "fused")):
                ms = entry[mode].get(f"{p}_ms")
                if ms is None:  # the caption says why
                    ax.text(i + offset, 0, "n/a", ha="center", va="bottom", fontsize=7, rotation=90)
                else:
                    ax.bar(i + offset, ms, width, color=colors[mode])
            if p in entry["speedup"]:
                ax.text(i + width / 2, entry["fused"][f"{p}_ms"], f"{entry['speedup'][p]:.2f}x", ha="center",
                        va="bottom", fontsize=8)
        ax.set_xticks(range(len(entries)), labels, fontsize=7)
        ax.set_xlim(-0.6, len(entries) - 0.4)
        ax.set_ylabel("ms (median, slowest rank)")
        ax.set_title(title, fontsize=9)

    layers = [e for e in report["layers"] if e["name"] != STEP]
    steps = [e for e in report["layers"] if e["name"] == STEP]
    caption = "\n".join(textwrap.fill(line, 170, subsequent_indent="    ")
                        for line in _missing(report["layers"], names))
    caption_inches = 0.15 * (caption.count("\n") + 1) + 0.1 if caption else 0.0
    height = 4.5 + caption_inches
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, height),
                                      gridspec_kw={"width_ratios": [max(len(layers), 1), 1]})
    bars(left, layers, "communicating layers")
    bars(right, steps, "whole training step")
    fig.legend(handles=[Patch(color=c, label=m) for m, c in colors.items()], loc="upper left")
    fig.suptitle(f"{report['model']}: bulk vs fused, {report['environment']['machine']['device']} "
                 f"x{report['environment']['machine']['world_size']}", fontsize=10)
    if caption:
        fig.text(0.01, 0.01, caption, fontsize=7, va="bottom")
    fig.tight_layout(rect=(0, caption_inches / height, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None
