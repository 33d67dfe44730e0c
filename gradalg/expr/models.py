"""Refusing products of gradients (or curvature) computed from different models.

``Q @ G.T`` or ``Q @ ga.fisher(G2).inv() @ G.T`` with ``G2`` from another model of the
same shapes type-checks (the parameter spaces agree) but means nothing: each example's
gradient lives in the tangent space of *its* model. :func:`check_same_models` raises a
:class:`SpaceMismatchError` when the two operands share no model — none of the same
object, no parameter held by both (a model and its DDP / compile / PEFT wrapper hold
the same ones), none with the same fingerprint (module tree and weights, see
:mod:`gradalg.fingerprint`). Operands without a model (stores, captured rows, resolved
numbers) are not checked. ``ga.options(check_models=False)`` turns the check off (e.g.
to compare a fine-tuned model's query gradients with the base model's on purpose).
"""
from __future__ import annotations

from ..errors import SpaceMismatchError

__all__ = ["check_same_models"]


def _models(node) -> dict:
    from .grads import Source
    return {id(x.task.model): x.task for x in node.walk() if isinstance(x, Source)}


def _parameter_ids(tasks: dict) -> set:
    return {id(p) for t in tasks.values() for p in t.model.parameters()}


def check_same_models(a, b, what: str) -> None:
    """Raise unless ``a`` and ``b`` (nodes) share a model, or one of them has none."""
    from ..options import get_options
    if not get_options().check_models:
        return
    left, right = _models(a), _models(b)
    if not left or not right or set(left) & set(right):
        return
    if _parameter_ids(left) & _parameter_ids(right):
        return  # a model and its wrapper (DDP, torch.compile, PEFT) hold the same parameters
    from ..capture.wrappers import unwrap
    from ..fingerprint import model_digest
    # a wrapper (DDP, torch.compile) of an equal copy is the same model
    fl = {model_digest(unwrap(t.model)[0]): t for t in left.values()}
    fr = {model_digest(unwrap(t.model)[0]): t for t in right.values()}
    if set(fl) & set(fr):
        return
    names = lambda d: ", ".join(sorted({f"{t.name} ({k[6:18]})" for k, t in d.items()}))  # noqa: E731
    raise SpaceMismatchError(
        f"{what} come from different models: {names(fl)} vs {names(fr)} (same shapes, other weights). "
        "Gradients of one model are not comparable with another's: build both from the same model "
        "(or the same checkpoint), or pass ga.options(check_models=False) if this is intended")
