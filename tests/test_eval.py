"""ga.eval: the retraining harness (subsets, leave-one-out, resumable store) and the
scores on its ground truth (LDS, LOO correlation), with exact numbers; and one
integration test: the exact-Hessian influence function reaches LDS ≥ 0.75 on
multinomial logistic regression over digits.
"""
from __future__ import annotations

import contextlib
import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import xarray as xr
from scipy import stats
from torch import nn

import gradalg as ga
from gradalg.errors import GradalgError, ShapeMismatchError

from gradalg.eval import retraining as retrain_module  # noqa: E402


# ------------------------------------------------------------------------ correlations
def test_spearman_and_pearson_equal_scipy_with_ties():
    rng = np.random.default_rng(0)
    x = rng.integers(0, 4, size=(25, 6)).astype(float)      # many ties
    y = rng.normal(size=(25, 6))
    y[:5, 2] = y[0, 2]                                       # ties on the other side too
    ours_s, ours_p = ga.eval.spearman(x, y), ga.eval.pearson(x, y)
    for j in range(6):
        assert ours_s[j] == pytest.approx(stats.spearmanr(x[:, j], y[:, j]).statistic, abs=1e-14)
        assert ours_p[j] == pytest.approx(stats.pearsonr(x[:, j], y[:, j]).statistic, abs=1e-14)
    assert ga.eval.spearman(x.T, y.T, axis=1) == pytest.approx(ours_s, abs=1e-15)
    assert float(ga.eval.spearman(x[:, 0], y[:, 0])) == pytest.approx(ours_s[0], abs=1e-15)


def test_correlation_of_a_constant_or_nonfinite_column_is_nan():
    x = np.array([[1.0, 1.0, 1.0], [2.0, 1.0, np.nan], [3.0, 1.0, 2.0]])
    y = np.array([[1.0, 2.0, 1.0], [3.0, 1.0, 2.0], [2.0, 0.0, 3.0]])
    s = ga.eval.spearman(x, y)
    assert s[0] == pytest.approx(0.5, abs=1e-15)
    assert np.isnan(s[1]) and np.isnan(s[2])


# -------------------------------------------------------------------------------- LDS
def _synthetic(n_train=40, n_query=7, n_subsets=30, seed=0):
    rng = np.random.default_rng(seed)
    tau = rng.normal(size=(n_query, n_train))
    masks = ga.eval.subset_masks(n_train, n_subsets, 0.5, seed=seed)
    return tau, masks, masks.astype(float) @ tau.T            # (M, n_query): Σ_{i∈S} τ_qi


def test_lds_is_one_when_actual_is_monotone_in_prediction():
    tau, masks, sums = _synthetic()
    loss = np.exp(-sums)                    # a loss: helpful (high τ) examples lower it
    result = ga.eval.lds(tau, {"masks": masks, "targets": loss}, target="loss")
    np.testing.assert_allclose(result.per_query.values, 1.0, rtol=0, atol=1e-12)
    assert result.mean == pytest.approx(1.0, abs=1e-12)
    assert result.interval == pytest.approx((1.0, 1.0), abs=1e-12)
    assert result.per_query.dims == ("query",) and result.n_queries == 7 and result.n_samples == 30
    margin = sums ** 3                      # a margin: helpful examples raise it
    assert ga.eval.lds(tau, {"masks": masks, "targets": margin}, target="margin").mean == pytest.approx(1.0)


def test_lds_is_minus_one_when_anti_monotone():
    tau, masks, sums = _synthetic()
    gt = {"masks": masks, "targets": sums ** 3}
    result = ga.eval.lds(tau, gt, target="loss")      # scores say it should fall, it rises
    np.testing.assert_allclose(result.per_query.values, -1.0, rtol=0, atol=1e-12)
    assert result.mean == pytest.approx(-1.0, abs=1e-12)


def test_lds_by_hand():
    # τ = [1, 2, 4]; subsets {0,1} {1,2} {0,2} {0}: sums [3, 6, 5, 1], ranks [2, 4, 3, 1]
    tau = np.array([[1.0, 2.0, 4.0]])
    masks = np.array([[1, 1, 0], [0, 1, 1], [1, 0, 1], [1, 0, 0]], dtype=bool)
    targets = np.array([[0.1], [0.4], [0.3], [0.2]])        # ranks [1, 4, 3, 2]
    gt = {"masks": masks, "targets": targets}
    # margin: d = [1, 0, 0, -1], Σd² = 2, ρ = 1 − 6·2/(4·15) = 0.8
    assert ga.eval.lds(tau, gt, target="margin", bootstrap=0).mean == pytest.approx(0.8, abs=1e-14)
    # loss: predicted −sums, ranks [3, 1, 2, 4], d = [2, −3, −1, 2], Σd² = 18, ρ = 1 − 108/60
    assert ga.eval.lds(tau, gt, target="loss", bootstrap=0).mean == pytest.approx(-0.8, abs=1e-14)
    assert ga.eval.lds(tau, gt, target="loss", bootstrap=0).interval is None


