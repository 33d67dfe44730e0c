"""Run one budget case in this (fresh) process and print its peak memory as JSON.

    python peak_memory.py CASE BUDGET_BYTES [--isolate-passes]

The model, the data and a warm-up run of the same expression on a few examples (which
loads lazily imported modules and the kernels' first allocations) come first; the
baseline is the resident memory after them, and the kernel's peak mark is reset there.
The case then runs under ``ga.options(memory_budget=BUDGET_BYTES)``; ``peak_growth`` is
the peak resident memory (``VmHWM``) above that baseline. Also printed: the plan's estimated peak, and each pass's.
"""
from __future__ import annotations

import gc
import json
import os
import resource
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import models  # noqa: E402

import gradalg as ga  # noqa: E402


def current_rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def reset_peak() -> bool:
    """Reset the kernel's peak-RSS mark (VmHWM) so that the warm-up's peak is not counted."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class ConvNet(nn.Module):
    def __init__(self, classes=3):
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.c2 = nn.Conv2d(8, 8, 3, stride=2, padding=1)
        self.fc = nn.Linear(8 * 8 * 8, classes)

    def forward(self, x):
        return self.fc(torch.relu(self.c2(torch.relu(self.c1(x)))).flatten(1))


def conv_ekfac(n):
    """EK-FAC influence (Gauss-Newton terms per class) on a conv net: 16×16 images."""
    torch.manual_seed(0)
    model = ConvNet().to(torch.float32)
    X, y = torch.randn(n + 4, 3, 16, 16), torch.randint(0, 3, (n + 4,))
    task = ga.tasks.classification(model)
    return lambda m: ga.methods.influence(task, (X[:m], y[:m]), (X[n:], y[n:]), curvature="ekfac")


def mlp_classes(n):
    """Influence with the exact Gauss-Newton (one row per class, 10 classes) and EK-FAC
    on an MLP whose unprojected training rows (~70k coordinates) outgrow the budget."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 256), nn.Tanh(), nn.Linear(256, 10))
    X, y = torch.randn(n + 4, 128), torch.randint(0, 10, (n + 4,))
    task = ga.tasks.classification(model)
    return lambda m: ga.methods.influence(task, (X[:m], y[:m]), (X[n:], y[n:]), curvature="ekfac")


def gpt2_logra(n):
    """LoGra's expression (Kronecker-projected EK-FAC of the training loss's gradients)
    on a small GPT-2, sequences of 32 tokens."""
    model = models.gpt2(dtype=torch.float32, n_layer=2, n_embd=64)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 101, (n + 4, 32), generator=g)
    mask = torch.ones_like(ids)
    task = models.lm_task(model)
    P = ga.proj.kron(k=16, seed=0)

    def scores(m):
        G, Q = ga.grads(task, (ids[:m], mask[:m])), ga.grads(task, (ids[n:], mask[n:]))
        return P(Q) @ ga.ekfac(P(G)).damp(1e-3).inv() @ P(G).T
    return scores


