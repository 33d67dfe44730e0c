"""The pass runner: interprets a physical plan, pass by pass, for any executor.

For each :class:`~gradalg.plan.planner.Pass` the runner

1. opens one sink per job (:func:`gradalg.exec.sinks.open_sink`, by job class);
2. hands the pass to the executor's **shard strategy**, which makes every sink see
   every example once: :class:`InProcess` reads the data here, batch by batch
   (:meth:`PassRunner.feed`); ``DaskExecutor`` splits it into shards that run
   :meth:`PassRunner.feed` on workers and absorbs their partial states;
3. publishes each sink's result into the run's :class:`~gradalg.exec.state.RunState`,
   and records the pass's measured time and memory (``executor.pass_stats``).

A shard strategy is an object with ``run_shards(runner, step, sinks) -> dict`` (results
it finished itself, by sink index: Dask's lazily gathered score blocks) and
``describe_pass(step) -> str | None``. The runner decides nothing: kernels, storage,
normalization and batch sizes are the plan's.

:meth:`PassRunner.feed` reads a pass's data once: each batch is captured once per
source (:class:`~gradalg.exec.capture_pass.PassCapture`), the row-wise chains of the
jobs' streams derived from it once per node (``memo``), and every sink fed.
"""
from __future__ import annotations

import time
from typing import Iterator

from ..data import batch_size_of, move_batch
from ..expr import GradNode, Source
from ..plan.planner import ROW_WISE, Pass, Plan, PlanError, stream_root
from .allocator import ResidentGuard, peak_resident_bytes, release_free_memory, resident_bytes
from .capture_pass import PassCapture, eval_mode, model_device_dtype
from ..capture.chunks import Chunk
from .progress import progress_bar
from .rowwise import apply_rowwise, fuses_blocks, project_blockwise
from .sinks import Sink, open_sink

__all__ = ["PassRunner", "InProcess"]


def _peak_growth(rss_start: int | None, mark_start: int, mark_end: int) -> dict:
    """A pass's peak resident growth from the process's resident set at its start and its
    peak mark before and after it.

    The kernel keeps one peak mark per process. When the pass raised it
    (``mark_end > mark_start``) the pass's peak is the new mark, and its growth
    ``mark_end − rss_start`` is exact. When an earlier pass (or code before the run) set a
    higher mark, the pass's own peak is hidden under it: ``mark_end − rss_start`` is then
    only an upper bound, reported with ``peak_rss_is_bound`` True. (Measured from the mark
    at the pass's start instead, a hidden peak read as 0 bytes.) Without a resident-set
    reading (not Linux) the growth is None.
    """
    if rss_start is None:                      # no resident-set reading (not Linux): no baseline to measure from
        return {"peak_rss_growth_bytes": None, "peak_rss_is_bound": False}
    return {"peak_rss_growth_bytes": max(0, mark_end - rss_start), "peak_rss_is_bound": mark_end <= mark_start}


class InProcess:
    """The shard strategy of one process: the whole pass here, as one shard."""

    def run_shards(self, runner: "PassRunner", step: Pass, sinks: list[Sink]) -> dict:
        runner.feed(step, sinks)
        return {}

    def describe_pass(self, step: Pass) -> str | None:
        return None


class PassRunner:
    """Runs plans for the executor ``ctx`` (its ``options``, ``trace``, ``state``,
    ``resolve``, ``pass_stats``, ``release_memory_above``) with a shard strategy."""

    def __init__(self, ctx, shards=None):
        self.ctx = ctx
        self.shards = shards if shards is not None else InProcess()

    # ------------------------------------------------------------------ plans and passes
    def run(self, plan: Plan) -> Plan:
        for index, step in enumerate(plan.passes):
            start, cpu0 = time.perf_counter(), time.process_time()
            rss0, mark0 = resident_bytes(), peak_resident_bytes()
            self.run_pass(step)
            mark1 = peak_resident_bytes()
            self.ctx.pass_stats.append({
                "pass": index, "seconds": time.perf_counter() - start,
                "cpu_seconds": time.process_time() - cpu0,   # this process's CPU time (excludes waiting for a core)
                **_peak_growth(rss0, mark0, mark1),
                "held_bytes": self.ctx.state.held_bytes(),
            })
        return plan

    def run_pass(self, step: Pass) -> None:
        sinks = [open_sink(job, self.ctx) for job in step.jobs]
        done = self.shards.run_shards(self, step, sinks)
        clock = self.ctx.clock
        for i, sink in enumerate(sinks):
            with clock.phase(sink.phase):
                sink.publish(done[i] if i in done else sink.finish(), self.ctx.state)

    # ------------------------------------------------------------------ one process's feed
    def feed(self, step: Pass, sinks: list[Sink]) -> None:
        """Read ``step``'s data once and hand every chunk to every sink."""
        state, clock = self.ctx.state, self.ctx.clock
        for base in self.batches(step):
            memo: dict[str, list[Chunk]] = {}
            for sink in sinks:
                with clock.phase("capture"):
                    fed = [self.derive(s, base, memo) for s in sink.fed]
                with clock.phase(sink.phase):
                    sink.feed(fed, state)
                del fed
            del base, memo   # the batch's rows are dropped before the next batch is captured

    def batches(self, step: Pass) -> Iterator[dict[str, list[Chunk]]]:
        """Per batch of the pass, ``{root token: chunks}`` of the nodes it reads."""
        kind = step.key[0]
        if kind == "memory":
            for chunk in self.ctx.state.rows[step.key[1]]:
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
        ctx = self.ctx
        data, task = sources[0].data, sources[0].task
        capture = PassCapture(sources, ctx.options, ctx.state.checked)
        device, _ = model_device_dtype(task.model)
        start = 0
        batch_size = step.batch_size or ctx.options.batch_size
        trim = step.per_example_bytes * batch_size >= ctx.release_memory_above
        guard = ResidentGuard(ctx.options.release_growth) if trim else None
        with eval_mode(task.model), progress_bar(ctx.options.progress, data.n, step.label,
                                                interval=ctx.options.progress_interval) as bar:
            for batch in data.loader(batch_size):
                batch = move_batch(batch, device)
                b = batch_size_of(batch)
                ids = data.ids[start:start + b]
                start += b
                with ctx.clock.phase("capture"):
                    chunks = capture.capture(batch, ids)
                yield chunks
                del chunks
                if guard is not None:   # the batch's tensors are gone: keep resident memory to one batch's
                    guard.after_batch()
                bar.update(b)
        if guard is not None:   # what the pass freed is not carried into the next pass
            release_free_memory()

    def derive(self, node: GradNode, base: dict, memo: dict) -> list[Chunk]:
        """Chunks of ``node`` in this batch: read, or derived row-wise from what was read."""
        if node.token in base:
            return base[node.token]
        if node.token in memo:
            return memo[node.token]
        if not isinstance(node, ROW_WISE):
            raise PlanError(f"{node.label!r} is not available in this pass (planner bug: report it)")
        if fuses_blocks(node) and node.grads.token not in memo:   # P(G.adam(·)) one block at a time
            out = [project_blockwise(self.ctx, node, c) for c in self.derive(node.grads.grads, base, memo)]
        else:
            out = [apply_rowwise(self.ctx, node, c) for c in self.derive(node.grads, base, memo)]
        memo[node.token] = out
        return out
