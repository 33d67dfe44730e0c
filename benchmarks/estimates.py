"""Are the planner's time estimates true? Estimated against measured seconds, per pass.

Every catalogue method (``ga.methods``: Grad-Dot, Grad-Cos, TracIn, influence with the
Gauss-Newton / K-FAC / EK-FAC / DataInf curvature, LoGra, GraSS and FactGraSS, TRAK,
RelatIF, LESS, self-influence) runs on two workloads with
``Scores.explain(analyze=True)``, which plans, runs the plan and keeps the measured
seconds of each pass beside the planner's estimate:

* **gpt2**: the GPT-2 4×256 of ``benchmarks/methods_cost.py`` (vocabulary 2048, T = 128,
  layers ``transformer.h.*``, its task with sampled labels and TRAK's margin), with
  fewer sequences by default (``--n-train``, ``--n-query``) so that the whole table
  takes a few minutes on one core;
* **mlp**: a 3-layer MLP classifier (64 → 256 → 256 → 10, ``ga.tasks.classification``),
  2,000 training examples and 64 queries, every Linear attributed;
* **gpt2-2l** and **gpt2-small**: GPT-2 of 2 and of 12 layers at GPT-2 small's width
  (768, 12 heads, vocabulary 50,257, tied head, random init), ``ga.tasks.causal_lm``,
  10 training sequences and 2 queries of 64 tokens (``--small-train``, ``--small-query``),
  every method at its defaults (no layers, k or damping given); by default LoGra,
  Grad-Dot and EK-FAC influence on the 2-layer model and LoGra and Grad-Dot on GPT-2 small
  (each run once: no warm-up run, a GPT-2 small pass takes seconds to minutes).

It prints one line per pass (workload, method, pass, what it reads, estimated s,
measured CPU s, wall s, measured CPU / estimated) and a summary: the worst ratio and
the number of passes within [0.5, 2], over all passes and per workload (the worst
pass of each setting: the planner's estimates should hold on small in-memory passes
as on passes over data). With one thread the process's CPU time is the
pass's work without the waits for a core that other processes cause on a shared
machine; on a quiet one it equals the wall time. Each workload starts with a warm-up
run of its first method (imports, allocator, kernels); put a method that draws no
projection matrix first, since matrices are cached for the process. The device profile is this machine's (``ga.devices``,
measured once and cached); it is printed first.

    OMP_NUM_THREADS=1 nice .venv/bin/python benchmarks/estimates.py
    OMP_NUM_THREADS=1 nice .venv/bin/python benchmarks/estimates.py --workloads mlp --methods grad_dot,ekfac
    OMP_NUM_THREADS=1 nice .venv/bin/python benchmarks/estimates.py --refresh   # re-measure the profile
    OMP_NUM_THREADS=1 nice .venv/bin/python benchmarks/estimates.py --workloads mlp,gpt2,gpt2-2l,gpt2-small

Timings of a shared machine vary with its load (printed at the start and the end); run
with one thread (the profile is measured with the thread count in force).
"""
from __future__ import annotations

import argparse
import copy
import datetime
import os
import platform
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import gradalg as ga  # noqa: E402
from gradalg import devices  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import methods_cost as mc  # noqa: E402

BATCH = 32


# ----------------------------------------------------------------------------- workloads
class GPT2Workload:
    """methods_cost.py's GPT-2, its task and a second checkpoint (TracIn, LESS)."""

    name = "gpt2"

    def __init__(self, n_train: int, n_query: int):
        self.inner = mc.Context(n_train, n_query)
        self.task, self.train, self.queries = self.inner.task, self.inner.train, self.inner.queries
        self.checkpoints = self.inner.checkpoints
        self.layers = mc.LAYERS
        self.damping = mc.DAMPING
        self.trak_projector = ga.proj.sparse(512, seed=0)   # a dense (512, 3.15 M) matrix would not fit
        self.query_groups = torch.arange(n_query) % 2

    def optimizers(self):
        return [_adam_state(t.model, (self.inner.X[:BATCH],), mc.lm_loss) for t in self.checkpoints]


