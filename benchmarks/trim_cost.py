"""What one ``malloc_trim(0)`` costs, before and after ``tokenizers`` ran in the process.

Issue 28: LoGra's last pass (scores over held rows) measured 25–49× its estimate in
``benchmarks/real_scale.py --data stdlib-bpe`` and ~2× with random token ids. The pass
returned free pages after every held block it preconditioned, and a trim walks every free
chunk of every glibc arena: after the byte-level BPE was trained and run in the process
(``real_scale.stdlib_tokens``), one trim that frees nothing costs milliseconds. The executor
now returns pages per ``release_memory_above`` bytes dropped (``exec/allocator.py``,
``FreedBytes``). Prints the CPU milliseconds of 5 trims in a row at each stage:

    PYTHONPATH=. OMP_NUM_THREADS=1 .venv/bin/python benchmarks/trim_cost.py [--cache build/tokcache]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def trims(label: str, n: int = 5) -> list[float]:
    from gradalg.exec.allocator import release_free_memory
    out = []
    for _ in range(n):
        start = time.process_time()
        release_free_memory()
        out.append(round(1e3 * (time.process_time() - start), 3))
    print(f"{label:28} trim CPU ms: {out}", flush=True)
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cache", default="build/tokcache", help="where the BPE is saved (trained when absent)")
    args = p.parse_args(argv)
    import torch  # noqa: F401 - the process a benchmark runs in
    import real_scale
    trims("fresh process")
    for label in ("after BPE train or load+encode", "after a second encode"):
        real_scale.stdlib_tokens("stdlib-bpe", 50257, 8 * 128, Path(args.cache))
        trims(label)


if __name__ == "__main__":
    main()
