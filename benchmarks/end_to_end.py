"""End-to-end profiles and floors: where a method's time goes, and how far it is from
the least its math needs.

The setting is the peer harness's W2 (``../shared/peers-bench``), rebuilt here so that
this script runs without it: GPT-2 from ``GPT2Config(n_layer=4, n_embd=256, n_head=4,
vocab_size=2048)`` with HF ``Conv1D`` swapped for identical ``nn.Linear``, T = 128,
random token ids, summed per-sequence causal-LM loss, batches of 16 (gradalg's plan reads
them in batches of ``ga.options(batch_tokens)`` positions, 4 sequences on CPU, and the floor
runs at that batch too: ``--floor-batch``), one torch thread.
Every measurement runs in its own cold process (imports, task, planning and the full
score matrix inside the timed region, as the harness times the peers); methods and
floors alternate within each round.

Per method (the harness's gradalg variants, same expressions and options):

``setup``       ``import gradalg`` and building the task and expression
``planning`` … ``assembly``   the run's phases (``S.compute().attrs["seconds"]``,
                :mod:`gradalg.exec.phases`)
``other``       what the phases do not cover (the call's own overhead)

The **floor** of a method is measured in plain PyTorch in the same kind of process:

* its passes over data, each as a capture-only pass: forward with hooks keeping the
  Linear layers' inputs and outputs, ``torch.autograd.grad`` w.r.t. those outputs (no
  weight-gradient GEMMs) — for the sampled-label passes of EK-FAC / LoGra, the loss of
  labels drawn from the model's softmax;
* plus its unavoidable statistics, timed as the bare tensor operations on tensors of
  the real shapes: Kronecker projections, per-example gradient materialization (and for
  TRAK a count sketch of it to k = 512, the sparsest JL projection), the score GEMM, K-FAC covariances (one GEMM per factor and batch), their float64
  eigendecompositions, the eigenvalue correction (rotated factors, squared and summed),
  and the preconditioning of the query gradients.

The tied embedding / LM head block is counted in the floor with its LM-head use only
(its embedding use is a one-hot row gather, nearly free when done as one); gradalg
densifies that one-hot factor, which the ratio then shows.

    .venv/bin/python benchmarks/end_to_end.py                 # 256 sequences, 3 rounds (~25 min)
    .venv/bin/python benchmarks/end_to_end.py --quick         # 64 sequences, 1 round
    .venv/bin/python benchmarks/end_to_end.py --methods ekfac --rounds 2
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
METHODS = ("projected", "full", "ekfac", "logra", "trak")
#: (train sequences, queries) per method at full size: the harness's sizes
SIZES = {"projected": (256, 32), "full": (256, 32), "ekfac": (256, 32), "logra": (32, 8), "trak": (32, 8)}
PHASES = ("planning", "capture", "statistics", "scoring", "assembly")


# ------------------------------------------------------------------------- the workload
def build_w2(n_train: int, n_test: int, seq: int = 128, vocab: int = 2048, seed: int = 0):
    """The harness's W2: model (eval, Conv1D → Linear), train and query token ids."""
    import torch
    from torch import nn
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.pytorch_utils import Conv1D
    cfg = GPT2Config(vocab_size=vocab, n_positions=seq, n_embd=256, n_layer=4, n_head=4,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(cfg)
    model.config.use_cache = False
    for _, mod in list(model.named_modules()):
        for cname, child in list(mod.named_children()):
            if isinstance(child, Conv1D):
                lin = nn.Linear(child.weight.shape[0], child.weight.shape[1])
                with torch.no_grad():
                    lin.weight.copy_(child.weight.t())
                    lin.bias.copy_(child.bias)
                setattr(mod, cname, lin)
    model.eval()
    g = torch.Generator().manual_seed(seed + 1)
    train = torch.randint(0, vocab, (n_train, seq), generator=g)
    test = torch.randint(0, vocab, (n_test, seq), generator=g)
    return model, train, test


def lm_loss_per_example(logits, ids):
    import torch.nn.functional as F
    lp = F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)).float(), ids[:, 1:].reshape(-1),
                         reduction="none")
    return lp.view(ids.size(0), -1).sum(1)


def sampled_lm_loss(model, ids, generator=None):
    """Cross-entropy of one target per position drawn from the model's softmax."""
    import torch
    import torch.nn.functional as F
    logits = model(input_ids=ids).logits[:, :-1]
    with torch.no_grad():
        p = torch.softmax(logits.detach().float(), -1)
        tgt = torch.multinomial(p.reshape(-1, p.size(-1)), 1, generator=generator).view(ids.size(0), -1)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), tgt.reshape(-1), reduction="sum")


def linear_names(model):
    import torch
    return [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]


