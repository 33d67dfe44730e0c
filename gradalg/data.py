"""Turning user data into batches, and batches into examples.

A *batch* is whatever the user's loss takes: a tensor, a tuple/list of tensors or a
dict of tensors (HF style), each with the examples along dimension 0.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
import hashlib
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Iterator

import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

from .collate import DictDataset, pad_collate
from .errors import DataError, OptionError
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

    def loader(self, default_batch_size: int) -> Iterator:
        """Batches over the examples, in order (a DataLoader is used as it is)."""
        if isinstance(self.source, DataLoader):
            return iter(self.source)
        if isinstance(self.source, Dataset) or hasattr(self.source, "__getitem__"):
            bs = self.batch_size or default_batch_size
            # gradalg's own loaders pad dict items of unequal length (collate.pad_collate)
            return iter(DataLoader(self.source, batch_size=bs, shuffle=False,
                                   collate_fn=self.collate_fn or pad_collate))
        raise TypeError(f"cannot iterate over {type(self.source).__name__}")

    def subset(self, start: int, stop: int) -> "DataRef":
        """Examples ``start:stop`` (a shard), batched like this one (same batch size and
        ``collate_fn`` as a DataLoader source)."""
        from torch.utils.data import Subset
        base = _dataset_of(self.source)
        is_loader = isinstance(self.source, DataLoader)
        bs = self.batch_size or (self.source.batch_size if is_loader else None)
        collate = self.source.collate_fn if is_loader else self.collate_fn
        key = f"{self.key}[{start}:{stop}]"
        return DataRef(Subset(base, range(start, stop)), self.ids[start:stop], bs, key, collate)

    def prefix(self, n: int | None) -> "DataRef":
        """The first ``n`` examples (all of them when ``n`` is None or at least ``self.n``),
        batched like this one: a :meth:`subset` ``0:n``, whose identity is the data's and
        the range (so a pass over it is a pass of its own, reading ``n`` examples only).
        Used by statistics estimated on a subset (``ga.kfac(..., covariance_max_examples=)``)."""
        if n is None or n >= self.n:
            return self
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise OptionError(f"a prefix of the data needs a positive int number of examples, got {n!r}")
        return self.subset(0, n)

    def first_example_batch(self) -> Any:
        """A batch holding the first example only: used for shape hints, never a forward."""
        collate = self.source.collate_fn if isinstance(self.source, DataLoader) else self.collate_fn
        return next(iter(DataLoader(_dataset_of(self.source), batch_size=1, collate_fn=collate or pad_collate)))


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


def as_data(data: Any, ids=None, batch_size: int | None = None) -> DataRef:
    """Wrap ``data`` (Dataset, DataLoader, tensor or tuple of tensors) as a :class:`DataRef`.

    Raises
    ------
    DataError (a ValueError and a TypeError)
        If ``data`` has no length (an ``IterableDataset`` without ``__len__``: gradalg
        needs the number of examples to plan without running anything) or no examples;
        if ``ids`` does not have one id per example, or ids repeat; if a DataLoader
        shuffles, reorders or drops examples; if tensors differ in length.
    """
    if isinstance(data, DataRef):
        return data
    if batch_size is not None and (not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1):
        raise OptionError(f"batch_size must be a positive int, got {batch_size!r}")
    if isinstance(data, torch.Tensor):
        data = TensorDataset(data)
    elif isinstance(data, tuple) and data and all(isinstance(t, torch.Tensor) for t in data):
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
        ids = tuple(ids.tolist() if isinstance(ids, torch.Tensor) else ids)
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
    return DataRef(data, ids, batch_size)
