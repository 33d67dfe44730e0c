"""Resolved operators as the executor holds them: every one is a
:class:`gradalg.linalg.LinearOp` (explicit ``ResolvedOp``, Kronecker ``KronOp``,
``LowRankOp``, ``ImplicitOp`` / ``SolvedOp``, DataInf's), whose algebra goes by the
named rules of :mod:`gradalg.linalg.rules`. Resolution of operator nodes into them is
:mod:`gradalg.exec.resolve`."""
from __future__ import annotations

from ..linalg import LinearOp, ResolvedOp

__all__ = ["ResolvedOp", "LinearOp"]
