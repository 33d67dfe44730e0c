"""The key of a pass: what it reads, as a typed record (one frozen class per kind).

Jobs that read the same rows share a pass (the schedule stage groups them by key), so a
key is compared, hashed and used as a dict key; plans travel to Dask workers and are
compared across torch.distributed ranks, so keys pickle and their fields are plain data.

    DataPassKey(task_token, data_token, task_name, n)   a read of a dataset: capture its batches
    ProductsPassKey(token, task_name, n, calls)         a products pass (``token``: the
                                                        operator H's): run on each call of its solver
    CapturedPassKey(token)                              rows captured earlier (``Captured``)
    MemoryPassKey(token)                                rows kept in memory (stored rows, a group mean's)

What the stages ask of a key is its behaviour (:attr:`~PassKey.label`,
:attr:`~PassKey.reads_data`, :attr:`~PassKey.per_call`, :attr:`~PassKey.rows`,
:attr:`~PassKey.kept`), never a position in a tuple.
"""
from __future__ import annotations

from dataclasses import astuple, dataclass
from typing import ClassVar

__all__ = ["PassKey", "DataPassKey", "ProductsPassKey", "CapturedPassKey", "MemoryPassKey"]


@dataclass(frozen=True)
class PassKey:
    """What a pass reads. A kind sets ``kind`` (its short name, in plain-data exports and
    the outline ranks compare) and :attr:`label`."""

    kind: ClassVar[str] = ""
    #: a pass over data captured once when the plan runs
    reads_data: ClassVar[bool] = False
    #: run on each call of the solver that uses it, not when the plan runs (products)
    per_call: ClassVar[bool] = False

    @property
    def label(self) -> str:
        """The pass as ``explain()`` names it."""
        raise NotImplementedError(f"{type(self).__name__} does not say how it is shown (PassKey.label)")

    #: the token of the node whose rows the pass reads as they are (rows in memory or
    #: captured earlier), or None (a read of data, a products pass); a kind that has one
    #: overrides it with a property
    rows: ClassVar[str | None] = None
    #: the token of the node whose rows kept in memory the pass reads, or None
    kept: ClassVar[str | None] = None

    def to_data(self) -> list:
        """Plain data (JSON): ``[kind, *fields]``."""
        return [self.kind, *astuple(self)]


@dataclass(frozen=True)
class DataPassKey(PassKey):
    """A read of a dataset: ``task_token`` (the task as captured, its loss and model),
    ``data_token`` (the data's fingerprint), ``task_name`` and ``n`` (examples) as shown."""

    kind: ClassVar[str] = "data"
    reads_data: ClassVar[bool] = True
    task_token: str
    data_token: str
    task_name: str
    n: int

    @property
    def label(self) -> str:
        return f"pass over {self.task_name} ({self.n:,} examples)"


@dataclass(frozen=True)
class ProductsPassKey(PassKey):
    """The pass of a products job: up to ``calls`` reads of the ``n`` examples of the
    operator ``token``'s data (task ``task_name``), one per call of its solver."""

    kind: ClassVar[str] = "products"
    per_call: ClassVar[bool] = True
    token: str
    task_name: str
    n: int
    calls: int

    @property
    def label(self) -> str:
        return f"up to {self.calls:,} passes over {self.task_name} ({self.n:,} examples)"


@dataclass(frozen=True)
class CapturedPassKey(PassKey):
    """A read of rows captured earlier (a ``Captured`` node ``token``'s store)."""

    kind: ClassVar[str] = "captured"
    label: ClassVar[str] = "pass over captured rows"
    token: str

    @property
    def rows(self) -> str:
        return self.token


@dataclass(frozen=True)
class MemoryPassKey(PassKey):
    """A read of rows kept in memory: the node ``token``'s (stored rows, a group mean's)."""

    kind: ClassVar[str] = "memory"
    label: ClassVar[str] = "pass over rows in memory"
    token: str

    @property
    def rows(self) -> str:
        return self.token

    kept = rows   # the rows it reads are the ones kept in memory
