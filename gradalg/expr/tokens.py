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

from ..capture.chunks import Chunk
from ..capture.factors import Factors, OneHot
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
        """B examples -> B·tokens rows (example, position): row (i, t) has the factors
        A (1, in), D (1, out) of position t, a reshape, no arithmetic; positions T..tokens-1
        (a batch padded shorter than the longest example) are zero rows."""
        _check_positions(self, chunk)
        ids = tuple((i, t) for i in chunk.ids for t in range(self.tokens))
        blocks = {name: Factors(_token_rows(v.A, self.tokens), _token_rows(v.D, self.tokens))
                  for name, v in chunk.blocks.items()}
        # per-example weights after the split would see B values for B·tokens rows: drop the batch
        return Chunk(ids, blocks, None, None, dict(chunk.meta, per_token=self.tokens))

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


def _token_rows(x, tokens: int):
    """(B, T, ...) factors → (B·tokens, 1, ...), zero-padding T to ``tokens``."""
    if isinstance(x, OneHot):
        valid = x.valid if x.valid is not None else torch.ones_like(x.idx, dtype=torch.bool)
        idx = x.idx.expand_as(valid) if x.idx.shape != valid.shape else x.idx   # positions: (1, T) ids
        B, T = idx.shape
        idx = torch.nn.functional.pad(idx, (0, tokens - T))
        valid = torch.nn.functional.pad(valid, (0, tokens - T), value=False)
        return OneHot(idx.reshape(B * tokens, 1), x.size, valid.reshape(B * tokens, 1))
    B, T, width = x.shape
    if T < tokens:
        x = torch.nn.functional.pad(x, (0, 0, 0, tokens - T))
    return x.reshape(B * tokens, 1, width)


def _check_positions(node: PerToken, chunk: Chunk) -> None:
    """Refuse a chunk ``node`` cannot split: a materialized block, a block whose output
    gradients are broadcast over the batch, layers that see different positions, more
    positions than ``node.tokens``, or a token mask of another shape."""
    T = None
    for name, value in chunk.blocks.items():
        if not isinstance(value, Factors):
            raise PerTokenError(f"block {name!r} arrived materialized: per-token rows need its factors "
                                "(capture with backend='hooks')")
        if value.D.shape[0] != chunk.n:
            raise PerTokenError(
                f"block {name!r} has output gradients for {value.D.shape[0]} rows in a chunk of {chunk.n} examples "
                "(a module whose output is broadcast over the batch, e.g. position embeddings of shape "
                "(1, T, d)): its per-example factors are not separable; leave it out of the layers")
        if T is None:
            T, first = value.T, name
        elif value.T != T:
            raise PerTokenError(
                f"blocks {first!r} and {name!r} see {T} and {value.T} positions per example: per-token rows "
                "need every layer on the same sequence (a module called twice per forward, or a layer "
                "outside the token sequence, has other positions). Select layers with equal positions: "
                "G.select([...]).per_token()")
    if T is not None and T > node.tokens:
        raise PerTokenError(
            f"the layers see {T} positions per example but the per-token rows were declared with "
            f"tokens={node.tokens} (examples {list(chunk.ids[:4])}...): pass G.per_token(tokens={T}) or more")
    mask = chunk.task.token_mask if chunk.task is not None else None
    if mask is not None and chunk.batch is not None and T is not None:
        shape = tuple(mask(chunk.batch).shape)
        if shape != (chunk.n, T):
            raise PerTokenError(f"the task's token_mask has shape {shape} but the layers see {T} positions "
                                f"for {chunk.n} examples: per-token rows need layers on the token sequence")
