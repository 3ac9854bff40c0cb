"""python -m fused_dlrm.bench dlrm_step on the CPU: torchrec's stock sharder and the project's bulk sharder under
DistributedModelParallel + TrainPipelineSparseDist, 2 gloo ranks at tiny shapes. Both must train the same model:
the same shapes, the first step's loss equal to the unsharded model's on the same batch, the same loss at every
step; the table and the JSON must hold what was measured. The torchrec baseline's "cannot run here" path is
simulated (this machine has no GPU) and must say why in one line, with no number for it."""

from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path

import fbgemm_gpu
import pytest
import torch
import torch.distributed as dist
from torchrec import EmbeddingBagCollection

from fused_dlrm.bench import dlrm_step
from fused_dlrm.dist import DistEnv, init_distributed
from fused_dlrm.sparse.fused_all_to_all import FusedCommConfig
from fused_dlrm.sparse.lookup import init_table
from fused_dlrm.sparse.sharded_ebc import table_seeds
from fused_dlrm.train.build import build_dataset, config_tables
from test_batch_not_made import criteo_file
from test_training import config as train_config
from world import run_torchrun, run_world

CPU = torch.device("cpu")
ROWS = [300, 1000, 700, 64, 2000, 500]
DIM = 8
# Uneven rows, a global batch that 2 ranks split 19 / 18.
TINY = [f"model.num_rows=[{','.join(map(str, ROWS))}]", "data.num_sparse=6", f"model.embedding_dim={DIM}",
        "model.dense_arch=[16,8]", "model.over_arch=[32,1]", "data.global_batch_size=37"]
WARMUP, STEPS = 1, 3
# Each table its own embedding optimizer (torchrec: apply_optimizer_in_backward per table).
PER_TABLE = ["model.embedding_optimizer.name=[sgd,rowwise_adagrad,sgd,rowwise_adagrad,rowwise_adagrad,sgd]",
             "model.embedding_optimizer.lr=[0.1,0.05,0.02,0.2,0.05,0.3]"]


def first_step_loss(args) -> tuple[float, int]:
    """(the loss of the initial model on the first global batch, its dense parameter count), unsharded in this
    process with torchrec's arches: the model every variant starts from, on both ranks' slices of the batch."""
    cfg = dlrm_step.config(args)
    model = dlrm_step.build_model(cfg, CPU, "torchrec")
    dense = sum(p.numel() for p in model.parameters() if not p.is_meta)  # the tables are on the meta device
    tables = config_tables(cfg)
    ebc = EmbeddingBagCollection(tables)
    seeds = table_seeds(tables, cfg.seed)
    with torch.no_grad():
        for t in tables:
            ebc.embedding_bags[t.name].weight.copy_(init_table(t, seeds[t.name], CPU))
    model.model.sparse_arch.embedding_bag_collection = ebc
    total, samples = 0.0, 0
    for rank in range(2):
        batch = build_dataset(cfg, "train", DistEnv(rank, 2, rank, CPU, "gloo")).batch(0)
        with torch.no_grad():
            total += float(model(batch)[0]) * batch.labels.numel()
        samples += batch.labels.numel()
    return total / samples, dense


def table_rows(stdout: str) -> dict[str, list[str]]:
    return {line.split()[0]: line.split()[1:] for line in stdout.splitlines()
            if line.split()[:1] and line.split()[0] in dlrm_step.VARIANTS}


