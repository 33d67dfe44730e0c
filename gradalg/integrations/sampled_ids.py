"""The dataset indices of each training batch, read from the dataloader's batch sampler.

A training loop's ``DataLoader`` asks its batch sampler for each batch's indices in the
main process (also with worker processes), in the order the batches come out
(``in_order=True``, the default). :class:`SampledIds` records each index list the sampler
yields on this process (under accelerate's DDP sharding, ``BatchSamplerShard`` yields this
rank's batches) into a queue; the integration takes the next one at each training forward.

Alignment is checked, never assumed: the number of indices must equal the forward's rows,
and with ``verify=True`` each row's tokens (``input_ids`` where ``attention_mask`` is 1)
must equal its example's ``input_ids`` from the dataset (a prefix or a suffix of it, for
truncation) whenever the dataset's items carry ``input_ids``. A mismatch raises
:class:`~gradalg.errors.ExampleIdsError` naming the row and the index. A collator that
drops examples (fewer rows than indices) is followed when each remaining row's tokens
match exactly one of the batch's examples, in order (a warning names the dropped
indices); otherwise the count mismatch is refused.

A DataLoader over an ``IterableDataset`` also has a batch sampler, but it yields
``[None, None, ...]``: the stream decides which examples come, so :meth:`SampledIds.install`
refuses it (the integrations then number rows in order, or read an index column).

A resumed run's first epoch skips the batches already trained (Trainer wraps the sampler
in accelerate's ``SkipBatchSampler``, which draws them from the recorded sampler and drops
them); :meth:`SampledIds.resume_skip` drops the same number from the queue.
"""
from __future__ import annotations

import warnings
from collections import deque
from collections.abc import Mapping

import torch

from ..errors import ExampleIdsError

__all__ = ["SampledIds", "is_iterable"]


def is_iterable(loader) -> bool:
    """Whether ``loader`` (a DataLoader, or accelerate's wrapper of one) streams an IterableDataset."""
    dataset = getattr(loader, "dataset", None)
    base = getattr(loader, "base_dataloader", None)
    return (isinstance(dataset, torch.utils.data.IterableDataset)
            or isinstance(getattr(base, "dataset", None), torch.utils.data.IterableDataset))


