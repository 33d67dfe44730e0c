"""EK-FAC influence on W3 against the floor of its math, measured in the same process (issue 28, item 7).

    PYTHONPATH=. OMP_NUM_THREADS=1 flock /work/bigmem.lock .venv/bin/python benchmarks/ekfac_floor.py
    ... benchmarks/ekfac_floor.py --json benchmarks/results/ekfac_floor_w3.json   # also keep the record
    ... benchmarks/ekfac_floor.py --eigh-dtypes float64,float32      # also time float32 eigh

The workload is the peer harness's W3 (``../shared/peers-bench/workloads.py``: GPT-2-small
width, 12 × 768, vocabulary 50,257, Conv1D swapped for nn.Linear, random init and tokens,
T = 128, batch 8; ``BENCH_W3_NTRAIN`` / ``BENCH_W3_NTEST`` set the sizes, 16 / 2 here by
default) and gradalg's side is the harness's ``gradalg_ekfac`` (public API:
``ga.methods.influence(curvature="ekfac")`` over the 48 ``nn.Linear`` of ``transformer.h.*``,
sampled-label curvature, damping 10⁻⁸), run as ``Scores.explain(analyze=True)`` so that each
of its passes is timed.

The floor is the same math written as directly as torch allows, with nothing else (no plan,
checks, digests or fingerprinting), each piece timed in this process after gradalg's run. Like
gradalg's plan at this size, it reads the training set once and keeps its factors (activations
and output gradients, float32: 1.9 GB here) for the later stages:

``covariance``  a capture pass over the training set: per batch one forward and two
                ``torch.autograd.grad`` w.r.t. the Linear outputs only (no weight-gradient
                GEMMs): of the loss with one label per position drawn from the model (the
                curvature's, as gradalg's ``sampled_loss`` and Kronfluence's ``sample=True``) and
                of the true loss (the scores'); per block A = Σ_t a aᵀ (in, in) and
                S = Σ_t g gᵀ (out, out), one float32 GEMM each per batch into float32 sums.
``eigh``        ``torch.linalg.eigh`` of the 2 × 48 factors at their sizes (768–3072), in the
                dtype gradalg uses (float64 at its default ``kron_float64_width``); the bases
                cast to float32. ``--eigh-dtypes float64,float32`` also times float32.
``correction``  from the kept factors, each example's gradient rotated into the eigenbases,
                ``(D_i Q_S)ᵀ (A_i Q_A)`` (float32), squared and summed: Λ (out, in) per block.
``scores``      the queries captured (true labels), their gradients formed, rotated, divided by
                Λ + λ and rotated back; each kept training example's gradient ``D_iᵀ A_i``
                formed and multiplied with the preconditioned queries (one GEMM per block and
                batch).

floor = the sum. Printed: each piece's time and gradalg's matching pass (its measured seconds
from ``explain(analyze=True)``; the eigendecompositions happen inside gradalg's covariance
pass, which is compared with covariance + eigh; its query pass counts with the scores), gradalg ÷ floor per stage and in total, and
everything × a plain forward+backward over the training set in the same process (median of
``--baseline-reps`` warm passes). Times are process CPU seconds (one thread: steady on a shared
machine) with wall seconds beside them.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
DAMPING = 1e-8   # the harness's KRON_DAMPING (Kronfluence's default damping_factor)


def _clock():
    return time.perf_counter(), time.process_time()


def _since(t0):
    w, c = _clock()
    return {"wall": w - t0[0], "cpu": c - t0[1]}


def _progress(what, t):
    print(f"[{time.strftime('%H:%M:%S')}] {what}: {t['cpu']:.2f} s CPU, {t['wall']:.2f} s wall, "
          f"load {os.getloadavg()[0]:.1f}", file=sys.stderr, flush=True)


def _add(*times):
    return {k: sum(t[k] for t in times) for k in ("wall", "cpu")}


class _Capture:
    """Forward hooks on the attributed Linears: inputs a (b, T, in) and outputs, whose
    gradients ``torch.autograd.grad`` gives as g (b, T, out) (the weight GEMMs never run)."""

    def __init__(self, modules: dict):
        self.modules, self.acts, self.outs = modules, {}, {}
        self.handles = [m.register_forward_hook(self._hook(n)) for n, m in modules.items()]

    def _hook(self, name):
        def hook(m, inputs, out):
            self.acts[name], self.outs[name] = inputs[0].detach(), out
        return hook

    def batch(self, *losses):
        """``({block: a}, [{block: g} per loss])`` of one forward (the losses share it)."""
        import torch
        names = list(self.modules)
        outs = [self.outs[n] for n in names]
        grads = [dict(zip(names, torch.autograd.grad(loss, outs, retain_graph=k + 1 < len(losses))))
                 for k, loss in enumerate(losses)]
        acts = dict(self.acts)
        self.acts.clear()
        self.outs.clear()
        return acts, grads

    def close(self):
        for h in self.handles:
            h.remove()


def floor_pieces(wl, names, eigh_dtypes, losses) -> tuple[dict, "torch.Tensor"]:
    """Each piece of EK-FAC's math (module docstring), timed. Returns (times, scores (q, n))."""
    import torch
    W = sys.modules["workloads"]
    model, bs = wl["model"], wl["batch_size"]
    modules = dict((n, m) for n, m in model.named_modules() if n in set(names))
    out = {}
    cap = _Capture(modules)
    gen = torch.Generator().manual_seed(0)
    try:
        # covariance pass: one forward per batch, the output gradients of the sampled-label
        # loss (curvature) and of the true loss (scores); A and S summed, the factors kept
        t0 = _clock()
        A = {n: torch.zeros(m.in_features, m.in_features) for n, m in modules.items()}
        S = {n: torch.zeros(m.out_features, m.out_features) for n, m in modules.items()}
        kept = []
        for b in W.iter_batches(wl["train"], bs):
            acts, (g_s, g_t) = cap.batch(*losses(model, b, gen))
            for n in modules:
                a, g = acts[n].flatten(0, 1), g_s[n].flatten(0, 1)
                A[n].addmm_(a.T, a)
                S[n].addmm_(g.T, g)
            kept.append((acts, g_s, g_t))
        out["covariance"] = _since(t0)
        _progress("floor covariance", out["covariance"])

        # eigendecompositions in gradalg's dtype (the first asked); the bases kept in float32
        t0 = _clock()
        Q = {}
        for n in modules:
            Q[n] = tuple(torch.linalg.eigh(M.to(eigh_dtypes[0]))[1].to(torch.float32) for M in (S[n], A[n]))
        out["eigh"] = _since(t0)
        _progress(f"floor eigh {eigh_dtypes[0]}", out["eigh"])
        for dtype in eigh_dtypes[1:]:   # other dtypes: timed only
            t0 = _clock()
            for n in modules:
                for M in (S[n], A[n]):
                    torch.linalg.eigh(M.to(dtype))
            out[f"eigh_{str(dtype).split('.')[-1]}"] = _since(t0)
            _progress(f"floor eigh {dtype}", out[f"eigh_{str(dtype).split('.')[-1]}"])
        del A, S

        # eigenvalue correction from the kept factors: (D_i Q_S)ᵀ (A_i Q_A), squared, summed
        t0 = _clock()
        lam = {n: torch.zeros(m.out_features, m.in_features) for n, m in modules.items()}
        n_train = 0
        for acts, g_s, _ in kept:
            for n in modules:
                Q_S, Q_A = Q[n]
                rotated = torch.matmul((g_s[n] @ Q_S).transpose(1, 2), acts[n] @ Q_A)   # (b, out, in)
                lam[n] += rotated.square_().sum(0)
            n_train += next(iter(acts.values())).shape[0]
        for n in lam:
            lam[n].div_(n_train).add_(DAMPING)
        out["correction"] = _since(t0)
        _progress("floor correction", out["correction"])

        # scores: the queries captured, preconditioned; the kept training gradients against them
        t0 = _clock()
        pre = {n: [] for n in modules}
        for b in W.iter_batches(wl["test"], bs):
            acts, (g_t,) = cap.batch(losses(model, b, None)[1])
            for n in modules:
                Q_S, Q_A = Q[n]
                G = torch.matmul(g_t[n].transpose(1, 2), acts[n])                 # (q, out, in)
                R = torch.matmul(Q_S.T, G) @ Q_A
                R.div_(lam[n])
                pre[n].append((torch.matmul(Q_S, R) @ Q_A.T).flatten(1))           # (q, out·in)
        pre = {n: torch.cat(v) for n, v in pre.items()}
        blocks = []
        for acts, _, g_t in kept:
            s = 0
            for n in modules:
                G = torch.matmul(g_t[n].transpose(1, 2), acts[n]).flatten(1)      # (b, out·in)
                s = s + pre[n] @ G.T
            blocks.append(s)
        scores = torch.cat(blocks, 1)
        out["scores"] = _since(t0)
        _progress("floor scores", out["scores"])
    finally:
        cap.close()
    out["floor"] = _add(out["covariance"], out["eigh"], out["correction"], out["scores"])
    return out, scores


