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

from ..errors import LayerNameError, OptionError, UnsupportedLayerError
from ..own_hooks import OwnHooks
from ..space import Block
from ..task import TransformerBlocks
from . import experts as _experts  # noqa: F401 (registers the fused experts' rule)
from .blocks import select_block_layers
from .factors import Factors
from .layers import POSITION_EMBEDDINGS, LayerRule, replaying, rule_class, rule_for  # noqa: F401 (re-exported)
from .provenance import CallStack, find_routed, replay_frames, routed_frames
from .rows import layout_for
from .tying import LayerUse, container_modules, tie_layers, use_factors
from .weight_uses import OutsideUses, mark_checked, needs_check
from .wrappers import BASE_LAYER, display_name, strip_prefixes, unwrap

__all__ = ["resolve_layers", "ForwardRecorder", "capture_batch", "LayerRef", "forward_share_key", "released_params"]


@dataclass(frozen=True)
class LayerRef:
    """A recorded block: its name, the module and :class:`LayerRule` that give its shape and
    parameter layout, and the modules that contribute to it.

    ``uses`` : the :class:`~gradalg.capture.tying.LayerUse` of every module whose calls
    add to the block (one for an untied layer; several for a tied parameter).
    ``aliases`` : other module names that select this block (the tied holders).
    ``params`` : names (in ``module``) of the block's parameters; None for all of them.
    """

    name: str
    module: nn.Module
    rule: LayerRule
    uses: tuple = ()
    aliases: tuple = ()
    params: tuple | None = None

    def __post_init__(self):
        if not self.uses and self.rule is not None:
            object.__setattr__(self, "uses", (LayerUse(self.name, self.module, self.rule),))

    def block(self):
        """The :class:`~gradalg.space.Block` of this layer (hooks backend)."""
        return Block(self.name, self.rule.block_shape(self.module), self.rule.kind, aliases=self.aliases)

    def param_names(self) -> tuple[str, ...]:
        """Names in ``module`` of the block's parameters."""
        if self.params is not None:
            return tuple(self.params)
        if self.rule is not None:
            return tuple(self.rule.param_names(self.module))
        return tuple(n for n, p in self.module.named_parameters(recurse=False) if p is not None)




