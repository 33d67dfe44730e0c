"""Ground truth by retraining: random-subset retraining (for LDS) and leave-one-out.

``retrain(train_fn, n_train, n_subsets=M, fraction=α, targets_fn=...)`` trains the
user's ``train_fn(indices) -> model`` on M random subsets of ⌊α·n⌉ training examples and
records ``targets_fn(model)`` for each; ``leave_one_out`` trains once on everything and
once without each listed example. Both return an :class:`xarray.Dataset`.

Reproducibility
    Subset j is drawn from ``numpy.random.default_rng([seed, j])``: it depends only on
    ``seed``, ``j``, α and n, so asking for more subsets later keeps the first ones.
    Before every call of ``train_fn`` the global RNGs of torch, numpy and ``random`` are
    seeded with that run's *training seed* (and restored afterwards), so a ``train_fn``
    that draws its initialisation or batch order from them is deterministic (one that
    seeds itself can read the seed as ``torch.initial_seed()``).

Several training runs per subset
    ``seeds_per_subset=k`` trains every subset k times with k training seeds and
    averages the targets: a ground truth less noisy than one run, and the input of
    :func:`gradalg.eval.reliability`, which measures how repeatable the targets are and
    so the highest LDS any scores can reach on them.

Resuming
    With ``store=path`` (a directory), each finished run is written to its own ``.npz``
    file, atomically (a temporary file in the same directory, then ``os.replace``). A
    rerun with the same store loads the finished runs and trains only the missing ones;
    an interrupted write leaves no partial file under a run's name. The store's
    ``meta.json`` records what the runs depend on, and a rerun with other settings is
    refused rather than mixed in; each run's file records its training seed, and a run
    stored with another seed is refused too. ``seeds_per_subset`` is not among the
    settings: a rerun with a larger k keeps the stored runs and trains only the new ones.

    >>> gt = ga.eval.retrain(train_fn, 500, n_subsets=50, fraction=0.5,
    ...                      targets_fn=query_losses, store="cache/lds")
    >>> gt
    <xarray.Dataset>
    Dimensions:  (subset: 50, train: 500, query: 100)
    Data variables:
        masks    (subset, train) bool ...
        targets  (subset, query) float64 ...
        runs     (subset, run, query) float64 ...
"""
from __future__ import annotations

import contextlib
from collections import Counter
import json
import os
import random
import tempfile
import time
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np
import torch

from ..errors import DataError, GradalgError, OptionError, ShapeMismatchError
from . import arguments

if TYPE_CHECKING:                 # xarray loads when a result is made (about 76 MB)
    import xarray as xr

__all__ = ["retrain", "leave_one_out", "subset_masks", "subset_size", "select_runs"]

_STORE_VERSION = 1


# ----------------------------------------------------------------------------- subsets
def subset_size(n_train: int, fraction: float) -> int:
    """Examples per subset: round(α · n), at least 1."""
    n_train = arguments.count("n_train", n_train)
    return max(1, round(arguments.fraction("fraction", fraction) * n_train))


def subset_masks(n_train: int, n_subsets: int, fraction: float, seed: int = 0) -> np.ndarray:
    """The (n_subsets, n_train) bool masks of :func:`retrain`.

    Row j holds exactly ``subset_size(n_train, fraction)`` True entries, drawn without
    replacement by ``numpy.random.default_rng([seed, j])``; it does not depend on
    ``n_subsets``.
    """
    n_subsets, seed = arguments.count("n_subsets", n_subsets), arguments.integer("seed", seed)
    size = subset_size(n_train, fraction)
    masks = np.zeros((n_subsets, n_train), dtype=bool)
    for j in range(n_subsets):
        masks[j, _subset_rng(seed, j).permutation(n_train)[:size]] = True
    return masks


def _run_seed(seed: int, run: int, replicate: int = 0) -> int:
    """The training seed of run ``run`` of a retraining with ``seed`` (a 31-bit int);
    ``replicate`` r ≥ 1 is the subset's (r + 1)-th training run (``seeds_per_subset``)."""
    entropy = [int(seed), int(run), 0x7E7] + ([int(replicate)] if replicate else [])
    return int(np.random.SeedSequence(entropy).generate_state(1)[0] >> 1)