def _losses(W):
    """``losses(model, batch, gen)`` → (sampled-label loss, true loss) of one forward: the
    summed per-sequence LM loss with one target per position drawn from the model
    (Kronfluence's ``sample=True``, gradalg's ``sampled_loss``; None without ``gen``) and
    with the true next tokens."""
    import torch
    import torch.nn.functional as F

    def losses(model, batch, gen):
        (ids,) = batch
        logits = model(input_ids=ids).logits
        true = W.lm_loss_per_example(logits, ids).sum()
        if gen is None:
            return None, true
        shifted = logits[:, :-1].reshape(-1, logits.shape[-1]).float()
        with torch.no_grad():
            tgt = torch.multinomial(torch.softmax(shifted.detach(), -1), 1, generator=gen).flatten()
        return F.cross_entropy(shifted, tgt, reduction="sum"), true
    return losses


def measure(args) -> dict:
    """One process: the baseline, gradalg's EK-FAC (per pass) and the floor's pieces."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("BENCH_W3_NTRAIN", "16")
    os.environ.setdefault("BENCH_W3_NTEST", "2")
    import torch
    torch.set_num_threads(1)
    sys.path.insert(0, os.path.abspath(args.harness))
    import run_peer as R
    import workloads as W

    import gradalg as ga

    wl = W.WORKLOADS["w3"]()
    model, bs = wl["model"], wl["batch_size"]
    names = R._wl_linear(wl)[:args.blocks or None]

    def baseline_pass():
        t0 = _clock()
        for b in W.iter_batches(wl["train"], bs):
            model.zero_grad(set_to_none=True)
            W.batch_loss_sum(model, b, "lm").backward()
        model.zero_grad(set_to_none=True)
        return _since(t0)

    baseline_pass()
    warm = [baseline_pass() for _ in range(args.baseline_reps)]
    base = {k: statistics.median(w[k] for w in warm) for k in ("wall", "cpu")}
    _progress("baseline", base)
    rec = {"workload": wl["name"], "n_train": W.n_examples(wl["train"]), "n_test": W.n_examples(wl["test"]),
           "batch_size": bs, "blocks": len(names), "gradalg": os.path.dirname(os.path.dirname(os.path.abspath(ga.__file__))),
           "torch": torch.__version__, "load_before": os.getloadavg()[0], "baseline": base}

    if not args.skip_gradalg:
        task = R._ga_task(wl)
        with ga.options(batch_size=bs, progress=False):
            t0 = _clock()
            S = ga.methods.influence(task, wl["train"], wl["test"], layers=names, curvature="ekfac", damping=DAMPING)
            ex = S.explain(analyze=True)
            rec["gradalg_total"] = _since(t0)
            _progress("gradalg", rec["gradalg_total"])
            print(ex, flush=True)
        rec["gradalg_passes"] = [{"reads": p["reads"], "jobs": p["jobs"], "cpu": p.get("measured_cpu_seconds"),
                                  "wall": p.get("measured_seconds"), "estimated": p["seconds"]}
                                 for p in ex.passes()]
        del S, ex
    dtypes = [getattr(torch, d) for d in args.eigh_dtypes.split(",")]
    floor, _ = floor_pieces(wl, names, dtypes, _losses(W))
    rec["floor"] = floor
    rec["load_after"] = os.getloadavg()[0]
    return rec


def _stage_of(p: dict) -> str:
    jobs = " ".join(p["jobs"])
    if jobs.startswith("kfac"):
        return "covariance+eigh"
    if jobs.startswith("ekfac"):
        return "correction"
    return "scores"


def table(rec: dict) -> str:
    """gradalg's passes beside the floor's pieces, CPU (wall) seconds and ratios."""
    fl, base = rec["floor"], rec["baseline"]
    lines = [f"{rec['workload']}: {rec['n_train']} training sequences / {rec['n_test']} queries, batch "
             f"{rec['batch_size']}, {rec['blocks']} blocks, 1 thread; load {rec['load_before']:.1f} → "
             f"{rec['load_after']:.1f}; plain forward+backward {base['cpu']:.2f} s CPU ({base['wall']:.2f} s wall)",
             f"{'stage':<22} {'floor cpu s':>11} {'gradalg cpu s':>13} {'gradalg/floor':>13} {'floor ×fb':>9} {'gradalg ×fb':>11}"]
    pieces = {"covariance+eigh": _add(fl["covariance"], fl["eigh"]), "correction": fl["correction"],
              "scores": fl["scores"]}
    got = {}
    for p in rec.get("gradalg_passes", []):
        st = _stage_of(p)
        got[st] = got.get(st, 0.0) + (p["cpu"] or p["wall"])
    for k, v in fl.items():   # the pieces (eigh: gradalg's dtype; eigh_<dtype>: each dtype timed)
        if k == "floor":
            continue
        lines.append(f"  {k:<20} {v['cpu']:11.2f} {'':>13} {'':>13} {v['cpu'] / base['cpu']:9.2f}")
    for st, v in pieces.items():
        g = got.get(st)
        lines.append(f"{st:<22} {v['cpu']:11.2f} {g if g is not None else float('nan'):13.2f} "
                     f"{(g / v['cpu']) if g else float('nan'):13.2f} {v['cpu'] / base['cpu']:9.2f} "
                     f"{(g / base['cpu']) if g else float('nan'):11.2f}")
    lines.append(f"{'floor (sum)':<22} {fl['floor']['cpu']:11.2f} {'':>13} {'':>13} {fl['floor']['cpu'] / base['cpu']:9.2f}")
    if "gradalg_total" in rec:
        t = rec["gradalg_total"]
        lines.append(f"{'total (gradalg: call)':<22} {fl['floor']['cpu']:11.2f} {t['cpu']:13.2f} "
                     f"{t['cpu'] / fl['floor']['cpu']:13.2f} {fl['floor']['cpu'] / base['cpu']:9.2f} "
                     f"{t['cpu'] / base['cpu']:11.2f}")
        lines.append(f"wall: floor {fl['floor']['wall']:.1f} s, gradalg {t['wall']:.1f} s "
                     f"({t['wall'] / fl['floor']['wall']:.2f}×)")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--harness", default=os.path.join(ROOT, "..", "shared", "peers-bench"))
    ap.add_argument("--baseline-reps", type=int, default=3)
    ap.add_argument("--eigh-dtypes", default="float64", help="gradalg's first (float64 at its defaults)")
    ap.add_argument("--skip-gradalg", action="store_true", help="the floor alone")
    ap.add_argument("--blocks", type=int, default=0, help="only the first N blocks (a quick check; 0: all 48)")
    ap.add_argument("--json", default=None, help="append this run's record here")
    args = ap.parse_args(argv)
    rec = measure(args)
    print(json.dumps(rec), flush=True)
    print(table(rec))
    if args.json:
        old = json.load(open(args.json)) if os.path.exists(args.json) else []
        json.dump(old + [rec], open(args.json, "w"), indent=1)
    return rec


if __name__ == "__main__":
    main()