def resolve_layers(model: nn.Module, layers=None, *, backend: str = "hooks") -> list[LayerRef]:
    """The blocks named by ``layers``, in model order.

    ``layers`` is None (every supported module with trainable parameters, except
    position embeddings named as in :data:`POSITION_EMBEDDINGS`, which HF models call
    with positions shared by the whole batch), a list of dotted module names, or glob
    patterns (``"transformer.h.*.mlp.c_fc"``). ``"all"``: the default plus the modules
    recorded by per-example replay (norms and any other module with parameters of its
    own: :class:`~gradalg.capture.layers.ReplayRule`), i.e. every parameter but the
    position embeddings'; globs select default kinds only, exact names any kind. A
    :class:`~gradalg.TransformerBlocks`: the linear layers inside the model's transformer
    blocks (:mod:`gradalg.capture.blocks`; the ``ga.tasks`` language tasks' default).

    Wrappers (DDP, ``torch.compile``, PEFT: :mod:`gradalg.capture.wrappers`) are looked
    through, so names are those of the wrapped model (a wrapper's prefix is accepted). A
    parameter several modules hold (tied embeddings, a reused weight) is one block, named by
    its first holder; the others are aliases (:mod:`gradalg.capture.tying`).
    """
    model, prefixes = unwrap(model)
    if isinstance(layers, TransformerBlocks):
        layers = list(select_block_layers(model, layers.head, layers.vocabulary).names)
    every_kind = isinstance(layers, str) and layers == "all" and "all" not in dict(model.named_modules())
    if every_kind:
        layers = None
    if layers is not None:
        if not isinstance(layers, (str, list, tuple)) or not all(isinstance(n, str) for n in layers):
            raise OptionError(f"layers must be None, 'all', a module name or glob pattern, a list of them or "
                              f"ga.TransformerBlocks(), got {layers!r:.80}")
        layers = [layers] if isinstance(layers, str) else list(layers)
        if not layers:
            raise UnsupportedLayerError("layers=[] names no layer: pass layers=None for every supported "
                                        "layer, or a list of module names")
        known = dict(model.named_modules(remove_duplicate=False))
        layers = [strip_prefixes(p, prefixes, known) for p in layers]
    modules = dict(model.named_modules(remove_duplicate=False))
    # "<module>.<part>": one block of a module recorded as several (fused experts)
    parts_named: dict[str, set] = {}
    known_parts: dict[str, set] = {}
    if layers is not None and backend != "func":
        whole = []
        for p in layers:
            if (hit := _part_of(p, modules, known_parts)) is not None:
                parts_named.setdefault(hit[0], set()).add(hit[1])
            else:
                whole.append(p)
        selected = _layer_names(model, whole, backend) if whole else []
        order = {n: i for i, n in enumerate(modules)}
        names = sorted(set(selected) | set(parts_named), key=order.__getitem__)
        parts_named = {m: s for m, s in parts_named.items() if m not in selected}   # whole: every part
    else:   # backend='func' records modules whole: a part names its module
        if layers is not None:
            layers = list(dict.fromkeys(hit[0] if (hit := _part_of(p, modules, known_parts)) else p for p in layers))
        names = _layer_names(model, layers, backend, every_kind)
    # a module registered under several names is one block, named by the first
    every: dict[int, list[str]] = {}
    for name, module in modules.items():
        every.setdefault(id(module), []).append(name)
    refs, seen = [], set()
    for name in names:
        module = modules[name]
        if id(module) in seen:
            continue
        seen.add(id(module))
        first = every[id(module)][0]
        shown = display_name(first)
        aliases = tuple(display_name(n) for n in every[id(module)][1:])
        rule = None if backend == "func" else rule_for(first, module)
        if hasattr(rule, "parts"):     # a module recorded as several blocks (fused experts)
            wanted = parts_named.get(name)
            refs.extend(LayerRef(f"{shown}.{suffix}", module, part, aliases=tuple(f"{a}.{suffix}" for a in aliases))
                        for suffix, part in rule.parts(module) if wanted is None or suffix in wanted)
            continue
        refs.append(LayerRef(shown, module, rule, aliases=aliases))
    return tie_layers(model, refs, _make_ref, backend)


def _part_of(pattern: str, modules: dict, known: dict) -> tuple[str, str] | None:
    """``(module name, part)`` when ``pattern`` names one block of a module recorded as
    several (``model.layers.0.mlp.experts.down_proj.3``), else None. ``known``: ``{module
    name: its parts' suffixes}``, filled as modules are met (one resolve)."""
    if pattern in modules:
        return None
    for cut in (2, 1):
        bits = pattern.rsplit(".", cut)
        owner = bits[0]
        if len(bits) != cut + 1 or owner not in modules:
            continue
        if owner not in known:
            rule = rule_class(modules[owner]).for_module(modules[owner])
            known[owner] = {s for s, _ in rule.parts(modules[owner])} if hasattr(rule, "parts") else set()
        suffix = ".".join(bits[1:])
        if suffix in known[owner]:
            return owner, suffix
    return None


def _make_ref(name, module, rule, uses, aliases, params) -> LayerRef:
    return LayerRef(name, module, rule, tuple(uses), tuple(aliases), params)


def _param_path(model, pattern: str, modules: dict) -> bool:
    """Whether ``pattern`` names a parameter ``<module>.<param>`` of one of ``modules``."""
    if "." not in pattern:
        return False
    mod, pname = pattern.rsplit(".", 1)
    return mod in modules and isinstance(getattr(modules[mod], pname, None), nn.Parameter)


def _layer_names(model: nn.Module, layers, backend: str, every_kind: bool = False) -> list[str]:
    """Module names (of ``model``) that ``layers`` selects, in model order (``every_kind``:
    ``layers="all"``, the default kinds and the replayed ones)."""
    modules = dict(model.named_modules(remove_duplicate=False))
    # submodules whose weights their parent uses without calling them (nn.MultiheadAttention's
    # out_proj): no hook of theirs fires. {name: the parent's name}
    functional = {f"{n}.{c}" if n else c: n for n, m in modules.items()
                  for c in rule_class(m).uses_without_calling} if backend != "func" else {}
    if layers is None:
        containers = container_modules(model)   # recorded through the descendant holding their parameters
        names = [name for name, module in model.named_modules()
                 if name not in containers and name not in functional and not rule_class(module).batch_shared(name)
                 and _recordable(name, module, backend, every_kind)]
        if not names:
            raise UnsupportedLayerError(
                f"{type(model).__name__} has no layer that hook capture supports; pass "
                "backend='func' or name the layers"
            )
        return names
    names = []
    for pattern in layers:
        names.extend(h for h in _pattern_names(model, modules, functional, pattern, backend) if h not in names)
    order = {n: i for i, n in enumerate(modules)}
    names.sort(key=order.__getitem__)
    return names


