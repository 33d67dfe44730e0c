"""Explicit operators: a diagonal, one matrix per block, or one dense matrix.

``ResolvedOp`` holds ``diag`` (a (dim,) vector), ``block`` (one (d_b, d_b) matrix per
block, block-diagonal across the space's blocks) or ``dense`` (one (dim, dim) matrix).
Inverses and powers go through a symmetric eigendecomposition in float64
(:func:`~gradalg.linalg.base.sym_eig_map`), so a singular matrix is refused with the
fix (damp it) instead of silently amplified.

A dense ResolvedOp keeps its eigendecomposition once asked for it (:meth:`ResolvedOp.eigenpairs`:
H = U diag(μ) Uᵀ, float64), and what follows shares it: H + λI (one λ for every coordinate)
keeps U with μ + λ, and its inverse (or power) is U diag(f(μ + λ)) Uᵀ with no second
decomposition. The formed Hessian (:class:`~gradalg.expr.Formed`) is thus decomposed once for
the near-minimum rule's μ_min, its PSD shift and its inverse (issue 31). The pairs live on the
resolved object (memoized by the executor for one run), never on an expression node.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..errors import OperatorError
from .base import LinearOp, power_values, reciprocal, sym_eig_map
from .labels import SHORT

__all__ = ["ResolvedOp", "explicit"]

#: ``kind`` (the form's one-word name, :data:`~gradalg.linalg.labels.SHORT`) ↦ the form
_FORM = {SHORT[form]: form for form in ("diagonal", "block", "dense")}


def _shifted(matrix: torch.Tensor, shift) -> torch.Tensor:
    """M + diag(shift) as one new (d, d) matrix (``shift``: a number or (d,)): a copy with its
    diagonal shifted in place, not M + shift·I, which also makes the d × d identity."""
    out = matrix.clone()
    out.diagonal().add_(shift)
    return out


@dataclass
class ResolvedOp(LinearOp):
    """An explicit operator's numbers. ``kind`` is "diag", "block" or "dense"."""

    space: object
    kind: str
    data: object  # (dim,) tensor | dict[name, (d_b, d_b)] | (dim, dim) tensor
    tags: frozenset = frozenset()
    rules: tuple = ()
    #: (μ (dim,), U (dim, dim)), float64, of a dense ``data`` once :meth:`eigenpairs` computed them
    #: (or inherited from the operator this one is a uniform shift of); None until then
    eig: tuple | None = field(default=None, compare=False, repr=False)

    @property
    def form(self) -> str:
        """``diagonal``, ``block`` or ``dense``: how the numbers are kept."""
        return _FORM[self.kind]

    # ---- constructors -------------------------------------------------------------
    @classmethod
    def identity(cls, space, dtype=torch.float32, device="cpu") -> "ResolvedOp":
        """I on ``space`` (labels ``identity``, ``psd``)."""
        return cls(space, "diag", torch.ones(space.dim, dtype=dtype, device=device),
                   frozenset({"identity", "psd"}))

    def _new(self, kind, data, eig=None) -> "ResolvedOp":
        return ResolvedOp(self.space, kind, data, self.tags, self.rules, eig)

    def eigenpairs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(μ, U)`` of a dense operator, H = U diag(μ) Uᵀ: μ (dim,) ascending, U (dim, dim), float64
        (``eigh`` of the symmetric part), computed on the first call and kept on this object."""
        if self.kind != "dense":
            raise OperatorError(f"eigenpairs() is kept for a dense operator; this one is {self.kind!r}: "
                                "use as_kind('dense') first")
        if self.eig is None:
            m = self.data.to(torch.float64)
            self.eig = torch.linalg.eigh((m + m.T) / 2)
        return self.eig

    def _shifted_eig(self, shift: float):
        """The kept eigenpairs of H + shift·I (None when none are kept)."""
        return None if self.eig is None else (self.eig[0] + shift, self.eig[1])

    # ---- conversions --------------------------------------------------------------
    def as_kind(self, kind: str) -> "ResolvedOp":
        """The same operator kept with a coarser structure ("block" or "dense")."""
        if kind == self.kind:
            return self
        if self.kind == "diag" and kind == "block":
            return self._new("block", {n: torch.diag(self.data[s]) for n, s in self.space.offsets().items()})
        if kind == "dense":
            return self._new("dense", self.dense())
        raise OperatorError(f"cannot keep a {self.kind} operator as {kind}: only as 'block' (a diagonal) "
                            "or 'dense' (any)")

    def dense(self) -> torch.Tensor:
        """The full (dim, dim) matrix."""
        if self.kind == "dense":
            return self.data
        if self.kind == "diag":
            return torch.diag(self.data)
        return torch.block_diag(*(self.data[n] for n in self.space.names))

    # ---- application --------------------------------------------------------------
    def _intrinsic_tags(self) -> frozenset:
        return frozenset({"psd"}) if self.kind == "diag" and bool((self.data >= 0).all()) else frozenset()

    def apply(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows (n, dim) ↦ rows Hᵀ = (H x_i)_i for symmetric H.   Returns (n, dim)."""
        # the numbers may live elsewhere than the rows (an identity or a given diagonal is
        # made on the CPU; rows come from the model's device): they follow the rows
        like = dict(device=rows.device, dtype=rows.dtype)
        if self.kind == "diag":
            return rows * self.data.to(**like)
        if self.kind == "dense":
            return rows @ self.data.to(**like)
        out = torch.empty_like(rows)
        for name, s in self.space.offsets().items():
            out[:, s] = rows[:, s] @ self.data[name].to(**like)
        return out

    def nbytes(self) -> int:
        """Its numbers' bytes, kept eigenpairs included (a shifted operator shares U with the
        one it came from: each counts it)."""
        if self.kind == "block":
            return sum(m.numel() * m.element_size() for m in self.data.values())
        kept = 0 if self.eig is None else sum(t.numel() * t.element_size() for t in self.eig)
        return self.data.numel() * self.data.element_size() + kept

    def trace(self) -> float:
        if self.kind == "diag":
            return float(self.data.sum())
        if self.kind == "dense":
            return float(self.data.diagonal().sum())
        return sum(float(m.diagonal().sum()) for m in self.data.values())

    # ---- primitives of the rules ---------------------------------------------------
    def _scale(self, c: float) -> "ResolvedOp":
        if self.kind == "block":
            return self._new("block", {n: c * m for n, m in self.data.items()})
        return self._new(self.kind, c * self.data)

    def _damp(self, damping: float) -> "ResolvedOp":
        if self.kind == "diag":
            return self._new("diag", self.data + damping)
        if self.kind == "dense":
            return self._new("dense", _shifted(self.data, damping), self._shifted_eig(damping))
        return self._new("block", {n: _shifted(m, damping) for n, m in self.data.items()})

    def _damp_blocks(self, lambdas: dict) -> "ResolvedOp":
        if self.kind == "block":
            return self._new("block", {n: _shifted(m, lambdas[n]) for n, m in self.data.items()})
        shift = torch.empty(self.space.dim, dtype=self.data.dtype, device=self.data.device)
        for n, s in self.space.offsets().items():
            shift[s] = lambdas[n]
        if self.kind == "diag":
            return self._new("diag", self.data + shift)
        one = len(set(lambdas.values())) == 1           # one λ: the eigenvectors are kept
        return self._new("dense", _shifted(self.data, shift),
                         self._shifted_eig(next(iter(lambdas.values()))) if one else None)

    def _map(self, fn, what) -> "ResolvedOp":
        if self.kind == "diag":
            return self._new("diag", fn(self.data.to(torch.float64), what).to(self.data.dtype))
        if self.kind == "block":
            return self._new("block", {n: sym_eig_map(m, fn, f"{what} (block {n!r})").to(m.dtype)
                                       for n, m in self.data.items()})
        if self.eig is not None:                         # U diag(fn(μ)) Uᵀ on the kept pairs, as sym_eig_map
            mu, U = self.eig
            return self._new("dense", ((U * fn(mu, what).unsqueeze(0)) @ U.T).to(self.data.dtype))
        return self._new("dense", sym_eig_map(self.data, fn, what).to(self.data.dtype))

    def _inverse(self, what, rule, settings) -> "ResolvedOp":
        return self._map(reciprocal, what)

    def _power(self, p, what, rtol) -> "ResolvedOp":
        return self._map(lambda values, w: power_values(values, p, w, rtol), what)

    def _spectral(self, fn, what) -> "ResolvedOp":
        return self._map(lambda values, _what: fn(values.to(torch.float64)), what)


def explicit(op: LinearOp, kind: str) -> ResolvedOp:
    """Any operator with numbers (Kronecker, low-rank, explicit) as a ``block`` or ``dense``
    :class:`ResolvedOp` of the same matrix."""
    if isinstance(op, ResolvedOp):
        return op.as_kind(kind)
    if kind == "block" and hasattr(op, "block_matrix"):
        return ResolvedOp(op.space, "block", {n: op.block_matrix(n) for n in op.space.names}, op.tags, op.rules)
    return ResolvedOp(op.space, "dense", op.dense(), op.tags, op.rules)