# ------------------------------------------------------------------------- child: gradalg
def run_gradalg(method: str, model, train, test, batch: int, batch_tokens: int | None = None) -> dict:
    """The harness's gradalg variant of ``method``; returns the phase split.
    ``batch_tokens``: ``ga.options(batch_tokens=)`` (None: the default)."""
    start = time.perf_counter()
    import gradalg as ga
    import torch
    import torch.nn.functional as F

    def loss(m, b):
        (ids,) = b
        return lm_loss_per_example(m(input_ids=ids).logits, ids).sum()

    def sampled_loss(m, b, rng):
        (ids,) = b
        logits = m(input_ids=ids).logits[:, :-1]
        tgt = rng.sample(torch.softmax(logits.detach().float(), -1))
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), tgt.reshape(-1), reduction="sum")

    def output(m, b):
        return -loss(m, b)

    def output_weight(m, b):
        return torch.ones(b[0].shape[0])

    task = ga.Task(model, loss, sampled_loss=sampled_loss, output=output, output_weight=output_weight,
                   name="W2-gpt2")
    lin = linear_names(model)
    blocks = [n for n in lin if n.startswith("transformer.h.")]
    tr, te = (train,), (test,)
    with ga.options(batch_size=batch, progress=False, batch_tokens=batch_tokens):
        if method == "projected":
            S = ga.methods.grad_dot(task, tr, te, layers=blocks, projector=ga.proj.kron(4096, seed=0, k_out=64, k_in=64))
        elif method == "full":
            S = ga.methods.grad_dot(task, tr, te, layers=lin)
        elif method == "ekfac":
            S = ga.methods.influence(task, tr, te, layers=lin, curvature="ekfac", damping=1e-8)
        elif method == "logra":
            S = ga.methods.logra(task, tr, te, layers=lin, k=4096, damping=1e-3)
        else:
            S = ga.methods.trak(task, tr, te, layers=lin, k=512, damping=1e-3)
        setup = time.perf_counter() - start
        out = S.compute()
    total = time.perf_counter() - start
    seconds = dict(out.attrs["seconds"])
    return {"total": total, "setup": setup, **seconds,
            "other": total - setup - sum(seconds.values()), "shape": list(out.shape)}


# ------------------------------------------------------------------------- child: floors
class _Hooks:
    """Forward hooks keeping each Linear's input and output (outputs made to require grad)."""

    def __init__(self, modules):
        self.inputs, self.outputs = [], []
        self.handles = [m.register_forward_hook(self.hook) for m in modules]

    def hook(self, module, args, output):
        self.inputs.append(args[0].detach())
        self.outputs.append(output)

    def clear(self):
        self.inputs.clear()
        self.outputs.clear()

    def remove(self):
        for h in self.handles:
            h.remove()


def capture_pass(model, modules, data, batch: int, sampled: bool, generator=None) -> float:
    """Seconds of one capture-only pass: forward, output gradients of ``modules``."""
    import torch
    hooks = _Hooks(modules)
    start = time.perf_counter()
    try:
        for i in range(0, data.shape[0], batch):
            ids = data[i:i + batch]
            hooks.clear()
            loss = (sampled_lm_loss(model, ids, generator) if sampled
                    else lm_loss_per_example(model(input_ids=ids).logits, ids).sum())
            grads = torch.autograd.grad(loss, hooks.outputs)
            del grads, loss
    finally:
        hooks.remove()
    return time.perf_counter() - start


def layer_shapes(model, names):
    """(in, out) of each named Linear."""
    mods = dict(model.named_modules())
    return [(mods[n].in_features + (mods[n].bias is not None), mods[n].out_features) for n in names]


