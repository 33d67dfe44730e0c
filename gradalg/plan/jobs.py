"""The jobs of a physical plan: one class per thing a pass does with its chunks.

A :class:`Job` names what it reads (``streams``: gradient nodes whose chunks the pass
feeds it, and ``deps``: the keys of jobs that must finish first), what it produces
(``output``) and how much it costs, filled in when the planner sizes its pass:
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

``Job.kind`` is the job's short name (``"scores"``, ...), shown by ``describe()`` and
kept for code that dispatches on it. A job is keyed by ``(kind, target token)``
(:attr:`Job.key`): the plan's ``jobs`` dict, the dependencies and the executor's
results all use that key.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from ..errors import OptionError
from ..expr import GradNode, Node
from ..expr.operators import Identity
from ..expr.tokens import token_rows
from .cost import Cost, fisher_cost
from .memory import (_gb, consumer_bytes_per_example, ekfac_bytes, ekfac_example_bytes, ghost_norm_bytes_per_example,
                     ghost_workspace_bytes, kron_bytes,
                     kron_bytes_arithmetic, kron_output_bytes, rows_bytes, rows_of)
from .shapes import element_size

__all__ = ["Job", "CollectJob", "StoreJob", "GroupJob", "FisherJob", "KFACJob", "EKFACJob", "ScoresJob",
           "DiagJob", "TopK", "TopKJob", "JOB_TYPES", "job_type"]


@dataclass(eq=False)
class Job:
    """One job of a pass. ``key`` is ``(kind, target token)``."""

    kind: ClassVar[str] = "job"
    #: what ``finish`` of the job's sink gives the executor
    output: ClassVar[str] = ""

    target: Node
    streams: tuple[GradNode, ...] = ()
    deps: set = field(default_factory=set)
    held: GradNode | None = None
    transposed: bool = False
    #: {block: "ghost" | "dense"}: the inner-product kernel of each block (scores jobs)
    kernels: dict = field(default_factory=dict)
    #: {block: "factors" | "flat"}: how kept rows are stored (collect, store jobs)
    storage: dict = field(default_factory=dict)
    #: estimated FLOPs and traffic of this job in its pass (set when the pass is sized)
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

    def __post_init__(self):
        if type(self) is Job or isinstance(self.target, str):
            raise TypeError("a job is an instance of its class: CollectJob(target, streams, deps, ...), or "
                            "job_type(kind)(target, ...), not Job(kind, target, ...)")

    @property
    def key(self) -> tuple[str, str]:
        return (self.kind, self.target.token)

    def describe(self) -> str:
        return f"{self.kind} {self.target.label}"

    def fixed_bytes(self, dtype) -> float:
        """Bytes the job holds for its whole pass (held rows, statistics)."""
        return 0.0

    def per_example_bytes(self, dtype) -> float:
        """Working bytes per streamed example, beyond the captured rows."""
        return consumer_bytes_per_example(self, dtype)

    def bytes_arithmetic(self, dtype) -> str:
        """How :meth:`fixed_bytes` adds up, for messages ("" when it is one number)."""
        return ""

    def output_bytes(self, n: int) -> float:
        """Rough bytes of the job's result over ``n`` streamed examples (what the shards of
        a distributed pass send back, summed over shards)."""
        return 8.0 * n


@dataclass(eq=False)
class RowsJob(Job):
    """A job whose output is rows kept in memory: their bytes are its footprint."""

    output: ClassVar[str] = "rows"

    def fixed_bytes(self, dtype) -> float:
        return rows_bytes(self.target, self.storage, dtype)

    def output_bytes(self, n: int) -> float:
        return 4.0 * self.target.n * self.target.space.dim


@dataclass(eq=False)
class CollectJob(RowsJob):
    """Keep every row of ``target`` (a held side, or the rows of a gradient node)."""

    kind: ClassVar[str] = "collect"

    def describe(self) -> str:
        return f"{self.kind} {self.target.label!r} ({self.target.n:,} rows)"


@dataclass(eq=False)
class StoreJob(CollectJob):
    """Keep rows that a later pass reads after this pass's statistics (stored, not re-read)."""

    kind: ClassVar[str] = "store"


@dataclass(eq=False)
class GroupJob(RowsJob):
    """Group means of the rows of ``target.grads`` (a :class:`~gradalg.expr.GroupMean`)."""

    kind: ClassVar[str] = "group"


