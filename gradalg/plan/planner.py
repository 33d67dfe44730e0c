"""The planner: expression → simplified → costed → physical plan.

Stages
------
``logical``     the expression as the user wrote it
``simplified``  rewrite rules (:mod:`gradalg.plan.rules`) applied to a fixpoint
``costed``      every choice made with its alternatives and their estimated costs:
                which side of a score is held (and preconditioned), ghost vs dense
                kernel per block, store vs recompute for data used by two passes,
                chunk sizes under the memory budget
``physical``    an ordered list of :class:`Pass` es; each pass reads one dataset once
                and feeds every job that can run in it (curvature statistics,
                collections, scores against an already-preconditioned held side)

Jobs
----
``collect``  keep all rows of a gradient node (a held side, or stored data)
``group``    accumulate group means (GroupMean)
``fisher``   accumulate Σ g gᵀ (dense / block / diag)
``kfac``     accumulate Kronecker factors; ``ekfac`` the eigenvalue correction (a
             second pass: it needs the eigenbasis)
``scores``   inner products of the streamed side with the held side
``diag``     self-scores, both sides streamed in lockstep

A job can run in a pass when the jobs it depends on have finished; jobs over the same
(task, data) run in the same pass. When a job must wait for statistics computed from
the data it streams (a Fisher before scoring against the same training set), the
planner stores the streamed rows in the first pass if they fit the memory budget and
cost less than a second pass — otherwise it reads the data again.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
from torch.utils.data import DataLoader

from ..capture.factors import dense_flops, ghost_flops
from ..capture.hooks import forward_share_key
from ..expr import (KFAC, AdamPrecondition, Arnoldi, Captured, Damp, DataInf, Fisher, GradNode, GroupMean, Identity, Inner, Inverse, Node, Normalize, OpNode, PerToken, Power,
                    Precondition, Project, ScaledOp, ScaleRows, ScoreDiagonal, ScoreNode, ScoreSum, Select,
                    Source, SumOp)
from ..errors import MemoryBudgetError
from ..expr.tokens import token_rows
from ..options import Options, get_options
from .choices import Choices
from . import estimates
from .cost import Cost, _si, fisher_cost, tokens_hint
from .devices import DeviceProfile, profile
from .shapes import forward_shapes
from .memory import capture_bytes_per_example, consumer_bytes_per_example, kron_bytes, positions, rows_bytes
from .rules import Firing, PlanError, simplify_until_fixpoint

__all__ = ["Job", "Pass", "Decision", "Plan", "plan", "estimate", "stream_root", "PlanError"]

ROW_WISE = (Project, Normalize, Select, Precondition, ScaleRows, AdamPrecondition, PerToken)
#: block kinds whose positions per example depend on the layer (unfolded convolutions)
#: rather than on the data's token length
CONV_KINDS = ("conv1d_nn", "conv2d", "conv3d")


# ------------------------------------------------------------------ graph helpers
def stream_root(node: GradNode) -> GradNode:
    """The node whose chunks a pass iterates to produce ``node`` row by row."""
    while isinstance(node, ROW_WISE):
        node = node.grads
    return node


def chain_ops(node: GradNode) -> list[OpNode]:
    """Operators used by the row-wise chain from ``node`` down to its stream root."""
    ops = []
    while isinstance(node, ROW_WISE):
        if isinstance(node, Precondition):
            ops.append(node.op)
        elif isinstance(node, Normalize) and node.op is not None:
            ops.append(node.op)
        node = node.grads
    return ops


# ------------------------------------------------------------------ plan records
@dataclass
class Job:
    kind: str
    target: Node
    streams: tuple[GradNode, ...] = ()
    deps: set = field(default_factory=set)
    held: GradNode | None = None
    transposed: bool = False
    kernels: dict = field(default_factory=dict)
    storage: dict = field(default_factory=dict)

    @property
    def key(self) -> str:
        return f"{self.kind}:{self.target.token}"

    def describe(self) -> str:
        what = self.target.label
        if self.kind == "scores":
            side = "rows" if not self.transposed else "columns"
            return f"scores ({what}) streaming {self.streams[0].label!r}, held {side}: {self.held.label!r}"
        if self.kind in ("collect", "store"):
            return f"{self.kind} {what!r} ({self.target.n:,} rows)"
        return f"{self.kind} {what}"


@dataclass
class Pass:
    """One read of a dataset (or of rows kept in memory) feeding several jobs."""

    key: tuple
    jobs: list[Job]
    batch_size: int | None = None
    cost: Cost = field(default_factory=Cost)
    seconds: float = 0.0
    per_example_bytes: float = 0.0
    fixed_bytes: float = 0.0
    note: str = ""

    @property
    def label(self) -> str:
        kind = self.key[0]
        if kind == "data":
            return f"pass over {self.key[3]} ({self.key[4]:,} examples)"
        if kind == "captured":
            return "pass over captured rows"
        return "pass over rows in memory"

    @property
    def reads_data(self) -> bool:
        return self.key[0] == "data"


@dataclass
class Decision:
    """A choice the planner made: the winner, every alternative and its estimated seconds."""

    what: str
    chosen: str
    alternatives: dict  # name -> seconds (or a string when not costed)
    why: str = ""


@dataclass
class Plan:
    """The planner's output: every stage, the decisions and the physical passes."""

    logical: Node
    simplified: Node
    fired: list[Firing]
    decisions: list[Decision]
    passes: list[Pass]
    jobs: dict
    roots: list[str]
    options: Options
    device: DeviceProfile
    stored: set
    dtype: torch.dtype = torch.float32

    @property
    def total(self) -> Cost:
        total = Cost()
        for p in self.passes:
            total = total + p.cost
        return total

    @property
    def seconds(self) -> float:
        return sum(p.seconds for p in self.passes)

    @property
    def peak_bytes(self) -> float:
        return max([p.fixed_bytes + p.per_example_bytes * (p.batch_size or 1) for p in self.passes] or [0.0])

    @property
    def data_passes(self) -> int:
        return sum(1 for p in self.passes if p.reads_data)

    def decision(self, what_prefix: str) -> Decision:
        for d in self.decisions:
            if d.what.startswith(what_prefix):
                return d
        raise KeyError(f"no decision about {what_prefix!r}; decisions: {[d.what for d in self.decisions]}")


