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
from ..expr.projection import Projector, dense_or_sparse, check_projector
from ..task import Task
from .registry import method
from ..errors import OptionError


@method('LESS: Adam-preconditioned, normalized, projected gradients; max over targets (Xia et al. 2024)')
def less(checkpoints: Sequence[Task], optimizers: Sequence, learning_rates: Sequence[float], train, targets,
         target_groups, *, layers=None, k: int = 8192, seed: int = 0,
         projector: Projector | None = None) -> Scores:
    """LESS scores (n_target_tasks, n_train).

    checkpoints : one Task per checkpoint; optimizers : the Adam/AdamW optimizer state
        at each checkpoint (``torch.optim`` objects over that checkpoint's model).
    targets : the validation examples of all target tasks; target_groups : the task
        label of each of them (rows of the result).
    k, seed : the projection's size (8192, the paper's) and seed.
    projector : default the paper's dense Rademacher (±1/√k) while its (k, d) float64
        matrix fits ``ga.options(dense_projection_bytes)`` (1 GiB: d ≤ 16,384 at k = 8192),
        else a sparse JL transform (SJLT) with the same k and seed
        (:func:`~gradalg.expr.projection.dense_or_sparse`): at GPT-2 small's 85 M block
        coordinates a dense map would be a 5.6 TB matrix and 7·10¹¹ multiply-adds per
        example. Nothing is formed for the whole model: each block's rows are
        materialized from its factors, Adam-preconditioned and projected by the block's
        own seeded table, then dropped, and the blocks' projections summed into k
        coordinates (``exec/rowwise.py``: ``project_blockwise``). The plan's "projection
        map" decision shows the choice and the option.
    """
    if not (len(checkpoints) == len(optimizers) == len(learning_rates)):
        raise OptionError("give one optimizer and one learning rate per checkpoint")
    dim = grads(checkpoints[0], train, layers).space.dim
    P = check_projector(projector) or dense_or_sparse("rademacher", k, dim, seed, factored=False)     # Adam's rows are flat
    terms = []
    for task, opt in zip(checkpoints, optimizers):
        G = grads(task, train, layers)
        train_side = P(G.adam(adam_state(opt, G))).normalize()
        val_side = P(grads(task, targets, layers)).normalize().group_mean(target_groups)
        terms.append(val_side @ train_side.T)
    return sum_scores(terms, learning_rates)
