"""Cost of every attribution method as a multiple of one plain forward+backward pass.

Model (built from a config, random weights, nothing downloaded)::

    GPT2Config(n_layer=4, n_embd=256, n_head=4, n_positions=128, vocab_size=2048,
               resid_pdrop=0, embd_pdrop=0, attn_pdrop=0)          # 3.7 M parameters

A vocabulary of 2048 keeps the LM head (256 × 2048) at about an eighth of the model's
forward FLOPs, so the transformer blocks, the part that is attributed, dominate.
Data: random token ids, T = 128; 256 training sequences and 32 queries; batches of 32.
Loss: next-token cross-entropy summed over tokens and sequences. Attributed layers:
every Conv1D of the transformer blocks (``transformer.h.*``: c_attn, attn.c_proj,
mlp.c_fc, mlp.c_proj; 16 blocks, 3.15 M coordinates), what a method gets on GPT-2 when
the embeddings and the LM head are left out.

The task (``lm_task``) also gives what the curvature methods need: ``sampled_loss``
(targets drawn per token from the model: the Gauss-Newton / true-Fisher gradients of
EK-FAC, K-FAC, LoGra, GraSS, the projected Fisher and RelatIF), and TRAK's output
function Σ_t log(p_t / (1 − p_t)) over a sequence's tokens with the sequence's mean
(1 − p_t) as its weight (a per-sequence stand-in for TRAK's per-token Q).

The baseline is the plain training step without the optimizer: forward and
``loss.backward()`` (all parameter gradients) over the same 256 sequences in batches of
32. Each method is timed end to end (``Scores.compute()``: planning, the query pass,
every pass over the training set, the safety checks), right after a baseline run in the
same process, and its ratio is over that adjacent baseline; with ``--rounds`` > 1 the
table gives the median ratio. The table also gives the passes over the training set in
gradalg's plan (``LocalExecutor.last_plan.data_passes``; each read of the training set
by windows of rows, an implicit operator applied outside the plan's passes, counts as one
more pass) and the fewest passes the method's math
needs (``MIN_PASSES`` below says why).

    .venv/bin/python benchmarks/methods_cost.py                      # all methods, 1 thread
    .venv/bin/python benchmarks/methods_cost.py --methods ekfac,logra --rounds 3
    .venv/bin/python benchmarks/methods_cost.py --quick              # 64 sequences
    .venv/bin/python benchmarks/methods_cost.py --profile ekfac      # cProfile of one method
    .venv/bin/python benchmarks/methods_cost.py --write docs/performance_methods.md
"""
from __future__ import annotations

import argparse
import copy
import cProfile
import datetime
import io
import os
import platform
import pstats
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import gradalg as ga  # noqa: E402

VOCAB, T, BATCH = 2048, 128, 32
LAYERS = ["transformer.h.*"]
DAMPING = 1e-3
TRAK_DAMPING = 1.0   # Φᵀ Φ (512 × 512) has rank ≤ n = 256 here: the kernel needs a real damping

# Peers measured on this model (from the issue): multiples of a forward+backward pass.
PEERS = {"ekfac": ("Kronfluence EK-FAC", 9.8, "256 sequences"),
         "logra": ("dattri LoGra", 25.0, "32 sequences"),
         "trak": ("dattri TRAK, k=512", 44.0, "32 sequences")}
TARGETS = {"ekfac": 3.0, "logra": 2.0, "trak": 2.0}


# ----------------------------------------------------------------------------- model, task
def build_model(seed: int = 0):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(n_layer=4, n_embd=256, n_head=4, n_positions=T, vocab_size=VOCAB, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config).eval()


def _logits(model, batch):
    return model(input_ids=batch[0]).logits[:, :-1]          # (B, T-1, V)


def _targets(batch):
    return batch[0][:, 1:]                                   # (B, T-1)


def lm_loss(model, batch):
    """Σ over sequences and tokens of the next-token cross-entropy."""
    logits = _logits(model, batch)
    return F.cross_entropy(logits.flatten(0, 1), _targets(batch).flatten(), reduction="sum")


def lm_sampled_loss(model, batch, rng):
    """The same loss with each target drawn from the model (per example and token)."""
    logits = _logits(model, batch)
    probs = torch.softmax(logits.detach(), dim=-1)          # ExampleRandom sums the CDF in float64
    return F.cross_entropy(logits.flatten(0, 1), rng.sample(probs).flatten(), reduction="sum")


