"""Contrastive queries: the behaviour's loss minus a control's, as one query example.

"Which training documents made the model say *this* rather than *that*?" is asked with a
query whose loss is a difference: for a pair (b_q, c_q) of a behaviour and a control
(the completion and a reference completion of one prompt, say)

    ℓ_q(θ) = L(b_q; θ) − L(c_q; θ),        ∇ℓ_q = ∇L(b_q) − ∇L(c_q)       (d,)

so every score a method forms from query gradients (Grad-Dot gᵢᵀ ∇ℓ_q, influence
gᵢᵀ H⁻¹ ∇ℓ_q, TRAK / LoGra with projected rows P ∇ℓ_q) is the behaviour's score minus the
control's, exactly (every method is linear in the query gradient).

Two pieces, and every method works unchanged:

* :func:`contrast_pairs` ``(behaviour, control, batch_size=None)`` pairs two query sets
  **by position** (query q is ``(behaviour[q], control[q])``; the counts must match) into a
  ``DataLoader`` whose batches carry both sides (each side batched by gradalg's
  :func:`~gradalg.collate.pad_collate`, so the sides are padded separately);
* :func:`contrastive` ``(task)`` is ``task`` whose loss (and TRAK output) on such a paired
  batch is the behaviour's minus the control's, and on any other batch is ``task``'s own:
  pass it to a method as the task, the training data as usual and the pairs as queries::

      pairs = ga.tasks.contrast_pairs(completions, references)
      S = ga.methods.influence(ga.tasks.contrastive(task), train, pairs)

Hook capture records the two forward passes of a paired batch as two calls of each layer
(concatenated along the token axis, like a tied layer's): a query's factored gradient has
T_b + T_c token rows, the control's with its output gradient negated, so nothing is
approximated and the planner sees the factored width it costs. On paired batches the
token mask is not applied (the two sides have their own lengths): padding positions carry
a zero output gradient (their targets never count and attention masks them out), so the
gradients are unchanged. Curvature objectives (``sampled`` / ``expected``) and TRAK's
per-row ``output_weight`` are refused on pairs: a difference of losses is a query, never
training data.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from ..collate import pad_collate
from ..data import as_data, batch_size_of
from ..errors import BatchContentError, DataError, OptionError
from ..task import Task

__all__ = ["contrastive", "contrast_pairs", "ContrastPairs", "is_pair_batch", "split_pair"]

#: key of the marker field of a paired batch, (B, T_b + T_c) int8 ones (see :func:`pair_collate`)
MARKER = "__gradalg_contrast__"
SIDES = ("behaviour", "control")


class ContrastPairs(Dataset):
    """Query q is the item pair ``(behaviour[q], control[q])``; refuses unequal counts."""

    def __init__(self, behaviour, control):
        self.behaviour, self.control = _items(behaviour, "behaviour"), _items(control, "control")
        nb, nc = len(self.behaviour), len(self.control)
        if nb != nc:
            raise DataError(f"ga.tasks.contrast_pairs: {nb} behaviour queries but {nc} controls: queries are "
                            "paired by position, so give one control per behaviour (repeat a shared control "
                            "with [control] * len(behaviour))")
        if nb == 0:
            raise DataError("ga.tasks.contrast_pairs: no queries: give at least one behaviour and its control")

    def __len__(self):
        return len(self.behaviour)

    def __getitem__(self, q):
        return self.behaviour[q], self.control[q]


def _items(data, side: str):
    """``data`` as an indexable sequence of examples (a list, a Dataset, tensors)."""
    if isinstance(data, Dataset) or (isinstance(data, Sequence) and not isinstance(data, (str, bytes, tuple))):
        return data
    source = as_data(data).source      # tensors, a tuple of tensors, dict of batched tensors
    if isinstance(source, DataLoader):
        raise DataError(f"ga.tasks.contrast_pairs: the {side} is a DataLoader: pass its dataset (or a list of "
                        "items); the pairs are batched together")
    return source


def pair_collate(pairs: list) -> dict:
    """Batch a list of ``(behaviour_item, control_item)``: each side by ``pad_collate``,
    flattened into one dict (``"behaviour/" + key`` …) after the marker field, so
    gradalg slices, moves and counts it as any dict batch.  Top-level: picklable."""
    out = {}
    for s, side in enumerate(SIDES):
        out.update(_flatten(side, pad_collate([pair[s] for pair in pairs])))
    return {MARKER: torch.ones(len(pairs), _positions(out), dtype=torch.int8), **out}


def _positions(flat: dict) -> int:
    """T_b + T_c: the token axes of the two sides (1 for a side without one, e.g. flat
    features). The marker is (B, T_b + T_c) and comes first, so the planner, which reads
    the first tensor of an example's batch for its positions per example, costs the
    factored width a paired query really has (both forward calls' tokens, concatenated)."""
    total = 0
    for side in SIDES:
        first = next(v for k, v in flat.items() if k == side or k.startswith((side + "/", side + "#")))
        total += first.shape[1] if first.dim() == 2 and not first.is_floating_point() else 1
    return total


def _flatten(side: str, batch) -> dict:
    if isinstance(batch, torch.Tensor):
        return {side: batch}
    if isinstance(batch, Mapping):
        return {f"{side}/{k}": v for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return {f"{side}#{i}": v for i, v in enumerate(batch)}
    raise DataError(f"ga.tasks.contrast_pairs: a {side} batch is a {type(batch).__name__}: items must be tensors, "
                    "dicts or tuples of tensors")


def is_pair_batch(batch) -> bool:
    """Whether ``batch`` is a paired (behaviour, control) batch of :func:`pair_collate`."""
    return isinstance(batch, Mapping) and MARKER in batch


def split_pair(batch) -> tuple[Any, Any]:
    """The (behaviour, control) batches of a paired batch, in their own structure."""
    sides = []
    for side in SIDES:
        if side in batch:
            sides.append(batch[side])
        elif any(k.startswith(side + "/") for k in batch):
            sides.append({k[len(side) + 1:]: v for k, v in batch.items() if k.startswith(side + "/")})
        else:
            n = sum(1 for k in batch if k.startswith(side + "#"))
            sides.append(tuple(batch[f"{side}#{i}"] for i in range(n)))
    return sides[0], sides[1]


def contrast_pairs(behaviour, control, *, batch_size: int | None = None) -> DataLoader:
    """Queries ``(behaviour[q], control[q])`` paired by position, as a ``DataLoader``
    (``batch_size`` pairs per batch; default 8) of paired batches for :func:`contrastive`
    tasks. ``behaviour`` and ``control``: lists of items, Datasets, tensors or tuples of
    tensors, with the same number of examples (else a :class:`DataError`)."""
    if batch_size is not None and (not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1):
        raise OptionError(f"batch_size must be a positive int, got {batch_size!r}")
    return DataLoader(ContrastPairs(behaviour, control), batch_size=batch_size or 8, shuffle=False,
                      collate_fn=pair_collate)


def _refuse_pairs(name: str, fn):
    if fn is None:
        return None

    def plain_only(model, batch, *rest):
        if is_pair_batch(batch):
            raise OptionError(f"ga.tasks.contrastive: {name} of a paired (behaviour, control) batch is not defined: "
                              "contrastive pairs are queries; pass them as `queries` and the training data "
                              "(plain items) as `train` / curvature data")
        return fn(model, batch, *rest)
    return plain_only


def _difference(fn):
    if fn is None:
        return None

    def paired(model, batch, *rest):
        if is_pair_batch(batch):
            b, c = split_pair(batch)
            return fn(model, b, *rest) - fn(model, c, *rest)
        return fn(model, batch, *rest)
    return paired


def contrastive(task: Task, *, name: str | None = None) -> Task:
    """``task`` whose loss on a paired batch (:func:`contrast_pairs`) is
    Σ_q L(b_q) − L(c_q) and on any other batch is ``task``'s own (module docstring).

    ``output`` and ``weighted_output`` (TRAK's query and training sides) are differenced
    the same way; ``sampled_loss``, ``expected_terms``, ``output_weight`` and
    ``forward`` / ``loss_from_outputs`` (curvature and per-row weights) are ``task``'s on
    plain batches and refused on pairs. Everything else (reduction, checks, default
    layers, curvature objective) is ``task``'s."""
    if not isinstance(task, Task):
        raise OptionError(f"ga.tasks.contrastive needs a ga.Task, got {type(task).__name__}")
    loss, reduction = task.loss, task.reduction

    def summed(model, batch):      # the base loss as a sum over examples (its reduction applied)
        value = loss(model, batch)
        return value * batch_size_of(batch) if reduction == "mean" else value

    def token_mask(batch):
        if is_pair_batch(batch):
            return None            # two sides, two lengths; padding has zero output gradient (docstring)
        return task.token_mask(batch)

    def check_batch(batch, ids=None):
        if is_pair_batch(batch):
            for side_name, side in zip(SIDES, split_pair(batch)):
                try:
                    task.validate_batch(side, ids)
                except BatchContentError as err:   # which side of the pairs is at fault
                    raise BatchContentError(f"the {side_name} side of contrastive queries: {err.message}",
                                            err.example_ids) from err
            return batch
        task.validate_batch(batch, ids)
        return batch

    return Task(task.model, _difference(summed), reduction="sum",
                token_mask=token_mask if task.token_mask is not None else None,
                sampled_loss=_refuse_pairs("the sampled loss", task.sampled_loss),
                output=_difference(task.output),
                output_weight=_refuse_pairs("TRAK's per-row output weight", task.output_weight),
                expected_terms=_refuse_pairs("the expected (Gauss-Newton) terms", task.expected_terms),
                weighted_output=_difference(task.weighted_output),
                curvature_objective=task.curvature_objective, check_batch=check_batch,
                forward=_refuse_pairs("the model's outputs (forward)", task.forward),
                loss_from_outputs=task.loss_from_outputs, default_layers=task.default_layers,
                name=name or f"contrastive({task.name})")
