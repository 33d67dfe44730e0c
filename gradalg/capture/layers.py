"""Per-layer rules, one registry keyed by module type: how a module's per-example gradient
factors as ``D_iᵀ A_i`` (capture), and its shapes for the planner (model facts).

For every supported layer the weight gradient of example ``i`` is a sum over its
positions ``t`` (tokens, or spatial positions of a convolution)::

    G_i = Σ_t d_{i,t} a_{i,t}ᵀ = D_iᵀ A_i          # (out, in)

with ``A_i`` (T, in) the layer's inputs (a ones column appended when the layer has a
bias, so the bias gradient is the last column of ``G_i``) and ``D_i`` (T, out) the
gradients of the summed loss with respect to the layer's outputs. Every block of a
:class:`~gradalg.space.ParamSpace` is stored in this canonical ``(out, in)``
orientation; :meth:`LayerRule.to_params` maps it back to the module's parameters.

A rule class is registered for its module types with :func:`register_layer`; the most
specific registered class in a module's MRO wins (``nn.Module``: :class:`ReplayRule`).
The same rule answers the planner's model facts (:mod:`gradalg.plan.shapes`). Adding a
layer type is one rule class with its decorator (``docs/contributing.md``, "A layer
rule"); :func:`register_layer` refuses a rule that leaves out a capture hook or a planner
fact (:func:`check_rule`).
"""
from __future__ import annotations

import contextvars
import math
import sys
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from ..errors import UnsupportedLayerError
from .factors import Factors, OneHot
from .rows import RowLayout

__all__ = ["LayerRule", "ReplayRule", "MultiheadAttentionRule", "rule_for", "rule_class", "register_layer", "check_rule", "LAYER_RULES",
           "measured_kind", "SUPPORTED_LAYERS", "DEFAULT_LAYERS", "check_session_layers"]

#: ``{module type, or "package.module:Class" of a library imported lazily: LayerRule subclass}``
LAYER_RULES: dict = {}


def register_layer(*module_types):
    """Class decorator: the :class:`LayerRule` records modules of ``module_types`` and of
    their subclasses (unless a more specific type is registered). A rule that leaves out
    a capture hook or a planner fact is refused here (:func:`check_rule`), before any
    model is captured or planned with it."""
    def register(rule):
        check_rule(rule)
        LAYER_RULES.update(dict.fromkeys(module_types, rule))
        return rule
    return register


#: the model facts a registered rule must state itself (``docs/contributing.md``, "A layer
#: rule"): the planner reads them for every module of the type, and LayerRule's defaults
#: would price it silently (no forward GEMM, positions taken from the data's shape).
#: ``weight_gemm`` may return None (no GEMM); ``measured_kinds`` is ``()`` when the data's
#: shape tells T. (Rules used only inside a tied block, never registered, keep the defaults.)
DECLARED_FACTS = ("weight_gemm", "measured_kinds")


def check_rule(rule) -> None:
    """Refuse a layer rule that does not answer everything capture and the planner ask:
    a :class:`LayerRule` subclass with no abstract hook left (``block_shape``,
    ``activations``, ``output_grads``, ``to_params``, ``from_params``) and each of
    :data:`DECLARED_FACTS` defined by the rule or a base of its own, not inherited from
    :class:`LayerRule`. Raises :class:`~gradalg.errors.UnsupportedLayerError`
    naming what is missing."""
    if not (isinstance(rule, type) and issubclass(rule, LayerRule)):
        raise UnsupportedLayerError(f"register_layer decorates a LayerRule subclass, got {rule!r}: write "
                                    "`@register_layer(MyModule) @dataclass(frozen=True) class MyRule(LayerRule): ...`")
    missing = sorted(getattr(rule, "__abstractmethods__", ()))
    own = rule.__mro__[:rule.__mro__.index(LayerRule)]
    missing += [name for name in DECLARED_FACTS if not any(name in c.__dict__ for c in own)]
    if missing:
        raise UnsupportedLayerError(
            f"layer rule {rule.__name__} does not say {', '.join(missing)}: define "
            + ", ".join(f"`{m}`" for m in missing) + " on the rule (docs/contributing.md, 'A layer rule': "
            "weight_gemm returns (in, out) of the GEMM its forward multiplies each position by, or None "
            "for none; measured_kinds = (kind,) when its positions are its own, as a convolution's, "
            "else ())")


#: ``[the registry as it was, {module type: rule class} found for it]``
_FOUND: list = [None, {}]


def rule_class(module: nn.Module) -> type:
    """The rule class registered for the most specific type in ``type(module).__mro__`` (a
    type named by a string is looked up once imported: an instance's library is)."""
    registry, found = _FOUND
    if registry != LAYER_RULES:
        registry, found = dict(LAYER_RULES), {}
        _FOUND[:] = [registry, found]
    rule = found.get(type(module))
    if rule is None:
        lazy = {getattr(sys.modules.get(k.partition(":")[0]), k.partition(":")[2], None): cls
                for k, cls in registry.items() if isinstance(k, str)}
        rule = found[type(module)] = next(registry.get(t) or lazy[t] for t in type(module).__mro__
                                          if t in registry or t in lazy)
    return rule


