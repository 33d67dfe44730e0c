"""Per-example factors ``(A, D)`` and the kernels that use them without materializing.

A factored block holds, for n examples, activations ``A`` (n, T, in) and output
gradients ``D`` (n, T, out) so that example i's gradient is ``G_i = D_iᵀ A_i``
(out, in). ``A`` may be a :class:`OneHot` (embedding layers): token ids standing for a
one-hot matrix (n, T, vocab) that is never built.

Kernels
-------
``ghost_inner(L, R)``  ⟨G_i, G_j⟩ = Σ_{t,s} (a_it·a_js)(d_it·d_js)       (nL, nR)
``materialize(F)``     G_i = D_iᵀ A_i                                      (n, out, in)
``kron_project(F, Po, Pi)`` (D_i Poᵀ)ᵀ (A_i Piᵀ) = Po G_i Piᵀ               (n, ko, ki)
``self_inner(F)``      ‖G_i‖² by the ghost identity                        (n,)

Precision
---------
Factors keep the model's dtype (a bf16 model records bf16 ``A`` and ``D``: half the
memory). Every kernel here computes in :func:`compute_dtype` of the factors — float32
for bfloat16 / float16, their own dtype otherwise — so inner products, materialized
gradients and projections are float32 sums of the half-precision entries, never sums
rounded to 8 (bf16) or 11 (fp16) bits. Statistics (Fisher, K-FAC covariances) are summed
in float64 downstream (``exec/accumulators.py``, ``curvature/kron.py``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["OneHot", "Factors", "ghost_inner", "materialize", "kron_project", "project_factors", "self_inner",
           "ghost_flops", "dense_flops", "compute_dtype", "HALF_DTYPES"]

HALF_DTYPES = (torch.float16, torch.bfloat16)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype kernels compute in for factors of ``dtype``: float32 for half precision."""
    return torch.float32 if dtype in HALF_DTYPES else dtype


def _up(x, dtype):
    return x.to(dtype) if isinstance(x, torch.Tensor) and x.dtype != dtype else x


@dataclass
class OneHot:
    """Token ids standing for one-hot activations.

    idx : (n, T) long
    size : vocabulary size (the ``in`` of the block)
    valid : (n, T) bool or None — False positions are all-zero rows.
    """

    idx: torch.Tensor
    size: int
    valid: torch.Tensor | None = None

    @property
    def shape(self):
        return (*self.idx.shape, self.size)

    def weights(self, dtype) -> torch.Tensor:
        """(n, T) multiplier: 1 at valid positions, 0 elsewhere."""
        if self.valid is None:
            return torch.ones(self.idx.shape, dtype=dtype, device=self.idx.device)
        return self.valid.to(dtype)

    def to_dense(self, dtype) -> torch.Tensor:
        out = torch.nn.functional.one_hot(self.idx, self.size).to(dtype)
        return out * self.weights(dtype).unsqueeze(-1)

    def __getitem__(self, index):
        return OneHot(self.idx[index], self.size, None if self.valid is None else self.valid[index])

    def mask(self, keep: torch.Tensor) -> "OneHot":
        valid = keep if self.valid is None else (self.valid & keep)
        return OneHot(self.idx, self.size, valid)


def _cat(parts, dim):
    if isinstance(parts[0], OneHot):
        valid = [p.valid if p.valid is not None else torch.ones_like(p.idx, dtype=torch.bool) for p in parts]
        return OneHot(torch.cat([p.idx for p in parts], dim), parts[0].size, torch.cat(valid, dim))
    return torch.cat(parts, dim)


@dataclass
class Factors:
    """One layer's factors for n examples: ``A`` (n, T, in) or OneHot, ``D`` (n, T, out)."""

    A: torch.Tensor | OneHot
    D: torch.Tensor

    @property
    def n(self) -> int:
        return self.D.shape[0]

    @property
    def T(self) -> int:
        return self.D.shape[1]

    @property
    def out_features(self) -> int:
        return self.D.shape[2]

    @property
    def in_features(self) -> int:
        return self.A.shape[2]

    def __getitem__(self, index) -> "Factors":
        return Factors(self.A[index], self.D[index])

    def scale_rows(self, w: torch.Tensor) -> "Factors":
        """Example i's gradient times ``w[i]`` (w: (n,))."""
        return Factors(self.A, self.D * w.to(device=self.D.device, dtype=self.D.dtype).view(-1, 1, 1))

    def mask_tokens(self, keep: torch.Tensor) -> "Factors":
        """Drop positions where ``keep`` (n, T) is False (zeroes them in A and D)."""
        keep = keep.to(self.D.device).bool()
        if isinstance(self.A, OneHot):
            A = self.A.mask(keep)
        else:
            A = self.A * keep.unsqueeze(-1).to(self.A.dtype)
        return Factors(A, self.D * keep.unsqueeze(-1).to(self.D.dtype))

    @staticmethod
    def concat_tokens(parts: list["Factors"]) -> "Factors":
        """A module called k times in one forward: G = Σ_c D_cᵀA_c = [D_1..D_k]ᵀ[A_1..A_k]."""
        if len(parts) == 1:
            return parts[0]
        return Factors(_cat([p.A for p in parts], 1), torch.cat([p.D for p in parts], 1))

    @staticmethod
    def concat_examples(parts: list["Factors"]) -> "Factors":
        """Stack chunks of examples, zero-padding T to the longest (zeros add nothing)."""
        T = max(p.T for p in parts)
        return Factors(_cat([_pad_T(p.A, T) for p in parts], 0), torch.cat([_pad_T(p.D, T) for p in parts], 0))

    def nbytes(self) -> int:
        a = self.A.idx.numel() * 8 if isinstance(self.A, OneHot) else self.A.numel() * self.A.element_size()
        return a + self.D.numel() * self.D.element_size()


