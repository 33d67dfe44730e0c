"""``benchmarks/explore_sparsity.py``'s reductions of a score matrix: the monotone ones keep
every query's ranking of the training examples (only the sums over subsets change), the
language ones are what their names say."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from scipy.stats import spearmanr

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import explore_sparsity as X  # noqa: E402


def _scores(seed=0):
    rng = np.random.default_rng(seed)
    S = rng.standard_t(3, size=(5, 80))                        # heavy-tailed, both signs, no ties
    same = (rng.integers(0, 4, size=(5, 1)) == rng.integers(0, 4, size=(1, 80))).astype(float)
    return S, same


def test_monotone_reductions_keep_each_query_s_order_of_the_examples():
    S, same = _scores()
    out = X.reductions(S, same)
    for name in ("sign(τ)·|τ|^1.5", "sign(τ)·|τ|^2", "sign(τ)·|τ|^3"):
        for q in range(S.shape[0]):
            assert spearmanr(out[name][q], S[q]).statistic == 1.0, name
    np.testing.assert_allclose(out["sign(τ)·|τ|^2"], S * np.abs(S))
    pos = out["positive part max(τ, 0)"]
    assert (pos >= 0).all() and np.array_equal(pos[S > 0], S[S > 0])
    for q in range(S.shape[0]):                                  # kept exactly the 16 largest
        kept = np.flatnonzero(out["top 16 per query"][q])
        assert set(kept) == set(np.argsort(S[q])[-16:])
        big = np.flatnonzero(out["16 largest |τ| per query"][q])
        assert set(big) == set(np.argsort(np.abs(S[q]))[-16:])
    sd = S.std(1, keepdims=True)
    soft = out["soft threshold at 1·sd"]
    np.testing.assert_allclose(soft, np.sign(S) * np.clip(np.abs(S) - sd, 0, None))


def test_language_reductions_split_the_scores_by_the_query_s_language():
    S, same = _scores(1)
    out = X.reductions(S, same)
    np.testing.assert_array_equal(out["within the query's language only"] + out["across languages only"], S)
    assert (out["within the query's language only"][same == 0] == 0).all()
    means = out["per-language means of the scores"]
    for q in range(S.shape[0]):
        np.testing.assert_allclose(means[q][same[q] > 0], S[q][same[q] > 0].mean())
        np.testing.assert_allclose(means[q][same[q] == 0], S[q][same[q] == 0].mean())
    assert set(X.MONOTONE) <= set(out)
