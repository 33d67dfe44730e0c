"""Visiting the states of a training run in reverse order with bounded memory.

Reverse-mode differentiation through T steps ``s_{t+1} = Φ_t(s_t)`` needs the states
``s_{T-1}, …, s_1, s_0`` in that order, while they are produced in the opposite one.
A *schedule* trades memory (states kept) for recomputation (extra forward steps):

=============  ==============================================  ================  ===============
schedule       what is kept                                    states kept       forward steps
=============  ==============================================  ================  ===============
``"all"``      every state of the first run                    T                 T
``k`` (int)    a checkpoint every k steps; the states of one   ≤ ⌈T/k⌉ + k − 1   ≤ 2T
               segment, recomputed from its checkpoint
``"sqrt"``     the int schedule with k = ⌈√T⌉                  ≤ 2⌈√T⌉           ≤ 2T
``"log"``      recursive halving (REPLAY's k-ary tree with     ⌈log₂ T⌉ + 1      ≤ T(⌈log₂ T⌉ + 1)
               k = 2): the state at the start of each open
               half, one per level
=============  ==============================================  ================  ===============

("states" are model-plus-optimizer states ``(θ, optimizer state)``; the current state
in flight is not counted.) Engstrom et al. 2025 ("Optimizing ML training with
metagradient descent", REPLAY) keep a lazy k-ary tree for O(k log_k T) states;
``"log"`` is its binary case. :class:`Ledger` counts what a schedule holds, so the
bounds are tested, not claimed.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterator

from ..errors import OptionError

__all__ = ["Ledger", "reverse_states", "schedule_bound", "SCHEDULES"]

SCHEDULES = ("all", "sqrt", "log")


@dataclass
class Ledger:
    """Counts the states a schedule holds: ``held`` now, ``peak`` over the run, and the
    ``forward_steps`` it ran (first run and recomputations)."""

    held: int = 0
    peak: int = 0
    forward_steps: int = 0

    def hold(self, n: int = 1) -> None:
        self.held += n
        self.peak = max(self.peak, self.held)

    def release(self, n: int = 1) -> None:
        self.held -= n


def _segment_length(schedule, n_steps: int) -> int | None:
    if schedule == "sqrt":
        return max(1, math.ceil(math.sqrt(n_steps)))
    if isinstance(schedule, int) and not isinstance(schedule, bool):
        if schedule < 1:
            raise OptionError(f"a checkpoint interval must be ≥ 1, got {schedule}")
        return schedule
    return None


def schedule_bound(schedule, n_steps: int) -> int:
    """The most states ``schedule`` keeps for ``n_steps`` steps (the table above)."""
    check_schedule(schedule)
    if schedule == "all":
        return n_steps
    if schedule == "log":
        return math.ceil(math.log2(max(n_steps, 1))) + 1
    k = _segment_length(schedule, n_steps)     # segment j holds checkpoints 0..j and its other states
    return max(j + min(k, n_steps - j * k) for j in range(math.ceil(n_steps / k)))


def check_schedule(schedule) -> None:
    if schedule in SCHEDULES or (isinstance(schedule, int) and not isinstance(schedule, bool) and schedule >= 1):
        return
    raise OptionError(f"checkpointing must be one of {SCHEDULES} or a positive checkpoint interval (int), "
                     f"got {schedule!r}")


def reverse_states(s0, n_steps: int, advance: Callable, schedule="sqrt",
                   ledger: Ledger | None = None) -> tuple[object, Iterator]:
    """Run the ``n_steps`` steps from ``s0`` once, then visit the states backwards.

    advance : ``advance(state, t) -> state_{t+1}`` (deterministic).
    Returns ``(s_T, states)``: the final state, and an iterator of ``(t, s_t)`` for
    t = T−1, …, 0 (consume it in order; it recomputes what the schedule dropped).
    """
    check_schedule(schedule)
    ledger = ledger if ledger is not None else Ledger()

    def step(state, t):
        ledger.forward_steps += 1
        return advance(state, t)

    if schedule == "all":
        kept, state = [], s0
        for t in range(n_steps):
            kept.append(state)
            ledger.hold()
            state = step(state, t)

        def backwards():
            for t in range(n_steps - 1, -1, -1):
                yield t, kept.pop()
                ledger.release()
        return state, backwards()

    if schedule == "log":
        state = s0
        for t in range(n_steps):
            state = step(state, t)

        def halves(a, s_a, b):          # s_a is held by the caller
            if b - a == 1:
                yield a, s_a
                return
            m = (a + b) // 2
            s_m = s_a
            for t in range(a, m):
                s_m = step(s_m, t)
            ledger.hold()
            yield from halves(m, s_m, b)
            del s_m
            ledger.release()
            yield from halves(a, s_a, m)

        def backwards():
            if n_steps == 0:
                return
            ledger.hold()
            yield from halves(0, s0, n_steps)
            ledger.release()
        return state, backwards()

    k = _segment_length(schedule, n_steps)
    checkpoints, state = {}, s0
    for t in range(n_steps):
        if t % k == 0:
            checkpoints[t] = state
            ledger.hold()
        state = step(state, t)

    def backwards():
        for a in sorted(checkpoints, reverse=True):
            b = min(a + k, n_steps)
            segment = [checkpoints.pop(a)]
            for t in range(a, b - 1):
                segment.append(step(segment[-1], t))
                ledger.hold()
            for t in range(b - 1, a - 1, -1):
                yield t, segment.pop()
                ledger.release()
    return state, backwards()
