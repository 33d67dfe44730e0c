"""Evaluating attribution against retraining: the ground truth and the scores on it.

    gt = ga.eval.retrain(train_fn, n_train, n_subsets=50, fraction=0.5,
                         targets_fn=query_losses, store="cache/lds")   # resumable
    ga.eval.lds(scores, gt, target="loss")         # LDS 0.87 (95% CI ...)
    ga.eval.lds(scores, gt, target="loss", resample="both")   # interval over queries and subsets
    loo = ga.eval.leave_one_out(train_fn, n_train, [3, 17, 42], query_losses)
    ga.eval.loo_correlation(scores, loo, target="loss")
    gt2 = ga.eval.retrain(..., seeds_per_subset=2, store="cache/lds")   # trains only the new runs
    ga.eval.reliability(gt2)                       # test–retest 0.51; LDS ceiling 0.79 ...
    ga.eval.lds(scores, ga.eval.select_runs(gt2, 1))   # against the first run alone

``retrain`` / ``leave_one_out`` (:mod:`.retraining`) call the user's
``train_fn(indices) -> model`` and ``targets_fn(model) -> (n_query,)``; ``lds`` and
``loo_correlation`` (:mod:`.correlation`) compare scores with what they measured;
``reliability`` (:mod:`.retest`) measures how repeatable the retrained targets are
and so the highest LDS they allow.
"""
from .correlation import (RESAMPLE, CorrelationResult, lds, lds_bootstrap, lds_resampled, loo_correlation, pearson,
                          spearman, spearman_brown, retest_correlation)
from .retest import Reliability, reliability
from .retraining import leave_one_out, retrain, select_runs, subset_masks, subset_size

__all__ = ["retrain", "select_runs", "leave_one_out", "subset_masks", "subset_size", "lds", "lds_bootstrap", "lds_resampled", "RESAMPLE",
           "loo_correlation", "spearman", "pearson", "CorrelationResult", "reliability", "Reliability",
           "spearman_brown", "retest_correlation"]
