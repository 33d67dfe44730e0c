"""The planner: an expression → its :class:`Plan`, through stages that are each a function
from one frozen record to the next, in a module of its own (``plan.explain(stage=...)``
shows a stage's record):

    logical → simplified (:mod:`~gradalg.plan.rules`) → lower (:mod:`~gradalg.plan.lower`:
    what the passes must give) → facts (:mod:`~gradalg.plan.facts`: measured shapes, the
    device) → decide (:mod:`~gradalg.plan.decide`: the job graph and its choices) →
    schedule (:mod:`~gradalg.plan.schedule`: ordered passes) → size
    (:mod:`~gradalg.plan.size`: batch sizes, bytes, costs)
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from ..expr import Node, Source
from ..errors import MemoryBudgetError
from ..fingerprint import digests_held
from ..options import Options, get_options
from .budget import Budget, resolve_budget, with_note
from .choices import Choices
from .cost import Cost
from .decide import decide
from ..units import format_bytes, format_bytes_alike
from .decisions import Decision, DecisionKind, DecisionSource, Decisions
from ..devices import DeviceProfile, profile
from .facts import facts as find_facts
from .lower import ROW_WISE, STATISTICS_JOBS, chain_ops, lower, stream_root  # noqa: F401 (exec reads)
from .jobs import Job, TopK
from .rules import Firing, PlanError, simplify_until_fixpoint
from .schedule import Pass, schedule
from .size import size

__all__ = ["Job", "Pass", "Decision", "DecisionKind", "Plan", "plan", "estimate", "stream_root", "PlanError"]

#: the stages ``Plan.explain(stage=...)`` shows, in order
STAGES = ("lower", "facts", "decide", "schedule", "size")


@dataclass(frozen=True)
class Plan:
    """The planner's output: every stage, the decisions and the physical passes.
    ``stages``: ``{stage name: its record}`` (:data:`STAGES`)."""

    logical: Node
    simplified: Node
    fired: list[Firing]
    decisions: Decisions        # typed records: plan.decisions.of(DecisionKind.KERNEL, block=...)
    passes: list[Pass]
    jobs: dict
    roots: list[str]
    options: Options
    device: DeviceProfile
    stored: set
    dtype: torch.dtype = torch.float32
    budget: Budget | None = None    # the memory budget and its source (options.memory_budget is its bytes)
    stages: dict = field(default_factory=dict, repr=False)
    placement: tuple = ()           # per pass, where it runs (plan.placement.Placement), recorded by the place stage from the executor's shard strategy

    @property
    def facts(self):
        """The facts stage's record (:class:`~gradalg.plan.facts.Facts`): the dtype, the
        measured forward shapes and the device every estimate of the plan was made with;
        a job's cost and bytes hooks take it (``job.fixed_bytes(plan.facts)``)."""
        return self.stages["facts"]

    @property
    def total(self) -> Cost:
        return sum((p.cost for p in self.passes), Cost())

    @property
    def seconds(self) -> float:
        return sum(p.seconds for p in self.passes)

    @property
    def peak_bytes(self) -> float:
        return max([p.fixed_bytes + p.per_example_bytes * (p.batch_size or 1) for p in self.passes] or [0.0])

    @property
    def data_passes(self) -> int:
        return sum(1 for p in self.passes if p.reads_data)

    def explain(self, stage: str) -> str:
        """The record of one planning stage as text: ``"lower"`` (the result and its score
        terms), ``"facts"`` (measured positions, device, dtype), ``"decide"`` (jobs and
        decisions), ``"schedule"`` (passes in order) or ``"size"`` (batch sizes, bytes, seconds)."""
        if stage not in STAGES:
            raise PlanError(f"unknown stage {stage!r}: the planner's stages are {', '.join(STAGES)}")
        return self.stages[stage].describe() if stage != "size" else "\n".join(
            f"{i + 1}. {p.label}: " + (f"batch {p.batch_size}, trimmed after batches: {p.trim_after_batches}"
                                      if p.reads_data else f"batch {p.batch_size} per call of its solver"
                                      if p.per_call else "reads no data (rows in memory or a store)")
            + f", %s held + %s per example, {p.seconds:.3g} s"
            % format_bytes_alike(p.fixed_bytes, p.per_example_bytes) + (f" ({p.note})" if p.note else "")
            for i, p in enumerate(self.passes))


def model_device(root: Node) -> torch.device | None:
    """The device of the first model's parameters among ``root``'s sources (None: no
    parameters, or a ``meta`` model: planned as if on the CPU)."""
    p = next((p for node in root.walk() if isinstance(node, Source) for p in node.task.model.parameters()), None)
    return None if p is None or p.device.type == "meta" else p.device


