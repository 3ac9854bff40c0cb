"""The per-layer report (fused_dlrm.report): standalone and after training, one process and 2 gloo ranks under
torchrun; the files, the layers with their bytes and times, and the fused column saying why it is missing here."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from fused_dlrm.dist import DistEnv
from fused_dlrm.dist.symmetric import SimulatedWorld
from fused_dlrm.report.__main__ import main as report_main
from fused_dlrm.report.dlrm import dlrm_layers
from fused_dlrm.report.layers import STEP, CommLayer, grad_allreduce_layer
from fused_dlrm.report.measure import measure_layer
from fused_dlrm.report.moe import moe_bytes_sent, moe_layers, routes_per_owner, with_modes
from fused_dlrm.report import render
from fused_dlrm.report.render import environment, markdown, write_json, write_png
from fused_dlrm.train.build import compose_config
from fused_dlrm.train.compute_copies import compute_copy
from fused_dlrm.train.loop import train as train_dlrm
from moe.layer import REFUSAL_WORDS, FusedMoEConfig, MoELayer
from moe.train import build_model as build_moe
from moe.train import fused_moe_config
from moe.train import train as train_moe
from moe.transformer import expert_parameters
from test_batch_not_made import criteo_file
from test_training import config
from world import run_torchrun, run_world

CPU = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend=None)
DLRM = ["trainer.device=cpu", "model.num_rows=[300,2000,700,5000,64,1000]", "data.num_sparse=6",
        "data.global_batch_size=50", "model.embedding_dim=8", "model.dense_arch=[16,8]"]
MOE = ["trainer.device=cpu", "model=moe_transformer", "data.size_bytes=100000", "data.global_batch_size=6",
       "data.seq_len=16", "model.d_model=32", "model.ffn=48", "model.num_heads=2"]
CPU_REASON = "no fused path on this machine (CPU)"
LOOKUP = "embedding lookup + output dist (pooled all-to-all)"
ARCH_SUMS = ["gradient all-reduce (dense arch)", "gradient all-reduce (over arch)"]  # one per ArchNode, as trained
DLRM_LAYERS = ["sparse input dist (KJT all-to-all)", LOOKUP, *ARCH_SUMS, STEP]


def read(run: Path) -> tuple[dict, str]:
    assert (run / "report.png").stat().st_size > 1000
    return json.loads((run / "report.json").read_text()), (run / "report.md").read_text()


def check_report(report: dict, table: str, names: list[str], world: int) -> dict[str, dict]:
    """Every layer in the JSON and in the md table, bulk timed, fused saying why it is missing; returns them."""
    layers = {e["name"]: e for e in report["layers"]}
    assert list(layers) == names
    env = report["environment"]
    assert env["machine"]["world_size"] == world and env["versions"]["torch"] == torch.__version__
    assert len(env["commit"]) == 40 and report["timing"]["method"] == "host perf_counter"
    assert report["peer_bandwidth_GBps"] is None
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| layer")]
    for name, entry in layers.items():
        assert any(row.startswith(f"| {name}") for row in rows), name
        if "unavailable" not in entry["bulk"]:
            assert entry["bulk"] and all(ms > 0 for ms in entry["bulk"].values()), name
        assert entry["fused"]["unavailable"], name
        assert entry["speedup"] == {}
    assert layers[STEP]["bulk"]["fwd_bwd_ms"] > 0
    assert sum(CPU_REASON in row for row in rows) >= 3
    assert "n/a: not measurable" in table
    return layers


def check_reproducible(report: dict, overrides: list[str]) -> None:
    """report.json records the command line's overrides (Hydra's own, hydra.*, left out: where, not what) and the
    config they composed, resolved: composed again from those overrides (`python -m fused_dlrm.report <overrides>`
    re-runs the report) they give the same config."""
    assert report["overrides"] == [o for o in overrides if not o.startswith("hydra.")]
    assert report["config"] == OmegaConf.to_container(compose_config(report["overrides"]), resolve=True)
    assert report["config"]["data"]["global_batch_size"] == int(next(
        o.split("=")[1] for o in overrides if o.startswith("data.global_batch_size=")))  # not the default's


def test_dlrm_standalone_one_process(tmp_path):
    report_main([*DLRM, f"hydra.run.dir={tmp_path}"])
    report, table = read(tmp_path)
    check_reproducible(report, [*DLRM, f"hydra.run.dir={tmp_path}"])
    assert report["config"]["data"]["train"]["seed"] == 0  # resolved (${seed} in conf/data/synthetic.yaml)
    layers = check_report(report, table, DLRM_LAYERS, world=1)
    assert layers[LOOKUP]["fused"]["unavailable"] == CPU_REASON
    assert layers[LOOKUP]["bytes_sent"] == {"fwd": 0, "fwd_bwd": 0}  # one process sends nothing
    assert "median of 5 runs after 1 warm-up run (host perf_counter)" in table  # the CPU's counts, not '1 ... runs'
    assert all(layers[name]["bulk"]["unavailable"] == "one process: nothing to all-reduce" for name in ARCH_SUMS)
    # its dtype too (issue 6: each layer with its real shapes and dtype): the indices' (their lengths travel in it)
    assert re.fullmatch(r"50 samples x 6 features, [0-9,]+ int64 indices on this rank",
                        layers["sparse input dist (KJT all-to-all)"]["shapes"])


def test_standalone_resolves_the_hydra_interpolations_train_py_takes(tmp_path):
    """An override train.py resolves through Hydra's run (`${hydra:runtime.output_dir}`) resolves here too, to this
    report's run directory: report.json records the config resolved."""
    overrides = [*DLRM, "trainer.checkpoint_dir=${hydra:runtime.output_dir}/ckpt", f"hydra.run.dir={tmp_path}"]
    report_main(overrides)
    report, _ = read(tmp_path)
    assert report["config"]["trainer"]["checkpoint_dir"] == f"{tmp_path}/ckpt"
    assert "trainer.checkpoint_dir=${hydra:runtime.output_dir}/ckpt" in report["overrides"]


def test_standalone_resolves_the_run_directory_as_hydra_does(tmp_path, monkeypatch):
    """A relative hydra.run.dir (the default, outputs/<launch time>, is one): `${hydra:runtime.output_dir}` resolves
    to the directory's absolute path, as in Hydra's run of train.py (hydra.core.utils.run_job), so report.json
    records the config train.py records for the same overrides, not a path relative to wherever the report ran."""
    monkeypatch.chdir(tmp_path)
    report_main([*DLRM, "trainer.checkpoint_dir=${hydra:runtime.output_dir}/ckpt", "hydra.run.dir=rel/run"])
    report, _ = read(tmp_path / "rel" / "run")
    assert report["config"]["trainer"]["checkpoint_dir"] == f"{tmp_path}/rel/run/ckpt"


def test_dlrm_with_row_blocks_one_process(tmp_path):
    """Row-wise tables: the lookup layer is timed through the blocks' sum, with the output's gradient."""
    report_main([*DLRM, "model.row_shards=2", f"hydra.run.dir={tmp_path}"])
    report, table = read(tmp_path)
    layers = check_report(report, table, DLRM_LAYERS, world=1)
    assert layers[LOOKUP]["shapes"].startswith("6 tables in 12 row blocks (12 here) x 64..5,000 rows"), \
        layers[LOOKUP]["shapes"]
    assert layers[LOOKUP]["bulk"]["fwd_bwd_ms"] > 0


