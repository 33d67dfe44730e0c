"""Per-stage estimate vs measured CPU time of LoGra's last pass (scores over rows in memory).

    REPS=2 PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/lastpass_stages.py mistral-swa ""

``real_scale.build_config(model, 128)`` (``key=value,...`` overrides its config), 4 training
sequences (third argument) and 2 queries of random tokens, ``ga.methods.logra`` at its
defaults under ``explain(analyze=True)``: per run, the last pass's estimate, its CPU time
and the CPU time of its stages (resolving the operator, preconditioning the held rows, the
score updates); then the estimate's parts, and the estimate with the profile's block units
measured again in this process (the load of the run). Session 42 (issue 28, "LoGra's
last pass") used it before and after the change in ``plan/estimates.py``.
"""
import sys, time, json, collections, torch, gradalg as ga
sys.path.insert(0, 'benchmarks')
import real_scale as rs
from gradalg.plan import estimates as E
from gradalg.plan.cost import Cost
import gradalg.exec.resolve as R
import gradalg.exec.base as B
import gradalg.plan.jobs.scores as SJ
torch.manual_seed(0); torch.set_num_threads(1)
name = sys.argv[1]
cls, cfg = rs.build_config(name, 128)
for kv in (sys.argv[2].split(",") if len(sys.argv) > 2 and sys.argv[2] else []):
    k, v = kv.split("="); setattr(cfg, k, int(v))
model = cls(cfg).eval()
g = torch.Generator().manual_seed(0)
V = cfg.vocab_size
ntr = int(sys.argv[3]) if len(sys.argv) > 3 else 4
train = [{"input_ids": torch.randint(0, V, (128,), generator=g)} for _ in range(ntr)]
queries = [{"input_ids": torch.randint(0, V, (128,), generator=g)} for _ in range(2)]
task = ga.tasks.causal_lm(model)
T = collections.Counter()
def timed(key, fn):
    def w(*a, **k):
        c = time.process_time()
        try: return fn(*a, **k)
        finally: T[key] += time.process_time() - c
    return w
B.Executor.resolve = timed("resolve", B.Executor.resolve)
R.precondition = timed("precondition", R.precondition)
B.precondition = R.precondition
SJ.ScoreAccumulator.update = timed("scores.update", SJ.ScoreAccumulator.update)
for rep in range(int(__import__("os").environ.get("REPS", "3"))):
    T.clear()
    S = ga.methods.logra(task, train, queries)
    e = S.explain(analyze=True)
    plan = e.plan
    last = plan.passes[-1]
    st = e.analyzed[-1]
    print(f"rep {rep}: last pass est {last.seconds*1e3:.2f} ms, measured cpu {st['cpu_seconds']*1e3:.2f} ms  wall {st['seconds']*1e3:.2f};",
          {k: round(v*1e3, 2) for k, v in T.items()})
# estimate pieces of the last pass
facts, dev = plan.facts, plan.device
job = last.jobs[0]
node = job.streams[0]
print("device", dev.name, "jobs", len(last.jobs), "blocks", len(node.space.blocks), "held n", job.held.n, "stream n", node.n)
c = node.n
sec = lambda cost: cost.seconds(dev, facts.dtype) * 1e3
print("  block_cost (per chunk)", sec(job.block_cost(node)))
lay = {b.name: "flat" for b in node.space.blocks}
print("  chunk_cost", sec(job.chunk_cost(node, c, lay, facts)))
op = job.target.op
print("  resolve_cost", sec(E.resolve_cost(op)))
print("  apply_cost", sec(E.apply_cost(op, job.held.space, job.held.n, facts.elem, plan.options, facts.shapes)))
print("  pass_overhead", sec(E.pass_overhead(len(last.jobs), 0, 0, False, dev)))
print("  job.cost total", sec(job.cost), " pass", last.seconds*1e3)
print("  applied", job.applied, "release_held", job.release_held)
# the same estimate with the block units measured now, in this process (the load of the run)
import dataclasses
from gradalg.plan.devices import _measure_blocks
now = dataclasses.replace(dev, block_seconds=_measure_blocks())
print("block units now:", {k: round(v*1e6, 1) for k, v in now.block_seconds}, "profile:", {k: round(v*1e6, 1) for k, v in dev.block_seconds})
cost = last.jobs[0].cost + E.pass_overhead(len(last.jobs), 0, 0, False, dev)
print(f"  est with units measured now: {cost.seconds(now, facts.dtype)*1e3:.2f} ms")
import gradalg.exec.allocator as AL
trims = []
orig_rel = AL.release_free_memory
def rel():
    c = time.process_time(); orig_rel(); trims.append(time.process_time() - c)
AL.release_free_memory = rel
T.clear()
S = ga.methods.logra(task, train, queries)
e = S.explain(analyze=True)
print(f"with trims timed: last pass cpu {e.analyzed[-1]['cpu_seconds']*1e3:.2f} ms;", {k: round(v*1e3, 2) for k, v in T.items()},
      "trims (all passes):", [round(t*1e3, 2) for t in trims])
