"""Curvature operator nodes beyond the Fisher: Kronecker (K-FAC / EK-FAC), products
with the Hessian or Gauss-Newton matrix, their Arnoldi low-rank approximation, and
DataInf's closed-form inverse. See :mod:`gradalg.curvature` for the math; each node
implements the operator protocol of :mod:`gradalg.expr.operators`.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch

from ..data import DataRef
from ..errors import NoForwardADError
from ..linalg import SINGULAR_RTOL, DataInfOp, ImplicitOp, Labels, LowRankOp
from ..linalg.base import singular
from ..linalg.explicit import ResolvedOp
from ..linalg.kron import diagonal_factor_rules
from ..linalg.solvers import arnoldi, arnoldi_iters, lanczos_min
from ..options import get_options
from ..space import ParamSpace
from .grads import GradNode, first_examples
from .operators import OpNode, ProductCalls, Statistic

__all__ = ["KFAC", "SubsetNote", "CurvatureProducts", "Formed", "Arnoldi", "DataInf", "NearMinimum", "NearMinimumProbe", "PROBES"]


@dataclass(frozen=True, eq=False)
class KFAC(OpNode):
    """K-FAC (``eigen_correction=False``) or EK-FAC (True) of the rows of ``grads``.

    ``grads`` must keep factors (hook capture, optionally Kronecker-projected): the
    statistics are the covariances of activations and output gradients.

    Per block, with A_i (T, in) and D_i (T, out) the factors of example i:

        A = (1/n_c) Σ_{i<n_c} A_iᵀA_i,   S = (1/n_c) Σ_{i<n_c} D_iᵀD_i     (covariances)
        Λ = (1/n_λ) Σ_{i<n_λ} (Q_Sᵀ G_i Q_A)²                             (EK-FAC's eigenvalues)

    over the first ``n_c = covariance_max_examples`` and ``n_λ = lambda_max_examples``
    examples of ``grads`` (None: all ``n``; Kronfluence's ``FactorArguments`` options of
    the same names). Both are part of the node's identity, and the node holds them only
    below ``n`` (``ga.kfac`` stores a larger value as None), so equal statistics are one node.
    """

    grads: GradNode
    eigen_correction: bool = False
    covariance_max_examples: int | None = None
    lambda_max_examples: int | None = None

    @property
    def space(self) -> ParamSpace:
        return self.grads.space

    def labels(self):
        """Kronecker; a factor wider than ``ga.options(kron_diagonal_width)`` kept diagonal
        is named (rule ``kronecker.diagonal_factor``); two K-FACs of the same gradients
        share their eigenbasis."""
        rules = diagonal_factor_rules(self.space, get_options().kron_diagonal_width)
        return Labels({"kronecker"}, rules, ("kfac", self.grads.token))

    def statistics(self):
        """The covariances over the first ``covariance_max_examples`` rows (a ``kfac`` job),
        and for EK-FAC the eigenvalues over the first ``lambda_max_examples`` (``ekfac``,
        after it: it needs the eigenbasis)."""
        kfac = Statistic("kfac", self, self.covariance_grads)
        if not self.eigen_correction:
            return (kfac,)
        return (kfac, Statistic("ekfac", self, self.lambda_grads, after=(kfac,)))

    def resolve(self, ctx):
        kfac, *ekfac = self.statistics()
        basis = ctx.accumulate(kfac)
        return ctx.accumulate(ekfac[0], basis) if ekfac else basis

    def apply_cost(self, space, n, prices):
        return prices.by_form(self.labels(), space, n)

    @cached_property
    def covariance_grads(self) -> GradNode:
        """The rows the Kronecker covariances are estimated from (the first
        ``covariance_max_examples`` examples of ``grads``)."""
        return first_examples(self.grads, self.covariance_max_examples)

    @cached_property
    def lambda_grads(self) -> GradNode:
        """The rows EK-FAC's eigenvalue correction is estimated from (the first
        ``lambda_max_examples`` examples of ``grads``)."""
        return first_examples(self.grads, self.lambda_max_examples)

    def subset_notes(self) -> tuple["SubsetNote", ...]:
        """What each statistic is estimated on, when not on every example: one
        :class:`SubsetNote` per statistic (``str``: "covariances: first 100 of 1,000
        examples"; shown by ``explain()``), found by its ``statistic`` (a job kind)."""
        n, out = self.grads.n, []
        if self.covariance_max_examples is not None:
            out.append(SubsetNote("kfac", self.covariance_max_examples, n))
        if self.eigen_correction and self.lambda_max_examples is not None:
            out.append(SubsetNote("ekfac", self.lambda_max_examples, n))
        return tuple(out)

    @property
    def label(self):
        name = "ekfac" if self.eigen_correction else "kfac"
        notes = "; ".join(map(str, self.subset_notes()))
        return f"{name} ({notes})" if notes else name


@dataclass(frozen=True)
class SubsetNote:
    """The statistic of kind ``statistic`` (a :class:`Statistic` job: ``"kfac"``, the
    Kronecker covariances; ``"ekfac"``, the eigenvalue correction) estimated on the first
    ``first`` of the ``n`` examples of its rows."""

    statistic: str
    first: int
    n: int

    def __str__(self) -> str:
        what = {"kfac": "covariances", "ekfac": "eigenvalue correction"}[self.statistic]
        return f"{what}: first {self.first:,} of {self.n:,} examples"


@dataclass(frozen=True, eq=False)
class CurvatureProducts(OpNode):
    """H = (1/n) Σ_i ∇²L_i ("hessian") or the Gauss-Newton matrix, known by products.

    Each product with a batch of vectors is one pass over ``data``.
    """

    task: Any
    data: DataRef
    layers: tuple[str, ...]
    kind: str = "hessian"
    space_: ParamSpace | None = None

    @property
    def space(self):
        return self.space_

    def labels(self):
        return Labels({"implicit"})

    def statistics(self):
        """Its products: a planned pass over raw batches of ``data`` per call
        (:class:`~gradalg.plan.jobs.products.ProductsJob`), once unless a solver above it
        says how many times (:meth:`Statistic.solved`)."""
        return (Statistic("products", self, None),)

    def resolve(self, ctx):
        matvec = ctx.products(self.task, self.data, self.layers, self.kind, node=self)
        # the Gauss-Newton matrix is PSD; the Hessian need not be
        return ImplicitOp(self.space, matvec, tags=frozenset({"psd"}) if self.kind != "hessian" else frozenset())

    def apply_cost(self, space, n, prices):
        """The n rows read and written: the products themselves are its products pass's
        (priced there per call, :class:`~gradalg.plan.jobs.products.ProductsJob`)."""
        return prices.traffic(2.0 * prices.elem * n * space.dim)

    @property
    def label(self):
        return f"{self.kind} products (n={self.data.n})"


def _identity_columns(d: int, start: int, stop: int) -> torch.Tensor:
    """Rows ``start:stop`` of the (d, d) float64 identity, made alone ((stop − start)·d·8 bytes, what the
    products pass prices of a formation's chunk: not a view of a d × d identity held through the formation)."""
    rows = torch.zeros(stop - start, d, dtype=torch.float64)
    rows[:, start:stop].fill_diagonal_(1.0)
    return rows


def _symmetrise(H: torch.Tensor, b: int) -> torch.Tensor:
    """(H + Hᵀ)/2 of a square H, in place, by (b, b) blocks: each pair of blocks (i, j), (j, i) read
    before either is written (Hᵀ is a view: ``H.add_(H.T)`` would read what it already wrote), each
    entry (H_rc + H_cr)/2, the same numbers as ``(H + H.T) / 2`` (a float sum commutes); 2·b² numbers
    at once beside H, not two new (d, d) matrices."""
    d = H.shape[0]
    for i in range(0, d, b):
        for j in range(i, d, b):
            mean = (H[i:i + b, j:j + b] + H[j:j + b, i:i + b].T) / 2
            H[i:i + b, j:j + b] = mean
            H[j:j + b, i:i + b] = mean.T
    return H


@dataclass(frozen=True, eq=False)
class Formed(OpNode):
    """``op`` (known by products, e.g. the Hessian (1/n) Σ_i ∇²L_i) formed as its dense
    (dim, dim) matrix: H = H·I, the products with the identity's columns, ``chunk`` of them
    per call (⌈dim/chunk⌉ passes over the data), each call's rows written into one (dim, dim) float64
    H, then symmetrised in place as (H + Hᵀ)/2 (:func:`_symmetrise`): 8·dim² bytes held beside each call,
    what the products pass prices (``ProductCalls.held``), and nothing more after the last one (before
    session 49 the rows were concatenated and H + Hᵀ and its half made anew: 3 × 8·dim² at once).

    What makes the Hessian an explicit H: its spectrum is then at hand (a relative or
    spectrum-read damping, a direct eigendecomposition, computed once and kept on the resolved
    operator: :meth:`~gradalg.linalg.explicit.ResolvedOp.eigenpairs`), at the price of dim products
    (each call's ``chunk`` vectors go through ``vmap`` in smaller chunks where the activations are
    large: ``ga.options(products_vmap_elements)``, :mod:`gradalg.curvature.hvp`). Keeps
    ``op``'s ``psd`` tag (the Gauss-Newton's); the Hessian's matrix may be indefinite.
    """

    op: OpNode
    chunk: int = 256

    @property
    def space(self):
        return self.op.space

    def labels(self):
        self.op.labels()        # its operand must resolve (refusals surface here)
        return Labels({"dense"})

    def statistics(self):
        """The operand's; its products run ⌊dim/chunk⌋ times on ``chunk`` vectors each, then once on
        the rest (dim mod chunk): two groups of calls, each priced at its vectors, beside the rows
        formed so far, the (dim, dim) float64 H (8·dim² bytes, held through every call)."""
        d = self.space.dim
        full, rest = divmod(d, self.chunk)
        why = f"formed: {d} products, {self.chunk} per call"
        parts = tuple((calls, m) for calls, m in ((full, self.chunk), (1, rest)) if calls and m)
        return tuple(s.solved_in(parts, why, torch.float64, 8.0 * d * d) for s in self.op.statistics())

    def resolve(self, ctx):
        inner, d, H = ctx.resolve(self.op), self.space.dim, None
        for i in range(0, d, self.chunk):
            rows = inner.apply(_identity_columns(d, i, min(i + self.chunk, d)))
            H = torch.empty(d, d, dtype=torch.float64, device=rows.device) if H is None else H
            H[i:i + rows.shape[0]] = rows       # cast to float64 as it is copied
            del rows
        return ResolvedOp(self.space, "dense", _symmetrise(H, self.chunk), frozenset(inner.tags & {"psd"}))

    def apply_cost(self, space, n, prices):
        """A dense (dim, dim) matrix applied: a GEMM (:meth:`OperatorPrices.by_form`)."""
        return prices.by_form(self.labels(), space, n)

    @property
    def label(self):
        return f"formed({self.op.label})"


@dataclass(frozen=True, eq=False)
class Arnoldi(OpNode):
    """Top-``rank`` eigen-approximation V diag(μ) Vᵀ of ``op`` (Schioppa et al. 2022)."""

    op: OpNode
    rank: int
    iters: int | None = None
    seed: int = 0

    @property
    def space(self):
        return self.op.space

    def labels(self):
        self.op.labels()        # its operand must resolve (refusals surface here)
        return Labels({"low-rank"})

    def statistics(self):
        """The operand's; its products run once per Arnoldi iteration on one vector
        (:func:`~gradalg.linalg.solvers.arnoldi_iters` at most)."""
        iters = arnoldi_iters(self.space.dim, self.rank, self.iters)
        why = f"Arnoldi iters={self.iters}" if self.iters else "Arnoldi iters=min(dim, 2·rank+10)"
        return tuple(s.solved(iters, why, vectors=1, dtype=torch.float64) for s in self.op.statistics())

    def resolve(self, ctx):
        inner = ctx.resolve(self.op)
        dtype = torch.float64
        evals, vecs = arnoldi(lambda V: inner.apply(V.to(dtype)), self.space.dim, self.rank,
                              iters=self.iters, seed=self.seed, dtype=dtype)
        return LowRankOp(self.space, evals, vecs, inner.tags & {"psd"})

    def apply_cost(self, space, n, prices):
        """V diag(μ) Vᵀ applied: 4n·d·r."""
        return prices.low_rank(space, n, self.rank)

    @property
    def label(self):
        return f"arnoldi(rank={self.rank})"


@dataclass(frozen=True, eq=False)
class DataInf(OpNode):
    """DataInf's inverse (Kwon et al. 2024), per block b:

        (F_b + λI)⁻¹ ≈ (1/(nλ)) Σ_i (I − g_ib g_ibᵀ / (λ + ‖g_ib‖²))

    the average of the Sherman-Morrison inverses of the per-example rank-one Fishers
    (an approximation that swaps the order of averaging and inversion).
    """

    grads: GradNode
    damping: float

    @property
    def space(self):
        return self.grads.space

    def labels(self):
        return Labels({"implicit", "approximate-inverse"})

    def statistics(self):
        """It reads its rows when applied: to a score's held rows in a planned pass
        (``"apply"``: :class:`~gradalg.plan.jobs.apply.ApplyJob`), elsewhere by itself."""
        return (Statistic("apply", self, self.grads),)

    def resolve(self, ctx):
        return DataInfOp(self.space, ctx.rows(self.grads), self.damping)

    def apply_cost(self, space, n, prices):
        """One read of the n_train training rows (captured again, factored blocks
        materialized) and, per block, two GEMMs (n, n_train, d_b) with the n held rows."""
        rows, cost = self.grads, prices.rows_read(self.grads)
        for b in rows.space.blocks:
            cost = cost + prices.gemm(n, rows.n, b.dim, 2) + prices.traffic(2.0 * prices.elem * rows.n * b.dim)
        return cost

    @property
    def label(self):
        return f"datainf⁻¹(λ={self.damping:g})"


@dataclass(frozen=True)
class NearMinimumProbe:
    """What decided a :class:`NearMinimum` choice, measured when it resolved.

    mu_min     the smallest eigenvalue of H̄ + decay: exact (``exact``, from the formed Hessian)
               or a Lanczos Ritz value, which is never below the true one
    scale      the Gauss-Newton matrix's mean eigenvalue tr(G)/dim
    ratio      −mu_min / scale (≤ 0: positive semi-definite)
    threshold  r, ``ga.options(hessian_negative_ratio)``
    chosen     "dense_hessian" (ratio ≤ r and its damped inverse exists) or "gauss_newton"
    how        which estimate decided, in words
    hessian_mean  tr(H̄ + decay)/dim where the Hessian was formed, else None
    singular   (smallest, largest |·|) eigenvalue of the Hessian as its inverse would take it
               (damped, shifted to PSD) where the ratio chose it but that matrix is singular by
               the test every inverse applies (smallest ≤ ``SINGULAR_RTOL`` × largest, e.g.
               ``damping=0`` on a model not exactly at a minimum: the shift leaves μ = 0):
               the Gauss-Newton is taken instead, so ``"auto"`` never turns into a refusal; else None
    """

    mu_min: float
    scale: float
    ratio: float
    threshold: float
    chosen: str
    exact: bool
    how: str
    hessian_mean: float | None = None
    singular: tuple[float, float] | None = None

    def describe(self) -> str:
        if self.mu_min != self.mu_min:           # NaN: the Hessian's products could not be taken
            return f"μ_min not measured ({self.how}), the Gauss-Newton's mean eigenvalue {self.scale:.3g}"
        mean = "" if self.hessian_mean is None else f", the Hessian's mean eigenvalue {self.hessian_mean:.3g}"
        op = "≤" if self.chosen == "dense_hessian" or self.singular is not None else ">"
        text = (f"μ_min {self.mu_min:.3g} ({self.how}), the Gauss-Newton's mean eigenvalue {self.scale:.3g}{mean}: "
                f"−μ_min / mean = {self.ratio:.3g} {op} r = {self.threshold:g}")
        if self.singular is None:
            return text
        low, high = self.singular
        return (f"{text}, but the Hessian damped and shifted to PSD is singular (smallest eigenvalue {low:.3g} ≤ "
                f"{SINGULAR_RTOL:g} × the largest {high:.3g}), so the dense Gauss-Newton: pass damping > 0 for "
                "the Hessian")


def _eigenvalues(op) -> torch.Tensor:
    """The eigenvalues (dim,) of a resolved operator: a dense one's kept decomposition
    (:meth:`~gradalg.linalg.explicit.ResolvedOp.eigenpairs`, computed once and shared with its
    shift and inverse), else ``eigvalsh`` of its matrix."""
    if isinstance(op, ResolvedOp) and op.kind == "dense":
        return op.eigenpairs()[0]
    return torch.linalg.eigvalsh(op.dense().to(torch.float64))


#: ``{NearMinimum token: NearMinimumProbe}`` of the choices resolved in this process (the 256
#: latest; a token names the model's weights, so a later plan of the same expression shows them)
PROBES: dict = {}


@dataclass(frozen=True, eq=False)
class NearMinimum(OpNode):
    """``curvature="auto"``'s dense choice (issue 31): the damped inverse ``hessian_inv`` of the
    formed Hessian where the model is near a minimum of its objective, else ``gauss_newton_inv``
    (the dense Gauss-Newton's), decided when it resolves, from no ground truth:

        near a minimum  ⇔  −μ_min(H̄ + decay) ≤ r · tr(G)/dim

    H̄ = (1/n) Σ ∇²ℓ_i (``products``; formed by ``formed``), G the formed Gauss-Newton matrix
    (``gauss_newton``, whose mean eigenvalue is the scale: PSD and exact), r = ``ratio``
    (``ga.options(hessian_negative_ratio)``), decay the objective's weight-decay term, whose
    smallest diagonal entry ``shift`` is added to μ_min (exact for a uniform wd·I, a lower
    bound otherwise). At a weight-decayed minimum H̄ + wd ⪰ 0; far from one (a model stopped
    early) the residual term makes H̄ strongly indefinite and its PSD shift swamps the
    curvature that ranks examples (a conv net: −μ_min = 25 × the mean, LDS 0.170 against the
    Gauss-Newton's 0.468; docs/fidelity.md).

    Up to ``iterations`` Lanczos steps on ``products`` (one vector each; never more than the
    ⌈dim/chunk⌉ passes forming the Hessian takes, :attr:`probe_steps`) come first: a Ritz value θ
    is never below μ_min, so −(θ + shift) > r · scale already proves the Gauss-Newton side and
    the Hessian is never formed; otherwise ``formed`` (the same node the Hessian's inverse
    holds, resolved once) gives the exact μ_min from its eigendecomposition, the one the PSD shift
    and the inverse reuse (:meth:`~gradalg.linalg.explicit.ResolvedOp.eigenpairs`: one ``eigh`` of
    the (dim, dim) matrix in all). Where the ratio picks the Hessian but ``hessian_damped`` (the
    operand ``hessian_inv`` inverts: H̄ + decay shifted to PSD and damped) is singular by the test
    every inverse applies (μ ≤ ``SINGULAR_RTOL`` × max |μ|: ``damping=0`` off an exact minimum),
    the Gauss-Newton is taken and the decision says why: ``"auto"`` does not turn a call the
    Gauss-Newton answers into a refusal. What decided is kept in :data:`PROBES` and shown by the
    plan (a ``CURVATURE`` decision).
    """

    products: OpNode
    formed: OpNode
    gauss_newton: OpNode
    hessian_inv: OpNode
    gauss_newton_inv: OpNode
    ratio: float
    iterations: int
    shift: float = 0.0
    #: the operand of ``hessian_inv``: H̄ (+ decay) shifted to PSD and damped (None: ``hessian_inv.op``)
    hessian_damped: OpNode | None = None

    @property
    def space(self):
        return self.gauss_newton_inv.space

    @property
    def probe_steps(self) -> int:
        """The Lanczos steps at most: ``iterations``, but never more passes over the data than
        forming the Hessian takes (⌈dim/chunk⌉ calls): the probe costs at most what it can save."""
        calls = -(-self.space.dim // getattr(self.formed, "chunk", 256))
        return min(self.iterations, calls, self.space.dim)

    def labels(self):
        self.hessian_inv.labels()        # both must resolve (refusals surface here)
        return self.gauss_newton_inv.labels()

    def statistics(self):
        """Both sides' (the products pass is run only as far as the decision needs: the probe's
        ``iterations`` calls, then the Hessian's formation if it is not ruled out)."""
        hess = self.hessian_inv.statistics()
        if self.probe_steps > 0:     # the probe's calls, one vector each: a group of their own before the formation's
            probe = ProductCalls(self.probe_steps, 1, f"{self.probe_steps} Lanczos probe products", torch.float64)
            hess = tuple(s.preceded(probe) for s in hess)
        return self.gauss_newton.statistics() + hess + tuple(
            s for s in self.gauss_newton_inv.statistics() if s not in self.gauss_newton.statistics())

    def resolve(self, ctx):
        probe = self.measure(ctx)
        PROBES[self.token] = probe
        while len(PROBES) > 256:
            PROBES.pop(next(iter(PROBES)))
        return ctx.resolve(self.hessian_inv if probe.chosen == "dense_hessian" else self.gauss_newton_inv)

    def measure(self, ctx) -> NearMinimumProbe:
        """The decision's numbers: the Lanczos bound first, the formed Hessian's exact μ_min if needed."""
        G = ctx.resolve(self.gauss_newton)
        dim = self.space.dim
        scale = float(G.trace()) / dim
        bound = scale * self.ratio
        try:
            return self._measure_hessian(ctx, dim, scale, bound)
        except NoForwardADError as err:     # the Hessian's products need jvp: the Gauss-Newton does not
            why = str(err).split(", which the model runs", 1)[0].split("no forward-AD rule for ", 1)[-1]
            return NearMinimumProbe(float("nan"), scale, float("nan"), self.ratio, "gauss_newton", False,
                                    f"the Hessian's products need forward-mode AD, and torch has no rule for {why}")

    def _measure_hessian(self, ctx, dim: int, scale: float, bound: float) -> NearMinimumProbe:
        most = self.probe_steps
        if most > 0 and self.ratio < float("inf"):
            H = ctx.resolve(self.products)
            ritz, steps = lanczos_min(H.apply, dim, most, stop_below=-bound - self.shift)
            theta = ritz + self.shift
            if -theta > bound:
                return NearMinimumProbe(theta, scale, -theta / scale, self.ratio, "gauss_newton", False,
                                        f"Lanczos, {steps} of up to {most} products: a bound from above")
        mu = _eigenvalues(ctx.resolve(self.formed))                       # (dim,), kept for the shift and inverse
        mu_min = float(mu.min()) + self.shift
        mean = float(mu.sum()) / dim + self.shift
        chosen = "dense_hessian" if -mu_min <= bound else "gauss_newton"
        held = None
        if chosen == "dense_hessian":            # its inverse must exist, else the Gauss-Newton (no refusal)
            damped = _eigenvalues(ctx.resolve(self.hessian_damped if self.hessian_damped is not None
                                              else self.hessian_inv.op))
            if singular(damped):
                chosen, held = "gauss_newton", (float(damped.min()), float(damped.abs().max()))
        return NearMinimumProbe(mu_min, scale, -mu_min / scale, self.ratio, chosen, True,
                                "the formed Hessian's eigenvalues", mean, held)

    def apply_cost(self, space, n, prices):
        return self.gauss_newton_inv.apply_cost(space, n, prices)

    @property
    def label(self):
        return (f"auto: formed Hessian if near a minimum (−μ_min ≤ {self.ratio:g} × mean eig of G), "
                "else Gauss-Newton")
