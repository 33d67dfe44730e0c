"""Projectors: ``ga.proj.gaussian``, ``rademacher``, ``kron`` (LoGra), ``sparse`` (SJLT),
``mask``, ``grass`` and ``factgrass`` (GraSS / FactGraSS), ``tensorsketch``; one class per
kind in :mod:`gradalg.proj.kinds`. See docs/projections.md.

>>> P = ga.proj.kron(k=64, seed=0)
>>> S = P(Q) @ P(G).T     # LoGra-style projected Grad-Dot
>>> P = ga.proj.factgrass(k=4096)   # FactGraSS: mask the factors, then a sparse JL transform
"""
from .projector import Projector, factgrass, gaussian, grass, kron, mask, rademacher, sparse, tensorsketch
from .matrices import dense_matrix, kron_matrices
from .matrices import clear_caches as _clear_matrices
from .sparse_tables import (SJLT, clear_tables, factgrass_tables, global_mask, grass_tables, mask_indices, sjlt,
                            tensorsketch_tables)


def clear_caches() -> None:
    """Forget every projection matrix and index table this process keeps (the next use
    draws them again, with the same numbers). The executors call it when a plan's run
    ends, and a Dask worker after each shard: the plan counts them as held while it runs."""
    _clear_matrices()
    clear_tables()


__all__ = ["Projector", "gaussian", "rademacher", "kron", "sparse", "mask", "grass", "factgrass",
           "tensorsketch", "tensorsketch_tables",
           "dense_matrix", "kron_matrices", "SJLT", "sjlt", "mask_indices", "grass_tables",
           "factgrass_tables", "global_mask", "clear_caches"]
