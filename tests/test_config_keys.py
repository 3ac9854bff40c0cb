"""Config keys no code reads are refused (fused_dlrm/train/config_keys.py): a `+trainer.<typo>=...` override adds a
key, which train.py, the report and the benchmarks (compose_config) refuse instead of running without it."""

import subprocess
import sys
from pathlib import Path

import pytest

from fused_dlrm.train.build import compose_config
from fused_dlrm.train.config_keys import CONF

ROOT = Path(__file__).resolve().parents[1]
# every packaged option of each group, under the model whose data it is (train.py's DATA_GROUPS)
OPTIONS = ([[f"model={m.stem}"] for m in sorted((CONF / "model").glob("*.yaml"))]
           + [["model=dlrm", f"data={d}"] for d in ("synthetic", "synthetic_paper", "criteo")]
           + [["model=moe_transformer", f"data={d}"] for d in ("bytes", "bytes_finegrained")]
           + [[f"comm={c.stem}"] for c in sorted((CONF / "comm").glob("*.yaml"))])


@pytest.mark.parametrize("overrides", OPTIONS + [
    ["+data.train.device=cuda"],  # keys under a `_target_` node are its class's arguments
    ["+trainer.dense_optimizer.momentum=0.9", "trainer.dense_optimizer._target_=torch.optim.SGD",
     "~trainer.dense_optimizer.fused"],
    ["model=moe_transformer", "+model.optimizer.betas=[0.9,0.95]"],
    ["report=true", "seed=3", "model.num_rows=[10,20]", "trainer.max_steps=2"],
], ids=" ".join)
def test_the_packaged_configs_and_their_keys_are_accepted(overrides):
    compose_config(overrides)


@pytest.mark.parametrize("overrides,said", [
    (["+trainer.max_step=3"], r"trainer.max_step \(did you mean trainer.max_steps\?\); the known keys of trainer: "
                              r"batches_ahead, .*max_steps, .*tf32$"),
    (["+model.embedding_optimizer.momentum=0.9"], r"model.embedding_optimizer.momentum; the known keys of "
                                                  r"model.embedding_optimizer: eps, lr, name$"),
    (["+data.typo.deeper=1", "+comm.backedn=gloo"], r"data.typo; the known keys of data: .* \| comm.backedn \(did you "
                                                    r"mean comm.backend\?\); the known keys of comm: .*transport"),
    (["+sed=1"], r"sed \(did you mean seed\?\); the known keys of the config: comm, data, hydra, model, report, "
                 r"seed, trainer$"),
])
def test_keys_no_conf_file_sets_are_refused(overrides, said):
    with pytest.raises(ValueError, match=r"^unknown config key\(s\), which no code reads \(a `\+` override adds any "
                                         r"key\): " + said):
        compose_config(overrides)


def test_train_py_refuses_a_typo_before_training(tmp_path):
    """(A short run, should the typo be taken: the test then fails on its exit status, not on a timeout.)"""
    done = subprocess.run([sys.executable, "train.py", "+trainer.max_step=1", "trainer.max_steps=1",
                           "trainer.eval_every=0", "trainer.checkpoint_every=0", "model.num_rows=100",
                           "data.global_batch_size=8", "data.eval_batches=1", f"hydra.run.dir={tmp_path}/run"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert "unknown config key(s)" in done.stderr and "trainer.max_step (did you mean" in done.stderr, done.stderr


def test_a_composition_with_the_hydra_config_is_accepted():
    """The standalone report composes with Hydra's own node (`hydra`): a top-level key of conf/config.yaml."""
    cfg = compose_config(["trainer.max_steps=2"], return_hydra_config=True)
    assert "hydra" in cfg and cfg.trainer.max_steps == 2
    with pytest.raises(ValueError, match=r"^unknown config key\(s\).*: sed \(did you mean seed\?\)"):
        compose_config(["+sed=1"], return_hydra_config=True)
