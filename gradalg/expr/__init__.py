"""Lazy expression nodes: pure data, no computation."""
from .base import Node, tokenize
from .grads import (AdamPrecondition, AdamState, Captured, GradNode, GroupMean, Normalize, Precondition,
                    Project, RowWeights, RowWise, ScaleRows, Select, Source)
from .operators import (AutoDamp, Damp, Dense, Diagonal, Fisher, Identity, Inverse, OpNode, Power, ResolveContext, ScaledOp,
                        Statistic, SumOp)
from .projection import Projector
from .scores import Diagonal as ScoreDiagonal
from .scores import Inner, ScoreNode, ScoreSum
from .curvature import KFAC, Arnoldi, CurvatureProducts, DataInf, Formed, NearMinimum
from .tokens import PerToken, PerTokenError
from .lowrank import LowRank
from ..space import Block, ParamSpace  # the shape types (gradalg/space.py), with the nodes that carry them
