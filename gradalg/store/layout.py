"""The on-disk layout shared by gradient and score stores, and its crash safety.

A store is a Zarr (v3) group written through xarray:

* the **template** (``to_zarr(..., compute=False)``): every variable's metadata, the
  coordinates (example ids) and the attributes, no chunk of data, written into a
  temporary directory renamed into place;
* one **region write** per chunk of rows (``to_zarr(region={dim: slice(a, b)})``): each
  variable's Zarr chunk is exactly the store chunk, so chunks never share a file;
* then that chunk's **done flag** (``done[i] = 1``, one Zarr chunk per flag).

Zarr's local store writes every file to a temporary name and renames it, so a file is
either the old one or the new one. A chunk whose flag is not set is rewritten whole
by the next write; a flag is set only after its chunk's data are on disk. A killed
writer can leave ``*.partial`` temporary files; they are removed on resume.
"""
from __future__ import annotations

import os
import shutil
import time
import uuid
from pathlib import Path

from typing import TYPE_CHECKING

import numpy as np

from ..errors import (IdMismatchError, MissingLibraryError, OptionError, StoreIncompleteError, StoreMismatchError,
                      StoreNotFoundError)
from . import integrity

if TYPE_CHECKING:                 # xarray loads when a result is made (about 76 MB)
    import xarray as xr

__all__ = ["require", "ids_array", "ids_tuple", "read_attrs", "done_flags", "prepare", "write_template",
           "write_region", "mark_done", "atomic_directory", "DELAY_ENV", "n_chunks", "with_metadata"]

DELAY_ENV = "GRADALG_STORE_TEST_DELAY"   # seconds to sleep between a chunk's data and its flag (tests)
FORMAT_VERSION = 1


def require() -> None:
    """ga.store needs zarr and dask (the ``[dask]`` extra); say how to install them."""
    try:
        import dask  # noqa: F401
        import zarr  # noqa: F401
    except ImportError as err:
        raise MissingLibraryError(f"ga.store needs zarr and dask ({err.name} is missing): "
                          "pip install 'gradalg[dask]'") from err


def with_metadata(attrs: dict, metadata: dict | None) -> dict:
    """``attrs`` plus the caller's extra attributes (which may not replace the store's own)."""
    if not metadata:
        return attrs
    clash = sorted(set(metadata) & (set(attrs) | {"dtype", "attrs_digest"}))
    if clash:
        raise OptionError(f"metadata may not set the store's own attributes {clash}: use other names")
    return dict(attrs, **metadata)


