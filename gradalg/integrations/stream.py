"""Stream training-time rows to disk: project each step's per-example gradients and append
them to a gradient store as training goes, with bounded memory.

    P = ga.proj.kron(k=16, seed=0)
    stream = ga.integrations.StoreStream("run.grads", P, flush_rows=1024)
    tc = ga.integrations.training_capture(model, layers, optimizer=opt)   # keep=False
    stream.attach(tc)
    with tc:
        ...                                   # train
    stream.close()
    G = ga.integrations.open_stream("run.grads")   # lazy GradientSet: P(rows), ids = dataset indices

Memory: a step's factors live until the step's callbacks end (as without streaming); then
only the projected rows are kept, ``n × k`` numbers, until ``flush_rows`` of them are
written (by a writer thread, ``background=True``, while training goes on; at most one
write in flight). So resident memory is one step's factors plus ``2 × flush_rows × k``
numbers, whatever the length of the run.

Layout: ``path/`` holds ``stream.json`` (the manifest) and one finished gradient store
per flush, ``part-000000.zarr``, ``part-000001.zarr``, ... each written with
``ga.store.write`` (crash-safe chunk by chunk) and entered into the manifest only once it
is complete (the manifest is replaced atomically). The manifest records the projector,
the layers, the projected blocks, what the rows are (``info``: the integration's loss
scaling), and per segment the training steps it covers and how many rows each step has.

Restarting into the same path (``attach(tc, start_step=s)``, ``s`` the optimizer steps
already taken, e.g. the Trainer's ``global_step`` after resuming a checkpoint):

* a new path: the stream starts;
* a stream of anything else (projector, layers, blocks or ``info`` differ):
  :class:`~gradalg.errors.StoreMismatchError` naming each difference;
* ``s = 0`` into a stream that holds rows: refused (an earlier run's rows would be mixed
  with this run's) unless ``overwrite=True``;
* ``s > 0``: the segments of steps ``< s`` are kept, those of steps ``≥ s`` (recorded after
  the checkpoint, which the resumed run records again) are removed; refused if the kept
  segments do not cover steps ``0 … s−1`` exactly (rows missing, or a segment that
  straddles step ``s``: flush at every checkpoint — the HF callback does, in ``on_save``).
"""
from __future__ import annotations

import json
import operator
import os
import shutil
import uuid
from pathlib import Path

import numpy as np

from ..errors import CaptureStateError, OptionError, StoreIncompleteError, StoreMismatchError

__all__ = ["StoreStream", "open_stream", "stream_steps"]

MANIFEST = "stream.json"
FORMAT = "gradalg-stream/1"


def _read_manifest(path: Path) -> dict | None:
    f = path / MANIFEST
    if not f.exists():
        return None
    return json.loads(f.read_text())


def _write_manifest(path: Path, manifest: dict) -> None:
    """Replace the manifest atomically (write a temporary file, rename it into place)."""
    tmp = path / f".{MANIFEST}.{uuid.uuid4().hex}.partial"
    tmp.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, path / MANIFEST)


def _space_dict(space) -> list[dict]:
    return [{"name": b.name, "shape": list(b.shape), "kind": b.kind, "basis": b.basis} for b in space.blocks]


