"""Tied parameters: one block per parameter, whatever number of modules use it.

A parameter held by several modules (GPT-2's ``transformer.wte.weight`` is also
``lm_head.weight``; two Linears given the same ``weight``) has one gradient, the sum
over its uses ``u`` (and over the calls of each use)::

    G_i = Σ_u G_{u,i} = Σ_u D_{u,i}ᵀ A_{u,i}                            # (out, in)

so it is one block of the parameter space, whose factors are the uses' factors
concatenated along positions: ``A_i = [A_{1,i}; A_{2,i}; …]``, ``D_i = [D_{1,i}; …]``.
Every kernel then sees an ordinary :class:`~gradalg.capture.factors.Factors`, and the
cross terms of an inner product come for free::

    ⟨G_i, G_j⟩ = Σ_{u,v} ⟨G_{u,i}, G_{v,j}⟩ = Σ_{t,s} (a_it·a_js)(d_it·d_js)   over all uses' positions

All uses must bring their factors to the block's orientation. An ``nn.Embedding``'s own
block is ``(embedding_dim, num_embeddings)`` = weightᵀ (the one-hot token ids are its
``A``), a Linear's is ``(out, in)`` = weight. A block tying an embedding to a Linear
(the LM head) is kept in the **weight's layout** ``(num_embeddings, embedding_dim)``: the
Linear use is unchanged and the embedding use is transposed, ``(D_eᵀ 1_idx)ᵀ =
1_idxᵀ D_e``, i.e. ``A' = D_e`` (n, T, embedding_dim) and ``D' = one_hot(idx)`` (n, T,
num_embeddings), the one-hot made dense (as large as the head's own ``D``).

Naming: the block is named by the first module (in ``model.named_modules()`` order) that
holds the parameter; every other holder is an *alias*: naming it in ``layers`` selects the
same block, and default layers count the block once. A module whose other parameters are
not tied (a Linear head with its own bias tied to an embedding weight, as in BERT) keeps
those in a block of their own (a bias-only block ``<module>.bias``; such a name is
accepted in ``layers`` too).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from ..errors import UnsupportedLayerError
from .factors import Factors, OneHot
from .layers import EmbeddingRule, LayerRule, LinearRule, _as_btf, rule_for
from .rows import RowLayout

__all__ = ["LayerUse", "TiedRule", "WeightOnlyLinearRule", "BiasOnlyLinearRule", "tie_layers", "use_factors",
           "holders", "container_modules"]


@dataclass(frozen=True)
class LayerUse:
    """One module that contributes to a block: its name, module and rule, and whether its
    factors are transposed into the block's orientation (an embedding tied to a Linear)."""

    name: str
    module: nn.Module
    rule: LayerRule
    transpose: bool = False


@dataclass(frozen=True)
class WeightOnlyLinearRule(LinearRule):
    """The ``weight`` of an ``nn.Linear`` without its bias (the bias is another block)."""

    kind: str = "linear"

    def block_shape(self, module):
        return module.out_features, module.in_features

    def activations(self, module, x):
        return _as_btf(x)

    def to_params(self, module, block):
        return {"weight": block}

    def from_params(self, module, params):
        return params["weight"]

    def param_names(self, module):
        return ("weight",)


@dataclass(frozen=True)
class BiasOnlyLinearRule(LinearRule):
    """The ``bias`` of an ``nn.Linear`` whose weight is tied elsewhere: ``A`` is a ones column."""

    kind: str = "bias"

    def block_shape(self, module):
        return module.out_features, 1

    def activations(self, module, x):
        x = _as_btf(x)
        return x.new_ones(*x.shape[:-1], 1)

    def to_params(self, module, block):
        return {"bias": block[:, :, 0]}

    def from_params(self, module, params):
        return params["bias"].unsqueeze(-1)

    def param_names(self, module):
        return ("bias",)


@dataclass(frozen=True)
class TiedRule(LayerRule):
    """The rule of a block several modules use. ``base`` is the rule that gives the block's
    shape and its parameter layout (applied to the canonical module: the block's own
    parameter names are those of that module)."""

    kind: str = "tied"
    base: LayerRule | None = None

    def block_shape(self, module):
        return self.base.block_shape(module)

    def activations(self, module, x):  # pragma: no cover - uses record with their own rules
        raise TypeError("a tied block is recorded through its uses")

    def output_grads(self, module, g):  # pragma: no cover
        raise TypeError("a tied block is recorded through its uses")

    def to_params(self, module, block):
        return self.base.to_params(module, block)

    def from_params(self, module, params):
        return self.base.from_params(module, params)

    def param_names(self, module):
        return self.base.param_names(module)


