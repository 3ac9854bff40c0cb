"""bench/checks.py on a gloo world: a fused result unlike the bulk twin's (or another reference's), on any rank,
raises on every rank."""

import math

import pytest
import torch

from fused_dlrm.bench.checks import (check_against_bulk, check_table_updates, different_elements, max_relative_error,
                                     relative_error)
from world import run_world


def test_relative_error():
    want = torch.tensor([3.0, 4.0])
    assert relative_error(want.bfloat16(), want) == 0.0
    assert relative_error(torch.tensor([3.0, 4.5]), want) == pytest.approx(0.1)
    assert relative_error(torch.tensor([float("nan"), 4.0]), want) != relative_error(want, want)  # NaN


def _one_rank_off(rank, world_size, wrong, reference):
    named = {} if reference == "the bulk twin" else {"reference": reference}
    bulk = torch.randn(64, 32, generator=torch.Generator().manual_seed(rank))
    error = check_against_bulk("op", bulk * (1 + 1e-3), bulk, 1e-2, **named)  # within tolerance: nothing raised
    assert error == pytest.approx(1e-3, rel=1e-3)  # the error it checked, for the bench's table
    got = wrong(bulk) if rank == 1 else bulk.clone()
    if rank == 1:
        with pytest.raises(AssertionError, match=rf"^op: relative error .* against {reference} \(tolerance 0.01\)"):
            check_against_bulk("op", got, bulk, 1e-2, **named)
    else:
        with pytest.raises(ValueError, match=rf"rank\(s\) \[1\] saw a result unlike {reference}'s: "
                                             r"AssertionError: op: relative error"):
            check_against_bulk("op", got, bulk, 1e-2, **named)


def _off_by_a_tenth(t):
    return t * 1.1


def _one_nan(t):
    t = t.clone()
    t[5, 7] = float("nan")
    return t


@pytest.mark.parametrize("reference", ["the bulk twin", "the torch reference"])
@pytest.mark.parametrize("wrong", [_off_by_a_tenth, _one_nan])
def test_a_wrong_result_on_one_rank_raises_on_every_rank(wrong, reference):
    run_world(2, _one_rank_off, wrong, reference)


def _one_rank_shaped_otherwise(rank, world_size, shaped):
    bulk = torch.randn(64, 32, generator=torch.Generator().manual_seed(rank))
    got = shaped(bulk) if rank == 1 else bulk.clone()
    if rank == 1:
        with pytest.raises(AssertionError, match=rf"^op: shape \[{', '.join(map(str, got.shape))}\] against the "
                                                 r"bulk twin's \[64, 32\]$"):
            check_against_bulk("op", got, bulk, 1e-2)
    else:
        with pytest.raises(ValueError, match=r"rank\(s\) \[1\] saw a result unlike the bulk twin's: "
                                             r"AssertionError: op: shape"):
            check_against_bulk("op", got, bulk, 1e-2)


def _one_row_short(t):  # an uneven batch's rank given the larger rank's rows: torch's error there alone
    return t[:-1]


def _unsqueezed(t):  # broadcasts against the bulk result: its error would be 0
    return t.unsqueeze(0)


@pytest.mark.parametrize("shaped", [_one_row_short, _unsqueezed])
def test_a_result_of_another_shape_on_one_rank_raises_on_every_rank(shaped):
    """Not broadcast into agreement, nor torch's size error on that rank alone (its peers left waiting)."""
    run_world(2, _one_rank_shaped_otherwise, shaped, timeout=120)


def test_max_relative_error_names_one_wrong_entry_the_norm_hides():
    """moe.bench's measure: one entry wrong by half the largest moves the Frobenius error of a 64 x 32 tensor by ~4%,
    the max relative error by a half."""
    want = torch.randn(64, 32, generator=torch.Generator().manual_seed(5))
    got = want.clone()
    got[3, 4] += want.abs().max() / 2
    assert relative_error(got, want) < 5e-2 and max_relative_error(got, want) == pytest.approx(0.5)
    assert math.isnan(max_relative_error(torch.tensor([float("nan"), 4.0]), torch.tensor([3.0, 4.0])))
    check_against_bulk("op", got, want, 5e-2)
    with pytest.raises(AssertionError, match=r"^op: max relative error 0.5 against the bulk twin \(tolerance 0.05\)"):
        check_against_bulk("op", got, want, 5e-2, metric=max_relative_error)


