"""Stage 2 of planning, **facts**: what is known about an expression before any choice.

``facts(lowered, options, device, measure)`` → :class:`Facts`, a frozen record the
later stages read and nothing writes:

- ``shapes``: ``{source token: ForwardShapes}``, each recorded layer's positions T_b per
  example, measured by one meta-device forward when ``measure`` (executors, before a run;
  :func:`~gradalg.plan.shapes.measure_forward_shapes`), else none (``tokens_hint``);
- ``device`` (the :class:`~gradalg.plan.devices.DeviceProfile` that prices the plan) and
  ``dtype`` (the model's);
- per node, computed once: the representation of its blocks, a source's task token and
  shared-forward key.

Measurements are memoised by source token in a cache the caller owns (``memo``; executors
use :data:`MEASURED`, bounded). No fact is written onto a node, so a display plans the
same before and after a ``compute()``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch

from ..capture.hooks import forward_share_key
from ..expr import GradNode, Node, Source
from ..expr.tokens import token_rows
from ..options import Options
from .cost import first_example_shape
from .devices import DeviceProfile
from .graph import CONV_KINDS
from .shapes import ForwardShapes, measure_forward_shapes

__all__ = ["Facts", "facts", "MEASURED", "positions_known"]

#: ``{source token: ForwardShapes}`` measured by executors' plans (bounded, oldest dropped)
MEASURED: dict = {}
_MEASURED_KEPT = 256


@dataclass(frozen=True)
class Facts:
    """Inputs of the decide, schedule and size stages, fixed before they run."""

    options: Options
    device: DeviceProfile
    dtype: torch.dtype
    for_run: bool                       # every layer's positions were measured (a run's plan)
    shapes: Mapping[str, ForwardShapes]     # {source token: measured shapes}
    representations: Mapping[str, Mapping]  # {node token: {block: representation}}
    task_tokens: Mapping[str, str]          # {source token: task.token}
    share_keys: Mapping[str, object]        # {source token: forward_share_key(source)}

    def representation(self, node: GradNode) -> Mapping:
        hit = self.representations.get(node.token)
        return node.representation if hit is None else hit

    def task_token(self, src: Source) -> str:
        return self.task_tokens[src.token] if src.token in self.task_tokens else src.task.token

    def share_key(self, src: Source):
        return self.share_keys[src.token] if src.token in self.share_keys else forward_share_key(src)

    def describe(self) -> str:
        lines = [f"device {self.device.name}, dtype {self.dtype}, "
                 f"{'measured for a run' if self.for_run else 'not measured (shape hints)'}"]
        for token, s in self.shapes.items():
            T = ", ".join(f"{k}: {v}" for k, v in s.positions.items())
            lines.append(f"source {token[:12]}: positions {{{T}}}, {s.activations:,} activations"
                         f"{'' if s.measured else ' (not measured)'}")
        return "\n".join(lines)


def positions_known(node: GradNode) -> bool:
    """Whether ``tokens_hint`` is every layer's T: the examples are token ids (T = their
    length) or flat vectors (T = 1). Images and other multi-dimensional inputs give each
    layer its own T (a convolution's output positions), known only when it runs."""
    if token_rows(node) > 1:
        return True   # per-token rows: one position each
    data = getattr(node.source, "data", None)
    if data is None:
        return False
    first = first_example_shape(data)   # None: unreadable; a shape hint never fails planning
    return first is not None and len(first[0]) == 2


def _measure(src: Source, memo: dict) -> ForwardShapes:
    hit = memo.get(src.token)
    if hit is None:
        hit = measure_forward_shapes(src)
        if len(memo) >= _MEASURED_KEPT:
            memo.pop(next(iter(memo)))
        memo[src.token] = hit
    return hit


def facts(root: Node, options: Options, device: DeviceProfile, measure: bool = False,
          memo: dict | None = None) -> Facts:
    """The :class:`Facts` of the simplified expression ``root``. ``measure``: run one
    meta-device forward per source whose positions the data's shape does not tell
    (convolutions, non-token inputs), memoised in ``memo`` (default :data:`MEASURED`)."""
    memo = MEASURED if memo is None else memo
    shapes, reps, tasks, shares, dtype = {}, {}, {}, {}, None
    for node in root.walk():
        if isinstance(node, GradNode) and node.token not in reps:
            reps[node.token] = node.representation
        if not isinstance(node, Source) or node.token in tasks:
            continue
        if dtype is None:
            dtype = next((p.dtype for p in node.task.model.parameters()), None)
        tasks[node.token], shares[node.token] = node.task.token, forward_share_key(node)
        # flat inputs (T = 1) and token ids (T = their length) tell every linear
        # layer's positions: the probe is for convolutions and other inputs
        if measure and (not positions_known(node) or any(b.kind in CONV_KINDS for b in node.space.blocks)):
            shapes[node.token] = _measure(node, memo)
    return Facts(options, device, dtype or torch.float32, measure, shapes, reps, tasks, shares)
