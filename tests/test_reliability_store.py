"""Damaged stores never read as good, and interrupted work resumes to the same numbers.

Damage: a deleted chunk file, a flipped bit, a truncated chunk, edited attributes, a
deleted done flag. Each is found by ``ga.store.verify`` (naming the file), refused on
open or read with a StoreCorruptError, and repaired by writing again (only the damaged
chunks are recomputed; the repaired store is bitwise the original). ``overwrite=True``
refuses to delete what is not a store. Interruptions (an exception raised inside the
loss) at capture, statistics and store-writing stages leave nothing behind: the next
computation gives the reference numbers.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import gradalg as ga
import gradalg.store.gradients as store_gradients

sys.path.insert(0, os.path.dirname(__file__))
import models  # noqa: E402

pytest.importorskip("zarr")


@pytest.fixture(scope="module")
def setting():
    model = models.mlp()
    X, y = models.classification_data(n=20)
    task = ga.tasks.classification(model)
    P = ga.proj.gaussian(k=6, seed=0)
    return task, P(ga.grads(task, (X, y))), P(ga.grads(task, (X[:3], y[:3])))


@pytest.fixture
def written(setting, tmp_path):
    _, G, Q = setting
    path = tmp_path / "g.zarr"
    stored = ga.store.write(G, path, chunk_rows=8)
    return path, (Q @ stored.T).compute().values, _files(path)


def _files(path) -> dict:
    return {str(p.relative_to(path)): p.read_bytes() for p in Path(path).rglob("*") if p.is_file()}


def _chunk(path, var="projected", index=1) -> Path:
    return Path(path) / var / "c" / str(index) / "0"


def _count_chunk_writes(monkeypatch) -> list:
    written = []
    real = store_gradients._write_chunk

    def spy(path, attrs, index, rows):
        written.append(index)
        return real(path, attrs, index, rows)

    monkeypatch.setattr(store_gradients, "_write_chunk", spy)
    return written


def _flip(file: Path, at: float = 0.5) -> None:
    data = bytearray(file.read_bytes())
    data[int(len(data) * at)] ^= 0x10
    file.write_bytes(bytes(data))


def test_an_intact_store_verifies(written):
    path, _, _ = written
    report = ga.store.verify(path)
    assert report.ok and report.chunks == 3 and not report.damaged_chunks


@pytest.mark.parametrize("damage", ["delete", "flip", "truncate", "empty"])
def test_damaged_chunks_are_found_refused_and_repaired(setting, written, monkeypatch, damage):
    _, G, Q = setting
    path, want, original = written
    file = _chunk(path)
    if damage == "delete":
        file.unlink()
    elif damage == "flip":
        _flip(file)
    elif damage == "truncate":
        file.write_bytes(file.read_bytes()[:9])
    else:
        file.write_bytes(b"")
    report = ga.store.verify(path)
    assert not report.ok and report.damaged_chunks == [1]
    assert str(file) in repr(report)
    with pytest.raises(ga.StoreCorruptError, match="chunk 1"):
        stored = ga.store.open(path)     # missing/empty files are seen on open ...
        (Q @ stored.T).compute()         # ... checksums as chunks are read
    writes = _count_chunk_writes(monkeypatch)
    repaired = ga.store.write(G, path, chunk_rows=8, verify=True)
    assert writes == [1]                                  # only the damaged chunk
    assert _files(path) == original                       # bitwise the original store
    np.testing.assert_array_equal((Q @ repaired.T).compute().values, want)


def test_a_deleted_done_flag_rewrites_its_chunk(setting, written, monkeypatch):
    _, G, _ = setting
    path, _, original = written
    (Path(path) / "done" / "c" / "2").unlink()
    with pytest.raises(ga.StoreIncompleteError):
        ga.store.open(path)
    writes = _count_chunk_writes(monkeypatch)
    ga.store.write(G, path, chunk_rows=8)
    assert writes == [2] and _files(path) == original


@pytest.mark.parametrize("edit", [("model_fingerprint", ["model-0000"]), ("n", 21), ("chunk_rows", 4)])
def test_edited_attributes_are_refused(written, edit):
    path, _, _ = written
    meta_file = Path(path) / "zarr.json"
    meta = json.loads(meta_file.read_text())
    meta["attributes"][edit[0]] = edit[1]
    meta_file.write_text(json.dumps(meta))
    assert not ga.store.verify(path).ok
    with pytest.raises(ga.StoreCorruptError, match="attributes"):
        ga.store.open(path)


def test_edited_block_shapes_are_checked_against_the_arrays(written):
    """Even with a recomputed seal, attributes that contradict the arrays are refused."""
    from gradalg.store.integrity import seal
    path, _, _ = written
    meta_file = Path(path) / "zarr.json"
    meta = json.loads(meta_file.read_text())
    meta["attributes"]["blocks"][0]["shape"] = [5]
    meta["attributes"] = seal(meta["attributes"])
    meta_file.write_text(json.dumps(meta))
    with pytest.raises(ga.StoreCorruptError, match="shape"):
        ga.store.open(path)


def test_overwrite_refuses_what_is_not_a_store(setting, tmp_path):
    _, G, _ = setting
    precious = tmp_path / "results"
    precious.mkdir()
    (precious / "notes.txt").write_text("keep me")
    for write in (lambda p: ga.store.write(G, p, overwrite=True),
                  lambda p: ga.store.write_operator(ga.fisher(G), p, overwrite=True)):
        with pytest.raises(ga.StoreMismatchError, match="not a gradalg store"):
            write(precious)
        assert (precious / "notes.txt").read_text() == "keep me"
    a_file = tmp_path / "file.zarr"
    a_file.write_text("x")
    with pytest.raises(ga.StoreMismatchError):
        ga.store.write(G, a_file, overwrite=True)
    empty = tmp_path / "empty"
    empty.mkdir()
    ga.store.write(G, empty, overwrite=True)     # an empty directory holds nothing to lose
    assert ga.store.verify(empty).ok


def test_a_damaged_operator_store_is_refused(setting, tmp_path):
    _, G, _ = setting
    path = tmp_path / "fisher.zarr"
    ga.store.write_operator(ga.fisher(G), path)
    chunk = next(p for p in (path / "dense").rglob("*") if p.is_file() and p.name != "zarr.json")
    _flip(chunk)
    assert not ga.store.verify(path).ok
    H = ga.store.open_operator(path)
    with pytest.raises(ga.StoreCorruptError):
        H.to_dense()


# ------------------------------------------------------------------ interruptions
class Interrupting:
    """A summed cross-entropy that raises KeyboardInterrupt on call ``at`` (once)."""

    def __init__(self, at):
        self.at, self.calls = at, 0

    def __call__(self, model, batch):
        self.calls += 1
        if self.calls == self.at:
            raise KeyboardInterrupt("interrupted")
        x, y = batch
        return F.cross_entropy(model(x), y, reduction="sum")


@pytest.mark.parametrize("stage", ["scores", "fisher", "store"])
def test_an_interrupted_computation_leaves_nothing_behind(setting, tmp_path, stage):
    task0, _, _ = setting
    model = task0.model
    X, y = models.classification_data(n=20)
    loss = Interrupting(at=4)
    task = ga.Task(model, loss, name="interrupting")
    G, Q = ga.grads(task, (X, y), batch_size=4), ga.grads(task, (X[:3], y[:3]))
    P = ga.proj.gaussian(k=6, seed=1)
    run = {"scores": lambda: (Q @ G.T).compute().values,
           "fisher": lambda: ga.fisher(P(G)).to_dense().numpy(),
           "store": lambda: (P(Q) @ ga.store.write(P(G), tmp_path / "s.zarr", chunk_rows=4).T).compute().values}[stage]
    hooks_before = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
    was_training = model.training
    with pytest.raises(KeyboardInterrupt):
        run()
    assert sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()) == hooks_before
    assert "forward" not in model.__dict__ and model.training == was_training
    got = run()
    reference = ga.tasks.classification(model)
    Gr, Qr = ga.grads(reference, (X, y)), ga.grads(reference, (X[:3], y[:3]))
    want = {"scores": lambda: (Qr @ Gr.T).compute().values,
            "fisher": lambda: ga.fisher(P(Gr)).to_dense().numpy(),
            "store": lambda: (P(Qr) @ P(Gr).T).compute().values}[stage]()
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)
    if stage == "store":
        assert ga.store.verify(tmp_path / "s.zarr").ok