def test_lds_per_query_equals_scipy_spearman():
    tau, masks, sums = _synthetic(seed=3)
    noisy = -sums + np.random.default_rng(1).normal(scale=2.0, size=sums.shape)
    result = ga.eval.lds(tau, {"masks": masks, "targets": noisy}, target="loss")
    expected = [stats.spearmanr(-sums[:, q], noisy[:, q]).statistic for q in range(tau.shape[0])]
    np.testing.assert_allclose(result.per_query.values, expected, rtol=0, atol=1e-14)
    assert result.mean == pytest.approx(np.mean(expected), abs=1e-14)
    assert 0.2 < result.mean < 0.99


def test_lds_takes_dataarray_scores_and_target_from_retrain_attrs():
    tau, masks, _ = _synthetic(n_train=10, n_query=3, n_subsets=8)
    gt = ga.eval.retrain(lambda idx: idx, 10, n_subsets=8, fraction=0.5, targets_fn=lambda idx: -tau[:, idx].sum(1),
                         target="loss", query_ids=["a", "b", "c"])
    np.testing.assert_array_equal(gt["masks"].values, masks)
    scores = xr.DataArray(tau, dims=("query", "train"), coords={"query": ["a", "b", "c"], "train": np.arange(10)})
    result = ga.eval.lds(scores, gt)
    assert result.mean == pytest.approx(1.0, abs=1e-12)
    assert list(result.per_query["query"].values) == ["a", "b", "c"]
    assert ga.eval.lds(scores.T, gt).mean == pytest.approx(1.0, abs=1e-12)   # (train, query) is transposed
    assert "LDS 1.000" in repr(result) and "3 queries, 8 subsets" in repr(result)


def test_lds_refuses_unstated_target_and_mismatched_shapes():
    tau, masks, sums = _synthetic()
    gt = {"masks": masks, "targets": sums}
    with pytest.raises(ValueError, match="target='loss'"):
        ga.eval.lds(tau, gt)
    with pytest.raises(ValueError, match="'loss' or 'margin'"):
        ga.eval.lds(tau, gt, target="accuracy")
    with pytest.raises(ShapeMismatchError):
        ga.eval.lds(tau[:, :-1], gt, target="loss")
    with pytest.raises(ShapeMismatchError):
        ga.eval.lds(tau[:-1], gt, target="loss")


def test_lds_bootstrap_interval():
    values = np.array([0.2, 0.4, 0.6, 0.8, np.nan])
    low, high = ga.eval.lds_bootstrap(values, n_resamples=2000, confidence=0.9, seed=0)
    assert (low, high) == ga.eval.lds_bootstrap(values, n_resamples=2000, confidence=0.9, seed=0)
    assert 0.2 <= low < 0.5 < high <= 0.8                    # NaN left out: the mean is 0.5
    # by definition: quantiles of the means of resampled queries
    rng = np.random.default_rng(0)
    finite = values[:4]
    means = finite[rng.integers(0, 4, size=(2000, 4))].mean(1)
    assert (low, high) == pytest.approx(tuple(np.quantile(means, [0.05, 0.95])), abs=1e-15)
    wide = ga.eval.lds_bootstrap(values, n_resamples=2000, confidence=0.99, seed=0)
    assert wide[0] <= low and wide[1] >= high
    assert ga.eval.lds_bootstrap(np.full(6, 0.5)) == pytest.approx((0.5, 0.5))


def scipy_spearman(x, y):
    from scipy.stats import spearmanr
    return spearmanr(x, y).statistic


