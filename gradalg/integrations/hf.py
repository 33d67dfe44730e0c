"""``transformers.Trainer`` (and TRL's ``SFTTrainer``, any Trainer subclass) integration.

    from gradalg.integrations.hf import GradientCallback

    cb = GradientCallback(layers=["transformer.h.*.mlp.c_fc", "lm_head"])
    trainer = Trainer(model, args, train_dataset=ds, callbacks=[cb])
    trainer.train()
    cb.grads                       # GradientSet of every training example seen, in order

    @cb.on_step                    # or: each step's StepGrads, before the optimizer step
    def look(step): ...

    # online data selection inside Trainer
    sel = ga.integrations.OnlineSelection(ga.integrations.BatchMean(), ga.integrations.DropFraction(0.2))
    trainer = Trainer(model, args, ..., callbacks=[GradientCallback(selection=sel)])

What the rows are
-----------------
Trainer backpropagates, per micro-batch, ``Σ_tokens ce / N`` where ``N``
(``num_items_in_batch``) counts the loss tokens of the whole optimizer step — all
gradient-accumulation micro-batches, and all ranks when ``average_tokens_across_devices``
(then the loss is also multiplied by the number of processes, which DDP's averaging
undoes). ``scale`` picks the normalization of the captured rows:

``"loss"`` (default)  each example's contribution to the step's (averaged) gradient:
    exactly what ``ga.capture`` gives around a plain loop that backpropagates the same
    loss, single process; under DDP it is divided by the world size, so that the rows of
    all ranks sum to the step's gradient and equal a single-process run on the global batch.
``"sum"``   the gradient of the example's summed token loss ``∇ Σ_t ce_it`` (undoes ``1/N``).
``"mean"``  the gradient of the example's mean token loss ``∇ (1/n_i) Σ_t ce_it``.

``"sum"`` and ``"mean"`` need the model to receive ``num_items_in_batch`` (models that
accept loss kwargs, with ``labels``; the Trainer's default loss) and are refused otherwise.

TRL trainers call the model with a fused LM head (``fused_lm_head=True``) that never runs
the head module: the head cannot be recorded and is refused with that explanation.

Gradient accumulation: one step = every micro-batch until the optimizer step.
Mixed precision (``bf16=True``): factors are kept in the wider dtype of input and gradient.
Gradient checkpointing: non-reentrant (transformers' default) is handled; reentrant is
refused with the fix. With ``selection`` and ``max_grad_norm > 0`` the callback takes
over gradient clipping so that it runs after the correction (Trainer clips before
``on_pre_optimizer_step``).
"""
from __future__ import annotations

from typing import Callable

import torch
from transformers import TrainerCallback

from ..errors import LossReductionError, UnsupportedLayerError
from .distributed import unwrap_model
from .selection import OnlineSelection
from .training import TrainingCapture

__all__ = ["GradientCallback"]


def _shifts_labels(model) -> bool:
    """Whether the model's own loss predicts token t+1 from t (so labels[:, 0] is never a target)."""
    try:
        from transformers.loss.loss_utils import ForCausalLMLoss
        fn = getattr(model, "loss_function", None)  # falls back to ForCausalLM for LM heads
    except Exception:  # pragma: no cover - very old transformers
        return "CausalLM" in type(model).__name__ or "LMHead" in type(model).__name__
    config = getattr(model, "config", None)
    return fn is ForCausalLMLoss and not getattr(config, "is_encoder_decoder", False)


