"""Immutable expression nodes with structural identity.

A node is a frozen dataclass. Its ``token`` is a deterministic digest of its type and
operands (child nodes by token, values by repr, tensors by content or identity), so
equal sub-expressions are equal nodes: the executor computes each token once.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, fields
from functools import cached_property

import torch

__all__ = ["Node", "tokenize"]


def tokenize(value) -> str:
    """A deterministic string standing for ``value`` inside a node's identity."""
    if isinstance(value, Node):
        return value.token
    if isinstance(value, torch.Tensor):
        if value.device.type != "meta" and value.numel() <= 1_000_000:
            digest = hashlib.blake2b(value.detach().cpu().contiguous().numpy().tobytes(), digest_size=8).hexdigest()
            return f"tensor{tuple(value.shape)}{value.dtype}-{digest}"
        return f"tensor{tuple(value.shape)}{value.dtype}-id{id(value):x}"
    if isinstance(value, (tuple, list)):
        return "(" + ",".join(tokenize(v) for v in value) + ")"
    if hasattr(value, "token"):
        return str(value.token)
    return repr(value)


@dataclass(frozen=True, eq=False)
class Node:
    """Base of every expression node: equality and hashing by :attr:`token`."""

    @cached_property
    def token(self) -> str:
        parts = [type(self).__name__] + [f"{f.name}={tokenize(getattr(self, f.name))}" for f in fields(self)]
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

    def __repr__(self) -> str:
        # Compact on purpose: operands (models, datasets) are not printed; the user-facing
        # wrappers (GradientSet, Operator, Scores) render the whole tree.
        return f"<{type(self).__name__} {self.label!r} {self.token}>"
