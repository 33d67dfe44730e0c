"""Stage 3 of planning, **decide**: ``decide(lowered, facts, choices)`` → :class:`JobGraph`,
the jobs keyed by ``(kind, target token)``, each created once with its choices as fields
(held side, storage and kernels: :mod:`gradalg.plan.blocks`; its kernels' ``ga.options``),
their dependencies and the decisions. Per score ``Inner``: hold the side with the smaller
footprint, collect it, stream the other; operators' statistics become jobs.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from ..errors import MemoryBudgetError
from ..expr import GradNode, Inner, NearMinimum, OpNode, Project, ScoreDiagonal
from ..expr.curvature import PROBES
from ..linalg.base import SINGULAR_RTOL
from .choices import Choices
from ..units import format_bytes
from .decisions import Decision, DecisionKind, DecisionSource
from .facts import Facts
from .lower import STATISTICS_JOBS, Lowered, chain, chain_ops, pass_key, stream_root
from .jobs import ApplyJob, CollectJob, DiagJob, Job, ScoresJob, TopKJob, held_application
from .memory import projection_map_decisions, rows_bytes
from .rules import PlanError
from .blocks import as_captured, held_storage, kernels, low_rank_decision, storage, storage_decision, windows_decision

__all__ = ["JobGraph", "decide", "kernel_fields", "refuse_dense_projections"]


@dataclass(frozen=True)
class JobGraph:
    """The jobs of a plan (insertion order), the keys of those that give its result,
    the decisions made so far, and ``stream_deps``: ``{token: keys}`` of the jobs each
    node of a streamed row-wise chain waits for."""

    jobs: dict
    roots: tuple
    decisions: tuple
    stream_deps: dict

    def describe(self) -> str:
        return "\n".join([j.describe() + (f"  after {sorted(k for k, _ in j.deps)}" if j.deps else "")
                          for j in self.jobs.values()] + [f"decision: {d.title()}: {d.chosen}" for d in self.decisions])


def kernel_fields(o) -> dict:
    """The ``ga.options`` a job's kernels run under (token blocks, ghost slices, precision
    of Kronecker factors): the executor reads them from the job."""
    return dict(token_block=o.token_block, slice_elements=o.ghost_slice_elements,
                kron_float64_width=o.kron_float64_width, kron_float32_rtol=o.kron_float32_rtol,
                kron_diagonal_width=o.kron_diagonal_width, buffer_bytes=o.reuse_buffer_bytes)


class _Graph:
    """The jobs as they are added (local to one :func:`decide` call)."""

    def __init__(self, facts: Facts, choices: Choices):
        self.facts, self.choices, self.fields = facts, choices, kernel_fields(facts.options)
        # {key: Job}, [Decision], {token: keys of the jobs it waits for}
        self.jobs, self.decisions, self.deps = {}, [], {}

    def add(self, job: Job) -> tuple:
        if job.key not in self.jobs:
            self.jobs[job.key] = replace(job, **self.fields)
        return job.key

    def stream_deps(self, node: GradNode) -> set:
        """The keys of the jobs that must finish before a pass can stream ``node``: those of
        the operators of its row-wise chain, and those of its stream root's statistics
        (``root.statistics()``: a group mean's group job)."""
        deps = set().union(*(self.op_deps(op, vectors=node.n) for op in chain_ops(node)),
                           *(self.statistic_deps(statistic) for statistic in stream_root(node).statistics()))
        self.deps[node.token] = frozenset(deps)
        return deps

    def op_deps(self, op: OpNode, vectors: int | None = None, windows: bool = True) -> set:
        """The keys of the jobs that must finish before ``op`` resolves: one per statistic
        it needs (``op.statistics()``), each after the jobs its rows need (``vectors``: the
        rows ``op`` is applied to, the vectors of its products per call). ``windows``: it
        reads the rows of an ``"apply"`` statistic in windows (no apply job reads them)."""
        return set().union(*(self.statistic_deps(statistic, vectors, windows) for statistic in op.statistics()))

    def statistic_deps(self, statistic, vectors: int | None = None, windows: bool = True) -> set:
        """The job of one statistic (added), or for a statistic read when applied (no job),
        the jobs its rows need (none for products: they read raw batches); one read by the
        operator in windows (``windows``: no apply job reads them) is a ``WINDOWS`` decision."""
        deps = set().union(self.stream_deps(statistic.rows) if statistic.rows is not None else set(),
                           *(self.statistic_deps(before) for before in statistic.after))
        if statistic.job in (None, "apply"):     # read by the operator when applied (a held side's: ApplyJob)
            if statistic.job == "apply" and windows and all(d.subject != statistic.node.token for d in self.decisions):
                self.decisions.append(windows_decision(statistic.node, statistic.rows, self.facts))
            return deps
        if statistic.job not in STATISTICS_JOBS:
            raise PlanError(f"{statistic.node.label} asks for a statistic of job kind {statistic.job!r}; the planner "
                            f"has jobs {sorted(STATISTICS_JOBS)}: return one of those from its statistics(), or "
                            "Statistic(None, node, rows) for rows it reads itself when applied")
        job = STATISTICS_JOBS[statistic.job].for_statistic(statistic, deps, self.facts.options, vectors)
        if job.key not in self.jobs:
            self.decisions.extend(job.first_decisions(self.facts.options))
        return {self.add(job)}

    def held_side(self, node: Inner, hold: str | None) -> bool:
        """Whether the right (training) side is held: the side with the smaller footprint,
        or as ``hold`` / ``Choices(held=...)`` forces; a recorded decision."""
        hold_left, hold_right = (rows_bytes(x, storage(x, self.facts), self.facts) for x in (node.left, node.right))
        forced = self.choices.held if hold is None else hold
        transposed = forced == "right" or (forced == "auto" and hold_right < hold_left)
        by_user = hold is None and forced != "auto"      # Choices(held=...), not a rule of the planner
        why = ("hold the side with the smaller footprint and stream the other; " if forced == "auto"
               else "" if by_user else "a term of a top-k over a sum: every term streams the training side; ")
        self.decisions.append(Decision(
            DecisionKind.HELD_SIDE, node.token, "right (training) rows" if transposed else "left (query) rows",
            {"hold left": format_bytes(hold_left), "hold right": format_bytes(hold_right)},
            why + "H (symmetric) is applied once to the held rows"
            + ("" if node.op.is_identity else " (precondition the held side)"), label=node.label,
            source=DecisionSource.CHOICES if by_user else DecisionSource.PLANNER,
            setting=f"held={forced!r}" if by_user else ""))
        return transposed

    def score_job(self, node: Inner, hold: str | None = None) -> ScoresJob:
        """The scores job of one ``Inner`` (its held side's collect job added); ``hold``
        forces the held side ("left"), else the planner (or ``Choices(held=...)``) picks it."""
        transposed = self.held_side(node, hold)
        held, streamed = (node.right, node.left) if transposed else (node.left, node.right)
        chosen, decisions = kernels(held, streamed, node, self.facts)
        kept = held_storage(held, chosen, node, self.facts)
        self.decisions += [d for d in (*decisions, storage_decision(held, kept, DecisionKind.HELD_STORAGE, self.facts),
                                       low_rank_decision(held, self.facts)) if d is not None]
        ready = self.stream_deps(held)
        # a job that keeps the held rows already (a group mean's group job) is not copied by a collect pass
        if not any(self.jobs[k].collects(held.token) for k in ready):
            ready = {self.add(CollectJob(held, (held,), ready, storage=kept))}
        applied = self.apply_job(node, held, ready)
        deps = ready | applied | self.op_deps(node.op, held.n, windows=not applied) | self.stream_deps(streamed)
        return ScoresJob(node, (streamed,), deps, held=held, transposed=transposed, held_storage=kept,
                         kernels=chosen, applied=next(iter(applied), None), **self.fields)

    def apply_job(self, node: Inner, held: GradNode, ready: set) -> set:
        """``{key}`` of the :class:`~gradalg.plan.jobs.apply.ApplyJob` that applies
        ``node.op`` to the held rows in a pass over the operator's rows, when the operator
        reads its rows when applied (``Statistic("apply", ...)``: DataInf); else empty."""
        if (statistic := held_application(node.op)) is None:
            return set()
        deps = ready | self.stream_deps(statistic.rows)
        return {self.add(ApplyJob(node, (statistic.rows,), deps, held=held))}

    def topk_job(self, lowered: Lowered) -> list[tuple]:
        """One :class:`TopKJob` for the whole score expression: its terms' score blocks are
        summed per streamed chunk and merged into a running top-k. A sum's terms all hold
        their query side and stream the training side in one pass (summed column blocks)."""
        terms, node, spec = lowered.terms, lowered.root, lowered.topk
        if len(terms) == 1 and terms[0][0] == 1.0:
            jobs = [(1.0, self.score_job(terms[0][1]))]
        else:
            jobs = [(c, self.score_job(t, hold="left")) for c, t in terms]
            if len(keys := {pass_key(j.streams[0], (), self.facts) for _, j in jobs}) > 1:
                raise PlanError(
                    f"the top-k of {node.label} needs every term's training side streamed in one pass, but its "
                    f"terms read {len(keys)} different (model, data) pairs: compute the scores into a store "
                    "(S.compute(store='scores.zarr')) and rank that, or take each term's top-k separately")
        streams = tuple({j.streams[0].token: j.streams[0] for _, j in jobs}.values())   # first of each token
        deps = set().union(*(j.deps for _, j in jobs))
        return [self.add(TopKJob(node, streams, deps, k=spec.k, largest=spec.largest, terms=tuple(jobs)))]

    def diag_job(self, node, inner: Inner) -> tuple:
        deps = self.op_deps(inner.op) | self.stream_deps(inner.left) | self.stream_deps(inner.right)
        if inner.left == inner.right:
            return self.add(DiagJob(node, (inner.left,), deps))
        if pass_key(inner.left, (), self.facts) == pass_key(inner.right, (), self.facts):
            return self.add(DiagJob(node, (inner.left, inner.right), deps))
        deps.add(self.add(CollectJob(inner.left, (inner.left,), self.stream_deps(inner.left),
                                     storage=as_captured(inner.left, self.facts))))
        return self.add(DiagJob(node, (inner.right,), deps, held=inner.left))

    def chains(self) -> None:
        """``stream_deps`` of every node of every streamed row-wise chain (the schedule
        stage asks which prefix of a chain can be stored)."""
        for job in list(self.jobs.values()):
            for x in (x for s in job.streams for x in chain(s) if x.token not in self.deps):
                self.stream_deps(x)


def _roots(g: _Graph, lowered: Lowered) -> list:
    root = lowered.root
    if lowered.result == "topk":
        return g.topk_job(lowered)
    if lowered.result == "scores":
        return [g.add(g.score_job(t)) for _, t in lowered.terms]
    if lowered.result == "diag":
        if len(lowered.terms) == 1 and lowered.terms[0][1] is root.scores:
            return [g.diag_job(root, root.scores)]
        return [g.diag_job(ScoreDiagonal(t), t) for _, t in lowered.terms]
    if lowered.result == "rows":
        return [g.add(CollectJob(root, (root,), g.stream_deps(root), storage=as_captured(root, g.facts)))]
    return sorted(g.op_deps(root))


def refuse_dense_projections(root, budget: float) -> None:
    """Refuse a dense projection (``gaussian``, ``rademacher``) of ``root`` whose matrix is
    over the memory budget: it keeps a (k, dim) float64 matrix in the CPU's memory
    (:mod:`gradalg.proj.matrices`), k·dim·8 bytes against ``budget`` bytes (k = 512
    on a 3 M-coordinate GPT-2 would be 13 GB). The :class:`~gradalg.errors.MemoryBudgetError`
    names the matrix, the budget and the projections without a dense matrix; its ``needed``
    (bytes, the matrix's) lets :func:`~gradalg.plan.planner.plan` say which budget would fit."""
    for x in (x for x in root.walk() if isinstance(x, Project) and x.projector.map == "dense"):
        p, dim = x.projector, x.grads.space.dim
        if (need := p.k * dim * 8) > budget:
            raise MemoryBudgetError(
                f"a dense {p.kind} projection of {dim:,} coordinates to k={p.k}", need, budget,
                parts=[(f"its (k, dim) = ({p.k}, {dim:,}) float64 matrix", need)],
                fixes=[f"a projection without a dense matrix (ga.proj.sparse({p.k}), ga.proj.grass({p.k}), "
                       f"ga.proj.kron({p.k}))", "fewer layers", "raise the memory budget"])


def decide(lowered: Lowered, facts: Facts, choices: Choices | None = None) -> JobGraph:
    """The :class:`JobGraph` of ``lowered`` under ``facts`` (``choices`` forces the held side);
    a dense projection over the memory budget is refused here (:func:`refuse_dense_projections`)."""
    refuse_dense_projections(lowered.root, facts.options.memory_budget)
    g = _Graph(facts, choices or Choices())
    roots = _roots(g, lowered)
    g.decisions += [*projection_map_decisions(lowered.root, facts.options), *near_minimum_decisions(lowered.root)]
    g.chains()
    return JobGraph(g.jobs, tuple(roots), tuple(g.decisions), g.deps)


def near_minimum_decisions(root) -> list[Decision]:
    """A ``CURVATURE`` :class:`~gradalg.plan.decisions.Decision` for each
    :class:`~gradalg.expr.NearMinimum` of ``root`` (``curvature="auto"``'s dense choice): the
    formed Hessian where −μ_min(H̄ + decay) ≤ r × the Gauss-Newton's mean eigenvalue and the
    Hessian damped and shifted to PSD is not singular (:func:`~gradalg.linalg.base.singular`),
    else the Gauss-Newton (:meth:`~gradalg.expr.curvature.NearMinimum._measure_hessian`). Decided when the operator resolves (its numbers are the data's): a plan made
    after that run shows what was chosen with the measured μ_min, scale and ratio
    (:data:`~gradalg.expr.curvature.PROBES`); before it, "decided when run" and the rule."""
    rows = []
    for x in (x for x in root.walk() if isinstance(x, NearMinimum)):
        probe = PROBES.get(x.token)
        rule = (f"near a minimum of its objective (−μ_min(H̄ + decay) ≤ r × tr(G)/dim, r = "
                f"ga.options(hessian_negative_ratio={x.ratio:g}); μ_min bounded first by "
                f"ga.options(hessian_probe_iterations={x.iterations}) Lanczos products, then exact from the formed "
                "Hessian if not ruled out), else the Gauss-Newton; the Gauss-Newton too where the rule picks the "
                "Hessian but the Hessian damped and shifted to PSD, the matrix its inverse takes, is singular "
                f"(smallest eigenvalue ≤ {SINGULAR_RTOL:g} × the largest: damping=0 off an exact minimum), so "
                "'auto' is never refused for it. Force one with curvature='dense_hessian' or 'gauss_newton'")
        alternatives = {"dense_hessian": f"{x.hessian_inv.label} (near a minimum, its damped inverse existing)",
                        "gauss_newton": f"{x.gauss_newton_inv.label} (otherwise)"}
        chosen, why = (("decided when run", "curvature='auto': the formed") if probe is None
                       else (probe.chosen, f"measured: {probe.describe()}; the"))
        rows.append(Decision(DecisionKind.CURVATURE, x.token, chosen, alternatives,
                             f"{why} Hessian where the model is {rule}", label="'auto'"))
    return rows