def test_different_elements_counts_bits_a_comparison_of_values_passes():
    """The quantized all-reduce bench's check against its twin, meant to agree bit for bit: -0 against +0 and a
    NaN are counted (relative_error at tolerance 0 passed the first; == passes it too)."""
    want = torch.randn(100, generator=torch.Generator().manual_seed(6)).bfloat16()
    assert different_elements(want.clone(), want) == 0
    got = want.clone()
    got[0], got[1], want[1] = float("nan"), 0.0, -0.0
    assert different_elements(got, want) == 2 and relative_error(got[1:], want[1:]) == 0
    with pytest.raises(AssertionError, match=r"^op: different elements 2 against its twin \(tolerance 0\)"):
        check_against_bulk("op", got, want, 0, "its twin", different_elements)


def _embedding_steps(broken=None):
    """A CPU lookup's forward+backward as the bulk step, and a second lookup over the same tables as the step
    checked, its optimizer's update of one table `broken(table, rows, grads, step)` where given."""
    from torchrec import EmbeddingBagConfig

    from fused_dlrm.bench.embedding import Config, make_bags
    from fused_dlrm.sparse.lookup import PooledEmbeddingLookup, init_table
    from fused_dlrm.sparse.optimizer import EmbeddingOptimizerConfig

    cfg = Config(global_batch=16, tables_per_gpu=3, dim=8, pooling=3, rows=200)  # rows no bag touches too
    bags = make_bags(cfg, 0, 1, torch.device("cpu"))
    tables = [EmbeddingBagConfig(name=f"t_{f}", embedding_dim=cfg.dim, num_embeddings=cfg.rows, feature_names=[f])
              for f in bags.features]
    weights = {t.name: init_table(t, i, torch.device("cpu")) for i, t in enumerate(tables)}
    sgd = EmbeddingOptimizerConfig("sgd", lr=0.1)
    bulk, checked = (PooledEmbeddingLookup(tables, weights, sgd, torch.device("cpu")) for _ in range(2))
    if broken is not None:
        step = checked.optimizer.step
        checked.optimizer.step = lambda table, rows, grads: (broken(table, rows, grads, step) if table == "t_r0_f1"
                                                             else step(table, rows, grads))
    grad = torch.randn(cfg.global_batch, cfg.tables_per_gpu * cfg.dim, generator=torch.Generator().manual_seed(3))
    return weights, (lambda: checked(bags).backward(grad)), (lambda: bulk(bags).backward(grad))


def _a_row_skipped(table, rows, grads, step):
    step(table, rows[rows != rows[0]], grads[rows != rows[0]])


def _a_larger_lr(table, rows, grads, step):
    step(table, rows, grads * (1 + 1e-3))


def _an_untouched_row_written(table, rows, grads, step):
    step(table, rows, grads)
    untouched = next(r for r in range(200) if r not in rows)
    step(table, torch.tensor([untouched]), grads[:1] * 1e-2)


@pytest.mark.parametrize("broken", [_a_row_skipped, _a_larger_lr, _an_untouched_row_written])
def test_a_wrong_table_update_raises_naming_the_table(broken):
    weights, step, bulk_step = _embedding_steps(broken)
    with pytest.raises(AssertionError, match=r"^fused's update of table t_r0_f1: relative error .* against the bulk "
                                             r"twin \(tolerance 1e-05\)"):
        check_table_updates("fused's update", weights, step, bulk_step, 1e-5)


def test_a_right_table_update_passes():
    weights, step, bulk_step = _embedding_steps()
    check_table_updates("fused's update", weights, step, bulk_step, 1e-5)


def _a_wrong_update_on_rank_1(rank, world_size):
    weights, step, bulk_step = _embedding_steps(_a_row_skipped if rank == 1 else None)
    error, match = (AssertionError, "^fused's update of table t_r0_f1: relative error") if rank == 1 else \
        (ValueError, r"rank\(s\) \[1\] saw a result unlike the bulk twin's: AssertionError: fused's update of table "
                     r"t_r0_f1")
    with pytest.raises(error, match=match):
        check_table_updates("fused's update", weights, step, bulk_step, 1e-5)


def test_a_wrong_table_update_on_one_rank_raises_on_every_rank():
    run_world(2, _a_wrong_update_on_rank_1, timeout=120)
