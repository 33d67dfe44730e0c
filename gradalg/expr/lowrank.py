"""Low-rank rows: each row's (out, in) layer blocks replaced by their best rank-r approximation.

``LowRank(G, r)`` maps row i's block G_i (out × in) to its truncated SVD

    G_i ≈ U_r Σ_r V_rᵀ = L_i R_iᵀ,   L_i = U_r Σ_r (out × r),   R_i = V_r (in × r)

(Eckart–Young: the closest rank-r matrix in Frobenius norm), kept as the factors
(L_i, R_i): r·(out + in) numbers per row and block instead of out·in. In the executor
the factors are a :class:`~gradalg.capture.factors.Factors` with r positions
(D = L_iᵀ, A = R_iᵀ, so Dᵀ A = L_i R_iᵀ), and a score against a factored training row
G_j = Σ_t d_t a_tᵀ is the ghost identity

    ⟨L_i R_iᵀ, G_j⟩ = Σ_t Σ_k (d_t · l_k)(a_t · r_k)          (T·r·(out + in) multiply-adds)

This is Kronfluence's ``query_gradient_low_rank`` (Grosse et al. 2023, §3.2: query
batching): the held (preconditioned) query side shrinks, so more queries fit at once.

Exact where it cannot truncate: a block with min(out, in) ≤ r, a block that is not a
matrix (a flat projection, a ``backend="func"`` parameter block), and factored rows
with at most r positions (their rank is at most r already) are left as they are. Token
masks and padding are in the factors (a padded position has d_t = 0 or a masked one-hot
a_t) and so in the truncated matrix; rows split per token (``G.per_token()``) are rank
one and kept.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from ..capture.factors import Factors, compute_dtype, materialize
from ..errors import OptionError
from ..options import plain
from .grads import GradNode, Normalize, Project, ScaleRows, Select, _RowMap

__all__ = ["LowRank", "check_rank", "truncated_blocks", "lowrank_below", "truncate_block"]


def check_rank(rank) -> int:
    """``rank`` as a positive int (a numpy integer accepted), or OptionError naming the fix."""
    rank = plain(rank)
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise OptionError(f"the rank of a low-rank approximation must be a positive int (e.g. 32), got {rank!r}; "
                         "use None (the default of query_gradient_rank) for exact rows")
    return rank


def truncated_blocks(space, rank: int) -> tuple[str, ...]:
    """Names of the blocks of ``space`` that rank ``rank`` truncates: (out, in) matrices with
    min(out, in) > rank. The others are kept exactly."""
    return tuple(b.name for b in space.blocks if len(b.shape) == 2 and min(b.shape) > rank)


@dataclass(frozen=True, eq=False)
class LowRank(_RowMap):
    """Each row's (out, in) blocks replaced by their best rank-``rank`` approximation
    (truncated SVD), kept as rank-``rank`` factors; exact for blocks with
    min(out, in) ≤ rank (module docs)."""

    grads: GradNode
    rank: int

    def __post_init__(self):
        object.__setattr__(self, "rank", check_rank(self.rank))
        if not any(len(b.shape) == 2 for b in self.grads.space.blocks):
            raise OptionError(
                "a low-rank approximation replaces each (out, in) layer block by a rank-r matrix, but no block "
                f"of this space is a matrix ({[b.shape for b in self.grads.space.blocks]}: a flat projection "
                "or backend='func'): drop the rank (query_gradient_rank=None), or use gradients from "
                "ga.grads (hooks backend), optionally projected with ga.proj.kron")

    @cached_property
    def truncated(self) -> tuple[str, ...]:
        """The blocks this node truncates (min(out, in) > rank)."""
        return truncated_blocks(self.grads.space, self.rank)

    @property
    def representation(self):
        rep = dict(self.grads.representation)
        for name in self.truncated:
            rep[name] = "factored"      # rank-r factors L_i, R_i
        return rep

    def positions(self, below: dict) -> dict:
        """``{block: T}`` of the rows given the input's ``below``: a truncated block has r
        factor positions, fewer when its factored input had fewer (kept as they are)."""
        rep = self.grads.representation
        return {name: (min(T, self.rank) if rep.get(name) == "factored" else self.rank)
                if name in self.truncated else T for name, T in below.items()}

    def apply(self, chunk, ctx):
        """Truncated blocks as rank-r factors (:func:`truncate_block`), the others as they are."""
        shapes = {b.name: b.shape for b in self.space.blocks}
        token_block = ctx.options.token_block
        return chunk.replace({name: truncate_block(v, shapes[name], self.rank, token_block)
                              if name in self.truncated else v for name, v in chunk.blocks.items()})

    def row_cost(self, n, chunk, prices):
        """Per truncated block: materialized (from factors; a factored block with at most
        ``rank`` positions is kept as it is) and one thin SVD per row."""
        src = self.grads

        def per(c):
            cost, T = prices.free(), prices.positions(src)
            for b in src.space.blocks:
                factors = prices.layout.get(b.name) == "factors"
                if b.name not in self.truncated or (factors and T[b.name] <= self.rank):
                    continue
                if factors:
                    cost = cost + prices.materialize_block(c, T[b.name], b.shape[1], b.shape[0])
                cost = cost + prices.svd(c, b.shape[0], b.shape[1])
            return cost
        return prices.per_chunk(src, n, chunk, per)

    @property
    def label(self):
        return f"rank-{self.rank} approximation (truncated SVD per block)"


def lowrank_below(node: GradNode) -> "LowRank | None":
    """The :class:`LowRank` below ``node`` through nodes that keep each block's factor
    positions (selection, scaling, a projection, normalization without a metric), if any."""
    x = node
    while isinstance(x, (Select, ScaleRows, Project)) or (isinstance(x, Normalize) and x.op is None):
        x = x.grads
    return x if isinstance(x, LowRank) else None


def truncate_block(value, shape: tuple, rank: int, token_block: int | None = None):
    """One block of n rows as rank-``rank`` factors. With M_i = U Σ Vᵀ row i's (out, in)
    matrix (float32 for half precision, else the rows' dtype) and k = min(r, out, in):
    L_i = U[:, :k] Σ[:k] (out, k), R_i = V[:, :k] (in, k), returned as
    ``Factors(A = R_iᵀ (n, k, in), D = L_iᵀ (n, k, out))`` (Dᵀ A = L_i R_iᵀ). Factored rows
    with T ≤ r positions are returned as they are (their rank is at most T: exact).
    value : Factors (n, T, ·) or flat (n, out·in)   returns Factors (n, k, ·)"""
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