def _pattern_names(model, modules: dict, functional: dict, pattern: str, backend: str) -> list[str]:
    """The module names one entry of ``layers`` selects: an exact name, ``<module>.<param>``
    or a glob; a name that selects nothing raises :class:`LayerNameError` with close names."""
    if pattern in functional:
        parent = functional[pattern]
        raise UnsupportedLayerError(
            f"{pattern!r} belongs to {parent!r} ({type(modules[parent]).__name__}), which uses its weights "
            f"without calling it: hook capture cannot record it alone. Name {parent!r} itself (replayed "
            "per example with all its parameters), pass layers='all', or use backend='func'")
    if pattern in modules:  # an exact name; "" is the model itself (a bare nn.Linear)
        # a PEFT tuner layer stands for the frozen layer it wraps
        wrapped = pattern + BASE_LAYER in modules and not _recordable(pattern, modules[pattern], backend)
        hits = [pattern + BASE_LAYER if wrapped else pattern]
    elif _param_path(model, pattern, modules):   # "<module>.bias": a tied module's own bias
        hits = [pattern.rsplit(".", 1)[0]]
    else:
        # a glob keeps the modules it can record: parameterless ones (activations,
        # dropout) and, for hooks, unsupported ones (norms) are skipped
        hits = [n for n in modules if n and (fnmatch.fnmatchcase(n, pattern)
                                             or fnmatch.fnmatchcase(display_name(n), pattern))
                and _recordable(n, modules[n], backend) and n not in functional]
    if not hits:
        named = [n for n in modules if n]
        close = [n for n in named if pattern.split(".")[-1] in n][:5]
        close += [n for n in difflib.get_close_matches(pattern, named, n=3) if n not in close]
        hint = f"; did you mean one of {close}?" if close else ""
        raise LayerNameError(f"no module named {pattern!r} in {type(model).__name__}{hint} "
                             "(names are those of model.named_modules())")
    return hits


def forward_share_key(source, refs: list[LayerRef] | None = None):
    """Sources (``expr.Source``) with equal keys can share one forward per batch (the
    executor's ``PassCapture``; the planner costs them so); None: never shared. Hooks on
    the model itself would fire on every replayed call, so those sources are not shared."""
    if source.backend != "hooks":
        return None
    refs = resolve_layers(source.task.model, list(source.layers)) if refs is None else refs
    inner = unwrap(source.task.model)[0]
    if any(use.module is source.task.model or use.module is inner for ref in refs for use in ref.uses):
        return None
    return (source.task.token, tuple(ref.name for ref in refs))


def _recordable(name: str, module: nn.Module, backend: str, every_kind: bool = False) -> bool:
    """Whether ``module`` has trainable parameters of its own that ``backend`` records
    (hooks: by a rule of the default kinds; ``every_kind``: replayed ones too)."""
    if not any(p.requires_grad for p in module.parameters(recurse=False)):
        return False
    if backend == "func":
        return True
    try:
        rule = rule_for(name, module)
    except UnsupportedLayerError:
        return False
    return every_kind or rule.in_default


@dataclass
class _Call:
    A: Any
    output: torch.Tensor
    edge: Any = None  # the output's autograd edge, taken before any in-place op overwrites it
    use: Any = None     # the LayerUse that recorded it (a tied block has several)
    frames: tuple = ()  # the module calls enclosing this one (capture.provenance)


