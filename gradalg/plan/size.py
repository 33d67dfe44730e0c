"""Stage 5 of planning, **size**: ``size(schedule, facts)`` → ``(passes, decisions)``, each
pass a new record with its batch size (a ``BATCH_SIZE`` decision), whether the runner trims
the resident set after its batches (a ``TRIM`` decision), bytes, cost and seconds,
each job with its cost; memory over the budget is refused before anything runs. Batches are
sized with a released held side counted twice (safe); a pass's bytes are what it leaves.
"""
from __future__ import annotations

from dataclasses import replace

from ..errors import MemoryBudgetError
from ..expr import Precondition, Project, Source
from ..expr.tokens import token_rows
from ..options import CPU_BATCH_TOKENS
from . import estimates
from .cost import Cost, _si, tokens_hint
from .decisions import Decision, DecisionKind, DecisionSource
from .facts import Facts
from .lower import ROW_WISE, chain
from .memory import capture_bytes_per_example, flattened_rows_bytes
from .schedule import Pass, Schedule
from .blocks import as_captured, storage

__all__ = ["size", "table_bytes", "FEWER_QUERIES"]

#: the refusal's fix of a pass whose held (query) rows shrink with fewer queries per call
FEWER_QUERIES = "use fewer queries per call"


def table_bytes(jobs) -> float:
    """Bytes of the index tables of the sparse projections the jobs' streams apply (once each)."""
    return sum({(x.projector, b.name, b.dim): estimates.sparse_table_bytes(x.projector, b)
                for job in jobs for s in job.streams for x in chain(s) if isinstance(x, Project)
                for b in x.grads.space.blocks}.values())


