"""Mixture-of-Experts: top-k routing, token permutation, SwiGLU experts, the expert-parallel layer."""

from moe.experts import SwiGLUExperts
from moe.layer import MoELayer
from moe.permute import Permutation, permute, unpermute
from moe.routing import Routing, TopKRouter, expert_capacity, route

__all__ = ["MoELayer", "Permutation", "Routing", "SwiGLUExperts", "TopKRouter", "expert_capacity", "permute",
           "route", "unpermute"]
