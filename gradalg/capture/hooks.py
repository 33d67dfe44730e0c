"""Recording per-example factors with module hooks, for a whole batch at once.

A forward hook on each recorded module keeps its input activations ``A`` and its
output tensor; one ``torch.autograd.grad(loss, outputs)`` then returns the output
gradients ``D`` of every recorded call. Asking autograd for the outputs' gradients,
not the parameters', skips the weight-gradient GEMMs that attribution never needs.
"""
from __future__ import annotations

import difflib
import fnmatch
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge

from ..errors import UnsupportedLayerError
from .factors import Factors
from .layers import LayerRule, replaying, rule_for
from .provenance import CallStack, find_routed, replay_frames, routed_frames
from .rows import layout_for

__all__ = ["resolve_layers", "ForwardRecorder", "capture_batch", "LayerRef", "forward_share_key"]


@dataclass(frozen=True)
class LayerRef:
    """A recorded module: its dotted name, the module and its :class:`LayerRule`."""

    name: str
    module: nn.Module
    rule: LayerRule


POSITION_EMBEDDINGS = ("wpe", "position_embeddings", "embed_positions", "pos_emb", "pos_embed",
                       "relative_attention_bias")


def resolve_layers(model: nn.Module, layers=None, *, backend: str = "hooks") -> list[LayerRef]:
    """The modules named by ``layers``, in model order.

    ``layers`` is None (every supported module with trainable parameters, except
    position embeddings named as in :data:`POSITION_EMBEDDINGS`, which HF models call
    with positions shared by the whole batch), a list of dotted module names, or glob
    patterns (``"transformer.h.*.mlp.c_fc"``). ``"all"``: the default plus the modules
    recorded by per-example replay (norms and any other module with parameters of its
    own: :class:`~gradalg.capture.layers.ReplayRule`), i.e. every parameter but the
    position embeddings'; globs select default kinds only, exact names any kind.
    """
    modules = dict(model.named_modules())
    if layers is None or (isinstance(layers, str) and layers == "all" and "all" not in modules):
        names = []
        for name, module in modules.items():
            if not any(p.requires_grad for p in module.parameters(recurse=False)):
                continue
            if isinstance(module, nn.Embedding) and name.split(".")[-1] in POSITION_EMBEDDINGS:
                continue  # called with positions shared by the batch: no per-example gradient
            if backend == "func":
                names.append(name)
                continue
            try:
                rule = rule_for(name, module)
            except UnsupportedLayerError:
                continue
            if layers is None and not rule.in_default:
                continue   # norms and other replayed modules: layers="all"
            names.append(name)
        if not names:
            raise UnsupportedLayerError(
                f"{type(model).__name__} has no layer that hook capture supports; pass "
                "backend='func' or name the layers"
            )
    else:
        if isinstance(layers, str):
            layers = [layers]
        names = []
        for pattern in layers:
            if pattern in modules:  # an exact name; "" is the model itself (a bare nn.Linear)
                hits = [pattern]
            else:
                # a glob keeps the modules it can record: parameterless ones (activations,
                # dropout) and, for hooks, unsupported ones (norms) are skipped
                hits = [n for n in modules if n and fnmatch.fnmatchcase(n, pattern)
                        and _recordable(n, modules[n], backend)]
            if not hits:
                named = [n for n in modules if n]
                close = [n for n in named if pattern.split(".")[-1] in n][:5]
                close += [n for n in difflib.get_close_matches(pattern, named, n=3) if n not in close]
                hint = f"; did you mean one of {close}?" if close else ""
                raise KeyError(f"no module named {pattern!r} in {type(model).__name__}{hint} "
                               "(names are those of model.named_modules())")
            names.extend(h for h in hits if h not in names)
        order = {n: i for i, n in enumerate(modules)}
        names.sort(key=order.__getitem__)
    refs = []
    for name in names:
        module = modules[name]
        if backend == "func":
            refs.append(LayerRef(name, module, None))
        else:
            refs.append(LayerRef(name, module, rule_for(name, module)))
    return refs


def forward_share_key(source, refs: list[LayerRef] | None = None):
    """Sources (``expr.Source``) with equal keys can share one forward per batch (the
    executor's ``PassCapture``; the planner costs them so); None: never shared. Hooks on
    the model itself would fire on every replayed call, so those sources are not shared."""
    if source.backend != "hooks":
        return None
    refs = resolve_layers(source.task.model, list(source.layers)) if refs is None else refs
    if any(ref.module is source.task.model for ref in refs):
        return None
    return (source.task.token, tuple(ref.name for ref in refs))


def _recordable(name: str, module: nn.Module, backend: str) -> bool:
    if not any(p.requires_grad for p in module.parameters(recurse=False)):
        return False
    if backend == "func":
        return True
    try:
        rule = rule_for(name, module)
    except UnsupportedLayerError:
        return False
    return rule.in_default


@dataclass
class _Call:
    A: Any
    output: torch.Tensor
    edge: Any = None  # the output's autograd edge, taken before any in-place op overwrites it
    frames: tuple = ()  # the module calls enclosing this one (capture.provenance)