@dataclass(frozen=True)
class _EmbeddingAsWeightRule(LayerRule):
    """An embedding's block in its weight's layout ``(num_embeddings, embedding_dim)``."""

    kind: str = "embedding"

    def block_shape(self, module):
        return module.num_embeddings, module.embedding_dim

    def activations(self, module, x):  # pragma: no cover - only used for shapes and names
        raise TypeError("recorded through its uses")

    def output_grads(self, module, g):  # pragma: no cover
        raise TypeError("recorded through its uses")

    def to_params(self, module, block):
        return {"weight": block}

    def from_params(self, module, params):
        return params["weight"]


def use_factors(use: LayerUse, A, g: torch.Tensor, token_mask: torch.Tensor | None = None,
                grad_scale: float = 1.0, layout: RowLayout | None = None) -> Factors:
    """One recorded call's factors in its block's orientation.

    ``A`` : what ``use.rule.activations`` recorded in the forward, ``g`` the gradient of
    the loss w.r.t. the call's output. Shared by ``ga.grads`` (``capture_batch``) and
    ``ga.capture`` (tensor hooks), so both record the same numbers. Under autocast the
    activations and gradients may differ in dtype: both are taken in the wider one.
    ``token_mask`` (B, T) zeroes padding positions (when the call has T positions; a rule
    whose positions are its own, a fused expert's routed tokens, gets it as the layout's
    ``keep`` over the call's B·T flattened rows and drops the padding rows);
    ``layout`` (:mod:`gradalg.capture.rows`) groups rows of flattened tokens into examples
    (default: one row per example).
    """
    g = g.detach() if grad_scale == 1.0 else g.detach() * grad_scale
    if layout is None:
        layout = RowLayout(use.rule.rows(A)[0], 1)
    if not use.rule.positions_are_tokens and token_mask is not None:
        # the rule's positions are its own (routed tokens): it drops the padding tokens' rows
        if token_mask.dim() == 2 and layout.rows == g.shape[0] and layout.per_example == token_mask.shape[1]:
            layout = replace(layout, keep=token_mask.reshape(-1).to(g.device).bool())
        token_mask = None
    F = use.rule.factors(use.module, A, g, layout)   # rows grouped into examples by ``layout``
    if isinstance(F.A, torch.Tensor) and F.A.dtype != F.D.dtype:   # autocast: fp32 inputs, bf16 grads
        dtype = torch.promote_types(F.A.dtype, F.D.dtype)
        F = Factors(F.A.to(dtype), F.D.to(dtype))
    if token_mask is not None and F.T == token_mask.shape[1] and not bool(token_mask.all()):
        F = F.mask_tokens(token_mask)     # (a mask of all ones, no padding, changes nothing: two passes saved)
    if use.transpose:
        F = transpose_embedding(F)
    return F


def transpose_embedding(F: Factors) -> Factors:
    """An embedding call's factors in the weight's layout: ``G_iᵀ = 1_idxᵀ D_e``, so
    ``A' = D_e`` (n, T, embedding_dim) and ``D' = one_hot(idx)`` (n, T, num_embeddings)."""
    if not isinstance(F.A, OneHot):
        raise TypeError("only an embedding's one-hot factors are transposed")
    return Factors(F.D, F.A.to_dense(F.D.dtype))


# ------------------------------------------------------------------------------ grouping
def holders(model: nn.Module) -> dict[int, list[tuple[str, nn.Module, str]]]:
    """Every module using each parameter: ``id(param) -> [(module_name, module, param_name)]``,
    in ``named_modules`` order (a module registered under two names appears under both).

    A module holding a parameter that one of its own descendants also holds is a
    *container* of it, not a use, and is left out: HF's ``BertLMPredictionHead`` registers
    ``bias`` only so that ``decoder.bias`` can be tied to it, and its forward calls
    ``decoder``. (A container whose own forward also used the parameter directly would
    make the captured gradient partial: :mod:`gradalg.capture.weight_uses` refuses such a
    use on the first batch.)"""
    out: dict[int, list] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        for pname, p in module.named_parameters(recurse=False):
            if p is not None:
                out.setdefault(id(p), []).append((name, module, pname))
    for pid, hs in out.items():
        names = [n for n, _, _ in hs]
        kept = [h for h in hs if not any(_is_inside(other, h[0]) for other in names)]
        out[pid] = kept or hs
    return out


