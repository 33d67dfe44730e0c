"""Stage 2 of planning, **facts**: what is known about an expression before any choice.

``facts(root, options, device, measure)`` → :class:`Facts`, read by the later stages and
written by none: ``shapes``, ``{source token: ForwardShapes}`` (each recorded layer's
positions T_b per example, measured by one meta-device forward when ``measure``:
executors, before a run), the device profile that prices the plan, the model's dtype, and
per node, once: its blocks' representation, a source's task token (a fingerprint of the
model) and shared-forward key. Measurements are memoised by source token in a cache the
caller owns (``memo``; default :data:`MEASURED`, read only by measuring plans). No fact is
written onto a node, so a display plans the same before and after a ``compute()``.
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
from .lower import CONV_KINDS
from .shapes import ForwardShapes, measure_forward_shapes

__all__ = ["Facts", "facts", "MEASURED", "positions_known"]

#: ``{source token: ForwardShapes}`` measured by executors' plans (the 256 latest)
MEASURED: dict = {}


@dataclass(frozen=True)
class Facts:
    """Inputs of the decide, schedule and size stages, fixed before they run."""

    options: Options
    device: DeviceProfile
    dtype: torch.dtype
    for_run: bool                           # every layer's positions were measured (a run's plan)
    shapes: Mapping[str, ForwardShapes]     # {source token: measured shapes}
    representations: Mapping[str, Mapping]  # {node token: {block: representation}}
    task_tokens: Mapping[str, str]          # {source token: its task's token}
    share_keys: Mapping[str, object]        # {source token: forward_share_key(source)}

    def representation(self, node: GradNode) -> Mapping:
        return self.representations.get(node.token) or node.representation

    def task_token(self, src: Source) -> str:
        return self.task_tokens.get(src.token) or src.task.token

    def share_key(self, src: Source):
        return self.share_keys[src.token] if src.token in self.share_keys else forward_share_key(src)

    def describe(self) -> str:
        return "\n".join([f"device {self.device.name}, dtype {self.dtype}, "
                          + ("measured for a run" if self.for_run else "not measured (shape hints)")]
                         + [f"source {t[:12]}: positions {dict(s.positions)}, {s.activations:,} activations"
                            for t, s in self.shapes.items()])


def positions_known(node: GradNode) -> bool:
    """Whether ``tokens_hint`` is every layer's T: the examples are token ids (T = their
    length) or flat vectors (T = 1), or the rows are per token. Images and other inputs
    give each layer its own T (a convolution's output positions), known when it runs."""
    if token_rows(node) > 1:
        return True
    data = getattr(node.source, "data", None)
    first = first_example_shape(data) if data is not None else None   # None: unreadable
    return first is not None and len(first[0]) == 2


def facts(root: Node, options: Options, device: DeviceProfile, measure: bool = False,
          memo: dict | None = None) -> Facts:
    """The :class:`Facts` of the simplified expression ``root``. ``measure``: one
    meta-device forward per source whose positions the data's shape does not tell
    (convolutions, non-token inputs), memoised in ``memo`` (default :data:`MEASURED`)."""
    memo = MEASURED if memo is None else memo
    shapes, reps, tasks, shares, dtype = {}, {}, {}, {}, None
    for node in root.walk():
        if isinstance(node, GradNode) and node.token not in reps:
            reps[node.token] = node.representation
        if not isinstance(node, Source) or node.token in tasks:
            continue
        dtype = dtype or next((p.dtype for p in node.task.model.parameters()), None)
        tasks[node.token], shares[node.token] = node.task.token, forward_share_key(node)
        if measure and (not positions_known(node) or any(b.kind in CONV_KINDS for b in node.space.blocks)):
            if node.token not in memo and len(memo) >= 256:
                memo.pop(next(iter(memo)))
            memo[node.token] = memo.get(node.token) or measure_forward_shapes(node)
            shapes[node.token] = memo[node.token]
    return Facts(options, device, dtype or torch.float32, measure, shapes, reps, tasks, shares)
