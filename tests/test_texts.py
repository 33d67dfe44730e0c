"""Documents, not ids: ``S.topk(k, texts=)``, ``ga.store.write(..., texts=)`` and an index's
``search`` return each training row's document, aligned by training id (permuted ids get
their own text) from a list, a dict, a callable, a ``datasets`` column or a JSONL file; an
id without text is refused with the fix; texts round-trip through a store on disk;
``ga.report.highlight`` colours a document's tokens by per-token scores."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import gradalg as ga
from gradalg.errors import DataError, OptionError

D, N, NQ = 6, 40, 3


def linear_task():
    torch.manual_seed(0)
    model = torch.nn.Linear(D, 1, bias=False).double()
    return ga.Task(model, lambda m, b: m(b[0]).sum())


@pytest.fixture(scope="module")
def setting():
    g = torch.Generator().manual_seed(0)
    X = torch.randn(N, D, generator=g, dtype=torch.float64)
    Xq = torch.randn(NQ, D, generator=g, dtype=torch.float64)
    ids = [int(i) for i in np.random.default_rng(1).permutation(1000)[:N]]   # ids not their positions
    task = linear_task()
    G = ga.grads(task, (X,), ids=ids)
    Q = ga.grads(task, (Xq,))
    docs = {i: f"document number {i}" for i in ids}
    return {"task": task, "G": G, "Q": Q, "X": X, "Xq": Xq, "ids": ids, "docs": docs}


def dense_topk(s, k):
    """Reference: scores <x_q, x_i> (the gradients of a linear model with loss = its output)."""
    full = (s["Xq"] @ s["X"].T).numpy()
    order = np.argsort(-full, axis=1, kind="stable")[:, :k]
    return np.take_along_axis(full, order, 1), np.asarray(s["ids"])[order]


def assert_texts_match(top, s):
    for t, text in zip(np.ravel(top["train"].values), np.ravel(top["text"].values)):
        assert text == f"document number {t}"


@pytest.mark.parametrize("source", ["list", "dict", "callable", "dataset", "jsonl", "jsonl_keyed"])
def test_topk_texts_align_by_id(setting, source, tmp_path):
    s = setting
    ids = s["ids"]
    in_order = [s["docs"][i] for i in ids]
    if source == "list":
        texts = in_order
    elif source == "dict":
        texts = dict(reversed(list(s["docs"].items())))
    elif source == "callable":
        texts = s["docs"].get
    elif source == "dataset":
        datasets = pytest.importorskip("datasets")
        texts = datasets.Dataset.from_dict({"text": in_order})["text"]
    else:
        f = tmp_path / "docs.jsonl"
        rows = [{"id": i, "body": t} for i, t in zip(ids, in_order)]
        if source == "jsonl_keyed":
            rows = rows[::-1]                        # another order: read by id
        f.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
        texts = ga.report.jsonl_texts(f, field="body", id_field="id" if source == "jsonl_keyed" else None)
    S = s["Q"] @ s["G"].T
    top = S.topk(5, texts=texts)
    values, train = dense_topk(s, 5)
    np.testing.assert_allclose(top.values, values, rtol=1e-12)
    np.testing.assert_array_equal(top["train"].values, train)
    assert top["text"].dims == ("query", "rank")
    assert_texts_match(top, s)
    frame = ga.report.documents_frame(top)
    assert list(frame.columns) == ["query", "rank", "train", "score", "text"] and len(frame) == NQ * 5
    assert (frame["text"] == [f"document number {t}" for t in frame["train"]]).all()
    np.testing.assert_allclose(frame["score"].values, values.ravel(), rtol=1e-12)


def test_missing_text_is_refused_with_the_fix(setting):
    s = setting
    S = s["Q"] @ s["G"].T
    partial = dict(list(s["docs"].items())[1:])
    with pytest.raises(DataError, match="no text for 1 of the 40 training examples.*give a text for every"):
        S.topk(3, texts=partial)
    with pytest.raises(DataError, match="has 39 texts for 40 examples"):
        S.topk(3, texts=[s["docs"][i] for i in s["ids"]][1:])
    best = int(S.topk(1)["train"].values[0, 0])
    with pytest.raises(DataError, match=f"no text for training example \\[{best}\\].*give a text"):
        S.topk(1, texts=lambda i: None if i == best else s["docs"][i])
    with pytest.raises(OptionError, match="takes a list of texts"):
        S.topk(1, texts="one string")
    top = S.topk(2)
    with pytest.raises(OptionError, match="pass ids="):
        ga.report.with_texts(top, [s["docs"][i] for i in s["ids"]])
    got = ga.report.with_texts(top, [s["docs"][i] for i in s["ids"]], ids=s["ids"])
    assert_texts_match(got, s)


def test_store_round_trip_and_index(setting, tmp_path):
    s = setting
    P = ga.proj.gaussian(4, seed=0)
    path = tmp_path / "g.zarr"
    with pytest.raises(DataError, match="no text for"):
        ga.store.write(P(s["G"]), path, texts={s["ids"][0]: "only one"})
    assert not path.exists() or ga.store.texts(path) is None
    with ga.options(progress=False):
        stored = ga.store.write(P(s["G"]), path, chunk_rows=16, texts=[s["docs"][i] for i in s["ids"]])
    assert ga.store.texts(path) == s["docs"]
    top = (P(s["Q"]) @ stored.T).topk(4, texts=ga.store.texts(path))
    ref = (P(s["Q"]) @ P(s["G"]).T).topk(4)
    np.testing.assert_array_equal(top["train"].values, ref["train"].values)
    np.testing.assert_allclose(top.values, ref.values, rtol=1e-12)
    assert_texts_match(top, s)
    pytest.importorskip("faiss")
    idx = ga.store.index(path, kind="flat")
    found = idx.search(P(s["Q"]), 4)                      # the store's texts, by default
    np.testing.assert_array_equal(found["train"].values, ref["train"].values)
    assert_texts_match(found, s)
    other = idx.search(P(s["Q"]), 2, texts={i: f"document number {i}" for i in s["ids"]})
    assert_texts_match(other, s)


def test_store_without_texts_has_none(setting, tmp_path):
    P = ga.proj.gaussian(4, seed=0)
    with ga.options(progress=False):
        ga.store.write(P(setting["G"]), tmp_path / "g.zarr")
    assert ga.store.texts(tmp_path / "g.zarr") is None
    (tmp_path / "g.zarr.texts.jsonl").write_text("{\"id\": 0, \"text\": \"stale\"}\n")
    with ga.options(progress=False):
        ga.store.write(P(setting["G"]), tmp_path / "g.zarr", overwrite=True)
    assert ga.store.texts(tmp_path / "g.zarr") is None      # a rewritten store forgets older texts


def test_highlight_colours_tokens_by_score():
    out = ga.report.highlight(["The", " cat", "<b>"], [2.0, -1.0, float("nan")])
    assert out._repr_html_() == str(out)
    spans = out.split("<span")[1:]
    assert "rgba(211,47,47,0.85)" in spans[0] and "The" in spans[0]          # the largest positive: full red
    assert "rgba(25,118,210,0.42)" in spans[1]                               # half as large, negative: blue
    assert "style" not in spans[2] and "&lt;b&gt;" in spans[2]               # NaN: white; escaped
    with pytest.raises(OptionError, match="one document's per-token scores"):
        ga.report.highlight(["a"], np.zeros((2, 2)))


def test_with_texts_on_a_score_matrix_and_pairs_round_trip(setting, tmp_path):
    s = setting
    full = (s["Q"] @ s["G"].T).compute()
    shuffled = full.isel(train=np.random.default_rng(0).permutation(N))      # ids in another order
    got = ga.report.with_texts(shuffled, s["docs"])
    assert got["text"].dims == ("train",)
    assert list(got["text"].values) == [f"document number {t}" for t in got["train"].values]
    in_order = [s["docs"][i] for i in s["ids"]]
    with pytest.raises(OptionError, match="pass ids="):      # the matrix's order is not the data's
        ga.report.with_texts(shuffled, in_order)
    got = ga.report.with_texts(shuffled, in_order, ids=s["ids"])
    assert list(got["text"].values) == [f"document number {t}" for t in got["train"].values]
    from gradalg.store.documents import texts as read_texts, write_texts
    pairs = {i: (f"prompt {i}", f" completion {i}") for i in s["ids"]}
    write_texts(tmp_path / "x.zarr", s["ids"], pairs)
    assert read_texts(tmp_path / "x.zarr") == pairs
