"""SOURCE (Bae et al., "Training data attribution via approximate unrolling", NeurIPS
2024): the unrolled response of a training run, approximated segment by segment.

The run's T steps are cut into L segments. In segment ℓ (K_ℓ steps of SGD with
learning rate η_ℓ) the curvature H_ℓ of the training objective and each example's
gradient ḡ_ℓ(z) (averaged over the segment's checkpoints) are taken as constant. Up-
weighting z by ε adds (ε/N)·ḡ_ℓ(z) per step to the averaged objective's gradient, and K
steps of gradient descent on a quadratic turn a perturbation δ at the segment's start
into

    δ ↦ S_ℓ δ − (ε/N) R_ℓ ḡ_ℓ(z),   S_ℓ = (I − η_ℓH_ℓ)^{K_ℓ},   R_ℓ = (I − S_ℓ) H_ℓ⁻¹

(R_ℓ = η Σ_{k<K} (I − ηH)^k, finite where H is singular). Chained over the segments,

    τ_qz = (1/N) Σ_ℓ ∇f_q(θ_T)ᵀ S_L ⋯ S_{ℓ+1} R_ℓ ḡ_ℓ(z)          (positive: z helps q)

the same scale and sign as :func:`gradalg.methods.magic` (−∂f_q/∂ε_z). Each S_ℓ and R_ℓ
is a function of H_ℓ's eigenvalues on its (EK-)FAC eigenbasis (``expr.spectral``), and
the scores are one gradalg expression:
``Σ_ℓ Σ_c w_ℓc · Q @ S_L @ … @ S_{ℓ+1} @ R_ℓ @ G_{ℓ,c}.T``.

For a run with ``reduction="weighted_mean"`` (batch loss Σεℓ/Σε) the exact per-step
effect of ε_z is the centred gradient ∇ℓ_z − ḡ_{B_t}; SOURCE keeps ∇ℓ_z. The difference
is the same for every z (a per-query constant, the scores of the mean gradient), so
rankings and LDS over subsets of equal size are unchanged.

Limits: one segment with K·η·λ_min → ∞ is the influence function (τ = ∇fᵀH⁻¹ḡ / N);
one segment per step of full-batch gradient descent on a quadratic objective is exact
(tested against MAGIC). Momentum enters as the effective learning rate η/(1 − μ);
Adam/AdamW runs are refused (their preconditioner is not in the closed form: use
:func:`gradalg.methods.magic`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from ..api import Operator, Scores, fisher, grads, kfac, sum_scores
from ..expr.spectral import Spectral, UnrollDecay, UnrollResponse
from ..options import options, plain
from ..task import Task
from ..unroll.errors import UnsupportedOptimizerError, UnsupportedTrainingError
from ..unroll.optimizers import SGD
from ..unroll.run import TrainingRun
from .influence import check_kron_subsets, gauss_newton_objective
from .registry import method
from ..errors import OptionError

__all__ = ["source", "Segment", "segments_of_run", "CrossCheckpointScores"]

CURVATURES = ("ekfac", "kfac", "gauss_newton", "empirical")


@dataclass(frozen=True)
class Segment:
    """One segment of a run: the checkpoints whose gradients are averaged, its learning
    rate and number of steps, and the checkpoint its curvature is taken at (default the
    middle one of ``tasks``)."""

    tasks: tuple
    lr: float
    steps: int
    curvature_task: Task | None = None

    def __post_init__(self):
        if not self.tasks:
            raise UnsupportedTrainingError("a segment needs at least one checkpoint task")
        if not self.lr > 0 or not isinstance(self.steps, int) or self.steps < 1:
            raise UnsupportedTrainingError(f"a segment needs lr > 0 and steps ≥ 1, got lr={self.lr}, steps={self.steps}")

    @property
    def curvature_at(self) -> Task:
        """The checkpoint whose curvature stands for the segment: ``curvature_task`` when
        given, else the middle checkpoint of the segment."""
        return self.curvature_task if self.curvature_task is not None else self.tasks[len(self.tasks) // 2]


def segments_of_run(run: TrainingRun, n_segments: int, checkpoints_per_segment: int = 1,
                    task_fn: Callable | None = None) -> tuple[list[Segment], Task, float]:
    """Replay ``run`` (weights 1) and cut it into ``n_segments`` segments of (nearly)
    equal length, with ``checkpoints_per_segment`` checkpoints each at the midpoints of
    equal sub-intervals. Returns (segments, task of the final model, 1/N scale).

    The segment's learning rate is the mean of its steps' (divided by 1 − μ for SGD
    momentum μ); weight decay is read by :func:`source` from the optimizer.
    """
    opt = run.optimizer
    if not isinstance(opt, SGD):
        raise UnsupportedOptimizerError(
            f"SOURCE's closed form is derived for SGD; this run uses {opt.name} (its preconditioner is not "
            "modelled): use ga.methods.magic for exact metagradients through the run")
    T = run.n_steps
    n_segments, checkpoints_per_segment = plain(n_segments), plain(checkpoints_per_segment)   # np.int64 works
    if not isinstance(n_segments, int) or not 1 <= n_segments <= T:
        raise UnsupportedTrainingError(f"n_segments must be an int in [1, {T}] (the run's steps), got {n_segments!r}")
    if not isinstance(checkpoints_per_segment, int) or checkpoints_per_segment < 1:
        raise UnsupportedTrainingError(f"checkpoints_per_segment must be a positive int, got {checkpoints_per_segment!r}")
    task_fn = task_fn or _classification
    bounds = [round(j * T / n_segments) for j in range(n_segments + 1)]
    wanted = {}
    for a, b in zip(bounds[:-1], bounds[1:]):
        c = min(checkpoints_per_segment, b - a)
        wanted[(a, b)] = sorted({a + int((j + 0.5) * (b - a) / c) for j in range(c)})
    at = {t for ts in wanted.values() for t in ts}
    snapshots = {}
    params, state = run.initial_state()
    ones = run._weights(None)
    with torch.no_grad():
        for t in range(T):
            if t in at:
                snapshots[t] = {k: v.clone() for k, v in params.items()}
            params, state = run.step(params, state, ones[run.batches[t]], t)
    models = {t: task_fn(run.model_with(p)) for t, p in snapshots.items()}
    segments = []
    for (a, b), ts in wanted.items():
        lr = sum(opt.lr_at(t) for t in range(a, b)) / (b - a) / (1 - opt.momentum)
        segments.append(Segment(tuple(models[t] for t in ts), lr, b - a))
    sizes = [bt.numel() for bt in run.batches]
    scale = (sum(sizes) / len(sizes)) / run.n_train if run.reduction == "sum" else 1.0 / run.n_train
    return segments, task_fn(run.model_with(params)), scale


def _classification(model):
    from ..tasks import classification
    return classification(model)


def _curvature(task: Task, data, layers, curvature: str, seed: int, covariance_max_examples=None,
               lambda_max_examples=None) -> Operator:
    objective = "loss" if curvature == "empirical" else gauss_newton_objective(task)
    C = grads(task, data, layers, objective=objective, seed=seed)
    if curvature in ("kfac", "ekfac"):
        return kfac(C, eigen_correction=curvature == "ekfac", covariance_max_examples=covariance_max_examples,
                    lambda_max_examples=lambda_max_examples)
    return fisher(C)


@method('SOURCE: segment-wise approximate unrolling with (EK-)FAC per segment (Bae et al. 2024)')
def source(training, queries, *, train=None, final: Task | None = None, n_segments: int = 3,
           checkpoints_per_segment: int = 1, task_fn: Callable | None = None, layers=None,
           curvature: str = "ekfac", damping: float = 0.0, weight_decay: float | None = None,
           scale: float | None = None, seed: int = 0, covariance_max_examples: int | None = None,
           lambda_max_examples: int | None = None) -> "CrossCheckpointScores":
    """SOURCE scores (query, train) as one gradalg expression.

    training : a :class:`ga.unroll.TrainingRun` (SGD; replayed once to take
        ``n_segments × checkpoints_per_segment`` checkpoints, tasks built by ``task_fn``,
        default ``ga.tasks.classification``), or a sequence of :class:`Segment` (then
        ``train`` and ``final``, the task of the final model, are required).
    queries : query data (as for ``ga.grads``).
    curvature : per-segment H: "ekfac" (default), "kfac", "gauss_newton" (dense, exact
        Gauss-Newton), "empirical".
    damping, weight_decay : H_ℓ + (damping + wd)·I; wd defaults to the run's SGD
        weight decay (0 for segments given by hand).
    scale : multiplies every term (default 1/N; mean batch size / N for reduction="sum").
    covariance_max_examples / lambda_max_examples : "kfac" / "ekfac" only: each segment's
        statistics on the first m training examples (``ga.kfac``).
    """
    if curvature not in CURVATURES:
        raise OptionError(f"curvature must be one of {CURVATURES}, got {curvature!r}")
    check_kron_subsets(curvature, covariance_max_examples, lambda_max_examples)
    if isinstance(training, TrainingRun):
        segments, final_task, default_scale = segments_of_run(training, n_segments, checkpoints_per_segment, task_fn)
        final = final if final is not None else final_task
        train = train if train is not None else torch.utils.data.TensorDataset(*_tensors(training.data))
        wd = training.optimizer.weight_decay if weight_decay is None else weight_decay
    else:
        segments = list(training)
        if not segments or not all(isinstance(s, Segment) for s in segments):
            raise UnsupportedTrainingError("training must be a ga.unroll.TrainingRun or a list of ga.methods.Segment")
        if train is None or final is None:
            raise UnsupportedTrainingError("with segments given by hand, pass train= (the training data) and "
                                           "final= (the task of the run's final model)")
        default_scale, wd = 1.0, (0.0 if weight_decay is None else weight_decay)
    scale = default_scale if scale is None else float(scale)
    # the two sides of each term live at different checkpoints of one run: on purpose
    with options(check_models=False):
        Q = grads(final, queries, layers)
        H = [_curvature(s.curvature_at, train, layers, curvature, seed, covariance_max_examples,
                        lambda_max_examples).damp(damping + wd) for s in segments]
        decay = [Operator(Spectral(h.expr, UnrollDecay(s.lr, s.steps))) for h, s in zip(H, segments)]
        terms, weights = [], []
        for l, seg in enumerate(segments):
            response = Operator(Spectral(H[l].expr, UnrollResponse(seg.lr, seg.steps)))
            for task in seg.tasks:
                right = response @ grads(task, train, layers).T
                for later in decay[l + 1:]:
                    right = later @ right
                terms.append(Q @ right)
                weights.append(scale / len(seg.tasks))
        return CrossCheckpointScores(sum_scores(terms, weights).expr)


class CrossCheckpointScores(Scores):
    """Scores whose sides are gradients at different checkpoints of one run, on purpose:
    planned, displayed and computed with ``ga.options(check_models=False)`` (the
    different-models check guards against mixing unrelated models by mistake)."""


def _unchecked(name):
    method = getattr(Scores, name)

    def wrapped(self, *args, **kwargs):
        with options(check_models=False):
            return method(self, *args, **kwargs)
    wrapped.__name__, wrapped.__doc__ = name, method.__doc__
    return wrapped


def _keeps_class(name):
    method = getattr(Scores, name)

    def wrapped(self, *args):
        with options(check_models=False):
            out = method(self, *args)
        return CrossCheckpointScores(out.expr) if isinstance(out, Scores) else out
    wrapped.__name__, wrapped.__doc__ = name, method.__doc__
    return wrapped


for _name in ("compute", "explain", "cost", "__repr__", "_repr_html_", "_run", "diag"):
    setattr(CrossCheckpointScores, _name, _unchecked(_name))
for _name in ("__add__", "__sub__", "__mul__", "__rmul__", "__truediv__"):   # S + T, 2 * S stay unchecked
    setattr(CrossCheckpointScores, _name, _keeps_class(_name))


def _tensors(data) -> Sequence[torch.Tensor]:
    if isinstance(data, dict):
        raise UnsupportedTrainingError("SOURCE from a run with dict data: pass train= (a dataset ga.grads reads)")
    return tuple(data)