def _training_seed(seed: int, j: int, replicate: int, training_seed: int | None) -> int:
    """Subset j's training seed for its run ``replicate``: derived from (seed, j, replicate),
    or ``training_seed + replicate`` (every subset shares the run's seed)."""
    return _run_seed(seed, j, replicate) if training_seed is None else int(training_seed) + int(replicate)


def _run_name(j: int, replicate: int) -> str:
    return f"subset-{j:06d}" if replicate == 0 else f"subset-{j:06d}-run{replicate:02d}"


def _subset_rng(seed: int, j: int) -> np.random.Generator:
    return np.random.default_rng([int(seed), int(j)])


# ------------------------------------------------------------------------------ public
def retrain(train_fn: Callable[[np.ndarray], Any], n_train: int, *, n_subsets: int, fraction: float = 0.5,
            targets_fn: Callable[[Any], Any], seed: int = 0, training_seed: int | None = None,
            seeds_per_subset: int = 1, store: str | os.PathLike | None = None,
            query_ids: Sequence | None = None, train_ids: Sequence | None = None, target: str | None = None,
            progress: bool = False) -> xr.Dataset:
    """Retrain on ``n_subsets`` random subsets and record each model's targets.

    Parameters
    ----------
    train_fn : ``train_fn(indices) -> model``, ``indices`` a sorted int64 array of the
        training examples to train on (positions 0..n_train-1 of the training set, in
        the order of the scores' ``train`` axis).
    n_train : size of the full training set.
    n_subsets : M, the number of subsets (≥ 50 is usual for LDS).
    fraction : α, the fraction of the training set in each subset.
    targets_fn : ``targets_fn(model) -> (n_query,)`` tensor or array: the measured
        outcome per query, e.g. each query's loss or margin.
    seed : draws the subsets (and the training seeds, unless ``training_seed`` is given).
    training_seed : None (default): subset j is trained with its own seed,
        derived from (``seed``, j); an int: every subset with this seed, so that
        the targets differ only through the data.
    seeds_per_subset : k ≥ 1, training runs per subset. Run r of subset j is trained
        with the seed above for r = 0 and, for r ≥ 1, with one derived from
        (``seed``, j, r), or ``training_seed + r`` when ``training_seed`` is given (then
        every subset's run r shares a seed). ``targets`` is the mean of the k runs,
        ``runs`` keeps each; with k ≥ 2 :func:`gradalg.eval.reliability` tells how
        repeatable they are. k = 1 trains exactly what earlier versions trained.
    store : a directory for resumable results (created if missing), or None.
    query_ids : labels of the queries, in the order of ``targets_fn``'s values (default
        0..n_query-1): the ``query`` coordinate, by which :func:`gradalg.eval.lds` pairs
        the ground truth with the scores' query ids.
    train_ids : labels of the training examples, in the order ``train_fn``'s indices
        count them (default 0..n_train-1): the ``train`` coordinate, by which ``lds``
        pairs the masks with the scores' train ids (pass the ids the scores carry, e.g.
        ``ga.grads(task, data, ids=...)``'s, when they are not the positions).
    target : optional label recorded in ``attrs["target"]`` ("loss" or "margin"),
        which :func:`gradalg.eval.lds` reads when it is not told.
    progress : print one line per trained subset.

    Returns
    -------
    xarray.Dataset with
        ``masks``   (subset, train) bool          which examples each model saw
        ``targets`` (subset, query) float64       ``targets_fn`` of the subset's models, averaged
        ``runs``    (subset, run, query) float64  ``targets_fn`` of each of its k models
    and attrs ``n_train``, ``fraction``, ``seed``, ``seeds_per_subset``,
    ``kind="subsets"`` (and ``training_seed``, ``target`` when given).
    """
    import xarray as xr
    _check_callable(train_fn, "train_fn")
    _check_callable(targets_fn, "targets_fn")
    _check_target(target)
    seeds_per_subset = arguments.count("seeds_per_subset", seeds_per_subset)
    if training_seed is not None:
        training_seed = arguments.integer("training_seed", training_seed)
    masks = subset_masks(n_train, n_subsets, fraction, seed)
    train_labels = _labels(train_ids, n_train, "train_ids", "training examples")
    _early_query_check(query_ids)
    meta = {"kind": "subsets", "n_train": int(n_train), "fraction": float(fraction), "seed": int(seed),
            "training_seed": None if training_seed is None else int(training_seed)}
    runs = _RunStore(store, meta)
    targets = []                                      # subset-major: run r of subset j at j·k + r
    for j in range(n_subsets):
        indices = np.flatnonzero(masks[j])
        for r in range(int(seeds_per_subset)):
            name, run_seed = _run_name(j, r), _training_seed(seed, j, r, training_seed)
            stored = runs.load(name, indices, run_seed)
            if stored is None:
                label = f"subset {j + 1}/{n_subsets}" + (f", run {r + 1}/{seeds_per_subset}"
                                                          if seeds_per_subset > 1 else "")
                stored = _run(train_fn, targets_fn, indices, run_seed, progress, label)
                runs.save(name, indices, stored, run_seed)
            targets.append(stored)
    values = _stack(targets).reshape(n_subsets, int(seeds_per_subset), -1)      # (M, k, n_query)
    attrs = {**{k: v for k, v in meta.items() if v is not None}, "seeds_per_subset": int(seeds_per_subset),
             **({"target": target} if target else {})}
    return xr.Dataset(
        {"masks": (("subset", "train"), masks), "targets": (("subset", "query"), values.mean(axis=1)),
         "runs": (("subset", "run", "query"), values)},
        coords={"subset": np.arange(n_subsets), "train": train_labels, "run": np.arange(values.shape[1]),
                "query": _labels(query_ids, values.shape[2], "query_ids", "targets")},
        attrs=attrs,
    )


