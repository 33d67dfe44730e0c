"""What a job does with the chunks of one pass: accumulate, collect, score.

Every accumulator satisfies :class:`Accumulator`: ``update(chunk)`` (called once per
chunk of the pass, in order; a self-score's takes the aligned left and right chunks, a
top-k's a block of scores and its first training position) and ``finish()``; the
executor stores what ``finish`` returns. For sharded passes (Dask, torch.distributed),
``export()`` gives a shard's partial state as plain tensors (pickled, sent to the
client) and ``absorb(state)`` adds it to another accumulator of the same job (shards
absorbed in order). The same accumulators
serve the fused passes of a plan and the one-node-at-a-time pull path, so both give
identical numbers.

Accumulators decide nothing: kernels, storage and slice sizes are the plan's
(:mod:`gradalg.plan.jobs`, shown by ``explain()``), and memory is checked by the planner
before a pass runs (:mod:`gradalg.plan.memory`).
"""
from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

from ..capture.factors import HALF_DTYPES, Factors, ghost_inner, materialize, self_inner, token_slices
from ..curvature.kron import FLOAT32_ROUNDOFF, EighCheck, KronStats, checked_eigh
from ..linalg.kron import (BlockEigenvalues, KronOp, diagonal_factor_rules, is_diagonal_factor, rotate_factors,
                           rotate_rows)
from ..errors import CurvatureError, DataError, GradalgError
from ..expr import KFAC, Fisher, GroupMean
from ..plan.memory import check_statistics_fit
from ..plan.rules import PlanError
from ..capture.chunks import Chunk, flat_block, flatten, row_sq_norms, unflatten
from .allocator import release_free_memory
from ..linalg import ResolvedOp

__all__ = ["Accumulator", "FisherAccumulator", "KronAccumulator", "EKFACAccumulator", "GroupAccumulator", "Collector",
           "ScoreAccumulator", "DiagAccumulator", "TopKAccumulator", "select_topk"]


@runtime_checkable
class Accumulator(Protocol):
    """What a job's sink (:mod:`gradalg.exec.sinks`) drives over one pass: ``update`` per
    chunk, ``export`` / ``absorb`` of a shard's partial state (plain tensors, absorbed in
    shard order), then ``finish`` once for the job's result."""

    def update(self, *chunks: Any) -> None: ...

    def export(self) -> Any: ...

    def absorb(self, part: Any) -> None: ...

    def finish(self) -> Any: ...


class FisherAccumulator:
    """F = (1/n) Σ_i g_i g_iᵀ, accumulated in float64, as dense, block or diag.

    ``memory_budget``: for the pull path, which runs without a plan: the planner's own
    check (:func:`gradalg.plan.memory.check_statistics_fit`) is made here. A plan's
    Fisher jobs were checked when planned and pass None."""

    def __init__(self, node: Fisher, memory_budget: int | None = None):
        space, structure = node.space, node.structure
        if memory_budget is not None:
            check_statistics_fit(node, memory_budget)
        self.node, self.space, self.structure = node, space, structure
        self.acc = None
        self.rows = 0

    def update(self, chunk: Chunk) -> None:
        self.rows += chunk.n
        if self.structure == "dense":
            x = flatten(chunk, self.space).to(torch.float64)
            part = x.T @ x
        elif self.structure == "diag":
            part = (flatten(chunk, self.space).to(torch.float64) ** 2).sum(0)
        else:
            part = {}
            for name in self.space.names:
                x = flat_block(chunk.blocks[name]).to(torch.float64)
                part[name] = x.T @ x
        if self.acc is None:
            self.acc = part
        elif self.structure == "block":
            for k in self.acc:
                self.acc[k] += part[k]
        else:
            self.acc += part

    def export(self) -> dict:
        return {"acc": self.acc, "rows": self.rows}

    def absorb(self, state: dict) -> None:
        self.rows += state["rows"]
        if state["acc"] is None:
            return
        if self.acc is None:
            self.acc = state["acc"]
        elif self.structure == "block":
            for k in self.acc:
                self.acc[k] += state["acc"][k]
        else:
            self.acc += state["acc"]

    def finish(self) -> ResolvedOp:
        if self.rows == 0:
            raise DataError("cannot compute a Fisher over zero examples: give the Fisher rows (its data is empty)")
        n = self.node.grads.n  # rows may repeat an example (objective="expected": one row per term)
        # kept in the accumulation's float64: rounding a rank-deficient Gram matrix (TRAK's
        # ΦᵀΦ with n < k) to float32 leaves eigenvalues of ±1e-7·‖F‖, which a small damping
        # does not cover; rows are cast to the operator where it is applied
        if self.structure == "block":
            return ResolvedOp(self.space, "block", {k: v / n for k, v in self.acc.items()})
        return ResolvedOp(self.space, self.structure, self.acc / n)


