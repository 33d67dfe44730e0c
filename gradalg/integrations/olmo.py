"""OLMo-core (``ai2-olmo-core``) integration: a ``Callback`` for ``olmo_core.train.Trainer``.

    from gradalg.integrations.olmo import OLMoCoreCallback

    cb = OLMoCoreCallback(layers=["blocks.*.feed_forward.w2", "lm_head.w_out"])
    trainer = TrainerConfig(save_folder=..., callbacks={"gradalg": cb}).build(train_module, data_loader)
    trainer.fit()
    cb.grads                         # GradientSet of every example of the run

OLMo-core's ``TransformerTrainModule.train_batch`` splits the rank's batch into
micro-batches (``rank_microbatch_size`` tokens) and backpropagates, per micro-batch,
``Σ_tokens ce / N`` with ``N`` the loss tokens of the rank's whole batch; the callback
closes each step in ``pre_optim_step`` — after the last micro-batch, before gradient
clipping and the optimizer step — so on_step callbacks and online selection see (and may
change) the step's full gradient. Under its FSDP/DDP the ranks' gradients are averaged.

``ids`` (default ``"index"``): rows are labelled with ``batch["index"]``, the dataset
index of each instance that OLMo-core's numpy data loaders put in every batch (the
micro-batches take them in order, and their counts are checked); without it, rows are
numbered in order. ``stream=StoreStream(path, projector)`` projects and appends each
step's rows to disk (flushed after each checkpoint).

``scale``: ``"loss"`` (default) each example's contribution to the (averaged) step
gradient — ``ga.capture``'s rows around a plain loop of the same loss, divided by the
data-parallel world size; ``"sum"`` the gradient of the example's summed token loss.

:class:`InMemoryDataLoader` feeds a list of batches (dicts with ``input_ids``) to the
OLMo-core trainer: small runs, tests and notebooks without a tokenized dataset on disk.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from olmo_core.data.data_loader import DataLoaderBase
from olmo_core.train.callbacks import Callback

from ..errors import CaptureStateError, OptionError
from . import distributed as _dist
from .selection import OnlineSelection
from .training import TrainingCapture

__all__ = ["OLMoCoreCallback", "InMemoryDataLoader"]


@dataclass
class OLMoCoreCallback(Callback):
    """Per-example gradients of every OLMo-core step (and optional online selection)."""

    layers: Any = None
    keep: bool = True
    scale: str = "loss"
    selection: OnlineSelection | None = None
    label_ignore_index: int = -100
    ids: str | None = "index"
    stream: Any = None
    capture: TrainingCapture | None = field(default=None, init=False, repr=False)
    _callbacks: list = field(default_factory=list, init=False, repr=False)

    def __post_init__(self):
        if not isinstance(self.scale, str) or self.scale not in ("loss", "sum"):
            raise OptionError(f"OLMoCoreCallback(scale=...) must be 'loss' or 'sum', got {self.scale!r}")
        if self.selection is not None and self.scale != "loss":
            raise OptionError("online selection needs each example's contribution to the step: scale='loss'")

    def on_step(self, callback: Callable) -> Callable:
        """Call ``callback(step: StepGrads)`` at each step, before clipping and the optimizer."""
        self._callbacks.append(callback)
        if self.capture is not None:
            self.capture.on_step(callback)
        return callback

    @property
    def grads(self):
        if self.capture is None:
            raise CaptureStateError("no training has run with this callback yet: its rows exist once "
                                    "trainer.fit() has begun")
        return self.capture.grads

    # ------------------------------------------------------------------ OLMo-core events
    def pre_train(self):
        model = self.trainer.train_module.model
        if self.selection is not None:
            self.selection.attach(model, step_on="manual", keep=self.keep)
            if _dist.world_size(getattr(self.trainer, "dp_process_group", None)) > 1:
                self.selection.world_reduction = "sum"  # rows are already divided by the world size
            self.capture = self.selection.capture
        else:
            self.capture = TrainingCapture(model, self.layers, step_on="manual", keep=self.keep)
        for cb in self._callbacks:
            self.capture.on_step(cb)
        if self.stream is not None:
            if _dist.world_size(getattr(self.trainer, "dp_process_group", None)) > 1:
                self.stream.path = self.stream.path / f"rank-{_dist.rank():03d}"
            self.stream.attach(self.capture, start_step=int(getattr(self.trainer, "global_step", 0)),
                               info={"integration": "olmo_core", "scale": self.scale})
        (self.selection or self.capture).__enter__()

    def pre_step(self, batch: dict[str, Any]):
        self.capture.discard_pending()  # the trainer's dry-run batch, which never steps
        if self.ids is not None and batch.get(self.ids) is not None:
            # OLMo-core's data loaders put each instance's dataset index in batch["index"]; the train
            # module splits the rank's batch into micro-batches in order, which take them n at a time
            self.capture.feed_ids(torch.as_tensor(batch[self.ids]).reshape(-1).tolist())
        world = _dist.world_size(getattr(self.trainer, "dp_process_group", None))
        if self.scale == "loss":
            self.capture.set_scale(1.0 / world if world > 1 else None)
            return
        labels = batch.get("labels")
        if labels is None:
            from olmo_core.data.utils import get_labels
            labels = get_labels(batch, label_ignore_index=self.label_ignore_index)
        n_tokens = float((labels != self.label_ignore_index).sum())
        self.capture.set_scale(n_tokens)

    def pre_optim_step(self):
        self.capture.end_step()

    def post_checkpoint_saved(self, path):
        if self.stream is not None:
            self.stream.flush(wait=True)

    def post_train(self):
        self.close()
        if self.stream is not None:
            self.stream.close()

    def on_error(self, exc: BaseException):
        self.close()

    def close(self):
        if self.capture is not None and self.capture._active:
            (self.selection or self.capture).__exit__(None, None, None)


class InMemoryDataLoader(DataLoaderBase):
    """An OLMo-core data loader over a list of batches (each ``{"input_ids": (B, T), ...}``)."""

    def __init__(self, batches: list[dict], work_dir, *, dp_world_size: int = 1, dp_rank: int = 0):
        tokens = int(batches[0]["input_ids"].numel()) * dp_world_size
        super().__init__(work_dir=work_dir, global_batch_size=tokens, dp_world_size=dp_world_size,
                         dp_rank=dp_rank, fs_local_rank=0)
        self.batches = batches

    @property
    def total_batches(self) -> int:
        return len(self.batches)

    def state_dict(self) -> dict[str, Any]:
        return {"batches_processed": self.batches_processed}

    def load_state_dict(self, state_dict: dict[str, Any]):
        self.batches_processed = state_dict.get("batches_processed", 0)

    def reshuffle(self, epoch: int | None = None, **kwargs):
        self._epoch = epoch or 1

    def _iter_batches(self):
        return iter([{k: (v.clone() if torch.is_tensor(v) else v) for k, v in b.items()} for b in self.batches])

    def get_mock_batch(self) -> dict[str, Any]:
        return dict(self.batches[0])
