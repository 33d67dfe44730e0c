"""Capturing a Source's per-example gradients for one batch.

``SourceCapture(source, options, checked_tasks).capture(batch, ids)`` returns the
chunks of that batch: one chunk, or one per term for ``objective="expected"``.
Several sources over the same (task, data) are captured from the same batch in one
read of the data (a fused pass).
"""
from __future__ import annotations

import contextlib

import torch

from ..capture.factors import Factors
from ..capture.hooks import ForwardRecorder, capture_batch, resolve_layers
from ..capture.reference import param_names_of, per_example_grads
from ..errors import NonFiniteGradientError
from ..expr import Source
from .chunks import Chunk

__all__ = ["SourceCapture", "model_device_dtype", "eval_mode"]


def model_device_dtype(model):
    for p in model.parameters():
        return p.device, p.dtype
    return torch.device("cpu"), torch.float32


@contextlib.contextmanager
def eval_mode(model):
    """Attribution runs with dropout off and BatchNorm frozen; the mode is restored after."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


class SourceCapture:
    def __init__(self, source: Source, options, checked_tasks: set):
        if source.backend == "func" and source.objective in ("sampled", "expected"):
            raise ValueError(f"objective={source.objective!r} is captured with backend='hooks' only")
        self.source = source
        self.options = options
        self.checked = checked_tasks
        self.refs = resolve_layers(source.task.model, list(source.layers), backend=source.backend)
        self.objective = source.task.objective_fn(source.objective, source.seed)

    def capture(self, batch, ids) -> list[Chunk]:
        src, task = self.source, self.source.task
        if (self.options.check_reduction and src.objective == "loss" and task.token not in self.checked):
            task.check_reduction(batch)
            self.checked.add(task.token)
        if src.objective == "expected":
            return [Chunk(ids, blocks, batch, task, {"term": term})
                    for term, blocks in enumerate(self._expected_blocks(batch))]
        if src.backend == "func":
            blocks = self._func_blocks(batch)
        else:
            blocks = self._hook_blocks(batch, ids)
        if self.options.check_finite:
            check_finite(blocks, ids)
        return [Chunk(ids, blocks, batch, task)]

    def _hook_blocks(self, batch, ids):
        task = self.source.task
        with torch.enable_grad(), ForwardRecorder(self.refs) as recorder:
            if self.source.objective == "sampled":   # each example's draw follows its id
                loss = self.objective(task.model, batch, ids)
            else:
                loss = self.objective(task.model, batch)
            mask = task.token_mask(batch) if task.token_mask is not None else None
            return capture_batch(loss, recorder, token_mask=mask)

    def _expected_blocks(self, batch):
        """One set of factors per term of ``task.expected_terms``; one forward in all."""
        task = self.source.task
        out = []
        with torch.enable_grad(), ForwardRecorder(self.refs) as recorder:
            terms = self.objective(task.model, batch)
            mask = task.token_mask(batch) if task.token_mask is not None else None
            for i, term in enumerate(terms):
                out.append(capture_batch(term, recorder, token_mask=mask, retain_graph=i < len(terms) - 1))
        return out

    def _func_blocks(self, batch):
        task = self.source.task
        out = {}
        grads = per_example_grads(task, batch, param_names_of(task.model, [r.name for r in self.refs]),
                                  loss_fn=self.objective)
        for ref in self.refs:
            names = param_names_of(task.model, [ref.name])
            out[ref.name] = torch.cat([grads[n].flatten(1) for n in names], dim=1)
        return out


def _finite_rows(x: torch.Tensor) -> torch.Tensor:
    """(n,) bool: row i of ``x`` (n, ...) has no NaN/inf.

    A row sum is NaN/inf whenever one of its entries is, so one reduction over the data
    clears the common case; only rows whose sum is not finite (a bad entry, or finite
    entries overflowing) are checked entry by entry.
    """
    rows = x.flatten(1)
    ok = torch.isfinite(rows.sum(1))
    if not bool(ok.all()):
        suspect = (~ok).nonzero().flatten()
        ok[suspect] = torch.isfinite(rows[suspect]).all(1)
    return ok


def check_finite(blocks: dict, ids) -> None:
    """Raise :class:`NonFiniteGradientError` naming the examples with NaN/inf gradients."""
    bad = None
    layers = []
    for name, value in blocks.items():
        if isinstance(value, Factors):
            ok = _finite_rows(value.D)
            if isinstance(value.A, torch.Tensor):  # one-hot activations are always finite
                ok &= _finite_rows(value.A)
        else:
            ok = _finite_rows(value)
        if not ok.all():
            layers.append(name)
            bad = ~ok if bad is None else bad | ~ok
    if bad is not None:
        raise NonFiniteGradientError([ids[i] for i in bad.nonzero().flatten().tolist()], layers)
