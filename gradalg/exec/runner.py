"""The pass runner: interprets a physical plan, pass by pass, for any executor.

For each :class:`~gradalg.plan.planner.Pass` the runner

1. opens each job's accumulator (``job.accumulator(ctx)``, a list parallel to
   ``step.jobs``: the job says what it is fed, how and where its result goes, the
   accumulator keeps its state);
2. feeds the jobs every example of the pass once: where the plan placed the pass
   (``plan.placement``, a :class:`Placement` per pass) in this process
   (:meth:`PassRunner.feed`, batch by batch), else through the executor's
   **shard strategy** (``run_shards``): the Dask strategy splits the pass into shards that
   run :meth:`PassRunner.feed` on workers and absorbs their partial states, the
   torch.distributed one feeds this rank's range and combines the ranks' states;
3. publishes each job's result into the run's :class:`~gradalg.exec.state.RunState`,
   and records the pass's measured time and memory (``executor.pass_stats``).

A products pass (``Pass.per_call``) is fed nothing when the plan runs: its job publishes
the matvec its solver calls, and each call reads the data then
(:class:`~gradalg.plan.jobs.products.ProductPass`, which adds the call's seconds to the
pass's entry in ``pass_stats``); a pass during which such calls run (the scores pass whose
queries a CG solve preconditions) is measured without them, so that each second is in one
entry and the entries sum to the run's time.

A shard strategy (:class:`ShardStrategy`) says where each pass runs (``place``, asked when
the plan is made by the plan's place stage, :func:`gradalg.plan.placement.place_passes`,
which records it as a ``PLACEMENT`` :class:`~gradalg.plan.decisions.Decision` with both
places' estimates), runs a sharded pass (``run_shards(runner, step, accs) -> dict``: results it
finished itself, by job index; ``runner.where`` is the plan's placement of the pass, with
its ``shards``) and describes it (``describe_pass``). The runner decides
nothing: kernels, storage, normalization, batch sizes and placement are the plan's.

:meth:`PassRunner.feed` reads a pass's data once: each batch is captured once per
source (:class:`~gradalg.exec.capture_pass.PassCapture`), the row-wise chains of the
jobs' streams derived from it once per node (``memo``), and every job fed.
"""
from __future__ import annotations

import contextlib
import time
from typing import Iterator

from ..eval_mode import eval_mode
from ..data import batch_size_of, move_batch
from ..errors import NonFiniteGradientError, NonFiniteWeightError
from ..expr import GradNode
from ..fingerprint import is_meta_model
from ..plan.placement import HERE, Placement
from ..plan.planner import ROW_WISE, Pass, Plan, PlanError, stream_root
from ..proj import clear_caches as clear_projection_caches
from .allocator import ResidentGuard, peak_growth, peak_resident_bytes, release_free_memory, resident_bytes
from .capture_pass import PassCapture, model_device_dtype
from ..capture.chunks import Chunk
from .progress import SILENT, progress_bar
from .rowwise import derive_rows
from .shards import restrict_step

__all__ = ["PassRunner", "ShardStrategy", "InProcess", "check_reductions", "captured_batches"]


class ShardStrategy:
    """How an executor maps a pass's shards and gathers their results; this base runs
    every pass whole in this process (:class:`InProcess`). ``keeps_held_rows``: accumulators are
    opened again per shard, so a score's raw held rows are kept, not released as they
    are preconditioned. ``here`` and ``spread`` name the two places a pass can run (whole
    in this process, or on shards; ``spread`` None: a strategy that never shards)."""

    keeps_held_rows = False
    here = "in this process"
    spread: str | None = "on shards"

    def place(self, step: Pass) -> Placement:
        """Where ``step`` runs (decided when the plan is made, recorded in ``plan.placement``).
        Whole :attr:`here`: a products pass (its solver calls it here, one pass over all
        of its data per call; refused where :meth:`refuse_here` says) and a pass over
        rows in memory; a pass over data where :meth:`place_data` says."""
        if self.spread is None:
            return HERE
        if step.per_call:
            return Placement(False, f"a products pass: its solver calls it {self.here}, one pass over all of its "
                                    "data per call",
                             self.refuse_here(step, f"the products of {step.jobs[0].target.label} (called by its solver)"))
        if not step.reads_data:
            return Placement(False, "rows already in memory")
        return self.place_data(step)

    def place_data(self, step: Pass) -> Placement:
        """Where a pass over data runs (here: on shards)."""
        return Placement(True, self.spread)

    def refuse_here(self, step: Pass, what: str) -> Exception | None:
        """The error of a pass that must run :attr:`here` (it needs ``what`` of this
        process's model) but cannot, or None."""
        return None

    def ways(self) -> int:
        """Shards that run at once (a sharded pass's estimate is the pass's divided by it)."""
        return 1

    def run_shards(self, runner: "PassRunner", step: Pass, accs: list) -> dict:
        """Feed every job every example of a pass placed on shards, into its accumulator
        ``accs[i]``; returns the results it finished itself, by job index (the runner
        finishes the others)."""
        runner.feed(step, accs)
        return {}

    def describe_pass(self, step: Pass, where: Placement | None = None) -> str | None:
        """How ``step`` is split and what crosses the network (``explain()``): where it runs
        and why, or for a sharded pass :meth:`describe_shards`, read from the plan's
        placement ``where`` (None: placed now, :meth:`place`); None for a strategy that
        never shards."""
        if self.spread is None:
            return None
        where = where or self.place(step)
        if not where.sharded:
            return f"runs {self.here} ({where.reason})"
        n = step.sources()[0].data.n
        return self.describe_shards(step, where, n, sum(job.output_bytes(n) for job in step.jobs))

    def describe_shards(self, step: Pass, where: Placement, n: int, result_bytes: float) -> str:
        """How a sharded pass over ``n`` examples is split (as ``where`` says), its jobs'
        results being ``result_bytes`` in all."""
        return f"{n} examples on shards"

    def budget(self, options, node):
        """The memory budget to plan ``node`` under (None: the options')."""
        return None

    def before_run(self, plan: Plan) -> None:
        """Checks before ``plan`` runs (the ranks agree on it, the models allow it)."""

    def as_array(self, result):
        """A score term as the executor returns it (here: as computed)."""
        return result

    def close(self) -> None:
        """Release resources (clusters, files)."""