def statistics_seconds(method: str, shapes, n_train: int, n_query: int, T: int, batch: int) -> dict:
    """Seconds of the bare tensor operations ``method``'s math needs, on random tensors of
    the real shapes (float32 factors, float64 eigendecompositions)."""
    import torch
    torch.manual_seed(0)
    out = {}

    def timed(name, fn):
        t = time.perf_counter()
        fn()
        out[name] = out.get(name, 0.0) + time.perf_counter() - t

    batches = [min(batch, n_train - i) for i in range(0, n_train, batch)]
    qbatches = [min(batch, n_query - i) for i in range(0, n_query, batch)]
    factors = {(i, o): (torch.randn(batch, T, i), torch.randn(batch, T, o)) for i, o in set(shapes)}
    dim = sum(i * o for i, o in shapes)
    if method == "projected":
        P = {(i, o): (torch.randn(i, 64), torch.randn(o, 64)) for i, o in set(shapes)}

        def project(b):
            for i, o in shapes:
                A, D = factors[(i, o)]
                Pi, Po = P[(i, o)]
                torch.einsum("btk,btl->bkl", D[:b] @ Po, A[:b] @ Pi)
        for b in qbatches + batches:
            timed("projection", lambda: project(b))
        held = torch.randn(n_query, 4096 * len(shapes))
        for b in batches:
            rows = torch.randn(b, held.shape[1])
            timed("score GEMM", lambda: held @ rows.T)
        return out
    def materialize(b):
        return [torch.bmm(factors[s][1][:b].transpose(1, 2), factors[s][0][:b]) for s in shapes]

    if method == "trak":
        # each example's gradient materialized and sketched to k = 512 with one nonzero per
        # coordinate (a count sketch: the sparsest JL projection), then the k × k kernel
        bucket = torch.randint(0, 512, (dim,))
        sign = torch.randint(0, 2, (dim,)).float() * 2 - 1

        def sketch(b):
            G = torch.cat([g.flatten(1) for g in materialize(b)], 1)
            torch.zeros(b, 512).index_add_(1, bucket, G * sign)
        for b in qbatches + batches:
            timed("materialization and sketch", lambda: sketch(b))
        return out

    bases = {}
    if method in ("ekfac", "logra"):
        if method == "logra":   # covariances and eigenvalues of the Kronecker-projected factors
            shapes = [(min(i, 64), min(o, 64)) for i, o in shapes]
            factors = {(i, o): (torch.randn(batch, T, i), torch.randn(batch, T, o)) for i, o in set(shapes)}
            dim = sum(i * o for i, o in shapes)
        for b in batches:
            def cov():
                for i, o in shapes:
                    A, D = factors[(i, o)]
                    A[:b].flatten(0, 1).T @ A[:b].flatten(0, 1)
                    D[:b].flatten(0, 1).T @ D[:b].flatten(0, 1)
            timed("covariances", cov)
        spd = {d: (lambda M: M @ M.T)(torch.randn(d, d, dtype=torch.float64)) for s in set(shapes) for d in s}
        for i, o in shapes:                     # every layer's two factors
            def eig():
                for d in (i, o):
                    bases[d] = torch.linalg.eigh(spd[d])[1].float()
            timed("eigendecompositions", eig)
        for b in batches:
            def correction():
                for i, o in shapes:
                    A, D = factors[(i, o)]
                    r = torch.einsum("nto,nti->noi", D[:b] @ bases[o], A[:b] @ bases[i])
                    r.square_().sum(0)
            timed("eigenvalue correction", correction)
        for b in qbatches:
            def precondition():
                for (i, o), G in zip(shapes, materialize(b)):
                    (bases[o] @ ((bases[o].T @ G @ bases[i]) * 0.5) @ bases[i].T)
            timed("preconditioning", precondition)
    if method != "logra":
        for b in batches:
            timed("materialization", lambda: materialize(b))
    held = torch.randn(n_query, dim)
    for b in batches:
        rows = torch.randn(b, dim)
        timed("score GEMM", lambda: held @ rows.T)
    return out


#: passes over data of each method: (train sequences?, sampled labels?)
PASSES = {"projected": [("query", False), ("train", False)],
          "full": [("query", False), ("train", False)],
          "ekfac": [("train", True), ("train", True), ("query", False), ("train", False)],
          "logra": [("train", True), ("train", True), ("query", False), ("train", False)],
          "trak": [("query", False), ("train", False)]}


def run_floor(method: str, model, train, test, batch: int) -> dict:
    import torch
    names = linear_names(model)
    if method == "projected":
        names = [n for n in names if n.startswith("transformer.h.")]
    mods = dict(model.named_modules())
    modules = [mods[n] for n in names]
    gen = torch.Generator().manual_seed(0)
    passes = 0.0
    for which, sampled in PASSES[method]:
        passes += capture_pass(model, modules, train if which == "train" else test, batch, sampled, gen)
    stats = statistics_seconds(method, layer_shapes(model, names), train.shape[0], test.shape[0],
                               train.shape[1], batch)
    return {"total": passes + sum(stats.values()), "passes": passes, **stats}


def run_baseline(model, train, batch: int) -> dict:
    """The harness's baseline: one plain forward+backward over the training set, the median
    of 3 warm passes after a cold one."""
    def one():
        t = time.perf_counter()
        for i in range(0, train.shape[0], batch):
            ids = train[i:i + batch]
            model.zero_grad(set_to_none=True)
            lm_loss_per_example(model(input_ids=ids).logits, ids).sum().backward()
        return time.perf_counter() - t
    one()
    return {"total": statistics.median(one() for _ in range(3))}


