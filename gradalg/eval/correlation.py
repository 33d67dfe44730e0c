"""How well scores predict retraining: LDS and leave-one-out correlation.

Linear datamodeling score (Park et al., "TRAK", ICML 2023). For query q and training
subsets S_1..S_M with measured targets y_{jq} (from :func:`gradalg.eval.retrain`):

    predicted_{jq} = sign · Σ_{i ∈ S_j} τ_{qi}          (additive prediction of subset j)
    LDS_q          = Spearman_j(predicted_{jq}, y_{jq})
    LDS            = mean_q LDS_q

Sign convention. gradalg scores are *positive for helpful examples*: removing a training
example with τ_qi > 0 raises the query's loss. So a subset full of high-score examples
predicts a *low* loss and a *high* margin:

    target="loss"    sign = −1   targets that helpful examples lower (loss, error, NLL)
    target="margin"  sign = +1   targets that helpful examples raise (margin, log p, accuracy)

Leave-one-out correlation compares τ_qi with the measured effect of removing i,
``effect_iq = y_q(without i) − y_q(all)``, which is +τ_qi-like for a loss and −τ_qi-like
for a margin; :func:`loo_correlation` applies the same ``target`` sign.

    >>> result = ga.eval.lds(scores, ground_truth, target="loss")
    >>> result
    LDS 0.873 (95% CI 0.851 to 0.893; 100 queries, 50 subsets, Spearman)
    >>> result.per_query            # xarray.DataArray, dim "query"

Both functions pair scores and ground truth by their ids (``query``, ``train``,
``removed`` coordinates), never by position where ids exist (:mod:`.align`).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, replace

from typing import TYPE_CHECKING

import numpy as np
import torch

from ..errors import DataError, IdMismatchError, OptionError, ShapeMismatchError
from . import arguments
from .align import aligned_pair, labels, locate

if TYPE_CHECKING:                 # xarray loads when a result is made (about 76 MB)
    import xarray as xr

__all__ = ["lds", "lds_bootstrap", "lds_resampled", "loo_correlation", "spearman", "pearson",
           "CorrelationResult", "RESAMPLE", "spearman_brown", "retest_correlation"]

_SIGN = {"loss": -1.0, "margin": 1.0}
RESAMPLE = ("queries", "subsets", "both")   # what an LDS bootstrap interval resamples
"""What an LDS bootstrap interval may resample: queries, retrained subsets, or both."""


@dataclass(frozen=True)
class CorrelationResult:
    """Per-query correlations, their mean over queries and a bootstrap interval.

    ``per_query`` (query,) may hold NaN where a query's values are constant; ``mean``
    and ``interval`` are over the finite values (``n_queries`` of them).
    """

    name: str                               # "LDS" or "LOO"
    method: str                             # "spearman" or "pearson"
    per_query: xr.DataArray                 # (query,)
    mean: float
    interval: tuple[float, float] | None    # bootstrap interval of the mean, or None
    confidence: float
    n_queries: int                          # finite per-query values
    n_samples: int                          # subsets (LDS) or removed examples (LOO)
    resample: str = "queries"               # what the bootstrap resampled (RESAMPLE)
    ceiling: float | None = None            # LDS: the ground truth's ceiling (k ≥ 2 runs per subset)

    def __float__(self) -> float:
        return self.mean

    def __repr__(self) -> str:
        what = "subsets" if self.name == "LDS" else "removed examples"
        ci = ""
        if self.interval is not None:
            over = "" if self.resample == "queries" else f" over {self.resample if self.resample != 'both' else 'queries and subsets'}"
            ci = f"{self.confidence:.0%} CI{over} {self.interval[0]:.3f} to {self.interval[1]:.3f}; "
        dropped = self.per_query.size - self.n_queries
        extra = f", {dropped} constant queries left out" if dropped else ""
        ceiling = f"; ground-truth ceiling {self.ceiling:.2f}" if self.ceiling is not None else ""
        return (f"{self.name} {self.mean:.3f} ({ci}{self.n_queries} queries, {self.n_samples} {what}, "
                f"{self.method.capitalize()}{extra}{ceiling})")

    def _repr_html_(self) -> str:
        import html
        return f"<code>{html.escape(repr(self))}</code>"


# ----------------------------------------------------------------------- correlations
def spearman(x, y, axis: int = 0) -> np.ndarray:
    """Spearman rank correlation of ``x`` and ``y`` along ``axis`` (ties get average ranks).

    x, y: same shape; returns that shape without ``axis`` (a 0-d array for vectors).
    Equals ``scipy.stats.spearmanr`` column by column; NaN where either side is constant
    or holds a non-finite value. Two DataArrays are paired by dimension name and id
    (``y`` transposed and reordered to ``x``'s, ``axis`` counted in ``x``; other ids or
    repeated ids raise :class:`~gradalg.errors.IdMismatchError`); anything else by position.
    """
    x, y, lead = _pair(x, y, axis)
    bad = ~(np.isfinite(x).all(-1) & np.isfinite(y).all(-1))
    x, y = np.where(bad[:, None], 0.0, x), np.where(bad[:, None], 0.0, y)
    out = _pearson_rows(_rank_rows(x), _rank_rows(y))
    out[bad] = np.nan
    return out.reshape(lead)


def pearson(x, y, axis: int = 0) -> np.ndarray:
    """Pearson correlation of ``x`` and ``y`` along ``axis``; NaN where a side is constant.
    Two DataArrays are paired by dimension name and id, as in :func:`spearman`."""
    x, y, lead = _pair(x, y, axis)
    return _pearson_rows(x, y).reshape(lead)


def _pair(x, y, axis):
    x, y = aligned_pair(x, y)                 # two DataArrays: y in x's dims and ids
    x = np.moveaxis(_numpy(x), axis, -1)
    y = np.moveaxis(_numpy(y), axis, -1)
    if x.shape != y.shape:
        raise ShapeMismatchError(f"cannot correlate arrays of shapes {x.shape} and {y.shape}")
    lead = x.shape[:-1]
    return (x.reshape(-1, x.shape[-1]).astype(np.float64), y.reshape(-1, y.shape[-1]).astype(np.float64),
            lead)


def _rank_rows(x: np.ndarray) -> np.ndarray:
    """Average ranks (1..m) along the last axis of a (r, m) array."""
    r, m = x.shape
    order = np.argsort(x, axis=1, kind="stable")
    xs = np.take_along_axis(x, order, axis=1)
    pos = np.broadcast_to(np.arange(m), (r, m))
    starts = np.ones((r, m), dtype=bool)
    starts[:, 1:] = xs[:, 1:] != xs[:, :-1]
    ends = np.ones((r, m), dtype=bool)
    ends[:, :-1] = starts[:, 1:]
    first = np.maximum.accumulate(np.where(starts, pos, 0), axis=1)
    last = np.flip(np.minimum.accumulate(np.flip(np.where(ends, pos, m - 1), axis=1), axis=1), axis=1)
    ranks = np.empty((r, m))
    np.put_along_axis(ranks, order, (first + last) / 2.0 + 1.0, axis=1)
    return ranks


def _pearson_rows(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    x = x - x.mean(axis=1, keepdims=True)
    y = y - y.mean(axis=1, keepdims=True)
    den = np.sqrt((x * x).sum(1) * (y * y).sum(1))
    with np.errstate(invalid="ignore", divide="ignore"):
        out = (x * y).sum(1) / den
    out[~(den > 0)] = np.nan
    return np.clip(out, -1.0, 1.0)


# -------------------------------------------------------------------------------- LDS
def spearman_brown(rho_1, runs: int):
    """ρ_k = k ρ_1 / (1 + (k − 1) ρ_1): the reliability of a mean of ``runs`` measurements
    whose single-run reliability is ``rho_1`` (array or float) in [0, 1]. A negative
    estimate of ρ_1 (no repeatable signal, up to sampling noise) has no meaning here and
    is refused; clip it at 0 first, as :func:`mean_ceiling` does."""
    if isinstance(runs, bool) or not isinstance(runs, (int, np.integer)) or runs < 1:
        raise OptionError(f"runs must be a positive integer, got {runs!r}")
    rho_1 = np.asarray(rho_1, dtype=np.float64)
    if np.any(rho_1[np.isfinite(rho_1)] < 0) or np.any(rho_1[np.isfinite(rho_1)] > 1):
        raise OptionError("spearman_brown needs single-run reliabilities in [0, 1] (clip a negative estimate "
                         f"at 0 first); got values in [{np.nanmin(rho_1):.3g}, {np.nanmax(rho_1):.3g}]")
    return runs * rho_1 / (1.0 + (runs - 1) * rho_1)


def retest_correlation(runs) -> np.ndarray:
    """ρ₁ per query: the Spearman correlation over subsets between two training runs of the
    same subsets, averaged over every pair of runs. ``runs``: (subset, run, query) with
    run ≥ 2; returns (n_query,), NaN where a run's targets are constant."""
    runs = _numpy(runs).astype(np.float64)
    if runs.ndim != 3 or runs.shape[1] < 2:
        raise ShapeMismatchError(f"retest_correlation needs runs (subset, run ≥ 2, query), got shape {runs.shape}")
    k = runs.shape[1]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        pairs = np.stack([spearman(runs[:, a], runs[:, b], axis=0)
                          for a in range(k) for b in range(a + 1, k)])          # (pairs, n_query)
        return np.nanmean(pairs, axis=0)


