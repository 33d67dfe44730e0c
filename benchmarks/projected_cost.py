"""The projected methods at GPT-2-small width, × a plain forward+backward, old checkout vs this one
(issue 28, items 3 and 7).

    python benchmarks/projected_cost.py                                  # this checkout only
    python benchmarks/projected_cost.py --compare ../wt-old --rounds 2   # old and new, alternating

Model: ``GPT2Config(n_layer=4, n_embd=768, n_head=12, vocab_size=50257)`` (``--layers``),
random init, dropout off, tied head: W3's width and vocabulary (``../shared/peers-bench``,
GPT-2 small with 12 layers) with fewer blocks, so that a run takes minutes on one thread.
Data: random token ids, T = 128, ``--train`` 16 training sequences and ``--queries`` 2
queries (W3's 1/8 share). Task: ``ga.tasks.causal_lm(model)``; every method at the
library's default layers (the block Linears: 16 at 4 layers, 48 at 12) and its defaults,
public API only:

    graddot_kron   (P(Q) @ P(G).T) with P = ga.proj.kron(4096): projected Grad-Dot, 64 × 64 per layer
    graddot        (Q @ G.T): full-gradient Grad-Dot (not run by default: name it in --methods)
    logra          ga.methods.logra (k = 4096 per layer, EK-FAC in the projected space)
    less           ga.methods.less, one checkpoint (an Adam state after one step on 4 training
                   sequences, weights put back, built before the clock), each query its own target
    trak           ga.methods.trak (k = 2048)
    grass          ga.methods.grass (FactGraSS, k = 256 per layer)

In one process, one thread: the unit is a plain forward and ``loss.backward()`` (all
parameter gradients) of the task's summed loss over the training set in batches of 4 (the
batch gradalg's plan reads here: ``batch_tokens`` 512 / T), the median of
``--baseline-reps`` warm passes after a cold one. ``floor`` is the least any capture can do:
the forward and ``torch.autograd.grad`` w.r.t. the attributed Linear outputs only (no weight
gradients), over the training set and the queries, nothing kept. ``floor_full`` (with
``graddot``) is the full Grad-Dot's floor in plain torch: the same passes, the queries'
layer inputs A and output gradients D kept, and per block and training batch the score
kernel of fewer multiply-adds, ghost Σ_{t,u} (a_t·a'_u + 1)(d_t·d'_u) (nq·nb·T²·(in+1+out))
or dense (each training example's D_iᵀ[A_i 1] materialized, then one GEMM with the
queries', materialized once: nb·T·out·(in+1) + nq·nb·out·(in+1)). One untimed tiny Grad-Dot
(1 sequence each side) loads gradalg's lazy imports first; then each method is timed once,
end to end (planning, every pass, scores). Times are process CPU time (steadier than wall
on a shared machine; wall is printed as well), each divided by the same process's plain
pass. ``--compare OLD`` runs the same measurement with ``PYTHONPATH=OLD`` (another
checkout, e.g. ``git worktree add ../wt-old main``) and this checkout in alternating
processes, and prints both side by side with new/old.
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
METHODS = ("graddot_kron", "logra", "less", "trak", "grass")
EXTRA = ("graddot",)          # run when named in --methods
T, VOCAB, BATCH = 128, 50257, 4


def _clock():
    return time.perf_counter(), time.process_time()


def _since(t0):
    w, c = _clock()
    return w - t0[0], c - t0[1]


def measure(args) -> dict:
    """One process: plain pass, floor and every method; seconds (wall, cpu)."""
    import torch
    import transformers as tf

    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = tf.GPT2Config(n_layer=args.layers, n_embd=768, n_head=12, vocab_size=VOCAB, n_positions=1024,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = tf.GPT2LMHeadModel(cfg).eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (args.train + args.queries, T), generator=g)
    train = [{"input_ids": r} for r in ids[:args.train]]
    queries = [{"input_ids": r} for r in ids[args.train:]]

    import gradalg as ga
    task = ga.tasks.causal_lm(model)

    def batches(rows):
        for i in range(0, len(rows), BATCH):
            yield {"input_ids": rows[i:i + BATCH]}

    def plain_pass():
        t0 = _clock()
        for b in batches(ids[:args.train]):
            model.zero_grad(set_to_none=True)
            task.summed_loss(model, b).backward()
        model.zero_grad(set_to_none=True)
        return _since(t0)

    def floor_pass():
        lin = [m for n, m in model.named_modules()
               if n.startswith("transformer.h.") and isinstance(m, (torch.nn.Linear, tf.pytorch_utils.Conv1D))]
        outs = []
        handles = [m.register_forward_hook(lambda m, a, o: outs.append(o)) for m in lin]
        t0 = _clock()
        try:
            for b in batches(ids):
                outs.clear()
                torch.autograd.grad(task.summed_loss(model, b), outs)
        finally:
            for h in handles:
                h.remove()
        return _since(t0)

    def floor_full_pass():
        """floor_pass plus the full Grad-Dot's score kernels: the least its math can cost."""
        lin = [m for n, m in model.named_modules()
               if n.startswith("transformer.h.") and isinstance(m, (torch.nn.Linear, tf.pytorch_utils.Conv1D))]
        ins, outs = [], []

        def hook(m, a, o):
            ins.append(a[0].detach())
            outs.append(o)

        def ones(A):     # the bias's column
            return torch.cat([A, A.new_ones(*A.shape[:-1], 1)], -1)

        handles = [m.register_forward_hook(hook) for m in lin]
        t0 = _clock()
        try:
            ins.clear()
            outs.clear()
            qD = torch.autograd.grad(task.summed_loss(model, {"input_ids": ids[args.train:]}), outs)
            nq = len(queries)
            held = [[A, D, None] for A, D in zip(ins, qD)]    # the dense kernel's G materialized once, when used
            scores = torch.zeros(nq, args.train)
            for i, b in enumerate(batches(ids[:args.train])):
                ins.clear()
                outs.clear()
                Ds = torch.autograd.grad(task.summed_loss(model, b), outs)
                nb = len(b["input_ids"])
                for q, A, D in zip(held, ins, Ds):
                    d_in, d_out = A.shape[-1] + 1, D.shape[-1]
                    ghost = nq * nb * T * T * (d_in + d_out)
                    dense = nb * T * d_out * d_in + nq * nb * d_out * d_in
                    if ghost <= dense:
                        K = (q[0].flatten(0, 1) @ A.flatten(0, 1).T + 1) * (q[1].flatten(0, 1) @ D.flatten(0, 1).T)
                        part = K.view(nq, T, nb, T).sum((1, 3))
                    else:
                        if q[2] is None:
                            q[2] = torch.einsum("bto,bti->boi", q[1], ones(q[0])).flatten(1)
                        part = q[2] @ torch.einsum("bto,bti->boi", D, ones(A)).flatten(1).T
                    scores[:, i * BATCH:i * BATCH + nb] += part
        finally:
            for h in handles:
                h.remove()
        took = _since(t0)
        floor_scores.append(scores)
        return took

    floor_scores = []   # the floor's scores, compared with gradalg's full Grad-Dot below

    def adam():
        saved = [p.detach().clone() for p in model.parameters()]
        opt = torch.optim.Adam(model.parameters(), lr=1e-4)
        task.summed_loss(model, {"input_ids": ids[:4]}).backward()
        opt.step()
        with torch.no_grad():
            for p, s in zip(model.parameters(), saved):
                p.copy_(s)
                p.grad = None
        return opt

    def build(method):
        m = ga.methods
        if method == "graddot_kron":
            P = ga.proj.kron(4096)
            return P(ga.grads(task, queries)) @ P(ga.grads(task, train)).T
        if method == "graddot":
            return ga.grads(task, queries) @ ga.grads(task, train).T
        if method == "less":
            return m.less([task], [adam()], [1.0], train, queries, torch.arange(len(queries)))
        return getattr(m, method)(task, train, queries)

    (ga.grads(task, queries[:1]) @ ga.grads(task, train[:1]).T).compute()     # lazy imports, untimed
    plain_pass()
    warm = [plain_pass() for _ in range(args.baseline_reps)]
    out = {"layers": args.layers, "n_train": args.train, "n_test": args.queries,
           "gradalg": os.path.dirname(os.path.dirname(os.path.abspath(ga.__file__))),
           "baseline": (statistics.median(w for w, _ in warm), statistics.median(c for _, c in warm)),
           "loadavg": os.getloadavg(), "times": {"floor": floor_pass()}}
    if "graddot" in args.methods:
        out["times"]["floor_full"] = floor_full_pass()
    for method in args.methods:
        scores = build(method)
        t0 = _clock()
        result = scores.compute()
        out["times"][method] = _since(t0)
        if method == "graddot" and floor_scores:    # the floor computes the same scores
            got = torch.as_tensor(result.values)
            out["floor_full_max_rel_diff"] = float((got - floor_scores[0].to(got.dtype)).abs().max() / got.abs().max())
        del result
        del scores
    return out


