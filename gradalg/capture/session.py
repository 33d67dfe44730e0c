"""Recording per-example factors inside a user's training loop, one :class:`Chunk` per backward.

    recorder = LoopRecorder(model, layers=["fc1", "fc2"], reduction="sum")
    recorder.on_chunk(lambda chunk: ...)     # each backward's rows, as soon as they are complete
    with recorder:
        for x, y in loader:
            F.cross_entropy(model(x), y, reduction="sum").backward()
    recorder.store                           # CaptureStore: every chunk seen, in order

A forward hook keeps each recorded layer's input ``A`` and hooks its output tensor;
the output's gradient ``D`` arrives during the user's own ``backward()``. When every
recorded call of a step has its gradient, the step's factors are complete: they are
stored (``keep=True``) and handed to each callback registered with :meth:`on_chunk`.
Several calls of the model before one backward (``(loss(model(x1)) + loss(model(x2))).backward()``)
are several groups of examples: the step's rows are the first forward's examples, then
the second's (a forward pre-hook on the model counts them).

This module records rows only. ``ga.capture`` (:mod:`gradalg.loop_capture`, above the
api) wraps a recorder and hands its rows to users as GradientSets; the training-time
integrations (:mod:`gradalg.integrations.training`) group its chunks into optimizer steps.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from ..errors import CaptureStateError, LossReductionError
from ..own_hooks import OwnHooks
from .factors import Factors
from .hooks import LayerRef, check_batch_rows, resolve_layers
from .provenance import CallStack
from .weight_uses import OutsideUses, mark_checked, needs_check
from .layers import check_session_layers
from .rows import layout_for, session_rows
from .tying import LayerUse, use_factors
from .chunks import Chunk
from ..errors import NonFiniteGradientError
from ..finite import check_model, check_rows
from ..options import get_options
from ..space import ParamSpace
from ..errors import OptionError

__all__ = ["CaptureStore", "LoopRecorder"]


@dataclass
class CaptureStore:
    """Factored per-example gradients of the batches seen, in memory, in order.

    ``model``: the module whose backward produced the rows (None when unknown), so that
    rows captured from one model are refused beside another's
    (:func:`gradalg.expr.models.check_same_models`).
    """

    chunks_: list = field(default_factory=list)
    model: Any = field(default=None, repr=False, compare=False)

    @property
    def n(self) -> int:
        return sum(c.n for c in self.chunks_)

    @property
    def ids(self) -> tuple:
        return tuple(i for c in self.chunks_ for i in c.ids)

    def chunks(self):
        return iter(self.chunks_)

    @property
    def token(self) -> str:
        return f"capturestore-{id(self):x}-{len(self.chunks_)}"


class LoopRecorder:
    """Records the per-example factors of every backward run inside ``with recorder:``.

    model : the module being trained.
    layers : module names or glob patterns, as for ``ga.grads`` (default: every layer of a factored
        kind it records; the blocks of fused experts are recorded by ``ga.grads`` only).
    reduction : ``"sum"`` (rows are the loss's per-example gradients) or ``"mean"`` (each
        step's rows are multiplied by its batch size, undoing the loss's ``1/B``).
    keep : append every chunk to :attr:`store` (False when only callbacks need them).

    Attributes: ``refs`` (the recorded blocks), ``space`` (their ParamSpace), ``store``
    (a :class:`CaptureStore`), ``steps`` (backwards completed).
    """

    def __init__(self, model: nn.Module, layers=None, *, reduction: str = "sum", keep: bool = True):
        if reduction not in ("sum", "mean"):
            raise OptionError(f"reduction must be 'sum' or 'mean', got {reduction!r}")
        self.model = model
        self.refs: list[LayerRef] = resolve_layers(model, layers)
        if layers is None:    # the default: the layers ga.capture records (not fused experts' blocks)
            self.refs = [r for r in self.refs if r.rule.in_session]
        check_session_layers(self.refs)
        self.reduction = reduction
        self.keep = keep
        self.store = CaptureStore(model=model)
        self._callbacks: list[Callable] = []
        self._handles = OwnHooks()
        self._pending: dict[str, list] = {}
        self._expected = 0
        self._received = 0
        self._trace = None
        self.steps = 0

    # ------------------------------------------------------------------ public
    def on_chunk(self, callback: Callable) -> Callable:
        """Call ``callback(chunk)`` after each backward, with that step's :class:`Chunk`.

        Runs inside ``backward()``, before the optimizer step. Usable as a decorator.
        """
        self._callbacks.append(callback)
        return callback

    @property
    def space(self) -> ParamSpace:
        """The ParamSpace of the recorded blocks (the same as ``ga.grads`` gives)."""
        return ParamSpace(tuple(r.block() for r in self.refs))

    @property
    def active(self) -> bool:
        """Whether the hooks are installed (inside ``with recorder:``)."""
        return bool(self._handles)

    # ------------------------------------------------------------------ context
    def __enter__(self):
        if get_options().check_finite:   # a NaN weight is named now, not blamed on the examples later
            check_model(self.model)
        self._reset_step()
        # each call of the model starts a forward: the rows of two forwards before one backward
        # are two groups of examples, not one
        self._handles.add(self.model.register_forward_pre_hook(self._forward_started))
        self._handles.add(self.model.register_forward_hook(self._forward_done, always_call=True))
        for ref in self.refs:
            for use in ref.uses:
                self._handles.add(use.module.register_forward_hook(self._forward_hook(ref, use)))
        return self

    def __exit__(self, *exc):
        self._handles.remove()
        return False

    # ------------------------------------------------------------------ internals
    def _reset_step(self):
        self._pending = {ref.name: [] for ref in self.refs}
        self._expected = 0
        self._received = 0
        self._forward = 0

    def _forward_started(self, module, args):
        if torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1:
            if self._received and self._received == self._expected:
                self._reset_step()
            self._forward += 1
            if self._trace is None and needs_check(self.model, self.refs):
                # the first forward: recorded weights used outside their modules (a hand-written
                # tied head) are refused before the backward (capture.weight_uses)
                stack = CallStack().__enter__()
                stack._push(module, args)
                uses = OutsideUses(self.refs, stack)
                uses.__enter__()
                self._trace = (stack, uses)

    def _forward_done(self, module, args, output):
        if self._trace is None:
            return
        stack, uses = self._trace
        self._trace = None
        uses.__exit__(None, None, None)
        stack.__exit__(None, None, None)
        if output is not None:      # None: the forward raised (always_call), its error stands
            uses.check(func_backend=False)
            mark_checked(self.model, self.refs)

    def _forward_hook(self, ref: LayerRef, use: LayerUse):
        def hook(module, args, output):
            if not torch.is_grad_enabled() or not isinstance(output, torch.Tensor) or not output.requires_grad:
                return
            if torch._C._current_graph_task_id() != -1:
                # a forward inside backward(): activation checkpointing recomputes a segment
                if any(s["D"] is None for s in self._pending[ref.name]):
                    return  # non-reentrant: this call's factors were recorded by the first forward
                raise CaptureStateError(
                    f"layer {ref.name!r} ran its forward inside backward() without a recorded first "
                    "forward: reentrant activation checkpointing (use_reentrant=True) hides the first "
                    "forward from hooks. Use use_reentrant=False (e.g. model.gradient_checkpointing_enable("
                    "gradient_checkpointing_kwargs={'use_reentrant': False})) or leave this layer out"
                )
            if self._received and self._received < self._expected:
                raise CaptureStateError(
                    "a forward pass started before the previous backward finished: ga.capture records one "
                    "forward/backward at a time. Run evaluation forwards under torch.no_grad() (in training-time "
                    "capture, inside `with capture.paused():`), or call backward on each forward's loss first")
            if self._received and self._received == self._expected:
                self._reset_step()
            slot = {"A": use.rule.activations(module, args[0].detach()), "D": None, "forward": self._forward}
            self._pending[ref.name].append(slot)
            self._expected += 1
            output.register_hook(self._grad_hook(use, slot))
        return hook

    def _grad_hook(self, use: LayerUse, slot: dict):
        def hook(grad):
            slot["F"] = use_factors(use, slot["A"], grad)   # the same per-call path as ga.grads
            slot["D"] = slot["F"].D
            self._received += 1
            if self._received == self._expected:
                self._finish_step()
        return hook

    def _finish_step(self):
        forwards = sorted({s["forward"] for slots in self._pending.values() for s in slots})
        if len(forwards) > 1 and self.reduction == "mean":
            raise LossReductionError(
                f"ga.capture(reduction='mean') saw {len(forwards)} forwards of the model before one "
                "backward: whether the loss is a mean over each forward's batch or over all of them "
                "is not known, so neither scaling is safe. Sum the losses (reduction='sum' on each) "
                "and pass ga.capture(..., reduction='sum'), or run one forward per backward")
        # two forwards before one backward: each forward's rows are examples of their own,
        # stacked in the order of the forwards
        parts = [self._forward_blocks({name: [s for s in slots if s["forward"] == f]
                                       for name, slots in self._pending.items()}, k, len(forwards))
                 for k, f in enumerate(forwards)]
        blocks = parts[0] if len(parts) == 1 else {name: Factors.concat_examples([p[name] for p in parts])
                                                   for name in parts[0]}
        n = next(iter(blocks.values())).n
        if self.reduction == "mean":
            blocks = {k: v.scale_rows(torch.full((n,), float(n))) for k, v in blocks.items()}
        start = self.store.n
        chunk = Chunk(tuple(range(start, start + n)), blocks)
        if get_options().check_finite:
            self._check_finite(chunk)
        if self.keep:
            self.store.chunks_.append(chunk)
        self.steps += 1
        for cb in self._callbacks:
            cb(chunk)

    def _check_finite(self, chunk: Chunk) -> None:
        """NaN/inf rows: the weights are named if they are at fault (a step that diverged),
        else the examples (numbered in the order this recorder saw them)."""
        try:
            check_rows(chunk.blocks, chunk.ids, f"NaN/inf per-example gradients in backward {self.steps} "
                                                "of ga.capture (examples numbered in the order seen)")
        except NonFiniteGradientError:
            check_model(self.model)
            raise


    def _forward_blocks(self, pending: dict, k: int, n_forwards: int) -> dict:
        """The factors of one forward's calls ``pending`` (``{layer: [slot]}``)."""
        blocks = {}
        n_examples, lengths = session_rows(pending)
        for ref in self.refs:
            slots = pending[ref.name]
            if not slots:
                continue
            parts = [layout_for(ref.name, s["A"].shape[0], n_examples, lengths).group(s["F"]) for s in slots]
            blocks[ref.name] = Factors.concat_tokens(parts)
        if len(blocks) != len(self.refs):
            missing = [r.name for r in self.refs if r.name not in blocks]
            which = "this step's forward pass" if n_forwards == 1 else f"forward {k + 1} of this step's {n_forwards}"
            raise CaptureStateError(f"layers {missing} were not used in {which}, or their output "
                               "needed no gradient (a frozen layer, e.g. PEFT's base weights, with no trainable "
                               "parameter before it); leave them out of `layers`, or use ga.grads, which "
                               "records frozen layers")
        check_batch_rows(blocks)
        return blocks
