"""Several training runs per subset (``retrain(seeds_per_subset=k)``) and the ground truth's
reliability (``ga.eval.reliability``): test–retest correlation and the LDS ceiling."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

import gradalg as ga
from gradalg.errors import GradalgError
from gradalg.eval import retraining

N_TRAIN, N_QUERY = 40, 6


def _weights():
    return np.random.default_rng(7).normal(size=(N_QUERY, N_TRAIN))     # (query, train) the additive truth


class Noisy:
    """train_fn: an 'additive model' whose targets are Σ_{i∈S} w_qi + σ·noise, the noise drawn
    from the global torch RNG that retrain seeds; records each call's seed."""

    def __init__(self, sigma):
        self.sigma, self.w, self.seeds = sigma, _weights(), []

    def __call__(self, idx):
        self.seeds.append(torch.initial_seed())
        noise = torch.randn(N_QUERY, dtype=torch.float64).numpy()
        return self.w[:, idx].sum(1) + self.sigma * noise             # (n_query,)


def _identity(values):
    return values


def test_runs_are_the_subset_trained_with_each_documented_seed_and_targets_their_mean():
    fn = Noisy(sigma=1.0)
    gt = ga.eval.retrain(fn, N_TRAIN, n_subsets=5, seeds_per_subset=3, seed=4, targets_fn=_identity)
    assert gt["runs"].dims == ("subset", "run", "query") and gt["runs"].shape == (5, 3, N_QUERY)
    assert gt.attrs["seeds_per_subset"] == 3
    np.testing.assert_allclose(gt["targets"].values, gt["runs"].values.mean(1), rtol=0, atol=1e-15)
    expected = [retraining._run_seed(4, j) if r == 0 else retraining._run_seed(4, j, r)
                for j in range(5) for r in range(3)]
    assert fn.seeds == expected and len(set(expected)) == 15          # every run its own seed
    masks = gt["masks"].values
    for j, r in itertools.product(range(5), range(3)):                # each run by hand, with its seed
        torch.manual_seed(expected[3 * j + r])
        by_hand = fn.w[:, masks[j]].sum(1) + torch.randn(N_QUERY, dtype=torch.float64).numpy()
        np.testing.assert_allclose(gt["runs"].values[j, r], by_hand, rtol=0, atol=1e-12)


def test_one_run_per_subset_trains_what_it_always_trained():
    fn = Noisy(sigma=1.0)
    gt = ga.eval.retrain(fn, N_TRAIN, n_subsets=4, seed=2, targets_fn=_identity)
    assert fn.seeds == [retraining._run_seed(2, j) for j in range(4)]
    np.testing.assert_array_equal(gt["runs"].values[:, 0], gt["targets"].values)


def test_a_shared_training_seed_gives_run_r_the_seed_plus_r():
    fn = Noisy(sigma=1.0)
    ga.eval.retrain(fn, N_TRAIN, n_subsets=3, seeds_per_subset=2, training_seed=10, targets_fn=_identity)
    assert fn.seeds == [10, 11, 10, 11, 10, 11]


def test_a_store_grows_from_one_to_more_runs_training_only_the_new_ones(tmp_path):
    store = tmp_path / "gt"
    first = Noisy(sigma=0.5)
    one = ga.eval.retrain(first, N_TRAIN, n_subsets=4, targets_fn=_identity, store=store)
    assert len(first.seeds) == 4
    second = Noisy(sigma=0.5)
    three = ga.eval.retrain(second, N_TRAIN, n_subsets=4, seeds_per_subset=3, targets_fn=_identity, store=store)
    assert len(second.seeds) == 8                                     # runs 1 and 2 of each subset only
    np.testing.assert_array_equal(three["runs"].values[:, 0], one["targets"].values)
    fresh = ga.eval.retrain(Noisy(sigma=0.5), N_TRAIN, n_subsets=4, seeds_per_subset=3, targets_fn=_identity)
    np.testing.assert_array_equal(three["runs"].values, fresh["runs"].values)
    none = Noisy(sigma=0.5)
    ga.eval.retrain(none, N_TRAIN, n_subsets=4, seeds_per_subset=2, targets_fn=_identity, store=store)
    assert none.seeds == []                                           # everything was stored
    assert {p.name for p in store.glob("*.npz")} == {f"subset-{j:06d}{s}.npz" for j in range(4)
                                                      for s in ("", "-run01", "-run02")}


def test_a_stored_run_with_another_training_seed_is_refused(tmp_path):
    store = tmp_path / "gt"
    ga.eval.retrain(Noisy(0.5), N_TRAIN, n_subsets=2, targets_fn=_identity, store=store)
    name = store / "subset-000001.npz"
    with np.load(name) as data:
        indices, targets = data["indices"], data["targets"]
    np.savez(name, indices=indices, targets=targets, training_seed=np.int64(12345))
    with pytest.raises(GradalgError, match="training seed 12345"):
        ga.eval.retrain(Noisy(0.5), N_TRAIN, n_subsets=2, targets_fn=_identity, store=store)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_seeds_per_subset_must_be_a_positive_integer(bad):
    with pytest.raises(ValueError, match="seeds_per_subset must be a positive integer"):
        ga.eval.retrain(Noisy(0.5), N_TRAIN, n_subsets=2, seeds_per_subset=bad, targets_fn=_identity)


