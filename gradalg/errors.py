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
    "ExampleIdsError",
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
