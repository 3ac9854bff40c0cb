"""DLRM's lr schedule (model.lr_schedule, fused_dlrm/train/lr_schedule.py): MLPerf's values, the lr each optimizer
actually steps with (the dense optimizer's groups, every table's embedding update) at world 1 and 2, exact resume,
refused settings."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from fused_dlrm.dist import DistEnv
from fused_dlrm.sparse.optimizer import EmbeddingOptimizer
from fused_dlrm.train.loop import check_config, train
from fused_dlrm.train.lr_schedule import DLRMLRSchedule, dlrm_lr_factor, mlperf_lr_factor
from fused_dlrm.train.rundir import register_resolvers
from world import run_world

ROOT = Path(__file__).resolve().parents[1]
CPU = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend=None)
SMALL = ["model.num_rows=500", "data.num_sparse=4", "data.global_batch_size=64", "trainer.progress=false",
         "trainer.log_every=4", "trainer.eval_every=0", "data.eval_batches=1", "trainer.batches_ahead=0"]
# each table its own lr (and optimizer): the factor scales each one's own
TABLE_LRS = [0.1, 0.05, 0.2, 0.02]
PER_TABLE = ["model.embedding_optimizer.name=[sgd,rowwise_adagrad,rowwise_adagrad,sgd]",
             f"model.embedding_optimizer.lr=[{','.join(map(str, TABLE_LRS))}]"]
DENSE_LR = 0.01
# warm-up over steps 1-5, held 6-9, decayed 10-17, 0 from 18 on
SCHEDULE = ["model.lr_schedule.warmup_steps=6", "model.lr_schedule.decay_start=10", "model.lr_schedule.decay_steps=8",
            f"trainer.dense_optimizer._target_={__name__}.RecordingAdam", f"trainer.dense_optimizer.lr={DENSE_LR}",
            *PER_TABLE]


def config(*overrides: str):
    register_resolvers()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def mlperf_lr(base: float, n: int, warmup: int, decay_start: int, decay_steps: int) -> float:
    """The lr of step n (from 1), written out as MLPerf's reference (LRPolicyScheduler's _step_count = n) reads,
    its warm-up reaching the lr and its decay reaching 0."""
    if n < warmup:
        return base * (1.0 - (warmup - n) / warmup)
    if decay_steps and decay_start <= n < decay_start + decay_steps:
        return base * ((decay_steps - (n - decay_start)) / decay_steps) ** 2
    if decay_steps and n >= decay_start + decay_steps:
        return 0.0
    return base


def test_the_factor_is_mlperfs_at_chosen_steps():
    for warmup, start, decay in ((6, 10, 8), (4, 4, 3), (0, 0, 5), (5, 0, 0), (3, 100, 0)):
        for n in (1, 2, 3, 4, 5, 6, 7, 9, 10, 11, 13, 14, 17, 18, 19, 1000):
            assert mlperf_lr_factor(warmup, start, decay, n - 1) == pytest.approx(
                mlperf_lr(1.0, n, warmup, start, decay), rel=1e-15, abs=0), (warmup, start, decay, n)
    # by hand: warm-up 6, decay from 10 over 8
    assert [mlperf_lr_factor(6, 10, 8, n - 1) for n in (1, 5, 6, 9, 10, 11, 17, 18, 40)] == pytest.approx(
        [1 / 6, 5 / 6, 1.0, 1.0, 1.0, (7 / 8) ** 2, (1 / 8) ** 2, 0.0, 0.0], rel=1e-15)


def test_off_by_default():
    cfg = config()
    assert dict(cfg.model.lr_schedule) == {"warmup_steps": 0, "decay_start": 0, "decay_steps": 0}
    assert dlrm_lr_factor(cfg.model.lr_schedule) is None
    assert dlrm_lr_factor(config("model=dlrm_paper").model.lr_schedule) is None


@pytest.mark.parametrize("overrides, message", [
    (["model.lr_schedule.warmup_steps=-1"], "model.lr_schedule.warmup_steps=-1: expected a step count >= 0"),
    (["model.lr_schedule.decay_steps=-3"], "model.lr_schedule.decay_steps=-3: expected a step count >= 0"),
    (["model.lr_schedule.decay_start=-2"], "model.lr_schedule.decay_start=-2: expected a step count >= 0"),
    (["model.lr_schedule.warmup_steps=2.5"], "model.lr_schedule.warmup_steps=2.5: expected a step count"),
    (["model.lr_schedule.decay_steps=true"], "model.lr_schedule.decay_steps=True: expected a step count"),
    (["model.lr_schedule.warmup_steps=10", "model.lr_schedule.decay_start=5", "model.lr_schedule.decay_steps=4"],
     "model.lr_schedule.decay_start=5 is before the warm-up's end at model.lr_schedule.warmup_steps=10"),
    (["+model.lr_schedule.decay=cosine"], "model.lr_schedule.decay is set by model=moe_transformer"),
])
def test_bad_settings_are_refused_naming_the_key(overrides, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        check_config(config(*SMALL, *overrides))


def test_a_warmup_without_decay_may_outlast_decay_start():
    """decay_start is read only with a decay: 0 there is no error for a warm-up alone."""
    check_config(config(*SMALL, "model.lr_schedule.warmup_steps=10"))


class RecordingAdam(torch.optim.Adam):
    """Adam that records the lr of each step it takes (its one group's)."""
    lrs: list[float] = []

    def step(self, closure=None):
        RecordingAdam.lrs.append(self.param_groups[0]["lr"])
        return super().step(closure)


def record_table_lrs(monkeypatch) -> list[dict[str, float]]:
    """Each backward's lr of every table (shard) the CPU embedding update steps, one dict per backward."""
    steps: list[dict[str, float]] = []
    original = EmbeddingOptimizer.step

    def step(self, table, rows, grads):
        if not steps or table in steps[-1]:
            steps.append({})
        steps[-1][table] = self.configs[table].lr
        return original(self, table, rows, grads)
    monkeypatch.setattr(EmbeddingOptimizer, "step", step)
    return steps


def expected_lrs(steps: range) -> tuple[list[float], list[dict[str, float]]]:
    """The dense lr and each table's lr (by table name; a shard's is its table's) of each of `steps` (from 1)."""
    factors = [mlperf_lr(1.0, n, 6, 10, 8) for n in steps]
    return [DENSE_LR * f for f in factors], [{f"t_cat_{i}": lr * f for i, lr in enumerate(TABLE_LRS)}
                                             for f in factors]


def by_table(steps: list[dict[str, float]]) -> list[dict[str, float]]:
    """Shard names (t_cat_0_r1, ...) to their table's."""
    tables = []
    for lrs in steps:
        table = {}
        for shard, lr in lrs.items():
            name = re.match(r"t_cat_\d+", shard).group(0)
            assert table.setdefault(name, lr) == lr  # every shard of a table alike
        tables.append(table)
    return tables


def test_every_optimizer_steps_with_the_scheduled_lr(tmp_path, monkeypatch):
    """World 1: the dense optimizer's lr at each of its 20 steps and every table's at each embedding update are
    the configured ones x MLPerf's factor of that step (a warm-up, a hold, a decay to 0 and 0 after); the log
    gives the dense lr and the factor of each interval's last step."""
    RecordingAdam.lrs = []
    tables = record_table_lrs(monkeypatch)
    train(config(*SMALL, *SCHEDULE, "trainer.max_steps=20", "trainer.checkpoint_every=0"), CPU, tmp_path)
    dense, table = expected_lrs(range(1, 21))
    assert RecordingAdam.lrs == pytest.approx(dense, rel=1e-15, abs=0)
    assert len(tables) == 20
    for n, (got, want) in enumerate(zip(by_table(tables), table), start=1):
        assert got == pytest.approx(want, rel=1e-6, abs=0), n  # EmbeddingOptimizerConfig keeps the float
    lines = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    logged = [l for l in lines if "loss" in l]
    assert [l["step"] for l in logged] == [4, 8, 12, 16, 20]
    factors = [mlperf_lr(1.0, l["step"], 6, 10, 8) for l in logged]
    assert [l["lr_factor"] for l in logged] == pytest.approx(factors, rel=1e-15, abs=0)
    assert [l["lr"] for l in logged] == pytest.approx([DENSE_LR * f for f in factors], rel=1e-15, abs=0)


def test_resume_continues_the_schedule_and_the_loss_curve(tmp_path, monkeypatch):
    """Resumed mid-warm-up (step 4) and mid-decay (step 12): each resumed step's lrs, dense and every table's,
    and each interval's loss are the uninterrupted run's."""
    common = [*SMALL, *SCHEDULE, "trainer.max_steps=20", "trainer.checkpoint_every=4", "trainer.keep_checkpoints=5"]
    RecordingAdam.lrs = []
    tables = record_table_lrs(monkeypatch)
    full = train(config(*common), CPU, tmp_path / "full")
    full_dense, full_tables = list(RecordingAdam.lrs), by_table(tables)
    for start in (4, 12):
        RecordingAdam.lrs, tables[:] = [], []
        resumed = train(config(*common, f"trainer.resume_from={tmp_path / 'full' / 'checkpoints' / f'step_{start}'}",
                               f"trainer.checkpoint_dir={tmp_path / f'r{start}'}"), CPU, tmp_path / f"r{start}")
        assert resumed.losses == [(s, l) for s, l in full.losses if s > start]
        # the first: loading's own step, which makes Adam's state at lr 0 (torch's _init_optim_state) to load into
        assert RecordingAdam.lrs[0] == 0.0 and RecordingAdam.lrs[1:] == full_dense[start:]
        assert by_table(tables) == full_tables[start:]


def test_a_constant_runs_checkpoint_resumes_under_a_schedule_and_back(tmp_path):
    """The schedule keeps nothing in a checkpoint that a run without one refuses, nor the other way round (the
    dense optimizer's initial_lr is dropped on load, the fused optimizer saves no param groups)."""
    common = [*SMALL, "trainer.max_steps=8", "trainer.checkpoint_every=4", *PER_TABLE]
    train(config(*common), CPU, tmp_path / "constant")
    resume = f"trainer.resume_from={tmp_path / 'constant' / 'checkpoints' / 'step_4'}"
    scheduled = [*SCHEDULE[:3], f"trainer.dense_optimizer.lr={DENSE_LR}"]
    train(config(*common, *scheduled, resume), CPU, tmp_path / "scheduled")
    back = f"trainer.resume_from={tmp_path / 'scheduled' / 'checkpoints' / 'step_8'}"
    assert train(config(*common, "trainer.max_steps=12", back), CPU, tmp_path / "back").step == 12


def _two_ranks(rank: int, world: int, tmp: str) -> None:
    env = DistEnv(rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"), backend="gloo")
    RecordingAdam.lrs = []
    with pytest.MonkeyPatch.context() as monkeypatch:
        tables = record_table_lrs(monkeypatch)
        train(config(*SMALL, *SCHEDULE, "trainer.max_steps=20", "trainer.checkpoint_every=0", "model.row_shards=2"),
              env, Path(tmp) / "run")
    dense, table = expected_lrs(range(1, 21))
    assert RecordingAdam.lrs == pytest.approx(dense, rel=1e-15, abs=0)
    assert len(tables) == 20
    for n, (got, want) in enumerate(zip(by_table(tables), table), start=1):
        assert got == pytest.approx(want, rel=1e-6, abs=0), (rank, n)  # every table: a row block on each rank


def test_two_ranks_step_with_the_scheduled_lr(tmp_path):
    run_world(2, _two_ranks, str(tmp_path), timeout=600)


class _CountingTableOptimizer:
    """A fused optimizer's face (param groups, step) that counts the steps which carry the groups' lr to the tables."""

    def __init__(self):
        self.param_groups, self.steps = [{"lr": 0.1}, {"lr": 0.2}], 0

    def step(self):
        self.steps += 1


def test_the_tables_are_updated_only_when_the_factor_changes():
    """Each changed factor reaches the tables once; through the hold and after the decay (the same factor) the
    per-table update on the host is skipped."""
    factor = dlrm_lr_factor(config("model.lr_schedule.warmup_steps=3", "model.lr_schedule.decay_start=6",
                                   "model.lr_schedule.decay_steps=2").model.lr_schedule)
    tables = _CountingTableOptimizer()
    dense = torch.optim.SGD([torch.nn.Parameter(torch.randn(3))], lr=0.5)
    schedule = DLRMLRSchedule(factor, dense, tables, 0)
    for _ in range(11):
        schedule.step()
    factors = [factor(done) for done in range(12)]  # 1/3, 2/3, 1 (steps 3-6), 1/4, 0 (steps 8-12)
    changes = 1 + sum(a != b for a, b in zip(factors, factors[1:]))
    assert tables.steps == changes == 5, (tables.steps, factors)
    assert [g["lr"] for g in tables.param_groups] == [0.0, 0.0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_one_gpu_graphed_steps_take_the_scheduled_lr(tmp_path):
    """One GPU, under the schedule: the direct step with its CUDA graphs (the dense optimizer's step replayed) gives
    the eager autograd step's losses at every step, and a run without the schedule does not (the schedule reaches
    the GPU's tables and dense optimizer)."""
    cuda = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cuda", 0), backend=None)
    common = [*SMALL, *SCHEDULE, "trainer.dense_optimizer._target_=torch.optim.Adam", "trainer.device=cuda",
              "trainer.max_steps=20", "trainer.log_every=1", "trainer.checkpoint_every=0"]
    losses = lambda run: torch.tensor([loss for _, loss in run.losses], dtype=torch.float64)  # noqa: E731
    graphed = losses(train(config(*common), cuda, tmp_path / "graphed"))
    eager = losses(train(config(*common, "trainer.cuda_graphs=false", "trainer.direct_step=false"), cuda,
                         tmp_path / "eager"))
    unscheduled = losses(train(config(*common, "model.lr_schedule.warmup_steps=0", "model.lr_schedule.decay_steps=0"),
                               cuda, tmp_path / "unscheduled"))
    assert len(graphed) == 20
    torch.testing.assert_close(graphed, eager, rtol=1e-5, atol=1e-6)
    assert ((unscheduled - graphed).abs() / graphed.abs()).max() > 1e-3
