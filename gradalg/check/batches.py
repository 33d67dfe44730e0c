"""The batches ``ga.check_model`` compares: each example alone, and the examples together.

From the first ``n`` examples of the data (items of its dataset, batched by the data's own
``collate_fn``: a DataLoader's, else :func:`gradalg.collate.pad_collate`):

* **alone** ``i``: example i as a batch of one, without padding (a dict batch whose
  ``attention_mask`` has zeros at its ends is cut to its real tokens; when the examples are
  padded together, an alone batch without an ``attention_mask`` gets one of ones, as
  :func:`~gradalg.collate.pad_collate` gives padded batches);
* **together** (:class:`Together`): ``"collated"``, the n examples as the data's collate
  batches them; and, for dict batches of token ids that are padded (an ``attention_mask``,
  or items of unequal length), ``"right-padded"`` and ``"left-padded"``: the alone batches
  padded to one more position than the longest (so every row holds padding) on that side,
  ``labels`` with ``-100``, other token fields with 0, ``attention_mask`` 0 on the padding.

A side that the task refuses (``task.validate_batch`` raising a
:class:`~gradalg.errors.BatchContentError`: the ``ga.tasks`` language tasks accept one
padding side) is not compared; ``accepts`` says so.

Token fields: for an encoder-decoder model (``config.is_encoder_decoder``) the encoder's
``input_ids``, ``attention_mask`` and ``token_type_ids``; otherwise every field whose second
dimension is the ``input_ids`` length. Other fields of unequal shape are right-padded.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch.utils.data import DataLoader

from ..collate import PAD_VALUES, pad_collate
from ..data import as_data, batch_size_of
from ..errors import BatchContentError

__all__ = ["Examples", "Together", "examples_of", "together_batches"]

ENCODER_FIELDS = ("input_ids", "attention_mask", "token_type_ids")


@dataclass(frozen=True)
class Examples:
    """``ids`` (n,), ``alone`` (n batches of one), ``items`` and ``collate`` (the data's)."""

    ids: tuple
    alone: tuple
    items: tuple
    collate: object
    padded: bool            # dict items of token ids that carry or need padding


@dataclass(frozen=True)
class Together:
    """One batch of all the examples: ``name`` ("batch", "right-padded", "left-padded"),
    ``batch``, and ``synthetic`` (built by the check, not by the data's collate)."""

    name: str
    batch: object
    synthetic: bool


def examples_of(data, n: int, encoder_decoder: bool = False) -> Examples:
    """The first ``n`` examples of ``data`` (anything ``ga.grads`` takes)."""
    ref = as_data(data)
    source = ref.source
    dataset = source.dataset if isinstance(source, DataLoader) else source
    collate = (source.collate_fn if isinstance(source, DataLoader) and source.batch_size is not None
               else ref.collate_fn or pad_collate)
    n = min(n, ref.n)
    items = tuple(dataset[i] for i in range(n))
    alone = tuple(_unpad(collate([item]), encoder_decoder) for item in items)
    padded = all(isinstance(b, Mapping) and "input_ids" in b for b in alone) and (
        any("attention_mask" in b for b in alone) or len({_length(b) for b in alone}) > 1)
    if padded:   # as the data's collate does when it pads: an attention_mask of ones on each alone
        alone = tuple(b if "attention_mask" in b else {**b, "attention_mask": torch.ones_like(b["input_ids"])}
                      for b in alone)
    return Examples(tuple(ref.ids[:n]), alone, items, collate, padded)


def _length(batch) -> int:
    return batch["input_ids"].shape[1] if batch["input_ids"].dim() >= 2 else 1


def _token_fields(batch: Mapping, encoder_decoder: bool) -> list[str]:
    ids = batch["input_ids"]
    if ids.dim() < 2:
        return []
    T = ids.shape[1]
    names = ENCODER_FIELDS if encoder_decoder else tuple(batch)
    return [k for k in names if k in batch and isinstance(batch[k], torch.Tensor) and batch[k].dim() >= 2
            and batch[k].shape[0] == ids.shape[0] and batch[k].shape[1] == T]


def _unpad(batch, encoder_decoder: bool):
    """A one-example dict batch cut to the positions its ``attention_mask`` marks real (when
    those are contiguous); any other batch unchanged."""
    if not isinstance(batch, Mapping) or "attention_mask" not in batch or "input_ids" not in batch:
        return batch
    mask = batch["attention_mask"]
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or mask.shape[0] != 1:
        return batch
    real = torch.nonzero(mask[0].bool()).flatten()
    if len(real) == 0 or int(real[-1] - real[0]) + 1 != len(real):
        return batch          # empty or with holes: the task's own checks speak about it
    start, stop = int(real[0]), int(real[-1]) + 1
    fields = _token_fields(batch, encoder_decoder)
    return {k: (v[:, start:stop] if k in fields else v) for k, v in batch.items()}


def _pad_to(x: torch.Tensor, T: int, side: str, value) -> torch.Tensor:
    """``x`` (1, t, ...) padded along dim 1 to T positions on ``side``."""
    pad = T - x.shape[1]
    if pad <= 0:
        return x
    fill = x.new_full((x.shape[0], pad, *x.shape[2:]), value)
    return torch.cat([x, fill] if side == "right" else [fill, x], dim=1)


def _stack(values: list, key: str) -> torch.Tensor:
    """Batches of one stacked along dim 0, right-padding dim 1 where the shapes differ."""
    if not all(isinstance(v, torch.Tensor) for v in values):
        return values[0]
    if len({tuple(v.shape[1:]) for v in values}) > 1 and all(v.dim() >= 2 for v in values):
        T = max(v.shape[1] for v in values)
        values = [_pad_to(v, T, "right", PAD_VALUES.get(key, 0)) for v in values]
    return torch.cat(values, dim=0)


def padded_batch(alone, side: str, encoder_decoder: bool = False) -> dict:
    """The alone batches padded on ``side`` to one position more than the longest."""
    T = max(_length(b) for b in alone) + 1
    rows = []
    for b in alone:
        fields = _token_fields(b, encoder_decoder)
        row = dict(b)
        if "attention_mask" not in row:
            row["attention_mask"] = torch.ones_like(b["input_ids"])
            fields.append("attention_mask")
        for k in fields:
            row[k] = _pad_to(row[k], T, side, PAD_VALUES.get(k, 0))
        rows.append(row)
    return {k: _stack([r[k] for r in rows], k) for k in rows[0]}


def together_batches(examples: Examples, task, encoder_decoder: bool = False) -> tuple[list, dict]:
    """The :class:`Together` batches, and ``{side: message}`` for the padding sides the
    task refuses."""
    out = [Together("collated", examples.collate(list(examples.items)), False)]
    refused = {}
    if examples.padded and len(examples.alone) > 1:
        for side in ("right", "left"):
            batch = padded_batch(examples.alone, side, encoder_decoder)
            try:
                task.validate_batch(batch, examples.ids)
            except BatchContentError as err:
                refused[side] = str(err)
                continue
            out.append(Together(f"{side}-padded", batch, True))
    for t in out:
        if batch_size_of(t.batch) != len(examples.ids):
            raise BatchContentError(
                f"the data's collate_fn made a batch of {batch_size_of(t.batch)} rows from "
                f"{len(examples.ids)} examples: one row per example is needed to attribute "
                "gradients; return every example from collate_fn")
    return out, refused
