"""Per-token rows: a gradient set whose rows are (example, position) pairs.

A recorded layer's per-example gradient is a sum over the positions of its input and
output sequence (hook capture keeps exactly these factors)::

    G_i = Σ_t d_it a_itᵀ          d_it = ∂L_i/∂y_it  (out,),   a_it = x_it  (in,)

``PerToken(G)`` keeps each term as its own row: row (i, t) has, in every block, the
rank-1 gradient ``G_it = d_it a_itᵀ`` (factors with T = 1). Over all blocks,
``G_it = ∂L_i/∂θ_t``, the gradient of example i's loss with respect to a copy θ_t of
the recorded parameters that acts at position t only. So:

* ``Σ_t G_it = G_i`` exactly: per-token scores sum over the token axis to the
  ordinary scores, for any operator in between (scores are linear in each side);
* this is Kronfluence's per-token decomposition (``compute_per_token_scores``:
  ``einsum("qio,bti,bto->qbt", H⁻¹Q, A, D)``, the training gradient split over the
  positions of each layer's input / output).

It is **not** the gradient of the loss at token t, ∇ℓ_it, for models that mix positions
(attention): d_it collects the losses of every later token that attends to position t
(for a causal LM, row t is "what the parameters do at position t", including its effect
on predicting later tokens; the last position's rows are zero when its logits carry no
loss). For position-wise models (an MLP applied to each token) the two coincide:
d_it = ∂ℓ_it/∂y_it. Per-token-loss rows have no rank-1 factors (each is a full Σ_s
over positions) and are not built.

Every recorded layer must see the same positions (the sequence of the example: T
equal across blocks). Padding positions have zero rows (the task's ``token_mask``
zeroes them at capture); positions past a batch's padded length up to ``tokens`` are
zero rows too.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property

import torch

from ..errors import PerTokenError
from .grads import (AdamPrecondition, Captured, GradNode, Normalize, Precondition, Project, RowWise, ScaleRows,
                    Select, Source, _not_from_data)
from .lowrank import LowRank

__all__ = ["PerToken", "token_rows", "per_token_node", "infer_positions", "PerTokenError"]


@dataclass(frozen=True, eq=False)
class PerToken(RowWise):
    """Rows (example, position) of ``grads``: row (i, t) = d_it a_itᵀ per block.

    ``tokens``: positions per example (the padded sequence length); n = grads.n · tokens;
    ids = ((id_i, t) for each example i, for t in 0..tokens-1).
    """

    grads: GradNode
    tokens: int

    def __post_init__(self):
        if not isinstance(self.tokens, int) or self.tokens < 1:
            raise PerTokenError(f"tokens must be a positive int (positions per example), got {self.tokens!r}")
        x = self.grads
        while isinstance(x, (Select, ScaleRows)):   # linear, factors kept: w_i G_i = Σ_t (w_i d_it) a_itᵀ
            x = x.grads
        if not isinstance(x, (Source, Captured)) or any(
                r != "factored" for r in self.grads.representation.values()):
            what = x.label if isinstance(x, (Source, Captured)) else type(x).__name__
            raise PerTokenError(
                f"per-token rows need factored gradients straight from capture (ga.grads with "
                f"backend='hooks', or ga.capture), got {what!r}. Split first, then transform: "
                "P(G.per_token()), G.per_token().normalize(); backend='func' keeps no positions")
        if isinstance(x, Source) and x.objective == "expected":
            raise PerTokenError("gradients with objective='expected' have one row per Gauss-Newton term, "
                                "not per example: they have no per-token rows")

    @property
    def space(self):
        return self.grads.space

    @property
    def n(self) -> int:
        return self.grads.n * self.tokens

    @property
    def example_ids(self) -> tuple:
        return self.grads.ids

    @cached_property
    def ids(self) -> tuple:
        return tuple((i, t) for i in self.grads.ids for t in range(self.tokens))

    @property
    def representation(self):
        return {name: "factored" for name in self.space.names}

    def apply(self, chunk, ctx):
        """B examples -> B·tokens rows (example, position)."""
        return ctx.split_tokens(self, chunk)

    def row_cost(self, n, chunk, prices):
        return prices.free()      # views of the factors

    def first_examples(self, n):
        _not_from_data(self, n)   # its rows are positions, not examples

    @property
    def label(self):
        return f"per token ({self.tokens} positions per example)"


# nodes that keep their input's rows (one output row per input row, same ids)
_ROW_PRESERVING = (Project, Normalize, Select, Precondition, ScaleRows, AdamPrecondition, LowRank)


def per_token_node(node: GradNode) -> "PerToken | None":
    """The :class:`PerToken` below ``node`` through row-preserving nodes (projections,
    normalization, selection, preconditioning, scaling), if any."""
    x = node
    while isinstance(x, _ROW_PRESERVING):
        x = x.grads
    return x if isinstance(x, PerToken) else None


def token_rows(node: GradNode) -> int:
    """Rows per example of ``node``: ``tokens`` for per-token rows, else 1."""
    pt = per_token_node(node)
    return 1 if pt is None else pt.tokens


def _sequence_length(item) -> int | None:
    """Length of one dataset item's sequence: ``input_ids`` of a dict item, else its first
    tensor's size along dim 0 (a (T,) token tensor or (T, d) features; a float (d,) vector
    has none)."""
    if isinstance(item, Mapping):
        value = item.get("input_ids")
        if value is None:
            value = next((v for v in item.values() if isinstance(v, torch.Tensor)), None)
    elif isinstance(item, (tuple, list)):
        value = next((v for v in item if isinstance(v, torch.Tensor)), None)
    else:
        value = item
    if not isinstance(value, torch.Tensor) or value.dim() == 0 or (value.dim() == 1 and value.is_floating_point()):
        return None   # a scalar, or one feature vector: no sequence
    return int(value.shape[0])


def infer_positions(data) -> int:
    """Positions per example of a :class:`~gradalg.data.DataRef`: the longest item's sequence
    length (tensor data: its dim 1, read off the shape). Other datasets have each item read
    once (never a model run); pass ``per_token(tokens=T)`` to skip that on large data.

    Raises :class:`PerTokenError` when the items have no sequence dimension.
    """
    from torch.utils.data import DataLoader, TensorDataset

    source = data.source.dataset if isinstance(data.source, DataLoader) else data.source
    if isinstance(source, TensorDataset):
        first = source.tensors[0]
        if first.dim() >= 3 or (first.dim() == 2 and not first.is_floating_point()):
            return int(first.shape[1])   # (n, T) token ids or (n, T, d) features
        raise PerTokenError("the data's examples have no sequence dimension (tensor of shape "
                            f"{tuple(first.shape)}): per-token rows need (n, T, ...) inputs, or pass tokens=")
    longest = 0
    for k in range(len(source)):
        length = _sequence_length(source[k])
        if length is None:
            raise PerTokenError(f"example {data.ids[k]!r} has no sequence dimension: pass "
                                "G.per_token(tokens=T) with the positions per example")
        longest = max(longest, length)
    if longest == 0:
        raise PerTokenError("the data has no positions (empty sequences): nothing to split per token")
    return longest
