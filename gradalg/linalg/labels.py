"""The one vocabulary of operator structure, and its algebra without numbers.

An operator's structure is a set of labels. Its *form*, exactly one of :data:`FORMS`,
says how its numbers are kept; its *tags*, any of :data:`TAGS`, add facts about it:

=====================  ==================================================================
``diagonal``           a (dim,) vector v: H = diag(v)
``block``              one (d_b, d_b) matrix per block (block-diagonal across layers)
``dense``              one (dim, dim) matrix over the whole space
``kronecker``          per block Q_S, Q_A and eigenvalues Λ (K-FAC / EK-FAC)
``low-rank``           V diag(μ) Vᵀ on a kept eigenspace (Arnoldi)
``implicit``           no numbers: known through products (Hessian, Gauss-Newton, DataInf)
``identity``           a multiple of the identity, c·I
``inverse``            an inverse applied by an iterative solver, (c·H + λI)⁻¹
``approximate-inverse``  an inverse known only by a closed form of products (DataInf)
``psd``                positive semi-definite
=====================  ==================================================================

Everything that names a structure uses these labels: a resolved
:class:`~gradalg.linalg.LinearOp`'s ``structure``, the rules of
:mod:`gradalg.linalg.rules`, an operator node's :meth:`~gradalg.expr.OpNode.labels`.
:data:`SHORT` is the one-word name of each form where a short word is shown or stored
(``Operator.structure``, ``LinearOp.kind``, an operator store's ``kind`` attribute).

:class:`Labels` is the structure an operator will have once resolved, with the rules
that make it and the eigenbasis it shares, computed from labels alone: its methods
(``damp``, ``inverse``, ``power``, ``spectral``, ``scale``, ``add``) pick the same named
rule the resolved operator's methods pick (:func:`~gradalg.linalg.rules.choose`), so the
rules a resolution will apply, and its refusals, are known before any data is read.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import OperatorError

__all__ = ["FORMS", "TAGS", "VOCABULARY", "SHORT", "form_of", "short_name", "from_short", "Labels"]

#: the labels that say how an operator's numbers are kept (exactly one per operator)
FORMS = ("diagonal", "block", "dense", "kronecker", "low-rank", "implicit")
#: the labels that add facts about an operator
TAGS = ("identity", "inverse", "approximate-inverse", "psd")
#: every label an operator's structure may carry
VOCABULARY = frozenset(FORMS + TAGS)
#: the one-word name of each form (and of the identity)
SHORT = {"diagonal": "diag", "block": "block", "dense": "dense", "kronecker": "kron", "low-rank": "lowrank",
         "implicit": "implicit", "identity": "identity"}


def form_of(structure) -> str:
    """The one label of ``structure`` that says how the numbers are kept."""
    for f in FORMS:
        if f in structure:
            return f
    raise OperatorError(f"structure {sorted(structure)} has no form label: give it one of {FORMS}")


def short_name(structure) -> str:
    """The one-word name of ``structure``: ``"identity"`` for a multiple of the identity,
    else its form's (``"diag"``, ``"block"``, ``"dense"``, ``"kron"``, ``"lowrank"``, ``"implicit"``)."""
    return "identity" if "identity" in structure else SHORT[form_of(structure)]


def from_short(word: str) -> frozenset:
    """The labels of the one-word name ``word`` (the inverse of :func:`short_name`)."""
    if word == "identity":
        return frozenset({"diagonal", "identity"})
    forms = {v: k for k, v in SHORT.items() if k in FORMS}
    if word not in forms:
        raise OperatorError(f"unknown structure {word!r}: use one of {sorted(SHORT.values())}")
    return frozenset({forms[word]})