def table(results: list[dict]) -> str:
    """Median CPU (and wall) ratio per (checkout, method) to the same process's plain pass;
    new/old where two checkouts ran."""
    by = {}
    for r in results:
        for m, (w, c) in r["times"].items():
            by.setdefault(m, {}).setdefault(r["gradalg"], []).append((w / r["baseline"][0], c / r["baseline"][1]))
    checkouts = list(dict.fromkeys(r["gradalg"] for r in results))
    r0 = results[0]
    loads = [la[0] for la in (r.get("loadavg") for r in results) if la]
    lines = [f"GPT-2 {r0['layers']} layers × 768, vocab {VOCAB}, T = {T}; {r0['n_train']} training sequences / "
             f"{r0['n_test']} queries; plain pass at batch {BATCH}; 1 thread; {len(results)} process(es); "
             f"load average {min(loads):.1f}–{max(loads):.1f}" if loads else "",
             "× a plain forward+backward over the training set (median over processes; CPU time, wall in brackets)",
             ""]
    names = [os.path.basename(c) for c in checkouts]
    head = "| method | " + " | ".join(f"{n} × plain" for n in names) + (" | new / old |" if len(checkouts) == 2 else " |")
    lines += [head, "|---" * (len(checkouts) + 1 + (len(checkouts) == 2)) + "|"]
    for m, per in by.items():
        cells, cpu = [], []
        for c in checkouts:
            v = per.get(c, [])
            if not v:
                cells.append("")
                cpu.append(None)
                continue
            cw, cc = statistics.median(w for w, _ in v), statistics.median(c_ for _, c_ in v)
            cells.append(f"{cc:.3f} ({cw:.3f})")
            cpu.append(cc)
        row = f"| {m} | " + " | ".join(cells)
        if len(checkouts) == 2:
            row += f" | {cpu[1] / cpu[0]:.3f}" if None not in cpu else " |"
        lines.append(row + " |")
    last = checkouts[-1]
    ref = {m: statistics.median(c for _, c in per[last]) for m, per in by.items() if last in per}
    if "logra" in ref:
        lines.append("")
        lines.append(f"{os.path.basename(last)}: " + ", ".join(
            f"{m} / logra {ref[m] / ref['logra']:.2f}" for m in ("less", "trak", "grass") if m in ref)
            + (f"; graddot_kron / floor {ref['graddot_kron'] / ref['floor']:.2f}" if "graddot_kron" in ref else ""))
    ratios = [f"{m} / {f} {ref[m] / ref[f]:.3f}" for m, f in (("graddot_kron", "floor"), ("graddot", "floor_full"))
              if m in ref and f in ref]
    if ratios:
        lines += ["", f"{os.path.basename(last)}: " + ", ".join(ratios)]
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--train", type=int, default=16)
    ap.add_argument("--queries", type=int, default=2)
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--baseline-reps", type=int, default=2)
    ap.add_argument("--compare", default=None, help="another checkout, run in alternating processes (first)")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--json", default=None, help="write (and resume from) every process's times here")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.methods = [m for m in args.methods.split(",") if m]
    if args.child:
        print("RESULT " + json.dumps(measure(args)), flush=True)
        return None
    checkouts = ([os.path.abspath(args.compare)] if args.compare else []) + [ROOT]
    results = []
    if args.json and os.path.exists(args.json):          # resume: rounds already measured
        with open(args.json) as f:
            results = json.load(f)
    for i in range(len(results), args.rounds * len(checkouts)):
        checkout = checkouts[i % len(checkouts)]
        env = dict(os.environ, PYTHONPATH=checkout, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        cmd = [sys.executable, os.path.abspath(__file__), "--child", "--layers", str(args.layers),
               "--train", str(args.train), "--queries", str(args.queries), "--methods", ",".join(args.methods),
               "--baseline-reps", str(args.baseline_reps)]
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
