"""The operator protocol: every resolved operator is a :class:`LinearOp`.

A LinearOp is a symmetric linear map H on a parameter space of ``dim`` coordinates
(``space`` has ``dim``, ``names`` and ``offsets()``). It acts on rows, one example per row:

    apply(X)    X (n, dim) ↦ (H x_i)_i          (n, dim)
    solve(X)    X (n, dim) ↦ (H⁻¹ x_i)_i        (n, dim)

and its algebra returns new operators, each by a named rule (:mod:`gradalg.linalg.rules`)
chosen from the operand's ``structure`` labels, never by trying types in turn:

    inverse()  power(p)  damp(λ, relative=)  scale(c)  add(other)

``rules`` is the tuple of rule names that made the operator (what ``explain`` shows),
``nbytes()`` the memory its numbers take, ``trace()`` tr(H), ``dense()`` the full
(dim, dim) matrix (tests and small spaces only).

A subclass is a dataclass with fields ``tags`` (labels beyond its form, e.g. ``psd``)
and ``rules``, and implements ``apply`` plus the primitives ``_damp``, ``_inverse``,
``_power`` and ``_scale`` for the rules of its form.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import replace

import torch

from ..errors import OptionError
from . import rules as _rules

__all__ = ["LinearOp", "SINGULAR_RTOL", "PSD_RTOL", "sym_eig_map", "reciprocal", "power_values", "singular"]

#: an eigenvalue at or below this fraction of the largest one makes an operator singular
SINGULAR_RTOL = 1e-15
#: a fractional power refuses an eigenvalue below −PSD_RTOL × the largest one (indefinite);
#: smaller negative ones are round-off of a positive semi-definite matrix and count as 0
PSD_RTOL = 1e-6

class LinearOp(ABC):
    """A resolved symmetric operator (see the module docstring)."""

    space: object
    tags: frozenset
    rules: tuple

    # ---- structure ------------------------------------------------------------------
    @property
    @abstractmethod
    def form(self) -> str:
        """How the numbers are kept: one of :data:`gradalg.linalg.labels.FORMS`."""

    @property
    def structure(self) -> frozenset:
        """The labels rules dispatch on: the form, ``tags`` and what the numbers show
        (``psd`` for non-negative eigenvalues of a diagonal, Kronecker or low-rank operator)."""
        return frozenset({self.form}) | frozenset(self.tags) | self._intrinsic_tags()

    def _intrinsic_tags(self) -> frozenset:
        return frozenset()

    #: the form in one word, :data:`gradalg.linalg.labels.SHORT` ("diag", "block", "dense",
    #: "kron", "lowrank", "implicit"); a class attribute of each operator (a field of ResolvedOp)
    kind: str

    def _recorded(self, rules: tuple, tags=None) -> "LinearOp":
        return replace(self, rules=tuple(rules), tags=frozenset(self.tags if tags is None else tags))

    # ---- application ----------------------------------------------------------------
    @abstractmethod
    def apply(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows (n, dim) ↦ (H x_i)_i.   Returns (n, dim)."""

    def solve(self, rows: torch.Tensor, **settings) -> torch.Tensor:
        """Rows (n, dim) ↦ (H⁻¹ x_i)_i by the inverse rule of this structure.   Returns (n, dim)."""
        return self.inverse(**settings).apply(rows)

    def dense(self) -> torch.Tensor:
        """The (dim, dim) matrix, by dim products (tests and small spaces only)."""
        eye = torch.eye(self.space.dim, dtype=torch.float64)
        return self.apply(eye).T

    def nbytes(self) -> int:
        """Bytes of the numbers this operator keeps (0 for operators known by products)."""
        return 0

    def trace(self) -> float:
        """tr(H)."""
        _rules.refuse("take the trace of", self.structure, "pass an absolute damping")

    # ---- algebra, by named rules -----------------------------------------------------
    def damp(self, damping: float, *, relative: bool = False, what: str = "the operator",
             rule=None) -> "LinearOp":
        """H + λI; ``relative``: λ = damping · tr(H)/dim (a multiple of the mean eigenvalue);
        ``rule`` (a :class:`~gradalg.linalg.autodamp.DampingRule`): H + ⊕_b λ_b I_b, λ_b from
        block b's spectrum (``damping`` is then ignored; rule ``damp.per_block_spectrum``)."""
        if rule is not None:
            from .autodamp import block_lambdas
            step = _rules.choose("damp_auto", self.structure, what=what).name
            shift = _rules.choose("damp", self.structure, variant="exact", what=what).name
            return self._damp_blocks(block_lambdas(self, rule))._recorded(self.rules + (step, shift), self.tags)
        if not damping >= 0:
            raise OptionError(f"damping must be non-negative, got {damping}: pass λ ≥ 0")
        steps = []
        if relative:
            steps.append(_rules.choose("damp_relative", self.structure, what=what).name)
            damping = damping * max(self.trace(), 0.0) / max(self.space.dim, 1)
        rule = _rules.choose("damp", self.structure, variant="exact", what=what)
        return self._damp(float(damping))._recorded(self.rules + tuple(steps) + (rule.name,), self.tags)

    def inverse(self, what: str = "the operator", method: str | None = None, **settings) -> "LinearOp":
        """H⁻¹ by structure; ``method`` ("cg", "lissa") and ``settings`` pick and tune the
        solver of an operator known only through products."""
        rule = _rules.choose("inverse", self.structure, variant=method, what=what)
        tags = set(self.tags)
        if rule.name.startswith("implicit.solve"):
            tags.add("inverse")        # (c·H + λI)⁻¹, applied by a solver
        elif rule.name == "implicit.inverse_of_solve":
            tags.discard("inverse")    # back to the products
        return self._inverse(what, rule, settings)._recorded(self.rules + (rule.name,), tags)

    def power(self, p: float, what: str = "the operator", *, rtol: float = PSD_RTOL) -> "LinearOp":
        """H^p: p = -1 is :meth:`inverse`, p = 1 the operator itself; other p by the eigenvalues
        (a fractional p needs H positive semi-definite up to ``rtol``; a negative p, H
        positive definite)."""
        if p == 1:
            return self
        if p == -1:
            return self.inverse(what)
        rule = _rules.choose("power", self.structure, what=what)
        return self._power(float(p), what, rtol)._recorded(self.rules + (rule.name,), self.tags)

    def spectral(self, fn, what: str = "the operator") -> "LinearOp":
        """f(H) = U diag(f(μ)) Uᵀ for a scalar function ``fn`` of the eigenvalues μ (float64
        tensor in, tensor out), on H's own eigenstructure (a Kronecker eigenbasis stays one)."""
        rule = _rules.choose("spectral", self.structure, what=what)
        return self._spectral(fn, what)._recorded(self.rules + (rule.name,), self.tags - {"psd"})

    def scale(self, c: float) -> "LinearOp":
        """c · H."""
        rule = _rules.choose("scale", self.structure)
        tags = set(self.tags) if c >= 0 else set(self.tags) - {"psd"}
        return self._scale(float(c))._recorded(self.rules + (rule.name,), tags)

    def add(self, other: "LinearOp") -> "LinearOp":
        """H + other, by the sum rule of the two structures (:func:`~gradalg.linalg.rules.choose_sum`)."""
        from .sums import add
        return add(self, other)

    # ---- primitives each form implements for its rules -------------------------------
    def _damp(self, damping: float) -> "LinearOp":
        raise NotImplementedError(f"{type(self).__name__} has no damping primitive (LinearOp._damp)")

    def _damp_blocks(self, lambdas: dict) -> "LinearOp":
        """H + ⊕_b λ_b I_b for ``lambdas`` {block name: λ_b} (automatic damping)."""
        raise NotImplementedError(f"{type(self).__name__} has no per-block damping primitive (LinearOp._damp_blocks)")

    def _inverse(self, what: str, rule, settings: dict) -> "LinearOp":
        raise NotImplementedError(f"{type(self).__name__} has no inverse primitive (LinearOp._inverse)")

    def _power(self, p: float, what: str, rtol: float) -> "LinearOp":
        raise NotImplementedError(f"{type(self).__name__} has no power primitive (LinearOp._power)")

    def _scale(self, c: float) -> "LinearOp":
        raise NotImplementedError(f"{type(self).__name__} has no scaling primitive (LinearOp._scale)")

    def _spectral(self, fn, what: str) -> "LinearOp":
        raise NotImplementedError(f"{type(self).__name__} has no eigenvalue-function primitive (LinearOp._spectral)")


