"""Store integrity: checksums on every chunk, sealed attributes, and a scan that finds
what is damaged.

* Every array of a store is written with Zarr's ``crc32c`` codec after compression, so
  a flipped bit or a truncated file fails to decode instead of reading as other numbers
  (Zarr checks the checksum on every read).
* Chunks are written even when all their values equal the fill value
  (``write_empty_chunks=True``), so a chunk file that is absent is always damage, never
  a chunk of zeros.
* The attributes are *sealed*: ``attrs_digest`` is a digest of all the others, written
  with the template. Attributes edited by hand (block shapes, model fingerprints) no
  longer match it; :func:`check_attrs` also checks them against the arrays (variables,
  shapes, chunking, dtype, number of ids).

:func:`verify` reads every finished chunk (checksums), lists the damaged ones with their
files; ``ga.store.write`` uses :func:`scan` on resume and rewrites only those chunks.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import StoreCorruptError, StoreNotFoundError
from .layout import store_path

__all__ = ["verify", "VerifyReport", "scan", "checksum_encoding", "seal", "check_attrs", "ATTRS_DIGEST"]

ATTRS_DIGEST = "attrs_digest"
# the dimension along which a store is written chunk by chunk, per kind
ROW_DIM = {"gradients": "example", "scores": "train"}


def checksum_encoding(ds) -> dict:
    """to_zarr encoding that adds a crc32c checksum to every variable's chunks."""
    from zarr.codecs import Crc32cCodec, ZstdCodec

    out = {}
    for name, var in ds.variables.items():
        if var.dtype == object or var.dtype.kind in "UO":
            continue     # variable-length strings: Zarr's own vlen codec (ids; checked against the data)
        out[name] = {"compressors": (ZstdCodec(level=0), Crc32cCodec())}
    return out


def seal(attrs: dict) -> dict:
    """``attrs`` with ``attrs_digest``: a digest of all the other attributes."""
    from .describe import digest

    body = {k: v for k, v in attrs.items() if k != ATTRS_DIGEST}
    return dict(body, **{ATTRS_DIGEST: digest(body)})


@dataclass
class VerifyReport:
    """What :func:`verify` found. Truthy when the store is intact.

    damaged_chunks : store chunk indices (rows ``i*chunk_rows:(i+1)*chunk_rows``) whose
        files are missing or fail their checksum; rewritten by ``ga.store.write`` with
        the same arguments.
    problems : one line per problem, naming the file.
    """

    path: str
    kind: str | None
    chunks: int = 0
    damaged_chunks: list = field(default_factory=list)
    unfinished_chunks: list = field(default_factory=list)
    problems: list = field(default_factory=list)

    def __bool__(self) -> bool:
        return not self.problems

    @property
    def ok(self) -> bool:
        """True when no problem was found (the report is also truthy then)."""
        return not self.problems

    def __repr__(self) -> str:
        if self.ok:
            extra = f", {len(self.unfinished_chunks)} unfinished" if self.unfinished_chunks else ""
            return f"VerifyReport({self.path}: intact, {self.chunks} chunks{extra})"
        lines = "\n  ".join(self.problems[:20])
        more = "" if len(self.problems) <= 20 else f"\n  ... ({len(self.problems) - 20} more)"
        return f"VerifyReport({self.path}: {len(self.problems)} problem(s)\n  {lines}{more})"

    def raise_if_damaged(self, fix: str | None = None) -> None:
        """Raise :class:`~gradalg.errors.StoreCorruptError` naming the damaged files and the
        fix (``fix``, or what rewrites them: ``ga.store.write`` with the same arguments for
        damaged chunks); do nothing when the store is intact."""
        if self.problems:
            raise StoreCorruptError(
                f"{self.path} is damaged: " + "; ".join(self.problems[:5])
                + ("" if len(self.problems) <= 5 else f" (and {len(self.problems) - 5} more)")
                + ". " + (fix or self._default_fix()))

    def _default_fix(self) -> str:
        chunk_only = self.damaged_chunks and -1 not in self.damaged_chunks and \
            len(self.problems) == sum(": " in p and "(store chunk" in p for p in self.problems)
        if chunk_only:
            return _fix(self.kind)
        return ("The damage is outside the chunked rows (attributes, ids or metadata): write the store again "
                "with overwrite=True")