def select_runs(ground_truth: xr.Dataset, runs) -> xr.Dataset:
    """The ground truth of :func:`retrain` restricted to some of its training runs.

    ``runs``: an int k (the first k runs of every subset) or a sequence of run indices.
    Returns the same Dataset with ``runs`` (subset, run, query) holding only those and
    ``targets`` their mean: what ``retrain(..., seeds_per_subset=k)`` returns for the first k
    (``ground_truth.isel(run=...)`` alone would keep the mean over all runs in ``targets``).
    """
    if "runs" not in ground_truth:
        raise DataError("select_runs needs the ground truth's individual runs ('runs', from ga.eval.retrain)")
    k = ground_truth.sizes["run"]
    if isinstance(runs, (int, np.integer)) and not isinstance(runs, bool):
        if not 1 <= runs <= k:
            raise OptionError(f"runs must be between 1 and the {k} runs per subset stored, got {runs}")
        chosen = np.arange(int(runs))
    else:
        chosen = np.asarray(list(runs), dtype=np.int64).reshape(-1)
        if chosen.size == 0 or chosen.min() < 0 or chosen.max() >= k or np.unique(chosen).size != chosen.size:
            raise OptionError(f"runs must be distinct indices in [0, {k}), got {list(chosen)}")
    out = ground_truth.isel(run=chosen)
    out["targets"] = out["runs"].mean("run")
    out.attrs = {**ground_truth.attrs, "seeds_per_subset": int(chosen.size)}
    return out


