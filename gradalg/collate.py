"""Batching examples of unequal length.

:func:`pad_collate` is the collate function gradalg's own loaders use. Items that are
dicts of tensors (HF style: ``input_ids``, ``attention_mask``, ``labels``, ...) whose
lengths differ are **right-padded** (:func:`left_pad_collate`: left-padded, for a task
made with ``padding_side="left"``) to the longest item of the batch: ``labels`` with
``-100`` (ignored by every loss), every other field (``input_ids``, ``attention_mask``,
``completion_mask``, ...) with 0, so padding is never a real token (attention_mask 0)
and never a counted label. Items without an ``attention_mask`` get one when they are
padded (ones over each item's own length, zeros over the padding, as HF's
``DataCollatorWithPadding`` does). Fields given as numpy arrays or lists of numbers (an HF
dataset without torch format) are read as tensors first: without it the model and the loss would read the
padding as tokens and an example's gradient would depend on its batch. Equal-length
items, tuples and tensors go to PyTorch's ``default_collate`` unchanged.

:class:`DictDataset` turns already-batched dict tensors ``{"input_ids": (N, T), ...}``
into a dataset of N dict items.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch
from torch.utils.data import Dataset, default_collate

from .errors import BatchContentError, DataError

__all__ = ["pad_collate", "left_pad_collate", "DictDataset", "PAD_VALUES"]

#: padding value per field; fields not named here pad with 0
PAD_VALUES = {"labels": -100}
"""Padding value per field (``labels`` pad with -100, ignored by the loss); other fields pad with 0."""


def pad_collate(items: list, padding_side: str = "right"):
    """Stack ``items`` into a batch, padding dict fields of unequal length on
    ``padding_side`` ("right" or "left").

    A field is padded along its first dimension (the token axis of an item) when its
    items differ there; the value is ``PAD_VALUES.get(field, 0)``.   (B, T_max, ...)
    When a field is padded and the items have no ``attention_mask``, one is added:
    ``mask[b, t] = t < T_b`` on the right, ``t ≥ T_max − T_b`` on the left, with ``T_b``
    item b's length (of ``input_ids`` when present, else of the first padded field).
    (B, T_max), int64
    """
    if not items or not isinstance(items[0], Mapping):
        return _stack(items)
    items = [{k: _as_tensor(v) for k, v in item.items()} if isinstance(item, Mapping) else item for item in items]
    keys = [set(item) for item in items]
    if any(k != keys[0] for k in keys):
        odd = sorted(set.union(*keys) - set.intersection(*keys))
        raise BatchContentError(f"the items of a batch have different fields: {odd} are in some only; "
                                "give every item the same fields")
    _check_aligned(items)
    out, lengths = {}, None
    for key in items[0]:
        values = [item[key] for item in items]
        if all(isinstance(v, torch.Tensor) and v.dim() >= 1 for v in values) and \
                len({tuple(v.shape) for v in values}) > 1:
            if len({tuple(v.shape[1:]) for v in values}) > 1:
                raise BatchContentError(f"field {key!r} differs in more than its first dimension across "
                                        f"the items of a batch: {sorted({tuple(v.shape) for v in values})}; "
                                        "give every item's field the same shape after the token axis")
            out[key] = torch.nn.utils.rnn.pad_sequence(values, batch_first=True, padding_side=padding_side,
                                                       padding_value=PAD_VALUES.get(key, 0))
            if lengths is None or key == "input_ids":
                lengths = torch.tensor([v.shape[0] for v in values])
        else:
            out[key] = _stack(values)
    if lengths is not None and "attention_mask" not in out:
        longest = int(lengths.max())
        positions = torch.arange(longest).unsqueeze(0)
        real = positions < lengths.unsqueeze(1) if padding_side == "right" else positions >= longest - lengths.unsqueeze(1)
        out["attention_mask"] = real.long()
    return out


def left_pad_collate(items: list):
    """:func:`pad_collate` padding on the left: the batching of a task made with
    ``padding_side="left"`` (``ga.tasks.causal_lm``, ``ga.tasks.sequence_classification``),
    which gradalg's own loaders use for it when the data brings no ``collate_fn``."""
    return pad_collate(items, padding_side="left")


def _stack(values: list):
    """PyTorch's ``default_collate``, its errors (an item that is None, a string among
    tensors, tensors of unequal shapes that are not dict fields) as a BatchContentError."""
    try:
        return default_collate(values)
    except (TypeError, RuntimeError) as err:
        kinds = sorted({type(v).__name__ for v in values})
        raise BatchContentError(
            f"the items of a batch cannot be stacked ({kinds}: {err}): an example must be a tensor, a number, "
            "or a dict / tuple of them, with equal shapes across examples (dict fields of unequal length "
            "are padded); pass a collate_fn for anything else") from err


def _as_tensor(value):
    """A numpy array, or a list of numbers (an HF dataset without torch format), as a
    tensor, so items of unequal length are padded like tensors; anything else unchanged."""
    if type(value).__module__ == "numpy" and getattr(value, "dtype", None) is not None \
            and value.dtype.kind in "biuf":
        return torch.as_tensor(value)
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, (int, float)) for v in value):
        return torch.as_tensor(value)
    return value


#: fields with one entry per token of ``input_ids`` in every item
ALIGNED_FIELDS = ("attention_mask", "token_type_ids", "completion_mask")


def _check_aligned(items: list) -> None:
    """Refuse an item whose ``attention_mask`` (or ``token_type_ids``, ``completion_mask``)
    has another length than its ``input_ids``: padded to the batch's longest, the mask would
    count padding as tokens (or drop tokens) without any error."""
    for position, item in enumerate(items):
        ids = item.get("input_ids")
        if not isinstance(ids, torch.Tensor) or ids.dim() < 1:
            continue
        if ids.shape[0] == 0:
            raise BatchContentError(f"item {position} of a batch has no tokens (empty 'input_ids'): drop empty "
                                    "sequences from the data")
        for key in ALIGNED_FIELDS:
            value = item.get(key)
            if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] != ids.shape[0]:
                raise BatchContentError(
                    f"item {position} of a batch has {value.shape[0]} entries of {key!r} for {ids.shape[0]} "
                    f"tokens of 'input_ids': give {key!r} one entry per token (the same length as input_ids)")


class DictDataset(Dataset):
    """Dict tensors with the examples along dim 0, as a dataset of dict items."""

    def __init__(self, fields: Mapping):
        fields = dict(fields)
        sizes = {k: v.shape[0] for k, v in fields.items() if isinstance(v, torch.Tensor)}
        if not sizes:
            raise DataError("a dict batch needs tensor fields with the examples along dim 0, got "
                                    f"{ {k: type(v).__name__ for k, v in fields.items()} }")
        if len(set(sizes.values())) > 1:
            raise DataError(f"the fields of a dict batch have different numbers of examples: {sizes}; "
                                    "give every field the same first dimension (one entry per example)")
        self.fields = fields
        self.n = next(iter(sizes.values()))

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {k: v[i] if isinstance(v, torch.Tensor) else v for k, v in self.fields.items()}
