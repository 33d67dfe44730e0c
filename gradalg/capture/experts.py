"""Fused mixture-of-experts modules: one factored block per expert and weight matrix.

transformers ≥ 5 stores the experts of Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE as two 3-D
parameters of one module (``…Experts``): ``gate_up_proj`` (E, 2I, H) and ``down_proj``
(E, H, I). Its forward takes the block's flattened tokens ``x`` (N, H), each token's
``k`` experts ``top_k_index`` (N, k) and routing weights ``top_k_weights`` (N, k), and
returns (N, H)::

    y_t = Σ_{s<k} w_{t,s} · W^down_{e_{t,s}} φ(W^gu_{e_{t,s}} x_t)       φ([g; u]) = act(g) ⊙ u

so every expert is two linear maps applied to the tokens routed to it. The module is
recorded as ``2E`` factored blocks, named ``<module>.gate_up_proj.<e>`` and
``<module>.down_proj.<e>``, each the (out, in) matrix ``W_e`` of one expert::

    grad W^down_e (example i) = Σ_{t ∈ i → e} δ_t h_tᵀ      δ_t = w_{t,s} g_t    h_t = φ(W^gu_e x_t)
    grad W^gu_e   (example i) = Σ_{t ∈ i → e} γ_t x_tᵀ      γ_t = J_φ(W^gu_e x_t)ᵀ (W^down_eᵀ δ_t)

with ``g_t`` (H) the gradient of the summed loss w.r.t. the module's output at token
``t`` (the routing weight is applied where the forward applies it: on the expert's
output). The hook keeps the call's three inputs (one record shared by its ``2E`` blocks);
given ``g``, each expert's factors are recomputed for its routed tokens alone: one gate/up
product (M_e × H × 2I), one ``δ W^down_e`` product and φ's vector-Jacobian product
(autograd on the recomputed gate/up only); the ``down`` block reuses the ``gate_up``
block's ``h`` (recomputed when recorded alone). The weight-gradient GEMMs are never formed.

Representation (token-sparse): example ``i``'s positions in the block of expert ``e`` are
the real tokens of ``i`` routed to ``e``, in token order, padded with zero rows to the
batch's largest count ``L_e = max_i |{t ∈ i → e}|`` (at least 1): factors ``A`` (B, L_e, in)
and ``D`` (B, L_e, out). Zero rows add nothing to ``G_i = D_iᵀ A_i``, to inner products or to
Kronecker statistics, so every factored kernel applies unchanged. An expert that receives
no token of example ``i`` leaves ``G_i = 0``. Padding tokens (the task's token mask False:
``attention_mask`` 0) are routed by the forward but get no rows: their output gradient is
zero (no loss term, and no real token attends to them), and the layers whose positions are
the tokens zero them in ``A`` and ``D`` alike (:func:`~gradalg.capture.tying.use_factors`),
so K-FAC's ``A = Σ_t a_t a_tᵀ`` and its token count leave them out for experts as for every
other layer. Real tokens without a loss term (a sequence's last token, a completion-only
prompt) keep their rows: their activations count in ``A`` as they do for the dense layers.

Planner facts (per position of the module's input, :mod:`gradalg.plan.shapes`): the
forward multiplies each token by ``k`` experts' ``H × 2I`` and ``I × H`` matrices (FLOPs
of one (H, 3kI) GEMM); autograd keeps, per token and routed expert, its input, gate/up
output, gated activation, expert output and weighted output (``k (3H + 4I)`` numbers);
each block's positions per example are priced at what a chunk of ``B`` examples pads it
to, the expected largest of ``B`` routed counts (:func:`expected_padded`)::

    T_e = ⌈E[max_{i<B} c_{i,e}]⌉      c_{i,e} ~ Binomial(T, p_e)      E[max] = Σ_{m≥1} 1 − F(m−1)^B

with ``p_e = k / E`` the share of tokens routed to expert ``e`` at balanced routing
(``B = 1`` gives the mean ``⌈T k / E⌉``): the price without running the model (displays).
Before a run (:func:`gradalg.plan.shapes.measure_forward_shapes`) the padded length is
measured instead: one no-grad forward of the data's first chunk of ``B`` examples, ``L_e =
max_i c_{i,e}`` over its real tokens (:func:`routed_counts`, padding left out as capture
leaves it out). Routing is neither balanced nor the same across
examples (each document has experts of its own): at real widths on real text
(``benchmarks/moe_positions.py``) the balanced price was ½ of the padded length.

Only the forward these classes ship (concatenated gate/up, not transposed, no biases, no
post-expert norm) is factored; ``config.experts_implementation`` (eager, grouped or
batched GEMMs) computes the same map and is accepted. Any other layout, or a subclass
overriding ``forward``, is recorded like any module with parameters of its own: by
per-example replay (:class:`~gradalg.capture.layers.ReplayRule`, dense rows), when named
in ``layers`` or with ``layers="all"``; it is then not a default layer, and the coverage
line names it.
"""
from __future__ import annotations

