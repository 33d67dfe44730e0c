"""Scores over training time: TracIn along the run itself, one term per optimizer step.

    traj = ga.trajectory(model, task, queries, layers=["fc1", "fc2"], optimizer=opt)
    with traj:                                  # or: traj.attach(tc) / traj.hf_callback()
        for i, (x, y) in loader:
            traj.ids_next(i)                    # dataset indices of the batch (optional)
            F.cross_entropy(model(x), y, reduction="sum").backward()
            opt.step(); opt.zero_grad()
    S = traj.scores                             # TrajectoryScores
    S.array                                     # xarray (query, train, step)
    S.total()                                   # xarray (query, train): Σ over steps

The math
--------
At optimizer step ``t`` the parameters are ``θ_t`` and the step's rows are ``g_i(θ_t)``,
each example's gradient of the loss that was backpropagated (``ga.integrations``'
rows: with a mean-reduced loss, the example's *contribution* ``(1/B)∇ℓ_i``). With the
queries' gradients ``g_q(θ_t)`` taken at the same parameters, *before* the step::

    τ_{q,i,t} = ⟨g_q(θ_t), M_t g_i(θ_t)⟩

    M_t = η_t                                  precondition=None   (TracIn)
    M_t = diag(η_t ⊘ (√v̂_{t+1} + ε))           precondition="adam" (TracIn/LESS with Adam)

``η_t`` is the learning rate in force at step ``t``, per coordinate (each parameter's
``param_group``; a coordinate the optimizer does not update gets 0); ``v̂_{t+1}`` is
the bias-corrected second moment *Adam uses in this step* (``β₂ v_t + (1 − β₂) g_t²``
over ``1 − β₂^{t+1}``, ``g_t`` the step's gradient in ``p.grad``; the running maximum
with ``amsgrad``). With precondition=None and plain SGD, ``Σ_i τ_{q,i,t}`` is the
first-order decrease of the query loss over the step,
``L_q(θ_t) − L_q(θ_{t+1}) ≈ η_t ⟨g_q, Σ_i g_i⟩``; with Adam the same holds for its
update without momentum. Momentum (SGD's, Adam's first moment) spreads an example's
step over later steps with weights that sum to 1; it is not modelled (as in TracIn and
LESS), nor is gradient clipping (the rows are the unclipped gradients).

* an example seen at several steps (epochs, or twice in one step) accumulates: its
  entry at step ``t`` is the sum of its rows there, its total ``Σ_t τ_{q,i,t}``;
* an example **not seen at step t scores exactly 0 there**: it did not move the
  parameters at that step (this is what makes the sum differ from TracIn-CP over
  checkpoints, which scores every example at every checkpoint; the two coincide when
  every example is in every step, e.g. full-batch gradient descent).

With ``projector=P`` both sides are projected, ``⟨P(M_t g_q), P(g_i)⟩`` (unbiased:
``E[⟨Px, Py⟩] = ⟨x, y⟩``), so nothing of the model's size is held per query.

Memory: the totals ``Σ_t τ`` are (n_query, n_examples_seen) numbers, always exact.
Per-step scores are kept for every row seen (n_query × rows seen), or with ``topk=k``
only the k entries of largest ``|τ|`` per query and step (the others are NaN in
:attr:`TrajectoryScores.array`, "seen but not kept"; totals stay exact); ``topk=0``
keeps totals only. Nothing is kept of gradients across steps and no checkpoint is saved.

Cost per step: the queries' forward and backward at ``θ_t`` (training capture paused, in
eval mode) and one (n_query × n_step) score matrix, planned as ``Q @ M @ G.T`` (ghost
products when ``M`` is a scalar).
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
from torch import nn

from ..errors import CaptureStateError, DataError, ModelMismatchError, OptionError
from ..eval_mode import eval_mode
from ..task import Task
from ..token_scores import Axis, labelled
from .distributed import unwrap_model
from .training import StepGrads, TrainingCapture

__all__ = ["Trajectory", "TrajectoryScores", "StepScores", "trajectory"]

PRECONDITIONS = (None, "adam")


@dataclass(frozen=True)
class StepScores:
    """One optimizer step's scores.

    index : the step's number. lr : the learning rate of the first param group (display;
        the scores use each coordinate's own). ids : (n_t,) the example id of each row.
    values : (n_query, n_t) float64, ``τ_{q,i,t}`` per row (``None`` with ``topk=0``);
        with ``topk=k``: (n_query, k) values at row positions ``kept`` (n_query, k).
    """

    index: int
    lr: float
    ids: tuple
    values: np.ndarray | None
    kept: np.ndarray | None = None


class TrajectoryScores:
    """Scores per (query, training example, step), from a :class:`Trajectory`.

    :attr:`array` is the dense xarray ``(query, train, step)`` (0 where an example was
    not seen, NaN where it was seen but not kept by ``topk``); :meth:`total` the exact
    sum over steps ``(query, train)``; :meth:`cumulative` the running sum over steps.
    ``steps`` is the list of :class:`StepScores`; ``train_ids`` the examples in the order
    first seen.
    """

    def __init__(self, query_ids: tuple, train_ids: tuple, totals: np.ndarray, steps: list, info: dict):
        self.query_ids = tuple(query_ids)
        self.train_ids = tuple(train_ids)
        self._totals = totals             # (n_query, n_train)
        self.steps = list(steps)
        self.info = dict(info)

    @property
    def shape(self) -> tuple[int, int, int]:
        """(n_query, n_train, n_steps)."""
        return len(self.query_ids), len(self.train_ids), len(self.steps)

    def total(self):
        """``Σ_t τ_{q,i,t}``: xarray (query, train), exact whatever ``topk`` kept."""
        return labelled(self._totals.copy(), self._axes(self.train_ids), "trajectory_total", dict(self.info))

    def _axes(self, train_ids) -> list[Axis]:
        """The (query, train) axes of a result: the query ids and ``train_ids``."""
        return [Axis("query", np.asarray(self.query_ids)), Axis("train", np.asarray(train_ids))]

    @property
    def array(self):
        """xarray (query, train, step) of ``τ_{q,i,t}``; 0 = not seen at that step, NaN = seen,
        not kept (``topk``). Holds n_query × n_train × n_steps float64 numbers."""
        if self.info.get("topk") == 0:
            raise CaptureStateError("this trajectory kept totals only (topk=0): read .total(), or record again "
                                    "with topk=None (every score) or topk=k (the k largest |τ| per step)")
        m, n, T = self.shape
        col = {i: c for c, i in enumerate(self.train_ids)}
        out = np.zeros((m, n, T))
        for t, st in enumerate(self.steps):
            cols = np.asarray([col[i] for i in st.ids], dtype=np.int64)
            if st.kept is None:
                for q in range(m):
                    np.add.at(out[q, :, t], cols, st.values[q])
            else:
                out[:, np.unique(cols), t] = np.nan
                rows_of = np.bincount(cols, minlength=n)
                for q in range(m):
                    keep = cols[st.kept[q]]
                    out[q, np.unique(keep), t] = 0.0
                    np.add.at(out[q, :, t], keep, st.values[q])
                    # an example with several rows in the step, not all kept: no partial sum
                    partial = np.nonzero(np.bincount(keep, minlength=n) < rows_of)[0]
                    out[q, partial[np.isin(partial, keep)], t] = np.nan
        return labelled(out, self._axes(self.train_ids) + [Axis("step", np.asarray([st.index for st in self.steps]))],
                        "trajectory", dict(self.info),
                        coords={"lr": ("step", np.asarray([st.lr for st in self.steps], dtype=float))})

    def cumulative(self):
        """Running sums over steps: xarray (query, train, step); NaN from a step whose score was
        not kept (``topk``) on, never a silently partial sum."""
        return self.array.cumsum("step", skipna=False)

    def at(self, step: int):
        """Step ``step``'s scores as xarray (query, train): one column per row of the step
        (an example seen twice in it has two columns)."""
        st = next((s for s in self.steps if s.index == step), None)
        if st is None:
            raise OptionError(f"no step {step} was recorded; steps are {[s.index for s in self.steps][:10]}...")
        if st.values is None or st.kept is not None:
            raise CaptureStateError(f"step {step}'s scores were not all kept (topk={self.info.get('topk')}): "
                                    "read .array (NaN where not kept), or record with topk=None")
        return labelled(st.values, self._axes(st.ids), "step_scores", {"step": st.index, "lr": st.lr})

    def records(self):
        """Every kept score as a long pandas DataFrame (columns query, train, step, lr, score):
        one row per (query, row of a step), rows of an example seen twice in a step summed.
        Its size is what was kept, not n_query × n_train × n_steps. With ``topk``, only kept
        rows are listed (an example with several rows in a step, some dropped, sums the kept ones;
        :attr:`array` shows NaN there)."""
        import pandas as pd

        frames = []
        for st in self.steps:
            if st.values is None:
                continue
            ids = np.asarray(st.ids, dtype=object)
            for q, qid in enumerate(self.query_ids):
                rows = st.kept[q] if st.kept is not None else np.arange(len(st.ids))
                frames.append(pd.DataFrame({"query": qid, "train": ids[rows], "step": st.index, "lr": st.lr,
                                            "score": st.values[q]}))
        if not frames:
            return pd.DataFrame(columns=["query", "train", "step", "lr", "score"])
        out = pd.concat(frames, ignore_index=True)
        return out.groupby(["query", "train", "step"], sort=False, as_index=False).agg(
            lr=("lr", "first"), score=("score", "sum"))

    def top(self, query, k: int = 5, *, largest: bool = True):
        """The ``k`` examples with the largest (or smallest) total score for ``query`` (an id):
        a pandas Series of totals, best first."""
        tot = self.total().sel(query=query).to_series()
        return tot.nlargest(k) if largest else tot.nsmallest(k)

    def __repr__(self):
        m, n, T = self.shape
        pre = self.info.get("precondition") or "none"
        return (f"TrajectoryScores(query={m}, train={n}, step={T}; precondition={pre}, "
                f"projector={self.info.get('projector')}, topk={self.info.get('topk')})")


class Trajectory:
    """Per-step TracIn scores computed during training. Build it with :func:`trajectory`.

    Attributes: ``scores`` (:class:`TrajectoryScores` of the steps so far), ``capture`` (the
    :class:`TrainingCapture` it scores), ``layers``, ``query_ids``, ``optimizer``,
    ``step_offset`` (added to the capture's step numbers: the steps a resumed run took before;
    the HF callback sets it from ``global_step``).
    """

    def __init__(self, model: nn.Module, task: Task, queries, *, layers=None, optimizer=None,
                 precondition: str | None = None, lr=None, projector=None, topk: int | None = None,
                 query_ids=None, batch_size: int | None = None):
        from ..api import grads
        from ..expr.projection import check_projector

        if not isinstance(model, nn.Module):
            raise OptionError(f"ga.trajectory takes the torch.nn.Module being trained, got {type(model).__name__}")
        if not isinstance(task, Task):
            raise OptionError(f"ga.trajectory needs a ga.Task for the queries' loss, got {type(task).__name__}: "
                              "wrap the model as ga.Task(model, loss)")
        self.model = unwrap_model(model)
        if unwrap_model(task.model) is not self.model:
            raise ModelMismatchError("the task's model is not the model being trained: the queries' gradients must "
                                     "be taken at the training parameters θ_t; build the task over the same module "
                                     "(ga.Task(model, loss))")
        if precondition not in PRECONDITIONS:
            raise OptionError(f"precondition must be None (η⟨g_q, g_i⟩) or 'adam' (η⟨g_q, g_i/(√v̂+ε)⟩), "
                              f"got {precondition!r}")
        self.optimizer = _torch_optimizer(optimizer) if optimizer is not None else None
        if precondition == "adam" and self.optimizer is not None:
            _check_adam(self.optimizer)
        if lr is not None and not callable(lr) and not _finite_number(lr):
            raise OptionError(f"lr must be a finite number or a function step -> lr, got {lr!r}")
        if topk is not None and (isinstance(topk, bool) or not isinstance(topk, numbers.Integral) or topk < 0):
            raise OptionError(f"topk must be None (keep every score), 0 (totals only) or a positive int, got {topk!r}")
        self.precondition = precondition
        self.lr = lr
        self.projector = check_projector(projector)
        self.topk = None if topk is None else int(topk)
        self.task = task
        # the queries' lazy gradients: refuses bad data / layers now (DataError, LayerNameError)
        self._Q = grads(task, queries, layers, ids=query_ids, batch_size=batch_size)
        self.layers = self._Q.layers
        self.queries = self._Q.expr.data
        self.query_ids = tuple(self._Q.ids)
        _check_queries_run(task, self.queries)
        self.capture: TrainingCapture | None = None
        self._own = False
        self._col: dict = {}
        self._totals = np.zeros((len(self.query_ids), 0))
        self._steps: list[StepScores] = []
        self._seconds = 0.0
        self._coords = None
        self.step_offset = 0      # optimizer steps taken before this capture began (a resumed run)

    # ------------------------------------------------------------------ wiring
    def attach(self, capture: TrainingCapture) -> "Trajectory":
        """Score the steps of an existing :class:`TrainingCapture` (shared with a stream or
        another callback); its layers must include this trajectory's. Returns ``self``."""
        if not isinstance(capture, TrainingCapture):
            raise OptionError(f"attach takes a ga.integrations.TrainingCapture, got {type(capture).__name__}")
        if capture.model is not self.model:
            raise ModelMismatchError("the capture records another model than this trajectory's")
        missing = [n for n in self.layers if n not in capture.space.names]
        if missing:
            raise OptionError(f"the capture does not record layers {missing} of this trajectory; record them "
                              f"(training_capture(model, layers=[..., {missing[0]!r}])) or leave them out of layers=")
        self._require_optimizer()
        self.capture = capture
        capture.on_step(self.on_step)
        return self

    def _require_optimizer(self) -> None:
        """Refuse, before training, a form that needs the optimizer when there is none (the HF
        callback brings the Trainer's at ``on_train_begin``)."""
        if self.optimizer is not None:
            return
        if self.precondition == "adam":
            raise OptionError("precondition='adam' reads Adam's second moment from the optimizer at every step: "
                              "pass ga.trajectory(..., optimizer=opt) (a torch.optim.Adam or AdamW); with the HF "
                              "Trainer, traj.hf_callback() takes the Trainer's optimizer")
        if self.lr is None:
            raise OptionError("the learning rate of each step comes from the optimizer: pass "
                              "ga.trajectory(..., optimizer=opt), or lr= (a number or a function step -> lr)")

    def __enter__(self):
        self._require_optimizer()
        if self.capture is None:
            from .training import training_capture
            self.attach(training_capture(self.model, list(self.layers), optimizer=self.optimizer))
            self._own = True
        if self._own:
            self.capture.__enter__()
        return self

    def __exit__(self, *exc):
        if self._own:
            self.capture.__exit__(*exc)
        return False

    def ids_next(self, ids) -> None:
        """Label the next micro-batch's rows with ``ids`` (dataset indices): see
        :meth:`TrainingCapture.ids_next`. Without it rows are numbered in the order seen."""
        if self.capture is None:
            raise CaptureStateError("ids_next needs the capture: call it inside `with traj:` (or after attach)")
        self.capture.ids_next(ids)

    def hf_callback(self, **kwargs):
        """A ``transformers`` ``TrainerCallback`` that scores every Trainer step (a
        :class:`~gradalg.integrations.hf.GradientCallback` over this trajectory's layers,
        ``keep=False``; ``kwargs`` go to it, e.g. ``scale="sum"``). Without ``optimizer=``,
        the Trainer's optimizer gives the learning rates (and Adam's moments)."""
        from .hf_trajectory import TrajectoryCallback
        return TrajectoryCallback(self, **kwargs)

    # ------------------------------------------------------------------ the step
    def on_step(self, step: StepGrads) -> None:
        """Score one closed step (an ``on_step`` callback: before the optimizer step)."""
        import time

        from ..api import diagonal, grads
        from ..exec.local import LocalExecutor

        self._require_optimizer()
        capture = step.capture if step.capture is not None else self.capture
        if capture is None:
            raise CaptureStateError("the trajectory scores a step with the queries' forward and backward at θ_t, "
                                    "with the training capture paused: attach it first (traj.attach(tc)), or use "
                                    "`with traj:` / traj.hf_callback()")
        t0 = time.perf_counter()
        G = step.grads
        if tuple(G.layers) != tuple(self.layers):
            G = G.select(self.layers)
        scale, diag = self._metric(step)
        with capture.paused():
            Q = grads(self.task, self.queries, list(self.layers))      # at θ_t: the live model
            P = self.projector
            if diag is not None:
                D = diagonal(diag, like=Q, note=f"step {self._index(step)}: η" + (" / (√v̂+ε) from Adam"
                                                                             if self.precondition else ""))
                S = (P(Q @ D) @ P(G).T) if P is not None else (Q @ D @ G.T)
            else:
                S = (P(Q) @ P(G).T) if P is not None else (Q @ G.T)
            values = np.asarray(S.compute(LocalExecutor()).values, dtype=np.float64) * scale   # (m, n_t)
        self._record(step, values)
        self._seconds += time.perf_counter() - t0

    def _record(self, step: StepGrads, values: np.ndarray) -> None:
        ids = step.ids
        new = [i for i in dict.fromkeys(ids) if i not in self._col]
        if new:
            for i in new:
                self._col[i] = len(self._col)
            self._totals = np.concatenate([self._totals, np.zeros((values.shape[0], len(new)))], axis=1)
        cols = np.asarray([self._col[i] for i in ids], dtype=np.int64)
        for q in range(values.shape[0]):
            np.add.at(self._totals[q], cols, values[q])
        lr = float(self._lr_scalar(step))
        if self.topk == 0:
            rec = StepScores(self._index(step), lr, tuple(ids), None)
        elif self.topk is None or self.topk >= values.shape[1]:
            rec = StepScores(self._index(step), lr, tuple(ids), values)
        else:
            kept = np.argsort(-np.abs(values), axis=1, kind="stable")[:, :self.topk]
            rec = StepScores(self._index(step), lr, tuple(ids), np.take_along_axis(values, kept, 1), kept)
        self._steps.append(rec)

    @property
    def scores(self) -> TrajectoryScores:
        """Every step scored so far, as :class:`TrajectoryScores`."""
        info = {"precondition": self.precondition or "none", "topk": self.topk,
                "projector": repr(self.projector) if self.projector is not None else "none",
                "seconds": round(self._seconds, 6)}
        return TrajectoryScores(self.query_ids, tuple(self._col), self._totals, self._steps, info)

    def _index(self, step: StepGrads) -> int:
        """The step's number in the run: ``step_offset`` (the optimizer steps taken before this
        capture began, e.g. a resumed Trainer's ``global_step``) plus the capture's count."""
        return self.step_offset + step.index

    # ------------------------------------------------------------------ M_t
    def _lr_scalar(self, step: StepGrads) -> float:
        if self.lr is not None:
            return float(self.lr(self._index(step)) if callable(self.lr) else self.lr)
        if self.optimizer is None:
            raise OptionError("the learning rate of each step comes from the optimizer: pass optimizer=opt to "
                              "ga.trajectory, or lr= (a number or a function step -> lr)")
        return float(self.optimizer.param_groups[0]["lr"])

    def _param_coords(self):
        if self._coords is None:
            from ..curvature.hvp import ParamCoords
            self._coords = ParamCoords(self.model, list(self.layers))
        return self._coords

    def _metric(self, step: StepGrads):
        """``M_t`` as (scalar, None) or (1, diag values (dim,) in the space's coordinates)."""
        if self.lr is not None and self.precondition is None:
            lr = self._lr_scalar(step)
            if not math.isfinite(lr):
                raise OptionError(f"lr({self._index(step)}) returned {lr!r}: a finite number is needed")
            return lr, None
        if self.optimizer is None:
            self._lr_scalar(step)     # raises, naming the fix
        coords = self._param_coords()
        params = dict(self.model.named_parameters())
        group_of = {id(p): g for g in self.optimizer.param_groups for p in g["params"]}
        per = {}
        lrs = set()
        for name in coords.param_names:
            p = params[name]
            g = group_of.get(id(p))
            if g is None:
                per[name] = torch.zeros((1, *p.shape), dtype=torch.float64, device=p.device)   # not updated
                lrs.add(0.0)
                continue
            lr = float(self.lr(self._index(step)) if callable(self.lr) else self.lr) if self.lr is not None else float(g["lr"])
            lrs.add(lr)
            if self.precondition == "adam":
                per[name] = (lr / _adam_denominator(self.optimizer, p, g)).unsqueeze(0)
            else:
                per[name] = torch.full((1, *p.shape), lr, dtype=torch.float64, device=p.device)
        if self.precondition is None and len(lrs) == 1:
            return lrs.pop(), None
        # in the parameters' dtype: float64 values would upcast the held and streamed rows of a
        # float32 model (twice the bytes and the GEMM time) for no accuracy the rows have
        dtype = next((p.dtype for p in self.model.parameters() if p.is_floating_point()), torch.float64)
        return 1.0, coords.from_params(per)[0].to(torch.promote_types(dtype, torch.float32))