def _ceiling(ground_truth, actual, subsets=None, queries=None) -> float | None:
    """√ρ_k (ρ₁ clipped at 0) averaged over queries when ``ground_truth`` holds k ≥ 2 runs per subset
    whose mean is its ``targets`` (else None): the LDS ceiling :func:`lds` reports. ``actual``
    (M, n_query) is in the order of the ids ``subsets`` and ``queries`` (None: by position);
    labelled runs are put in that order first."""
    try:
        runs, ids = labelled_array(ground_truth, "runs", ("subset", "run", "query"))
    except (KeyError, TypeError):
        return None
    if runs.ndim != 3:
        return None
    try:
        for axis, (dim, ref) in enumerate((("subset", subsets), ("query", queries))):
            if ref is not None and ids[dim] is not None:
                runs = np.take(runs, locate(ref, ids[dim], dim=dim, wanted_name="targets",
                                            available_name="runs", fix=""), axis=2 * axis)
    except ShapeMismatchError:           # runs of other subsets or queries: no ceiling claimed
        return None
    if runs.shape[1] < 2 or runs.shape[0] < 3 or runs.shape[::2] != actual.shape \
            or not np.allclose(runs.mean(axis=1), actual, rtol=1e-12, atol=1e-12, equal_nan=True):
        return None
    value = mean_ceiling(retest_correlation(runs), runs.shape[1])
    return value if np.isfinite(value) else None