class InProcess(ShardStrategy):
    """The shard strategy of one process: the whole pass here, as one shard."""

    spread = None


def check_reductions(ctx, step: Pass) -> None:
    """Check each task's loss reduction once before a sharded pass, here, on the pass's
    first (at most 8) examples, instead of once per shard (every rank checks the same
    batch, so their forwards match); a model on the meta device is checked on its workers."""
    for src in step.sources():
        task = src.task
        if (not ctx.options.check_reduction or src.objective != "loss" or task.token in ctx.state.checked
                or is_meta_model(task.model)):      # a meta model has no weights here: each shard checks on its worker
            continue
        batch = next(iter(src.data.loader(min(step.batch_size, 8))))
        with eval_mode(task.model):
            task.check_reduction(move_batch(batch, model_device_dtype(task.model)[0]))
        ctx.state.checked.add(task.token)


def _own_clock(stats: list[dict]) -> tuple[float, float]:
    """Wall and CPU seconds now, less those summed over the measured entries ``stats`` so
    far. A pass's own time is the difference of two readings: what the entries gained
    meanwhile is not counted, since the calls of a products pass
    (:class:`~gradalg.plan.jobs.products.ProductPass`) made by a solver during a later pass
    are timed into the products pass's entry, and counted there only."""
    return (time.perf_counter() - sum(e["seconds"] for e in stats),
            time.process_time() - sum(e.get("cpu_seconds", 0.0) for e in stats))


