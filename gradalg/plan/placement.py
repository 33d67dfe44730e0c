"""The place stage: where each pass of a sized plan runs, and the decisions recording it.

The executor's shard strategy (:class:`~gradalg.exec.runner.ShardStrategy`) answers only
*where* (its ``place(step) -> Placement``, from the pass alone); this stage asks it once per
pass and records the answer in the plan: ``plan.placement`` (a :class:`Placement` per
pass) and, in ``plan.decisions``,

* ``PLACEMENT``, subject ``(index, pass key)``: chosen the strategy's ``here`` (this
  process, the client, every rank) or its ``spread`` (on shards), its alternatives the
  pass's estimated seconds here, :math:`t`, and on shards, :math:`t / w` with :math:`w`
  the strategy's ``ways()`` (shards that run at once; transfers not costed), its reason the
  placement's (and its refusal, if any);
* ``SHARDS``, for a pass split into ``where.shards`` tasks: chosen that count, its
  alternatives ``where.weighed`` (the counts weighed).

A strategy that never shards (``spread`` None: the local executor's) places every pass
here and records nothing (there was nothing to choose).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from .decisions import Decision, DecisionKind, Decisions

__all__ = ["Placement", "HERE", "place_passes"]


@dataclass(frozen=True)
class Placement:
    """Where one pass runs: ``sharded`` (by the strategy's ``run_shards``) or in this
    process, and why (shown by ``explain()``); ``refusal``: an error the pass raises
    instead of running (a pass the strategy cannot run anywhere); ``shards``: the shard
    tasks of a sharded pass (0: the strategy's own split, one range per rank) and
    ``weighed`` the counts it was chosen from ({name: count as shown}: the ``SHARDS``
    decision's alternatives)."""

    sharded: bool
    reason: str = ""
    refusal: Exception | None = None
    shards: int = 0
    weighed: tuple = ()


#: a pass run whole in this process
HERE = Placement(False, "in this process")


def place_passes(p, strategy):
    """``p`` (a :class:`~gradalg.plan.planner.Plan`) with each pass placed by ``strategy``
    (its ``place``, asked once per pass) and the ``PLACEMENT`` / ``SHARDS`` decisions
    recording it (module docstring)."""
    placement = tuple(strategy.place(step) for step in p.passes)
    if strategy.spread is None:
        return replace(p, placement=placement)
    ways, here, spread = strategy.ways(), strategy.here, strategy.spread
    decisions = list(p.decisions)
    for index, (step, where) in enumerate(zip(p.passes, placement)):
        subject, label = (index, step.key), f"pass {index + 1} ({step.label})"
        reason = where.reason + (f"; refused: {where.refusal}" if where.refusal is not None else "")
        decisions.append(Decision(
            DecisionKind.PLACEMENT, subject, spread if where.sharded else here,
            {here: step.seconds, spread: step.seconds / ways},
            f"{reason} (on shards: the pass's estimate over {ways} shard(s) at once; transfers not costed)",
            label=label))
        if where.sharded and where.shards:
            decisions.append(Decision(DecisionKind.SHARDS, subject, str(where.shards), dict(where.weighed),
                                      "the strategy's count from those weighed (an option, when set, forces it)",
                                      label=label))
    return replace(p, placement=placement, decisions=Decisions(decisions))