@dataclass
class ForwardRecorder:
    """Context manager: records ``A`` and the output tensor of every call of each layer."""

    layers: list[LayerRef]
    calls: dict[str, list[_Call]] = field(default_factory=dict)
    _handles: list = field(default_factory=list)

    def __enter__(self):
        self.calls = {ref.name: [] for ref in self.layers}
        self._stack = CallStack().__enter__()
        for ref in self.layers:
            self._handles.append(ref.module.register_forward_hook(self._hook(ref), with_kwargs=True))
        return self

    def __exit__(self, *exc):
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._stack.__exit__(*exc)
        return False

    def _hook(self, ref: LayerRef):
        def hook(module, args, kwargs, output):
            if not torch.is_grad_enabled() or replaying():
                return
            recorded = ref.rule.record(module, args, kwargs, output)
            for rec, out in recorded:
                self.calls[ref.name].append(_Call(rec, out, get_gradient_edge(out), self._stack.snapshot()))
            return ref.rule.hooked_output(output, recorded)
        return hook


def capture_batch(loss: torch.Tensor, recorder: ForwardRecorder, *, token_mask: torch.Tensor | None = None,
                  grad_scale: float = 1.0, retain_graph: bool = False,
                  n_examples: int | None = None) -> dict[str, Factors]:
    """Per-example factors of every recorded layer for the batch whose summed loss is ``loss``.

    One backward pass; gradients are taken w.r.t. the layers' outputs only.
    ``token_mask`` (B, T) removes padding positions; ``grad_scale`` multiplies D (a
    mean-reduced loss is rescaled by the batch size this way). ``n_examples`` (default: the
    token mask's rows) lets rows of flattened tokens (B·T, d) be attributed to examples
    (:mod:`gradalg.capture.rows`).
    """
    n_examples, lengths = batch_rows(recorder, n_examples, token_mask)
    routed = find_routed(recorder, n_examples, lengths)    # rows gathered by index: replayed
    outputs, edges, owners = [], [], []
    for ref in recorder.layers:
        calls = recorder.calls[ref.name]
        if not calls:
            raise RuntimeError(
                f"layer {ref.name!r} was not called with gradients enabled in the forward "
                "pass of the loss; remove it from `layers`, or check that the loss uses it"
            )
        for i, call in enumerate(calls):
            if (ref.name, i) in routed:
                continue
            outputs.append(call.output)
            edges.append(call.edge)
            owners.append((ref, i))
    # Gradients w.r.t. the outputs' edges as recorded: an in-place op after the layer
    # (ReLU(inplace=True)) rewrites the output tensor's history, not the edge.
    frames = routed_frames(routed)
    grads = torch.autograd.grad(loss, edges + [f.edge for f in frames], allow_unused=True,
                                retain_graph=retain_graph)
    grads, frame_grads = grads[:len(edges)], grads[len(edges):]
    per_layer: dict[str, list[Factors]] = {ref.name: [] for ref in recorder.layers}
    for name, factors in replay_frames(routed, frames, frame_grads, recorder.layers, grad_scale):
        per_layer[name].append(factors)
    for (ref, i), out, g in zip(owners, outputs, grads):
        call = recorder.calls[ref.name][i]
        if g is None:
            g = torch.zeros_like(out)
        g = g.detach() if grad_scale == 1.0 else g.detach() * grad_scale
        layout = layout_for(ref.name, ref.rule.rows(call.A)[0], n_examples, lengths)
        factors = ref.rule.factors(ref.module, call.A, g, layout)
        if token_mask is not None and factors.T == token_mask.shape[1]:
            factors = factors.mask_tokens(token_mask)
        per_layer[ref.name].append(factors)
    blocks = {name: Factors.concat_tokens(parts) for name, parts in per_layer.items()}
    check_batch_rows(blocks)
    return blocks


def batch_rows(recorder: ForwardRecorder, n_examples: int | None, token_mask) -> tuple[int | None, set]:
    """The batch's number of examples (given, or the token mask's rows) and its sequence
    lengths: the token mask's T and the positions of every call with one row per example."""
    if n_examples is None and token_mask is not None:
        n_examples = token_mask.shape[0]
    lengths = {token_mask.shape[1]} if token_mask is not None and token_mask.dim() == 2 else set()
    for ref in recorder.layers:
        for call in recorder.calls[ref.name]:
            rows, positions = ref.rule.rows(call.A)
            if rows == n_examples:
                lengths.add(positions)
    return n_examples, lengths


def check_batch_rows(blocks: dict) -> None:
    """Every layer must record one row per example; a layer whose input is shared by the
    whole batch (broadcast) records one row for all, and its per-example gradients
    cannot be separated."""
    rows = {name: f.n for name, f in blocks.items()}
    if len(set(rows.values())) <= 1:
        return
    n = max(rows.values())
    shared = [name for name, k in rows.items() if k != n]
    raise UnsupportedLayerError(
        f"layers {shared} recorded {sorted(set(rows[s] for s in shared))} rows while the batch has "
        f"{n}: their input is shared by the whole batch (broadcast), e.g. GPT-2's position "
        "embedding `transformer.wpe` called with position_ids of shape (1, T), so their "
        "per-example gradients cannot be separated. Pass per-example inputs (position_ids of "
        "shape (B, T)) or leave these layers out of `layers`"
    )
