"""What users hold: thin wrappers over expression nodes, and the functions that build them.

``GradientSet``, ``Operator`` and ``Scores`` each wrap one immutable node (``.expr``).
Building them never runs the model; ``.compute()`` hands the node to an executor.

    G = ga.grads(task, train, layers=["fc1", "fc2"])     # lazy
    S = Q @ ga.fisher(G).damp(1e-3).inv() @ G.T           # lazy
    S.compute()                                           # xarray.DataArray (query, train)
"""
from __future__ import annotations

import contextlib
import numbers
import os
from typing import TYPE_CHECKING, Any, Callable, Iterable, Protocol, runtime_checkable

import numpy as np
import torch

from .data import as_data
from .dtensor import write_version
from .errors import OptionError
from .options import plain
from .expr import (KFAC, AdamPrecondition, AdamState, GroupMean, ScoreDiagonal, Arnoldi, CurvatureProducts, DataInf, Damp, Dense, Diagonal, Fisher, GradNode, Identity, Inner, Inverse, LowRank, Normalize, OpNode,
                   Power, Precondition, Project, Projector, RowWeights, ScaledOp, ScaleRows, ScoreNode,
                   ScoreSum, Select, Source, SumOp)
from .task import Task

if TYPE_CHECKING:                 # xarray loads when a result is made (about 76 MB)
    import xarray as xr

__all__ = ["GradientSet", "TransposedGradients", "Operator", "Scores", "grads", "fisher", "identity",
           "diagonal", "dense", "sum_scores", "mean_scores", "row_weights", "kfac", "ekfac", "hessian",
           "gauss_newton", "arnoldi", "datainf", "adam_state", "SelfScores", "ScoreSink", "register_path_sink"]


def _executor(executor):
    from .exec.base import get_executor
    return get_executor(executor)


@contextlib.contextmanager
def executor_for(executor):
    """The executor to use (:func:`~gradalg.exec.base.get_executor`); one made here from a name
    or None is closed afterwards (``"dask"``: the LocalCluster it started), one given is not."""
    ex = _executor(executor)
    try:
        yield ex
    finally:
        if ex is not executor:
            ex.close()


def _compute(view: "_Displayed", executor, attrs: dict | None = None) -> xr.DataArray:
    """The one compute path of every result (scores, self-scores, a top-k; per-token
    sides included): plan and run ``view``'s node with the executor's entry point
    (``view._run``: plan → run → read, :meth:`gradalg.exec.base.Executor.compute`), then
    assemble the DataArray (``view._assemble``) in the ``assembly`` phase, after the passes
    (xarray's ~76 MB do not add to their peak). ``attrs`` of every result: the expression,
    the kernels that ran (``kernels``) and the seconds per phase (``seconds``), with the
    view's own (``attrs``)."""
    ex = _executor(executor)
    with _PhaseDelta(ex) as seconds:
        values = view._run(ex)
        with seconds.phase("assembly"):
            attrs = {"expression": _expression_text(view.expr), **(attrs or {}),
                     "kernels": dict(getattr(ex, "trace", {}))}
            out = view._assemble(values, attrs)
    out.attrs["seconds"] = seconds.report()
    if ex is not executor:
        ex.close()   # made here: what it started is stopped (compute(executor="dask")'s LocalCluster, not left running)
    return out


class _PhaseDelta:
    """The seconds per phase (:mod:`gradalg.exec.phases`) an executor spends inside the
    block; ``phase(name)`` charges work done here to the executor's clock. Executors
    without a clock report nothing."""

    def __init__(self, ex):
        self.clock = getattr(ex, "clock", None)

    def __enter__(self):
        self.start = self.clock.report() if self.clock is not None else {}
        return self

    def __exit__(self, *exc):
        self.end = self.clock.report() if self.clock is not None else {}
        return False

    def phase(self, name):
        return self.clock.phase(name) if self.clock is not None else contextlib.nullcontext()

    def report(self) -> dict:
        return {k: v - self.start.get(k, 0.0) for k, v in self.end.items()}


def _unsupported(op: str, left, right, takes: str):
    """An OptionError for ``left <op> right`` with an operand the wrapper does not combine with."""
    raise OptionError(f"{type(left).__name__} {op} {type(right).__name__}: a {type(left).__name__} combines "
                      f"with {takes} here")


def _expression_text(node) -> str:
    """The expression tree as plain text (no cost line), for a result's attrs."""
    from .viz.tree import text_tree
    return text_tree(node, "expression").split("\n", 1)[1]


def _cost_line(node) -> str:
    """The header of a displayed expression: its estimated cost under the options in force
    (planned from shapes only; a display never fails, so an error is shown, not raised)."""
    from .plan.planner import estimate
    try:
        return "estimated cost: " + estimate(node).describe()
    except Exception as err:  # a display must never fail
        return f"estimated cost unavailable ({type(err).__name__}: {err})"


