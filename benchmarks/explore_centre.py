"""Where to linearise the digits settings' influence, from the one trained model: issue 31's
digits-MLP ≥ 0.85 (docs/fidelity.md, "A Newton step to the counterfactuals' centre").

The digits objective is J(θ; c) = (c/n) Σ_i ℓ_i(θ) + (wd/2)‖θ‖², trained at c = 1; the LDS
retrains on ½-subsets, whose mean weight is c = ½ ("At the counterfactuals' centre"). Its
minimiser θ_c is estimated from θ* by Newton steps on J(·; c),

    θ ← θ − (c H(θ) + wd I)⁻¹ (c ḡ(θ) + wd θ),     ḡ = (1/n) Σ ∇ℓ_i,  (d,)

with H the exact Hessian (1/n) Σ ∇²ℓ_i or the Gauss-Newton matrix (d, d), both formed densely
here by torch.func (d = 650 / 2,410). Each estimate is scored as the library's
``influence(..., data_weight=c)`` scores a model trained there:
(1/c) Q (H_c + λI + wd/c)⁻¹ Gᵀ with H_c the Hessian or the Gauss-Newton at the estimate
(G (n, d), Q (m, d) the per-example gradients there). Rows also at ε = 1 (θ*) with the
exact Hessian and several dampings, and at the trained centre (``Setting.centred``) as the
reference. No row reads the ground truth. LDS: ``ga.eval.lds(..., target="loss",
resample="both")`` against the setting's cached ground truth (fidelity.py's store).

On another setting (``conv``: a float32 conv net trained by Adam without weight decay) the
matrices come from the library's own builders instead (``LibraryPoint``: ``ga.grads``, the formed
Hessian of ``curvature="dense_hessian"``, the Gauss-Newton of ``curvature="gauss_newton"``), and
the rows are at the trained model only, with the Hessian's spectrum (``run_library``).

    PYTHONPATH=. OMP_NUM_THREADS=1 nice -n 10 python benchmarks/explore_centre.py --settings mlp,logreg
    PYTHONPATH=. OMP_NUM_THREADS=1 nice -n 10 python benchmarks/explore_centre.py --settings conv

Writes ``build/fidelity/explore-centre-<setting>.json``.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as Fn
from torch.func import functional_call, grad, jacrev, jvp, vmap

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
import gradalg as ga  # noqa: E402

import defaults_suite as D  # noqa: E402
import fidelity as F  # noqa: E402


class Flat:
    """A model as a function of its flat parameter vector θ (d,)."""

    def __init__(self, model):
        self.model = model
        self.names = [n for n, _ in model.named_parameters()]
        self.shapes = [p.shape for _, p in model.named_parameters()]
        self.sizes = [p.numel() for _, p in model.named_parameters()]

    def theta(self, model=None):
        return torch.cat([p.detach().reshape(-1) for p in (model or self.model).parameters()])

    def params(self, theta):
        return {n: t.reshape(s) for n, t, s in zip(self.names, theta.split(self.sizes), self.shapes)}

    def logits(self, theta, X):
        return functional_call(self.model, self.params(theta), (X,))

    def loss1(self, theta, x, y):
        return Fn.cross_entropy(self.logits(theta, x[None]), y[None])

    def mean_loss(self, theta, X, y):
        return Fn.cross_entropy(self.logits(theta, X), y)

    def grads(self, theta, X, y):                               # (n, d)
        return vmap(grad(self.loss1), in_dims=(None, 0, 0))(theta, X, y)

    def hessian(self, theta, X, y, chunk=64):                  # (d, d) of the mean data loss
        g = grad(self.mean_loss)
        eye = torch.eye(len(theta), dtype=theta.dtype)
        cols = [vmap(lambda v: jvp(lambda t: g(t, X, y), (theta,), (v,))[1])(eye[i:i + chunk])
                for i in range(0, len(theta), chunk)]
        return torch.cat(cols, 0)

    def gauss_newton(self, theta, X, y):                        # (d, d): (1/n) Σ Jᵀ (diag p − p pᵀ) J
        J = vmap(jacrev(lambda t, x: self.logits(t, x[None])[0]), in_dims=(None, 0))(theta, X)  # (n, k, d)
        p = torch.softmax(self.logits(theta, X), -1)                                            # (n, k)
        A = torch.diag_embed(p) - p[:, :, None] * p[:, None, :]                                 # (n, k, k)
        return torch.einsum("nkd,nkl,nle->de", J, A, J) / X.shape[0]


def newton_centre(f: Flat, theta, X, y, c, wd, curvature="hessian", steps=1):
    """θ after ``steps`` Newton steps on J(·; c) = c·mean ℓ + (wd/2)‖θ‖² (each halved until J
    decreases, Armijo 1e-4), and ‖∇J‖∞ after each. The system is c H + wd I; where it is not
    positive definite (the Hessian away from θ*), the step falls back to the Gauss-Newton's."""
    norms = []
    J = lambda t: c * f.mean_loss(t, X, y) + wd / 2 * (t ** 2).sum()      # noqa: E731
    eye = torch.eye(len(theta), dtype=theta.dtype)
    for _ in range(steps):
        g = c * f.grads(theta, X, y).mean(0) + wd * theta
        H = f.hessian(theta, X, y) if curvature == "hessian" else f.gauss_newton(theta, X, y)
        A = c * (H + H.T) / 2 + wd * eye
        if float(torch.linalg.eigvalsh(A)[0]) <= 0:
            A = c * f.gauss_newton(theta, X, y) + wd * eye
        step = torch.linalg.solve(A, g)
        t, j0 = 1.0, float(J(theta))
        while float(J(theta - t * step)) > j0 - 1e-4 * t * float(g @ step) and t > 1e-6:
            t /= 2
        theta = theta - t * step
        norms.append(float((c * f.grads(theta, X, y).mean(0) + wd * theta).abs().max()))
    return theta, norms