class MLPWorkload:
    """A 3-layer MLP classifier on random inputs and labels."""

    name = "mlp"

    def __init__(self, n_train: int, n_query: int, d_in: int = 64, width: int = 256, classes: int = 10):
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(d_in, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                                   nn.Linear(width, classes)).eval()
        g = torch.Generator().manual_seed(0)
        X, XQ = torch.randn(n_train, d_in, generator=g), torch.randn(n_query, d_in, generator=g)
        y, yq = torch.randint(0, classes, (n_train,), generator=g), torch.randint(0, classes, (n_query,), generator=g)
        self.task = ga.tasks.classification(self.model, name="mlp-64x256x256x10")
        self.train, self.queries = (X, y), (XQ, yq)
        other = copy.deepcopy(self.model)
        with torch.no_grad():
            for p in other.parameters():
                p.add_(0.01 * torch.randn(p.shape, generator=g))
        self.checkpoints = [self.task, ga.tasks.classification(other.eval(), name="mlp-ckpt2")]
        self.layers = None
        self.damping = 1e-3
        self.trak_projector = None
        self.query_groups = torch.arange(n_query) % 2

    def optimizers(self):
        X, y = self.train
        loss = lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1], reduction="sum")  # noqa: E731
        return [_adam_state(t.model, (X[:BATCH], y[:BATCH]), loss) for t in self.checkpoints]


class GPT2DefaultsWorkload:
    """GPT-2 at GPT-2 small's width (``n_layer`` layers), random init, with
    ``ga.tasks.causal_lm`` and every method at its defaults (:func:`default_methods`)."""

    defaults = True
    warm_up = False     # one run of each: a GPT-2 small pass takes seconds to minutes

    def __init__(self, n_layer: int, n_train: int, n_query: int, T: int = 64):
        from transformers import GPT2Config, GPT2LMHeadModel
        torch.manual_seed(0)
        config = GPT2Config(n_layer=n_layer, n_embd=768, n_head=12, vocab_size=50257)
        self.model = GPT2LMHeadModel(config).eval()
        self.name = "gpt2-small" if n_layer == 12 else f"gpt2-{n_layer}l"
        self.task = ga.tasks.causal_lm(self.model)
        g = torch.Generator().manual_seed(0)
        self.train = {"input_ids": torch.randint(0, config.vocab_size, (n_train, T), generator=g)}
        self.queries = {"input_ids": torch.randint(0, config.vocab_size, (n_query, T), generator=g)}
        self.default_keys = ("logra", "grad_dot") if n_layer >= 12 else ("logra", "grad_dot", "influence_ekfac")


def default_methods(w) -> dict:
    """``{key: (description, lambda: lazy Scores)}``: the catalogue at its defaults on
    workload ``w`` (its task, training data and queries only)."""
    m = ga.methods
    return {
        "logra": ("LoGra, defaults", lambda: m.logra(w.task, w.train, w.queries)),
        "grad_dot": ("Grad-Dot, defaults", lambda: m.grad_dot(w.task, w.train, w.queries)),
        "grad_cos": ("Grad-Cos, defaults", lambda: m.grad_cos(w.task, w.train, w.queries)),
        "influence_ekfac": ("influence, EK-FAC, defaults",
                            lambda: m.influence(w.task, w.train, w.queries, curvature="ekfac")),
        "influence_kfac": ("influence, K-FAC, defaults",
                           lambda: m.influence(w.task, w.train, w.queries, curvature="kfac")),
        "trak": ("TRAK, defaults", lambda: m.trak(w.task, w.train, w.queries)),
        "grass": ("GraSS, defaults", lambda: m.grass(w.task, w.train, w.queries)),
    }


def _adam_state(model, batch, loss):
    """An Adam optimizer over ``model``'s parameters after one step (LESS reads its
    moments); the weights are put back, so the checkpoint is unchanged."""
    saved = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    opt.zero_grad()
    loss(model, batch).backward()
    opt.step()
    with torch.no_grad():
        for p, s in zip(model.parameters(), saved):
            p.copy_(s)
            p.grad = None
    return opt


