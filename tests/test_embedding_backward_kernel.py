"""The fused backward + exact optimizer kernel (interpreter on CPU) against the per-table torch path.

Two lookups start from the same random tables and momentum; one applies each step's gradient with the torch
reference (the CPU path of PooledEmbeddingLookup.apply_gradient), the other with the kernel (compiled, on the GPU
where there is one). After several steps
their tables and momentum must agree. The bags have duplicate rows within and across bags, a table read by two
features, uneven dims, a mean-pooled table, empty bags and a table that no bag reads. The hot-segment tests lower
the hot kernel's threshold and tiles so that these small shapes give it Zipf-like hot rows, rows of exactly the
threshold and one more, and segments of several of its steps.
"""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch
import triton.language as tl
from torchrec import EmbeddingBagConfig, PoolingType

from fused_dlrm.kernels import embedding_backward
from fused_dlrm.kernels.embedding_backward import (BackwardTables, launch_embedding_backward, optimizer_settings,
                                                  plan_embedding_backward)
from fused_dlrm.sparse.input_dist import OwnedBags
from fused_dlrm.sparse.lookup import PooledEmbeddingLookup, init_table
from fused_dlrm.sparse.optimizer import EmbeddingOptimizerConfig
from sm90 import compile_for_sm90

DTYPES = {"fp32": (torch.float32, 1e-5), "fp16": (torch.float16, 1e-3), "bf16": (torch.bfloat16, 1e-2)}

# t0 is read by f0 and f1; t1 and t3 are mean-pooled; t4's feature has only empty bags (no occurrence).
TABLES = [
    EmbeddingBagConfig(name="t0", embedding_dim=4, num_embeddings=10, feature_names=["f0", "f1"]),
    EmbeddingBagConfig(name="t1", embedding_dim=8, num_embeddings=57, feature_names=["f2"], pooling=PoolingType.MEAN),
    EmbeddingBagConfig(name="t2", embedding_dim=16, num_embeddings=7, feature_names=["f3"]),
    EmbeddingBagConfig(name="t3", embedding_dim=3, num_embeddings=300, feature_names=["f4"], pooling=PoolingType.MEAN),
    EmbeddingBagConfig(name="t4", embedding_dim=5, num_embeddings=20, feature_names=["f5"]),
]
ROWS = [t.num_embeddings for t in TABLES for _ in t.feature_names]  # per feature
UNREAD = "t4"
# Each table its own optimizer: SGD for t0 (two features) and t3 (mean-pooled, the hot tests' rows of the threshold),
# row-wise Adagrad for the others, all at other lrs and eps.
MIXED = {"t0": EmbeddingOptimizerConfig("sgd", lr=0.1), "t1": EmbeddingOptimizerConfig("rowwise_adagrad", 0.05, 1e-3),
         "t2": EmbeddingOptimizerConfig("rowwise_adagrad", lr=0.2), "t3": EmbeddingOptimizerConfig("sgd", lr=0.02),
         "t4": EmbeddingOptimizerConfig("rowwise_adagrad", lr=0.1)}
OPTIMIZERS = ["sgd", "rowwise_adagrad", "mixed"]
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # of the kernel's tensors


def make_lookup(optimizer: str, dtype: torch.dtype, device: torch.device = torch.device("cpu")):
    """optimizer: one for every table (lr 0.1), or "mixed": each table its own (MIXED)."""
    weights = {t.name: init_table(t, i, device).to(dtype) for i, t in enumerate(TABLES)}
    lookup = PooledEmbeddingLookup(TABLES, weights, MIXED if optimizer == "mixed"
                                   else EmbeddingOptimizerConfig(optimizer, lr=0.1), device)
    gen = torch.Generator().manual_seed(7)
    for m in lookup.optimizer.momentum.values():  # state as after some training, not the zeros of a fresh one
        m.copy_(torch.rand(m.shape, generator=gen) + 0.05)
    return lookup


def copy_state(src: PooledEmbeddingLookup, dst: PooledEmbeddingLookup) -> None:
    for name, w in src.weights.items():
        dst.weights[name].copy_(w)
    for name, m in src.optimizer.momentum.items():
        dst.optimizer.momentum[name].copy_(m)


