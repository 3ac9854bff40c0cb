"""End-to-end training on synthetic data: loss falls, AUC rises, checkpoints resume exactly, NaN stops the run."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import OmegaConf

from fused_dlrm.data import CriteoTSV, SyntheticCriteo
from fused_dlrm.dist import DistEnv, all_reduce_sum
from fused_dlrm.sparse.sharded_ebc import ShardedEmbeddingBagCollection, shard_weight
from fused_dlrm.sparse.optimizer import EmbeddingOptimizerConfig
from fused_dlrm.train.build import build_dataset, build_model, config_tables, dense_parameters, embedding_optimizers
from fused_dlrm.train.checkpoint import load_checkpoint
from fused_dlrm.train.loop import check_own_eval_samples, train, train_step
from fused_dlrm.train.metrics import CTRMetrics
from fused_dlrm.train.schedule import NonFiniteLossError, TrainingRun
from fused_dlrm.train.rundir import register_resolvers
from world import run_torchrun, run_world

ROOT = Path(__file__).resolve().parents[1]
CPU = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend=None)
SMALL = ["model.num_rows=2000", "data.num_sparse=8", "data.global_batch_size=128", "trainer.progress=false",
         "trainer.log_every=5", "data.eval_batches=2"]


def config(*overrides: str):
    register_resolvers()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def test_config_composes_with_defaults_and_overrides():
    cfg = config()
    assert cfg.model.name == "dlrm" and cfg.comm.mode == "bulk" and cfg.data.train._target_.endswith("SyntheticCriteo")
    assert cfg.model.dense_arch[-1] == cfg.model.embedding_dim
    cfg = config("data=criteo", "data.train.paths=[a.tsv]", "model.embedding_dim=8", "model.dense_arch=[32,8]")
    assert cfg.data.num_sparse == 26 and list(cfg.data.train.paths) == ["a.tsv"] and cfg.model.embedding_dim == 8


def test_loss_falls_and_auc_rises(tmp_path, caplog):
    # The default model and data, shortened: well inside a minute on 2 cores.
    cfg = config("trainer.max_steps=120", "trainer.eval_every=0", "trainer.checkpoint_every=0",
                 "trainer.progress=false", "trainer.log_every=20")
    with caplog.at_level(logging.INFO, logger="fused_dlrm.train.loop"):
        result = train(cfg, CPU, tmp_path)
    losses = [loss for _, loss in result.losses]
    assert losses[-1] < losses[0] - 0.05, losses
    assert result.evals[-1]["auc"] > 0.6, result.evals
    lines = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert {"step", "loss", "step_ms", "samples_per_s"} <= set(lines[0]) and "auc" in lines[-1]
    assert [line["steps"] for line in lines if "loss" in line] == [20] * 6  # each interval's (scripts/step_times.py)
    # the mean step time of the interval, next to the rate it gives
    assert lines[0]["step_ms"] * lines[0]["samples_per_s"] / 1000 == pytest.approx(cfg.data.global_batch_size)
    # the loop's own lines (caplog takes every logger's: torch logs a warning once per process, first in a run alone)
    loop_lines = [r.getMessage() for r in caplog.records if r.name == "fused_dlrm.train.loop"]
    assert re.fullmatch(r"step 20 loss \d+\.\d{5} step_ms \d+\.\d samples/s \d+", loop_lines[0])


OPTIMIZER = "trainer.dense_optimizer"


# Every dense optimizer's state resumes: Adam's moments and step, SGD's momentum buffers (weight decay, Nesterov),
# AdamW's decoupled decay, Adagrad's sums (not fused: torch's fused Adagrad is CPU-only)
@pytest.mark.parametrize("optimizer", [
    [f"{OPTIMIZER}._target_=torch.optim.Adam", f"{OPTIMIZER}.lr=0.01"],
    [f"{OPTIMIZER}._target_=torch.optim.SGD", f"{OPTIMIZER}.lr=0.05", f"+{OPTIMIZER}.momentum=0.9",
     f"+{OPTIMIZER}.nesterov=true", f"+{OPTIMIZER}.weight_decay=0.01"],
    [f"{OPTIMIZER}._target_=torch.optim.AdamW", f"{OPTIMIZER}.lr=0.01", f"+{OPTIMIZER}.weight_decay=0.1"],
    [f"{OPTIMIZER}._target_=torch.optim.Adagrad", f"{OPTIMIZER}.lr=0.05", f"~{OPTIMIZER}.fused"],
], ids=["Adam", "SGD-momentum", "AdamW", "Adagrad"])
def test_resume_continues_the_exact_loss_curve(tmp_path, optimizer):
    common = SMALL + ["trainer.max_steps=30", "trainer.eval_every=0", "trainer.checkpoint_every=10", *optimizer]
    full = train(config(*common), CPU, tmp_path / "full")
    assert sorted(p.name for p in (tmp_path / "full" / "checkpoints").iterdir()) == ["step_20", "step_30"]
    resumed = train(config(*common, f"trainer.resume_from={tmp_path / 'full' / 'checkpoints' / 'step_20'}"),
                    CPU, tmp_path / "resumed")
    assert resumed.losses == [(s, l) for s, l in full.losses if s > 20]


def _resume_two_ranks(rank: int, world: int, tmp: str, shards: tuple[str, ...]) -> None:
    env = DistEnv(rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"), backend="gloo")
    common = SMALL + ["trainer.max_steps=20", "trainer.eval_every=0", "trainer.checkpoint_every=10",
                      "data.global_batch_size=101",  # uneven local batches: 51 and 50
                      *shards]
    full = train(config(*common), env, Path(tmp) / "full")
    resumed = train(config(*common, f"trainer.resume_from={tmp}/full/checkpoints/step_10"), env, Path(tmp) / "r10")
    assert resumed.losses == [(s, l) for s, l in full.losses if s > 10]


def test_synthetic_data_is_made_on_the_models_device_unless_told():
    """data.train.device is auto by default, eval's following it: each dataset makes its batches on the model's
    device (env.device); cpu and cuda are kept. The GPU model's datasets are only made, never asked for a batch:
    no GPU is needed."""
    assert config(*SMALL).data.train.device == "auto"
    gpu = DistEnv(rank=1, world_size=2, local_rank=1, device=torch.device("cuda", 1), backend=None)
    for env, told, made in ((CPU, "auto", "cpu"), (gpu, "auto", "cuda:1"), (gpu, "cpu", "cpu"), (gpu, "cuda", "cuda")):
        cfg = config(*SMALL, f"data.train.device={told}")
        datasets = [build_dataset(cfg, split, env) for split in ("train", "eval")]
        assert [d.device for d in datasets] == [torch.device(made)] * 2, (env.device, told)
    assert build_dataset(config(*SMALL), "train", CPU).batch(0).labels.device == torch.device("cpu")


def _step_loss_is_the_global_batch_mean(rank: int, world: int) -> None:
    env = DistEnv(rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"), backend="gloo")
    cfg = config(*SMALL, "data.global_batch_size=101")  # uneven local batches: 51 and 50
    model = build_model(cfg, env)
    batch = build_dataset(cfg, "train", env).batch(0)
    with torch.no_grad():
        logits = model(batch.dense_features, batch.sparse_features).squeeze(-1)
    want = all_reduce_sum(F.binary_cross_entropy_with_logits(logits, batch.labels, reduction="sum")) / 101
    optimizer = instantiate(cfg.trainer.dense_optimizer, params=dense_parameters(model))
    loss = train_step(model, optimizer, batch, world)  # this rank's share, times the world size
    torch.testing.assert_close(all_reduce_sum(loss.clone()) / world, want, rtol=1e-6, atol=0)


def test_step_loss_weights_uneven_local_batches_by_the_global_batch():
    """train_step's loss (the one whose gradient the ranks average) is the mean over the global batch, local
    batches of 51 and 50 samples weighted by their size: the global batch comes from the input dist's header."""
    run_world(2, _step_loss_is_the_global_batch_mean)