def leave_one_out(train_fn: Callable[[np.ndarray], Any], n_train: int, indices: Sequence[int],
                  targets_fn: Callable[[Any], Any], *, seed: int = 0, store: str | os.PathLike | None = None,
                  query_ids: Sequence | None = None, train_ids: Sequence | None = None,
                  target: str | None = None, progress: bool = False) -> xr.Dataset:
    """Retrain without each of ``indices`` (and once on everything) with one training seed.

    Every run, the full one included, is trained with the same training seed ``seed``
    (global RNGs seeded as in :func:`retrain`), so a difference in targets is due to the
    removed example alone (for a ``train_fn`` whose randomness comes from those RNGs).

    Returns
    -------
    xarray.Dataset with
        ``base``    (query,)            targets of the model trained on all n examples
        ``targets`` (removed, query)    targets of the model trained without example i
        ``effect``  (removed, query)    ``targets − base``: the effect of removing i
    coordinate ``removed``: the removed examples' ids, ``indices`` themselves (positions
    0..n_train-1 in the order ``train_fn`` counts) or, with ``train_ids`` (labels of the
    training examples in that order), ``train_ids[indices]``;
    :func:`gradalg.eval.loo_correlation` reads the scores' columns by these ids. ``query``:
    ``query_ids`` (default 0..n_query-1). Attrs ``n_train``, ``seed``, ``kind="loo"``.
    """
    import xarray as xr
    _check_callable(train_fn, "train_fn")
    _check_callable(targets_fn, "targets_fn")
    _check_target(target)
    n_train, seed = arguments.count("n_train", n_train, 2), arguments.integer("seed", seed)
    removed = np.asarray(indices.detach().cpu() if isinstance(indices, torch.Tensor) else indices).reshape(-1)
    if removed.size and (removed.dtype.kind not in "iu"):
        raise OptionError(f"indices must be integer positions in [0, {n_train}), got {removed[:5].tolist()} "
                          f"({removed.dtype})")
    removed = removed.astype(np.int64)
    if removed.size == 0:
        raise OptionError("leave_one_out needs at least one index to remove")
    if removed.min() < 0 or removed.max() >= n_train:
        raise OptionError(f"indices must lie in [0, {n_train}), got values in [{removed.min()}, {removed.max()}]")
    if np.unique(removed).size != removed.size:
        raise OptionError("indices must not repeat")
    train_labels = _labels(train_ids, n_train, "train_ids", "training examples")
    _early_query_check(query_ids)
    meta = {"kind": "loo", "n_train": int(n_train), "seed": int(seed)}
    runs = _RunStore(store, meta)
    everything = np.arange(n_train, dtype=np.int64)

    def one(name, keep, label):
        stored = runs.load(name, keep, int(seed))
        if stored is None:
            stored = _run(train_fn, targets_fn, keep, int(seed), progress, label)
            runs.save(name, keep, stored, int(seed))
        return stored

    base = one("full", everything, "full training set")
    rows = [one(f"loo-{i:09d}", np.delete(everything, i), f"without {i} ({k + 1}/{removed.size})")
            for k, i in enumerate(removed)]
    values = _stack(rows)
    if values.shape[1] != base.shape[0]:
        raise ShapeMismatchError(f"targets_fn returned {base.shape[0]} values for the full model and "
                         f"{values.shape[1]} for the others")
    attrs = {**meta, **({"target": target} if target else {})}
    return xr.Dataset(
        {"base": (("query",), base), "targets": (("removed", "query"), values),
         "effect": (("removed", "query"), values - base[None, :])},
        coords={"removed": train_labels[removed], "query": _labels(query_ids, base.shape[0], "query_ids", "targets")},
        attrs=attrs,
    )


# ----------------------------------------------------------------------------- running
def _check_callable(fn, what):
    if not callable(fn):
        raise OptionError(f"{what} must be a callable, got {type(fn).__name__}")


def _check_target(target):
    if target is not None and target not in ("loss", "margin"):
        raise OptionError(f"target must be 'loss', 'margin' or None, got {target!r}")


def _run(train_fn, targets_fn, indices, run_seed, progress, label) -> np.ndarray:
    start = time.perf_counter()
    with _seeded(run_seed):
        model = train_fn(indices.copy())
        values = _as_targets(targets_fn(model))
    if progress:
        print(f"retrained {label}: {indices.size} examples, {time.perf_counter() - start:.2f} s", flush=True)
    return values


def _as_targets(values) -> np.ndarray:
    if isinstance(values, torch.Tensor):
        values = values.detach().to("cpu", torch.float64).numpy()
    array = np.asarray(values, dtype=np.float64)
    if array.ndim > 1:
        array = array.squeeze()
    if array.ndim == 0:
        array = array.reshape(1)
    if array.ndim != 1:
        raise ShapeMismatchError(f"targets_fn must return a (n_query,) vector, got shape {np.shape(values)}")
    return array


def _stack(rows: list[np.ndarray]) -> np.ndarray:
    sizes = {r.shape[0] for r in rows}
    if len(sizes) != 1:
        raise ShapeMismatchError(f"targets_fn returned vectors of different lengths {sorted(sizes)} across runs "
                         "(a store written for other queries? use a new store path)")
    return np.stack(rows)