# ---------------------------------------------------------------------- eigenvalue maps
def sym_eig_map(matrix: torch.Tensor, fn, what: str) -> torch.Tensor:
    """U fn(μ) Uᵀ for the symmetric part of ``matrix`` (eigh in float64).   (d, d) float64"""
    m = matrix.to(torch.float64)
    m = (m + m.T) / 2
    evals, evecs = torch.linalg.eigh(m)
    return (evecs * fn(evals, what).unsqueeze(0)) @ evecs.T


def singular(values: torch.Tensor) -> bool:
    """Whether eigenvalues μ make an operator singular or not positive definite for
    :func:`reciprocal`: some μ ≤ :data:`SINGULAR_RTOL` × max |μ| (the one test every inverse uses)."""
    scale = values.abs().max().clamp_min(1e-300)
    return bool((values <= scale * SINGULAR_RTOL).any())


def reciprocal(values: torch.Tensor, what: str) -> torch.Tensor:
    """1/μ for eigenvalues μ, refusing a singular or indefinite operator with the fix."""
    if singular(values):
        from ..errors import OperatorError
        raise OperatorError(
            f"cannot invert {what}: it is singular or not positive definite (smallest "
            f"eigenvalue {float(values.min()):.3g}). Add damping first: op.damp(λ) with λ around "
            "1e-3 × the mean eigenvalue, or project to fewer dimensions than examples."
        )
    return 1.0 / values


def power_values(values: torch.Tensor, p: float, what: str, rtol: float = PSD_RTOL) -> torch.Tensor:
    """μ^p for eigenvalues μ: an integer p as it is (a negative one needs μ ≠ 0), a fractional
    p on μ ≥ 0 (eigenvalues above −rtol·max(|μ|) count as 0; below, the operator is refused
    as indefinite)."""
    if p < 0:
        return reciprocal(values, what) ** (-p)
    if float(p).is_integer():
        return values ** p
    scale = values.abs().max().clamp_min(1e-300)
    if (values < -rtol * scale).any():
        from ..errors import OperatorError
        raise OperatorError(
            f"cannot take the power {p:g} of {what}: it is indefinite (eigenvalue {float(values.min()):.3g}), "
            "so a fractional power is not real. Use a positive semi-definite curvature (ga.fisher, "
            "ga.gauss_newton, ga.kfac) or damp it above its most negative eigenvalue.")
    return values.clamp_min(0) ** p