def _factors(node, name, value) -> Factors:
    if not isinstance(value, Factors):
        raise GradalgError(
            f"K-FAC needs factored gradients, but block {name!r} is {node.grads.representation[name]}: "
            "apply ga.kfac to gradients from ga.grads (hook backend), optionally projected with "
            "ga.proj.kron, not to normalized, preconditioned or gaussian-projected ones"
        )
    return value


class KronAccumulator:
    """K-FAC's Kronecker factors; ``finish`` gives the eigenbasis and K-FAC eigenvalues.

    ``token_block``: positions of each example whose statistics are computed at once;
    ``float64_width``: factors wider than this are summed and eigendecomposed in float32,
    checked to ``float32_rtol`` (:mod:`gradalg.curvature.kron`, "Precision of wide
    factors"); ``diagonal_width``: factors wider than this are kept as their diagonal, with
    the identity as eigenbasis ("Diagonal factors of vocabulary-wide sides"). All are
    fields of the plan's job (``ga.options``)."""

    def __init__(self, node: KFAC, token_block: int | None = None, float64_width: int | None = None,
                 float32_rtol: float = 1e-2, diagonal_width: int | None = None):
        self.node, self.token_block = node, token_block
        self.float32_rtol, self.diagonal_width = float32_rtol, diagonal_width
        self.stats = {name: KronStats(float64_width=float64_width, diagonal_width=diagonal_width)
                      for name in node.space.names}
        self.rules = diagonal_factor_rules(node.space, diagonal_width)

    def update(self, chunk: Chunk) -> None:
        for name in self.node.space.names:
            self.stats[name].update(_factors(self.node, name, chunk.blocks[name]), self.token_block)

    def export(self) -> dict:
        return {n: (*st.sums(), st.tokens, st.examples) for n, st in self.stats.items()}

    def absorb(self, state: dict) -> None:
        for name, (A, S, tokens, examples) in state.items():
            st = self.stats[name]
            st.add_sums(A, S)
            st.tokens += tokens
            st.examples += examples

    def finish(self) -> KronOp:
        bases, eigenvalues, errors = {}, {}, {}
        # the float64 width a failed float32 check names: the widest dense factor of all blocks
        widest = max([d for b in self.node.space.blocks if len(b.shape) == 2 for d in b.shape
                      if not is_diagonal_factor(d, self.diagonal_width)] or [0])
        for name in self.node.space.names:
            self.stats[name].examples = self.node.covariance_grads.n   # the examples fed (covariance_max_examples)
            S, A = self.stats[name].covariances()
            self.stats[name] = None        # the sums are not needed past their eigendecomposition
            Q_S, lam_S, check_S = _eigenbasis(S, self.float32_rtol, f"the output-gradient factor of {name!r}", widest)
            del S
            Q_A, lam_A, check_A = _eigenbasis(A, self.float32_rtol, f"the activation factor of {name!r}", widest)
            del A
            bases[name] = (Q_S, Q_A)
            dtype = torch.promote_types(lam_S.dtype, lam_A.dtype) if torch.float32 not in (
                lam_S.dtype, lam_A.dtype) else torch.float32
            # Λ = λ_S λ_Aᵀ kept as its two vectors (made a slice at a time where applied)
            eigenvalues[name] = BlockEigenvalues((lam_S.to(dtype), lam_A.to(dtype)))
            if check_S.error or check_A.error:
                # |λ̂_S λ̂_A − λ_S λ_A| ≤ δ_S max λ_A + max λ_S δ_A + δ_S δ_A
                top_S, top_A = float(lam_S.max()), float(lam_A.max())
                errors[name] = check_S.error * top_A + top_S * check_A.error + check_S.error * check_A.error
        return KronOp(self.node.space, bases, eigenvalues, eigenvalue_errors=errors,
                      float32_rtol=self.float32_rtol, rules=self.rules)


