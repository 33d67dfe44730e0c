"""Rank-r rows (:class:`~gradalg.expr.lowrank.LowRank`): the truncated SVD of each row's
(out, in) blocks, kept as factors, and the check that scores them.

A chunk of n rows of one block (factors A (n, T, in), D (n, T, out), or flat (n, out·in))
becomes, per row i, with M_i = U Σ Vᵀ its SVD (float32 for half precision, else the
rows' dtype) and k = min(r, out, in):

    L_i = U[:, :k] Σ[:k]   (out, k)        R_i = V[:, :k]   (in, k)
    Factors(A = R_iᵀ (n, k, in), D = L_iᵀ (n, k, out))       Dᵀ A = L_i R_iᵀ

Factored rows with T ≤ r positions are returned as they are (their rank is at most T:
the approximation is exact). Token masks and padding are in the factors (a padded
position has d_t = 0 or a masked one-hot a_t) and so in M_i; rows split per token
(``G.per_token()``) are rank one and kept.

Scoring needs no new kernel: held rank-r factors against factored training rows are
the ghost identity with r held positions, Σ_t Σ_k (d_t·l_k)(a_t·r_k)
(:func:`gradalg.capture.factors.ghost_inner`, T·r·(out + in) multiply-adds per pair);
the planner prices it against materializing the held rows once (the dense kernel)
and shows both (``explain()``).
"""
from __future__ import annotations

import torch

from ..capture.chunks import Chunk
from ..capture.factors import Factors, compute_dtype, materialize
from ..expr.lowrank import LowRank

__all__ = ["truncate_block", "truncate_chunk"]


def truncate_block(value, shape: tuple, rank: int, token_block: int | None = None):
    """One block of n rows as rank-``rank`` factors (module docs).   Factors (n, k, ·)"""
    out_f, in_f = shape
    if isinstance(value, Factors):
        if value.T <= rank:
            return value                       # rank ≤ T ≤ r: exact as it is
        M = materialize(value, token_block)    # (n, out, in) in the compute dtype, masks applied
    else:
        M = value.reshape(value.shape[0], out_f, in_f)
        M = M.to(compute_dtype(M.dtype))
    k = min(rank, out_f, in_f)
    U, S, Vh = torch.linalg.svd(M, full_matrices=False)           # (n, out, m), (n, m), (n, m, in)
    D = (U[:, :, :k] * S[:, None, :k]).transpose(1, 2).contiguous()  # L_iᵀ (n, k, out)
    A = Vh[:, :k, :].contiguous()                                   # R_iᵀ (n, k, in)
    return Factors(A, D)


def truncate_chunk(node: LowRank, chunk: Chunk, token_block: int | None = None) -> Chunk:
    """The chunk of ``node`` from the chunk of ``node.grads``: truncated blocks as rank-r
    factors, the others as they are."""
    shapes = {b.name: b.shape for b in node.space.blocks}
    truncated = set(node.truncated)
    return chunk.replace({name: truncate_block(v, shapes[name], node.rank, token_block) if name in truncated else v
                          for name, v in chunk.blocks.items()})
