"""Turning user data into batches, and batches into examples.

A *batch* is whatever the user's loss takes: a tensor, a tuple/list of tensors or a
dict of tensors (HF style), each with the examples along dimension 0.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
import hashlib
import itertools
import os
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any, Callable, Iterator

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset

from .collate import DictDataset, pad_collate
from .errors import DataError, OptionError
from .options import plain
from .fingerprint import callable_fingerprint, object_fingerprint, stable_token, tensor_digest

__all__ = ["DataRef", "batch_size_of", "slice_batch", "move_batch", "as_data", "data_fingerprint"]


def batch_size_of(batch: Any) -> int:
    """Number of examples in ``batch`` (size of dim 0 of its first tensor)."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[0]
    if isinstance(batch, Mapping):
        for value in batch.values():
            if isinstance(value, torch.Tensor):
                return value.shape[0]
    if isinstance(batch, Sequence) and not isinstance(batch, str):
        for value in batch:
            if isinstance(value, torch.Tensor) or isinstance(value, (Mapping, Sequence)):
                return batch_size_of(value)
    raise DataError(
        f"cannot find the batch dimension of a {type(batch).__name__}: a batch must be a "
        "tensor, or a tuple/list/dict of tensors with the examples along dimension 0"
    )


def slice_batch(batch: Any, index) -> Any:
    """The examples ``index`` (a slice, int list or tensor) of ``batch``, same structure."""
    if isinstance(batch, torch.Tensor):
        return batch[index]
    if isinstance(batch, Mapping):
        return {k: slice_batch(v, index) for k, v in batch.items()}
    if isinstance(batch, tuple):
        return tuple(slice_batch(v, index) for v in batch)
    if isinstance(batch, list):
        return [slice_batch(v, index) for v in batch]
    return batch