def _eigenbasis(M: torch.Tensor, rtol: float, what: str, float64_fix: int | None = None):
    """``(Q, λ ≥ 0, EighCheck)`` of a factor: :func:`checked_eigh` of a (d, d) matrix, or
    ``(None, diagonal, exact)`` for a diagonal factor kept as its (d,) diagonal (the
    identity is its eigenbasis)."""
    if not bool(torch.isfinite(M).all()):   # finite rows whose products overflowed: named, never NaN scores
        raise CurvatureError(
            f"{what} holds NaN/inf ({int((~torch.isfinite(M)).sum()):,} of {M.numel():,} entries) though every "
            "per-example gradient is finite: the sums of products of its activations or output gradients "
            "overflowed (values near the float32 range). Compute in float64 (model.double() and float64 "
            "inputs), scale the inputs down, or leave this layer out")
    if M.dim() == 1:
        return None, M.clamp_min(0), EighCheck(M.shape[0], torch.float64)
    return checked_eigh(M, rtol, what, float64_fix)


class EKFACAccumulator:
    """EK-FAC's eigenvalue correction Λ = (1/n) Σ_i (Q_Sᵀ G_i Q_A)² in a K-FAC eigenbasis
    (summed in float64; stored in the K-FAC eigenvalues' dtype). A block with a diagonal
    factor (an identity basis: a vocabulary-wide side) is rotated one example at a time:
    its (out, in) rotated gradient is the size of the block (GPT-2's tied head: 154 MB)."""

    def __init__(self, node: KFAC, kfac: KronOp, token_block: int | None = None):
        self.node, self.kfac, self.token_block = node, kfac, token_block
        self.sums = {name: torch.zeros(lam.shape, dtype=torch.float64, device=lam.base[0].device)
                     for name, lam in kfac.parts.items()}

    def update(self, chunk: Chunk) -> None:
        for name in self.node.space.names:
            Q_S, Q_A = self.kfac.bases[name]
            value = chunk.blocks[name]
            if isinstance(value, torch.Tensor) and value.dim() == 2:
                # rows kept flat (a Kronecker-projected block over long sequences is
                # smaller than its factors): rotate the (out, in) gradients themselves
                rotated = rotate_rows(value.reshape(value.shape[0], Q_S.shape[0], Q_A.shape[0]), Q_S, Q_A)
            elif Q_S is None or Q_A is None:
                F = _factors(self.node, name, value)
                for i in range(F.n):
                    rotated = rotate_factors(F[i:i + 1], Q_S, Q_A, self.token_block)
                    self.sums[name] += rotated[0].square_().to(self.sums[name].dtype)
                    del rotated
                continue
            else:
                rotated = rotate_factors(_factors(self.node, name, value), Q_S, Q_A, self.token_block)
            self.sums[name] += (rotated ** 2).sum(0).to(self.sums[name].dtype)

    def export(self) -> dict:
        return self.sums

    def absorb(self, state: dict) -> None:
        for k, v in state.items():
            self.sums[k] += v

    def finish(self) -> KronOp:
        n = self.node.lambda_grads.n   # the examples fed (lambda_max_examples)
        eigenvalues = {k: (s / n).to(self.kfac.parts[k].dtype) for k, s in self.sums.items()}
        errors = {}
        for name, err in self.kfac.eigenvalue_errors.items():
            # the K-FAC basis's relative error, times the largest re-fitted eigenvalue, and
            # the float32 rounding of the stored eigenvalues
            top = self.kfac.parts[name].extremes()[1]
            relative = (err / top if top > 0 else 0.0) + FLOAT32_ROUNDOFF
            errors[name] = relative * float(eigenvalues[name].abs().max())
        return KronOp(self.node.space, self.kfac.bases, eigenvalues, eigenvalue_errors=errors,
                      float32_rtol=self.kfac.float32_rtol, rules=self.kfac.rules)


class GroupAccumulator:
    """Group means of the rows (GroupMean): one flat row per group label."""

    def __init__(self, node: GroupMean, start: int = 0):
        self.node = node
        where = {g: i for i, g in enumerate(node.ids)}
        self.index = torch.tensor([where[g] for g in node.groups])
        self.total, self.start = None, start   # start: first row of the shard fed here

    def update(self, chunk: Chunk) -> None:
        x = flatten(chunk, self.node.space)
        if self.total is None:
            self.total = x.new_zeros(self.node.n, x.shape[1])
        self.total.index_add_(0, self.index[self.start:self.start + chunk.n].to(x.device), x)
        self.start += chunk.n

    def export(self):
        return self.total

    def absorb(self, total) -> None:
        if total is not None:
            self.total = total if self.total is None else self.total + total

    def finish(self) -> list[Chunk]:
        counts = torch.bincount(self.index, minlength=self.node.n).to(self.total)
        return [Chunk(self.node.ids, unflatten(self.total / counts.unsqueeze(1), self.node.space))]


