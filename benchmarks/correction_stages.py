"""Estimate vs measured CPU time of every pass, and the stages of EK-FAC's correction pass.

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/correction_stages.py mistral-swa num_hidden_layers=1
    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/correction_stages.py gpt2-small "" 2 logra
    ... benchmarks/correction_stages.py mistral-swa num_hidden_layers=1 2 influence_ekfac

``real_scale.build_config(model, 128)`` (second argument: ``key=value,...`` overrides of
its config), 4 training sequences and 2 queries of 128 random tokens, the method (fourth
argument: ``logra``, the default, or ``influence_ekfac``) at its defaults under
``explain(analyze=True)``, repeated (third argument, default 3) in one process. Per run:
each pass's estimate, CPU time and CPU ÷ estimate, and the CPU time of the correction
pass's stages (``EKFACAccumulator`` opened, updated, finished; the rotations of the
gradients formed first, ``rotate_gradients``, and of the factors, ``rotate_factors``,
with their calls), and the load average. Session 44 (issue 28, "LoGra's pass before its
last") ran it with the library before and after its change (``PYTHONPATH`` the other
tree), in alternating processes.
"""
import collections
import os
import sys
import time

import torch

import gradalg as ga
import gradalg.plan.jobs.kron as KJ

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import real_scale as rs  # noqa: E402

torch.manual_seed(0)
torch.set_num_threads(1)
name = sys.argv[1]
cls, cfg = rs.build_config(name, 128)
for kv in (sys.argv[2].split(",") if len(sys.argv) > 2 and sys.argv[2] else []):
    k, v = kv.split("=")
    setattr(cfg, k, int(v))
reps = int(sys.argv[3]) if len(sys.argv) > 3 else 3
method = sys.argv[4] if len(sys.argv) > 4 else "logra"
model = cls(cfg).eval()
g = torch.Generator().manual_seed(0)
train = [{"input_ids": torch.randint(0, cfg.vocab_size, (128,), generator=g)} for _ in range(4)]
queries = [{"input_ids": torch.randint(0, cfg.vocab_size, (128,), generator=g)} for _ in range(2)]
task = ga.tasks.causal_lm(model)
seconds, calls = collections.Counter(), collections.Counter()


def timed(key, owner, attr):
    """Wrap ``owner.attr`` (if it exists: the tree before the change has no ``rotate_gradients``)."""
    fn = getattr(owner, attr, None)
    if fn is None:
        return

    def wrapper(*a, **k):
        start = time.process_time()
        try:
            return fn(*a, **k)
        finally:
            seconds[key] += time.process_time() - start
            calls[key] += 1
    setattr(owner, attr, wrapper)


timed("open", KJ.EKFACAccumulator, "__init__")
timed("update", KJ.EKFACAccumulator, "update")
timed("finish", KJ.EKFACAccumulator, "finish")
timed("rotate_gradients", KJ, "rotate_gradients")
timed("rotate_factors", KJ, "rotate_factors")
for rep in range(reps):
    seconds.clear()
    calls.clear()
    if method == "logra":
        S = ga.methods.logra(task, train, queries)
    else:
        S = ga.methods.influence(task, train, queries, curvature=method.split("_", 1)[1])
    e = S.explain(analyze=True)
    passes = [f"p{i} {'+'.join(j.kind for j in p.jobs)}: est {p.seconds * 1e3:.2f} ms, cpu "
              f"{st['cpu_seconds'] * 1e3:.2f} ms, {st['cpu_seconds'] / p.seconds:.2f}x"
              for i, (p, st) in enumerate(zip(e.plan.passes, e.analyzed))]
    print(f"run {rep} ({method}, load {os.getloadavg()[0]:.1f}):\n  " + "\n  ".join(passes), flush=True)
    print("  correction stages, CPU ms (calls):",
          {k: f"{v * 1e3:.2f} ({calls[k]})" for k, v in seconds.items()}, flush=True)
