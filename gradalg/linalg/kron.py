"""The Kronecker operator: K-FAC and EK-FAC once resolved (:class:`KronOp`).

Per block b of shape (out, in), with eigenbases ``Q_S`` (out, out), ``Q_A`` (in, in) and
eigenvalues Λ (out, in), the operator maps a gradient block G (out, in) to

    H G = Q_S [(Q_Sᵀ G Q_A) ∘ Λ] Q_Aᵀ

(block-diagonal across the space's blocks; form ``kronecker`` of
:mod:`gradalg.linalg.labels`). Damping, inverse, powers and functions of the eigenvalues
act on Λ, exactly, since ``Q_S ⊗ Q_A`` is orthogonal. Rows may come flat (n, out·in) or as
per-example factors (:class:`~gradalg.capture.factors.Factors`, G_i = D_iᵀ A_i), rotated
in from the factors without materializing G_i (:func:`rotate_factors`).

A basis ``None`` is the identity: the factor of that side is kept as its diagonal (a
factor wider than ``ga.options(kron_diagonal_width)``, the rule ``kronecker.diagonal_factor``;
:func:`diagonal_factor_rules`). How the factors and Λ are estimated from data is
:mod:`gradalg.curvature.kron`.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import ClassVar

import torch

from ..capture.factors import Factors, OneHot, materialize, token_slices
from ..errors import CurvatureError, OptionError
from . import rules as _rules
from .base import LinearOp, power_values, reciprocal

__all__ = ["KronOp", "BlockEigenvalues", "EigenvalueGrids", "rotate_factors", "rotate_rows", "rotate_back",
           "work_dtype", "is_diagonal_factor", "diagonal_factors", "diagonal_factor_rules"]


def is_diagonal_factor(width: int, diagonal_width: int | None) -> bool:
    """Whether a Kronecker factor of ``width`` is kept as its diagonal (wider than
    ``diagonal_width``; None: never)."""
    return diagonal_width is not None and width > diagonal_width


def diagonal_factors(space, diagonal_width: int | None) -> dict:
    """``{block: ("S" and/or "A")}``: the sides of each 2-D block of ``space`` wider than
    ``diagonal_width``, kept diagonal (blocks with none are left out)."""
    out = {}
    for b in space.blocks:
        if len(b.shape) == 2:
            sides = tuple(side for side, d in (("S", b.shape[0]), ("A", b.shape[1]))
                          if is_diagonal_factor(d, diagonal_width))
            if sides:
                out[b.name] = sides
    return out


def diagonal_factor_rules(space, diagonal_width: int | None) -> tuple:
    """``("kronecker.diagonal_factor",)`` when a block of ``space`` has a factor wider than
    ``diagonal_width`` (kept diagonal), else ``()``: the rule a K-FAC operator over
    ``space`` records when it is built (and an operator node's ``labels()`` list)."""
    if not diagonal_factors(space, diagonal_width):
        return ()
    return (_rules.choose("kron_factor", frozenset({"kronecker"}), variant="diagonal").name,)


def _rotated_acts(A, Q_A: torch.Tensor | None, dtype) -> torch.Tensor:
    """``A Q_A`` for activations (n, b, in) or one-hot ids (rows of Q_A gathered, never a
    dense one-hot); ``Q_A`` None is the identity (dense activations only).   (n, b, in)"""
    if isinstance(A, OneHot):
        return Q_A.to(dtype)[A.idx] * A.weights(dtype).unsqueeze(-1)
    A = A.to(dtype)
    return A if Q_A is None else A @ Q_A.to(dtype)


def _gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.2f}"


def work_dtype(x: torch.Tensor) -> torch.dtype:
    """The precision of per-chunk products for rows ``x``: theirs (float32 or float64),
    float32 for half-precision rows. Running sums stay in float64."""
    return x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32