class Collector:
    """Keeps the chunks (a held side, or rows stored for a later pass).

    ``storage[block] == "flat"`` keeps that block materialized when it is smaller than
    its factors (a Kronecker-projected block over long sequences).
    """

    def __init__(self, node, storage: dict | None = None, whole: bool = False):
        self.node = node
        self.flat = {name for name, how in (storage or {}).items() if how == "flat"}
        self.chunks: list[Chunk] = []
        self.whole = whole

    def update(self, chunk: Chunk) -> None:
        # kept rows drop the batch and task they came from: they are data now; and own
        # their memory (a view would keep its whole base alive: a batch's concatenated
        # rows, or an activation shared by every Gauss-Newton term of the batch)
        self.chunks.append(Chunk(chunk.ids, {n: _owned(flat_block(v) if n in self.flat else v)
                                             for n, v in chunk.blocks.items()}))

    def export(self) -> list[Chunk]:
        return self.chunks

    def absorb(self, chunks: list[Chunk]) -> None:
        self.chunks.extend(chunks)

    def finish(self) -> list[Chunk]:
        """The kept chunks; with ``whole``, concatenated into one (a held side is read whole:
        its consumer would otherwise concatenate a second copy)."""
        if not self.whole or len(self.chunks) < 2:
            return self.chunks
        chunks, self.chunks = self.chunks, []
        ids = tuple(i for c in chunks for i in c.ids)
        blocks = {}
        for name in list(chunks[0].blocks):   # block by block, each block's pieces freed once joined
            parts = [c.blocks.pop(name) for c in chunks]
            blocks[name] = Factors.concat_examples(parts) if isinstance(parts[0], Factors) else torch.cat(parts, 0)
            del parts
            # the pieces' pages back to the OS: glibc keeps freed batch-sized pieces in its heap,
            # where the joined block (larger) cannot reuse them (full Grad-Dot on GPT-2: the
            # 471 MB of held queries were resident twice)
            release_free_memory()
        return [Chunk(ids, blocks)]


def _owned(value):
    """``value`` with tensors that are views of larger storage copied out."""
    if isinstance(value, Factors):
        return Factors(_owned(value.A), _owned(value.D))
    if isinstance(value, torch.Tensor) and value.untyped_storage().nbytes() > value.numel() * value.element_size():
        return value.clone()
    return value