def _direct_lds_interval(predicted, actual, over, n_resamples, confidence, seed):
    """The resampled LDS by a loop of scipy.stats.spearmanr, with lds_resampled's draws."""
    m, n_query = predicted.shape
    rng = np.random.default_rng(seed)
    rows = rng.integers(0, m, size=(n_resamples, m)) if over != "queries" else np.tile(np.arange(m), (n_resamples, 1))
    cols = (rng.integers(0, n_query, size=(n_resamples, n_query)) if over != "subsets"
            else np.tile(np.arange(n_query), (n_resamples, 1)))
    means = []
    for b in range(n_resamples):
        per_query = []
        for q in cols[b]:
            x, y = predicted[rows[b], q], actual[rows[b], q]
            per_query.append(np.nan if np.ptp(x) == 0 or np.ptp(y) == 0 else scipy_spearman(x, y))
        means.append(np.nanmean(per_query))
    tail = (1 - confidence) / 2
    return tuple(np.quantile(means, [tail, 1 - tail]))


@pytest.mark.parametrize("over", ["queries", "subsets", "both"])
def test_lds_resampled_equals_a_direct_loop(over):
    rng = np.random.default_rng(3)
    predicted = rng.normal(size=(12, 5))
    actual = 0.6 * predicted + rng.normal(size=(12, 5))
    actual[:, 4] = np.round(actual[:, 4])                     # ties
    got = ga.eval.lds_resampled(predicted, actual, over=over, n_resamples=300, confidence=0.8, seed=7)
    want = _direct_lds_interval(predicted, actual, over, 300, 0.8, 7)
    assert got == pytest.approx(want, abs=1e-12)
    point = np.mean([scipy_spearman(predicted[:, q], actual[:, q]) for q in range(5)])
    assert got[0] < point < got[1]


def test_lds_resample_option_and_its_interval():
    rng = np.random.default_rng(0)
    masks = rng.random((30, 20)) < 0.5
    tau = rng.normal(size=(6, 20))
    actual = -(masks @ tau.T) + 2.0 * rng.normal(size=(30, 6))
    gt = {"masks": masks, "targets": actual}
    by_query = ga.eval.lds(tau, gt, target="loss", bootstrap=400, seed=1)
    both = ga.eval.lds(tau, gt, target="loss", bootstrap=400, seed=1, resample="both")
    subsets = ga.eval.lds(tau, gt, target="loss", bootstrap=400, seed=1, resample="subsets")
    assert by_query.mean == both.mean == subsets.mean             # the point estimate is unchanged
    assert both.resample == "both" and by_query.resample == "queries"
    assert both.interval == pytest.approx(ga.eval.lds_resampled(-(masks @ tau.T), actual, over="both",
                                                                n_resamples=400, seed=1), abs=1e-15)
    assert subsets.interval == pytest.approx(_direct_lds_interval(-(masks @ tau.T).astype(float), actual,
                                                                  "subsets", 400, 0.95, 1), abs=1e-12)
    assert by_query.interval == ga.eval.lds_bootstrap(by_query.per_query, n_resamples=400, seed=1)
    assert "queries and subsets" in repr(both)
    with pytest.raises(ValueError, match="resample"):
        ga.eval.lds(tau, gt, target="loss", resample="examples")


# --------------------------------------------------------------------------- subsets
def test_subset_masks_are_reproducible_and_do_not_depend_on_their_number():
    a = ga.eval.subset_masks(101, 10, 0.3, seed=5)
    assert a.shape == (10, 101) and a.dtype == bool
    assert (a.sum(1) == 30).all()                            # round(0.3 · 101)
    np.testing.assert_array_equal(a, ga.eval.subset_masks(101, 10, 0.3, seed=5))
    np.testing.assert_array_equal(a[:4], ga.eval.subset_masks(101, 4, 0.3, seed=5))
    assert not np.array_equal(a, ga.eval.subset_masks(101, 10, 0.3, seed=6))
    assert len({row.tobytes() for row in a}) == 10
    with pytest.raises(ValueError, match="fraction"):
        ga.eval.subset_masks(10, 3, 1.5)


def test_retrain_records_masks_and_targets():
    x = np.arange(20.0) ** 2
    gt = ga.eval.retrain(lambda idx: idx, 20, n_subsets=6, fraction=0.25, seed=2,
                         targets_fn=lambda idx: torch.tensor([len(idx), x[idx].sum()]))
    assert set(gt.data_vars) == {"masks", "targets", "runs"}
    assert gt["masks"].dims == ("subset", "train") and gt["targets"].dims == ("subset", "query")
    np.testing.assert_array_equal(gt["masks"].values, ga.eval.subset_masks(20, 6, 0.25, seed=2))
    np.testing.assert_array_equal(gt["targets"].values[:, 0], 5.0)
    np.testing.assert_array_equal(gt["targets"].values[:, 1], gt["masks"].values @ x)
    assert gt.attrs["fraction"] == 0.25 and gt.attrs["seed"] == 2 and gt.attrs["n_train"] == 20


