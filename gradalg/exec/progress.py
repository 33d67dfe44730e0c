"""Progress on passes over data, readable in a notebook, on a terminal and in a log file.

``ga.options(progress=...)`` (default from ``GRADALG_PROGRESS``) picks the form:

=========== ==================================================================================
``"auto"``   (``True``) a widget in Jupyter; a tqdm bar when stderr is a terminal; otherwise
             (nohup, SLURM, CI, a pipe) **plain lines**, one every ``progress_interval`` s
``"bar"``    a tqdm bar even when stderr is not a terminal
``"lines"``  plain lines even on a terminal or in a notebook
``"off"``    (``False``) nothing
=========== ==================================================================================

A plain line says which pass, rows done of the total, the rate, the time elapsed and the
estimated time left::

    [gradalg] capture Sequential: 640/1,400 rows (45.7%), 312 rows/s, elapsed 2.1 s, ETA 2.4 s

and a closing line (``done, 1,400 rows in 4.5 s (311 rows/s)``). A pass shorter than the
interval writes nothing (like a bar that vanishes when done), so many small computations
do not flood a log. Lines are written to stderr as they happen (flushed), so ``tail -f``
of a job's log shows them live.

**Logging.** gradalg's log records go to ``logging.getLogger("gradalg")`` (children
``gradalg.exec``, ...), which has only a ``NullHandler``: nothing is printed unless the
application configures logging (the ``gradalg`` command's ``--verbose`` / ``--quiet`` set
its level). Each pass logs its start and end at ``INFO`` on ``gradalg.exec.progress``,
whatever the progress form.
"""
from __future__ import annotations

import contextlib
import logging
import sys
import time

from tqdm import tqdm

__all__ = ["progress_bar", "progress_mode", "LineProgress", "in_notebook", "LOGGER", "SILENT"]

LOGGER = "gradalg"
logging.getLogger(LOGGER).addHandler(logging.NullHandler())   # the library never configures output
log = logging.getLogger(f"{LOGGER}.exec.progress")

#: a progress display that shows nothing (its ``update`` and ``close`` do nothing)
SILENT = tqdm(disable=True)


def _count(n: float) -> str:
    return f"{int(n):,}"


def _duration(seconds: float) -> str:
    """``4.5 s``, ``3 min 12 s``, ``1 h 02 min``."""
    if seconds != seconds or seconds == float("inf"):
        return "?"
    if seconds < 60:
        return f"{seconds:.1f} s"
    if seconds < 3600:
        return f"{int(seconds // 60)} min {int(seconds % 60):02d} s"
    return f"{int(seconds // 3600)} h {int(seconds % 3600 // 60):02d} min"


class LineProgress:
    """Plain progress lines for a stream that is not a terminal.

    A line whenever ``interval`` seconds have passed since the start or the last line
    (checked at each :meth:`update`), and at :meth:`close` a closing line if any line was
    written or the pass took at least ``interval``. ``clock`` returns seconds (``time.monotonic``; tests pass a fake one).

    The rate is rows done / seconds since the start; the ETA is rows left / rate.
    """

    def __init__(self, total: int, description: str, *, stream=None, interval: float = 30.0,
                 clock=time.monotonic, unit: str = "rows"):
        self.total = int(total)
        self.description = description
        self.stream = stream if stream is not None else sys.stderr
        self.interval = float(interval)
        self.clock = clock
        self.unit = unit
        self.n = 0
        self.start = clock()
        self._last = self.start
        self._closed = False
        self.lines = 0

    def _write(self, text: str) -> None:
        self.lines += 1
        self.stream.write(f"[gradalg] {self.description}: {text}\n")
        self.stream.flush()

    def status(self) -> str:
        """Rows done of the total, rate, elapsed time and ETA, in words."""
        elapsed = self.clock() - self.start
        rate = self.n / elapsed if elapsed > 0 else float("nan")
        left = (self.total - self.n) / rate if rate == rate and rate > 0 else float("nan")
        share = f" ({100 * self.n / self.total:.1f}%)" if self.total else ""
        rate_text = f"{rate:,.3g} {self.unit}/s" if rate == rate else f"? {self.unit}/s"
        return (f"{_count(self.n)}/{_count(self.total)} {self.unit}{share}, {rate_text}, "
                f"elapsed {_duration(elapsed)}, ETA {_duration(left)}")

    def update(self, n: int = 1) -> None:
        """``n`` more rows done; writes a line if ``interval`` seconds passed since the last."""
        self.n += n
        now = self.clock()
        if now - self._last >= self.interval and self.n < self.total:
            self._last = now
            self._write(self.status())

    def close(self) -> None:
        """The closing line: rows done, total time and mean rate (``stopped`` when fewer
        rows than the total were done: the pass was interrupted)."""
        if self._closed:
            return
        self._closed = True
        elapsed = self.clock() - self.start
        if not self.lines and elapsed < self.interval:
            return                                       # a short pass: nothing to report
        rate = f" ({self.n / elapsed:,.3g} {self.unit}/s)" if elapsed > 0 else ""
        word = "done" if self.n >= self.total else "stopped"
        self._write(f"{word}, {_count(self.n)} {self.unit} in {_duration(elapsed)}{rate}")


def in_notebook() -> bool:
    """True inside a Jupyter kernel (an IPython ``ZMQInteractiveShell``)."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    return type(get_ipython()).__name__ == "ZMQInteractiveShell"     # None outside IPython


def _is_terminal(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):   # no isatty, or a closed stream
        return False


def progress_mode(setting, stream=None) -> str:
    """What ``ga.options(progress=setting)`` shows on ``stream`` (default stderr):
    ``"off"``, ``"widget"`` (Jupyter), ``"bar"`` (tqdm) or ``"lines"``."""
    if setting is False or setting == "off":
        return "off"
    if setting in ("bar", "lines"):
        return setting
    if in_notebook():
        return "widget"
    return "bar" if _is_terminal(stream if stream is not None else sys.stderr) else "lines"


@contextlib.contextmanager
def progress_bar(setting, total: int, description: str, *, interval: float | None = None, stream=None):
    """Progress of one pass over ``total`` examples, in the form ``setting`` asks for
    (:func:`progress_mode`); yields an object with ``update(n)``.

    interval : seconds between plain lines (default ``ga.get_options().progress_interval``).
    stream : where bars and lines go (default ``sys.stderr``).
    """
    if interval is None:
        from ..options import get_options
        interval = get_options().progress_interval
    mode = progress_mode(setting, stream)
    label = description[:60]
    log.info("pass started: %s, %s rows", label, _count(total))
    start = time.perf_counter()
    bar = _open(mode, total, label, interval, stream)
    try:
        yield bar
    finally:
        bar.close()
        log.info("pass finished: %s in %s", label, _duration(time.perf_counter() - start))


def _open(mode: str, total: int, label: str, interval: float, stream):
    if mode == "off":
        return SILENT
    if mode == "lines":
        return LineProgress(total, label, stream=stream, interval=interval)
    if mode == "widget":   # a notebook's widget (tqdm.auto imports ipywidgets: only when asked for)
        from tqdm.auto import tqdm as bar
    else:
        bar = tqdm
    return bar(total=total, desc=label[:40], unit="ex", leave=False, file=stream)
