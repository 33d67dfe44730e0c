"""Batches of ``batch_tokens`` positions against full batches: time and peak memory.

The planner reads sequences of T positions in batches of at most
``⌈batch_tokens / T⌉`` (``ga.options(batch_tokens=)``, default 512 on the CPU). This
script runs the harness's gradalg variants (:mod:`end_to_end`'s W2: GPT-2 4 × 256,
T = 128, ``batch_size=16``, one thread) with the default and with ``batch_tokens=0``
(full batches of 16), each run in its own cold process, the two settings alternating
within each round, and prints the medians and their ratios.

    .venv/bin/python benchmarks/batch_tokens.py                       # projected and full Grad-Dot, 3 rounds
    .venv/bin/python benchmarks/batch_tokens.py --methods ekfac --rounds 1
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SETTINGS = {"default (512 positions)": None, "batch_tokens=0 (full batches)": 0}


def child(method: str, n: int, q: int, batch: int, batch_tokens: str) -> None:
    import resource

    import torch
    sys.path.insert(0, HERE)
    from end_to_end import build_w2, run_gradalg

    torch.set_num_threads(1)
    model, train, test = build_w2(n, q)
    tokens = None if batch_tokens == "none" else int(batch_tokens)
    result = run_gradalg(method, model, train, test, batch, batch_tokens=tokens)
    result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print("RESULT " + json.dumps(result), flush=True)


def spawn(method, n, q, batch, tokens, python) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "GRADALG_PROGRESS": "0",
           "TRANSFORMERS_VERBOSITY": "error", "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    arg = "none" if tokens is None else str(tokens)
    out = subprocess.run([python, os.path.abspath(__file__), "--child", method, str(n), str(q), str(batch), arg],
                         capture_output=True, text=True, env=env, timeout=3600)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"{method} batch_tokens={arg} failed:\n{out.stderr[-3000:]}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--methods", default="projected,full")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--n-train", type=int, default=128)
    ap.add_argument("--n-test", type=int, default=32)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        m, n, q, b, t = a.child
        return child(m, int(n), int(q), int(b), t)
    print(f"# W2 GPT-2 4×256, T=128, batch_size {a.batch}, {a.n_train} training sequences, {a.n_test} queries, "
          f"1 thread, {a.rounds} rounds, load average at start {os.getloadavg()[0]:.1f}")
    runs = {}
    for r in range(a.rounds):
        for m in a.methods.split(","):
            for label, tokens in SETTINGS.items():
                res = spawn(m, a.n_train, a.n_test, a.batch, tokens, a.python)
                runs.setdefault((m, label), []).append(res)
                print(f"# round {r + 1} {m:9s} {label:30s} {res['total']:6.2f} s  peak {res['peak_rss_mb']:.0f} MB",
                      flush=True)
    med = statistics.median
    print(f"\n{'method':10s} {'setting':30s} {'seconds':>8s} {'peak MB':>8s} {'time / full':>11s} {'peak / full':>11s}")
    for m in a.methods.split(","):
        full = runs[(m, "batch_tokens=0 (full batches)")]
        t0, p0 = med([x["total"] for x in full]), med([x["peak_rss_mb"] for x in full])
        for label in SETTINGS:
            xs = runs[(m, label)]
            t, p = med([x["total"] for x in xs]), med([x["peak_rss_mb"] for x in xs])
            print(f"{m:10s} {label:30s} {t:8.2f} {p:8.0f} {t / t0:10.2f}× {p / p0:10.2f}×")


if __name__ == "__main__":
    main()
