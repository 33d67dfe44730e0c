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
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, replace

from typing import TYPE_CHECKING

import numpy as np
import torch

from ..errors import ShapeMismatchError, OptionError

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
    or holds a non-finite value.
    """
    x, y, lead = _pair(x, y, axis)
    bad = ~(np.isfinite(x).all(-1) & np.isfinite(y).all(-1))
    x, y = np.where(bad[:, None], 0.0, x), np.where(bad[:, None], 0.0, y)
    out = _pearson_rows(_rank_rows(x), _rank_rows(y))
    out[bad] = np.nan
    return out.reshape(lead)


def pearson(x, y, axis: int = 0) -> np.ndarray:
    """Pearson correlation of ``x`` and ``y`` along ``axis``; NaN where a side is constant."""
    x, y, lead = _pair(x, y, axis)
    return _pearson_rows(x, y).reshape(lead)


def _pair(x, y, axis):
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


def _ceiling(ground_truth, actual) -> float | None:
    """√ρ_k (ρ₁ clipped at 0) averaged over queries when ``ground_truth`` holds k ≥ 2 runs per subset
    whose mean is its ``targets`` (else None): the LDS ceiling :func:`lds` reports."""
    try:
        runs = ground_truth_array(ground_truth, "runs", ("subset", "run", "query"))
    except (KeyError, TypeError):
        return None
    if runs.ndim != 3 or runs.shape[1] < 2 or runs.shape[0] < 3 or runs.shape[::2] != actual.shape \
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
        :class:`~gradalg.api.Scores` (computed here), or an array. Its train axis is in
        the order of the training examples ``train_fn`` indexes; its queries in the order
        of ``targets_fn``'s values.
    ground_truth : the Dataset of :func:`gradalg.eval.retrain`: ``masks`` (subset, train)
        and ``targets`` (subset, query) (any mapping with those two arrays).
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
    masks = ground_truth_array(ground_truth, "masks", ("subset", "train"))       # (M, n_train)
    actual = ground_truth_array(ground_truth, "targets", ("subset", "query"))    # (M, n_query)
    tau, query = _scores(scores)                                      # (n_query, n_train)
    if masks.ndim != 2 or actual.ndim != 2 or masks.shape[0] != actual.shape[0]:
        raise ShapeMismatchError(f"ground truth needs masks (M, n_train) and targets (M, n_query), got "
                                 f"{masks.shape} and {actual.shape}")
    if tau.shape != (actual.shape[1], masks.shape[1]):
        raise ShapeMismatchError(f"scores are {tau.shape} (query, train) but the ground truth has "
                                 f"{actual.shape[1]} queries and {masks.shape[1]} training examples")
    if masks.shape[0] < 3:
        raise OptionError(f"LDS needs at least 3 subsets, got {masks.shape[0]}")
    if resample not in RESAMPLE:
        raise OptionError(f"resample must be one of {RESAMPLE}, got {resample!r}")
    predicted = sign * (masks @ tau.T)                                # (M, n_query)
    per_query = spearman(predicted, actual, axis=0)
    query = query if query is not None else _coord(ground_truth, "query", actual.shape[1])
    result = _result("LDS", "spearman", per_query, query, masks.shape[0],
                     bootstrap if resample == "queries" else 0, confidence, seed)
    result = replace(result, ceiling=_ceiling(ground_truth, actual))
    if resample == "queries" or not bootstrap:
        return result
    interval = lds_resampled(predicted, actual, over=resample, n_resamples=bootstrap, confidence=confidence,
                             seed=seed)
    return replace(result, interval=interval, resample=resample)


def lds_resampled(predicted, actual, *, over: str = "both", n_resamples: int = 1000, confidence: float = 0.95,
                  seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of the LDS, resampling subsets and/or queries.

    predicted, actual : (M, n_query) the additive predictions sign·Σ_{i∈S_j} τ_qi and the
        retrained targets (rows: subsets).
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
    if not 0 < confidence < 1:
        raise OptionError(f"confidence must be in (0, 1), got {confidence!r}")
    if n_resamples < 1:
        raise OptionError(f"n_resamples must be positive, got {n_resamples!r}")
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
    values = _numpy(per_query).reshape(-1)
    values = values[np.isfinite(values)]
    if values.size == 0:
        return (float("nan"), float("nan"))
    if not 0 < confidence < 1:
        raise OptionError(f"confidence must be in (0, 1), got {confidence!r}")
    if n_resamples < 1:
        raise OptionError(f"n_resamples must be positive, got {n_resamples!r}")
    rng = np.random.default_rng(seed)
    means = values[rng.integers(0, values.size, size=(n_resamples, values.size))].mean(axis=1)
    tail = (1 - confidence) / 2
    low, high = np.quantile(means, [tail, 1 - tail])
    return (float(low), float(high))


# -------------------------------------------------------------------------------- LOO
def loo_correlation(scores, loo, *, target: str | None = None, method: str = "pearson", bootstrap: int = 1000,
                    confidence: float = 0.95, seed: int = 0) -> CorrelationResult:
    """Per query, the correlation across removed examples of τ_qi and the LOO effect.

    ``loo`` is the Dataset of :func:`gradalg.eval.leave_one_out` (``effect`` (removed,
    query), coordinate ``removed``). The prediction is ``−sign · τ_qi`` (the loss rises by
    τ when a helpful example goes: ``target="loss"`` correlates τ with the effect,
    ``target="margin"`` correlates −τ with it). ``method``: "pearson" or "spearman".
    """
    if method not in ("pearson", "spearman"):
        raise OptionError(f"method must be 'pearson' or 'spearman', got {method!r}")
    sign = _sign(target, loo)
    effect = ground_truth_array(loo, "effect", ("removed", "query"))             # (n_removed, n_query)
    removed = np.asarray(_coord(loo, "removed", effect.shape[0])).astype(np.int64)
    tau, query = _scores(scores)                                      # (n_query, n_train)
    if effect.ndim != 2 or tau.shape[0] != effect.shape[1]:
        raise ShapeMismatchError(f"scores have {tau.shape[0]} queries, the LOO effect "
                                 f"{effect.shape[-1]}")
    if removed.max() >= tau.shape[1]:
        raise ShapeMismatchError(f"removed example {removed.max()} is beyond the {tau.shape[1]} scored ones")
    predicted = -sign * tau[:, removed].T                              # (n_removed, n_query)
    per_query = (spearman if method == "spearman" else pearson)(predicted, effect, axis=0)
    query = query if query is not None else _coord(loo, "query", effect.shape[1])
    return _result("LOO", method, per_query, query, removed.size, bootstrap, confidence, seed)


# ----------------------------------------------------------------------------- helpers
def _sign(target, data) -> float:
    if target is None:
        attrs = getattr(data, "attrs", {}) or {}
        target = attrs.get("target")
        if target is None:
            raise OptionError("say what the targets are: target='loss' (helpful examples lower it) or "
                             "target='margin' (they raise it); or record it with retrain(..., target=...)")
    if target not in _SIGN:
        raise OptionError(f"target must be 'loss' or 'margin', got {target!r}")
    return _SIGN[target]


def _scores(scores):
    """(values (n_query, n_train) float64, query coordinate or None)."""
    import xarray as xr
    if not isinstance(scores, (xr.DataArray, np.ndarray, torch.Tensor)) and hasattr(scores, "compute"):
        scores = scores.compute()                                     # lazy ga.Scores
    if isinstance(scores, xr.DataArray):
        if scores.dims != ("query", "train"):
            if set(scores.dims) == {"query", "train"}:
                scores = scores.transpose("query", "train")
            else:
                raise ShapeMismatchError(f"scores need dims ('query', 'train'), got {scores.dims}")
        return np.asarray(scores.values, dtype=np.float64), np.asarray(scores["query"].values)
    values = _numpy(scores).astype(np.float64)
    if values.ndim != 2:
        raise ShapeMismatchError(f"scores must be (n_query, n_train), got shape {values.shape}")
    return values, None


def _numpy(x) -> np.ndarray:
    import xarray as xr
    if isinstance(x, torch.Tensor):
        return x.detach().to("cpu").numpy()
    if isinstance(x, xr.DataArray):
        return np.asarray(x.values)
    return np.asarray(x)


def ground_truth_array(ground_truth, name: str, dims: tuple[str, ...]) -> np.ndarray:
    """``ground_truth[name]`` as a float64 array with axes in the order ``dims``: an
    xarray variable with exactly those dimensions in another order (``gt.transpose(...)``)
    is put back in order by name, so its axes are never misread by position."""
    import xarray as xr
    value = ground_truth[name]
    if isinstance(value, xr.DataArray) and value.dims != dims and set(value.dims) == set(dims):
        value = value.transpose(*dims)
    return _numpy(value).astype(np.float64)


def _coord(data, name, size):
    try:
        return np.asarray(data[name].values)
    except (KeyError, AttributeError, TypeError):
        return np.arange(size)


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
