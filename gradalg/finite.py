"""NaN/inf found where it starts: a model's weights and buffers, the rows of a batch,
the examples of a data set.

    check_model(model)                  # NonFiniteWeightError naming the first bad parameter / buffer
    check_rows(blocks, ids)             # NonFiniteGradientError naming the examples and layers
    check_examples(tensors, ids, what)  # NonFiniteGradientError naming the examples of an input

A NaN weight makes every example's gradient NaN; reported on the gradients, it would be
blamed on the examples. So every pass checks the model first (:func:`check_model`: one
finite sum per parameter and buffer, before the first batch), and only
then the rows of each batch (:func:`check_rows`: one reduction per row, see
:func:`finite_rows`). On the foundation floor (imports torch, ``errors`` and ``dtensor``
only), so that ``capture/`` (``ga.capture``, training-time capture), ``exec/`` (``ga.grads``) and
``unroll/`` (MAGIC) share it.
"""
from __future__ import annotations

import torch
from torch import nn

from .dtensor import local_shard
from .errors import NonFiniteGradientError, NonFiniteWeightError

__all__ = ["check_model", "finite_rows", "check_rows", "check_examples", "nonfinite_examples"]


def _is_norm_statistic(model: nn.Module, name: str) -> bool:
    """Whether buffer ``name`` is a normalization layer's running statistic (BatchNorm,
    InstanceNorm: ``_NormBase``), where an inf is as wrong as a NaN."""
    owner, _, _ = name.rpartition(".")
    try:
        module = model.get_submodule(owner) if owner else model
    except AttributeError:
        return False
    return isinstance(module, nn.modules.batchnorm._NormBase)


def _sum_is_finite(t: torch.Tensor) -> bool:
    """True when ``t`` certainly holds no NaN/inf: its sum (one read, no temporary) is
    finite. A NaN/inf entry makes the sum NaN/inf; finite entries can overflow it (then
    the caller checks entry by entry). Half precision sums in float32."""
    if t.is_complex():
        return bool(torch.isfinite(t.sum()))
    return bool(torch.isfinite(t.sum(dtype=torch.float64 if t.dtype == torch.float64 else torch.float32)))


def check_model(model: nn.Module) -> None:
    """Raise :class:`NonFiniteWeightError` naming the first parameter or buffer of
    ``model`` (in ``named_parameters()``, then ``named_buffers()`` order) holding NaN/inf.

    Parameters: any NaN or inf. Buffers: any NaN, and inf in a normalization layer's
    running statistics; other buffers may hold ±inf on purpose (an additive attention mask
    registered as a buffer) and are left alone. Integer tensors and tensors on the
    ``meta`` device have no non-finite values. Cost: one ``sum`` per tensor (a sum is
    NaN/inf when an entry is; only a tensor whose sum is not finite is checked entry by
    entry); GPT-2 small: see ``docs/reliability.md``.
    """
    for kind, named in (("parameter", model.named_parameters()), ("buffer", model.named_buffers())):
        for name, tensor in named:
            t = local_shard(tensor.detach())
            if not (t.is_floating_point() or t.is_complex()) or t.device.type == "meta" or t.numel() == 0:
                continue
            if _sum_is_finite(t) or bool(torch.isfinite(t).all()):
                continue
            n_nan = int(torch.isnan(t).sum())
            if kind == "buffer" and n_nan == 0 and not _is_norm_statistic(model, name):
                continue   # ±inf in a mask buffer: a value the model uses on purpose
            raise NonFiniteWeightError(name, kind, n_nan, int(torch.isinf(t).sum()), t.numel())


def finite_rows(x: torch.Tensor) -> torch.Tensor:
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


def check_rows(blocks: dict, ids, where: str | None = None) -> None:
    """Raise :class:`NonFiniteGradientError` naming the examples with NaN/inf gradients.

    blocks : {layer: (n, ...) tensor, or factors with ``D`` (n, T, out) and ``A``
        (n, T, in) tensors (one-hot activations, not tensors, are always finite)}
    ids : the n example ids.
    where : replaces "NaN/inf per-example gradients in layers [...]" in the message.
    """
    bad = None
    layers = []
    for name, value in blocks.items():
        if isinstance(value, torch.Tensor):
            ok = finite_rows(value)
        else:
            ok = finite_rows(value.D)
            if isinstance(value.A, torch.Tensor):
                ok &= finite_rows(value.A)
        if not ok.all():
            layers.append(name)
            bad = ~ok if bad is None else bad | ~ok
    if bad is not None:
        raise NonFiniteGradientError([ids[i] for i in bad.nonzero().flatten().tolist()], layers,
                                     None if where is None else f"{where} (layers {layers})")


def nonfinite_examples(tensors) -> list[int]:
    """Positions of the rows (dim 0) holding NaN/inf in any floating tensor of ``tensors``
    (a tensor, or a tuple, list or dict of tensors with one row per example)."""
    values = tensors.values() if isinstance(tensors, dict) else \
        (tensors if isinstance(tensors, (tuple, list)) else (tensors,))
    bad = None
    for t in values:
        if not isinstance(t, torch.Tensor) or not (t.is_floating_point() or t.is_complex()) or t.dim() == 0:
            continue
        ok = finite_rows(t.detach()) if t.dim() > 1 else torch.isfinite(t.detach())
        bad = ~ok if bad is None else bad | ~ok
    return [] if bad is None else bad.nonzero().flatten().tolist()


def check_examples(tensors, ids, what: str, fix: str) -> None:
    """Raise :class:`NonFiniteGradientError` naming the examples (``ids[i]``) whose rows of
    ``tensors`` hold NaN/inf; ``what`` names the input ("the training data")."""
    bad = nonfinite_examples(tensors)
    if bad:
        raise NonFiniteGradientError([ids[i] for i in bad], [], f"NaN/inf in {what}", fix)