def _adam_denominator(opt, p: torch.Tensor, group: dict) -> torch.Tensor:
    """``√v̂_{t+1} + ε`` as Adam will compute it in the coming step (float64, p's shape)."""
    beta1, beta2 = group["betas"]
    eps = float(group["eps"])
    state = opt.state.get(p, {})
    v = (state["exp_avg_sq"].detach().double() if "exp_avg_sq" in state
         else torch.zeros(p.shape, dtype=torch.float64, device=p.device))
    t = float(state["step"]) if "step" in state else 0.0
    if p.grad is None:
        return torch.full(p.shape, math.inf, dtype=torch.float64, device=p.device)   # Adam skips p: no update
    g = p.grad.detach().double()
    if group.get("maximize", False):
        g = -g
    if type(opt).__name__ == "Adam" and group.get("weight_decay", 0):   # L2 in the gradient, not decoupled
        g = g + float(group["weight_decay"]) * p.detach().double()
    v = beta2 * v + (1 - beta2) * g * g
    if group.get("amsgrad", False):
        vmax = state.get("max_exp_avg_sq")
        if vmax is not None:
            v = torch.maximum(vmax.detach().double().to(v.device), v)
    bc2 = 1 - beta2 ** (t + 1)
    return (v / bc2).sqrt() + eps