@dataclass(frozen=True)
class Labels:
    """The structure an operator will have once resolved: its ``labels`` (a frozenset of
    :data:`VOCABULARY`), the names of the ``rules`` that make it, in order, and ``basis``,
    a key of the eigenbasis it shares with other operators (two K-FACs of the same
    gradients: ``("kfac", token)``) or None. Iterating it, or ``in``, reads ``labels``."""

    labels: frozenset
    rules: tuple = ()
    basis: object = None

    def __post_init__(self):
        object.__setattr__(self, "labels", frozenset(self.labels))
        object.__setattr__(self, "rules", tuple(self.rules))
        unknown = self.labels - VOCABULARY
        if unknown or sum(f in self.labels for f in FORMS) != 1:
            raise OperatorError(f"operator labels {sorted(self.labels)}: need exactly one form of {FORMS} and "
                                f"tags of {TAGS} only (unknown: {sorted(unknown)})")

    @classmethod
    def coerce(cls, value, owner: str = "an operator") -> "Labels":
        """``value`` as Labels: Labels as they are; a set, frozenset, list or tuple of labels,
        or one label string (``"diagonal"``), as Labels with no rules and no shared basis."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            value = {value}
        if isinstance(value, (set, frozenset, list, tuple)) and all(isinstance(v, str) for v in value):
            return cls(frozenset(value))
        raise OperatorError(f"{owner}.labels() returned {type(value).__name__} {value!r}: return "
                            f"ga.Labels({{'diagonal'}}) (one form of {FORMS}, tags of {TAGS}) or a set of "
                            "those label strings")

    def __iter__(self):
        return iter(self.labels)

    def __contains__(self, label) -> bool:
        return label in self.labels

    @property
    def form(self) -> str:
        """How the numbers are kept: the one form label (``diagonal``, ``kronecker``, ...)."""
        return form_of(self.labels)

    def _then(self, rule: str, labels=None) -> "Labels":
        return Labels(self.labels if labels is None else labels, self.rules + (rule,), self.basis)

    # ---- the algebra of LinearOp, on labels -------------------------------------------
    def damp(self, *, relative: bool = False, what: str = "the operator", auto: bool = False) -> "Labels":
        """H + λI (``relative``: λ a multiple of the mean eigenvalue; ``auto``: λ_b per block
        from its spectrum)."""
        from .rules import choose
        if auto:
            out = self._then(choose("damp_auto", self.labels, what=what).name)
        else:
            out = self._then(choose("damp_relative", self.labels, what=what).name) if relative else self
        return out._then(choose("damp", self.labels, variant="exact", what=what).name)

    def inverse(self, method: str | None = None, what: str = "the operator") -> "Labels":
        """H⁻¹ (``method``: the solver of an operator known only through products)."""
        from .rules import choose
        rule = choose("inverse", self.labels, variant=method, what=what).name
        labels = self.labels
        if rule.startswith("implicit.solve"):
            labels = labels | {"inverse"}           # (c·H + λI)⁻¹, applied by a solver
        elif rule == "implicit.inverse_of_solve":
            labels = labels - {"inverse"}           # back to the products
        return self._then(rule, labels)

    def power(self, p: float, what: str = "the operator") -> "Labels":
        """H^p: p = 1 is H, p = -1 the inverse."""
        from .rules import choose
        if p == 1:
            return self
        if p == -1:
            return self.inverse(what=what)
        return self._then(choose("power", self.labels, what=what).name)

    def spectral(self, what: str = "the operator") -> "Labels":
        """f(H) for a scalar function f of the eigenvalues (f may be negative: no ``psd``)."""
        from .rules import choose
        return self._then(choose("spectral", self.labels, what=what).name, self.labels - {"psd"})

    def scale(self) -> "Labels":
        """c · H."""
        from .rules import choose
        return self._then(choose("scale", self.labels).name)

    def add(self, other: "Labels") -> "Labels":
        """self + other, by the sum rules (:func:`~gradalg.linalg.rules.choose_sum`)."""
        from .rules import choose_sum
        same = self.basis is not None and self.basis == other.basis
        steps, result, _ = choose_sum(self.labels, other.labels, same_eigenbasis=same)
        identity = {"identity"} if "identity" in self.labels and "identity" in other.labels else set()
        basis = (self.basis if self.basis is not None else other.basis) if "kronecker" in result else None
        return Labels(result | identity, self.rules + other.rules + tuple(steps), basis)