import functools
import math
import sys
import weakref
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import nn

from ..errors import UnsupportedLayerError
from .factors import Factors
from .layers import LayerRule, ReplayRule, register_layer
from .rows import RowLayout

__all__ = ["FUSED_EXPERTS", "FusedExpertsRule", "ExpertMatrixRule", "MATRICES", "expected_padded",
           "routed_counts", "meta_forward", "ParamPart", "add_param", "dense_param"]

#: the transformers classes whose forward this module factors ("package.module:Class")
FUSED_EXPERTS = (
    "transformers.models.olmoe.modeling_olmoe:OlmoeExperts",
    "transformers.models.qwen3_moe.modeling_qwen3_moe:Qwen3MoeExperts",
    "transformers.models.qwen2_moe.modeling_qwen2_moe:Qwen2MoeExperts",
    "transformers.models.mixtral.modeling_mixtral:MixtralExperts",
)

#: the module's two weight matrices, in block order within one expert
MATRICES = ("gate_up_proj", "down_proj")

#: (attribute, value) the forward factored here needs (set by transformers' decorator)
_LAYOUT = (("has_gate", True), ("has_bias", False), ("is_transposed", False), ("is_concatenated", True),
           ("has_post_expert_norm", False))


def _registered_class(module: nn.Module):
    """The class of FUSED_EXPERTS (imported) in ``type(module).__mro__``, or None."""
    names = {}
    for key in FUSED_EXPERTS:
        mod, _, cls = key.partition(":")
        found = getattr(sys.modules.get(mod), cls, None)
        if found is not None:
            names[found] = key
    return next((t for t in type(module).__mro__ if t in names), None)


def check_fused_experts(module: nn.Module) -> None:
    """Refuse an experts module whose forward is not the one factored here."""
    cls = _registered_class(module)
    problems = []
    if cls is not None and type(module).forward is not cls.forward:
        problems.append(f"{type(module).__name__} overrides {cls.__name__}.forward")
    gate = getattr(type(module), "_apply_gate", None)
    if gate is not None and getattr(gate, "__name__", "") != "_default_apply_gate":
        problems.append(f"{type(module).__name__} has a gate of its own (_apply_gate)")
    for attr, value in _LAYOUT:
        if getattr(module, attr, value) != value:
            problems.append(f"{attr}={getattr(module, attr)!r}")
    gu, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not (isinstance(gu, torch.Tensor) and isinstance(down, torch.Tensor) and gu.dim() == 3 and down.dim() == 3
            and gu.shape[0] == down.shape[0] and gu.shape[1] == 2 * down.shape[2] and gu.shape[2] == down.shape[1]):
        problems.append("parameters are not gate_up_proj (E, 2I, H) and down_proj (E, H, I)")
    if problems:
        raise UnsupportedLayerError(
            f"{type(module).__name__} is a fused experts module with a layout gradalg does not factor "
            f"({'; '.join(problems)}): leave it out of `layers` (the default layers do), or use backend='func'")


def _top_k(module: nn.Module) -> int:
    config = getattr(module, "config", None)
    k = getattr(config, "num_experts_per_tok", None) or getattr(config, "top_k", None)
    return int(k) if k else 1


def _n_experts(module: nn.Module) -> int:
    return int(module.gate_up_proj.shape[0])