def test_one_table_is_one_table(tmp_path):
    """The lookup row counts its tables (and those here) in the singular when there is one."""
    one = ["trainer.device=cpu", "model.num_rows=300", "data.num_sparse=1", "data.global_batch_size=50",
           "model.embedding_dim=8", "model.dense_arch=[16,8]"]
    lookup = next(layer for layer in dlrm_layers(config(*one), CPU, tmp_path) if layer.name == LOOKUP)
    assert lookup.shapes.startswith("1 table (1 here) x 300 rows x D=8"), lookup.shapes


def test_column_shards_are_counted_as_such(tmp_path):
    """Tables cut into column shards: the lookup row counts both, not one number under three names."""
    layers = dlrm_layers(config(*DLRM, "model.column_shards=2"), CPU, tmp_path)
    lookup = next(layer for layer in layers if layer.name == LOOKUP)
    assert lookup.shapes.startswith("6 tables in 12 column shards (12 here) x 64..5,000 rows"), lookup.shapes


def test_moe_standalone_one_process(tmp_path):
    report_main([*MOE, f"hydra.run.dir={tmp_path}"])
    report, table = read(tmp_path)
    check_reproducible(report, MOE)
    layers = check_report(report, table, ["MoE layer (route, dispatch all-to-all, experts, combine all-to-all)",
                                          "gradient all-reduce", STEP], world=1)
    moe = layers["MoE layer (route, dispatch all-to-all, experts, combine all-to-all)"]
    assert moe["count"] == 2 and moe["fused"]["unavailable"] == CPU_REASON
    assert moe["shapes"].startswith("96 tokens x d=32 float32, 4 experts (4 here) top-2, ffn 48")
    assert moe["bulk"]["fwd_ms"] > 0 and moe["bulk"]["fwd_bwd_ms"] > 0


def test_one_expert_is_one_expert(tmp_path):
    """The MoE row counts its experts in the singular when there is one."""
    layers = moe_layers(config(*MOE, "model.num_experts=1", "model.top_k=1"), CPU, tmp_path)
    moe = next(layer for layer in layers if layer.name == MOE_LAYER)
    assert moe.shapes.startswith("96 tokens x d=32 float32, 1 expert (1 here) top-1, ffn 48"), moe.shapes


def test_moe_report_in_mixed_precision(tmp_path):
    """model.precision=bf16: the MoE layer is timed under autocast, as the model runs it, and says so."""
    report_main([*MOE, "model.precision=bf16", f"hydra.run.dir={tmp_path}"])
    report, table = read(tmp_path)
    moe = check_report(report, table, ["MoE layer (route, dispatch all-to-all, experts, combine all-to-all)",
                                       "gradient all-reduce", STEP], world=1)[
        "MoE layer (route, dispatch all-to-all, experts, combine all-to-all)"]
    assert moe["shapes"].startswith("96 tokens x d=32 bfloat16, 4 experts")
    assert moe["bulk"]["fwd_ms"] > 0 and moe["bulk"]["fwd_bwd_ms"] > 0


def _not_json(constant: str):
    raise ValueError(f"report.json holds {constant}, which strict JSON parsers refuse")


def test_report_json_is_strict_json_with_an_infinite_setting(tmp_path):
    """A setting training takes as inf (model.clip_grad=inf: the norm measured, never clipped) is recorded in the
    resolved config; report.json stays JSON that strict parsers read (no Infinity / NaN literals), the value as
    the override spells it."""
    report_main([*MOE, "model.clip_grad=inf", f"hydra.run.dir={tmp_path}"])
    report = json.loads((tmp_path / "report.json").read_text(), parse_constant=_not_json)
    assert report["config"]["model"]["clip_grad"] == "inf"
    assert report["layers"][0]["bulk"]["fwd_ms"] > 0


@pytest.mark.parametrize("overrides, error", [
    # the fused column has p2p only: timed as p2p under the user's nvshmem it would report a run training refuses
    (["comm=fused", "comm.transport=nvshmem"],
     "comm.transport=nvshmem: the MoE layers' fused dispatch and combine have the p2p transport only"),
    # the report sets comm.mode for each column itself: a typo is refused, as training refuses it, not timed
    (["comm.mode=fuse"], "unknown comm.mode 'fuse': expected bulk or fused"),
    # the fused column's settings, refused where no fused column is built (the CPU) as training refuses them
    (["comm=fused", "comm.wait_timeout_spins=0"], "comm.wait_timeout_spins=0: expected a whole number of polls"),
    (["comm=fused", "comm.moe_dispatch=row"], "dispatch='row': expected 'auto', 'rows' or 'tokens'"),
    (["comm=fused", "comm.moe_combine=tokens"], "combine='tokens': expected 'auto' or 'rows'"),
    (["comm=fused", "comm.num_programs=0"], r"comm.num_programs=0: expected a whole number >= 1 or null"),
    (["model.clip_grad=-1.0"], "model.clip_grad=-1.0: expected a norm >= 0"),
    (["model.lr_schedule.decay=cos"], "decay='cos': expected constant, linear or cosine"),
    (["model.lr_schedule.min_lr=0.01"], "min_lr=0.01: expected 0 <= min_lr <= the optimizer's lr 0.003"),
    (["trainer.epochs=2"], r"trainer.epochs is not supported \(got 2\)"),
    (["trainer.log_every=0"], r"trainer.log_every=0: expected a step count >= 1"),
])
def test_moe_settings_training_refuses_are_refused_before_measuring(tmp_path, monkeypatch, overrides, error):
    """The report times the step a config trains: a config moe/train.py's train refuses is refused here too (the
    same checks), not measured as something else or as if it were valid."""
    import fused_dlrm.report as report

    def measured(*args):
        raise AssertionError("the layers were timed before the setting was refused")
    monkeypatch.setattr(report, "measure", measured)
    with pytest.raises(ValueError, match=error):
        report_main([*MOE, *overrides, f"hydra.run.dir={tmp_path}"])
    assert not (tmp_path / "report.json").exists()


# DLRM on Criteo files ({file}: a file of 40 lines), the eval files given by each case
CRITEO = ["trainer.device=cpu", "data=criteo", "data.num_workers=0", "data.global_batch_size=16",
          "model.num_rows=100", "model.embedding_dim=8", "model.dense_arch=[16,8]", "data.train.paths=[{file}]"]