def _is_inside(name: str, ancestor: str) -> bool:
    return name != ancestor and (ancestor == "" or name.startswith(ancestor + "."))


def container_modules(model: nn.Module) -> set[str]:
    """Names of the modules whose every parameter of their own is held by one of their
    descendants too (containers: see :func:`holders`); their parameters are recorded
    through the descendant, so a layer selection of every module skips them."""
    used = {(n, pid) for pid, hs in holders(model).items() for n, _, _ in hs}
    out = set()
    for name, module in model.named_modules(remove_duplicate=False):
        own = [id(p) for p in module.parameters(recurse=False)]
        if own and not any((name, pid) in used for pid in own):
            out.add(name)
    return out


def _params(module: nn.Module) -> dict[str, nn.Parameter]:
    return {n: p for n, p in module.named_parameters(recurse=False) if p is not None}


def tie_layers(model: nn.Module, refs: list, make_ref, backend: str = "hooks") -> list:
    """Merge the resolved layers ``refs`` (``LayerRef``, in model order) that share parameters.

    Each group of modules connected by shared parameters becomes one block named by its
    first module (every holder of the parameters joins, named in ``layers`` or not: the
    block is the parameter's whole gradient); the others are its aliases. ``make_ref(name,
    module, rule, uses, aliases, params)`` builds a ``LayerRef``. Untied layers come back as
    they are.
    """
    owners = holders(model)
    shared = {pid for pid, hs in owners.items() if len({id(m) for _, m, _ in hs}) > 1}
    if not shared:
        return refs
    out, done = [], set()
    order = {id(m): i for i, (_, m) in enumerate(model.named_modules())}
    for ref in refs:
        mine = {id(p) for p in _params(ref.module).values()} & shared
        if not mine:
            out.append(ref)
            continue
        key = frozenset(mine)
        # every module holding one of these parameters (transitively)
        group_ids, members = set(mine), {}
        frontier = list(mine)
        while frontier:
            pid = frontier.pop()
            for name, module, _ in owners[pid]:
                members.setdefault(id(module), []).append(name)
                for p in _params(module).values():
                    if id(p) in shared and id(p) not in group_ids:
                        group_ids.add(id(p))
                        frontier.append(id(p))
        key = frozenset(group_ids)
        if key in done:
            # this module's tied part is already a block: only its own (untied) bias remains
            extra = _own_bias_ref(ref, group_ids, make_ref, backend)
            if extra is not None:
                out.append(extra)
            continue
        done.add(key)
        out.extend(_group_refs(model, ref, group_ids, members, order, make_ref, backend))
    # a group recorded once, its bias-only blocks after it, all in model order (so the same
    # blocks named in any order, or by any alias, give the same space)
    seen, unique = set(), []
    for r in out:
        if r.name not in seen:
            seen.add(r.name)
            unique.append(r)
    position = {n: i for i, (n, _) in enumerate(model.named_modules(remove_duplicate=False))}

    def key(r):
        own_bias = r.name not in position and r.name.endswith(".bias")
        module = r.name[: -len(".bias")] if own_bias else r.name
        return position.get(module, len(position)), own_bias

    return sorted(unique, key=key)


def _own_bias_ref(ref, group_ids, make_ref, backend):
    own = {n: p for n, p in _params(ref.module).items() if id(p) not in group_ids}
    if not own:
        return None
    name = f"{ref.name}.bias" if ref.name else "bias"   # the tied block has the module's name
    if backend == "func" and set(own) == {"bias"}:
        return make_ref(name, ref.module, None, (), (), ("bias",))
    if isinstance(ref.module, nn.Linear) and set(own) == {"bias"}:
        rule = BiasOnlyLinearRule()
        return make_ref(name, ref.module, rule, (LayerUse(ref.name, ref.module, rule),), (), ("bias",))
    raise UnsupportedLayerError(
        f"module {ref.name!r} shares some parameters with other modules but not {sorted(own)}: hook capture "
        "records such a partly tied module only when it is an nn.Linear whose bias alone is its own. Use "
        "backend='func', or leave it out of `layers`")