def test_spearman_brown_by_hand():
    assert ga.eval.spearman_brown(0.5, 1) == pytest.approx(0.5)
    assert ga.eval.spearman_brown(0.5, 2) == pytest.approx(2 * 0.5 / 1.5)
    np.testing.assert_allclose(ga.eval.spearman_brown(np.array([0.2, 0.9]), 4), [0.8 / 1.6, 3.6 / 3.7])
    with pytest.raises(ValueError, match="runs must be a positive integer"):
        ga.eval.spearman_brown(0.5, 0)
    with pytest.raises(ValueError, match=r"in \[0, 1\]"):
        ga.eval.spearman_brown(-0.5, 4)                 # would give 4: no meaning for a negative ρ₁


def test_the_ceiling_of_pure_noise_is_at_most_one_and_negative_estimates_count_as_zero():
    runs = np.random.default_rng(0).normal(size=(6, 2, 40))            # no signal: ρ₁ scatters around 0
    rel = ga.eval.reliability({"runs": runs}, bootstrap=0)
    assert (rel.per_query.values < 0).any()
    rho = np.clip(rel.per_query.values, 0, 1)
    for k in (1, 2, 4, 16):
        assert 0 <= rel.ceiling_with(k) <= 1
        assert rel.ceiling_with(k) == pytest.approx(np.sqrt(k * rho / (1 + (k - 1) * rho)).mean())


def test_reliability_per_query_is_the_mean_spearman_over_pairs_of_runs():
    gt = ga.eval.retrain(Noisy(sigma=2.0), N_TRAIN, n_subsets=30, seeds_per_subset=3, targets_fn=_identity)
    rel = ga.eval.reliability(gt, bootstrap=200)
    runs = gt["runs"].values
    from scipy import stats
    by_hand = np.mean([[stats.spearmanr(runs[:, a, q], runs[:, b, q])[0] for q in range(N_QUERY)]
                       for a, b in [(0, 1), (0, 2), (1, 2)]], axis=0)
    np.testing.assert_allclose(rel.per_query.values, by_hand, atol=1e-12)
    assert rel.retest == pytest.approx(by_hand.mean())
    assert rel.interval == ga.eval.lds_bootstrap(rel.per_query, n_resamples=200, seed=0)
    rho_1 = np.clip(by_hand, 0, 1)
    assert rel.ceiling == pytest.approx(np.sqrt(3 * rho_1 / (1 + 2 * rho_1)).mean())
    assert rel.ceiling_with(1) == pytest.approx(np.sqrt(rho_1).mean())
    assert rel.runs == 3 and rel.n_subsets == 30
    text = repr(rel)
    assert "3 runs per subset" in text and "test–retest" in text and "with 1 run" in text and "CI" in text
    assert "CI" not in repr(ga.eval.reliability(gt, bootstrap=0))


def test_without_noise_the_ground_truth_is_perfectly_repeatable():
    gt = ga.eval.retrain(Noisy(sigma=0.0), N_TRAIN, n_subsets=20, seeds_per_subset=2, targets_fn=_identity)
    rel = ga.eval.reliability(gt)
    np.testing.assert_allclose(rel.per_query.values, 1.0)
    assert rel.ceiling == pytest.approx(1.0) and rel.ceiling_with(1) == pytest.approx(1.0)


@pytest.mark.parametrize("sigma", [2.0, 4.0])
def test_the_ceiling_matches_the_noise_it_was_made_with_and_the_exact_scores_reach_it(sigma):
    """y_r(S) = Σ_{i∈S} w_qi + σ e_r: Var μ over 50 % subsets is ≈ ¼ Σ_i w_qi² (exactly
    α(1−α)·n/(n−1)·(Σ w² − (Σw)²/n)), so ρ_1 = Var μ / (Var μ + σ²). The exact additive
    scores −w (a loss-like target lowered by helpful examples) are the noise-free predictor:
    their LDS against the k-run mean should sit at the ceiling, not above it."""
    m = 400
    gt = ga.eval.retrain(Noisy(sigma), N_TRAIN, n_subsets=m, seeds_per_subset=2, targets_fn=_identity)
    rel = ga.eval.reliability(gt, bootstrap=0)
    w = _weights()
    var_mu = 0.25 * N_TRAIN / (N_TRAIN - 1) * ((w ** 2).sum(1) - w.sum(1) ** 2 / N_TRAIN)
    rho_1 = var_mu / (var_mu + sigma ** 2)
    np.testing.assert_allclose(rel.per_query.values, rho_1, atol=0.1)          # Spearman ≈ Pearson here
    assert rel.retest == pytest.approx(rho_1.mean(), abs=0.04)
    exact = ga.eval.lds(-w, gt, target="loss", bootstrap=0)       # −w: helpful examples lower the target
    assert exact.mean == pytest.approx(rel.ceiling, abs=0.04)
    one_run = {"masks": gt["masks"], "targets": gt["runs"].isel(run=0)}
    assert ga.eval.lds(-w, one_run, target="loss", bootstrap=0).mean == pytest.approx(rel.ceiling_with(1), abs=0.04)