@pytest.mark.parametrize("overrides, error", [
    # what training alone reads (its length, batches made ahead, the evaluation's batches): not timed as if it trained
    ([*DLRM, "trainer.batches_ahead=-1"], r"trainer.batches_ahead=-1: expected a count >= 0"),
    ([*DLRM, "trainer.max_steps=null"], "set trainer.max_steps or trainer.epochs"),
    ([*DLRM, "trainer.epochs=0"], r"trainer.epochs=0: expected a count >= 1"),
    ([*DLRM, "trainer.max_steps=2.5"], r"trainer.max_steps=2.5: expected a step count >= 0"),
    ([*DLRM, "trainer.log_every=0"], r"trainer.log_every=0: expected a step count >= 1"),
    ([*DLRM, "trainer.max_steps=null", "trainer.epochs=1", "data.steps_per_epoch=null"],
     "trainer.epochs with step-indexed .* without it the run would never end"),
    ([*DLRM, "data.eval_batches=0"], "data.eval_batches=0: expected a count >= 1"),
    ([*DLRM, "data.eval.device=cuda"], "data.eval.device=cuda makes the batches on a GPU, but the model is on cpu"),
    ([*CRITEO], r"data.eval.paths must be given"),
    # the report's batch is made by data.steps_per_epoch's stream
    ([*DLRM, "data.steps_per_epoch=2.5"], r"data.steps_per_epoch=2.5: expected a step count >= 1"),
    ([*CRITEO, "data.eval.paths=[{file}]", "data.steps_per_epoch=3"],
     "data.steps_per_epoch=3: an epoch of file-backed data is one pass over its files"),
    # the report sets comm.mode for each column itself, and builds no fused column without GPUs
    ([*DLRM, "comm.mode=fuse"], "unknown comm.mode 'fuse': expected bulk or fused"),
    ([*DLRM, "comm=fused", "comm.transport=ib"], r"comm.transport='ib' is unknown; expected one of"),
    ([*DLRM, "comm=fused", "comm.wait_timeout_spins=0"], "comm.wait_timeout_spins=0: expected a whole number of polls"),
], ids=lambda value: " ".join(o for o in value if o not in DLRM + CRITEO[2:]) if isinstance(value, list) else "")
def test_dlrm_settings_training_refuses_are_refused_before_measuring(tmp_path, monkeypatch, overrides, error):
    """The report times the step a config trains: a config the DLRM's train refuses is refused here too, by the same
    checks, not measured as if it were valid (on the CPU nothing would read the fused settings)."""
    import fused_dlrm.report as report

    file = criteo_file(tmp_path / "day_0.tsv", 40, bad_line=None)
    overrides = [o.replace("{file}", str(file)) for o in overrides]
    with pytest.raises(ValueError, match=error):  # as training refuses it
        train_dlrm(config("trainer.max_steps=0", "trainer.progress=false", *overrides), CPU, tmp_path / "train")

    def measured(*args):
        raise AssertionError("the layers were timed before the setting was refused")
    monkeypatch.setattr(report, "measure", measured)
    with pytest.raises(ValueError, match=error):
        report_main([*overrides, f"hydra.run.dir={tmp_path / 'report'}"])
    assert not (tmp_path / "report" / "report.json").exists()


