"""Stage 4 of planning, **schedule**: ``schedule(graph, facts, target, choices)`` →
:class:`Schedule`, the job graph as ordered passes. A job runs once its dependencies have
finished; ready jobs over the same (task, data) share a pass. Rows a later job needs after
statistics from the same data are stored if that costs less than a second read (``STORE``).
Per pass: where ``G.normalize()`` is normalized, and which preconditioned scores jobs
release their raw held rows (new job records).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..expr import Source
from . import estimates
from .choices import Choices
from .cost import Cost
from .decide import JobGraph
from ..units import format_bytes
from .decisions import Decision, DecisionKind, DecisionSource
from .facts import Facts
from .lower import ROW_WISE, chain_contains, chain_ops, pass_key, stream_root
from .jobs import StoreJob
from .memory import rows_bytes
from .passkeys import PassKey
from .rules import PlanError
from .blocks import storage, storage_decision, store_cap

__all__ = ["Pass", "Schedule", "schedule", "store_cap"]


@dataclass(frozen=True)
class Pass:
    """One read of a dataset (or of rows kept in memory) feeding several jobs; the size
    stage gives it a batch size, cost, seconds and bytes (a new record). ``key``: what it
    reads (:mod:`~gradalg.plan.passkeys`).

    ``batch_size``: the examples per batch the pass reads its data in (a ``BATCH_SIZE``
    decision; a products pass: its job's per call), its largest real batch: at most its
    examples (:meth:`~gradalg.data.DataRef.largest_batch`), what its peak is priced at; never None once sized for a pass that
    reads data; None for a pass that reads no data (rows in memory or a store, read in the
    chunks they were kept in). ``trim_after_batches``: after each batch the runner returns
    free memory to the system when the resident set has grown
    (:class:`~gradalg.exec.allocator.ResidentGuard`), and once after the pass (a ``TRIM``
    decision); False for a pass that captures no batches."""

    key: PassKey
    jobs: list
    batch_size: int | None = None
    trim_after_batches: bool = False
    cost: Cost = field(default_factory=Cost)
    seconds: float = 0.0
    per_example_bytes: float = 0.0
    fixed_bytes: float = 0.0
    note: str = ""

    @property
    def label(self) -> str:
        return self.key.label

    @property
    def reads_data(self) -> bool:
        """A pass over data captured once when the plan runs (a products pass reads its
        data on each call of its solver instead: :attr:`per_call`)."""
        return self.key.reads_data

    @property
    def per_call(self) -> bool:
        """A products pass: run on each call of the solver that uses it, not when the plan runs."""
        return self.key.per_call

    def sources(self) -> list[Source]:
        """The distinct sources its jobs' streams read, in the order the jobs name them (the
        same order on every process: the size stage prices them, executors iterate them)."""
        return list(dict.fromkeys(root for job in self.jobs for s in job.streams
                                  if isinstance(root := stream_root(s), Source)))

    def models(self) -> list:
        """The distinct models of its sources (and of a products pass's target), in the
        order the jobs name them."""
        tasks = [src.task for src in self.sources()] + ([self.jobs[0].target.task] if self.per_call else [])
        return list({id(task.model): task.model for task in tasks}.values())

    def operators(self) -> list:
        """The operators the row-wise chains of its jobs' streams apply, in order."""
        return [op for job in self.jobs for s in job.streams for op in chain_ops(s)]


@dataclass(frozen=True)
class Schedule:
    """The passes in order (unsized), the tokens of rows stored for a later pass, the jobs
    as scheduled (``{key: job}``) and every decision so far."""

    passes: tuple
    stored: frozenset
    jobs: dict
    decisions: tuple

    def describe(self) -> str:
        return "\n".join(f"{i + 1}. {p.label}: " + "; ".join(j.describe() for j in p.jobs)
                         for i, p in enumerate(self.passes))


def _defer_held(ready: list, remaining: dict, done: set, stored: set, facts: Facts) -> list:
    """Ready jobs to run in this wave, less the collections of held rows that can wait.

    A held side collected in a pass of its own (no other ready job reads its data) is
    collected in the last wave before its scores job can run: the rows are not carried
    through the passes that build the preconditioner (EK-FAC's covariance and correction
    passes would otherwise hold the query gradients)."""
    keys = {j.key: job_pass_key(j, stored, facts) for j in ready}
    after = done | set(keys)

    def waits(j) -> bool:
        if not (j.can_wait() and len(ready) > 1 and list(keys.values()).count(keys[j.key]) == 1):
            return False
        consumers = [c for c in remaining.values() if j.key in c.deps]
        return bool(consumers) and all(not (c.deps - {j.key}) <= after for c in consumers)
    return [j for j in ready if not waits(j)] or ready


def job_pass_key(job, stored, facts) -> PassKey:
    """The key of the pass ``job`` runs in: its own (``job.pass_key()``: products), else
    the pass that reads its first stream."""
    return job.pass_key() or pass_key(job.streams[0], stored, facts)


def _store_or_recompute(node, remaining: dict, facts: Facts, choices: Choices,
                        already: float = 0.0) -> tuple[str, Decision, dict]:
    """``(choice, decision, storage)``: store ``node``'s rows in this pass, or read the
    data again, whichever costs less (writing and reading the rows once vs recapturing).
    ``already``: bytes of the rows this pass already stores; the cap bounds their sum
    (before, each node's rows alone: EK-FAC on a Pythia-160M shape at T = 512 stored two
    sets of 1.2 GB under a 1.34 GB cap and was refused where recomputing one fit)."""
    need = frozenset(node.space.names) if any(
        j.reads_stored_factors and any(chain_contains(s, node) for s in j.streams) for j in remaining.values()) \
        else frozenset()   # a later job reads the rows as factors (K-FAC's covariances of A and D)
    kept = storage(node, facts, need)
    size = rows_bytes(node, kept, facts)
    src, o = stream_root(node), facts.options
    recompute = estimates.capture_cost(src, o, facts.dtype, device=facts.device).seconds(facts.device, facts.dtype) \
        if isinstance(src, Source) else 0.0
    fits = already + size <= o.store_fraction * o.memory_budget
    keep = 2.0 * size / facts.device.bandwidth     # write the rows once, read them once
    choice = "store" if fits and keep <= recompute else "recompute"
    why = (f"fits under the store cap, {store_cap(o)}, and costs less than reading the data again"
           if choice == "store" else f"would exceed the store cap, {store_cap(o)}" if not fits else
           f"fits under the store cap, {store_cap(o)}, but moving the rows costs more than recapturing them")
    if forced := (choices.store != "auto"):   # Choices(store=...): the user's, not the cost's
        choice = "store" if choices.store == "always" else "recompute"
    return choice, Decision(
        DecisionKind.STORE, node.token, choice,
        {"store": keep if fits else f"{format_bytes(already + size - o.store_fraction * o.memory_budget)} "
                                    "over the limit", "recompute": recompute},
        "a later job needs these rows after statistics from the same pass"
        + ("" if forced else "; storing them " + why),
        label=repr(node.label), source=DecisionSource.CHOICES if forced else DecisionSource.PLANNER,
        setting=f"store={choices.store!r}" if forced else ""), kept


def _stores(key, group, remaining, done, stored, graph: JobGraph, facts, choices, decisions) -> list:
    """Store jobs for rows that a later job on this same data will need, when cheaper than
    re-reading (``stored`` gains their tokens). A later job whose rows depend on this
    pass's statistics (a metric-normalized or preconditioned side) can still reuse the
    part of its row-wise chain that does not: that prefix is stored, and the later pass
    derives the rest from memory."""
    if not key.reads_data:
        return []
    out, group_keys, kept_bytes = [], {j.key for j in group}, 0.0
    for job in list(remaining.values()):
        if job.key in group_keys or job.deps <= done:
            continue
        if (refused := job.store_refused()) is not None:    # a top-k whose terms stream several nodes
            decisions.append(refused)
            continue
        for node in job.streams:
            # the longest row-wise prefix computable now: for P(G).normalize(metric=H⁻¹)
            # with H from this pass, the projected rows P(G) (RelatIF's training side)
            while isinstance(node, ROW_WISE) and not graph.stream_deps[node.token] <= done:
                node = node.grads
            if node.token in stored or pass_key(node, stored, facts) != key \
                    or not graph.stream_deps[node.token] <= done:
                continue
            choice, decision, kept = _store_or_recompute(node, remaining, facts, choices, kept_bytes)
            decisions.append(decision)
            if choice == "store":
                kept_bytes += rows_bytes(node, kept, facts)
                stored.add(node.token)
                decisions += [d for d in [storage_decision(node, kept, DecisionKind.STORED_STORAGE, facts)] if d]
                out.append(StoreJob(node, (node,), set(), storage=kept))
    return out


def _waves(graph: JobGraph, facts: Facts, choices: Choices, decisions: list) -> tuple[list, set]:
    """``([(pass key, jobs)], stored tokens)``: the jobs grouped into passes, in order."""
    remaining, done, stored, passes = dict(graph.jobs), set(), set(), []
    for _ in range(4 * len(graph.jobs) + 4):
        if not remaining:
            break
        ready = [j for j in remaining.values() if j.deps <= done]
        if not ready:
            raise PlanError(f"circular job dependencies among {sorted(remaining)}")
        groups: dict[PassKey, list] = {}
        for j in _defer_held(ready, remaining, done, stored, facts):
            groups.setdefault(job_pass_key(j, stored, facts), []).append(j)
        for key, group in groups.items():
            passes.append((key, group + _stores(key, group, remaining, done, stored, graph, facts, choices,
                                                decisions)))
            for j in group:
                remaining.pop(j.key, None)
        done |= {j.key for g in groups.values() for j in g}
    else:
        raise PlanError("the scheduling stage did not converge")
    return passes, stored


def _normalized(job, key: PassKey, decisions: list):
    """``job`` with it decided where a streamed side ``G.normalize()`` is normalized
    (:meth:`~gradalg.plan.jobs.base.Job.normalized`): in the score kernel, each column
    divided by its row's norm (⟨h, g/‖g‖⟩ = ⟨h, g⟩/‖g‖, the norm taken from rows the kernel
    reads anyway), when the pass reads G or something below it; row-wise when the
    normalized rows themselves are kept in memory."""
    def decide(s, scores) -> bool:
        inside = key.kept != s.token
        decisions.append(Decision(
            DecisionKind.NORMALIZATION, s.token, "in the score kernel" if inside else "row-wise",
            {"in the score kernel": "⟨h, g⟩/‖g‖ per column", "row-wise": "g/‖g‖ per row, then ⟨h, ·⟩"},
            "the normalized rows are kept in memory: read as they are" if not inside else
            "the pass reads the rows before normalization: each column is divided by its row's norm, "
            "from the rows the kernel reads (ghost blocks by their factors)",
            label=f"{s.label!r} in {scores.target.label}"))
        return inside
    return job.normalized(decide)


def released(jobs, passes, target) -> set:
    """Keys of the preconditioned scores jobs whose held rows nothing else reads (no other
    job, not the job's own streamed side, no pass over rows kept in memory) and the plan
    does not return: the run drops the raw rows once the preconditioned copy exists
    (EK-FAC influence on GPT-2: the raw query gradients were 20 % of the peak)."""
    jobs = list(jobs)
    from_memory = {key.kept for key, _ in passes} - {None}
    def reads(j, job, token) -> bool:
        return not j.collects(token) and (
            any(stream_root(s).token == token or s.token == token for s in j.streams)
            or (j is not job and j.held is not None and j.held.token == token))
    return {job.key for job in jobs if job.can_release_held() and job.held is not target
            and job.held.token not in from_memory and not any(reads(j, job, job.held.token) for j in jobs)}


def schedule(graph: JobGraph, facts: Facts, target, choices: Choices | None = None,
             keep_held_rows: bool = False) -> Schedule:
    """The :class:`Schedule` of ``graph`` (``target``: the simplified root, whose own held
    rows a plan returns and so never releases; ``keep_held_rows``: the executor opens the
    jobs again per shard, each reading the raw held rows: none are released)."""
    decisions = list(graph.decisions)
    waves, stored = _waves(graph, facts, choices or Choices(), decisions)
    release = set() if keep_held_rows else released(graph.jobs.values(), waves, target)
    passes = [Pass(key, [replace(j, release_held=True) if j.key in release else j
                         for j in (_normalized(j, key, decisions) for j in group)]) for key, group in waves]
    jobs = {j.key: j for p in passes for j in p.jobs}
    jobs = {k: jobs.get(k, j) for k, j in graph.jobs.items()}
    return Schedule(tuple(passes), frozenset(stored), jobs, tuple(decisions))
