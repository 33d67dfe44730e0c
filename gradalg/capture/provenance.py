"""Rows gathered by index: the enclosing module replayed per example.

An expert of a mixture of experts that is its own ``nn.Linear`` receives the rows of
the tokens routed to it, ``flat[idx]``: their examples cannot be read off its input
(:mod:`gradalg.capture.rows` refuses them). They can be established exactly one level
up. While a batch is recorded, :class:`CallStack` keeps the chain of module calls in
progress (global forward hooks), so each recorded call knows the calls that enclose it.
For a call whose rows cannot be attributed, the innermost enclosing call whose input
and output rows *can* (the MoE block, fed (B, T, d)) is replayed on each example alone
with the routed layers recorded; the gradient of the loss w.r.t. the enclosing call's
output, taken in the batch's backward, gives each replayed layer its ``D``::

    D_i = ∂⟨g_enclosing[rows of i], f(x_i)⟩ / ∂(layer output in the replay of example i)

so example ``i``'s factors are the rows routed from example ``i`` only, exactly as the
batch routed them: checked, the replayed output of the enclosing call must equal the
batch's rows (``torch.testing.assert_close``'s tolerances), else the layer is refused.
Cost: one forward and backward of the enclosing module per example and batch.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import get_gradient_edge
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.utils._pytree import tree_flatten, tree_map

from ..errors import UnsupportedLayerError
from ..own_hooks import OwnHooks
from .factors import Factors
from .layers import _REPLAYING, _leading_rows, replaying
from .rows import RowLayout, layout_for

__all__ = ["CallStack", "Frame", "enclosing_frame", "find_routed", "routed_frames", "replay_frames",
           "replay_routed"]


@dataclass(eq=False)
class Frame:
    """One module call: its inputs (detached) and its differentiable output, once returned."""

    module: torch.nn.Module
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    output: torch.Tensor | None = None
    output_index: int | None = None
    edge: object = None
    done: bool = False

    @property
    def rows(self) -> int | None:
        first = next((t for t in tree_flatten((self.args, self.kwargs))[0]
                      if isinstance(t, torch.Tensor) and t.dim()), None)
        return None if first is None else first.shape[0]


class CallStack:
    """Context manager: the module calls in progress (``frames``, outermost first)."""

    def __init__(self):
        self.frames: list[Frame] = []
        self._handles = OwnHooks()

    def __enter__(self):
        self._thread = threading.get_ident()       # the hooks are global: other threads' calls are not ours
        self._handles.add(register_module_forward_pre_hook(self._push))
        self._handles.add(register_module_forward_hook(self._pop, with_kwargs=True))
        return self

    def __exit__(self, *exc):
        self._handles.remove()
        self.frames = []
        return False

    def _push(self, module, args):
        if replaying() is None and threading.get_ident() == self._thread and not torch.compiler.is_compiling():
            self.frames.append(Frame(module))

    def _pop(self, module, args, kwargs, output):
        if replaying() is not None or not self.frames or self.frames[-1].module is not module \
                or threading.get_ident() != self._thread:
            return
        frame = self.frames.pop()
        frame.args, frame.kwargs, frame.done = args, kwargs, True    # detached when replayed
        if isinstance(output, torch.Tensor):
            outs = [(None, output)]
        elif isinstance(output, (tuple, list)):
            outs = [(k, o) for k, o in enumerate(output) if isinstance(o, torch.Tensor)]
        else:
            outs = []
        outs = [(k, o) for k, o in outs if o.requires_grad]
        if len(outs) == 1:                 # several outputs may depend on each other: not replayed
            frame.output_index, frame.output = outs[0]
            frame.edge = get_gradient_edge(frame.output)

    def snapshot(self) -> tuple[Frame, ...]:
        return tuple(self.frames)


def enclosing_frame(frames, n_examples: int | None, lengths) -> tuple[Frame, RowLayout] | None:
    """The innermost enclosing call whose input and output rows are attributed to examples."""
    if n_examples is None:
        return None
    for frame in reversed(frames):
        if not frame.done or frame.output is None or frame.rows is None or not frame.output.dim():
            continue
        if frame.output.shape[0] != frame.rows:
            continue
        try:
            layout = layout_for("", frame.rows, n_examples, lengths)
        except UnsupportedLayerError:
            continue
        return frame, layout
    return None


def find_routed(recorder, n_examples: int | None, lengths) -> dict:
    """``{(layer name, call index): (frame, layout)}`` for the recorded calls whose rows are
    not attributable by :func:`~gradalg.capture.rows.layout_for` (other than a single
    broadcast row, which stays refused) but that an attributable call encloses."""
    out = {}
    for ref in recorder.layers:
        for i, call in enumerate(recorder.calls[ref.name]):
            rows = (call.use.rule if getattr(call, "use", None) is not None else ref.rule).rows(call.A)[0]
            try:
                layout_for(ref.name, rows, n_examples, lengths)
            except UnsupportedLayerError:
                found = enclosing_frame(getattr(call, "frames", ()), n_examples, lengths) if rows != 1 else None
                if found is not None:
                    out[(ref.name, i)] = found
    return out


class _SubRecorder:
    """Records the routed layers' calls during one replay (the batch's recorder is paused)."""

    def __init__(self, refs):
        self.refs = refs
        self.calls = {ref.name: [] for ref in refs}
        self._handles = OwnHooks()

    def __enter__(self):
        self._token = _REPLAYING.set(self)
        for ref in self.refs:
            self._handles.add(ref.module.register_forward_hook(self._hook(ref), with_kwargs=True))
        return self

    def __exit__(self, *exc):
        self._handles.remove()
        _REPLAYING.reset(self._token)
        return False

    def _hook(self, ref):
        def hook(module, args, kwargs, output):
            if replaying() is not self:
                return
            recorded = ref.rule.record(module, args, kwargs, output)
            for rec, out in recorded:
                self.calls[ref.name].append((rec, out, get_gradient_edge(out)))
            return ref.rule.hooked_output(output, recorded)
        return hook


def replay_routed(frame: Frame, g: torch.Tensor, layout: RowLayout, refs) -> dict[str, Factors]:
    """Per-example factors (n_examples, T_max, ·) of the layers ``refs`` called inside
    ``frame``, from a replay of ``frame`` on each example; ``g`` is the gradient of the
    summed loss w.r.t. ``frame``'s output."""
    per_example: dict[str, list[Factors]] = {ref.name: [] for ref in refs}
    n_rows = layout.rows
    for b in range(layout.n_examples):
        rows = layout.example_rows(b)
        args, kwargs = tree_map(lambda t: _leading_rows(t.detach() if isinstance(t, torch.Tensor) else t, n_rows, rows),
                                (frame.args, frame.kwargs))
        with torch.enable_grad(), _SubRecorder(refs) as sub:
            out = frame.module.forward(*args, **kwargs)
            if frame.output_index is not None:
                out = out[frame.output_index]
            try:
                torch.testing.assert_close(out.detach(), frame.output.detach()[rows])
            except AssertionError:
                raise UnsupportedLayerError(
                    f"layers {[r.name for r in refs]} receive rows gathered by index, and "
                    f"{type(frame.module).__name__}, the module that encloses them, gives other outputs "
                    "for an example alone than in its batch (e.g. capacity-limited routing), so the "
                    "example each row came from cannot be established exactly. Leave these layers out "
                    "of `layers` or use backend='func'"
                ) from None
            owners = [(ref, rec) for ref in refs for rec, _, _ in sub.calls[ref.name]]
            edges = [edge for ref in refs for _, _, edge in sub.calls[ref.name]]
            grads = torch.autograd.grad(out, edges, g[rows], allow_unused=True) if edges else ()
            outs = [o for ref in refs for _, o, _ in sub.calls[ref.name]]
        parts: dict[str, list[Factors]] = {ref.name: [] for ref in refs}
        for (ref, rec), o, gr in zip(owners, outs, grads):
            gr = torch.zeros_like(o) if gr is None else gr.detach()
            n = ref.rule.rows(rec)[0]
            parts[ref.name].append(ref.rule.factors(ref.module, rec, gr, RowLayout(1, n)))
        for ref in refs:
            if parts[ref.name]:
                per_example[ref.name].append(Factors.concat_tokens(parts[ref.name]))
            else:                                   # no token of this example reached the layer
                n_out, n_in = ref.rule.block_shape(ref.module)
                zeros = g.new_zeros(1, 1, n_in), g.new_zeros(1, 1, n_out)
                per_example[ref.name].append(Factors(*zeros))
    return {name: Factors.concat_examples(parts) for name, parts in per_example.items()}


def routed_frames(routed: dict) -> list[Frame]:
    """The distinct enclosing calls of :func:`find_routed`'s result, in order."""
    return list({id(frame): frame for frame, _ in routed.values()}.values())


def replay_frames(routed: dict, frames: list[Frame], grads, layers, grad_scale: float = 1.0):
    """``(layer name, factors)`` of every routed layer, each enclosing call replayed once;
    ``grads``: the loss's gradients w.r.t. the ``frames``' outputs (None: unused)."""
    for frame, g in zip(frames, grads):
        refs = [ref for ref in layers if any(f is frame for (name, _), (f, _) in routed.items() if name == ref.name)]
        layout = next(lay for f, lay in routed.values() if f is frame)
        g = torch.zeros_like(frame.output) if g is None else g.detach() * grad_scale
        yield from replay_routed(frame, g, layout, refs).items()
