"""Capturing a Source's per-example gradients for one batch.

``SourceCapture(source, options, checked_tasks).capture(batch, ids)`` returns the
chunks of that batch: one chunk, or one per term for ``objective="expected"``.
Several sources over the same (task, data) are captured from the same batch in one
read of the data (a fused pass): :class:`PassCapture` does that, and sources that
differ only in their objective (the training loss and labels drawn from the model,
for an influence function with the true Fisher) share one forward per batch
(:class:`SharedForward`), each adding only its loss head and its backward.
"""
from __future__ import annotations

import contextlib

import torch

from ..capture.hooks import ForwardRecorder, capture_batch, forward_share_key, resolve_layers
from ..capture.reference import block_param_names, per_example_grads
from ..data import batch_size_of
from ..errors import OptionError
from ..finite import check_model, check_rows as check_finite
from ..expr import Source
from ..capture.chunks import Chunk

__all__ = ["SourceCapture", "PassCapture", "SharedForward", "model_device_dtype"]


def model_device_dtype(model):
    p = next(model.parameters(), None)
    return (p.device, p.dtype) if p is not None else (torch.device("cpu"), torch.float32)


class SourceCapture:
    def __init__(self, source: Source, options, checked_tasks: set):
        if source.backend == "func" and source.objective in ("sampled", "expected"):
            raise OptionError(f"objective={source.objective!r} is captured with backend='hooks' only: "
                              f"ga.grads(task, data, objective={source.objective!r}) (backend='hooks', the "
                              "default), not backend='func'")
        self.source = source
        self.options = options
        self.checked = checked_tasks
        self.refs = resolve_layers(source.task.model, list(source.layers), backend=source.backend)
        if options.check_finite:   # a NaN weight is named here, not blamed on every example
            check_model(source.task.model)
        self.objective = source.task.objective_fn(source.objective, source.seed)
        # sources with equal keys can share one forward per batch (None: never shared); a task's
        # token fingerprints its model and functions: computed once per pass, not once per batch
        self.share_key = forward_share_key(source, self.refs)
        self._reduction_checked = False

    def capture(self, batch, ids) -> list[Chunk]:
        """The batch's chunks (one per Gauss-Newton term for ``objective="expected"``); the
        forward is recorded for per-example weights to replay where it may be shared."""
        src = self.source
        if src.backend == "func":
            self.check_reduction(batch)   # the hooks backend checks with its own forward's loss
            return self.finish(self._func_blocks(batch), batch, ids)
        replay = self.options.share_forward and self.share_key is not None and src.objective != "expected"
        return _one_forward([self], batch, ids, SharedForward(src.task.model) if replay else None)[src.token]

    def check_reduction(self, batch, loss: torch.Tensor | None = None) -> None:
        """The task's sum/mean check, once per task (training-loss objective only).

        ``loss``: this batch's summed loss from the capture's forward; the check then
        reuses it instead of running that forward again (``Task.check_reduction``'s
        ``full_loss``: a batch of 2 to 4 examples)."""
        task = self.source.task
        if self._reduction_checked or not (self.options.check_reduction and self.source.objective == "loss"):
            return
        self._reduction_checked = True
        if task.token not in self.checked:
            task.check_reduction(batch, full_loss=None if loss is None else float(loss.detach()))
            self.checked.add(task.token)

    def loss(self, batch, ids) -> torch.Tensor:
        """The summed objective of ``batch`` (labels drawn per example id for "sampled")."""
        if self.source.objective == "sampled":   # each example's draw follows its id
            return self.objective(self.source.task.model, batch, ids)
        return self.objective(self.source.task.model, batch)

    def finish(self, blocks: dict, batch, ids, forward=None, term: int | None = None) -> list[Chunk]:
        """The batch's chunk (of Gauss-Newton term ``term`` for ``objective="expected"``);
        ``forward`` (a :class:`SharedForward` record) lets per-example weights of this batch
        reuse its forward (dropped when rows are kept)."""
        if self.options.check_finite:
            check_finite(blocks, ids)
        meta = {"term": term} if term is not None else {"forward": forward} if forward else {}
        return [Chunk(ids, blocks, batch, self.source.task, meta)]

    def _func_blocks(self, batch):
        task = self.source.task
        per_block = {ref.name: block_param_names(task.model, ref) for ref in self.refs}
        grads = per_example_grads(task, batch, [n for names in per_block.values() for n in names],
                                  loss_fn=self.objective)
        return {ref.name: torch.cat([grads[n].flatten(1) for n in per_block[ref.name]], dim=1) for ref in self.refs}