class GradientCallback(TrainerCallback):
    """Per-example gradients of every Trainer step, before the optimizer step.

    Parameters
    ----------
    layers : module names or glob patterns (default: every supported layer).
    keep : keep every step's factors for :attr:`grads` (memory grows with the run).
    scale : "loss" (default), "sum" or "mean": see the module docs.
    selection : an :class:`~gradalg.integrations.OnlineSelection` to run at every step
        (its own ``layers`` are used).
    record : model inputs to keep alongside the rows (e.g. ``("input_ids",)``): Trainer
        shuffles, so this tells which example each row is. ``cb.inputs[key]`` is a list
        with one tensor per row, in row order.
    """

    def __init__(self, layers=None, *, keep: bool = True, scale: str = "loss",
                 selection: OnlineSelection | None = None, record: tuple[str, ...] = ()):
        if scale not in ("loss", "sum", "mean"):
            raise ValueError(f"scale must be 'loss', 'sum' or 'mean', got {scale!r}")
        self.layers = layers
        self.keep = keep
        self.scale = scale
        self.selection = selection
        self.record = tuple([record] if isinstance(record, str) else record)
        self.inputs: dict[str, list] = {key: [] for key in self.record}
        self.capture: TrainingCapture | None = None
        self._on_step: list[Callable] = []
        self._handles = []
        self._clip = None
        self._args = None
        self._world = 1
        self._shift = True

    # ------------------------------------------------------------------ public
    def on_step(self, callback: Callable) -> Callable:
        """Call ``callback(step: StepGrads)`` at each optimizer step, before it. Decorator."""
        self._on_step.append(callback)
        if self.capture is not None:
            self.capture.on_step(callback)
        return callback

    @property
    def grads(self):
        """GradientSet of every example of the run (keep=True), in the order Trainer fed them."""
        if self.capture is None:
            raise RuntimeError("no training has run with this callback yet")
        return self.capture.grads

    # ------------------------------------------------------------------ Trainer events
    def on_train_begin(self, args, state, control, model=None, **kwargs):
        model = unwrap_model(model)
        self._world = max(1, int(getattr(args, "world_size", 1)))
        if self.selection is not None:
            if self.scale != "loss":
                raise ValueError("online selection corrects the step's gradient from each example's contribution "
                                 "to it: use GradientCallback(scale='loss') with selection=")
            self.selection.attach(model, step_on="manual", keep=self.keep)
            if self._world > 1:
                # rows are already contributions to the rank-averaged gradient (divided by the world
                # size), so the ranks' corrections add up
                self.selection.world_reduction = "sum"
            self.capture = self.selection.capture
        else:
            self.capture = TrainingCapture(model, self.layers, step_on="manual", keep=self.keep)
        for cb in self._on_step:
            self.capture.on_step(cb)
        self._args = args
        self._shift = _shifts_labels(model)
        self._handles.append(model.register_forward_pre_hook(self._pre_forward, with_kwargs=True))
        if self.selection is not None and args.max_grad_norm and args.max_grad_norm > 0:
            self._clip, args.max_grad_norm = args.max_grad_norm, 0.0
        (self.selection or self.capture).__enter__()

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.capture.end_step()
        if self._clip:
            torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], self._clip)

    def on_train_end(self, args, state, control, **kwargs):
        self._close(args)

    def _close(self, args):
        if self.capture is None or not self.capture._active:
            return
        (self.selection or self.capture).__exit__(None, None, None)
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if self._clip:
            args.max_grad_norm, self._clip = self._clip, None

    def _check_fused_head(self, model):
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        hit = [r.name for r in self.capture.refs if head is not None and any(u.module is head for u in r.uses)]
        if hit:
            self._close(self._args)
            raise UnsupportedLayerError(
                f"TRL's fused LM head projects through {hit[0]!r}'s weight inside its own autograd "
                "function, so the module's hooks never run and its per-example gradients cannot be "
                f"recorded; leave {hit[0]!r} out of `layers` (the backbone's layers are recorded as usual)"
            )

    # ------------------------------------------------------------------ scaling
    def _pre_forward(self, module, args, kwargs):
        if not torch.is_grad_enabled() or not module.training or self.capture is None:
            return
        if kwargs.get("fused_lm_head"):
            self._check_fused_head(module)
        for key in self.record:
            value = kwargs.get(key)
            if value is None:
                raise KeyError(f"GradientCallback(record=...) asked for {key!r}, but the model was called "
                               f"with {sorted(kwargs)}")
            self.inputs[key].extend(value.detach().cpu().unbind(0))
        if self.scale == "loss":
            if self._world > 1:
                self.capture.scale_next(1.0 / self._world)
            return
        N = kwargs.get("num_items_in_batch")
        labels = kwargs.get("shift_labels", kwargs.get("labels"))
        if N is None or labels is None:
            self._close(self._args)
            raise LossReductionError(
                f"GradientCallback(scale={self.scale!r}) needs the Trainer's token count: the model must "
                "receive `labels` and `num_items_in_batch` (a model that accepts loss kwargs, with "
                "Trainer's default loss). Use scale='loss' for the loss's own normalization"
            )
        N = float(N.reshape(-1)[0]) if torch.is_tensor(N) else float(N)
        averaged = bool(getattr(self._args, "average_tokens_across_devices", False)) and self._world > 1
        factor = N / (self._world if averaged else 1)
        if self.scale == "sum":
            self.capture.scale_next(factor)
            return
        if "shift_labels" not in kwargs and self._shift:
            labels = labels[..., 1:]
        counts = (labels != -100).reshape(labels.shape[0], -1).sum(1).double()
        self.capture.scale_next(factor / counts.clamp_min(1))
