"""Give freed memory back to the operating system between batches.

A pass allocates and frees the same large tensors every batch (activations, factors,
one backward per Gauss-Newton term). glibc's allocator raises its mmap threshold after
such frees, so later tensors of that size come from the heap, whose free pages it keeps:
resident memory then grows with the number of batches rather than with their size
(measured: EK-FAC on a small conv net, 2× the memory budget at batch 7, 1.0× with the
pages returned). ``release_free_memory()`` asks glibc to return free pages
(``malloc_trim(0)``, a few microseconds when little is free); elsewhere it does nothing.

Returning pages is not free either: the next batch's tensors then fault every page in
again (measured on a GPT-2 pass, 4 layers × 256, batches of 16: 2.2 M page faults and
20 % of the pass's time when trimming after every batch, 0.1–0.3 M without).
:class:`ResidentGuard` trims only when the pass's resident growth after a batch (the
resident set less its size as the pass started) has passed ``ga.options(release_growth)``
times its growth after the first batch (default 1.25; 1.0 trims after every batch), the
batch after a trim setting the reference again, so a steady pass keeps its pages, a
growing one is cut back, and rows the pass keeps (which no trim returns) are not trimmed
after every batch; the pass runner trims once more after a pass's last batch (one
batch's pages faulted in again per pass, not per batch). Which passes are guarded is the plan's: the size stage's
``TRIM`` decision per pass over data (``Pass.trim_after_batches``: the pass's working
set per batch against ``ga.options(release_memory_above)``).

Joining or preconditioning rows block by block frees a block at a time; each
``malloc_trim`` walks every free chunk of every arena (one ``madvise`` per chunk
spanning a page), so its cost grows with the process's heap, not with what was freed.
:class:`FreedBytes` trims only once the blocks freed since the last trim reach the
option ``ga.options(release_memory_above)`` (1 MiB, shown in the plan's header): a block smaller than that is reused by the
allocator anyway. Measured (issue 28, LoGra's scores over held query rows, 48 projected
64 × 64 blocks of 16–32 KiB, GPT-2 small at T = 128, 2.6 GB process, load 9–12): 48
trims took 8.5 ms of the pass's 27 ms of CPU and the pages they returned faulted in
again (1,750 page faults against 200); with one trim per MiB the pass took 18 ms. A heap
with many free chunks makes each trim far dearer: after ``tokenizers`` trained and ran a
byte-level BPE in the process (``benchmarks/real_scale.py --data stdlib-bpe``), one
``malloc_trim(0)`` that freed nothing took 5–9 ms of CPU (8 µs before), which is the
0.29 s of GPT-2 small's 48 held blocks (25× the pass's estimate) and the 0.88 s of
Qwen2-0.5B's 168 (49×).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools

import os

__all__ = ["release_free_memory", "resident_bytes", "peak_resident_bytes", "peak_growth", "ResidentGuard", "FreedBytes"]


@functools.cache
def _malloc_trim():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):   # not glibc (macOS, musl): nothing to release
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


def release_free_memory() -> None:
    """Return the allocator's free pages to the system (glibc ``malloc_trim(0)``; nothing
    elsewhere): called after a pass or a large join so that the next pass's peak is its own."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def resident_bytes() -> int | None:
    """This process's resident set in bytes (Linux ``/proc/self/statm``), or None."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def peak_resident_bytes() -> int:
    """This process's peak resident set in bytes since it started (or since the kernel's
    mark was last reset): Linux ``VmHWM``, elsewhere ``getrusage``'s ``ru_maxrss``
    (kilobytes on Linux, bytes on macOS)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    except (OSError, ValueError, IndexError, StopIteration):   # not Linux, or no VmHWM line
        pass
    import resource
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else 1024 * peak


def peak_growth(rss_start: int | None, mark_start: int, mark_end: int) -> dict:
    """A pass's peak resident growth from the process's resident set at its start and its
    peak mark before and after it.

    The kernel keeps one peak mark per process. When the pass raised it
    (``mark_end > mark_start``) the pass's peak is the new mark, and its growth
    ``mark_end − rss_start`` is exact. When an earlier pass (or code before the run) set a
    higher mark, the pass's own peak is hidden under it: ``mark_end − rss_start`` is then
    only an upper bound, reported with ``peak_rss_is_bound`` True. (Measured from the mark
    at the pass's start instead, a hidden peak read as 0 bytes.) Without a resident-set
    reading (not Linux) the growth is None.
    """
    if rss_start is None:                      # no resident-set reading (not Linux): no baseline to measure from
        return {"peak_rss_growth_bytes": None, "peak_rss_is_bound": False}
    return {"peak_rss_growth_bytes": max(0, mark_end - rss_start), "peak_rss_is_bound": mark_end <= mark_start}


class ResidentGuard:
    """Returns free pages after a batch only when the pass's resident set has grown.

    Made as a pass starts, it reads the resident set ``r₀`` there; ``after_batch()``
    reads it again, ``r``, and compares the pass's growth ``r − r₀`` (not the process's
    resident set, whose hundreds of MB of framework, model and data a small pass never
    moved by 25 %) with a reference growth ``g``: the growth after the first batch since
    the pass started, which only sets ``g``, or since the last trim. A later batch trims
    (glibc ``malloc_trim``) when ``r − r₀ > growth · g`` and the batch after the trim
    sets ``g`` again, so a trim that returned nothing (the growth was rows the pass keeps,
    a store's) is not repeated after every batch: growing kept rows trim at growths
    ``growth`` times apart, a heap that holds freed pages beyond ``growth · g`` is cut
    back. ``growth`` 1.0 trims after every batch without reading the resident set;
    without a reading (not Linux) the guard never trims (the runner still trims after
    the pass). ``trims`` counts the trims (``benchmarks/resident_guard.py`` reports it).
    """

    def __init__(self, growth: float):
        self.growth, self.trims, self.reference = growth, 0, None
        self.start = resident_bytes() if growth > 1.0 else None      # r₀: before the pass's first batch

    def after_batch(self) -> None:
        rss = resident_bytes() if self.growth > 1.0 and self.start is not None else None
        if self.growth > 1.0 and (rss is None or self.reference is None):
            # no reading: off; else the first batch since the start or the last trim sets g
            self.reference = None if rss is None else max(rss - self.start, 0)
            return
        if self.growth == 1.0 or rss - self.start > self.growth * self.reference:
            release_free_memory()
            self.trims, self.reference = self.trims + 1, None


class FreedBytes:
    """Returns free pages once enough bytes were freed since the last return.

    ``freed(nbytes)`` adds ``nbytes`` (a block just dropped) to the pending count and,
    when it reaches ``above`` bytes, calls ``release`` (default
    :func:`release_free_memory`, looked up when called) and starts the count again.
    ``above`` 0 returns pages after every block; ``float("inf")`` never. ``trims``
    counts the returns.
    """

    def __init__(self, above: float, release=None):
        self.above, self.release = float(above), release
        self.pending = 0.0
        self.trims = 0

    def freed(self, nbytes: float) -> None:
        self.pending += float(nbytes)
        if self.pending >= self.above:
            (self.release or release_free_memory)()
            self.pending = 0.0
            self.trims += 1
