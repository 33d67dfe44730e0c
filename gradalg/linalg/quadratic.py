"""Per-row quadratic forms of a resolved operator H, a block at a time where H acts per block:

    q_i = ⟨L_i, H R_i⟩ = Σ_b ⟨L_i,b, (H R_i)_b⟩          q: (n,)

(R = L: the squared H-norm ‖L_i‖²_H of RelatIF's normalization and of a self-influence
S_zz = ⟨g_z, H⁻¹ g_z⟩.)

An operator that applies per block (:meth:`~gradalg.linalg.KronOp.apply_block`: K-FAC,
EK-FAC; block-diagonal across the space's blocks) is applied to one block's rows at a time:
the block's rows made flat, (n, d_b) (from their factors where they are factored), H_b
applied, the products summed, and all of it dropped before the next block; a block is
taken ⌊d_max / d_b⌋ rows at a time (d_max: the widest block's), so the working set is that
of one row of the widest block whatever the chunk's rows, 5·d_max numbers
(:func:`~gradalg.plan.memory.quadratic_form_bytes`, which the plan counts per example). Any other operator is applied
to the concatenated rows, (n, d): the rows, their image and the product, 3·n·d numbers.
On GPT-2 small's 85 M block coordinates with 8 rows each such array is 2.7 GB in float32
(issue 28: RelatIF and EK-FAC self-influence peaked ~4.5 GB above their plans).
"""
from __future__ import annotations

import torch

from ..capture.chunks import flat_block
from ..capture.factors import Factors

__all__ = ["row_quadratic", "applies_per_block"]


def applies_per_block(op, names) -> bool:
    """Whether ``op`` applies to each of the blocks ``names`` on its own (``apply_block``)."""
    bases = getattr(op, "bases", None)
    return hasattr(op, "apply_block") and bases is not None and all(n in bases for n in names)


def row_quadratic(op, left: dict, space, right: dict | None = None) -> torch.Tensor:
    """``q_i = ⟨L_i, H R_i⟩`` of the rows ``left`` / ``right`` (``{block: Factors or (n, d_b)}``;
    ``right`` None: R = L), H = ``op``, summed over ``space``'s blocks.

    Returns (n,) in the rows' flat dtype (float32 for half-precision rows, as
    :func:`~gradalg.capture.chunks.flatten`): per block in that dtype, summed over blocks in float64."""
    names = list(space.names)
    if not applies_per_block(op, names):
        x = flatten_rows(left, space)
        y = x if right is None else flatten_rows(right, space).to(x.dtype)
        return (x * op.apply(y).to(x.dtype)).sum(1)
    widest = max(b.dim for b in space.blocks)
    total, dtype = None, None
    for b in space.blocks:
        step = max(1, widest // max(b.dim, 1))   # rows at a time: at most one row of the widest block
        n = left[b.name].shape[0] if not isinstance(left[b.name], Factors) else left[b.name].n
        parts = []
        for start in range(0, n, step):
            rows = slice(start, min(n, start + step))
            L = flat_block(left[b.name][rows])   # factored rows: both A and D sliced (Factors[rows])
            R = (left if right is None else right)[b.name][rows]
            if not (isinstance(R, Factors) and R.D.dtype == L.dtype):
                # flat rows in L's precision (half-precision rows in float32, as the flat path)
                R = L if right is None else flat_block(R).to(L.dtype)
            if isinstance(R, torch.Tensor) and all(q is None for q in op.bases[b.name]):
                R = R.clone()   # no basis on either side: apply_block would scale the caller's rows in place
            image = op.apply_block(b.name, R)
            parts.append((L * image.to(L.dtype)).sum(1).double())
            dtype = L.dtype if dtype is None else torch.promote_types(dtype, L.dtype)
            del L, R, image
        part = torch.cat(parts)
        total = part if total is None else total + part
    return total.to(dtype)


def flatten_rows(blocks: dict, space) -> torch.Tensor:
    """The blocks concatenated in ``space``'s order, (n, d) (:func:`~gradalg.capture.chunks.flatten` of a dict)."""
    return torch.cat([flat_block(blocks[name]) for name in space.names], dim=1)