class Point:
    """G (n, d), Q (m, d), the Hessian and the Gauss-Newton (d, d) of the mean data loss at θ."""

    def __init__(self, f: Flat, theta, train, queries):
        self.theta = theta
        self.G, self.Q = f.grads(theta, *train), f.grads(theta, *queries)
        H = f.hessian(theta, *train)
        self.H = (H + H.T) / 2
        self.GN = f.gauss_newton(theta, *train)
        self.mu_H = torch.linalg.eigvalsh(self.H)

    def scores(self, c, wd, curvature="hessian", relative=0.0, shift=False, absolute=False):
        """(1/c) Q (A + λI + wd/c)⁻¹ Gᵀ (m, n): A the Hessian (``absolute``: |H|, its eigenvalues'
        magnitudes) or the Gauss-Newton; λ = relative × tr(A)/d, plus −μ_min(A) when ``shift``
        (A shifted to positive semi-definite)."""
        A = self.H if curvature == "hessian" else self.GN
        d = A.shape[0]
        if absolute:
            mu, V = torch.linalg.eigh(A)
            A = (V * mu.abs()) @ V.T
        lam = relative * float(torch.trace(A)) / d
        if shift:
            lam += max(0.0, -float(torch.linalg.eigvalsh(A)[0]))
        M = A + (lam + wd / c) * torch.eye(d, dtype=A.dtype)
        mu = torch.linalg.eigvalsh(M)
        return (self.Q @ torch.linalg.solve(M, self.G.T) / c).numpy(), float(mu[0]), float(mu[-1])


def lds(values, truth, bootstrap=1000):
    import xarray as xr
    v = xr.DataArray(values[:truth.sizes["query"]], dims=("query", "train"))
    r = ga.eval.lds(v, truth, target="loss", bootstrap=bootstrap, resample="both")
    return float(r.mean), float(r.interval[0]), float(r.interval[1])