# ----------------------------------------------------------------------------- methods
def methods(w) -> dict:
    """``{key: (description, lambda: lazy Scores or SelfScores)}`` over workload ``w``."""
    m, L, lam = ga.methods, w.layers, w.damping
    kron64 = ga.proj.kron(64, seed=0)
    trak_kwargs = {"projector": w.trak_projector} if w.trak_projector is not None else {}
    return {
        "grad_dot": ("Grad-Dot", lambda: m.grad_dot(w.task, w.train, w.queries, layers=L)),
        "grad_cos": ("Grad-Cos", lambda: m.grad_cos(w.task, w.train, w.queries, layers=L)),
        "tracin": ("TracIn-CP, 2 checkpoints",
                   lambda: m.tracin(w.checkpoints, [1e-3, 1e-3], w.train, w.queries, layers=L)),
        "influence_gn": ("influence, Gauss-Newton in kron(64)/layer",
                         lambda: m.influence(w.task, w.train, w.queries, layers=L, projector=kron64, damping=lam)),
        "influence_kfac": ("influence, K-FAC",
                           lambda: m.influence(w.task, w.train, w.queries, layers=L, curvature="kfac", damping=lam)),
        "influence_ekfac": ("influence, EK-FAC",
                            lambda: m.influence(w.task, w.train, w.queries, layers=L, curvature="ekfac",
                                                damping=lam)),
        "datainf": ("influence, DataInf",
                    lambda: m.influence(w.task, w.train, w.queries, layers=L, curvature="datainf", damping=lam)),
        "logra": ("LoGra, EK-FAC in kron(256)/layer",
                  lambda: m.logra(w.task, w.train, w.queries, layers=L, k=256, damping=lam)),
        "factgrass": ("FactGraSS, k=256/layer",
                      lambda: m.grass(w.task, w.train, w.queries, layers=L, k=256, damping=lam)),
        "grass": ("GraSS, k=256/layer",
                  lambda: m.grass(w.task, w.train, w.queries, layers=L, k=256, damping=lam, factored=False)),
        "trak": ("TRAK, 1 model, k=512",
                 lambda: m.trak(w.task, w.train, w.queries, layers=L, k=512, damping=1.0, **trak_kwargs)),
        "relatif": ("RelatIF, Gauss-Newton in kron(64)/layer",
                    lambda: m.relatif(w.task, w.train, w.queries, layers=L, projector=kron64, damping=lam)),
        "less": ("LESS, 2 checkpoints, k=512",
                 lambda: m.less(w.checkpoints, w.optimizers(), [1e-3, 1e-3], w.train, w.queries, w.query_groups,
                                layers=L, k=512, **trak_kwargs)),
        "self_influence": ("self-influence, Gauss-Newton in kron(64)/layer",
                           lambda: m.self_influence(m.influence, w.task, w.train, layers=L, projector=kron64,
                                                    damping=lam)),
    }


# ----------------------------------------------------------------------------- measuring
def rows_of(explained) -> list[dict]:
    """The physical stage's rows (estimate and measurement side by side)."""
    return [r for r in explained.passes() if "measured_seconds" in r]