# Each of SMALL's 8 tables its own optimizer and lr.
PER_TABLE = ("model.embedding_optimizer.name=[sgd,rowwise_adagrad,rowwise_adagrad,sgd,rowwise_adagrad,sgd,sgd,"
             "rowwise_adagrad]", "model.embedding_optimizer.lr=[0.1,0.05,0.2,0.02,0.1,0.3,0.05,0.01]")


@pytest.mark.parametrize("shards", [("model.column_shards=1",), ("model.column_shards=2",), ("model.row_shards=2",),
                                    ("model.row_shards=2", *PER_TABLE)])
def test_two_rank_resume_is_exact(tmp_path, shards):
    # column_shards=2: every table's 16 columns in two shards, one on each rank; row_shards=2: its rows.
    run_world(2, _resume_two_ranks, str(tmp_path), shards)


def test_per_table_embedding_optimizers_from_the_config():
    """model.embedding_optimizer's name, lr and eps: one value for every table, or a list with one per feature."""
    cfg = config("data.num_sparse=3", "model.embedding_optimizer.name=[sgd,rowwise_adagrad,rowwise_adagrad]",
                 "model.embedding_optimizer.lr=[0.1,0.2,0.3]", "model.embedding_optimizer.eps=0.5")
    assert embedding_optimizers(cfg, config_tables(cfg)) == {
        "t_cat_0": EmbeddingOptimizerConfig("sgd", 0.1, 0.5),
        "t_cat_1": EmbeddingOptimizerConfig("rowwise_adagrad", 0.2, 0.5),
        "t_cat_2": EmbeddingOptimizerConfig("rowwise_adagrad", 0.3, 0.5)}
    model = build_model(cfg, CPU)
    assert sorted(model.sparse_arch.embedding_bag_collection.lookup.optimizer.momentum) == ["t_cat_1", "t_cat_2"]
    for overrides, error in ((["model.embedding_optimizer.lr=[0.1,0.2]"],
                              r"model.embedding_optimizer.lr: 2 values for 3 tables \(one per sparse feature"),
                             (["model.embedding_optimizer.lr=[0.1,-0.1,0.2]"],
                              r"model.embedding_optimizer of table t_cat_1 \(.*\): embedding optimizer lr must be >= 0"),
                             (["model.embedding_optimizer.name=[sgd,adam,sgd]"],
                              r"of table t_cat_1 .*unknown embedding optimizer 'adam'")):
        cfg = config("data.num_sparse=3", *overrides)
        with pytest.raises(ValueError, match=error):
            embedding_optimizers(cfg, config_tables(cfg))


