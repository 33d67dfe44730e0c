"""Each method's time as × a plain forward+backward, old checkout vs this one (issue 28, item 7).

    python benchmarks/capture_floor.py --workload w2                       # this checkout only
    python benchmarks/capture_floor.py --workload w3 --compare ../wt-old --rounds 2

The workloads are the peer harness's (``../shared/peers-bench/workloads.py``: W2 GPT-2 4 × 256,
vocab 2048; W3 GPT-2-small width, vocab 50,257; T = 128, Conv1D swapped for nn.Linear) and
the methods its ``gradalg_*`` functions (public API only): projected Grad-Dot (Kronecker
64 × 64 per layer), full Grad-Dot, LoGra (64 × 64), TRAK (k = 4096 on W2, 512 on W3).

In one process (one thread): the baseline is a plain ``loss.backward()`` over the training
set at the workload's batch size (1 cold pass, then the median of ``--baseline-reps``
warm passes, as the harness does); ``floor`` is the least a hook capture can do: a forward
and ``torch.autograd.grad`` w.r.t. the attributed Linear outputs over the training set and
the queries, nothing kept; each method is then timed once, end to end (planning, the
capture of training set and queries, scores). Every time is reported as wall and as CPU
time (``time.process_time``: on a loaded machine a single-threaded process's CPU time is
far steadier than its wall time), each divided by the baseline's of the same process.
``--compare OLD`` runs the same measurement in alternating processes with
``PYTHONPATH=OLD`` (another checkout) and this checkout, and prints both.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
METHODS = ("graddot_kron", "graddot", "logra", "trak")


def _clock():
    return time.perf_counter(), time.process_time()


def _since(t0):
    w, c = _clock()
    return w - t0[0], c - t0[1]


def measure(args) -> dict:
    """One process: baseline, floor and every method, times in seconds (wall, cpu)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    sys.path.insert(0, os.path.abspath(args.harness))
    import run_peer as R
    import workloads as W

    wl = W.WORKLOADS[args.workload]()
    model, kind, bs = wl["model"], wl["kind"], wl["batch_size"]

    def baseline_pass():
        t0 = _clock()
        for b in W.iter_batches(wl["train"], bs):
            model.zero_grad(set_to_none=True)
            W.batch_loss_sum(model, b, kind).backward()
        model.zero_grad(set_to_none=True)
        return _since(t0)

    def floor_pass():
        lin = [m for n, m in model.named_modules() if n in set(R._wl_linear(wl))]
        outs = []
        handles = [m.register_forward_hook(lambda m, a, o: outs.append(o)) for m in lin]
        t0 = _clock()
        try:
            for data in (wl["train"], wl["test"]):
                for b in W.iter_batches(data, bs):
                    outs.clear()
                    torch.autograd.grad(W.batch_loss_sum(model, b, kind), outs)
        finally:
            for h in handles:
                h.remove()
        return _since(t0)

    import gradalg as ga   # imported before timing: the harness counts it, a comparison should not

    baseline_pass()
    warm = [baseline_pass() for _ in range(args.baseline_reps)]
    base = (statistics.median(w for w, _ in warm), statistics.median(c for _, c in warm))
    out = {"workload": wl["name"], "n_train": W.n_examples(wl["train"]), "n_test": W.n_examples(wl["test"]),
           "batch_size": bs, "gradalg": os.path.dirname(os.path.dirname(os.path.abspath(ga.__file__))),
           "baseline": base, "times": {}}
    out["times"]["floor"] = floor_pass()
    for method in args.methods:
        k = args.trak_k if method == "trak" else args.proj_dim
        a = argparse.Namespace(proj_dim=k or (512 if args.workload == "w3" else 4096), gradalg_variant=method)
        t0 = _clock()
        R.peer_gradalg(wl, a, method)
        out["times"][method] = _since(t0)
    return out


def table(results: list[dict]) -> str:
    """Median ratios per (checkout, method): wall and CPU time ÷ the same process's baseline."""
    by = {}
    for r in results:
        for m, (w, c) in r["times"].items():
            by.setdefault((r["gradalg"], m), []).append((w / r["baseline"][0], c / r["baseline"][1]))
    r0 = results[0]
    lines = [f"{r0['workload']}: {r0['n_train']} training sequences / {r0['n_test']} queries, batch "
             f"{r0['batch_size']}, 1 thread; × a plain forward+backward over the training set "
             f"(median of {len(results) // max(1, len({r['gradalg'] for r in results}))} process(es) each)",
             f"{'checkout':<28} {'method':<14} {'wall ×':>8} {'cpu ×':>8}"]
    for (checkout, m), v in by.items():
        lines.append(f"{os.path.basename(checkout):<28} {m:<14} {statistics.median(w for w, _ in v):8.3f} "
                     f"{statistics.median(c for _, c in v):8.3f}")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workload", default="w2", choices=("w2", "w3"))
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--harness", default=os.path.join(ROOT, "..", "shared", "peers-bench"))
    ap.add_argument("--baseline-reps", type=int, default=3)
    ap.add_argument("--proj-dim", type=int, default=4096, help="64 × 64 per layer for Grad-Dot and LoGra")
    ap.add_argument("--trak-k", type=int, default=0, help="TRAK's k (0: 4096 on W2, 512 on W3)")
    ap.add_argument("--compare", default=None, help="another checkout, run in alternating processes")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json", default=None, help="also write every process's times here")
    args = ap.parse_args(argv)
    args.methods = [m for m in args.methods.split(",") if m]
    if args.child:
        print("RESULT " + json.dumps(measure(args)), flush=True)
        return None
    checkouts = ([os.path.abspath(args.compare)] if args.compare else []) + [ROOT]
    results = []
    for _ in range(args.rounds):
        for checkout in checkouts:
            env = dict(os.environ, PYTHONPATH=checkout, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
            cmd = [sys.executable, os.path.abspath(__file__), "--child", "--workload", args.workload,
                   "--methods", ",".join(args.methods), "--harness", args.harness,
                   "--baseline-reps", str(args.baseline_reps), "--proj-dim", str(args.proj_dim),
                   "--trak-k", str(args.trak_k)]
            done = subprocess.run(cmd, env=env, capture_output=True, text=True)
            line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                raise RuntimeError(f"{checkout}: no result\n{done.stderr[-3000:]}")
            results.append(json.loads(line[len("RESULT "):]))
            print(json.dumps(results[-1]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    print(table(results))
    return results


if __name__ == "__main__":
    main()
