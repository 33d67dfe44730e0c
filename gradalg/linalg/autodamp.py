"""Automatic damping: λ_b for each block b of an explicit operator, from its own spectrum.

``H.damp(rule=DampingRule(...))`` adds ``λ_b I`` on block b (the blocks of H's space, one
per layer or projected layer), each λ_b computed from the eigenvalues μ_b of that block
alone (μ < 0, round-off of a PSD curvature, count as 0). Blocks whose spectra differ by
orders of magnitude — a layer norm next to an MLP, an embedding next to attention — thus
get a λ on their own scale, where one λ = c · tr(H)/dim (the relative rule) over-damps the
small blocks and under-damps the large ones. No ground truth is read: only H.

Rules (``DampingRule.kind``; ``value`` is the rule's one parameter):

``mass``    λ_b = μ_(k), the k-th largest eigenvalue of block b, k the smallest with
            Σ_{i≤k} μ_(i) ≥ q · tr(H_b), q = ``value`` ∈ (0, 1]: the directions that
            carry the last 1 − q of the block's eigenvalue mass are damped to the knee.
``effdim``  λ_b solving d_eff(λ) = Σ_i μ_i / (μ_i + λ) = f · r_b, r_b = (Σμ)² / Σμ² the
            block's participation ratio (its effective rank, a function of μ alone),
            f = ``value`` > 0; d_eff falls from #{μ > 0} at λ = 0 to 0, so λ_b is unique
            (bisection in log λ to a relative 1e-10); a target at or above #{μ > 0} gives 0.
``mean``    λ_b = c · tr(H_b)/d_b, c = ``value``: the relative rule of one block.
``absolute`` λ_b = ``value`` (≥ 0): a given λ, with ``psd=True`` on top of the shift below
            (``influence(curvature="dense_hessian", damping=λ)``).

Eigenvalues of a block: a diagonal's entries; a block's (d_b, d_b) matrix or a dense
matrix's diagonal block H_bb by float64 ``eigvalsh``; a Kronecker block's Λ (out, in)
(K-FAC's λ_S λ_Aᵀ, EK-FAC's re-fitted grid). A dense H damped per block adds
diag(λ_b I_b): the same matrix a block-diagonal H damped per block gets on its blocks.
``global_`` (``per_block=False``) pools every block's eigenvalues into one spectrum and
one λ (a dense H's pooled spectrum is then its own eigenvalues).

``psd=True`` first shifts an indefinite matrix to positive semi-definite: λ_b += max(0, −μ_min),
μ_min the smallest eigenvalue of block b (of the whole matrix for one pooled λ), so that
H + λ_b I ⪰ rule_b I. For the Hessian (1/n) Σ ∇²ℓ_i, which may have negative eigenvalues
(the residual term the Gauss-Newton drops; at a weight-decayed optimum μ_min ≈ −wd, so the
shift stands in for a weight decay not given); a PSD matrix's shift is 0 (round-off aside).

``note`` names where a rule came from in the plan (a method's default names itself), in
place of "damping='auto'" / "damping=DampingRule (given)"; it is not part of equality.

``floor`` = c > 0 bounds every λ_b below by c · tr(H)/dim, H's pooled mean eigenvalue (the
relative rule's λ at factor c): λ_b = max(rule_b, c · tr(H)/dim). A block whose own scale is
far below the rest keeps at least the damping one shared λ would give it (issue 31: on a
conv net, per-block λ under-damps the small-scale conv block; docs/fidelity.md "Automatic
damping").
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..errors import OptionError

__all__ = ["DampingRule", "RULE_KINDS", "block_spectra", "block_lambdas", "rule_lambda"]

RULE_KINDS = ("mass", "effdim", "mean", "absolute")


@dataclass(frozen=True)
class DampingRule:
    """A data-driven damping: ``kind`` (:data:`RULE_KINDS`), its parameter ``value``, and
    whether λ is chosen per block (``per_block``, default) or once for the whole H."""

    kind: str
    value: float
    per_block: bool = True
    floor: float = 0.0
    #: shift an indefinite matrix to PSD first: λ_b += max(0, −μ_min) (the Hessian's negative curvature)
    psd: bool = False
    #: where the rule came from, for the plan (a method's default names itself); not part of equality
    note: str = field(default="", compare=False)

    def __post_init__(self):
        if self.kind not in RULE_KINDS:
            raise OptionError(f"damping rule must be one of {RULE_KINDS}, got {self.kind!r}: e.g. "
                              "DampingRule('mass', 0.99)")
        v = self.value
        if self.kind == "absolute":
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
                raise OptionError(f"DampingRule('absolute', {v!r}): the value is a λ, a finite number ≥ 0")
        elif not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v <= 0 or (
                self.kind == "mass" and v > 1):
            raise OptionError(f"DampingRule({self.kind!r}, {v!r}): the value must be a finite number > 0"
                              + (" and ≤ 1 (a fraction of the eigenvalue mass)" if self.kind == "mass" else ""))
        f = self.floor
        if not isinstance(f, (int, float)) or isinstance(f, bool) or not math.isfinite(f) or f < 0:
            raise OptionError(f"DampingRule floor={f!r}: a factor c ≥ 0 of H's mean eigenvalue (λ_b ≥ c · tr(H)/dim), "
                              "e.g. floor=1.0; 0 for none")

    def describe(self) -> str:
        """The rule in words, as the plan shows it."""
        where = "per block" if self.per_block else "one λ for all blocks"
        if self.floor:
            where += f", at least {self.floor:g} × H's mean eigenvalue"
        if self.psd:
            where += ", plus −(smallest eigenvalue) where negative (shifted to PSD)"
        if self.kind == "mass":
            return f"λ_b = the eigenvalue where the top ones hold {self.value:g} of the mass, {where}"
        if self.kind == "absolute":
            return f"λ_b = {self.value:g}, {where}"
        if self.kind == "effdim":
            return f"λ_b at effective dimension {self.value:g} × participation ratio, {where}"
        return f"λ_b = {self.value:g} × mean eigenvalue, {where}"

    def short(self) -> str:
        return (f"{self.kind}={self.value:g}" + ("" if self.per_block else ", global")
                + (f", floor {self.floor:g}×mean" if self.floor else "") + (", psd shift" if self.psd else ""))


def rule_lambda(rule: DampingRule, mu: torch.Tensor) -> float:
    """λ of ``rule`` for the eigenvalues ``mu`` (any shape; negatives count as 0)."""
    if rule.kind == "absolute":
        return float(rule.value)
    mu = mu.detach().reshape(-1).to(torch.float64).clamp_min(0)
    total = float(mu.sum())
    if mu.numel() == 0 or total <= 0:
        return 0.0
    if rule.kind == "mean":
        return rule.value * total / mu.numel()
    if rule.kind == "mass":
        s = torch.sort(mu, descending=True).values
        cum = torch.cumsum(s, 0)
        k = int(torch.searchsorted(cum, torch.tensor(rule.value * total * (1 - 1e-12), dtype=torch.float64)))
        return float(s[min(k, s.numel() - 1)])
    # effdim: Σ μ/(μ+λ) = f · (Σμ)²/Σμ²
    pos = mu[mu > 0]
    target = rule.value * total ** 2 / float((pos ** 2).sum())
    if target >= pos.numel():
        return 0.0
    lo, hi = math.log(float(pos.min())) - 40.0, math.log(float(pos.max())) + 40.0
    for _ in range(200):
        mid = (lo + hi) / 2
        if float((pos / (pos + math.exp(mid))).sum()) > target:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-10:
            break
    return math.exp((lo + hi) / 2)


def block_spectra(op) -> dict:
    """``{block name: eigenvalues (float64, flat)}`` of an explicit or Kronecker operator."""
    from .explicit import ResolvedOp
    from .kron import KronOp
    offsets = op.space.offsets()
    if isinstance(op, KronOp):
        return {n: op.parts[n].value().reshape(-1).to(torch.float64) for n in op.parts}
    if isinstance(op, ResolvedOp):
        if op.kind == "diag":
            return {n: op.data[s].to(torch.float64) for n, s in offsets.items()}
        if op.kind == "block":
            return {n: torch.linalg.eigvalsh(_sym(op.data[n])) for n in op.space.names}
        return {n: torch.linalg.eigvalsh(_sym(op.data[s, s])) for n, s in offsets.items()}
    raise OptionError(f"automatic damping needs the spectrum of an explicit operator; got {type(op).__name__}: "
                      "pass an absolute damping=λ")


def _sym(m: torch.Tensor) -> torch.Tensor:
    m = m.to(torch.float64)
    return (m + m.T) / 2


def _psd_shift(rule: DampingRule, mu: torch.Tensor) -> float:
    """max(0, −min μ) when ``rule.psd`` (the shift that makes the matrix PSD), else 0."""
    if not rule.psd or mu.numel() == 0:
        return 0.0
    return max(0.0, -float(mu.min()))


def block_lambdas(op, rule: DampingRule) -> dict:
    """``{block name: λ_b}`` of ``rule`` on ``op`` (one shared λ when not ``per_block``;
    a dense operator's shared λ from its full spectrum), each at least ``rule.floor`` ×
    tr(op)/dim (the blocks' eigenvalues summed: a dense op's diagonal blocks hold its trace).

    A dense op's pooled spectrum is its kept eigendecomposition
    (:meth:`~gradalg.linalg.explicit.ResolvedOp.eigenpairs`, computed here if not yet): the
    shifted operator and its inverse reuse it, with no decomposition of their own."""
    from .explicit import ResolvedOp
    if not rule.per_block and isinstance(op, ResolvedOp) and op.kind == "dense":
        mu = op.eigenpairs()[0]                       # (dim,): tr(op) = Σ μ
        lam = rule_lambda(rule, mu) + _psd_shift(rule, mu)
        out = {n: lam for n in op.space.names}
        total, dim = float(mu.sum()), mu.numel()
    else:
        spectra = block_spectra(op)
        if rule.per_block:
            out = {n: rule_lambda(rule, mu) + _psd_shift(rule, mu) for n, mu in spectra.items()}
        else:
            mu = torch.cat(list(spectra.values()))
            lam = rule_lambda(rule, mu) + _psd_shift(rule, mu)
            out = {n: lam for n in op.space.names}
        total, dim = float(sum(mu.sum() for mu in spectra.values())), sum(mu.numel() for mu in spectra.values())
    if rule.floor:
        least = rule.floor * total / max(dim, 1)
        out = {n: max(lam, least) for n, lam in out.items()}
    return out
