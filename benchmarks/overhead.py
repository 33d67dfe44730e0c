"""Overhead benchmark: attribution scores versus one plain forward+backward pass.

Model (built from a config, random weights, nothing downloaded)::

    GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=1024, n_positions=128,
               resid_pdrop=0, embd_pdrop=0, attn_pdrop=0)        # 3.4 M parameters

Data: random token ids, T = 128; 512 training sequences, 32 queries; batches of 32.
Loss: next-token cross-entropy summed over sequences. Attributed layers: every Conv1D
of the transformer blocks (``transformer.h.*``: c_attn, attn.c_proj, mlp.c_fc,
mlp.c_proj; 16 blocks, 3.2 M coordinates; embeddings and the LM head are left out).

Measured side by side in one process, interleaved round by round:

    plain      forward + ``loss.backward()`` (all parameter gradients) over the training set
    grad-dot   ``(Q @ G.T).compute()``: the 32 query gradients, then the training pass
    projected  ``(P(Q) @ P(G).T).compute()`` with ``P = ga.proj.kron(k=256)`` (16×16 per block)

Every gradalg run includes its query pass, planning, and the default safety checks
(finite gradients, loss reduction). The ratio is the method's time over the plain pass's
time in the same round; the table gives the median over rounds. With one thread
(``--threads 1``) the ratios use the process's CPU time, which on a shared machine does
not count the time spent waiting for a core (wall-clock ratios are printed too). Peak memory is measured
in a fresh subprocess per (run, training-set size): the growth of its peak resident set
(VmHWM) above its resident set after the model and data are built, before anything
runs; the flat-memory check runs each method on the training set and on a
quarter of it. On a shared machine run it with ``--threads 1``: two threads competing
with other processes make the timings swing by 3×.

    .venv/bin/python benchmarks/overhead.py --threads 1   # 512 sequences, 3 rounds (~10 min here)
    .venv/bin/python benchmarks/overhead.py --quick       # 128 sequences, 1 round (the 32
                                                          # queries weigh 4× more: higher ratios)
"""
from __future__ import annotations

import argparse
import datetime
import gc
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import gradalg as ga  # noqa: E402

T, N_QUERY, BATCH = 128, 32, 32
LAYERS = ["transformer.h.*"]
PEERS = "Bergson (Kronecker-projected scores) 1.6×, Kronfluence (no curvature) 2.5× — 256 training sequences"


def build_model():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=1024, n_positions=T, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config).eval()


def lm_loss(model, batch):
    ids = batch[0]
    logits = model(input_ids=ids).logits[:, :-1]
    return F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten(), reduction="sum")


# ------------------------------------------------------------------------------ memory
def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    return 0


def run_measured(fn):
    """(wall seconds, CPU seconds of this process) of ``fn()``."""
    gc.collect()
    start, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - start, time.process_time() - cpu


# ------------------------------------------------------------------------------ the three runs
def make_runs(model, X, XQ):
    task = ga.Task(model, lm_loss, name="gpt2-4x256")
    P = ga.proj.kron(k=256, seed=0)

    def plain():
        model.zero_grad(set_to_none=True)
        for i in range(0, len(X), BATCH):
            lm_loss(model, (X[i:i + BATCH],)).backward()
        model.zero_grad(set_to_none=True)

    def scores(projector=None):
        def run():
            G = ga.grads(task, (X,), LAYERS)
            Q = ga.grads(task, (XQ,), LAYERS)
            if projector is not None:
                G, Q = projector(G), projector(Q)
            with ga.options(batch_size=BATCH):
                ex = ga.LocalExecutor()
                (Q @ G.T).compute(ex)
            run.kernels = dict(ex.trace)
        run.kernels = {}
        return run

    return {"plain fwd+bwd": plain, "grad-dot": scores(), "projected grad-dot": scores(P)}


def setup(n_train):
    model = build_model()
    g = torch.Generator().manual_seed(0)
    X = torch.randint(0, 1024, (n_train, T), generator=g)
    XQ = torch.randint(0, 1024, (N_QUERY, T), generator=g)
    return model, X, XQ


def child(name: str, n_train: int) -> None:
    """Run one measurement in this (fresh) process and print seconds and peak growth."""
    import json

    model, X, XQ = setup(n_train)
    run = make_runs(model, X, XQ)[name]
    gc.collect()
    before = _status("VmRSS")     # model, data and libraries loaded; nothing run yet
    start = time.perf_counter()
    run()
    seconds = time.perf_counter() - start
    print(json.dumps({"seconds": seconds, "peak": _status("VmHWM") - before}))


