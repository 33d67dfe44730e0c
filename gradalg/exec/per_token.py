"""Splitting a chunk of factored examples into per-token rows (:class:`~gradalg.expr.PerToken`).

A factored block of B examples holds A (B, T, in) and D (B, T, out) with
G_i = Σ_t d_it a_itᵀ. The per-token chunk has B·tokens rows, row (i, t) the factors
A (1, in), D (1, out) of position t — a reshape, no arithmetic. Positions
T..tokens-1 (a batch padded shorter than the longest example) are zero rows.
"""
from __future__ import annotations

import torch

from ..capture.factors import Factors, OneHot
from ..expr.tokens import PerToken, PerTokenError
from ..capture.chunks import Chunk

__all__ = ["split_tokens"]


def _rows(x, tokens: int):
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


def split_tokens(node: PerToken, chunk: Chunk) -> Chunk:
    """The per-token chunk of ``node`` from a chunk of ``node.grads``.   B → B·tokens rows."""
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
    ids = tuple((i, t) for i in chunk.ids for t in range(node.tokens))
    blocks = {name: Factors(_rows(v.A, node.tokens), _rows(v.D, node.tokens)) for name, v in chunk.blocks.items()}
    # per-example weights after the split would see B values for B·tokens rows: drop the batch
    return Chunk(ids, blocks, None, None, dict(chunk.meta, per_token=node.tokens))