def lm_margin(model, batch):
    """TRAK's output function, summed over tokens: Σ_t log p_t − log(1 − p_t)."""
    logp = torch.log_softmax(_logits(model, batch), dim=-1)
    y = _targets(batch).unsqueeze(-1)
    correct = logp.gather(-1, y).squeeze(-1)
    others = logp.scatter(-1, y, float("-inf")).logsumexp(-1)
    return (correct - others).sum()


def lm_one_minus_p(model, batch):
    """(B,): the mean over a sequence's tokens of 1 − p_t (TRAK's Q, per sequence)."""
    p = torch.softmax(_logits(model, batch), dim=-1).gather(-1, _targets(batch).unsqueeze(-1)).squeeze(-1)
    return (1 - p).mean(1)


def lm_task(model, name="gpt2-4x256"):
    return ga.Task(model, lm_loss, sampled_loss=lm_sampled_loss, output=lm_margin,
                   output_weight=lm_one_minus_p, name=name)


def second_checkpoint(model, X, steps: int = 2, lr: float = 1e-3):
    """TracIn's other checkpoint: a copy of the model after a few Adam steps."""
    other = copy.deepcopy(model).train()
    opt = torch.optim.Adam(other.parameters(), lr=lr)
    for _ in range(steps):
        opt.zero_grad()
        (lm_loss(other, (X[:BATCH],)) / (BATCH * (T - 1))).backward()
        opt.step()
    return other.eval()


# ----------------------------------------------------------------------------- methods
@dataclass
class Method:
    key: str
    label: str
    build: callable        # (ctx) -> lazy Scores
    min_passes: int
    why: str


def _methods():
    m = ga.methods
    kron64 = ga.proj.kron(64, seed=0)
    return [
        Method("grad_dot", "Grad-Dot", lambda c: m.grad_dot(c.task, c.train, c.queries, layers=LAYERS), 1,
               "stream G against the held query gradients"),
        Method("grad_cos", "Grad-Cos", lambda c: m.grad_cos(c.task, c.train, c.queries, layers=LAYERS), 1,
               "row norms come with the rows: same pass"),
        Method("tracin", "TracIn-CP, 2 checkpoints",
               lambda c: m.tracin(c.checkpoints, [1e-3, 1e-3], c.train, c.queries, layers=LAYERS), 2,
               "one pass per checkpoint (other weights, other gradients)"),
        Method("ekfac", "influence, EK-FAC",
               lambda c: m.influence(c.task, c.train, c.queries, layers=LAYERS, curvature="ekfac",
                                     damping=DAMPING), 3,
               "K-FAC factors; then the eigenvalue correction (needs the factors' eigenbasis); then the "
               "scores (need the finished inverse). 2 + a pass from memory if the n training gradients "
               "were kept (memory ∝ n)"),
        Method("kfac", "influence, K-FAC",
               lambda c: m.influence(c.task, c.train, c.queries, layers=LAYERS, curvature="kfac",
                                     damping=DAMPING), 2,
               "factors; then the scores"),
        Method("fisher_proj", "influence, Gauss-Newton in kron(64)/layer (1024 dims, dense)",
               lambda c: m.influence(c.task, c.train, c.queries, layers=LAYERS, projector=kron64,
                                     damping=DAMPING), 1,
               "the projected training rows (n × 1024) fit in memory: Fisher and rows from one pass"),
        Method("logra", "LoGra, EK-FAC in kron(256)/layer",
               lambda c: m.logra(c.task, c.train, c.queries, layers=LAYERS, k=256, damping=DAMPING), 1,
               "projected rows are small: factors, correction and scores from rows kept in memory"),
        Method("factgrass", "FactGraSS, k=256/layer",
               lambda c: m.grass(c.task, c.train, c.queries, layers=LAYERS, k=256, damping=DAMPING), 1,
               "projected rows kept: Fisher and scores from one pass"),
        Method("grass", "GraSS, k=256/layer",
               lambda c: m.grass(c.task, c.train, c.queries, layers=LAYERS, k=256, damping=DAMPING,
                                 factored=False), 1,
               "as FactGraSS"),
        Method("trak", "TRAK, 1 model, k=512 (sparse JL)",
               lambda c: m.trak(c.task, c.train, c.queries, layers=LAYERS, k=512,
                                projector=ga.proj.sparse(512, seed=0), damping=TRAK_DAMPING), 1,
               "the projected features Φ (n × 512) are kept: kernel and scores from one pass"),
        Method("datainf", "influence, DataInf",
               lambda c: m.influence(c.task, c.train, c.queries, layers=LAYERS, curvature="datainf",
                                     damping=DAMPING), 2,
               "the queries' inverse-Fisher products need a pass over the training gradients; then "
               "the scores"),
        Method("relatif", "RelatIF, Gauss-Newton in kron(64)/layer",
               lambda c: m.relatif(c.task, c.train, c.queries, layers=LAYERS, projector=kron64,
                                   damping=DAMPING), 1,
               "as the projected Fisher; the self-influence norms come with the rows"),
    ]


