"""Named algebraic rules: how each operation on a resolved operator is done, by structure.

An operator's ``structure`` is a frozenset of labels of the one vocabulary of
:mod:`gradalg.linalg.labels`: exactly one *form* (``diagonal``, ``block``, ``dense``,
``kronecker``, ``low-rank``, ``implicit``: how its numbers are kept) and tags
(``identity``, ``inverse``, ``approximate-inverse``, ``psd``: facts about it).

Each operation (``damp``, ``damp_relative``, ``inverse``, ``power``, ``scale``) takes
the first rule of its table whose labels the operand carries; a sum takes the rules of
:func:`choose_sum`. The rule's name is appended to the result's ``rules``, and because
the choice needs only labels, the planner lists the same names before any data is read
(:class:`~gradalg.linalg.labels.Labels`, an operator node's ``labels()``). A rule with a ``refusal`` raises
:class:`~gradalg.errors.OperatorError` naming the structure and the fix: an operation
that cannot be done exactly for a structure is refused, never approximated silently.

This module imports nothing but the errors and the vocabulary.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import OperatorError
from .labels import FORMS, form_of

__all__ = ["FORMS", "Rule", "RULES", "choose", "choose_sum", "describe_rule", "form_of", "refuse"]


@dataclass(frozen=True)
class Rule:
    """One way of doing ``operation`` on operators carrying all of ``needs``."""

    operation: str
    name: str
    needs: frozenset
    doc: str
    refusal: str | None = None   # the fix, when the operation is refused for this structure
    variant: str | None = None   # e.g. the solver ("cg", "lissa") of an implicit inverse


def _rule(operation, name, needs, doc, refusal=None, variant=None) -> Rule:
    return Rule(operation, name, frozenset(needs), doc, refusal, variant)


_REFUSE_DATAINF = ("DataInf's operator is already the damped inverse (Kwon et al. 2024), known only "
                   "through its closed form: set λ in ga.datainf(G, damping=λ) and use it as it is, or "
                   "use an explicit curvature, ga.fisher(G, structure='block').damp(λ).inv()")

#: the unary rules, in dispatch order per operation
RULES: tuple[Rule, ...] = (
    # ---- damp: H + λI
    _rule("damp", "identity.shift", {"identity"}, "c·I + λI = (c + λ)·I"),
    _rule("damp", "diagonal.shift", {"diagonal"}, "diag(v) + λI = diag(v + λ)"),
    _rule("damp", "block.shift_diagonals", {"block"}, "each block M_b + λI"),
    _rule("damp", "dense.shift_diagonal", {"dense"}, "M + λI"),
    _rule("damp", "kronecker.factorwise_damp", {"kronecker"},
          "K-FAC's factor-wise damping (Martens & Grosse 2015, §6.3): (S + √λ/π I) ⊗ (A + π√λ I), "
          "π² = (tr A / in) / (tr S / out); not F + λI, so only when asked for (damp_factorwise)",
          variant="factorwise"),
    _rule("damp", "kronecker.damp_in_eigenbasis", {"kronecker"},
          "(Q_S⊗Q_A) Λ (Q_S⊗Q_A)ᵀ + λI = (Q_S⊗Q_A)(Λ + λ)(Q_S⊗Q_A)ᵀ, exact because Q_S⊗Q_A is "
          "orthogonal (not K-FAC's factor-wise damping, kronecker.factorwise_damp, another operator)"),
    _rule("damp", "low-rank.damp_within_subspace", {"low-rank"},
          "V diag(μ) Vᵀ ↦ V diag(μ + λ) Vᵀ: the shift on the kept eigenspace only, its complement "
          "stays zero (Arnoldi influence, Schioppa et al. 2022)"),
    _rule("damp", "refused", {"approximate-inverse"}, "", refusal=_REFUSE_DATAINF),
    _rule("damp", "refused", {"inverse"}, "",
          refusal="damp the operator before inverting it: H.damp(λ).inv(), not H.inv().damp(λ)"),
    _rule("damp", "implicit.shift", {"implicit"}, "c·H + λI: λ·x is added to every product"),
    # ---- damp with relative=True: λ = damping · tr(H)/dim
    _rule("damp_relative", "refused", {"implicit"}, "",
          refusal="relative damping needs tr(H)/dim, which an operator known only through products "
                  "does not have exactly: pass an absolute damping, H.damp(λ)"),
    _rule("damp_relative", "damp.relative_to_mean_eigenvalue", (),
          "λ = damping · tr(H)/dim, a multiple of H's mean eigenvalue"),
    # ---- damp with a rule (automatic damping): λ_b from each block's spectrum
    _rule("damp_auto", "refused", {"implicit"}, "",
          refusal="automatic damping reads each block's eigenvalues, which an operator known only through "
                  "products does not have: pass an absolute damping, H.damp(λ)"),
    _rule("damp_auto", "refused", {"low-rank"}, "",
          refusal="automatic damping needs every block's spectrum; a low-rank operator keeps one eigenspace: "
                  "pass an absolute damping, H.damp(λ)"),
    _rule("damp_auto", "damp.per_block_spectrum", (),
          "H + ⊕_b λ_b I_b, λ_b from block b's own eigenvalues by a DampingRule (mass, effdim, mean; "
          "gradalg.linalg.autodamp)"),
    # ---- inverse: H⁻¹
    _rule("inverse", "identity.reciprocal", {"identity"}, "(c·I)⁻¹ = (1/c)·I"),
    _rule("inverse", "diagonal.reciprocal", {"diagonal"}, "diag(v)⁻¹ = diag(1/v)"),
    _rule("inverse", "block.eigh_per_block", {"block"},
          "per block M_b = U diag(μ) Uᵀ (float64 eigh), M_b⁻¹ = U diag(1/μ) Uᵀ"),
    _rule("inverse", "dense.eigh", {"dense"}, "M = U diag(μ) Uᵀ (float64 eigh), M⁻¹ = U diag(1/μ) Uᵀ"),
    _rule("inverse", "kronecker.invert_eigenvalues", {"kronecker"},
          "((Q_S⊗Q_A) Λ (Q_S⊗Q_A)ᵀ)⁻¹ = (Q_S⊗Q_A) Λ⁻¹ (Q_S⊗Q_A)ᵀ: no (out·in)² matrix"),
    _rule("inverse", "low-rank.invert_within_subspace", {"low-rank"},
          "V diag(1/μ) Vᵀ: the inverse on the kept eigenspace (the pseudo-inverse of V diag(μ) Vᵀ)"),
    _rule("inverse", "refused", {"approximate-inverse"}, "", refusal=_REFUSE_DATAINF),
    _rule("inverse", "implicit.inverse_of_solve", {"inverse"}, "((c·H + λI)⁻¹)⁻¹ = c·H + λI"),
    _rule("inverse", "implicit.solve_by_cg", {"implicit"},
          "(c·H + λI)⁻¹ x by conjugate gradients on products (H symmetric positive definite)", variant="cg"),
    _rule("inverse", "implicit.solve_by_lissa", {"implicit"},
          "(c·H + λI)⁻¹ x by LiSSA's Neumann recursion on products", variant="lissa"),
    # ---- power: H^p (p ≠ ±1; p = -1 is the inverse, p = 1 the operator)
    _rule("power", "identity.power", {"identity"}, "(c·I)^p = c^p·I"),
    _rule("power", "diagonal.elementwise_power", {"diagonal"}, "diag(v)^p = diag(v^p)"),
    _rule("power", "block.eigh_power_per_block", {"block"}, "per block U diag(μ^p) Uᵀ (float64 eigh)"),
    _rule("power", "dense.eigh_power", {"dense"}, "U diag(μ^p) Uᵀ (float64 eigh)"),
    _rule("power", "kronecker.eigenvalue_power", {"kronecker"}, "(Q_S⊗Q_A) Λ^p (Q_S⊗Q_A)ᵀ"),
    _rule("power", "low-rank.eigenvalue_power_within_subspace", {"low-rank"},
          "V diag(μ^p) Vᵀ on the kept eigenspace"),
    _rule("power", "refused", {"approximate-inverse"}, "", refusal=_REFUSE_DATAINF),
    _rule("power", "refused", {"implicit"}, "",
          refusal="powers other than ±1 of an operator known only through products need its "
                  "eigendecomposition: ga.arnoldi(H, rank).pow(p) (its top eigenspace) or an explicit "
                  "curvature (ga.fisher, ga.kfac, ga.ekfac)"),
    # ---- spectral: f(H) for a scalar function f of the eigenvalues (SOURCE's segment operators)
    _rule("spectral", "diagonal.elementwise_function", {"diagonal"}, "f(diag(v)) = diag(f(v))"),
    _rule("spectral", "block.eigh_function_per_block", {"block"}, "per block U diag(f(μ)) Uᵀ (float64 eigh)"),
    _rule("spectral", "dense.eigh_function", {"dense"}, "U diag(f(μ)) Uᵀ (float64 eigh)"),
    _rule("spectral", "kronecker.eigenvalue_function", {"kronecker"}, "(Q_S⊗Q_A) f(Λ) (Q_S⊗Q_A)ᵀ"),
    _rule("spectral", "refused", {"low-rank"}, "",
          refusal="a function of the eigenvalues of a low-rank operator is not low-rank when f(0) ≠ 0: "
                  "use an explicit curvature (ga.fisher, ga.kfac, ga.ekfac)"),
    _rule("spectral", "refused", {"approximate-inverse"}, "", refusal=_REFUSE_DATAINF),
    _rule("spectral", "refused", {"implicit"}, "",
          refusal="a function of the eigenvalues of an operator known only through products needs its "
                  "eigendecomposition: use an explicit curvature (ga.fisher, ga.kfac, ga.ekfac) instead of "
                  "ga.hessian / ga.gauss_newton products"),
    # ---- kron_factor: how a K-FAC / EK-FAC factor is kept (recorded when the operator is built)
    _rule("kron_factor", "kronecker.diagonal_factor", {"kronecker"},
          "a Kronecker factor wider than ga.options(kron_diagonal_width) kept as its diagonal, the identity "
          "its eigenbasis (no d×d matrix, no eigendecomposition): exact for an embedding's one-hot inputs "
          "(token counts), diag(S) for a head's output gradients (their off-diagonal covariances dropped); "
          "EK-FAC re-fits the eigenvalues per coordinate in that basis", variant="diagonal"),
    # ---- scale: c·H
    _rule("scale", "scale", (), "c·H: the stored numbers (eigenvalues, diagonal, blocks) times c, "
                                "or c times every product"),
)

#: the rules of a sum A + B (see :func:`choose_sum`)
SUM_RULES: tuple[Rule, ...] = (
    _rule("add", "identity.sum", {"identity"}, "a·I + b·I = (a + b)·I"),
    _rule("add", "diagonal.sum", {"diagonal"}, "diag(u) + diag(v) = diag(u + v)"),
    _rule("add", "kronecker.plus_identity", {"kronecker"},
          "(Q_S⊗Q_A) Λ (Q_S⊗Q_A)ᵀ + c·I = (Q_S⊗Q_A)(Λ + c)(Q_S⊗Q_A)ᵀ (exact)"),
    _rule("add", "implicit.plus_identity", {"implicit"}, "c·H + λI + b·I: the shift grows by b"),
    _rule("add", "kronecker.sum_in_shared_eigenbasis", {"kronecker"},
          "two Kronecker operators with the same eigenbases: eigenvalues add"),
    _rule("add", "implicit.sum_of_products", {"implicit"}, "(A + B) x = A x + B x, lazily"),
    _rule("add", "kronecker.expand_to_block", {"kronecker"},
          "each layer's (out·in)² block (Q_S⊗Q_A) Λ (Q_S⊗Q_A)ᵀ, exact but (out·in)² numbers"),
    _rule("add", "kronecker.expand_to_dense", {"kronecker"}, "the full (dim, dim) matrix of a Kronecker operator"),
    _rule("add", "low-rank.expand_to_dense", {"low-rank"}, "V diag(μ) Vᵀ as a (dim, dim) matrix"),
    _rule("add", "block.sum", {"block"}, "block by block (a diagonal operand as its diagonal blocks)"),
    _rule("add", "dense.sum", {"dense"}, "M + N (every operand as its (dim, dim) matrix)"),
)

_DOCS = {r.name: r.doc for r in RULES + SUM_RULES if r.refusal is None}


def _describe_structure(structure) -> str:
    extra = sorted(set(structure) - {form_of(structure)})
    return form_of(structure) + (f" ({', '.join(extra)})" if extra else "")


def refuse(operation: str, structure, fix: str, what: str = "the operator"):
    """Raise the :class:`OperatorError` of an operation a structure cannot do exactly."""
    described = _describe_structure(structure)
    article = "an" if described[0] in "aeiou" else "a"
    raise OperatorError(f"cannot {operation} {what}: it is {article} {described} operator. {fix}")


def choose(operation: str, structure, *, variant: str | None = None, what: str = "the operator") -> Rule:
    """The rule that does ``operation`` on an operator with labels ``structure``
    (raising its refusal when the structure cannot do it exactly)."""
    structure = frozenset(structure)
    for r in RULES:
        if r.operation != operation or not r.needs <= structure:
            continue
        if r.variant is not None and variant != r.variant and (variant is not None or operation == "damp"):
            continue   # a variant rule only when asked for (the first one is the default, except damping's)
        if r.refusal is not None:
            refuse({"damp_relative": "damp relatively", "damp_auto": "damp automatically", "power": "take a power of",
                     "spectral": "apply a function of the eigenvalues of"}.get(operation, operation),
                   structure, r.refusal, what)
        return r
    raise OperatorError(f"no rule does {operation} on a {_describe_structure(structure)} operator")


def _named(name: str) -> Rule:
    return next(r for r in SUM_RULES if r.name == name)


def choose_sum(a, b, *, same_eigenbasis: bool = False) -> tuple[list[str], frozenset, bool]:
    """``(rule names, result structure, swapped)`` of A + B for labels ``a``, ``b``.

    ``swapped``: the rules act on B + A (the result is the same operator). Tags other
    than the form (``psd`` ...) are the caller's to combine."""
    a, b = frozenset(a), frozenset(b)
    fa, fb = form_of(a), form_of(b)

    def one(name, form, extra=()):
        return [name], frozenset({form, *extra})

    for left, right, swapped in ((a, b, False), (b, a, True)):
        fl = form_of(left)
        if "identity" in left and "identity" in right:
            return (*one("identity.sum", "diagonal", ("identity",)), False)
        if fl == "kronecker" and "identity" in right:
            return (*one("kronecker.plus_identity", "kronecker"), swapped)
        if fl == "implicit" and "identity" in right and not ({"inverse", "approximate-inverse"} & left):
            return (*one("implicit.plus_identity", "implicit"), swapped)
    if fa == fb == "diagonal":
        return (*one("diagonal.sum", "diagonal"), False)
    if fa == fb == "kronecker" and same_eigenbasis:
        return (*one("kronecker.sum_in_shared_eigenbasis", "kronecker"), False)
    if "implicit" in (fa, fb):
        return (*one("implicit.sum_of_products", "implicit"), fa != "implicit")
    target = "dense" if {"dense", "low-rank"} & {fa, fb} else "block"
    steps = []
    for f in (fa, fb):
        if f == "kronecker":
            steps.append(f"kronecker.expand_to_{target}")
        elif f == "low-rank":
            steps.append("low-rank.expand_to_dense")
    steps.append(f"{target}.sum")
    return steps, frozenset({target}), False


def describe_rule(name: str) -> str:
    """The math of the rule called ``name`` (for explain and docs)."""
    return _DOCS[name]
