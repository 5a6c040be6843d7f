"""Routed experts: the backends that compute them and, later, the tiers that hold them."""

from moetier.experts.backends import BACKENDS, ExpertBackend, ExpertWeights, ResidentExperts, make_backend

__all__ = ["BACKENDS", "ExpertBackend", "ExpertWeights", "ResidentExperts", "make_backend"]
