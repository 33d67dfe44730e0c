"""Score jobs, with their accumulators: a score matrix, each streamed chunk against the
held rows (:class:`ScoresJob`), and the self-scores of a square score expression, both
sides streamed in lockstep or one held (:class:`DiagJob`)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import reduce
from typing import ClassVar

import torch

from ...capture.chunks import Chunk, concat_chunks, flat_block, flatten, row_sq_norms, unflatten
from ...capture.factors import (HALF_DTYPES, Factors, compute_dtype, ghost_inner, ghost_workspace_elements,
                                materialize, self_inner, token_slices)
from ...errors import DataError
from ...expr import Normalize
from ...expr.tokens import token_rows
from ...linalg.quadratic import row_quadratic
from ..cost import Cost, block_cost, dense_cost, gemm_cost, ghost_cost, materialize_cost
from ..estimates import factored_blocks, made_flat_cost, apply_cost, resolve_once
from ..memory import positions, quadratic_form_bytes, rows_bytes, rows_of
from ..rules import PlanError
from ..shapes import element_size
from .base import Job

__all__ = ["ScoresJob", "DiagJob", "blockwise_preconditioner", "ScoreAccumulator", "DiagAccumulator", "reused_buffer"]


def reused_buffer(owner, attr: str, shape: tuple, dtype: torch.dtype, device, min_bytes: int) -> torch.Tensor | None:
    """A view of ``shape`` into the flat buffer ``owner.<attr>``, made again only to grow it
    or for another dtype or device, so one buffer serves every block and chunk; None under
    ``min_bytes`` (``ga.options(reuse_buffer_bytes)``: the allocator recycles small tensors).
    Fresh tensors of tens of MB per block and chunk (above the allocator's mmap threshold)
    cost about as much in page faults as the GEMM that fills them."""
    size = math.prod(shape)
    if size * element_size(dtype) < min_bytes:
        return None
    buf = getattr(owner, attr)
    if buf is None or buf.numel() < size or buf.dtype != dtype or buf.device != device:
        buf = torch.empty(size, dtype=dtype, device=device)
        setattr(owner, attr, buf)
    return buf[:size].view(shape)


class _Concatenated:
    """An accumulator whose state is the tensors ``parts`` it made, joined along ``dim``
    when it finishes; a shard's part is absorbed after those before it (shard order)."""

    dim = 0

    def export(self) -> torch.Tensor | None:
        return torch.cat(self.parts, dim=self.dim) if self.parts else None

    def absorb(self, part) -> None:
        if part is not None:
            self.parts.append(part)

    def finish(self) -> torch.Tensor:
        return torch.cat(self.parts, dim=self.dim)


def _compute_elem(dtype) -> int:
    """Bytes per number the ghost kernels compute in (float32 for half-precision factors)."""
    return element_size(compute_dtype(dtype if isinstance(dtype, torch.dtype) else torch.float32))


@dataclass(eq=False, frozen=True)
class ScoresJob(Job):
    """⟨held_i, H streamed_j⟩ for a score ``Inner(L, H, R)``: the held side (collected by
    a CollectJob, preconditioned once) against each chunk of the streamed side.

    ``held_storage``: how the held rows are kept; ``normalize_streamed``: the streamed
    side is ``G.normalize()`` read unnormalized, each column divided by its row's norm;
    ``release_held``: no other job (nor a shard opened again) reads the raw held rows,
    so the run drops them block by block as they are preconditioned (schedule stage);
    ``applied``: the key of the :class:`~gradalg.plan.jobs.apply.ApplyJob` whose pass
    leaves the held rows preconditioned (decide stage), read by key when the job runs."""

    kind: ClassVar[str] = "scores"
    ops_per_block: ClassVar[int] = 10
    shards_are_blocks: ClassVar[bool] = True

    held_storage: dict = field(default_factory=dict)
    normalize_streamed: bool = False
    release_held: bool = False
    applied: tuple | None = None

    def describe(self) -> str:
        side = "rows" if not self.transposed else "columns"
        return f"scores ({self.target.label}) streaming {self.streams[0].label!r}, held {side}: {self.held.label!r}"

    # ------------------------------------------------------------------ cost
    def block_cost(self, node) -> Cost:
        """A ghost block's fixed cost is its own (measured apart)."""
        n, ghosts = len(node.space.blocks), sum(self.kernels.get(b.name) == "ghost" for b in node.space.blocks)
        return block_cost("ghost", ghosts, self.ops_per_block) + block_cost(self.kind, n - ghosts, self.ops_per_block)

    def chunk_cost(self, node, c, layout, facts) -> Cost:
        """One chunk of ``c`` streamed rows against the held rows, per block by its kernel:
        ghost products, the chunk materialized and one GEMM (dense over factors), or a GEMM."""
        T, factored, elem = positions(node, facts.shapes), factored_blocks(node, layout), facts.elem
        P_h, n_h = positions(self.held, facts.shapes), self.held.n

        def block(b) -> Cost:
            ghost = self.kernels.get(b.name) == "ghost"
            if not (ghost or factored[b.name]):
                return gemm_cost(n_h, c, b.dim, 1, elem) + Cost(bytes=float(elem) * c * b.dim)
            sizes = (n_h, c, P_h[b.name], T[b.name], b.shape[1], b.shape[0])
            return ghost_cost(*sizes, elem) if ghost else dense_cost(*sizes, True, elem)
        return sum(map(block, self.held.space.blocks), Cost())

    def once_cost(self, facts, storage_of=None, options=None, resolved=None) -> Cost:
        """Held factored blocks a dense kernel reads materialized once, the operator
        resolved (unless ``resolved`` before) and applied to the held rows (unless the
        planned apply job ``applied`` did: its rows are read by key)."""
        held, op, elem = self.held, self.target.op, facts.elem
        if self.applied is not None:
            return resolve_once(op, resolved)
        layout, P_h = storage_of(held) if storage_of is not None else {}, positions(held, facts.shapes)
        once = sum((materialize_cost(held.n, P_h[b.name], b.shape[1], b.shape[0], elem) for b in held.space.blocks
                    if self.kernels.get(b.name) != "ghost" and layout.get(b.name) == "factors" and len(b.shape) == 2),
                   Cost())
        return once + resolve_once(op, resolved) + apply_cost(op, held.space, held.n, elem, options, facts.shapes)

    # ------------------------------------------------------------------ memory
    def fixed_bytes(self, facts) -> float:
        """The held rows, their preconditioned copy, and the ghost kernel's intermediates
        (bounded by token blocks).

        A preconditioned product ``⟨H L_i, R_j⟩`` makes ``H L_i`` once, as flat rows
        (n_held, dim) beside the held rows it is made from, and both count (EK-FAC
        influence on W2, 32 queries: 292 MiB of factors + 471 MB of preconditioned rows)
        for an operator applied to the concatenated rows. A Kronecker one with
        ``release_held`` (:func:`blockwise_preconditioner`) is applied block by block, each
        raw block dropped as it is done: at most the larger of the two copies plus one
        block's preconditioned rows, and never more than both (W2: the scores pass grew
        by 325 MB against 1.03 GB counted with both copies). The size stage sizes batches
        with both copies (safe) and gives the pass these bytes."""
        raw = rows_bytes(self.held, self.held_storage, facts)
        flat = 0.0 if self.target.op.is_identity else rows_bytes(self.held, {}, facts)
        held = raw + flat
        if self.release_held and blockwise_preconditioner(self.target.op):     # never the identity
            block = max((self.held.n * rows_of(self.held) * b.dim * facts.elem
                         for b in self.held.space.blocks), default=0.0)
            held = min(held, max(raw, flat) + block)
        return held + self.ghost_workspace_bytes(facts)

    def ghost_workspace_bytes(self, facts) -> float:
        """The ghost kernel's intermediates: per ghost block the activation Gram, the
        gradient Gram and their product, each
        :func:`~gradalg.capture.factors.ghost_workspace_elements` numbers of the compute
        dtype; the blocks run one after the other, so the largest counts."""
        held, streamed = self.held, self.streams[0]
        P_h, P_s = positions(held, facts.shapes), positions(streamed, facts.shapes)
        worst = max([ghost_workspace_elements(held.n, streamed.n, P_h[b.name], P_s[b.name], self.slice_elements,
                                              self.token_block)
                     for b in held.space.blocks if self.kernels.get(b.name) == "ghost"] or [0])
        return 3.0 * _compute_elem(facts.dtype) * worst

    def example_bytes(self, facts) -> float:
        """Per block a dense kernel reads: the streamed rows materialized, and their product
        (T rows per example when per-token)."""
        return float(sum(b.dim * 8 * token_rows(self.streams[0]) for b in self.held.space.blocks
                         if self.kernels.get(b.name) != "ghost"))

    def output_bytes(self, n: int) -> float:
        return 8.0 * self.held.n * n

    def applied_ops(self) -> tuple:
        """H of ⟨held_i, H streamed_j⟩, resolved in this pass when the accumulator
        preconditions the held rows (:meth:`once_cost`): the size stage counts its
        resolution (a damped dense inverse: 40·d², 378 MB at d = 3075) in the pass's peak."""
        return () if self.target.op.is_identity else (self.target.op,)

    # ------------------------------------------------------------------ scheduling
    def normalized(self, decide) -> "ScoresJob":
        """``normalize_streamed`` as ``decide(side, self)`` says for a streamed side
        ``G.normalize()`` (no metric): in the score kernel, each column divided by its
        row's norm (⟨h, g/‖g‖⟩ = ⟨h, g⟩/‖g‖), or row-wise."""
        s = self.streams[0]
        return replace(self, normalize_streamed=decide(s, self)) if isinstance(s, Normalize) and s.op is None else self

    def can_release_held(self) -> bool:
        """A preconditioned score keeps a preconditioned copy of its held rows: the raw rows can go."""
        return not self.target.op.is_identity

    def keeping_held_rows(self) -> "ScoresJob":
        """Sized with ``release_held`` off: the raw held rows beside their preconditioned copy."""
        return replace(self, release_held=False) if self.release_held else self

    # ------------------------------------------------------------------ running
    def accumulator(self, ctx) -> "ScoreAccumulator":
        """The held rows, preconditioned once here; with ``release_held`` the raw rows are
        taken out of the run state and dropped block by block as they are preconditioned."""
        space, rows = self.held.space, ctx.state.rows
        held = concat_chunks(rows.pop(self.held.token) if self.release_held else rows[self.held.token])
        if not self.target.op.is_identity:   # (release_held only then: can_release_held)
            held = held.replace(dict(held.blocks))      # its own dict: a store's chunk is never emptied
            held = held.replace(unflatten(ctx.state.results[self.applied], space)) if self.applied is not None \
                else ctx.precondition_held(self.target.op, held, space, consume=self.release_held)
        return ScoreAccumulator(held, space, self.kernels, ctx.trace, normalize_streamed=self.normalize_streamed,
                                slice_elements=self.slice_elements, buffer_bytes=self.buffer_bytes,
                                token_block=self.token_block)

    @property
    def fed(self) -> tuple:
        """A normalization the kernel applies is read below it (the unnormalized rows)."""
        return (self.streams[0].grads if self.normalize_streamed else self.streams[0],)

    def publish(self, result, state) -> None:
        state.results[self.key] = result.T if self.transposed else result


def blockwise_preconditioner(op) -> bool:
    """Whether ``op`` resolves to an operator applied block by block to factored rows (a
    Kronecker K-FAC / EK-FAC, :meth:`~gradalg.linalg.kron.KronOp.apply_block`): its
    structure is "kron" and no iterative solver (``Inverse(method="cg"/"lissa")``) wraps it."""
    x = op
    while x is not None and getattr(x, "method", "auto") not in ("cg", "lissa"):
        x = getattr(x, "op", None)
    return x is None and getattr(op, "structure", None) == "kron"


@dataclass(eq=False, frozen=True)
class DiagJob(Job):
    """d_i = ⟨L_i, H R_i⟩ of a :class:`~gradalg.expr.ScoreDiagonal`: both sides streamed in
    lockstep, or the left one ``held`` (collected) and aligned to the streamed rows by id."""

    kind: ClassVar[str] = "diag"
    ops_per_block: ClassVar[int] = 6

    def chunk_cost(self, node, c, layout, facts) -> Cost:
        """Self-scores of one chunk: the rows made flat, the operator applied, the row products."""
        T, factored, space, elem = positions(node, facts.shapes), factored_blocks(node, layout), node.space, facts.elem
        flat = sum((made_flat_cost(b, c, T, factored, elem) for b in space.blocks), Cost())
        return (flat + Cost(flops=2.0 * c * space.dim, bytes=3.0 * elem * c * space.dim)
                + apply_cost(self.target.scores.op, space, c, elem, shapes=facts.shapes))

    def once_cost(self, facts, storage_of=None, options=None, resolved=None) -> Cost:
        return resolve_once(self.target.scores.op, resolved)

    def applied_ops(self) -> tuple:
        """H of ⟨L_i, H R_i⟩, resolved in this pass."""
        return (self.target.scores.op,)

    def fixed_bytes(self, facts) -> float:
        """Nothing: a held side is a CollectJob's rows."""
        return 0.0

    def output_bytes(self, n: int) -> float:
        return 8.0 * n

    def example_bytes(self, facts) -> float:
        """With an operator H: ⟨L_i, H R_i⟩'s working set (:func:`~gradalg.plan.memory.quadratic_form_bytes`:
        a block at a time for a Kronecker H); else one example's rows materialized flat,
        and their product (8 bytes more per coordinate). Then the ghost norms'
        intermediates of factored rows (a self-score of one side: ‖G_i‖² by the ghost
        identity): three (bT, bS) Gram-sized intermediates per example for the
        widest-positioned factored block (b = min(T, token_block); the kernel caps a slice
        at ``max(ghost_slice_elements, b²)`` elements, so this overcounts large batches)."""
        op, node = self.target.scores.op, self.streams[0]
        T = positions(node, facts.shapes)
        worst = max([self.at_once(T[b.name]) ** 2 for b in node.space.blocks if len(b.shape) == 2] or [0])
        made = (node.space.dim * (facts.elem + 8.0) if op.is_identity
                else quadratic_form_bytes(op, node.space, facts.elem))
        return made + 3.0 * _compute_elem(facts.dtype) * worst

    def accumulator(self, ctx) -> "DiagAccumulator":
        inner = self.target.scores
        resolved = None if inner.op.is_identity else ctx.resolve(inner.op)
        return DiagAccumulator(inner.left.space, resolved, inner.left == inner.right, self.slice_elements,
                               self.token_block)

    def feed(self, acc, chunks, state) -> None:
        """One stream, two in lockstep, or the held side aligned to the streamed chunk by id
        (the held rows indexed once per pass: :class:`HeldById`)."""
        if self.held is not None and acc.held is None:
            acc.held = HeldById(state.rows[self.held.token])
        pairs = zip(*chunks) if self.held is None else ((acc.held.aligned(r), r) for r in chunks[0])
        for sides in pairs:
            acc.update(*sides)

    def publish(self, result, state) -> None:
        state.results[self.key] = result


class ScoreAccumulator(_Concatenated):
    """Columns of ⟨held_i, streamed_j⟩ summed over blocks, chunk by chunk of the streamed side
    (``parts``: one (n_held, chunk) block of columns per chunk).

    ``held`` is already preconditioned. Per block the kernel is the plan's choice
    (``kernels``: what ``explain()`` shows; ``ga.options(ghost=...)`` forces it there);
    a ghost kernel on rows that are not factored on both sides is a planner bug and is
    refused. ``slice_elements`` bounds the ghost kernel's intermediate (with pairs of
    ``token_block`` positions), ``buffer_bytes`` is the size from which streamed blocks
    reuse one buffer (``ga.options(ghost_slice_elements=..., token_block=...,
    reuse_buffer_bytes=...)``).

    ``normalize_streamed``: the streamed rows arrive unnormalized and each column is
    divided by its row's norm, ⟨h, g/‖g‖⟩ = ⟨h, g⟩/‖g‖ (Grad-Cos, TracIn-cos). A block
    the dense kernel materializes gives its ‖g‖² from the materialized rows for a read
    of them; only ghost blocks pay the ghost identity's T²·(in + out).
    """

    dim = 1

    def __init__(self, held: Chunk, space, kernels: dict, trace, normalize_streamed: bool = False,
                 slice_elements: int = 2**26, buffer_bytes: int = 2**20, token_block: int | None = None):
        self.held, self.space, self.kernels, self.trace = held, space, kernels, trace
        self.slice_elements, self.buffer_bytes, self.token_block = slice_elements, buffer_bytes, token_block
        self.normalize_streamed = normalize_streamed
        self._sq_norms: torch.Tensor | None = None
        self.parts: list[torch.Tensor] = []
        self._materialized: dict[str, torch.Tensor] = {}
        self._buffer: torch.Tensor | None = None

    def update(self, chunk: Chunk) -> None:
        self.parts.append(self.block(chunk))

    def block(self, chunk: Chunk) -> torch.Tensor:
        """The scores of the held rows against one streamed chunk, kept nowhere.   (n_held, chunk.n)"""
        self._sq_norms = None
        total = reduce(torch.add, (self._block(name, self.held.blocks[name], chunk.blocks[name])
                                   for name in self.space.names))
        if self.normalize_streamed:
            norms = self._sq_norms.sqrt().to(total.dtype)
            total = total * torch.where(norms > 0, 1.0 / norms, torch.zeros_like(norms)).unsqueeze(0)
        return total

    def _add_sq_norms(self, sq: torch.Tensor) -> None:
        self._sq_norms = sq if self._sq_norms is None else self._sq_norms + sq.to(self._sq_norms.dtype)

    def _block(self, name, lval, rval) -> torch.Tensor:
        kernel = self.kernels.get(name, "dense")
        if kernel not in ("ghost", "dense"):
            raise PlanError(f"block {name!r} has no kernel in the plan ({kernel!r}): plan it with "
                            "measure_shapes=True, as executors do")
        if kernel == "ghost" and not (isinstance(lval, Factors) and isinstance(rval, Factors)):
            raise PlanError(f"the plan chose the ghost kernel for block {name!r}, but its rows are not "
                            "factored on both sides (a planner bug: please report it)")
        self.trace[kernel] += 1
        if kernel == "ghost":
            if self.normalize_streamed:
                self._add_sq_norms(self_inner(rval, self.slice_elements, self.token_block))
            return ghost_inner(lval, rval, self.slice_elements, self.token_block)
        if isinstance(lval, Factors) and name not in self._materialized:     # the held block, materialized once
            self._materialized[name] = materialize(lval, self.token_block).flatten(1)
        lflat = self._materialized[name] if isinstance(lval, Factors) else lval
        rows = self._streamed_rows(rval)
        if self.normalize_streamed:
            self._add_sq_norms(torch.linalg.vector_norm(rows, dim=1).square())
        return lflat @ rows.to(lflat.dtype).T

    def _streamed_rows(self, value) -> torch.Tensor:
        """A streamed block as (n, dim) rows, valid until the next call: large factored
        blocks are materialized into one buffer reused across blocks and chunks
        (:func:`reused_buffer`), small ones (under ``buffer_bytes``) and half-precision
        ones (float32 rows) take the ordinary path."""
        if not isinstance(value, Factors):
            return flat_block(value)
        D, A = value.D, value.A
        out = None if (not isinstance(A, torch.Tensor) or A.dtype != D.dtype or D.dtype in HALF_DTYPES) else \
            reused_buffer(self, "_buffer", (D.shape[0], D.shape[2], A.shape[2]), D.dtype, D.device, self.buffer_bytes)
        if out is None:
            return materialize(value, self.token_block).flatten(1)
        for k, tp in enumerate(token_slices(value.T, self.token_block)):   # G_i = Σ_p D_{i,p}ᵀ A_{i,p}  (n, out, in)
            if k == 0:
                torch.bmm(D[:, tp].transpose(1, 2), A[:, tp], out=out)
            else:
                out.baddbmm_(D[:, tp].transpose(1, 2), A[:, tp])
        return out.view(D.shape[0], -1)

class DiagAccumulator(_Concatenated):
    """d_i = ⟨L_i, H R_i⟩ for chunks of the two sides arriving together."""

    def __init__(self, space, resolved, same: bool, slice_elements: int = 2**26, token_block: int | None = None):
        self.space, self.resolved, self.same = space, resolved, same
        self.slice_elements, self.token_block = slice_elements, token_block   # of the ghost norms
        self.parts: list[torch.Tensor] = []
        self.held: HeldById | None = None      # a held left side, indexed by DiagJob.feed

    def update(self, left: Chunk, right: Chunk | None = None) -> None:
        if right is not None and right.ids != left.ids:
            raise DataError("the two sides of the diagonal are chunked differently; give both "
                             "the same data object and batch size")
        if self.same and self.resolved is None:
            part = row_sq_norms(left, self.slice_elements, self.token_block)
        elif self.resolved is not None:   # a block at a time where H acts per block (K-FAC / EK-FAC)
            part = row_quadratic(self.resolved, left.blocks, self.space, None if right is None else right.blocks)
        else:
            x = flatten(left, self.space)
            part = (x * (x if right is None else flatten(right, self.space).to(x.dtype))).sum(1)
        self.parts.append(part)


class HeldById:
    """The held rows of a self-score, joined once per pass and indexed by example id.

    ``aligned(right)`` picks, block by block, the held rows of the streamed chunk's ids, in
    its order: factored blocks stay factored (``Factors[index]``: (c, T, in) and (c, T, out)
    of the n held), flat ones are (c, d_b) rows. Joining and indexing once per pass keeps a
    pass of k chunks at O(n + k·c) row reads (it was O(k·n): the held rows were joined and
    materialized flat for every chunk).
    """

    def __init__(self, chunks: list[Chunk]):
        self.rows = concat_chunks(chunks)
        self.position = {i: k for k, i in enumerate(self.rows.ids)}
        if len(self.position) != len(self.rows.ids):
            raise DataError(
                "the rows of a self-score (a diagonal S_zz) repeat example ids (e.g. training-time rows "
                "of an example seen in several epochs), so they cannot be aligned by id: combine them "
                "first, ga.integrations.combine_repeats(G, 'sum' or 'mean')")

    def aligned(self, right: Chunk) -> Chunk:
        """The held rows of ``right``'s example ids, in that order."""
        missing = [i for i in right.ids if i not in self.position]
        if missing:
            raise DataError(f"the streamed side of a self-score has example ids {missing[:5]} that its held side "
                            "lacks: give both sides of the diagonal the same data")
        index = torch.tensor([self.position[i] for i in right.ids])
        return Chunk(right.ids, {name: value[index] for name, value in self.rows.blocks.items()})
