"""Turning user data into batches, and batches into examples.

A *batch* is whatever the user's loss takes: a tensor, a tuple/list of tensors or a
dict of tensors (HF style), each with the examples along dimension 0.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

from .collate import DictDataset, pad_collate

__all__ = ["DataRef", "batch_size_of", "slice_batch", "move_batch", "as_data"]


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
    raise TypeError(
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

    Identity is the object's identity: two ``DataRef`` of the same dataset object and ids
    are equal, so an expression that uses the same data twice captures it once. Tensors
    passed directly are wrapped in a new ``TensorDataset`` on every call; ``key`` then
    names the user's tensors, so ``ga.grads(task, (X, y))`` twice is still the same data.
    """

    source: Any
    ids: tuple
    batch_size: int | None = None
    key: str | None = None

    @property
    def n(self) -> int:
        return len(self.ids)

    @property
    def token(self) -> str:
        return f"data-{self.key or format(id(self.source), 'x')}-{len(self.ids)}-{self.batch_size}"

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
            return iter(DataLoader(self.source, batch_size=bs, shuffle=False, collate_fn=pad_collate))
        raise TypeError(f"cannot iterate over {type(self.source).__name__}")

    def subset(self, start: int, stop: int) -> "DataRef":
        """Examples ``start:stop`` (a shard), batched like this one."""
        from torch.utils.data import Subset
        base = _dataset_of(self.source)
        bs = self.batch_size or (self.source.batch_size if isinstance(self.source, DataLoader) else None)
        key = f"{self.key or format(id(self.source), 'x')}[{start}:{stop}]"
        return DataRef(Subset(base, range(start, stop)), self.ids[start:stop], bs, key)

    def first_example_batch(self) -> Any:
        """A batch holding the first example only: used for shape hints, never a forward."""
        return next(iter(DataLoader(_dataset_of(self.source), batch_size=1, collate_fn=pad_collate)))


def _dataset_of(source):
    return source.dataset if isinstance(source, DataLoader) else source


def as_data(data: Any, ids=None, batch_size: int | None = None) -> DataRef:
    """Wrap ``data`` (Dataset, DataLoader, tensor or tuple of tensors) as a :class:`DataRef`.

    Raises
    ------
    TypeError
        If ``data`` has no length (an ``IterableDataset`` without ``__len__``): gradalg
        needs the number of examples to plan without running anything.
    ValueError
        If ``ids`` does not have one id per example, or ids repeat.
    """
    if isinstance(data, DataRef):
        return data
    key = None
    if isinstance(data, torch.Tensor):
        key = f"tensors-{id(data):x}"
        data = TensorDataset(data)
    elif isinstance(data, tuple) and all(isinstance(t, torch.Tensor) for t in data):
        key = "tensors-" + "-".join(f"{id(t):x}" for t in data)
        data = TensorDataset(*data)
    elif isinstance(data, Mapping):   # already-batched dict tensors {"input_ids": (N, T), ...}
        key = "dict-" + "-".join(f"{k}:{id(v):x}" for k, v in data.items())
        data = DictDataset(data)
    if isinstance(data, DataLoader):
        sampler = type(data.sampler).__name__
        if sampler != "SequentialSampler":
            raise ValueError(
                f"the DataLoader uses a {sampler}: gradalg maps scores to examples by "
                "position, so it needs a loader with shuffle=False (or pass the Dataset "
                "and let gradalg batch it)"
            )
        try:
            n = len(data.dataset)
        except TypeError as err:
            raise TypeError("the DataLoader's dataset has no len(); gradalg needs the "
                            "number of examples to plan") from err
    else:
        try:
            n = len(data)
        except TypeError as err:
            raise TypeError(
                f"{type(data).__name__} has no len(): pass a map-style Dataset, a DataLoader "
                "over one, or tensors"
            ) from err
    if ids is None:
        ids = tuple(range(n))
    else:
        ids = tuple(ids.tolist() if isinstance(ids, torch.Tensor) else ids)
        if len(ids) != n:
            raise ValueError(f"got {len(ids)} ids for {n} examples: pass one id per example")
        if len(set(ids)) != n:
            raise ValueError("example ids must be unique")
    return DataRef(data, ids, batch_size, key)
