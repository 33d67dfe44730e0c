"""The products pass's estimates against measurements on three conv nets, an MLP, a tiny GPT-2 and a tiny Llama.

For each model and each setting (``dense_hessian``: a formation's 256-vector calls; ``gn_cg`` /
``hessian_cg``: CG's Gauss-Newton / Hessian products of the queries' vectors, 3 iterations), ``influence(...).explain(analyze=True)`` runs the plan; every call of a products pass
is timed (this process's CPU seconds) against the job's price of one call of its vectors
(``call_cost`` on this machine's profile). Memory: one batch of the largest call's products,
its peak from torch.profiler's memory events (what autograd, ``vmap`` and the conv kernels
allocate), against the job's ``fixed_bytes + per_example_bytes · batch``.

    PYTHONPATH=. OMP_NUM_THREADS=1 nice -n 10 .venv/bin/python benchmarks/products_conv.py [models [settings]]

Models: ``conv8`` (1×8×8 → Conv2d(1, 8, 3, pad 1) → ReLU → Conv2d(8, 16, 3, pad 1) → ReLU →
MaxPool2d(2) → Linear(256, 10): ``benchmarks/fidelity_more.py``'s conv), ``conv32`` (1×32×32 →
Conv2d(1, 32, 3, pad 1) → ReLU → Conv2d(32, 32, 3, pad 1) → ReLU → MaxPool2d(4) → Linear(2048, 10),
the first conv's products), ``convwd`` (``benchmarks/fidelity.py``'s ``conv_wd`` net in float64:
Conv2d(1, 4, 3) → Tanh → Conv2d(4, 8, 3) → Tanh → AvgPool2d(2) → Linear(128, 10)), ``mlp`` (64 → 32 → 32 → 10), ``gpt2`` (``benchmarks/alternating.py``'s
tiny GPT-2, T = 32, one attention projection's products), ``llama`` (:func:`tiny_llama`, T = 24,
its first attention output projection's products; its ``dense_hessian`` failed before session 48's
``hessdtype`` fix: the formation's float64 identity vectors met the float32 model under ``vmap``; each
tangent is now cast to its parameter's dtype). Batches of 32.
Run against another tree (``PYTHONPATH=<tree>``) for a before/after table (``docs/planner.md``,
session 48: the memory measured on the meta device).

``--formation [models]`` (default ``mlp,gpt2,llama``, float32 models): the formed Hessian's products pass
only, planned (``Formed`` of ``ga.hessian``), not run: one call of its ``chunk`` = 256 identity columns in
float64, as the formation passes them (:meth:`~gradalg.expr.curvature.Formed.resolve`), over every batch of
the data (:class:`~gradalg.plan.jobs.ProductPass`), torch.profiler's peak plus the chunk's own bytes,
and the formed rows held beside it (the (d, d) float64 H, ``ProductsJob.beside``), against the job's
``fixed_bytes + per_example_bytes · batch`` (session 49: a float32 model's chunk priced at 4 bytes a number). The MLP on its 96 examples (3 batches of 32), the transformers on their first 8 sequences
(one batch). No formation runs: a few minutes.

``--whole [models]`` (default ``mlp,llama``; ``name:n`` keeps the first n examples): the dense-Hessian
influence (``curvature="dense_hessian"``, damping 0.1, 2 queries) run whole, the formation (every products
call beside the formed rows, then their symmetrisation), the damped inverse and the scores: the peak
resident growth (``VmHWM`` over the resident set at the start, the mark reset there, after a warm-up on 2
examples; run it with ``MALLOC_MMAP_THRESHOLD_=131072`` so that freed tensors leave the resident set)
against each pass's estimate, the products pass's (which prices the formed rows beside its calls since
session 49's ``formedrows``) and the pass that resolves the inverse (``resolve_bytes``, 40·d²). Resident
pages only: a chunk of identity columns, zeros but for its diagonal, is mostly never touched.
"""
from __future__ import annotations

import json
import sys
import time
import warnings
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))
from test_products_groups import _peak_bytes  # noqa: E402  (torch.profiler's memory events: the test's own)
from test_products_memory import RUN  # noqa: E402  (an executor's stand-in for a ProductPass run alone)


def conv8():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(),
                          nn.MaxPool2d(2), nn.Flatten(), nn.Linear(256, 10)).eval()
    g = torch.Generator().manual_seed(0)
    return model, torch.rand(96, 1, 8, 8, generator=g), torch.randint(0, 10, (96,), generator=g), None


def conv32():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(),
                          nn.MaxPool2d(4), nn.Flatten(), nn.Linear(2048, 10)).eval()
    g = torch.Generator().manual_seed(0)
    return model, torch.rand(32, 1, 32, 32, generator=g), torch.randint(0, 10, (32,), generator=g), ["0"]


def convwd():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.Tanh(), nn.Conv2d(4, 8, 3, padding=1), nn.Tanh(),
                          nn.AvgPool2d(2), nn.Flatten(), nn.Linear(128, 10)).double().eval()
    g = torch.Generator().manual_seed(0)
    return (model, torch.rand(96, 1, 8, 8, generator=g, dtype=torch.float64), torch.randint(0, 10, (96,), generator=g),
            None)


