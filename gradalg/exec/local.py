"""The local executor: PyTorch on the model's device, streaming the data in chunks.

Scores ``L H Rᵀ`` are computed by holding the smaller side (the queries, usually),
preconditioning it once, and streaming the other side chunk by chunk: per-example
training gradients exist one chunk at a time and are never all in memory.

Per block, the inner product of a chunk is computed by one of two kernels, chosen by
the cost rule in :mod:`gradalg.plan.routing` (or forced with ``ga.options(ghost=...)``):

``ghost``  ⟨D_iᵀA_i, D_jᵀA_j⟩ = Σ_{t,s}(a_it·a_js)(d_it·d_js), from the factors
``dense``  materialize G_j = D_jᵀA_j, then one GEMM against the held side

``executor.trace`` counts which kernels ran, so tests can prove the routing.
"""
from __future__ import annotations

from collections import Counter
from typing import Iterator

import torch

from ..capture.factors import Factors, ghost_inner, project_factors
from ..capture.hooks import ForwardRecorder, capture_batch, resolve_layers
from ..capture.reference import param_names_of, per_example_grads
from ..data import batch_size_of, move_batch
from ..errors import GradalgError, MemoryBudgetError, NonFiniteGradientError
from ..expr import (AdamPrecondition, GroupMean, ScoreDiagonal, Captured, Damp, Dense, Diagonal, Fisher, GradNode, Identity, Inner, Inverse,
                    Normalize, OpNode, Power, Precondition, Project, RowWeights, ScaledOp, ScaleRows,
                    ScoreNode, ScoreSum, Select, Source, SumOp)
from ..options import Options, get_options
from ..plan.rewrite import simplify
from ..plan.routing import choose_kernel, shared_grad_nodes
from ..proj.matrices import dense_matrix, kron_matrices
from ..proj.kernels import SPARSE_KINDS, project_sparse_block
from ..expr.curvature import KFAC, Arnoldi, CurvatureProducts, DataInf
from .chunks import Chunk, concat_chunks, flat_block, flatten, row_sq_norms, unflatten
from .curvature import resolve_curvature
from .operators import ResolvedOp

CURVATURE_NODES = (KFAC, CurvatureProducts, Arnoldi, DataInf)

__all__ = ["LocalExecutor"]


def _model_device_dtype(model):
    for p in model.parameters():
        return p.device, p.dtype
    return torch.device("cpu"), torch.float32