def mean_ceiling(rho_1, runs: int) -> float:
    """The LDS ceiling of a ground truth averaging ``runs`` runs per subset: the mean over
    queries of √ρ_runs, ρ_runs = :func:`spearman_brown` of the per-query single-run
    reliabilities ``rho_1`` clipped to [0, 1] (a negative estimate: no repeatable signal,
    ceiling 0 for that query; NaN entries left out; NaN if none is finite)."""
    rho_1 = np.asarray(rho_1, dtype=np.float64)
    rho_1 = np.clip(rho_1[np.isfinite(rho_1)], 0.0, 1.0)
    return float(np.sqrt(spearman_brown(rho_1, runs)).mean()) if rho_1.size else float("nan")


def lds(scores, ground_truth, *, target: str | None = None, bootstrap: int = 1000, confidence: float = 0.95,
        seed: int = 0, resample: str = "queries") -> CorrelationResult:
    """Linear datamodeling score of ``scores`` against retrained ``ground_truth``.

    Parameters
    ----------
    scores : (n_query, n_train) DataArray from ``Scores.compute()``, a lazy
        :class:`~gradalg.api.Scores` (computed here), or an array.
    ground_truth : the Dataset of :func:`gradalg.eval.retrain`: ``masks`` (subset, train)
        and ``targets`` (subset, query) (any mapping with those two arrays).

    Pairing. Scores and ground truth are paired **by id** where both carry ids (a
    DataArray's ``query`` and ``train`` coordinates; ``retrain`` labels the training
    examples 0..n_train-1, the positions ``train_fn`` indexes, unless given
    ``train_ids=``, and the queries 0..n_query-1 unless given ``query_ids=``): ids in
    another order are aligned, giving the number of the aligned input. Scores of other
    queries or training examples, of a subset or a superset of the ground truth's, or
    with a repeated id, raise :class:`~gradalg.errors.IdMismatchError` naming the ids
    and how to subset explicitly (``scores.sel(query=ground_truth["query"])``): LDS over
    the intersection would silently change the protocol. A side without ids (NumPy,
    torch) is paired by position, and only when the shapes agree. ``per_query`` follows
    the ground truth's query order.
    target : "loss" (helpful examples lower the target: predicted = −Σ_{i∈S} τ_qi) or
        "margin" (they raise it: predicted = +Σ_{i∈S} τ_qi). Default: the ``target``
        recorded by ``retrain(..., target=...)``; one of the two is required.
    bootstrap : resamples for the confidence interval of the mean (0: no interval).
    confidence : level of the interval.
    seed : seed of the bootstrap.
    resample : what the interval resamples: "queries" (default; the per-query values
        with replacement, :func:`lds_bootstrap`: the uncertainty from which queries were
        asked), "subsets" (the retrained subsets with replacement, every query's Spearman
        recomputed: the uncertainty from the finite ground truth) or "both"
        (independently, per resample: the wider, honest interval when both are small);
        see :func:`lds_resampled`.

    Returns
    -------
    CorrelationResult: ``per_query`` (DataArray, dim "query"), ``mean``, ``interval``, and
    ``ceiling`` when the ground truth holds k ≥ 2 training runs per subset whose mean is its
    ``targets`` (``retrain(..., seeds_per_subset=k)``): the highest LDS those targets allow,
    √ρ_k averaged over queries (:func:`gradalg.eval.reliability`); None otherwise.
    """
    sign = _sign(target, ground_truth)
    bootstrap, confidence, seed = _bootstrap_args(bootstrap, confidence, seed)
    masks, mask_ids = labelled_array(ground_truth, "masks", ("subset", "train"))       # (M, n_train)
    actual, target_ids = labelled_array(ground_truth, "targets", ("subset", "query"))  # (M, n_query)
    tau, score_ids = _scores(scores)                                  # (n_query, n_train)
    if masks.ndim != 2 or actual.ndim != 2 or masks.shape[0] != actual.shape[0]:
        raise ShapeMismatchError(f"ground truth needs masks (M, n_train) and targets (M, n_query), got "
                                 f"{masks.shape} and {actual.shape}")
    if mask_ids["subset"] is not None and target_ids["subset"] is not None:
        actual = actual[locate(mask_ids["subset"], target_ids["subset"], dim="subset",
                               wanted_name="the ground truth's masks", available_name="its targets",
                               fix="take masks and targets from one retraining (the Dataset of ga.eval.retrain)")]
    tau, query = _aligned_scores(tau, score_ids, {"query": target_ids["query"], "train": mask_ids["train"]},
                                 "ground_truth", _lds_fix)
    if tau.shape != (actual.shape[1], masks.shape[1]):                # paired by position: sizes must agree
        raise ShapeMismatchError(f"scores are {tau.shape} (query, train) but the ground truth has "
                                 f"{actual.shape[1]} queries and {masks.shape[1]} training examples")
    if masks.shape[0] < 3:
        raise DataError(f"LDS needs at least 3 subsets, got {masks.shape[0]}")
    if resample not in RESAMPLE:
        raise OptionError(f"resample must be one of {RESAMPLE}, got {resample!r}")
    predicted = sign * (masks @ tau.T)                                # (M, n_query)
    per_query = spearman(predicted, actual, axis=0)
    query = query if query is not None else np.arange(actual.shape[1])
    result = _result("LDS", "spearman", per_query, query, masks.shape[0],
                     bootstrap if resample == "queries" else 0, confidence, seed)
    subsets = mask_ids["subset"] if mask_ids["subset"] is not None else target_ids["subset"]
    result = replace(result, ceiling=_ceiling(ground_truth, actual, subsets, target_ids["query"]))
    if resample == "queries" or not bootstrap:
        return result
    interval = lds_resampled(predicted, actual, over=resample, n_resamples=bootstrap, confidence=confidence,
                             seed=seed)
    return replace(result, interval=interval, resample=resample)