def _group_refs(model, first_ref, group_ids, members, order, make_ref, backend) -> list:
    modules = {mid: m for _, m in model.named_modules(remove_duplicate=False) for mid in [id(m)]}
    ordered = sorted(members, key=lambda mid: order.get(mid, len(order)))
    names = [members[mid][0] for mid in ordered]
    aliases = tuple(dict.fromkeys(n for mid in ordered for n in members[mid]))
    canon_mod = modules[ordered[0]]
    canon_params = _params(canon_mod)
    tied_names = tuple(n for n, p in canon_params.items() if id(p) in group_ids)
    for mid, name in zip(ordered, names):
        held = {id(p) for p in _params(modules[mid]).values()} & group_ids
        if held != group_ids:
            raise UnsupportedLayerError(
                f"modules {names} share parameters, but {name!r} holds only some of them: hook capture "
                "records a tied block only when every module that holds it holds all of its tied "
                "parameters. Use backend='func', or untie them")
    refs = []
    if backend == "func":
        refs.append(make_ref(names[0], canon_mod, None, (), aliases, tied_names))
    else:
        uses, base = _uses(names, [modules[m] for m in ordered], tied_names)
        # "tied": uses of different kinds (an embedding and a Linear) pooled in one block
        rule = TiedRule(kind="tied" if any(u.transpose for u in uses) else base.kind, base=base)
        refs.append(make_ref(names[0], canon_mod, rule, uses, aliases, tied_names))
    for mid, name in zip(ordered, names):
        module = modules[mid]
        extra = None
        own = {n for n, p in _params(module).items() if id(p) not in group_ids}
        if own:
            ref = make_ref(name, module, None, (), (), ())
            extra = _own_bias_ref(ref, group_ids, make_ref, backend)
        if extra is not None:
            refs.append(extra)
    return refs


def _uses(names, modules, tied_names) -> tuple[tuple[LayerUse, ...], LayerRule]:
    """The uses of a tied block and the rule of its layout."""
    kinds = []
    for name, module in zip(names, modules):
        try:
            kinds.append(type(rule_for(name, module)))
        except UnsupportedLayerError as e:
            raise UnsupportedLayerError(
                f"{name!r} shares its parameters with {[n for n in names if n != name]}, but hook capture "
                f"cannot record it ({e}); every use of a tied parameter must be recorded for its gradient "
                "to be the true one. Use backend='func'") from None
    if all(k is EmbeddingRule for k in kinds):
        rule = EmbeddingRule()
        return tuple(LayerUse(n, m, rule) for n, m in zip(names, modules)), rule
    if all(k in (LinearRule, EmbeddingRule) for k in kinds) and tied_names == ("weight",) and LinearRule in kinds:
        uses = []
        for name, module, kind in zip(names, modules, kinds):
            if kind is EmbeddingRule:
                uses.append(LayerUse(name, module, EmbeddingRule(), transpose=True))
            elif module.bias is not None:
                uses.append(LayerUse(name, module, WeightOnlyLinearRule()))
            else:
                uses.append(LayerUse(name, module, LinearRule()))
        if kinds[0] is EmbeddingRule:
            base = _EmbeddingAsWeightRule()
        else:
            base = WeightOnlyLinearRule() if modules[0].bias is not None else LinearRule()
        return tuple(uses), base
    if len(set(kinds)) == 1:
        if any(set(_params(m)) != set(tied_names) for m in modules):
            raise UnsupportedLayerError(
                f"modules {names} share {list(tied_names)} but not all their parameters; hook capture "
                "records such partial ties for nn.Linear (a bias of its own) only. Use backend='func'")
        rule = rule_for(names[0], modules[0])
        shapes = {rule_for(n, m).block_shape(m) for n, m in zip(names, modules)}
        if len(shapes) != 1:
            raise UnsupportedLayerError(f"tied modules {names} have different block shapes {sorted(shapes)}")
        return tuple(LayerUse(n, m, rule_for(n, m)) for n, m in zip(names, modules)), rule
    raise UnsupportedLayerError(
        f"modules {names} ({', '.join(type(m).__name__ for m in modules)}) share parameters in a way hook "
        "capture does not record (supported: modules of one kind holding the same parameters, and an "
        "nn.Embedding weight tied to nn.Linear weights). Use backend='func'")