def move_batch(batch: Any, device: torch.device) -> Any:
    """``batch`` with every tensor moved to ``device``."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, Mapping):
        return {k: move_batch(v, device) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(move_batch(v, device) for v in batch)
    return batch


def _to_meta(value):
    """``value`` with every tensor replaced by an empty one of its shape and dtype on ``meta``."""
    if isinstance(value, torch.Tensor):
        return torch.empty_like(value, device="meta")
    if isinstance(value, dict):
        return type(value)({k: _to_meta(v) for k, v in value.items()})
    if isinstance(value, (tuple, list)):
        return type(value)(_to_meta(v) for v in value)
    return value


def meta_batch(batch):
    """``batch`` on the meta device (its tensors' shapes and dtypes, no values), without an ``attention_mask`` of all ones (a
    dict batch's): a Hugging Face model reads a missing mask as all ones, and its mask
    builder reads the mask's values (``.all()``), which a meta tensor does not have."""
    if isinstance(batch, Mapping) and isinstance(batch.get("attention_mask"), torch.Tensor) \
            and bool((batch["attention_mask"] != 0).all()):
        batch = {k: v for k, v in batch.items() if k != "attention_mask"}
    return _to_meta(batch)


@dataclass(frozen=True, eq=False)
class DataRef:
    """A dataset (or DataLoader) with the ids of its examples.

    Identity is the data's content: ``key`` is a stable fingerprint of the source
    (:func:`data_fingerprint`: the values of tensors, the pickled state of a dataset, a
    loader's batching and ``collate_fn``), the same in every process, so a ``DataRef``
    unpickled on a Dask worker is still the data of the plan it came from. Two
    ``DataRef`` of the same data and ids are equal, so an expression that uses the same
    data twice captures it once (tensors passed directly are wrapped in a new
    ``TensorDataset`` on every call, and still name the same data).

    collate_fn : how examples are batched when gradalg builds the loader itself (a
        shard of a DataLoader keeps the loader's ``collate_fn``); None: :func:`gradalg.collate.pad_collate` (torch's default, with dict items of unequal length right-padded).
    """

    source: Any
    ids: tuple
    batch_size: int | None = None
    key: str | None = None
    collate_fn: Any = None

    def __post_init__(self):
        if self.key is None:
            object.__setattr__(self, "key", data_fingerprint(self.source))

    @property
    def n(self) -> int:
        return len(self.ids)

    @cached_property
    def token(self) -> str:
        return f"data-{self.key}-{len(self.ids)}-{self.batch_size}-{_ids_digest(self.ids)}"

    def __eq__(self, other):
        return isinstance(other, DataRef) and self.token == other.token and self.ids == other.ids

    def __hash__(self):
        return hash(self.token)

    @property
    def fixed_batch_size(self) -> int | None:
        """The examples per batch the data fixes, whatever ``loader()`` is asked for: this
        ref's ``batch_size`` (``ga.grads(..., batch_size=)``), a batching DataLoader's, or
        the largest batch of its ``batch_sampler``; None where gradalg batches the data
        (a Dataset, tensors, a ``DataLoader(batch_size=None)``, whose items are grouped)."""
        if self.batch_size is not None:
            return self.batch_size
        if not isinstance(self.source, DataLoader) or _unbatched(self.source):
            return None
        return self.source.batch_size or max(_loader_sizes(self.source, self.n) or [1])

    def largest_batch(self, batch_size: int) -> int:
        """The most examples one batch of ``loader(batch_size)`` holds: the data's own batch
        size where it fixes one (:attr:`fixed_batch_size`), else ``batch_size``, at most
        the n examples there are (at least 1). A pass over 4 examples in batches of 16
        holds 4: what its memory and per-batch work are priced at."""
        return max(1, min(self.fixed_batch_size or batch_size, self.n))

    def loader(self, default_batch_size: int) -> Iterator:
        """Batches over the examples, in order (a DataLoader is used as it is), each checked
        to hold as many examples as the loader was asked for (:func:`counted_batches`): a
        ``collate_fn`` that drops or adds examples is refused naming the batch, rather than
        rows being labelled with the wrong ids. A ``DataLoader(batch_size=None)`` yields
        one example per item: they are batched ``default_batch_size`` at a time."""
        if isinstance(self.source, DataLoader):
            if _unbatched(self.source):
                bs = self.batch_size or default_batch_size
                return counted_batches(_group_items(iter(self.source), bs), _even_sizes(self.n, bs), self.n)
            return counted_batches(iter(self.source), _loader_sizes(self.source, self.n), self.n)
        if isinstance(self.source, Dataset) or hasattr(self.source, "__getitem__"):
            bs = self.batch_size or default_batch_size
            # gradalg's own loaders pad dict items of unequal length (collate.pad_collate)
            collate = self.collate_fn or pad_collate
            sizes = None if isinstance(self.source, IterableDataset) else _even_sizes(self.n, bs)
            return counted_batches(iter(DataLoader(self.source, batch_size=bs, shuffle=False, collate_fn=collate)),
                                   sizes, self.n)
        raise DataError(f"cannot iterate over a {type(self.source).__name__}: pass a Dataset, a DataLoader or tensors")

    def subset(self, start: int, stop: int) -> "DataRef":
        """Examples ``start:stop`` (a shard), batched like this one (same batch size and
        ``collate_fn`` as a DataLoader source)."""
        from torch.utils.data import Subset
        base = _dataset_of(self.source)
        is_loader = isinstance(self.source, DataLoader)
        bs = self.batch_size or (self.source.batch_size if is_loader else None)
        collate = _example_collate(self.source) if is_loader else self.collate_fn
        key = f"{self.key}[{start}:{stop}]"
        part = IterableSlice(base, start, stop) if isinstance(base, IterableDataset) else Subset(base, range(start, stop))
        return DataRef(part, self.ids[start:stop], bs, key, collate)

    def prefix(self, n: int | None) -> "DataRef":
        """The first ``n`` examples (all of them when ``n`` is None or at least ``self.n``),
        batched like this one: a :meth:`subset` ``0:n``, whose identity is the data's and
        the range (so a pass over it is a pass of its own, reading ``n`` examples only).
        Used by statistics estimated on a subset (``ga.kfac(..., covariance_max_examples=)``)."""
        n = plain(n)
        if n is None or n >= self.n:
            return self
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise OptionError(f"a prefix of the data needs a positive int number of examples, got {n!r}")
        return self.subset(0, n)

    def examples(self) -> Iterator:
        """Each example alone, in order, as a batch of one (collated as the data's own loader
        would: a DataLoader's ``collate_fn``, else this ref's or ``pad_collate``): for reading
        values example by example (content digests), never for a forward."""
        collate = _example_collate(self.source) if isinstance(self.source, DataLoader) else self.collate_fn
        return iter(DataLoader(_dataset_of(self.source), batch_size=1, collate_fn=collate or pad_collate))

    def first_example_batch(self) -> Any:
        """A batch holding the first example only: used for shape hints, never a forward."""
        return next(self.examples())


class IterableSlice(IterableDataset):
    """Items ``start:stop`` of an ``IterableDataset`` (a shard of one: ``Subset`` needs
    ``__getitem__``). Reads and discards the first ``start`` items."""

    def __init__(self, dataset, start: int, stop: int):
        self.dataset, self.start, self.stop = dataset, start, stop

    def __iter__(self):
        return itertools.islice(iter(self.dataset), self.start, self.stop)

    def __len__(self):
        return self.stop - self.start


class ItemsCollate:
    """The collate of a ``DataLoader(batch_size=None)``'s items as examples: the loader's
    own per-item function (``collate_fn``, torch's ``default_convert`` by default) on each
    item, then :func:`~gradalg.collate.pad_collate` over them. Picklable."""

    def __init__(self, per_item):
        self.per_item = per_item

    def __call__(self, items: list):
        return pad_collate([self.per_item(item) for item in items])


def _unbatched(loader: DataLoader) -> bool:
    """Whether a DataLoader has automatic batching off (``batch_size=None``): one example per item."""
    return loader.batch_size is None and loader.batch_sampler is None


def _example_collate(loader: DataLoader):
    """The function batching a list of the loader's dataset items as the loader would."""
    return ItemsCollate(loader.collate_fn) if _unbatched(loader) else loader.collate_fn


def _group_items(items: Iterator, size: int) -> Iterator:
    """Batches of ``size`` items (the last may be smaller) of an unbatched loader."""
    while True:
        group = list(itertools.islice(items, size))
        if not group:
            return
        yield pad_collate(group)


def _even_sizes(n: int, size: int) -> list[int]:
    """The batch sizes of ``n`` examples batched ``size`` at a time."""
    return [min(size, n - start) for start in range(0, n, size)]


def _loader_sizes(loader: DataLoader, n: int) -> list[int] | None:
    """How many examples each batch of a DataLoader holds, from its batch sampler (None for
    an IterableDataset, whose batches are known only by counting them)."""
    from torch.utils.data import BatchSampler, SequentialSampler

    batches = loader.batch_sampler
    if isinstance(loader.dataset, IterableDataset):
        return None
    if batches is None:
        return [1] * n
    if type(batches) is BatchSampler and type(batches.sampler) is SequentialSampler:
        return _even_sizes(n, batches.batch_size)[: len(batches)]
    return [len(indices) for indices in batches]


def counted_batches(batches: Iterator, sizes: list[int] | None, n: int) -> Iterator:
    """``batches``, each checked against ``sizes[k]`` (the examples batch k was made from;
    None: only counted, for an ``IterableDataset``), and all together against ``n``
    examples. A batch of another size means the ``collate_fn`` dropped, split or added
    examples, and a total other than ``n`` a ``len()`` that is not what the data yields:
    either way rows could not be labelled with their ids, so it is refused
    (:class:`DataError`, the batch and the counts named)."""
    seen = 0
    for k, batch in enumerate(batches):
        got = batch_size_of(batch)
        expected = sizes[k] if sizes is not None and k < len(sizes) else None
        if expected is not None and got != expected:
            raise DataError(
                f"batch {k} (from example {seen} on) holds {got} examples, but the loader made it from "
                f"{expected} examples: its collate_fn drops, splits or adds examples, so rows cannot be matched "
                "to their example ids. Make the collate_fn return one row per item it is given (remove "
                "unwanted examples from the dataset instead)")
        if seen + got > n:
            raise DataError(f"the data yields more than the {n} examples its len() says (batch {k} reaches "
                            f"{seen + got}): make len() return the number of examples the data yields")
        seen += got
        yield batch
    if seen != n:
        raise DataError(f"the data yielded {seen} examples but its len() says {n}: make len() return the "
                        "number of examples the data yields (every example must come out exactly once)")


def _ids_digest(ids: tuple) -> str:
    return hashlib.blake2b(repr(ids).encode(), digest_size=8).hexdigest()


def data_fingerprint(source) -> str:
    """A stable name for a data source, the same in every process holding the same data.

    TensorDataset: the digests of its tensors; Subset: its dataset's name and indices;
    DataLoader: its dataset's name, batch size and ``collate_fn``; any other dataset:
    :func:`gradalg.fingerprint.object_fingerprint` (its pickled state, tensors by
    content; a dataset can define ``__gradalg_fingerprint__()`` to name itself cheaply).
    """
    from torch.utils.data import Subset

    if isinstance(source, TensorDataset):
        return "tensors-" + "-".join(tensor_digest(t) for t in source.tensors)
    if isinstance(source, Subset):
        indices = source.indices
        text = (f"{indices.start}:{indices.stop}:{indices.step}" if isinstance(indices, range)
                else stable_token(list(indices) if not isinstance(indices, torch.Tensor) else indices))
        return f"subset-{data_fingerprint(source.dataset)}-" + hashlib.blake2b(text.encode(), digest_size=8).hexdigest()
    if isinstance(source, DataLoader):
        return (f"loader-{data_fingerprint(source.dataset)}-{source.batch_size}-"
                f"{callable_fingerprint(source.collate_fn)}")
    return object_fingerprint(source)


def _dataset_of(source):
    return source.dataset if isinstance(source, DataLoader) else source


def _in_order(sampler, n: int) -> bool:
    """Whether ``sampler`` gives 0..n-1 in order, twice in a row (a random one would not)."""
    try:
        return all([int(i) for i in sampler] == list(range(n)) for _ in range(2))
    except TypeError:
        return False


def _check_loader(data: DataLoader, n: int) -> None:
    """Refuse a loader that would not give every example once, in order."""
    from torch.utils.data import BatchSampler, SequentialSampler

    if isinstance(data.dataset, IterableDataset):
        return   # its order is its own; counted_batches checks that it yields n examples
    sampler = type(data.sampler).__name__
    if type(data.sampler) is not SequentialSampler and not _in_order(data.sampler, n):
        raise DataError(
            f"the DataLoader uses a {sampler}: gradalg maps scores to examples by "
            "position, so it needs a loader with shuffle=False (or pass the Dataset "
            "and let gradalg batch it)"
        )
    batches = data.batch_sampler
    drop_last = data.drop_last or bool(getattr(batches, "drop_last", False))
    if drop_last and n % (data.batch_size or getattr(batches, "batch_size", 1) or 1):
        raise DataError(
            "the DataLoader has drop_last=True: its last partial batch would never be read, "
            "so those examples would get no rows. Pass a loader with drop_last=False (or "
            "the Dataset)")
    if batches is None or (type(batches) is BatchSampler and type(batches.sampler) is SequentialSampler):
        return
    # a custom batch_sampler: it must visit 0..n-1 once each, in order (checked on the indices only)
    for attempt in range(2):   # twice: a shuffling sampler draws a new order each time
        order = [int(i) for batch in batches for i in batch]
        if order != list(range(n)):
            first_bad = next((p for p, (a, b) in enumerate(zip(order, range(n))) if a != b), min(len(order), n))
            raise DataError(
                f"the DataLoader's batch_sampler ({type(batches).__name__}) does not visit the examples "
                f"0..{n - 1} once each in order (it gives {len(order)} indices; position {first_bad} differs): "
                "gradalg maps rows to examples by position. Pass a loader with an in-order sampler, "
                "or the Dataset and let gradalg batch it")


def _tensor_of(value) -> torch.Tensor:
    """A column of tensor data given as a list or a numpy array, as a tensor (DataError if not numbers)."""
    if isinstance(value, torch.Tensor):
        return value
    try:
        return torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError) as err:
        raise DataError(f"a tuple of tensors was passed as data, but one element is a {type(value).__name__} "
                        "that is not an array of numbers: pass tensors with the examples along dimension 0") from err