class PassCapture:
    """Captures every source of one pass from each batch.

    Sources over the same task and layers that differ only in their objective share one
    forward (:class:`SharedForward`) and run one backward each (``retain_graph`` for all
    but the last), instead of a forward and a backward each. If an objective calls the
    model more than once, or with other inputs, the batch is captured again source by
    source and sharing stays off for that group (results are the same either way).
    """

    def __init__(self, sources, options, checked_tasks: set):
        self.capturers = [SourceCapture(s, options, checked_tasks) for s in sources]
        groups: dict = {}
        for c in self.capturers:
            key = c.share_key if options.share_forward else None
            groups.setdefault(key if key is not None else id(c), []).append(c)
        self.groups = list(groups.values())
        self.shared_batches = 0

    def capture(self, batch, ids) -> dict[str, list[Chunk]]:
        out: dict[str, list[Chunk]] = {}
        for task in {id(c.source.task): c.source.task for c in self.capturers}.values():
            task.validate_batch(batch, ids)
        groups = []
        for group in self.groups:
            chunks = _one_forward(group, batch, ids, SharedForward(group[0].source.task.model)) \
                if len(group) > 1 else None
            if chunks is not None:
                out.update(chunks)
                self.shared_batches += 1
                groups.append(group)
                continue
            for c in group:   # one source, or a group found not shareable: captured (and tried) source by source
                out[c.source.token] = c.capture(batch, ids)
            groups.extend([c] for c in group)
        self.groups = groups
        return out


def _one_forward(group: list[SourceCapture], batch, ids, shared: "SharedForward | None"
                 ) -> dict[str, list[Chunk]] | None:
    """The chunks of each source of ``group`` (one task and layers) from one forward of
    ``batch``: one backward per loss (per Gauss-Newton term for ``objective="expected"``),
    the graph retained for all but the last. ``shared`` (or None) answers the model's later
    calls with equal inputs from the first call and keeps its record for per-example weights
    to replay. None when a source of a group of several called the model other than once
    with the first call's inputs (the caller captures the group source by source)."""
    model = group[0].source.task.model
    with torch.enable_grad(), ForwardRecorder(group[0].refs, model=model) as recorder, \
            shared if shared is not None else contextlib.nullcontext():
        losses = []                                  # (capturer, term or None, loss)
        for k, c in enumerate(group):
            calls = shared.calls if shared is not None else 0
            if c.source.objective == "expected":     # one loss per Gauss-Newton term
                losses += [(c, term, loss) for term, loss in enumerate(c.objective(model, batch))]
            else:
                losses.append((c, None, c.loss(batch, ids)))
            if len(group) > 1 and (shared.calls != calls + 1 or shared.hits != k):
                return None
        task = group[0].source.task
        mask = task.token_mask(batch) if task.token_mask is not None else None
        blocks = [capture_batch(loss, recorder, token_mask=mask, retain_graph=k < len(losses) - 1,
                                n_examples=batch_size_of(batch)) for k, (_, _, loss) in enumerate(losses)]
    record = shared.record if shared is not None else None
    for c, term, loss in losses:   # the sum/mean check reuses each training loss's value
        c.check_reduction(batch, loss if term is None else None)
    out: dict[str, list[Chunk]] = {c.source.token: [] for c in group}
    for (c, term, _), b in zip(losses, blocks):   # NaN rows name their examples here (finish)
        out[c.source.token] += c.finish(b, batch, ids, record if term is None else None, term)
    return out


class SharedForward:
    """Context manager: the model's forward runs once; later calls with equal inputs
    return the first call's outputs, with their autograd graph.

    ``model.forward`` is shadowed by an instance attribute while active. ``calls``
    counts calls and ``hits`` those answered from the first; a call with other inputs
    runs the real forward (and is a miss the caller can detect). ``record`` keeps the
    first call after exit; ``SharedForward(model, first=record)`` replays it (per-example
    weights such as TRAK's 1 − p read the captured batch's outputs, not a new forward).
    """

    def __init__(self, model: torch.nn.Module, first=None):
        self.model = model
        self.calls = self.hits = 0
        self._first = first          # ((args, kwargs), output) of an earlier forward to replay
        self.record = None           # the first call's ((args, kwargs), output), kept after exit

    def __enter__(self):
        self._shadowed = vars(self.model).get("forward")
        self._forward = self.model.forward
        self.model.forward = self._call
        return self

    def __exit__(self, *exc):
        if self._shadowed is not None:
            self.model.forward = self._shadowed
        else:
            del self.model.forward
        self.record, self._first = self._first, None

    def _call(self, *args, **kwargs):
        self.calls += 1
        if self._first is not None and _same_inputs(self._first[0], (args, kwargs)):
            self.hits += 1
            return self._first[1]
        output = self._forward(*args, **kwargs)
        if self._first is None:
            self._first = ((args, kwargs), output)
        return output


def _same_inputs(a, b) -> bool:
    """Whether two forward inputs (nested tuples, lists, dicts of tensors and values) are equal."""
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
                and a.dtype == b.dtype and a.device == b.device and bool(torch.equal(a, b)))
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same_inputs, a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same_inputs(a[k], b[k]) for k in a)
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - values without a truth value are not the same input
        return False
