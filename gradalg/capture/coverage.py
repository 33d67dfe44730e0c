"""Coverage: which of a model's parameters the attributed layers hold, and which not.

For the blocks resolved from ``layers`` (:func:`~gradalg.capture.hooks.resolve_layers`)::

    attributed = |⋃_blocks params(block) ∩ trainable|      total = |trainable params of the model|

each parameter counted **once** (a tied embedding/head is one tensor, as in
``model.named_parameters()``), trainable meaning ``requires_grad`` (under PEFT/LoRA the
adapters, not the frozen base weights). The trainable parameters left out are grouped
for reading: every norm (a module whose class name contains ``Norm``) in one group,
the other modules by their name with each numeric index replaced by ``*``
(``model.layers.*.mlp.experts``), largest first; a left-out parameter that another
module also holds is marked ``tied to <that module>``, and a position embedding (shared by the batch: hook
capture cannot separate its examples, ``layers="all"`` leaves it out) is marked
``backend='func' only``.

``explain()`` shows it, e.g.::

    coverage: 48 blocks, 85.0 M of 124.4 M parameters (68.3 %); not attributed:
    transformer.wte (38.6 M, tied to lm_head), transformer.wpe (786.4 k, position embedding:
    backend='func' only), 25 norms (38.4 k) — pass layers="all" or name them to include
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from torch import nn

from .blocks import select_block_layers
from .hooks import resolve_layers
from .layers import rule_class
from .wrappers import display_name, unwrap

__all__ = ["Coverage", "layer_coverage", "count_label"]

_INDEX = re.compile(r"(?<=\.)\d+(?=\.|$)")


def count_label(n: int) -> str:
    """A parameter count for reading: ``84.9 M``, ``38.4 k``, ``640``."""
    for scale, unit in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return str(int(n))


@dataclass(frozen=True)
class LeftOut:
    """A group of trainable parameters not attributed: ``label`` (a module name, a name
    pattern or ``"norms"``), the number of modules and of parameters, and a note."""

    label: str
    modules: int
    params: int
    note: str = ""
    func_only: bool = False   # hook capture cannot record it (a position embedding)

    def describe(self) -> str:
        details = [count_label(self.params)] + ([self.note] if self.note else [])
        if self.label == "norms":
            return f"{self.modules} norm{'s' if self.modules != 1 else ''} ({', '.join(details)})"
        if self.modules > 1:
            details.insert(0, f"{self.modules} modules")
        return f"{self.label} ({', '.join(details)})"


@dataclass(frozen=True)
class Coverage:
    """What a set of layers attributes of a model's trainable parameters.

    ``blocks``: blocks resolved; ``attributed`` / ``total``: trainable parameters, each
    counted once; ``frozen_attributed``: parameters of the blocks that do not require a
    gradient (counted apart); ``left_out``: the :class:`LeftOut` groups; ``rule``: how
    the layers were selected (a :class:`~gradalg.TransformerBlocks` rule), or ""."""

    model: str
    blocks: int
    attributed: int
    total: int
    frozen_attributed: int = 0
    left_out: tuple = ()
    rule: str = ""

    @property
    def fraction(self) -> float:
        return self.attributed / self.total if self.total else 0.0

    def describe(self) -> str:
        """The one-line coverage statement (with ``rule`` on a second line when set)."""
        line = (f"coverage: {self.blocks} blocks, {count_label(self.attributed)} of {count_label(self.total)} "
                f"parameters ({100 * self.fraction:.1f} %)")
        if self.frozen_attributed:
            line += f" (+ {count_label(self.frozen_attributed)} frozen)"
        if self.left_out:
            line += "; not attributed: " + ", ".join(g.describe() for g in self.left_out)
            if not all(g.func_only for g in self.left_out):
                line += ' — pass layers="all" or name them to include'
        else:
            line += "; every trainable parameter is attributed"
        return line + (f"\n  layers: {self.rule}" if self.rule else "")

    def to_dict(self) -> dict:
        return {"model": self.model, "blocks": self.blocks, "attributed_parameters": self.attributed,
                "trainable_parameters": self.total, "fraction": self.fraction,
                "frozen_attributed_parameters": self.frozen_attributed, "rule": self.rule,
                "not_attributed": [{"what": g.label, "modules": g.modules, "parameters": g.params,
                                    "note": g.note, "func_only": g.func_only} for g in self.left_out]}


def _is_norm(module: nn.Module) -> bool:
    return "Norm" in type(module).__name__


def _note(tied: set, position: bool) -> str:
    notes = (["tied to " + ", ".join(sorted(tied))] if tied else []) + (
        ["position embedding: backend='func' only"] if position else [])
    return ", ".join(notes)


def layer_coverage(model: nn.Module, layers, backend: str = "hooks", selection=None) -> Coverage:
    """The :class:`Coverage` of ``layers`` (names as a ``Source`` holds them) in ``model``.

    ``selection``: the task's default layer selection; when it is a
    :class:`~gradalg.TransformerBlocks` that selects exactly ``layers``, its rule is shown.
    """
    from ..task import TransformerBlocks

    refs = resolve_layers(model, list(layers), backend=backend)
    inner, _ = unwrap(model)
    chosen: set[int] = set()
    for ref in refs:   # a tied block's parameters are its first holder's (the same tensors)
        own = dict(ref.module.named_parameters())   # dotted: a MultiheadAttention's out_proj
        chosen.update(id(own[n]) for n in ref.param_names() if n in own)
    # each parameter once, with every module holding it (first holder first)
    holders: dict[int, list[tuple[str, nn.Module]]] = {}
    params: dict[int, nn.Parameter] = {}
    for mname, module in inner.named_modules(remove_duplicate=False):
        for p in module.parameters(recurse=False):
            if mname not in [n for n, _ in holders.get(id(p), [])]:
                holders.setdefault(id(p), []).append((mname, module))
            params[id(p)] = p
    total = sum(p.numel() for p in params.values() if p.requires_grad)
    attributed = sum(params[i].numel() for i in chosen if i in params and params[i].requires_grad)
    frozen = sum(params[i].numel() for i in chosen if i in params and not params[i].requires_grad)
    groups: dict[str, list] = {}
    for pid, p in params.items():
        if pid in chosen or not p.requires_grad:
            continue
        (owner, module), *others = holders[pid]
        key = "norms" if _is_norm(module) else _INDEX.sub("*", display_name(owner))
        entry = groups.setdefault(key, [set(), 0, set(), False])
        entry[0].add(owner)
        entry[1] += p.numel()
        entry[2].update(display_name(n) for n, _ in others)
        entry[3] = entry[3] or (backend == "hooks" and rule_class(module).batch_shared(owner))
    left_out = tuple(sorted((LeftOut(k, len(v[0]), v[1], _note(v[2], v[3]), v[3]) for k, v in groups.items()),
                            key=lambda g: (-g.params, g.label)))
    rule = ""
    if isinstance(selection, TransformerBlocks):
        picked = select_block_layers(inner, selection.head, selection.vocabulary)
        if tuple(r.name for r in resolve_layers(model, list(picked.names), backend=backend)) == tuple(
                r.name for r in refs):
            rule = f"{selection}: {picked.rule}"
    return Coverage(type(inner).__name__, len(refs), attributed, total, frozen, left_out, rule)