class _Displayed:
    """Shared repr machinery: text tree and HTML tree of ``.expr``."""

    expr: Any

    def __repr__(self):
        from .viz.tree import text_tree
        return text_tree(self.expr, type(self).__name__, _cost_line(self.expr))

    def _repr_html_(self):
        from .viz.html import html_tree
        return html_tree(self.expr, type(self).__name__, _cost_line(self.expr))

    def cost(self):
        """Estimated cost of computing this expression (:class:`gradalg.plan.Cost`)."""
        from .plan.planner import estimate
        return estimate(self.expr)

    def explain(self, *, analyze: bool = False, stage: str | None = None, rewrites: bool = True,
                device=None, gpus=(1, 4, 8), n_devices: int | None = None, memory_budget=None, executor=None):
        """The plan, stage by stage (logical, simplified, costed, physical), as an object that
        prints a text table and renders HTML in a notebook.

        analyze : also run the plan and add measured time and memory per pass.
        stage : show only "logical", "simplified", "costed", "physical" or "scale", or the
            record of one of the planner's stages: "lower", "facts", "decide", "schedule", "size".
        rewrites : False shows (and runs) the plan without rewrite rules.
        device : plan for this device ("h200", "h100", "a100", or a profile such as
            ``ga.devices.profile("h200", count=4)``; default: this machine) and add
            estimated time and memory per GPU for each count in ``gpus``.
        n_devices : run on exactly this many GPUs of ``device`` (default: the profile's
            ``count`` when above 1): the scale table has that count only, and a run that
            does not fit raises :class:`~gradalg.errors.MemoryBudgetError` with the
            arithmetic (weights / n + unsharded units + held rows + one example per GPU;
            :mod:`gradalg.plan.scale`).
        memory_budget : bytes for the plan (default: the options' budget here —
            ``ga.options(memory_budget=...)``, else ``memory_fraction`` of the memory
            available when the plan is made, :mod:`gradalg.plan.budget` — and
            ``ga.options(device_memory_fraction=...)`` (0.4) of the device's memory when
            planning for another device).
        executor : the executor that would run it (a ``ga.exec.DaskExecutor`` adds, per
            pass, its shards, tasks and what crosses the network).
        """
        from .devices import DeviceProfile
        if n_devices is None and isinstance(device, DeviceProfile) and device.count > 1:
            n_devices = device.count
        if n_devices is not None:
            if device is None or device == "cpu":
                raise OptionError("n_devices needs a GPU device: explain(device='h200', n_devices=4)")
            gpus = (n_devices,)
        result = self._explain(analyze, stage, rewrites, device, gpus, memory_budget, executor)
        if n_devices is not None:
            from .plan.scale import check_fits
            check_fits(result.plan, n_devices, device)
        return result

    def _explain(self, analyze, stage, rewrites, device, gpus, memory_budget, executor):
        from .errors import MemoryBudgetError
        from .plan.explain import Explain
        from .plan.planner import plan

        options = budget = None
        if device is not None or memory_budget is not None:
            from dataclasses import replace as _replace

            from .options import get_options
            from .plan.budget import Budget, device_budget, is_here, resolve_budget, setting_now
            from .devices import profile
            options = get_options()
            if memory_budget is not None:
                # a string ("4GB") is parsed by Options, like ga.options(memory_budget=...)
                options = _replace(options, memory_budget=memory_budget)
                budget = Budget(options.memory_budget, "explain(memory_budget=...)",
                                setting="cli" if setting_now() == "cli" else "explain")
            elif is_here(device):   # "cpu", "cuda:0": the options' budget, or this machine's
                budget = resolve_budget(options, device)
            else:   # hardware one plans for: device_memory_fraction of one device's memory
                budget = device_budget(options, profile(device, measure=False))
            options = _replace(options, memory_budget=budget.bytes)
        if analyze:
            from .exec.local import LocalExecutor
            ex = executor or LocalExecutor(rewrites=rewrites)
            self._run(ex)
            return Explain(ex.last_plan, ex.pass_stats, tuple(gpus), device, stage, ex)
        try:
            return Explain(plan(self.expr, options=options, device=device, rewrites=rewrites, budget=budget,
                                **self._plan_args()), [], tuple(gpus), device, stage, executor)
        except MemoryBudgetError as err:
            if device is None:
                raise
            # planning for hardware one does not have: show how it would run on all the GPUs
            # asked about, and say plainly that one GPU's budget is not enough
            from .plan.cost import _si
            wide = int(options.device_memory_fraction * profile(device).memory * max(gpus))
            p = plan(self.expr, options=_replace(options, memory_budget=wide), device=device, rewrites=rewrites,
                     budget=Budget(wide, f"{options.device_memory_fraction:g} of {max(gpus)} × "
                                         f"{profile(device).name}'s memory (device_memory_fraction)",
                                 option="device_memory_fraction", setting=setting_now()),
                     **self._plan_args())
            warning = (f"does not fit a memory budget of {_si(options.memory_budget)}B on one "
                       f"{profile(device).name}: {err}. Shown: the plan for a budget of {_si(wide)}B "
                       f"({max(gpus)} GPUs); the scale table gives the memory per GPU.")
            return Explain(p, [], tuple(gpus), device, stage, executor, warning=warning)

    def _run(self, ex):  # each wrapper runs its node with the executor's matching entry point
        raise OptionError(f"{type(self).__name__} has no executor entry point")

    def _plan_args(self) -> dict:  # what the planner is asked besides the node (a top-k)
        return {}


