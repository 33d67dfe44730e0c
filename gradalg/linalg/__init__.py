"""The operator floor: one protocol for every resolved operator, and the named rules of
its algebra. Imports only torch (and :mod:`gradalg.errors`), so ``exec/``, ``store/``
and ``curvature/`` all build on it.

``LinearOp``     the protocol: apply, solve, inverse, power, damp, scale, add, nbytes, dense
``ResolvedOp``   explicit: a diagonal, one matrix per block, one dense matrix
``LowRankOp``    V diag(μ) Vᵀ on a kept eigenspace
``ImplicitOp``   c·H + λI known through products; ``SolvedOp`` its CG / LiSSA inverse
``rules``        the named rules (``RULES``, ``choose``, ``choose_sum``, ``describe_rule``)

The Kronecker operator (K-FAC / EK-FAC) is :class:`gradalg.curvature.kron.KronOp`, a
LinearOp whose rows may come as factors.
"""
from . import rules
from .base import PSD_RTOL, SINGULAR_RTOL, LinearOp
from .explicit import ResolvedOp, explicit
from .implicit import ImplicitOp, SolvedOp
from .lowrank import LowRankOp
from .rules import choose, choose_sum, describe_rule
from .sums import add

__all__ = ["LinearOp", "ResolvedOp", "LowRankOp", "ImplicitOp", "SolvedOp", "explicit", "add", "rules",
           "choose", "choose_sum", "describe_rule", "PSD_RTOL", "SINGULAR_RTOL"]
