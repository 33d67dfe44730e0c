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

Which example each row is (``ids``)
-----------------------------------
Rows are labelled with the **dataset index** of their example (``cb.grads.ids``, the
``train`` coordinate of scores):

``ids="auto"`` (default)  ``"sampler"`` where the train dataloader has a batch sampler
    over a map-style dataset (not GRPO's, see :mod:`gradalg.integrations.grpo`); otherwise
    (a streaming ``IterableDataset``) rows are numbered in the order seen, with a warning
    at ``on_train_begin`` that says how to label them.
``ids="sampler"``  the indices the train dataloader's batch sampler yields on this
    rank (Trainer's own shuffling sampler, accelerate's per-rank shard), matched to the
    training forwards in order; every forward checks that its rows are as many as the
    sampled indices and, when the dataset's items carry ``input_ids``, that each row's
    tokens are its example's (``verify_ids``). A resumed run skips the batches Trainer
    skips. Works whatever the collator and ``remove_unused_columns`` do; a collator that
    drops examples is followed by their tokens. Refused at ``on_train_begin`` for a
    streaming dataset (it has no indices to sample).
``ids="<column>"``  an index column the batch carries to the model (set
    ``remove_unused_columns=False`` so that Trainer keeps it, else it is refused at
    ``on_train_begin``); the callback takes it out of the model's inputs.
``ids=None``  rows numbered in the order seen.

An example seen in several steps (epochs) gives one row per step with the same id;
``ga.integrations.combine_repeats(G, "sum")`` sums them.

Streaming: ``stream=ga.integrations.StoreStream(path, projector)`` projects each step's rows
and appends them to disk (flushed at every checkpoint save, closed at the end of training;
a run resumed from a checkpoint continues the stream). ``keep`` then defaults to False.

Gradient accumulation: one step = every micro-batch until the optimizer step (one row
per example). Evaluation forwards (``no_grad``, eval mode) are not recorded.
What can be known before training (an index column Trainer removes, ``scale="sum"``/
``"mean"`` without the token count or labels, a ``record`` key the model cannot take) is
refused at ``on_train_begin``, before the first forward.
Mixed precision (``bf16=True``): factors are kept in the wider dtype of input and gradient.
Gradient checkpointing: non-reentrant (transformers' default) is handled; reentrant is
refused with the fix. With ``selection`` and ``max_grad_norm > 0`` the callback takes
over gradient clipping so that it runs after the correction (Trainer clips before
``on_pre_optimizer_step``).
"""
from __future__ import annotations

import inspect
import warnings
from typing import Callable

import torch
from transformers import TrainerCallback

from ..errors import (CaptureStateError, DataError, ExampleIdsError, LossReductionError, OptionError,
                      UnsupportedLayerError)
from ..own_hooks import OwnHooks
from . import distributed as _dist
from .distributed import unwrap_model
from .sampled_ids import SampledIds, is_iterable
from .selection import OnlineSelection
from .training import TrainingCapture

__all__ = ["GradientCallback"]


def _rows_of(kwargs) -> int | None:
    """The batch size of a model call (its ``input_ids``, else its first batched tensor)."""
    for key in ("input_ids", "inputs_embeds", "pixel_values"):
        value = kwargs.get(key)
        if torch.is_tensor(value):
            return int(value.shape[0])
    for value in kwargs.values():
        if torch.is_tensor(value) and value.dim() > 0:
            return int(value.shape[0])
    return None


def _forward_params(model) -> tuple[bool, set]:
    """(whether ``model.forward`` takes ``**kwargs``, the names of its parameters)."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):  # pragma: no cover - a forward without a signature
        return True, set()
    return (any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params.values()),
            {name for name, p in params.items() if p.kind != inspect.Parameter.VAR_KEYWORD})


def _column_dropped(loader, column: str) -> bool:
    """Whether Trainer's train ``loader`` removes ``column`` before the model sees it: a
    ``datasets.Dataset`` whose columns no longer include it, or the ``RemoveColumnsCollator``
    Trainer wraps around the collator of any other dataset (streaming ones included)."""
    if loader is None:
        return False
    collate = getattr(loader, "collate_fn", None)
    if type(collate).__name__ == "RemoveColumnsCollator":
        return column not in getattr(collate, "signature_columns", [column])
    names = getattr(getattr(loader, "dataset", None), "column_names", None)
    return isinstance(names, list) and column not in names


def _take_column(module, kwargs: dict, name: str):
    """Remove the index column ``name`` from this forward's ``kwargs`` (the model does not take
    it) and return it. Several callbacks reading the same column (one per scale, say) share
    it: the first to take it leaves it on the module for the others in the same call."""
    if name in kwargs:
        value = kwargs.pop(name)
        # keyed by the kwargs dict itself (held, so never confused with a later call's)
        module._gradalg_columns = (kwargs, {**_columns_of(module, kwargs), name: value})
        return value
    return _columns_of(module, kwargs).get(name)


def _columns_of(module, kwargs: dict) -> dict:
    taken = module.__dict__.get("_gradalg_columns")
    return taken[1] if taken is not None and taken[0] is kwargs else {}


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
    record : model inputs to keep alongside the rows (e.g. ``("input_ids",)``).
        ``cb.inputs[key]`` is a list with one tensor per row, in row order.
    ids : "auto" (default), "sampler", an index column's name, or None: see the module docs.
    verify_ids : with ``ids="sampler"``, check each row's tokens against its example's
        ``input_ids`` (when the dataset's items have them).
    stream : a :class:`~gradalg.integrations.StoreStream`: project each step and append it
        to disk (``keep`` then defaults to False).
    """

    def __init__(self, layers=None, *, keep: bool | None = None, scale: str = "loss",
                 selection: OnlineSelection | None = None, record: tuple[str, ...] = (),
                 ids: str | None = "auto", verify_ids: bool = True, stream=None):
        if not isinstance(scale, str) or scale not in ("loss", "sum", "mean"):
            raise OptionError(f"GradientCallback(scale=...) must be 'loss', 'sum' or 'mean', got {scale!r}")
        if ids is not None and (not isinstance(ids, str) or not ids):
            raise OptionError(f"GradientCallback(ids=...) must be 'auto', 'sampler', an index column's name or None, "
                              f"got {ids!r}")
        if selection is not None and not isinstance(selection, OnlineSelection):
            raise OptionError(f"GradientCallback(selection=...) must be a ga.integrations.OnlineSelection, got "
                              f"{type(selection).__name__}")
        if selection is not None and scale != "loss":
            raise OptionError("online selection corrects the step's gradient from each example's contribution "
                              "to it: use GradientCallback(scale='loss') with selection=")
        if stream is not None and not hasattr(stream, "attach"):
            raise OptionError(f"GradientCallback(stream=...) must be a ga.integrations.StoreStream, got "
                              f"{type(stream).__name__}")
        record = (record,) if isinstance(record, str) else record
        if not isinstance(record, (tuple, list)) or not all(isinstance(k, str) for k in record):
            raise OptionError(f"GradientCallback(record=...) must be model input names, e.g. ('input_ids',), "
                              f"got {record!r}")
        self.layers = layers
        self.keep = (stream is None) if keep is None else keep
        self.ids = ids
        self.verify_ids = verify_ids
        self.stream = stream
        self.sampled: SampledIds | None = None
        self._grpo_column = None
        self._mode = ids          # "sampler", a column, "grpo" or None, once training has begun
        self.scale = scale
        self.selection = selection
        self.record = tuple(record)
        self.inputs: dict[str, list] = {key: [] for key in self.record}
        self.capture: TrainingCapture | None = None
        self._on_step: list[Callable] = []
        self._handles = OwnHooks()
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
            raise CaptureStateError("no training has run with this callback yet: its rows exist once "
                                    "trainer.train() has begun")
        return self.capture.grads

    # ------------------------------------------------------------------ Trainer events
    def on_train_begin(self, args, state, control, model=None, train_dataloader=None, **kwargs):
        model = unwrap_model(model)
        self._refuse_up_front(args, model, train_dataloader)
        # a callback used for a second run (or a resumed one) describes that run: rows, inputs, ids
        self.inputs = {key: [] for key in self.record}
        if self.sampled is not None:
            self.sampled.remove()
            self.sampled = None
        self._world = max(1, int(getattr(args, "world_size", 1)))
        if self.selection is not None:
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
        if self.ids == "grpo":       # gradalg.integrations.grpo.grpo_ids(trainer) labels the rows
            if self._grpo_column is None:
                self.sampled = SampledIds.install(train_dataloader, verify=False, repeats=True)
        elif self.ids in ("sampler", "auto"):
            try:
                self.sampled = SampledIds.install(train_dataloader, verify=self.verify_ids)
                self._mode = "sampler"
            except ExampleIdsError as err:
                if self.ids == "sampler":
                    raise
                warnings.warn(f"GradientCallback: rows are numbered in the order seen, not by dataset index: {err}",
                              stacklevel=2)
                self._mode = None
        if self.sampled is not None:
            self.sampled.resume_skip(state.global_step, args.gradient_accumulation_steps,
                                     ignore_data_skip=bool(getattr(args, "ignore_data_skip", False)))
        if self.stream is not None:
            rank_dir = f"rank-{_dist.rank():03d}"
            if self._world > 1 and self.stream.path.name != rank_dir:
                self.stream.path = self.stream.path / rank_dir
            self.stream.attach(self.capture, start_step=state.global_step,
                               info={"integration": "transformers.Trainer", "scale": self.scale,
                                     "world_size": self._world})
        self._handles.add(model.register_forward_pre_hook(self._pre_forward, with_kwargs=True))
        if self.selection is not None and args.max_grad_norm and args.max_grad_norm > 0:
            self._clip, args.max_grad_norm = args.max_grad_norm, 0.0
        (self.selection or self.capture).__enter__()

    def _refuse_up_front(self, args, model, loader) -> None:
        """Refuse, before the first step, the combinations that would fail at a training forward.

        An index column Trainer drops (``remove_unused_columns``), ``scale="sum"``/``"mean"``
        without the token count, and a ``record`` key the model cannot take are known from the
        arguments, the model's signature and the dataloader; data-dependent mismatches (a
        collator that joins rows, tokens out of step) are caught at the first forward that
        shows them.
        """
        if self.ids == "sampler" and is_iterable(loader):
            SampledIds.install(loader, verify=False)   # raises: a stream has no indices to sample
        column = self.ids not in (None, "sampler", "auto", "grpo")
        if column and getattr(args, "remove_unused_columns", False) and _column_dropped(loader, self.ids):
            raise ExampleIdsError(
                f"GradientCallback(ids={self.ids!r}) reads the index column {self.ids!r} from each batch, but Trainer "
                f"drops it before the model is called (remove_unused_columns=True and the model's forward does not "
                f"take {self.ids!r}). Set TrainingArguments(remove_unused_columns=False) and keep the column in your "
                "collator, or use ids='auto' (the indices the sampler yields; a streaming dataset numbers rows in "
                "the order seen)")
        collate = getattr(loader, "collate_fn", None)
        collate = getattr(collate, "data_collator", collate)        # inside Trainer's RemoveColumnsCollator
        if column and type(collate).__module__.split(".")[0] == "trl":
            raise ExampleIdsError(
                f"GradientCallback(ids={self.ids!r}) reads an index column from each batch, but TRL's "
                f"{type(collate).__name__} passes on only its own keys (input_ids, labels, masks), so the column "
                "never reaches the model. Use ids='auto' (the indices the sampler yields, for a map-style dataset; "
                "rows numbered in the order seen for a streaming one)")
        takes_kwargs, params = _forward_params(model)
        if self.scale != "loss":
            accepts = getattr(model, "accepts_loss_kwargs", takes_kwargs)
            smoothing = float(getattr(args, "label_smoothing_factor", 0.0) or 0.0)
            if not accepts or smoothing > 0:
                why = ("Trainer smooths the labels itself (label_smoothing_factor > 0), so the model receives no "
                       "`labels`" if accepts else
                       f"{type(model).__name__}.forward takes no loss kwargs, so Trainer passes it no "
                       "`num_items_in_batch`")
                raise LossReductionError(
                    f"GradientCallback(scale={self.scale!r}) needs the Trainer's token count and the labels at each "
                    f"forward: {why}. Use scale='loss' (each example's contribution to the step's gradient)")
        if getattr(args, "fp16", False):
            raise OptionError(
                "GradientCallback with TrainingArguments(fp16=True): float16 training scales the loss by a "
                "GradScaler factor that changes between steps (and skips steps whose gradients overflow to inf), "
                "so the captured rows would carry that factor, or be inf. Train with bf16=True (no loss "
                "scaling) or in float32")
        missing = [key for key in self.record if not takes_kwargs and key not in params]
        if missing:
            raise DataError(
                f"GradientCallback(record={self.record!r}): {type(model).__name__}.forward takes no {missing[0]!r} "
                f"(it takes {sorted(params)}), so no batch can carry it to the model; record model inputs only")

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.capture.end_step()
        if self._clip:
            torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], self._clip)

    def on_epoch_begin(self, args, state, control, **kwargs):
        if self.sampled is not None:
            self.sampled.new_epoch()

    def on_save(self, args, state, control, **kwargs):
        if self.stream is not None:
            self.stream.flush(wait=True)  # a run resumed from this checkpoint continues the stream here

    def on_train_end(self, args, state, control, **kwargs):
        self._close(args)
        if self.stream is not None:
            self.stream.close()

    def _close(self, args):
        if self.capture is None or not self.capture._active:
            return
        (self.selection or self.capture).__exit__(None, None, None)
        self._handles.remove()
        self.capture.model.__dict__.pop("_gradalg_columns", None)   # the last batch's index column
        if self.sampled is not None:
            self.sampled.remove()
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
        recording = (torch.is_grad_enabled() and module.training and self.capture is not None
                     and self.capture.session.active)   # not paused (online selection's validation)
        if not recording:
            if self.ids not in (None, "sampler", "auto", "grpo") and self.ids in kwargs:
                kwargs.pop(self.ids)  # an evaluation forward: the model does not take the index column
                return args, kwargs
            return
        if kwargs.get("fused_lm_head"):
            self._check_fused_head(module)
        changed = self._label_rows(kwargs, module)
        self._scale_rows(kwargs)
        return (args, kwargs) if changed else None

    def _label_rows(self, kwargs, module) -> bool:
        """Give the capture this forward's dataset indices; True when ``kwargs`` was changed."""
        if self._mode is None or self._mode == "grpo":
            return False
        rows = _rows_of(kwargs)
        if self._mode == "sampler":
            try:
                ids = self.sampled.next_batch(rows, kwargs)
            except ExampleIdsError:
                self._close(self._args)
                raise
            self.capture.ids_next(ids)
            return False
        column = _take_column(module, kwargs, self.ids)
        if column is None:
            self._close(self._args)
            why = ("Trainer drops columns the model does not take. Set TrainingArguments(remove_unused_columns="
                   "False) and keep the column in your collator"
                   if getattr(self._args, "remove_unused_columns", True) else
                   "the collator did not pass it on (transformers' default collator keeps numbers only and drops "
                   "string values; a custom collator may keep only its own keys). Use integer ids, or a collator "
                   "that keeps the column")
            raise ExampleIdsError(
                f"GradientCallback(ids={self.ids!r}) reads the index column {self.ids!r} from the batch, but the "
                f"model was called with {sorted(kwargs)}: {why}; or use ids='auto' (the default: the indices the "
                "sampler yields)")
        ids = column.reshape(-1).tolist() if torch.is_tensor(column) else list(column)
        if rows is not None and len(ids) != rows:
            self._close(self._args)
            raise ExampleIdsError(f"the batch has {rows} rows but {len(ids)} values in column {self.ids!r}")
        self.capture.ids_next(ids)
        return True

    def _scale_rows(self, kwargs) -> None:
        for key in self.record:
            value = kwargs.get(key)
            if value is None:
                self._close(self._args)
                raise DataError(f"GradientCallback(record=...) asked for {key!r}, but the model was called "
                                f"with {sorted(kwargs)}: record one of those inputs, or keep {key!r} in the "
                                "batch (TrainingArguments(remove_unused_columns=False))")
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
