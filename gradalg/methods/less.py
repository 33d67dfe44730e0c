"""LESS (Xia et al., "LESS: Selecting influential data for targeted instruction
tuning", ICML 2024):

    Γ(z; θ_c) = Adam's update direction for z alone at checkpoint c: m/(√v + ε)
    S_tz = Σ_c η_c cos(P ∇L(v̄_t; θ_c), P Γ(z; θ_c))
    select z by max_t S_tz

where v̄_t averages the (normalized, projected) gradients of target task t's
validation examples, P is a random projection shared by all checkpoints, and η_c the
learning rate at checkpoint c. The returned scores have one row per target task; the
selection score of a training example is ``scores.max("query")``.
"""
from __future__ import annotations

from typing import Sequence

from ..api import Scores, adam_state, grads, sum_scores
from ..expr.projection import Projector, rademacher
from ..task import Task


def less(checkpoints: Sequence[Task], optimizers: Sequence, learning_rates: Sequence[float], train, targets,
         target_groups, *, layers=None, k: int = 8192, seed: int = 0,
         projector: Projector | None = None) -> Scores:
    """LESS scores (n_target_tasks, n_train).

    checkpoints : one Task per checkpoint; optimizers : the Adam/AdamW optimizer state
        at each checkpoint (``torch.optim`` objects over that checkpoint's model).
    targets : the validation examples of all target tasks; target_groups : the task
        label of each of them (rows of the result).
    """
    if not (len(checkpoints) == len(optimizers) == len(learning_rates)):
        raise ValueError("give one optimizer and one learning rate per checkpoint")
    P = projector or rademacher(k, seed)
    terms = []
    for task, opt in zip(checkpoints, optimizers):
        G = grads(task, train, layers)
        train_side = P(G.adam(adam_state(opt, G))).normalize()
        val_side = P(grads(task, targets, layers)).normalize().group_mean(target_groups)
        terms.append(val_side @ train_side.T)
    return sum_scores(terms, learning_rates)