class SampledIds:
    """A queue of the index lists a batch sampler yielded, consumed one per training forward."""

    def __init__(self, loader, batch_sampler, verify: bool):
        self.loader = loader
        self.batch_sampler = batch_sampler
        self.verify = verify
        self.queue: deque = deque()
        self.drop = 0            # batches to discard at the start of the next epoch (resume)
        self._cls = type(batch_sampler)

    @classmethod
    def install(cls, loader, *, verify: bool = True, repeats: bool = False) -> "SampledIds":
        """Record ``loader``'s batch sampler (its class is swapped for a recording subclass)."""
        bs = getattr(loader, "batch_sampler", None)
        if loader is None or bs is None:
            raise ExampleIdsError(
                "ids='sampler' needs a training DataLoader with a batch sampler over a map-style dataset; this "
                f"run's is {type(loader).__name__} with {type(bs).__name__} (an IterableDataset, or batches "
                "dispatched from one process). Add an index column to the dataset and pass ids='<column>' "
                "with remove_unused_columns=False, or ids=None")
        inner = getattr(bs, "batch_sampler", bs)
        sampler = getattr(inner, "sampler", None)
        if is_iterable(loader) or type(sampler).__name__ == "_InfiniteConstantSampler":
            # a DataLoader over an IterableDataset still has a batch sampler, but it yields
            # [None, None, ...]: the stream, not the sampler, decides which examples come
            raise ExampleIdsError(
                f"ids='sampler' needs a map-style dataset, but the training DataLoader streams an IterableDataset "
                f"({type(getattr(loader, 'dataset', None)).__name__}): it has no indices to sample. Add an index "
                "column to each example and pass ids='<column>' with TrainingArguments(remove_unused_columns="
                "False), or ids=None (rows numbered in the order the stream yields them)")
        if not repeats and (type(sampler).__name__ == "RepeatSampler" or type(bs).__name__ == "RepeatSampler"):
            raise ExampleIdsError(
                "TRL's GRPOTrainer generates completions for a buffer of sampled prompts and shuffles the buffer "
                "before its forwards, so the sampler's order is not the forwards' order: use "
                "gradalg.integrations.grpo.grpo_ids(trainer) before trainer.train()")
        self = cls(loader, bs, verify)
        base = type(bs)

        def __iter__(sampler_self):
            for batch in base.__iter__(sampler_self):
                if self.drop > 0:
                    self.drop -= 1
                else:
                    self.queue.append(list(batch))
                yield batch

        bs.__class__ = type(f"Recording{base.__name__}", (base,), {"__iter__": __iter__, "__module__": __name__})
        return self

    def remove(self) -> None:
        """Give the batch sampler its own class back."""
        if type(self.batch_sampler) is not self._cls:
            self.batch_sampler.__class__ = self._cls

    def resume_skip(self, global_step: int, accumulation: int, *, ignore_data_skip: bool = False) -> None:
        """Trainer resumed at ``global_step``: its first epoch skips ``(global_step mod
        steps_per_epoch) · accumulation`` batches (``transformers.Trainer._init_training_state``)."""
        if global_step <= 0 or ignore_data_skip:
            return
        length = len(self.loader)
        per_epoch = max(length // accumulation + int(length % accumulation > 0), 1)
        self._resume_drop = (global_step % per_epoch) * accumulation

    def new_epoch(self) -> None:
        """A new pass over the dataloader: batches prefetched past the last step never ran."""
        self.queue.clear()
        self.drop, self._resume_drop = getattr(self, "_resume_drop", 0), 0

    def next_batch(self, rows: int | None, kwargs: dict) -> list:
        """The indices of the forward about to run (``rows`` examples, model inputs ``kwargs``)."""
        if not self.queue:
            raise ExampleIdsError(
                "a training forward ran but the train dataloader's sampler has yielded no batch for it: the "
                "batches do not come from the recorded dataloader (a custom training loop or data feed). Pass "
                "ids='<column>' with an index column, or ids=None")
        ids = self.queue.popleft()
        if rows is not None and rows < len(ids) and self.verify:
            kept = self._match_dropped(ids, rows, kwargs)
            if kept is not None:
                return kept
        if rows is not None and rows != len(ids):
            raise ExampleIdsError(
                f"the forward has {rows} rows but its sampled batch has {len(ids)} examples (first: {ids[:5]}): "
                "rows are not examples (packing, or a collator that splits or joins examples). Turn packing "
                "off, or label rows with an index column (ids='<column>')")
        if self.verify:
            self._check_tokens(ids, kwargs)
        return ids

    def _match_dropped(self, ids: list, rows: int, kwargs: dict) -> list | None:
        """A collator dropped examples (``rows < len(ids)``): the sampled indices of the rows
        left, matched by their tokens, in order. None where that cannot be decided: the
        dataset's items carry no ``input_ids``, two sampled examples have the same tokens,
        a row matches no example or several, or the rows are out of the sampled order (then
        the count mismatch is refused)."""
        input_ids = kwargs.get("input_ids")
        dataset = getattr(self.loader, "dataset", None)
        if not torch.is_tensor(input_ids) or dataset is None:
            return None
        wants = []
        for i in ids:
            item = dataset[i]
            if not isinstance(item, Mapping) or "input_ids" not in item:
                return None
            wants.append(torch.as_tensor(item["input_ids"]).reshape(-1).cpu())
        if len({tuple(w.tolist()) for w in wants}) < len(wants):
            return None      # identical examples: which one was dropped cannot be told
        mask = kwargs.get("attention_mask")
        kept, last = [], -1
        for r in range(rows):
            row = input_ids[r].reshape(-1).cpu()
            if torch.is_tensor(mask) and mask.shape == input_ids.shape:
                row = row[mask[r].reshape(-1).cpu().bool()]
            hits = [j for j, want in enumerate(wants) if _same_tokens(row, want)]
            if len(hits) != 1 or hits[0] <= last:
                return None  # no example, or several (one a prefix of another), or out of order
            last = hits[0]
            kept.append(ids[last])
        dropped = [i for i in ids if i not in set(kept)]
        warnings.warn(f"GradientCallback: the collator dropped {len(dropped)} of the {len(ids)} sampled examples of "
                      f"this batch (dataset indices {dropped[:10]}); the remaining rows are labelled by their "
                      "tokens, and the dropped examples have no row", stacklevel=2)
        return kept

    def _check_tokens(self, ids: list, kwargs: dict) -> None:
        input_ids = kwargs.get("input_ids")
        dataset = getattr(self.loader, "dataset", None)
        if not torch.is_tensor(input_ids) or dataset is None:
            return
        mask = kwargs.get("attention_mask")
        for r, i in enumerate(ids):
            item = dataset[i]
            if not isinstance(item, Mapping) or "input_ids" not in item:
                return  # the dataset's items are not tokenized: nothing to compare
            want = torch.as_tensor(item["input_ids"]).reshape(-1).cpu()
            row = input_ids[r].reshape(-1).cpu()
            if torch.is_tensor(mask) and mask.shape == input_ids.shape:
                row = row[mask[r].reshape(-1).cpu().bool()]
            if not _same_tokens(row, want):
                raise ExampleIdsError(
                    f"row {r} of this training forward does not hold the tokens of dataset example {i}, the index "
                    "the sampler gave it: the dataloader's batches and the sampler are out of step (or the "
                    "collator rewrites input_ids). Label rows with an index column (ids='<column>'), or pass "
                    "verify_ids=False if the collator changes the tokens on purpose")


def _same_tokens(row: torch.Tensor, want: torch.Tensor) -> bool:
    """A row's tokens are its example's: equal, or a prefix or suffix of it (truncation, padding)."""
    k = min(len(row), len(want))
    return k > 0 and (torch.equal(row[:k], want[:k]) or torch.equal(row[-k:], want[-k:]))