def on(bags: OwnedBags, device: torch.device) -> OwnedBags:
    return OwnedBags(bags.features, bags.values.to(device), bags.lengths.to(device),
                     None if bags.weights is None else bags.weights.to(device), bags.feature_value_offsets,
                     bags.batch_sizes)


def owned_bags(lengths: torch.Tensor, values: list[torch.Tensor], weighted: bool, gen: torch.Generator) -> OwnedBags:
    """The bags of every feature of TABLES over one batch: lengths [F, B], the values of each feature."""
    offsets = [0]
    for v in values:
        offsets.append(offsets[-1] + v.numel())
    all_values = torch.cat(values)
    weights = torch.rand(all_values.numel(), generator=gen) + 0.5 if weighted else None
    return OwnedBags(features=[f for t in TABLES for f in t.feature_names], values=all_values, lengths=lengths,
                     weights=weights, feature_value_offsets=offsets, batch_sizes=[lengths.shape[1]])


def random_bags(batch: int, weighted: bool, gen: torch.Generator) -> OwnedBags:
    """Skewed values over few rows (duplicates within and across bags), empty bags, one long bag."""
    lengths = torch.randint(0, 5, (len(ROWS), batch), generator=gen)
    lengths[:, 0] = 0  # an empty bag in every feature
    lengths[0, -1] = 12  # a long bag: t0 has 10 rows, so it repeats rows
    lengths[-1] = 0  # the last feature (table t4) reads nothing
    values = [(torch.rand(int(l.sum()), generator=gen) ** 3 * r).long() for r, l in zip(ROWS, lengths)]
    return owned_bags(lengths, values, weighted, gen)


HOT_THRESHOLD = 8  # the tests' threshold (the module's is for GPU shapes)
EXACT_TABLE, AT_THRESHOLD, ABOVE_THRESHOLD = "t3", 299, 298  # rows of exactly HOT_THRESHOLD and one more occurrences


def hot_bags(batch: int, weighted: bool, gen: torch.Generator) -> OwnedBags:
    """Zipf(1.05)-distributed rows (rank r drawn with probability ~ (r + 1)^-1.05: a few hot rows per table, t0's
    read by both its features) in bags of 0 to 8; t3's feature also gets exactly HOT_THRESHOLD occurrences of one
    row and HOT_THRESHOLD + 1 of another (rows that Zipf draws do not reach)."""
    lengths = torch.randint(0, 9, (len(ROWS), batch), generator=gen)
    lengths[-1] = 0  # the last feature (table t4) reads nothing
    exact = [f for t in TABLES for f in t.feature_names].index(TABLES[3].feature_names[0])
    values = []
    for f, (rows, length) in enumerate(zip(ROWS, lengths)):
        count = int(length.sum())
        extra = [AT_THRESHOLD] * HOT_THRESHOLD + [ABOVE_THRESHOLD] * (HOT_THRESHOLD + 1) if f == exact else []
        zipf = (torch.arange(rows - 2, dtype=torch.float64) + 1) ** -1.05  # the last 2 rows: never drawn
        drawn = (torch.multinomial(zipf, count - len(extra), replacement=True, generator=gen) if count
                 else torch.empty(0, dtype=torch.int64))  # multinomial draws at least one
        v = torch.cat([drawn, torch.tensor(extra, dtype=torch.int64)])
        values.append(v[torch.randperm(count, generator=gen)])
    return owned_bags(lengths, values, weighted, gen)


def row_counts(bags: OwnedBags) -> dict[str, torch.Tensor]:
    """Occurrences of every row of every table, over all its features (the segment lengths); asserts what the
    hot-segment tests rely on: rows of exactly the threshold and one more, rows of more than 3 of the hot kernel's
    steps (of 4 occurrences), a hot row of t0 read by both of its features."""
    counts = {t.name: torch.zeros(t.num_embeddings, dtype=torch.int64) for t in TABLES}
    for i, t in enumerate(t for t in TABLES for _ in t.feature_names):
        counts[t.name] += torch.bincount(bags.feature_bags(i)[0], minlength=t.num_embeddings)
    assert counts[EXACT_TABLE][AT_THRESHOLD] == HOT_THRESHOLD
    assert counts[EXACT_TABLE][ABOVE_THRESHOLD] == HOT_THRESHOLD + 1
    assert sum(int((c > 3 * 4).sum()) for c in counts.values()) >= 3
    f0, f1 = (torch.bincount(bags.feature_bags(i)[0], minlength=TABLES[0].num_embeddings) for i in (0, 1))
    assert ((f0 > 0) & (f1 > 0) & (f0 + f1 > HOT_THRESHOLD)).any()
    return counts


