"""Iterative inverse-operator solvers on matrix-vector products.

All solvers take ``matvec(X) -> H X`` on a batch of right-hand sides ``X`` (m, dim),
never the matrix, and solve ``(H + λI) Y = X`` for all rows at once:

``conjugate_gradient``  CG on the damped system (H symmetric PSD); exact in ≤ dim steps.
``lissa``               the Neumann-series recursion of Agarwal et al. (2017), as used by
                        Koh & Liang:  Y_{j+1} = X + (1 − λ/s) Y_j − (H Y_j)/s,  H⁻¹X ≈ Y/s,
                        for a scale s > λ_max(H).
``arnoldi``             top-r eigenpairs of H by the Arnoldi iteration (Schioppa et al. 2022):
                        H ≈ V diag(μ) Vᵀ on its top eigenspace.
"""
from __future__ import annotations

from typing import Callable

import torch

from ..errors import GradalgError

__all__ = ["conjugate_gradient", "lissa", "arnoldi", "lanczos_min", "cg_max_iter", "arnoldi_iters", "LISSA_DEPTH",
           "iteration_bound"]

MatVec = Callable[[torch.Tensor], torch.Tensor]

#: LiSSA's default recursion depth (products per solve, at most)
LISSA_DEPTH = 1000


def cg_max_iter(dim: int, max_iter: int | None = None) -> int:
    """CG's iterations at most (one product each): ``max_iter``, else min(2·dim + 10, 1000)
    (rounding: exact arithmetic needs dim)."""
    return max_iter or min(2 * dim + 10, 1000)


def arnoldi_iters(dim: int, rank: int, iters: int | None = None) -> int:
    """Arnoldi's iterations (one product of one vector each): min(dim, iters or 2·rank + 10)."""
    return min(dim, iters or 2 * rank + 10)


def iteration_bound(method: str, settings: dict, dim: int) -> tuple[int, str]:
    """``(products at most, the setting that bounds them)`` of one solve by ``method``
    ("cg", "lissa") with ``settings`` on ``dim`` coordinates: each iteration is one
    product; CG and LiSSA may stop earlier (``rtol``, ``tol``)."""
    if method == "cg":
        given = settings.get("max_iter")
        return cg_max_iter(dim, given), f"CG max_iter={given}" if given else "CG max_iter=min(2·dim+10, 1000)"
    depth = settings.get("depth")
    return depth or LISSA_DEPTH, f"LiSSA depth={depth or LISSA_DEPTH}"


def conjugate_gradient(matvec: MatVec, X: torch.Tensor, damping: float = 0.0, *, max_iter: int | None = None,
                       rtol: float = 1e-10) -> torch.Tensor:
    """Solve (H + λI) Y = X row-wise by conjugate gradients.   X: (m, dim) → Y: (m, dim)."""
    max_iter = cg_max_iter(X.shape[1], max_iter)

    def A(V):
        return matvec(V) + damping * V

    Y = torch.zeros_like(X)
    R = X.clone()
    P = R.clone()
    rs = (R * R).sum(1)
    target = (rtol ** 2) * (X * X).sum(1).clamp_min(1e-300)
    for _ in range(max_iter):
        if bool((rs <= target).all()):
            break
        AP = A(P)
        denom = (P * AP).sum(1)
        if bool((denom <= 0).any() & (rs > target).any()):
            raise GradalgError("conjugate gradient met a direction of non-positive curvature: the "
                               "operator is not positive definite; add damping (op.damp(λ)) or use "
                               "a Gauss-Newton curvature")
        alpha = torch.where(rs > target, rs / denom.clamp_min(1e-300), torch.zeros_like(rs))
        Y = Y + alpha[:, None] * P
        R = R - alpha[:, None] * AP
        rs_new = (R * R).sum(1)
        beta = torch.where(rs > target, rs_new / rs.clamp_min(1e-300), torch.zeros_like(rs))
        P = R + beta[:, None] * P
        rs = rs_new
    return Y