# lean: train.py's arches, through the pipeline's fx trace; with each table's own optimizer
@pytest.mark.parametrize("arches,optimizers", [("torchrec", []), ("lean", PER_TABLE)])
def test_torchrec_and_bulk_train_the_same_model(tmp_path, arches, optimizers):
    out = tmp_path / "dlrm_step.json"
    argv = ["dlrm_step", "--warmup", str(WARMUP), "--steps", str(STEPS), "--batches", "3", "--arches", arches,
            "--out", str(out), *TINY, *optimizers]
    done = run_torchrun(argv, program=("-m", "fused_dlrm.bench"), timeout=300)
    report = json.loads(out.read_text())
    variants = report["variants"]
    assert list(variants) == ["torchrec", "bulk", "fused"]
    assert variants["fused"] == {"unavailable": "no fused path on this machine (CPU)"}
    assert report["timing"] == {"method": "host perf_counter", "warmup": WARMUP, "iters": STEPS,
                                "statistic": "median over iters, slowest rank"}
    assert report["environment"]["machine"]["world_size"] == 2
    assert report["config"]["num_rows"] == ROWS and report["config"]["global_batch_size"] == 37
    assert report["config"]["arches"] == arches

    expected_loss, dense = first_step_loss(dlrm_step.parse_args(TINY))
    torchrec, bulk = variants["torchrec"], variants["bulk"]
    for name, r in (("torchrec", torchrec), ("bulk", bulk)):
        assert r["warmup_steps"] == WARMUP and r["timed_steps"] == STEPS
        assert r["steps_run"] == len(r["losses"]) == WARMUP + STEPS, name
        assert r["loss_first"] == r["losses"][0] and r["loss_last"] == r["losses"][-1], name
        assert r["loss_first"] == pytest.approx(expected_loss, rel=1e-5), name
        assert r["global_batch"] == 37 and r["samples_per_s"] == pytest.approx(37e3 / r["step_ms"]), name
        assert r["model"] == {"tables": len(ROWS), "embedding_parameters": sum(ROWS) * DIM, "dense_parameters": dense}
        assert r["sharding"]["sharding_types"] == ["table_wise"] and r["sharding"]["compute_kernels"] == ["fused"]
        assert r["sharding"]["pipelined_modules"] == [r["sharding"]["module"]], name  # the pipeline ran its input dist
    assert torchrec["sharding"]["module"] == "ShardedEmbeddingBagCollection"  # torchrec's own, fbgemm's TBE
    assert bulk["sharding"]["module"] == "FusedShardedEBC"
    assert torchrec["sharding"]["backward_pushes"] is None and bulk["sharding"]["backward_pushes"] is None
    # Same model, batches and optimizers: the same loss curve (fp32, summation order aside), and it moved.
    assert bulk["losses"] == pytest.approx(torchrec["losses"], rel=1e-5)
    assert len(set(torchrec["losses"])) == len(torchrec["losses"])
    assert torchrec["speedup_vs_torchrec"] == 1.0
    assert bulk["speedup_vs_torchrec"] == pytest.approx(torchrec["step_ms"] / bulk["step_ms"])

    rows = table_rows(done.stdout)
    for name, r in (("torchrec", torchrec), ("bulk", bulk)):
        step_ms, samples, first, last, ratio = rows[name]
        assert float(step_ms) == pytest.approx(r["step_ms"], abs=1e-3)
        assert float(samples) == pytest.approx(r["samples_per_s"], abs=1)
        assert float(first) == pytest.approx(r["loss_first"], abs=1e-5)
        assert float(last) == pytest.approx(r["loss_last"], abs=1e-5)
        assert ratio == f"{r['speedup_vs_torchrec']:.2f}x"
    assert rows["fused"] == "not run: no fused path on this machine (CPU)".split()
    assert "dlrm_step: fused: no fused path on this machine (CPU)" in done.stdout.splitlines()


def _bulk_and_fused_at_one_rank(rank: int, world: int, argv: list[str], tmp: str) -> None:
    args = dlrm_step.parse_args(argv)
    cfg = dlrm_step.config(args)
    env = init_distributed(cfg.trainer.device, cfg.comm.backend)
    batches = dlrm_step.make_batches(cfg, env, args.batches)
    # run_variant, not run_suite: the suite leaves comm=fused out at world 1 (nothing to exchange to time)
    results = {v: dlrm_step.run_variant(v, cfg, env, batches, args.warmup, args.steps, args.arches)
               for v in ("bulk", "fused")}
    report = dlrm_step.suite_report(cfg, env, args.warmup, args.steps, args.arches, results)
    Path(tmp, "report.json").write_text(json.dumps(report))
    Path(tmp, "table.txt").write_text(dlrm_step.render_table(report))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (comm=fused)")
