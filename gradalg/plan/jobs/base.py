"""The base of every job type: what a pass does with the chunks it streams.

A :class:`Job` names what it reads (``streams``: gradient nodes whose chunks the pass
feeds it, and ``deps``: the keys of jobs that must finish first), what it produces
(its accumulator's ``finish``, put in the run's state by ``publish``) and how much it
costs, in the new record the size stage makes of it (jobs are frozen: a stage that
decides something about a job makes a new one):
``cost`` (FLOPs and traffic of this job in its pass), ``fixed`` (bytes it holds for the
whole pass: held rows, statistics) and ``per_example`` (working bytes per streamed
example). Every choice the planner made for a job is a field of the job (kernels,
storage, normalization, token blocks, Kronecker precision, release of held rows) and a
:class:`~gradalg.plan.decisions.Decision` in the plan.

A job type is **one class** (in a module of this package, with its accumulator) that
answers everything the planner and the executor ask of it; nothing dispatches on its
kind. The planner asks ``stream_cost`` (:meth:`Job.chunk_cost` per chunk, plus
:meth:`Job.once_cost`), ``fixed_bytes``, ``per_example_bytes``, ``output_bytes`` and
``first_decisions``, each cost and bytes hook with the plan's
:class:`~gradalg.plan.shapes.ModelFacts` (``facts``: the dtype of the rows and the measured
positions of every layer, ``positions(node, facts.shapes)``: an explicit input, nothing in
force behind the call); the schedule stage ``can_wait``, ``collects``, ``store_refused``,
``normalized``, ``can_release_held`` and ``reads_stored_factors`` (where a job differs
from the defaults, all off: it asks the job, never its type); the size stage
``keeping_held_rows``, ``applied_ops``, ``shrinks_with_queries`` and ``streamed_back``; a
cluster executor ``shards_are_blocks``; the executor
``accumulator(ctx)`` (its :class:`Accumulator`, made from the job's fields), ``fed``,
``feed``, ``for_shard`` and ``publish`` (where the result goes in the run's
:class:`~gradalg.exec.state.RunState`). ``ctx`` is the executor
(duck-typed: the plan's floor does not import the executor's): its ``trace`` of
kernels, ``state``, ``resolve(op)``, ``precondition_held`` and
``page_returner()`` (a :class:`~gradalg.exec.allocator.FreedBytes`); never its options.

``Job.kind`` is the job's short name (``"scores"``, ...), shown by ``describe()``; a
class that sets it registers itself in :data:`JOB_TYPES`. A job is keyed by
``(kind, target token)`` (:attr:`Job.key`): the plan's ``jobs`` dict, the dependencies
and the executor's results all use that key. ``tests/test_job_protocol.py`` builds every
registered type and checks that it answers each question itself.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, runtime_checkable

from ...errors import OptionError
from ...expr import GradNode, Node
from ..cost import Cost, block_cost
from ..decisions import Decision
from ..estimates import chunk_count
from ..memory import rows_of, stream_workspace_bytes
from ..passkeys import PassKey
from ..shapes import ModelFacts

__all__ = ["Accumulator", "Job", "JOB_TYPES", "job_type"]

#: every job class with a ``kind``, by kind (filled as the classes are defined)
JOB_TYPES: dict[str, type["Job"]] = {}


@runtime_checkable
class Accumulator(Protocol):
    """What a job's run keeps over one pass: ``update`` per chunk (in order; a
    self-score's takes the aligned left and right chunks, a top-k's a block of scores),
    ``export`` / ``absorb`` of a shard's partial state (plain tensors, absorbed in shard
    order: Dask, torch.distributed), then ``finish`` once for the job's result.
    Accumulators decide nothing: kernels, storage and slice sizes are their job's fields."""

    def update(self, *chunks: Any) -> None: ...

    def export(self) -> Any: ...

    def absorb(self, part: Any) -> None: ...

    def finish(self) -> Any: ...


