"""Wrapped models: the same block names for a model and its wrappers.

A wrapper adds a prefix to every module name and forwards to the model it holds:

=======================================  ==========================  ======================
wrapper                                  prefix                      inner model
=======================================  ==========================  ======================
``DistributedDataParallel`` / ``DataParallel`` / FSDP1   ``module.``  ``.module``
``torch.compile`` (``OptimizedModule``)  ``_orig_mod.``              ``._orig_mod``
PEFT ``PeftModel``                       ``base_model.model.``       ``.base_model.model``
PEFT tuner (``LoraModel``)               ``model.``                  ``.model``
=======================================  ==========================  ======================

FSDP2 (``fully_shard``) changes the class of the modules in place and renames nothing.
Whether a model's parameters are split across ranks (FSDP1, or DTensor parameters: FSDP2,
tensor parallel) is :func:`sharding` / :func:`is_sharded`, which the executors, the
methods' curvature choice and the trainer integrations read.
Layers are resolved on the innermost model, so ``ga.capture(ddp_model)``,
``ga.grads(ga.Task(model, ...))`` and the trainer integrations name blocks alike and their
gradients combine; a layer name given with a wrapper's prefix is accepted too. Inside a
PEFT model a LoRA-wrapped layer ``x`` keeps its frozen layer as ``x.base_layer``: that
block is named ``x`` (as in the model without adapters), and the adapters are
``x.lora_A.<adapter>`` and ``x.lora_B.<adapter>``.
"""
from __future__ import annotations

import sys

from torch import nn

from ..dtensor import is_dtensor

__all__ = ["unwrap", "strip_prefixes", "BASE_LAYER", "sharding", "is_sharded"]

BASE_LAYER = ".base_layer"
_DATA_PARALLEL = ("DistributedDataParallel", "DataParallel", "FullyShardedDataParallel")


def sharding(model: nn.Module) -> str | None:
    """How ``model``'s parameters are split across ranks:

    * ``"fsdp1"``: an FSDP1 ``FullyShardedDataParallel`` wrapper anywhere in it (flat
      parameters, whole only inside its forward and backward, or under
      ``summon_full_params``);
    * ``"dtensor"``: DTensor parameters (FSDP2 ``fully_shard``, tensor parallel): each rank
      keeps a shard of each, and a whole weight exists only inside a forward or backward;
    * None: every rank holds whole parameters (a plain model, DDP, ``DataParallel``).
    """
    fsdp = sys.modules.get("torch.distributed.fsdp")   # a model cannot be wrapped before it is imported
    wrapper = getattr(fsdp, "FullyShardedDataParallel", None)
    if wrapper is not None and any(isinstance(m, wrapper) for m in model.modules()):
        return "fsdp1"
    if any(is_dtensor(p) for p in model.parameters()):
        return "dtensor"
    return None


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model``'s parameters are split across ranks (FSDP1, FSDP2, tensor
    parallel: :func:`sharding`), so that no rank holds a whole weight outside a forward or
    backward and anything that reads whole parameters (``torch.func``, formed curvature
    products) cannot run on it."""
    return sharding(model) is not None


def _peft_inner(model: nn.Module):
    if "peft" not in sys.modules:   # a PEFT wrapper's class comes from peft: it is imported already
        return None
    try:
        from peft import PeftModel
        from peft.tuners.tuners_utils import BaseTuner
    except Exception:  # peft not installed: no PEFT wrappers exist
        return None
    if isinstance(model, PeftModel):
        return "base_model.", model.base_model
    if isinstance(model, BaseTuner):
        return "model.", model.model
    return None


def unwrap(model: nn.Module) -> tuple[nn.Module, tuple[str, ...]]:
    """``(inner_model, prefixes)``: the model under every wrapper, and the prefixes the
    wrappers add to module names (outermost first)."""
    prefixes = []
    for _ in range(8):
        name = type(model).__name__
        inner = None
        if name in _DATA_PARALLEL and isinstance(getattr(model, "module", None), nn.Module):
            prefix, inner = "module.", model.module
        elif name == "OptimizedModule" and isinstance(getattr(model, "_orig_mod", None), nn.Module):
            prefix, inner = "_orig_mod.", model._orig_mod
        else:
            found = _peft_inner(model)
            if found is not None:
                prefix, inner = found
        if inner is None:
            break
        prefixes.append(prefix)
        model = inner
    return model, tuple(prefixes)


def strip_prefixes(name: str, prefixes: tuple[str, ...], known=None) -> str:
    """A layer name as the inner model calls it: the wrappers' prefixes (all of them, in
    order) removed. ``known`` (the inner model's module names): a name it holds is kept as
    it is (Llama's own ``model.layers…`` is not a PEFT tuner's ``model.`` prefix)."""
    if known is not None and name in known:
        return name
    full = "".join(prefixes)
    if full and name.startswith(full):
        return name[len(full):]
    if full and name + "." == full:
        return ""
    return name


def display_name(name: str) -> str:
    """The block name of a module: a PEFT tuner's ``x.base_layer`` is ``x``."""
    while BASE_LAYER + "." in name + ".":
        i = (name + ".").index(BASE_LAYER + ".")
        name = name[:i] + name[i + len(BASE_LAYER):]
    return name
