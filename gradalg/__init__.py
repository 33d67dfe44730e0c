"""gradalg: training data attribution with lazy per-example gradient algebra.

    import gradalg as ga
    task = ga.tasks.classification(model)
    G = ga.grads(task, train, layers=["fc1", "fc2"])
    Q = ga.grads(task, test, layers=["fc1", "fc2"])
    P = ga.proj.kron(k=64)
    S = P(Q) @ ga.fisher(P(G)).damp(1e-3).inv() @ P(G).T
    S.compute()          # xarray.DataArray (query, train)
"""
from . import collate, devices, eval, integrations, methods, proj, store, tasks, viz, widgets  # noqa: A004 - ga.eval, the evaluation subpackage
from .api import (GradientSet, Operator, Scores, SelfScores, TransposedGradients, adam_state, arnoldi, datainf, dense, diagonal,
                  ekfac, fisher, gauss_newton, grads, hessian, identity, kfac, mean_scores, row_weights,
                  sum_scores)
from .capture import per_example_grads
from .loop_capture import capture  # ga.capture, the function (gradalg.capture stays the package in sys.modules)
from .compiled import Compiled, compile  # noqa: A004 - ga.compile(S): compile once, score many queries
from .errors import (BatchContentError, GradalgError, LossReductionError, MemoryBudgetError, NonFiniteGradientError, NonFiniteWeightError, PerTokenError,
                     ShapeMismatchError, SpaceMismatchError, StoreIncompleteError, StoreMismatchError,
                     UnsupportedLayerError)
from .errors import DataError, ObjectiveError, OptionError, StoreCorruptError, WorkerFaultError  # noqa: E402
from .errors import CurvatureError, DistributedError, ModelMismatchError, OperatorError, StaleCompiledError  # noqa: E402
from .errors import IdMismatchError  # noqa: E402 - results paired by id whose ids differ
from .errors import HeadMismatchError, PartialGradientError  # noqa: E402
from .errors import NoForwardADError  # noqa: E402 - no forward-mode AD through an op of the model
from .exec import LocalExecutor
from . import fingerprint  # noqa: E402 - ga.fingerprint.forget(model) after writes through .data
from . import unroll  # noqa: E402 - ga.unroll.TrainingRun, replayed by ga.methods.magic / source
from . import report  # noqa: E402 - ga.report: S.to_html(path), one self-contained page
from .objective import training_objective
from .expr import OpNode, ResolveContext, Statistic  # noqa: E402 - the operator protocol (docs/contributing.md)
from .linalg import Labels, LinearOp, ResolvedOp  # noqa: E402 - what an operator node resolves to
from .check import ModelCheckError, check_model  # noqa: E402 - ga.check_model(task, data) before a long run
from .options import get_options, options
from .integrations.trajectory import trajectory  # noqa: E402 - ga.trajectory: TracIn per training step
from .task import ExampleRandom, Task, TransformerBlocks

sum = sum_scores  # noqa: A001 - ga.sum / ga.mean read like the math
"""``ga.sum(scores_list, weights=None)`` is :func:`sum_scores`: Σ_k w_k S_k, one lazy Scores."""
mean = mean_scores
"""``ga.mean(scores_list)`` is :func:`mean_scores`: (1/K) Σ_k S_k, e.g. an ensemble over checkpoints."""

from .version import __version__  # noqa: E402

__all__ = [
    "Task", "TransformerBlocks", "grads", "fisher", "adam_state", "SelfScores", "kfac", "ekfac", "hessian", "gauss_newton", "arnoldi", "datainf", "identity", "diagonal", "dense", "sum", "mean", "sum_scores",
    "mean_scores", "row_weights", "capture", "per_example_grads", "options", "get_options",
    "GradientSet", "Operator", "Scores", "TransposedGradients", "LocalExecutor", "methods", "proj",
    "tasks", "viz", "devices", "integrations", "GradalgError", "LossReductionError", "MemoryBudgetError", "NonFiniteGradientError", "NonFiniteWeightError",
    "ShapeMismatchError", "SpaceMismatchError", "UnsupportedLayerError", "NoForwardADError", "store", "StoreMismatchError",
    "StoreIncompleteError", "BatchContentError", "PerTokenError", "StoreCorruptError", "OptionError",
    "DataError", "WorkerFaultError", "fingerprint", "compile", "Compiled", "OperatorError", "CurvatureError", "DistributedError", "ModelMismatchError",
    "StaleCompiledError", "unroll", "training_objective", "ObjectiveError", "check_model", "ModelCheckError",
    "IdMismatchError", "report", "OpNode", "ResolveContext", "Statistic", "Labels", "LinearOp", "ResolvedOp",
    "HeadMismatchError", "PartialGradientError", "trajectory",
]