class StoreStream:
    """Project each closed training step's rows with ``projector`` and append them to disk.

    Parameters
    ----------
    path : a directory (created); see the module docs for its layout.
    projector : any ``ga.proj`` projector (``kron`` keeps factored rows cheap to project).
    flush_rows : projected rows kept in memory before a segment is written.
    overwrite : replace whatever ``path`` holds.
    info : a JSON-able dict stored in the manifest and compared on restart (the
        integrations record their loss scaling here).
    background : write segments from a writer thread while training goes on (default);
        an error there is raised at the next flush or at :meth:`close`.

    Use :meth:`attach` with a :class:`~gradalg.integrations.TrainingCapture` (or pass it to
    ``GradientCallback(stream=...)`` / ``OLMoCoreCallback(stream=...)``), then :meth:`close`.
    """

    def __init__(self, path, projector, *, flush_rows: int = 4096, overwrite: bool = False,
                 info: dict | None = None, background: bool = True):
        from ..expr import Projector

        if not isinstance(projector, Projector):
            raise OptionError(f"StoreStream(projector=...) must be a ga.proj projector (e.g. ga.proj.kron(k=16)), "
                              f"got {type(projector).__name__}")
        try:
            rows = None if isinstance(flush_rows, bool) else operator.index(flush_rows)   # int or numpy integer
        except TypeError:
            rows = None
        if rows is None or rows < 1:
            raise OptionError(f"StoreStream(flush_rows=...) must be a positive integer, got {flush_rows!r}")
        flush_rows = int(rows)
        self.path = Path(path)
        self.projector = projector
        self.flush_rows = flush_rows
        self.overwrite = overwrite
        self.info = dict(info or {})
        self.manifest: dict | None = None
        self._buffer: list = []       # projected Chunks not yet written
        self._steps: list = []        # [step, rows] of the buffered rows
        self._offset = 0
        self._space = None
        self.rows_written = 0
        self.background = background
        self._writer = None
        self._pending = None

    # ------------------------------------------------------------------ attach / restart
    def attach(self, capture, *, start_step: int = 0, info: dict | None = None) -> "StoreStream":
        """Stream ``capture``'s steps; ``start_step`` = optimizer steps already taken (a resumed
        run). Prepares ``path`` (new, resumed, or refused: see the module docs)."""
        from ..store.describe import projector_dict

        if info:
            self.info.update(info)
        self._offset = int(start_step)
        layers = [r.name for r in capture.refs]
        space = self.projector(capture_grads_like(capture)).space
        self._space = space
        new = {"format": FORMAT, "projector": projector_dict(self.projector), "layers": layers,
               "blocks": _space_dict(space), "info": self.info, "segments": [], "complete": False}
        if self.overwrite and self.path.exists():
            shutil.rmtree(self.path)
        old = _read_manifest(self.path) if self.path.exists() else None
        if old is None:
            if self.path.exists() and any(self.path.iterdir()):
                raise StoreMismatchError([f"{self.path} exists and is not a gradalg training stream"],
                                         "choose another path, or pass overwrite=True to replace it")
            self.path.mkdir(parents=True, exist_ok=True)
            self.manifest = new
        else:
            self.manifest = self._resume(old, new)
        self._remove_orphans()
        _write_manifest(self.path, self.manifest)
        # rows numbered in the order seen (no dataset index: a streaming dataset) go on from the
        # rows kept before the checkpoint, so that a resumed run's ids do not repeat theirs
        kept = sum(seg["n"] for seg in self.manifest["segments"])
        if kept:
            capture.number_from(kept)
        capture.on_step(self)
        return self

    def _resume(self, old: dict, new: dict) -> dict:
        fix = "pass overwrite=True to replace the stream, or stream to another path"
        problems = [f"{key}: the stream has {old.get(key)!r}, this run has {new[key]!r}"
                    for key in ("format", "projector", "layers", "blocks", "info") if old.get(key) != new[key]]
        if problems:
            raise StoreMismatchError(problems, fix)
        segments = old["segments"]
        s = self._offset
        if s == 0 and segments:
            n = sum(seg["n"] for seg in segments)
            raise StoreMismatchError(
                [f"{self.path} holds {n} rows of steps 0–{segments[-1]['last_step']} of an earlier run, and this "
                 "run starts again from step 0"],
                "resume training from its checkpoint (the stream keeps the rows before it), or " + fix)
        kept = [seg for seg in segments if seg["last_step"] < s]
        straddle = [seg for seg in segments if seg["first_step"] < s <= seg["last_step"]]
        if straddle:
            seg = straddle[0]
            raise StoreMismatchError(
                [f"segment {seg['name']} holds steps {seg['first_step']}–{seg['last_step']} and training resumes "
                 f"at step {s}: its rows of steps ≥ {s} cannot be told apart on disk"],
                "flush the stream at every checkpoint (GradientCallback does, in on_save), or " + fix)
        last = kept[-1]["last_step"] if kept else -1
        if last != s - 1:
            raise StoreMismatchError(
                [f"the stream has rows up to step {last} but training resumes at step {s}: the rows of steps "
                 f"{last + 1}–{s - 1} were never written"], fix)
        for seg in segments:
            if seg not in kept:
                shutil.rmtree(self.path / seg["name"], ignore_errors=True)
        return dict(old, segments=kept, complete=False)

    def _remove_orphans(self) -> None:
        """Segments a killed run wrote but never entered into the manifest."""
        listed = {seg["name"] for seg in self.manifest["segments"]}
        for entry in self.path.iterdir():
            if entry.name.startswith("part-") and entry.name not in listed:
                shutil.rmtree(entry, ignore_errors=True)
            elif entry.name.endswith(".partial") or (entry.name.startswith(".part-") and entry.is_dir()):
                shutil.rmtree(entry, ignore_errors=True) if entry.is_dir() else entry.unlink(missing_ok=True)

    # ------------------------------------------------------------------ per step
    def __call__(self, step) -> None:
        """An ``on_step`` callback: project the step's rows and buffer them (flushing when full)."""
        from ..capture.chunks import Chunk, flat_block
        from ..exec.local import LocalExecutor

        if self.manifest is None:
            raise CaptureStateError("StoreStream.attach(capture) must run before training (or pass the "
                                    "stream to GradientCallback(stream=...) / OLMoCoreCallback(stream=...))")
        node = self.projector(step.grads).expr
        chunk = LocalExecutor().gradients(node)
        rows = {b.name: flat_block(chunk.blocks[b.name]).detach().cpu() for b in node.space.blocks}
        self._buffer.append(Chunk(tuple(step.ids), rows))
        self._steps.append([self._offset + step.index, step.n])
        if sum(c.n for c in self._buffer) >= self.flush_rows:
            self.flush()

    def flush(self, wait: bool = False) -> None:
        """Write the buffered rows as one segment (a finished gradient store) and list it.

        With ``background=True`` the segment is written by a writer thread while training
        goes on (at most one write in flight: a second flush waits for the first, so at
        most two buffers are held); ``wait=True`` returns once it is on disk (checkpoints do).
        """
        self._wait()
        if self._buffer:
            from ..capture.chunks import concat_chunks

            chunk = concat_chunks(self._buffer)
            steps, self._buffer, self._steps = self._steps, [], []
            if self.background:
                from concurrent.futures import ThreadPoolExecutor

                if self._writer is None:
                    self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gradalg-stream")
                self._pending = self._writer.submit(self._write_segment, chunk, steps)
            else:
                self._write_segment(chunk, steps)
        if wait:
            self._wait()

    def _wait(self) -> None:
        """Wait for the segment in flight; re-raise its error here, in the training thread."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def _write_segment(self, chunk, steps) -> None:
        from ..api import GradientSet
        from ..expr.stored import Stored
        from ..store import write as store_write
        from ..store.rows import MemoryRows

        index = len(self.manifest["segments"])
        name = f"part-{index:06d}.zarr"
        token = f"stream-{uuid.uuid4().hex}"
        rep = tuple((b.name, "projected") for b in self._space.blocks)
        G = GradientSet(Stored(MemoryRows(chunk, token, f"{self.path.name}/{name}"), self._space, rep))
        store_write(G, self.path / name, chunk_rows=max(1, chunk.n), overwrite=True)
        self.manifest["segments"].append({"name": name, "first_step": steps[0][0], "last_step": steps[-1][0],
                                          "n": chunk.n, "steps": steps})
        _write_manifest(self.path, self.manifest)
        self.rows_written += chunk.n

    def close(self) -> None:
        """Flush what is buffered, wait for the writes, and mark the stream complete."""
        if self.manifest is None:
            return
        try:
            self.flush(wait=True)
        finally:
            if self._writer is not None:
                self._writer.shutdown(wait=True)
                self._writer = None
        self.manifest["complete"] = True
        _write_manifest(self.path, self.manifest)

    @property
    def grads(self):
        """The rows written so far (call :meth:`close` or :meth:`flush` first for all of them)."""
        self._wait()
        return open_stream(self.path, require_complete=False)


def capture_grads_like(capture):
    """A zero-row GradientSet in ``capture``'s space (to derive the projected space)."""
    from ..loop_capture import captured_grads

    return captured_grads([], capture.space)