def lissa(matvec: MatVec, X: torch.Tensor, damping: float = 0.0, *, scale: float = 10.0, depth: int = LISSA_DEPTH,
          tol: float = 1e-10) -> torch.Tensor:
    """(H + λI)⁻¹ X by LiSSA's recursion; needs ``scale`` > the largest eigenvalue of H + λI.

    Converges geometrically at rate 1 − (λ_min + λ)/scale; stops early when an update
    changes Y by less than ``tol`` relative to Y.
    """
    Y = X.clone()
    for _ in range(depth):
        Y_next = X + Y - (matvec(Y) + damping * Y) / scale
        if not torch.isfinite(Y_next).all():
            raise GradalgError(f"LiSSA diverged: scale={scale} is below the largest eigenvalue of the "
                               "damped operator; raise `scale`")
        delta = (Y_next - Y).norm() / Y_next.norm().clamp_min(1e-300)
        Y = Y_next
        if delta < tol:
            break
    return Y / scale


def arnoldi(matvec: MatVec, dim: int, rank: int, *, iters: int | None = None, seed: int = 0,
            dtype=torch.float64, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``rank`` eigenpairs of a symmetric H by the Arnoldi (Lanczos) iteration.

    Runs ``iters`` (default min(dim, 2·rank + 10)) matrix-vector products with full
    re-orthogonalization, then keeps the ``rank`` largest Ritz pairs.
    Returns (eigenvalues (rank,), eigenvectors (dim, rank)).
    """
    iters = arnoldi_iters(dim, rank, iters)
    gen = torch.Generator().manual_seed(seed)
    v = torch.randn(dim, generator=gen, dtype=torch.float64).to(device=device, dtype=dtype)
    V = torch.zeros(iters + 1, dim, dtype=dtype, device=device)
    Hm = torch.zeros(iters + 1, iters, dtype=dtype, device=device)
    V[0] = v / v.norm()
    k = iters
    for j in range(iters):
        w = matvec(V[j:j + 1])[0]
        for _ in range(2):  # re-orthogonalize twice for stability
            coeffs = V[: j + 1] @ w
            w = w - coeffs @ V[: j + 1]
            Hm[: j + 1, j] += coeffs
        h = w.norm()
        Hm[j + 1, j] = h
        if h < 1e-12:
            k = j + 1
            break
        V[j + 1] = w / h
    H_small = Hm[:k, :k]
    evals, evecs = torch.linalg.eigh((H_small + H_small.T) / 2)
    order = torch.argsort(evals, descending=True)[:rank]
    return evals[order], V[:k].T @ evecs[:, order]


def lanczos_min(matvec: MatVec, dim: int, iters: int, *, stop_below: float = float("-inf"), seed: int = 0,
                dtype=torch.float64) -> tuple[float, int]:
    """``(θ, steps)``: the smallest Ritz value θ of a symmetric H after ``steps`` ≤ ``iters`` Lanczos
    steps (one product with one vector each, full re-orthogonalization), from a seeded Gaussian
    start. θ ≥ μ_min(H) always (a Ritz value lies inside the spectrum), and falls toward it with
    each step; it stops as soon as θ < ``stop_below`` (what the caller needed to know is proved).
    """
    iters = max(1, min(int(iters), dim))
    gen = torch.Generator().manual_seed(seed)
    V = torch.zeros(iters + 1, dim, dtype=dtype)
    T = torch.zeros(iters + 1, iters, dtype=dtype)                  # (iters + 1, iters): Hessenberg = tridiagonal
    v = torch.randn(dim, generator=gen, dtype=torch.float64).to(dtype)
    V[0] = v / v.norm()
    theta, steps = float("inf"), 0
    for j in range(iters):
        w = matvec(V[j:j + 1])[0].to(dtype)                         # (dim,)
        for _ in range(2):                                           # re-orthogonalize twice
            c = V[: j + 1] @ w
            w = w - c @ V[: j + 1]
            T[: j + 1, j] += c
        steps = j + 1
        small = T[:steps, :steps]
        theta = float(torch.linalg.eigvalsh((small + small.T) / 2).min())
        h = w.norm()
        if theta < stop_below or h < 1e-12:
            break
        T[j + 1, j] = h
        V[j + 1] = w / h
    return theta, steps