def _torch_optimizer(opt):
    inner = getattr(opt, "optimizer", None)      # accelerate's AcceleratedOptimizer wraps the torch one
    while isinstance(inner, torch.optim.Optimizer):   # (itself an Optimizer subclass)
        opt, inner = inner, getattr(inner, "optimizer", None)
    if not isinstance(opt, torch.optim.Optimizer):
        raise OptionError(f"optimizer must be a torch.optim.Optimizer, got {type(opt).__name__}")
    return opt


def _check_adam(opt) -> None:
    if not isinstance(opt, (torch.optim.Adam, torch.optim.AdamW)):
        raise OptionError(f"precondition='adam' needs a torch.optim.Adam or AdamW (its exp_avg_sq and betas), got "
                          f"{type(opt).__name__}; use precondition=None for plain TracIn")


def _finite_number(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(float(x))


def _check_queries_run(task: Task, data) -> None:
    """One forward of the first query batch (no gradients): queries that do not fit the model
    are refused here, not at the first training step."""
    from ..data import move_batch

    device = next((p.device for p in task.model.parameters()), torch.device("cpu"))
    batch = next(iter(data.loader(min(2, data.n))))
    try:
        with eval_mode(task.model), torch.no_grad():
            task.summed_loss(task.model, move_batch(batch, device))
    except (RuntimeError, ValueError, TypeError, IndexError) as err:
        raise DataError(f"the queries do not fit the model: their loss failed with {type(err).__name__}: "
                        f"{str(err).splitlines()[0][:200]}. Give queries shaped like one training batch "
                        "(the same inputs and targets, examples along dimension 0)") from err


def trajectory(model: nn.Module, task: Task, queries, *, layers=None, optimizer=None,
               precondition: str | None = None, lr=None, projector=None, topk: int | None = None,
               query_ids=None, batch_size: int | None = None) -> Trajectory:
    """TracIn along the training run: ``τ_{q,i,t} = ⟨g_q(θ_t), M_t g_i(θ_t)⟩`` per (query,
    training example, optimizer step), the queries' gradients taken during training.

    Parameters
    ----------
    model : the module being trained. task : a :class:`ga.Task` over ``model`` (the queries'
        loss, a sum over examples). queries : the query examples (as ``ga.grads`` takes them).
    layers : the layers attributed (default: the task's default layers). Coordinates outside
        them are left out of every inner product.
    optimizer : the torch optimizer: a step closes at ``optimizer.step()``, its param groups
        give ``η_t`` per coordinate. Needed for ``precondition="adam"``.
    precondition : None (``M_t = η_t``) or "adam" (``η_t / (√v̂_{t+1} + ε)``): see the module docs.
    lr : a number or ``step -> lr``, overriding the optimizer's (needed without one).
    projector : a ``ga.proj`` projector applied to both sides (bounded memory per query).
    topk : None (keep every per-step score), k (the k largest ``|τ|`` per query and step), or
        0 (totals only). Totals are exact in every case.
    query_ids, batch_size : as in ``ga.grads``.

    Returns a :class:`Trajectory`: ``with traj:`` around the loop (or ``traj.attach(tc)``,
    ``traj.hf_callback()``), then ``traj.scores``.
    """
    return Trajectory(model, task, queries, layers=layers, optimizer=optimizer, precondition=precondition, lr=lr,
                      projector=projector, topk=topk, query_ids=query_ids, batch_size=batch_size)
