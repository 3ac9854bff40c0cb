"""The project's interaction and sparse arches equal torchrec's: same output and same gradients; with_lean_arches keeps
torchrec's DLRM, DLRM_DCN and DLRM_Projection as they are."""

from __future__ import annotations

import pytest
import torch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, KeyedTensor
from torchrec.models import dlrm as torchrec_dlrm
from torchrec.models.dlrm import InteractionArch, SparseArch

from fused_dlrm.models.dlrm import PairwiseInteractionArch, ViewSparseArch, with_lean_arches


@pytest.mark.parametrize("num_sparse", [0, 1, 5, 26])
def test_pairwise_interaction_equals_torchrec(num_sparse):
    gen = torch.Generator().manual_seed(num_sparse)
    dense = torch.randn(7, 16, generator=gen, dtype=torch.float64)
    sparse = torch.randn(7, num_sparse, 16, generator=gen, dtype=torch.float64)
    grad_out = None
    results = []
    for arch in (InteractionArch(num_sparse), PairwiseInteractionArch(num_sparse)):
        d, s = dense.clone().requires_grad_(), sparse.clone().requires_grad_()
        out = arch(d, s)
        if grad_out is None:
            grad_out = torch.randn(out.shape, generator=gen, dtype=torch.float64)
        out.backward(grad_out)
        results.append((out.detach(), d.grad, s.grad))
    for want, got in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


class _Pooled(torch.nn.Module):
    """A stand-in embedding collection: returns `values` as a KeyedTensor under `keys` (any order)."""

    def __init__(self, features: list[str], keys: list[str], dim: int, values: torch.Tensor):
        super().__init__()
        self.configs = [EmbeddingBagConfig(name=f"t_{f}", embedding_dim=dim, num_embeddings=10, feature_names=[f])
                        for f in features]
        self.keys, self.dim, self.values = keys, dim, values

    def embedding_bag_configs(self):
        return self.configs

    def forward(self, features):
        return KeyedTensor(self.keys, [self.dim] * len(self.keys), self.values)


@pytest.mark.parametrize("keys", [["a", "b", "c"], ["c", "a", "b"]])  # in the arch's order (a view), or not
def test_view_sparse_arch_equals_torchrec(keys):
    gen = torch.Generator().manual_seed(len(keys))
    values = torch.randn(5, 3 * 4, generator=gen, dtype=torch.float64)
    grad_out = torch.randn(5, 3, 4, generator=gen, dtype=torch.float64)
    results = []
    for arch in (SparseArch, ViewSparseArch):
        v = values.clone().requires_grad_()
        out = arch(_Pooled(["a", "b", "c"], keys, 4, v))(None)
        out.backward(grad_out)
        results.append((out.detach(), v.grad))
    # the arch of the last iteration (ViewSparseArch) views its input exactly when the keys are in order
    assert (out.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()) == (keys == ["a", "b", "c"])
    for want, got in zip(*results):
        assert torch.equal(got, want)


def _torchrec_dlrm(kind: str, dim: int):
    """A torchrec DLRM of `kind` over 3 small tables; its inputs."""
    tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=dim, num_embeddings=10, feature_names=[f"f{i}"])
              for i in range(3)]
    extra = {"DLRM": {}, "DLRM_DCN": {"dcn_num_layers": 2, "dcn_low_rank_dim": 4},
             "DLRM_Projection": {"interaction_branch1_layer_sizes": [16, 2 * dim],
                                 "interaction_branch2_layer_sizes": [16, 2 * dim]}}[kind]
    torch.manual_seed(0)
    model = getattr(torchrec_dlrm, kind)(embedding_bag_collection=EmbeddingBagCollection(tables), dense_in_features=4,
                                         dense_arch_layer_sizes=[8, dim], over_arch_layer_sizes=[8, 1], **extra)
    features = KeyedJaggedTensor.from_lengths_sync(keys=["f0", "f1", "f2"], values=torch.tensor([1, 2, 3, 4, 5, 6, 7]),
                                                   lengths=torch.tensor([1, 2, 0, 1, 1, 2]))
    return model, torch.randn(2, 4), features


# dim 2 with 3 features: DCN's interaction output (F + 1) * D is as wide as the pairwise one, D + F + F(F - 1) / 2,
# so a swapped interaction would run, silently another model
@pytest.mark.parametrize("kind", ["DLRM", "DLRM_DCN", "DLRM_Projection"])
@pytest.mark.parametrize("dim", [2, 8])
def test_lean_arches_keep_torchrecs_dlrm_outputs_and_gradients(kind, dim):
    model, dense, features = _torchrec_dlrm(kind, dim)
    params = dict(model.named_parameters())
    want = model(dense, features)
    want.sum().backward()
    want_grads = {name: p.grad.clone() for name, p in params.items()}
    model.zero_grad()
    lean = with_lean_arches(model)
    got = lean(dense, features)
    got.sum().backward()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    # no parameter dropped (DCN's crossnet, the projections' branches)
    assert {n: id(p) for n, p in lean.named_parameters()} == {n: id(p) for n, p in params.items()}
    for name, p in params.items():
        torch.testing.assert_close(p.grad, want_grads[name], rtol=1e-6, atol=1e-6, msg=name)