def measured_kind(kind: str) -> bool:
    """Whether blocks of ``kind`` have positions of their own (a convolution's output
    pixels), known only by running the model, not from the data's shape."""
    return any(kind in cls.measured_kinds for cls in set(LAYER_RULES.values()))


@dataclass(frozen=True)
class LayerRule(ABC):
    """How to record one module kind. Subclasses implement the abstract methods below."""

    kind: str = "linear"

    @abstractmethod
    def block_shape(self, module: nn.Module) -> tuple[int, int]:
        """``(out, in)`` of the canonical gradient block (``in`` counts the bias column)."""

    @abstractmethod
    def activations(self, module: nn.Module, x: torch.Tensor):
        """``A``: (B, T, in) tensor, or :class:`OneHot` for embeddings."""

    @abstractmethod
    def output_grads(self, module: nn.Module, g: torch.Tensor) -> torch.Tensor:
        """``D``: (B, T, out) from the gradient w.r.t. the module's output."""

    @abstractmethod
    def to_params(self, module: nn.Module, block: torch.Tensor) -> dict[str, torch.Tensor]:
        """Split ``block`` (n, out, in) into ``{param_name: (n, *param.shape)}``."""

    @abstractmethod
    def from_params(self, module: nn.Module, params: dict[str, torch.Tensor]) -> torch.Tensor:
        """Inverse of :meth:`to_params`: ``{param_name: (n, *param.shape)}`` → (n, out, in)."""

    def param_names(self, module: nn.Module) -> tuple[str, ...]:
        return tuple(name for name, p in module.named_parameters(recurse=False) if p is not None)

    #: whether ``layers=None`` (the default) records this kind; ``layers="all"`` records every kind
    in_default: ClassVar[bool] = True
    #: whether ``ga.capture`` records it (one row per example, ``A`` from the first input)
    in_session: ClassVar[bool] = True
    #: submodules whose parameters the forward uses without calling them (no hook fires)
    uses_without_calling: ClassVar[tuple[str, ...]] = ()
    #: whether the block is a slice of its parameters (one expert of a fused experts
    #: module): :meth:`to_params` fills the rest with zeros, so compare in the block's layout
    partial_params: ClassVar[bool] = False
    #: whether the factors' positions are the call's tokens, so a (B, T) token mask applies to
    #: them; False: the rule's positions are its own (a fused expert's routed tokens) and
    #: :meth:`factors` gets the mask as ``layout.keep`` (rows of flattened tokens): it must
    #: leave out the rows that are not kept (padding), activations included
    positions_are_tokens: ClassVar[bool] = True
    #: block kinds whose positions T are the layer's own (measured by a meta forward); every
    #: registered rule states it (``()``: T is known from the data's shape), :func:`check_rule`
    measured_kinds: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def for_module(cls, module: nn.Module) -> "LayerRule":
        """The rule instance recording ``module`` (a subclass may set its kind from it)."""
        return cls()

    @classmethod
    def batch_shared(cls, name: str) -> bool:
        """Whether the module ``name`` is called with inputs shared by the batch (no
        per-example gradient: left out of the default layers)."""
        return False

    # --- the planner's model facts, per position, from module shapes (meta modules work)
    def positions(self, module: nn.Module, output: torch.Tensor) -> int:
        """T of the factors of a call that returned ``output`` (B, ..., out): its positions."""
        return max(1, int(output.numel() // max(1, output.shape[0] * self.block_shape(module)[0])))

    def positions_for_tokens(self, module: nn.Module, tokens: int) -> int:
        """Positions per example when the example has ``tokens`` tokens, known without
        running the model (the planner's hint): ``tokens`` itself, except for rules whose
        positions are their own (a fused expert's routed tokens)."""
        return tokens

    def weight_gemm(self, module: nn.Module) -> tuple[int, int] | None:
        """``(in, out)`` of the GEMM the forward multiplies each position by; None: none
        (a lookup, a replayed module). Every registered rule defines it (:func:`check_rule`)."""
        return None

    def unfolds(self, module: nn.Module, in_shape, batch: int) -> bool:
        """Whether torch's kernel for this layer, on ``batch`` inputs of ``in_shape`` (one
        example's) in its weight's device and dtype, unfolds each example's input into columns
        (in, positions) and multiplies them one example at a time (a convolution's im2col
        kernel: :meth:`ConvRule.unfolds`); False for a layer that is one GEMM over the batch."""
        return False

    def activation_numbers(self, module: nn.Module) -> int:
        """Numbers autograd keeps around the layer: ``sum(weight.shape[:2])`` (in + out)."""
        w = getattr(module, "weight", None)
        return int(sum(w.shape[:2])) if isinstance(w, torch.Tensor) and w.dim() >= 2 else 0

    def output_width(self, module: nn.Module) -> int | None:
        """The output's width when the layer is a model's head (None: it cannot be one)."""
        w = getattr(module, "weight", None)
        return int(w.shape[0]) if isinstance(w, torch.Tensor) and w.dim() >= 2 else None

    #: the forward of the module class this rule reads (``nn.Linear.forward``, ...); a
    #: subclass that overrides it is checked on each call (see :meth:`record`)
    base_forward: ClassVar[Any] = None

    def record(self, module: nn.Module, args: tuple, kwargs: dict, output) -> list[tuple[Any, torch.Tensor]]:
        """What a forward hook keeps of one call: ``[(recorded, output_tensor)]``, one pair per
        output whose gradient ``D`` the layer's factors need (none when the output does not
        require grad). Default: ``activations`` of the first input, and the output.

        A subclass that overrides the base class's forward (Gemma's embedding scaled by
        ``√d``) must return ``c ·`` the base forward for a scalar ``c`` (checked on every call;
        ``D`` is then scaled by ``c``); any other forward is refused."""
        if not isinstance(output, torch.Tensor) or not output.requires_grad:
            return []
        x = (args[0] if args else next(iter(kwargs.values()))).detach()
        A = self.activations(module, x)
        if self.base_forward is None or type(module).forward is self.base_forward:
            return [(A, output)]
        with torch.no_grad():
            base = self.base_forward(module, x)
        return [(_Scaled(A, _scalar_multiple(module, output.detach(), base)), output)]

    def hooked_output(self, output, recorded: list):
        """The output the forward hook hands on (None: unchanged). See :class:`ReplayRule`."""
        return None

    def rows(self, recorded) -> tuple[int, int]:
        """``(rows, positions)`` of a recorded call: its leading dimension (examples, or the
        batch's flattened tokens: see :mod:`gradalg.capture.rows`) and positions per row."""
        A = recorded.A if isinstance(recorded, _Scaled) else recorded
        return A.shape[0], A.shape[1]

    def factors(self, module: nn.Module, recorded, g: torch.Tensor, layout: RowLayout) -> Factors:
        """One example per row: the call's factors, from what :meth:`record` kept and the
        gradient ``g`` w.r.t. the recorded output, rows grouped by ``layout``."""
        if isinstance(recorded, _Scaled):
            recorded, g = recorded.A, g * recorded.scale
        return layout.group(Factors(recorded, self.output_grads(module, g)))


@dataclass
class _Scaled:
    """Activations of a call whose output is ``scale ×`` the base layer's output."""

    A: Any
    scale: float


def _scalar_multiple(module, output: torch.Tensor, base: torch.Tensor) -> float:
    """``c`` with ``output = c · base`` (least squares, then checked), else refuse."""
    if output.shape == base.shape:
        denom = (base * base).sum()
        c = float((output * base).sum() / denom) if denom > 0 else 1.0
        try:
            torch.testing.assert_close(output, base * c)
            return c
        except AssertionError:
            pass
    raise UnsupportedLayerError(
        f"{type(module).__name__} overrides the forward of {type(module).__mro__[1].__name__} with one "
        "that is not a scalar multiple of it, so its factored per-example gradient is unknown; record "
        "it by replay (name it in `layers` after wrapping its extra computation in a submodule), use "
        "backend='func', or leave it out"
    )


def _with_ones(x: torch.Tensor) -> torch.Tensor:
    return torch.cat([x, x.new_ones(*x.shape[:-1], 1)], dim=-1)


def _as_btf(x: torch.Tensor) -> torch.Tensor:
    """(B, ..., F) -> (B, T, F), folding every middle dim into T (T = 1 for 2-D input)."""
    if x.dim() == 2:
        return x.unsqueeze(1)
    return x.reshape(x.shape[0], -1, x.shape[-1])


@register_layer(nn.Linear)
@dataclass(frozen=True)
class LinearRule(LayerRule):
    kind: str = "linear"
    measured_kinds: ClassVar[tuple[str, ...]] = ()
    base_forward: ClassVar[Any] = staticmethod(nn.Linear.forward)

    def block_shape(self, module):
        return module.out_features, module.in_features + (module.bias is not None)

    def weight_gemm(self, module):
        return module.in_features, module.out_features

    def activations(self, module, x):
        x = _as_btf(x)
        return _with_ones(x) if module.bias is not None else x

    def output_grads(self, module, g):
        return _as_btf(g)

    def to_params(self, module, block):
        out = {"weight": block[:, :, : module.in_features]}
        if module.bias is not None:
            out["bias"] = block[:, :, -1]
        return out

    def from_params(self, module, params):
        if module.bias is None:
            return params["weight"]
        return torch.cat([params["weight"], params["bias"].unsqueeze(-1)], dim=-1)


@register_layer("transformers.pytorch_utils:Conv1D")
@dataclass(frozen=True)
class HFConv1DRule(LayerRule):
    """HF ``Conv1D`` (GPT-2): ``y = x @ W + b`` with ``W`` stored (in, out)."""

    kind: str = "conv1d"
    measured_kinds: ClassVar[tuple[str, ...]] = ()

    def block_shape(self, module):
        n_in, n_out = module.weight.shape
        return n_out, n_in + 1

    def weight_gemm(self, module):
        return tuple(module.weight.shape)

    def output_width(self, module):
        return module.weight.shape[1]

    def activations(self, module, x):
        return _with_ones(_as_btf(x))

    def output_grads(self, module, g):
        return _as_btf(g)

    def to_params(self, module, block):
        return {"weight": block[:, :, :-1].transpose(1, 2), "bias": block[:, :, -1]}

    def from_params(self, module, params):
        return torch.cat([params["weight"].transpose(1, 2), params["bias"].unsqueeze(-1)], dim=-1)


class _Lookup:
    """Model facts of an embedding: a row lookup, no GEMM or activations, never a head,
    one position per id (known from the data's shape)."""

    measured_kinds: ClassVar[tuple[str, ...]] = ()

    def weight_gemm(self, module):
        return None

    def activation_numbers(self, module):
        return 0

    def output_width(self, module):
        return None


@register_layer(nn.Embedding)
@dataclass(frozen=True)
class EmbeddingRule(_Lookup, LayerRule):
    """``nn.Embedding``: ``A`` is the one-hot of the token ids, never materialized.

    The block is (embedding_dim, num_embeddings), the transpose of ``weight``. Positions
    holding ``padding_idx`` get no gradient, as in PyTorch.
    """

    kind: str = "embedding"
    base_forward: ClassVar[Any] = staticmethod(nn.Embedding.forward)

    @classmethod
    def batch_shared(cls, name):
        """Position embeddings (:data:`POSITION_EMBEDDINGS`): HF models call them with
        positions shared by the batch."""
        return name.split(".")[-1] in POSITION_EMBEDDINGS

    def block_shape(self, module):
        return module.embedding_dim, module.num_embeddings

    def activations(self, module, x):
        if module.scale_grad_by_freq:
            raise UnsupportedLayerError(
                "nn.Embedding(scale_grad_by_freq=True) scales gradients by batch-level token "
                "counts, so its gradient is not a sum of per-example gradients; set "
                "scale_grad_by_freq=False or leave this layer out of `layers`"
            )
        idx = x.reshape(x.shape[0], -1)
        valid = None if module.padding_idx is None else idx != module.padding_idx
        return OneHot(idx, module.num_embeddings, valid)

    def output_grads(self, module, g):
        return _as_btf(g)

    def to_params(self, module, block):
        return {"weight": block.transpose(1, 2)}

    def from_params(self, module, params):
        return params["weight"].transpose(1, 2)


POSITION_EMBEDDINGS = ("wpe", "position_embeddings", "embed_positions", "pos_emb", "pos_embed",
                       "relative_attention_bias")

_CONV_KINDS = {1: "conv1d_nn", 2: "conv2d", 3: "conv3d"}   # "conv1d" is transformers' Conv1D


def unfold_patches(x: torch.Tensor, kernel, stride, padding, dilation) -> torch.Tensor:
    """The patches an N-d convolution multiplies by its weight.   x: (B, C, *S) → (B, L, C·Πk).

    ``L`` is the number of output positions; a patch's features are ordered like
    ``weight.flatten(1)``: (C, k_1, …, k_n). 2-d uses ``F.unfold``; other ranks pad and
    take strided windows (``Tensor.unfold``) along each spatial dimension.
    """
    nd = len(kernel)
    if nd == 2:
        cols = F.unfold(x, kernel, dilation=dilation, padding=padding, stride=stride)  # (B, C*kh*kw, L)
        return cols.transpose(1, 2)
    x = F.pad(x, [p for i in reversed(range(nd)) for p in (padding[i], padding[i])])
    for i in range(nd):
        x = x.unfold(2 + i, dilation[i] * (kernel[i] - 1) + 1, stride[i])
    x = x[(...,) + tuple(slice(None, None, d) for d in dilation)]     # (B, C, O_1..O_n, k_1..k_n)
    B, positions = x.shape[0], x.shape[2:2 + nd]
    order = (0, *range(2, 2 + nd), 1, *range(2 + nd, 2 + 2 * nd))
    return x.permute(order).reshape(B, math.prod(positions), -1)


@register_layer(nn.Conv1d, nn.Conv2d, nn.Conv3d)
@dataclass(frozen=True)
class ConvRule(LayerRule):
    """``nn.Conv1d`` / ``Conv2d`` / ``Conv3d`` as a Linear over unfolded patches.

    With patches ``a_{i,t}`` (C_in·Πk features, :func:`unfold_patches`) and output gradients
    ``d_{i,t}`` at the output positions ``t``, ``G_i = Σ_t d_{i,t} a_{i,t}ᵀ`` is
    ``weight.flatten(1)``'s gradient (C_out, C_in·Πk), with the bias as a last column.
    """

    kind: str = "conv2d"
    measured_kinds: ClassVar[tuple[str, ...]] = tuple(_CONV_KINDS.values())

    @classmethod
    def for_module(cls, module):
        return cls(kind=_CONV_KINDS[len(module.kernel_size)])

    def weight_gemm(self, module):
        return module.weight[0].numel(), module.weight.shape[0]

    def unfolds(self, module, in_shape, batch):
        """True where torch picks an im2col kernel for this convolution (its ``Slow*`` backends:
        on the CPU every float64 convolution and a batch of one; not oneDNN's or cuDNN's), asked
        of torch's own choice (``torch._C._select_conv_backend``) on an uninitialised batch of
        ``batch`` inputs of ``in_shape`` on the weight's device; False where torch cannot say."""
        w = module.weight
        if w.is_meta or isinstance(module.padding, str) or not hasattr(torch._C, "_select_conv_backend"):
            return False
        x = torch.empty((batch, *in_shape), dtype=w.dtype, device=w.device)
        try:
            backend = torch._C._select_conv_backend(x, w, module.bias, list(module.stride), list(module.padding),
                                                    list(module.dilation), False, [0] * len(module.kernel_size),
                                                    module.groups, None)
        except (RuntimeError, TypeError):
            return False
        return str(backend).rsplit(".", 1)[-1].startswith("Slow")

    @property
    def base_forward(self):
        return {"conv1d_nn": nn.Conv1d.forward, "conv2d": nn.Conv2d.forward, "conv3d": nn.Conv3d.forward}[self.kind]

    def _check(self, module):
        name = type(module).__name__
        if module.groups != 1:
            raise UnsupportedLayerError(
                f"{name} with groups={module.groups} is not supported by hook capture (its "
                "gradient is block-sparse per group); use backend='func' or leave it out"
            )
        if module.padding_mode != "zeros" or isinstance(module.padding, str):
            raise UnsupportedLayerError(
                f"{name} with padding_mode={module.padding_mode!r} / padding={module.padding!r} "
                "is not supported by hook capture; use numeric zero padding, "
                "backend='func', or leave it out"
            )

    def block_shape(self, module):
        self._check(module)
        return module.out_channels, module.in_channels * math.prod(module.kernel_size) + (module.bias is not None)

    def activations(self, module, x):
        self._check(module)
        nd = len(module.kernel_size)
        if x.dim() != nd + 2:
            raise UnsupportedLayerError(
                f"{type(module).__name__} was called on an unbatched input of shape {tuple(x.shape)}; "
                "hook capture needs a batch dimension (one row per example)"
            )
        cols = unfold_patches(x, module.kernel_size, module.stride, module.padding, module.dilation)
        return _with_ones(cols) if module.bias is not None else cols

    def output_grads(self, module, g):
        return g.flatten(2).transpose(1, 2)  # (B, out, *S') -> (B, L, out)

    def to_params(self, module, block):
        n = block.shape[0]
        n_w = block.shape[2] - (module.bias is not None)
        out = {"weight": block[:, :, :n_w].reshape(n, *module.weight.shape)}
        if module.bias is not None:
            out["bias"] = block[:, :, -1]
        return out

    def from_params(self, module, params):
        w = params["weight"].flatten(2)
        if module.bias is None:
            return w
        return torch.cat([w, params["bias"].unsqueeze(-1)], dim=-1)


@register_layer(nn.EmbeddingBag)
@dataclass(frozen=True)
class EmbeddingBagRule(_Lookup, LayerRule):
    """``nn.EmbeddingBag`` with ``mode="sum"`` or ``"mean"``: one bag per example.

    Bag ``i`` holds ids ``j_1 … j_L`` with weights ``w_l`` (1 for sum, ``1/L`` for mean,
    ``per_sample_weights`` when given); its output is ``Σ_l w_l E[j_l]``, so
    ``G_i = Σ_l (w_l d_i) onehot(j_l)ᵀ``: ``A`` is the one-hot of the ids (never built) and
    ``D`` repeats the bag's output gradient ``d_i`` scaled by each id's weight. The block is
    (embedding_dim, num_embeddings), the transpose of ``weight``; ``padding_idx`` entries
    take no part, as in PyTorch.
    """

    kind: str = "embedding"
    in_session: ClassVar[bool] = False     # needs the call's offsets and weights

    def _check(self, module):
        problems = []
        if module.mode not in ("sum", "mean"):
            problems.append(f"mode={module.mode!r} (the gradient goes to each dimension's arg-max "
                            "row, not a sum of rank-one terms)")
        if module.scale_grad_by_freq:
            problems.append("scale_grad_by_freq=True (scaled by batch-level counts)")
        if module.max_norm is not None:
            problems.append("max_norm (the weight is renormalized in place during the forward)")
        if problems:
            raise UnsupportedLayerError(
                f"nn.EmbeddingBag with {', '.join(problems)} has no factored per-example gradient "
                "in hook capture; use mode='sum' or 'mean', backend='func', or leave it out"
            )

    def block_shape(self, module):
        self._check(module)
        return module.embedding_dim, module.num_embeddings

    def activations(self, module, x):
        raise UnsupportedLayerError(
            "nn.EmbeddingBag is recorded by ga.grads (it needs the call's offsets and weights); "
            "ga.capture does not record it: leave it out of `layers` there"
        )

    def output_grads(self, module, g):
        return g

    def record(self, module, args, kwargs, output):
        self._check(module)
        if not isinstance(output, torch.Tensor) or not output.requires_grad:
            return []
        names = ("input", "offsets", "per_sample_weights")
        bound = dict(zip(names, args)) | {k: v for k, v in kwargs.items() if k in names}
        idx, offsets, weights = bound["input"], bound.get("offsets"), bound.get("per_sample_weights")
        if weights is not None:
            weights = weights.detach()
        if idx.dim() == 2:                                   # (n_bags, L): fixed-length bags
            valid = torch.ones_like(idx, dtype=torch.bool)
        else:                                                # flat ids with bag offsets
            starts = offsets[:-1] if module.include_last_offset else offsets
            ends = torch.cat([starts[1:], starts.new_tensor([idx.numel()])]) if not module.include_last_offset \
                else offsets[1:]
            size = int((ends - starts).max()) if starts.numel() else 0
            pos = starts[:, None] + torch.arange(size, device=idx.device)[None, :]   # (n_bags, L)
            valid = pos < ends[:, None]
            pos = pos.clamp(max=max(idx.numel() - 1, 0))
            idx = idx[pos]
            if weights is not None:
                weights = weights[pos]
        if module.padding_idx is not None:
            valid = valid & (idx != module.padding_idx)
        scale = valid.to(output.dtype) if weights is None else weights.to(output.dtype) * valid
        if module.mode == "mean":
            scale = scale / valid.sum(1, keepdim=True).clamp_min(1).to(output.dtype)
        return [((OneHot(idx, module.num_embeddings, valid), scale), output)]

    def rows(self, recorded):
        return recorded[0].idx.shape[0], 1

    def factors(self, module, recorded, g, layout):
        onehot, scale = recorded
        return layout.group(Factors(onehot, g[:, None, :] * scale[:, :, None]))   # D: (n_bags, L, dim)

    def to_params(self, module, block):
        return {"weight": block.transpose(1, 2)}

    def from_params(self, module, params):
        return params["weight"].transpose(1, 2)


_REPLAYING: contextvars.ContextVar = contextvars.ContextVar("gradalg_replaying", default=None)


def replaying():
    """None, or what is replaying a module now (a :class:`ReplayRule`: True; a per-example
    replay of an enclosing module: its recorder): the batch's recorders ignore those calls."""
    return _REPLAYING.get()


@dataclass
class _ReplayCall:
    """One call of a replayed module: its inputs and one of its outputs (all detached)."""

    args: tuple
    kwargs: dict
    output_index: int | None      # None: the output is a tensor; else its index in the tuple
    output: torch.Tensor
    time_major: bool = False      # inputs and output stored batch-first from a (T, B, ·) call

    @property
    def shape(self):
        first = next((t for t in tree_flatten((self.args, self.kwargs))[0] if isinstance(t, torch.Tensor)), None)
        return (first.shape[0] if first is not None and first.dim() else 1, 1)


def _leading_rows(x, n: int, rows: slice):
    return x[rows] if isinstance(x, torch.Tensor) and x.dim() and x.shape[0] == n else x


@register_layer(nn.Module)
@dataclass(frozen=True)
class ReplayRule(LayerRule):
    """Any module with parameters of its own (LayerNorm, RMSNorm of any model, GroupNorm, a
    MoE router, fused experts of another layout than :mod:`gradalg.capture.experts` factors):
    per-example gradients by replaying it on each example.

    The forward hook keeps the call's inputs; given the gradient ``g`` of the summed loss
    w.r.t. its output (rows attributed to examples by :mod:`gradalg.capture.rows`), example
    ``i``'s gradient is the vector-Jacobian product of the module run on that example's
    rows alone::

        g_i = (∂ f(x_i; θ) / ∂θ)ᵀ g[rows of i]           # (P,), P = its parameters' size

    exact for every module whose output rows for one example depend only on that
    example's input rows (checked: the replayed output must equal the batch's rows to
    ``torch.testing.assert_close``'s default tolerance for the dtype, else the layer is
    refused). Nothing is assumed about the module's formula: ``(1 + weight)`` scaling,
    casts and centring are whatever its forward does. For an elementwise norm that is
    ``Σ_t g_{i,t} ⊙ x̂_{i,t}`` (weight) and ``Σ_t g_{i,t}`` (bias).

    The block is dense, stored as factors with one position: ``A = 1``, ``D = g_iᵀ``, so
    ``G_i = D_iᵀ A_i`` is the (P, 1) column of the module's parameters flattened in
    ``named_parameters(recurse=False)`` order. Not in the default layers (see
    ``layers="all"``).
    """

    kind: str = "dense"
    in_default: ClassVar[bool] = False
    in_session: ClassVar[bool] = False
    measured_kinds: ClassVar[tuple[str, ...]] = ()     # one position: positions() below

    def weight_gemm(self, module):
        return None     # its arithmetic is whatever its forward does: not priced by shape

    @staticmethod
    def _params(module):
        return [(n, p) for n, p in module.named_parameters(recurse=False) if p is not None]

    def positions(self, module, output):
        return 1     # the block is one (P, 1) column per example

    def block_shape(self, module):
        params = self._params(module)
        if not params:
            raise UnsupportedLayerError(
                f"{type(module).__name__} has no parameters of its own (e.g. a norm with "
                "elementwise_affine=False / affine=False): it has no gradient to record; leave it "
                "out of `layers`"
            )
        return sum(p.numel() for _, p in params), 1

    def activations(self, module, x):
        raise UnsupportedLayerError(
            f"{type(module).__name__} is recorded by replaying it per example, which ga.grads does "
            "(hooks backend); ga.capture records factored layers only (Linear, Conv1D, Embedding, "
            "convolutions): leave it out of `layers` there"
        )

    def output_grads(self, module, g):
        return g

    def record(self, module, args, kwargs, output):
        detach = lambda t: t.detach() if isinstance(t, torch.Tensor) else t  # noqa: E731
        args, kwargs = tree_map(detach, args), tree_map(detach, kwargs)
        if isinstance(output, torch.Tensor):
            outputs = [(None, output)]
        elif isinstance(output, (tuple, list)):
            # each differentiable output is handed on as an alias (a view), so the gradient
            # recorded for it is the one from outside the module only: the router's scores are
            # computed from its logits inside, and the logits' own gradient would count them again
            outputs = [(k, o.view_as(o)) for k, o in enumerate(output)
                       if isinstance(o, torch.Tensor) and o.requires_grad]
        else:
            outputs = []
        return [(_ReplayCall(args, kwargs, k, o.detach()), o) for k, o in outputs if o.requires_grad]

    def hooked_output(self, output, recorded):
        if isinstance(output, torch.Tensor) or not recorded:
            return None
        new = list(output)
        for call, alias in recorded:
            new[call.output_index] = alias
        return type(output)(new)

    def rows(self, recorded):
        return recorded.shape

    def factors(self, module, recorded, g, layout):
        token = _REPLAYING.set(True)
        try:
            D = self._vmapped(module, recorded, g, layout)
            if D is None:
                D = self._looped(module, recorded, g, layout)
        finally:
            _REPLAYING.reset(token)
        D = D.unsqueeze(1)                                               # (B, 1, P)
        return Factors(D.new_ones(D.shape[0], 1, 1), D)

    def _vmapped(self, module, recorded, g, layout):
        """All examples at once: ``vmap`` over examples of the module's vjp (None when vmap
        cannot trace the module, e.g. data-dependent routing: then :meth:`_looped`)."""
        from torch.func import functional_call, vjp, vmap

        B, per, N = layout.n_examples, layout.per_example, layout.rows
        split = lambda t: (t.reshape(B, per, *t.shape[1:])  # noqa: E731
                           if isinstance(t, torch.Tensor) and t.dim() and t.shape[0] == N else t)
        inputs = tree_map(split, (recorded.args, recorded.kwargs))
        dims = tree_map(lambda t: 0 if isinstance(t, torch.Tensor) and t.dim() and t.shape[0] == N else None,
                        (recorded.args, recorded.kwargs))
        params = self._params(module)
        theta = {n: p.detach() for n, p in params}
        k = recorded.output_index

        def one(theta, inputs, g_b):
            args, kwargs = inputs

            def f(th):
                out = self._call(module, th, args, kwargs, recorded)
                return out if k is None else out[k]
            out, pullback = vjp(f, theta)
            return out, pullback(g_b)[0]

        try:
            out, grads = vmap(one, in_dims=(None, dims, 0))(theta, inputs, g.reshape(B, per, *g.shape[1:]))
        except Exception:  # noqa: BLE001 - vmap's failures are many; the loop is the fallback
            return None
        self._check_replay(module, out.reshape(recorded.output.shape), recorded.output)
        return torch.cat([(grads[n] if p.requires_grad else torch.zeros_like(grads[n])).reshape(B, -1)
                          for n, p in params], dim=1)

    def _looped(self, module, recorded, g, layout):
        """One example at a time: ``module.forward`` on its rows, ``autograd.grad``. (B, P)"""
        params = [p for _, p in self._params(module)]
        free = [p for p in params if p.requires_grad]
        n_rows = layout.rows
        per_example = []
        for b in range(layout.n_examples):
            rows = layout.example_rows(b)
            args, kwargs = tree_map(lambda t: _leading_rows(t, n_rows, rows), (recorded.args, recorded.kwargs))
            with torch.enable_grad():
                out = self._call(module, None, args, kwargs, recorded)   # no hooks: not recorded again
                if recorded.output_index is not None:
                    out = out[recorded.output_index]
                self._check_replay(module, out, recorded.output[rows])
                grads = torch.autograd.grad(out, free, g[rows], allow_unused=True) if free else ()
            grads = iter(grads)
            row = [next(grads) if p.requires_grad else None for p in params]
            per_example.append(torch.cat([(r if r is not None else torch.zeros_like(p)).reshape(-1)
                                          for r, p in zip(row, params)]))
        return torch.stack(per_example)

    def _call(self, module, theta, args, kwargs, recorded):
        """The module's forward on recorded inputs: with parameters ``theta`` swapped in
        (``functional_call``), or its own (``theta`` None; no hooks run either way)."""
        if theta is None:
            return module.forward(*args, **kwargs)
        from torch.func import functional_call
        return functional_call(module, theta, args, kwargs)

    @staticmethod
    def _check_replay(module, out, expected):
        try:
            torch.testing.assert_close(out.detach(), expected)
        except AssertionError as err:
            raise UnsupportedLayerError(
                f"{type(module).__name__} gives other outputs for an example alone than in its batch "
                f"({str(err).splitlines()[1] if len(str(err).splitlines()) > 1 else err}): its output "
                "for one example depends on the other examples (e.g. batch statistics, capacity-limited "
                "routing), so its per-example gradient is not defined by replay. Leave it out of `layers` "
                "or use backend='func'"
            ) from None

    def to_params(self, module, block):
        out, start = {}, 0
        for name, p in self._params(module):
            out[name] = block[:, start:start + p.numel(), 0].reshape(block.shape[0], *p.shape)
            start += p.numel()
        return out

    def from_params(self, module, params):
        n = next(iter(params.values())).shape[0]
        return torch.cat([params[name].reshape(n, -1) for name, _ in self._params(module)], dim=1).unsqueeze(-1)


_MHA_INPUTS = ("query", "key", "value")


@register_layer(nn.MultiheadAttention)
@dataclass(frozen=True)
class MultiheadAttentionRule(ReplayRule):
    """``nn.MultiheadAttention``: replayed per example with **all** its parameters, the
    input projections and ``out_proj`` (which its forward applies with ``F.linear`` on the
    weight, never calling the submodule, so no hook of ``out_proj`` fires).

    Parameters, in order: ``named_parameters(recurse=False)`` (``in_proj_weight``,
    ``in_proj_bias``, or ``q/k/v_proj_weight``; ``bias_k``, ``bias_v``), then
    ``out_proj.weight``, ``out_proj.bias``: the block is their (P, 1) column, as for
    :class:`ReplayRule`. A call with ``batch_first=False`` ((T, B, E) inputs) is stored
    batch-first and transposed back to replay it; ``attn_mask`` must be shared by the
    batch ((T, S)): a per-example (B·heads, T, S) mask is refused.
    """

    uses_without_calling: ClassVar[tuple[str, ...]] = ("out_proj",)

    @staticmethod
    def _params(module):
        own = [(n, p) for n, p in module.named_parameters(recurse=False) if p is not None]
        return own + [(f"out_proj.{n}", p) for n, p in module.out_proj.named_parameters(recurse=False)
                      if p is not None]

    def param_names(self, module):
        return tuple(n for n, _ in self._params(module))

    def record(self, module, args, kwargs, output):
        names = dict(zip(_MHA_INPUTS + ("key_padding_mask", "need_weights", "attn_mask"), args)) | kwargs
        mask = names.get("attn_mask")
        if isinstance(mask, torch.Tensor) and mask.dim() == 3:
            raise UnsupportedLayerError(
                f"nn.MultiheadAttention called with a per-example attn_mask of shape {tuple(mask.shape)}: "
                "its replay per example needs a mask shared by the batch, (T, S); pass per-example "
                "padding as key_padding_mask (B, S), or use backend='func'")
        calls = super().record(module, args, kwargs, output)
        if module.batch_first or names["query"].dim() != 3:
            return calls
        flip = lambda t: t.transpose(0, 1) if isinstance(t, torch.Tensor) and t.dim() == 3 else t  # noqa: E731
        out = []
        for call, alias in calls:
            a = tuple(flip(t) if i < 3 else t for i, t in enumerate(call.args))
            kw = {k: flip(v) if k in _MHA_INPUTS else v for k, v in call.kwargs.items()}
            o = call.output.transpose(0, 1) if call.output_index == 0 else call.output
            out.append((_ReplayCall(a, kw, call.output_index, o, time_major=True), alias))
        return out

    def factors(self, module, recorded, g, layout):
        if recorded.time_major and recorded.output_index == 0:
            g = g.transpose(0, 1)
        return super().factors(module, recorded, g, layout)

    def _call(self, module, theta, args, kwargs, recorded):
        if not recorded.time_major:
            return super()._call(module, theta, args, kwargs, recorded)
        flip = lambda t: t.transpose(0, 1) if isinstance(t, torch.Tensor) and t.dim() == 3 else t  # noqa: E731
        args = tuple(flip(t) if i < 3 else t for i, t in enumerate(args))
        kwargs = {k: flip(v) if k in _MHA_INPUTS else v for k, v in kwargs.items()}
        out = super()._call(module, theta, args, kwargs, recorded)
        return (out[0].transpose(0, 1), *out[1:])


#: factored layers: in the default ``layers``, and recorded by ``ga.capture`` too
DEFAULT_LAYERS = ("nn.Linear", "transformers Conv1D", "nn.Embedding", "nn.EmbeddingBag", "nn.Conv1d",
                  "nn.Conv2d", "nn.Conv3d")
SUPPORTED_LAYERS = DEFAULT_LAYERS + ("transformers' fused MoE experts (one factored block per expert and "
                                     "matrix, ga.grads only)",
                                     "any other module with parameters of its own (LayerNorm, RMSNorm, "
                                     "GroupNorm, ...), by per-example replay")


def rule_for(name: str, module: nn.Module) -> LayerRule:
    """The rule recording ``module`` (:data:`LAYER_RULES`, by :func:`rule_class`), or an
    :class:`UnsupportedLayerError` naming the fix.

    Factored rules for the layers of :data:`DEFAULT_LAYERS`; :class:`ReplayRule` (dense,
    not in the default layers) for any other module with parameters of its own.
    """
    rule = rule_class(module).for_module(module)
    rule.block_shape(module)    # refuses unsupported variants now
    return rule


def check_session_layers(refs) -> None:
    """``ga.capture`` records the factored layers of :data:`DEFAULT_LAYERS` (one row per
    example, A from the first input); refuse the others before the loop starts."""
    bad = [f"{r.name!r} ({type(r.module).__name__})" for r in refs
           if not r.rule.in_session
           or (r.rule.base_forward is not None and type(r.module).forward is not r.rule.base_forward)]
    if bad:
        raise UnsupportedLayerError(
            f"ga.capture records factored layers only ({', '.join(DEFAULT_LAYERS[:3])}, nn.Conv1d/2d/3d); "
            f"layers {', '.join(bad)} need ga.grads (hook capture replays them per example, or "
            "backend='func'): leave them out of ga.capture's `layers`"
        )
