"""Leaves over numbers kept outside the expression: a gradient store's rows and an
operator store's resolved numbers (``ga.store``).

``Stored`` is a :class:`Captured` (rows the executor reads chunk by chunk from
``store.chunks()``; the planner gives it a "captured" pass), with the row ids and block
representations of what was written. ``StoredOp`` is an operator leaf the executor
resolves by calling ``store.load()``. Both are pure data: their ``store`` objects know
where the numbers are, and their token is the store's, so two openings of one store
are the same node.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..linalg import Labels
from ..linalg.labels import from_short
from ..space import ParamSpace
from .grads import Captured
from .operators import OpNode

__all__ = ["Stored", "StoredOp"]


@dataclass(frozen=True, eq=False)
class Stored(Captured):
    """Rows kept outside the expression (a Zarr gradient store, or rows computed once).

    ``store`` has ``.n``, ``.ids``, ``.token``, ``.label`` and ``.chunks()`` (Chunks of
    flat (rows, dim) blocks); ``representation_`` is ((block, "projected" | "dense"), ...).
    """

    representation_: tuple = ()

    @property
    def ids(self):
        return self.store.ids

    @property
    def representation(self):
        rep = dict(self.representation_)
        return {b.name: rep.get(b.name, "dense") for b in self.space.blocks}

    @property
    def label(self):
        return f"stored({self.store.label}, n={self.n})"


@dataclass(frozen=True, eq=False)
class StoredOp(OpNode):
    """An operator whose numbers are kept outside the expression; ``store.load()`` gives
    them (a ResolvedOp, KronOp or LowRankOp)."""

    store: Any
    space_: ParamSpace
    structure_: str = "dense"

    @property
    def space(self):
        return self.space_

    def labels(self):
        """A compiled operator's labels and rules as it was resolved (``store.structure``,
        ``store.rules``), else those of its stored form; its eigenbasis is its own."""
        labels = getattr(self.store, "structure", None)
        labels = frozenset(labels) if labels is not None else from_short(self.structure_)
        return Labels(labels - {"psd"}, tuple(getattr(self.store, "rules", ())), ("stored", self.token))

    def statistics(self):
        return ()

    def resolve(self, ctx):
        return self.store.load()

    def apply_cost(self, space, n, prices):
        return prices.by_form(self.labels(), space, n)

    @property
    def label(self):
        return f"stored operator[{self.structure_}] ({self.store.label})"