def rotate_factors(F: Factors, Q_S: torch.Tensor | None, Q_A: torch.Tensor | None,
                   token_block: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """``Q_Sᵀ G_i Q_A`` for each example, from factors: ``Σ_p (D_{i,p} Q_S)ᵀ (A_{i,p} Q_A)``
    over token blocks p, in the factors' precision. A basis None is the identity (a
    diagonal factor); one-hot activations with the identity are scattered into G_i
    (:func:`~gradalg.capture.factors.materialize`), never made dense.   (n, out, in)

    ``out``: an (n, out, in) tensor of the work dtype to write the result into (a buffer
    the caller reuses across blocks and chunks: a fresh tensor of tens of MB costs about
    as much in page faults as the batched GEMM that fills it); the one-hot/identity path
    ignores it."""
    dtype = work_dtype(F.D)
    if isinstance(F.A, OneHot) and Q_A is None:
        G = materialize(F, token_block).to(dtype)
        return G if Q_S is None else Q_S.T.to(dtype) @ G
    result = None
    for tp in token_slices(F.T, token_block):
        Fp = F.tokens(tp)
        A = _rotated_acts(Fp.A, Q_A, dtype)                 # (n, b, in)
        D = Fp.D.to(dtype)                                  # (n, b, out)
        if Q_S is not None:
            D = D @ Q_S.to(dtype)
        if out is not None:                                 # (n, out, b) @ (n, b, in), into the buffer
            if result is None:
                result = torch.bmm(D.transpose(1, 2), A, out=out)
            else:
                result.baddbmm_(D.transpose(1, 2), A)
            continue
        part = torch.einsum("nto,nti->noi", D, A)
        result = part if result is None else result.add_(part)
    if result is None and out is not None:                  # no positions: G_i = 0
        result = out.zero_()
    return result


def rotate_rows(G: torch.Tensor, Q_S: torch.Tensor | None, Q_A: torch.Tensor | None) -> torch.Tensor:
    """``Q_Sᵀ G_i Q_A`` for materialized rows ``G`` (n, out, in), in their precision (a basis
    None: the identity).   (n, out, in)"""
    dtype = work_dtype(G)
    G = G.to(dtype)
    if Q_S is not None:
        G = Q_S.T.to(dtype) @ G
    return G if Q_A is None else G @ Q_A.to(dtype)


def rotate_back(rotated: torch.Tensor, Q_S: torch.Tensor | None, Q_A: torch.Tensor | None) -> torch.Tensor:
    """``Q_S R_i Q_Aᵀ`` for rotated rows R (n, out, in) (a basis None: the identity), in R's
    precision: ``· Q_Aᵀ`` as one (n·out, in, in) GEMM, then ``Q_S ·``.   (n, out, in)"""
    dtype = rotated.dtype
    n, o, i = rotated.shape
    back = rotated if Q_A is None else (rotated.reshape(n * o, i) @ Q_A.T.to(dtype)).reshape(n, o, i)
    return back if Q_S is None else torch.matmul(Q_S.to(dtype), back)


#: rows × columns of one slice of an eigenvalue grid made at once (float64: 32 MiB), so that
#: an operator's lazily made Λ (:class:`BlockEigenvalues`) never exists whole beside the rows
_SLICE_ELEMENTS = 2 ** 22


@dataclass(frozen=True)
class BlockEigenvalues:
    """One block's eigenvalues Λ (out, in), kept as what they are made from.

    ``base``: K-FAC's two per-side vectors ``(λ_S (out,), λ_A (in,))``, Λ₀ = λ_S λ_Aᵀ (an
    outer product: out + in numbers), or an (out, in) grid (EK-FAC's re-fitted Λ, a sum of
    operators); ``steps``: the elementwise maps applied since, in order —
    ``("scale", c)`` c·Λ, ``("damp", λ)`` Λ + λ, ``("inverse", None)`` 1/Λ and
    ``("power", p)`` Λ^p (these two in float64, back to Λ's dtype). A damp → inverse chain of operators thus
    shares one base (one grid for EK-FAC, two vectors for K-FAC) instead of holding a
    grid per operator; :meth:`rows` makes a slice of rows of Λ on demand, by exactly
    the operations the grid itself would have gone through (the same numbers).
    """

    base: tuple          # (λ_S, λ_A) vectors, or (grid,)
    steps: tuple = ()
    #: full-size sweeps (reads + writes) over Λ (out·in float64 numbers) of one scan for
    #: :meth:`extremes`, as the planner prices it (``gradalg.plan.estimates.resolve_cost``): cast
    #: to float64 (1 + 1), min (1), |·| (1 + 1), max (1), |·| (1 + 1), min (1)
    SCAN_SWEEPS: ClassVar[int] = 9

    @property
    def shape(self) -> tuple:
        return tuple(self.base[0].shape) if len(self.base) == 1 else (self.base[0].shape[0], self.base[1].shape[0])

    @property
    def dtype(self) -> torch.dtype:
        return self.base[0].dtype

    def then(self, *step) -> "BlockEigenvalues":
        return replace(self, steps=self.steps + (step,))

    def rows(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Rows ``start:stop`` of Λ, made from the base.   (stop − start, in)"""
        if len(self.base) == 1:
            v = self.base[0][start:stop]
        else:
            v = torch.outer(self.base[0][start:stop], self.base[1])
        for kind, arg in self.steps:
            if kind == "scale":
                v = arg * v
            elif kind == "damp":
                v = v + arg
            elif kind == "inverse":    # reciprocal without its check (done when the step was added)
                v = (1.0 / v.to(torch.float64)).to(v.dtype)
            else:                      # ("power", p): power_values without its checks
                v64 = v.to(torch.float64)
                if arg < 0:
                    v64 = (1.0 / v64) ** (-arg)
                elif float(arg).is_integer():
                    v64 = v64 ** arg
                else:
                    v64 = v64.clamp_min(0) ** arg
                v = v64.to(v.dtype)
        return v

    def value(self) -> torch.Tensor:
        """The whole (out, in) grid (a new tensor unless it is stored as one)."""
        return self.rows()

    def slices(self):
        """Row ranges of at most ``_SLICE_ELEMENTS`` numbers each."""
        o, i = self.shape
        step = max(1, _SLICE_ELEMENTS // max(i, 1))
        for start in range(0, o, step):
            yield start, min(o, start + step)

    def extremes(self) -> tuple[float, float, float]:
        """``(min Λ, max |Λ|, min |Λ|)``, a slice at a time (cached: the object is immutable)."""
        cached = self.__dict__.get("_extremes")
        if cached is None:
            lo, top, small = float("inf"), 0.0, float("inf")
            for a, b in self.slices():
                v = self.rows(a, b).to(torch.float64)
                lo, top = min(lo, float(v.min())), max(top, float(v.abs().max()))
                small = min(small, float(v.abs().min()))
            cached = (lo, top, small)
            object.__setattr__(self, "_extremes", cached)
        return cached

    def summary(self) -> torch.Tensor:
        """A two-entry float64 tensor with the same min and max |·| as Λ: what the checks of
        :func:`~gradalg.linalg.base.reciprocal` and :func:`~gradalg.linalg.base.power_values`
        read, so they raise the same errors without Λ made whole."""
        lo, top, _ = self.extremes()
        return torch.tensor([lo, top], dtype=torch.float64)

    def mul_into(self, rotated: torch.Tensor) -> torch.Tensor:
        """``rotated *= Λ`` in place for rotated rows (n, out, in), Λ made a slice of rows at a
        time in rotated's precision.   Returns rotated."""
        for a, b in self.slices():
            rotated[:, a:b] *= self.rows(a, b).to(rotated.dtype)
        return rotated

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.base)


class EigenvalueGrids(Mapping):
    """``{block: Λ (out, in)}`` of a :class:`KronOp`, each grid made when read
    (:meth:`BlockEigenvalues.value`, a new tensor for a lazy one); ``parts[block]`` is the
    lazy form (:class:`BlockEigenvalues`)."""

    def __init__(self, parts: dict):
        self.parts = dict(parts)

    def __getitem__(self, name) -> torch.Tensor:
        return self.parts[name].value()

    def __iter__(self):
        return iter(self.parts)

    def __len__(self) -> int:
        return len(self.parts)

    def __repr__(self) -> str:
        return f"EigenvalueGrids({self.parts!r})"


def _as_parts(eigenvalues) -> dict:
    """``{block: BlockEigenvalues}`` from grids, lazy parts or an :class:`EigenvalueGrids`."""
    if isinstance(eigenvalues, EigenvalueGrids):
        return dict(eigenvalues.parts)
    return {k: v if isinstance(v, BlockEigenvalues) else BlockEigenvalues((v,)) for k, v in eigenvalues.items()}


@dataclass
class KronOp(LinearOp):
    """Per block: eigenbases ``Q_S`` (out, out), ``Q_A`` (in, in) and eigenvalues Λ (out, in).

    The operator on block b maps G (out, in) to ``Q_S [(Q_Sᵀ G Q_A) ∘ Λ] Q_Aᵀ``; it is
    block-diagonal across the space's blocks. A basis ``None`` is the identity: the factor
    of that side is diagonal (a vocabulary-wide side, module docstring), never stored as a
    d × d matrix. Damping, inverse and powers act on Λ
    (rules ``kronecker.*``), exactly, since ``Q_S ⊗ Q_A`` is orthogonal.

    The bases are stored in the precision of the rows they rotate (float32 for statistics of
    float32 or half-precision rows, float64 for float64 rows:
    :func:`gradalg.curvature.kron.basis_dtype`); each use casts them to the rows' work dtype.

    ``eigenvalue_errors``: for blocks with float32 factors (module docstring), the
    estimated error δ_Λ of the entries of Λ; an inverse or negative power is refused
    (:class:`~gradalg.errors.CurvatureError`) where ``δ_Λ / min |Λ| > float32_rtol``.

    ``eigenvalues`` is given as grids or :class:`BlockEigenvalues` and kept as an
    :class:`EigenvalueGrids`: Λ of K-FAC is its two per-side vectors, and damping,
    scaling, the inverse and powers add a step to each block's Λ instead of making a new
    grid, so the operators of a chain (F, F + λI, (F + λI)⁻¹) share their numbers and
    hold, all together, the bytes of one (:meth:`nbytes`). Λ is made a slice of rows at
    a time where it is applied; the checks of the inverse and of powers read its
    extremes, computed the same way, when the step is added (the same refusals, at the
    same moment, as with a grid).
    """

    space: object
    bases: dict  # name -> (Q_S, Q_A)
    eigenvalues: dict  # name -> (out, in)
    tags: frozenset = frozenset()
    rules: tuple = ()
    eigenvalue_errors: dict = field(default_factory=dict)   # name -> δ_Λ (float32 factors only)
    float32_rtol: float = 1e-2

    form = "kronecker"
    kind = "kron"

    def __post_init__(self):
        self.eigenvalues = EigenvalueGrids(_as_parts(self.eigenvalues))

    @property
    def parts(self) -> dict:
        """``{block: BlockEigenvalues}``: each block's Λ as it is kept."""
        return self.eigenvalues.parts

    def _with(self, eigenvalues) -> "KronOp":
        return replace(self, eigenvalues=eigenvalues)

    def _then(self, *step) -> "KronOp":
        return self._with({k: lam.then(*step) for k, lam in self.parts.items()})

    def _scale(self, c: float) -> "KronOp":
        return replace(self._then("scale", c),
                       eigenvalue_errors={k: abs(c) * e for k, e in self.eigenvalue_errors.items()})

    def _damp(self, damping: float) -> "KronOp":
        return self._then("damp", damping)

    def _damp_blocks(self, lambdas: dict) -> "KronOp":
        return self._with({k: lam.then("damp", lambdas[k]) for k, lam in self.parts.items()})

    def _check_float32(self, what: str, p: float) -> None:
        """Refuse H^p (p < 0) where a float32 block's eigenvalues are not accurate enough:
        the relative error of (Λ_ij)^p is about |p|·δ_Λ/|Λ_ij|."""
        # the float64 fix covers every float32 block, not just this one (else the next one refuses)
        widest = max([Q.shape[0] for k in self.eigenvalue_errors for Q in self.bases[k] if Q is not None] or [0])
        for name, err in self.eigenvalue_errors.items():
            lam = self.parts[name]
            smallest = lam.extremes()[2]
            relative = abs(p) * err / smallest if smallest > 0 else float("inf")
            if relative <= self.float32_rtol:
                continue
            o, i = lam.shape
            wide = widest
            need = abs(p) * err / self.float32_rtol
            raise CurvatureError(
                f"{what}: block {name!r} has Kronecker factors of {o}×{o} and {i}×{i} (those wider than "
                f"ga.options(kron_float64_width) are kept in float32), whose eigenvalues Λ are accurate to "
                f"δ = {err:.2e}; its smallest |Λ| (after damping) is {smallest:.2e}, so the power {p:g} would "
                f"have a relative error of |p|·δ/min|Λ| = {relative:.2e}, over kron_float32_rtol = "
                f"{self.float32_rtol:g}. Fixes: damp by at least |p|·δ/rtol = {need:.2e}; project the layer "
                f"(ga.proj.kron(k=...)); or float64 factors, ga.options(kron_float64_width={wide}) "
                f"({_gb(8.0 * (o * o + i * i))} GB for the factors, {_gb(32.0 * wide * wide)} GB at the "
                "largest eigendecomposition)")

    def _inverse(self, what, rule, settings) -> "KronOp":
        self._check_float32(what, -1.0)
        for k, lam in self.parts.items():   # reciprocal's refusal, read from Λ's extremes
            reciprocal(lam.summary(), f"{what} (block {k!r})")
        return replace(self._then("inverse", None), eigenvalue_errors={})   # checked here, where the division happens

    def _power(self, p, what, rtol) -> "KronOp":
        if p < 0:
            self._check_float32(what, p)
        for k, lam in self.parts.items():   # power_values' refusals, read from Λ's extremes
            power_values(lam.summary(), p, f"{what} (block {k!r})", rtol)
        out = self._then("power", p)
        return replace(out, eigenvalue_errors={}) if p < 0 else out

    def _spectral(self, fn, what) -> "KronOp":
        return self._with({k: fn(v.to(torch.float64)).to(v.dtype) for k, v in self.eigenvalues.items()})

    def trace(self) -> float:
        return sum(float(lam.value().sum()) for lam in self.parts.values())   # a block's grid at a time

    def damp_factorwise(self, damping: float, *, rtol: float = 1e-10) -> "KronOp":
        """K-FAC's factor-wise damping, rule ``kronecker.factorwise_damp`` (another operator
        than ``damp(λ)`` = F + λI): per block (S + √λ/π I) ⊗ (A + π√λ I) with
        π² = (tr A / in) / (tr S / out) (Martens & Grosse 2015, §6.3; invariant to how Λ
        splits into λ_S ⊗ λ_A), computed on the eigenvalues
        λ_S ⊗ λ_A. Needs K-FAC's Λ = λ_S λ_Aᵀ (rank one up to ``rtol``); EK-FAC's re-fitted
        eigenvalues are refused."""
        if not damping >= 0:
            raise OptionError(f"damping must be non-negative, got {damping}: pass λ ≥ 0")
        rule = _rules.choose("damp", self.structure, variant="factorwise")
        root = damping ** 0.5
        out = {}
        for name, lam in self.eigenvalues.items():
            lam64 = lam.to(torch.float64)
            U, sv, Vh = torch.linalg.svd(lam64)
            if len(sv) > 1 and sv[1] > rtol * sv[0]:
                _rules.refuse("damp factor-wise", self.structure,
                              f"block {name!r}: its eigenvalues are not a Kronecker product λ_S ⊗ λ_A "
                              "(EK-FAC re-fits them), so K-FAC's factor-wise damping does not exist for it; "
                              "use damp(λ), exact in the eigenbasis")
            lam_S, lam_A = U[:, 0] * sv[0] ** 0.5, Vh[0] * sv[0] ** 0.5
            sign = 1.0 if float(lam_S.sum()) >= 0 else -1.0      # the SVD's sign is arbitrary
            lam_S, lam_A = sign * lam_S, sign * lam_A
            pi = ((lam_A.mean() / lam_S.mean().clamp_min(1e-300)).clamp_min(0)) ** 0.5
            out[name] = torch.outer(lam_S + root / pi.clamp_min(1e-300), lam_A + pi * root).to(lam.dtype)
        return self._with(out)._recorded(self.rules + (rule.name,), self.tags)

    def _intrinsic_tags(self) -> frozenset:
        return frozenset({"psd"}) if all(lam.extremes()[0] >= 0 for lam in self.parts.values()) else frozenset()

    def apply(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows (n, dim) ↦ (H x_i)_i.   Returns (n, dim)."""
        out = torch.empty_like(rows)
        dtype = work_dtype(rows)  # float32 rows are rotated in float32 (orthogonal maps: no growth)
        for name, s in self.space.offsets().items():
            Q_S, Q_A = self.bases[name]
            lam = self.parts[name]
            G = rows[:, s].reshape(rows.shape[0], *lam.shape)
            rotated = rotate_rows(G.to(dtype), Q_S, Q_A)
            if rotated.untyped_storage().data_ptr() == rows.untyped_storage().data_ptr():
                rotated = rotated.clone()     # no basis to rotate by: a view of the caller's rows
            scaled = lam.mul_into(rotated)
            out[:, s] = rotate_back(scaled, Q_S, Q_A).flatten(1).to(rows.dtype)
        return out

    def apply_blocks(self, blocks: dict, *, consume: bool = False) -> dict:
        """Per block, rows given as :class:`Factors` or (n, out·in) ↦ (n, out·in) rows
        ``Q_S [(Q_Sᵀ G_i Q_A) ∘ Λ] Q_Aᵀ``, without concatenating the blocks.

        consume : pop each block from ``blocks`` (a dict the caller owns) before the next
            one is preconditioned, so the raw and the preconditioned copies of the rows are
            never all held at once (EK-FAC queries on GPT-2: 344 MB raw beside 471 MB).
        """
        out = {}
        for name in list(blocks):
            out[name] = self.apply_block(name, blocks.pop(name) if consume else blocks[name])
        return out

    def apply_block(self, name: str, value) -> torch.Tensor:
        """Block ``name``'s rows (:class:`Factors` or (n, out·in)) ↦ (n, out·in)
        ``Q_S [(Q_Sᵀ G_i Q_A) ∘ Λ] Q_Aᵀ``, in the rows' precision.

        Factored rows are rotated in from their factors, ``(D_i Q_S)ᵀ (A_i Q_A)``:
        T·(out² + in² + out·in) per example instead of materializing G_i (T·out·in) and
        rotating it (out·in·(out + in)), whichever is fewer multiply-adds (an identity
        basis of a diagonal factor costs nothing: its out² or in² terms are 0).
        """
        Q_S, Q_A = self.bases[name]
        o, i = self.parts[name].shape
        o_b, i_b = (o if Q_S is not None else 0), (i if Q_A is not None else 0)
        if isinstance(value, Factors) and value.T * (o_b * o + i_b * i + o * i) < value.T * o * i + o * i * (o_b + i_b):
            rotated = rotate_factors(value, Q_S, Q_A)
        else:
            G = materialize(value).flatten(1) if isinstance(value, Factors) else value
            rotated = rotate_rows(G.reshape(G.shape[0], o, i), Q_S, Q_A)
        del value
        n = rotated.shape[0]
        self.parts[name].mul_into(rotated)   # Λ a slice of rows at a time
        return rotate_back(rotated, Q_S, Q_A).reshape(n, o * i)

    def block_matrix(self, name: str) -> torch.Tensor:
        """Block ``name``'s (out·in, out·in) matrix (Q_S⊗Q_A) diag(vec Λ) (Q_S⊗Q_A)ᵀ, in the
        wider of the bases' and Λ's precision (float32 bases of float32 rows, float64 Λ:
        float64, the operator exactly as the rows are rotated by it)."""
        Q_S, Q_A = self.bases[name]
        lam = self.eigenvalues[name]   # the grid, made once
        dtype = torch.promote_types(lam.dtype, next((Q.dtype for Q in (Q_S, Q_A) if Q is not None), lam.dtype))
        Q_S = Q_S.to(dtype) if Q_S is not None else torch.eye(lam.shape[0], dtype=dtype)
        Q_A = Q_A.to(dtype) if Q_A is not None else torch.eye(lam.shape[1], dtype=dtype)
        K = torch.kron(Q_S.contiguous(), Q_A.contiguous())
        return (K * lam.flatten().unsqueeze(0)) @ K.T

    def dense(self) -> torch.Tensor:
        return torch.block_diag(*(self.block_matrix(n) for n in self.space.names))

    def nbytes(self) -> int:
        total = 0
        for name in self.space.names:
            total += sum(Q.numel() * Q.element_size() for Q in self.bases[name] if Q is not None)
            total += self.parts[name].nbytes()      # K-FAC: (out + in) numbers; a grid: out·in
        return total
