"""Choices forced on the planner instead of costed.

The planner decides, by estimated cost, which side of a score is held (and
preconditioned) and whether rows needed again after a pass's statistics are stored or
recaptured. :class:`Choices` fixes those decisions: the differential tests run every
method under every combination and compare with the dense reference, and a user can
pin a plan while measuring. A forced decision is recorded in the plan like a costed
one, its alternatives still shown, its reason saying it was forced.

>>> import gradalg as ga
>>> ga.exec.LocalExecutor(choices=ga.plan.Choices(held="right", store="never"))  # doctest: +ELLIPSIS
<gradalg.exec.local.LocalExecutor object at ...>
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import OptionError

__all__ = ["Choices"]

@dataclass(frozen=True)
class Choices:
    """Decisions the planner takes as given.

    Attributes
    ----------
    held : {"auto", "left", "right"}
        The side of every score kept in memory (and preconditioned): ``"auto"`` the
        smaller footprint, ``"left"`` the queries, ``"right"`` the training rows.
    store : {"auto", "always", "never"}
        Rows a later pass needs after statistics from the pass that reads them (the
        training side of an influence after its Fisher): ``"auto"`` by cost under a
        quarter of the memory budget, ``"always"`` kept in memory, ``"never"`` read again.
    """

    held: str = "auto"
    store: str = "auto"

    def __post_init__(self):
        for name, allowed in (("held", ("auto", "left", "right")), ("store", ("auto", "always", "never"))):
            if getattr(self, name) not in allowed:
                raise OptionError(f"Choices({name}=...) must be one of {allowed}, got {getattr(self, name)!r}")