class GradientSet(_Displayed):
    """Lazy per-example gradients: rows are examples, columns a parameter space.

    Attributes: ``space`` (ParamSpace), ``n`` (rows), ``ids`` (row ids),
    ``representation`` ({block: "factored" | "dense" | "projected"}).
    """

    def __init__(self, expr: GradNode):
        if not isinstance(expr, GradNode):
            raise OptionError(f"GradientSet wraps a gradient node, got {type(expr).__name__}")
        self.expr = expr

    # ---- metadata ------------------------------------------------------------------
    @property
    def space(self):
        """The parameter space of a row: ordered blocks (one per layer), each with its
        shape and basis (``params``, or the projector that produced it)."""
        return self.expr.space

    @property
    def n(self) -> int:
        """Number of rows (examples); the matrix is (n, space.dim)."""
        return self.expr.n

    @property
    def ids(self) -> tuple:
        """The example id of each row, in row order: ``(n,)``."""
        return self.expr.ids

    @property
    def representation(self) -> dict[str, str]:
        """Layer name -> how its rows are held: ``"factored"`` (outer products of
        activations and output gradients), ``"dense"`` or ``"projected"``."""
        return self.expr.representation

    @property
    def layers(self) -> tuple[str, ...]:
        """The names of the space's blocks (the captured layers), in order."""
        return self.space.names

    def __len__(self):
        return self.n

    def __eq__(self, other):
        return isinstance(other, GradientSet) and self.expr == other.expr

    def __hash__(self):
        return hash(self.expr)

    # ---- algebra -------------------------------------------------------------------
    @property
    def T(self) -> "TransposedGradients":
        """The transposed set, for the right-hand side of ``Q @ G.T``."""
        return TransposedGradients(self.expr)

    def __matmul__(self, other):
        if isinstance(other, TransposedGradients):
            return Scores(Inner(self.expr, Identity(self.space), other.expr))
        if isinstance(other, Operator):
            return GradientSet(Precondition(self.expr, other.expr))
        if isinstance(other, GradientSet):
            raise OptionError("Q @ G is a product of two gradient sets with examples as rows: "
                            "write Q @ G.T for scores")
        raise OptionError(f"G @ {type(other).__name__}: a GradientSet multiplies G.T (scores) or an Operator "
                          "(preconditioning); wrap a matrix as ga.dense(M, like=G) or ga.diagonal(d, like=G)")

    def project(self, projector: Projector) -> "GradientSet":
        """``P(G)``: the projected set (same as calling the projector)."""
        node = Project(self.expr, projector)
        _warn_expanding(self.expr.space, node.space, projector)
        return GradientSet(node)

    def normalize(self, metric: "Operator | None" = None) -> "GradientSet":
        """Each row divided by its norm over all blocks (cosine similarity).

        With ``metric`` H the norm is √⟨g, H g⟩ (RelatIF: H = inverse curvature).
        """
        if metric is not None:
            if not isinstance(metric, Operator):
                raise OptionError("metric must be an Operator, e.g. ga.fisher(G).damp(1e-3).inv()")
            self.space.check_same(metric.space, "the gradients and the metric")
            return GradientSet(Normalize(self.expr, metric.expr))
        return GradientSet(Normalize(self.expr))

    def group_mean(self, groups) -> "GradientSet":
        """Rows averaged within groups (one label per row); the result's ids are the labels."""
        groups = tuple(groups.tolist() if isinstance(groups, torch.Tensor) else groups)
        return GradientSet(GroupMean(self.expr, groups))

    def adam(self, state: AdamState) -> "GradientSet":
        """LESS's Adam transform m/(√v + ε) of each row (see :func:`adam_state`)."""
        return GradientSet(AdamPrecondition(self.expr, state))

    def select(self, layers: Iterable[str]) -> "GradientSet":
        """Only the blocks ``layers``."""
        names = (layers,) if isinstance(layers, str) else tuple(layers)
        names = tuple(self.space.canonical(name) for name in names)  # KeyError naming the valid blocks
        return GradientSet(Select(self.expr, names))

    __getitem__ = select

    def per_token(self, tokens: int | None = None) -> "GradientSet":
        """Rows (example, position): row (i, t) is position t's term d_it a_itᵀ of each layer's
        G_i = Σ_t d_it a_itᵀ (Kronfluence's per-token scores; definition and limits in
        :mod:`gradalg.expr.tokens`). Σ_t of the rows is G_i exactly.

        ``tokens``: positions per example (default: the longest example's sequence length,
        read from the data without running the model). Scores over these rows compute to
        a DataArray with a ``query_token`` / ``train_token`` axis (padding NaN).
        """
        from .expr import Captured, PerToken
        from .expr.tokens import infer_positions
        if tokens is None:
            src = self.expr.source
            tokens = _captured_positions(src) if isinstance(src, Captured) else infer_positions(src.data)
        return GradientSet(PerToken(self.expr, int(tokens)))

    def low_rank(self, rank: int) -> "GradientSet":
        """Each row's (out, in) layer blocks replaced by their best rank-``rank`` approximation
        (truncated SVD, G_i ≈ L_i R_iᵀ), kept as factors: ``rank·(out + in)`` numbers per row
        and block instead of ``out·in`` (Kronfluence's ``query_gradient_low_rank``; apply it
        to the held, preconditioned query side: ``(Q @ H.inv()).low_rank(32) @ G.T``).
        Exact for blocks with min(out, in) ≤ rank and for blocks that are not matrices;
        definition and costs in :mod:`gradalg.expr.lowrank`.
        """
        return GradientSet(LowRank(self.expr, rank))

    def scale(self, weights) -> "GradientSet":
        """Rows times a constant, or times per-example values (:func:`row_weights`)."""
        if not isinstance(weights, (numbers.Real, RowWeights)):
            raise OptionError("scale takes a number or ga.row_weights(fn)")
        return GradientSet(ScaleRows(self.expr, weights if isinstance(weights, RowWeights) else float(weights)))

    def __mul__(self, other):
        if isinstance(other, (numbers.Real, RowWeights)):
            return self.scale(other)
        _unsupported("*", self, other, "a number or ga.row_weights(fn)")

    __rmul__ = __mul__

    # ---- computation ---------------------------------------------------------------
    def _run(self, ex):
        return ex.gradients(self.expr)

    def to_dense(self, executor=None) -> dict[str, torch.Tensor]:
        """All rows, materialized: ``{block: (n, *block.shape)}``. Holds n × dim numbers."""
        from .capture.chunks import flat_block
        from .space import AliasDict
        with executor_for(executor) as ex:
            chunk = ex.gradients(self.expr)
        return AliasDict.blocks({b.name: flat_block(chunk.blocks[b.name]).reshape(chunk.n, *b.shape)
                                 for b in self.space.blocks}, self.space)

    def to_params(self, executor=None) -> dict[str, torch.Tensor]:
        """Per-example gradients in the model's layout: ``{param_name: (n, *param.shape)}``.

        Only for gradients captured with ``ga.grads`` in parameter coordinates.
        """
        src = self.expr.source
        if not isinstance(src, Source) or src.backend != "hooks":
            raise OptionError("to_params needs gradients captured with ga.grads(..., backend='hooks')")
        if any(b.basis != "params" for b in self.space.blocks):
            raise OptionError("projected gradients have no parameter layout; use to_dense()")
        from .capture.experts import add_param
        from .capture.hooks import resolve_layers
        from .capture.wrappers import unwrap
        refs = {r.name: r for r in resolve_layers(src.task.model, list(self.layers))}
        # names as the (unwrapped) model's named_parameters() gives them: one per tied parameter
        canonical = {id(p): n for n, p in unwrap(src.task.model)[0].named_parameters()}
        out = {}
        for name, block in self.to_dense(executor).items():
            ref = refs[name]
            for pname, value in ref.rule.to_params(ref.module, block).items():
                key = canonical[id(ref.module.get_parameter(pname))]
                add_param(out, key, value)   # a fused experts' blocks add up (one tensor per parameter)
        from .space import AliasDict   # a tied block's parameters by any holder's name
        return AliasDict.params(out, self.space)


def _captured_positions(src) -> int:
    """Longest position count among the factors ``ga.capture`` recorded."""
    from .capture.factors import Factors
    return max((v.T for c in src.store.chunks() for v in c.blocks.values() if isinstance(v, Factors)), default=1)


class TransposedGradients:
    """``G.T``: only meaningful on the right of ``@``."""

    def __init__(self, expr: GradNode):
        self.expr = expr

    @property
    def T(self) -> GradientSet:
        """The untransposed set again: ``G.T.T`` is ``G``."""
        return GradientSet(self.expr)

    def __repr__(self):
        return f"({GradientSet(self.expr)!r}).T"


