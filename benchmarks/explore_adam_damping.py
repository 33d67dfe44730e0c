"""Damping shaped like Adam's preconditioner, (G + λ D)⁻¹ with D = √v̂ + ε (issue 31: a lead measured).

A model trained by Adam for T steps at learning rate η responds to removing an example, to
first order along its linearised dynamics θ ← θ − η D⁻¹ (∇J), by

    Δθ ≈ D^{-1/2} f(D^{-1/2} G D^{-1/2}) D^{-1/2} g,   f(x) = (1 − (1 − ηx)^T) / x ≈ 1 / (x + 1/(ηT)),

that is (G + D/(ηT))⁻¹ g: damping proportional to Adam's own per-coordinate scale rather than the
identity. Here that is measured without touching the library: each GPT-2 ``Conv1D`` of the
blocks is reparametrised as W = diag(b) Φ diag(a) (an exact reparametrisation: the outputs are
unchanged), with b aᵀ = (Adafactor's rank-1 factorisation of D)^{-1/2}, so that the library's
methods on the wrapped model, with λ·I damping in Φ's coordinates, compute qᵀ (G + λ D̂)⁻¹ g with
D̂ = (b aᵀ)^{-2} ≈ D. v̂ is Adam's bias-corrected second moment at the end of the run (``adam``),
or the mean of squared batch-32 gradients at the trained model (``estimate``: no optimizer
state), or the identity (``none``: the methods as they are). ``auto`` is each method's default
damping rule; a number r is influence's ``relative_damping=r`` (λ = r × the mean eigenvalue of
the EK-FAC curvature in the wrapped model's coordinates; RelatIF runs at ``auto`` only).

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/explore_adam_damping.py --settings lm
"""
from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch
from transformers.pytorch_utils import Conv1D

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fidelity_lm as F  # noqa: E402
import gradalg as ga  # noqa: E402
from explore_sparsity import lds  # noqa: E402

LAYERS = ["transformer.h.*"]          # the blocks' Conv1D layers: the ones reparametrised


class Rescaled(torch.nn.Module):
    """``y = a ⊙ conv(b ⊙ x)`` with ``conv.weight`` = W / (b aᵀ) and its bias / a: W's layer exactly."""

    def __init__(self, conv: Conv1D, a: torch.Tensor, b: torch.Tensor):
        super().__init__()
        self.inner = conv
        self.register_buffer("a", a)
        self.register_buffer("b", b)

    def forward(self, x):
        return self.inner(x * self.b) * self.a


def rescaled(model, v: dict, eps: float = 1e-8):
    """A copy of ``model`` with every Conv1D W (in, out) as diag(b) Φ diag(a), b aᵀ = D̂^{-1/2},
    D̂ = r cᵀ / Σ D the rank-1 factorisation of D = √v + ε (r, c its row and column sums)."""
    out = copy.deepcopy(model)
    for parent_name, parent in list(out.named_modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, Conv1D):
                D = v[f"{parent_name}.{name}.weight"].sqrt() + eps
                b, a = (D.sum(1) / D.sum().sqrt()).rsqrt(), (D.sum(0) / D.sum().sqrt()).rsqrt()
                with torch.no_grad():
                    child.weight.div_(torch.outer(b, a))
                    child.bias.div_(a)
                setattr(parent, name, Rescaled(child, a, b))
    return out.eval()


def second_moments(p, source: str, model, snapshots) -> dict | None:
    if source == "none":
        return None
    if source == "adam":
        opt = snapshots[-1][1]
        state, names = opt.state_dict()["state"], [n for n, _ in model.named_parameters()]
        step = float(state[0]["step"])
        return {n: state[i]["exp_avg_sq"] / (1 - 0.999 ** step) for i, n in enumerate(names)}
    g = torch.Generator().manual_seed(123)
    data = ga.collate.pad_collate(p.train)
    acc = {n: torch.zeros_like(q) for n, q in model.named_parameters()}
    for _ in range(64):
        batch = torch.randint(0, len(p.train), (32,), generator=g)
        model.zero_grad()
        F.sequence_losses(model, {k: t[batch] for k, t in data.items()}).mean().backward()
        for n, q in model.named_parameters():
            acc[n] += q.grad ** 2 / 64
    model.zero_grad()
    return acc


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--settings", default="lm")
    ap.add_argument("--methods", default="relatif,influence")
    ap.add_argument("--sources", default="none,adam,estimate")
    ap.add_argument("--dampings", default="auto,1e-3,1e-2,1e-1,1",
                    help="'auto' or influence's relative_damping (λ / the curvature's mean eigenvalue)")
    ap.add_argument("--bootstrap", type=int, default=1000)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    print("| setting | D | method | damping | LDS |\n|---|---|---|---|---:|")
    for name in args.settings.split(","):
        p = F.Prepared(F.SETTINGS[name], seeds_per_subset=4)
        truth, queries = p.truth.isel(query=slice(0, p.n_query)), p.queries[:p.n_query]
        model, snapshots = F.train_model(p.setting, p.train, checkpoints=10)
        for source in args.sources.split(","):
            v = second_moments(p, source, model, snapshots)
            m = model if v is None else rescaled(model, v)
            for method in args.methods.split(","):
                for d in args.dampings.split(","):
                    if d != "auto" and method != "influence":
                        continue
                    kw = {} if d == "auto" else {"relative_damping": float(d)}
                    S = getattr(ga.methods, method)(p.task(m), p.train, queries, layers=LAYERS, **kw).compute()
                    mean, (lo, hi) = lds(S.values, truth, args.bootstrap)
                    print(f"| `{name}` | {source} | {method} | {d} | {mean:.3f} [{lo:.3f}, {hi:.3f}] |", flush=True)


if __name__ == "__main__":
    main()
