"""Ensembles of any method over models, seeds or checkpoints, as one expression:

    S = (1/M) Σ_m S_m         S_m = method(task_m, train, queries)          (M, weights w_m:
    S = Σ_m w_m S_m / Σ_m w_m                                                a weighted mean)

TRAK-M (Park et al. 2023) averages TRAK over M independently trained models; influence
ensembles (EK-FAC or Gauss-Newton influence on M models) reduce the variance of a single
model's scores over training randomness (Bae et al. 2022; Park et al. 2023, §5). Each member
is built with its own task (its model), its own curvature and its own gradients; the sum is
one lazy :class:`~gradalg.api.Scores`, so one plan covers every member: the planner streams
each distinct (task, data) once for all the jobs that read it (members over the same model —
other dampings, other curvatures — share their passes; the training gradients of one model
are captured once for its curvature and its scores).
"""
from __future__ import annotations

from typing import Callable, Sequence

from ..api import Scores, mean_scores
from ..task import Task
from ..errors import OptionError


def ensemble(method: Callable[..., Scores], tasks: Sequence[Task], train, queries, *,
             weights: Sequence[float] | None = None, per_member: Sequence[dict] | None = None,
             **kwargs) -> Scores:
    """``ga.mean([method(task_m, train, queries, **kwargs) for task_m in tasks], weights=weights)``.

    method : any ``ga.methods`` function called as ``method(task, train, queries, ...)``
        (influence, trak, logra, grass, grad_dot, trackstar, ...).
    tasks : one Task per member (same architecture: other seeds, other checkpoints).
    weights : optional non-negative member weights (a weighted mean).
    per_member : optional kwargs per member, merged over ``kwargs`` (e.g. each checkpoint's
        own ``optimizer=`` for influence or TrackStar).
    """
    tasks = [tasks] if isinstance(tasks, Task) else list(tasks)
    if not tasks:
        raise OptionError("an ensemble needs at least one task")
    if per_member is not None and len(per_member) != len(tasks):
        raise OptionError(f"got {len(per_member)} per-member settings for {len(tasks)} tasks")
    members = [method(task, train, queries, **{**kwargs, **(per_member[m] if per_member else {})})
               for m, task in enumerate(tasks)]
    return mean_scores(members, weights=weights)