class Operator(_Displayed):
    """A lazy symmetric operator on a parameter space (curvature, preconditioner)."""

    def __init__(self, expr: OpNode):
        if not isinstance(expr, OpNode):
            raise OptionError(f"Operator wraps an operator node, got {type(expr).__name__}")
        self.expr = expr

    @property
    def space(self):
        """The parameter space the operator acts on (that of the gradients it is built from)."""
        return self.expr.space

    @property
    def shape(self) -> tuple[int, int]:
        """``(dim, dim)``, dim = the space's total number of coordinates."""
        return self.expr.shape

    @property
    def structure(self) -> str:
        """How the matrix is held, which decides how it is applied and inverted:
        ``"identity"``, ``"diag"``, ``"block"``, ``"dense"``, ``"kron"`` (Kronecker
        factors per layer), ``"implicit"`` (products only: CG / LiSSA) or ``"lowrank"``."""
        return self.expr.structure

    def damp(self, damping: float, *, relative: bool = False, note: str = "") -> "Operator":
        """H + λI; ``relative=True``: λ = damping · tr(H)/dim, a multiple of H's mean
        eigenvalue (scale-free; needs an explicit H: dense, block, diagonal or K-FAC).
        ``note`` says where λ came from; it is shown in the plan, not part of the value.
        ``damping`` may be a :class:`~gradalg.linalg.autodamp.DampingRule`: λ_b per block from
        that block's spectrum (automatic damping; explicit and Kronecker operators)."""
        from .linalg.autodamp import DampingRule
        if isinstance(damping, DampingRule):
            from .expr.operators import AutoDamp
            return Operator(AutoDamp(self.expr, damping, str(note)))
        if not isinstance(damping, numbers.Real) or isinstance(damping, bool) or not 0 <= damping < float("inf"):
            raise OptionError(f"damping must be a finite non-negative number, got {damping!r}")
        return Operator(Damp(self.expr, float(damping), bool(relative), str(note)))

    def inv(self, method: str = "auto", **settings) -> "Operator":
        """H⁻¹, computed by structure when needed.

        For operators known only through products (``ga.hessian``, ``ga.gauss_newton``)
        ``method`` picks the iterative solver: "cg" (default; ``max_iter``, ``rtol``) or
        "lissa" (``scale`` > λ_max, ``depth``, ``tol``). Ignored for explicit structures.
        """
        if method not in ("auto", "cg", "lissa"):
            raise OptionError(f"inverse method must be 'auto', 'cg' or 'lissa', got {method!r}")
        return Operator(Inverse(self.expr, method, tuple(sorted(settings.items()))))

    def pow(self, p: float) -> "Operator":
        """H^p for a positive semi-definite H."""
        p = plain(p)
        if not isinstance(p, numbers.Real) or isinstance(p, bool) or p != p or abs(p) == float("inf"):
            raise OptionError(f"the power p must be a finite number, got {p!r}")
        return Operator(Power(self.expr, float(p)))

    def __add__(self, other):
        if isinstance(other, Operator):
            return Operator(SumOp((self.expr, other.expr)))
        _unsupported("+", self, other, "another Operator")

    def __mul__(self, c):
        if isinstance(c, numbers.Real):
            return Operator(ScaledOp(self.expr, float(c)))
        _unsupported("*", self, c, "a number")

    __rmul__ = __mul__

    def __matmul__(self, other):
        if isinstance(other, TransposedGradients):
            return TransposedGradients(Precondition(other.expr, self.expr))
        if isinstance(other, GradientSet):
            raise OptionError("H @ G: write H @ G.T (examples are the columns on the right)")
        raise OptionError(f"H @ {type(other).__name__}: an Operator multiplies G.T (a TransposedGradients); wrap "
                          "a matrix as ga.dense(M, like=G)")

    def _run(self, ex):
        return ex.operator(self.expr)

    def to_dense(self, executor=None) -> torch.Tensor:
        """The (dim, dim) matrix (runs the passes its statistics need)."""
        with executor_for(executor) as ex:
            return ex.operator(self.expr).dense()


def _warn_expanding(before, after, projector) -> None:
    """Warn when a projection does not reduce: k at or above the dimension it projects."""
    import warnings
    pairs = [(before.dim, after.dim, "the gradients")] if len(after.blocks) != len(before.blocks) else \
        [(b.dim, a.dim, f"block {b.name!r}") for b, a in zip(before.blocks, after.blocks)]
    wide = [(d, k, what) for d, k, what in pairs if k > d]
    if wide:
        d, k, what = wide[0]
        warnings.warn(
            f"{projector!r} maps {what} ({d:,} coordinates) to {k:,}: k is above the dimension, so the "
            "projection adds cost and reduces nothing. Use k at most the dimension, or no projection"
            + (f" ({len(wide)} blocks are like this)" if len(wide) > 1 else ""), UserWarning, stacklevel=4)


@runtime_checkable
class ScoreSink(Protocol):
    """Where ``Scores.compute(store=sink)`` puts the scores instead of memory:
    ``sink.write_scores(S, executor=...)`` computes ``S`` into it and returns the result read
    back from it (a DataArray). :class:`gradalg.store.ScoreStore` is one (a resumable Zarr
    score store, ``ga.store.ScoreStore("scores.zarr", chunk_rows=1024)``); any object with
    this method is another."""

    def write_scores(self, scores: "Scores", *, executor=None) -> "xr.DataArray": ...


#: The factory ``(path, chunk_rows=, overwrite=) -> ScoreSink`` that ``Scores.compute(store=path)``
#: writes a path through, declared by :func:`register_path_sink` (empty: none declared)
_PATH_SINK: list = []


def register_path_sink(factory: Callable[..., ScoreSink]) -> None:
    """Declare the sink a path given as ``Scores.compute(store="scores.zarr")`` is written to:
    ``factory(path, chunk_rows=, overwrite=)`` returns a :class:`ScoreSink`. :mod:`gradalg.store`
    declares :class:`~gradalg.store.ScoreStore` with it (the store sits above api: it returns
    api objects, so api does not import it; ``gradalg/__init__.py`` imports the store, so
    any ``import gradalg...`` declares it before a score is computed). Declaring again
    replaces the factory. A sink object, ``store=ga.store.ScoreStore(path)``, needs none."""
    if not callable(factory):
        raise OptionError(f"register_path_sink takes a callable (path, chunk_rows=, overwrite=) -> sink, "
                          f"got {type(factory).__name__}")
    _PATH_SINK[:] = [factory]


def _score_sink(store, chunk_rows: int | None, overwrite: bool | None) -> ScoreSink:
    """The sink ``Scores.compute(store=...)`` writes to: ``store`` itself when it is a
    :class:`ScoreSink` (its own chunking and overwrite), else the declared path sink of the
    path ``store``."""
    if isinstance(store, ScoreSink):
        if chunk_rows is not None or overwrite is not None:
            raise OptionError("S.compute(store=sink, chunk_rows=..., overwrite=...): a sink carries its own "
                              "chunking and overwrite; set them on it, e.g. store=ga.store.ScoreStore(path, "
                              "chunk_rows=1024, overwrite=True), or pass a path as store=")
        return store
    if not isinstance(store, (str, os.PathLike)):
        raise OptionError(f"S.compute(store=...) takes a path (store='scores.zarr') or a score sink "
                          f"(store=ga.store.ScoreStore(path)), got {type(store).__name__}")
    if not _PATH_SINK:
        raise OptionError("S.compute(store=path) writes through a score store, and none is declared: "
                          "`import gradalg` declares the Zarr store (gradalg.store), or pass a sink: "
                          "store=ga.store.ScoreStore(path)")
    if isinstance(chunk_rows, numbers.Integral) and not isinstance(chunk_rows, bool):
        chunk_rows = int(chunk_rows)     # a numpy integer reads as its value
    return _PATH_SINK[0](store, chunk_rows=1024 if chunk_rows is None else chunk_rows,
                         overwrite=bool(overwrite))