@pytest.fixture
def hot_path(monkeypatch):
    """The module's constants scaled to the tests' shapes (block dim 16): the narrow kernel takes 2 occurrences a
    step (as at dim 256), the hot one 4 (a hot segment is several steps) and scans windows of 4 segments (every
    program several)."""
    monkeypatch.setattr(embedding_backward, "HOT_THRESHOLD", HOT_THRESHOLD)
    monkeypatch.setattr(embedding_backward, "TILE_ELEMENTS", 32)
    monkeypatch.setattr(embedding_backward, "HOT_TILE_ELEMENTS", 64)
    monkeypatch.setattr(embedding_backward, "HOT_SCAN_SEGMENTS", 4)
    return monkeypatch


def backward_tables(lookup: PooledEmbeddingLookup) -> BackwardTables:
    """What the lookup builds for its GPU path, here over its CPU tensors."""
    names = list(lookup.tables)
    momentum = [lookup.optimizer.momentum.get(n) for n in names]
    return BackwardTables([lookup.weights[n] for n in names], momentum,
                          [names.index(t) for _, t in lookup.features],
                          [lookup.tables[t].pooling == PoolingType.MEAN for _, t in lookup.features],
                          lookup._anchor.device)


def settings(lookup: PooledEmbeddingLookup, device: torch.device = DEVICE) -> torch.Tensor:
    """The lookup's optimizer settings as its GPU path gives them to the kernels."""
    return optimizer_settings([lookup.optimizer.configs[n] for n in lookup.tables], device)