def as_data(data: Any, ids=None, batch_size: int | None = None, collate_fn: Callable | None = None) -> DataRef:
    """Wrap ``data`` (Dataset, DataLoader, tensor or tuple of tensors) as a :class:`DataRef`.

    ``collate_fn``: how gradalg's own loaders batch the examples (a task's
    :attr:`~gradalg.Task.collate_fn`); ignored for a DataLoader, which batches as it does.

    Raises
    ------
    DataError (a ValueError and a TypeError)
        If ``data`` has no length (an ``IterableDataset`` without ``__len__``: gradalg
        needs the number of examples to plan without running anything) or no examples;
        if ``ids`` does not have one id per example, or ids repeat; if a DataLoader
        shuffles, reorders or drops examples; if tensors differ in length.
    """
    if isinstance(data, DataRef):
        if collate_fn is None or data.collate_fn is not None or isinstance(data.source, DataLoader):
            return data
        return replace(data, collate_fn=collate_fn)
    batch_size = plain(batch_size)
    if data is None or isinstance(data, (str, bytes, int, float, os.PathLike)):
        raise DataError(f"the data is a {type(data).__name__} ({data!r:.60}), not examples: pass a Dataset, a "
                        "DataLoader, a list of examples or tensors with the examples along dimension 0 (a file "
                        "is read by you, or by the `gradalg` command's [data] section)")
    if batch_size is not None and (not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1):
        raise OptionError(f"batch_size must be a positive int, got {batch_size!r}")
    if isinstance(data, torch.Tensor):
        data = TensorDataset(data)
    elif isinstance(data, tuple) and data and any(isinstance(t, torch.Tensor) or type(t).__module__ == "numpy"
                                                  for t in data):
        data = tuple(_tensor_of(t) for t in data)   # (X, labels as a list or numpy array) works too
        sizes = {t.shape[0] if t.dim() else None for t in data}
        if len(sizes) != 1 or None in sizes:
            raise DataError(f"the tensors passed as data have different numbers of examples along "
                            f"dimension 0 ({[tuple(t.shape) for t in data]}): pass tensors of one length")
        data = TensorDataset(*data)
    elif isinstance(data, Mapping):   # already-batched dict tensors {"input_ids": (N, T), ...}
        data = DictDataset(data)
    if isinstance(data, DataLoader):
        try:
            n = len(data.dataset)
        except TypeError as err:
            raise DataError("the DataLoader's dataset has no len(); gradalg needs the "
                            "number of examples to plan") from err
        _check_loader(data, n)
    else:
        try:
            n = len(data)
        except TypeError as err:
            raise DataError(
                f"{type(data).__name__} has no len(): pass a map-style Dataset, a DataLoader "
                "over one, or tensors"
            ) from err
    if n == 0:
        raise DataError(f"the data ({type(data).__name__}) has no examples: pass at least one")
    if ids is None:
        ids = tuple(range(n))
    else:
        ids = tuple(ids.tolist() if isinstance(ids, torch.Tensor) or type(ids).__module__ == "numpy"
                    else (plain(i) for i in ids))
        if len(ids) != n:
            raise DataError(f"got {len(ids)} ids for {n} examples: pass one id per example")
        try:
            unique = len(set(ids)) == n
        except TypeError as err:
            raise DataError("example ids must be hashable (ints or strings)") from err
        if not unique:
            seen, repeated = set(), []
            for i in ids:
                if i in seen and i not in repeated:
                    repeated.append(i)
                seen.add(i)
            raise DataError(f"example ids must be unique; repeated: {repeated[:10]}")
    return DataRef(data, ids, batch_size, collate_fn=None if isinstance(data, DataLoader) else collate_fn)
