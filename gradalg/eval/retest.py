"""How repeatable a retrained ground truth is, and the highest LDS it allows.

Retraining a subset with another training seed (initialisation, batch order) changes
its targets. Write subset S's target under run r as

    y_r(S) = μ(S) + e_r(S),        E[e_r(S) | S] = 0,  runs independent given S,

with μ(S) the target expected over training seeds. Scores τ predict a function of S
alone, so whatever they predict is uncorrelated with the noise e, and for any predictor
ŷ(S) (Pearson, over subsets)

    corr(ŷ, ȳ_k) ≤ corr(μ, ȳ_k) = √ρ_k,        ρ_k = Var μ / Var ȳ_k,

where ȳ_k is the mean of k runs, the ground truth :func:`gradalg.eval.retrain` returns
with ``seeds_per_subset=k``. Two runs estimate the single-run reliability directly,
ρ_1 = corr(y_a, y_b) (the *test–retest* correlation: the LDS one retraining scores
against another), and the Spearman–Brown formula carries it to k runs:

    ρ_k = k ρ_1 / (1 + (k − 1) ρ_1).

:func:`reliability` computes ρ_1 per query as the Spearman correlation over subsets
between two runs (the mean over every pair of runs when there are more), and the
**ceiling** √ρ_k per query (ρ_1 clipped at 0 first: a negative estimate means no
repeatable signal), averaged over queries: the LDS of the noise-free
μ against the k-run ground truth, which no scores can beat except by chance. Using a
rank correlation in formulas derived for Pearson's is an approximation (close for
targets near Gaussian), and with M subsets each estimate carries O(1/√M) noise.

    >>> gt = ga.eval.retrain(train_fn, n, n_subsets=50, seeds_per_subset=2, ...)
    >>> ga.eval.reliability(gt)       # the "lm" GPT-2 of benchmarks/fidelity_lm.py
    Ground truth: 2 runs per subset, 50 subsets, 64 queries; test–retest (Spearman) 0.515
    (95% CI ...); LDS ceiling 0.79 against the 2-run mean (0.69 with 1 run, 0.87 with 4 runs,
    0.92 with 8 runs)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ..errors import ShapeMismatchError, OptionError
from .correlation import ground_truth_array, lds_bootstrap, mean_ceiling, retest_correlation

if TYPE_CHECKING:                 # xarray loads when a result is made (about 76 MB)
    import xarray as xr

__all__ = ["reliability", "Reliability"]


@dataclass(frozen=True)
class Reliability:
    """The test–retest correlation of a retrained ground truth and its LDS ceiling.

    ``per_query`` (query,): ρ_1 per query, the Spearman correlation over subsets between
    two training runs of the same subsets (mean over pairs of runs); NaN where a run's
    targets are constant. ``retest``: its mean over queries, with ``interval`` (a
    percentile bootstrap over queries). ``ceiling``: mean over queries of √ρ_k (ρ_1
    clipped at 0 first) for the ground truth's own k = ``runs``; :meth:`ceiling_with` gives it for another k.
    """

    per_query: "xr.DataArray"
    retest: float
    interval: tuple[float, float]
    runs: int
    n_subsets: int
    confidence: float

    @property
    def ceiling(self) -> float:
        """The LDS ceiling against the mean of this ground truth's ``runs`` runs."""
        return self.ceiling_with(self.runs)

    def ceiling_with(self, runs: int) -> float:
        """The LDS ceiling against a ground truth averaging ``runs`` runs per subset
        (mean over queries of √ρ_runs, ρ_runs by Spearman–Brown from ρ_1 clipped to [0, 1])."""
        return mean_ceiling(self.per_query.values, runs)

    def __float__(self) -> float:
        return self.ceiling

    def __repr__(self) -> str:
        low, high = self.interval
        others = sorted({1, 2 * self.runs, 4 * self.runs} - {self.runs})
        more = ", ".join(f"{self.ceiling_with(k):.2f} with {k} run{'s' if k > 1 else ''}" for k in others)
        ci = f" ({self.confidence:.0%} CI {low:.3f} to {high:.3f})" if np.isfinite([low, high]).all() else ""
        return (f"Ground truth: {self.runs} runs per subset, {self.n_subsets} subsets, "
                f"{self.per_query.sizes['query']} queries; test–retest (Spearman) {self.retest:.3f}{ci}; "
                f"LDS ceiling {self.ceiling:.2f} against the {self.runs}-run mean ({more})")

    def _repr_html_(self) -> str:
        import html
        return f"<pre>{html.escape(repr(self))}</pre>"


def reliability(ground_truth, *, bootstrap: int = 1000, confidence: float = 0.95, seed: int = 0) -> Reliability:
    """Test–retest correlation of ``ground_truth`` and the highest LDS it allows.

    Parameters
    ----------
    ground_truth : the Dataset of ``ga.eval.retrain(..., seeds_per_subset=k)`` with
        k ≥ 2: its ``runs`` (subset, run, query) (any mapping with that array).
    bootstrap : resamples of the queries for the interval of ``retest`` (0: none).
    confidence : level of that interval.
    seed : seed of the bootstrap.

    Returns
    -------
    :class:`Reliability`: ``per_query`` ρ_1, ``retest`` (its mean), ``interval``,
    ``ceiling`` (against the k-run mean) and ``ceiling_with(k')`` (module docstring).
    """
    import xarray as xr
    if not hasattr(ground_truth, "keys") or "runs" not in ground_truth.keys():
        raise OptionError("reliability needs the ground truth's individual training runs: the Dataset of "
                         "ga.eval.retrain(..., seeds_per_subset=2 or more), or a mapping with 'runs' "
                         f"(subset, run, query); got {type(ground_truth).__name__}"
                         + (" without 'runs'" if hasattr(ground_truth, "keys") else ""))
    runs = ground_truth_array(ground_truth, "runs", ("subset", "run", "query"))
    if runs.ndim != 3:
        raise ShapeMismatchError(f"ground truth 'runs' must be (subset, run, query), got shape {runs.shape}")
    m, k, n_query = runs.shape
    if k < 2:
        raise OptionError(f"reliability compares training runs of the same subsets, and this ground truth has "
                         f"{k} run per subset: retrain with seeds_per_subset=2 or more (with the same store, "
                         "only the new runs are trained)")
    if m < 3:
        raise OptionError(f"reliability needs at least 3 subsets, got {m}")
    per_query = retest_correlation(runs)                                                 # (n_query,)
    finite = per_query[np.isfinite(per_query)]
    retest = float(finite.mean()) if finite.size else float("nan")
    interval = (lds_bootstrap(per_query, n_resamples=bootstrap, confidence=confidence, seed=seed)
                if bootstrap and finite.size else (float("nan"), float("nan")))
    query = (np.asarray(ground_truth["query"]) if "query" in getattr(ground_truth, "coords", {})
             else np.arange(n_query))
    return Reliability(per_query=xr.DataArray(per_query, dims=("query",), coords={"query": query},
                                              name="test_retest"),
                       retest=retest, interval=interval, runs=int(k), n_subsets=int(m),
                       confidence=float(confidence))