METHODS = {mm.key: mm for mm in _methods()}


# ----------------------------------------------------------------------------- timing
class Context:
    def __init__(self, n_train: int, n_query: int):
        self.model = build_model()
        g = torch.Generator().manual_seed(0)
        self.X = torch.randint(0, VOCAB, (n_train, T), generator=g)
        self.XQ = torch.randint(0, VOCAB, (n_query, T), generator=g)
        self.task = lm_task(self.model)
        self.train, self.queries = (self.X,), (self.XQ,)
        self.checkpoints = [self.task, lm_task(second_checkpoint(self.model, self.X), name="gpt2-ckpt2")]

    def plain(self):
        """The baseline: forward + loss.backward() over the training set."""
        model = self.model
        model.zero_grad(set_to_none=True)
        for i in range(0, len(self.X), BATCH):
            lm_loss(model, (self.X[i:i + BATCH],)).backward()
        model.zero_grad(set_to_none=True)


class CountingExecutor(ga.LocalExecutor):
    """The local executor, counting the reads of the training set by windows of rows
    (an implicit operator such as DataInf applied outside the plan's apply job reads it
    again, by planned passes over windows of it, each time it is applied)."""

    def __init__(self, n_train: int):
        super().__init__()
        self.n_train, self.pulls = n_train, 0

    def windows(self, node):
        from gradalg.expr import Source
        from gradalg.expr.windows import stream_root
        root = stream_root(node)
        if isinstance(root, Source) and root.n == self.n_train:
            self.pulls += 1
        return super().windows(node)


def run_method(method: Method, ctx: Context):
    """(seconds, executor) of one end-to-end run."""
    with ga.options(batch_size=BATCH, progress=False):
        scores = method.build(ctx)
        ex = CountingExecutor(len(ctx.X))
        start = time.perf_counter()
        values = scores.compute(ex)
        seconds = time.perf_counter() - start
    if not torch.isfinite(torch.as_tensor(values.values)).all():
        raise RuntimeError(f"{method.key}: non-finite scores")
    return seconds, ex