def test_retrain_seeds_each_training_run_and_restores_global_rngs():
    def train_fn(idx):
        return (torch.rand(()).item(), np.random.rand(), random.random())

    torch.manual_seed(123)
    before = torch.rand(3)
    torch.manual_seed(123)
    per_subset = ga.eval.retrain(train_fn, 10, n_subsets=4, targets_fn=np.array)["targets"].values
    assert torch.equal(torch.rand(3), before)               # the caller's stream is untouched
    assert len({row.tobytes() for row in per_subset}) == 4   # a seed per subset
    again = ga.eval.retrain(train_fn, 10, n_subsets=4, targets_fn=np.array)["targets"].values
    np.testing.assert_array_equal(per_subset, again)
    shared = ga.eval.retrain(train_fn, 10, n_subsets=4, targets_fn=np.array, training_seed=7)["targets"].values
    assert len({row.tobytes() for row in shared}) == 1


# ---------------------------------------------------------------------------- resume
class Counting:
    """train_fn(indices) -> indices, recording calls; raises on call number ``fail_at``."""

    def __init__(self, fail_at=None):
        self.calls, self.fail_at = [], fail_at

    def __call__(self, idx):
        if self.fail_at is not None and len(self.calls) == self.fail_at:
            raise KeyboardInterrupt("killed")
        self.calls.append(idx)
        return idx


def _targets(idx):
    return np.array([idx.sum(), (idx ** 2).sum() + torch.rand(()).item()])   # a seed-dependent part


def test_interrupted_retrain_resumes_and_equals_an_uninterrupted_run(tmp_path):
    store = tmp_path / "gt"
    uninterrupted = ga.eval.retrain(Counting(), 30, n_subsets=8, fraction=0.5, targets_fn=_targets)
    first = Counting(fail_at=3)
    with pytest.raises(KeyboardInterrupt):
        ga.eval.retrain(first, 30, n_subsets=8, fraction=0.5, targets_fn=_targets, store=store)
    assert sorted(p.name for p in store.glob("*.npz")) == [f"subset-{j:06d}.npz" for j in range(3)]
    masks = ga.eval.subset_masks(30, 8, 0.5)
    second = Counting()
    resumed = ga.eval.retrain(second, 30, n_subsets=8, fraction=0.5, targets_fn=_targets, store=store)
    assert [c.tolist() for c in second.calls] == [np.flatnonzero(m).tolist() for m in masks[3:]]
    xr.testing.assert_identical(resumed, uninterrupted)
    third = Counting()
    xr.testing.assert_identical(
        ga.eval.retrain(third, 30, n_subsets=8, fraction=0.5, targets_fn=_targets, store=store), uninterrupted)
    assert third.calls == []
    more = Counting()                                         # more subsets: the first 8 are reused
    bigger = ga.eval.retrain(more, 30, n_subsets=10, fraction=0.5, targets_fn=_targets, store=store)
    assert len(more.calls) == 2
    xr.testing.assert_identical(bigger.isel(subset=slice(0, 8)), uninterrupted)


def test_interrupted_write_leaves_no_partial_file(tmp_path, monkeypatch):
    store = tmp_path / "gt"
    real = retrain_module._write_run
    writes = []

    def dying(file, *args):
        writes.append(1)
        if len(writes) == 3:
            file.write(b"PK\x03\x04 half a zip")              # bytes on disk, then killed
            raise KeyboardInterrupt("killed while writing")
        real(file, *args)

    monkeypatch.setattr(retrain_module, "_write_run", dying)
    with pytest.raises(KeyboardInterrupt):
        ga.eval.retrain(Counting(), 12, n_subsets=5, targets_fn=_targets, store=store)
    assert sorted(p.name for p in store.iterdir()) == ["meta.json", "subset-000000.npz", "subset-000001.npz"]
    monkeypatch.setattr(retrain_module, "_write_run", real)
    (store / ".subset-000002.npz.stale.tmp").write_bytes(b"left by a kill -9")   # ignored on resume
    again = Counting()
    resumed = ga.eval.retrain(again, 12, n_subsets=5, targets_fn=_targets, store=store)
    assert len(again.calls) == 3
    xr.testing.assert_identical(resumed, ga.eval.retrain(Counting(), 12, n_subsets=5, targets_fn=_targets))