def _fix(kind) -> str:
    call = {"gradients": "ga.store.write(G, path)", "scores": "ga.store.write_scores(S, path)"}.get(kind)
    if call:
        return f"Run {call} again with the same arguments: it rewrites only the damaged chunks"
    return "Write the store again with overwrite=True"


def _raw_attrs(path) -> dict | None:
    import json
    try:
        return json.loads((Path(path) / "zarr.json").read_text()).get("attributes", {})
    except (OSError, ValueError):
        return None


def check_attrs(path, attrs: dict, group=None) -> list[str]:
    """Problems with a store's attributes: edited after writing (seal), or contradicting
    its arrays (block variables, shapes, chunk rows, dtype, number of ids)."""
    from .describe import digest

    problems = []
    if ATTRS_DIGEST in attrs:
        body = {k: v for k, v in attrs.items() if k != ATTRS_DIGEST}
        if digest(body) != attrs[ATTRS_DIGEST]:
            problems.append(f"{Path(path) / 'zarr.json'}: the attributes were changed after the store was written "
                            "(they no longer match their digest)")
    if group is None:
        return problems
    arrays = dict(group.arrays())
    kind = attrs.get("gradalg_store")
    if kind == "gradients":
        n = attrs.get("n")
        ids = arrays.get("example")
        if ids is None or ids.shape != (n,):
            problems.append(f"{path}: attribute n={n} but the store has "
                            f"{None if ids is None else ids.shape[0]} example ids")
        for blk in attrs.get("blocks", []):
            var = arrays.get(str(blk.get("variable")))
            try:
                dim = int(np.prod(blk["shape"]))
            except (KeyError, TypeError, ValueError):
                problems.append(f"{path}: block {blk.get('name')!r} has no valid shape in the attributes")
                continue
            if var is None:
                problems.append(f"{path}: block {blk.get('name')!r} names variable {blk.get('variable')!r}, "
                                "which the store does not have")
            elif var.shape != (n, dim):
                problems.append(f"{Path(path) / str(blk['variable'])}: shape {var.shape}, but the attributes "
                                f"describe block {blk['name']!r} of shape {tuple(blk['shape'])} for {n} rows")
            elif not isinstance(attrs.get("chunk_rows"), int) or var.chunks[0] != min(attrs["chunk_rows"], n):
                problems.append(f"{Path(path) / str(blk['variable'])}: chunks of {var.chunks[0]} rows, but "
                                f"chunk_rows={attrs.get('chunk_rows')} in the attributes")
            elif str(var.dtype) != str(attrs.get("dtype")):
                problems.append(f"{Path(path) / str(blk['variable'])}: dtype {var.dtype}, attributes say "
                                f"{attrs.get('dtype')}")
    if kind in ROW_DIM and "done" in arrays and "chunk_rows" in attrs:
        rows = {"gradients": attrs.get("n"), "scores": arrays["train"].shape[0] if "train" in arrays else None}[kind]
        if isinstance(rows, int) and isinstance(attrs["chunk_rows"], int) and attrs["chunk_rows"] > 0:
            expected = max(1, -(-rows // attrs["chunk_rows"]))
            if arrays["done"].shape != (expected,):
                problems.append(f"{Path(path) / 'done'}: {arrays['done'].shape[0]} flags for {expected} chunks")
    return problems


def _chunk_file(path, name: str, arr, coords) -> Path:
    return Path(path) / name / arr.metadata.encode_chunk_key(coords)


def scan(path, *, full: bool = True) -> VerifyReport:
    """Find damage in the store at ``path``.

    full : read and decode every finished chunk (checksums verified); False checks only
        that every finished chunk's files exist and are not empty (a ``stat`` each).
    """
    import zarr

    path = str(path)
    report = VerifyReport(path, None)
    attrs = _raw_attrs(path)
    if attrs is None or "gradalg_store" not in attrs:
        report.problems.append(f"{Path(path) / 'zarr.json'}: missing or unreadable: not a gradalg store")
        return report
    kind = report.kind = attrs.get("gradalg_store")
    try:
        group = zarr.open_group(path, mode="r")
    except Exception as err:  # noqa: BLE001 - damaged group metadata
        report.problems.append(f"{path}: cannot open the Zarr group ({type(err).__name__}: {err})")
        return report
    report.problems += check_attrs(path, attrs, group)
    flags = None
    if kind in ROW_DIM:
        try:
            flags = np.asarray(group["done"][:]).astype(bool)
        except Exception as err:  # noqa: BLE001
            report.problems.append(f"{Path(path) / 'done'}: unreadable ({type(err).__name__}: {err})")
            flags = None
        if flags is not None:
            report.chunks = len(flags)
            report.unfinished_chunks = np.flatnonzero(~flags).tolist()
    damaged = set()
    for name, arr in group.arrays():
        if name == "done":
            continue
        dims = tuple(arr.metadata.dimension_names or ())
        axis = dims.index(ROW_DIM[kind]) if kind in ROW_DIM and ROW_DIM[kind] in dims and arr.ndim > 1 else None
        grid = [range(max(1, math.ceil(s / c))) if s else range(0) for s, c in zip(arr.shape, arr.chunks)]
        for coords in itertools.product(*grid):
            store_chunk = coords[axis] if axis is not None else None
            if store_chunk is not None and flags is not None and store_chunk < len(flags) and not flags[store_chunk]:
                continue    # not written yet: resume writes it
            file = _chunk_file(path, name, arr, coords)
            problem = None
            if not file.exists():
                problem = "missing"
            elif file.stat().st_size == 0:
                problem = "empty"
            elif full:
                try:
                    arr.get_block_selection(coords)
                except Exception as err:  # noqa: BLE001 - checksum, truncation, codec errors
                    problem = f"fails to decode ({type(err).__name__}: {str(err)[:120]})"
            if problem:
                where = f" (store chunk {store_chunk})" if store_chunk is not None else ""
                report.problems.append(f"{file}: {problem}{where}")
                if store_chunk is not None:
                    damaged.add(store_chunk)
                elif kind in ROW_DIM:
                    damaged.add(-1)    # an array outside the chunked rows (ids): not repairable by chunk
    report.damaged_chunks = sorted(damaged)
    return report


def verify(path) -> VerifyReport:
    """Check a store (gradients, scores or operator) end to end: its attributes against
    their seal and against the arrays, and every finished chunk's files (present,
    decodable, checksums). Returns a :class:`VerifyReport` (truthy when intact; its
    ``damaged_chunks`` are what ``ga.store.write`` with the same arguments rewrites).

    >>> report = ga.store.verify("train.zarr")
    >>> report.ok, report.damaged_chunks
    (False, [3])
    """
    path = store_path(path)   # a str or os.PathLike, else an OptionError
    if not Path(path).exists():
        raise StoreNotFoundError(f"no store at {path}")
    return scan(path, full=True)


def chunk_error(path, index: int, err: Exception, kind: str = "gradients") -> StoreCorruptError:
    """The error for a store chunk that failed to read."""
    return StoreCorruptError(
        f"{path}: store chunk {index} cannot be read ({type(err).__name__}: {str(err)[:200]}). "
        f"ga.store.verify({str(path)!r}) lists the damaged files; {_fix(kind)[0].lower() + _fix(kind)[1:]}")