@functools.lru_cache(maxsize=4096)
def expected_padded(tokens: int, share: float, examples: int) -> float:
    """``E[max(1, max_{i<B} c_i)]`` for ``B = examples`` independent counts ``c_i ~
    Binomial(tokens, share)``: the expected padded length of one expert's block in a chunk
    of ``B`` examples of ``tokens`` tokens each (``_by_example`` pads to the largest count,
    at least 1). Exact: ``1 + Σ_{m≥2} 1 − F(m−1)^B`` with ``F`` the binomial CDF (float64,
    from the log-pmf). ``B = 1``: ``max(1, tokens · share)`` up to the floor at 1."""
    tokens, examples = int(tokens), max(1, int(examples))
    p = min(max(float(share), 0.0), 1.0)
    if tokens < 1 or p == 0.0:
        return 1.0
    if p == 1.0:
        return float(tokens)
    m = torch.arange(tokens + 1, dtype=torch.float64)
    log_pmf = (torch.lgamma(torch.tensor(tokens + 1.0, dtype=torch.float64)) - torch.lgamma(m + 1)
               - torch.lgamma(tokens - m + 1) + m * math.log(p) + (tokens - m) * math.log1p(-p))
    cdf = torch.cumsum(log_pmf.exp(), 0).clamp(max=1.0)           # F(m), m = 0..tokens
    # E[max(1, M)] = Σ_{m≥1} P(max(1, M) ≥ m) = 1 + Σ_{m=2}^{tokens} (1 − F(m−1)^B)
    return 1.0 + float((1.0 - cdf[1:tokens].pow(examples)).sum())