def run(workload, keys, log) -> list[dict]:
    table = []
    catalogue = default_methods(workload) if getattr(workload, "defaults", False) else methods(workload)
    for key in keys:
        label, build = catalogue[key]
        with ga.options(batch_size=BATCH, progress=False):
            try:
                start = time.perf_counter()
                ex = build().explain(analyze=True)
                total = time.perf_counter() - start
            except Exception as exc:  # noqa: BLE001 - reported in the table
                log(f"{workload.name:5s} {key:16s} failed: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
                continue
        for row in rows_of(ex):
            # one thread: the process's CPU time is the pass's work without the waits for a
            # core that other processes of a shared machine cause (wall time is printed too)
            measured = row.get("measured_cpu_seconds", row["measured_seconds"])
            ratio = measured / max(row["seconds"], 1e-9)
            entry = {"workload": workload.name, "method": key, "label": label, "pass": row["pass"],
                     "reads": row["reads"], "jobs": row["jobs"], "estimated": row["seconds"],
                     "measured": measured, "wall": row["measured_seconds"], "ratio": ratio, "total": total}
            table.append(entry)
            log(f"{workload.name:5s} {key:16s} {row['pass']:>2} {row['reads'][:40]:<40} "
                f"{row['seconds']:8.3f} {measured:8.3f} {row['measured_seconds']:8.3f} {ratio:6.2f}  "
                f"[{'; '.join(j.split(' (')[0] for j in row['jobs'])}]")
    return table


def markdown(table) -> str:
    lines = ["| workload | method | pass | reads | jobs | estimated s | measured s (CPU) | wall s | measured / est. |",
             "|---|---|---:|---|---|---:|---:|---:|---:|"]
    for r in table:
        jobs = ", ".join(sorted({j.split(" ")[0] for j in r["jobs"]}))
        lines.append(f"| {r['workload']} | {r['method']} | {r['pass']} | {r['reads']} | {jobs} | "
                     f"{r['estimated']:.3f} | {r['measured']:.3f} | {r['wall']:.3f} | {r['ratio']:.2f} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="mlp,gpt2")
    parser.add_argument("--methods", default="", help="comma-separated keys (default: all)")
    parser.add_argument("--gpt2-train", type=int, default=64)
    parser.add_argument("--gpt2-query", type=int, default=8)
    parser.add_argument("--mlp-train", type=int, default=2000)
    parser.add_argument("--mlp-query", type=int, default=64)
    parser.add_argument("--small-train", type=int, default=10, help="training sequences of gpt2-2l and gpt2-small")
    parser.add_argument("--small-query", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--refresh", action="store_true", help="measure the device profile again")
    parser.add_argument("--markdown", action="store_true", help="print the table as markdown at the end")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    load0 = os.getloadavg()
    prof = devices.local_profile(refresh=args.refresh)
    print(f"# gradalg estimates vs measured — {datetime.datetime.now():%Y-%m-%d %H:%M}; {platform.machine()}, "
          f"{os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} thread(s); "
          f"load average {load0[0]:.2f}")
    print(f"# profile: { {k: v for k, v in asdict(prof).items() if k not in ('name',)} }")
    print(f"# {'work':5s} {'method':16s} {'#':>2} {'reads':<40} {'est s':>8} {'cpu s':>8} {'wall s':>8} "
          f"{'cpu/est':>6}")
    table = []
    for name in args.workloads.split(","):
        if name == "mlp":
            workload = MLPWorkload(args.mlp_train, args.mlp_query)
        elif name == "gpt2":
            workload = GPT2Workload(args.gpt2_train, args.gpt2_query)
        elif name in ("gpt2-small", "gpt2-2l"):
            workload = GPT2DefaultsWorkload(12 if name == "gpt2-small" else 2, args.small_train, args.small_query)
        else:
            parser.error(f"unknown workload {name!r}: mlp, gpt2, gpt2-2l or gpt2-small")
        default = getattr(workload, "default_keys", None) or list(methods(workload))
        keys = [k for k in (args.methods.split(",") if args.methods else default) if k]
        if getattr(workload, "warm_up", True):
            run(workload, keys[:1], lambda s: None)          # warm-up: allocator, kernels, first-call costs
        table += run(workload, keys, lambda s: print(s, flush=True))
    load1 = os.getloadavg()
    if not table:
        return 1
    worst = max(table, key=lambda r: max(r["ratio"], 1 / r["ratio"]))
    inside = sum(0.5 <= r["ratio"] <= 2.0 for r in table)
    print(f"\nsummary: {len(table)} passes, {inside} within [0.5, 2]; worst ratio {worst['ratio']:.2f} "
          f"({worst['workload']} {worst['method']} pass {worst['pass']}: est {worst['estimated']:.3f} s, "
          f"measured {worst['measured']:.3f} s); load average {load0[0]:.2f} at start, {load1[0]:.2f} at the end")
    for name in dict.fromkeys(r["workload"] for r in table):    # the worst pass of each setting
        rows = [r for r in table if r["workload"] == name]
        w = max(rows, key=lambda r: max(r["ratio"], 1 / r["ratio"]))
        print(f"  {name:10s} {len(rows):3d} passes, {sum(0.5 <= r['ratio'] <= 2.0 for r in rows):3d} within [0.5, 2]; "
              f"worst {w['ratio']:.2f} ({w['method']} pass {w['pass']}, {w['reads'][:26]}: est {w['estimated']:.4f} s, "
              f"measured {w['measured']:.4f} s, wall {w['wall']:.4f} s)")
    if args.markdown:
        print()
        print(markdown(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