@dataclass(eq=False, frozen=True)
class Job:
    """One job of a pass. ``key`` is ``(kind, target token)``.

    A job type sets ``kind`` and implements :meth:`chunk_cost` (or :meth:`stream_cost`),
    :meth:`example_bytes` (or :meth:`per_example_bytes`), :meth:`fixed_bytes`,
    :meth:`output_bytes`, :meth:`accumulator` and :meth:`publish`; the base raises for
    what a type leaves out (no job is priced or run like another)."""

    kind: ClassVar[str] = "job"
    #: where its run's time is counted (:mod:`gradalg.exec.phases`)
    phase: ClassVar[str] = "scoring"
    #: small tensor ops the job runs per chunk and block (casts, views, accumulation,
    #: checks): the price of its fixed cost per block (``block_cost(kind, …)``) on a
    #: profile that has not measured that kind (``DeviceProfile.block_seconds``: the
    #: nominal GPU profiles; on a measured CPU "ekfac", "kfac", "scores" and "ghost"
    #: blocks are timed)
    ops_per_block: ClassVar[int] = 4
    #: each row set of an example (one per Gauss-Newton term) reaches the job as its own
    #: chunk (statistics and kept rows); False: one chunk per batch
    per_row_set: ClassVar[bool] = False
    #: it reads rows stored for it as factors (K-FAC's covariances of A and D): rows an
    #: earlier pass stores for it keep every block's factors
    reads_stored_factors: ClassVar[bool] = False
    #: what it holds for its pass (:meth:`fixed_bytes`) grows with the rows of the held
    #: (query) side, so fewer queries per call shrink it; False: statistics and training
    #: rows stored for a later pass, which a memory refusal cannot shrink that way
    shrinks_with_queries: ClassVar[bool] = True
    #: the rows it keeps are streamed back by a later pass in the chunks of its own pass
    #: (rows stored instead of re-read); False: kept whole, or not rows
    streamed_back: ClassVar[bool] = False
    #: a shard's state is a column block of its output (the shard's training columns of a
    #: score matrix): a cluster executor keeps the blocks as a lazy array (Dask) instead of
    #: absorbing them into one accumulator; False: shard states are absorbed in order
    shards_are_blocks: ClassVar[bool] = False

    target: Node
    streams: tuple[GradNode, ...] = ()
    deps: set = field(default_factory=set)
    held: GradNode | None = None
    transposed: bool = False
    #: {block: "ghost" | "dense"}: the inner-product kernel of each block (scores jobs)
    kernels: dict = field(default_factory=dict)
    #: {block: "factors" | "flat"}: how kept rows are stored (collect, store jobs)
    storage: dict = field(default_factory=dict)
    #: estimated FLOPs and traffic of this job in its pass (the size stage's record)
    cost: Cost = field(default_factory=Cost)
    #: positions of an example its kernels over factors take at once (``ga.options(token_block)``;
    #: None: all); the ghost kernel's largest intermediate slice (``ga.options(ghost_slice_elements)``)
    token_block: int | None = None
    slice_elements: int = 2**26
    #: Kronecker factors wider than this in float32, checked to ``kron_float32_rtol`` (``ga.options``)
    kron_float64_width: int | None = None
    kron_float32_rtol: float = 1e-2
    #: Kronecker factors wider than this kept as their diagonal (``ga.options(kron_diagonal_width)``; None: never)
    kron_diagonal_width: int | None = None
    #: streamed blocks of at least this many bytes reuse one buffer (``ga.options(reuse_buffer_bytes)``)
    buffer_bytes: int = 2**20

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "kind" in cls.__dict__:
            JOB_TYPES[cls.kind] = cls

    def __post_init__(self):
        if type(self) is Job or isinstance(self.target, str):
            raise OptionError("a job is an instance of its class: CollectJob(target, streams, deps, ...), or "
                              "job_type(kind)(target, ...), not Job(kind, target, ...)")

    @property
    def key(self) -> tuple[str, str]:
        return (self.kind, self.target.token)

    @classmethod
    def for_statistic(cls, statistic, deps: set, options=None, vectors: int | None = None) -> "Job":
        """The job of an operator's :class:`~gradalg.expr.Statistic` of this kind, after
        ``deps``: it reads the statistic's rows (``vectors``: the rows the operator is
        applied to, for a job that cares)."""
        return cls(statistic.node, (statistic.rows,), set(deps))

    def pass_key(self) -> PassKey | None:
        """The key of a pass of its own (a job that reads no gradient rows: products), or
        None: the pass that reads ``streams[0]`` (:func:`~gradalg.plan.lower.pass_key`)."""
        return None

    def at_once(self, T: int) -> int:
        """Positions of an example its kernels over factors take at once: ``min(T, token_block)``."""
        return min(T, self.token_block) if self.token_block else T

    def describe(self) -> str:
        return f"{self.kind} {self.target.label}"

    # ------------------------------------------------------------------ cost
    def stream_cost(self, n_stream: int, chunk: int | None, facts: ModelFacts, layout_of, storage_of=None,
                    options=None, resolved: set | None = None) -> Cost:
        """The job's work on the ``n_stream`` examples it streams in chunks of ``chunk``:
        per chunk (:meth:`block_cost` + :meth:`chunk_cost`, for one chunk's shapes) times
        the chunks (one per chunk and, where ``per_row_set``, per row set), plus what it
        does once (:meth:`once_cost`).

        ``layout_of(node)``: ``{block: "factors" | "flat"}`` of ``node``'s rows as they
        arrive in this pass; ``storage_of(node)``: how kept rows of ``node`` are stored (a
        held side); ``resolved``: tokens of operators resolved earlier in the plan (not
        resolved again; one this job resolves is added)."""
        if not self.streams:
            return Cost()
        node = self.streams[0]
        c, chunks = chunk_count(n_stream, chunk, rows_of(node) if self.per_row_set else 1)
        per = self.block_cost(node) + self.chunk_cost(node, c, layout_of(node), facts)
        return per.scaled(chunks) + self.once_cost(facts, storage_of, options, resolved)

    def block_cost(self, node) -> Cost:
        """The fixed cost of one chunk: ``ops_per_block`` small ops per block of ``node``."""
        return block_cost(self.kind, len(node.space.blocks), self.ops_per_block)

    def chunk_cost(self, node, c: int, layout: dict, facts: ModelFacts) -> Cost:
        """FLOPs and traffic of the job on one chunk of ``c`` examples of ``node``."""
        raise NotImplementedError(f"{type(self).__name__} does not say what a chunk costs (Job.chunk_cost)")

    def once_cost(self, facts: ModelFacts, storage_of=None, options=None, resolved: set | None = None) -> Cost:
        """What the job does once per pass (an eigendecomposition, the held side's preconditioning)."""
        return Cost()

    # ------------------------------------------------------------------ memory
    def fixed_bytes(self, facts: ModelFacts) -> float:
        """Bytes the job holds for its whole pass (held rows, statistics)."""
        raise NotImplementedError(f"{type(self).__name__} does not say what it holds (Job.fixed_bytes)")

    def per_example_bytes(self, facts: ModelFacts) -> float:
        """Working bytes per streamed example, beyond the captured rows: what the job
        materializes (:meth:`example_bytes`) and the workspace of the projections its
        streams apply (:func:`~gradalg.plan.memory.stream_workspace_bytes`)."""
        if not self.streams:
            return 0.0
        return self.example_bytes(facts) + stream_workspace_bytes(self.streams, facts)

    def example_bytes(self, facts: ModelFacts) -> float:
        """Bytes the job materializes per streamed example (rows made flat, float64 copies)."""
        raise NotImplementedError(f"{type(self).__name__} does not say its bytes per example (Job.example_bytes)")

    def bytes_arithmetic(self, facts: ModelFacts) -> str:
        """How :meth:`fixed_bytes` adds up, for messages ("" when it is one number)."""
        return ""

    def output_bytes(self, n: int) -> float:
        """Rough bytes of the job's result over ``n`` streamed examples (what the shards of
        a distributed pass send back, summed over shards)."""
        raise NotImplementedError(f"{type(self).__name__} does not say its output's bytes (Job.output_bytes)")

    # ------------------------------------------------------------------ planning
    def first_decisions(self, options) -> list:
        """What planning the job adds the first time it enters a plan: a refusal before
        any pass runs (raised), decisions shown by ``explain()``. None by default."""
        return []

    def applied_ops(self) -> tuple:
        """The operators its kernels apply in its pass beyond its streams' row-wise chains
        (a self-score's H in ⟨g_i, H g_i⟩): the size stage counts resolving them there,
        unless an earlier pass did. None by default."""
        return ()

    # ------------------------------------------------------------------ scheduling
    def can_wait(self) -> bool:
        """Whether the schedule may run the job in a later wave than the first it is ready
        in: the last before a job that reads its result (a held side collected in a pass
        of its own, :class:`~gradalg.plan.jobs.rows.CollectJob`). False by default."""
        return False

    def collects(self, token: str) -> bool:
        """Whether the job keeps the rows of the node ``token`` for later jobs (it writes
        them: its reading them does not keep the raw rows alive). False by default."""
        return False

    def store_refused(self) -> Decision | None:
        """Why rows this job streams are never stored for it by an earlier pass over the
        same data (a ``STORE`` decision, chosen "recompute"), or None: they may be."""
        return None

    def normalized(self, decide) -> "Job":
        """The job with it decided where its streamed side ``G.normalize()`` is normalized:
        ``decide(side, scores job)`` says True (in the score kernel) or False (row-wise),
        the schedule's choice from the pass. Itself where it streams no such side."""
        return self

    def can_release_held(self) -> bool:
        """Whether the job could drop its raw held rows once it has preconditioned them (a
        preconditioned scores job); the schedule decides whether it does. False by default."""
        return False

    # ------------------------------------------------------------------ sizing
    def keeping_held_rows(self) -> "Job":
        """The job as the size stage fits a batch beside it: holding its raw held rows for
        the whole pass, even where the schedule lets it release them (counted twice: safe).
        Itself by default."""
        return self

    # ------------------------------------------------------------------ running
    def accumulator(self, ctx) -> Accumulator:
        """The job's :class:`Accumulator` for one pass, made from its fields (and what
        earlier passes left in ``ctx.state``)."""
        raise NotImplementedError(f"{type(self).__name__} does not say how it accumulates (Job.accumulator)")

    @property
    def fed(self) -> tuple:
        """The gradient nodes whose chunks the pass hands the job (by position)."""
        return self.streams

    def feed(self, acc: Accumulator, chunks: list, state) -> None:
        """Hand ``acc`` one batch: ``chunks[i]`` are the chunks of ``fed[i]``."""
        for chunk in chunks[0]:
            acc.update(chunk)

    def for_shard(self, acc: Accumulator, start: int) -> None:
        """``acc`` will see the examples of a shard starting at ``start`` (a job that
        counts positions: group means, top-k)."""

    def publish(self, result, state) -> None:
        """Put the finished result where the run's later passes and assembly read it."""
        raise NotImplementedError(f"{type(self).__name__} does not say where its result goes (Job.publish)")


def job_type(kind: str) -> type[Job]:
    """The job class of a kind name (``"scores"`` → :class:`ScoresJob`)."""
    if kind not in JOB_TYPES:
        raise OptionError(f"unknown job kind {kind!r}: job_type(kind) takes one of {sorted(JOB_TYPES)} "
                          "(a new job type is a Job subclass that sets its own `kind`, registered as it is defined)")
    return JOB_TYPES[kind]