# ------------------------------------------------------------------ the planner
class _Planner:
    def __init__(self, options: Options, device: DeviceProfile, choices: Choices | None = None):
        self.options = options
        self.choices = choices or Choices()
        self.device = device
        self.jobs: dict[str, Job] = {}
        self.decisions: list[Decision] = []
        self.dtype = torch.float32

    # ---- jobs -------------------------------------------------------------------
    def add(self, job: Job) -> str:
        if job.key not in self.jobs:
            self.jobs[job.key] = job
        return job.key

    def stream_deps(self, node: GradNode) -> set:
        deps = set()
        for op in chain_ops(node):
            deps |= self.op_deps(op)
        root = stream_root(node)
        if isinstance(root, GroupMean):
            deps.add(self.add(Job("group", root, (root.grads,), self.stream_deps(root.grads))))
        return deps

    def op_deps(self, op: OpNode) -> set:
        if isinstance(op, Fisher):
            return {self.add(Job("fisher", op, (op.grads,), self.stream_deps(op.grads)))}
        if isinstance(op, KFAC):
            first = self.add(Job("kfac", op, (op.grads,), self.stream_deps(op.grads)))
            if not op.eigen_correction:
                return {first}
            return {self.add(Job("ekfac", op, (op.grads,), {first} | self.stream_deps(op.grads)))}
        if isinstance(op, (Damp, Inverse, Power, ScaledOp, Arnoldi)):
            return self.op_deps(op.op)
        if isinstance(op, SumOp):
            out = set()
            for child in op.ops:
                out |= self.op_deps(child)
            return out
        if isinstance(op, DataInf):
            return self.stream_deps(op.grads)
        return set()  # Identity, Diagonal, Dense, CurvatureProducts: nothing to precompute

    def score_jobs(self, node: ScoreNode) -> list[str]:
        if isinstance(node, ScoreSum):
            keys = []
            for t in node.terms:
                keys.extend(self.score_jobs(t))
            return keys
        if not isinstance(node, Inner):
            raise PlanError(f"cannot plan scores of {type(node).__name__}")
        for side in (node.left, node.right):
            src = stream_root(side)
            if isinstance(src, Source) and src.objective == "expected":
                raise ValueError("gradients with objective='expected' have one row per term of the "
                                 "Gauss-Newton decomposition, not per example: use them for curvature "
                                 "(ga.fisher, ga.kfac) only")
        held, streamed, transposed = node.left, node.right, False
        hold_left = self._held_bytes(node.left)
        hold_right = self._held_bytes(node.right)
        forced = self.choices.held
        if (forced == "right") or (forced == "auto" and hold_right < hold_left):
            held, streamed, transposed = node.right, node.left, True
        why = ("hold the side with the smaller footprint and stream the other" if forced == "auto"
               else f"forced by Choices(held={forced!r})")
        self.decisions.append(Decision(
            f"held side of {node.label} [{node.token}]", "right (training) rows" if transposed else "left (query) rows",
            {"hold left": f"{hold_left / 2**20:.2f} MiB", "hold right": f"{hold_right / 2**20:.2f} MiB"},
            why + "; H (symmetric) is applied once to the held rows"
            + ("" if isinstance(node.op, Identity) else " (precondition the held side)")))
        collect = self.add(Job("collect", held, (held,), self.stream_deps(held), storage=self.storage(held)))
        job = Job("scores", node, (streamed,), {collect} | self.op_deps(node.op) | self.stream_deps(streamed),
                  held=held, transposed=transposed)
        job.kernels = self._kernels(held, streamed, node)
        return [self.add(job)]

    def diag_jobs(self, node: ScoreDiagonal) -> list[str]:
        inner = node.scores
        if isinstance(inner, ScoreSum):
            keys = []
            for t in inner.terms:
                keys.extend(self.diag_jobs(ScoreDiagonal(t)))
            return keys
        if not isinstance(inner, Inner):
            raise PlanError(f"cannot plan the diagonal of {type(inner).__name__}")
        deps = self.op_deps(inner.op) | self.stream_deps(inner.left) | self.stream_deps(inner.right)
        streams = (inner.left,) if inner.left == inner.right else (inner.left, inner.right)
        if len(streams) == 2 and self._pass_key(inner.left, set()) != self._pass_key(inner.right, set()):
            deps.add(self.add(Job("collect", inner.left, (inner.left,), self.stream_deps(inner.left))))
            streams = (inner.right,)
            return [self.add(Job("diag", node, streams, deps, held=inner.left))]
        return [self.add(Job("diag", node, streams, deps))]

    # ---- sizes and costs ----------------------------------------------------------
    def storage(self, node: GradNode, need_factors: frozenset = frozenset()) -> dict[str, str]:
        """How kept rows are stored, per block: "factors" (n·T_b·(in+out) numbers) or "flat"
        (n·dim), whichever is smaller; factors where a consumer needs them (``need_factors``:
        K-FAC statistics) or ``ga.options(ghost="always")`` forces ghost kernels."""
        T = positions(node)
        forced = self.options.ghost == "always"  # ghost kernels need the factors kept
        out = {}
        for b in node.space.blocks:
            factored = len(b.shape) == 2 and self._is_factored(node, b.name)
            keep = factored and (forced or b.name in need_factors
                                 or T[b.name] * (b.shape[0] + b.shape[1]) < b.dim)
            out[b.name] = "factors" if keep else "flat"
        return out

    def _rows_bytes(self, node: GradNode, storage: dict | None = None) -> float:
        """Bytes of all rows of ``node`` in its storage form (factors or flat)."""
        return rows_bytes(node, self.storage(node) if storage is None else storage, self.dtype)

    def _kron_factored(self, node: GradNode, block: str) -> bool:
        root = node
        while isinstance(root, ROW_WISE) and not isinstance(root, Project):
            if isinstance(root, (Precondition, AdamPrecondition)) or (isinstance(root, Normalize) and root.op):
                return False
            root = root.grads
        return isinstance(root, Project) and root.projector.kind == "kron" and \
            stream_root(root.grads) is not None and root.grads.representation.get(block) == "factored"

    def _held_bytes(self, node: GradNode) -> float:
        return self._rows_bytes(node)

    def _is_factored(self, node: GradNode, block: str) -> bool:
        rep = node.representation[block]
        return rep == "factored" or (rep == "projected" and self._kron_factored(node, block))

    def _kernels(self, held: GradNode, streamed: GradNode, inner: Inner) -> dict:
        kernels = {}
        TL, TR = tokens_hint(held), tokens_hint(streamed)
        kept = self.storage(held)
        for b in held.space.blocks:
            if len(b.shape) != 2 or not isinstance(inner.op, Identity) or kept[b.name] != "factors" or not (
                    self._is_factored(held, b.name) and self._is_factored(streamed, b.name)):
                kernels[b.name] = "dense"
                continue
            mode = self.options.ghost
            if mode == "auto" and not (b.kind not in CONV_KINDS and _positions_known(held) and _positions_known(streamed)):
                # T differs per layer (convolutions, non-token inputs): a guessed T could pick
                # ghost for thousands of positions; the executor routes on the real shapes
                self.decisions.append(Decision(
                    f"kernel for block {b.name!r} of {inner.label} [{inner.token}]", "at run time",
                    {"ghost": "per chunk", "dense": "per chunk"},
                    "the positions per example (T) of this layer are not known from the data's shape: "
                    "each chunk is routed on its real shapes (gradalg.plan.routing.choose_kernel)"))
                continue
            out_f, in_f = b.shape
            args = (held.n, streamed.n, TL, TR, in_f, out_f)
            ghost = 2.0 * ghost_flops(*args)
            dense = 2.0 * dense_flops(*args, left_ready=False)
            chosen = "ghost" if (mode == "always" or (mode == "auto" and ghost <= dense)) else "dense"
            kernels[b.name] = chosen
            self.decisions.append(Decision(
                f"kernel for block {b.name!r} of {inner.label} [{inner.token}]", chosen,
                # the choice and the seconds shown both count arithmetic only: measured
                # (benchmarks/planner.py) it picks within 10% of the faster kernel
                {"ghost": self.device.seconds(ghost, 0), "dense": self.device.seconds(dense, 0)},
                f"T={TL}/{TR}, in={in_f}, out={out_f}, {held.n}×{streamed.n} pairs"
                + ("" if mode == "auto" else f" (forced by ga.options(ghost={mode!r}))")))
        return kernels

    def _pass_key(self, node: GradNode, stored: set) -> tuple:
        x = node
        while True:
            if x.token in stored:
                return ("memory", x.token)
            if not isinstance(x, ROW_WISE):
                break
            x = x.grads
        if isinstance(x, Source):
            return ("data", x.task.token, x.data.token, x.task.name, x.data.n)
        if isinstance(x, Captured):
            return ("captured", x.token)
        return ("memory", x.token)  # GroupMean, filled by its group job

    def _sources(self, jobs: list[Job], stored: set) -> list[Source]:
        out = []
        for j in jobs:
            for s in j.streams:
                root = stream_root(s)
                if isinstance(root, Source) and root not in out:
                    out.append(root)
        return out

    # ---- costs: thin calls into gradalg.plan.estimates (one cost module) ---------------
    def _capture_cost(self, src: Source, forward: bool = True) -> Cost:
        """Forward (unless shared with another source) + one backward to the recorded
        outputs per captured row set (no weight-gradient GEMMs)."""
        return estimates.capture_cost(src, self.options, self.dtype, forward)

    def _pass_capture_cost(self, sources: list[Source], batch: int | None = None) -> Cost:
        """Capturing all sources of a pass: those differing only in their objective share
        one forward per batch (:class:`~gradalg.exec.capture_pass.PassCapture`)."""
        return estimates.pass_capture_cost(sources, self.options, self.dtype, forward_share_key, batch)

    def _layout(self, node: GradNode, reads_data: bool) -> dict:
        """``{block: "factors" | "flat"}`` of ``node``'s rows as a pass delivers them: as
        stored (a pass over rows in memory), else factors where the capture or a
        Kronecker projection leaves factors."""
        if not reads_data:
            store = self.jobs.get(f"store:{node.token}") or self.jobs.get(f"collect:{node.token}")
            if store is not None and store.storage:
                return dict(store.storage)
        return {b.name: "factors" if (len(b.shape) == 2 and self._is_factored(node, b.name)) else "flat"
                for b in node.space.blocks}

    def _job_cost(self, job: Job, n_stream: int, reads_data: bool = True, chunk: int | None = None) -> Cost:
        node = job.streams[0] if job.streams else None
        layout = self._layout(node, reads_data) if node is not None else {}
        held = self.storage(job.held) if job.held is not None else None
        return estimates.job_cost(job, n_stream, layout, chunk or self.options.batch_size, self.dtype, held,
                                  self.options)

    def _projection_cost(self, jobs: list[Job], n: int, chunk: int | None = None) -> Cost:
        """Projections computed in the pass, each distinct one once per example."""
        seen, cost = set(), Cost()
        for job in jobs:
            for s in job.streams:
                x = s
                while isinstance(x, ROW_WISE):
                    if isinstance(x, Project) and x.token not in seen:
                        seen.add(x.token)
                        cost = cost + _project_cost(x, n * token_rows(x), tokens_hint(x), chunk)
                    x = x.grads
        return cost

    def _per_example_bytes(self, p_jobs: list[Job], sources: list[Source]) -> float:
        total = sum(capture_bytes_per_example(src, self.dtype) for src in sources)
        total += sum(consumer_bytes_per_example(job, self.dtype) for job in p_jobs)
        for job in p_jobs:
            if job.kind == "scores":
                for b in job.held.space.blocks:
                    if job.kernels.get(b.name) != "ghost":
                        # the streamed rows materialized, and their product (T rows per example when per-token)
                        total += b.dim * 8 * token_rows(job.streams[0])
        return total

    def _fixed_bytes(self, p_jobs: list[Job]) -> float:
        total = 0.0
        for job in p_jobs:
            if job.kind == "scores":
                total += self._held_bytes(job.held)
            if job.kind == "fisher":
                total += fisher_cost(1, [b.dim for b in job.target.space.blocks], job.target.structure).peak_bytes
            if job.kind in ("kfac", "ekfac"):
                total += kron_bytes(job.target.space)
            if job.kind in ("collect", "store", "group"):
                total += self._rows_bytes(job.target, job.storage or None)
        return total

    # ---- scheduling -----------------------------------------------------------------
    def schedule(self) -> tuple[list[Pass], set]:
        remaining = dict(self.jobs)
        done: set = set()
        stored: set = set()
        passes: list[Pass] = []
        for _ in range(4 * len(self.jobs) + 4):
            if not remaining:
                break
            ready = [j for j in remaining.values() if j.deps <= done]
            if not ready:
                raise PlanError(f"circular job dependencies among {sorted(remaining)}")
            groups: dict[tuple, list[Job]] = {}
            for j in ready:
                groups.setdefault(self._pass_key(j.streams[0], stored), []).append(j)
            for key, group in groups.items():
                self._consider_storing(key, group, remaining, done, stored)
                p = Pass(key, group)
                passes.append(p)
                for j in group:
                    remaining.pop(j.key, None)
            done |= {j.key for g in groups.values() for j in g}
        else:
            raise PlanError("the scheduling stage did not converge")
        for p in passes:
            self._size_pass(p, stored)
        return passes, stored

    def _consider_storing(self, key, group, remaining, done, stored):
        """Store rows that a later job on this same data will need, when cheaper than re-reading.

        A later job whose rows depend on this pass's statistics (a metric-normalized or
        preconditioned side) can still reuse the part of its row-wise chain that does not:
        that prefix is stored, and the later pass derives the rest from memory.
        """
        if key[0] != "data":
            return
        group_keys = {j.key for j in group}
        for job in list(remaining.values()):
            if job.key in group_keys or job.deps <= done:
                continue
            for node in job.streams:
                # the longest row-wise prefix computable now: for P(G).normalize(metric=H⁻¹)
                # with H from this pass, the projected rows P(G) (RelatIF's training side)
                while isinstance(node, ROW_WISE) and not self.stream_deps(node) <= done:
                    node = node.grads
                if node.token in stored or self._pass_key(node, stored) != key:
                    continue
                if not self.stream_deps(node) <= done:
                    continue
                storage = self.storage(node, self._factors_needed(node, remaining))
                size = self._rows_bytes(node, storage)
                src = stream_root(node)
                recompute = self._capture_cost(src).seconds(self.device, self.dtype) if isinstance(src, Source) else 0.0
                fits = size <= self.options.memory_budget / 4
                keep = 2.0 * size / self.device.bandwidth     # write the rows once, read them once
                choice = "store" if fits and keep <= recompute else "recompute"
                forced = self.choices.store
                if forced != "auto":
                    choice = "store" if forced == "always" else "recompute"
                    why = f"forced by Choices(store={forced!r})"
                elif not fits:
                    why = "would exceed a quarter of the memory budget"
                elif choice == "store":
                    why = "fits in a quarter of the memory budget and costs less than reading the data again"
                else:
                    why = "fits, but moving the rows costs more than recapturing them"
                self.decisions.append(Decision(
                    f"second use of {node.label!r} [{node.token}]", choice,
                    {"store": keep if fits else f"{size / 2**20:.2f} MiB over the limit", "recompute": recompute},
                    "a later job needs these rows after statistics from the same pass; storing them " + why))
                if choice == "store":
                    stored.add(node.token)
                    group.append(Job("store", node, (node,), set(), storage=storage))

    def _factors_needed(self, node: GradNode, jobs: dict) -> frozenset:
        """Blocks of ``node`` that a later K-FAC job reads as factors (its statistics
        are covariances of A and D; every other consumer takes flat rows)."""
        need = set()
        for job in jobs.values():
            if job.kind == "kfac" and any(self._chain_contains(s, node) for s in job.streams):
                need |= set(node.space.names)
        return frozenset(need)

    @staticmethod
    def _chain_contains(stream: GradNode, node: GradNode) -> bool:
        x = stream
        while True:
            if x.token == node.token:
                return True
            if not isinstance(x, ROW_WISE):
                return False
            x = x.grads

    def _size_pass(self, p: Pass, stored: set) -> None:
        sources = self._sources(p.jobs, stored) if p.reads_data else []
        per_ex = self._per_example_bytes(p.jobs, sources)
        fixed = self._fixed_bytes(p.jobs)
        p.per_example_bytes, p.fixed_bytes = per_ex, fixed
        budget = self.options.memory_budget
        if p.reads_data:
            data = sources[0].data
            if data.batch_size is not None or _is_loader(data):
                p.batch_size = data.batch_size or getattr(data.source, "batch_size", None)
                p.note = "batch size fixed by the data"
            else:
                room = budget - fixed
                if room < per_ex:  # not even a batch of one example fits next to the held rows
                    raise MemoryBudgetError(
                        f"{p.label}: held rows and statistics take {_si(fixed)}B and one example's "
                        f"factors and activations {_si(per_ex)}B, over the memory budget of {_si(budget)}B. "
                        "Project the gradients (ga.proj.kron), use fewer queries per call, or raise "
                        "ga.options(memory_budget=...)")
                fit = int(room // max(per_ex, 1.0))
                p.batch_size = max(1, min(self.options.batch_size, fit))
                if p.batch_size < self.options.batch_size:
                    p.note = f"batch size {p.batch_size} (not {self.options.batch_size}) to stay under the memory budget"
            cost = self._pass_capture_cost(sources, p.batch_size)
            n = data.n
        else:
            cost = Cost()
            n = p.jobs[0].streams[0].n
        batches = -(-n // (p.batch_size or n)) if p.reads_data and n else 0
        cost = cost + estimates.pass_overhead(len(p.jobs), batches, per_ex * (p.batch_size or 1))
        for job in p.jobs:
            # rows streamed by the job: n·T for per-token rows (ga.GradientSet.per_token)
            cost = cost + self._job_cost(job, job.streams[0].n if job.streams and p.reads_data else n,
                                         p.reads_data, p.batch_size)
        if p.reads_data:
            cost = cost + self._projection_cost(p.jobs, n, p.batch_size)
        # one read of the data, however many sources are captured from each batch
        cost = replace(cost, peak_bytes=fixed + per_ex * (p.batch_size or 1), passes=1.0 if p.reads_data else 0.0)
        p.cost = cost
        p.seconds = cost.seconds(self.device, self.dtype)


def apply_flops(op: OpNode, space, n: int) -> float:
    """FLOPs of applying the resolved ``op`` to n rows of ``space``, by its structure
    (:func:`gradalg.plan.estimates.apply_cost`)."""
    return estimates.apply_flops(op, space, n)


def _positions_known(node: GradNode) -> bool:
    """Whether ``tokens_hint`` is every layer's T: the examples are token ids (T = their
    length) or flat vectors (T = 1). Images and other multi-dimensional inputs give each
    layer its own T (a convolution's output positions), known only when it runs."""
    if token_rows(node) > 1:
        return True   # per-token rows: one position each
    data = getattr(node.source, "data", None)
    if data is None:
        return False
    try:
        first = data.first_example_batch()
        while not isinstance(first, torch.Tensor):
            first = next(iter(first.values())) if isinstance(first, dict) else first[0]
    except Exception:  # noqa: BLE001 - a shape hint must never fail planning: route at run time
        return False
    return first.dim() == 2


def _project_cost(node: Project, n: int, T: int, chunk: int | None = None) -> Cost:
    """``node``'s projection for n examples (:func:`gradalg.plan.estimates.project_cost`)."""
    return estimates.project_cost(node, n, T, chunk=chunk)


def _compute_dtype(root: Node) -> torch.dtype:
    for node in root.walk():
        if isinstance(node, Source):
            for p in node.task.model.parameters():
                return p.dtype
    return torch.float32


def _is_loader(data) -> bool:
    return isinstance(data.source, DataLoader)


# ------------------------------------------------------------------ entry point
def plan(root: Node, *, options: Options | None = None, device=None, rewrites: bool = True,
         choices: Choices | None = None, measure_shapes: bool = False) -> Plan:
    """Plan ``root`` (a score, self-score, gradient or operator node).

    ``choices`` forces decisions the planner would otherwise cost (:class:`Choices`).
    ``measure_shapes`` (executors about to run the plan) finds every layer's positions
    per example with one meta-device call of each source's loss
    (:func:`gradalg.plan.shapes.forward_shapes`) and measures this machine's speeds if
    they were never measured; without it the planner calls no model and benchmarks
    nothing (displays: the cached device profile, or an unmeasured default)."""
    options = options or get_options()
    prof = profile(device, measure=measure_shapes)
    simplified, fired = simplify_until_fixpoint(root, enabled=rewrites)
    if measure_shapes:
        for node in simplified.walk():
            # flat inputs (T = 1) and token ids (T = their length) tell every linear
            # layer's positions: the probe is for convolutions and other inputs
            if isinstance(node, Source) and (not _positions_known(node)
                                             or any(b.kind in CONV_KINDS for b in node.space.blocks)):
                forward_shapes(node, measure=True)
    planner = _Planner(options, prof, choices)
    planner.dtype = _compute_dtype(simplified)
    if isinstance(simplified, ScoreNode):
        roots = planner.score_jobs(simplified)
    elif isinstance(simplified, ScoreDiagonal):
        roots = planner.diag_jobs(simplified)
    elif isinstance(simplified, GradNode):
        roots = [planner.add(Job("collect", simplified, (simplified,), planner.stream_deps(simplified)))]
    elif isinstance(simplified, OpNode):
        roots = sorted(planner.op_deps(simplified))
    else:
        raise PlanError(f"cannot plan a {type(root).__name__}")
    passes, stored = planner.schedule()
    return Plan(root, simplified, fired, planner.decisions, passes, planner.jobs, roots, options, prof, stored,
                planner.dtype)


def estimate(node) -> Cost:
    """Estimated total cost of computing ``node`` under the options in force (via its
    plan; nothing is run, measured or read beyond the data's shape)."""
    return plan(node).total
