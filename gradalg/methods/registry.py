"""The registry of published methods: one entry per method, written where the method is.

A method is a function in its own file of ``gradalg/methods/`` that returns lazy
:class:`~gradalg.api.Scores` (an expression over the gradient algebra), decorated with
:func:`method`::

    @method("Grad-Dot: ⟨∇L(q), ∇L(z)⟩ (Charpiat et al. 2019)", cli=True)
    def grad_dot(task, train, queries, *, layers=None, projector=None) -> Scores: ...

The decorator is the one registration: ``ga.methods.<name>``, the catalogue
``ga.methods.list()`` / :data:`~gradalg.methods.CATALOGUE` and the command line's method
table (``gradalg score``, ``cli=True``: methods that take one task, train and queries) read
:data:`REGISTRY`. ``gradalg/methods/__init__.py`` imports every module of the package, so a
new file needs no other edit there. ``tests/test_contributing.py`` checks each entry
(docs/contributing.md, "A method").
"""
from __future__ import annotations

from ..errors import OptionError

from dataclasses import dataclass
from typing import Callable

__all__ = ["Method", "REGISTRY", "method"]


@dataclass(frozen=True)
class Method:
    """One published method: its ``name`` (``ga.methods.<name>``), the function ``fn``, the
    one-line ``summary`` of the catalogue (its formula and reference), and ``cli``: whether
    ``gradalg score`` runs it (it takes one task, train and queries)."""

    name: str
    fn: Callable
    summary: str
    cli: bool = False


#: every registered method, by name, in registration order (the catalogue's order)
REGISTRY: dict[str, Method] = {}


def method(summary: str, *, name: str | None = None, cli: bool = False) -> Callable[[Callable], Callable]:
    """Register the decorated function as the method ``name`` (default: the function's name)
    with its catalogue line ``summary``; ``cli=True`` lists it in ``gradalg score``'s table.
    Returns the function unchanged."""
    def register(fn: Callable) -> Callable:
        key = name or fn.__name__
        if key in REGISTRY and REGISTRY[key].fn is not fn:
            raise OptionError(f"a method named {key!r} is already registered ({REGISTRY[key].fn.__module__}); "
                             "give the new one another name")
        REGISTRY[key] = Method(key, fn, summary, cli)
        return fn
    return register