@dataclass
class ForwardRecorder:
    """Context manager: records ``A`` and the output tensor of every call of each layer.

    ``model`` (optional): the model whose forward is recorded. While recording, its
    parameters outside the recorded blocks stop requiring grad (:func:`released_params`),
    so the forward keeps no tensors for their gradients and the backward of
    :func:`capture_batch` starts at the first recorded layer; the flags are restored on
    exit. The output gradients are the same: they never depend on which leaves require
    grad, only on every recorded output requiring it, which its own parameters ensure.
    """

    layers: list[LayerRef]
    calls: dict[str, list[_Call]] = field(default_factory=dict)
    _handles: OwnHooks = field(default_factory=OwnHooks)
    model: nn.Module | None = None

    def __enter__(self):
        self.calls = {ref.name: [] for ref in self.layers}
        # a frozen layer (PEFT's base weights) has an output gradient only if something
        # upstream needs one: its parameters need a gradient while the batch is recorded
        self._frozen = [p for ref in self.layers for p in _block_params(ref) if not p.requires_grad]
        for p in self._frozen:
            p.requires_grad_(True)
        self._released = released_params(self.model, self.layers) if self.model is not None else []
        for p in self._released:
            p.requires_grad_(False)
        self._stack = CallStack().__enter__()
        # the first batch of a (model, layers) pair: recorded weights used outside their modules
        self._uses = OutsideUses(self.layers, self._stack) if needs_check(self.model, self.layers) else None
        if self._uses is not None:
            self._uses.__enter__()
        for ref in self.layers:
            for use in ref.uses:
                self._handles.add(use.module.register_forward_hook(self._hook(ref, use), with_kwargs=True))
        return self

    def __exit__(self, *exc):
        self._handles.remove()
        if getattr(self, "_uses", None) is not None:
            self._uses.__exit__(*exc)
            self._uses = None
        for p in getattr(self, "_frozen", ()):
            p.requires_grad_(False)
        for p in getattr(self, "_released", ()):
            p.requires_grad_(True)
        self._frozen = self._released = []
        self._stack.__exit__(*exc)
        return False

    def check_uses(self) -> None:
        """After the forward: refuse recorded weights used outside their modules
        (:mod:`gradalg.capture.weight_uses`; the first batch of a model and layers only)."""
        if getattr(self, "_uses", None) is not None and not getattr(self, "_uses_checked", False):
            self._uses.check()
            self._uses_checked = True
            mark_checked(self.model, self.layers)

    def _hook(self, ref: LayerRef, use: LayerUse):
        def hook(module, args, kwargs, output):
            if not torch.is_grad_enabled() or replaying():
                return
            recorded = use.rule.record(module, args, kwargs, output)
            for rec, out in recorded:
                self.calls[ref.name].append(_Call(rec, out, get_gradient_edge(out), use, self._stack.snapshot()))
            return use.rule.hooked_output(output, recorded)
        return hook


def _block_params(ref: LayerRef) -> list:
    own = dict(ref.module.named_parameters())    # dotted names too (a replayed MultiheadAttention's out_proj)
    return [own[n] for n in ref.param_names() if n in own]


def released_params(model: nn.Module, layers: list[LayerRef]) -> list:
    """The parameters of ``model`` that require grad but belong to no recorded block
    (nor to a module a block records: a replayed norm's, a tied block's holders'), which
    capture can run without: the embedding a recorded head is tied to is kept, an untied
    embedding or norm below the first recorded layer is released.

    None are released (``[]``) for a wrapped model (DDP, FSDP, ``torch.compile``, PEFT:
    their hooks and compiled guards follow the flags) or one holding a compiled submodule,
    whose flags are left as the user set them."""
    inner, prefixes = unwrap(model)
    if prefixes or any(getattr(m, "_compiled_call_impl", None) is not None
                       or type(m).__name__ in ("FullyShardedDataParallel", "DistributedDataParallel")
                       for m in inner.modules()):
        return []
    kept = {id(p) for ref in layers for p in _block_params(ref)}
    kept |= {id(p) for ref in layers for use in ref.uses for p in use.module.parameters(recurse=False)}
    return [p for p in inner.parameters() if p.requires_grad and id(p) not in kept]


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
    recorder.check_uses()
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
        layout = layout_for(ref.name, call.use.rule.rows(call.A)[0], n_examples, lengths)
        per_layer[ref.name].append(use_factors(call.use, call.A, g, token_mask, grad_scale, layout))
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
            rows, positions = call.use.rule.rows(call.A)
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