def routed_counts(module: nn.Module, top_k_index: torch.Tensor, examples: int = 1,
                  real: torch.Tensor | None = None) -> torch.Tensor:
    """(B, E) tokens of each example routed to each expert, from a call's ``top_k_index``
    (N, k), ``N = B·T`` tokens flattened batch-major (``B = examples``), the tokens where
    ``real`` (B, T) or (N,) is False (padding) left out, as capture leaves them out.
    ``.max(0)`` is what capture pads each expert to."""
    E = _n_experts(module)
    index = top_k_index.detach().long().cpu()
    example = torch.div(torch.arange(index.shape[0]), max(1, index.shape[0] // max(1, examples)),
                        rounding_mode="floor").unsqueeze(1).expand_as(index)
    keep = (index >= 0) & (index < E)
    if real is not None and real.numel() == index.shape[0]:
        keep &= real.detach().reshape(-1, 1).cpu().bool()
    flat = example[keep] * E + index[keep]
    return torch.bincount(flat, minlength=examples * E)[:examples * E].reshape(examples, E)


def meta_forward(module: nn.Module, args, kwargs) -> torch.Tensor:
    """The fused experts' output on the ``meta`` device (the planner's shape measurement):
    (N, H) like ``hidden_states``, the routing is not known there (the module's own forward
    needs it: ``nonzero``)."""
    hidden = args[0] if args else kwargs["hidden_states"]
    return torch.empty_like(hidden)


@dataclass
class _ExpertCall:
    """One call's inputs (detached): tokens (N, H), experts (N, k), routing weights (N, k),
    shared by the call's ``2E`` blocks; ``gated``: ``{expert: act(gate)·up}`` of its routed
    tokens, left by the ``gate_up`` block for the ``down`` block that follows it."""

    x: torch.Tensor
    index: torch.Tensor
    weights: torch.Tensor
    gated: dict = field(default_factory=dict)

    @property
    def shape(self):
        return (self.x.shape[0], 1)


@dataclass(frozen=True)
class _ExpertsBase(LayerRule):
    """What the module and its blocks share: the model facts of its forward."""

    kind: str = "experts"
    in_session: ClassVar[bool] = False    # ga.capture records one A per call: not these
    positions_are_tokens: ClassVar[bool] = False
    #: the routed tokens depend on the data: positions are measured before a run (the routing
    #: of the data's first chunk, :func:`gradalg.plan.shapes.measure_forward_shapes`), priced at
    #: balanced routing otherwise (:meth:`ExpertMatrixRule.positions_for_tokens`; a display
    #: costs the kernels there, :func:`gradalg.plan.blocks.kernels`)
    measured_kinds: ClassVar[tuple[str, ...]] = ("expert",)

    def weight_gemm(self, module):
        E, I2, H = module.gate_up_proj.shape
        return H, 3 * _top_k(module) * (I2 // 2)

    def activation_numbers(self, module):
        _, I2, H = module.gate_up_proj.shape
        return _top_k(module) * (3 * H + 2 * I2)

    def output_width(self, module):
        return None

    def activations(self, module, x):
        raise UnsupportedLayerError(
            f"{type(module).__name__} (fused experts) is recorded by ga.grads (hooks backend) only; "
            "leave it out of ga.capture's `layers`")

    def output_grads(self, module, g):
        return g


@dataclass(frozen=True)
class FusedExpertsRule(_ExpertsBase):
    """The experts module as a whole: it is selected like a layer (by its name, a glob, the
    default layers), and :func:`~gradalg.capture.hooks.resolve_layers` replaces it by its
    ``2E`` blocks (:meth:`parts`, each an :class:`ExpertMatrixRule`)."""

    @classmethod
    def for_module(cls, module):
        """This rule for the forward it factors; :class:`~gradalg.capture.layers.ReplayRule`
        (dense rows by per-example replay, not a default layer) for any other."""
        try:
            check_fused_experts(module)
        except UnsupportedLayerError:
            return ReplayRule()
        return cls()

    def block_shape(self, module):
        check_fused_experts(module)
        E, I2, H = module.gate_up_proj.shape
        return 2 * E, I2 * H + H * I2 // 2     # never a block: the sizes of its parts, summed

    def parts(self, module) -> list[tuple[str, "ExpertMatrixRule"]]:
        """``[(suffix, rule)]``: ``gate_up_proj.<e>`` and ``down_proj.<e>`` for every expert."""
        check_fused_experts(module)
        return [(f"{m}.{e}", ExpertMatrixRule(expert=e, matrix=m))
                for e in range(module.gate_up_proj.shape[0]) for m in MATRICES]

    def to_params(self, module, block):
        raise UnsupportedLayerError("a fused experts module is recorded as its experts' blocks, never whole")

    from_params = to_params


@dataclass(frozen=True)
class ExpertMatrixRule(_ExpertsBase):
    """One expert's ``gate_up_proj`` (2I, H) or ``down_proj`` (H, I) as a factored block
    (kind ``"expert"``: a linear map of the tokens routed to it)."""

    kind: str = "expert"
    expert: int = 0
    matrix: str = "gate_up_proj"
    partial_params: ClassVar[bool] = True

    def block_shape(self, module):
        return tuple(getattr(module, self.matrix).shape[1:])

    def param_names(self, module):
        return (self.matrix,)

    def weight_gemm(self, module):
        return None    # the module's rule answers for the whole forward

    def activation_numbers(self, module):
        return 0

    def to_params(self, module, block):
        """(n, out, in) → ``{matrix: ParamPart}``: this expert's slice ``[:, e]`` of the
        (n, E, out, in) parameter, not allocated whole (the callers add the parts of one
        parameter with :func:`add_param`: one (n, E, out, in) tensor for all its experts)."""
        return {self.matrix: ParamPart(block, self.expert, tuple(getattr(module, self.matrix).shape))}

    def from_params(self, module, params):
        return params[self.matrix][:, self.expert]

    def positions(self, module, output):
        """The mean routed tokens per example, ``⌈T k / E⌉`` (the meta forward that measures
        positions runs one example: ``output`` (T, H); the routing is not known on meta:
        :func:`gradalg.plan.shapes.measure_forward_shapes` replaces this by
        :meth:`positions_for_tokens` at the measured share and the chunk's examples)."""
        return self.positions_for_tokens(module, output.shape[0])

    def positions_for_tokens(self, module, tokens, examples: int = 1, share: float | None = None):
        """``⌈E[max_{i<B} c_i]⌉`` (:func:`expected_padded`), ``B = examples``: the padded
        length of this expert's block in a chunk of ``B`` examples of ``tokens`` tokens, each
        token routed here with probability ``share`` (default ``k / E``, balanced routing;
        ``B = 1`` then gives the mean ``⌈T k / E⌉``)."""
        if share is None:
            share = _top_k(module) / _n_experts(module)
            if examples <= 1:
                return max(1, math.ceil(tokens * share))
        return max(1, math.ceil(expected_padded(int(tokens), round(float(share), 6), int(examples)) - 1e-9))

    def record(self, module, args, kwargs, output):
        if not isinstance(output, torch.Tensor) or not output.requires_grad:
            return []
        hit = _CALLS.get(id(output))      # the call's other blocks recorded it already
        if hit is not None and hit[0]() is output:
            return [(hit[1], output)]
        names = ("hidden_states", "top_k_index", "top_k_weights")
        given = dict(zip(names, args)) | {k: v for k, v in kwargs.items() if k in names}
        call = _ExpertCall(*(given[n].detach() for n in names))
        key = id(output)
        _CALLS[key] = (weakref.ref(output, lambda _, key=key: _CALLS.pop(key, None)), call)
        return [(call, output)]

    def rows(self, recorded):
        return recorded.shape

    def factors(self, module, recorded, g, layout: RowLayout) -> Factors:
        x, index, weights = recorded.x, recorded.index, recorded.weights
        hit = index == self.expert                                # (N, k)
        if layout.keep is not None:                               # padding tokens: no rows
            hit &= layout.keep.to(hit.device).unsqueeze(1)
        rows, slot = torch.where(hit)                             # rows ascending: token order
        W_gu = module.gate_up_proj.detach()[self.expert]          # (2I, H)
        W_down = module.down_proj.detach()[self.expert]           # (H, I)
        xe = x[rows]                                              # (M, H)
        delta = g[rows] * weights[rows, slot].unsqueeze(-1).to(g.dtype)     # (M, H)
        if self.matrix == "down_proj" and self.expert in recorded.gated:
            return _by_example(recorded.gated.pop(self.expert), delta, rows, layout)
        with torch.enable_grad():
            h = nn.functional.linear(xe, W_gu).requires_grad_(self.matrix == "gate_up_proj")
            gate, up = h.chunk(2, dim=-1)
            act = module.act_fn(gate) * up                        # (M, I)
            if self.matrix == "down_proj":
                return _by_example(act, delta, rows, layout)
            (gamma,) = torch.autograd.grad(act, h, delta @ W_down.to(delta.dtype))
        recorded.gated[self.expert] = act.detach()
        return _by_example(xe, gamma, rows, layout)


@dataclass(frozen=True, eq=False)
class ParamPart:
    """One expert's slice of a fused parameter: ``value`` (n, out, in) is ``full[:, index]``
    of the parameter's (n, E, out, in) gradient, zero elsewhere (``shape``: the parameter's
    (E, out, in)). :func:`add_param` adds it into one tensor per parameter."""

    value: torch.Tensor
    index: int
    shape: tuple

    def dense(self) -> torch.Tensor:
        """(n, E, out, in): zero but for ``[:, index]`` (a new tensor)."""
        full = self.value.new_zeros(self.value.shape[0], *self.shape)
        full[:, self.index] = self.value
        return full


def add_param(acc: dict, key, value) -> None:
    """``acc[key] += value`` for the values of ``rule.to_params``: a tensor, or a
    :class:`ParamPart` written into ``acc[key]`` in place (its first part allocates the
    parameter's tensor once; a tensor ``acc`` did not allocate this way is copied first,
    never written)."""
    old = acc.get(key)
    if not isinstance(value, ParamPart):
        acc[key] = value if old is None else old + value.to(old.dtype)
        return
    if old is None:
        acc[key] = _own(value.dense())
        return
    if not _owned(old):
        old = acc[key] = _own(old.clone())
    old[:, value.index] += value.value.to(old.dtype)


def dense_param(value) -> torch.Tensor:
    """A value of ``rule.to_params`` as a tensor (a :class:`ParamPart` made whole)."""
    return value.dense() if isinstance(value, ParamPart) else value


#: ``{id(tensor): weak reference}`` of the tensors :func:`add_param` allocated (writable)
_OWNED: dict = {}


def _own(t: torch.Tensor) -> torch.Tensor:
    _OWNED[id(t)] = weakref.ref(t, lambda _, key=id(t): _OWNED.pop(key, None))
    return t


def _owned(t: torch.Tensor) -> bool:
    ref = _OWNED.get(id(t))
    return ref is not None and ref() is t


#: ``{id(module output): (weak reference to it, _ExpertCall)}``: one record per call, made by
#: whichever of its blocks' hooks runs first, dropped with the output tensor
_CALLS: dict = {}


def _by_example(A: torch.Tensor, D: torch.Tensor, rows: torch.Tensor, layout: RowLayout) -> Factors:
    """Rows (M, ·) of flattened tokens ``rows`` → (B, L, ·) per example, token order kept,
    zero-padded to the largest count ``L`` (≥ 1)."""
    B, per = layout.n_examples, layout.per_example
    example = torch.div(rows, per, rounding_mode="floor")
    counts = torch.bincount(example, minlength=B)
    L = max(1, int(counts.max())) if rows.numel() else 1
    first = torch.cumsum(counts, 0) - counts
    position = torch.arange(rows.numel(), device=rows.device) - first[example]
    outA = A.new_zeros(B, L, A.shape[-1])
    outD = D.new_zeros(B, L, D.shape[-1])
    outA[example, position] = A
    outD[example, position] = D
    return Factors(outA, outD)


register_layer(*FUSED_EXPERTS)(FusedExpertsRule)