class Scores(_Displayed):
    """Lazy (n_query, n_train) attribution scores."""

    def __init__(self, expr: ScoreNode):
        if not isinstance(expr, ScoreNode):
            raise OptionError(f"Scores wraps a score node, got {type(expr).__name__}")
        self.expr = expr

    @property
    def shape(self):
        """``(n_query, n_train)``: rows are the left side's examples, columns the right's."""
        return self.expr.shape

    def __add__(self, other):
        if isinstance(other, Scores):
            return Scores(ScoreSum((self.expr, other.expr), (1.0, 1.0)))
        _unsupported("+", self, other, "other Scores")

    def __sub__(self, other):
        if isinstance(other, Scores):
            return Scores(ScoreSum((self.expr, other.expr), (1.0, -1.0)))
        _unsupported("-", self, other, "other Scores")

    def __mul__(self, c):
        if isinstance(c, numbers.Real):
            return Scores(ScoreSum((self.expr,), (float(c),)))
        _unsupported("*", self, c, "a number")

    __rmul__ = __mul__

    def __truediv__(self, c):
        if isinstance(c, numbers.Real):
            if c == 0 or c != c:
                raise OptionError(f"S / {c!r}: divide scores by a finite non-zero number")
            return self * (1.0 / c)
        _unsupported("/", self, c, "a number")

    def _run(self, ex):
        return ex.scores(self.expr)

    def diag(self) -> "SelfScores":
        """The diagonal S_ii (self-influence) when queries and training set are the same data."""
        return SelfScores(ScoreDiagonal(self.expr))

    def explain(self, *, topk: int | None = None, largest: bool = True, **kwargs):
        """The plan, as for any expression (``analyze``, ``stage``, ``device``, ...:
        ``_Displayed.explain``); ``topk=k`` explains the plan of :meth:`topk` instead: one ``topk`` job whose
        result is n_query·k, not n_query·n_train."""
        if topk is not None:
            from .plan.jobs import TopK
            return _TopKView(self.expr, TopK(_positive_int("topk", topk), largest)).explain(**kwargs)
        return super().explain(**kwargs)

    def topk(self, k: int, *, largest: bool = True, executor=None, texts=None) -> xr.DataArray:
        """The ``k`` highest-scoring training examples per query (``largest=False``: the
        ``k`` lowest, e.g. the most harmful), by streaming score blocks through a running
        top-k: the (n_query, n_train) matrix is never formed (memory n_query·(k + batch)
        besides the held rows; ``S.explain(topk=k)`` shows the plan).

        Returns a DataArray of the scores, dims ("query", "rank"), with coordinates
        ``query`` (query ids), ``rank`` (0 = best) and ``train`` (dims query, rank: the
        training ids). Ties are broken by training position: of equal scores, the
        training example that comes first in the data ranks first, so the result equals
        a stable sort of ``S.compute()`` by score (and is the same with any batch size or
        number of Dask shards). ``k`` above n_train returns n_train ranks.
        ``executor``: as :meth:`compute`.

        ``texts``: the training documents (a list in training-data order, a dict {id: text},
        a function id -> text, a ``datasets.Dataset`` column, ``ga.report.jsonl_texts(path,
        field)``) add a ``text`` coordinate (query, rank), aligned by training id; an id
        without text raises DataError, before any pass. ``ga.report.documents_frame(top)``:
        a DataFrame of query, rank, train, score, text.
        """
        from .plan.jobs import TopK
        from .token_scores import token_sides

        k, largest = _positive_int("k", k), plain(largest)
        if not isinstance(largest, bool):
            raise OptionError(f"largest must be True or False, got {largest!r}")
        spec = TopK(k, largest)
        if texts is not None:             # checked before the passes: every training id needs its text
            from .report.texts import check_texts
            check_texts(texts, list(self.expr.col_ids))
        if token_sides(self.expr) != (None, None):
            raise OptionError("S.topk ranks whole examples: a side of per-token rows (G.per_token()) has "
                             "several score rows per example; rank S.compute() instead, or sum the tokens first")
        result = _compute(_TopKView(self.expr, spec), executor,
                          {"k": k, "largest": int(largest), "ties": "lower training position first"})
        if texts is None:
            return result
        from .report.texts import with_texts
        return with_texts(result, texts, ids=list(self.expr.col_ids))

    def to_html(self, path, *, texts=None, queries=None, k: int = 5, method: str | None = None, **kwargs):
        """Write a report page of these scores to ``path``: one self-contained HTML file (no
        network) with, per query, its text and its top and bottom ``k`` training examples
        with their scores and texts (``texts``: a list in data order, a dict {id: text} or a
        function id -> text; ``queries`` likewise, a ``(prompt, completion)`` pair marks the
        completion), the ``method``'s formula and fidelity note, and the plan. Other
        arguments (``token_scores``, ``tokens``, ``title``, ``math``, ``executor``):
        :func:`gradalg.report.write_report`. Returns the path."""
        from .report import write_report
        return write_report(self, path, texts=texts, queries=queries, k=k, method=method, **kwargs)

    def compute(self, executor=None, *, store=None, chunk_rows: int | None = None, overwrite: bool | None = None
                ) -> xr.DataArray:
        """Run the expression. Returns a DataArray with dims ("query", "train"); a side made
        of per-token rows (``G.per_token()``) adds its token axis: ("query", "query_token",
        "train"), ("query", "train", "train_token") or both, padding positions NaN.

        ``executor``: None or "local" (this process), "dask" (a local cluster), or an
        executor object (``ga.exec.DaskExecutor(client=...)``). With Dask the DataArray is
        backed by a Dask array whose blocks are the training shards' scores.
        ``attrs`` records the expression, which kernels ran (``kernels``) and the seconds
        per phase (``seconds``); every result is assembled by the one path :func:`_compute`.

        ``store``: a path (``"scores.zarr"``): the scores are written to a Zarr score store
        block by block of ``chunk_rows`` (default 1024) training examples as the training
        side streams (each block atomic; a store left unfinished by a killed run is
        completed, only its missing blocks computed; ``overwrite=True`` replaces it) and the
        result is a Dask-backed DataArray over the store (:func:`gradalg.store.write_scores`),
        for results that do not fit in memory. Or a sink object (:class:`ScoreSink`), e.g.
        ``store=ga.store.ScoreStore(path, chunk_rows=1024)``, which carries its own
        ``chunk_rows`` and ``overwrite``.
        """
        if store is not None:
            return _score_sink(store, chunk_rows, overwrite).write_scores(self, executor=executor)
        if chunk_rows is not None or overwrite is not None:
            raise OptionError("chunk_rows= and overwrite= apply to S.compute(store=...): pass store='scores.zarr' "
                              "to write a score store, or leave them out")
        return _compute(self, executor)

    def _assemble(self, values, attrs: dict) -> xr.DataArray:   # per-token sides: token axes
        from .token_scores import scores_array
        return scores_array(values, self.expr, _option_batch_size(), attrs)


class _TopKView(_Displayed):
    """A score expression planned as its top-k (``Scores.explain(topk=k)``)."""

    def __init__(self, expr: ScoreNode, spec):
        self.expr, self.spec = expr, spec

    def _plan_args(self) -> dict:
        return {"topk": self.spec}

    def _run(self, ex):
        return ex.topk(self.expr, self.spec)

    def _assemble(self, values, attrs: dict) -> xr.DataArray:
        """``(values, positions)`` (n_query, k) as a DataArray ("query", "rank") with the
        training ids of ``positions`` as its ``train`` coordinate (query, rank)."""
        from .token_scores import Axis, labelled
        values, positions = values
        positions = positions.detach().cpu().numpy()
        return labelled(values, [Axis("query", np.asarray(self.expr.row_ids)), Axis("rank", np.arange(positions.shape[1]))],
                        "scores", attrs, coords={"train": (("query", "rank"), np.asarray(self.expr.col_ids)[positions])})


