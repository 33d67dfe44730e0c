"""The planner's decisions as typed records: what was decided, about what, and why.

A :class:`Decision` is one choice the planner made, with every alternative it weighed:

    kind          DecisionKind: which question (held side, kernel per block, ...)
    subject       what it is about: a node's token (``inner-38a5…``), a projector's token,
                  a pass key (:mod:`~gradalg.plan.passkeys`) for a pass's batch size, or
                  ``(index, pass key)`` for where a pass runs and its shards
    block         the parameter block it is about (a kernel, a Kronecker factor), or None
    chosen        the winner, as the plan shows it ("ghost", "store", "left (query) rows")
    alternatives  {name: estimated seconds (a float) or a description (a str)}, the
                  winner among them where it was costed
    reason        why the winner won, with the thresholds (``ga.options`` fields) it used
    source        DecisionSource: who chose: the planner (by cost or a rule), or forced by
                  the caller's ``Choices(...)`` or by a ``ga.options`` field
    setting       the forcing setting as written, ``"store='never'"`` (``""`` for the planner)
    label         the subject as a reader names it (a node's label): display only

Look decisions up by their fields, never by their wording::

    plan.decisions.of(DecisionKind.KERNEL, block="transformer.h.0.mlp.c_fc")   # [Decision]
    plan.decisions.one(DecisionKind.HELD_SIDE)                                 # exactly one

Code reads whether a choice was forced from ``source``, never from the wording::

    [d for d in plan.decisions.of("store") if d.source is DecisionSource.CHOICES]

The text and HTML of ``explain()`` are rendered from the fields (:meth:`Decision.title`,
:meth:`Decision.explanation`: ``forced by Choices(store='never'); <reason>``).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping

from ..errors import PlanError
from .passkeys import PassKey

__all__ = ["Decision", "DecisionKind", "DecisionSource", "Decisions"]


class DecisionKind(enum.Enum):
    """Every kind of decision the planner records; the value is its title's template
    (``{label}``: the subject as a reader names it, ``{block}``: the block)."""

    HELD_SIDE = "held side of {label}"                          # which side of a score is held
    HELD_STORAGE = "storage of held rows {label}"               # factors or flat, held rows
    STORED_STORAGE = "storage of stored rows {label}"           # factors or flat, stored rows
    LOW_RANK = "rank of held rows {label}"                      # rank-r factors of held rows
    KERNEL = "kernel for block {block} of {label}"              # ghost or dense, per block
    NORMALIZATION = "normalization of {label}"                  # in the score kernel or row-wise
    STORE = "second use of {label}"                             # store or recompute rows used twice
    BATCH_SIZE = "batch size of {label}"                        # examples per batch of a pass
    TRIM = "free memory returned after the batches of {label}"  # trim the resident set per batch, or never
    KRON_PRECISION = "precision of the Kronecker factors of block {block}"   # float32 or float64
    KRON_DIAGONAL = "structure of the Kronecker factors of block {block}"    # diagonal or dense
    PROJECTION_MAP = "projection map {label}"                   # dense, sparse JL or TensorSketch
    PLACEMENT = "where {label} runs"                            # here (client, every rank) or on shards
    SHARDS = "shards of {label}"                                # shard tasks of a pass on Dask workers
    CURVATURE = "curvature of {label}"                          # formed Hessian or Gauss-Newton (near a minimum)
    PRODUCTS_BATCHING = "batching of the vectors of {label}"     # one vmap over a call's vectors, or a loop
    WINDOWS = "windows of the rows {label} reads when applied"   # rows per window read outside a pass (DataInf)

    @classmethod
    def coerce(cls, kind) -> "DecisionKind":
        """``kind`` as a member: a member, or its name in any case (``"kernel"``); anything
        else raises :class:`~gradalg.errors.PlanError` listing the kinds."""
        if isinstance(kind, cls):
            return kind
        if isinstance(kind, str) and kind.upper() in cls.__members__:
            return cls[kind.upper()]
        raise PlanError(f"no decision kind {kind!r}: use one of DecisionKind."
                        f"{{{', '.join(cls.__members__)}}} (or its name, e.g. 'kernel')")

    def title(self, label: str = "", block: str = "") -> str:
        """The kind's title with the subject's ``label`` and the ``block`` filled in:
        ``DecisionKind.KERNEL.title("scores", "'fc1'")`` is ``"kernel for block 'fc1' of scores"``."""
        return self.value.format(label=label, block=block)


class DecisionSource(enum.Enum):
    """Who made a decision; the value is how its explanation names the forcing call."""

    PLANNER = "planner"          # by cost, or by a rule with its thresholds (in the reason)
    CHOICES = "Choices"          # forced by the caller's Choices(...) (an executor's choices=)
    OPTIONS = "ga.options"       # forced by a ga.options field (ghost=, row_storage=)


@dataclass(frozen=True)
class Decision:
    """A choice the planner made: its kind, subject and block, the winner, every
    alternative with its estimated seconds (or a description where it was not costed), and
    the reason. Immutable: ``alternatives`` is a read-only mapping."""

    kind: DecisionKind
    subject: str | tuple | PassKey
    chosen: str
    alternatives: Mapping[str, float | str]
    reason: str = ""
    block: str | None = None
    label: str = ""
    source: DecisionSource = DecisionSource.PLANNER
    setting: str = ""

    def __post_init__(self):
        object.__setattr__(self, "kind", DecisionKind.coerce(self.kind))
        object.__setattr__(self, "alternatives", MappingProxyType(dict(self.alternatives)))
        if not isinstance(self.source, DecisionSource):
            raise PlanError(f"Decision.source must be a DecisionSource ({', '.join(DecisionSource.__members__)}), "
                            f"got {self.source!r}")
        if (self.source is DecisionSource.PLANNER) != (not self.setting):
            raise PlanError(f"a decision forced by {self.source.value} names its setting (setting='store=...'); "
                            f"one by the planner has none: got source={self.source.name}, setting={self.setting!r}")

    def __reduce__(self):      # picklable (plans travel to Dask workers): the mapping as a dict
        return (Decision, (self.kind, self.subject, self.chosen, dict(self.alternatives), self.reason,
                           self.block, self.label, self.source, self.setting))

    @property
    def forced(self) -> bool:
        """Whether the caller forced it (``Choices(...)`` or a ``ga.options`` field)."""
        return self.source is not DecisionSource.PLANNER

    def explanation(self) -> str:
        """The reason as the plan shows it: ``forced by Choices(store='never'); <reason>``
        when forced, else the reason."""
        forced = f"forced by {self.source.value}({self.setting})" if self.forced else ""
        return "; ".join(x for x in (forced, self.reason) if x)

    def title(self, block: str | None = None) -> str:
        """What was decided, as a reader names it: ``kernel for block 'fc1' of scores``.
        ``block``: how to show the block (default: its name, quoted)."""
        shown = block if block is not None else (repr(self.block) if self.block is not None else "")
        return self.kind.title(self.label, shown)

    def to_dict(self) -> dict:
        """Plain data: the kind's name, the subject (a pass key as ``[kind, *fields]``, a
        placement's as ``[index, [kind, *fields]]``), the block, the winner, the alternatives,
        the reason as shown (:meth:`explanation`), who decided (``"planner"``, ``"choices"``,
        ``"options"``) and the forcing setting."""
        subject = _plain(self.subject)
        return {"kind": self.kind.name.lower(), "subject": subject, "block": self.block, "what": self.title(),
                "chosen": self.chosen, "alternatives": dict(self.alternatives), "reason": self.explanation(),
                "source": self.source.name.lower(), "setting": self.setting}


def _plain(subject):
    """A decision's subject as plain data (JSON)."""
    if isinstance(subject, PassKey):
        return subject.to_data()
    return [_plain(x) for x in subject] if isinstance(subject, tuple) else subject