def _batch_tokens(sources: list[Source], options) -> tuple[int, int, int | None]:
    """``(batch_tokens, T, examples)``: the ``batch_tokens`` in force for the pass's
    model (``ga.options``; None: :data:`~gradalg.options.CPU_BATCH_TOKENS` on the CPU,
    no limit elsewhere), the positions T per example of its data (the first
    example's) and the examples per batch that many positions allow,
    ``max(1, ⌈batch_tokens / T⌉)`` (None: no limit)."""
    tokens = options.batch_tokens
    if tokens is None:
        param = next(iter(sources[0].task.model.parameters()), None)
        tokens = CPU_BATCH_TOKENS if param is None or param.device.type == "cpu" else 0
    if not tokens:
        return 0, 1, None
    T = max(tokens_hint(s) for s in sources)
    return tokens, T, max(1, -(-tokens // T))


def _error(p: Pass, needed: float, budget: float, parts, fixes, detail: str = "") -> MemoryBudgetError:
    """The refusal of pass ``p``: ``needed`` bytes at a batch of one (what it holds and one
    example's or one chunk's work, ``parts``, those of 0 bytes left out), over ``budget``,
    ``fixes`` and then a larger budget; :func:`size` raises its ``fits_under`` to what every
    pass of the plan needs."""
    return MemoryBudgetError(p.label, needed, budget, parts=[(what, n) for what, n in parts if n],
                             detail=detail, fixes=[*fixes, "raise the memory budget"])


#: the refusal's arithmetic of an operator's resolution (``resolving`` bytes, :meth:`_Sizer.resolving_bytes`)
_RESOLVING = ("resolving an operator is a d × d eigendecomposition in float64, 32·d² bytes, and 8·d² for a damped "
              "copy, which a smaller projection dimension k shrinks")


def _over_budget(p: Pass, jobs, fixed: float, per_ex: float, budget: float, facts: Facts, resolving: float,
                 held_alone: bool) -> MemoryBudgetError:
    """The refusal of a pass holding ``fixed`` bytes (``resolving`` of them an operator's
    resolution) beside ``per_ex`` of work at a batch of one, by part. ``held_alone``: what it
    holds is over the budget alone (its fixes: fewer queries first; the jobs' arithmetic of
    their bytes in the detail), else only with one example (projecting first).

    "Use fewer queries per call" is offered only where holding fewer rows can fit the pass,
    and "project to a smaller k" only where an operator's resolution is counted. What the jobs
    that do not shrink with the queries hold (``Job.shrinks_with_queries`` False: the
    statistics, K-FAC / EK-FAC factors or a formed Fisher; the rows stored for a second use
    of the streamed side, the training rows of a pass over the training data) and the
    projection tables do not shrink with the queries, so when they and one
    example exceed the budget alone, that fix would fail as written and the refusal does
    not offer it; nor does an operator's resolution. (Found at real size: EK-FAC influence
    on a Llama shape at T = 512 was told to use fewer queries while holding one.)"""
    tables = table_bytes(jobs)
    kept = sum(j.fixed_bytes(facts) for j in jobs if not j.shrinks_with_queries)
    fewer = FEWER_QUERIES if kept + tables + resolving + per_ex <= budget else ""
    smaller, project = "project to a smaller k" if resolving else "", "project the gradients (ga.proj.kron)"
    work = "one example's factors and activations" if p.reads_data else "its work on one chunk"
    parts = [("held rows and statistics", fixed - tables - resolving), ("sparse projection tables", tables),
             ("resolving an operator", resolving), (work, per_ex)]
    fixes = [fewer, smaller, project] if held_alone else [project, smaller, fewer]
    arithmetic = [j.bytes_arithmetic(facts) for j in jobs] if held_alone else []
    detail = "; ".join(a for a in [*arithmetic, _RESOLVING if resolving else ""] if a)
    return _error(p, fixed + per_ex, budget, parts, fixes, detail)


def _batch_size(p: Pass, sources, fixed: float, per_ex: float, facts: Facts,
                resolving: float = 0.0) -> tuple[int, str, Decision]:
    """``(batch size, note, BATCH_SIZE decision)`` of a pass over data: the data's own
    batch size, else the smallest of ``ga.options(batch_size)``, what fits the memory
    budget beside ``fixed`` held bytes at ``per_ex`` bytes per example, and
    ``batch_tokens`` over the positions per example; at most the pass's n examples
    (:meth:`~gradalg.data.DataRef.largest_batch`: the largest batch it reads, what its
    memory and per-batch work are priced at: 4 queries in batches of 16 hold 4)."""
    data, o, budget = sources[0].data, facts.options, facts.options.memory_budget
    few = f"; the pass has {data.n:,} examples: one batch holds them all"
    if (own := data.fixed_batch_size) is not None:
        batch = data.largest_batch(own)
        return batch, "batch size fixed by the data", Decision(
            DecisionKind.BATCH_SIZE, p.key, str(batch), {"the data's": str(own), "ga.options": str(o.batch_size)},
            "fixed by the data (a batching DataLoader, the largest batch of its batch_sampler, or "
            "ga.grads(..., batch_size=...))" + (few if batch < own else ""), label=p.label)
    if budget - fixed < per_ex:  # not even a batch of one example fits next to the held rows
        if per_ex > budget:   # one example alone: projecting or fewer queries shrinks only the held rows
            T = max(tokens_hint(s) for s in sources)
            raise _error(p, fixed + per_ex, budget, [(f"one example's factors and activations ({T:,} positions)",
                                                      per_ex), ("held rows and statistics", fixed)],
                         ["use shorter sequences (one example's factors and activations grow with its "
                          "positions, not with the queries or a projection)"])
        raise _over_budget(p, p.jobs, fixed, per_ex, budget, facts, resolving, held_alone=False)
    fit = int((budget - fixed) // max(per_ex, 1.0))
    tokens, T, by_tokens = _batch_tokens(sources, o)
    limit = max(1, min(o.batch_size, fit, by_tokens or o.batch_size))
    batch = data.largest_batch(limit)
    note = "" if limit >= o.batch_size or batch < limit else (
        f"batch size {batch} (not {o.batch_size}) " + ("to stay under the memory budget" if batch == fit else
                                                      f"of {T} positions each: {tokens} positions per batch "
                                                      "(ga.options(batch_tokens))"))
    alternatives = {"ga.options": str(o.batch_size), "largest under the budget": f"{fit:,}"}
    if by_tokens:
        alternatives[f"batch_tokens {tokens} / T {T}"] = f"{by_tokens:,}"
    return batch, note, Decision(
        DecisionKind.BATCH_SIZE, p.key, str(batch), alternatives,
        f"the smallest: {_si(fixed)}B held and {_si(per_ex)}B per example under the memory budget of {_si(budget)}B"
        + (f"; batches of {tokens} positions already run efficient GEMMs, and fewer examples keep "
           "the activations small" if by_tokens and batch == by_tokens < fit else "")
        + (few if batch < limit else ""), label=p.label)


def _trim(p: Pass, per_ex: float, batch: int, options) -> tuple[bool, Decision]:
    """``(trim, TRIM decision)`` of a pass over data read in batches of ``batch`` at
    ``per_ex`` bytes per example: free memory is returned to the system after its batches
    (:class:`~gradalg.exec.allocator.ResidentGuard`: when the pass's resident growth passes
    ``ga.options(release_growth)`` times its first batch's, and once after the pass) when its planned
    working set per batch, ``per_ex · batch`` (``batch``: the largest it reads, at most its
    examples: :func:`_batch_size`), is at least ``ga.options(release_memory_above)``
    (a smaller batch frees too little to be worth the call, which walks the whole heap).
    ``release_memory_above`` 0 or infinite forces the answer for every pass (source ``OPTIONS``)."""
    above, work = options.release_memory_above, per_ex * batch
    trim = work >= above
    forced = above in (0.0, float("inf"))
    chosen = "after each batch" if trim else "never"
    return trim, Decision(
        DecisionKind.TRIM, p.key, chosen,
        {"after each batch": f"the pass's resident growth past {options.release_growth:g}× its first batch's (release_growth), "
                             "and once after the pass", "never": "freed pages kept for the next batch"},
        f"its working set, {_si(work)}B per batch ({_si(per_ex)}B per example × {batch}), is "
        f"{'at least' if trim else 'under'} release_memory_above = {_si(above)}B", label=p.label,
        source=DecisionSource.OPTIONS if forced else DecisionSource.PLANNER,
        setting=f"release_memory_above={above:g}" if forced else "")


class _Sizer:
    """Sizes the passes of one schedule in order (local to one :func:`size` call): what an
    earlier pass draws (dense projections) or resolves (operators) is not counted again;
    rows in memory are read in the chunks they were stored in."""

    def __init__(self, schedule: Schedule, facts: Facts):
        self.schedule, self.facts = schedule, facts
        self.drawn, self.resolved, self.stored_chunks, self.decisions = set(), set(), {}, []

    def layout(self, node, reads_data: bool) -> dict:
        """``{block: "factors" | "flat"}`` of ``node``'s rows as a pass delivers them: as
        collected (a pass over rows in memory), else as captured or Kronecker-projected."""
        kept = None if reads_data else self.schedule.jobs.get(("collect", node.token))
        return dict(kept.storage) if kept is not None and kept.storage else as_captured(node, self.facts)

    def per_example_bytes(self, jobs, sources) -> float:
        total, forwards = 0.0, set()
        for src in sources:   # sources sharing one forward per batch keep its activations once
            key = self.facts.share_key(src)
            total += capture_bytes_per_example(src, self.facts, forward_shared=key is not None and key in forwards)
            forwards.add(key)
        return (total + sum(job.per_example_bytes(self.facts) for job in jobs)
                + flattened_rows_bytes([s for job in jobs for s in job.streams], self.facts.dtype))

    def resolving_bytes(self, jobs) -> float:
        """The working set of the operators this pass applies and no earlier pass resolved
        (:func:`~gradalg.plan.estimates.resolve_bytes`: a dense or block inverse or power,
        (32 + 8)·d² when damped; TrackStar's R^{-1/2} at k = 4096 takes 0.67 GB), the largest: they are
        resolved one at a time, beside what the pass holds: the preconditioners of the
        jobs' streams and the operators their kernels apply (``Job.applied_ops``)."""
        ops = [x.op for job in jobs for s in job.streams for x in s.walk() if isinstance(x, Precondition)]
        ops += [op for job in jobs for op in job.applied_ops()]
        return max((estimates.resolve_bytes(op) for op in ops if op.token not in self.resolved), default=0.0)

    def rowwise_cost(self, jobs, n: int, chunk, base: set, reads_data: bool) -> Cost:
        """The row-wise transforms the pass derives from the rows it reads (``base``: their
        tokens, when the pass reads rows in memory), each distinct one once."""
        seen, cost = set(), Cost()
        for job in jobs:
            for x in job.fed:   # a normalization the score kernel applies: fed the rows below it
                while isinstance(x, ROW_WISE) and x.token not in base and x.token not in seen:
                    seen.add(x.token)
                    cost = cost + estimates.rowwise_cost(
                        x, n * token_rows(x), chunk, self.layout(x.grads, reads_data),
                        self.facts.elem, self.facts.options, self.drawn, self.resolved, self.facts.shapes)
                    x = x.grads
        return cost

    def size_per_call(self, p: Pass) -> Pass:
        """A products pass (:attr:`Pass.per_call`): its job's bound on the calls times one
        call (:meth:`~gradalg.plan.jobs.products.ProductsJob.stream_cost`), in batches of
        the job's ``batch`` (``ga.options(batch_size)``, as the products read their data; at
        most the data's examples, its own batch where it fixes one), its vectors held beside
        one batch's activations. Not refused for memory: the
        products have always run at that batch size."""
        facts, dtype, job = self.facts, self.facts.dtype, p.jobs[0]
        job = replace(job, cost=job.stream_cost(0, None, facts, None))
        fixed, per_ex = job.fixed_bytes(facts), job.per_example_bytes(facts)
        batch = job.target.data.largest_batch(job.batch)
        cost = replace(job.cost, peak_bytes=fixed + per_ex * batch, passes=float(job.calls))
        return replace(p, jobs=[job], batch_size=batch, cost=cost, seconds=cost.seconds(self.facts.device, dtype),
                       per_example_bytes=per_ex, fixed_bytes=fixed,
                       note=f"run by its solver, one pass per call: the estimate is for {job.calls:,} calls")

    def size_pass(self, p: Pass) -> Pass:
        if p.per_call:
            return self.size_per_call(p)
        facts, dtype, o = self.facts, self.facts.dtype, self.facts.options
        sizing = [j.keeping_held_rows() for j in p.jobs]
        sources = p.sources() if p.reads_data else []
        per_ex = self.per_example_bytes(sizing, sources)
        resolving = self.resolving_bytes(sizing)
        fixed = sum(job.fixed_bytes(facts) for job in sizing) + table_bytes(sizing) + resolving
        if fixed > o.memory_budget:    # held rows and statistics alone: refused before anything runs
            raise _over_budget(p, sizing, fixed, per_ex, o.memory_budget, facts, resolving, held_alone=True)
        batch, note, cost, trim = None, "", Cost(), False
        if p.reads_data:
            batch, note, decision = _batch_size(p, sources, fixed, per_ex, facts, resolving)
            trim, trimmed = _trim(p, per_ex, batch, o)
            self.decisions += [decision, trimmed]
            cost = estimates.pass_capture_cost(sources, o, dtype, facts.share_key, batch, facts.device)
            n, chunk = sources[0].data.n, batch
            self.stored_chunks.update({j.target.token: batch for j in p.jobs if j.streamed_back})
        else:
            n, chunk = p.jobs[0].streams[0].n, self.stored_chunks.get(p.key.rows)
        cost = cost + estimates.pass_overhead(len(p.jobs), n if p.reads_data else 0, per_ex, p.reads_data, facts.device)
        # each job's cost, for the rows it streams: n·T for per-token rows (ga.GradientSet.per_token)
        layout, kept = (lambda node: self.layout(node, p.reads_data)), (lambda node: storage(node, facts))
        jobs = [replace(job, cost=job.stream_cost(job.streams[0].n if job.streams and p.reads_data else n,
                                                  chunk or o.batch_size, facts, layout, kept, o, self.resolved))
                for job in p.jobs]
        cost = sum((job.cost for job in jobs), cost)
        cost = cost + self.rowwise_cost(jobs, n, chunk, set() if p.reads_data else {p.key.rows}, p.reads_data)
        # what the jobs sized holding their raw held rows release once preconditioned
        drop = sum(a.fixed_bytes(facts) - b.fixed_bytes(facts) for a, b, j in zip(sizing, jobs, p.jobs) if a is not j)
        drop = drop if drop > 0 else 0.0
        # one read of the data, however many sources are captured from each batch
        cost = replace(cost, peak_bytes=fixed + per_ex * (batch or 1) - drop, passes=1.0 if p.reads_data else 0.0)
        if cost.peak_bytes > o.memory_budget:   # a pass over rows in memory: its chunk beside what it holds
            raise _error(p, cost.peak_bytes, o.memory_budget,
                         [("held rows and statistics", fixed - drop), ("its work on one chunk", per_ex)],
                         ["project the gradients (ga.proj.kron)"])
        return replace(p, jobs=jobs, batch_size=batch, trim_after_batches=trim, note=note, cost=cost,
                       seconds=cost.seconds(facts.device, dtype), per_example_bytes=per_ex, fixed_bytes=fixed - drop)


def size(schedule: Schedule, facts: Facts) -> tuple[tuple, tuple]:
    """``(sized passes, decisions)`` of ``schedule`` under ``facts``.

    A pass over the budget is refused (:class:`~gradalg.errors.MemoryBudgetError`, ``needed``
    what that pass needs at a batch of one); its ``fits_under`` is the smallest budget under
    which EVERY pass fits (each at a batch of one:
    what it holds plus one example's or one chunk's work), so that the budget the refusal
    suggests plans as written, not only past the pass that was refused first."""
    sizer = _Sizer(schedule, facts)
    try:
        passes = tuple(sizer.size_pass(p) for p in schedule.passes)
    except MemoryBudgetError as err:
        err.fits_under = max(err.fits_under or 0.0, _needed(schedule, facts))
        raise
    return passes, schedule.decisions + tuple(sizer.decisions)


def _needed(schedule: Schedule, facts: Facts) -> float:
    """The smallest budget every pass of ``schedule`` fits in: the largest of each pass's
    held bytes plus one example's (or one chunk's) working bytes, sized without a budget."""
    unlimited = replace(facts, options=replace(facts.options, memory_budget=2**62))
    sizer = _Sizer(schedule, unlimited)
    return max((p.fixed_bytes + p.per_example_bytes for p in map(sizer.size_pass, schedule.passes)), default=0.0)