def test_reliability_refuses_one_run_and_says_how_to_get_two():
    gt = ga.eval.retrain(Noisy(sigma=1.0), N_TRAIN, n_subsets=5, targets_fn=_identity)
    with pytest.raises(ValueError, match="seeds_per_subset=2"):
        ga.eval.reliability(gt)
    with pytest.raises(ValueError, match="without 'runs'"):
        ga.eval.reliability({"masks": gt["masks"], "targets": gt["targets"]})
    for bad in (None, 5, gt["targets"].values):
        with pytest.raises(ValueError, match="seeds_per_subset=2 or more"):
            ga.eval.reliability(bad)
    small = ga.eval.retrain(Noisy(sigma=1.0), N_TRAIN, n_subsets=2, seeds_per_subset=2, targets_fn=_identity)
    with pytest.raises(ValueError, match="at least 3 subsets"):
        ga.eval.reliability(small)


def test_select_runs_is_what_fewer_seeds_per_subset_would_have_returned():
    four = ga.eval.retrain(Noisy(sigma=1.0), N_TRAIN, n_subsets=5, seeds_per_subset=4, targets_fn=_identity,
                           target="loss")
    two = ga.eval.retrain(Noisy(sigma=1.0), N_TRAIN, n_subsets=5, seeds_per_subset=2, targets_fn=_identity,
                          target="loss")
    picked = ga.eval.select_runs(four, 2)
    np.testing.assert_array_equal(picked["runs"].values, two["runs"].values)
    np.testing.assert_allclose(picked["targets"].values, two["targets"].values, rtol=0, atol=1e-15)
    assert picked.attrs["seeds_per_subset"] == 2 and picked.attrs["target"] == "loss"
    np.testing.assert_allclose(ga.eval.select_runs(four, [3, 1])["targets"].values,
                               four["runs"].values[:, [3, 1]].mean(1), rtol=0, atol=1e-15)
    assert four.attrs["seeds_per_subset"] == 4                       # the input is left as it was
    for bad in (0, 5, [], [1, 1], [4]):
        with pytest.raises(ValueError, match="runs must be"):
            ga.eval.select_runs(four, bad)


def test_lds_reports_the_ceiling_of_a_ground_truth_with_several_runs():
    gt = ga.eval.retrain(Noisy(sigma=2.0), N_TRAIN, n_subsets=30, seeds_per_subset=3, targets_fn=_identity,
                         target="loss")
    w = _weights()
    result = ga.eval.lds(-w, gt, bootstrap=0)
    assert result.ceiling == pytest.approx(ga.eval.reliability(gt, bootstrap=0).ceiling, abs=1e-15)
    assert f"ground-truth ceiling {result.ceiling:.2f}" in repr(result)
    assert ga.eval.lds(-w, gt, resample="both", bootstrap=50).ceiling == result.ceiling
    assert ga.eval.lds(-w, ga.eval.select_runs(gt, 1), bootstrap=0).ceiling is None   # one run: unknown
    assert "ceiling" not in repr(ga.eval.lds(-w, ga.eval.select_runs(gt, 1), bootstrap=0))
    assert ga.eval.lds(-w, {"masks": gt["masks"], "targets": gt["targets"]}, target="loss").ceiling is None
    inconsistent = gt.isel(run=[0, 1])                  # targets still the 3-run mean: no ceiling claimed
    assert ga.eval.lds(-w, inconsistent, bootstrap=0).ceiling is None
    np.testing.assert_allclose(ga.eval.retest_correlation(gt["runs"]),
                               ga.eval.reliability(gt, bootstrap=0).per_query.values, atol=0)


def test_a_transposed_ground_truth_is_read_by_dimension_names_not_positions():
    """gt.transpose(...) reorders the arrays' axes; reading them by position would swap
    subsets and runs (or subsets and queries) and return another number without an error."""
    gt = ga.eval.retrain(Noisy(sigma=2.0), N_TRAIN, n_subsets=30, seeds_per_subset=3, targets_fn=_identity,
                         target="loss")
    w = _weights()
    flipped = gt.transpose("query", "run", "subset", "train")
    assert flipped["runs"].dims == ("query", "run", "subset")
    rel, rel_flipped = ga.eval.reliability(gt, bootstrap=0), ga.eval.reliability(flipped, bootstrap=0)
    np.testing.assert_array_equal(rel_flipped.per_query.values, rel.per_query.values)
    assert rel_flipped.n_subsets == 30 and rel_flipped.runs == 3
    plain, from_flipped = ga.eval.lds(-w, gt, bootstrap=0), ga.eval.lds(-w, flipped, bootstrap=0)
    assert from_flipped.mean == plain.mean and from_flipped.ceiling == plain.ceiling