class SelfScores(_Displayed):
    """Lazy self-scores S_ii, one per example (``Scores.diag()``)."""

    def __init__(self, expr: ScoreDiagonal):
        self.expr = expr

    def _run(self, ex):
        return ex.diagonal(self.expr)

    def compute(self, executor=None) -> xr.DataArray:
        """Returns a DataArray with dim ("train",), indexed by example id; per-token rows:
        ("train", "train_token"). ``attrs`` as :meth:`Scores.compute`'s."""
        return _compute(self, executor)

    def _assemble(self, values, attrs: dict) -> xr.DataArray:
        from .token_scores import self_scores_array
        return self_scores_array(values, self.expr, _option_batch_size(), attrs)


def _option_batch_size() -> int:
    from .options import get_options
    return get_options().batch_size


# ---------------------------------------------------------------------- constructors
def grads(task: Task, data, layers=None, *, ids=None, batch_size: int | None = None,
          backend: str = "hooks", objective: str = "loss", seed: int = 0) -> GradientSet:
    """Lazy per-example gradients of ``task`` on ``data``.

    Parameters
    ----------
    task : :class:`Task`
    data : Dataset, DataLoader (shuffle=False), tensor or tuple of tensors.
    layers : module names or glob patterns, ``"all"`` (every parameter) or a
        :class:`TransformerBlocks` selection; default the task's ``default_layers``: every
        default layer for ``ga.Task(model, loss)``, the linear layers inside the
        transformer blocks for the ``ga.tasks`` language tasks (``explain()`` shows the
        coverage: what is attributed, what is left out).
    ids : one id per example (default 0..n-1); they label the scores.
    batch_size : examples per captured chunk (default ``ga.options().batch_size``).
    backend : "hooks" (factored capture of supported layers, one backward per chunk)
        or "func" (torch.func vmap over examples: any module, dense blocks, slower).
    objective : "loss" (default), "sampled" (targets drawn from the model: gradients
        whose Fisher is the Gauss-Newton matrix, in expectation), "expected" (one row per
        term of the exact Gauss-Newton decomposition: for curvature only) or "output"
        (TRAK's output function); see :class:`Task`.
    seed : seed of the sampled targets.
    """
    if not isinstance(task, Task):
        raise OptionError(f"ga.grads needs a ga.Task, got {type(task).__name__}: wrap the model "
                        "as ga.Task(model, loss)")
    if backend not in ("hooks", "func"):
        raise OptionError(f"backend must be 'hooks' or 'func', got {backend!r}")
    from .capture.hooks import resolve_layers

    refs = resolve_layers(task.model, task.layers_for(layers), backend=backend)  # errors now, not at compute time
    if objective not in ("loss", "sampled", "expected", "output", "weighted_output"):
        raise OptionError(f"objective must be 'loss', 'sampled', 'expected' or 'output', got {objective!r}")
    task.objective_fn(objective)  # a missing sampled_loss/output is reported now
    return GradientSet(Source(task, as_data(data, ids, batch_size, task.collate_fn), tuple(r.name for r in refs), backend,
                              objective, _int("seed", seed)))


def fisher(G: GradientSet, structure: str = "dense") -> Operator:
    """F = (1/n) Σ_i g_i g_iᵀ over the rows of ``G``: "dense", "block" (per layer) or "diag"."""
    if not isinstance(G, GradientSet):
        raise OptionError("ga.fisher takes a GradientSet, e.g. ga.fisher(P(G))")
    if structure not in ("dense", "block", "diag"):
        raise OptionError(f"Fisher structure must be 'dense', 'block' or 'diag', got {structure!r}")
    return Operator(Fisher(G.expr, structure))


def identity(like) -> Operator:
    """I on the space of ``like`` (a GradientSet or Operator)."""
    return Operator(Identity(like.space))


def diagonal(values: torch.Tensor, like, *, note: str = "") -> Operator:
    """diag(values) on the space of ``like``; values: (dim,). ``note`` is shown in the plan."""
    return Operator(Diagonal(values, like.space, str(note)))


def dense(matrix: torch.Tensor, like) -> Operator:
    """A given symmetric (dim, dim) matrix on the space of ``like`` (blocks in space order)."""
    return Operator(Dense(matrix, like.space))


def _score_list(scores, more) -> list:
    """``f(S1, S2, ...)`` or ``f([S1, S2, ...])`` (any iterable) as a list of Scores."""
    items = [scores, *more] if isinstance(scores, Scores) else [*scores, *more]
    bad = [type(s).__name__ for s in items if not isinstance(s, Scores)]
    if bad:
        raise OptionError(f"expected Scores (lazy, e.g. Q @ G.T or a ga.methods result), got {bad[0]}")
    return items


def sum_scores(scores: Iterable[Scores] | Scores, *more: Scores,
               weights: Iterable[float] | None = None) -> Scores:
    """Σ_k w_k S_k (checkpoints, ensembles): ``ga.sum([S1, S2], weights)`` or ``ga.sum(S1, S2)``.

    One expression: the planner puts every member's jobs over the same (task, data) into
    one pass, so data shared by members is read once."""
    if more and not isinstance(scores, Scores) and weights is None:   # ga.sum(list, weights): positional
        weights, more = more[0], more[1:]
    scores = _score_list(scores, more)
    if not scores:
        raise OptionError("sum_scores needs at least one Scores")
    w = [1.0] * len(scores) if weights is None else [float(x) for x in weights]
    if len(w) != len(scores):
        raise OptionError(f"got {len(w)} weights for {len(scores)} scores")
    return Scores(ScoreSum(tuple(s.expr for s in scores), tuple(w)))


def mean_scores(scores: Iterable[Scores] | Scores, *more: Scores,
                weights: Iterable[float] | None = None) -> Scores:
    """(1/K) Σ_k S_k, or with ``weights`` the weighted mean Σ_k w_k S_k / Σ_k w_k (an ensemble
    over models, seeds or checkpoints): ``ga.mean([S1, S2, S3])``, ``ga.mean(S1, S2)``,
    ``ga.mean(members, weights=[2, 1, 1])``."""
    scores = _score_list(scores, more)
    if not scores:
        raise OptionError("ga.mean needs at least one Scores")
    if weights is None:
        return sum_scores(scores, weights=[1.0 / len(scores)] * len(scores))
    w = [float(x) for x in weights]
    if len(w) != len(scores):
        raise OptionError(f"got {len(w)} weights for {len(scores)} scores")
    if any(x < 0 or x != x for x in w) or sum(w) <= 0:
        raise OptionError(f"a weighted mean needs non-negative weights with a positive sum, got {w}")
    total = sum(w)
    return sum_scores(scores, weights=[x / total for x in w])