class SegmentRows:
    """The rows of a stream's segments, one after another (the store of a Stored leaf)."""

    def __init__(self, path: Path, manifest: dict, stores: list):
        from ..store.describe import digest

        self.path = str(Path(path).resolve())
        self.stores = stores
        self.token = "stream-" + digest([self.path, [(s["name"], s["n"]) for s in manifest["segments"]]])
        self.label = Path(path).name
        self.description = {"stream": self.token}
        self.summary = {"projector": [manifest["projector"]], "layers": [manifest["layers"]]}

    @property
    def n(self) -> int:
        return sum(s.n for s in self.stores)

    @property
    def ids(self) -> tuple:
        return tuple(i for s in self.stores for i in s.ids)

    def chunks(self):
        for s in self.stores:
            yield from s.chunks()

    def rows(self, start: int, stop: int) -> "SegmentRows":
        out, at = [], 0
        for s in self.stores:
            a, b = max(start - at, 0), min(stop - at, s.n)
            if a < b:
                out.append(s.rows(a, b))
            at += s.n
        view = SegmentRows.__new__(SegmentRows)
        view.__dict__.update(self.__dict__, stores=out, token=f"{self.token}[{start}:{stop}]")
        return view


def open_stream(path, *, require_complete: bool = True):
    """A training stream's rows as a lazy GradientSet (ids: the rows' example ids, e.g. the
    dataset indices; they repeat when an example was seen in several steps).

    A data-parallel run streams each rank to ``path/rank-000``, ``path/rank-001``, ...:
    opening ``path`` reads them all, rank by rank (rank 0's rows, then rank 1's).
    """
    from ..api import GradientSet
    from ..space import Block, ParamSpace
    from ..expr.stored import Stored
    from ..store.gradients import GradientStore
    from ..store.layout import check_complete, ids_tuple

    path = Path(path)
    manifest = _read_manifest(path)
    ranks = sorted(path.glob("rank-*")) if manifest is None and path.is_dir() else []
    if ranks:   # a data-parallel run: one stream per rank, read in rank order
        parts = [open_stream(r, require_complete=require_complete) for r in ranks]
        spaces = {json.dumps(_space_dict(p.space)) for p in parts}
        if len(spaces) != 1:
            raise StoreMismatchError([f"the rank streams under {path} hold different blocks"],
                                     "stream every rank with the same projector and layers")
        stores = [p.expr.store for p in parts]
        merged = SegmentRows.__new__(SegmentRows)
        merged.__dict__.update(stores[0].__dict__, path=str(path.resolve()),
                               stores=[s for st in stores for s in st.stores],
                               token="stream-" + "+".join(st.token for st in stores), label=path.name)
        return GradientSet(Stored(merged, parts[0].space, tuple(parts[0].expr.representation_)))
    if manifest is None:
        raise FileNotFoundError(f"no training stream at {path} (no {MANIFEST})")
    if require_complete and not manifest.get("complete"):
        raise StoreIncompleteError(f"the training stream at {path} was not closed (training stopped or is "
                                   "running): StoreStream.close() finishes it; open_stream(path, "
                                   "require_complete=False) reads the segments written so far")
    stores = []
    for seg in manifest["segments"]:
        ds = check_complete(path / seg["name"], "gradients", "the training run again")
        stores.append(GradientStore(path / seg["name"], dict(ds.attrs), ids_tuple(ds["example"].values)))
    space = ParamSpace(tuple(Block(b["name"], tuple(b["shape"]), b["kind"], b["basis"]) for b in manifest["blocks"]))
    rep = tuple((b["name"], "projected") for b in manifest["blocks"])
    return GradientSet(Stored(SegmentRows(path, manifest, stores), space, rep))


def stream_steps(path) -> np.ndarray:
    """(n,) int64: the optimizer step of each row of the stream at ``path``, in row order."""
    manifest = _read_manifest(Path(path))
    if manifest is None:
        raise FileNotFoundError(f"no training stream at {path}")
    return np.asarray([s for seg in manifest["segments"] for s, k in seg["steps"] for _ in range(k)], dtype=np.int64)