def _row_blocks_train_as_whole_tables(rank: int, world: int, tmp: str) -> None:
    env = DistEnv(rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"), backend="gloo")
    common = SMALL + ["trainer.max_steps=20", "trainer.eval_every=10", "trainer.log_every=1",
                      "data.global_batch_size=101", "model.pooling=mean"]
    whole = train(config(*common), env, Path(tmp) / "whole")
    cut = train(config(*common, "model.row_shards=3"), env, Path(tmp) / "cut")
    assert [s for s, _ in cut.losses] == [s for s, _ in whole.losses] and len(cut.losses) == 20
    torch.testing.assert_close([l for _, l in cut.losses], [l for _, l in whole.losses], rtol=1e-5, atol=0)
    torch.testing.assert_close(cut.evals, whole.evals, rtol=1e-5, atol=0)


def test_row_blocks_train_as_whole_tables(tmp_path):
    """Every table (mean-pooled) cut into 3 row blocks over 2 ranks trains as the whole tables do: the same init
    (the blocks are rows of the whole table's), the same row-wise Adagrad state per row, the same losses and
    evaluations to float rounding (the blocks' parts are summed in another order than one bag's rows)."""
    run_world(2, _row_blocks_train_as_whole_tables, str(tmp_path))


RESHARD = SMALL + ["trainer.max_steps=20", "trainer.eval_every=0", "trainer.checkpoint_every=10",
                   "data.global_batch_size=101"]


def _resume_one_rank_run_on_two(rank: int, world: int, tmp: str, optimizer: tuple[str, ...], plan: str) -> None:
    """The checkpoint of a one-rank run of whole tables (`optimizer`'s overrides), resumed on two ranks under
    `plan` (an override)."""
    env = DistEnv(rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"), backend="gloo")
    checkpoint = Path(tmp, "full", "checkpoints", "step_10")
    cfg = config(*RESHARD, *optimizer, plan, f"trainer.resume_from={checkpoint}")
    model = build_model(cfg, env)
    sparse = model.sparse_arch.embedding_bag_collection
    load_checkpoint(checkpoint, model, instantiate(cfg.trainer.dense_optimizer, params=dense_parameters(model)),
                    sparse.fused_optimizer)
    for t in config_tables(cfg):  # each shard here: its rows and columns of the checkpoint's table, bit for bit
        saved = {"table": torch.full((t.num_embeddings, t.embedding_dim), float("nan")),
                 "momentum": torch.full((t.num_embeddings,), float("nan"))}
        keys = {"table": f"model.sparse_arch.embedding_bag_collection.embedding_bags.{t.name}.weight",
                "momentum": f"embedding_optimizer.state.embedding_bags.{t.name}.weight.{t.name}.momentum1"}
        adagrad = sparse.lookup.optimizer.momentum
        dcp.load({keys[k]: v for k, v in saved.items() if k == "table" or adagrad}, checkpoint_id=checkpoint)
        for s in sparse.plan.shards_of(rank):
            if s.table == t.name:
                assert torch.equal(sparse.shard_weights[s.name], shard_weight(saved["table"], s)), s
                if adagrad:  # row blocks of a table written whole: its accumulators' rows
                    assert torch.equal(adagrad[s.name], saved["momentum"][s.row:s.row + s.num_rows(t)]), s
    # it continues as the checkpoint's whole tables do on two ranks (the synthetic batches depend on the world
    # size: not as the one-rank run did), to float rounding (row blocks' parts are summed in another order)
    resumed = train(cfg, env, Path(tmp) / "resumed")
    whole = train(config(*RESHARD, *optimizer, f"trainer.resume_from={checkpoint}"), env, Path(tmp) / "whole")
    assert [s for s, _ in resumed.losses] == [s for s, _ in whole.losses] and resumed.losses[0][0] > 10
    torch.testing.assert_close([l for _, l in resumed.losses], [l for _, l in whole.losses], rtol=1e-5, atol=0)


@pytest.mark.parametrize("optimizer, plan", [((), "model.row_shards=2"),
                                             (("model.embedding_optimizer.name=sgd",), "model.column_shards=2")])
def test_resume_on_two_ranks_under_another_plan(tmp_path, optimizer, plan):
    """A one-rank run of whole tables resumes on two ranks in row blocks (row-wise Adagrad: its accumulators
    reshard by rows) or column shards (SGD: no state but the tables): every shard starts as its rows and columns of
    the checkpoint, and the run goes on as it does with whole tables."""
    train(config(*RESHARD, *optimizer), CPU, tmp_path / "full")
    run_world(2, _resume_one_rank_run_on_two, str(tmp_path), optimizer, plan, timeout=600)


def test_resume_of_row_wise_adagrad_in_other_column_shards_is_a_clear_error(tmp_path):
    common = SMALL + ["trainer.max_steps=10", "trainer.eval_every=0", "trainer.checkpoint_every=10"]
    train(config(*common), CPU, tmp_path / "full")
    resume = f"trainer.resume_from={tmp_path / 'full' / 'checkpoints' / 'step_10'}"
    with pytest.raises(ValueError, match=r"holds \['embedding_optimizer\.state\.embedding_bags\.t_cat_0\.weight\.t_cat_0\."
                                         r"momentum1 \[2000\] \(this run: \[4000\]\)'.*row-wise Adagrad state written for "
                                         r"other column shards.*model\.column_shards"):
        train(config(*common, "model.column_shards=2", resume), CPU, tmp_path / "resumed")


class NaNAfterStep(SyntheticCriteo):
    """Synthetic data whose dense features turn NaN from step 12 on."""

    def batch(self, step):
        b = super().batch(step)
        if step >= 12:
            b.dense_features[0, 0] = float("nan")
        return b


def test_nan_loss_stops_with_message_and_keeps_last_good_checkpoint(tmp_path):
    cfg = config(*SMALL, "trainer.max_steps=40", "trainer.eval_every=0", "trainer.checkpoint_every=10",
                 f"data.train._target_={__name__}.NaNAfterStep")
    # the data's step 12 is the run's step 13, inside the interval of steps 11 to 15
    with pytest.raises(NonFiniteLossError, match=r"^loss became NaN or inf at step 13; .*Last good checkpoint: "
                                                 r".*step_10"):
        train(cfg, CPU, tmp_path)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_10"]
    # resumed into a new directory, which holds no checkpoint of its own yet: the one it resumed from is named
    resumed = config(*SMALL, "trainer.max_steps=40", "trainer.eval_every=0", "trainer.checkpoint_every=10",
                     f"data.train._target_={__name__}.NaNAfterStep", f"trainer.resume_from={tmp_path / 'checkpoints'}")
    with pytest.raises(NonFiniteLossError, match=r"^loss became NaN or inf at step 13; .*Last good checkpoint: "
                                                 r".*checkpoints \(this run resumed from it\)"):
        train(resumed, CPU, tmp_path / "resumed")


class NaNEvalOnRank1(SyntheticCriteo):
    """Synthetic data whose evaluation batches hold a NaN dense feature on rank 1 only."""

    def batch(self, step):
        b = super().batch(step)
        if self.split == "eval" and self.rank == 1:
            b.dense_features[-1, 0] = float("nan")
        return b


def _nan_evaluation_stops_every_rank(rank: int, world: int, tmp: str) -> None:
    env = DistEnv(rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"), backend="gloo")
    cfg = config(*SMALL, "trainer.max_steps=20", "trainer.eval_every=10", "trainer.checkpoint_every=5",
                 f"data.eval._target_={__name__}.NaNEvalOnRank1")
    last_good = Path(tmp) / "checkpoints" / "step_10"
    with pytest.raises(NonFiniteLossError, match=r"^2 of the 256 evaluation outputs at step 10 are NaN or inf .*; "
                                                 rf"stopping\. Last good checkpoint: {last_good}$"):
        train(cfg, env, Path(tmp))
    assert sorted(p.name for p in (Path(tmp) / "checkpoints").iterdir()) == ["step_10", "step_5"]


def test_nan_evaluation_outputs_stop_every_rank(tmp_path):
    """An evaluation whose outputs hold NaN on one rank (there from its data; a model diverged after its last loss
    check gives the same) stops both ranks at that step, naming the last good checkpoint (as a NaN loss does, and
    the MoE loop's NaN eval loss; it named none): its scores were plausible numbers, torchmetrics dropping the NaN
    from the log loss and ranking it into the AUC."""
    run_world(2, _nan_evaluation_stops_every_rank, str(tmp_path), timeout=300)


@pytest.mark.parametrize("losses, first_bad", [([1.0, float("inf"), 2.0], 1), ([float("-inf"), 1.0], 0),
                                               ([float("inf"), float("-inf")], 0), ([0.5, float("nan")], 1)])
def test_any_nonfinite_loss_of_an_interval_stops_the_run(tmp_path, losses, first_bad):
    """One NaN, +inf or -inf step (or two infinities of opposite signs) among finite ones stops the run, naming
    the first of them; finite losses must not."""
    trainer = OmegaConf.create({"log_every": len(losses), "eval_every": 0, "checkpoint_every": 0,
                                "max_steps": None, "progress": False, "resume_from": None})
    run = TrainingRun(trainer, CPU, tmp_path, tmp_path / "checkpoints", 0, items="samples", items_per_step=1,
                      log_fields=lambda interval: ({"loss": interval.losses[0]}, ""), evaluate=lambda step: {},
                      save=lambda step: None, log=logging.getLogger(__name__))
    for loss in [0.25, 0.5, 0.75][:len(losses)]:
        run.end_step(torch.tensor(loss))
    assert run.check_loss() == pytest.approx(sum([0.25, 0.5, 0.75][:len(losses)]) / len(losses))
    for loss in losses:
        run.end_step(torch.tensor(loss))
    with pytest.raises(NonFiniteLossError, match=f"^loss became NaN or inf at step {len(losses) + 1 + first_bad}; "):
        run.check_loss()


def _recording_run(tmp_path: Path, intervals: list, step: int = 0, items_per_step: int = 1) -> TrainingRun:
    """A run from `step`, logging every 3 steps, whose log_fields keeps each Interval in `intervals`."""
    trainer = OmegaConf.create({"log_every": 3, "eval_every": 0, "checkpoint_every": 0, "max_steps": None,
                                "progress": False, "resume_from": None})
    return TrainingRun(trainer, CPU, tmp_path, tmp_path / "checkpoints", step, items="samples",
                       items_per_step=items_per_step,
                       log_fields=lambda interval: intervals.append(interval) or ({"loss": 0.0}, ""),
                       evaluate=lambda step: {}, save=lambda step: None, log=logging.getLogger(__name__))


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_gradient_norms_are_averaged_and_a_nonfinite_one_stops_the_run(tmp_path, bad):
    """A loop that measures gradient norms (moe/train.py, when it clips) gets their mean over the interval's steps
    that measured one. A NaN / inf norm stops the run at the interval's check like a NaN loss, naming its step,
    although its loss was finite: clipping by an inf norm zeroes every finite gradient (a step that silently moved
    nothing but momentum and decay) and turns the inf ones, as a NaN norm all of them, into NaN weights."""
    intervals = []
    run = _recording_run(tmp_path, intervals, step=10)
    for norm in (1.5, None, 2.5):  # a step that measured none counts for the loss only
        run.end_step(torch.tensor(0.5), grad_norm=None if norm is None else torch.tensor(norm))
    run.check_loss()
    run.end_step(torch.tensor(0.5))
    run.check_loss()
    assert [(i.step, i.grad_norm) for i in intervals] == [(13, 2.0), (14, None)]
    # clipping by a NaN / inf norm makes the next steps' losses (and norms) NaN: the norm's step is named
    for norm, loss in ((1.0, 0.5), (bad, 0.5), (float("nan"), float("nan"))):
        run.end_step(torch.tensor(loss), grad_norm=torch.tensor(norm))
    with pytest.raises(NonFiniteLossError, match=r"^gradient norm became NaN or inf at step 16; stopping\. Last good "
                                                 r"checkpoint: none$"):
        run.check_loss()


def test_the_rate_counts_the_samples_of_each_step(tmp_path, monkeypatch):
    """samples/s over the steps' own sizes (a file's short last batch), not steps x the configured batch."""
    clock = iter([0.0, 2.0, 2.0])  # the run starts, the interval ends, the next one starts
    monkeypatch.setattr("fused_dlrm.train.schedule.time.perf_counter", lambda: next(clock))
    intervals = []
    run = _recording_run(tmp_path, intervals, items_per_step=16)
    for items in (16, None, 6):
        run.end_step(torch.tensor(0.5), items=items)
    run.check_loss()
    assert intervals[0].rate == (16 + 16 + 6) / 2.0 and intervals[0].step_ms == 2000.0 / 3


def test_missing_resume_path_is_a_clear_error(tmp_path):
    cfg = config(*SMALL, "trainer.max_steps=5", f"trainer.resume_from={tmp_path / 'nope'}")
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        train(cfg, CPU, tmp_path)


def test_fused_comm_on_the_cpu_is_a_clear_error_for_either_transport(tmp_path):
    for transport in ("p2p", "nvshmem"):
        with pytest.raises(RuntimeError, match="comm=fused needs CUDA GPUs under torchrun"):
            train(config(*SMALL, "comm=fused", f"comm.transport={transport}"), CPU, tmp_path)


def test_missing_data_file_is_a_clear_error(tmp_path):
    cfg = config(*SMALL, "data=criteo", "data.num_sparse=26", f"data.train.paths=[{tmp_path / 'missing.tsv'}]",
                 f"data.eval.paths=[{tmp_path / 'missing.tsv'}]")
    with pytest.raises(FileNotFoundError, match="missing.tsv"):
        train(cfg, CPU, tmp_path)


def test_criteo_without_paths_names_the_keys_to_set(tmp_path):
    """data=criteo's paths are mandatory (???): left out, the error names them (it said "file not found: ???")."""
    with pytest.raises(ValueError, match=r"data.train.paths must be given, e.g. data.train.paths=\[train.tsv\]"):
        train(config(*SMALL, "data=criteo", "data.num_sparse=26"), CPU, tmp_path)


@pytest.mark.parametrize("nproc", [2, 4])
def test_torchrun_processes(tmp_path, nproc):
    """The README's distributed command (gloo here, NCCL where there are GPUs): every rank trains, one run
    directory, a checkpoint per step."""
    run_torchrun([*SMALL, "trainer.max_steps=20", "trainer.eval_every=10", "trainer.checkpoint_every=20",
                  f"hydra.run.dir={tmp_path}/run"], nproc=nproc)
    run = tmp_path / "run"
    assert all((run / f"train_rank{r}.log").exists() for r in range(nproc))
    assert (run / "checkpoints" / "step_20").is_dir()
    evals = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines() if "auc" in l]
    assert [e["step"] for e in evals] == [10, 20]


def _criteo_file(path: Path, num_lines: int) -> Path:
    gen = torch.Generator().manual_seed(0)
    lines = []
    for i in range(num_lines):
        dense = [str(int(x)) if x > 0 else "" for x in torch.randint(-1, 50, (13,), generator=gen)]
        cats = [f"{int(x):08x}" if x % 7 else "" for x in torch.randint(0, 2**31, (26,), generator=gen)]
        lines.append("\t".join(["1" if i % 3 == 0 else "0"] + dense + cats))
    path.write_text("\n".join(lines) + "\n")
    return path


def test_epochs_over_criteo_files(tmp_path):
    """trainer.epochs with the TSV reader: each epoch is one pass over the file, resumable mid-epoch."""
    path = _criteo_file(tmp_path / "day_0.tsv", 70)  # global batch 16: 4 full batches and one short one per epoch
    common = ["data=criteo", "data.global_batch_size=16", "data.eval_batches=2", f"data.train.paths=[{path}]",
              f"data.eval.paths=[{path}]", "model.num_rows=100", "trainer.max_steps=null", "trainer.epochs=2",
              "trainer.log_every=1", "trainer.eval_every=0", "trainer.checkpoint_every=3", "trainer.keep_checkpoints=5",
              "trainer.progress=false"]
    full = train(config(*common), CPU, tmp_path / "full")
    assert full.step == 10  # 5 batches per epoch
    resumed = train(config(*common, f"trainer.resume_from={tmp_path / 'full' / 'checkpoints' / 'step_6'}"),
                    CPU, tmp_path / "resumed")
    assert resumed.losses == [(s, l) for s, l in full.losses if s > 6]
    # the file's position is a step count: at another batch size it would be other lines
    with pytest.raises(ValueError, match=r"taken at data.global_batch_size=16, this run's is 32: .*resume with "
                                         r"data.global_batch_size=16"):
        train(config(*common, "data.global_batch_size=32",
                     f"trainer.resume_from={tmp_path / 'full' / 'checkpoints' / 'step_6'}"), CPU, tmp_path / "bsz")


def _build_from_own_copy(rank, world, folder, lines_of_rank):
    """Each rank reads its own copy of the day (as ranks on other nodes do): rank r's holds lines_of_rank[r]."""
    env = DistEnv(rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"), backend="gloo")
    path = _criteo_file(Path(folder) / f"copy_{rank}.tsv", lines_of_rank[rank])
    cfg = config("data=criteo", "data.global_batch_size=16", f"data.train.paths=[{path}]",
                 f"data.eval.paths=[{path}]", "model.num_rows=100")
    if len(set(lines_of_rank)) == 1:
        build_dataset(cfg, "train", env)
        return
    with pytest.raises(ValueError, match=rf"rank {rank}: data.train's files differ between ranks: rank 1's "
                                         rf"\[\d+\] bytes, rank 0's \[\d+\] bytes \(this rank's: .*copy_{rank}.tsv"):
        build_dataset(cfg, "train", env)


@pytest.mark.parametrize("lines_of_rank", [(70, 70), (70, 60)])
def test_ranks_reading_files_of_other_sizes_are_refused(tmp_path, lines_of_rank):
    """A copy cut short on one node would end that rank's batches first, its peers waiting for it in the input
    dist: refused on every rank when the datasets are made; like copies pass."""
    run_world(2, _build_from_own_copy, str(tmp_path), lines_of_rank, timeout=300)


def test_evaluation_reads_a_short_file_once(tmp_path, monkeypatch, caplog):
    """data.eval_batches beyond the eval file's batches: its samples are each counted once (the stream used to
    start over at the top of the file), with a warning."""
    path = _criteo_file(tmp_path / "eval.tsv", 70)  # global batch 16: 5 batches
    counted = []
    update = CTRMetrics.update
    monkeypatch.setattr(CTRMetrics, "update", lambda self, logits, labels: counted.append(labels.numel()) or
                        update(self, logits, labels))
    with caplog.at_level(logging.WARNING, logger="fused_dlrm.train.loop"):
        train(config("data=criteo", "data.global_batch_size=16", "data.eval_batches=9", f"data.train.paths=[{path}]",
                     f"data.eval.paths=[{path}]", "model.num_rows=100", "trainer.max_steps=1",
                     "trainer.eval_every=0", "trainer.checkpoint_every=0", "trainer.progress=false"),
              CPU, tmp_path / "run")
    assert counted == [16, 16, 16, 16, 6]
    assert "holds 5 global batches, fewer than data.eval_batches=9" in caplog.text


def test_evaluation_files_the_run_trains_on_are_named(tmp_path, caplog):
    """data.eval.paths naming a training file (a copy-paste of data.train.paths) scored the samples the model
    trained on without a word: an AUC of 0.999 after 4 steps on random labels. Synthetic data of the training split
    is refused (check_own_eval_samples); a file is warned about, by any name of it (one may hold no other file)."""
    day_0, day_1 = _criteo_file(tmp_path / "day_0.tsv", 20), _criteo_file(tmp_path / "day_1.tsv", 20)
    (tmp_path / "link.tsv").symlink_to(day_0)

    def warnings(train_paths: list, eval_paths: list) -> list[str]:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="fused_dlrm.train.loop"):
            check_own_eval_samples(CriteoTSV(train_paths, [100] * 26, 16, num_workers=0),
                                   CriteoTSV(eval_paths, [100] * 26, 16, num_workers=0))
        return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warnings([day_0], [day_1]) == []
    for eval_paths in ([day_0], [day_1, tmp_path / "link.tsv"]):
        assert warnings([day_0], eval_paths) == [
            f"data.eval.paths shares {eval_paths[-1]} with data.train.paths: the evaluation scores samples the model "
            "trained on, not what it learned; give data.eval files of their own (a later day, or the last lines of "
            "a file split off)"]


def test_steps_per_epoch_is_refused_for_files(tmp_path):
    """An epoch of file-backed data is one pass over the files: a data.steps_per_epoch would be ignored."""
    path = _criteo_file(tmp_path / "day_0.tsv", 20)
    with pytest.raises(ValueError, match="data.steps_per_epoch=3: an epoch of file-backed data is one pass"):
        train(config("data=criteo", "data.global_batch_size=16", f"data.train.paths=[{path}]",
                     f"data.eval.paths=[{path}]", "model.num_rows=100", "data.steps_per_epoch=3"), CPU, tmp_path / "r")


def test_epochs_end_synthetic_runs_only_with_steps_per_epoch(tmp_path):
    """Step-indexed data: trainer.epochs counts epochs of data.steps_per_epoch steps (2 x 3 here, max_steps
    further); without steps_per_epoch every step is of epoch 0 and max_steps ends the run."""
    common = [*SMALL, "trainer.eval_every=0", "trainer.checkpoint_every=0", "trainer.max_steps=8", "trainer.epochs=2"]
    assert train(config(*common, "data.steps_per_epoch=3"), CPU, tmp_path / "epochs").step == 6
    assert train(config(*common, "data.steps_per_epoch=null"), CPU, tmp_path / "steps").step == 8


@pytest.mark.parametrize("data", ["synthetic", "criteo"])
def test_a_run_that_starts_at_the_end_of_its_epochs_says_so(tmp_path, caplog, data):
    """A resume from the last checkpoint of a run of trainer.epochs trains no step: it said nothing (as a resume at
    or past trainer.max_steps warns), logged "resumed from ... (step 6)" and an evaluation, and ended as a run
    would."""
    common = ["trainer.progress=false", "trainer.eval_every=0", "trainer.checkpoint_every=3", "trainer.max_steps=null",
              "trainer.epochs=2", "data.eval_batches=2"]
    if data == "criteo":  # global batch 32: 2 full batches and one short one per epoch
        path, held_out = _criteo_file(tmp_path / "day_0.tsv", 70), _criteo_file(tmp_path / "day_1.tsv", 70)
        common += ["data=criteo", "data.global_batch_size=32", f"data.train.paths=[{path}]",
                   f"data.eval.paths=[{held_out}]", "model.num_rows=100"]
    else:
        common += [*SMALL, "data.steps_per_epoch=3"]
    full = train(config(*common), CPU, tmp_path / "full")
    resume = f"trainer.resume_from={tmp_path / 'full' / 'checkpoints'}"
    warning = (f"the run starts at step {full.step}, at or past the end of trainer.epochs=2: it trains no step (only "
               "evaluates); raise trainer.epochs to train on")

    def warnings() -> list[str]:  # the loop's (another test may have left its logger at INFO: the full run's lines)
        return [r.getMessage() for r in caplog.records
                if r.name == "fused_dlrm.train.loop" and r.levelno >= logging.WARNING]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fused_dlrm.train.loop"):
        resumed = train(config(*common, resume), CPU, tmp_path / "resumed")
    assert resumed.step == full.step and resumed.losses == []
    assert warnings() == [warning]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fused_dlrm.train.loop"):  # one more epoch: trains, no warning
        more = train(config(*common, resume, "trainer.epochs=3"), CPU, tmp_path / "more")
    assert more.step == full.step // 2 * 3
    assert warnings() == []


def _prefetch_same_curve(rank: int, world: int, tmp: str) -> None:
    env = DistEnv(rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"), backend="gloo")
    common = SMALL + ["trainer.max_steps=12", "trainer.eval_every=6", "trainer.checkpoint_every=0",
                      "trainer.log_every=1"]
    # The batch thread distributes (the default): count the batches it distributed and the forwards that took them.
    counts = {"distributed": 0, "taken": 0}
    made_by = ShardedEmbeddingBagCollection.input_dist_on_thread
    take = ShardedEmbeddingBagCollection._take_prefetched

    def on_thread(self):
        distribute = made_by(self)

        def counted(features):
            distribute(features)
            counts["distributed"] += 1
        return counted

    def taken(self, features):
        bags = take(self, features)
        counts["taken"] += bags is not None
        return bags

    collection = ShardedEmbeddingBagCollection
    collection.input_dist_on_thread, collection._take_prefetched = on_thread, taken
    try:
        thread = train(config(*common), env, Path(tmp) / "thread")
    finally:
        collection.input_dist_on_thread, collection._take_prefetched = made_by, take
    # Every step's batch came from the thread. The loop read 12 batches (it knows the run is done before a 13th);
    # on closing, the thread ran on to 12 + depth (2) + 1, the same count on both ranks, whatever its timing.
    assert counts == {"distributed": 15, "taken": 12}, counts
    headers = train(config(*common, "trainer.input_dist_on_thread=false"), env, Path(tmp) / "headers")
    ahead = train(config(*common, "trainer.input_dist_on_thread=false", "trainer.header_ahead=false"), env,
                  Path(tmp) / "ahead")
    inline = train(config(*common, "trainer.prefetch_input_dist=false"), env, Path(tmp) / "inline")
    assert thread.losses == headers.losses == ahead.losses == inline.losses
    assert thread.evals == headers.evals == ahead.evals == inline.evals
    assert len(thread.losses) == 12


def test_input_dist_ahead_gives_the_same_training(tmp_path):
    run_world(2, _prefetch_same_curve, str(tmp_path))


def _one_hardware_queue_keeps_the_input_dist_off_the_thread(rank: int, world: int, tmp: str) -> None:
    import fused_dlrm.train.loop as loop
    env = DistEnv(rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"), backend="gloo")
    common = SMALL + ["trainer.max_steps=6", "trainer.eval_every=0", "trainer.checkpoint_every=0",
                      "trainer.log_every=1"]
    made_by, made = ShardedEmbeddingBagCollection.input_dist_on_thread, []

    def on_thread(self):
        made.append(1)
        return made_by(self)
    ShardedEmbeddingBagCollection.input_dist_on_thread = on_thread
    ranks = loop.ranks_with_one_hardware_queue
    loop.ranks_with_one_hardware_queue = lambda env: [1]  # as on GPUs with CUDA_DEVICE_MAX_CONNECTIONS=1 on rank 1
    try:
        serial = train(config(*common), env, Path(tmp) / "serial")
    finally:
        ShardedEmbeddingBagCollection.input_dist_on_thread, loop.ranks_with_one_hardware_queue = made_by, ranks
    assert made == []  # the batch thread never got the input dist, on either rank
    side_stream = train(config(*common, "trainer.input_dist_on_thread=false"), env, Path(tmp) / "side_stream")
    assert serial.losses == side_stream.losses and len(serial.losses) == 6


def test_one_hardware_queue_keeps_the_input_dist_off_the_batch_thread(tmp_path):
    """A rank whose GPU streams share one hardware queue (dist.env.ranks_with_one_hardware_queue): the loop runs
    the input dist from its own thread on every rank (the thread's all-to-alls could otherwise queue in another
    order than the step's collectives on some rank), and trains as with trainer.input_dist_on_thread=false."""
    run_world(2, _one_hardware_queue_keeps_the_input_dist_off_the_thread, str(tmp_path))


def _converges_with_q8_gradients(rank: int, world: int, tmp: str) -> None:
    env = DistEnv(rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"), backend="gloo")
    # Shorter than test_loss_falls_and_auc_rises: the codec kernels run in the Triton interpreter here.
    cfg = config("trainer.max_steps=50", "trainer.eval_every=0", "trainer.checkpoint_every=0",
                 "trainer.progress=false", "trainer.log_every=10", "data.eval_batches=4", "comm.grad_allreduce=q8")
    model = build_model(cfg, env)
    assert all(arch.forward.codec == "q8" for arch in (model.dense_arch, model.over_arch))  # their ArchNodes
    result = train(cfg, env, Path(tmp))
    losses = [loss for _, loss in result.losses]
    assert losses[-1] < losses[0] - 0.05, losses
    assert result.evals[-1]["auc"] > 0.6, result.evals


def test_two_ranks_converge_with_q8_gradient_allreduce(tmp_path):
    run_world(2, _converges_with_q8_gradients, str(tmp_path))


def test_bad_run_settings_are_refused_before_training(tmp_path):
    """Settings that would never end, train no step without a word, log NaN, divide by zero after the first step, meet
    the model on the wrong device or delete checkpoints are refused before the first step."""
    later = tmp_path / "ckpt" / "step_50"
    later.mkdir(parents=True)
    for overrides, error in (
            (["data.eval_batches=0"], "data.eval_batches=0: expected a count >= 1: the evaluation needs at least one"),
            (["trainer.max_steps=null", "trainer.epochs=1", "data.steps_per_epoch=null"],
             "set it \\(>= 1\\), or trainer.max_steps; without it the run would never end"),
            (["trainer.epochs=0"], r"trainer.epochs=0: expected a count >= 1, or null"),
            (["trainer.epochs=2", "data.steps_per_epoch=-3"], r"data.steps_per_epoch=-3: expected a step count >= 1"),
            (["trainer.log_every=0"], "trainer.log_every=0: expected a step count >= 1"),
            (["trainer.checkpoint_every=2", "trainer.keep_checkpoints=0"],
             "trainer.keep_checkpoints=0: expected a count >= 1"),
            (["data.train.device=cuda"], "data.train.device=cuda makes the batches on a GPU, but the model is on cpu"),
            # the evaluation's labels from another hidden teacher: an AUC near 0.5 whatever the model learned
            (["data.eval.seed=3"], r"data.eval.seed=3, data.train's 0: its samples would be labelled by another "
                                   r"hidden teacher"),
            (["data.eval.mean_pooling=1.0", "data.eval.zipf_alpha=0.5"],
             r"data.eval.mean_pooling=1.0, data.train's 3.0; data.eval.zipf_alpha=0.5, data.train's 1.05: its samples"),
            # the evaluation's samples the first training batches (an AUC of 0.97 after 2 steps)
            (["data.eval.split=train"], r"data.eval.split=train is data.train's: the evaluation would score the "
                                        r"first data.eval_batches training batches"),
            # an OverflowError naming no key; the dataset's own checks named its arguments, not their keys
            (["data.train.mean_pooling=inf"], r"^data.train.mean_pooling must be finite and >= 0, got \[inf, inf"),
            (["data.train.zipf_alpha=-1"], r"^data.train.zipf_alpha must be >= 0, got -1"),
            (["data.eval.split=''"], r"^data.eval.split must be a non-empty string, got ''$"),
            # torch's own device-string error, naming no key
            (["data.train.device=tpu"], r"^data.train.device='tpu': expected auto, cpu, cuda or cuda:<index>$"),
            (["comm.grad_allreduce=q7"], "comm.grad_allreduce='q7': expected one of"),
            (["model.pooling=max"], r"model.pooling='max': expected one of \('sum', 'mean'\)"),
            (["model.data_type=int8"], r"model.data_type='int8': expected one of"),
            (["model.num_rows=0"], "model.num_rows=0: expected a whole number of rows >= 1"),
            (["model.embedding_dim=32"], r"model.dense_arch=\[64, 16\] must end in model.embedding_dim=32"),
            # not "must end in model.embedding_dim=abc"
            (["model.embedding_dim=abc"], r"^model.embedding_dim='abc': expected a whole number of columns >= 1$"),
            (["model.embedding_dim=0", "model.dense_arch=[64,0]"], r"^model.embedding_dim=0: expected a whole number"),
            # named by their keys: the plan named its arguments, per table
            (["model.row_shards=2.5"], r"^model.row_shards=2.5: expected a whole number >= 1 \(1: table-wise\)$"),
            (["model.row_shards=0"], r"^model.row_shards=0: expected a whole number >= 1"),
            (["model.column_shards=true"], r"^model.column_shards=True: expected a whole number >= 1"),
            (["model.column_shards=3"], r"^model.column_shards=3: table 't_cat_0': 16 columns do not split into 3 "
                                        r"equal column shards$"),
            (["model.column_shards=2", "model.row_shards=2"], r"^model.row_shards=2 with model.column_shards=2: a "
                                                              r"table is cut into row blocks or into column shards, "
                                                              r"not both$"),
            ([f"trainer.checkpoint_dir={later.parent}"], "already holds step_50, after this run's start at step 0")):
        with pytest.raises(ValueError, match=error):
            train(config(*SMALL, "trainer.max_steps=3", *overrides), CPU, tmp_path / "run")
    assert later.exists()  # nothing deleted


# Counts that are no whole number: YAML's true is a Python int (1), a float is compared and taken modulo as a step
# count (eval_every=2.5: every fifth step), a negative cadence fires at its multiples, and eval_batches=1.5 failed
# only after the last step (range(1.5)); batches_ahead=-1 was refused as "depth".
@pytest.mark.parametrize("overrides, error", [
    (["trainer.epochs=true"], r"trainer.epochs=True: expected a count >= 1, or null"),
    (["trainer.max_steps=true"], r"trainer.max_steps=True: expected a step count >= 0, or null"),
    (["trainer.max_steps=2.5"], r"trainer.max_steps=2.5: expected a step count >= 0, or null"),
    (["trainer.log_every=true"], r"trainer.log_every=True: expected a step count >= 1"),
    (["trainer.log_every=1.5"], r"trainer.log_every=1.5: expected a step count >= 1"),
    (["trainer.eval_every=2.5"], r"trainer.eval_every=2.5: expected a step count >= 0 \(0 or null: the run's last "
                                 r"evaluation only\)"),
    (["trainer.eval_every=-1"], r"trainer.eval_every=-1: expected a step count >= 0"),
    (["trainer.checkpoint_every=true"], r"trainer.checkpoint_every=True: expected a step count >= 0"),
    (["trainer.checkpoint_every=-2"], r"trainer.checkpoint_every=-2: expected a step count >= 0 \(0 or null: no "
                                      r"checkpoints\)"),
    (["trainer.checkpoint_every=2", "trainer.keep_checkpoints=true"],
     r"trainer.keep_checkpoints=True: expected a count >= 1"),
    (["trainer.batches_ahead=-1"], r"trainer.batches_ahead=-1: expected a count >= 0"),
    (["trainer.batches_ahead=1.5"], r"trainer.batches_ahead=1.5: expected a count >= 0"),
    (["data.eval_batches=1.5"], r"data.eval_batches=1.5: expected a count >= 1"),
    (["data.eval_batches=true"], r"data.eval_batches=True: expected a count >= 1"),
    (["trainer.epochs=1", "data.steps_per_epoch=true"], r"data.steps_per_epoch=True: expected a step count >= 1"),
    (["data.global_batch_size=true"], r"^data.global_batch_size=True: expected a whole number of samples >= the "
                                      r"world size 1: each rank takes a slice of the batch$"),
    (["data.global_batch_size=0"], r"^data.global_batch_size=0: expected a whole number of samples >= the world"),
    (["model.num_rows=true"], r"model.num_rows=True: expected a whole number of rows >= 1"),
    # a float failed in list() ('float' object is not iterable), a string was one table per character, and a list
    # of another length named no key
    (["model.num_rows=100.5"], r"model.num_rows=100.5: expected a whole number of rows >= 1 or a list of one per "
                               r"sparse feature \(data.num_sparse=8\)"),
    (["model.num_rows=abc"], r"model.num_rows='abc': expected a whole number of rows >= 1 or a list"),
    # a layer of no width trained, its inputs ignored; the others failed in torch or omegaconf, naming no key
    (["model.dense_arch=[0,16]"], r"model.dense_arch=\[0, 16\]: expected a list of layer widths, whole numbers >= 1"),
    (["model.dense_arch=[]"], r"model.dense_arch=\[\]: expected a list of layer widths"),
    (["model.dense_arch=16"], r"model.dense_arch=16: expected a list of layer widths"),
    (["model.over_arch=[64.5,1]"], r"model.over_arch=\[64.5, 1\]: expected a list of layer widths"),
    (["model.over_arch=[]"], r"model.over_arch=\[\]: expected a list of layer widths"),
    (["model.num_rows=[10,20]"], r"model.num_rows=\[10, 20\]: 2 table sizes for data.num_sparse=8 sparse features"),
    # true built one table; 0 failed in torchrec's assert, the dense ones in torch (randn's or Linear's arguments)
    (["data.num_sparse=true"], r"data.num_sparse=True: expected a whole number >= 1 of sparse features"),
    (["data.num_sparse=0"], r"data.num_sparse=0: expected a whole number >= 1 of sparse features"),
    (["data.num_dense=true"], r"data.num_dense=True: expected a whole number >= 1 of dense features"),
    (["data.num_dense=2.5"], r"data.num_dense=2.5: expected a whole number >= 1 of dense features"),
], ids=lambda value: " ".join(value) if isinstance(value, list) else "")
def test_counts_that_are_no_whole_number_are_refused(tmp_path, overrides, error):
    with pytest.raises(ValueError, match=error):
        train(config(*SMALL, "trainer.max_steps=3", "trainer.eval_every=0", *overrides), CPU, tmp_path)
    assert not (tmp_path / "metrics.jsonl").exists()  # before the first step


def test_the_last_checkpoint_is_written_before_the_last_evaluation(tmp_path, monkeypatch):
    """An evaluation that fails at the end of a run loses none of its steps."""
    def failing(*args, **kwargs):
        raise RuntimeError("evaluation failed")
    monkeypatch.setattr("fused_dlrm.train.loop.evaluate", failing)
    with pytest.raises(RuntimeError, match="evaluation failed"):
        train(config(*SMALL, "trainer.max_steps=3", "trainer.eval_every=0", "trainer.checkpoint_every=10"), CPU,
              tmp_path)
    assert (tmp_path / "checkpoints" / "step_3").is_dir()


def test_resume_with_other_sizes_or_optimizers_is_a_clear_error(tmp_path):
    common = SMALL + ["trainer.max_steps=5", "trainer.eval_every=0", "trainer.checkpoint_every=5"]
    train(config(*common, "model.embedding_optimizer.name=sgd"), CPU, tmp_path / "full")
    resume = f"trainer.resume_from={tmp_path / 'full' / 'checkpoints' / 'step_5'}"
    with pytest.raises(ValueError, match=r"holds no \['embedding_optimizer\..*momentum1'.*another embedding optimizer"):
        train(config(*common, resume), CPU, tmp_path / "adagrad")
    with pytest.raises(ValueError,
                       match=r"holds \['model\..*\[2000, \d+\] \(this run: \[2001, \d+\]\).*model.num_rows"):
        train(config(*common, "model.embedding_optimizer.name=sgd", "model.num_rows=2001", resume), CPU,
              tmp_path / "rows")
    # the other way round: state the run has no place for, which DCP would drop without a word
    train(config(*common), CPU, tmp_path / "adagrad_full")
    resume_adagrad = f"trainer.resume_from={tmp_path / 'adagrad_full' / 'checkpoints' / 'step_5'}"
    with pytest.raises(ValueError, match=r"holds \['embedding_optimizer\..*momentum1'.*, state this run does not "
                                         r"keep: it was written with another embedding optimizer"):
        train(config(*common, "model.embedding_optimizer.name=sgd", resume_adagrad), CPU, tmp_path / "sgd")
    sgd = ["trainer.dense_optimizer._target_=torch.optim.SGD", "~trainer.dense_optimizer.fused"]
    with pytest.raises(ValueError, match=r"holds \['dense_optimizer\.state\..*exp_avg'.*, state this run does not "
                                         r"keep: it was written with another dense optimizer"):
        train(config(*common, *sgd, resume_adagrad), CPU, tmp_path / "dense_sgd")
    with pytest.raises(ValueError, match=r"holds no \['dense_optimizer\.state\..*momentum_buffer'.*another dense"):
        train(config(*common, *sgd, "+trainer.dense_optimizer.momentum=0.9", resume_adagrad), CPU,
              tmp_path / "dense_momentum")
    # tables of another dtype: DCP cast them without a word (fp32 rounded into fp16)
    with pytest.raises(ValueError, match=r"holds \['model\..*embedding_bags\.\S+\.weight torch\.float32 \(this run: "
                                         r"torch\.float16\)'.*: it was written for tables of another dtype; resume "
                                         r"with its model\.data_type"):
        train(config(*common, "model.data_type=fp16", resume_adagrad), CPU, tmp_path / "fp16")
    # Adam's state names under AdamW: the checkpoint's record of its class tells them apart
    with pytest.raises(ValueError, match=r"dense optimizer Adam, this run's is AdamW: .*another dense optimizer"):
        train(config(*common, "trainer.dense_optimizer._target_=torch.optim.AdamW", resume_adagrad), CPU,
              tmp_path / "dense_adamw")
