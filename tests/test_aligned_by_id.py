"""Every function that pairs two results aligns them by id, never by position.

For each one: both sides permuted (and renamed consistently) give the number of the
aligned input; scores of other queries or examples, a subset or a superset, and
repeated ids are refused with an :class:`IdMismatchError` that names the ids and a fix,
and the fix is run. Sides without ids (NumPy, torch) are paired by position only when
their shapes agree. (docs/reliability.md, "Aligned by id".)
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
import xarray as xr

import gradalg as ga
from gradalg.errors import IdMismatchError, ShapeMismatchError

N_TRAIN, N_QUERY, M = 16, 5, 12


def _setup(noise: float = 0.0, seed: int = 0):
    """Scores τ (query, train) as a DataArray and a retrained ground truth whose targets
    are exactly additive in τ (noise 0: LDS 1.0 when paired right)."""
    rng = np.random.default_rng(seed)
    tau = rng.normal(size=(N_QUERY, N_TRAIN))
    jitter = rng.normal(size=(10_000, N_QUERY))
    calls = iter(range(10_000))

    def targets_fn(idx):
        return -tau[:, idx].sum(1) + noise * jitter[next(calls)]

    gt = ga.eval.retrain(lambda idx: idx, N_TRAIN, n_subsets=M, fraction=0.5, targets_fn=targets_fn, target="loss")
    scores = xr.DataArray(tau, dims=("query", "train"),
                          coords={"query": np.arange(N_QUERY), "train": np.arange(N_TRAIN)})
    return scores, gt


def _permutations(seed=1):
    rng = np.random.default_rng(seed)
    return rng.permutation(N_QUERY), rng.permutation(N_TRAIN), rng.permutation(M)


# ------------------------------------------------------------------------------------ LDS
def test_lds_of_an_additive_ground_truth_is_one_under_any_permutation_of_either_side():
    scores, gt = _setup()
    q, t, s = _permutations()
    assert ga.eval.lds(scores, gt, bootstrap=0).mean == pytest.approx(1.0, abs=1e-12)
    for permuted in (scores.isel(query=q), scores.isel(train=t), scores.isel(query=q, train=t),
                     scores.isel(query=q, train=t).T):
        assert ga.eval.lds(permuted, gt, bootstrap=0).mean == pytest.approx(1.0, abs=1e-12)
    shuffled_gt = gt.isel(query=q, train=t, subset=s)
    assert ga.eval.lds(scores.isel(train=t[::-1]), shuffled_gt, bootstrap=0).mean == pytest.approx(1.0, abs=1e-12)
    # masks and targets as separate DataArrays, each in its own subset order
    pieces = {"masks": gt["masks"].isel(subset=s), "targets": gt["targets"].isel(subset=s[::-1], query=q)}
    assert ga.eval.lds(scores.isel(train=t), pieces, target="loss", bootstrap=0).mean == pytest.approx(1.0, abs=1e-12)


def test_lds_of_permuted_and_renamed_inputs_equals_the_aligned_reference():
    scores, gt = _setup(noise=3.0)
    q, t, s = _permutations()
    reference = ga.eval.lds(scores, gt, bootstrap=200, seed=3, resample="both")
    assert 0.1 < reference.mean < 0.95          # a number that a misalignment would change
    labels_q = np.array([f"q{i}" for i in range(N_QUERY)])
    labels_t = np.array([f"doc-{i}" for i in range(N_TRAIN)])
    renamed_gt = gt.assign_coords(query=labels_q, train=labels_t)
    renamed_scores = scores.assign_coords(query=labels_q, train=labels_t)
    for sc, truth in ((scores.isel(query=q, train=t), gt),
                      (renamed_scores.isel(query=q, train=t).T, renamed_gt),
                      (renamed_scores, renamed_gt)):
        result = ga.eval.lds(sc, truth, bootstrap=200, seed=3, resample="both")
        assert result.mean == reference.mean
        np.testing.assert_array_equal(result.per_query.values, reference.per_query.values)
        assert result.interval == reference.interval
    per_query = ga.eval.lds(scores, gt.isel(query=q), bootstrap=0).per_query   # the ground truth's order
    np.testing.assert_array_equal(per_query["query"].values, q)
    np.testing.assert_allclose(per_query.sel(query=np.arange(N_QUERY)).values, reference.per_query.values, atol=0)
    # train_ids given to retrain label the masks as the scores are labelled
    relabelled = ga.eval.retrain(lambda idx: idx, N_TRAIN, n_subsets=M, fraction=0.5,
                                 targets_fn=lambda idx: -scores.values[:, idx].sum(1), target="loss",
                                 train_ids=labels_t, query_ids=labels_q)
    assert ga.eval.lds(renamed_scores.isel(train=t, query=q), relabelled, bootstrap=0).mean == pytest.approx(1.0)


def _refused(fn, *ids):
    with pytest.raises(IdMismatchError) as info:
        fn()
    text = str(info.value)
    for i in ids:
        assert repr(i) in text, (i, text)
    return info.value


def test_lds_refuses_other_missing_extra_and_repeated_ids_and_each_fix_works():
    scores, gt = _setup(noise=1.0)
    reference = ga.eval.lds(scores, gt, bootstrap=0)
    # scores of other queries altogether (was LDS 1.0 by position)
    err = _refused(lambda: ga.eval.lds(scores.assign_coords(query=np.arange(N_QUERY) + 100), gt), 100, 0)
    assert err.dim == "query" and err.missing == list(range(N_QUERY)) and isinstance(err, ShapeMismatchError)
    # a subset of the queries: refused, and the suggested explicit subset works
    some = scores.isel(query=[3, 1])
    err = _refused(lambda: ga.eval.lds(some, gt), 0, 2, 4)
    assert "ground_truth.sel(query=scores['query'])" in str(err)
    ground_truth = gt
    fixed = ga.eval.lds(some, ground_truth.sel(query=some["query"]), bootstrap=0)
    np.testing.assert_array_equal(fixed.per_query.values, reference.per_query.values[[3, 1]])
    # a superset of the queries
    more = xr.concat([scores, scores.isel(query=[0]).assign_coords(query=[77])], "query")
    err = _refused(lambda: ga.eval.lds(more, gt), 77)
    assert "scores.sel(query=ground_truth['query'])" in str(err)
    assert ga.eval.lds(more.sel(query=ground_truth["query"]), gt, bootstrap=0).mean == reference.mean
    # a superset of the training examples
    wider = xr.concat([scores, scores.isel(train=[0]).assign_coords(train=[500])], "train")
    err = _refused(lambda: ga.eval.lds(wider, gt), 500)
    assert ga.eval.lds(wider.sel(train=ground_truth["train"]), gt, bootstrap=0).mean == reference.mean
    # fewer training examples than the retrained models saw: no explicit fix changes the protocol
    _refused(lambda: ga.eval.lds(scores.isel(train=slice(0, 10)), gt), 10, 15)
    # string ids against retrain's positions: relabel the ground truth
    named = scores.assign_coords(train=[f"doc-{i}" for i in range(N_TRAIN)])
    err = _refused(lambda: ga.eval.lds(named, gt), "doc-0", 0)
    assert "assign_coords(train=scores['train'].values)" in str(err)
    assert ga.eval.lds(named, ground_truth.assign_coords(train=named["train"].values), bootstrap=0).mean == \
        reference.mean
    # repeated ids
    err = _refused(lambda: ga.eval.lds(scores.assign_coords(train=[0, 0] + list(range(2, N_TRAIN))), gt), 0)
    assert err.repeated == [0] and "combine_repeats" in str(err)
    err = _refused(lambda: ga.eval.lds(scores.assign_coords(query=[0, 1, 2, 3, 3]), gt), 3)
    # a ground truth whose masks and targets disagree on the subsets
    pieces = {"masks": gt["masks"], "targets": gt["targets"].assign_coords(subset=np.arange(M) + 1)}
    _refused(lambda: ga.eval.lds(scores, pieces, target="loss"), M)


def test_lds_pairs_sides_without_ids_by_position_only_when_shapes_agree():
    scores, gt = _setup(noise=1.0)
    reference = ga.eval.lds(scores, gt, bootstrap=0).mean
    for plain in (scores.values, torch.tensor(scores.values), torch.tensor(scores.values, dtype=torch.bfloat16)):
        value = ga.eval.lds(plain, gt, bootstrap=0).mean
        assert value == pytest.approx(reference, abs=0.05 if plain.dtype == torch.bfloat16 else 0)
    unlabelled = {"masks": gt["masks"].values, "targets": gt["targets"].values}
    assert ga.eval.lds(scores.isel(query=[1, 0, 2, 3, 4]), unlabelled, target="loss", bootstrap=0).mean != reference
    assert ga.eval.lds(scores, unlabelled, target="loss", bootstrap=0).mean == reference
    with pytest.raises(ShapeMismatchError, match="paired with the 16 train ids"):
        ga.eval.lds(scores.values[:, :-1], gt)
    with pytest.raises(ShapeMismatchError):
        ga.eval.lds(scores, {"masks": gt["masks"].values[:, :-1], "targets": gt["targets"].values}, target="loss")


def test_lds_ceiling_reads_runs_by_id():
    rng = np.random.default_rng(0)
    tau = rng.normal(size=(N_QUERY, N_TRAIN))
    gt = ga.eval.retrain(lambda idx: idx, N_TRAIN, n_subsets=M, fraction=0.5, seeds_per_subset=2, target="loss",
                         targets_fn=lambda idx: -tau[:, idx].sum(1) + torch.randn(N_QUERY).numpy())
    scores = xr.DataArray(tau, dims=("query", "train"))
    result = ga.eval.lds(scores.values, gt, bootstrap=0)
    assert result.ceiling is not None
    q, _, s = _permutations()
    pieces = {"masks": gt["masks"], "targets": gt["targets"].isel(query=q), "runs": gt["runs"].isel(subset=s)}
    assert ga.eval.lds(scores.values[q], pieces, target="loss", bootstrap=0).ceiling == pytest.approx(result.ceiling)


# ------------------------------------------------------------------------ leave-one-out
def test_loo_correlation_pairs_queries_and_removed_examples_by_id():
    rng = np.random.default_rng(2)
    tau = rng.normal(size=(N_QUERY, N_TRAIN))
    effect = rng.normal(size=(N_TRAIN, N_QUERY)) + 2 * tau.T        # a correlated, imperfect LOO effect
    removed = [3, 7, 1, 12, 9]
    loo = ga.eval.leave_one_out(lambda idx: idx, N_TRAIN, removed, lambda idx: effect.T @ np.isin(
        np.arange(N_TRAIN), idx, invert=True), target="loss")
    scores = xr.DataArray(tau, dims=("query", "train"),
                          coords={"query": np.arange(N_QUERY), "train": np.arange(N_TRAIN)})
    reference = ga.eval.loo_correlation(scores, loo, bootstrap=0)
    assert 0.2 < reference.mean < 0.99
    q, t, _ = _permutations()
    for sc in (scores.isel(query=q, train=t), scores.isel(train=t).T):
        result = ga.eval.loo_correlation(sc, loo, bootstrap=0)
        np.testing.assert_array_equal(result.per_query.values, reference.per_query.values)
    # by position without ids
    assert ga.eval.loo_correlation(tau, loo, bootstrap=0).mean == reference.mean
    # other queries; removed examples the scores lack; string ids and the fix
    _refused(lambda: ga.eval.loo_correlation(scores.assign_coords(query=np.arange(N_QUERY) + 9), loo), 9)
    _refused(lambda: ga.eval.loo_correlation(scores.isel(train=slice(0, 8)), loo), 12, 9)
    named = scores.assign_coords(train=[f"doc-{i}" for i in range(N_TRAIN)]).isel(train=t)
    err = _refused(lambda: ga.eval.loo_correlation(named, loo), 3, 7)
    assert "loo.assign_coords(removed=scores['train'].values[loo['removed'].values])" in str(err)
    ordered = scores.assign_coords(train=[f"doc-{i}" for i in range(N_TRAIN)])
    fixed = ga.eval.loo_correlation(named, loo.assign_coords(removed=ordered["train"].values[loo["removed"].values]),
                                    bootstrap=0)
    assert fixed.mean == reference.mean
    labelled = ga.eval.leave_one_out(lambda idx: idx, N_TRAIN, removed, lambda idx: effect.T @ np.isin(
        np.arange(N_TRAIN), idx, invert=True), target="loss", train_ids=ordered["train"].values)
    assert list(labelled["removed"].values) == [f"doc-{i}" for i in removed]
    assert ga.eval.loo_correlation(named, labelled, bootstrap=0).mean == reference.mean
    _refused(lambda: ga.eval.loo_correlation(scores.assign_coords(train=[0, 0] + list(range(2, N_TRAIN))), loo), 0)


# ------------------------------------------------------------ correlations, reliability
def test_spearman_and_pearson_of_two_dataarrays_pair_by_name_and_id():
    rng = np.random.default_rng(4)
    x = xr.DataArray(rng.normal(size=(6, 9)), dims=("query", "train"),
                     coords={"query": list("abcdef"), "train": np.arange(9)})
    y = x + rng.normal(size=x.shape)
    for f in (ga.eval.spearman, ga.eval.pearson):
        reference = f(x.values, y.values, axis=1)
        shuffled = y.isel(query=[5, 3, 1, 0, 2, 4], train=rng.permutation(9)).T
        np.testing.assert_array_equal(f(x, shuffled, axis=1), reference)
        assert not np.allclose(f(x.values, shuffled.T.values, axis=1), reference)    # by position: other numbers
        with pytest.raises(IdMismatchError, match="'z'"):
            f(x, y.assign_coords(query=list("abcdez")), axis=1)
        with pytest.raises(ShapeMismatchError, match="dimensions differ"):
            f(x, y.rename(train="example"), axis=1)
    predicted, actual = x.rename(query="subset", train="query"), y.rename(query="subset", train="query")
    reference = ga.eval.lds_resampled(predicted.values, actual.values, n_resamples=50)
    assert ga.eval.lds_resampled(predicted, actual.isel(subset=[2, 0, 1, 5, 4, 3]), n_resamples=50) == reference


def test_reliability_labels_its_queries_by_id():
    rng = np.random.default_rng(5)
    gt = ga.eval.retrain(lambda idx: idx, N_TRAIN, n_subsets=M, fraction=0.5, seeds_per_subset=2,
                         query_ids=[f"q{i}" for i in range(N_QUERY)],
                         targets_fn=lambda idx: rng.normal(size=N_QUERY) + np.arange(N_QUERY) * len(idx))
    reference = ga.eval.reliability(gt, bootstrap=0).per_query
    q, _, s = _permutations()
    shuffled = ga.eval.reliability(gt.isel(query=q, subset=s), bootstrap=0).per_query
    xr.testing.assert_allclose(shuffled.sel(query=reference["query"]), reference)
    pieces = {"runs": gt["runs"].isel(query=q)}
    assert list(ga.eval.reliability(pieces, bootstrap=0).per_query["query"].values) == [f"q{i}" for i in q]


def test_retrain_refuses_repeated_labels_before_training():
    calls = []

    def train_fn(idx):
        calls.append(idx)
        return idx

    for kwargs in ({"train_ids": [0] * N_TRAIN}, {"query_ids": ["a", "a", "b"]}):
        with pytest.raises(ga.DataError, match="repeat"):
            ga.eval.retrain(train_fn, N_TRAIN, n_subsets=3, targets_fn=lambda i: np.zeros(3), **kwargs)
        with pytest.raises(ga.DataError, match="repeat"):
            ga.eval.leave_one_out(train_fn, N_TRAIN, [1], lambda i: np.zeros(3), **kwargs)
    with pytest.raises(ShapeMismatchError, match="train_ids has 3 labels"):
        ga.eval.retrain(train_fn, N_TRAIN, n_subsets=3, targets_fn=lambda i: np.zeros(3), train_ids=[1, 2, 3])
    assert calls == []


# ------------------------------------------- lazy scores: sums, ensembles, stores, compiled
@pytest.fixture(scope="module")
def lazy():
    from models import classification_data, mlp

    torch.set_num_threads(1)
    X, y = classification_data(n=18, d_in=5, classes=3)
    tasks = [ga.tasks.classification(mlp(d_in=5, hidden=4, classes=3, seed=s)) for s in range(2)]
    perm = np.random.default_rng(7).permutation(12)
    return {"tasks": tasks, "train": (X[:12], y[:12]), "query": (X[12:], y[12:]), "perm": perm,
            "train_perm": (X[:12][perm], y[:12][perm]), "X": X, "y": y}


def _by_id(scores: xr.DataArray, like: xr.DataArray) -> np.ndarray:
    return scores.sel(query=like["query"], train=like["train"]).values


def test_a_sum_of_scores_over_reordered_or_other_examples_is_refused_and_the_fix_works(lazy):
    task, perm = lazy["tasks"][0], lazy["perm"]
    Q = ga.grads(task, lazy["query"])
    G = ga.grads(task, lazy["train"])
    Gp = ga.grads(task, lazy["train_perm"], ids=perm.tolist())      # the same examples, another order
    S1, S2 = Q @ G.T, Q @ Gp.T
    np.testing.assert_allclose(_by_id(S2.compute(), S1.compute()), S1.compute().values, rtol=1e-12)
    for bad in (lambda: S1 + S2, lambda: ga.mean([S1, S2]), lambda: ga.sum(S1, S2, weights=[1, 2])):
        with pytest.raises(IdMismatchError, match="another order") as info:
            bad()
        assert info.value.dim == "train" and "S2.compute().sel(query=a['query'], train=a['train'])" in str(info.value)
    a = S1.compute()
    b = S2.compute().sel(query=a["query"], train=a["train"])         # the fix the error names
    np.testing.assert_allclose((a + b).values, 2 * a.values, rtol=1e-12)
    Q_other = ga.grads(task, lazy["query"], ids=[f"q{i}" for i in range(6)])
    with pytest.raises(IdMismatchError, match="'q0'") as info:
        ga.mean([S1, Q_other @ G.T])
    assert info.value.dim == "query" and info.value.missing == list(range(6))
    with pytest.raises(IdMismatchError, match=r"\[10, 11\]"):
        S1 + Q @ ga.grads(task, (lazy["X"][:10], lazy["y"][:10])).T
    # a diagonal pairs the i-th query with the i-th training example: the same ids, in order
    with pytest.raises(IdMismatchError, match="another order"):
        (Gp @ G.T).diag()
    diag = (G @ G.T).diag().compute()
    np.testing.assert_allclose(diag.values, np.diag((G @ G.T).compute().values), rtol=1e-10)


def test_an_ensemble_over_a_reordered_training_set_gives_the_same_scores_by_id(lazy):
    tasks, perm = lazy["tasks"], lazy["perm"]
    E = ga.methods.ensemble(ga.methods.grad_dot, tasks, lazy["train"], lazy["query"]).compute()
    Ep = ga.methods.ensemble(ga.methods.grad_dot, tasks, ga.data.as_data(lazy["train_perm"], ids=perm.tolist()),
                             lazy["query"]).compute()
    assert list(Ep["train"].values) == perm.tolist()
    np.testing.assert_allclose(_by_id(Ep, E), E.values, rtol=1e-12)


def test_stores_keep_ids_and_refuse_rows_in_another_order(lazy, tmp_path):
    pytest.importorskip("zarr")
    from gradalg.errors import StoreMismatchError

    task, perm = lazy["tasks"][0], lazy["perm"]
    P = ga.proj.gaussian(k=6, seed=0)
    Q, G = ga.grads(task, lazy["query"]), ga.grads(task, lazy["train"])
    Gp = ga.grads(task, lazy["train_perm"], ids=perm.tolist())
    stored = ga.store.write(P(G), tmp_path / "g.zarr", chunk_rows=5)
    reference = (P(Q) @ P(G).T).compute()
    from_store = (P(Q) @ stored.T).compute()
    np.testing.assert_allclose(_by_id(from_store, reference), reference.values, rtol=1e-12)
    with pytest.raises(StoreMismatchError, match="another order"):
        ga.store.open(tmp_path / "g.zarr", like=P(Gp))
    with pytest.raises(StoreMismatchError, match="another order"):
        ga.store.write(P(Gp), tmp_path / "g.zarr", chunk_rows=5)
    fewer = ga.grads(task, (lazy["X"][:10], lazy["y"][:10]))
    with pytest.raises(StoreMismatchError, match=r"\[10, 11\]"):
        ga.store.open(tmp_path / "g.zarr", like=P(fewer))
    # a score store of the permuted training set reads back labelled by id
    written = ga.store.write_scores(P(Q) @ P(Gp).T, tmp_path / "s.zarr", chunk_rows=5)
    assert list(written["train"].values) == perm.tolist()
    np.testing.assert_allclose(_by_id(written.compute(), reference), reference.values, rtol=1e-12)
    # resuming a score store with the queries (or training examples) in another order is refused
    q_perm = [5, 4, 3, 2, 1, 0]
    Qp = ga.grads(task, (lazy["query"][0][q_perm], lazy["query"][1][q_perm]), ids=q_perm)
    with pytest.raises(StoreMismatchError, match="query ids differ .*another order"):
        ga.store.write_scores(P(Qp) @ P(Gp).T, tmp_path / "s.zarr", chunk_rows=5)
    with pytest.raises(StoreMismatchError, match="train ids differ .*another order"):
        ga.store.write_scores(P(Q) @ P(G).T, tmp_path / "s.zarr", chunk_rows=5)


def test_store_rows_with_other_ids_than_expected_are_refused():
    from gradalg.store.rows import check_row_ids

    check_row_ids((1, 2, 3), (1, 2, 3), "rows 0:3")
    with pytest.raises(ga.GradalgError, match=r"another order \(position 0: 2 and 1\)"):
        check_row_ids((2, 1, 3), (1, 2, 3), "rows 0:3")
    with pytest.raises(ga.GradalgError, match=r"\[9\]"):
        check_row_ids((1, 2, 9), (1, 2, 3), "rows 0:3")


def test_compiled_scores_of_reordered_queries_and_training_sets_match_by_id(lazy):
    task, perm = lazy["tasks"][0], lazy["perm"]
    Q, G = ga.grads(task, lazy["query"]), ga.grads(task, lazy["train"])
    S = Q @ ga.fisher(G).damp(0.1).inv() @ G.T
    reference = S.compute()
    C = ga.compile(S)
    q_perm = [4, 2, 0, 5, 1, 3]
    Qp = ga.grads(task, (lazy["query"][0][q_perm], lazy["query"][1][q_perm]), ids=q_perm)
    got = C.scores(Qp)
    assert list(got["query"].values) == q_perm
    np.testing.assert_allclose(_by_id(got, reference), reference.values, rtol=1e-10)
    Gp = ga.grads(task, lazy["train_perm"], ids=perm.tolist())
    other_order = C(Q @ ga.fisher(G).damp(0.1).inv() @ Gp.T)
    np.testing.assert_allclose(_by_id(other_order, reference), reference.values, rtol=1e-10)


def test_combine_repeats_is_by_id_whatever_the_order_of_the_rows(lazy):
    from gradalg.api import GradientSet
    from gradalg.capture.chunks import Chunk
    from gradalg.exec.local import LocalExecutor
    from gradalg.expr.stored import Stored
    from gradalg.store.rows import MemoryRows

    task = lazy["tasks"][0]
    P = ga.proj.gaussian(k=6, seed=0)
    G = P(ga.grads(task, lazy["train"]))
    rows = LocalExecutor().gradients(G.expr)
    ids = list(rows.ids) + list(rows.ids[:5])                       # five examples seen twice
    blocks = {k: torch.cat([v, 3 * v[:5]]) for k, v in rows.blocks.items()}

    def rows_in(order):
        chunk = Chunk(tuple(ids[i] for i in order), {k: v[list(order)] for k, v in blocks.items()})
        return GradientSet(Stored(MemoryRows(chunk, f"rows-{list(order)}", "rows"), G.space,
                                  tuple(G.expr.representation.items())))

    Q = P(ga.grads(task, lazy["query"]))
    order = np.random.default_rng(3).permutation(len(ids)).tolist()
    for how in ("sum", "mean"):
        a = (Q @ ga.integrations.combine_repeats(rows_in(range(len(ids))), how).T).compute()
        b = (Q @ ga.integrations.combine_repeats(rows_in(order), how).T).compute()
        np.testing.assert_allclose(_by_id(b, a), a.values, rtol=1e-12)
        seen = (Q @ G.T).compute().values
        expected = seen.copy()
        expected[:, :5] *= 4 if how == "sum" else 2
        np.testing.assert_allclose(a.values, expected, rtol=1e-12)


# ------------------------------------------------------- eval arguments (no raw errors)
def test_eval_takes_numpy_scalars_and_refuses_other_arguments_with_gradalg_errors():
    scores, gt = _setup(noise=1.0)
    reference = ga.eval.lds(scores, gt, bootstrap=20, confidence=0.9, seed=1)
    same = ga.eval.lds(scores, gt, bootstrap=np.int64(20), confidence=np.float32(0.9), seed=np.int32(1))
    assert same.mean == reference.mean and same.interval == pytest.approx(reference.interval)
    masks = ga.eval.subset_masks(np.int64(N_TRAIN), np.int32(4), np.float32(0.5), seed=np.int64(0))
    np.testing.assert_array_equal(masks, ga.eval.subset_masks(N_TRAIN, 4, 0.5, seed=0))
    bad = [lambda: ga.eval.lds(scores, gt, bootstrap="many"), lambda: ga.eval.lds(scores, gt, bootstrap=1.5),
           lambda: ga.eval.lds(scores, gt, confidence="high"), lambda: ga.eval.lds(scores, gt, seed="a"),
           lambda: ga.eval.lds(scores, gt, target=["loss"]), lambda: ga.eval.lds(scores, None, target="loss"),
           lambda: ga.eval.lds_bootstrap([0.1, 0.2], n_resamples=0),
           lambda: ga.eval.lds_resampled(np.zeros((3, 2)), np.zeros((3, 2)), confidence=1),
           lambda: ga.eval.subset_masks(N_TRAIN, 3, "half"), lambda: ga.eval.subset_size(N_TRAIN, None),
           lambda: ga.eval.retrain(lambda i: i, N_TRAIN, n_subsets=3, targets_fn=len, seed="x"),
           lambda: ga.eval.leave_one_out(lambda i: i, N_TRAIN, ["a"], len),
           lambda: ga.eval.leave_one_out(lambda i: i, N_TRAIN, [1], len, seed=0.5),
           lambda: ga.eval.reliability(gt, bootstrap=-1),
           lambda: ga.eval.reliability(gt),                 # one run per subset
           lambda: ga.eval.loo_correlation(scores, gt, target="loss")]          # not a LOO Dataset
    for call in bad:
        with pytest.raises(ga.GradalgError):
            call()