def test_store_refuses_runs_of_other_settings(tmp_path):
    ga.eval.retrain(Counting(), 12, n_subsets=2, fraction=0.5, targets_fn=_targets, store=tmp_path)
    with pytest.raises(GradalgError, match="fraction: stored 0.5, asked 0.25"):
        ga.eval.retrain(Counting(), 12, n_subsets=2, fraction=0.25, targets_fn=_targets, store=tmp_path)
    with pytest.raises(GradalgError, match="kind"):
        ga.eval.leave_one_out(Counting(), 12, [0], _targets, store=tmp_path)


def test_targets_of_changing_length_are_refused():
    lengths = iter([2, 3])
    with pytest.raises(ShapeMismatchError, match="different lengths"):
        ga.eval.retrain(lambda idx: idx, 8, n_subsets=2, targets_fn=lambda m: np.zeros(next(lengths)))


# ---------------------------------------------------------------------- leave one out
def test_leave_one_out_effects_and_correlation(tmp_path):
    v = np.array([3.0, -1.0, 2.0, 0.5, 4.0, -2.0])
    w = np.array([1.0, 2.0, 0.0, -1.0, 1.0, 3.0])

    def targets_fn(idx):            # two query losses; the same draw of torch.rand in every run
        return np.array([-v[idx].sum(), -(w[idx] ** 3).sum()]) + torch.rand(()).item()

    interrupted = Counting(fail_at=3)
    with pytest.raises(KeyboardInterrupt):
        ga.eval.leave_one_out(interrupted, 6, [1, 4, 0, 5], targets_fn, store=tmp_path)
    resumed = Counting()
    loo = ga.eval.leave_one_out(resumed, 6, [1, 4, 0, 5], targets_fn, store=tmp_path, target="loss")
    assert [c.tolist() for c in resumed.calls] == [[1, 2, 3, 4, 5], [0, 1, 2, 3, 4]]
    assert loo["effect"].dims == ("removed", "query") and list(loo["removed"].values) == [1, 4, 0, 5]
    np.testing.assert_allclose(loo["effect"].values[:, 0], v[[1, 4, 0, 5]], rtol=0, atol=1e-12)
    np.testing.assert_allclose(loo["effect"].values[:, 1], w[[1, 4, 0, 5]] ** 3, rtol=0, atol=1e-12)
    xr.testing.assert_identical(loo, ga.eval.leave_one_out(Counting(), 6, [1, 4, 0, 5], targets_fn, target="loss"))

    scores = np.stack([v, w])                                   # (query, train)
    pear = ga.eval.loo_correlation(scores, loo)                 # target from attrs: "loss"
    assert pear.per_query.values[0] == pytest.approx(1.0, abs=1e-14)
    assert pear.per_query.values[1] == pytest.approx(stats.pearsonr(w[[1, 4, 0, 5]], w[[1, 4, 0, 5]] ** 3).statistic,
                                                     abs=1e-14)
    spear = ga.eval.loo_correlation(scores, loo, method="spearman")
    np.testing.assert_allclose(spear.per_query.values, 1.0, atol=1e-14)
    flipped = ga.eval.loo_correlation(scores, loo, target="margin", method="spearman")
    np.testing.assert_allclose(flipped.per_query.values, -1.0, atol=1e-14)
    assert "LOO" in repr(spear) and "4 removed examples" in repr(spear)


# ------------------------------------------------------------------------ integration
@contextlib.contextmanager
def _one_thread():
    # two test workers share two cores: more intra-op threads only contend (≈ 4× slower)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