def peak_in_subprocess(name: str, n_train: int, threads: int | None):
    import json
    import subprocess

    cmd = [sys.executable, __file__, "--child", name, "--n-train", str(n_train)]
    if threads:
        cmd += ["--threads", str(threads)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])["peak"]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="128 training sequences, one round")
    parser.add_argument("--n-train", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument("--no-memory", action="store_true", help="skip the subprocess memory runs")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    n_train = args.n_train or (128 if args.quick else 512)
    rounds = args.rounds or (1 if args.quick else 3)
    if args.child:
        child(args.child, n_train)
        return 0

    model, X, XQ = setup(n_train)
    runs = make_runs(model, X, XQ)
    n_params = sum(p.numel() for p in model.parameters())

    print(f"# gradalg overhead benchmark — {datetime.datetime.now():%Y-%m-%d %H:%M}")
    print(f"# {platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{os.cpu_count()} cores, load average at start {os.getloadavg()[0]:.1f}")
    print(f"# GPT-2 4 layers × width 256, vocab 1024, {n_params / 1e6:.1f} M parameters; T={T}; "
          f"{n_train} training sequences, {N_QUERY} queries, batch {BATCH}; layers {LAYERS}")

    # warm-up on one batch each (allocator, kernel selection, the device profile)
    for fn in make_runs(model, X[:BATCH], XQ[:4]).values():
        fn()

    wall = {name: [] for name in runs}
    cpu = {name: [] for name in runs}
    for r in range(rounds):
        for name, fn in runs.items():
            w, c = run_measured(fn)
            wall[name].append(w)
            cpu[name].append(c)
        line = ", ".join(f"{name} {wall[name][-1]:.1f} s wall / {cpu[name][-1]:.1f} s CPU" for name in runs)
        print(f"# round {r + 1}: {line}; load average {os.getloadavg()[0]:.1f}", flush=True)
    # one thread: CPU time is the work done, immune to waiting for a core on a shared machine
    times = cpu if torch.get_num_threads() == 1 else wall
    basis = "CPU time (1 thread)" if times is cpu else "wall time"

    peaks = {name: None for name in runs}
    peaks_quarter = dict(peaks)
    if not args.no_memory and os.path.exists("/proc/self/status"):
        for name in runs:
            peaks[name] = peak_in_subprocess(name, n_train, args.threads)
            peaks_quarter[name] = peak_in_subprocess(name, n_train // 4, args.threads)

    base = times["plain fwd+bwd"]
    print()
    print(f"ratios from {basis}; medians over {rounds} round(s)")
    print(f"{'run':<20} {'wall s':>7} {'CPU s':>7} {'ratio':>7} {'ratio (min)':>12} {'ratio (wall)':>13} "
          f"{'peak MiB, n/4':>14} {'peak MiB, n':>12}  kernels")
    results = {}
    for name in runs:
        ratio = statistics.median(t / b for t, b in zip(times[name], base))
        ratio_min = min(times[name]) / min(base)
        ratio_wall = statistics.median(t / b for t, b in zip(wall[name], wall["plain fwd+bwd"]))
        results[name] = ratio
        kernels = getattr(runs[name], "kernels", {})
        kern = ", ".join(f"{k} {v}" for k, v in sorted(kernels.items())) or "-"
        print(f"{name:<20} {statistics.median(wall[name]):>7.1f} {statistics.median(cpu[name]):>7.1f} "
              f"{ratio:>6.2f}× {ratio_min:>11.2f}× {ratio_wall:>12.2f}× {_mib(peaks_quarter[name]):>14} "
              f"{_mib(peaks[name]):>12}  {kern}")
    print()
    flat = []
    for name in ("grad-dot", "projected grad-dot"):
        pk, pq = peaks[name], peaks_quarter[name]
        if pk is not None and pq:
            growth = pk / pq - 1
            flat.append(growth <= 0.10)
            print(f"{name}: peak memory {_mib(pq)} MiB at n={n_train // 4} → {_mib(pk)} MiB at n={n_train} "
                  f"({100 * growth:+.0f} %; target within +10 %)")
    for name in ("grad-dot", "projected grad-dot"):
        print(f"{name}: {results[name]:.2f}× a plain forward+backward (target ≤ 1.2×, stretch ≤ 1.0×)")
    print(f"peers measured on this model (from the issue): {PEERS}")
    ok = all(results[n] <= 1.2 for n in ("grad-dot", "projected grad-dot")) and all(flat)
    return 0 if ok else 1


def _mib(x) -> str:
    return "-" if x is None else f"{x / 2**20:.0f}"


if __name__ == "__main__":
    sys.exit(main())
