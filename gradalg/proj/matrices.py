"""The random matrices behind a :class:`~gradalg.expr.projection.Projector`.

Drawn on the CPU from a generator seeded per block (and per part for Kronecker
factors), then moved, so results do not depend on the device or the process.
"""
from __future__ import annotations

import math
from functools import lru_cache

import torch

from ..expr.projection import Projector

__all__ = ["dense_matrix", "kron_matrices"]


def _draw(kind: str, rows: int, cols: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if kind == "rademacher":
        signs = torch.randint(0, 2, (rows, cols), generator=gen, dtype=torch.int8)
        return (signs.to(torch.float64) * 2 - 1) / math.sqrt(rows)
    return torch.randn(rows, cols, generator=gen, dtype=torch.float64) / math.sqrt(rows)


@lru_cache(maxsize=64)
def _dense_cpu(projector: Projector, block_name: str, dim: int) -> torch.Tensor:
    kind = "gaussian" if projector.kind == "kron" else projector.kind
    return _draw(kind, projector.k, dim, projector.block_seed(block_name))


def dense_matrix(projector: Projector, block_name: str, dim: int, *, dtype=torch.float32,
                 device="cpu") -> torch.Tensor:
    """The (k, dim) matrix projecting block ``block_name``.

    With ``per_block=False`` the whole space is projected by one (k, Σ dim) matrix;
    its column slice for one block is drawn with that block's own seed, which is the
    same thing as a single matrix and lets each block be projected on its own.
    """
    if projector.kind not in ("gaussian", "rademacher", "kron"):
        raise ValueError(f"a {projector.kind} projector has no dense matrix; its index tables are "
                         "in gradalg.proj.sparse_tables (SJLT.dense() builds one for tests)")
    return _dense_cpu(projector, block_name, dim).to(device=device, dtype=dtype)


@lru_cache(maxsize=64)
def _kron_cpu(projector: Projector, block_name: str, out: int, n_in: int):
    k_out, k_in = projector.kron_shape(out, n_in)
    P_out = _draw("gaussian", k_out, out, projector.block_seed(block_name, "out"))
    P_in = _draw("gaussian", k_in, n_in, projector.block_seed(block_name, "in"))
    return P_out, P_in


def kron_matrices(projector: Projector, block_name: str, out: int, n_in: int, *,
                  dtype=torch.float32, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """``(P_out (k_out, out), P_in (k_in, in))`` with N(0, 1/k_·) entries."""
    P_out, P_in = _kron_cpu(projector, block_name, out, n_in)
    return P_out.to(device=device, dtype=dtype), P_in.to(device=device, dtype=dtype)
