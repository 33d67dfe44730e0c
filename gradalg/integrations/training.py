"""Training-time capture: each optimizer step's per-example gradients, before the step.

    tc = ga.integrations.training_capture(model, layers=["fc1", "fc2"], optimizer=opt)

    @tc.on_step
    def look(step):                        # a StepGrads, called before opt.step()
        print(step.index, step.n, step.sq_norms())

    with tc:
        for i, (x, y) in enumerate(loader):
            F.cross_entropy(model(x), y, reduction="sum").backward()
            if i % 2 == 1:                 # gradient accumulation: two backwards per step
                opt.step(); opt.zero_grad()
    tc.grads                               # GradientSet of every example seen (keep=True)

A *micro-batch* is one ``backward()``; a *step* is every micro-batch between two
optimizer steps. A :class:`~gradalg.capture.session.LoopRecorder` records each
micro-batch's factors during backward (one Chunk); a step pre-hook on the optimizer (or
the trainer integrations, or an explicit :meth:`TrainingCapture.end_step`) closes the
step and hands its :class:`StepGrads` to every ``on_step`` callback, while ``p.grad``
holds the step's gradient and nothing has been applied yet. Callbacks may change
``p.grad`` (online data selection, :mod:`gradalg.integrations.selection`, does).

Per-example gradients are those of the loss that was backpropagated (``ga.capture``'s
``reduction="sum"``): with a mean-reduced loss they are each example's *contribution* to
the step's gradient. ``scale_next`` lets an integration multiply the rows of the
micro-batch being recorded (the HF and OLMo-core callbacks use it to express rows in the
loss's own normalization, see their docs).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from ..capture.factors import Factors, self_inner
from ..capture.session import LoopRecorder
from ..errors import CaptureStateError, ExampleIdsError, OptionError
from ..loop_capture import captured_grads
from ..capture.chunks import Chunk
from .distributed import unwrap_model

__all__ = ["StepGrads", "TrainingCapture", "training_capture"]


@dataclass
class StepGrads:
    """The per-example gradients of one optimizer step (every micro-batch of it).

    index : the step's number (0 for the first optimizer step seen).
    chunks : one :class:`~gradalg.capture.chunks.Chunk` per micro-batch, in order; each block
        is :class:`~gradalg.capture.Factors` (n_mb, T, in) / (n_mb, T, out).
    space : the ParamSpace of the captured layers.
    capture : the :class:`TrainingCapture` that closed the step (a callback that runs the
        model, e.g. a trajectory's queries, pauses it with ``step.capture.paused()``).
    """

    index: int
    chunks: tuple
    space: object
    extras: dict = field(default_factory=dict)
    model: object = field(default=None, repr=False)   # the module trained (rows refused beside another's)
    capture: object = field(default=None, repr=False, compare=False)

    @property
    def n(self) -> int:
        """Examples in the step, over all its micro-batches."""
        return sum(c.n for c in self.chunks)

    @property
    def micro_batches(self) -> int:
        """Micro-batches accumulated into this step (gradient accumulation)."""
        return len(self.chunks)

    @property
    def ids(self) -> tuple:
        """The example id of each row, micro-batch after micro-batch: ``(n,)``."""
        return tuple(i for c in self.chunks for i in c.ids)

    @property
    def grads(self):
        """The step's rows as a lazy GradientSet (project, normalize, score it as any other)."""
        return captured_grads(list(self.chunks), self.space, self.model)

    def factors(self, layer: str) -> Factors:
        """One layer's factors over the whole step: A (n, T, in), D (n, T, out)."""
        parts = [c.blocks[layer] for c in self.chunks]
        return parts[0] if len(parts) == 1 else Factors.concat_examples(parts)

    def sq_norms(self, layers=None) -> torch.Tensor:
        """‖g_i‖² over ``layers`` (default: all), by the ghost identity.   Returns (n,)."""
        names = self.space.names if layers is None else tuple(layers)
        return torch.cat([sum(self_inner(c.blocks[name]) for name in names) for c in self.chunks])


class TrainingCapture:
    """Per-example gradients of each training step, handed to callbacks before the step.

    Build it with :func:`training_capture`. Use as a context manager around the loop.

    Attributes
    ----------
    session : the underlying :class:`~gradalg.capture.session.LoopRecorder` (a Chunk per
        micro-batch).
    steps : number of steps closed so far.
    """

    def __init__(self, model: nn.Module, layers=None, *, optimizer=None, keep: bool = False,
                 step_on: str = "auto", upcast: bool = True):
        if step_on == "auto":
            step_on = "optimizer" if optimizer is not None else "backward"
        if not isinstance(step_on, str) or step_on not in ("optimizer", "backward", "manual"):
            raise OptionError(f"step_on must be 'auto', 'optimizer', 'backward' or 'manual', got {step_on!r}")
        if step_on == "optimizer" and optimizer is None:
            raise OptionError("step_on='optimizer' needs the optimizer: training_capture(..., optimizer=opt)")
        if optimizer is not None and not hasattr(optimizer, "register_step_pre_hook"):
            raise OptionError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        self.model = unwrap_model(model)
        self.session = LoopRecorder(self.model, layers, reduction="sum", keep=False)
        self.session.on_chunk(self._micro_batch_done)
        self.refs = self.session.refs
        self.optimizer = optimizer
        self.step_on = step_on
        self.keep = keep
        self.upcast = upcast
        self.steps = 0
        self._micro: list[Chunk] = []
        self._kept: list[Chunk] = []
        self._seen = 0
        self._callbacks: list[Callable] = []
        self._micro_callbacks: list[Callable] = []
        self._discard_callbacks: list[Callable] = []
        self._row_scale = None
        self.row_scale = None
        self._next_ids = None
        self._id_feed: list = []     # ids of the examples to come, taken n at a time by micro-batches
        self._handles = []
        self._active = False

    # ------------------------------------------------------------------ public
    @property
    def space(self):
        """The ParamSpace of the captured layers (one block per layer, its (out, in + bias) shape)."""
        return self.session.space

    def on_step(self, callback: Callable) -> Callable:
        """Call ``callback(step: StepGrads)`` when a step closes, before the optimizer step.

        Usable as a decorator. Callbacks run in registration order.
        """
        self._callbacks.append(callback)
        return callback

    def on_micro_batch(self, callback: Callable) -> Callable:
        """Call ``callback(chunk)`` after each backward (inside it), with that micro-batch's Chunk."""
        self._micro_callbacks.append(callback)
        return callback

    def scale_next(self, scale) -> None:
        """Multiply the rows of the micro-batch being recorded by ``scale`` (a number or (n,))."""
        self._row_scale = scale

    def ids_next(self, ids) -> None:
        """Label the rows of the micro-batch being recorded with ``ids`` (one per row, e.g.
        the dataset indices of its examples); without it rows are numbered in the order seen.
        A count that differs from the micro-batch's rows is refused when it is recorded."""
        self._next_ids = tuple(i if isinstance(i, str) else int(i) for i in ids)

    def feed_ids(self, ids) -> None:
        """Ids of the examples the following micro-batches hold, in order (e.g. a whole
        step's batch, split into micro-batches by the trainer): each micro-batch takes as
        many as it has rows; a step that closes with ids left over is refused."""
        self._id_feed.extend(i if isinstance(i, str) else int(i) for i in ids)

    def number_from(self, n: int) -> None:
        """Number the following unlabelled rows (no ``ids_next``/``feed_ids``) from ``n``:
        a resumed run continues the numbering of the rows recorded before its checkpoint."""
        self._seen = int(n)

    def set_scale(self, scale) -> None:
        """Multiply the rows of every following micro-batch by ``scale`` (a number; None = 1)."""
        self.row_scale = scale

    @property
    def pending(self) -> int:
        """Micro-batches recorded since the last step closed."""
        return len(self._micro)

    def discard_pending(self) -> int:
        """Forget the micro-batches recorded since the last step (e.g. a trainer's warm-up
        "dry-run" batch that never reaches an optimizer step). Returns how many."""
        k = len(self._micro)
        self._seen -= sum(c.n for c in self._micro)
        self._micro = []
        self._id_feed = []
        for cb in self._discard_callbacks:
            cb()
        return k

    def end_step(self) -> StepGrads | None:
        """Close the current step: call the ``on_step`` callbacks. A no-op if nothing is pending."""
        if self._id_feed:
            left, self._id_feed = self._id_feed, []
            raise ExampleIdsError(
                f"step {self.steps} closed with {len(left)} example ids fed but never recorded (first: {left[:5]}): "
                "the step's batch had more examples than its micro-batches had rows (rows joined or dropped)")
        if not self._micro:
            return None
        step = StepGrads(self.steps, tuple(self._micro), self.space, model=self.model, capture=self)
        self._micro = []
        for cb in self._callbacks:
            cb(step)
        if self.keep:
            self._kept.extend(step.chunks)
        self.steps += 1
        return step

    @property
    def grads(self):
        """GradientSet of every example of the closed steps (needs ``keep=True``), in order."""
        if not self.keep:
            raise CaptureStateError("this capture keeps nothing (keep=False); pass keep=True to read .grads, or "
                                    "read each step's rows in an on_step callback")
        return captured_grads(list(self._kept), self.space, self.model)

    # ------------------------------------------------------------------ context
    def __enter__(self):
        if self._active:
            raise CaptureStateError("this TrainingCapture is already active (entered twice): leave the first "
                                    "`with` block before entering it again")
        self.session.__enter__()
        if self.step_on == "optimizer":
            self._handles.append(self.optimizer.register_step_pre_hook(self._pre_step_hook))
        self._active = True
        return self

    def __exit__(self, *exc):
        if exc[0] is None and self.step_on != "manual":
            self.end_step()  # backwards after the last optimizer step
        self.session.__exit__(*exc)
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._active = False
        return False

    def paused(self):
        """Context manager: forwards and backwards inside it are not recorded."""
        return _Paused(self)

    # ------------------------------------------------------------------ internals
    def _pre_step_hook(self, optimizer, args, kwargs):
        self.end_step()
        return None  # a step pre-hook returning a value would replace the step's arguments

    def _micro_batch_done(self, chunk: Chunk) -> None:
        n = chunk.n
        blocks = chunk.blocks
        scale, self._row_scale = self._row_scale, None
        if self.row_scale is not None:
            scale = self.row_scale if scale is None else torch.as_tensor(scale, dtype=torch.float64) * self.row_scale
        meta = {}
        if scale is not None:
            w = torch.as_tensor(scale, dtype=torch.float64).reshape(-1)
            w = w.expand(n) if w.numel() == 1 else w
            if w.numel() != n:
                raise OptionError(f"scale_next got {w.numel()} row scales for a micro-batch of {n} examples")
            blocks = {k: v.scale_rows(w.to(v.D.device)) for k, v in blocks.items()}
            meta["row_scale"] = w  # (n,): what the rows were multiplied by
        if self.upcast:
            blocks = {k: _upcast(v) for k, v in blocks.items()}
        ids, self._next_ids = self._next_ids, None
        if ids is None and self._id_feed:
            if len(self._id_feed) < n:
                raise ExampleIdsError(
                    f"a micro-batch of {n} rows was recorded but only {len(self._id_feed)} fed example ids remain: "
                    "rows are not examples (packing?) or the ids fed do not cover the batch")
            ids, self._id_feed = tuple(self._id_feed[:n]), self._id_feed[n:]
        if ids is None:
            ids = tuple(range(self._seen, self._seen + n))
        else:
            meta["labelled"] = True   # ids name examples (dataset indices), not positions in the run
        if len(ids) != n:
            raise ExampleIdsError(
                f"the micro-batch has {n} rows but {len(ids)} example ids were given for it (first ids: "
                f"{list(ids[:5])}): each row must be one example. Packed sequences (several examples per "
                "row) cannot be attributed to single examples; turn packing off, or label rows yourself")
        meta["step"] = self.steps  # the optimizer step this micro-batch belongs to
        chunk = Chunk(ids, blocks, meta=meta)
        self._seen += n
        self._micro.append(chunk)
        for cb in self._micro_callbacks:
            cb(chunk)
        if self.step_on == "backward":
            self.end_step()


def _upcast(F: Factors) -> Factors:
    """bf16/fp16 factors (mixed precision) as float32: scores and sums accumulate in float32."""
    low = (torch.float16, torch.bfloat16)
    A = F.A.float() if isinstance(F.A, torch.Tensor) and F.A.dtype in low else F.A
    D = F.D.float() if F.D.dtype in low else F.D
    return F if (A is F.A and D is F.D) else Factors(A, D)


class _Paused:
    def __init__(self, tc: TrainingCapture):
        self.tc = tc

    def __enter__(self):
        self.was_active = self.tc.session.active
        if self.was_active:
            self.tc.session.__exit__(None, None, None)
        return self.tc

    def __exit__(self, *exc):
        if self.was_active:
            # re-entering resets only the half-recorded step state, which is empty between steps
            self.tc.session.__enter__()
        return False


def training_capture(model: nn.Module, layers=None, *, optimizer=None, keep: bool = False,
                     step_on: str = "auto", upcast: bool = True) -> TrainingCapture:
    """Per-example gradients of each training step, handed to ``on_step`` callbacks.

    Parameters
    ----------
    model : the module being trained (a DDP wrapper is unwrapped; FSDP2 modules work as is).
    layers : module names or glob patterns (default: every supported layer).
    optimizer : with an optimizer, a step closes at ``optimizer.step()`` (a step pre-hook),
        so gradient accumulation gives one step of several micro-batches.
    keep : keep every step's factors for :attr:`TrainingCapture.grads`.
    step_on : "auto" ("optimizer" with an optimizer, else "backward": every backward is a
        step), or "manual" (call :meth:`TrainingCapture.end_step` yourself, e.g. before
        gradient clipping).
    upcast : keep bf16/fp16 factors (mixed precision) as float32 (default True).
    """
    return TrainingCapture(model, layers, optimizer=optimizer, keep=keep, step_on=step_on, upcast=upcast)
