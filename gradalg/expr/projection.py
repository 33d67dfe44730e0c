"""Projector specifications, as the expression floor names them: re-exported from
:mod:`gradalg.proj.projector`, where :class:`Projector` and its kinds live (the floor
below this one)."""
from ..proj.projector import (GRASS_BLOWUP, KINDS, Projector, _even_kron_split, check_projector,  # noqa: F401
                              dense_or_sparse, factgrass, gaussian, grass, kron, mask, rademacher, sparse,
                              tensorsketch)

__all__ = ["Projector", "gaussian", "rademacher", "kron", "sparse", "mask", "grass", "factgrass",
           "tensorsketch", "dense_or_sparse", "check_projector", "KINDS", "GRASS_BLOWUP"]
