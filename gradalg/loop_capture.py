"""``ga.capture``: per-example gradients from any training loop that calls backward().

    with ga.capture(model, layers=["fc1", "fc2"], reduction="sum") as cap:
        for x, y in loader:
            opt.zero_grad()
            F.cross_entropy(model(x), y, reduction="sum").backward()
            opt.step()
    cap.grads            # GradientSet of every example seen, in order

The recording is :class:`~gradalg.capture.session.LoopRecorder`'s (on the capture floor:
it yields one :class:`~gradalg.capture.chunks.Chunk` per backward). This module sits above
the api and only turns those rows into GradientSets, so that the capture floor never
imports the objects users hold. (The module is not called
``capture``: ``gradalg.capture`` is the capture package, and ``ga.capture`` this function.)
"""
from __future__ import annotations

import warnings
from typing import Callable

from torch import nn

from .api import GradientSet
from .errors import OptionError
from .capture.session import CaptureStore, LoopRecorder
from .expr import Captured

__all__ = ["CaptureSession", "capture", "captured_grads"]


class CaptureSession:
    """The object bound by ``with ga.capture(...) as cap``. See :func:`capture`.

    ``recorder`` is the :class:`~gradalg.capture.session.LoopRecorder` that records the
    rows; ``model``, ``refs`` (the recorded blocks), ``space``, ``store`` and ``steps``
    are its.
    """

    def __init__(self, model: nn.Module, layers=None, *, reduction: str = "sum", keep: bool = True):
        self.recorder = LoopRecorder(model, layers, reduction=reduction, keep=keep)

    def on_batch(self, callback: Callable) -> Callable:
        """Call ``callback(grads)`` after each backward, with that step's GradientSet.

        Runs inside ``backward()``, before the optimizer step. Usable as a decorator.
        """
        self.recorder.on_chunk(lambda chunk: callback(captured_grads([chunk], self.space, self.model)))
        return callback

    @property
    def grads(self) -> GradientSet:
        """GradientSet of every example captured so far (requires ``keep=True``)."""
        return captured_grads(list(self.store.chunks_), self.space, self.model)

    @property
    def model(self) -> nn.Module:
        """The module being trained."""
        return self.recorder.model

    @property
    def refs(self) -> list:
        """The recorded blocks (:class:`~gradalg.capture.hooks.LayerRef`), in model order."""
        return self.recorder.refs

    @property
    def space(self):
        """The ParamSpace of the recorded blocks (the same as ``ga.grads`` gives)."""
        return self.recorder.space

    @property
    def store(self) -> CaptureStore:
        """Every step's rows kept so far (``keep=True``), in order."""
        return self.recorder.store

    @property
    def steps(self) -> int:
        """Backwards recorded so far."""
        return self.recorder.steps

    def __enter__(self):
        self.recorder.__enter__()
        return self

    def __exit__(self, *exc):
        return self.recorder.__exit__(*exc)


def captured_grads(chunks: list, space, model: nn.Module | None = None) -> GradientSet:
    """Recorded rows as a lazy GradientSet: a :class:`~gradalg.expr.Captured` leaf over the
    ``chunks`` (:class:`~gradalg.capture.chunks.Chunk`, in order) in ``space``, recorded
    from ``model`` (kept, so that the rows are refused beside another model's gradients or
    curvature; None: unknown, not checked). Shared by ``ga.capture`` and the training-time
    integrations."""
    return GradientSet(Captured(CaptureStore(chunks, model=model), space))


def capture(model: nn.Module, layers=None, *, reduction: str | None = None, keep: bool = True) -> CaptureSession:
    """Record per-example gradients around any loop that calls ``loss.backward()``.

    Parameters
    ----------
    model : the module being trained.
    layers : module names or glob patterns (default: every supported layer).
    reduction : how the loop's loss combines examples. ``"sum"`` gives true per-example
        gradients. ``"mean"`` (the usual ``F.cross_entropy`` default) scales each step's
        gradients by its batch size to undo the ``1/B``. ``ga.capture`` never sees the
        loop's loss, so it cannot check this (``ga.grads`` does): left unset, ``"sum"`` is
        assumed and a warning says so — a mean loss taken for a sum scales every score by
        ``1/B²``. Pass it explicitly.
    keep : keep every step's factors in memory for ``cap.grads`` (set False when only
        callbacks are needed).
    """
    if not isinstance(model, nn.Module):
        raise OptionError(f"ga.capture takes the torch.nn.Module being trained, got a {type(model).__name__}")
    if reduction is None:
        warnings.warn(
            "ga.capture cannot see the training loop's loss, so it cannot check how it combines the "
            "examples of a batch: it assumes a SUM over examples. If the loss is a mean (the default "
            "of F.cross_entropy and of most trainers), every captured gradient is 1/B too small and "
            "every score 1/B² too small: pass ga.capture(..., reduction='mean'); pass "
            "reduction='sum' to state that the loss is a sum (and silence this warning)",
            UserWarning, stacklevel=2)
        reduction = "sum"
    return CaptureSession(model, layers, reduction=reduction, keep=keep)
