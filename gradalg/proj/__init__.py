"""Projectors: ``ga.proj.gaussian``, ``ga.proj.rademacher``, ``ga.proj.kron``.

>>> P = ga.proj.kron(k=64, seed=0)
>>> S = P(Q) @ P(G).T     # LoGra-style projected Grad-Dot
"""
from ..expr.projection import Projector, gaussian, kron, rademacher
from .matrices import dense_matrix, kron_matrices

__all__ = ["Projector", "gaussian", "rademacher", "kron", "dense_matrix", "kron_matrices"]
