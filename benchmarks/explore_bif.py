"""The local Bayesian influence function on the LM settings: a measured lead (issue 31).

Kreer et al. (2025, "Bayesian influence functions for Hessian-free data attribution") replace
the inverse Hessian by a covariance over a local posterior around the trained θ*,

    p(θ) ∝ exp(−nβ L_n(θ) − (γ/2) ‖θ − θ*‖²),      τ_qi = Cov_p(ℓ_i(θ), f_q(θ))     (helpful > 0),

sampled by SGLD on mini-batches of 32 (B),

    θ ← θ − (ε/2) (nβ ∇L_B(θ) + γ (θ − θ*)) + √ε ξ,   ξ ~ N(0, I),

with every training loss ℓ_i (n,) and query target f_q (m,) evaluated at each kept draw. Where
the posterior is Gaussian, τ = (1/nβ) ∇ℓ_iᵀ (H + γ/nβ)⁻¹ ∇f_q: the influence function with damping
λ = γ/nβ, so the grid below is over nβ and λ. The step is ε = ``eps_scale`` / (nβ μ_max + γ), μ_max
the top eigenvalue of ∇²L_n at θ* (power iteration on Hessian-vector products), for a stable
chain. No ground truth is read but by the LDS. ``mean Δℓ`` is the chains' mean training loss
above θ*'s: how far the posterior reaches.

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/explore_bif.py --settings lm
"""
from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fidelity_lm as F  # noqa: E402
from explore_sparsity import lds  # noqa: E402


def top_eigenvalue(model, params, batch, iters: int = 20) -> float:
    """μ_max of ∇²L_n (the mean of the sequences' losses) by power iteration."""
    v = [torch.randn_like(q) for q in params]
    mu = 0.0
    for _ in range(iters):
        g = torch.autograd.grad(F.sequence_losses(model, batch).mean(), params, create_graph=True)
        hv = torch.autograd.grad(sum((gi * vi).sum() for gi, vi in zip(g, v)), params)
        mu = float(torch.sqrt(sum((h * h).sum() for h in hv)))
        v = [h / mu for h in hv]
    return mu


def bif_scores(model, params, train, queries, *, nbeta, lam, mu, eps_scale, chains, draws, burn, thin, seed=1):
    """(τ (m, n), mean Δℓ): the SGLD covariance estimate of the module docstring."""
    n, gamma = len(train["input_ids"]), nbeta * lam
    eps = eps_scale / (nbeta * mu + gamma)
    start = [q.detach().clone() for q in params]
    g = torch.Generator().manual_seed(seed)
    L, Fq = [], []
    for _ in range(chains):
        with torch.no_grad():
            for q, w in zip(params, start):
                q.copy_(w)
        for step in range(burn + draws * thin):
            b = torch.randint(0, n, (32,), generator=g)
            grads = torch.autograd.grad(F.sequence_losses(model, {k: v[b] for k, v in train.items()}).mean(), params)
            with torch.no_grad():
                for q, gq, w in zip(params, grads, start):
                    q.add_(-(eps / 2) * (nbeta * gq + gamma * (q - w)))
                    q.add_(torch.randn(q.shape, generator=g) * np.sqrt(eps))
            if step >= burn and (step - burn) % thin == 0:
                with torch.no_grad():
                    L.append(F.sequence_losses(model, train).double().numpy())
                    Fq.append(F.query_token_loss_sums(model, queries).double().numpy())
    with torch.no_grad():
        for q, w in zip(params, start):
            q.copy_(w)
        base = F.sequence_losses(model, train).double().numpy()
    L, Fq = np.array(L), np.array(Fq)                         # (draws, n), (draws, m)
    tau = (Fq - Fq.mean(0)).T @ (L - L.mean(0)) / (len(L) - 1)
    return tau, float(L.mean() - base.mean())


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--settings", default="lm")
    ap.add_argument("--nbeta", type=float, nargs="+", default=[2000.0, 20000.0])
    ap.add_argument("--lam", type=float, nargs="+", default=[0.01, 0.1, 1.0])
    ap.add_argument("--eps-scale", type=float, default=0.2)
    ap.add_argument("--chains", type=int, default=4)
    ap.add_argument("--draws", type=int, default=100)
    ap.add_argument("--burn", type=int, default=100)
    ap.add_argument("--thin", type=int, default=2)
    ap.add_argument("--bootstrap", type=int, default=1000)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    for name in args.settings.split(","):
        p = F.Prepared(F.SETTINGS[name], seeds_per_subset=4)
        truth = p.truth.isel(query=slice(0, p.n_query))
        model = p.model
        model.config._attn_implementation = "eager"         # the fused CPU attention has no double backward
        params = list(model.parameters())
        train = ga_collate(p.train)
        torch.manual_seed(0)
        mu = top_eigenvalue(model, params, train)
        print(f"| {name}: nβ | λ = γ/nβ | mean Δℓ | LDS | seconds |\n|---:|---:|---:|---|---:|", flush=True)
        for nbeta, lam in itertools.product(args.nbeta, args.lam):
            t0 = time.perf_counter()
            tau, dl = bif_scores(model, params, train, p.query_batch, nbeta=nbeta, lam=lam, mu=mu,
                                 eps_scale=args.eps_scale, chains=args.chains, draws=args.draws,
                                 burn=args.burn, thin=args.thin)
            mean, (lo, hi) = lds(tau[:p.n_query], truth, args.bootstrap)
            print(f"| {nbeta:g} | {lam:g} | {dl:.3f} | {mean:.3f} [{lo:.3f}, {hi:.3f}] | "
                  f"{time.perf_counter() - t0:.0f} |", flush=True)


def ga_collate(items):
    import gradalg as ga
    return ga.collate.pad_collate(items)


if __name__ == "__main__":
    main()