def materials(name):
    """(Flat, θ* (d,) float64, train, queries, truth, the objective's wd, the trained centre): a digits setting."""
    ctx = D.digits(name)
    s = F.SETTINGS[name]
    f = Flat(s.full)
    return f, f.theta(), s.train, s.queries, D.load_truth(ctx.truth_spec), F.WD, f.theta(s.centred()[0])


def run(name, bootstrap, only=None, newton_steps=(1, 2, 3)):
    f, theta, train, queries, truth, wd, centred = materials(name)
    c = F.FRACTION
    out_path = D.BUILD / f"explore-centre-{name}.json"
    results = json.loads(out_path.read_text()) if out_path.exists() else {}
    t0 = time.process_time()
    star = Point(f, theta, train, queries)
    print(f"[{name}] d={len(theta)}; θ*: Hessian μ ∈ [{float(star.mu_H[0]):.2e}, {float(star.mu_H[-1]):.2e}], "
          f"mean {float(star.mu_H.mean()):.2e}; ({time.process_time() - t0:.1f} s CPU)", flush=True)

    def row(label, point, c_, w, **kw):
        if only and not any(o in label for o in only):
            return
        t = time.process_time()
        v, lo, hi = point.scores(c_, w, **kw)
        r = lds(v, truth, bootstrap)
        results[label] = dict(lds=r[0], low=r[1], high=r[2], cpu=time.process_time() - t, mu_min=lo, mu_max=hi)
        if centred is not None:
            results[label]["dist_to_trained_centre"] = float((point.theta - centred).norm())
        print(f"  [{name}] {label:58s} LDS {r[0]:.3f} [{r[1]:.3f}, {r[2]:.3f}]  μ ∈ [{lo:.2e}, {hi:.2e}]",
              flush=True)
        out_path.write_text(json.dumps(results, indent=1))

    # at ε = 1, as a user calls it (no weight decay given): the default and candidates
    for r_ in (1.0, 0.3):
        row(f"at 1: Gauss-Newton, {r_:g} × mean" + (" (the default)" if r_ == 1 else ""), star, 1.0, 0.0,
            curvature="gn", relative=r_)
    for r_ in (0.03, 0.1, 0.3, 1.0):
        row(f"at 1: Hessian shifted to PSD + {r_:g} × mean", star, 1.0, 0.0, shift=True, relative=r_)
    for r_ in (0.1, 0.3, 1.0):
        row(f"at 1: |Hessian| + {r_:g} × mean", star, 1.0, 0.0, absolute=True, relative=r_)
    if not wd:
        return results
    # with the objective's weight decay given
    row("at 1: Gauss-Newton + wd", star, 1.0, wd, curvature="gn")
    for r_ in (0.0, 0.1, 0.3, 1.0):
        row(f"at 1: Hessian + wd + {r_:g} × mean", star, 1.0, wd, relative=r_)
    # at the trained centre (reference: the 0.870 / 0.848 rows)
    ref = Point(f, centred, train, queries)
    row("trained centre: Hessian + wd/c", ref, c, wd)
    row("trained centre: Gauss-Newton + wd/c", ref, c, wd, curvature="gn")
    row("trained centre: Hessian + wd/c + 0.3 × mean", ref, c, wd, relative=0.3)
    # Newton estimates of the centre
    for curv in ("hessian", "gn"):
        for steps in newton_steps:
            t = time.process_time()
            th, norms = newton_centre(f, theta, *train, c, wd, curv, steps)
            print(f"  [{name}] Newton ({curv}) {steps} step(s): ‖∇J‖∞ {[f'{x:.1e}' for x in norms]}, "
                  f"‖θ − θ_c‖ {float((th - centred).norm()):.3f}, {time.process_time() - t:.1f} s CPU", flush=True)
            p = Point(f, th, train, queries)
            row(f"Newton {curv} × {steps}: Hessian + wd/c", p, c, wd)
            row(f"Newton {curv} × {steps}: Gauss-Newton + wd/c", p, c, wd, curvature="gn")
            row(f"Newton {curv} × {steps}: Hessian + wd/c + 0.3 × mean", p, c, wd, relative=0.3)
    return results


