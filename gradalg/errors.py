"""Exceptions that name the problem and the fix.

Every error a user can trigger with bad input is one of these, so notebooks can catch
``gradalg.GradalgError`` and tests can assert on the exact class.
"""
from __future__ import annotations

__all__ = [
    "GradalgError",
    "UnsupportedLayerError",
    "LossReductionError",
    "SpaceMismatchError",
    "NonFiniteGradientError",
    "ShapeMismatchError",
    "MemoryBudgetError",
    "StoreMismatchError",
    "StoreIncompleteError",
    "BatchContentError",
    "PerTokenError",
    "StoreCorruptError",
    "OptionError",
    "DataError",
    "WorkerFaultError",
    "ExampleIdsError",
    "OperatorError",
    "CurvatureError",
    "StaleCompiledError",
    "ObjectiveError",
    "DistributedError",
    "ModelMismatchError",
    "LayerNameError",
    "StoreNotFoundError",
]


class GradalgError(Exception):
    """Base class of every error gradalg raises on purpose."""


class UnsupportedLayerError(GradalgError, TypeError):
    """A layer was requested that hook capture cannot record per example."""


class LossReductionError(GradalgError, ValueError):
    """The task's loss is not a sum over the examples of a batch."""


class SpaceMismatchError(GradalgError, ValueError):
    """Two operands live in different parameter spaces (layers, shapes or projections)."""


class ShapeMismatchError(GradalgError, ValueError):
    """A tensor handed to gradalg has the wrong shape."""


class MemoryBudgetError(GradalgError, MemoryError):
    """An operation cannot be carried out within the memory budget."""


class ExampleIdsError(GradalgError, ValueError):
    """Captured rows cannot be labelled with the dataset examples they came from."""


class StoreMismatchError(GradalgError, ValueError):
    """A store (``ga.store``) was written from something else: another model, projector,
    layer list, objective, set of examples or chunking.

    Attributes
    ----------
    differences : list[str]
        One line per metadata field that differs, with both values.
    """

    def __init__(self, differences, fix: str):
        self.differences = list(differences)
        self.fix = fix
        super().__init__("the store does not match: " + "; ".join(self.differences) + f". {fix}.")

    def __reduce__(self):   # picklable (raised on a Dask worker, re-raised here)
        return type(self), (self.differences, self.fix)


class StoreIncompleteError(GradalgError, RuntimeError):
    """A store whose writing did not finish (or never started) was opened."""


class StoreNotFoundError(GradalgError, FileNotFoundError):
    """No store at the path given (``ga.store.open``, ``ga.store.verify``, ``gradalg inspect``)."""


class StoreCorruptError(GradalgError, OSError):
    """A store's files are damaged: a chunk is missing, truncated or fails its checksum,
    or its attributes contradict its data. The message names the files."""


class OptionError(GradalgError, ValueError, TypeError):
    """An option or argument is unknown or has an invalid value (wrong type or out of
    range). Both a ``ValueError`` and a ``TypeError``."""


class LayerNameError(OptionError, KeyError):
    """A layer name or glob pattern matches no module of the model (close names are
    suggested). Also a ``KeyError``."""

    def __str__(self):   # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class DataError(GradalgError, ValueError, TypeError):
    """The data cannot be attributed as given (no examples or no length, a shuffling or
    dropping loader, ids that do not match, a batch without a batch dimension). Both a
    ``ValueError`` and a ``TypeError``."""


class WorkerFaultError(GradalgError, RuntimeError):
    """A distributed pass could not finish: workers kept dying, a task stalled past its
    timeout (the worker is named), or the cluster has no workers left."""


class NonFiniteGradientError(GradalgError, FloatingPointError):
    """Per-example gradients contain NaN or inf.

    Attributes
    ----------
    example_ids : list
        Ids of the examples whose gradients are not finite.
    layers : list[str]
        Layers in which the non-finite values were found.
    """

    def __init__(self, example_ids, layers):
        self.example_ids = list(example_ids)
        self.layers = list(layers)
        shown = ", ".join(map(str, self.example_ids[:20]))
        more = "" if len(self.example_ids) <= 20 else f" (and {len(self.example_ids) - 20} more)"
        super().__init__(
            f"NaN/inf per-example gradients for example ids [{shown}]{more} in layers "
            f"{self.layers}. Check these examples' inputs and labels (an empty target, a "
            "log of zero, an overflow in half precision); remove them with a filtered "
            "dataset, or compute in float32/float64."
        )


class BatchContentError(GradalgError, ValueError):
    """A batch's fields cannot give the loss the task declares: a missing field, padding
    on the other side than the task assumes, a row with no real token, or a row none of
    whose labels count.

    Attributes
    ----------
    example_ids : list
        Ids of the offending examples (batch positions when the ids are not known).
    """

    def __init__(self, message: str, example_ids=()):
        self.example_ids = list(example_ids)
        self.message = message
        super().__init__(message)

    def __reduce__(self):   # picklable (raised on a Dask worker, re-raised here)
        return type(self), (self.message, self.example_ids)


class PerTokenError(GradalgError, ValueError):
    """Per-token rows (``G.per_token()``) cannot be built or computed exactly for these gradients."""


class OperatorError(GradalgError, ValueError):
    """An operation a resolved operator cannot do exactly for its structure (the inverse of
    a singular matrix, a fractional power of an indefinite one, a power of an operator known
    only through products, ...). The message names the structure and the fix."""


class CurvatureError(OperatorError):
    """Kronecker curvature kept in float32 (factors wider than
    ``ga.options(kron_float64_width)``) whose eigendecomposition is not accurate enough for
    what is asked of it: the eigensolver's residual or orthogonality check failed, or an
    inverse would divide by eigenvalues smaller than their own error. The message shows
    the arithmetic and the fixes (more damping, a projection, float64 factors)."""


class StaleCompiledError(GradalgError, RuntimeError):
    """A compiled expression (``ga.compile``) whose model weights changed since it was
    compiled, used with ``on_change="raise"``."""


class ObjectiveError(GradalgError, ValueError):
    """The optimizer's settings (weight decay, Adam state) cannot be read, or have no exact form
    in the requested space (``gradalg.objective``)."""


class DistributedError(GradalgError, RuntimeError):
    """A torch.distributed run cannot give exact results: no process group, ranks that
    planned different passes, a sharded model on a path that reads whole weights, or an
    error on another rank (named, with its message)."""


class ModelMismatchError(GradalgError, ValueError):
    """The model a Dask worker built or loaded from its factory
    (``DaskExecutor(model_fn=...)``) is not the client's: another architecture, other
    weights (both fingerprints are named), or workers that disagree with each other; or a
    pass needs the weights of a model the client holds on the ``meta`` device."""
