"""The operator floor: one protocol for every resolved operator, the one vocabulary of
operator structure, and the named rules of its algebra. Every resolved operator lives
here. Imports torch, :mod:`gradalg.errors` and the factored rows of
:mod:`gradalg.capture` (which a Kronecker operator applies to), so ``expr/``, ``exec/``,
``store/`` and ``curvature/`` all build on it.

``labels``       the vocabulary (``FORMS``, ``TAGS``) and ``Labels``, the algebra on labels alone
``LinearOp``     the protocol: apply, solve, inverse, power, damp, scale, add, nbytes, dense
``ResolvedOp``   explicit: a diagonal, one matrix per block, one dense matrix
``KronOp``       Kronecker (K-FAC / EK-FAC): per block Q_S, Q_A, Λ; rows flat or as factors
``LowRankOp``    V diag(μ) Vᵀ on a kept eigenspace
``ImplicitOp``   c·H + λI known through products; ``SolvedOp`` its CG / LiSSA inverse
``DataInfOp``    DataInf's closed-form inverse over a stream of training rows
``DampingRule``  automatic damping: λ_b per block from its own spectrum (``autodamp``)
``rules``        the named rules (``RULES``, ``choose``, ``choose_sum``, ``describe_rule``)
"""
from . import rules
from .autodamp import DampingRule
from .base import PSD_RTOL, SINGULAR_RTOL, LinearOp
from .datainf import DataInfOp
from .explicit import ResolvedOp, explicit
from .implicit import ImplicitOp, SolvedOp
from .kron import KronOp
from .labels import FORMS, SHORT, TAGS, VOCABULARY, Labels
from .lowrank import LowRankOp
from .rules import choose, choose_sum, describe_rule
from .sums import add

__all__ = ["DampingRule", "LinearOp", "ResolvedOp", "KronOp", "LowRankOp", "ImplicitOp", "SolvedOp", "DataInfOp", "explicit", "add",
           "rules", "Labels", "FORMS", "TAGS", "VOCABULARY", "SHORT",
           "choose", "choose_sum", "describe_rule", "PSD_RTOL", "SINGULAR_RTOL"]
