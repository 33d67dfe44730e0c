"""The scores caches of ``benchmarks/defaults_suite.py`` (digits / lm settings) and
``benchmarks/fidelity_ensembles.py`` are keyed by label and checked against the row's
expression token, as the standard rows' caches are (``fidelity_lm.cache_is_current``): an
entry written under another default, or before tokens were kept, is recomputed, not served.
Also the suite's one-block twins: one pooled λ is the per-block λ where the damped matrix has
one block (so the row may be copied), and not where it has several."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch.utils.data import TensorDataset

import gradalg as ga
from gradalg.linalg.autodamp import DampingRule

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import models  # noqa: E402
from references import one_thread  # noqa: E402,F401 - one intra-op thread in this module
import defaults_suite as D  # noqa: E402
import fidelity_ensembles as E  # noqa: E402
import fidelity_lm as L  # noqa: E402
import fidelity_text as T  # noqa: E402


@pytest.fixture(scope="module")
def tiny():
    model = models.mlp(seed=0)                               # blocks "0" (16, 9), "2" (3, 17): 195 coords
    x, y = models.classification_data(20, seed=1)
    xq, yq = models.classification_data(4, seed=2)
    return SimpleNamespace(model=model, task=ga.tasks.classification(model), train=TensorDataset(x, y),
                           queries=TensorDataset(xq, yq), layers=None)


def _rewrite(path: Path, **changes):
    """Rewrite a cached .npz with some fields replaced (None: dropped)."""
    with np.load(path) as z:
        fields = {k: z[k] for k in z.files}
    for k, v in changes.items():
        if v is None:
            fields.pop(k, None)
        else:
            fields[k] = v
    np.savez(path, **fields)


def test_defaults_suite_cache_serves_only_the_current_expression(tiny, tmp_path, monkeypatch):
    monkeypatch.setattr(D, "BUILD", tmp_path)
    cache = D._own_cache("tiny")

    def thunk():
        return ga.methods.grass(tiny.task, tiny.train, tiny.queries, k=4)

    expected = np.asarray(thunk().compute().transpose("query", "train").values)       # (4, 20)
    values, _, base, path = cache("grass", "row", thunk, 0.5)
    np.testing.assert_array_equal(values, expected)
    with np.load(path) as z:
        assert str(z["token"]) == thunk().expr.token and float(z["base"]) == 0.5

    _rewrite(Path(path), values=np.zeros_like(expected))                 # same token: served as stored
    np.testing.assert_array_equal(cache("grass", "row", thunk, 0.5)[0], 0.0)

    _rewrite(Path(path), token=np.asarray("another expression"))          # another token: recomputed
    np.testing.assert_array_equal(cache("grass", "row", thunk, 0.5)[0], expected)
    with np.load(path) as z:
        assert str(z["token"]) == thunk().expr.token

    _rewrite(Path(path), values=np.zeros_like(expected), token=None)     # no token (older entry): recomputed
    np.testing.assert_array_equal(cache("grass", "row", thunk, 0.5)[0], expected)

    # the method's default changes: the same call under the same label is recomputed at the new default
    np.testing.assert_array_equal(cache("grass", "row", thunk, 0.5)[0], expected)
    monkeypatch.setitem(ga.methods.grass.__kwdefaults__, "relative_damping", 1.0)
    fresh = np.asarray(thunk().compute().transpose("query", "train").values)
    assert not np.allclose(fresh, expected)
    np.testing.assert_array_equal(cache("grass", "row", thunk, 0.5)[0], fresh)


def test_with_options_row_is_recomputed_when_its_default_or_options_change(tiny, tmp_path, monkeypatch):
    """A row computed under ga.options (fidelity_lm.WithOptions: the vocabulary-factor-diagonal
    rows) is cached under its expression's token and its options. Before, it had no token and
    its cache was served whatever changed: the 2026-12-05 K-FAC / EK-FAC rows with
    kron_diagonal_width=512 kept the earlier 0.1 × mean damping after the per-block default
    (issue 31), while the rows beside them were recomputed."""
    monkeypatch.setattr(T, "BUILD", tmp_path)
    p = SimpleNamespace(key="tiny", n_query=4, train=tiny.train)

    def row(width=8, **kw):
        return lambda: L.WithOptions(ga.methods.influence(tiny.task, tiny.train, tiny.queries, curvature="kfac",
                                                          **kw), kron_diagonal_width=width)

    def fresh(thunk):
        return np.asarray(thunk().compute().transpose("query", "train").values)      # (4, 20)

    earlier, now = row(relative_damping=0.1), row()                       # 0.1 × mean, then λ_b per block
    assert L.expression_token(now()) == f"{now().scores.expr.token}|ga.options(kron_diagonal_width=8)"
    assert L.expression_token(now()) != L.expression_token(row(width=4)())
    assert L.expression_token(now()) != L.expression_token(earlier())
    old = T.cached_scores(p, "influence", "K-FAC, diagonal", earlier, 0.5)[0].values
    np.testing.assert_array_equal(old, fresh(earlier))
    new = T.cached_scores(p, "influence", "K-FAC, diagonal", now, 0.5)[0].values
    assert not np.allclose(new, old)                                      # the default moved the scores
    np.testing.assert_array_equal(new, fresh(now))
    wider = T.cached_scores(p, "influence", "K-FAC, diagonal", row(width=16384), 0.5)[0].values
    np.testing.assert_array_equal(wider, fresh(row(width=16384)))          # another option: recomputed
    assert not np.allclose(wider, new)


def test_ensemble_row_token_follows_the_methods_defaults(tiny, monkeypatch):
    ctx = SimpleNamespace(members=SimpleNamespace(base=tiny.model), task=ga.tasks.classification,
                          train=tiny.train, queries=tiny.queries)
    token = E.row_token(ctx, "grass", {"k": 4})
    assert token == ga.methods.grass(tiny.task, tiny.train, tiny.queries, k=4).expr.token
    assert E.row_token(ctx, "grass", {"k": 4}) == token                                   # stable
    assert E.row_token(ctx, "grass", {"k": 4, "damping": 1e-3}) != token                  # the arguments
    monkeypatch.setitem(ga.methods.grass.__kwdefaults__, "damping", None)                 # a default changes
    assert E.row_token(ctx, "grass", {"k": 4}) != token


def test_ensemble_cache_serves_only_the_current_token(tmp_path):
    path, calls = tmp_path / "ensemble-row.npz", []

    def compute():
        calls.append(1)
        return np.full((2, 3), float(len(calls))), 7.0, 0.25

    values, seconds, base = E.cached_ensemble(path, "tok-a", compute)
    assert (values == 1.0).all() and (seconds, base) == (7.0, 0.25) and len(calls) == 1
    assert (E.cached_ensemble(path, "tok-a", compute)[0] == 1.0).all() and len(calls) == 1   # served
    assert (E.cached_ensemble(path, "tok-b", compute)[0] == 2.0).all() and len(calls) == 2   # another token
    with np.load(path) as z:
        assert str(z["token"]) == "tok-b"
    _rewrite(path, token=None)
    assert (E.cached_ensemble(path, "tok-b", compute)[0] == 3.0).all() and len(calls) == 3   # no token


def test_one_pooled_lambda_is_the_per_block_lambda_on_one_block(tiny):
    """Projected into one k-block, TRAK's kernel (and TrackStar's R) damped by one pooled λ is
    damped by the block's own λ: the same scores, which the suite's twin rows rely on. Unprojected
    (two layer blocks) they differ, and ``damped_blocks`` says so."""
    pooled = DampingRule("mass", 0.95, per_block=False)
    opt = torch.optim.Adam(tiny.model.parameters())
    loss = torch.nn.functional.cross_entropy(tiny.model(tiny.train.tensors[0]), tiny.train.tensors[1])
    loss.backward()
    opt.step()
    opt.zero_grad()
    calls = {"trak": lambda k, d: ga.methods.trak(tiny.task, tiny.train, tiny.queries, k=k, damping=d),
             "trackstar": lambda k, d: ga.methods.trackstar(tiny.task, tiny.train, tiny.queries, optimizer=opt,
                                                            k=k, damping=d)}
    for method, call in calls.items():
        assert D.damped_blocks(tiny, method, {"k": 8}) == 1
        assert D.damped_blocks(tiny, method, {"k": 4096}) == 2
        one = [np.asarray(call(8, d).compute().values) for d in ("auto", pooled)]
        # equal up to round-off (3e-16 in float64: the two rules reach the same λ by other operations)
        np.testing.assert_allclose(one[0], one[1], rtol=1e-12, atol=1e-15)
        two = [np.asarray(call(4096, d).compute().values) for d in ("auto", pooled)]
        assert not np.allclose(two[0], two[1])
    assert D.damped_blocks(tiny, "grass", {"k": 4}) == 2
    assert D.damped_blocks(tiny, "influence", {}) is None


# ------------------------------------------------------------ committed ground truths
def _toy_retrain(store, train_fn, n_subsets=3, k=2, seed=0):
    """A retraining ground truth whose 'model' is its subset and whose targets are sums of
    fixed per-example values, each run shifted by its training seed (so runs differ)."""
    values = np.arange(1.0, 9.0).reshape(8, 1) * np.array([[1.0, -2.0]])        # (n_train=8, n_query=2)

    def targets_fn(model):
        indices, run_seed = model
        return values[indices].sum(0) + run_seed

    return ga.eval.retrain(train_fn, 8, n_subsets=n_subsets, fraction=0.5, seed=seed, training_seed=0,
                           targets_fn=targets_fn, seeds_per_subset=k, store=store, target="loss")


def test_a_packed_ground_truth_is_served_to_retrain_without_training(tmp_path):
    import ground_truths as GT
    trained = []

    def train_fn(indices):
        trained.append(tuple(indices))
        return np.asarray(indices), torch.initial_seed()

    built = _toy_retrain(tmp_path / "toy-key", train_fn)
    assert len(trained) == 6
    archive = GT.pack(tmp_path / "toy-key", archives=tmp_path / "archives")
    assert archive.name == "toy-key.tar.gz"
    assert GT.pack(tmp_path / "toy-key", archives=tmp_path / "again").read_bytes() == archive.read_bytes()

    fresh = tmp_path / "clone" / "toy-key"
    assert GT.seed_store(fresh, archives=tmp_path / "archives") == 7          # meta.json + 6 runs
    assert GT.seed_store(fresh, archives=tmp_path / "archives") == 0          # nothing twice

    def refuse(indices):
        raise AssertionError("a committed run was trained again")

    served = _toy_retrain(fresh, refuse)
    np.testing.assert_array_equal(served.runs.values, built.runs.values)
    np.testing.assert_array_equal(served.masks.values, built.masks.values)
    # a third run per subset is not in the archive: only it is trained
    trained.clear()
    more = _toy_retrain(fresh, train_fn, k=3)
    assert len(trained) == 3
    np.testing.assert_array_equal(more.runs.values[:, :2], built.runs.values)
    assert GT.seed_store(tmp_path / "no-archive", archives=tmp_path / "archives") == 0


def test_a_ground_truth_archive_of_other_settings_is_refused_not_served(tmp_path):
    import ground_truths as GT

    def train_fn(indices):
        return np.asarray(indices), torch.initial_seed()

    _toy_retrain(tmp_path / "toy-key", train_fn, seed=0)
    GT.pack(tmp_path / "toy-key", archives=tmp_path / "archives")
    GT.seed_store(tmp_path / "clone" / "toy-key", archives=tmp_path / "archives")
    with pytest.raises(ga.GradalgError, match="holds runs of other settings"):
        _toy_retrain(tmp_path / "clone" / "toy-key", train_fn, seed=1)          # other subsets drawn


def test_every_committed_ground_truth_archive_unpacks_into_a_store():
    import tarfile

    import ground_truths as GT
    for archive in sorted(GT.ARCHIVES.glob("*.tar.gz")):
        with tarfile.open(archive, "r:gz") as tar:
            names = [m.name for m in GT._members(tar)]
            meta = json.loads(tar.extractfile("meta.json").read())
        assert "meta.json" in names and meta["kind"] == "subsets", archive.name
        assert any(n.endswith(".npz") for n in names), archive.name
