"""Progress of a store being written, watched from its ``done`` flags.

``gradalg build`` writes a store chunk by chunk (``ga.store.write``); a background
thread reads the flags every ``poll`` seconds and reports rows done, rate and ETA: a
tqdm bar on a terminal, else a log line every ``interval`` seconds (nohup and SLURM
logs get plain lines). The flags are read-only here; a flag file is replaced
atomically by the writer, so a read sees it set or not.
"""
from __future__ import annotations

import logging
import sys
import threading
import time
from pathlib import Path

import numpy as np

__all__ = ["ChunkMonitor", "done_count", "format_seconds"]

log = logging.getLogger("gradalg.cli")


def done_count(path) -> int | None:
    """Chunks flagged done in the store at ``path`` (None before its template exists)."""
    import zarr

    if not (Path(path) / "done" / "zarr.json").exists():
        return None
    try:
        return int(np.count_nonzero(zarr.open_array(str(Path(path) / "done"), mode="r")[:]))
    except Exception:  # noqa: BLE001 - a flag being replaced: read again at the next poll
        return None


def format_seconds(s: float) -> str:
    s = int(round(s))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


class ChunkMonitor:
    """Context manager reporting the progress of the store at ``path``.

    total_chunks, chunk_rows, n : the store's chunking (rows of the last chunk are fewer).
    enabled : False reports nothing (``--quiet``).
    interval : seconds between plain log lines when stderr is not a terminal.
    """

    def __init__(self, path, total_chunks: int, chunk_rows: int, n: int, *, enabled: bool = True,
                 interval: float = 30.0, poll: float = 0.5, tty: bool | None = None):
        self.path, self.total, self.chunk_rows, self.n = path, total_chunks, chunk_rows, n
        self.enabled, self.interval, self.poll = enabled, interval, poll
        self.tty = sys.stderr.isatty() if tty is None else tty
        self._stop = threading.Event()
        self._thread = None
        self._bar = None

    def rows(self, chunks: int) -> int:
        return min(chunks * self.chunk_rows, self.n)

    def __enter__(self):
        if not self.enabled:
            return self
        self.start_done = done_count(self.path) or 0
        self.start_time = time.monotonic()
        if self.tty:
            from tqdm.auto import tqdm
            self._bar = tqdm(total=self.n, initial=self.rows(self.start_done), unit="row", desc="build",
                             file=sys.stderr, dynamic_ncols=True)
        self._thread = threading.Thread(target=self._run, name="gradalg-build-monitor", daemon=True)
        self._thread.start()
        return self

    def line(self, done: int) -> str:
        rows = self.rows(done)
        elapsed = time.monotonic() - self.start_time
        new_rows = rows - self.rows(self.start_done)
        rate = new_rows / elapsed if elapsed > 0 else 0.0
        eta = f", ETA {format_seconds((self.n - rows) / rate)}" if rate > 0 and rows < self.n else ""
        return (f"build: {rows:,}/{self.n:,} rows ({done}/{self.total} chunks), {rate:,.1f} rows/s, "
                f"elapsed {format_seconds(elapsed)}{eta}")

    def _run(self):
        last_line = time.monotonic()
        last_done = self.start_done
        while not self._stop.wait(self.poll):
            done = done_count(self.path)
            if done is None:
                continue
            if self._bar is not None and done != last_done:
                self._bar.update(self.rows(done) - self.rows(last_done))
            elif self._bar is None and time.monotonic() - last_line >= self.interval:
                log.info(self.line(done))
                last_line = time.monotonic()
            last_done = done

    def __exit__(self, *exc):
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            done = done_count(self.path) or 0
            if self._bar is not None:
                self._bar.update(self.rows(done) - self._bar.n)
                self._bar.close()
        return False