def test_fused_variant_on_one_gpu_pushes_through_the_interaction(tmp_path):
    """One rank on a GPU, train.py's lean arches under DMP + TrainPipelineSparseDist: the fused sharder trains the
    bulk sharder's model (same losses) and every backward's table gradient is pushed by the pairwise interaction's
    kernel (the exchange's output reaches it as a KeyedTensor's values, viewed), not by the exchange's fallback."""
    tiny = [a for a in TINY if not a.startswith("model.embedding_dim")] + ["model.embedding_dim=16",
                                                                          "model.dense_arch=[16,16]"]
    run_world(1, _bulk_and_fused_at_one_rank, ["--warmup", str(WARMUP), "--steps", str(STEPS), "--batches", "3",
                                               "--arches", "lean", *tiny], str(tmp_path), backend="nccl")
    bulk, fused = json.loads((tmp_path / "report.json").read_text())["variants"].values()
    assert fused["sharding"]["module"] == "FusedShardedEBC"
    assert fused["sharding"]["pipelined_modules"] == ["FusedShardedEBC"]
    assert fused["sharding"]["backward_pushes"] == {"consumer": WARMUP + STEPS, "exchange": 0}
    assert len(set(bulk["losses"])) == len(bulk["losses"])  # it trained
    assert fused["losses"] == pytest.approx(bulk["losses"], rel=1e-4)  # TF32 off: fp32 summation order aside
    assert (f"fused: the tables' gradient pushed by the interaction's kernel in {WARMUP + STEPS} backwards, by the "
            "exchange's push kernel in 0") in (tmp_path / "table.txt").read_text().splitlines()


# ------------------------------------------------------------------------------------------------------------
# The torchrec baseline where it cannot run: on GPUs with fbgemm-gpu's CPU build.


def test_check_for_fbgemm_cuda_kernels():
    reason = dlrm_step.torchrec_unavailable(torch.device("cuda"), cuda_kernels=lambda: False)
    assert reason.startswith("the torchrec baseline needs fbgemm-gpu (CUDA) and was not run")
    assert dlrm_step.torchrec_unavailable(torch.device("cuda"), cuda_kernels=lambda: True) is None
    assert dlrm_step.torchrec_unavailable(CPU, cuda_kernels=lambda: False) is None  # fbgemm's CPU kernels run it
    if fbgemm_gpu.__variant__ == "cpu":  # CI installs fbgemm-gpu-cpu: the real probe must see no CUDA kernels
        assert not dlrm_step.fbgemm_cuda_kernels()
        assert "is its cpu build" in dlrm_step.torchrec_unavailable(torch.device("cuda"))


def _suite_without_torchrec(rank: int, world: int, argv: list[str], tmp: str) -> None:
    real = dlrm_step.torchrec_unavailable
    # No GPU here: the check as it goes on a GPU whose fbgemm_gpu has no CUDA kernels.
    dlrm_step.torchrec_unavailable = lambda device: real(torch.device("cuda"), cuda_kernels=lambda: False)
    args = dlrm_step.parse_args(argv)
    cfg = dlrm_step.config(args)
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        dlrm_step.run(args, cfg, init_distributed(cfg.trainer.device, cfg.comm.backend))
    Path(tmp, f"stdout{rank}.txt").write_text(stdout.getvalue())


def test_torchrec_baseline_that_cannot_run_says_so(tmp_path):
    out = tmp_path / "report.json"
    run_world(1, _suite_without_torchrec, ["--variants", "torchrec,bulk", "--warmup", "0", "--steps", "2",
                                           "--batches", "2", "--out", str(out), *TINY], str(tmp_path))
    stdout = (tmp_path / "stdout0.txt").read_text().splitlines()
    reason = dlrm_step.torchrec_unavailable(torch.device("cuda"), cuda_kernels=lambda: False)
    assert stdout[0] == f"dlrm_step: torchrec: {reason}"  # one line, up front
    report = json.loads(out.read_text())
    assert report["variants"]["torchrec"] == {"unavailable": reason}
    bulk = report["variants"]["bulk"]
    assert bulk["steps_run"] == 2 and bulk["speedup_vs_torchrec"] is None  # no baseline: no ratio
    rows = table_rows("\n".join(stdout))
    assert rows["torchrec"] == f"not run: {reason}".split()
    assert rows["bulk"][-1] == "n/a"


def _batches_with_a_bad_line(rank: int, world: int, tmp: str) -> None:
    env = DistEnv(rank=rank, world_size=world, local_rank=rank, device=CPU, backend="gloo")
    cfg = train_config("data=criteo", f"data.train.paths=[{tmp}/bad.tsv]", "data.global_batch_size=16",
                       "model.num_rows=100")
    bad = re.escape(f"{tmp}/bad.tsv:28: malformed Criteo line")
    with pytest.raises(ValueError, match=bad if rank == 1 else rf"rank 0: rank\(s\) \[1\] could not make their "
                                                                rf"batches: ValueError: {bad}"):
        dlrm_step.make_batches(cfg, env, 2)
    dist.barrier()  # both raised: rank 0 does not go on into DMP's collectives without rank 1


