"""The ``torch.func`` reference: per-example gradients of any module, the test oracle.

``per_example_grads(task, batch)`` returns ``{param_name: (B, *param.shape)}`` with
``vmap(grad(loss_of_one_example))``. HF attention-mask code branches on data and
breaks ``vmap`` for padded batches; there (or with ``method="loop"``) the reference
loops over single examples with ``torch.autograd.grad``. Slow, simple, obviously right.
"""
from __future__ import annotations

from ..errors import OptionError

from typing import Any

import torch
from torch import nn
from torch.func import functional_call, grad, vmap
from torch.utils._pytree import tree_map

from ..data import batch_size_of, slice_batch

__all__ = ["per_example_grads", "param_names_of", "block_param_names"]


class _LossOf(nn.Module):
    """``forward(batch) = task.summed_loss(model, batch)``, so functional_call can swap params."""

    def __init__(self, task, loss_fn):
        super().__init__()
        self.model = task.model
        self._loss_fn = loss_fn

    def forward(self, batch):
        return self._loss_fn(self.model, batch)


def param_names_of(model: nn.Module, layers: list[str] | None) -> list[str]:
    """Parameter names of the modules ``layers`` (all trainable parameters if None)."""
    if layers is None:
        return [n for n, p in model.named_parameters() if p.requires_grad]
    modules = dict(model.named_modules())
    # a tied parameter (GPT-2's lm_head.weight is transformer.wte.weight) goes by the one
    # name model.named_parameters() gives it
    canonical = {id(p): n for n, p in model.named_parameters()}
    names = []
    for layer in layers:
        for p in modules[layer].parameters(recurse=False):
            if canonical[id(p)] not in names:
                names.append(canonical[id(p)])
    return names


def block_param_names(model: nn.Module, ref) -> list[str]:
    """Names, as ``model.named_parameters()`` gives them, of the parameters of a resolved
    block ``ref`` (``capture.hooks.LayerRef``). A tied parameter has one name (its first
    holder's), so a block that several modules share is differentiated once: its gradient
    is the sum over all its uses, not one copy per module."""
    canonical = {id(p): n for n, p in model.named_parameters()}
    return [canonical[id(ref.module.get_parameter(pname))] for pname in ref.param_names()]


def per_example_grads(task, batch: Any, params: list[str] | None = None, *,
                      method: str = "auto", loss_fn=None) -> dict[str, torch.Tensor]:
    """Per-example gradients ``{name: (B, *shape)}`` of ``task``'s loss on ``batch``.

    Parameters
    ----------
    params : list of parameter names (default: every trainable parameter).
    method : "vmap", "loop" or "auto" (vmap, falling back to the loop if vmap fails).
    loss_fn : ``(model, batch) -> summed scalar``; default ``task.summed_loss``.
    """
    loss_fn = loss_fn or task.summed_loss
    model = task.model
    all_params = dict(model.named_parameters())
    requested = params if params is not None else [n for n, p in all_params.items() if p.requires_grad]
    # a tied parameter answers to every holder's name ("lm_head.weight" is "transformer.wte.weight")
    canonical = {id(p): n for n, p in all_params.items()}
    alias = {n: canonical[id(p)] for n, p in model.named_parameters(remove_duplicate=False)}
    missing = [n for n in requested if n not in alias]
    if missing:
        raise KeyError(f"no parameters named {missing} in {type(model).__name__}")
    names = list(dict.fromkeys(alias[n] for n in requested))
    if method not in ("auto", "vmap", "loop"):
        raise OptionError(f"method must be 'auto', 'vmap' or 'loop', got {method!r}")
    out = None
    if method in ("auto", "vmap"):
        try:
            out = _vmap_grads(task, batch, names, loss_fn)
        except Exception:
            if method == "vmap":
                raise
    if out is None:
        out = _loop_grads(task, batch, names, loss_fn)
    return {n: out[alias[n]] for n in requested}


def _vmap_grads(task, batch, names, loss_fn):
    wrapper = _LossOf(task, loss_fn)
    fixed = {f"model.{n}": p.detach() for n, p in task.model.named_parameters() if n not in names}
    fixed.update({f"model.{n}": b for n, b in task.model.named_buffers()})
    free = {n: task.model.get_parameter(n).detach() for n in names}

    def one(free_params, example):
        example = tree_map(lambda t: t.unsqueeze(0) if isinstance(t, torch.Tensor) else t, example)
        state = {f"model.{n}": p for n, p in free_params.items()}
        state.update(fixed)
        return functional_call(wrapper, state, (example,))

    return vmap(grad(one), in_dims=(None, 0), randomness="different")(free, batch)


def _loop_grads(task, batch, names, loss_fn):
    model = task.model
    tensors = [model.get_parameter(n) for n in names]
    rows = []
    for i in range(batch_size_of(batch)):
        loss = loss_fn(model, slice_batch(batch, slice(i, i + 1)))
        rows.append(torch.autograd.grad(loss, tensors, allow_unused=True))
    out = {}
    for j, (name, p) in enumerate(zip(names, tensors)):
        out[name] = torch.stack([r[j] if r[j] is not None else torch.zeros_like(p) for r in rows])
    return out