class LibraryPoint(Point):
    """A :class:`Point` from the library's own builders at the setting's model (any dtype, default
    layers): G, Q (``ga.grads``), the formed Hessian (``curvature="dense_hessian"``'s
    :class:`~gradalg.expr.curvature.Formed`) and the Gauss-Newton (``curvature="gauss_newton"``'s
    formed Fisher of the expected terms), all float64 in the space's canonical coordinates."""

    def __init__(self, ctx):
        from gradalg.expr.curvature import Formed
        from gradalg.methods.influence import CURVATURE_TABLE
        G = ga.grads(ctx.task, ctx.train)
        offsets = G.space.offsets()

        def flat(gs):
            dense = gs.to_dense()
            return torch.cat([dense[b].reshape(dense[b].shape[0], -1).to(torch.float64) for b in offsets], 1)
        self.theta = None
        self.G, self.Q = flat(G), flat(ga.grads(ctx.task, ctx.queries))
        H = ga.Operator(Formed(ga.hessian(ctx.task, ctx.train).expr)).to_dense().to(torch.float64)
        self.H = (H + H.T) / 2
        self.GN = CURVATURE_TABLE["gauss_newton"].build(ctx.task, ctx.train, None, lambda g: g, "direct",
                                                        {}).to_dense().to(torch.float64)
        self.mu_H = torch.linalg.eigvalsh(self.H)


def run_library(name, bootstrap):
    """The settings where the formed Hessian lost (conv): its spectrum and dampings, no wd."""
    ctx = D.context(name)
    truth = D.load_truth(ctx.truth_spec)
    out_path = D.BUILD / f"explore-centre-{name}.json"
    results = json.loads(out_path.read_text()) if out_path.exists() else {}
    t0 = time.process_time()
    p = LibraryPoint(ctx)
    mu, mg = p.mu_H, torch.linalg.eigvalsh(p.GN)
    neg = mu[mu < 0]
    info = dict(d=len(mu), mu_min=float(mu[0]), mu_max=float(mu[-1]), mean=float(mu.mean()),
                negative_count=int(neg.numel()), negative_mass=float(-neg.sum()), positive_mass=float(mu[mu > 0].sum()),
                gn_mean=float(mg.mean()), cpu=time.process_time() - t0)
    results["spectrum"] = info
    print(f"[{name}] Hessian spectrum {info}", flush=True)
    for label, kw in [("at 1: Gauss-Newton, 1 × mean (the default)", dict(curvature="gn", relative=1.0)),
                      *[(f"at 1: Hessian shifted to PSD + {r:g} × mean", dict(shift=True, relative=r))
                        for r in (0.3, 1.0, 3.0, 10.0)],
                      *[(f"at 1: |Hessian| + {r:g} × mean", dict(absolute=True, relative=r)) for r in (0.3, 1.0)],
                      ("at 1: Hessian + 1 × mean, unshifted", dict(relative=1.0))]:
        v, lo, hi = p.scores(1.0, 0.0, **kw)
        r = lds(v, truth, bootstrap)
        results[label] = dict(lds=r[0], low=r[1], high=r[2], mu_min=lo, mu_max=hi)
        print(f"  [{name}] {label:58s} LDS {r[0]:.3f} [{r[1]:.3f}, {r[2]:.3f}]  μ ∈ [{lo:.2e}, {hi:.2e}]",
              flush=True)
        out_path.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--settings", default="mlp,logreg")
    ap.add_argument("--bootstrap", type=int, default=1000)
    ap.add_argument("--only", default=None)
    ap.add_argument("--newton-steps", default="1,2,3")
    a = ap.parse_args()
    torch.set_num_threads(1)
    for name in a.settings.split(","):
        if name not in ("logreg", "mlp"):
            run_library(name, a.bootstrap)
            continue
        run(name, a.bootstrap, a.only.split(",") if a.only else None,
            tuple(int(x) for x in a.newton_steps.split(",")))