def test_a_batch_one_rank_cannot_make_stops_every_rank(tmp_path):
    """Batch 1's line 12 (in rank 1's slice) is malformed: made up front, before any variant, it raises on both."""
    criteo_file(tmp_path / "bad.tsv", 32, bad_line=16 + 12)
    run_world(2, _batches_with_a_bad_line, str(tmp_path), timeout=120)


def _refused_before_measuring(rank: int, world: int, argv: list[str], error: str) -> None:
    def measured(*args):
        raise AssertionError("a variant was timed before the setting was refused")
    dlrm_step.run_variant = measured
    with pytest.raises(ValueError, match=error):
        args = dlrm_step.parse_args(argv)
        cfg = dlrm_step.config(args)
        dlrm_step.run(args, cfg, init_distributed(cfg.trainer.device, cfg.comm.backend))


# DLRM on Criteo files ({file}: a file of 40 lines)
CRITEO = ["data=criteo", "data.num_workers=0", "data.global_batch_size=16", "model.num_rows=100",
          "model.embedding_dim=8", "model.dense_arch=[16,8]", "data.train.paths=[{file}]"]


@pytest.mark.parametrize("overrides, error", [
    # the bench's batches are made by data.steps_per_epoch's stream
    ([*TINY, "data.steps_per_epoch=2.5"], r"data.steps_per_epoch=2.5: expected a step count >= 1"),
    ([*CRITEO, "data.steps_per_epoch=3"], "data.steps_per_epoch=3: an epoch of file-backed data is one pass"),
    # the fused variant's settings
    ([*TINY, "comm=fused", "comm.transport=ib"], r"comm.transport='ib' is unknown; expected one of"),
    ([*TINY, "comm=fused", "comm.wait_timeout_spins=0"], "comm.wait_timeout_spins=0: expected a whole number of polls"),
], ids=lambda value: " ".join(o for o in value if o not in TINY + CRITEO) if isinstance(value, list) else "")
def test_settings_training_refuses_are_refused_before_measuring(tmp_path, overrides, error):
    """The bench shapes its model, batches and fused variant by train.py's config: a setting it reads that training
    refuses (test_report.py's DLRM cases: train/loop.py's check_config, build_train_data) is refused here too, by
    the same checks, before anything is measured."""
    file = criteo_file(tmp_path / "day_0.tsv", 40, bad_line=None)
    overrides = [o.replace("{file}", str(file)) for o in overrides]
    run_world(1, _refused_before_measuring, ["--variants", "bulk", "--warmup", "0", "--steps", "1", "--batches", "1",
                                             *overrides], error, timeout=120)


@pytest.mark.parametrize("overrides, comm", [
    ([], "fused"),  # comm=bulk: the fused variant takes the fused exchange's defaults
    (["comm=fused", "comm.num_programs=3", "comm.wait_timeout_spins=1000"],
     FusedCommConfig(transport="p2p", num_programs=3, wait_timeout_spins=1000, allocation_timeout_s=60)),
])
def test_fused_variant_takes_the_configured_fused_settings(monkeypatch, overrides, comm):
    """comm=fused's settings are the fused variant's (GPUs), not checked and then left unread."""
    cfg = dlrm_step.config(dlrm_step.parse_args([*TINY, *overrides]))
    given = []

    def sharder(optimizers, comm):  # stops shard() there: the fused sharder needs a GPU
        given.append(comm)
        raise InterruptedError
    monkeypatch.setattr(dlrm_step, "FusedEmbeddingBagCollectionSharder", sharder)
    for variant, expected in (("bulk", "bulk"), ("fused", comm)):
        with pytest.raises(InterruptedError):
            dlrm_step.shard(dlrm_step.build_model(cfg, CPU), variant, cfg, DistEnv(0, 1, 0, CPU, None))
        assert given.pop() == expected


def test_needs_a_process_group(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SystemExit, match="needs a process group .* run it under torchrun"):
        dlrm_step.main(["--steps", "1", *TINY, "trainer.device=cpu"])


def test_a_variant_named_twice_is_refused(capsys):
    """Each variant's results are kept under its name: named twice it ran twice and the first run's numbers were
    dropped without a word."""
    with pytest.raises(SystemExit) as exit_:
        dlrm_step.parse_args(["--variants", "bulk,torchrec,bulk", *TINY])
    assert exit_.value.code == 2 and "--variants: bulk named twice" in capsys.readouterr().err
