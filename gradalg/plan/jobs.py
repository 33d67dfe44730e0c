"""The jobs of a physical plan: one class per thing a pass does with its chunks.

A :class:`Job` names what it reads (``streams``: gradient nodes whose chunks the pass
feeds it, and ``deps``: the keys of jobs that must finish first), what it produces
(``output``) and how much it costs, in the new record the size stage makes of it (jobs are
frozen: a stage that decides something about a job makes a new one):
``cost`` (FLOPs and traffic of this job in its pass), ``fixed`` (bytes it holds for the
whole pass: held rows, statistics) and ``per_example`` (working bytes per streamed
example). Every choice the planner made for a job is a field of the job (kernels,
storage, normalization) and a :class:`~gradalg.plan.decisions.Decision` in the plan; the
executor interprets the job as it is (:mod:`gradalg.exec.sinks`).

=============  ==============================================  ========================
class          reads                                            produces
=============  ==============================================  ========================
CollectJob     every row of ``target`` (a held side)            rows (list of chunks)
StoreJob       rows a later pass needs after this pass's        rows (list of chunks)
               statistics (the store-vs-recompute decision)
GroupJob       rows of ``target.grads``                         group means (rows)
FisherJob      rows of the Fisher's gradients                   (1/n) Σ g gᵀ, resolved
KFACJob        factors of the gradients                         Kronecker eigenbases
EKFACJob       factors, and the KFACJob's eigenbases            corrected eigenvalues
ScoresJob      the streamed side; the held side (collected)     (n_left, n_right) scores
TopKJob        its terms' streamed sides; their held sides      (n_query, k) best scores
                                                                and training positions
DiagJob        both sides in lockstep (or one, the other held)  (n,) self-scores
=============  ==============================================  ========================

A job type is one class here and one sink in :mod:`gradalg.exec.sinks` (the executor's
floor: the plan does not import it). The class answers everything the planner asks of it,
as methods that call the formulas of :mod:`gradalg.plan.estimates` and
:mod:`gradalg.plan.memory`; nothing dispatches on its kind:

``stream_cost``        its work on the rows it streams (:meth:`Job.chunk_cost` per chunk,
                       times the chunks, plus :meth:`Job.once_cost`)
``fixed_bytes``        bytes held for the whole pass
``per_example_bytes``  working bytes per streamed example (:meth:`Job.example_bytes`, and
                       the workspace of the projections its streams apply)
``output_bytes``       bytes of its result (what shards send back)

``Job.kind`` is the job's short name (``"scores"``, ...), shown by ``describe()``; a
class that sets it registers itself in :data:`JOB_TYPES`. A job is keyed by
``(kind, target token)`` (:attr:`Job.key`): the plan's ``jobs`` dict, the dependencies
and the executor's results all use that key. ``tests/test_plan_jobs.py`` checks that
every registered type implements the methods and has a sink.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from ..errors import OptionError
from ..expr import GradNode, Node
from ..expr.operators import Identity
from ..expr.tokens import token_rows
from .cost import Cost, block_cost, fisher_cost
from .estimates import (chunk_count, diag_chunk_cost, ekfac_chunk_cost, fisher_chunk_cost, kfac_chunk_cost,
                        kfac_once_cost, resolve_once, rows_chunk_cost, scores_chunk_cost, scores_once_cost)
from .memory import (_gb, check_statistics_fit, ekfac_bytes, ekfac_example_bytes, ekfac_rotated_bytes, flat_example_bytes,
                     ghost_norm_bytes_per_example, ghost_workspace_bytes, kfac_example_bytes, kron_bytes,
                     kron_bytes_arithmetic, kron_output_bytes, kron_precision_decisions, rows_bytes, rows_of, stream_workspace_bytes)
from .shapes import element_size

__all__ = ["Job", "CollectJob", "StoreJob", "GroupJob", "FisherJob", "KFACJob", "EKFACJob", "ScoresJob",
           "DiagJob", "TopK", "TopKJob", "JOB_TYPES", "job_type"]

#: every job class with a ``kind``, by kind (filled as the classes are defined)
JOB_TYPES: dict[str, type["Job"]] = {}


@dataclass(eq=False, frozen=True)
class Job:
    """One job of a pass. ``key`` is ``(kind, target token)``.

    A job type sets ``kind`` and implements :meth:`chunk_cost` (or :meth:`stream_cost`),
    :meth:`example_bytes` (or :meth:`per_example_bytes`), :meth:`fixed_bytes` and
    :meth:`output_bytes`; the base raises for what a type leaves out."""

    kind: ClassVar[str] = "job"
    #: what ``finish`` of the job's sink gives the executor
    output: ClassVar[str] = ""
    #: small tensor ops the job runs per chunk and block (casts, views, accumulation,
    #: checks): the price of its fixed cost per block (``block_cost(kind, …)``) on a
    #: profile that has not measured that kind (``DeviceProfile.block_seconds``: the
    #: nominal GPU profiles; on a measured CPU "ekfac", "kfac", "scores" and "ghost"
    #: blocks are timed)
    ops_per_block: ClassVar[int] = 4
    #: each row set of an example (one per Gauss-Newton term) reaches the job as its own
    #: chunk (statistics and kept rows); False: one chunk per batch
    per_row_set: ClassVar[bool] = False

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
            raise TypeError("a job is an instance of its class: CollectJob(target, streams, deps, ...), or "
                            "job_type(kind)(target, ...), not Job(kind, target, ...)")

    @property
    def key(self) -> tuple[str, str]:
        return (self.kind, self.target.token)

    def describe(self) -> str:
        return f"{self.kind} {self.target.label}"

    # ------------------------------------------------------------------ cost
    def stream_cost(self, n_stream: int, chunk: int | None, dtype, layout_of, storage_of=None, options=None,
                    resolved: set | None = None) -> Cost:
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
        elem = element_size(dtype)
        per = self.block_cost(node) + self.chunk_cost(node, c, layout_of(node), elem)
        return per.scaled(chunks) + self.once_cost(elem, storage_of, options, resolved)

    def block_cost(self, node) -> Cost:
        """The fixed cost of one chunk: ``ops_per_block`` small ops per block of ``node``."""
        return block_cost(self.kind, len(node.space.blocks), self.ops_per_block)

    def chunk_cost(self, node, c: int, layout: dict, elem: int) -> Cost:
        """FLOPs and traffic of the job on one chunk of ``c`` examples of ``node``."""
        raise NotImplementedError(f"{type(self).__name__} does not say what a chunk costs (Job.chunk_cost)")

    def once_cost(self, elem: int, storage_of=None, options=None, resolved: set | None = None) -> Cost:
        """What the job does once per pass (an eigendecomposition, the held side's preconditioning)."""
        return Cost()

    # ------------------------------------------------------------------ memory
    def fixed_bytes(self, dtype) -> float:
        """Bytes the job holds for its whole pass (held rows, statistics)."""
        raise NotImplementedError(f"{type(self).__name__} does not say what it holds (Job.fixed_bytes)")

    def per_example_bytes(self, dtype) -> float:
        """Working bytes per streamed example, beyond the captured rows: what the job
        materializes (:meth:`example_bytes`) and the workspace of the projections its
        streams apply (:func:`~gradalg.plan.memory.stream_workspace_bytes`)."""
        if not self.streams:
            return 0.0
        return self.example_bytes(dtype) + stream_workspace_bytes(self.streams, dtype)

    def example_bytes(self, dtype) -> float:
        """Bytes the job materializes per streamed example (rows made flat, float64 copies)."""
        raise NotImplementedError(f"{type(self).__name__} does not say its bytes per example (Job.example_bytes)")

    def bytes_arithmetic(self, dtype) -> str:
        """How :meth:`fixed_bytes` adds up, for messages ("" when it is one number)."""
        return ""

    # ------------------------------------------------------------------ planning
    def first_decisions(self, options) -> list:
        """What planning the job adds the first time it enters a plan: a refusal before
        any pass runs (raised), decisions shown by ``explain()``. None by default."""
        return []

    def score_parts(self) -> tuple:
        """The :class:`ScoresJob` s whose kernels this job runs (itself, a top-k's terms)."""
        return ()

    def output_bytes(self, n: int) -> float:
        """Rough bytes of the job's result over ``n`` streamed examples (what the shards of
        a distributed pass send back, summed over shards)."""
        raise NotImplementedError(f"{type(self).__name__} does not say its output's bytes (Job.output_bytes)")


@dataclass(eq=False, frozen=True)
class RowsJob(Job):
    """A job whose output is rows kept in memory: their bytes are its footprint."""

    output: ClassVar[str] = "rows"

    def chunk_cost(self, node, c, layout, elem) -> Cost:
        return rows_chunk_cost(node, c, layout, self.storage or {}, elem)

    def fixed_bytes(self, dtype) -> float:
        return rows_bytes(self.target, self.storage, dtype)

    def example_bytes(self, dtype) -> float:
        return 0.0

    def output_bytes(self, n: int) -> float:
        return 4.0 * self.target.n * self.target.space.dim


@dataclass(eq=False, frozen=True)
class CollectJob(RowsJob):
    """Keep every row of ``target`` (a held side, or the rows of a gradient node)."""

    kind: ClassVar[str] = "collect"
    per_row_set: ClassVar[bool] = True

    def describe(self) -> str:
        return f"{self.kind} {self.target.label!r} ({self.target.n:,} rows)"


@dataclass(eq=False, frozen=True)
class StoreJob(CollectJob):
    """Keep rows that a later pass reads after this pass's statistics (stored, not re-read)."""

    kind: ClassVar[str] = "store"


@dataclass(eq=False, frozen=True)
class GroupJob(RowsJob):
    """Group means of the rows of ``target.grads`` (a :class:`~gradalg.expr.GroupMean`)."""

    kind: ClassVar[str] = "group"
    ops_per_block: ClassVar[int] = 6


@dataclass(eq=False, frozen=True)
class FisherJob(Job):
    """F = (1/n) Σ_i g_i g_iᵀ in float64 (dense d², block Σ d_b², diag d)."""

    kind: ClassVar[str] = "fisher"
    output: ClassVar[str] = "operator"
    ops_per_block: ClassVar[int] = 6
    per_row_set: ClassVar[bool] = True

    def chunk_cost(self, node, c, layout, elem) -> Cost:
        return fisher_chunk_cost(node, c, layout, self.target.structure, elem)

    def first_decisions(self, options) -> list:
        """A Fisher whose matrix alone exceeds the memory budget is refused here."""
        check_statistics_fit(self.target, options.memory_budget)
        return []

    def example_bytes(self, dtype) -> float:
        return flat_example_bytes(self.streams[0], dtype, 16.0)   # materialized, cast to float64, its product

    def fixed_bytes(self, dtype) -> float:
        return fisher_cost(1, [b.dim for b in self.target.space.blocks], self.target.structure).peak_bytes

    def output_bytes(self, n: int) -> float:
        return self.fixed_bytes(None)


@dataclass(eq=False, frozen=True)
class KronStatisticsJob(Job):
    """A job accumulating per-block Kronecker statistics: two (out, out) and (in, in)
    matrices per block are its footprint and its output."""

    output: ClassVar[str] = "operator"
    per_row_set: ClassVar[bool] = True

    def fixed_bytes(self, dtype) -> float:
        return kron_bytes(self.target.space, self.kron_float64_width, self.kron_diagonal_width)

    def bytes_arithmetic(self, dtype) -> str:
        return kron_bytes_arithmetic(self.target.space, self.kron_float64_width, self.kron_diagonal_width)

    def output_bytes(self, n: int) -> float:
        return kron_output_bytes(self.target.space, self.kron_float64_width, self.kron_diagonal_width)


@dataclass(eq=False, frozen=True)
class KFACJob(KronStatisticsJob):
    """K-FAC's Kronecker factors S = E[DᵀD], A = E[AᵀA] per block, and their eigenbases."""

    kind: ClassVar[str] = "kfac"
    ops_per_block: ClassVar[int] = 14

    def chunk_cost(self, node, c, layout, elem) -> Cost:
        return kfac_chunk_cost(node, c, elem, self.kron_diagonal_width)

    def once_cost(self, elem, storage_of=None, options=None, resolved=None) -> Cost:
        return kfac_once_cost(self.streams[0], self.kron_diagonal_width)

    def first_decisions(self, options) -> list:
        """The precision (float32 or float64) and form (dense or diagonal) of each factor."""
        return kron_precision_decisions(self.target, options)

    def example_bytes(self, dtype) -> float:
        return kfac_example_bytes(self.streams[0], self.token_block)

    def describe(self) -> str:
        t = self.target
        notes = [x for x in t.subset_notes() if x.startswith("covariances")]
        return f"{self.kind} {'ekfac' if t.eigen_correction else 'kfac'}" + (f" ({notes[0]})" if notes else "")


@dataclass(eq=False, frozen=True)
class EKFACJob(KronStatisticsJob):
    """EK-FAC's eigenvalue correction E[(Q_Sᵀ G Q_A)²], in the KFACJob's eigenbases
    (a second pass: it depends on the KFACJob of the same operator)."""

    kind: ClassVar[str] = "ekfac"
    ops_per_block: ClassVar[int] = 10

    def chunk_cost(self, node, c, layout, elem) -> Cost:
        return ekfac_chunk_cost(node, c, layout, elem, self.kron_diagonal_width)

    def example_bytes(self, dtype) -> float:
        return ekfac_rotated_bytes(self.streams[0], self.token_block, self.kron_diagonal_width)

    def fixed_bytes(self, dtype) -> float:
        """The statistics' bytes, and one example's rotated gradient of a block with a
        diagonal (vocabulary-wide) factor, which is corrected one example at a time."""
        return (ekfac_bytes(self.target.space, self.kron_float64_width, self.kron_diagonal_width)
                + ekfac_example_bytes(self.target.space, self.kron_diagonal_width))

    def bytes_arithmetic(self, dtype) -> str:
        return (f"EK-FAC correction: eigenbases, K-FAC and corrected eigenvalues and their float64 sums "
                f"{_gb(self.fixed_bytes(dtype))} GB")

    def output_bytes(self, n: int) -> float:
        """The eigenbases and the re-fitted (out, in) eigenvalue grid of each block."""
        return kron_output_bytes(self.target.space, self.kron_float64_width, self.kron_diagonal_width, refit=True)

    def describe(self) -> str:
        notes = [x for x in self.target.subset_notes() if x.startswith("eigenvalue")]
        return f"{self.kind} ekfac" + (f" ({notes[0]})" if notes else "")


@dataclass(eq=False, frozen=True)
class ScoresJob(Job):
    """⟨held_i, H streamed_j⟩ for a score ``Inner(L, H, R)``: the held side (collected by
    a CollectJob, preconditioned once) against each chunk of the streamed side.

    ``held_storage``: how the held rows are kept; ``normalize_streamed``: the streamed
    side is ``G.normalize()`` read unnormalized, each column divided by its row's norm."""

    kind: ClassVar[str] = "scores"
    output: ClassVar[str] = "scores"
    ops_per_block: ClassVar[int] = 10

    held_storage: dict = field(default_factory=dict)
    normalize_streamed: bool = False
    #: the held rows are read by no other job: once preconditioned, the run drops them
    release_held: bool = False

    def describe(self) -> str:
        side = "rows" if not self.transposed else "columns"
        return (f"scores ({self.target.label}) streaming {self.streams[0].label!r}, "
                f"held {side}: {self.held.label!r}")

    def fixed_bytes(self, dtype) -> float:
        """The held rows, their preconditioned copy, and the ghost kernel's intermediates
        (bounded by token blocks).

        A preconditioned product ``⟨H L_i, R_j⟩`` makes ``H L_i`` once, as flat rows
        (n_held, dim) beside the held rows it is made from, and both count (EK-FAC
        influence on W2, 32 queries: 292 MiB of factors + 471 MB of preconditioned rows)
        for an operator applied to the concatenated rows. A Kronecker one with
        ``release_held`` (:func:`blockwise_preconditioner`) is applied block by block, each
        raw block dropped as it is done: at most the larger of the two copies plus one
        block's preconditioned rows, and never more than both (W2: the scores pass grew
        by 325 MB against 1.03 GB counted with both copies). ``release_held`` is decided after the batch sizes (sized
        with both copies: safe); the planner then lowers the pass's estimate to this."""
        raw = rows_bytes(self.held, self.held_storage, dtype)
        if isinstance(self.target.op, Identity):
            return raw + ghost_workspace_bytes(self, dtype)
        flat = rows_bytes(self.held, {}, dtype)
        if self.release_held and blockwise_preconditioner(self.target.op):
            block = max((self.held.n * rows_of(self.held) * b.dim * element_size(dtype)
                         for b in self.held.space.blocks), default=0.0)
            return min(raw + flat, max(raw, flat) + block) + ghost_workspace_bytes(self, dtype)
        return raw + flat + ghost_workspace_bytes(self, dtype)

    def block_cost(self, node) -> Cost:
        """A ghost block's fixed cost is its own (measured apart)."""
        blocks = node.space.blocks
        ghosts = sum(1 for b in blocks if self.kernels.get(b.name) == "ghost")
        return block_cost("ghost", ghosts, self.ops_per_block) + block_cost(self.kind, len(blocks) - ghosts,
                                                                            self.ops_per_block)

    def chunk_cost(self, node, c, layout, elem) -> Cost:
        return scores_chunk_cost(node, self.held, self.kernels, c, layout, elem)

    def once_cost(self, elem, storage_of=None, options=None, resolved=None) -> Cost:
        held_layout = storage_of(self.held) if storage_of is not None else {}
        return scores_once_cost(self.held, self.kernels, held_layout, self.target.op, elem, options, resolved)

    def output_bytes(self, n: int) -> float:
        return 8.0 * self.held.n * n

    def score_parts(self) -> tuple:
        return (self,)

    def example_bytes(self, dtype) -> float:
        return 0.0

    def per_example_bytes(self, dtype) -> float:
        total = super().per_example_bytes(dtype)
        for b in self.held.space.blocks:
            if self.kernels.get(b.name) != "ghost":
                # the streamed rows materialized, and their product (T rows per example when per-token)
                total += b.dim * 8 * token_rows(self.streams[0])
        return total


def blockwise_preconditioner(op) -> bool:
    """Whether ``op`` resolves to an operator applied block by block to factored rows (a
    Kronecker K-FAC / EK-FAC, :meth:`~gradalg.linalg.kron.KronOp.apply_block`): its
    structure is "kron" and no iterative solver (``Inverse(method="cg"/"lissa")``) wraps it."""
    if getattr(op, "structure", None) != "kron":
        return False
    x = op
    while x is not None:
        if getattr(x, "method", "auto") in ("cg", "lissa"):
            return False
        x = getattr(x, "op", None)
    return True


@dataclass(frozen=True)
class TopK:
    """What a top-k plan keeps per query: the ``k`` largest scores (``largest=True``,
    most helpful) or the ``k`` smallest (``largest=False``, most harmful), ties broken
    by the lower training position (``plan(node, topk=TopK(k))``)."""

    k: int
    largest: bool = True

    def __post_init__(self):
        if not isinstance(self.k, int) or isinstance(self.k, bool) or self.k < 1:
            raise OptionError(f"k must be a positive integer (the best training rows per query), got {self.k!r}")


@dataclass(eq=False, frozen=True)
class TopKJob(Job):
    """The ``k`` best training rows per query of a score expression, merged chunk by
    chunk of the streamed side; the (query × train) matrix is never formed.

    ``terms``: ``((coef, ScoresJob), ...)``, one per ``Inner`` of the expression (a sum
    has several), each with its held side and kernels as the planner chose them; per
    streamed chunk the sink sums ``coef · scores`` of the terms and merges the block into
    a running top-k (:class:`~gradalg.exec.accumulators.TopKAccumulator`). A sum's terms
    all hold their query side; a single term may hold the training side instead, then
    each streamed chunk of queries is ranked over all training rows at once.

    Bytes: held rows of every term, plus the running (n_query, k) values and positions
    (8 + 8 bytes each); per streamed example, besides each term's own working bytes, one
    column of n_query scores per term, their sum, and in the merge its copy with an int64
    position and an int64 index (``output_bytes`` is n_query·k, not n_query·n_train)."""

    kind: ClassVar[str] = "topk"
    output: ClassVar[str] = "topk"

    k: int = 1
    largest: bool = True
    terms: tuple = ()

    def describe(self) -> str:
        which = "largest" if self.largest else "smallest"
        return (f"top-{self.k} ({which}) of {self.target.label} streaming "
                f"{', '.join(repr(s.label) for s in self.streams)}")

    @property
    def n_query(self) -> int:
        return self.target.shape[0]

    def stream_cost(self, n_stream, chunk, dtype, layout_of, storage_of=None, options=None, resolved=None) -> Cost:
        """Its terms' score blocks (the merge is O(n_query·(k + chunk)), not counted)."""
        total = Cost()
        for _, term in self.terms:
            total = total + term.stream_cost(n_stream, chunk, dtype, layout_of, storage_of, options, resolved)
        return total

    def score_parts(self) -> tuple:
        return tuple(t for _, t in self.terms)

    def fixed_bytes(self, dtype) -> float:
        return sum(j.fixed_bytes(dtype) for _, j in self.terms) + 16.0 * self.n_query * self.k

    def per_example_bytes(self, dtype) -> float:
        held = max((j.held.n for _, j in self.terms), default=0)
        elem = element_size(dtype) if dtype is not None else 4
        return (sum(j.per_example_bytes(dtype) for _, j in self.terms)
                + held * (elem * (len(self.terms) + 2) + 16.0))

    def output_bytes(self, n: int) -> float:
        return 16.0 * self.n_query * self.k


@dataclass(eq=False, frozen=True)
class DiagJob(Job):
    """d_i = ⟨L_i, H R_i⟩ of a :class:`~gradalg.expr.ScoreDiagonal`: both sides streamed in
    lockstep, or the left one ``held`` (collected) and aligned to the streamed rows by id."""

    kind: ClassVar[str] = "diag"
    output: ClassVar[str] = "scores"
    ops_per_block: ClassVar[int] = 6

    def chunk_cost(self, node, c, layout, elem) -> Cost:
        return diag_chunk_cost(node, self.target.scores.op, c, layout, elem)

    def once_cost(self, elem, storage_of=None, options=None, resolved=None) -> Cost:
        return resolve_once(self.target.scores.op, resolved)

    def fixed_bytes(self, dtype) -> float:
        """Nothing: a held side is a CollectJob's rows."""
        return 0.0

    def output_bytes(self, n: int) -> float:
        return 8.0 * n

    def example_bytes(self, dtype) -> float:
        return flat_example_bytes(self.streams[0], dtype, 8.0)

    def per_example_bytes(self, dtype) -> float:
        """What the job materializes per example, and the ghost norms' intermediates of
        factored rows (a self-score of one side: ‖G_i‖² by the ghost identity)."""
        return super().per_example_bytes(dtype) + ghost_norm_bytes_per_example(self, dtype)


def job_type(kind: str) -> type[Job]:
    """The job class of a kind name (``"scores"`` → :class:`ScoresJob`)."""
    try:
        return JOB_TYPES[kind]
    except KeyError:
        raise KeyError(f"unknown job kind {kind!r}; kinds: {sorted(JOB_TYPES)}") from None

