"""Which example each recorded row belongs to.

A recorded call's input has ``N`` leading rows. Hook capture attributes them to the
batch's ``B`` examples in one of two ways, and refuses every other case:

* ``N == B``: one row per example (inputs of shape (B, ...)).
* ``N == B·T`` for a sequence length ``T`` of this batch (the token mask's ``T``, or the
  positions of a layer called with (B, T, ...) inputs in the same forward): the batch's
  tokens flattened batch-major, as ``hidden.view(-1, d)`` does before an MLP or a
  mixture-of-experts block; row ``r`` is position ``r mod T`` of example ``r // T``.

A single row for a batch of several examples is an input shared by the whole batch
(GPT-2's position embedding called with position_ids of shape (1, T)): refused with
:class:`~gradalg.errors.UnsupportedLayerError`. Other row counts are rows gathered by
index (tokens routed to one expert of a mixture of experts): they are attributed by
replaying the enclosing module per example (:mod:`gradalg.capture.provenance`), and
refused where no enclosing module allows it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..errors import UnsupportedLayerError
from .factors import Factors, OneHot

__all__ = ["RowLayout", "layout_for", "session_rows"]


@dataclass(frozen=True)
class RowLayout:
    """``n_examples · per_example`` rows, batch-major: example ``b`` owns rows
    ``b·per_example … (b+1)·per_example - 1``. ``keep`` (rows,) bool, optional: the rows
    that hold a real token (the task's token mask, flattened); a rule whose positions are
    not the call's tokens (a fused expert's routed tokens) drops the others."""

    n_examples: int
    per_example: int = 1
    keep: torch.Tensor | None = field(default=None, compare=False, repr=False)

    @property
    def rows(self) -> int:
        return self.n_examples * self.per_example

    def example_rows(self, b: int) -> slice:
        return slice(b * self.per_example, (b + 1) * self.per_example)

    def group(self, factors: Factors) -> Factors:
        """(N, P, ·) factors → (B, per_example·P, ·): an example's rows become its positions."""
        if self.per_example == 1:
            return factors
        return Factors(_group(factors.A, self.n_examples), _group(factors.D, self.n_examples))


def _group(x, n: int):
    if isinstance(x, OneHot):
        valid = None if x.valid is None else x.valid.reshape(n, -1)
        return OneHot(x.idx.reshape(n, -1), x.size, valid)
    return x.reshape(n, -1, x.shape[-1])


def layout_for(name: str, rows: int, n_examples: int | None, lengths) -> RowLayout:
    """The layout of a call with ``rows`` leading rows in a batch of ``n_examples``
    examples whose sequences have the lengths ``lengths`` (a set of ints)."""
    if n_examples is None or rows == n_examples:
        return RowLayout(rows, 1)
    if rows == 1:
        raise UnsupportedLayerError(
            f"layer {name!r} recorded 1 row while the batch has {n_examples} examples: its input is "
            "shared by the whole batch (broadcast), e.g. GPT-2's position embedding `transformer.wpe` "
            "called with position_ids of shape (1, T), so its per-example gradients cannot be "
            "separated. Pass per-example inputs (position_ids of shape (B, T)) or leave this layer "
            "out of `layers`"
        )
    per = rows // n_examples
    if rows % n_examples == 0 and per in lengths:
        return RowLayout(n_examples, per)
    raise UnsupportedLayerError(
        f"layer {name!r} recorded {rows} rows in a batch of {n_examples} examples with sequence "
        f"lengths {sorted(lengths)}: its rows are neither one per example nor the batch's tokens "
        "flattened (B·T), e.g. tokens gathered by index for one expert of a mixture of experts, and "
        "no module around it receives rows of whole examples with a single differentiable output "
        "(gradalg replays that module per example to attribute such rows, see "
        "gradalg.capture.provenance), so the example each row came from is not known and its "
        "per-example gradient would be a guess. Leave this layer out of `layers`, or record a module "
        "that receives every token (a fused experts module, replayed per example; layers='all')"
    )


def session_rows(pending: dict) -> tuple[int | None, set]:
    """``ga.capture`` does not see the batch: its number of examples is read from the calls
    with several positions per row ((B, T, ·) inputs), when they all agree, and their T's
    are the sequence lengths; otherwise None (every layer must then have one row per
    example). ``pending``: ``{layer: [{"A": (rows, T, ·), ...}]}``."""
    shapes = {(s["A"].shape[0], s["A"].shape[1]) for slots in pending.values() for s in slots}
    batch = {rows for rows, positions in shapes if positions > 1 and rows > 1}
    if len(batch) != 1:
        return None, set()
    (n,) = batch
    return n, {positions for rows, positions in shapes if rows == n}
