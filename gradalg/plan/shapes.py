"""Shapes a plan needs, known without numbers: positions per example of every
recorded layer, rows per example of an objective, the element size of the rows.

A layer's factors hold one row per *position* of its input: the tokens of a sequence,
the output pixels of a convolution (H_out·W_out, which only the layers before it
determine). :func:`measure_forward_shapes` finds them by running the task's loss once on the
``meta`` device for the first example — shapes propagate, nothing is computed or
allocated, the model's own parameters are not touched — and records, per block, its
rule's ``positions`` (``T_b = output.numel() / (batch · out_features)``; 1 for a block
recorded by replay, one (P, 1) column per example). Models whose forward cannot run on
``meta`` (a data-dependent branch, ``.item()``) fall back to :func:`tokens_hint` for
every block. The tasks skip their value checks on meta tensors (the real batch is checked
before every capture); fused MoE experts (:mod:`gradalg.capture.experts`) run a shape-only
forward there, and their routed positions are measured for real: one no-grad forward of
the first chunk of the data, ``B`` examples (:func:`chunk_examples`, the most a chunk of the
pass holds), stopped at the last experts module, records each module's routing, and each
expert's block is priced at what capture pads it to in that chunk, its most-routed
example's count (:func:`_routed_positions`).

Executors measure before they plan a run (``plan(..., measure_shapes=True)``: the facts
stage, :mod:`gradalg.plan.facts`); displays (``repr``, ``explain()``, the plan explorer)
never call the model and use ``tokens_hint``. Nothing is cached on a node and nothing is in
force behind a call: a measurement is a field of a :class:`ModelFacts` (the plan's
:class:`~gradalg.plan.facts.Facts` is one), handed to every cost and bytes formula that
reads a layer's positions (:func:`gradalg.plan.memory.positions`, the jobs' hooks).
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field
from typing import Mapping

import torch
from torch import nn
from torch.func import functional_call

from ..capture.experts import ExpertMatrixRule, FusedExpertsRule, meta_forward, routed_counts
from ..capture.hooks import resolve_layers
from ..capture.layers import rule_class
from ..curvature.held import HeldBytes
from ..data import batch_size_of, meta_batch, move_batch
from ..options import get_options
from .cost import tokens_hint

__all__ = ["ForwardShapes", "ModelFacts", "forward_shapes", "measure_forward_shapes", "rows_per_example", "element_size",
           "weight_layers", "attention_shape", "activation_bytes", "output_width", "output_bytes",
           "OUTPUT_COPIES", "chunk_examples", "measurement_key"]


@dataclass(frozen=True)
class ForwardShapes:
    """What one example's forward leaves in memory, from a meta-device run.

    positions : ``{block name: T_b}`` positions per example of each recorded layer.
    activations : numbers per example in the outputs of every leaf module (what autograd
        keeps for the backward, within a small factor); 0 when not measured.
    measured : False when the forward could not run on meta (``tokens_hint`` used).
    routed : the blocks whose positions are routed tokens (fused experts): a share of the
        tokens their module sees, so they do not say the model's layers see other position
        counts than the data's (:func:`gradalg.plan.memory.capture_bytes_per_example`).
    """

    positions: dict
    activations: int
    measured: bool
    routed: frozenset = frozenset()


@dataclass(frozen=True, kw_only=True)
class ModelFacts:
    """What the cost and bytes formulas read besides the nodes: the dtype of the rows and
    the measured forward shapes, ``{source token: ForwardShapes}`` (empty: nothing
    measured, every layer at ``tokens_hint``). The plan's
    :class:`~gradalg.plan.facts.Facts` is one; a job's hooks take it
    (``job.fixed_bytes(facts)``, ``job.stream_cost(n, chunk, facts, ...)``)."""

    dtype: torch.dtype = torch.float32
    shapes: Mapping[str, ForwardShapes] = field(default_factory=dict)

    @property
    def elem(self) -> int:
        """Bytes per number of the rows (:func:`element_size` of ``dtype``)."""
        return element_size(self.dtype)


def forward_shapes(src, shapes: Mapping[str, ForwardShapes]) -> ForwardShapes:
    """The :class:`ForwardShapes` of a Source: its measurement in ``shapes`` (a plan's
    facts), else ``tokens_hint`` for every block (not measured)."""
    return shapes.get(src.token) or ForwardShapes(_hinted_positions(src, tokens_hint(src)), 0, False)


def _hinted_positions(src, tokens: int) -> dict:
    """``{block: T_b}`` without running the model: ``tokens`` for every block, but what its
    rule's :meth:`~gradalg.capture.layers.LayerRule.positions_for_tokens` says (a fused
    expert's padded share of the tokens in a chunk of :func:`chunk_examples`, at balanced
    routing). Kept by ``(source token, tokens, examples)`` (a few, most recent)."""
    task = getattr(src, "task", None)
    if task is None or getattr(src, "backend", "hooks") != "hooks":
        return {b.name: tokens for b in src.space.blocks}
    examples = chunk_examples(src) if any(b.kind == ExpertMatrixRule.kind for b in src.space.blocks) else 1
    key = (src.token, tokens, examples)
    if key not in _HINTS:
        _HINTS[key] = {ref.name: (ref.rule.positions_for_tokens(ref.module, tokens, examples)
                                  if isinstance(ref.rule, ExpertMatrixRule)
                                  else ref.rule.positions_for_tokens(ref.module, tokens))
                       for ref in resolve_layers(task.model, list(src.layers))}
        while len(_HINTS) > 32:
            _HINTS.pop(next(iter(_HINTS)))
    return {b.name: _HINTS[key].get(b.name, tokens) for b in src.space.blocks}


#: ``{(source token, tokens, examples): {block: T_b}}`` of :func:`_hinted_positions`
_HINTS: dict = {}


def chunk_examples(src) -> int:
    """The most examples one chunk of a pass over ``src`` holds: ``min(n, batch_size,
    ⌈batch_tokens / T⌉)`` (``ga.options``; the data's own batch size when it has one). The
    planner may choose fewer (under ``memory_budget``); a fused expert's padded length
    grows with the chunk, so pricing it here is an upper bound for a smaller one."""
    from .size import _batch_tokens     # size imports this module
    options, data = get_options(), getattr(src, "data", None)
    B = data.largest_batch(options.batch_size) if data is not None else min(int(src.n or 1), options.batch_size)
    by_tokens = None
    with contextlib.suppress(Exception):   # a source without a model's parameters: no token limit
        by_tokens = _batch_tokens([src], options)[2]
    return max(1, min(B, by_tokens) if by_tokens else B)


def measurement_key(src):
    """What :func:`measure_forward_shapes` of ``src`` depends on: its token, and with fused
    experts among its layers the chunk's examples (:func:`chunk_examples`, from the options'
    ``batch_size`` / ``batch_tokens``: a later change re-measures the padded lengths)."""
    return (src.token, chunk_examples(src)) if any(b.kind == ExpertMatrixRule.kind for b in src.space.blocks) \
        else src.token


def measure_forward_shapes(src) -> ForwardShapes:
    """One meta-device forward of the first example (executors, before running a plan):
    every recorded layer's positions; ``tokens_hint`` where the forward cannot run. With
    fused experts among the layers, also one real no-grad forward of the data's first chunk
    (:func:`_routed_positions`: the experts' padded lengths)."""
    shapes = forward_shapes(src, {})
    data, task = getattr(src, "data", None), getattr(src, "task", None)
    if data is not None and task is not None and src.backend == "hooks":
        # shapes are a hint: a model meta cannot run keeps tokens_hint
        with contextlib.suppress(Exception):
            batch = data.first_example_batch()
            refs = resolve_layers(task.model, list(src.layers))
            positions, activations, _ = _measure_on_meta(task, batch, refs)
            routed = frozenset(r.name for r in refs if isinstance(r.rule, ExpertMatrixRule))
            if positions and routed:
                positions.update(_routed_positions(task, data, refs, chunk_examples(src)))
            shapes = ForwardShapes({**shapes.positions, **positions}, activations, bool(positions), routed)
    return shapes


def _measure_on_meta(task, batch, refs, fn=None, free=()) -> tuple[dict[str, int], int, tuple | None]:
    """``({block: T_b}, activations, saved)`` of one meta forward of the one-example ``batch``:
    every recorded layer's positions and the numbers in every leaf module's output (a
    fused experts module: its own per-token numbers, ``activation_numbers``).

    With ``fn`` (``fn(model, batch)``, e.g. ``task.summed_loss`` or ``task.forward``) the forward
    is ``fn``'s instead of the task's loss, with gradients enabled for the parameters named
    ``free`` (the others and the buffers fixed), and ``saved`` is ``(plain, dual, working)``, one
    example's bytes (:class:`~gradalg.curvature.held.HeldBytes`: what autograd saves for the
    backward, without and with a tangent, and the most bytes alive at once beside it; the
    parameters, buffers and batch left out); None without ``fn`` or where ``fn`` did not run to
    its end on meta (a partial count would be low)."""
    model: nn.Module = task.model
    seen, activations, handles, patched = {}, [0], [], {}   # {block: T_b}, [numbers], hooks, {id: (module, forward)}
    for ref in refs:
        def hook(module, args, output, name=ref.name, rule=ref.rule):
            if isinstance(output, torch.Tensor) and name not in seen:
                # one example: every row of the output is its own, also a module's of flattened
                # tokens (T, d) (a Qwen2-MoE shared expert); a fused expert reads (T, H) as tokens
                seen[name] = rule.positions(module, output if isinstance(rule, ExpertMatrixRule)
                                            else output.unsqueeze(0))
        handles.append(ref.module.register_forward_hook(hook))

    def count(module, args, output):     # one example: every number of the output is its
        if isinstance(output, torch.Tensor) and output.dim() > 0:
            activations[0] += output.numel()
    for module in model.modules():
        if not any(True for _ in module.children()):
            handles.append(module.register_forward_hook(count))
        elif isinstance(rule_class(module).for_module(module), FusedExpertsRule) and id(module) not in patched:
            patched[id(module)] = (module, module.__dict__.get("forward"))   # an instance forward (accelerate's) kept
            module.forward = functools.partial(_meta_experts, module, activations)
    try:
        # one name per tensor: a tied weight (GPT-2's lm_head and wte) named twice is refused by
        # functional_call, which would leave every tied model on tokens_hint
        state = {k: torch.empty_like(v, device="meta").requires_grad_(k in free) for k, v in (*model.named_parameters(), *model.named_buffers())}
        meta, saved = meta_batch(batch), None
        # the model's tensors replaced by meta ones for one call; the forward ran (hooks fired) even
        # where the loss, which may need numbers, fails
        with torch.enable_grad() if fn else torch.no_grad(), contextlib.suppress(Exception), \
                HeldBytes([*state.values(), meta]) if fn else contextlib.nullcontext() as held:
            (fn or task.loss)(_MetaModel(model, state), meta)
            saved = (held.plain, held.dual, held.working) if fn else None
    finally:
        for h in handles:
            h.remove()
        for module, own in patched.values():
            del module.forward             # the class's forward again, or the instance's own put back
            if own is not None:
                module.forward = own
    return seen, activations[0], saved


def _meta_experts(module, activations, *args, **kwargs):
    """A fused experts module's forward on meta (its own needs the routing's values): the
    output's shape, and its per-token activations added to ``activations[0]``."""
    out = meta_forward(module, args, kwargs)
    activations[0] += FusedExpertsRule().activation_numbers(module) * int(out.shape[0])
    return out


class _Routed(Exception):
    """Raised by the last experts module's pre-hook: the routing is known, the rest of the
    forward is not needed."""


def _routed_positions(task, data, refs, examples: int) -> dict[str, int]:
    """``{expert block: T_b}``: the padded length of each expert's blocks in the first chunk
    of ``examples`` examples, ``L_e = max(1, max_i c_{i,e})`` (``c_{i,e}``: tokens of example
    ``i`` routed to expert ``e``, padding tokens left out, as capture leaves them out), from one
    real no-grad forward of that chunk stopped at the last fused experts module. Empty when
    the forward fails (the balanced-routing price stays)."""
    experts = {id(r.module): r.module for r in refs if isinstance(r.rule, ExpertMatrixRule)}
    padded: dict[int, torch.Tensor] = {}

    def pre(module, args, kwargs):
        index = args[1] if len(args) > 1 else kwargs.get("top_k_index")
        if id(module) not in padded and isinstance(index, torch.Tensor):
            padded[id(module)] = routed_counts(module, index, chunk, real).max(0).values.clamp_min(1)
        if len(padded) == len(experts):
            raise _Routed
    handles = [m.register_forward_pre_hook(pre, with_kwargs=True) for m in experts.values()]
    batches = None
    try:
        batches = data.prefix(examples).loader(examples)
        batch = next(iter(batches))
        chunk = batch_size_of(batch)
        real = task.token_mask(batch) if task.token_mask is not None else None     # (B, T): padding False
        param = next(iter(task.model.parameters()), None)
        cuda = [param.device] if param is not None and param.device.type == "cuda" else []
        # the random state is restored: a model in training mode (dropout) draws the run's numbers unchanged
        with torch.no_grad(), torch.random.fork_rng(devices=cuda):
            task.loss(task.model, move_batch(batch, param.device) if param is not None else batch)
    except _Routed:
        pass
    except Exception:  # noqa: BLE001 - shapes are a hint: a forward that fails keeps the balanced price
        return {}
    finally:
        for h in handles:
            h.remove()
        if hasattr(batches, "close"):
            batches.close()
    return {ref.name: int(padded[id(ref.module)][ref.rule.expert]) for ref in refs
            if isinstance(ref.rule, ExpertMatrixRule) and id(ref.module) in padded}


class _MetaModel:
    """Calls ``model`` with its tensors replaced by ``state``; other attributes are the model's."""

    def __init__(self, model, state):
        self._model, self._state = model, state

    def __call__(self, *args, **kwargs):
        return functional_call(self._model, self._state, args, kwargs, strict=False)

    def __getattr__(self, name):
        return getattr(self._model, name)


def rows_per_example(src) -> int:
    """Rows a source captures per example: one, or one per Gauss-Newton term
    (``objective="expected"``: the number of model outputs, :func:`output_width`)."""
    return (output_width(src.task.model) or 1) if getattr(src, "objective", "loss") == "expected" else 1


# ------------------------------------------------------------------ model facts
def _layers(model: nn.Module):
    """``(module, rule)`` of every module, its rule from the layer registry."""
    return [(m, rule_class(m).for_module(m)) for m in model.modules()]


def weight_layers(model: nn.Module) -> list[tuple[int, int]]:
    """``(in, out)`` of every GEMM a forward multiplies each position by, in module order
    (:meth:`~gradalg.capture.layers.LayerRule.weight_gemm`: Linear, HF Conv1D, convolutions
    with their kernel folded into ``in``)."""
    return [g for m, rule in _layers(model) if (g := rule.weight_gemm(m)) is not None]


def attention_shape(model: nn.Module) -> tuple[int, int, int]:
    """(layers, width, heads) of a transformer config, (0, 0, 1) otherwise."""
    config = getattr(model, "config", None)    # each field by its Hugging Face name, then its GPT-2 name
    fields = (("num_hidden_layers", "n_layer", 0), ("hidden_size", "n_embd", 0), ("num_attention_heads", "n_head", 1))
    return tuple(int(getattr(config, name, None) or getattr(config, gpt2, None) or default)
                 for name, gpt2, default in fields)


def activation_bytes(model: nn.Module, tokens: int, elem: int = 4) -> float:
    """Bytes autograd keeps per example for a forward/backward: the inputs and outputs of
    every layer with a matrix weight at every position
    (:meth:`~gradalg.capture.layers.LayerRule.activation_numbers`; a lower bound:
    nonlinearities add a few)."""
    return float(sum(rule.activation_numbers(m) for m, rule in _layers(model))) * tokens * elem


def output_width(model: nn.Module) -> int | None:
    """The output width of the model's last layer that can be a head (``lm_head`` of a
    Hugging Face model, the last Linear of a Sequential); None without one."""
    widths = [w for m, rule in _layers(model) if (w := rule.output_width(m)) is not None]
    return widths[-1] if widths else None


#: copies of the model's output (per position, its full width) the loss adds while a batch is
#: captured (a language model's shifted logits, their log-softmax and its gradient). Measured
#: on a GPT-2 of width 768, vocabulary 50,257, T = 64 (``benchmarks/machine_budget.py``): 67 and
#: 92 MB per example (block linears, every layer) against 33 and 58 MB without it: 2.8 (T, V) tensors.
OUTPUT_COPIES = 3


def output_bytes(model: nn.Module, tokens: int, elem: int = 4) -> float:
    """Bytes per example the loss adds over the model's output: :data:`OUTPUT_COPIES` ×
    :func:`output_width` × ``tokens``. Noticeable only for wide outputs: 3 × 50,257 × 64 ×
    4 B = 38.6 MB per GPT-2 sequence of 64 tokens."""
    return float(OUTPUT_COPIES * (output_width(model) or 0) * tokens * elem)


def element_size(dtype: torch.dtype) -> int:
    """Bytes per number of rows in ``dtype`` (the model's)."""
    return torch.empty((), dtype=dtype).element_size()