def lds_resampled(predicted, actual, *, over: str = "both", n_resamples: int = 1000, confidence: float = 0.95,
                  seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of the LDS, resampling subsets and/or queries.

    predicted, actual : (M, n_query) the additive predictions sign·Σ_{i∈S_j} τ_qi and the
        retrained targets (rows: subsets); two DataArrays are paired by dimension name and
        id (as in :func:`spearman`), anything else by position.
    over : "subsets", "queries" or "both".

    Resample b draws, from ``numpy.random.default_rng(seed)``, first (for "subsets" and
    "both") the rows ``J_b = rng.integers(0, M, M)`` for all b at once, shape
    (n_resamples, M), then (for "queries" and "both") the columns
    ``K_b = rng.integers(0, n_query, n_query)``, shape (n_resamples, n_query), and
    computes

        LDS_b = nanmean_{q ∈ K_b} Spearman_{j ∈ J_b}(predicted_jq, actual_jq)

    (a subset drawn twice is two tied observations; a query whose resampled values are
    constant is left out of that mean). The interval is the (1 ± confidence)/2 quantiles
    of the LDS_b. With ``over="queries"`` this is :func:`lds_bootstrap` of the
    per-query values except that NaN queries are kept in the draw (and left out of the
    mean).
    """
    if over not in RESAMPLE:
        raise OptionError(f"over must be one of {RESAMPLE}, got {over!r}")
    n_resamples, confidence, seed = _bootstrap_args(n_resamples, confidence, seed, "n_resamples", 1)
    predicted, actual = aligned_pair(predicted, actual, "predicted and actual")   # two DataArrays: by id
    predicted = _numpy(predicted).astype(np.float64)
    actual = _numpy(actual).astype(np.float64)
    if predicted.shape != actual.shape or predicted.ndim != 2:
        raise ShapeMismatchError(f"predicted and actual must both be (M, n_query), got {predicted.shape} "
                                 f"and {actual.shape}")
    m, n_query = predicted.shape
    rng = np.random.default_rng(seed)
    rows = rng.integers(0, m, size=(n_resamples, m)) if over != "queries" else None
    cols = rng.integers(0, n_query, size=(n_resamples, n_query)) if over != "subsets" else None
    means = np.empty(n_resamples)
    chunk = max(1, 2**22 // max(1, m * n_query))                        # bound (chunk, M, n_query) memory
    base = spearman(predicted, actual, axis=0) if rows is None else None  # (n_query,)
    for start in range(0, n_resamples, chunk):
        stop = min(start + chunk, n_resamples)
        if rows is None:
            per_query = np.broadcast_to(base, (stop - start, n_query))
        else:
            per_query = spearman(predicted[rows[start:stop]], actual[rows[start:stop]], axis=1)  # (b, n_query)
        if cols is not None:
            per_query = np.take_along_axis(per_query, cols[start:stop], axis=1)
        with np.errstate(invalid="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            means[start:stop] = np.nanmean(per_query, axis=1)
    means = means[np.isfinite(means)]
    if means.size == 0:
        return (float("nan"), float("nan"))
    tail = (1 - confidence) / 2
    low, high = np.quantile(means, [tail, 1 - tail])
    return (float(low), float(high))


def lds_bootstrap(per_query, *, n_resamples: int = 1000, confidence: float = 0.95,
                  seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean over queries.

    ``per_query``: (n_query,) values (a :class:`CorrelationResult` or its ``per_query``);
    NaN entries are left out. Queries are resampled with replacement ``n_resamples``
    times; the interval is the (1 ± confidence)/2 quantiles of the resampled means.
    """
    if isinstance(per_query, CorrelationResult):
        per_query = per_query.per_query
    n_resamples, confidence, seed = _bootstrap_args(n_resamples, confidence, seed, "n_resamples", 1)
    values = _numpy(per_query).astype(np.float64).reshape(-1)
    values = values[np.isfinite(values)]
    if values.size == 0:
        return (float("nan"), float("nan"))
    rng = np.random.default_rng(seed)
    means = values[rng.integers(0, values.size, size=(n_resamples, values.size))].mean(axis=1)
    tail = (1 - confidence) / 2
    low, high = np.quantile(means, [tail, 1 - tail])
    return (float(low), float(high))


# -------------------------------------------------------------------------------- LOO
def loo_correlation(scores, loo, *, target: str | None = None, method: str = "pearson", bootstrap: int = 1000,
                    confidence: float = 0.95, seed: int = 0) -> CorrelationResult:
    """Per query, the correlation across removed examples of τ_qi and the LOO effect.

    Pairing: the queries by id as in :func:`lds`; each removed example's score column by
    its id (the ``removed`` coordinate) among the scores' ``train`` ids (scores without
    ids: ``removed`` holds column positions). Missing or repeated ids raise
    :class:`~gradalg.errors.IdMismatchError` with the fix.

    ``loo`` is the Dataset of :func:`gradalg.eval.leave_one_out` (``effect`` (removed,
    query), coordinate ``removed``). The prediction is ``−sign · τ_qi`` (the loss rises by
    τ when a helpful example goes: ``target="loss"`` correlates τ with the effect,
    ``target="margin"`` correlates −τ with it). ``method``: "pearson" or "spearman".
    """
    if method not in ("pearson", "spearman"):
        raise OptionError(f"method must be 'pearson' or 'spearman', got {method!r}")
    sign = _sign(target, loo)
    bootstrap, confidence, seed = _bootstrap_args(bootstrap, confidence, seed)
    effect, effect_ids = labelled_array(loo, "effect", ("removed", "query"))         # (n_removed, n_query)
    tau, score_ids = _scores(scores)                                  # (n_query, n_train)
    if effect.ndim != 2:
        raise ShapeMismatchError(f"the LOO effect must be (removed, query), got shape {effect.shape}")
    removed = effect_ids["removed"] if effect_ids["removed"] is not None else _coord(loo, "removed")
    if removed is None:
        raise DataError("the LOO effect needs the ids of the removed examples: the Dataset of "
                        "ga.eval.leave_one_out (coordinate 'removed')")
    tau, query = _aligned_scores(tau, score_ids, {"query": effect_ids["query"], "train": None}, "loo",
                                 _loo_fix, check_train=False)
    if tau.shape[0] != effect.shape[1]:
        raise ShapeMismatchError(f"scores have {tau.shape[0]} queries, the LOO effect {effect.shape[1]}")
    if len(removed) != effect.shape[0]:
        raise ShapeMismatchError(f"the LOO effect has {effect.shape[0]} rows for {len(removed)} removed examples")
    if score_ids["train"] is not None:                               # removed examples by id
        columns = locate(removed, score_ids["train"], dim="train", wanted_name="the removed examples",
                         available_name="the scores",
                         fix=lambda m, e, r: _loo_fix("train", "loo", m, e, r), allow_extra=True)
    else:                                                             # by position
        columns = _positions(removed, tau.shape[1])
    predicted = -sign * tau[:, columns].T                             # (n_removed, n_query)
    per_query = (spearman if method == "spearman" else pearson)(predicted, effect, axis=0)
    query = query if query is not None else np.arange(effect.shape[1])
    return _result("LOO", method, per_query, query, len(removed), bootstrap, confidence, seed)


# ----------------------------------------------------------------------------- helpers
def _bootstrap_args(n, confidence, seed, name: str = "bootstrap", minimum: int = 0):
    """(resamples, confidence level, seed) checked: an int ≥ ``minimum``, a level in
    (0, 1), an int or None (Python or NumPy numbers)."""
    return (arguments.count(name, n, minimum), arguments.level("confidence", confidence),
            None if seed is None else arguments.integer("seed", seed))


def _sign(target, data) -> float:
    if target is None:
        attrs = getattr(data, "attrs", {}) or {}
        target = attrs.get("target")
        if target is None:
            raise OptionError("say what the targets are: target='loss' (helpful examples lower it) or "
                             "target='margin' (they raise it); or record it with retrain(..., target=...)")
    if not isinstance(target, str) or target not in _SIGN:
        raise OptionError(f"target must be 'loss' or 'margin', got {target!r}")
    return _SIGN[target]


def _scores(scores):
    """(values (n_query, n_train) float64, {"query": ids or None, "train": ids or None})."""
    import xarray as xr
    if not isinstance(scores, (xr.DataArray, np.ndarray, torch.Tensor)) and hasattr(scores, "compute"):
        scores = scores.compute()                                     # lazy ga.Scores
    if isinstance(scores, xr.DataArray):
        if scores.dims != ("query", "train"):
            if set(scores.dims) == {"query", "train"}:
                scores = scores.transpose("query", "train")
            else:
                raise ShapeMismatchError(f"scores need dims ('query', 'train'), got {scores.dims}")
        return (np.asarray(scores.values, dtype=np.float64),
                {"query": labels(scores, "query"), "train": labels(scores, "train")})
    values = _numpy(scores).astype(np.float64)
    if values.ndim != 2:
        raise ShapeMismatchError(f"scores must be (n_query, n_train), got shape {values.shape}")
    return values, {"query": None, "train": None}


def _aligned_scores(tau, score_ids: dict, reference: dict, name: str, fix, check_train: bool = True):
    """``tau`` (n_query, n_train) with its rows (and, with ``check_train``, columns) in the
    order of the ``reference`` ids of ``name`` (the ground truth); where either side has
    no ids, by position (equal lengths required). Returns (tau, query labels or None)."""
    for axis, dim in enumerate(("query", "train")):
        if dim == "train" and not check_train:
            continue
        ref, own = reference[dim], score_ids[dim]
        if ref is not None and own is not None:
            tau = np.take(tau, locate(ref, own, dim=dim, wanted_name=name, available_name="the scores",
                                      fix=lambda m, e, r, dim=dim: fix(dim, name, m, e, r)), axis=axis)
        elif ref is not None and len(ref) != tau.shape[axis]:
            raise ShapeMismatchError(f"scores are {tau.shape} (query, train) and carry no {dim} ids, so they are "
                                     f"paired with the {len(ref)} {dim} ids of {name} by position: the lengths "
                                     "must agree")
    query = reference["query"] if reference["query"] is not None else score_ids["query"]
    return tau, query


def _repeated_fix(dim: str) -> str:
    if dim == "query":
        return "Each query id must occur once on each side: drop the repeated queries, or label them apart"
    return (f"Each {dim} id must occur once on each side: drop the repeats, or combine rows seen in several "
            "epochs first (ga.integrations.combine_repeats)")


def _lds_fix(dim: str, name: str, missing: list, extra: list, repeated: list) -> str:
    """What to do when the scores' ``dim`` ids are not the ground truth's (:func:`lds`)."""
    if repeated:
        return _repeated_fix(dim)
    if dim == "query":
        if not extra:
            return ("Score every query of the ground truth, or compare on the scored queries explicitly: "
                    f"ga.eval.lds(scores, {name}.sel(query=scores['query']))")
        if not missing:
            return f"Select the ground truth's queries explicitly: ga.eval.lds(scores.sel(query={name}['query']), {name})"
        return ("These are scores of other queries than the ground truth's. If they are the same queries under "
                "other labels, in the order targets_fn returns them, label the ground truth with the scores' ids: "
                f"{name}.assign_coords(query=scores['query'].values) (or ga.eval.retrain(..., query_ids=...)); "
                "or select the queries both hold on both sides with .sel(query=...)")
    if not missing:
        return ("The scores hold training examples the retrained subsets never drew from; select the ground "
                f"truth's explicitly: ga.eval.lds(scores.sel(train={name}['train']), {name})")
    if not extra:
        return ("The retrained models saw training examples that have no score column: score the whole training "
                "set train_fn indexes (LDS on fewer examples is another protocol)")
    return ("ga.eval.retrain labels the training examples 0..n_train-1, the positions train_fn indexes, unless "
            "given train_ids=. If the scores' train axis is in that order, label the ground truth with the scores' "
            f"ids: {name}.assign_coords(train=scores['train'].values) (or ga.eval.retrain(..., train_ids=...))")


def _loo_fix(dim: str, name: str = "loo", missing=(), extra=(), repeated=()) -> str:
    """What to do when the scores' ids are not the LOO effect's (:func:`loo_correlation`)."""
    if dim != "train":
        return _lds_fix(dim, name, missing, extra, repeated).replace("ga.eval.lds", "ga.eval.loo_correlation") \
            .replace("ga.eval.retrain", "ga.eval.leave_one_out")
    if repeated:
        return _repeated_fix(dim)
    return ("ga.eval.leave_one_out labels each removed example by its position in the training set (0..n_train-1) "
            "unless given train_ids=. If the scores' train axis is in that order, label the removed examples with "
            f"the scores' ids: {name}.assign_coords(removed=scores['train'].values[{name}['removed'].values]) "
            "(or ga.eval.leave_one_out(..., train_ids=...)); otherwise score the removed examples")


def _positions(removed, n_train: int) -> np.ndarray:
    """Removed examples as column positions of scores without ids (ints in [0, n_train))."""
    values = np.asarray(removed)
    if values.dtype.kind not in "iu":
        raise ShapeMismatchError(f"the scores carry no train ids, so the removed examples {values[:5].tolist()} "
                                 "must be column positions (ints); pass the scores as a DataArray with a train "
                                 "coordinate to pair them by id")
    values = values.astype(np.int64)
    if values.size and (values.min() < 0 or values.max() >= n_train):
        raise ShapeMismatchError(f"removed example {values.max() if values.max() >= n_train else values.min()} "
                                 f"is outside the {n_train} scored ones")
    if np.unique(values).size != values.size:
        raise IdMismatchError(f"the removed examples repeat: {values.tolist()[:8]}. {_repeated_fix('removed')}",
                              "removed", repeated=[int(v) for v in values if (values == v).sum() > 1])
    return values


def _numpy(x) -> np.ndarray:
    import xarray as xr
    if isinstance(x, torch.Tensor):
        x = x.detach().to("cpu")
        return (x.double() if x.is_floating_point() else x).numpy()
    if isinstance(x, xr.DataArray):
        return np.asarray(x.values)
    return np.asarray(x)


def labelled_array(data, name: str, dims: tuple[str, ...]) -> tuple[np.ndarray, dict]:
    """``data[name]`` as a float64 array with axes in the order ``dims``, and its ids per
    dimension ({dim: list or None}). An xarray variable with exactly those dimensions in
    another order (``gt.transpose(...)``) is put back in order by name, so its axes are
    never misread by position; a variable without dimension names has no ids."""
    import xarray as xr
    try:
        value = data[name]
    except (KeyError, IndexError, TypeError) as err:
        raise DataError(f"the ground truth has no {name!r} ({name} {dims}): pass the Dataset "
                        "ga.eval.retrain / ga.eval.leave_one_out returned, or a mapping with that array") from err
    named = isinstance(value, xr.DataArray) and set(value.dims) == set(dims) and len(value.dims) == len(dims)
    if named and value.dims != dims:
        value = value.transpose(*dims)
    ids = {d: labels(value, d) if named else None for d in dims}
    return _numpy(value).astype(np.float64), ids


def ground_truth_array(ground_truth, name: str, dims: tuple[str, ...]) -> np.ndarray:
    """``ground_truth[name]`` as a float64 array with axes in the order ``dims`` (by name
    for an xarray variable with those dimensions, see :func:`labelled_array`)."""
    return labelled_array(ground_truth, name, dims)[0]


def _coord(data, name):
    """``data[name]`` as a list (a coordinate of a Dataset, a key of a mapping), or None."""
    try:
        value = data[name]
    except (KeyError, IndexError, TypeError):
        return None
    return np.asarray(getattr(value, "values", value)).reshape(-1).tolist()


def _result(name, method, per_query, query, n_samples, bootstrap, confidence, seed) -> CorrelationResult:
    import xarray as xr
    finite = per_query[np.isfinite(per_query)]
    mean = float(finite.mean()) if finite.size else float("nan")
    interval = lds_bootstrap(per_query, n_resamples=bootstrap, confidence=confidence, seed=seed) if bootstrap else None
    return CorrelationResult(
        name=name, method=method,
        per_query=xr.DataArray(per_query, dims=("query",), coords={"query": query}, name=name.lower()),
        mean=mean, interval=interval, confidence=confidence, n_queries=int(finite.size), n_samples=int(n_samples),
    )