class PassRunner:
    """Runs plans for the executor ``ctx`` (its ``options``, ``trace``, ``state``,
    ``resolve``, ``pass_stats``) with a shard strategy."""

    def __init__(self, ctx, shards: ShardStrategy | None = None):
        self.ctx = ctx
        self.shards = shards if shards is not None else InProcess()
        self.where = HERE     # the placement of the pass being run

    # ------------------------------------------------------------------ plans and passes
    def run(self, plan: Plan) -> Plan:
        """Run each pass where the plan placed it (``plan.placement``, made by
        :func:`~gradalg.plan.placement.place_passes`)."""
        if len(plan.placement) != len(plan.passes):
            raise PlanError(f"the plan places {len(plan.placement)} of its {len(plan.passes)} passes: run it with "
                            "Executor.run, which places it first")
        try:
            self._run_passes(plan)
        finally:
            clear_projection_caches()    # kept for this plan's passes (counted in its memory), not after
        return plan

    def _run_passes(self, plan: Plan) -> None:
        stats = self.ctx.pass_stats
        for index, (step, where) in enumerate(zip(plan.passes, plan.placement)):
            wall0, cpu0 = _own_clock(stats)
            rss0, mark0 = resident_bytes(), peak_resident_bytes()
            self.run_pass(step, where)
            mark1 = peak_resident_bytes()
            wall1, cpu1 = _own_clock(stats)    # CPU: this process's time (excludes waiting for a core)
            stats.append({"pass": index, "key": step.key, "seconds": wall1 - wall0, "cpu_seconds": cpu1 - cpu0,
                          **peak_growth(rss0, mark0, mark1), "held_bytes": self.ctx.state.held_bytes()})

    def run_pass(self, step: Pass, where: Placement = HERE) -> None:
        if where.refusal is not None:
            raise where.refusal
        accs = [job.accumulator(self.ctx) for job in step.jobs]
        if where.sharded:
            self.where = where      # the plan's placement of the pass (its shard count), read by the strategy
            done = self.shards.run_shards(self, step, accs)
        else:
            self.feed(step, accs)
            done = {}
        for i, (job, acc) in enumerate(zip(step.jobs, accs)):
            with self.ctx.clock.phase(job.phase):
                job.publish(done[i] if i in done else acc.finish(), self.ctx.state)

    # ------------------------------------------------------------------ one process's feed
    def feed(self, step: Pass, accs: list, stepped: list | None = None) -> None:
        """Read ``step``'s data once and hand every chunk to every job, into its
        accumulator ``accs[i]`` (None: what the job is fed is derived, the same
        forward/backward calls, and kept nowhere: a padding batch's); ``stepped[0]``
        (optional) counts the batches whose forward and backward ran (:func:`_counted`)."""
        state, clock = self.ctx.state, self.ctx.clock
        for base in _counted(self.batches(step), stepped if stepped is not None else [0]):
            memo: dict[str, list[Chunk]] = {}
            for job, acc in zip(step.jobs, accs):
                with clock.phase("capture"):
                    fed = [self.derive(s, base, memo) for s in job.fed]
                if acc is not None:
                    with clock.phase(job.phase):
                        job.feed(acc, fed, state)
                del fed
            del base, memo   # the batch's rows are dropped before the next batch is captured

    def feed_shard(self, step: Pass, data_token: str, start: int, stop: int, accs: list | None = None,
                   stepped: list | None = None) -> list:
        """The partial states (``export()``) of ``step``'s accumulators over examples start:stop
        of the dataset ``data_token``: the pass restricted to them
        (:func:`~gradalg.exec.shards.restrict_step`), fed into ``accs`` (a Dask worker's,
        unpickled) or into freshly opened ones (a rank's); ``stepped`` as :meth:`feed`. An
        empty range (more ranks than examples) feeds nothing."""
        shard = restrict_step(step, data_token, start, stop)
        accs = accs if accs is not None else [job.accumulator(self.ctx) for job in shard.jobs]
        for job, acc in zip(shard.jobs, accs):
            job.for_shard(acc, start)
        if stop > start:
            self.feed(shard, accs, stepped)
        return [acc.export() for acc in accs]

    def batches(self, step: Pass) -> Iterator[dict[str, list[Chunk]]]:
        """Per batch of the pass, ``{root token: chunks}`` of the nodes it reads: data in
        the plan's batches (``step.batch_size``), the resident set trimmed after them as the
        plan decided (``step.trim_after_batches``); rows in memory or a store in their chunks."""
        if step.per_call:   # a products pass reads its batches on each call of its solver (ProductPass)
            return
        if step.key.kept is not None:    # rows kept in memory
            yield from ({step.key.kept: [chunk]} for chunk in self.ctx.state.rows[step.key.kept])
            return
        if step.key.rows is not None:    # rows captured earlier: their store
            root = stream_root(step.jobs[0].streams[0])
            yield from ({root.token: [chunk]} for chunk in root.store.chunks())
            return
        sources = step.sources()
        if not sources:
            raise PlanError(f"no source to read for {step.label}")
        yield from captured_batches(self.ctx, sources, step.batch_size, label=step.label,
                                    trim=step.trim_after_batches)

    def derive(self, node: GradNode, base: dict, memo: dict) -> list[Chunk]:
        """Chunks of ``node`` in this batch: read, or derived row-wise from what was read."""
        if node.token in base:
            return base[node.token]
        if node.token in memo:
            return memo[node.token]
        if not isinstance(node, ROW_WISE):
            raise PlanError(f"{node.label!r} is not available in this pass (planner bug: report it)")
        memo[node.token] = list(derive_rows(self.ctx, node, lambda x: self.derive(x, base, memo), memo))
        return memo[node.token]


def captured_batches(ctx, sources: list, batch_size: int, *, label: str | None = None,
                     trim: bool = False) -> Iterator[dict[str, list[Chunk]]]:
    """Per batch of the sources' data (one dataset), ``{source token: chunks}``, each
    batch captured once per source (:class:`~gradalg.exec.capture_pass.PassCapture`) in the
    executor ``ctx``'s run state. ``label``: shown by a progress display (None: none);
    ``trim``: keep resident memory to one batch's (:class:`~gradalg.exec.allocator.ResidentGuard`)."""
    data, task = sources[0].data, sources[0].task
    capture = PassCapture(sources, ctx.options, ctx.state.checked)
    device, _ = model_device_dtype(task.model)
    start = 0
    guard = ResidentGuard(ctx.options.release_growth) if trim else None
    shown = progress_bar(ctx.options.progress, data.n, label, interval=ctx.options.progress_interval) \
        if label is not None else contextlib.nullcontext(SILENT)
    with eval_mode(task.model), shown as bar:
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


def _counted(batches: Iterator, stepped: list) -> Iterator:
    """``batches``, counting in ``stepped[0]`` those whose forward and backward ran. A batch
    whose capture raised counts when the error came after its backward (a
    :class:`~gradalg.errors.NonFiniteGradientError` names the examples then); a
    :class:`~gradalg.errors.NonFiniteWeightError` is found before the first forward, and any
    other error is taken to have stopped the batch before its collectives."""
    while True:
        try:
            base = next(batches)
        except StopIteration:
            return
        except NonFiniteGradientError as err:
            stepped[0] += not isinstance(err, NonFiniteWeightError)
            raise
        stepped[0] += 1
        yield base