class LogisticRegression:
    """Multinomial logistic regression by Newton's method, in float64:

        min_θ (1/n) Σ_{i ∈ S} CE(θ x̃_i, y_i) + (wd/2) ‖θ‖²,   θ (10, 65) = [W | b]

    with n the size of the *full* training set, so that dropping examples is exactly a
    change of their weights from 1 to 0 (the counterfactual the influence function
    linearizes), and the Hessian of the full objective is ga.hessian(...) + wd·I.
    """

    def __init__(self, X, y, wd):
        self.X, self.y, self.wd, self.n = X, y, wd, len(X)
        self.full = self.fit(np.arange(self.n), torch.zeros(10, 65, dtype=torch.float64))

    def objective(self, theta, Xa, Y):
        logits = Xa @ theta.T
        return (torch.logsumexp(logits, 1) - (logits * Y).sum(1)).sum() / self.n + self.wd / 2 * (theta ** 2).sum()

    def fit(self, idx, theta):
        Xa = torch.cat([self.X[idx], torch.ones(len(idx), 1, dtype=torch.float64)], 1)
        Y = F.one_hot(self.y[idx], 10).double()
        m, eye = len(idx), torch.eye(650, dtype=torch.float64)
        XX = (Xa[:, :, None] * Xa[:, None, :]).reshape(m, -1)
        for _ in range(50):
            P = torch.softmax(Xa @ theta.T, 1)
            grad = (P - Y).T @ Xa / self.n + self.wd * theta
            if grad.abs().max() < 1e-11:
                return theta
            W = torch.diag_embed(P) - P[:, :, None] * P[:, None, :]
            H = (W.reshape(m, -1).T @ XX).reshape(10, 10, 65, 65).permute(0, 2, 1, 3).reshape(650, 650)
            step = torch.linalg.solve(H / self.n + self.wd * eye, grad.reshape(-1)).reshape(10, 65)
            f0, t = self.objective(theta, Xa, Y), 1.0
            slack = 8 * torch.finfo(torch.float64).eps * abs(float(f0))   # near the minimum f differs by round-off
            while self.objective(theta - t * step, Xa, Y) > f0 + slack and t > 1e-10:
                t /= 2
            theta = theta - t * step
        raise AssertionError("Newton's method did not converge")

    def __call__(self, idx):                                   # train_fn: warm start from the full fit
        return self.model(self.fit(idx, self.full))

    @staticmethod
    def model(theta):
        linear = nn.Linear(64, 10).double()
        with torch.no_grad():
            linear.weight.copy_(theta[:, :64])
            linear.bias.copy_(theta[:, 64])
        return linear


@pytest.mark.slow
def test_exact_hessian_influence_reaches_lds_075_on_digits(tmp_path):
    from sklearn.datasets import load_digits

    X, y = load_digits(return_X_y=True)
    X, y = torch.tensor(X / 16.0), torch.tensor(y)
    order = np.random.default_rng(0).permutation(len(X))
    train = (X[order[:300]], y[order[:300]])
    queries = (X[order[300:340]], y[order[300:340]])
    wd = 1e-3

    def query_losses(model):
        with torch.no_grad():
            return F.cross_entropy(model(queries[0]), queries[1], reduction="none")

    with _one_thread():
        fit = LogisticRegression(*train, wd)
        gt = ga.eval.retrain(fit, 300, n_subsets=50, fraction=0.5, targets_fn=query_losses, target="loss",
                             store=tmp_path / "lds")
        task = ga.tasks.classification(fit.model(fit.full))
        G, Q = ga.grads(task, train), ga.grads(task, queries)
        H = ga.hessian(task, train).damp(wd)                  # (1/n) Σ ∇²ℓ_i + wd·I: the objective's Hessian
        scores = (Q @ H.inv() @ G.T).compute()                # (40, 300)
        lds = ga.eval.lds(scores, gt)
        assert lds.mean >= 0.75, lds                          # measured 0.915 (grad_dot: 0.452)
        assert lds.interval[0] >= 0.75, lds
        assert ga.eval.lds(ga.methods.grad_dot(task, train, queries), gt).mean < lds.mean - 0.2

        loo = ga.eval.leave_one_out(fit, 300, np.arange(0, 300, 15), query_losses, target="loss")
        corr = ga.eval.loo_correlation(scores, loo)
        assert corr.mean >= 0.95, corr         # measured 0.984: one removal is close to first order


def test_a_damaged_run_in_a_retraining_store_is_refused_naming_the_file(tmp_path):
    """A run's ``.npz`` cut short (a disk error, a partial copy) raised zipfile's own error;
    it is refused naming the file and the fix, which works: that run alone is retrained."""
    trained = []

    def train_fn(indices):
        trained.append(1)
        return indices

    def targets_fn(model):
        return np.array([float(len(model)), float(model.sum())])
    first = ga.eval.retrain(train_fn, 8, n_subsets=2, targets_fn=targets_fn, store=tmp_path)
    damaged = sorted(tmp_path.glob("subset-*.npz"))[0]
    damaged.write_bytes(damaged.read_bytes()[:50])
    with pytest.raises(ga.GradalgError, match=f"{damaged.name} is damaged .*delete it and run again"):
        ga.eval.retrain(train_fn, 8, n_subsets=2, targets_fn=targets_fn, store=tmp_path)
    damaged.unlink()
    trained.clear()
    again = ga.eval.retrain(train_fn, 8, n_subsets=2, targets_fn=targets_fn, store=tmp_path)
    assert len(trained) == 1
    np.testing.assert_array_equal(again.targets.values, first.targets.values)