def llama_kfac(n):
    """K-FAC influence on a small Llama (rotary attention, SiLU-gated MLP, RMSNorm; every
    Linear of the decoder layers attributed), 24-token sequences, through
    ``ga.tasks.causal_lm`` (labels drawn from the model for the curvature)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                         bos_token_id=0, eos_token_id=0, pad_token_id=0)
    model = LlamaForCausalLM(config).eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 96, (n + 4, 24), generator=g)
    data = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    task = ga.tasks.causal_lm(model)

    def scores(m):
        train = {k: v[:m] for k, v in data.items()}
        queries = {k: v[n:] for k, v in data.items()}
        return ga.methods.influence(task, train, queries, layers=["model.layers.*"], curvature="kfac",
                                    damping=1e-3)
    return scores


def gpt2_held_queries(n):
    """EK-FAC influence on a small GPT-2's full (unprojected) gradients with many queries:
    the held side, preconditioned once into flat rows beside the raw query factors,
    is most of the peak (``n`` queries against 96 training sequences of 16 tokens)."""
    model = models.gpt2(dtype=torch.float32, n_layer=2, n_embd=128)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 101, (n + 96, 16), generator=g)
    mask = torch.ones_like(ids)
    task = models.lm_task(model)

    def scores(m):
        G, Q = ga.grads(task, (ids[n:], mask[n:])), ga.grads(task, (ids[:m], mask[:m]))
        return Q @ ga.ekfac(G).damp(1e-3).inv() @ G.T
    return scores


def gpt2_trackstar(n):
    """TrackStar at its defaults on a small GPT-2 (block linears: 1.6 M coordinates, wider
    than its k = 4096, so its rows are corrected by Adam's 1/(√v̂ + ε) as flat rows and
    then projected), 16-token sequences; the optimizer after one step on 4 sequences."""
    model = models.gpt2(dtype=torch.float32, n_layer=2, n_embd=256)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 101, (n + 4, 16), generator=g)
    mask = torch.ones_like(ids)
    task = models.lm_task(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    task.summed_loss(model, (ids[:4], mask[:4])).backward()
    opt.step()
    model.zero_grad(set_to_none=True)

    def scores(m):
        return ga.methods.trackstar(task, (ids[:m], mask[:m]), (ids[n:], mask[n:]), optimizer=opt)
    return scores


def _gpt2_causal(n, queries=4):
    """A small GPT-2 whose block linears (1.6 M coordinates, the widest 263 k) take EK-FAC
    at ``curvature="auto"``, through ``ga.tasks.causal_lm``, 16-token sequences."""
    model = models.gpt2(dtype=torch.float32, n_layer=2, n_embd=256)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 101, (n + queries, 16), generator=g)
    return ga.tasks.causal_lm(model), [{"input_ids": r} for r in ids]


def gpt2_relatif(n):
    """RelatIF at its defaults (EK-FAC): the training side normalized in the metric of H⁻¹,
    ⟨g, H⁻¹ g⟩ per training row (issue 28: flat rows and their image, 3·d per row, unplanned)."""
    task, items = _gpt2_causal(n)
    return lambda m: ga.methods.relatif(task, items[:m], items[n:])


def gpt2_self_influence(n):
    """EK-FAC self-influence, ⟨g_z, H⁻¹ g_z⟩ per training row (the diagonal's working set)."""
    task, items = _gpt2_causal(n)
    return lambda m: ga.methods.self_influence(ga.methods.influence, task, items[:m], curvature="ekfac")


CASES = {"conv_ekfac": (conv_ekfac, 400), "mlp_classes": (mlp_classes, 1500), "gpt2_logra": (gpt2_logra, 300),
         "llama_kfac": (llama_kfac, 200), "gpt2_held_queries": (gpt2_held_queries, 48),
         "gpt2_trackstar": (gpt2_trackstar, 64), "gpt2_relatif": (gpt2_relatif, 32),
         "gpt2_self_influence": (gpt2_self_influence, 32)}


def isolate_pass_peaks() -> list[dict]:
    """Reset the peak mark at the start of every pass the executor runs, so that each
    pass's own peak is measured even when an earlier pass's was higher (the process keeps
    one mark). Returns the list that fills with each pass's growth, in order."""
    from gradalg.exec.runner import PassRunner

    isolated, run_pass = [], PassRunner.run_pass

    def measured(self, step, *where):
        gc.collect()
        reset = reset_peak()
        start = current_rss()
        run_pass(self, step, *where)
        isolated.append({"peak_rss_growth_bytes": peak_rss() - start, "reset": reset})
    PassRunner.run_pass = measured
    return isolated


def main():
    case, budget = sys.argv[1], int(sys.argv[2])
    torch.set_num_threads(1)
    build, n = CASES[case]
    scores = build(n)
    ga.devices.local_profile()                # this machine's speeds: measured once, not part of a run
    with ga.options(progress=False):
        scores(8).compute()                        # warm-up: imports, kernels, allocator pools
    gc.collect()
    reset_peak()
    base = current_rss()
    with ga.options(progress=False, memory_budget=budget):
        S = scores(n)
        ex = ga.exec.LocalExecutor()
        estimated = ex.plan(S.expr).peak_bytes
        S.compute(executor=ex)
    peak_growth = peak_rss() - base
    isolated = []
    if "--isolate-passes" in sys.argv:              # again, each pass measured on its own
        isolated = isolate_pass_peaks()
        with ga.options(progress=False, memory_budget=budget):
            scores(n).compute(executor=ga.exec.LocalExecutor())
    print(json.dumps({"case": case, "budget": budget, "peak_growth": peak_growth, "estimated": estimated,
                      "isolated_passes": isolated,
                      "passes": [{k: v for k, v in st.items()} for st in ex.pass_stats],
                      "batch_sizes": [p.batch_size for p in ex.last_plan.passes],
                      "estimated_per_pass": [p.cost.peak_bytes for p in ex.last_plan.passes],
                      "resident_at_start_per_pass": [resident_at_start(p, ex.last_plan)
                                                     for p in ex.last_plan.passes],
                      "pass_jobs": [[j.kind for j in p.jobs] for p in ex.last_plan.passes]}, default=str))


def resident_at_start(p, plan) -> float:
    """Bytes of a pass's estimate already resident when it starts: the raw held rows of
    its scores jobs, collected by an earlier pass (a growth measured from the pass's start
    does not see them)."""
    from gradalg.plan.jobs import ScoresJob
    from gradalg.plan.memory import rows_bytes
    return sum(rows_bytes(j.held, j.held_storage, plan.facts) for j in p.jobs if isinstance(j, ScoresJob))


if __name__ == "__main__":
    main()
