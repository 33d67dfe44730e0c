"""The local executor: runs a physical plan with PyTorch on the model's device.

A plan (:mod:`gradalg.plan.planner`) is a list of passes. Each pass reads one dataset
(or rows kept in memory) once, batch by batch; every batch is captured once per
source and fed to all the jobs of the pass — curvature statistics, collections of
held or stored rows, and scores against a held side that was preconditioned before
the pass started. Per-example training gradients exist one batch at a time.

Per block, the inner product of a batch with the held side uses the kernel the plan
chose (``ghost``: ⟨D_iᵀA_i, D_jᵀA_j⟩ = Σ_{t,s}(a_it·a_js)(d_it·d_js) from the factors;
``dense``: materialize, then one GEMM); ``executor.trace`` counts which ran.

Besides plans, the executor offers a pull path (``iter_chunks``, ``resolve``) that
computes one node at a time; iterative solvers and other operators known only through
products use it from inside a pass.
"""
from __future__ import annotations

import resource
import time
from collections import Counter
from typing import Iterator

import torch

from ..capture.factors import Factors
from ..expr import Captured, GradNode, GroupMean, Identity, Normalize, OpNode, ScoreDiagonal, ScoreNode, ScoreSum, Source
from ..data import batch_size_of, move_batch
from ..errors import DataError
from ..options import Options, get_options
from ..plan.choices import Choices
from ..plan.planner import ROW_WISE, Plan, PlanError, plan as make_plan, stream_root
from .allocator import release_free_memory
from .base import Executor
from .accumulators import (Collector, DiagAccumulator, EKFACAccumulator, FisherAccumulator, GroupAccumulator,
                           KronAccumulator, ScoreAccumulator)
from .capture_pass import PassCapture, SourceCapture, eval_mode, model_device_dtype
from .progress import progress_bar
from .chunks import Chunk, concat_chunks, flatten, unflatten
from .resolve import precondition, resolve_node
from .rowwise import apply_rowwise

__all__ = ["LocalExecutor"]