def _pad_T(x, T):
    if isinstance(x, OneHot):
        if x.idx.shape[1] == T:
            return x
        pad = T - x.idx.shape[1]
        valid = x.valid if x.valid is not None else torch.ones_like(x.idx, dtype=torch.bool)
        return OneHot(torch.nn.functional.pad(x.idx, (0, pad)), x.size,
                      torch.nn.functional.pad(valid, (0, pad), value=False))
    if x.shape[1] == T:
        return x
    return torch.nn.functional.pad(x, (0, 0, 0, T - x.shape[1]))


def _act_gram(AL, AR, dtype) -> torch.Tensor:
    """(nL, nR, TL, TR) of activation inner products a_it · a_js."""
    if isinstance(AL, OneHot) and isinstance(AR, OneHot):
        eq = (AL.idx[:, None, :, None] == AR.idx[None, :, None, :]).to(dtype)
        return eq * AL.weights(dtype)[:, None, :, None] * AR.weights(dtype)[None, :, None, :]
    if isinstance(AL, OneHot):
        AL = AL.to_dense(dtype)
    if isinstance(AR, OneHot):
        AR = AR.to_dense(dtype)
    return torch.einsum("qti,rsi->qrts", AL, AR)


def ghost_inner(L: Factors, R: Factors, max_elements: int = 2**26) -> torch.Tensor:
    """⟨G_i, G_j⟩ for every pair, from factors only.   Returns (nL, nR).

    Cost: nL·nR·TL·TR·(in + out) multiply-adds; never forms the (out, in) gradients.
    Computed in slices of the right-hand examples so that the (nL, nR, TL, TR)
    intermediate stays under ``max_elements``.
    """
    dtype = compute_dtype(torch.promote_types(L.D.dtype, R.D.dtype))
    out = torch.empty(L.n, R.n, dtype=dtype, device=L.D.device)
    per_r = max(1, L.n * L.T * R.T)
    step = max(1, max_elements // per_r)
    LA, LD = _up(L.A, dtype), _up(L.D, dtype)
    for start in range(0, R.n, step):
        Rs = R[start:start + step]
        a = _act_gram(LA, _up(Rs.A, dtype), dtype)
        d = torch.einsum("qto,rso->qrts", LD, _up(Rs.D, dtype))
        out[:, start:start + step] = (a * d).sum(dim=(2, 3))
    return out


def self_inner(F: Factors) -> torch.Tensor:
    """‖G_i‖² for each example, by ghost products of an example with itself. (n,)"""
    dtype = compute_dtype(F.D.dtype)
    if isinstance(F.A, OneHot):
        a = (F.A.idx[:, :, None] == F.A.idx[:, None, :]).to(dtype)
        w = F.A.weights(dtype)
        a = a * w[:, :, None] * w[:, None, :]
    else:
        A = _up(F.A, dtype)
        a = torch.einsum("nti,nsi->nts", A, A)
    D = _up(F.D, dtype)
    d = torch.einsum("nto,nso->nts", D, D)
    return (a * d).sum(dim=(1, 2))


def materialize(F: Factors) -> torch.Tensor:
    """G_i = D_iᵀ A_i for each example, in :func:`compute_dtype`.   Returns (n, out, in)."""
    dtype = compute_dtype(F.D.dtype)
    if isinstance(F.A, OneHot):
        n, T, out = F.D.shape
        G = F.D.new_zeros(n, out, F.A.size, dtype=dtype)
        D = _up(F.D, dtype) * F.A.weights(dtype).unsqueeze(-1)
        index = F.A.idx.unsqueeze(1).expand(n, out, T)
        return G.scatter_add_(2, index, D.transpose(1, 2))
    return torch.einsum("nto,nti->noi", _up(F.D, dtype), _up(F.A, dtype))


def kron_project(F: Factors, P_out: torch.Tensor, P_in: torch.Tensor) -> torch.Tensor:
    """P_out G_i P_inᵀ computed as (D_i P_outᵀ)ᵀ (A_i P_inᵀ).   Returns (n, k_out, k_in).

    P_out : (k_out, out), P_in : (k_in, in). Cost n·T·(in·k_in + out·k_out + k_out·k_in).
    """
    return materialize(project_factors(F, P_out, P_in))


def project_factors(F: Factors, P_out: torch.Tensor, P_in: torch.Tensor) -> Factors:
    """Factors of P_out G_i P_inᵀ: ``(A_i P_inᵀ, D_i P_outᵀ)``, shapes (n, T, k_in), (n, T, k_out),
    in the wider of the factors' :func:`compute_dtype` and the matrices' dtype."""
    dtype = torch.promote_types(compute_dtype(F.D.dtype), P_in.dtype)
    P_in, P_out = P_in.to(dtype), P_out.to(dtype)
    if isinstance(F.A, OneHot):
        A = P_in.T[F.A.idx] * F.A.weights(P_in.dtype).unsqueeze(-1)
    else:
        A = _up(F.A, dtype) @ P_in.T
    return Factors(A, _up(F.D, dtype) @ P_out.T)


def ghost_flops(nL: int, nR: int, TL: int, TR: int, n_in: int, n_out: int) -> int:
    """Multiply-adds of :func:`ghost_inner`."""
    return nL * nR * TL * TR * (n_in + n_out + 1)


def dense_flops(nL: int, nR: int, TL: int, TR: int, n_in: int, n_out: int, left_ready: bool = False) -> int:
    """Multiply-adds of materializing both sides and one GEMM of the flattened blocks."""
    left = 0 if left_ready else nL * TL * n_in * n_out
    return left + nR * TR * n_in * n_out + nL * nR * n_in * n_out