def timed(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def plan_passes(ex) -> tuple[int, str]:
    """Passes over the training set in the plan that ran, and the kinds of pass."""
    labels = []
    n = 0
    for step in ex.last_plan.passes:
        kinds = "+".join(sorted({j.kind for j in step.jobs}))
        if step.reads_data and step.key.n == ex.n_train:
            n += 1
            labels.append(kinds)
        elif not step.reads_data:
            labels.append("memory: " + kinds)
    if ex.pulls:
        n += ex.pulls
        labels.append(f"{ex.pulls} pull" + ("s" if ex.pulls > 1 else ""))
    return n, ", ".join(labels)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated of {list(METHODS)}")
    parser.add_argument("--n-train", type=int, default=256)
    parser.add_argument("--n-query", type=int, default=32)
    parser.add_argument("--quick", action="store_true", help="64 training sequences, 16 queries")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    parser.add_argument("--profile", default=None, help="cProfile one method and print the top functions")
    parser.add_argument("--plans", action="store_true", help="print each method's passes")
    parser.add_argument("--write", default=None, help="write the table into this markdown file")
    parser.add_argument("--note", default="", help="a sentence about the machine, for --write")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    n_train, n_query = (64, 16) if args.quick else (args.n_train, args.n_query)
    ctx = Context(n_train, n_query)
    keys = [k for k in args.methods.split(",") if k]
    load0 = os.getloadavg()
    header = (f"# gradalg methods cost — {datetime.datetime.now():%Y-%m-%d %H:%M}; {platform.machine()}, "
              f"{os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} thread(s); "
              f"load average {load0[0]:.1f}\n# GPT-2 4×256, vocab {VOCAB}, T={T}, {n_train} training "
              f"sequences, {n_query} queries, batch {BATCH}, layers {LAYERS}")
    print(header, flush=True)

    # warm-up: allocator, kernels, the device profile
    small = Context(BATCH, 4)
    small.plain()
    run_method(METHODS["grad_dot"], small)

    if args.profile:
        method = METHODS[args.profile]
        ctx.plain()
        prof = cProfile.Profile()
        prof.enable()
        seconds, ex = run_method(method, ctx)
        prof.disable()
        base = timed(ctx.plain)
        print(f"{method.key}: {seconds:.1f} s, baseline {base:.1f} s, ratio {seconds / base:.2f}")
        for i, st in enumerate(ex.pass_stats):
            print(f"  pass {i}: {st['seconds']:.2f} s  {ex.last_plan.passes[i].label}: "
                  + "; ".join(j.describe() for j in ex.last_plan.passes[i].jobs))
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(30)
        print(out.getvalue())
        return 0

    results = {k: {"ratios": [], "seconds": [], "base": []} for k in keys}
    for r in range(args.rounds):
        for key in keys:
            method = METHODS[key]
            base = timed(ctx.plain)
            try:
                seconds, ex = run_method(method, ctx)
            except Exception as exc:  # noqa: BLE001 - reported in the table
                results[key]["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:150]}"
                print(f"  {key:12s} failed: {results[key]['error']}", flush=True)
                continue
            res = results[key]
            res["ratios"].append(seconds / base)
            res["seconds"].append(seconds)
            res["base"].append(base)
            res["passes"], res["kinds"] = plan_passes(ex)
            res["pass_seconds"] = [round(s["seconds"], 1) for s in ex.pass_stats]
            print(f"  round {r + 1} {key:12s} {seconds:7.1f} s  baseline {base:5.1f} s  {seconds / base:5.2f}×  "
                  f"passes {res['passes']} ({res['kinds']}); per pass {res['pass_seconds']}; "
                  f"load {os.getloadavg()[0]:.1f}", flush=True)
            if args.plans:
                for step in ex.last_plan.passes:
                    print("      " + step.label + ": " + "; ".join(j.describe() for j in step.jobs))
    text = table(results, keys)
    load1 = os.getloadavg()
    print()
    print(text)
    print(f"\nload average {load0[0]:.1f} at start, {load1[0]:.1f} at the end")
    if args.write:
        write_markdown(Path(args.write), header, text, args, load0, load1, n_train, n_query)
    return 0


def table(results, keys) -> str:
    lines = ["| method | configuration | seconds | × fwd+bwd | target (peer) | passes in plan | "
             "fewest passes | why |",
             "|---|---|---:|---:|---|---:|---:|---|"]
    for key in keys:
        method, res = METHODS[key], results[key]
        peer = PEERS.get(key)
        target = (f"≤ {TARGETS[key]:g}× ({peer[0]} {peer[1]:g}×, {peer[2]})" if key in TARGETS else "")
        if "error" in res and not res["ratios"]:
            lines.append(f"| {key} | {method.label} | failed: {res['error']} |  | {target} |  | "
                         f"{method.min_passes} | {method.why} |")
            continue
        ratio = statistics.median(res["ratios"])
        secs = statistics.median(res["seconds"])
        lines.append(f"| {key} | {method.label} | {secs:.1f} | {ratio:.2f}× | {target} | {res['passes']} "
                     f"({res['kinds']}) | {method.min_passes} | {method.why} |")
    return "\n".join(lines)


def write_markdown(path, header, text, args, load0, load1, n_train, n_query):
    body = f"""# Performance: every method against one forward+backward pass

Generated by `benchmarks/methods_cost.py` on {datetime.date.today().isoformat()}
({platform.machine()}, {os.cpu_count()} CPU cores, torch {torch.__version__} with
{torch.get_num_threads()} intra-op thread(s), Python {platform.python_version()}); load average
{load0[0]:.1f} at the start and {load1[0]:.1f} at the end (other jobs shared the machine), {args.rounds}
round(s).{" " + args.note if args.note else ""}

**Setup.** GPT-2 from `GPT2Config(n_layer=4, n_embd=256, n_head=4, n_positions={T},
vocab_size={VOCAB})` (random weights; the small vocabulary keeps the LM head from
dominating), {n_train} training sequences and {n_query} queries of T = {T} random tokens,
batches of {BATCH}, float32. Attributed layers `{LAYERS[0]}` (every Conv1D of the blocks,
3.15 M coordinates). Baseline: forward + `loss.backward()` over the same {n_train}
sequences, timed right before each method in the same process. Each method's time is
its whole `Scores.compute()`: planning, the query pass, every pass over the training
set, the finite and loss-reduction checks.

{text}
"""
    # hand-written analysis below the marker survives a rerun
    if path.exists() and MARKER in path.read_text():
        body += "\n" + path.read_text()[path.read_text().index(MARKER):]
    path.write_text(body)
    print(f"wrote {path}")


MARKER = "<!-- analysis: kept when the table above is regenerated -->"


if __name__ == "__main__":
    sys.exit(main())
