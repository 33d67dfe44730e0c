"""Refusing products of gradients (or curvature) computed from different models.

``Q @ G.T`` or ``Q @ ga.fisher(G2).inv() @ G.T`` with ``G2`` from another model of the
same shapes type-checks (the parameter spaces agree) but means nothing: each example's
gradient lives in the tangent space of *its* model. :func:`check_same_models` raises a
:class:`SpaceMismatchError` when the two operands share no model — none of the same
object, no parameter held by both (a model and its DDP / compile / PEFT wrapper hold
the same ones), none with the same fingerprint (module tree and weights, see
:mod:`gradalg.fingerprint`). A store (``ga.store``: gradient rows, an operator) stands
for the models it was written from by the fingerprints it recorded (``model_digest``),
so a store of model A next to model B's gradients is refused as the in-memory operands
are. Rows recorded by ``ga.capture`` or the training integrations stand for the module they
were recorded from. Operands without a model (resolved numbers, stores written before
the fingerprint was recorded) are not checked. ``ga.options(check_models=False)`` turns the check off (e.g.
to compare a fine-tuned model's query gradients with the base model's on purpose).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import SpaceMismatchError

__all__ = ["check_same_models"]


@dataclass(frozen=True)
class _Recorded:
    """A model known only as the one rows were recorded from (``ga.capture``, the training
    integrations): named like a task for the error message."""

    model: object
    name: str = "captured rows"


def _models(node) -> dict:
    """{id(model): its task (or :class:`_Recorded`)} of every leaf of ``node`` with a model:
    ``ga.grads`` sources and captured rows that recorded theirs."""
    from .grads import Captured, Source
    out = {}
    for x in node.walk():
        if isinstance(x, Source):
            out[id(x.task.model)] = x.task
        elif isinstance(x, Captured) and getattr(x.store, "model", None) is not None:
            out.setdefault(id(x.store.model), _Recorded(x.store.model))
    return out


def _stored_digests(node) -> set:
    """Model fingerprints recorded by the stores among ``node``'s leaves (``ga.store``)."""
    out = set()
    for x in node.walk():
        summary = getattr(getattr(x, "store", None), "summary", None)
        if isinstance(summary, dict):
            out.update(summary.get("model_digest") or ())
    return out


def _digests(tasks: dict) -> dict:
    from ..capture.wrappers import unwrap
    from ..fingerprint import stable_model_digest
    out = {}
    for t in tasks.values():
        d = stable_model_digest(unwrap(t.model)[0])
        if d is not None:
            out[d] = t
    return out


def _check_stores(left: dict, right: dict, a, b, what: str) -> None:
    """The check when a side's models are known only by a store's recorded fingerprints."""
    sl, sr = _stored_digests(a), _stored_digests(b)
    if not (sl or sr):
        return
    dl, dr = {**{d: None for d in sl}, **_digests(left)}, {**{d: None for d in sr}, **_digests(right)}
    if not dl or not dr or set(dl) & set(dr):
        return

    def names(d):
        return ", ".join(sorted(f"{t.name} ({k[6:18]})" if t is not None else f"a store ({k[6:18]})"
                                for k, t in d.items()))
    raise SpaceMismatchError(
        f"{what} come from different models: {names(dl)} vs {names(dr)} (the store recorded the fingerprint "
        "of the model it was written from: same shapes, other weights). Use the store written from this "
        "model (or write one: ga.store.write / write_operator with overwrite=True), or pass "
        "ga.options(check_models=False) if this is intended")


def _parameter_ids(tasks: dict) -> set:
    return {id(p) for t in tasks.values() for p in t.model.parameters()}


def check_same_models(a, b, what: str) -> None:
    """Raise unless ``a`` and ``b`` (nodes) share a model, or one of them has none."""
    from ..options import get_options
    if not get_options().check_models:
        return
    left, right = _models(a), _models(b)
    if not left or not right:
        _check_stores(left, right, a, b, what)
        return
    if set(left) & set(right):
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