def n_chunks(n: int, chunk_rows: int) -> int:
    return max(1, -(-n // chunk_rows))


def ids_array(ids) -> np.ndarray:
    """Example ids as a numpy array Zarr can keep: int64 or (variable-length) strings."""
    ids = list(ids)
    if all(isinstance(i, (int, np.integer)) and not isinstance(i, bool) for i in ids):
        return np.asarray(ids, dtype=np.int64)
    if all(isinstance(i, str) for i in ids):
        return np.asarray(ids, dtype=object)
    kinds = sorted({type(i).__name__ for i in ids})
    raise OptionError(f"a store keeps example ids that are all ints or all strings; these are {kinds}. "
                    "Pass ids=[str(i) for i in ...] to ga.grads")


def ids_difference(first_name: str, second_name: str, first, second, dim: str) -> str:
    """One line saying how two id lists differ (a few missing, extra or repeated ids, or
    the same ids in another order): a store's rows are positional, so both must agree."""
    first, second = (list(x.tolist() if isinstance(x, np.ndarray) else x) for x in (first, second))
    missing, extra, repeated = IdMismatchError.difference(first, second)
    text = IdMismatchError.describe(missing, extra, repeated, first_name.removeprefix("the "), second_name, dim)
    at = next((i for i, (a, b) in enumerate(zip(first, second)) if a != b), None)
    if not (missing or extra or repeated) and at is not None:
        text = f"the same ids in another order (position {at}: {first[at]!r} and {second[at]!r})"
    return f"{first_name} differ from {second_name}: {text}"


def ids_tuple(values: np.ndarray) -> tuple:
    return tuple(values.tolist())


def open_dataset(path, *, chunks=None) -> xr.Dataset:
    """The store as an xarray Dataset (numpy-backed and lazy; ``chunks={}`` for Dask)."""
    import xarray as xr
    return xr.open_zarr(path, consolidated=False, chunks=chunks, mask_and_scale=False)


def read_attrs(path) -> dict | None:
    """The store's attributes, or None when ``path`` holds no gradalg store template."""
    try:
        ds = open_dataset(path)
    except Exception:   # noqa: BLE001 - not a Zarr group (or a template cut short)
        return None
    attrs = dict(ds.attrs)
    if "gradalg_store" not in attrs or "done" not in ds.variables:
        return None
    return attrs


def done_flags(path) -> np.ndarray:
    """(chunks,) bool: which chunks are complete (a flag whose file is damaged reads as
    not done, so its chunk is written again)."""
    try:
        return open_dataset(path)["done"].values.astype(bool)
    except Exception:  # noqa: BLE001 - a damaged flag file: read the flags one by one
        import zarr
        arr = zarr.open_array(str(Path(path) / "done"), mode="r")
        out = np.zeros(arr.shape, dtype=bool)
        for i in range(arr.shape[0]):
            try:
                out[i] = bool(arr[i])
            except Exception:  # noqa: BLE001
                out[i] = False
        return out


def unmark(path, indices) -> None:
    """Clear the flags of chunks ``indices`` (damaged: the next write rewrites them)."""
    import xarray as xr
    for index in indices:
        xr.Dataset({"done": (("chunk",), np.zeros(1, dtype=np.uint8))}).to_zarr(
            path, region={"chunk": slice(index, index + 1)}, consolidated=False, write_empty_chunks=True)


def is_gradalg_store(path) -> bool:
    """Whether ``path`` is a directory holding a gradalg store (its group metadata names
    one), even a damaged one; a partial template or any other directory is not."""
    import json
    path = Path(path)
    if not path.is_dir():
        return False
    try:
        meta = json.loads((path / "zarr.json").read_text())
    except OSError:
        return False
    except ValueError:    # group metadata damaged: still a store if it has the layout's arrays
        return (path / "done" / "zarr.json").is_file()
    return isinstance(meta, dict) and "gradalg_store" in (meta.get("attributes") or {})


def _describe_value(key: str, value) -> str:
    if key == "projector" and isinstance(value, list):
        from ..expr.projection import Projector
        try:
            return "[" + ", ".join(repr(Projector(**p)) for p in value) + "]"
        except (TypeError, ValueError):
            pass
    if key == "blocks" and isinstance(value, list):
        value = [(b.get("name"), tuple(b.get("shape", ())), b.get("basis")) for b in value]
    text = repr(value)
    return text if len(text) <= 200 else text[:200] + "…"


# a difference in these makes the blocks differ too: blocks are reported only without them
_IMPLY_BLOCKS = ("projector", "layers")


def compare(stored: dict, new: dict, keys, what: str, fix: str) -> None:
    """Raise :class:`StoreMismatchError` naming every key whose value differs."""
    problems = []
    differ = [key for key in keys if stored.get(key) != new.get(key)]
    for key in differ:
        if key == "blocks" and any(k in differ for k in _IMPLY_BLOCKS):
            continue
        if key == "expression_digest":
            problems.append(f"the expression differs (its data, transforms or operators): the store holds "
                            f"{stored.get('expression')!r}, {what} is {new.get('expression')!r}")
        else:
            problems.append(f"{key}: the store has {_describe_value(key, stored.get(key))}, {what} has "
                            f"{_describe_value(key, new.get(key))}")
    if problems:
        raise StoreMismatchError(problems, fix)


def prepare(path, attrs: dict, ids: np.ndarray, keys, *, overwrite: bool, kind: str, verify: bool = False,
            other_ids: dict | None = None) -> str:
    """Decide how to write ``path``: "new" (no store yet: write the template), "resume"
    (a matching store with unfinished or damaged chunks) or "complete" (nothing to do).

    A store written from something else is refused with :class:`StoreMismatchError`;
    ``overwrite=True`` deletes only a gradalg store (anything else is refused). Damaged
    chunks of a matching store (missing or failing their checksum, see
    :mod:`gradalg.store.integrity`) are unflagged, so that they are written again; the
    checksums are read when resuming or when ``verify``. ``ids`` are the chunked
    dimension's; ``other_ids`` ({dim: ids}, e.g. a score store's queries) are compared too,
    before the expression digest, so that the error names the ids that differ.
    """
    path = Path(path)
    for leftover in path.parent.glob(f".{path.name}.*.partial"):   # a killed template or operator write
        shutil.rmtree(leftover, ignore_errors=True)
    if overwrite and path.exists():
        remove_store(path)
    if not path.exists():
        return "new"
    old = read_attrs(path)
    if old is None:
        raise StoreMismatchError([f"{path} exists and is not a gradalg store"],
                                 "choose another path, or pass overwrite=True to replace it")
    if old.get("gradalg_store") != kind:
        raise StoreMismatchError([f"{path} is a {old.get('gradalg_store')} store, not a {kind} store"],
                                 "choose another path, or pass overwrite=True to replace it")
    fix = "pass overwrite=True to replace the store, or write to another path"
    compare(old, attrs, [k for k in keys if k != "expression_digest"], "this write", fix)
    ds = open_dataset(path)
    dim = "example" if kind == "gradients" else "train"
    stored_ids = ds[dim].values
    if stored_ids.shape != ids.shape or not np.array_equal(stored_ids, ids):
        raise StoreMismatchError([ids_difference(f"the store's {dim} ids", "this write's", stored_ids, ids, dim)], fix)
    for other_dim, other in (other_ids or {}).items():
        stored_other = ds[other_dim].values
        if stored_other.shape != other.shape or not np.array_equal(stored_other, other):
            raise StoreMismatchError([ids_difference(f"the store's {other_dim} ids", "this write's", stored_other,
                                                     other, other_dim)], fix)
    compare(old, attrs, [k for k in keys if k == "expression_digest"], "this write", fix)
    for leftover in path.rglob("*.partial"):
        leftover.unlink(missing_ok=True)
    flags = done_flags(path)
    # repair: chunks flagged done whose files are missing or fail their checksum are
    # unflagged and rewritten (a full read when resuming, a stat per file otherwise)
    report = integrity.scan(path, full=verify or not flags.all())
    if -1 in report.damaged_chunks or (report.problems and not report.damaged_chunks):
        report.raise_if_damaged("The damage is outside the chunked rows (ids or attributes): write the "
                                "store again with overwrite=True")
    if report.damaged_chunks:
        unmark(path, report.damaged_chunks)
        flags = done_flags(path)
    return "complete" if flags.all() else "resume"


def remove_store(path) -> None:
    """Delete the gradalg store at ``path`` (``overwrite=True``); refuse anything else."""
    path = Path(path)
    if path.is_dir() and not any(path.iterdir()):
        path.rmdir()
        return
    if not is_gradalg_store(path):
        what = "a file" if path.is_file() else "a directory"
        raise StoreMismatchError(
            [f"{path} is {what} that is not a gradalg store"],
            "overwrite=True replaces only gradalg stores: choose another path, or delete it yourself")
    shutil.rmtree(path)


def store_path(path):
    """``path`` checked to be a str or ``os.PathLike`` (an OptionError naming the fix otherwise)."""
    if not isinstance(path, (str, os.PathLike)) or (isinstance(path, str) and not path):
        raise OptionError(f"a store's path must be a folder name (a str or pathlib.Path), got {path!r:.80}")
    return path


def write_template(path, template: xr.Dataset) -> None:
    """Metadata, coordinates and attributes; no data chunk (they are written per chunk).

    Written into a temporary sibling renamed into place: ``path`` holds a whole template
    or nothing, never one cut short."""
    template = template.copy()
    template.attrs = integrity.seal(dict(template.attrs))
    encoding = integrity.checksum_encoding(template)
    atomic_directory(path, lambda tmp: template.to_zarr(tmp, mode="w", compute=False, consolidated=False,
                                                        encoding=encoding, write_empty_chunks=True),
                     overwrite=False)


def write_region(path, variables: dict, dim: str, start: int, stop: int) -> None:
    """Rows ``start:stop`` of each variable (``{name: (dims, array)}``) along ``dim``."""
    import xarray as xr
    xr.Dataset(variables).to_zarr(path, region={dim: slice(start, stop)}, consolidated=False,
                                  write_empty_chunks=True)


def mark_done(path, index: int) -> None:
    """Set chunk ``index``'s flag, after its data (sleeping ``$GRADALG_STORE_TEST_DELAY``
    seconds first, so that tests can interrupt a writer between the two)."""
    import xarray as xr
    delay = float(os.environ.get(DELAY_ENV, "0") or 0)
    if delay > 0:
        time.sleep(delay)
    xr.Dataset({"done": (("chunk",), np.ones(1, dtype=np.uint8))}).to_zarr(
        path, region={"chunk": slice(index, index + 1)}, consolidated=False, write_empty_chunks=True)


def check_complete(path, kind: str, write_call: str) -> xr.Dataset:
    """The store's Dataset (numpy-backed, lazy) if it is a finished ``kind`` store."""
    attrs = read_attrs(path)
    if attrs is None:
        if not Path(path).exists():
            raise StoreNotFoundError(f"no store at {path}")
        try:
            other = open_dataset(path).attrs.get("gradalg_store")
        except Exception:  # noqa: BLE001 - not a Zarr group
            other = None
        if other == "operator":
            raise StoreMismatchError([f"{path} is an operator store, not a {kind} store"],
                                     "open it with ga.store.open_operator")
        raise StoreIncompleteError(f"{path} is not a finished gradalg store (its template is missing or "
                                   f"was cut short): write it again with {write_call}")
    if attrs.get("gradalg_store") != kind:
        raise StoreMismatchError([f"{path} is a {attrs.get('gradalg_store')} store, not a {kind} store"],
                                 f"open it with ga.store.open{'' if attrs.get('gradalg_store') == 'gradients' else '_' + str(attrs.get('gradalg_store'))}")
    flags = done_flags(path)
    if not flags.all():
        missing = np.flatnonzero(~flags)
        raise StoreIncompleteError(
            f"{path} is unfinished: {len(missing)} of {len(flags)} chunks are not written (first: "
            f"{missing[:5].tolist()}). Run {write_call} again with the same arguments to finish it "
            "(only the missing chunks are computed)")
    # cheap checks on open (a stat per chunk file; checksums are verified as chunks are read)
    integrity.scan(path, full=False).raise_if_damaged()
    return open_dataset(path)


def atomic_directory(path, build, *, overwrite: bool) -> None:
    """Write a whole directory at once: ``build(tmp)`` fills a temporary sibling, which is
    then renamed to ``path`` (a rename is atomic; replacing an old store is two renames)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.partial")
    try:
        build(tmp)
        if path.exists():
            if not overwrite:
                raise FileExistsError(path)
            trash = path.with_name(f".{path.name}.{uuid.uuid4().hex}.old")
            os.rename(path, trash)
            os.rename(tmp, path)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.rename(tmp, path)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