def test_train_py_refuses_switches_that_are_not_true_or_false(tmp_path):
    """report=no is Hydra's string 'no', which Python takes as true: it would train and then time the report the
    user turned off. Refused before training, naming the value, with every other such switch: trainer.tf32 before
    init_distributed reads it (torch: `set_allow_tf32_cublas expects a bool`)."""
    done = subprocess.run([sys.executable, "train.py", *DLRM, "report=no", "trainer.tf32=off", "trainer.max_steps=1",
                           "trainer.progress=false", "data.eval_batches=1", "trainer.checkpoint_every=0",
                           f"hydra.run.dir={tmp_path}"], cwd=Path(__file__).resolve().parents[1],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert "report='no': expected true or false | trainer.tf32='off': expected true or false" in done.stderr, \
        done.stderr[-3000:]
    assert not (tmp_path / "metrics.jsonl").exists() and not (tmp_path / "report.json").exists()


def test_dlrm_after_training_two_gloo_ranks(tmp_path):
    """train.py report=true under torchrun: trains 2 steps, then the report of both ranks, written once; its
    overrides and config those Hydra recorded for the run (.hydra/)."""
    overrides = [*DLRM, "report=true", "trainer.max_steps=2", "trainer.progress=false", "data.eval_batches=1",
                 "trainer.checkpoint_every=0", "comm.grad_allreduce=q8", f"hydra.run.dir={tmp_path}"]
    run_torchrun(overrides)
    report, table = read(tmp_path)
    check_reproducible(report, overrides)
    assert report["overrides"] == list(OmegaConf.load(tmp_path / ".hydra" / "overrides.yaml"))
    assert report["config"] == OmegaConf.to_container(OmegaConf.load(tmp_path / ".hydra" / "config.yaml"),
                                                      resolve=True)
    layers = check_report(report, table, DLRM_LAYERS, world=2)
    assert report["environment"]["machine"]["backend"] == "gloo"
    # The greedy plan (rows x dim) gives the 5000-row table one rank and the 5 others the other rank. Forward: the
    # busiest sender pools 5 tables x 8 dims for the other rank's 25 samples; backward: the gradient of those 40
    # columns returns from the other rank (25 x 40) while this one returns 25 x 8: 4000 + 800 bytes either way.
    assert layers[LOOKUP]["bytes_sent"] == {"fwd": 25 * 40 * 4, "fwd_bwd": 25 * 40 * 4 + 25 * 8 * 4}
    assert layers["sparse input dist (KJT all-to-all)"]["bytes_sent"]["fwd"] > 25 * 3 * 8
    for name in ARCH_SUMS:
        values = int(layers[name]["shapes"].split()[0].replace(",", ""))
        assert layers[name]["bytes_sent"] == {"fwd_bwd": values * 4}  # ring: 2 (W-1)/W of the buffer
    for name in (LOOKUP, *ARCH_SUMS, STEP):
        assert layers[name]["fused"]["unavailable"] == CPU_REASON
        assert layers[name]["bulk"]["fwd_bwd_ms"] > 0
    assert (tmp_path / "metrics.jsonl").exists()  # it trained first


def _report_with_a_bad_line(rank: int, world: int, tmp: str) -> None:
    env = DistEnv(rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"), backend="gloo")
    cfg = config("trainer.device=cpu", "data=criteo", f"data.train.paths=[{tmp}/bad.tsv]",
                 f"data.eval.paths=[{tmp}/bad.tsv]", "data.global_batch_size=16", "model.num_rows=100")
    bad = re.escape(f"{tmp}/bad.tsv:12: malformed Criteo line")
    with pytest.raises(ValueError if rank == 1 else RuntimeError,
                       match=bad if rank == 1 else r"rank 0: rank\(s\) \[1\] could not make their batch"):
        dlrm_layers(cfg, env, Path(tmp))
    dist.barrier()  # both raised: neither waits in the input dist for the other (else run_world's timeout)


def test_a_first_batch_one_rank_cannot_make_stops_every_rank(tmp_path):
    """The report's batch: a malformed line in rank 1's slice (lines 9..16) raises on both ranks."""
    criteo_file(tmp_path / "bad.tsv", 16, bad_line=12)
    run_world(2, _report_with_a_bad_line, str(tmp_path), timeout=120)


class SentBytes:
    """Counts what this rank's all-to-alls and all-reduces send to other ranks (an all-reduce as a ring: 2 (W - 1) / W
    of its buffer), by wrapping torch.distributed's two functions while it is entered."""

    def __init__(self, rank: int):
        self.rank, self.sent = rank, 0
        self.reduced: list[int] = []  # the values of each all-reduce, in call order

    def __enter__(self):
        self.all_to_all, self.all_reduce = dist.all_to_all_single, dist.all_reduce

        def all_to_all(out, x, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
            world = dist.get_world_size(group)
            splits = input_split_sizes or [x.shape[0] // world] * world
            row = x[0].numel() * x.element_size() if x.shape[0] else 0
            self.sent += row * sum(n for r, n in enumerate(splits) if r != dist.get_rank(group))
            return self.all_to_all(out, x, output_split_sizes, input_split_sizes, group=group, async_op=async_op)

        def all_reduce(x, *args, group=None, **kwargs):
            world = dist.get_world_size(group)
            self.sent += 2 * (world - 1) * x.numel() * x.element_size() // world
            self.reduced.append(x.numel())
            return self.all_reduce(x, *args, group=group, **kwargs)
        dist.all_to_all_single, dist.all_reduce = all_to_all, all_reduce
        return self

    def __exit__(self, *exc):
        dist.all_to_all_single, dist.all_reduce = self.all_to_all, self.all_reduce

    def of(self, run) -> int:
        self.sent = 0
        run()
        return self.sent


MOE_LAYER = "MoE layer (route, dispatch all-to-all, experts, combine all-to-all)"


def _bytes_as_sent(rank: int, world: int, tmp: str) -> None:
    env = DistEnv(rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"), backend="gloo")
    moe = config(*MOE)
    dlrm = dlrm_layers(config(*DLRM), env, Path(tmp))
    layers = dlrm + moe_layers(moe, env, Path(tmp))
    with SentBytes(rank) as sent:
        # the gradient all-reduce rows are the all-reduces the DLRM's training step makes (one per dense arch)
        sent.of(dlrm[-1].bulk["fwd_bwd"])
        rows = [int(layer.shapes.split()[0].replace(",", "")) for layer in dlrm if "all-reduce" in layer.name]
        assert sorted(rows) == sorted(sent.reduced), (rows, sent.reduced)
        for layer in layers:
            if layer.name == STEP and layer is layers[-1]:
                continue  # the MoE step's: the timed layer's bytes, whose routing is that of random tokens
            for p, run in ({} if isinstance(layer.bulk, str) else layer.bulk).items():
                # the MoE layer's forward also exchanges its counts per expert and refusal words ([world, local
                # experts + REFUSAL_WORDS] int64)
                local_experts = moe.model.num_experts // world
                counts = (world - 1) * (local_experts + REFUSAL_WORDS) * 8 if layer.name == MOE_LAYER else 0
                assert sent.of(run) == layer.bytes_sent[p] + counts, (rank, layer.name, p, layer.bytes_sent)


def test_bytes_are_what_each_rank_sends(tmp_path):
    """Every layer's bytes, per pass and rank, against what its bulk mode's collectives send (both modes move the
    same rows): the DLRM input dist's header and lengths included; an MoE rank sends the rows it dispatches and
    those dispatched to its experts, which it returns (uneven between the ranks), and as many backward."""
    run_world(2, _bytes_as_sent, str(tmp_path), timeout=400)


def _unwritable_run_dir(rank: int, world: int, tmp: str) -> None:
    import fused_dlrm.report as report

    def measured(*args):
        raise AssertionError("the layers were built and timed before the run directory was found unwritable")
    report._layers = measured  # minutes of building and timing on GPUs; here it must not start at all
    env = DistEnv(rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"), backend="gloo")
    run_dir = Path(tmp) / "a_file" / "run"
    with pytest.raises(NotADirectoryError if rank == 0 else ValueError,
                       match=None if rank == 0 else rf"rank 1: rank\(s\) \[0\] cannot write the report into "
                                                    rf"{re.escape(str(run_dir))}: NotADirectoryError"):
        report.write_report(config(*DLRM), env, run_dir, DLRM)


def test_an_unwritable_run_dir_stops_every_rank_before_measuring(tmp_path):
    """Only rank 0 writes the files: it finds out at once whether it can, and every rank stops there."""
    (tmp_path / "a_file").write_text("not a directory")
    run_world(2, _unwritable_run_dir, str(tmp_path), timeout=120)


@pytest.mark.parametrize("model", [DLRM, MOE])
def test_an_unknown_grad_allreduce_codec_is_refused_before_measuring(tmp_path, model, monkeypatch):
    """comm.grad_allreduce names the fused column's codec: refused as training refuses it, not left unread where
    no fused column is built (the CPU, one process) and the report written as if it were a codec."""
    import fused_dlrm.report as report

    def measured(*args):
        raise AssertionError("the layers were built and timed before the codec was refused")
    monkeypatch.setattr(report, "_layers", measured)
    with pytest.raises(ValueError, match=r"comm.grad_allreduce='q7': expected one of"):
        report_main([*model, "comm.grad_allreduce=q7", f"hydra.run.dir={tmp_path}"])
    assert not (tmp_path / "report.json").exists()


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_moe_tensor_parallel_two_gloo_ranks(tmp_path, sequence_parallel):
    """model.tp_size=2 under torchrun: every kind of TP projection is a layer of its own (real shapes, counted per
    model, the bytes of its collectives), and the gradients' all-reduce one per group it sums over."""
    run_torchrun([*MOE, "model.tp_size=2", f"model.sequence_parallel={sequence_parallel}", "model.num_layers=3",
                  "model.moe_every=2", "model.shared_expert=true", f"hydra.run.dir={tmp_path}"],
                 program=("-m", "fused_dlrm.report"))
    report, table = read(tmp_path)
    column = "all-gather of the rows before the GEMM; backward: reduce-scatter" if sequence_parallel else \
        "backward: the input gradient's all-reduce"
    row = "reduce-scatter of the output rows; backward: all-gather" if sequence_parallel else "all-reduce of the output"
    projections = [f"TP {kind}.{name} ({'column' if name in ('qkv', 'w13') else 'row'}-parallel; "
                   f"{column if name in ('qkv', 'w13') else row})"
                   for kind, names in (("attn", ("qkv", "out")), ("ffn", ("w13", "w2")),
                                       ("shared_expert", ("w13", "w2"))) for name in names]
    sums = (["gradient all-reduce (TP shards, data-parallel group)", "gradient all-reduce (the rest, world)"]
            if sequence_parallel else ["gradient all-reduce"])
    layers = check_report(report, table, ["MoE layer (route, dispatch all-to-all, experts, combine all-to-all)",
                                          *projections, *sums, STEP], world=2)
    tokens = 6 * 16 // (2 if sequence_parallel else 1)  # one data-parallel rank: the batch, cut under SP
    qkv, out = layers[projections[0]], layers[projections[1]]
    assert [layers[p]["count"] for p in projections] == [3, 3, 2, 2, 1, 1]
    assert qkv["shapes"] == f"[{tokens}, 32] -> [96, 48] float32 on each of 2 ranks"
    assert out["shapes"] == f"[96, 16] -> [{tokens}, 32] float32 on each of 2 ranks"
    whole = 96 * 32 * 4  # the group's rows of d_model, fp32: half of them cross in each collective of 2 ranks
    if sequence_parallel:
        assert qkv["bytes_sent"] == out["bytes_sent"] == {"fwd": whole // 2, "fwd_bwd": whole}
    else:
        assert qkv["bytes_sent"] == {"fwd": 0, "fwd_bwd": whole} and out["bytes_sent"] == {"fwd": whole,
                                                                                            "fwd_bwd": whole}
    for name in projections:
        assert layers[name]["fused"]["unavailable"] == CPU_REASON and layers[name]["bulk"]["fwd_bwd_ms"] > 0
    # one data-parallel rank: the projections' shards need no sum; under SP the rest is summed over the world
    assert layers[sums[0]]["bulk"]["unavailable"] == "one rank in the group"
    if sequence_parallel:
        assert layers[sums[0]]["shapes"] == "13,056 fp32 values (flat) over 1 rank"  # not '1 ranks'
        assert layers[sums[1]]["bulk"]["fwd_bwd_ms"] > 0 and "over 2 ranks" not in layers[sums[1]]["shapes"]


def test_measure_and_render_with_both_modes(tmp_path):
    """Where a fused mode exists: both timed, speedup and % of speed of light from the measured times."""
    layer = CommLayer("fake exchange", "[4 x 4]", {"fwd": 2_000_000},
                      {"fwd": lambda: time.sleep(0.02)}, {"fwd": lambda: time.sleep(0.004)})
    entry = measure_layer(layer, CPU, bandwidth=1e9, warmup=1, iters=5)
    bulk, fused = entry["bulk"]["fwd_ms"], entry["fused"]["fwd_ms"]
    assert 20 <= bulk < 200 and 4 <= fused < 100  # host timer: a sleep takes at least its time
    assert entry["speedup"]["fwd"] == pytest.approx(bulk / fused) and entry["speedup"]["fwd"] > 1.5
    assert entry["pct_sol"]["fused"]["fwd"] == pytest.approx(100 * 2.0 / fused)  # 2 MB at 1 GB/s: 2 ms
    step = CommLayer(STEP, "batch 4", {"fwd": 0}, {"fwd": lambda: None}, "no fused step here")
    report = {"model": "fake", "modes": "bulk vs fused", "environment": environment(CPU),
              "timing": {"method": "host perf_counter", "warmup": 1, "iters": 5},
              "peer_bandwidth_GBps": 1.0, "layers": [entry, measure_layer(step, CPU, None, 0, 2)]}
    table = markdown(report)
    row = next(line for line in table.splitlines() if line.startswith("| fake exchange"))
    assert f"{bulk:.3f} | {fused:.3f} | {bulk / fused:.2f}x" in row and "2.00 MB" in row
    assert "measured in this run (1 GB/s)" in table and "no fused step here" in table
    assert "Shapes ('here', 'on this rank'): rank 0's." in table  # the bytes are another rank's where it sends more
    write_json(report, tmp_path / "report.json")
    assert json.loads((tmp_path / "report.json").read_text())["layers"][0]["fused"]["fwd_ms"] == fused
    assert write_png(report, tmp_path / "report.png") is None and (tmp_path / "report.png").stat().st_size > 1000


def _codec_bytes(rank: int, world: int) -> None:
    """The gradient all-reduce with a codec: its fused column is timed (here the bulk twin stands in for the fused
    kernel: the same encoded messages), and its bytes and % of speed of light are those of the encoded messages it
    sends, not the fp32 ring's of the plain column."""
    env = DistEnv(rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"), backend="gloo")
    layer = grad_allreduce_layer([1000], "q8", env, None, 60.0)
    wire, gather = dist.all_to_all_single, dist.all_gather_into_tensor
    counted = []

    def all_to_all(out, x, *args, **kwargs):
        counted.append((world - 1) * x[0].numel())  # [world, bytes] uint8: a row to every other rank
        return wire(out, x, *args, **kwargs)

    def all_gather(out, x, *args, **kwargs):
        if x.dtype == torch.uint8:  # the reduced chunk's encoding to every other rank (not the calls' check)
            counted.append((world - 1) * x.numel())
        return gather(out, x, *args, **kwargs)
    dist.all_to_all_single, dist.all_gather_into_tensor = all_to_all, all_gather
    try:
        layer.fused["fwd_bwd"]()
    finally:
        dist.all_to_all_single, dist.all_gather_into_tensor = wire, gather
    sent = sum(counted)
    assert sent == 2 * (world - 1) * 16 * 34  # 1000 values: 16 blocks of 32 per rank's chunk, 34 bytes each (q8)
    entry = measure_layer(layer, env, bandwidth=1e9, warmup=0, iters=2)
    assert entry["bytes_sent"] == {"fwd_bwd": 2 * (world - 1) * 1000 * 4 // world}  # the plain ring's, fp32
    assert entry["fused_bytes_sent"] == {"fwd_bwd": sent}
    for mode, nbytes in (("bulk", entry["bytes_sent"]["fwd_bwd"]), ("fused", sent)):
        assert entry["pct_sol"][mode]["fwd_bwd"] == pytest.approx(100 * nbytes / 1e9 * 1e3
                                                                  / entry[mode]["fwd_bwd_ms"])
    report = {"model": "fake", "modes": "bulk vs fused", "environment": environment(CPU), "peer_bandwidth_GBps": 1.0,
              "timing": {"method": "host perf_counter", "warmup": 0, "iters": 2}, "layers": [entry]}
    row = next(line for line in markdown(report).splitlines() if line.startswith("| gradient all-reduce"))
    assert "| 4.00 kB (fused 1.09 kB) |" in row


def test_a_codecs_bytes_and_speed_of_light_are_its_encoded_messages():
    run_world(2, _codec_bytes, timeout=300)


def _enumerated_moe_bytes(routings: list[tuple[torch.Tensor, torch.Tensor]], rank: int, local_experts: int,
                          row_bytes: int, dispatch_by_token: bool, combine_by_token: bool) -> dict[str, int]:
    """What `rank` sends in one MoE layer, token by token, from the kernels' protocol (moe/kernels/fused_dispatch.py,
    fused_combine.py): routings[s] = (expert ids [tokens, k], kept [tokens, k]) of source s. A token's n kept rows on
    another owner: the dispatch by row sends n rows, by token one row and n (int32 id, fp32 weight); the combine
    sends back n rows, by token one summed row. Backward: the source sends the output gradient n times (by row) or
    once (by token); the owner sends each row's input gradient, by token also each row's routing weight gradient
    as an int64 word."""
    fwd = bwd = 0
    for source, (ids, kept) in enumerate(routings):
        for token in range(ids.shape[0]):
            owners = [int(e) // local_experts for e, k in zip(ids[token], kept[token]) if k]
            for owner in set(owners) - {source}:
                n = owners.count(owner)
                if source == rank:
                    fwd += row_bytes + 8 * n if dispatch_by_token else n * row_bytes
                    bwd += row_bytes if combine_by_token else n * row_bytes
                if owner == rank:
                    fwd += row_bytes if combine_by_token else n * row_bytes
                    bwd += n * row_bytes + (8 * n if combine_by_token else 0)
    return {"fwd": fwd, "fwd_bwd": fwd + bwd}


def _routing(ids: list[list[int]], dropped: list[tuple[int, int]] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    expert_ids = torch.tensor(ids, dtype=torch.int64).view(len(ids), -1)
    kept = torch.ones_like(expert_ids, dtype=torch.bool)
    for token, j in dropped:
        kept[token, j] = False
    return expert_ids, kept


def _moe_bytes_of_every_rank(routings, local_experts: int, row_bytes: int, by_token: tuple[bool, bool]):
    world = len(routings)
    routes = torch.stack([routes_per_owner(ids, kept, local_experts, world) for ids, kept in routings])
    return [moe_bytes_sent(routes, rank, row_bytes, *by_token) for rank in range(world)]


MODES = [(False, False), (True, False), (True, True)]  # (dispatch, combine) by token: rows, tokens + rows, auto


# 3 ranks of 2 experts each (rank r: experts 2r, 2r + 1)
HAND_BUILT = {
    "top-2": [_routing([[2, 3], [0, 4], [1, 0], [5, 4], [3, 4]], dropped=[(4, 1)]),  # a pair on rank 1, one on 2,
              # one kept at home, a token with one of two dropped
              _routing([[0, 1], [4, 5], [2, 3], [0, 5]]),
              _routing([[4, 5], [5, 4]])],  # no token routed away
    "top-3": [_routing([[2, 3, 4], [0, 1, 2], [5, 4, 3]], dropped=[(2, 0)]),
              _routing([[0, 2, 4], [1, 0, 5], [3, 2, 1], [4, 0, 2], [5, 4, 1]]),
              _routing([[4, 5, 0], [5, 4, 1]])],
    "a rank without tokens": [_routing([[2, 4], [4, 5]]), _routing([[0, 1]]),
                              (torch.empty(0, 2, dtype=torch.int64), torch.empty(0, 2, dtype=torch.bool))],
}


@pytest.mark.parametrize("by_token", MODES)
@pytest.mark.parametrize("case", list(HAND_BUILT))
def test_moe_bytes_are_what_the_exchanges_move(case, by_token):
    """The MoE row's bytes per rank (fused_dlrm.report.moe.moe_bytes_sent) against the tokens enumerated one by one:
    tokens whose experts share an owner, tokens kept at home, dropped assignments, a rank sending nothing away."""
    routings = HAND_BUILT[case]
    counted = _moe_bytes_of_every_rank(routings, 2, 64, by_token)
    assert counted == [_enumerated_moe_bytes(routings, rank, 2, 64, *by_token) for rank in range(3)]
    assert counted[2]["fwd"] > 0  # it sends nothing away, but returns what it received


@pytest.mark.parametrize("settings", [{}, {"max_tokens_per_rank": 8}, {"max_tokens_per_rank": 8, "combine": "rows"},
                                      {"max_tokens_per_rank": 8, "dispatch": "rows"},
                                      {"max_tokens_per_rank": 8, "dispatch": "tokens"}])
def test_moe_bytes_count_the_exchanges_the_fused_layer_makes(settings):
    """The fused column's bytes go by token where the fused layer's dispatch and combine do ("auto" resolved as
    MoELayer resolves it), and the report's fused column (training's max_tokens_per_rank) resolves "auto" to tokens."""
    fused = FusedMoEConfig(**settings)
    layer = MoELayer(32, 48, 4, 2, comm="fused", fused=fused, workspace=SimulatedWorld(1).workspaces()[0])
    assert (fused.dispatches_by_token, fused.combines_by_token) == (layer.dispatch.by_token, layer.combine_by_token)
    trained = fused_moe_config(with_modes(config(*MOE), "fused"), CPU)
    assert trained.dispatches_by_token and trained.combines_by_token


def _moe_fused_bytes(rank: int, world: int, tmp: str) -> None:
    """The MoE row with its fused column stood in for by the bulk layer (the CPU has no fused path): its fused bytes
    are the exchanges by token's for the routing the report counted (every rank's, enumerated token by token), and
    the step row's fused bytes count them for each MoE layer."""
    import fused_dlrm.report.moe as report_moe
    env = DistEnv(rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"), backend="gloo")
    routed = []
    report_moe.fused_moe = lambda cfg, env, layer: (layer, build_moe(with_modes(cfg, "bulk"), env))
    count = report_moe.routes_per_owner
    report_moe.routes_per_owner = lambda ids, kept, *args: routed.append((ids, kept)) or count(ids, kept, *args)
    moe = config(*MOE, "model.num_experts=8", "model.top_k=3")
    layers = moe_layers(moe, env, Path(tmp))
    routings = [None] * world
    dist.all_gather_object(routings, routed[0])
    layer, step = layers[0], layers[-1]
    assert layer.name == MOE_LAYER and step.name == STEP and not isinstance(layer.fused, str)
    assert layer.fused_bytes_sent == _enumerated_moe_bytes(routings, rank, 4, 32 * 4, True, True)
    assert layer.bytes_sent == _enumerated_moe_bytes(routings, rank, 4, 32 * 4, False, False)
    assert not any("upper bound" in note for note in layer.notes)
    assert any(note.startswith("bytes: fused (what its % of speed of light counts): dispatch by token")
               for note in layer.notes)
    for p in ("fwd", "fwd_bwd"):
        assert (step.fused_bytes_sent[p] - step.bytes_sent[p]
                == layer.count * (layer.fused_bytes_sent[p] - layer.bytes_sent[p])), p


def test_moe_fused_bytes_are_the_exchanges_by_token(tmp_path):
    run_world(2, _moe_fused_bytes, str(tmp_path), timeout=400)


def test_moe_bytes_by_token_save_a_row_per_shared_owner():
    """The exchanges by row move the bulk all-to-alls' rows; by token at most those rows (plus 8 bytes of id and
    weight per row, and backward an 8-byte routing weight gradient per received row), as many where every token's
    experts are on distinct ranks, fewer where some share one."""
    generator = torch.Generator().manual_seed(7)
    world, local_experts, row_bytes = 3, 4, 256
    for top_k in (1, 2, 3, 5):
        routings = []
        for tokens in (37, 0, 51):
            ids = torch.rand(tokens, world * local_experts, generator=generator).argsort(dim=1)[:, :top_k]
            routings.append((ids, torch.rand(tokens, top_k, generator=generator) < 0.9))
        distinct = []  # every token's experts on distinct ranks (one expert per rank, a random one)
        for tokens in (23, 0, 30):
            ranks = torch.rand(tokens, world, generator=generator).argsort(dim=1)[:, :min(top_k, world)]
            distinct.append((ranks * local_experts + torch.randint(local_experts, ranks.shape, generator=generator),
                             torch.ones_like(ranks, dtype=torch.bool)))
        for routing, equal in ((routings, top_k == 1), (distinct, True)):
            bulk = _moe_bytes_of_every_rank(routing, local_experts, row_bytes, (False, False))
            by_token = _moe_bytes_of_every_rank(routing, local_experts, row_bytes, (True, True))
            assert bulk == [_enumerated_moe_bytes(routing, r, local_experts, row_bytes, False, False)
                            for r in range(world)]
            assert by_token == [_enumerated_moe_bytes(routing, r, local_experts, row_bytes, True, True)
                                for r in range(world)]
            for rank in range(world):
                rows_out = sum(int((ids[k] // local_experts != rank).sum()) for ids, k in [routing[rank]])
                rows_in = sum(int((ids[k] // local_experts == rank).sum()) for s, (ids, k) in enumerate(routing)
                              if s != rank)
                rows = {"fwd": 8 * rows_out, "fwd_bwd": 8 * (rows_out + rows_in)}  # ids, weights, weight gradients
                assert bulk[rank]["fwd"] == (rows_out + rows_in) * row_bytes
                assert bulk[rank]["fwd_bwd"] == 2 * bulk[rank]["fwd"]
                for p in ("fwd", "fwd_bwd"):
                    if equal:
                        assert by_token[rank][p] == bulk[rank][p] + rows[p], (top_k, rank, p)
                    else:
                        assert by_token[rank][p] <= bulk[rank][p] + rows[p], (top_k, rank, p)
            if not equal:  # top-3 and top-5 of 12 experts on 3 ranks: some tokens have two experts on one rank
                assert sum(b["fwd_bwd"] for b in by_token) < sum(b["fwd_bwd"] for b in bulk)


def test_commit_unknown_without_git_or_outside_a_checkout_of_this_code(monkeypatch):
    """The commit is this code's or 'unknown': not another repository's that holds an installed copy of it."""
    assert len(environment(CPU)["commit"]) == 40  # this checkout
    monkeypatch.setattr(render, "REPO", render.REPO / "fused_dlrm")  # as a copy inside another repository
    assert environment(CPU)["commit"] is None and environment(CPU)["uncommitted_changes"] is None
    monkeypatch.undo()
    monkeypatch.setenv("PATH", "/nonexistent")  # no git at all
    env = environment(CPU)
    assert env["commit"] is None and env["uncommitted_changes"] is None
    report = {"model": "fake", "modes": "bulk vs fused", "environment": env, "peer_bandwidth_GBps": None,
              "timing": {"method": "host perf_counter", "warmup": 1, "iters": 2}, "layers": []}
    assert "; commit unknown; torch" in markdown(report)


def test_paper_scale_configs_compose_and_fit_two_h200s():
    dlrm = config("model=dlrm_paper")
    assert (dlrm.data.num_sparse, dlrm.model.num_rows, dlrm.model.embedding_dim) == (128, 100_000, 256)
    assert dlrm.data.train.mean_pooling == 10 and 2048 <= dlrm.data.global_batch_size <= 4096
    assert dlrm.data.train.device == dlrm.data.eval.device == "auto"  # on GPUs the GPU's: the host is slower
    assert dlrm.model.dense_arch[-1] == dlrm.model.embedding_dim and dlrm.model.name == "dlrm"
    tables_per_gpu = dlrm.data.num_sparse * dlrm.model.num_rows * dlrm.model.embedding_dim * 4 / 2
    assert tables_per_gpu < 7e9  # + row-wise Adagrad state (one value per row) and per-step buffers: see the yaml

    moe = config("model=moe_transformer_finegrained")
    m = moe.model
    assert (m.d_model, m.num_experts, m.top_k, m.ffn, m.name) == (2048, 64, 6, 1408, "moe_transformer")
    with torch.device("meta"):  # the real module structure, no memory
        model = build_moe(moe, DistEnv(0, 1, 0, torch.device("meta"), None))
    experts = sum(p.numel() for p in expert_parameters(model))
    replicated = sum(p.numel() for p in model.parameters()) - experts
    per_gpu = (experts / 2 + replicated) * 16  # fp32 weights, gradients and AdamW's two moments
    assert 30e9 < per_gpu < 45e9, per_gpu  # the yaml's estimate (activations ~32 GB more) within 141 GB


def test_shrunken_paper_configs_train_two_steps(tmp_path):
    dlrm = config("model=dlrm_paper", "data.num_sparse=12", "model.num_rows=500",  # data.train.device=auto: the CPU
                  "model.embedding_dim=16", "model.dense_arch=[32,16]", "model.over_arch=[64,32,1]",
                  "data.global_batch_size=32",
                  "trainer.max_steps=2", "trainer.log_every=1", "trainer.progress=false", "data.eval_batches=1",
                  "trainer.checkpoint_every=0")
    result = train_dlrm(dlrm, CPU, tmp_path / "dlrm")
    assert result.step == 2 and all(math.isfinite(loss) for _, loss in result.losses)
    moe = config("model=moe_transformer_finegrained", "model.d_model=32", "model.ffn=24", "model.num_experts=8",
                 "model.num_layers=2", "model.num_heads=2", "data.seq_len=16", "data.global_batch_size=4",
                 "data.size_bytes=100000", "trainer.max_steps=2", "trainer.log_every=1", "trainer.progress=false",
                 "data.eval_batches=1", "trainer.checkpoint_every=0")
    result = train_moe(moe, CPU, tmp_path / "moe")
    assert result.step == 2 and all(math.isfinite(loss) for _, loss in result.losses)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (NCCL, symmetric memory)")
def test_two_gpus_fused_columns_timed(tmp_path):
    """On 2 GPUs: train.py comm=fused report=true; the fused columns are timed with CUDA events, speedups and % of
    speed of light filled in; the MoE report times the fused MoELayer and the whole fused MoE Transformer step."""
    run_torchrun([*DLRM[1:], "comm=fused", "comm.grad_allreduce=q8", "report=true", "trainer.max_steps=5",
                  "trainer.progress=false", "data.eval_batches=1", "trainer.checkpoint_every=0",
                  f"hydra.run.dir={tmp_path}/dlrm"])
    report, _ = read(tmp_path / "dlrm")
    layers = {e["name"]: e for e in report["layers"]}
    assert report["timing"]["method"] == "CUDA events" and report["peer_bandwidth_GBps"] > 1
    for name in (LOOKUP, STEP):
        assert set(layers[name]["speedup"]) == {"fwd", "fwd_bwd"}, layers[name]
        assert all(v > 0 for v in layers[name]["pct_sol"]["fused"].values())
    assert all(layers[name]["fused"]["fwd_bwd_ms"] > 0 for name in ARCH_SUMS)
    for name in (*ARCH_SUMS, STEP):  # q8's encoded messages: ~1.06 bytes a value against the ring's 4
        assert layers[name]["fused_bytes_sent"]["fwd_bwd"] < layers[name]["bytes_sent"]["fwd_bwd"], name
    assert "no fused input dist" in layers["sparse input dist (KJT all-to-all)"]["fused"]["unavailable"]

    run_torchrun([*MOE[1:], "report=true", "trainer.max_steps=2", "trainer.progress=false", "data.eval_batches=1",
                  "trainer.checkpoint_every=0", f"hydra.run.dir={tmp_path}/moe"])
    report, _ = read(tmp_path / "moe")
    moe, step = report["layers"][0], report["layers"][-1]
    assert set(moe["speedup"]) == {"fwd", "fwd_bwd"} and moe["bytes_sent"]["fwd"] > 0  # the fused MoELayer
    assert set(step["speedup"]) == {"fwd", "fwd_bwd"} and step["fused"]["fwd_bwd_ms"] > 0  # bbd6165's fused step


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (side-stream copy of the next batch)")
@pytest.mark.parametrize("data_device", ["cpu", "auto"])
def test_gpu_batches_copied_ahead_train_as_without_prefetch(tmp_path, data_device):
    """The loop's next batch is made (auto: on the GPU) or pinned and copied (cpu), and input-distributed, on side
    streams: the same losses with and without the input dist ahead. (Not comparable with the CPU: tables and dense
    layers initialise from the device's generator.)"""
    gpu = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cuda", 0), backend=None)
    common = [*DLRM[1:], f"data.train.device={data_device}", "trainer.max_steps=12", "trainer.log_every=1",
              "trainer.progress=false", "data.eval_batches=1", "trainer.checkpoint_every=0"]
    ahead = train_dlrm(config(*common), gpu, tmp_path / "ahead")
    plain = train_dlrm(config(*common, "trainer.prefetch_input_dist=false"), gpu, tmp_path / "plain")
    assert [s for s, _ in ahead.losses] == list(range(1, 13)) == [s for s, _ in plain.losses]
    # a batch read before its copy landed, or another step's batch, would move the curve far more than this
    torch.testing.assert_close([l for _, l in ahead.losses], [l for _, l in plain.losses], rtol=1e-5, atol=1e-6)


def test_the_picture_names_the_pass_of_a_layer_timed_in_neither_mode(tmp_path, monkeypatch):
    """A layer with no mode here (the gradient all-reduce of one process) is drawn as n/a under its own pass,
    forward+backward, not 'forward', which it does not have."""
    from matplotlib.axes import Axes

    labels = []
    set_xticks = Axes.set_xticks
    monkeypatch.setattr(Axes, "set_xticks", lambda ax, ticks, names, **kw: (labels.extend(names),
                                                                            set_xticks(ax, ticks, names, **kw)))
    layers = [grad_allreduce_layer([100], "nccl", CPU, CPU_REASON, 60.0),
              CommLayer("input", "[2 x 2]", {"fwd": 8}, {"fwd": lambda: None}, "no fused input"),
              CommLayer(STEP, "batch 4", {"fwd": 0, "fwd_bwd": 0}, {"fwd": lambda: None, "fwd_bwd": lambda: None},
                        CPU_REASON)]
    report = {"model": "fake", "modes": "bulk vs fused", "environment": environment(CPU), "peer_bandwidth_GBps": None,
              "timing": {"method": "host perf_counter", "warmup": 0, "iters": 1},
              "layers": [measure_layer(layer, CPU, None, 0, 1) for layer in layers]}
    assert write_png(report, tmp_path / "report.png") is None
    assert labels == ["gradient all-reduce\n(forward+backward)", "input\n(forward)",
                      "training step\n(forward+backward)"]


def _drawn(report: dict, path: Path, monkeypatch) -> tuple[list[str], list[str]]:
    """(the bars' labels, every text of the figure as saved) of write_png's picture of `report`."""
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure
    from matplotlib.text import Text

    labels, texts = [], []
    set_xticks, savefig = Axes.set_xticks, Figure.savefig
    monkeypatch.setattr(Axes, "set_xticks", lambda ax, ticks, names, **kw: (labels.extend(names),
                                                                            set_xticks(ax, ticks, names, **kw)))
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **kw: (
        texts.extend(t.get_text() for t in fig.findobj(Text)), savefig(fig, *a, **kw)))
    assert write_png(report, path) is None
    return labels, texts


def test_the_picture_tells_layers_apart_and_says_why_a_bar_is_missing(tmp_path, monkeypatch):
    """The DLRM's two gradient all-reduces (one per dense arch) get labels of their own, and each n/a bar's reason
    is on the picture, in the words of the md (e.g. no fused path on this machine), with the layers it concerns."""
    grad = torch.zeros(2)
    layers = [CommLayer("input (KJT all-to-all)", "[2 x 2]", {"fwd": 8}, {"fwd": lambda: None},
                        "no fused input dist yet"),
              CommLayer("gradient all-reduce (dense arch)", "9 values", {"fwd_bwd": 4},
                        {"fwd_bwd": lambda: grad.add_(1)}, CPU_REASON),
              CommLayer("gradient all-reduce (over arch)", "7 values", {"fwd_bwd": 4},
                        {"fwd_bwd": lambda: grad.add_(1)}, CPU_REASON),
              CommLayer(STEP, "batch 4", {"fwd": 0, "fwd_bwd": 0}, {"fwd": lambda: None, "fwd_bwd": lambda: None},
                        CPU_REASON)]
    report = {"model": "fake", "modes": "bulk vs fused", "environment": environment(CPU), "peer_bandwidth_GBps": None,
              "timing": {"method": "host perf_counter", "warmup": 0, "iters": 1},
              "layers": [measure_layer(layer, CPU, None, 0, 1) for layer in layers]}
    labels, texts = _drawn(report, tmp_path / "report.png", monkeypatch)
    assert len(set(labels)) == len(labels) == 4, labels
    flat = [label.replace("\n", " ") for label in labels]  # labels are wrapped
    assert "gradient all-reduce (dense arch) (forward+backward)" in flat, flat
    assert "gradient all-reduce (over arch) (forward+backward)" in flat, flat
    caption = " ".join(texts).replace("\n", " ")
    assert f"fused n/a, {CPU_REASON}: gradient all-reduce (dense arch), gradient all-reduce (over arch), " \
           f"training step" in caption, caption
    assert "fused n/a, no fused input dist yet: input" in caption, caption


def _models_built(monkeypatch) -> list:
    """The models report/moe.py builds (bulk first), recorded as it builds them."""
    import fused_dlrm.report.moe as report_moe

    models, build = [], report_moe.build_model
    monkeypatch.setattr(report_moe, "build_model", lambda cfg, env: models.append(build(cfg, env)) or models[-1])
    return models


def _experts_compute_with_copies(layer: MoELayer) -> bool:
    return all(compute_copy(p, torch.bfloat16) is not None for p in (layer.experts.w13, layer.experts.w2))


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="AdamW writes the compute copies on GPUs and in the Triton interpreter")
def test_moe_layers_are_timed_with_the_compute_copies_training_computes_with(tmp_path, monkeypatch):
    """model.precision=bf16: training's AdamW writes the experts' bf16 copies in its first step, and every forward
    after it computes with them instead of casting the fp32 experts (commit 6700867: ~8% of a fine-grained step on
    one H200). The report times its layers as those forwards run: the model's MoE layers hold their copies before
    anything is timed (a model never stepped cast every expert in each timed forward of the MoE layer row and the
    step's forward row, bulk and fused)."""
    models = _models_built(monkeypatch)
    moe_layers(config(*MOE, "model.precision=bf16"), CPU, tmp_path)
    layers = [m for m in models[0].modules() if isinstance(m, MoELayer)]
    assert len(layers) == 2 and all(map(_experts_compute_with_copies, layers))


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="AdamW writes the compute copies on GPUs and in the Triton interpreter")
def test_the_fused_twin_computes_with_copies_as_the_layer_does(tmp_path, monkeypatch):
    """The MoE row's fused column is a twin of the model's first MoE layer (its weights and routing settings): it
    computes with bf16 copies of its experts where that layer does, not casting its fp32 weights in every forward
    (the fused layer on one simulated rank stands in for the GPUs')."""
    import fused_dlrm.report.moe as report_moe

    models = _models_built(monkeypatch)
    cfg = config(*MOE, "model.precision=bf16")
    monkeypatch.setattr(report_moe, "fused_moe", lambda cfg, env, layer: ("no fused twin here", "no fused model"))
    moe_layers(cfg, CPU, tmp_path)  # the bulk model, as the report leaves it before timing
    layer = next(m for m in models[0].modules() if isinstance(m, MoELayer))
    world = SimulatedWorld(1).workspaces()[0]

    class OnASimulatedRank(MoELayer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, workspace=world, **kwargs)
    monkeypatch.undo()
    monkeypatch.setattr(report_moe, "no_fused_path", lambda env: None)
    monkeypatch.setattr(report_moe, "MoELayer", OnASimulatedRank)
    monkeypatch.setattr(report_moe, "build_model", lambda cfg, env: "the fused model")
    twin, _ = report_moe.fused_moe(cfg, CPU, layer)
    assert _experts_compute_with_copies(layer) and _experts_compute_with_copies(twin)
    for mine, theirs in ((twin.experts.w13, layer.experts.w13), (twin.experts.w2, layer.experts.w2)):
        assert torch.equal(mine, theirs) and compute_copy(mine, torch.bfloat16) is not compute_copy(theirs,
                                                                                                  torch.bfloat16)
        torch.testing.assert_close(compute_copy(mine, torch.bfloat16), mine.detach().to(torch.bfloat16),
                                   rtol=0, atol=0)