class LocalExecutor:
    """Runs expression nodes with PyTorch in this process.

    One executor serves one ``compute()``: it memoizes resolved operators and the
    gradient sets that the expression uses more than once (when they fit in
    ``memory_budget / 4``), so shared sub-expressions are computed once.
    """

    def __init__(self, options: Options | None = None):
        self.options = options or get_options()
        self.trace: Counter = Counter()
        self._ops: dict[str, ResolvedOp] = {}
        self._cache: dict[str, list[Chunk]] = {}
        self._cacheable: set[str] = set()
        self._checked_tasks: set[str] = set()

    # ------------------------------------------------------------------ entry points
    def scores(self, node: ScoreNode) -> torch.Tensor:
        """The (n_left, n_right) score matrix of ``node``."""
        node = simplify(node)
        self._cacheable = shared_grad_nodes(node, self.options.memory_budget // 4)
        return self._scores(node)

    def gradients(self, node: GradNode) -> Chunk:
        """All rows of ``node`` in one chunk (for inspection and tests; holds n × dim)."""
        return concat_chunks(list(self.iter_chunks(node)))

    def operator(self, node: OpNode) -> ResolvedOp:
        self._cacheable = shared_grad_nodes(node, self.options.memory_budget // 4)
        return self.resolve(node)

    # ------------------------------------------------------------------ scores
    def _scores(self, node: ScoreNode) -> torch.Tensor:
        if isinstance(node, ScoreSum):
            total = None
            for coef, term in zip(node.coefs, node.terms):
                s = coef * self._scores(term)
                total = s if total is None else total + s
            return total
        if isinstance(node, Inner):
            if node.left.n > node.right.n:   # hold the smaller side; H is symmetric
                return self._inner(node.right, node.op, node.left).T
            return self._inner(node.left, node.op, node.right)
        raise TypeError(f"cannot compute scores from {type(node).__name__}")

    def _inner(self, left: GradNode, op: OpNode, right: GradNode) -> torch.Tensor:
        for side in (left, right):
            src = side.source
            if isinstance(src, Source) and src.objective == "expected":
                raise ValueError("gradients with objective='expected' have one row per term of the "
                                 "Gauss-Newton decomposition, not per example: use them for curvature "
                                 "(ga.fisher, ga.kfac) only")
        held = self.gradients(left)
        space = left.space
        if not isinstance(op, Identity):
            resolved = self.resolve(op)
            held = held.replace(unflatten(resolved.apply(flatten(held, space)), space))
        self._check_budget(held, space)
        columns = []
        materialized_left: dict[str, torch.Tensor] = {}
        for chunk in self.iter_chunks(right):
            total = None
            for name in space.names:
                part = self._block_inner(name, held.blocks[name], chunk.blocks[name], materialized_left)
                total = part if total is None else total + part
            columns.append(total)
        return torch.cat(columns, dim=1)

    def _block_inner(self, name, lval, rval, materialized_left) -> torch.Tensor:
        if isinstance(lval, Factors) and isinstance(rval, Factors):
            kernel = choose_kernel(lval, rval, self.options.ghost)
            if kernel == "ghost":
                self.trace["ghost"] += 1
                return ghost_inner(lval, rval)
        self.trace["dense"] += 1
        if isinstance(lval, Factors):
            if name not in materialized_left:
                materialized_left[name] = flat_block(lval)
            lflat = materialized_left[name]
        else:
            lflat = lval
        return lflat @ flat_block(rval).to(lflat.dtype).T

    def _check_budget(self, held: Chunk, space) -> None:
        nbytes = 0
        for value in held.blocks.values():
            nbytes += value.nbytes() if isinstance(value, Factors) else value.numel() * value.element_size()
        if nbytes > self.options.memory_budget:
            raise MemoryBudgetError(
                f"the held side of the scores takes {nbytes / 2**20:.0f} MiB, over the memory budget "
                f"of {self.options.memory_budget / 2**20:.0f} MiB: use fewer queries per call, "
                "project the gradients (ga.proj.kron), or raise ga.options(memory_budget=...)"
            )

    # ------------------------------------------------------------------ self-scores
    def diagonal(self, node: ScoreDiagonal) -> torch.Tensor:
        """S_ii of a square score expression, without its off-diagonal entries.   (n,)"""
        root = simplify(node.scores)
        self._cacheable = shared_grad_nodes(root, self.options.memory_budget // 4)
        return self._diag(root)

    def _diag(self, node: ScoreNode) -> torch.Tensor:
        if isinstance(node, ScoreSum):
            return sum(c * self._diag(t) for c, t in zip(node.coefs, node.terms))
        if not isinstance(node, Inner):
            raise TypeError(f"cannot take the diagonal of {type(node).__name__}")
        space = node.left.space
        resolved = None if isinstance(node.op, Identity) else self.resolve(node.op)
        parts = []
        same = node.left == node.right
        right_chunks = None if same else self.iter_chunks(node.right)
        for left in self.iter_chunks(node.left):
            if same and resolved is None:
                parts.append(row_sq_norms(left))
                continue
            x = flatten(left, space)
            if same:
                y = x
            else:
                right = next(right_chunks)
                if right.ids != left.ids:
                    raise ValueError("the two sides of the diagonal are chunked differently; give both "
                                     "the same data object and batch size")
                y = flatten(right, space).to(x.dtype)
            if resolved is not None:
                y = resolved.apply(y).to(x.dtype)
            parts.append((x * y).sum(1))
        return torch.cat(parts)

    # ------------------------------------------------------------------ gradient rows
    def iter_chunks(self, node: GradNode) -> Iterator[Chunk]:
        """Chunks of rows of ``node``, in order."""
        if node.token in self._cache:
            yield from self._cache[node.token]
            return
        keep = node.token in self._cacheable
        stored = []
        for chunk in self._produce(node):
            if keep:
                stored.append(chunk)
            yield chunk
        if keep:
            self._cache[node.token] = stored

    def _produce(self, node: GradNode) -> Iterator[Chunk]:
        if isinstance(node, Source):
            yield from self._capture(node)
        elif isinstance(node, Captured):
            yield from node.store.chunks()
        elif isinstance(node, Project):
            for chunk in self.iter_chunks(node.grads):
                yield chunk.replace(self._project(node, chunk))
        elif isinstance(node, Normalize) and node.op is not None:
            metric = self.resolve(node.op)
            space = node.space
            for chunk in self.iter_chunks(node.grads):
                x = flatten(chunk, space)
                sq = (x * metric.apply(x).to(x.dtype)).sum(1)
                if bool((sq < 0).any()):
                    raise GradalgError("the normalizing operator gave a negative ⟨g, H g⟩: it must be "
                                       "positive semi-definite (damp it)")
                norms = sq.sqrt()
                inv = torch.where(norms > 0, 1.0 / norms, torch.zeros_like(norms))
                yield chunk.replace(unflatten(x * inv.unsqueeze(1), space))
        elif isinstance(node, GroupMean):
            yield self._group_mean(node)
        elif isinstance(node, AdamPrecondition):
            st = node.state
            space = node.space
            for chunk in self.iter_chunks(node.grads):
                g = flatten(chunk, space)
                m = st.beta1 * st.exp_avg.to(g) + (1 - st.beta1) * g
                v = st.beta2 * st.exp_avg_sq.to(g) + (1 - st.beta2) * g * g
                yield chunk.replace(unflatten(m / (v.sqrt() + st.eps), space))
        elif isinstance(node, Normalize):
            for chunk in self.iter_chunks(node.grads):
                norms = row_sq_norms(chunk).sqrt()
                inv = torch.where(norms > 0, 1.0 / norms, torch.zeros_like(norms))
                yield chunk.replace({n: _scale_rows(v, inv) for n, v in chunk.blocks.items()})
        elif isinstance(node, Select):
            for chunk in self.iter_chunks(node.grads):
                yield chunk.replace({n: chunk.blocks[n] for n in node.names})
        elif isinstance(node, Precondition):
            resolved = self.resolve(node.op)
            space = node.space
            for chunk in self.iter_chunks(node.grads):
                yield chunk.replace(unflatten(resolved.apply(flatten(chunk, space)), space))
        elif isinstance(node, ScaleRows):
            for chunk in self.iter_chunks(node.grads):
                w = self._row_weights(node.weights, chunk)
                yield chunk.replace({n: _scale_rows(v, w) for n, v in chunk.blocks.items()})
        else:
            raise TypeError(f"the local executor cannot compute {type(node).__name__}")

    def _group_mean(self, node: GroupMean) -> Chunk:
        space = node.space
        labels = node.ids
        where = {g: i for i, g in enumerate(labels)}
        index = torch.tensor([where[g] for g in node.groups])
        total, start = None, 0
        for chunk in self.iter_chunks(node.grads):
            x = flatten(chunk, space)
            if total is None:
                total = x.new_zeros(len(labels), x.shape[1])
            total.index_add_(0, index[start:start + chunk.n].to(x.device), x)
            start += chunk.n
        counts = torch.bincount(index, minlength=len(labels)).to(total)
        return Chunk(labels, unflatten(total / counts.unsqueeze(1), space))

    def _row_weights(self, weights, chunk: Chunk) -> torch.Tensor:
        if not isinstance(weights, RowWeights):
            return torch.full((chunk.n,), float(weights), dtype=torch.float64)
        if chunk.batch is None or chunk.task is None:
            raise ValueError(f"per-example weights {weights.name!r} need the batches the gradients "
                             "came from; apply them to gradients from ga.grads, not to stored ones")
        model = chunk.task.model
        with torch.no_grad():
            w = weights.fn(model, chunk.batch)
        if w.shape != (chunk.n,):
            raise ValueError(f"row weights {weights.name!r} returned shape {tuple(w.shape)}; expected "
                             f"({chunk.n},), one value per example")
        return w.detach()

    def _capture(self, node: Source) -> Iterator[Chunk]:
        task = node.task
        model = task.model
        device, _ = _model_device_dtype(model)
        refs = resolve_layers(model, list(node.layers), backend=node.backend)
        if node.backend == "func" and node.objective == "sampled":
            raise ValueError("objective='sampled' is captured with backend='hooks' only")
        objective = task.objective_fn(node.objective, node.seed)
        was_training = model.training
        model.eval()
        start = 0
        try:
            for batch in node.data.loader(self.options.batch_size):
                batch = move_batch(batch, device)
                b = batch_size_of(batch)
                ids = node.data.ids[start:start + b]
                start += b
                if (self.options.check_reduction and node.objective == "loss"
                        and task.token not in self._checked_tasks):
                    task.check_reduction(batch)
                    self._checked_tasks.add(task.token)
                if node.objective == "expected":
                    for term, blocks in enumerate(self._expected_blocks(task, objective, batch, refs)):
                        yield Chunk(ids, blocks, batch, task, {"term": term})
                    continue
                if node.backend == "func":
                    blocks = self._func_blocks(task, objective, batch, refs)
                else:
                    blocks = self._hook_blocks(task, objective, batch, refs)
                if self.options.check_finite:
                    _check_finite(blocks, ids)
                yield Chunk(ids, blocks, batch, task)
        finally:
            model.train(was_training)

    def _hook_blocks(self, task, objective, batch, refs):
        with torch.enable_grad(), ForwardRecorder(refs) as recorder:
            loss = objective(task.model, batch)
            mask = task.token_mask(batch) if task.token_mask is not None else None
            return capture_batch(loss, recorder, token_mask=mask)

    def _expected_blocks(self, task, terms_fn, batch, refs):
        """One chunk of factors per term of ``task.expected_terms``; one forward in all."""
        with torch.enable_grad(), ForwardRecorder(refs) as recorder:
            terms = terms_fn(task.model, batch)
            mask = task.token_mask(batch) if task.token_mask is not None else None
            for i, term in enumerate(terms):
                yield capture_batch(term, recorder, token_mask=mask, retain_graph=i < len(terms) - 1)

    def _func_blocks(self, task, objective, batch, refs):
        out = {}
        grads = per_example_grads(task, batch, param_names_of(task.model, [r.name for r in refs]),
                                  loss_fn=objective)
        for ref in refs:
            names = param_names_of(task.model, [ref.name])
            out[ref.name] = torch.cat([grads[n].flatten(1) for n in names], dim=1)
        return out

    def _project(self, node: Project, chunk: Chunk) -> dict:
        p = node.projector
        src_space = node.grads.space
        out = {}
        combined = None
        for block in src_space.blocks:
            value = chunk.blocks[block.name]
            dtype, device = _dtype_device(value)
            if p.kind == "kron":
                P_out, P_in = kron_matrices(p, block.name, *block.shape, dtype=dtype, device=device)
                if isinstance(value, Factors):
                    # Stays factored: (D P_outᵀ)ᵀ (A P_inᵀ), so ghost products and
                    # Kronecker statistics remain available in the projected space.
                    self.trace["kron_factored"] += 1
                    out[block.name] = project_factors(value, P_out, P_in)
                else:
                    out[block.name] = (P_out @ value.view(-1, *block.shape) @ P_in.T).flatten(1)
                continue
            if p.kind in SPARSE_KINDS:
                # index tables and scatter-adds; factored blocks are never materialized
                # whole except by a plain "sparse" projection (see gradalg.proj.kernels)
                form = "factored" if isinstance(value, Factors) else "flat"
                self.trace[f"{p.kind}_{form}"] += 1
                projected = project_sparse_block(
                    p, block, value, space_blocks=tuple((b.name, b.dim) for b in src_space.blocks),
                    max_elements=self.options.memory_budget // 64)
            else:
                P = dense_matrix(p, block.name, block.dim, dtype=dtype, device=device)
                projected = flat_block(value) @ P.T
            if p.per_block:
                out[block.name] = projected
            else:
                combined = projected if combined is None else combined + projected
        if combined is not None:
            out["projected"] = combined
        return out

    # ------------------------------------------------------------------ operators
    def resolve(self, node: OpNode) -> ResolvedOp:
        """The numbers of an operator node (memoized per executor)."""
        if node.token not in self._ops:
            self._ops[node.token] = self._resolve(node)
        return self._ops[node.token]

    def _resolve(self, node: OpNode) -> ResolvedOp:
        if isinstance(node, Identity):
            return ResolvedOp.identity(node.space, torch.float64)  # exact in any row dtype
        if isinstance(node, Diagonal):
            return ResolvedOp(node.space, "diag", node.values)
        if isinstance(node, Dense):
            return ResolvedOp(node.space, "dense", node.matrix)
        if isinstance(node, Fisher):
            return self._fisher(node)
        if isinstance(node, Damp):
            return self.resolve(node.op).damp(node.damping)
        if isinstance(node, Inverse):
            inner = self.resolve(node.op)
            if inner.kind == "implicit":
                method = "cg" if node.method == "auto" else node.method
                return inner.inverse(node.op.label, method=method, **dict(node.settings))
            return inner.inverse(node.op.label)
        if isinstance(node, Power):
            return self.resolve(node.op).power(node.p, node.op.label)
        if isinstance(node, ScaledOp):
            return self.resolve(node.op).scale(node.scale)
        if isinstance(node, SumOp):
            total = self.resolve(node.ops[0])
            for op in node.ops[1:]:
                total = _add(total, self.resolve(op))
            return total
        if isinstance(node, CURVATURE_NODES):
            return resolve_curvature(self, node)
        raise TypeError(f"the local executor cannot resolve operator {type(node).__name__}")

    def _fisher(self, node: Fisher) -> ResolvedOp:
        space = node.space
        structure = node.structure
        need = {"dense": space.dim ** 2, "block": sum(b.dim ** 2 for b in space.blocks),
                "diag": space.dim}[structure] * 8
        if need > self.options.memory_budget:
            raise MemoryBudgetError(
                f"a {structure} Fisher over {space.dim:,} coordinates needs {need / 2**30:.1f} GiB, over "
                f"the memory budget of {self.options.memory_budget / 2**30:.1f} GiB. Project first "
                "(ga.fisher(P(G)) with P = ga.proj.kron(k=...)), use structure='block' or 'diag', "
                "or raise ga.options(memory_budget=...)."
            )
        acc, n = None, 0
        for chunk in self.iter_chunks(node.grads):
            n += chunk.n
            if structure == "dense":
                x = flatten(chunk, space).to(torch.float64)
                part = x.T @ x
            elif structure == "diag":
                part = (flatten(chunk, space).to(torch.float64) ** 2).sum(0)
            else:
                part = {}
                for name in space.names:
                    x = flat_block(chunk.blocks[name]).to(torch.float64)
                    part[name] = x.T @ x
            if acc is None:
                acc = part
            elif structure == "block":
                for k in acc:
                    acc[k] += part[k]
            else:
                acc += part
        if n == 0:
            raise ValueError("cannot compute a Fisher over zero examples")
        n = node.grads.n  # rows may repeat an example (objective="expected": one row per term)
        dtype = _first_dtype(node.grads, self)
        if structure == "block":
            return ResolvedOp(space, "block", {k: (v / n).to(dtype) for k, v in acc.items()})
        return ResolvedOp(space, structure, (acc / n).to(dtype))


def _add(a, b):
    """a + b for resolved operators of any kinds (explicit ones know only each other)."""
    if isinstance(a, ResolvedOp) and not isinstance(b, ResolvedOp):
        return b.add(a)
    return a.add(b)


def _first_dtype(node, executor):
    src = node.source
    if isinstance(src, Source):
        return _model_device_dtype(src.task.model)[1]
    if isinstance(src, Captured):  # the dtype the loop recorded (a float64 model stays float64)
        for chunk in src.store.chunks():
            for value in chunk.blocks.values():
                return _dtype_device(value)[0]
    return torch.float32


def _dtype_device(value):
    if isinstance(value, Factors):
        return value.D.dtype, value.D.device
    return value.dtype, value.device


def _scale_rows(value, w: torch.Tensor):
    if isinstance(value, Factors):
        return value.scale_rows(w)
    return value * w.to(value.dtype).unsqueeze(1)


def _check_finite(blocks: dict, ids) -> None:
    bad = None
    layers = []
    for name, value in blocks.items():
        if isinstance(value, Factors):
            ok = torch.isfinite(value.D).flatten(1).all(1)
            if isinstance(value.A, torch.Tensor):  # one-hot activations are always finite
                ok &= torch.isfinite(value.A).flatten(1).all(1)
        else:
            ok = torch.isfinite(value).all(1)
        if not ok.all():
            layers.append(name)
            bad = ~ok if bad is None else bad | ~ok
    if bad is not None:
        raise NonFiniteGradientError([ids[i] for i in bad.nonzero().flatten().tolist()], layers)