class LocalExecutor(Executor):
    """Runs expression nodes with PyTorch in this process.

    One executor serves one ``compute()``. ``rewrites=False`` disables the planner's
    rewrite rules and ``choices`` (:class:`~gradalg.plan.Choices`) forces the held side
    and store-vs-recompute decisions (differential tests compare all of them).
    ``release_memory_above``: after each batch of a pass whose planned working set is
    at least this many bytes, free memory is returned to the system
    (:mod:`gradalg.exec.allocator`; smaller batches free too little to be worth the call;
    ``float("inf")`` never). After a run, ``last_plan`` is the
    plan that ran and ``pass_stats`` the measured seconds and memory of each pass.
    """

    name = "local"

    def __init__(self, options: Options | None = None, *, rewrites: bool = True, choices: Choices | None = None,
                 release_memory_above: float = 2**20):
        self.options = options or get_options()
        self.rewrites = rewrites
        self.choices = choices
        self.release_memory_above = release_memory_above
        self.reset()

    def reset(self) -> None:
        """Forget every resolved operator, kept row and result of earlier runs.

        An executor memoizes by node identity, which does not see model weights changed
        in place: call ``reset()`` (or use a new executor) after a training step."""
        self.trace: Counter = Counter()
        self._ops: dict[str, object] = {}
        self._kron: dict[str, object] = {}
        self._cache: dict[str, list[Chunk]] = {}
        self._results: dict[str, torch.Tensor] = {}
        self._checked_tasks: set[str] = set()
        self.last_plan: Plan | None = None
        self.pass_stats: list[dict] = []

    # ------------------------------------------------------------------ entry points
    def plan(self, node) -> Plan:
        """The plan this executor would run for ``node``, under its options, rewrites and
        forced choices (row counts measured from the data; nothing is computed)."""
        return make_plan(node, options=self.options, rewrites=self.rewrites, choices=self.choices,
                         measure_shapes=True)

    def scores(self, node: ScoreNode) -> torch.Tensor:
        """The (n_left, n_right) score matrix of ``node``."""
        p = self.run(self.plan(node))
        return self._combine(p.simplified)

    def diagonal(self, node: ScoreDiagonal) -> torch.Tensor:
        """S_ii of a square score expression, without its off-diagonal entries.   (n,)"""
        p = self.run(self.plan(node))
        return self._combine_diag(p.simplified.scores)

    def gradients(self, node: GradNode) -> Chunk:
        """All rows of ``node`` in one chunk (for inspection and tests; holds n × dim)."""
        p = self.run(self.plan(node))
        return concat_chunks(self._cache[p.simplified.token])

    def operator(self, node: OpNode):
        """The resolved numbers of an operator node."""
        p = self.run(self.plan(node))
        return self.resolve(p.simplified)

    # ------------------------------------------------------------------ running plans
    def run(self, p: Plan) -> Plan:
        """Execute every pass of plan ``p`` in order, recording each pass's seconds and memory
        in ``pass_stats``; the results are kept by node identity for the entry points.
        Returns ``p`` (also kept as ``last_plan``)."""
        self.last_plan = p
        for index, step in enumerate(p.passes):
            start, cpu0 = time.perf_counter(), time.process_time()
            rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            self._run_pass(step)
            self.pass_stats.append({
                "pass": index, "seconds": time.perf_counter() - start,
                "cpu_seconds": time.process_time() - cpu0,   # this process's CPU time (excludes waiting for a core)
                "peak_rss_growth_bytes": 1024 * (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0),
                "held_bytes": self._held_bytes(),
            })
        return p

    def _run_pass(self, step) -> None:
        sinks = self._open_sinks(step.jobs, step)
        self._feed(step, sinks)
        for job, sink in sinks:
            self._store(job, sink.finish())

    def _open_sinks(self, jobs, step) -> list:
        return [(job, self._sink(job, step)) for job in jobs]

    def _feed(self, step, sinks) -> None:
        """Read ``step``'s data once and hand every chunk to every job's sink."""
        for base in self._batches(step):
            memo: dict[str, list[Chunk]] = {}
            for job, sink in sinks:
                streams = [self._derive(s, base, memo) for s in _fed_streams(job, step)]
                if job.kind == "diag" and job.held is not None:
                    for right in streams[0]:
                        sink.update(self._aligned_held(job.held, right), right)
                elif len(streams) == 2:
                    for left, right in zip(*streams):
                        sink.update(left, right)
                else:
                    for chunk in streams[0]:
                        sink.update(chunk)

    def _batches(self, step) -> Iterator[dict[str, list[Chunk]]]:
        kind = step.key[0]
        if kind == "memory":
            for chunk in self._cache[step.key[1]]:
                yield {step.key[1]: [chunk]}
            return
        roots = []
        for job in step.jobs:
            for s in job.streams:
                r = stream_root(s)
                if r not in roots:
                    roots.append(r)
        if kind == "captured":
            for chunk in roots[0].store.chunks():
                yield {roots[0].token: [chunk]}
            return
        sources = [r for r in roots if isinstance(r, Source)]
        if not sources:
            raise PlanError(f"no source to read for {step.label}")
        data, task = sources[0].data, sources[0].task
        capture = PassCapture(sources, self.options, self._checked_tasks)
        device, _ = model_device_dtype(task.model)
        start = 0
        batch_size = step.batch_size or self.options.batch_size
        trim = step.per_example_bytes * batch_size >= self.release_memory_above
        with eval_mode(task.model), progress_bar(self.options.progress, data.n, step.label,
                                                 interval=self.options.progress_interval) as bar:
            for batch in data.loader(batch_size):
                batch = move_batch(batch, device)
                b = batch_size_of(batch)
                ids = data.ids[start:start + b]
                start += b
                yield capture.capture(batch, ids)
                if trim:   # the batch's tensors are gone: keep resident memory to one batch's
                    release_free_memory()
                bar.update(b)

    def _derive(self, node: GradNode, base: dict, memo: dict) -> list[Chunk]:
        if node.token in base:
            return base[node.token]
        if node.token in memo:
            return memo[node.token]
        if not isinstance(node, ROW_WISE):
            raise PlanError(f"{node.label!r} is not available in this pass (planner bug: report it)")
        out = [apply_rowwise(self, node, c) for c in self._derive(node.grads, base, memo)]
        memo[node.token] = out
        return out

    def _sink(self, job, step):
        kind, target = job.kind, job.target
        if kind in ("collect", "store"):
            return Collector(target, job.storage)
        if kind == "group":
            return GroupAccumulator(target)
        if kind == "fisher":
            return FisherAccumulator(target, self.options.memory_budget)
        if kind == "kfac":
            return KronAccumulator(target)
        if kind == "ekfac":
            return EKFACAccumulator(target, self._kron[target.token])
        if kind == "scores":
            held = concat_chunks(self._cache[job.held.token])
            space = job.held.space
            if not isinstance(target.op, Identity):
                held = precondition(self.resolve(target.op), held, space)
            return ScoreAccumulator(held, space, job.kernels, self.options.ghost, self.trace,
                                    self.options.memory_budget, normalize_streamed=_normalized_late(job, step))
        if kind == "diag":
            inner = target.scores
            resolved = None if isinstance(inner.op, Identity) else self.resolve(inner.op)
            return DiagAccumulator(inner.left.space, resolved, inner.left == inner.right)
        raise PlanError(f"unknown job kind {kind!r}")

    def _store(self, job, result) -> None:
        kind, target = job.kind, job.target
        if kind in ("collect", "store", "group"):
            self._cache[target.token] = result
        elif kind == "kfac" and target.eigen_correction:
            self._kron[target.token] = result
        elif kind in ("fisher", "kfac", "ekfac"):
            self._ops[target.token] = result
        elif kind == "scores":
            self._results[job.key] = result.T if job.transposed else result
        elif kind == "diag":
            self._results[job.key] = result

    def _aligned_held(self, held: GradNode, right: Chunk) -> Chunk:
        rows = concat_chunks(self._cache[held.token])
        position = {i: k for k, i in enumerate(rows.ids)}
        if len(position) != len(rows.ids):
            raise DataError(
                "the rows of a self-score (a diagonal S_zz) repeat example ids (e.g. training-time rows "
                "of an example seen in several epochs), so they cannot be aligned by id: combine them "
                "first, ga.integrations.combine_repeats(G, 'sum' or 'mean')")
        index = torch.tensor([position[i] for i in right.ids])
        return Chunk(right.ids, unflatten(flatten(rows, held.space)[index], held.space))

    def _combine(self, node: ScoreNode) -> torch.Tensor:
        if isinstance(node, ScoreSum):
            return sum(c * self._combine(t) for c, t in zip(node.coefs, node.terms))
        return self._results[f"scores:{node.token}"]

    def _combine_diag(self, node: ScoreNode) -> torch.Tensor:
        if isinstance(node, ScoreSum):
            return sum(c * self._combine_diag(t) for c, t in zip(node.coefs, node.terms))
        return self._results[f"diag:{ScoreDiagonal(node).token}"]

    def _held_bytes(self) -> int:
        total = 0
        for chunks in self._cache.values():
            for c in chunks:
                for v in c.blocks.values():
                    total += v.nbytes() if isinstance(v, Factors) else v.numel() * v.element_size()
        return total

    # ------------------------------------------------------------------ pull path
    def iter_chunks(self, node: GradNode) -> Iterator[Chunk]:
        """Chunks of rows of ``node``, in order, one node at a time (no fusion)."""
        if node.token in self._cache:
            yield from self._cache[node.token]
            return
        if isinstance(node, Source):
            capture = SourceCapture(node, self.options, self._checked_tasks)
            device, _ = model_device_dtype(node.task.model)
            start = 0
            with eval_mode(node.task.model):
                for batch in node.data.loader(self.options.batch_size):
                    batch = move_batch(batch, device)
                    b = batch_size_of(batch)
                    ids = node.data.ids[start:start + b]
                    start += b
                    yield from capture.capture(batch, ids)
        elif isinstance(node, Captured):
            yield from node.store.chunks()
        elif isinstance(node, GroupMean):
            acc = GroupAccumulator(node)
            for chunk in self.iter_chunks(node.grads):
                acc.update(chunk)
            self._cache[node.token] = acc.finish()
            yield from self._cache[node.token]
        elif isinstance(node, ROW_WISE):
            for chunk in self.iter_chunks(node.grads):
                yield apply_rowwise(self, node, chunk)
        else:
            raise TypeError(f"the local executor cannot compute {type(node).__name__}")

    def resolve(self, node: OpNode):
        """The numbers of an operator node (memoized; computed on the pull path if no
        pass of the plan produced them)."""
        if node.token not in self._ops:
            self._ops[node.token] = self._resolve(node)
        return self._ops[node.token]

    def _resolve(self, node: OpNode):
        return resolve_node(self, node)   # by the named rules of the operator protocol


def _normalized_late(job, step) -> bool:
    """A scores job whose streamed side is ``G.normalize()``, in a pass that reads G or
    something below it (not the normalized rows kept in memory): the accumulator divides
    each column by the row's norm, taken from the rows it materializes anyway."""
    s = job.streams[0] if job.streams else None
    return (job.kind == "scores" and isinstance(s, Normalize) and s.op is None
            and not (step.key[0] == "memory" and step.key[1] == s.token))


def _fed_streams(job, step) -> tuple:
    """The nodes whose chunks feed ``job``'s sink (unnormalized rows for a late normalization)."""
    return (job.streams[0].grads,) if _normalized_late(job, step) else job.streams
