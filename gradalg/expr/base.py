"""Immutable expression nodes with structural identity.

A node is a frozen dataclass. Its ``token`` is a deterministic digest of its type and
operands (child nodes by token, values by repr, tensors by a digest of all their values,
see :mod:`gradalg.fingerprint`), so equal sub-expressions are equal nodes: the executor
computes each token once. Tokens are the same in every process that builds the same
expression (a job unpickled on a Dask worker keeps its identity).
"""
from __future__ import annotations

import hashlib
from abc import ABC
from dataclasses import dataclass, fields, replace
from functools import cached_property

import torch

from ..fingerprint import stable_token

__all__ = ["Node", "tokenize", "transform"]


def tokenize(value) -> str:
    """A deterministic string standing for ``value`` inside a node's identity."""
    if isinstance(value, Node):
        return value.token
    if isinstance(value, torch.Tensor):
        return stable_token(value)   # every value hashed (cached per tensor version): no size threshold
    if isinstance(value, (tuple, list)):
        return "(" + ",".join(tokenize(v) for v in value) + ")"
    if hasattr(value, "token"):
        return str(value.token)
    return repr(value)


@dataclass(frozen=True, eq=False)
class Node(ABC):
    """Base of every expression node: equality and hashing by :attr:`token`."""

    @cached_property
    def token(self) -> str:
        # a field with metadata {"identity": False} (a display note) is not part of the identity
        parts = [type(self).__name__] + [f"{f.name}={tokenize(getattr(self, f.name))}" for f in fields(self)
                                         if f.metadata.get("identity", True)]
        digest = hashlib.blake2b("|".join(parts).encode(), digest_size=6).hexdigest()
        return f"{type(self).__name__.lower()}-{digest}"

    def __eq__(self, other):
        return type(self) is type(other) and self.token == other.token

    def __hash__(self):
        return hash(self.token)

    @property
    def children(self) -> tuple["Node", ...]:
        """Operand nodes, in field order."""
        out = []
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Node):
                out.append(value)
            elif isinstance(value, tuple):
                out.extend(v for v in value if isinstance(v, Node))
        return tuple(out)

    def walk(self):
        """This node and all nodes below it, each once (pre-order)."""
        seen = set()
        stack = [self]
        while stack:
            node = stack.pop()
            if node.token in seen:
                continue
            seen.add(node.token)
            yield node
            stack.extend(reversed(node.children))

    @property
    def label(self) -> str:
        """One-line description used by reprs."""
        return type(self).__name__

    def adjust_rebuild(self, changes: dict) -> dict:
        """Hook for :func:`transform`: fix up fields that depend on rebuilt operands."""
        return changes

    def __repr__(self) -> str:
        # Compact on purpose: operands (models, datasets) are not printed; the user-facing
        # wrappers (GradientSet, Operator, Scores) render the whole tree.
        return f"<{type(self).__name__} {self.label!r} {self.token}>"


def transform(node: Node, fn) -> Node:
    """Rebuild ``node`` bottom-up, replacing each rebuilt node ``x`` by ``fn(x)`` (or
    keeping it when ``fn`` returns None). Pure: returns new nodes, shares unchanged ones.
    """
    memo: dict[str, Node] = {}

    def visit(x: Node) -> Node:
        if x.token in memo:
            return memo[x.token]
        changes = {}
        for f in fields(x):
            value = getattr(x, f.name)
            if isinstance(value, Node):
                new = visit(value)
                if new is not value:
                    changes[f.name] = new
            elif isinstance(value, tuple) and any(isinstance(v, Node) for v in value):
                new = tuple(visit(v) if isinstance(v, Node) else v for v in value)
                if any(a is not b for a, b in zip(new, value)):
                    changes[f.name] = new
        if changes:
            changes = x.adjust_rebuild(changes)
        rebuilt = replace(x, **changes) if changes else x
        out = fn(rebuilt)
        memo[x.token] = rebuilt if out is None else out
        return memo[x.token]

    try:
        return visit(node)
    finally:
        del visit   # visit's cell holds visit: a cycle keeping memo's nodes and fn (an executor's) for the cyclic GC