def mlp():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 10)).eval()
    g = torch.Generator().manual_seed(0)
    return model, torch.randn(96, 64, generator=g), torch.randint(0, 10, (96,), generator=g), None


MODELS = {"conv8": conv8, "conv32": conv32, "convwd": convwd, "mlp": mlp}
SETTINGS = {"dense_hessian": dict(curvature="dense_hessian"),
            "gn_cg": dict(curvature="gauss_newton", solver="cg", solver_settings={"max_iter": 3}),
            "hessian_cg": dict(curvature="hessian", solver="cg", solver_settings={"max_iter": 3}, damping=100.0)}


def tiny_llama():
    """``tests/budget_scripts/peak_memory.py``'s small Llama (rotary attention, SiLU-gated MLP,
    RMSNorm, grouped keys: 4 heads, 2 key/value heads; width 48, 2 layers, vocabulary 96), eager attention."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                         bos_token_id=0, eos_token_id=0, pad_token_id=0)
    model = LlamaForCausalLM(config).eval()
    model.config._attn_implementation = "eager"
    return model


def workload(name):
    import gradalg as ga
    if name == "gpt2":
        from alternating import tiny_gpt2
        model, _ = tiny_gpt2(T=32)
        model.config._attn_implementation = "eager"
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, 256, (32, 32), generator=g)
        return (ga.tasks.causal_lm(model), {"input_ids": ids}, {"input_ids": ids[:2]},
                ["transformer.h.0.attn.c_proj"])
    if name == "llama":
        model = tiny_llama()
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(1, 96, (32, 24), generator=g)
        return (ga.tasks.causal_lm(model), {"input_ids": ids}, {"input_ids": ids[:2]},
                ["model.layers.0.self_attn.o_proj"])
    model, X, y, layers = MODELS[name]()
    return ga.tasks.classification(model), (X, y), (X[:2], y[:2]), layers


def run(name: str, setting: str) -> list[dict]:
    import gradalg as ga
    from gradalg.curvature.hvp import Products
    from gradalg.devices import local_profile
    from gradalg.eval_mode import eval_mode
    from gradalg.plan.jobs import ProductPass
    prof, calls, original = local_profile(), [], ProductPass.__call__

    def timed(self, V):
        cpu = time.process_time()
        out = original(self, V)
        m, job = int(V.shape[0]), self.job
        dtype = next(job.target.task.model.parameters()).dtype
        calls.append((job, m, time.process_time() - cpu, prof.time_of(job.call_cost(dtype, prof, m), dtype)))
        return out
    task, train, queries, layers = workload(name)
    ProductPass.__call__ = timed
    try:
        with ga.options(batch_size=32, progress=False), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            shown = ga.methods.influence(task, train, queries, layers=layers,
                                         **{"damping": 0.1, **SETTINGS[setting]}).explain(analyze=True)
    finally:
        ProductPass.__call__ = original
    rows = []
    for m in sorted({m for _, m, _, _ in calls}):
        these = [c for c in calls if c[1] == m]
        job = these[0][0]
        cpu = sorted(c[2] for c in these)[len(these) // 2]          # the median call
        products = Products(job.target.task, job.target.data, job.target.layers, job.target.kind,
                            batching=job.batching)
        _, batch = next(products.batches(job.batch))
        V = torch.randn(m, job.target.space.dim, dtype=next(products.model.parameters()).dtype)
        sized = replace(job, groups=((1, m, ""),))
        facts = shown.plan.facts
        estimate = sized.fixed_bytes(facts) + sized.per_example_bytes(facts) * min(job.batch, job.target.data.n)
        with eval_mode(products.model):
            peak = _peak_bytes(lambda: products.batch_rows(batch, V, 0)) + 2.0 * V.numel() * V.element_size()
        rows.append(dict(model=name, setting=setting, kind=job.target.kind, vectors=m, calls=len(these),
                         dim=job.target.space.dim, batching=job.batching,
                         est_s=these[0][3], cpu_s=cpu, time_est_over_meas=these[0][3] / cpu,
                         est_bytes=estimate, peak_bytes=peak, mem_est_over_meas=estimate / peak))
    return rows


def formation(name: str) -> dict:
    """The formed Hessian's products pass on ``name``'s data: its estimate against one call's peak."""
    import gradalg as ga
    from gradalg.eval_mode import eval_mode
    from gradalg.exec import LocalExecutor
    from gradalg.expr.curvature import Formed
    from gradalg.plan.jobs import ProductPass
    task, train, _, layers = workload(name)
    if isinstance(train, dict):     # the transformers' first 8 sequences: torch.profiler's events of 32 take minutes
        train = {k: v[:8] for k, v in train.items()}
    with ga.options(batch_size=32, progress=False), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        formed = Formed(ga.hessian(task, train, layers=layers).expr)
        plan = LocalExecutor().plan(formed)
        [step] = [p for p in plan.passes if p.per_call]
        job, m = step.jobs[0], formed.chunk
        estimate = job.fixed_bytes(plan.facts) + job.per_example_bytes(plan.facts) * step.batch_size
        V = torch.zeros(m, job.target.space.dim, dtype=torch.float64)       # the formation's chunk
        V[:, :m] = torch.eye(m, dtype=torch.float64)
        call = ProductPass(job, RUN)
        with eval_mode(task.model):
            peak = _peak_bytes(lambda: call(V)) + V.numel() * V.element_size() + job.beside    # + the formed rows
    return dict(model=name, dtype=str(next(task.model.parameters()).dtype), dim=job.target.space.dim, vectors=m,
                batch=step.batch_size, n=job.target.data.n, fixed_bytes=job.fixed_bytes(plan.facts),
                est_bytes=estimate, peak_bytes=peak, mem_est_over_meas=estimate / peak)


