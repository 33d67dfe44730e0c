"""Errors of unrolled attribution (``ga.unroll``, ``ga.methods.magic`` / ``source``)."""
from __future__ import annotations

from ..errors import GradalgError

__all__ = ["NonDeterministicTrainingError", "UnsupportedOptimizerError", "UnsupportedTrainingError"]


class NonDeterministicTrainingError(GradalgError, RuntimeError):
    """A training run cannot be replayed exactly: its data order is not given, the model
    draws random numbers (dropout) without a seed, or a replayed step differs from the
    first run."""


class UnsupportedOptimizerError(GradalgError, TypeError):
    """An optimizer (or an option of one) that the unrolled replay cannot differentiate."""


class UnsupportedTrainingError(GradalgError, ValueError):
    """A model or training set-up that the unrolled replay cannot reproduce (batch
    statistics carried in buffers, for instance)."""