def row_weights(fn: Callable[[torch.nn.Module, Any], torch.Tensor], name: str | None = None) -> RowWeights:
    """Per-example values ``fn(model, batch) -> (B,)`` to scale gradient rows by (e.g. TRAK's 1 − p)."""
    if not callable(fn) or isinstance(fn, GradientSet) or not (name is None or isinstance(name, str)):
        raise OptionError("ga.row_weights(fn, name=None) takes a function fn(model, batch) -> (B,) weights; "
                          "scale a GradientSet with G * ga.row_weights(fn) or G * number")
    return RowWeights(fn, name or getattr(fn, "__name__", "weights"))


def kfac(G: GradientSet, *, eigen_correction: bool = False, covariance_max_examples: int | None = None,
         lambda_max_examples: int | None = None) -> Operator:
    """K-FAC approximation S ⊗ A of the Fisher of ``G``'s rows, per layer (Martens & Grosse 2015).

    ``G`` must keep factors: gradients from ``ga.grads`` (hooks), optionally projected
    with ``ga.proj.kron`` (LoGra). Use ``objective="sampled"`` gradients for the true
    Fisher / Gauss-Newton, as K-FAC intends.

    A tied parameter (GPT-2's embedding and LM head) is one block whose factors pool its
    uses (:mod:`gradalg.capture.tying`), so its S and A are the covariances of the pooled
    rows, as EK-FAC's eigenbasis and the gradients treat it. A factor wider than
    ``ga.options(kron_diagonal_width)`` (a vocabulary side) is kept as its diagonal
    (:mod:`gradalg.curvature.kron`, "Diagonal factors of vocabulary-wide sides"), named in
    the plan's decisions and operator rules (``kronecker.diagonal_factor``).

    covariance_max_examples : estimate the Kronecker covariances A = (1/m) Σ_{i<m} A_iᵀA_i
        and S = (1/m) Σ_{i<m} D_iᵀD_i from the first m examples of ``G`` only (its data's
        order), as Kronfluence's ``FactorArguments.covariance_max_examples``. The pass that
        accumulates them reads those m examples and no others. None (default): all of them,
        exact. A value of at least ``G.n`` uses all of them (the same operator as None).
    lambda_max_examples : EK-FAC only (``eigen_correction=True``): the eigenvalue correction
        Λ = (1/m) Σ_{i<m} (Q_Sᵀ G_i Q_A)² from the first m examples (Kronfluence's
        ``lambda_max_examples``); None: all; at least ``G.n``: all.

    Both are positive ints (``ValueError`` naming the option otherwise), part of the
    operator's identity, and shown by ``explain()`` ("covariances: first 100 of 1,000
    examples"). ``G`` must then be computed from data (``ga.grads``), not captured rows.
    """
    if not isinstance(G, GradientSet):
        raise OptionError("ga.kfac takes a GradientSet")
    for b in G.space.blocks:
        if len(b.shape) != 2:
            if b.basis == "params":
                raise OptionError(
                    f"K-FAC needs (out, in) layer blocks; block {b.name!r} has shape {b.shape}: its rows are "
                    "flat (ga.grads with backend='func'). Use ga.grads(task, data, layers, backend='hooks') (the "
                    "default), whose rows keep their Kronecker factors")
            raise OptionError(
                f"K-FAC needs (out, in) layer blocks; block {b.name!r} has shape {b.shape}: a flat projection "
                f"(gaussian, rademacher, sparse) has no Kronecker structure. Project each layer with "
                f"ga.proj.kron(k={min(b.shape[0], 64)}), which keeps (k, k) blocks, or use ga.fisher on the flat rows")
    cov = _max_examples("covariance_max_examples", covariance_max_examples, G.n)
    lam = _max_examples("lambda_max_examples", lambda_max_examples, G.n)
    if not eigen_correction:
        if lambda_max_examples is not None:
            raise OptionError("lambda_max_examples is the number of examples of EK-FAC's eigenvalue "
                             "correction: use it with ga.ekfac (eigen_correction=True), or leave it None")
    node = KFAC(G.expr, eigen_correction, cov, lam)
    node.covariance_grads, node.lambda_grads   # refused now (captured rows), not at compute time
    return Operator(node)


def _max_examples(name: str, value, n: int) -> int | None:
    """``value`` checked as a number of examples (None, or a positive int); None when it
    covers all ``n`` examples."""
    if value is None:
        return None
    value = _positive_int(name, value, "(a number of examples) or None for all of them")
    return None if value >= n else value


def _int(name: str, value) -> int:
    """``value`` as an int (numpy integers accepted), or an OptionError naming it."""
    value = plain(value)
    if not isinstance(value, int) or isinstance(value, bool):
        raise OptionError(f"{name} must be an int, got {value!r}")
    return value


def _positive_int(name: str, value, what: str = "") -> int:
    """``value`` as a positive int (numpy integers accepted), or an OptionError naming it."""
    value = plain(value)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise OptionError(f"{name} must be a positive integer{' ' + what if what else ''}, got {value!r}")
    return value


def ekfac(G: GradientSet, *, covariance_max_examples: int | None = None,
          lambda_max_examples: int | None = None) -> Operator:
    """EK-FAC: K-FAC's eigenbasis with eigenvalues re-fitted to ``G`` (George et al. 2018).

    ``covariance_max_examples`` / ``lambda_max_examples``: the covariances (the eigenbasis)
    and the eigenvalue correction from the first m examples of ``G`` only (:func:`kfac`;
    None: all, exact; at least ``G.n``: all)."""
    return kfac(G, eigen_correction=True, covariance_max_examples=covariance_max_examples,
                lambda_max_examples=lambda_max_examples)


def _products(task, data, layers, kind, ids, batch_size) -> Operator:
    from .capture.hooks import resolve_layers
    from .expr.grads import _module_blocks
    from .space import ParamSpace

    refs = resolve_layers(task.model, task.layers_for(layers))
    names = tuple(r.name for r in refs)
    space = ParamSpace(_module_blocks(task, names, "hooks"))
    return Operator(CurvatureProducts(task, as_data(data, ids, batch_size, task.collate_fn), names, kind, space))


def hessian(task: Task, data, layers=None, *, ids=None, batch_size: int | None = None) -> Operator:
    """H = (1/n) Σ_i ∇²_θ L_i over ``data``, known through Hessian-vector products.

    Invert with ``.damp(λ).inv(method="cg" | "lissa")`` or approximate with
    ``ga.arnoldi(H, rank)``; every product is one pass over ``data``.
    """
    return _products(task, data, layers, "hessian", ids, batch_size)


def gauss_newton(task: Task, data, layers=None, *, ids=None, batch_size: int | None = None) -> Operator:
    """G = (1/n) Σ_i J_iᵀ ∇²ℓ J_i, the exact Gauss-Newton matrix through products."""
    return _products(task, data, layers, "gauss_newton", ids, batch_size)