def _early_query_check(query_ids) -> None:
    """Refuse repeated or unhashable ``query_ids`` before any training (their number is
    checked against the targets once ``targets_fn`` has run)."""
    if query_ids is not None:
        values = np.asarray(query_ids.detach().cpu() if isinstance(query_ids, torch.Tensor) else query_ids)
        _labels(values, values.shape[0] if values.ndim else 1, "query_ids", "queries")


def _labels(ids, n: int, name: str, what: str) -> np.ndarray:
    """``ids`` (one unique label per item, n of them) as a coordinate; 0..n-1 when None."""
    if ids is None:
        return np.arange(n)
    values = np.asarray(ids.detach().cpu() if isinstance(ids, torch.Tensor) else ids)
    if values.shape != (n,):
        raise ShapeMismatchError(f"{name} has {values.size} labels (shape {values.shape}) for {n} {what}")
    try:
        repeated = [i for i, c in Counter(values.tolist()).items() if c > 1]
    except TypeError as err:
        raise DataError(f"{name} must be ints or strings, got {values.dtype}") from err
    if repeated:
        raise DataError(f"{name} repeat: {repeated[:8]}; give each of the {n} {what} its own label")
    return values


@contextlib.contextmanager
def _seeded(seed: int):
    """Seed torch, numpy and ``random`` with ``seed``; restore their states afterwards."""
    py_state, np_state = random.getstate(), np.random.get_state()
    cuda = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=cuda):
        torch.manual_seed(seed)
        np.random.seed(seed % 2**32)
        random.seed(seed)
        try:
            yield
        finally:
            random.setstate(py_state)
            np.random.set_state(np_state)


# ------------------------------------------------------------------------------- store
class _RunStore:
    """One ``.npz`` per finished run in a directory, written atomically; or nothing."""

    def __init__(self, path, meta: dict):
        self.path = None if path is None else Path(path)
        if self.path is None:
            return
        self.path.mkdir(parents=True, exist_ok=True)
        meta = {"version": _STORE_VERSION, **meta}
        meta_file = self.path / "meta.json"
        if meta_file.exists():
            found = json.loads(meta_file.read_text())
            diff = {k: (found.get(k), v) for k, v in meta.items() if found.get(k) != v}
            if diff:
                text = ", ".join(f"{k}: stored {a!r}, asked {b!r}" for k, (a, b) in diff.items())
                raise GradalgError(f"the store {self.path} holds runs of other settings ({text}); "
                                   "use another store path or delete this one")
        else:
            _atomic_write(meta_file, lambda f: f.write(json.dumps(meta, indent=1, sort_keys=True).encode()))

    def load(self, name: str, indices: np.ndarray, run_seed: int) -> np.ndarray | None:
        if self.path is None:
            return None
        file = self.path / f"{name}.npz"
        if not file.exists():
            return None
        try:
            with np.load(file) as data:
                stored_indices, targets = data["indices"], data["targets"]
                stored_seed = int(data["training_seed"]) if "training_seed" in data.files else None
        except (zipfile.BadZipFile, OSError, ValueError, KeyError, EOFError) as err:
            raise GradalgError(f"{file} is damaged ({type(err).__name__}: {err}); delete it and run again: that "
                               "run alone is retrained") from err
        if not np.array_equal(stored_indices, indices):
            raise GradalgError(f"{file} was trained on other examples than this run draws (a store "
                               "written by another version?); use another store path or delete it")
        if stored_seed is not None and stored_seed != int(run_seed):
            raise GradalgError(f"{file} was trained with training seed {stored_seed}, this run asks for "
                               f"{int(run_seed)} (a store written by another version?); use another store "
                               "path or delete it")
        return np.asarray(targets, dtype=np.float64)

    def save(self, name: str, indices: np.ndarray, targets: np.ndarray, run_seed: int) -> None:
        if self.path is None:
            return
        _atomic_write(self.path / f"{name}.npz", lambda f: _write_run(f, indices, targets, run_seed))


def _write_run(file, indices: np.ndarray, targets: np.ndarray, run_seed: int) -> None:
    np.savez(file, indices=indices, targets=targets, training_seed=np.int64(run_seed))


def _atomic_write(target: Path, write: Callable) -> None:
    """Write through ``write(file)`` to a temporary file beside ``target``, then rename."""
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