@dataclass(eq=False)
class FisherJob(Job):
    """F = (1/n) Σ_i g_i g_iᵀ in float64 (dense d², block Σ d_b², diag d)."""

    kind: ClassVar[str] = "fisher"
    output: ClassVar[str] = "operator"

    def fixed_bytes(self, dtype) -> float:
        return fisher_cost(1, [b.dim for b in self.target.space.blocks], self.target.structure).peak_bytes

    def output_bytes(self, n: int) -> float:
        return self.fixed_bytes(None)


@dataclass(eq=False)
class KronStatisticsJob(Job):
    """A job accumulating per-block Kronecker statistics: two (out, out) and (in, in)
    matrices per block are its footprint and its output."""

    output: ClassVar[str] = "operator"

    def fixed_bytes(self, dtype) -> float:
        return kron_bytes(self.target.space, self.kron_float64_width, self.kron_diagonal_width)

    def bytes_arithmetic(self, dtype) -> str:
        return kron_bytes_arithmetic(self.target.space, self.kron_float64_width, self.kron_diagonal_width)

    def output_bytes(self, n: int) -> float:
        return kron_output_bytes(self.target.space, self.kron_float64_width, self.kron_diagonal_width)


@dataclass(eq=False)
class KFACJob(KronStatisticsJob):
    """K-FAC's Kronecker factors S = E[DᵀD], A = E[AᵀA] per block, and their eigenbases."""

    kind: ClassVar[str] = "kfac"

    def describe(self) -> str:
        t = self.target
        notes = [x for x in t.subset_notes() if x.startswith("covariances")]
        return f"{self.kind} {'ekfac' if t.eigen_correction else 'kfac'}" + (f" ({notes[0]})" if notes else "")


@dataclass(eq=False)
class EKFACJob(KronStatisticsJob):
    """EK-FAC's eigenvalue correction E[(Q_Sᵀ G Q_A)²], in the KFACJob's eigenbases
    (a second pass: it depends on the KFACJob of the same operator)."""

    kind: ClassVar[str] = "ekfac"

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


@dataclass(eq=False)
class ScoresJob(Job):
    """⟨held_i, H streamed_j⟩ for a score ``Inner(L, H, R)``: the held side (collected by
    a CollectJob, preconditioned once) against each chunk of the streamed side.

    ``held_storage``: how the held rows are kept; ``normalize_streamed``: the streamed
    side is ``G.normalize()`` read unnormalized, each column divided by its row's norm."""

    kind: ClassVar[str] = "scores"
    output: ClassVar[str] = "scores"

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

    def output_bytes(self, n: int) -> float:
        return 8.0 * self.held.n * n

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


@dataclass(eq=False)
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

    def fixed_bytes(self, dtype) -> float:
        return sum(j.fixed_bytes(dtype) for _, j in self.terms) + 16.0 * self.n_query * self.k

    def per_example_bytes(self, dtype) -> float:
        held = max((j.held.n for _, j in self.terms), default=0)
        elem = element_size(dtype) if dtype is not None else 4
        return (sum(j.per_example_bytes(dtype) for _, j in self.terms)
                + held * (elem * (len(self.terms) + 2) + 16.0))

    def output_bytes(self, n: int) -> float:
        return 16.0 * self.n_query * self.k


@dataclass(eq=False)
class DiagJob(Job):
    """d_i = ⟨L_i, H R_i⟩ of a :class:`~gradalg.expr.ScoreDiagonal`: both sides streamed in
    lockstep, or the left one ``held`` (collected) and aligned to the streamed rows by id."""

    kind: ClassVar[str] = "diag"
    output: ClassVar[str] = "scores"

    def per_example_bytes(self, dtype) -> float:
        """What the job materializes per example, and the ghost norms' intermediates of
        factored rows (a self-score of one side: ‖G_i‖² by the ghost identity)."""
        return super().per_example_bytes(dtype) + ghost_norm_bytes_per_example(self, dtype)


JOB_TYPES: dict[str, type[Job]] = {cls.kind: cls for cls in
                                   (CollectJob, StoreJob, GroupJob, FisherJob, KFACJob, EKFACJob, ScoresJob,
                                    DiagJob, TopKJob)}


def job_type(kind: str) -> type[Job]:
    """The job class of a kind name (``"scores"`` → :class:`ScoresJob`)."""
    try:
        return JOB_TYPES[kind]
    except KeyError:
        raise KeyError(f"unknown job kind {kind!r}; kinds: {sorted(JOB_TYPES)}") from None

