"""Planning LLMs that exist only on PyTorch's ``meta`` device: time of ``explain()`` and
the per-GPU estimates it gives, for 7B / 70B / 110B models × four methods.

Models are built from transformers configs under ``torch.device("meta")`` (shapes, no
storage, nothing downloaded), in bfloat16, with the published dimensions of

    Qwen2-7B        Qwen2Config(hidden 3584, intermediate 18944, 28 layers, 28 heads / 4 kv, vocab 152064)
    Llama-3-70B     LlamaConfig(hidden 8192, intermediate 28672, 80 layers, 64 heads / 8 kv, vocab 128256)
    Qwen1.5-110B    Qwen2Config(hidden 8192, intermediate 49152, 80 layers, 64 heads / 8 kv, vocab 152064)

Data: stand-in datasets of token sequences (length ``--tokens``, 1024) that report
their length and one example's shape; the planner reads that one shape, never the rest.
Training set: ⌈10⁶ / T⌉ sequences (10⁶ training tokens); ``--queries`` (32) queries.
Attributed layers: every Linear of the decoder layers (attention and MLP).

Methods (``ga.methods``)::

    grad-dot kron   grad_dot(..., projector=ga.proj.kron(k=4096))
    logra           logra(...)                     (k = 4096, EK-FAC in the projected space)
    ekfac           influence(..., curvature="ekfac")   (unprojected)
    trak            trak(...)                      (k = 2048, its default projection)

Printed per model × method: seconds to build the expression, seconds of ``explain()``
(planning and rendering the text), and the estimated time and memory per GPU on 1, 2, 4
and 8 H200s (``ga.plan.scale.scale_estimates``: model estimates from NVIDIA's spec
sheet, not measurements). ``--markdown`` also prints the table of docs/performance.md.

    .venv/bin/python benchmarks/plan_scale.py
    .venv/bin/python benchmarks/plan_scale.py --models 70b --methods logra
"""
from __future__ import annotations

import argparse
import math
import os
import time

import torch
from torch.utils.data import Dataset

import gradalg as ga
from gradalg.plan.cost import _si

from gpu import scores_of   # benchmarks/ is the script's folder: the same method recipes

GPU_COUNTS = (1, 2, 4, 8)


class TokenShapes(Dataset):
    """``n`` sequences of ``T`` token ids: a shape for the planner (all zeros)."""

    def __init__(self, n: int, T: int):
        self.n, self.T = n, T
        self.reads = 0

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        self.reads += 1
        return {"input_ids": torch.zeros(self.T, dtype=torch.long)}


def configs():
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
    return {
        "7b": ("Qwen2-7B", Qwen2ForCausalLM, Qwen2Config(
            hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
            num_key_value_heads=4, vocab_size=152064)),
        "70b": ("Llama-3-70B", LlamaForCausalLM, LlamaConfig(
            hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
            num_key_value_heads=8, vocab_size=128256)),
        "110b": ("Qwen1.5-110B", Qwen2ForCausalLM, Qwen2Config(
            hidden_size=8192, intermediate_size=49152, num_hidden_layers=80, num_attention_heads=64,
            num_key_value_heads=8, vocab_size=152064)),
    }


LAYERS = ["model.layers.*.self_attn.*", "model.layers.*.mlp.*"]


def method_scores(method: str, task, train, queries):
    """The method's Scores on the attention and MLP layers (the GPU benchmark's recipes)."""
    return scores_of(method, task, train, queries, LAYERS)


METHODS = ("grad-dot kron", "logra", "ekfac", "trak")


def build(key: str):
    name, cls, config = configs()[key]
    with torch.device("meta"):
        model = cls(config).to(torch.bfloat16)
    return name, model


def plan_one(model, name: str, method: str, T: int, n_queries: int):
    """(wall seconds to build the expression, wall seconds of explain(), CPU seconds of
    both, scale rows, error or None)."""
    task = ga.tasks.causal_lm(model, name=name)
    train = TokenShapes(math.ceil(1e6 / T), T)
    queries = TokenShapes(n_queries, T)
    c0, t0 = time.process_time(), time.perf_counter()
    S = method_scores(method, task, train, queries)
    t1 = time.perf_counter()
    try:
        e = S.explain(device="h200", gpus=GPU_COUNTS)
        str(e)
        rows, error = e.to_dict()["scale"], None
    except ga.errors.MemoryBudgetError as err:
        rows, error = [], str(err)
    t2, c2 = time.perf_counter(), time.process_time()
    assert train.reads <= 1 and queries.reads <= 1, "planning read more than one example's shape"
    assert all(p.is_meta for p in model.parameters()), "planning materialized a weight"
    return t1 - t0, t2 - t1, c2 - c0, rows, error


def _cell(row) -> str:
    if not row["fits"]:
        return f"does not fit ({_si(row['memory_per_gpu'])}B)"
    return f"{_fmt_h(row['seconds'])}, {_si(row['memory_per_gpu'])}B"


def _fmt_h(seconds: float) -> str:
    return f"{seconds / 3600:.1f} h" if seconds >= 3600 else f"{seconds / 60:.1f} min"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["7b", "70b", "110b"], choices=["7b", "70b", "110b"])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--tokens", type=int, default=1024, help="T, tokens per sequence")
    parser.add_argument("--queries", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--markdown", action="store_true", help="also print the docs table")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"# gradalg plan_scale — {time.strftime('%Y-%m-%d %H:%M')}, torch {torch.__version__}, "
          f"load average {os.getloadavg()[0]:.1f}")
    print(f"# T = {args.tokens}, {math.ceil(1e6 / args.tokens)} training sequences (10⁶ tokens), "
          f"{args.queries} queries, bfloat16 meta models; device H200 (spec-sheet preset)")
    header = f"{'model':14} {'method':14} {'params':>7} {'build s':>8} {'explain s':>9} {'CPU s':>6}  " + "  ".join(
        f"{g} GPU(s)".ljust(24) for g in GPU_COUNTS)
    print(header)
    table = []
    for key in args.models:
        t0 = time.perf_counter()
        name, model = build(key)
        made = time.perf_counter() - t0
        n_params = sum(p.numel() for p in model.parameters())
        print(f"# {name}: {n_params / 1e9:.1f} B parameters, built on meta in {made:.1f} s (transformers)")
        for method in args.methods:
            built, explained, cpu, rows, error = plan_one(model, name, method, args.tokens, args.queries)
            cells = [_cell(r) for r in rows] if rows else [f"refused: {error[:60]}…"]
            print(f"{name:14} {method:14} {n_params / 1e9:6.1f}B {built:8.2f} {explained:9.2f} {cpu:6.2f}  "
                  + "  ".join(c.ljust(24) for c in cells))
            table.append((name, method, rows, error, built + explained))
    for name, method, rows, error, seconds in table:
        if error:
            print(f"# {name} {method} refused: {error}")
    if args.markdown:
        print()
        print("| model | method | planning s | " + " | ".join(f"{g}× H200" for g in GPU_COUNTS) + " |")
        print("|---|---|---|" + "---|" * len(GPU_COUNTS))
        for name, method, rows, error, seconds in table:
            cells = [_cell(r) for r in rows] if rows else ["refused"] * len(GPU_COUNTS)
            print(f"| {name} | {method} | {seconds:.1f} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