class ScoreAccumulator:
    """Columns of ⟨held_i, streamed_j⟩ summed over blocks, chunk by chunk of the streamed side.

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

    def __init__(self, held: Chunk, space, kernels: dict, trace, normalize_streamed: bool = False,
                 slice_elements: int = 2**26, buffer_bytes: int = 2**20, token_block: int | None = None):
        self.held, self.space, self.kernels = held, space, kernels
        self.trace = trace
        self.slice_elements, self.buffer_bytes, self.token_block = slice_elements, buffer_bytes, token_block
        self.normalize_streamed = normalize_streamed
        self._sq_norms: torch.Tensor | None = None
        self.columns: list[torch.Tensor] = []
        self._materialized: dict[str, torch.Tensor] = {}
        self._buffer: torch.Tensor | None = None

    def update(self, chunk: Chunk) -> None:
        self.columns.append(self.block(chunk))

    def block(self, chunk: Chunk) -> torch.Tensor:
        """The scores of the held rows against one streamed chunk, kept nowhere.   (n_held, chunk.n)"""
        total = None
        self._sq_norms = None
        for name in self.space.names:
            part = self._block(name, self.held.blocks[name], chunk.blocks[name])
            total = part if total is None else total + part
        if self.normalize_streamed:
            norms = self._sq_norms.sqrt().to(total.dtype)
            total = total * torch.where(norms > 0, 1.0 / norms, torch.zeros_like(norms)).unsqueeze(0)
        return total

    def _add_sq_norms(self, sq: torch.Tensor) -> None:
        self._sq_norms = sq if self._sq_norms is None else self._sq_norms + sq.to(self._sq_norms.dtype)

    def _block(self, name, lval, rval) -> torch.Tensor:
        kernel = self.kernels.get(name, "dense")
        if kernel == "ghost":
            if not (isinstance(lval, Factors) and isinstance(rval, Factors)):
                raise PlanError(f"the plan chose the ghost kernel for block {name!r}, but its rows are not "
                                "factored on both sides (a planner bug: please report it)")
            self.trace["ghost"] += 1
            if self.normalize_streamed:
                self._add_sq_norms(self_inner(rval, self.slice_elements, self.token_block))
            return ghost_inner(lval, rval, self.slice_elements, self.token_block)
        if kernel != "dense":
            raise PlanError(f"block {name!r} has no kernel in the plan ({kernel!r}): plan it with "
                            "measure_shapes=True, as executors do")
        self.trace["dense"] += 1
        if isinstance(lval, Factors):
            if name not in self._materialized:
                self._materialized[name] = materialize(lval, self.token_block).flatten(1)
            lflat = self._materialized[name]
        else:
            lflat = lval
        rows = self._streamed_rows(rval)
        if self.normalize_streamed:
            self._add_sq_norms(torch.linalg.vector_norm(rows, dim=1).square())
        return lflat @ rows.to(lflat.dtype).T

    def _streamed_rows(self, value) -> torch.Tensor:
        """A streamed block as (n, dim) rows, valid until the next call.

        Large factored blocks are materialized into one buffer reused across blocks and
        chunks: a fresh tensor of tens of MB per block and chunk (above the allocator's
        mmap threshold) costs about as much in page faults as the batched GEMM that fills
        it. Small ones (under ``buffer_bytes``, 1 MiB by default, recycled by the allocator)
        take the ordinary path.
        """
        if not isinstance(value, Factors):
            return flat_block(value)
        if (not isinstance(value.A, torch.Tensor) or value.A.dtype != value.D.dtype
                or value.D.dtype in HALF_DTYPES):   # half precision: float32 rows
            return materialize(value, self.token_block).flatten(1)
        D, A = value.D, value.A
        n, size = D.shape[0], D.shape[0] * D.shape[2] * A.shape[2]
        if size * D.element_size() < self.buffer_bytes:
            return materialize(value, self.token_block).flatten(1)
        buf = self._buffer
        if buf is None or buf.numel() < size or buf.dtype != D.dtype or buf.device != D.device:
            buf = self._buffer = torch.empty(size, dtype=D.dtype, device=D.device)
        out = buf[:size].view(n, D.shape[2], A.shape[2])
        for k, tp in enumerate(token_slices(value.T, self.token_block)):   # G_i = Σ_p D_{i,p}ᵀ A_{i,p}  (n, out, in)
            if k == 0:
                torch.bmm(D[:, tp].transpose(1, 2), A[:, tp], out=out)
            else:
                out.baddbmm_(D[:, tp].transpose(1, 2), A[:, tp])
        return out.view(n, -1)

    def export(self) -> torch.Tensor:
        return torch.cat(self.columns, dim=1) if self.columns else None

    def absorb(self, columns) -> None:
        if columns is not None:
            self.columns.append(columns)

    def finish(self) -> torch.Tensor:
        return torch.cat(self.columns, dim=1)


class DiagAccumulator:
    """d_i = ⟨L_i, H R_i⟩ for chunks of the two sides arriving together."""

    def __init__(self, space, resolved, same: bool, slice_elements: int = 2**26, token_block: int | None = None):
        self.space, self.resolved, self.same = space, resolved, same
        self.slice_elements, self.token_block = slice_elements, token_block   # of the ghost norms
        self.parts: list[torch.Tensor] = []

    def update(self, left: Chunk, right: Chunk | None = None) -> None:
        if self.same and self.resolved is None:
            self.parts.append(row_sq_norms(left, self.slice_elements, self.token_block))
            return
        x = flatten(left, self.space)
        y = x if right is None else flatten(right, self.space).to(x.dtype)
        if right is not None and right.ids != left.ids:
            raise DataError("the two sides of the diagonal are chunked differently; give both "
                             "the same data object and batch size")
        if self.resolved is not None:
            y = self.resolved.apply(y).to(x.dtype)
        self.parts.append((x * y).sum(1))

    def export(self) -> torch.Tensor:
        return torch.cat(self.parts) if self.parts else None

    def absorb(self, part) -> None:
        if part is not None:
            self.parts.append(part)

    def finish(self) -> torch.Tensor:
        return torch.cat(self.parts)


def select_topk(values: torch.Tensor, positions: torch.Tensor, k: int, largest: bool):
    """Per row, the ``k`` best of ``values`` in rank order, ties broken by the lower position.

    values : (n, m) scores; positions : (n, m) int64 training positions of those scores.
    Returns ``(values, positions)``, each (n, min(k, m)): rank 0 is the largest score
    (``largest=True``) or the smallest; equal scores rank by ascending position, so the
    result is the first k of the stable sort of all m by (score, position), whatever
    order the candidates came in. ``torch.topk`` picks the candidates; only when a row's
    k-th score is tied with one it left out (or among the k) are the tied rows resolved
    by a stable sort of the candidates, by position first, then by score.
    """
    kk = min(k, values.shape[1])
    top, idx = torch.topk(values, kk, dim=1, largest=largest, sorted=True)
    if kk == 0:
        return top, positions[:, :0]
    kth = top[:, -1:]
    left_out = (values == kth).sum(1) != (top == kth).sum(1)
    if bool(left_out.any()):      # a tie at the boundary: which tied rows are kept depends on position
        by_pos = torch.argsort(positions, dim=1, stable=True)
        v = torch.gather(values, 1, by_pos)
        order = torch.sort(v, dim=1, descending=largest, stable=True).indices[:, :kk]
        idx = torch.gather(by_pos, 1, order)
    else:                         # the k are right: order ties among them by position
        p = torch.gather(positions, 1, idx)
        by_pos = torch.argsort(p, dim=1, stable=True)
        v = torch.gather(top, 1, by_pos)
        order = torch.sort(v, dim=1, descending=largest, stable=True).indices
        idx = torch.gather(idx, 1, torch.gather(by_pos, 1, order))
    return torch.gather(values, 1, idx), torch.gather(positions, 1, idx)


class TopKAccumulator:
    """A running top-k per query over score blocks streamed by training position.

    ``columns`` mode (the query side held): ``update(block, start)`` takes the
    (n_query, b) scores of training positions start:start+b and keeps, per query, the k
    best of what it kept and the block (:func:`select_topk`): memory n_query·(k + b),
    never n_query·n_train. ``rows`` mode (the training side held): ``update_rows(block,
    n_train)`` ranks a (b, n_train) block of whole query rows at once and appends them.
    Shards export their kept (values, positions) and are absorbed in shard order: the
    merge is the same selection, so the result does not depend on the sharding.
    A NaN score is refused (its rank would be arbitrary).
    """

    def __init__(self, k: int, largest: bool):
        self.k, self.largest = k, largest
        self.values: torch.Tensor | None = None      # (n_query, ≤k)
        self.positions: torch.Tensor | None = None   # (n_query, ≤k) int64
        self.rows: list[tuple[torch.Tensor, torch.Tensor]] = []

    @staticmethod
    def _check(block: torch.Tensor) -> None:
        if bool(torch.isnan(block).any()):
            raise DataError("a score is NaN, so it has no rank: find the non-finite gradients "
                            "(ga.options(check_finite=True)) or damp the operator more")

    def update(self, block: torch.Tensor, start: int) -> None:
        self._check(block)
        pos = torch.arange(start, start + block.shape[1], dtype=torch.int64).expand(block.shape[0], -1)
        self._merge(block, pos)

    def update_rows(self, block: torch.Tensor) -> None:
        self._check(block)
        pos = torch.arange(block.shape[1], dtype=torch.int64).expand(block.shape[0], -1)
        self.rows.append(select_topk(block, pos, self.k, self.largest))

    def _merge(self, values: torch.Tensor, positions: torch.Tensor) -> None:
        if self.values is not None:
            values = torch.cat([self.values, values.to(self.values.dtype)], dim=1)
            positions = torch.cat([self.positions, positions], dim=1)
        self.values, self.positions = select_topk(values, positions, self.k, self.largest)

    def export(self) -> dict:
        return {"values": self.values, "positions": self.positions, "rows": self.rows}

    def absorb(self, part: dict) -> None:
        if part["values"] is not None:
            self._merge(part["values"], part["positions"])
        self.rows.extend(part["rows"])

    def finish(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(values, positions)``, each (n_query, min(k, n_train)), rank order."""
        if self.rows:
            return torch.cat([v for v, _ in self.rows]), torch.cat([p for _, p in self.rows])
        return self.values, self.positions