def whole(spec: str) -> dict:
    """The dense-Hessian influence of ``spec`` (``name`` or ``name:n``) run whole: its peak resident
    growth against each pass's estimated peak (``--whole``)."""
    import gc
    import gradalg as ga
    sys.path.insert(0, str(HERE.parent / "tests" / "budget_scripts"))
    from peak_memory import current_rss, peak_rss, reset_peak
    name, _, n = spec.partition(":")
    task, train, queries, layers = workload(name)
    first = (lambda data, k: {key: v[:k] for key, v in data.items()} if isinstance(data, dict)
             else tuple(t[:k] for t in data))
    train = first(train, int(n)) if n else train
    with ga.options(batch_size=32, progress=False), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ga.methods.influence(task, first(train, 2), queries, layers=layers, curvature="dense_hessian",
                             damping=0.1).compute()                          # warm-up: kernels, lazy imports
        run = ga.methods.influence(task, train, queries, layers=layers, curvature="dense_hessian", damping=0.1)
        plan = run.explain().plan
        gc.collect()
        base, _ = current_rss(), reset_peak()
        run.compute()
        peak = peak_rss() - base
    [products] = [p for p in plan.passes if p.per_call]
    d = products.jobs[0].target.space.dim
    est = max(p.cost.peak_bytes for p in plan.passes)
    return dict(model=name, dim=d, n=products.jobs[0].target.data.n, batch=products.batch_size,
                products_est_bytes=products.cost.peak_bytes, pass_est_bytes=[p.cost.peak_bytes for p in plan.passes],
                est_bytes=est, peak_bytes=peak, mem_est_over_meas=est / peak)


def _show(row: dict, line: str) -> None:
    print(json.dumps(row), flush=True)
    print(line, flush=True)


def main(argv) -> int:
    torch.set_num_threads(1)
    if argv and argv[0] == "--formation":
        for name in (argv[1] if len(argv) > 1 else "mlp,gpt2,llama").split(","):
            r = formation(name)
            _show(r, f"# formation {r['model']:6s} {r['dtype']:13s} dim={r['dim']:5d} m={r['vectors']} batch={r['batch']} "
                     f"n={r['n']}  mem est/meas {r['mem_est_over_meas']:5.2f} ({r['est_bytes'] / 2**20:7.2f} / "
                     f"{r['peak_bytes'] / 2**20:7.2f} MiB; fixed {r['fixed_bytes'] / 2**20:6.2f} MiB)")
        return 0
    if argv and argv[0] == "--whole":
        for spec in (argv[1] if len(argv) > 1 else "mlp,llama").split(","):
            r, sq = whole(spec), lambda b: b / (8 * r["dim"] ** 2)
            _show(r, f"# whole {r['model']:6s} dim={r['dim']:5d} n={r['n']} batch={r['batch']}  products est "
                     f"{sq(r['products_est_bytes']):5.2f}·8d², plan est {sq(r['est_bytes']):5.2f}·8d², measured "
                     f"{sq(r['peak_bytes']):5.2f}·8d² ({r['peak_bytes'] / 2**20:7.2f} MiB)  est/meas {r['mem_est_over_meas']:5.2f}")
        return 0
    names = (argv[0] if argv else "conv8,conv32,convwd,mlp,gpt2,llama").split(",")
    settings = (argv[1] if len(argv) > 1 else ",".join(SETTINGS)).split(",")
    run("mlp", "gn_cg")                                              # warm-up: torch.func's first call
    for name in names:
        for setting in settings:
            for r in run(name, setting):
                _show(r, f"# {r['model']:7s} {r['setting']:18s} m={r['vectors']:4d} x{r['calls']:3d} "
                         f"time est/meas {r['time_est_over_meas']:6.2f} ({r['est_s'] * 1e3:8.1f} / "
                         f"{r['cpu_s'] * 1e3:8.1f} ms)  mem est/meas {r['mem_est_over_meas']:6.2f} "
                         f"({r['est_bytes'] / 2**20:8.2f} / {r['peak_bytes'] / 2**20:8.2f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