def arnoldi(H: Operator, rank: int, *, iters: int | None = None, seed: int = 0) -> Operator:
    """H ≈ V diag(μ) Vᵀ on its top-``rank`` eigenspace (Schioppa et al. 2022)."""
    if rank < 1:
        raise OptionError(f"rank must be positive, got {rank}")
    return Operator(Arnoldi(H.expr, int(rank), iters, int(seed)))


def datainf(G: GradientSet, damping: float) -> Operator:
    """DataInf's closed-form approximation of (F + λI)⁻¹ per layer (Kwon et al. 2024)."""
    damping = plain(damping)
    if not isinstance(damping, numbers.Real) or isinstance(damping, bool) or not 0 <= damping < float("inf"):
        raise OptionError(f"damping must be a finite non-negative number, got {damping!r}")
    return Operator(DataInf(G.expr, float(damping)))


def adam_state(optimizer: torch.optim.Optimizer, like: GradientSet) -> AdamState:
    """Adam's moments from ``optimizer`` (torch.optim.Adam/AdamW), in the coordinates of ``like``.

    ``like`` must be gradients captured with ``ga.grads`` in parameter coordinates; the
    optimizer must have taken at least one step. The moments are read from the
    optimizer's own tensors a block at a time when the scores run (no copy of the
    model's size): the optimizer must not step before then, and a step in between is
    refused (``OptionError``); for several checkpoints of one run, keep a copy of each
    checkpoint's optimizer (``copy.deepcopy``) or compute the scores before stepping on.
    """
    from .curvature.hvp import ParamCoords

    src = like.expr.source
    if not isinstance(src, Source):
        raise OptionError("adam_state needs gradients from ga.grads (to map parameters to blocks)")
    coords = ParamCoords(src.task.model, src.layers, src.backend)
    params = dict(src.task.model.named_parameters())
    m, v = {}, {}
    for name in coords.param_names:
        state = optimizer.state.get(params[name], {})
        if "exp_avg" not in state:
            raise OptionError(f"the optimizer has no Adam state for {name!r}: take a step first, "
                             "and pass an Adam/AdamW optimizer over this model's parameters")
        m[name], v[name] = state["exp_avg"], state["exp_avg_sq"]
    group = optimizer.param_groups[0]
    beta1, beta2 = group["betas"]
    return AdamState(_BlockMoments(coords, m), _BlockMoments(coords, v), float(beta1), float(beta2),
                     float(group["eps"]))


class _BlockMoments:
    """One Adam moment in a gradient space's canonical coordinates, (dim,), read from the
    optimizer's own tensors a block at a time instead of copied whole.

    ``moment[a:b]`` forms only the blocks that overlap coordinates [a, b) (the block's
    ``from_params``: a view, or a weight/bias concatenation of that block's size), so
    LESS's Adam transform, which reads one block's slice per chunk
    (``AdamState.direction``), holds one block's moments at a time, not 2 · dim numbers
    (0.8–1.1 GB on 10⁸-parameter models, outside the plan). The optimizer must not step
    between ``ga.adam_state`` and the scores' evaluation: the tensors' versions are
    recorded and a change is refused (a flat copy used to freeze them). ``moment`` holds
    the optimizer's own tensors, not views of them: a view of a DTensor (FSDP2) has
    version counters of its own, which a write into the optimizer's tensor's local shard
    does not bump (:func:`gradalg.dtensor.write_version`).
    """

    def __init__(self, coords, moment: dict):
        self._coords, self._moment = coords, moment
        self._versions = {k: write_version(t) for k, t in moment.items()}
        self._spans, start = [], 0          # (start, stop, ref index) per ref, in coords order
        for i, size in enumerate(self._sizes()):
            self._spans.append((start, start + size, i))
            start += size
        self.shape = (start,)
        first = next(iter(moment.values()))
        self.dtype, self.device = first.dtype, first.device

    def _sizes(self):
        for i in range(len(self._coords.refs)):
            yield self._block(i).shape[-1]

    def _block(self, i: int) -> torch.Tensor:
        """Ref i's coordinates, (dim_i,)."""
        ref, names = self._coords.refs[i], self._coords.local[i]
        local = {pname: self._moment[full].detach().unsqueeze(0) for pname, full in names.items()}
        if self._coords.backend == "func":
            return torch.cat([t.flatten(1) for t in local.values()], dim=1)[0]
        return ref.rule.from_params(ref.module, local).flatten(1)[0]

    def _check(self):
        for k, t in self._moment.items():
            if write_version(t) != self._versions[k]:
                raise OptionError(f"the optimizer's state of {k!r} changed after ga.adam_state(...) read it (a "
                                  "step was taken, or the state was loaded): call ga.adam_state (or the method) again after the step")

    def __getitem__(self, index) -> torch.Tensor:
        if not isinstance(index, slice) or index.step not in (None, 1):
            return self.full()[index]
        self._check()
        a, b, _ = index.indices(self.shape[0])
        parts = [(s, e, i) for s, e, i in self._spans if s < b and e > a]
        if not parts:
            return torch.empty(0, dtype=self.dtype, device=self.device)
        flat = torch.cat([self._block(i) for _, _, i in parts]) if len(parts) > 1 else self._block(parts[0][2])
        return flat[a - parts[0][0]:b - parts[0][0]]

    def full(self) -> torch.Tensor:
        """The whole (dim,) vector (a copy: several blocks are concatenated into a new
        tensor; one block may be a view of the optimizer's, so it is cloned)."""
        whole = self[0:self.shape[0]]
        return whole.clone() if len(self._spans) == 1 else whole

    # Anything else a (dim,) tensor does, it does on the whole vector (a copy, made when
    # asked): ``v.double().sqrt()``, ``torch.sqrt(v)``, ``v + eps``, ``np.asarray(v)``.
    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.full(), name)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        def whole(x):
            return x.full() if isinstance(x, cls) else x
        return func(*map(whole, args), **{k: whole(v) for k, v in (kwargs or {}).items()})

    def __array__(self, dtype=None, copy=None):
        return self.full().numpy() if dtype is None else self.full().numpy().astype(dtype)

    def to(self, *args, **kwargs) -> torch.Tensor:
        return self.full().to(*args, **kwargs)

    def __len__(self) -> int:
        return self.shape[0]

    def __setstate__(self, state):
        # unpickled on a worker: fresh tensors, their versions start again (the driver checked)
        self.__dict__.update(state)
        self._versions = {k: write_version(t) for k, t in self._moment.items()}

    @property
    def token(self) -> str:
        from .expr.base import tokenize
        self._check()
        return "moments" + tokenize([self._moment[k].detach().unsqueeze(0) for k in self._moment])


def _whole(name: str):
    """``_BlockMoments``' operator ``name``: the tensor's, on the whole vector."""
    return lambda self, *other: getattr(self.full(), name)(*other)


for _name in ("__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__", "__rtruediv__",
              "__pow__", "__rpow__", "__neg__", "__lt__", "__le__", "__gt__", "__ge__"):
    setattr(_BlockMoments, _name, _whole(_name))