def assert_same_state(got: PooledEmbeddingLookup, expected: PooledEmbeddingLookup, tol: float) -> None:
    for name in expected.weights:
        torch.testing.assert_close(got.weights[name].cpu(), expected.weights[name], rtol=tol, atol=tol, msg=name)
    for name in expected.optimizer.momentum:
        torch.testing.assert_close(got.optimizer.momentum[name].cpu(), expected.optimizer.momentum[name],
                                   rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("dtype,weighted,wide_keys", [("fp32", False, False), ("fp32", True, False),
                                                      ("fp16", True, False), ("bf16", False, False),
                                                      ("fp32", True, True)])
def test_kernel_matches_torch_path(optimizer, dtype, weighted, wide_keys):
    """wide_keys: 64-bit sort keys (rows too many for 32), forced on these small tables."""
    torch_dtype, tol = DTYPES[dtype]
    reference, fused = make_lookup(optimizer, torch_dtype), make_lookup(optimizer, torch_dtype, DEVICE)
    copy_state(reference, fused)  # init_table draws differently on a GPU
    untouched = reference.weights[UNREAD].clone()
    tables = backward_tables(fused)
    if wide_keys:
        tables.row_bits, tables.key_dtype = 40, torch.int64
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        bags = random_bags(6, weighted, gen)
        grad = torch.randn(6, reference.output_dim, generator=gen)
        reference.apply_gradient(bags, grad)
        launch_embedding_backward(on(bags, DEVICE), grad.to(DEVICE), tables, settings(fused))
        assert_same_state(fused, reference, tol)
        if torch_dtype != torch.float32:  # both round each update to fp16/bf16, a little differently: start the
            copy_state(reference, fused)  # next step equal, so rounding differences cannot compound
    assert torch.equal(fused.weights[UNREAD].cpu(), untouched)
    if UNREAD in reference.optimizer.momentum:
        assert torch.equal(fused.optimizer.momentum[UNREAD].cpu(), reference.optimizer.momentum[UNREAD])


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad"])
def test_a_plan_made_ahead_updates_as_one_made_in_the_backward(optimizer):
    """The batch thread makes the plan (sort, segments) before the backward: the same updates as the torch path,
    bags with and without occurrences."""
    reference, fused = make_lookup(optimizer, torch.float32), make_lookup(optimizer, torch.float32, DEVICE)
    copy_state(reference, fused)
    tables = backward_tables(fused)
    gen = torch.Generator().manual_seed(3)
    for batch, empty in ((6, False), (3, True), (5, False)):
        bags = (owned_bags(torch.zeros(len(ROWS), batch, dtype=torch.int64),
                           [torch.empty(0, dtype=torch.int64)] * len(ROWS), True, gen) if empty
                else random_bags(batch, True, gen))
        grad = torch.randn(batch, reference.output_dim, generator=gen)
        device_bags = on(bags, DEVICE)
        plan = plan_embedding_backward(device_bags, tables)
        assert (plan is None) == empty
        reference.apply_gradient(bags, grad)
        launch_embedding_backward(device_bags, grad.to(DEVICE), tables, settings(fused), plan)
        assert_same_state(fused, reference, 1e-5)
    # and the plan given is the one used: another batch's plan updates other rows
    bags, other = random_bags(6, True, gen), on(random_bags(6, True, gen), DEVICE)
    grad = torch.randn(6, reference.output_dim, generator=gen)
    reference.apply_gradient(bags, grad)
    launch_embedding_backward(on(bags, DEVICE), grad.to(DEVICE), tables, settings(fused),
                              plan_embedding_backward(other, tables))
    with pytest.raises(AssertionError):
        assert_same_state(fused, reference, 1e-5)


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("dtype,weighted,hot_tile", [("fp32", True, 64), ("fp32", False, 8192),
                                                     ("fp16", True, 64)])
def test_hot_segments_match_torch_path(hot_path, optimizer, dtype, weighted, hot_tile):
    """Zipf-like rows, the long segments through the hot kernel: a few steps each (hot_tile 64: 4 occurrences a
    step), or one masked step (8192, the module's tile: 512 occurrences at block dim 16)."""
    hot_path.setattr(embedding_backward, "HOT_TILE_ELEMENTS", hot_tile)
    torch_dtype, tol = DTYPES[dtype]
    reference, fused = make_lookup(optimizer, torch_dtype), make_lookup(optimizer, torch_dtype, DEVICE)
    copy_state(reference, fused)
    tables = backward_tables(fused)
    gen = torch.Generator().manual_seed(12)
    for _ in range(3):
        bags = hot_bags(16, weighted, gen)
        row_counts(bags)  # asserts that the bags have what the test is for
        grad = torch.randn(16, reference.output_dim, generator=gen)
        reference.apply_gradient(bags, grad)
        launch_embedding_backward(on(bags, DEVICE), grad.to(DEVICE), tables, settings(fused))
        assert_same_state(fused, reference, tol)
        if torch_dtype != torch.float32:  # as in test_kernel_matches_torch_path
            copy_state(reference, fused)


def adagrad_step(bags: OwnedBags):
    """One row-wise Adagrad backward of fresh tables on `bags`: (lookup, weights before, momentum before)."""
    lookup = make_lookup("rowwise_adagrad", torch.float32, DEVICE)
    before = {n: w.to("cpu", copy=True) for n, w in lookup.weights.items()}
    momentum = {n: m.to("cpu", copy=True) for n, m in lookup.optimizer.momentum.items()}
    batch = bags.global_batch
    launch_embedding_backward(on(bags, DEVICE), torch.randn(batch, lookup.output_dim, device=DEVICE),
                              backward_tables(lookup), settings(lookup))
    return lookup, before, momentum


@pytest.mark.parametrize("kernel", ["_LAUNCHES", "_HOT_LAUNCHES"])
def test_each_segment_goes_to_one_kernel(hot_path, kernel):
    """With either kernel's launch dropped, the other updates exactly its own rows: those of at most (narrow) or
    more than (hot) HOT_THRESHOLD occurrences, the rows of exactly the threshold and one more included."""
    class Dropped:  # no binary (as in the interpreter), no launch
        def compiled(self, key, grid, args, options):
            return None

        def __call__(self, key, grid, args, options):
            pass

    hot_path.setattr(embedding_backward, kernel, Dropped())
    bags = hot_bags(16, True, torch.Generator().manual_seed(13))
    lookup, before, momentum = adagrad_step(bags)
    for table, counts in row_counts(bags).items():
        hot = counts > HOT_THRESHOLD
        mine = (counts > 0) & (hot if kernel == "_LAUNCHES" else ~hot)  # the rows of the kernel left
        changed = (lookup.weights[table].cpu() != before[table]).any(dim=1)
        assert torch.equal(changed, mine), table
        assert torch.equal(lookup.optimizer.momentum[table].cpu() != momentum[table], mine), table


def test_sort_keys_are_32_bit_while_table_and_row_fit():
    """table << row_bits | row: 4 tables of 2**29 rows take 2 + 29 bits (int32), 8 tables 3 + 29 (int64)."""
    meta = torch.device("meta")
    for count, dtype in ((4, torch.int32), (8, torch.int64)):
        weights = [torch.empty(2**29, 4, device=meta) for _ in range(count)]
        tables = BackwardTables(weights, [None] * count, list(range(count)), [False] * count, meta)
        assert (tables.row_bits, tables.key_dtype) == (29, dtype)


def float64_step(lookup: PooledEmbeddingLookup, weights: dict, momentum: dict, bags: OwnedBags,
                 grad: torch.Tensor) -> None:
    """One backward by its definition, in float64, in place on `weights` and `momentum`: each table's dense
    gradient by autograd through the pooled lookup, then the table's optimizer (lookup.optimizer.configs) on every
    row (a row no bag reads has a zero gradient, which changes neither weight nor state)."""
    leaves = {n: w.detach().requires_grad_() for n, w in weights.items()}
    pooled = []
    for i, (_, table) in enumerate(lookup.features):
        values, lengths, sample_weights = bags.feature_bags(i)
        rows = leaves[table][values]
        if sample_weights is not None:
            rows = rows * sample_weights.double()[:, None]
        bag = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
        bag_sums = rows.new_zeros(lengths.numel(), rows.shape[1]).index_add(0, bag, rows)
        pooled.append(bag_sums / lengths.clamp(min=1)[:, None] if lookup.is_mean(table) else bag_sums)
    (torch.cat(pooled, dim=1) * grad.double()).sum().backward()
    with torch.no_grad():
        for name, config in lookup.optimizer.configs.items():
            g = leaves[name].grad
            if config.name == "sgd":
                weights[name] -= config.lr * g
                continue
            momentum[name] += g.pow(2).mean(dim=1)
            weights[name] -= config.lr * g / (momentum[name].sqrt() + config.eps)[:, None]


@pytest.mark.parametrize("hot", [False, True])
def test_per_table_optimizers_match_float64(hot_path, hot):
    """Each table its own optimizer (MIXED: SGD and row-wise Adagrad, other lrs and eps) in one launch pair,
    against float64 by definition; hot: Zipf-like rows, the long segments (of SGD and Adagrad tables) through the
    hot kernel. An lr changed between steps (optimizer.update) is the next step's, 0 included."""
    fused = make_lookup("mixed", torch.float32, DEVICE)
    weights = {n: w.to("cpu", torch.float64) for n, w in fused.weights.items()}
    momentum = {n: m.to("cpu", torch.float64) for n, m in fused.optimizer.momentum.items()}
    tables = backward_tables(fused)
    gen = torch.Generator().manual_seed(21)
    for step in range(3):
        if step == 2:
            fused.optimizer.update("t0", lr=0.15)  # SGD
            fused.optimizer.update("t2", lr=0.4, eps=0.1)  # row-wise Adagrad
            fused.optimizer.update("t1", lr=0.0)  # row-wise Adagrad at lr 0 (a warm-up's first step): state only
        bags = hot_bags(16, True, gen) if hot else random_bags(6, True, gen)
        if hot:
            row_counts(bags)  # asserts that the bags have what the test is for
        grad = torch.randn(bags.global_batch, fused.output_dim, generator=gen)
        float64_step(fused, weights, momentum, bags, grad)
        launch_embedding_backward(on(bags, DEVICE), grad.to(DEVICE), tables, settings(fused))
        for name, w in weights.items():
            torch.testing.assert_close(fused.weights[name].cpu().double(), w, rtol=1e-5, atol=1e-6, msg=name)
        for name, m in momentum.items():
            torch.testing.assert_close(fused.optimizer.momentum[name].cpu().double(), m, rtol=1e-5, atol=1e-6,
                                       msg=name)
    assert sorted(momentum) == ["t1", "t2", "t4"]  # the Adagrad tables' state only


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad"])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_half_tables_round_each_update_once(optimizer, dtype):
    """fp16 / bf16 tables: a row's update is computed in fp32 from the row's value and rounded once, by the torch
    path as by the kernel: both give float64's update rounded to the table's dtype, but for the rare element that
    fp32's own rounding moves across a tie. (Rounding the step to the dtype first, then the sum, left ~30% of the
    updated elements an ulp away: the torch path and the kernel disagreed after every step.)"""
    torch_dtype, tol = DTYPES[dtype]
    reference, fused = make_lookup(optimizer, torch_dtype), make_lookup(optimizer, torch_dtype, DEVICE)
    copy_state(reference, fused)
    before = {n: w.clone() for n, w in reference.weights.items()}
    weights = {n: w.double() for n, w in reference.weights.items()}
    momentum = {n: m.double() for n, m in reference.optimizer.momentum.items()}
    gen = torch.Generator().manual_seed(4)
    bags = random_bags(6, True, gen)
    grad = torch.randn(6, reference.output_dim, generator=gen)
    float64_step(reference, weights, momentum, bags, grad)
    reference.apply_gradient(bags, grad)
    launch_embedding_backward(on(bags, DEVICE), grad.to(DEVICE), backward_tables(fused), settings(fused))
    expected = {n: w.to(torch_dtype) for n, w in weights.items()}
    updated = sum(int((expected[n] != before[n]).sum()) for n in expected)
    assert updated > 200  # what the count below is a fraction of
    # Triton's interpreter (3.6) casts fp32 to bf16 by truncation, GPUs round to nearest: the kernel's bf16 rounding
    # is checked where it is compiled.
    for lookup in (reference, fused) if DEVICE.type == "cuda" or torch_dtype != torch.bfloat16 else (reference,):
        for name, w in expected.items():
            torch.testing.assert_close(lookup.weights[name].cpu(), w, rtol=tol, atol=tol, msg=name)
        off = sum(int((lookup.weights[n].cpu() != w).sum()) for n, w in expected.items())
        assert off <= updated // 100, f"{off} of {updated} updated elements are not float64's update rounded once"


def test_settings_reach_the_gpu_once_per_change():
    """The GPU path's (lr, eps) per table: copied when the optimizer's settings changed, else the same tensor."""
    lookup = make_lookup("mixed", torch.float32)
    first = lookup._kernel_settings()
    torch.testing.assert_close(first, torch.tensor([[c.lr, c.eps] for c in MIXED.values()]))
    assert lookup._kernel_settings() is first
    lookup.optimizer.update("t3", lr=0.02)  # the lr it has: nothing changed
    assert lookup._kernel_settings() is first
    lookup.optimizer.update("t3", lr=0.5, eps=2.0)
    expected = torch.tensor([[c.lr, c.eps] for c in MIXED.values()])
    expected[3] = torch.tensor([0.5, 2.0])
    torch.testing.assert_close(lookup._kernel_settings(), expected)
    with pytest.raises(ValueError, match="lr must be >= 0"):
        lookup.optimizer.update("t1", lr=-0.01)


@pytest.mark.parametrize("setting,value", [("eps", float("nan")), ("eps", float("inf")), ("eps", -1e-8),
                                           ("lr", float("nan")), ("lr", float("inf"))])
def test_a_setting_that_would_spoil_every_updated_row_is_refused(setting, value):
    """A NaN lr or eps makes every row a backward touches NaN, an infinite lr makes them inf or NaN (inf x 0), an
    infinite eps freezes them, and a negative eps can make sqrt(m) + eps reach 0 or change sign: refused when a
    config is made and when a setting changes (an LR scheduler's step, update_hyper_parameters), as a negative lr
    is."""
    with pytest.raises(ValueError, match=rf"embedding optimizer {setting} must be >= 0, got {value} \(a finite"):
        EmbeddingOptimizerConfig("rowwise_adagrad", **{setting: value})
    lookup = make_lookup("rowwise_adagrad", torch.float32)
    with pytest.raises(ValueError, match=rf"embedding optimizer {setting} must be >= 0, got {value}"):
        lookup.optimizer.update("t1", **{setting: value})
    assert lookup.optimizer.configs["t1"] == EmbeddingOptimizerConfig("rowwise_adagrad", lr=0.1)


def test_untouched_rows_keep_weight_and_state():
    bags = random_bags(5, True, torch.Generator().manual_seed(2))
    lookup, before, momentum = adagrad_step(bags)
    after = {n: w.cpu() for n, w in lookup.weights.items()}
    after_momentum = {n: m.cpu() for n, m in lookup.optimizer.momentum.items()}
    for i, (_, table) in enumerate(lookup.features):
        touched = torch.zeros(lookup.tables[table].num_embeddings, dtype=torch.bool)
        for j, (_, t) in enumerate(lookup.features):
            if t == table:
                touched[bags.feature_bags(j)[0]] = True
        assert touched.any() == (table != UNREAD)
        assert torch.equal(after[table][~touched], before[table][~touched])
        assert torch.equal(after_momentum[table][~touched], momentum[table][~touched])
        assert (after[table][touched] != before[table][touched]).all()
        assert (after_momentum[table][touched] > momentum[table][touched]).all()


def test_no_occurrence_at_all_is_a_no_op():
    lookup = make_lookup("sgd", torch.float32, DEVICE)
    before = {n: w.clone() for n, w in lookup.weights.items()}
    bags = random_bags(3, False, torch.Generator().manual_seed(3))
    bags.lengths.zero_()
    bags.values = bags.values[:0]
    bags.feature_value_offsets = [0] * len(bags.feature_value_offsets)
    launch_embedding_backward(on(bags, DEVICE), torch.randn(3, lookup.output_dim, device=DEVICE),
                              backward_tables(lookup), settings(lookup))
    for name, w in lookup.weights.items():
        assert torch.equal(w, before[name])


def test_launch_has_no_data_dependent_shape(monkeypatch):
    """The whole host side of a launch (weighted bags, a mean-pooled table, Adagrad) runs on the meta device, the
    kernel stubbed out: no op in it needs a value on the host."""
    meta = torch.device("meta")
    lookup = make_lookup("rowwise_adagrad", torch.float32)
    names = list(lookup.tables)
    tables = BackwardTables([lookup.weights[n].to(meta) for n in names],
                            [lookup.optimizer.momentum[n].to(meta) for n in names],
                            [names.index(t) for _, t in lookup.features],
                            [lookup.tables[t].pooling == PoolingType.MEAN for _, t in lookup.features], meta)
    grids = []

    class Launches:  # CompiledLaunches without a kernel: no binary (as in the interpreter), records the grid
        def compiled(self, key, grid, args, options):
            return None

        def __call__(self, key, grid, args, options):
            grids.append(grid)

    monkeypatch.setattr(embedding_backward, "_LAUNCHES", Launches())
    monkeypatch.setattr(embedding_backward, "_HOT_LAUNCHES", Launches())
    monkeypatch.setattr(embedding_backward, "_OCCURRENCE_LAUNCHES", lambda *args: None)
    monkeypatch.setattr(embedding_backward, "HOT_SCAN_SEGMENTS", 4)  # at least 4 windows: 4 hot programs
    bags = random_bags(6, True, torch.Generator().manual_seed(5))
    assert bags.values.numel() > embedding_backward.HOT_THRESHOLD  # so the hot kernel is launched
    launch_embedding_backward(on(bags, meta), torch.empty(6, lookup.output_dim, device=meta), tables,
                              settings(lookup, meta))
    assert grids == [(4, 1, 1), (4, 1, 1)]  # min(n, 4) and min(windows, 4) programs off the GPU


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_gpu_lookup_matches_cpu_without_host_sync(optimizer):
    """The lookup's CUDA branch against its CPU branch; after the first step (which builds the launch metadata)
    a backward makes no host sync, also the one after an lr and eps change (the settings copied again)."""
    cuda = torch.device("cuda")
    reference, fused = make_lookup(optimizer, torch.float32), make_lookup(optimizer, torch.float32, cuda)
    copy_state(reference, fused)
    gen = torch.Generator().manual_seed(4)
    for step in range(4):
        if step == 2:
            for lookup in (reference, fused):
                lookup.optimizer.update("t0", lr=0.05)
                lookup.optimizer.update("t2", lr=0.3, eps=1e-3)
        bags = random_bags(9, True, gen)
        grad = torch.randn(9, reference.output_dim, generator=gen)
        reference.apply_gradient(bags, grad)
        gpu_bags, gpu_grad = on(bags, cuda), grad.to(cuda)
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")  # a warning per synchronizing call
            try:
                fused.apply_gradient(gpu_bags, gpu_grad)
            finally:
                torch.cuda.set_sync_debug_mode(0)
        syncs = [str(w.message) for w in record if "synchroniz" in str(w.message)]
        if step > 0:
            assert not syncs, syncs
    for name in reference.weights:
        torch.testing.assert_close(fused.weights[name].cpu(), reference.weights[name], rtol=1e-5, atol=1e-6)
    for name in reference.optimizer.momentum:
        torch.testing.assert_close(fused.optimizer.momentum[name].cpu(), reference.optimizer.momentum[name],
                                   rtol=1e-5, atol=1e-6)



def test_shared_binaries_do_not_specialise_on_ints():
    """The kernels' compiled binaries are shared by every lookup of a process under keys that hold no ints, so
    no int argument may be specialised (Triton would bake 1 in as a constant, or assume divisibility by 16)."""
    for kernel in (embedding_backward._occurrences_kernel, embedding_backward._embedding_backward_kernel,
                   embedding_backward._hot_segments_kernel):
        # JITFunction, or the interpreter's wrapper of one (which keeps the decorator's arguments)
        unspecialised = getattr(kernel, "do_not_specialize", None) or kernel.kwargs["do_not_specialize"]
        ints = [name for name, p in inspect.signature(kernel.fn).parameters.items()
                if p.annotation not in (tl.constexpr, "tl.constexpr") and not name.endswith(("_ptr", "_ptrs"))]
        assert ints and set(ints) <= set(unspecialised), set(ints) - set(unspecialised)


COMPILE_FOR_SM90 = """
from fused_dlrm.kernels import embedding_backward as eb

types = {n: "*i64" for n in ("values_ptr", "csr_ptr", "feature_table_ptr", "cols_ptr", "grad_offsets_ptr",
                             "starts_ptr", "num_segments_ptr", "table_ptrs", "momentum_ptrs")}
types.update(weights_ptr="*fp32", scales_ptr="*fp32", grad_ptr="*fp32", mean_ptr="*i1", dims_ptr="*i32",
             adagrad_ptr="*i1", settings_ptr="*fp32", num_values="i64")
for key_dtype, key_type in ((tl.int32, "*i32"), (tl.int64, "*i64")):
    types["keys_ptr"] = key_type
    for scale in (False, True):
        build(eb._occurrences_kernel, types, dict(BLOCK_BAGS=16, BLOCK_L=8, HAS_WEIGHTS=scale, HAS_SCALE=scale,
                                                  KEY_DTYPE=key_dtype))
        for adagrad in (eb.NO_ADAGRAD, eb.SOME_ADAGRAD, eb.ALL_ADAGRAD):
            # the module's tiles and warps at dim 256, as the launches use them
            build(eb._embedding_backward_kernel, types, dict(BLOCK_N=eb.TILE_ELEMENTS // 256, BLOCK_D=256,
                                                             TABLE_DTYPE=tl.float16, HAS_SCALE=scale,
                                                             ADAGRAD=adagrad), num_warps=eb.NUM_WARPS)
            build(eb._hot_segments_kernel, types, dict(BLOCK_SCAN=eb.HOT_SCAN_SEGMENTS,
                                                       BLOCK_N=eb.HOT_TILE_ELEMENTS // 256, BLOCK_D=256,
                                                       TABLE_DTYPE=tl.float16, HAS_SCALE=scale,
                                                       ADAGRAD=adagrad),
                  num_warps=eb.HOT_NUM_WARPS)
"""


def test_kernels_compile_for_sm90():
    """The backward kernels as the GPU compiles them, 32- and 64-bit sort keys."""
    compile_for_sm90(COMPILE_FOR_SM90)
