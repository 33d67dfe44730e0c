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

Jobs (one class each in :mod:`gradalg.plan.jobs`; ``kind`` in brackets)
----
CollectJob (``collect``)  keep all rows of a gradient node (a held side); StoreJob
                          (``store``) rows a later pass needs again
GroupJob (``group``)      accumulate group means (GroupMean)
FisherJob (``fisher``)    accumulate Σ g gᵀ (dense / block / diag)
KFACJob (``kfac``)        accumulate Kronecker factors; EKFACJob (``ekfac``) the
                          eigenvalue correction (a second pass: it needs the eigenbasis)
ScoresJob (``scores``)    inner products of the streamed side with the held side
TopKJob (``topk``)        the k best scores per query, merged block by block (``plan(..., topk=)``)
DiagJob (``diag``)        self-scores, both sides streamed in lockstep

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

from ..capture.hooks import forward_share_key
from ..expr import (AdamPrecondition, Captured, GradNode, GroupMean, Identity, Inner, Node, Normalize, OpNode,
                    Precondition, Project, RowWise, ScoreDiagonal, ScoreNode, ScoreSum, Source)
from ..errors import MemoryBudgetError, ObjectiveError
from ..expr.lowrank import lowrank_below
from ..expr.tokens import token_rows
from ..options import CPU_BATCH_TOKENS, Options, get_options
from .budget import Budget, resolve_budget, with_note
from .choices import Choices
from . import estimates
from .cost import Cost, _si, first_example_shape, tokens_hint
from .devices import DeviceProfile, profile
from .shapes import element_size, forward_shapes
from .jobs import (CollectJob, DiagJob, EKFACJob, FisherJob, GroupJob, Job, KFACJob, ScoresJob, StoreJob, TopK,
                   TopKJob)
from .decisions import Decision, DecisionKind, Decisions
from .memory import (capture_bytes_per_example, positions,
                     projection_map_decisions, rows_bytes)
from .rules import Firing, PlanError, simplify_until_fixpoint

__all__ = ["Job", "Pass", "Decision", "DecisionKind", "Plan", "plan", "estimate", "stream_root", "PlanError"]  # jobs: plan/jobs.py

ROW_WISE = RowWise      # the nodes a pass derives chunk by chunk (the row-wise protocol)
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
    """Operators used by the row-wise chain from ``node`` down to its stream root (the
    operator operands of each of its nodes: a preconditioner, a normalization's metric)."""
    ops = []
    while isinstance(node, ROW_WISE):
        ops.extend(c for c in node.children if isinstance(c, OpNode))
        node = node.grads
    return ops


#: the job class of each statistics kind an operator asks for (``Statistic.job``)
STATISTICS_JOBS = {cls.kind: cls for cls in (FisherJob, KFACJob, EKFACJob)}


# ------------------------------------------------------------------ plan records
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
class Plan:
    """The planner's output: every stage, the decisions and the physical passes."""

    logical: Node
    simplified: Node
    fired: list[Firing]
    decisions: Decisions        # typed records: plan.decisions.of(DecisionKind.KERNEL, block=...)
    passes: list[Pass]
    jobs: dict
    roots: list[str]
    options: Options
    device: DeviceProfile
    stored: set
    dtype: torch.dtype = torch.float32
    budget: Budget | None = None    # the memory budget and its source (options.memory_budget is its bytes)
    placement: tuple = ()           # per pass, where it runs (exec.runner.Placement), from the executor's shard strategy

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


