"""How much a bf16 model's rounding moves each method's scores, by damping.

A bf16 model's per-example gradients carry its own rounding (≈ 2⁻⁸ relative each); a
method that inverts a curvature, (F + λI)⁻¹, amplifies that rounding along the
curvature's small eigenvalues, the more so the smaller λ. This script separates the two
sources of error on a small Qwen2-shaped model (tied head, grouped-query attention):

* **gradalg's own error**: its scores on the bf16 model against a float64 computation
  from the same bf16 model's own per-example gradients (loop of backward):
  S_ref = Q (GᵀG/n + λI)⁻¹ Gᵀ for empirical-Fisher influence, Q Gᵀ for Grad-Dot;
* **the model's rounding**: the bf16 model's scores against those of the same weights
  in float64.

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/low_precision_damping.py

prints one table (relative Frobenius errors). ``docs/user_guide.md`` ("Low precision")
quotes it.
"""
from __future__ import annotations

import argparse
import copy

import torch
from torch import nn

import gradalg as ga
from gradalg.capture.reference import param_names_of, per_example_grads


def build(vocab: int, seed: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    bf16 = Qwen2ForCausalLM(cfg).to(torch.bfloat16).eval()
    return bf16, copy.deepcopy(bf16).double()


def rows(model, data, layers) -> torch.Tensor:
    """(n, p) float64 per-example gradients of the model in its own dtype (loop of backward)."""
    task = ga.tasks.causal_lm(model)
    g = per_example_grads(task, data, param_names_of(model, layers), method="loop")
    return torch.cat([v.reshape(v.shape[0], -1).double() for v in g.values()], 1)


def rel(a, b) -> float:
    a, b = torch.as_tensor(a).double(), torch.as_tensor(b).double()
    return float((a - b).norm() / b.norm())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--train", type=int, default=12)
    ap.add_argument("--queries", type=int, default=3)
    ap.add_argument("--T", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dampings", type=float, nargs="+", default=[1e-3, 1e-2, 1e-1, 1.0])
    args = ap.parse_args()

    bf16, f64 = build(args.vocab, args.seed)
    gen = torch.Generator().manual_seed(args.seed + 1)
    train = {"input_ids": torch.randint(0, args.vocab, (args.train, args.T), generator=gen)}
    queries = {"input_ids": torch.randint(0, args.vocab, (args.queries, args.T), generator=gen)}
    layers = [n for n, m in bf16.named_modules() if isinstance(m, nn.Linear) and ".layers." in n]

    G, Q = rows(bf16, train, layers), rows(bf16, queries, layers)
    n = G.shape[0]
    K = G @ G.T / n                                   # (n, n): (GᵀG/n + λI)⁻¹Gᵀ = Gᵀ(GGᵀ/n + λI)⁻¹
    eye = torch.eye(n, dtype=K.dtype)

    def scores(model, fn):
        return torch.as_tensor(fn(ga.tasks.causal_lm(model)).compute().values).double()

    print(f"Qwen2-shaped, 1 layer, width 16, vocabulary {args.vocab}, {args.train} x {args.T} training "
          f"tokens, {args.queries} queries; {G.shape[1]} attributed parameters")
    print("| method | damping | gradalg bf16 vs float64 solve of its own bf16 rows | bf16 model vs float64 model |")
    print("|---|---:|---:|---:|")
    gd = lambda t: ga.methods.grad_dot(t, train, queries, layers=layers)  # noqa: E731
    print(f"| Grad-Dot | — | {rel(scores(bf16, gd), Q @ G.T):.1e} | {rel(scores(bf16, gd), scores(f64, gd)):.1e} |")
    for lam in args.dampings:
        inf = lambda t: ga.methods.influence(t, train, queries, curvature="empirical",  # noqa: E731
                                             damping=lam, layers=layers)
        own = Q @ G.T @ torch.linalg.inv(K + lam * eye)
        print(f"| influence, empirical Fisher, direct | {lam:g} | {rel(scores(bf16, inf), own):.1e} | "
              f"{rel(scores(bf16, inf), scores(f64, inf)):.1e} |")


if __name__ == "__main__":
    main()
