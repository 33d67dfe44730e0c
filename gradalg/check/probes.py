"""The checks that read the model and the data directly (no gradient): finite weights,
modules in train mode, duplicated special tokens.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from .result import Finding

__all__ = ["finite_state", "train_mode", "special_tokens", "batch_stat_modules", "dropout_modules"]

_SHOWN = 8


def _names(names: list) -> str:
    return ", ".join(names[:_SHOWN]) + (f" (and {len(names) - _SHOWN} more)" if len(names) > _SHOWN else "")


def finite_state(model: nn.Module) -> Finding:
    """Fail when a parameter or a floating buffer holds NaN/inf (naming them)."""
    bad = [f"parameter {n}" for n, p in model.named_parameters() if not bool(torch.isfinite(p.detach()).all())]
    bad += [f"buffer {n}" for n, b in model.named_buffers()
            if b.is_floating_point() and not bool(torch.isfinite(b).all())]
    if not bad:
        return Finding("finite", "ok", "every parameter and floating buffer is finite")
    return Finding("finite", "fail", f"NaN/inf in {_names(bad)}: every gradient and score would be NaN",
                   "reload the checkpoint, or find the step that made them non-finite (a learning rate too "
                   "high, an overflow in half precision); gradalg cannot attribute through NaN weights",
                   {"non_finite": len(bad)}, where=tuple(bad))


def dropout_modules(model: nn.Module) -> list[str]:
    """Names of modules in train mode that drop at random: ``nn.Dropout*`` (and any module
    whose class name contains "Dropout") with a probability ``p > 0``."""
    out = []
    for name, m in model.named_modules():
        p = getattr(m, "p", None)
        if m.training and "Dropout" in type(m).__name__ and isinstance(p, (int, float)) and p > 0:
            out.append(name or type(m).__name__)
    return out


def batch_stat_modules(model: nn.Module) -> list[str]:
    """Names of modules in train mode that normalize by the batch's statistics: every
    ``_BatchNorm`` (BatchNorm1d/2d/3d, SyncBatchNorm, LazyBatchNorm) and instance norms that
    track running statistics."""
    out = []
    for name, m in model.named_modules():
        if not m.training:
            continue
        if isinstance(m, nn.modules.batchnorm._BatchNorm) or (
                isinstance(m, nn.modules.instancenorm._InstanceNorm) and m.track_running_stats):
            out.append(name or type(m).__name__)
    return out


def train_mode(model: nn.Module, random_forward: bool | None = None) -> Finding:
    """Fail when modules in train mode make an example's gradient depend on its batch.

    ``random_forward``: whether two forwards of the same batch in the model's current mode
    gave different losses (functional dropout, e.g. an attention kernel's ``dropout_p``);
    None when not measured."""
    dropout, stats = dropout_modules(model), batch_stat_modules(model)
    numbers = {"dropout_modules": len(dropout), "batch_statistics_modules": len(stats),
               "model_training": bool(model.training)}
    if random_forward is not None:
        numbers["random_forward"] = bool(random_forward)
    if not dropout and not stats and not random_forward:
        mode = "train" if model.training else "eval"
        return Finding("train_mode", "ok", f"the model is in {mode} mode with no dropout or batch statistics active",
                       numbers=numbers)
    parts = []
    if dropout:
        parts.append(f"dropout with p > 0 is active in {_names(dropout)} (each call draws new masks)")
    if stats:
        parts.append(f"{_names(stats)} normalize by the batch's statistics (an example's output depends "
                     "on the other examples of its batch)")
    if random_forward and not dropout:
        parts.append("two forwards of the same batch give different losses (dropout inside a kernel, "
                     "e.g. attention dropout)")
    message = ("; ".join(parts) + ". ga.grads and the methods run the model in eval mode, but ga.capture, "
               "training-time capture and any loop of your own record it as it is")
    return Finding("train_mode", "fail", message,
                   "call model.eval() before capturing (and model.train() to resume training), or set the "
                   "dropout probabilities to 0", numbers, where=tuple(dropout + stats))


def special_token_ids(model: nn.Module) -> dict:
    """``{name: id}`` of the model config's BOS / CLS / EOS / SEP ids that are set."""
    config = getattr(model, "config", None)
    out = {}
    for name in ("bos_token_id", "cls_token_id", "eos_token_id", "sep_token_id"):
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            out[name] = value
    return out


def special_tokens(model: nn.Module, alone, ids) -> Finding | None:
    """Warn when examples start with their BOS/CLS token twice or end with EOS/SEP twice
    (text tokenized with ``add_special_tokens=True`` after the special tokens were already
    written into it). None when the data are not token ids or the model names no special
    tokens."""
    specials = special_token_ids(model)
    if not specials or not all(isinstance(b, Mapping) and isinstance(b.get("input_ids"), torch.Tensor)
                               and b["input_ids"].dim() == 2 for b in alone):
        return None
    starts = {v for k, v in specials.items() if k in ("bos_token_id", "cls_token_id")}
    ends = {v for k, v in specials.items() if k in ("eos_token_id", "sep_token_id")}
    doubled = []
    for i, b in zip(ids, alone):
        row = b["input_ids"][0].tolist()
        if len(row) >= 3 and ((row[0] == row[1] and row[0] in starts) or (row[-1] == row[-2] and row[-1] in ends)):
            doubled.append(i)
    numbers = {"examples": len(alone), "doubled": len(doubled)}
    if not doubled:
        return Finding("special_tokens", "ok", "no example starts or ends with a doubled special token",
                       numbers=numbers)
    return Finding("special_tokens", "warning",
                   f"examples {doubled[:_SHOWN]} start with their BOS/CLS token twice or end with EOS/SEP twice "
                   f"(special ids {specials}): the text was likely tokenized with special tokens it already held",
                   "tokenize with add_special_tokens=False when the text already carries them (or strip the "
                   "duplicates), so each example's gradient is that of the sequence the model is trained on",
                   numbers, examples=tuple(doubled))