# ------------------------------------------------------------------ the planner
class _Planner:
    def __init__(self, options: Options, device: DeviceProfile, choices: Choices | None = None):
        self.options = options
        self.choices = choices or Choices()
        self.device = device
        self.jobs: dict[tuple, Job] = {}
        self.decisions = Decisions()
        self.dtype = torch.float32
        self.for_run = False     # planning a run: every layer's positions were measured
        # {id(node): (node, representation)}: a node's representation is a fresh dict over
        # all its blocks; asked per block, it made planning quadratic in the block count
        self._representations: dict[int, tuple] = {}
        self._task_tokens: dict[int, tuple] = {}     # {id(task): (task, task.token)}
        self._share_keys: dict[int, tuple] = {}      # {id(source): (source, forward_share_key)}
        self.drawn: set = set()     # dense projection matrices an earlier pass draws (kept by the process)
        self.resolved: set = set()  # operators an earlier pass or transform resolves (kept by the run)
        self.stored_chunks: dict = {}  # {token: examples per chunk} of rows a pass stores batch by batch

    # ---- jobs -------------------------------------------------------------------
    def add(self, job: Job) -> tuple:
        if job.key not in self.jobs:
            self.jobs[job.key] = self._with_kernel_options(job)
        return job.key

    def _with_kernel_options(self, job: Job) -> Job:
        """``job`` with the kernel options it runs under (token blocks, ghost slices,
        precision of Kronecker factors) copied from ``ga.options``, so the executor reads them
        from the plan."""
        o = self.options
        job.token_block, job.slice_elements = o.token_block, o.ghost_slice_elements
        job.kron_float64_width, job.kron_float32_rtol = o.kron_float64_width, o.kron_float32_rtol
        job.kron_diagonal_width, job.buffer_bytes = o.kron_diagonal_width, o.reuse_buffer_bytes
        return job

    def stream_deps(self, node: GradNode) -> set:
        deps = set()
        for op in chain_ops(node):
            deps |= self.op_deps(op)
        root = stream_root(node)
        if isinstance(root, GroupMean):
            deps.add(self.add(GroupJob(root, (root.grads,), self.stream_deps(root.grads),
                                       storage=self.storage(root))))
        return deps

    def op_deps(self, op: OpNode) -> set:
        """The keys of the jobs that must finish before ``op`` resolves: one per statistic
        it needs (``op.statistics()``), each after the jobs its rows need."""
        out = set()
        for statistic in op.statistics():
            out |= self.statistic_deps(statistic)
        return out

    def statistic_deps(self, statistic) -> set:
        """The job of one statistic (added), or for a statistic read when applied (no job),
        the jobs its rows need."""
        deps = self.stream_deps(statistic.rows)
        for before in statistic.after:
            deps |= self.statistic_deps(before)
        if statistic.job is None:
            return deps
        if statistic.job not in STATISTICS_JOBS:
            raise PlanError(f"{statistic.node.label} asks for a statistic of job kind {statistic.job!r}; the planner "
                            f"has jobs {sorted(STATISTICS_JOBS)}: return one of those from its statistics(), or "
                            "Statistic(None, node, rows) for rows it reads itself when applied")
        job = STATISTICS_JOBS[statistic.job](statistic.node, (statistic.rows,), deps)
        if job.key not in self.jobs:
            self.decisions.extend(job.first_decisions(self.options))
        return {self.add(job)}

    def score_jobs(self, node: ScoreNode) -> list[tuple]:
        if isinstance(node, ScoreSum):
            keys = []
            for t in node.terms:
                keys.extend(self.score_jobs(t))
            return keys
        return [self.add(self._score_job(node))]

    def topk_jobs(self, node: ScoreNode, spec: TopK) -> list[tuple]:
        """One :class:`TopKJob` for the whole score expression: its terms' score blocks are
        summed per streamed chunk and merged into a running top-k. A sum's terms all hold
        their query side and stream the training side in one pass (summed column blocks)."""
        terms = _flat_terms(node)
        if len(terms) == 1 and terms[0][0] == 1.0:
            jobs = [(1.0, self._score_job(terms[0][1]))]
        else:
            jobs = [(c, self._score_job(t, hold="left")) for c, t in terms]
            keys = {self._pass_key(j.streams[0], set()) for _, j in jobs}
            if len(keys) > 1:
                raise PlanError(
                    f"the top-k of {node.label} needs every term's training side streamed in one pass, but its "
                    f"terms read {len(keys)} different (model, data) pairs: compute the scores into a store "
                    "(S.compute(store='scores.zarr')) and rank that, or take each term's top-k separately")
        streams, deps = [], set()
        for _, j in jobs:
            deps |= j.deps
            if j.streams[0].token not in {s.token for s in streams}:
                streams.append(j.streams[0])
        terms = tuple((c, self._with_kernel_options(j)) for c, j in jobs)   # its sink runs them
        job = TopKJob(node, tuple(streams), deps, k=spec.k, largest=spec.largest, terms=terms)
        return [self.add(job)]

    def _score_job(self, node: Inner, hold: str | None = None) -> ScoresJob:
        """The scores job of one ``Inner`` (its held side's collect job added); ``hold``
        forces the held side ("left"), else the planner (or ``Choices(held=...)``) picks it."""
        if not isinstance(node, Inner):
            raise PlanError(f"cannot plan scores of {type(node).__name__}")
        for side in (node.left, node.right):
            src = stream_root(side)
            if isinstance(src, Source) and src.objective == "expected":
                raise ObjectiveError("gradients with objective='expected' have one row per term of the "
                                     "Gauss-Newton decomposition, not per example: use them for curvature "
                                     "(ga.fisher, ga.kfac) only, and score with objective='loss' (the default) "
                                     "or 'sampled' gradients")
        held, streamed, transposed = node.left, node.right, False
        hold_left = self._rows_bytes(node.left)
        hold_right = self._rows_bytes(node.right)
        forced = self.choices.held if hold is None else hold
        if (forced == "right") or (forced == "auto" and hold_right < hold_left):
            held, streamed, transposed = node.right, node.left, True
        why = ("hold the side with the smaller footprint and stream the other" if forced == "auto"
               else f"forced by Choices(held={forced!r})" if hold is None
               else "a term of a top-k over a sum: every term streams the training side")
        self.decisions.append(Decision(
            DecisionKind.HELD_SIDE, node.token, "right (training) rows" if transposed else "left (query) rows",
            {"hold left": f"{hold_left / 2**20:.2f} MiB", "hold right": f"{hold_right / 2**20:.2f} MiB"},
            why + "; H (symmetric) is applied once to the held rows"
            + ("" if isinstance(node.op, Identity) else " (precondition the held side)"), label=node.label))
        kernels = self._kernels(held, streamed, node)
        storage = self._held_storage(held, kernels, node)
        self._record_storage(held, storage, DecisionKind.HELD_STORAGE)
        self._record_low_rank(held)
        if isinstance(held, GroupMean):
            # its group job keeps the held rows (state.rows[held.token], in this storage):
            # collecting them again would be a pass that copies them
            ready = self.stream_deps(held)
        else:
            ready = {self.add(CollectJob(held, (held,), self.stream_deps(held), storage=storage))}
        job = ScoresJob(node, (streamed,), ready | self.op_deps(node.op) | self.stream_deps(streamed),
                        held=held, transposed=transposed, held_storage=storage)
        job.kernels = kernels
        return self._with_kernel_options(job)

    def _held_storage(self, held: GradNode, kernels: dict, inner: Inner) -> dict[str, str]:
        """The held rows' storage: :meth:`storage`, except that a block whose kernel is
        dense in an unpreconditioned product is kept flat under ``row_storage="auto"``: the
        dense kernel multiplies the flat rows, so keeping the factors too would hold the
        block twice (factors and their materialization)."""
        storage = self.storage(held)
        if self.options.row_storage != "auto" or not isinstance(inner.op, Identity):
            return storage
        return {name: "flat" if how == "factors" and kernels.get(name) == "dense" else how
                for name, how in storage.items()}

    def _record_low_rank(self, held: GradNode) -> None:
        """What a rank-r approximation of the held rows keeps (``G.low_rank(r)``,
        ``query_gradient_rank=``): its bytes against the exact rows', per truncated block."""
        low = lowrank_below(held)
        if low is None:
            return
        r, names = low.rank, low.truncated
        kept = [b.name for b in low.space.blocks if b.name not in names]
        exact = rows_bytes(low.grads, self.storage(low.grads), self.dtype)   # as the exact rows would be kept
        approx = rows_bytes(low, self.storage(low), self.dtype)
        self.decisions.append(Decision(
            DecisionKind.LOW_RANK, held.token, f"rank-{r} factors",
            {"exact rows": f"{_si(exact)}B", f"rank-{r} factors": f"{_si(approx)}B"},
            f"each held row's (out, in) block replaced by its best rank-{r} approximation L Rᵀ (truncated "
            f"SVD), r·(out + in) numbers instead of out·in, in {len(names)} block(s)"
            + (f"; exact in {len(kept)} block(s) with min(out, in) ≤ {r} or no matrix shape" if kept else "")
            + "; scored against factored rows as Σ_t Σ_k (d_t·l_k)(a_t·r_k) (the ghost kernel with r "
              "held positions) or materialized once (dense: out·in per row while scoring), per the kernel "
              "decisions; ga.options(ghost='always') keeps them factored", label=repr(held.label)))

    def diag_jobs(self, node: ScoreDiagonal) -> list[tuple]:
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
            deps.add(self.add(CollectJob(inner.left, (inner.left,), self.stream_deps(inner.left),
                                         storage=self.as_captured(inner.left))))
            streams = (inner.right,)
            return [self.add(DiagJob(node, streams, deps, held=inner.left))]
        return [self.add(DiagJob(node, streams, deps))]

    # ---- sizes and costs ----------------------------------------------------------
    def storage(self, node: GradNode, need_factors: frozenset = frozenset()) -> dict[str, str]:
        """How kept rows are stored, per block: "factors" (n·T_b·(in+out) numbers) or "flat"
        (n·dim), whichever is smaller under ``ga.options(row_storage="auto")``, else as that
        option forces; factors where a consumer needs them (``need_factors``: K-FAC
        statistics) or ``ga.options(ghost="always")`` forces ghost kernels. Blocks that are
        not factored are flat."""
        T = positions(node)
        forced = self.options.ghost == "always"  # ghost kernels need the factors kept
        mode = self.options.row_storage
        out = {}
        for b in node.space.blocks:
            factored = len(b.shape) == 2 and self._is_factored(node, b.name)
            keep = factored and (forced or b.name in need_factors or mode == "factors"
                                 or (mode == "auto" and T[b.name] * (b.shape[0] + b.shape[1]) < b.dim))
            out[b.name] = "factors" if keep else "flat"
        return out

    def as_captured(self, node: GradNode) -> dict[str, str]:
        """Rows kept as the pass produces them: factored blocks as factors, others flat."""
        return {b.name: "factors" if len(b.shape) == 2 and self._is_factored(node, b.name) else "flat"
                for b in node.space.blocks}

    def _record_storage(self, node: GradNode, storage: dict, kind: DecisionKind) -> None:
        """The factors-vs-flat decision for kept rows (``kind``: held or stored rows), when
        some block could be either."""
        factored = [b for b in node.space.blocks if len(b.shape) == 2 and self._is_factored(node, b.name)]
        if not factored:
            return
        kinds = sorted({storage[b.name] for b in factored})
        chosen = kinds[0] if len(kinds) == 1 else ", ".join(
            f"{k} for {sum(storage[b.name] == k for b in factored)} block(s)" for k in kinds)
        as_factors = {**storage, **{b.name: "factors" for b in factored}}
        as_flat = {**storage, **{b.name: "flat" for b in factored}}
        mode = self.options.row_storage
        why = ("per block the smaller of its factors, T·(in + out) numbers per row, and its flat "
               "gradient, out·in" if mode == "auto" else f"forced by ga.options(row_storage={mode!r})")
        T = positions(node)
        if mode == "auto" and kind is DecisionKind.HELD_STORAGE and any(
                storage[b.name] == "flat" and T[b.name] * sum(b.shape) < b.dim for b in factored):
            why += "; flat where the block's kernel is dense (it multiplies the flat rows: not kept twice)"
        if self.options.ghost == "always":
            why += "; factors kept for ghost kernels (ga.options(ghost='always'))"
        self.decisions.append(Decision(
            kind, node.token, chosen,
            {"factors": f"{_si(rows_bytes(node, as_factors, self.dtype))}B",
             "flat": f"{_si(rows_bytes(node, as_flat, self.dtype))}B"}, why, label=repr(node.label)))

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
            stream_root(root.grads) is not None and self._representation(root.grads).get(block) == "factored"

    def _task_token(self, task) -> str:
        """``task.token`` once per plan: it fingerprints the model (a walk of every module),
        which planning never changes."""
        hit = self._task_tokens.get(id(task))
        if hit is None or hit[0] is not task:
            hit = self._task_tokens[id(task)] = (task, task.token)
        return hit[1]

    def _forward_share_key(self, src: Source):
        """``forward_share_key(src)`` once per plan (it resolves the layers and reads the
        task's token: a walk of the model)."""
        hit = self._share_keys.get(id(src))
        if hit is None or hit[0] is not src:
            hit = self._share_keys[id(src)] = (src, forward_share_key(src))
        return hit[1]

    def _representation(self, node: GradNode) -> dict:
        hit = self._representations.get(id(node))
        if hit is None or hit[0] is not node:
            hit = self._representations[id(node)] = (node, node.representation)
        return hit[1]

    def _is_factored(self, node: GradNode, block: str) -> bool:
        rep = self._representation(node)[block]
        return rep == "factored" or (rep == "projected" and self._kron_factored(node, block))

    def _kernels(self, held: GradNode, streamed: GradNode, inner: Inner) -> dict:
        """The inner-product kernel of every block, each a recorded decision where there is a
        choice: ``ghost`` from the factors or ``dense`` (materialize, one GEMM). The executor
        runs what this returns; it never routes a chunk itself."""
        kernels = {}
        kept = self.storage(held)
        P_h, P_s = positions(held), positions(streamed)
        known = self._positions_measured(held) and self._positions_measured(streamed)
        for b in held.space.blocks:
            kernels[b.name] = "dense"
            about = dict(block=b.name, label=inner.label)
            factored = len(b.shape) == 2 and self._is_factored(held, b.name) and self._is_factored(streamed, b.name)
            if not factored:
                continue           # flat rows on one side: dense is the only kernel
            fixed = self._kernel_without_choice(inner, kept[b.name], known)
            if fixed is not None:      # dense or "when run", nothing to cost
                kernels[b.name] = fixed[0]
                self.decisions.append(Decision(DecisionKind.KERNEL, inner.token, *fixed, **about))
                continue
            mode = self.options.ghost
            out_f, in_f = b.shape
            TL, TR = P_h[b.name], P_s[b.name]
            # both kernels priced by the calibrated cost model, as the scores job costs them
            costs = estimates.kernel_costs(held.n, streamed.n, self.options.batch_size, TL, TR, in_f, out_f,
                                           element_size(self.dtype))
            ghost, dense = (self.device.time_of(costs[k], self.dtype) for k in ("ghost", "dense"))
            if mode == "auto" and not known:
                chosen = "dense"   # the forward could not be measured: dense grows linearly in T, ghost as T²
                why = (f"T of this layer unknown (its model cannot run on the meta device; {TL}/{TR} "
                       "assumed): dense, whose cost grows linearly with T where ghost's grows as T²")
            else:
                chosen = "ghost" if (mode == "always" or (mode == "auto" and ghost <= dense)) else "dense"
                why = (f"T={TL}/{TR}, in={in_f}, out={out_f}, {held.n}×{streamed.n} pairs in chunks of "
                       f"{min(self.options.batch_size, streamed.n)}: the faster by the device profile "
                       f"({self.device.name})"
                       + ("" if mode == "auto" else f" (forced by ga.options(ghost={mode!r}))"))
            if chosen == "ghost":
                why += (f"; in slices of at most {self.options.ghost_slice_elements:,} elements, "
                        f"pairs of blocks of {self.options.token_block} positions")
            else:
                why += (f"; streamed blocks of {_si(self.options.reuse_buffer_bytes)}B or more are "
                        "materialized into one reused buffer")
            kernels[b.name] = chosen
            # the estimated seconds of each kernel (GEMMs by shape, traffic) on this device
            self.decisions.append(Decision(DecisionKind.KERNEL, inner.token, chosen, {"ghost": ghost, "dense": dense},
                                           why, **about))
        return kernels

    def _kernel_without_choice(self, inner: Inner, held_storage: str, known: bool) -> tuple | None:
        """``(chosen, alternatives, reason)`` of a factored block whose kernel is not a
        costed choice: dense for a preconditioned product or flat held rows, "when run"
        while the positions per example are unmeasured; None when both kernels are costed."""
        if not isinstance(inner.op, Identity):
            return ("dense", {"ghost": "unavailable", "dense": "the preconditioned held rows"},
                    "H·L_i of a preconditioned product is not a product of the factors of L_i: the held "
                    "rows are materialized once, preconditioned, and multiplied with each streamed chunk")
        if held_storage != "factors":
            return ("dense", {"ghost": "needs the held factors", "dense": "the flat held rows"},
                    "the held rows of this block are kept flat (see their storage decision)")
        if self.options.ghost == "auto" and not known and not self.for_run:
            # T differs per layer (convolutions, non-token inputs): measured on the meta
            # device by the executor, which plans again with it before running
            return ("when run", {"ghost": "needs T", "dense": "needs T"},
                    "the positions per example (T) of this layer are not known from the data's shape: "
                    "an executor measures them (one meta-device forward) and decides before the run")
        return None

    def _positions_measured(self, node: GradNode) -> bool:
        """Whether ``positions(node)`` are every layer's real T: known from the data's shape
        (token ids, flat vectors) or measured by a meta-device forward."""
        if _positions_known(node) and not any(b.kind in CONV_KINDS for b in node.space.blocks):
            return True
        src = node.source
        if isinstance(src, Captured):
            return True     # rows in memory: their factors' shapes are known (memory.captured_positions)
        return isinstance(src, Source) and forward_shapes(src).measured

    def _pass_key(self, node: GradNode, stored: set) -> tuple:
        x = node
        while True:
            if x.token in stored:
                return ("memory", x.token)
            if not isinstance(x, ROW_WISE):
                break
            x = x.grads
        if isinstance(x, Source):
            return ("data", self._task_token(x.task), x.data.token, x.task.name, x.data.n)
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

    def _batch_tokens(self, sources: list[Source]) -> tuple[int, int, int | None]:
        """``(batch_tokens, T, examples)``: the ``batch_tokens`` in force for the pass's
        model (``ga.options``; None: :data:`~gradalg.options.CPU_BATCH_TOKENS` on the CPU,
        no limit elsewhere), the positions T per example of its data (the first
        example's) and the examples per batch that many positions allow,
        ``max(1, ⌈batch_tokens / T⌉)`` (None: no limit)."""
        tokens = self.options.batch_tokens
        if tokens is None:
            model = sources[0].task.model
            param = next(iter(model.parameters()), None)
            on_cpu = param is None or param.device.type == "cpu"
            tokens = CPU_BATCH_TOKENS if on_cpu else 0
        if not tokens:
            return 0, 1, None
        T = max(tokens_hint(s) for s in sources)
        return tokens, T, max(1, -(-tokens // T))

    def _pass_capture_cost(self, sources: list[Source], batch: int | None = None) -> Cost:
        """Capturing all sources of a pass: those differing only in their objective share
        one forward per batch (:class:`~gradalg.exec.capture_pass.PassCapture`)."""
        return estimates.pass_capture_cost(sources, self.options, self.dtype, self._forward_share_key, batch)

    def _layout(self, node: GradNode, reads_data: bool) -> dict:
        """``{block: "factors" | "flat"}`` of ``node``'s rows as a pass delivers them: as
        stored (a pass over rows in memory), else factors where the capture or a
        Kronecker projection leaves factors."""
        if not reads_data:
            store = self.jobs.get(("store", node.token)) or self.jobs.get(("collect", node.token))
            if store is not None and store.storage:
                return dict(store.storage)
        return {b.name: "factors" if (len(b.shape) == 2 and self._is_factored(node, b.name)) else "flat"
                for b in node.space.blocks}

    def _job_cost(self, job: Job, n_stream: int, reads_data: bool = True, chunk: int | None = None) -> Cost:
        return job.stream_cost(n_stream, chunk or self.options.batch_size, self.dtype,
                               lambda node: self._layout(node, reads_data), self.storage, self.options, self.resolved)

    def _rowwise_cost(self, jobs: list[Job], n: int, chunk: int | None, base: set, reads_data: bool) -> Cost:
        """The row-wise transforms the pass derives from the rows it reads (``base``: their
        tokens, when the pass reads rows in memory), each distinct one once
        (:func:`gradalg.plan.estimates.rowwise_cost`)."""
        seen, cost = set(), Cost()
        for job in jobs:
            for s in job.streams:
                # a normalization the score kernel applies: the sink is fed the rows below it
                x = s.grads if getattr(job, "normalize_streamed", False) else s
                while isinstance(x, ROW_WISE) and x.token not in base and x.token not in seen:
                    seen.add(x.token)
                    cost = cost + estimates.rowwise_cost(
                        x, n * token_rows(x), chunk, self._layout(x.grads, reads_data), element_size(self.dtype),
                        self.options, self.drawn, self.resolved)
                    x = x.grads
        return cost

    def _per_example_bytes(self, p_jobs: list[Job], sources: list[Source]) -> float:
        total, forwards = 0.0, set()
        for src in sources:   # sources sharing one forward per batch keep its activations once
            key = self._forward_share_key(src)
            total += capture_bytes_per_example(src, self.dtype, forward_shared=key is not None and key in forwards)
            forwards.add(key)
        return total + sum(job.per_example_bytes(self.dtype) for job in p_jobs)

    def _fixed_bytes(self, p_jobs: list[Job]) -> float:
        """Held rows and statistics of the pass's jobs, plus the index tables of the sparse
        projections its streams apply (each (projector, block) once)."""
        return sum(job.fixed_bytes(self.dtype) for job in p_jobs) + self._table_bytes(p_jobs)

    @staticmethod
    def _table_bytes(p_jobs: list[Job]) -> float:
        tables: dict[tuple, float] = {}
        for job in p_jobs:
            for x in job.streams:
                while isinstance(x, ROW_WISE):
                    if isinstance(x, Project):
                        for b in x.grads.space.blocks:
                            tables[(x.projector, b.name, b.dim)] = estimates.sparse_table_bytes(x.projector, b)
                    x = x.grads
        return sum(tables.values())

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
            ready = self._defer_held(ready, remaining, done, stored)
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
            self._decide_normalization(p)
            self._size_pass(p, stored)
        return passes, stored

    def _defer_held(self, ready: list, remaining: dict, done: set, stored: set) -> list:
        """Ready jobs to run in this wave, less the collections of held rows that can wait.

        A held side collected in a pass of its own (no other ready job reads its data) is
        collected in the last wave before its scores job can run, not the first: the rows
        are not carried through the passes that build the preconditioner (EK-FAC's
        covariance and eigenvalue-correction passes would otherwise hold the query
        gradients). Collections that share a pass with another ready job stay (that read
        of the data is shared)."""
        keys = {j.key: self._pass_key(j.streams[0], stored) for j in ready}
        after = done | set(keys)
        kept = []
        for j in ready:
            if isinstance(j, CollectJob) and len(ready) > 1 \
                    and sum(k == keys[j.key] for k in keys.values()) == 1:
                consumers = [c for c in remaining.values() if j.key in c.deps]
                if consumers and all(not (c.deps - {j.key}) <= after for c in consumers):
                    continue
            kept.append(j)
        return kept or ready

    def _decide_normalization(self, p: Pass) -> None:
        """Where the streamed side ``G.normalize()`` of a scores job is normalized: in the
        score kernel, each column divided by its row's norm (⟨h, g/‖g‖⟩ = ⟨h, g⟩/‖g‖, the
        norm taken from rows the kernel reads anyway), when the pass reads G or something
        below it; row-wise when the normalized rows themselves are kept in memory."""
        for job in [t for j in p.jobs for t in j.score_parts()]:
            s = job.streams[0] if job.streams else None
            if not (isinstance(s, Normalize) and s.op is None):
                continue
            job.normalize_streamed = not (p.key[0] == "memory" and p.key[1] == s.token)
            self.decisions.append(Decision(
                DecisionKind.NORMALIZATION, s.token, "in the score kernel" if job.normalize_streamed else "row-wise",
                {"in the score kernel": "⟨h, g⟩/‖g‖ per column", "row-wise": "g/‖g‖ per row, then ⟨h, ·⟩"},
                "the normalized rows are kept in memory: read as they are" if not job.normalize_streamed else
                "the pass reads the rows before normalization: each column is divided by its row's norm, "
                "from the rows the kernel reads (ghost blocks by their factors)",
                label=f"{s.label!r} in {job.target.label}"))

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
            if isinstance(job, TopKJob) and len(job.streams) > 1:
                # a pass over rows in memory reads one node: terms streaming several read the data again
                self.decisions.append(Decision(
                    DecisionKind.STORE, job.target.token, "recompute",
                    {"store": "n/a: a pass over rows in memory reads one node", "recompute": "one pass over the data"},
                    f"the top-k's terms stream {len(job.streams)} different nodes, summed block by block: "
                    "they are read together from the data", label=f"the training sides of {job.target.label}"))
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
                cap = self.options.store_fraction * self.options.memory_budget
                fits = size <= cap
                keep = 2.0 * size / self.device.bandwidth     # write the rows once, read them once
                choice = "store" if fits and keep <= recompute else "recompute"
                forced = self.choices.store
                if forced != "auto":
                    choice = "store" if forced == "always" else "recompute"
                    why = f"forced by Choices(store={forced!r})"
                elif not fits:
                    why = f"would exceed the store cap, {_store_cap(self.options)}"
                elif choice == "store":
                    why = f"fits under the store cap, {_store_cap(self.options)}, and costs less than reading the data again"
                else:
                    why = f"fits under the store cap, {_store_cap(self.options)}, but moving the rows costs more than recapturing them"
                self.decisions.append(Decision(
                    DecisionKind.STORE, node.token, choice,
                    {"store": keep if fits else f"{size / 2**20:.2f} MiB over the limit", "recompute": recompute},
                    "a later job needs these rows after statistics from the same pass; storing them " + why,
                    label=repr(node.label)))
                if choice == "store":
                    stored.add(node.token)
                    self._record_storage(node, storage, DecisionKind.STORED_STORAGE)
                    group.append(StoreJob(node, (node,), set(), storage=storage))

    def _factors_needed(self, node: GradNode, jobs: dict) -> frozenset:
        """Blocks of ``node`` that a later K-FAC job reads as factors (its statistics
        are covariances of A and D; every other consumer takes flat rows)."""
        need = set()
        for job in jobs.values():
            if isinstance(job, KFACJob) and any(self._chain_contains(s, node) for s in job.streams):
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

    def _decide_batch_size(self, p: Pass, sources: list[Source], fixed: float, per_ex: float) -> None:
        """The examples per batch of pass ``p`` over data (``p.batch_size``, ``p.note``), a
        ``BATCH_SIZE`` decision: the data's own batch size, else the smallest of
        ``ga.options(batch_size)``, what fits the memory budget beside ``fixed`` held bytes at
        ``per_ex`` bytes per example, and ``batch_tokens`` over the positions per example."""
        data, budget = sources[0].data, self.options.memory_budget
        if data.batch_size is not None or _is_loader(data):
            p.batch_size = data.batch_size or getattr(data.source, "batch_size", None)
            p.note = "batch size fixed by the data"
            self.decisions.append(Decision(
                DecisionKind.BATCH_SIZE, p.key, str(p.batch_size),
                {"the data's": str(p.batch_size), "ga.options": str(self.options.batch_size)},
                "fixed by the data (a DataLoader, or ga.grads(..., batch_size=...))", label=p.label))
        else:
            room = budget - fixed
            if room < per_ex:  # not even a batch of one example fits next to the held rows
                err = MemoryBudgetError(
                    f"{p.label}: held rows and statistics take {_si(fixed)}B and one example's "
                    f"factors and activations {_si(per_ex)}B, over the memory budget of {_si(budget)}B. "
                    "Project the gradients (ga.proj.kron), use fewer queries per call, or raise "
                    "ga.options(memory_budget=...)")
                err.needed = fixed + per_ex
                raise err
            fit = int(room // max(per_ex, 1.0))
            tokens, T, by_tokens = self._batch_tokens(sources)
            p.batch_size = max(1, min(self.options.batch_size, fit, by_tokens or self.options.batch_size))
            if p.batch_size < self.options.batch_size:
                p.note = (f"batch size {p.batch_size} (not {self.options.batch_size}) "
                          + ("to stay under the memory budget" if p.batch_size == fit else
                             f"of {T} positions each: {tokens} positions per batch (ga.options(batch_tokens))"))
            alternatives = {"ga.options": str(self.options.batch_size), "largest under the budget": f"{fit:,}"}
            if by_tokens:
                alternatives[f"batch_tokens {tokens} / T {T}"] = f"{by_tokens:,}"
            self.decisions.append(Decision(
                DecisionKind.BATCH_SIZE, p.key, str(p.batch_size), alternatives,
                f"the smallest: {_si(fixed)}B held and {_si(per_ex)}B per example "
                f"under the memory budget of {_si(budget)}B"
                + (f"; batches of {tokens} positions already run efficient GEMMs, and fewer examples keep "
                   "the activations small" if by_tokens and p.batch_size == by_tokens < fit else ""),
                label=p.label))

    def _size_pass(self, p: Pass, stored: set) -> None:
        sources = self._sources(p.jobs, stored) if p.reads_data else []
        per_ex = self._per_example_bytes(p.jobs, sources)
        fixed = self._fixed_bytes(p.jobs)
        p.per_example_bytes, p.fixed_bytes = per_ex, fixed
        budget = self.options.memory_budget
        if fixed > budget:   # held rows and statistics alone: refused before anything runs
            parts = "".join(f" ({a})" for a in (j.bytes_arithmetic(self.dtype) for j in p.jobs) if a)
            tables = self._table_bytes(p.jobs)
            parts += f" (sparse projection tables {_si(tables)}B)" if tables else ""
            err = MemoryBudgetError(
                f"{p.label}: held rows and statistics take {_si(fixed)}B{parts}, over the memory budget of "
                f"{_si(budget)}B: use fewer queries per call, project the gradients (ga.proj.kron), "
                "or raise ga.options(memory_budget=...)")
            err.needed = fixed + per_ex     # what a batch of one example needs (refusal_note)
            raise err
        if p.reads_data:
            data = sources[0].data
            self._decide_batch_size(p, sources, fixed, per_ex)
            cost = self._pass_capture_cost(sources, p.batch_size)
            n = data.n
            chunk = p.batch_size
            for job in p.jobs:    # stored rows stay in the chunks of this pass's batches
                if isinstance(job, StoreJob):
                    self.stored_chunks[job.target.token] = p.batch_size
        else:
            cost = Cost()
            n = p.jobs[0].streams[0].n
            chunk = self.stored_chunks.get(p.key[1])   # rows in memory: read in the chunks they were stored in
        cost = cost + estimates.pass_overhead(len(p.jobs), n if p.reads_data else 0, per_ex, p.reads_data)
        for job in p.jobs:
            # rows streamed by the job: n·T for per-token rows (ga.GradientSet.per_token)
            job.cost = self._job_cost(job, job.streams[0].n if job.streams and p.reads_data else n,
                                      p.reads_data, chunk)
            cost = cost + job.cost
        cost = cost + self._rowwise_cost(p.jobs, n, chunk, set() if p.reads_data else {p.key[1]},
                                         p.reads_data)
        # one read of the data, however many sources are captured from each batch
        cost = replace(cost, peak_bytes=fixed + per_ex * (p.batch_size or 1), passes=1.0 if p.reads_data else 0.0)
        p.cost = cost
        p.seconds = cost.seconds(self.device, self.dtype)


def _store_cap(options: Options) -> str:
    """The store cap as the plan shows it: ``ga.options(store_fraction=...)`` of the budget."""
    return (f"{_si(options.store_fraction * options.memory_budget)}B "
            f"(store_fraction={options.store_fraction:g} of the memory budget)")


def _positions_known(node: GradNode) -> bool:
    """Whether ``tokens_hint`` is every layer's T: the examples are token ids (T = their
    length) or flat vectors (T = 1). Images and other multi-dimensional inputs give each
    layer its own T (a convolution's output positions), known only when it runs."""
    if token_rows(node) > 1:
        return True   # per-token rows: one position each
    data = getattr(node.source, "data", None)
    if data is None:
        return False
    first = first_example_shape(data)   # None: unreadable; a shape hint never fails planning
    return first is not None and len(first[0]) == 2


def _flat_terms(node: ScoreNode) -> list[tuple[float, Inner]]:
    """[(coef, Inner)] of a score expression, sums flattened."""
    if isinstance(node, ScoreSum):
        return [(c * c2, t2) for c, t in zip(node.coefs, node.terms) for c2, t2 in _flat_terms(t)]
    if not isinstance(node, Inner):
        raise PlanError(f"cannot plan scores of {type(node).__name__}")
    return [(1.0, node)]


def _compute_dtype(root: Node) -> torch.dtype:
    for node in root.walk():
        if isinstance(node, Source):
            for p in node.task.model.parameters():
                return p.dtype
    return torch.float32


def model_device(root: Node) -> torch.device | None:
    """The device of the first model's parameters among ``root``'s sources (None: no
    parameters, or a ``meta`` model: planned as if on the CPU)."""
    for node in root.walk():
        if isinstance(node, Source):
            for p in node.task.model.parameters():
                return None if p.device.type == "meta" else p.device
    return None


def _is_loader(data) -> bool:
    return isinstance(data.source, DataLoader)


# ------------------------------------------------------------------ entry point
def plan(root: Node, *, options: Options | None = None, device=None, rewrites: bool = True,
         choices: Choices | None = None, measure_shapes: bool = False, topk: TopK | None = None,
         budget: Budget | None = None) -> Plan:
    """Plan ``root`` (a score, self-score, gradient or operator node).

    ``choices`` forces decisions the planner would otherwise cost (:class:`Choices`).
    ``measure_shapes`` (executors about to run the plan) finds every layer's positions
    per example with one meta-device call of each source's loss
    (:func:`gradalg.plan.shapes.forward_shapes`) and measures this machine's speeds if
    they were never measured; without it the planner calls no model and benchmarks
    nothing (displays: the cached device profile, or an unmeasured default).
    ``topk`` (:class:`~gradalg.plan.jobs.TopK`): plan the ``k`` best training rows per
    query of the score node ``root`` (one :class:`~gradalg.plan.jobs.TopKJob`), not its
    full matrix.

    ``device`` (default: where the model's parameters are) prices the plan: a CUDA model
    with its measured or nominal profile (:mod:`gradalg.plan.accelerators`), else the CPU's.
    ``budget`` (default: :func:`gradalg.plan.budget.resolve_budget` now, for that device):
    the plan's ``options.memory_budget`` becomes its bytes, and ``plan.budget`` keeps its
    source; a refusal for memory says both (:func:`gradalg.plan.budget.refusal_note`)."""
    options = options or get_options()
    simplified, fired = simplify_until_fixpoint(root, enabled=rewrites)
    where = device if device is not None else model_device(simplified)
    prof = profile(where, measure=measure_shapes and options.measure_devices)
    budget = budget or resolve_budget(options, where, prof)
    options = replace(options, memory_budget=budget.bytes)
    try:
        return _plan(root, simplified, fired, options, prof, budget, choices, measure_shapes, topk)
    except MemoryBudgetError as err:   # every refusal says where the budget came from and how to change it
        err.args = (with_note(err, budget, getattr(err, "needed", None)), *err.args[1:])
        raise


def _plan(root, simplified, fired, options, prof, budget, choices, measure_shapes, topk) -> Plan:
    if measure_shapes:
        for node in simplified.walk():
            # flat inputs (T = 1) and token ids (T = their length) tell every linear
            # layer's positions: the probe is for convolutions and other inputs
            if isinstance(node, Source) and (not _positions_known(node)
                                             or any(b.kind in CONV_KINDS for b in node.space.blocks)):
                forward_shapes(node, measure=True)
    planner = _Planner(options, prof, choices)
    planner.for_run = measure_shapes
    planner.dtype = _compute_dtype(simplified)
    if topk is not None:
        if not isinstance(simplified, ScoreNode):
            raise PlanError(f"a top-k is taken of scores, not of a {type(root).__name__}")
        roots = planner.topk_jobs(simplified, topk)
    elif isinstance(simplified, ScoreNode):
        roots = planner.score_jobs(simplified)
    elif isinstance(simplified, ScoreDiagonal):
        roots = planner.diag_jobs(simplified)
    elif isinstance(simplified, GradNode):
        roots = [planner.add(CollectJob(simplified, (simplified,), planner.stream_deps(simplified),
                                        storage=planner.as_captured(simplified)))]
    elif isinstance(simplified, OpNode):
        roots = sorted(planner.op_deps(simplified))
    else:
        raise PlanError(f"cannot plan a {type(root).__name__}")
    planner.decisions.extend(projection_map_decisions(simplified, options))
    passes, stored = planner.schedule()
    mark_released_held(planner.jobs.values(), passes, simplified, planner.dtype)
    return Plan(root, simplified, fired, planner.decisions, passes, planner.jobs, roots, options, prof, stored,
                planner.dtype, budget)


def mark_released_held(jobs, passes, target, dtype=torch.float32) -> None:
    """``release_held`` on each preconditioned scores job whose held rows nothing else reads
    (no other job, not the job's own streamed side, no pass over rows kept in memory) and
    the plan does not return: the run drops the raw rows once the preconditioned copy
    exists (EK-FAC influence on GPT-2: the raw query gradients were 20 % of the peak).
    The passes of those jobs get their held bytes and peak estimate lowered to what the
    release leaves (:meth:`ScoresJob.fixed_bytes`; their batches were sized with both
    copies)."""
    jobs = list(jobs)
    before = {id(j): j.fixed_bytes(dtype) for j in jobs if isinstance(j, ScoresJob)}
    from_memory = {p.key[1] for p in passes if p.key[0] == "memory"}
    for job in jobs:
        if not isinstance(job, ScoresJob) or isinstance(job.target.op, Identity) or job.held is target:
            continue
        token = job.held.token
        if token in from_memory:
            continue
        readers = [j for j in jobs if not (isinstance(j, CollectJob) and j.target.token == token)
                   and (any(stream_root(s).token == token or s.token == token for s in j.streams)
                        or (j is not job and getattr(getattr(j, "held", None), "token", None) == token))]
        job.release_held = not readers
    for p in passes:
        drop = sum(before[id(j)] - j.fixed_bytes(dtype) for j in p.jobs if id(j) in before)
        if drop > 0:
            p.fixed_bytes -= drop
            p.cost = replace(p.cost, peak_bytes=p.cost.peak_bytes - drop)


def estimate(node) -> Cost:
    """Estimated total cost of computing ``node`` under the options in force (via its
    plan; nothing is run, measured or read beyond the data's shape)."""
    return plan(node).total