# ------------------------------------------------------------------ entry point
@digests_held()     # no model changes while planning: each task's model is walked once
def plan(root: Node, *, options: Options | None = None, device=None, rewrites: bool = True,
         choices: Choices | None = None, measure_shapes: bool = False, topk: TopK | None = None,
         budget: Budget | None = None, keep_held_rows: bool = False) -> Plan:
    """Plan ``root`` (a score, self-score, gradient or operator node).

    ``choices`` forces decisions the planner would otherwise cost (:class:`Choices`).
    ``measure_shapes`` (executors about to run the plan) finds every layer's positions
    per example with one meta-device call of each source's loss (the facts stage) and
    measures this machine's speeds if they were never measured; without it the planner
    calls no model and benchmarks nothing (displays: the cached device profile, or an
    unmeasured default).
    ``topk`` (:class:`~gradalg.plan.jobs.TopK`): plan the ``k`` best training rows per
    query of the score node ``root`` (one :class:`~gradalg.plan.jobs.TopKJob`), not its
    full matrix.

    ``device`` (default: where the model's parameters are) prices the plan: a CUDA model
    with its measured or nominal profile (:mod:`gradalg.devices.accelerators`), else the CPU's.
    ``budget`` (default: :func:`gradalg.plan.budget.resolve_budget` now, for that device):
    the plan's ``options.memory_budget`` becomes its bytes, and ``plan.budget`` keeps its
    source; a refusal for memory says both (:func:`gradalg.plan.budget.refusal_note`).
    ``keep_held_rows``: the executor opens each pass's jobs again per shard (its shard
    strategy's ``keeps_held_rows``: Dask, torch.distributed), so every shard reads a
    score's raw held rows and no scores job releases them (the schedule stage)."""
    options = options or get_options()
    simplified, fired = simplify_until_fixpoint(root, enabled=rewrites)
    where = device if device is not None else model_device(simplified)
    prof = profile(where, measure=measure_shapes and options.measure_devices)
    budget = budget or resolve_budget(options, where, prof)
    options = replace(options, memory_budget=budget.bytes)
    lowered = lower(simplified, topk)
    known = find_facts(simplified, options, prof, measure=measure_shapes)
    try:
        graph = decide(lowered, known, choices)
        scheduled = schedule(graph, known, simplified, choices, keep_held_rows)
        try:
            passes, decisions = size(scheduled, known)
        except MemoryBudgetError as err:
            fallback = _recomputed(err, scheduled, graph, known, simplified, choices, keep_held_rows)
            if fallback is None:
                raise
            scheduled, passes, decisions = fallback
    except MemoryBudgetError as err:   # every refusal says where the budget came from and how to change it
        with_note(err, budget, err.fits_under, options.budget_headroom)
        raise
    return Plan(root, simplified, fired, Decisions(decisions), list(passes), scheduled.jobs, list(graph.roots),
                options, prof, set(scheduled.stored), known.dtype, budget,
                {"lower": lowered, "facts": known, "decide": graph, "schedule": scheduled})


def _recomputed(err: MemoryBudgetError, scheduled, graph, known, simplified, choices: Choices | None,
                keep_held_rows: bool):
    """``(schedule, passes, decisions)`` reading the data again for every row set the
    refused schedule stored for a later pass, when storing them is what made a pass exceed
    the memory budget; None when it stored nothing, the caller forced its choice
    (``Choices(store=...)``), or the plan without stored rows is refused too.

    Exact: the later pass recaptures the same rows (the store-or-recompute decision weighs
    only time, under ``ga.options(store_fraction)`` of the budget, not the pass it joins:
    EK-FAC on the Llama-200M shape at T = 512 stored 1.79 GB of factors beside 3.2 GB of
    float64 factor sums and was refused at 7.84 GB, where reading the 4 examples again fits,
    peak 6.14 GB, for one more pass). The plan shows it as a ``STORE`` decision with the
    refusal and the cost of the plan that recomputes."""
    if not scheduled.stored or (choices is not None and choices.store != "auto"):
        return None
    try:
        rescheduled = schedule(graph, known, simplified, replace(choices or Choices(), store="never"), keep_held_rows)
        passes, decisions = size(rescheduled, known)
    except MemoryBudgetError:
        return None
    why = (f"storing them in the pass that reads them made it exceed the memory budget ({err.summary()}); "
           "each is read again where it is needed")
    before = {d.subject: d for d in scheduled.decisions if d.kind == DecisionKind.STORE}

    def shown(d: Decision) -> Decision:       # forced here, not by the user: say why each is read again
        if d.kind != DecisionKind.STORE or d.source is not DecisionSource.CHOICES:
            return d
        if d.subject in scheduled.stored:
            return replace(d, reason="a later job needs these rows after statistics from the same pass; " + why,
                           source=DecisionSource.PLANNER, setting="")
        return before.get(d.subject, d)       # read again anyway (by cost or the store cap)
    decisions = [*map(shown, decisions), Decision(
        DecisionKind.STORE, "memory budget", "recompute",
        {"store": f"refused: {format_bytes(err.needed)} needed",
         "recompute": sum(p.seconds for p in passes)},
        "rows kept for a later pass would not fit beside the pass that reads them; read again instead "
        "(the same rows: exact)", label="rows stored for later passes (under the memory budget)")]
    return rescheduled, passes, decisions


def estimate(node) -> Cost:
    """Estimated total cost of computing ``node`` under the options in force (via its
    plan; nothing is run, measured or read beyond the data's shape)."""
    return plan(node).total