def child(kind: str, method: str, n_train: int, n_test: int, batch: int) -> None:
    import resource
    import torch
    torch.set_num_threads(1)
    model, train, test = build_w2(n_train, n_test)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if kind == "gradalg":
        result = run_gradalg(method, model, train, test, batch)
    elif kind == "floor":
        result = run_floor(method, model, train, test, batch)
    else:
        result = run_baseline(model, train, batch)
    result.update(rss_before_mb=rss0, peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    print("RESULT " + json.dumps(result), flush=True)


# ------------------------------------------------------------------------- parent
def spawn(kind, method, n_train, n_test, batch, python) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "GRADALG_PROGRESS": "0",
           "TRANSFORMERS_VERBOSITY": "error", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [python, os.path.abspath(__file__), "--child", kind, method, str(n_train), str(n_test), str(batch)]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"{kind} {method} failed:\n{p.stderr[-3000:]}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="a quarter of the sequences, one round")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--floor-batch", type=int, default=None,
                    help="the floor's batch (default: the batch gradalg's plan reads, min(--batch, "
                         "ceil(batch_tokens / T)) on CPU: the floor runs at the same batch as the run it bounds)")
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--json", help="write every run's numbers here")
    ap.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        kind, method, n, q, b = a.child
        return child(kind, method, int(n), int(q), int(b))
    methods = a.methods.split(",")
    rounds = 1 if a.quick else a.rounds
    scale = 4 if a.quick else 1
    import platform
    import torch
    print(f"# gradalg end-to-end profile — {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print(f"# {platform.machine()}, torch {torch.__version__}, 1 thread, {os.cpu_count()} cores, "
          f"load average at start {os.getloadavg()[0]:.1f}; W2 GPT-2 4×256, vocab 2048, T=128, batch {a.batch}")
    sys.path.insert(0, ROOT)
    from gradalg.options import CPU_BATCH_TOKENS
    floor_batch = a.floor_batch or min(a.batch, max(1, -(-CPU_BATCH_TOKENS // 128)))
    print(f"# floor batch {floor_batch} (gradalg's plan: ga.options(batch_tokens={CPU_BATCH_TOKENS}) / T = 128)")
    runs = []
    for r in range(rounds):
        for m in methods:
            n, q = SIZES[m]
            n, q = max(n // scale, a.batch), max(q // scale, 4)
            for kind in ("baseline", "gradalg", "floor"):
                if kind == "baseline" and any(x["kind"] == "baseline" and x["n"] == n and x["round"] == r for x in runs):
                    continue
                res = spawn(kind, m, n, q, floor_batch if kind == "floor" else a.batch, a.python)
                runs.append({"round": r, "kind": kind, "method": m, "n": n, "q": q, **res,
                             "load": os.getloadavg()[0]})
                print(f"# round {r + 1} {kind:8s} {m:9s} n={n:3d}: {res['total']:.2f} s, peak {res['peak_rss_mb']:.0f} MB, "
                      f"load {os.getloadavg()[0]:.1f}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(runs, f, indent=1)
    med = lambda xs: statistics.median(xs) if xs else float("nan")  # noqa: E731
    print("\nmedians over rounds; seconds (wall, 1 thread); floor = capture-only passes + bare statistics")
    head = (f"{'method':10s} {'n':>4s} {'total':>6s} {'setup':>6s} " + " ".join(f"{p[:8]:>8s}" for p in PHASES)
            + f" {'other':>6s} | {'floor':>6s} {'/floor':>6s} {'/plain':>6s} | {'peak MB':>7s} {'floor MB':>8s}")
    print(head)
    for m in methods:
        g = [x for x in runs if x["kind"] == "gradalg" and x["method"] == m]
        f = [x for x in runs if x["kind"] == "floor" and x["method"] == m]
        n = g[0]["n"]
        base = med([x["total"] for x in runs if x["kind"] == "baseline" and x["n"] == n])
        total, floor = med([x["total"] for x in g]), med([x["total"] for x in f])
        print(f"{m:10s} {n:4d} {total:6.2f} {med([x['setup'] for x in g]):6.2f} "
              + " ".join(f"{med([x[p] for x in g]):8.2f}" for p in PHASES)
              + f" {med([x['other'] for x in g]):6.2f} | {floor:6.2f} {total / floor:5.2f}× {total / base:5.2f}× | "
              f"{med([x['peak_rss_mb'] for x in g]):7.0f} {med([x['peak_rss_mb'] for x in f]):8.0f}")
    print("\nfloor parts (median seconds):")
    for m in methods:
        f = [x for x in runs if x["kind"] == "floor" and x["method"] == m]
        keys = [k for k in f[0] if k not in ("total", "rss_before_mb", "peak_rss_mb", "round", "kind", "method",
                                             "n", "q", "load")]
        print(f"  {m:10s} " + ", ".join(f"{k} {med([x[k] for x in f]):.2f}" for k in keys))


if __name__ == "__main__":
    main()