class Decisions(list):
    """The plan's decisions in the order they were made, looked up by their fields."""

    def of(self, kind: DecisionKind | str, block: str | None = None, subject=None) -> list[Decision]:
        """The decisions of ``kind`` (a :class:`DecisionKind`, or its name: ``"kernel"``)
        about ``block`` (a block name; ``0`` reads as ``"0"``) and ``subject`` when given,
        in the order they were made."""
        kind = DecisionKind.coerce(kind)
        block = None if block is None else str(block)
        return [d for d in self if d.kind is kind and (block is None or d.block == block)
                and (subject is None or d.subject == subject)]

    def one(self, kind: DecisionKind | str, block: str | None = None, subject=None) -> Decision:
        """The one decision of ``kind`` (about ``block`` and ``subject`` when given); a
        :class:`~gradalg.errors.PlanError` (also a ``KeyError``) names the decisions there
        are when there is none or several."""
        found = self.of(kind, block, subject)
        if len(found) == 1:
            return found[0]
        about = "".join(f", {k}={v!r}" for k, v in (("block", block), ("subject", subject)) if v is not None)
        there = sorted({(d.kind.name, d.block or "") for d in self})
        raise DecisionLookupError(
            f"{len(found)} decisions of kind {DecisionKind.coerce(kind).name}{about} (want exactly one): pass block= or subject= "
            f"to pick one, or use plan.decisions.of(...) for all; the plan has {there}")


class DecisionLookupError(PlanError, KeyError):
    """No decision, or several, matches a :meth:`Decisions.one` lookup."""

    def __str__(self) -> str:   # the message, not KeyError's quoted repr of it
        return str(self.args[0]) if self.args else ""
