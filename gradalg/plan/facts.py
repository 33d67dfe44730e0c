"""Stage 2 of planning, **facts**: ``facts(root, options, device, measure)`` → :class:`Facts`,
what is known before any choice, read by the later stages and written by none: each
layer's positions T_b per example (measured on ``meta`` when ``measure``: executors), the
device profile, the dtype, and per node, once, its representation, task token and
shared-forward key. Measurements are memoised by source token in the caller's ``memo``,
never written onto a node: a display plans the same before and after a ``compute()``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

import torch

from ..capture.hooks import forward_share_key
from ..capture.layers import measured_kind
from ..expr import GradNode, Node, Source
from ..expr.tokens import token_rows
from ..options import Options
from .cost import first_example_shape
from ..devices import DeviceProfile
from .shapes import ModelFacts, measure_forward_shapes, measurement_key

__all__ = ["Facts", "facts", "MEASURED", "positions_known", "own_position_kinds", "data_positions"]

#: ``{source token: ForwardShapes}`` measured by executors' plans (the 256 latest)
MEASURED: dict = {}


@dataclass(frozen=True)
class Facts(ModelFacts):
    """Inputs of the decide, schedule and size stages, fixed before they run: a
    :class:`~gradalg.plan.shapes.ModelFacts` (``dtype``; ``shapes``, ``{source token:
    measured shapes}``, handed to every cost and bytes formula) with the options, the
    device profile and each node's representation."""

    options: Options
    device: DeviceProfile
    for_run: bool                           # every layer's positions were measured (a run's plan)
    representations: Mapping[str, Mapping]  # {node token: {block: representation}}
    #: {id(task): (task, task.token)}, {source token: forward_share_key(source)}, {node token:
    #: its blocks' kinds with positions of their own} and {node token: positions_known(node)},
    #: each read once when first asked (a model's fingerprint walks every tensor; an 80-layer
    #: model has 560 blocks, each asked; the data's first example is read for its shape)
    memo: dict = field(default_factory=lambda: {"tasks": {}, "shares": {}, "own": {}, "known": {}}, repr=False, compare=False)

    def representation(self, node: GradNode) -> Mapping:
        return self.representations.get(node.token) or node.representation

    def task_token(self, src: Source) -> str:
        tasks = self.memo["tasks"]
        if tasks.get(id(src.task), (None,))[0] is not src.task:
            tasks[id(src.task)] = (src.task, src.task.token)
        return tasks[id(src.task)][1]

    def _once(self, table: str, node: Node, find):
        """``find(node)``, read once per node token into ``memo[table]``."""
        memo = self.memo[table]
        if node.token not in memo:
            memo[node.token] = find(node)
        return memo[node.token]

    def share_key(self, src: Source):
        return self._once("shares", src, forward_share_key)

    def own_position_kinds(self, node: GradNode) -> frozenset:
        """The kinds of ``node``'s blocks that have positions of their own (:func:`own_position_kinds`)."""
        return self._once("own", node, own_position_kinds)

    def positions_known(self, node: GradNode) -> bool:
        """:func:`positions_known`, read once per node."""
        return self._once("known", node, lambda x: not self.own_position_kinds(x) and data_positions(x))

    def describe(self) -> str:
        return "\n".join([f"device {self.device.name}, dtype {self.dtype}, "
                          + ("measured for a run" if self.for_run else "not measured (shape hints)")]
                         + [f"source {t[:12]}: positions {dict(s.positions)}, {s.activations:,} activations"
                            for t, s in self.shapes.items()])


def own_position_kinds(node: GradNode) -> frozenset:
    """The kinds of ``node``'s blocks with positions of their own (a convolution's output
    positions, a fused expert's routed tokens: ``measured_kind``, known when it runs)."""
    return frozenset(kind for kind in {b.kind for b in node.space.blocks} if measured_kind(kind))


def positions_known(node: GradNode) -> bool:
    """Whether ``tokens_hint`` is every layer's T: no layer has positions of its own
    (:func:`own_position_kinds`) and :func:`data_positions`."""
    return not own_position_kinds(node) and data_positions(node)


def data_positions(node: GradNode) -> bool:
    """Whether the data's shape tells ``tokens_hint``: the examples are token ids (T = their
    length) or flat vectors (T = 1), or the rows are per token."""
    if token_rows(node) > 1:
        return True
    data = getattr(node.source, "data", None)
    first = first_example_shape(data) if data is not None else None   # None: unreadable
    return first is not None and len(first[0]) == 2


def facts(root: Node, options: Options, device: DeviceProfile, measure: bool = False,
          memo: dict | None = None) -> Facts:
    """The :class:`Facts` of the simplified expression ``root``. ``measure``: one
    meta-device forward per source whose positions the data's shape does not tell
    (convolutions, non-token inputs), memoised in ``memo`` (default :data:`MEASURED`) by
    :func:`~gradalg.plan.shapes.measurement_key` (a fused expert's measurement depends on
    the chunk's examples too)."""
    memo = MEASURED if memo is None else memo
    shapes, reps, dtype = {}, {}, None
    for node in root.walk():
        if not isinstance(node, GradNode) or node.token in reps:
            continue
        reps[node.token] = node.representation
        if isinstance(node, Source):    # each source once
            dtype = dtype or next((p.dtype for p in node.task.model.parameters()), None)
            if measure and not positions_known(node):
                key = measurement_key(node)
                if key not in memo and len(memo) >= 256:
                    memo.pop(next(iter(memo)))
                memo[key] = memo.get(key) or measure_forward_shapes(node)
                shapes[node.token] = memo[key]
    return Facts(options, device, measure, reps, dtype=dtype or torch.float32, shapes=shapes)
