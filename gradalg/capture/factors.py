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

Token blocks
------------
Every kernel takes ``token_block`` (``ga.options(token_block=...)``, default 512; None:
all positions at once) and works on positions ``t0:t0+b`` of each example at a time, so
its temporaries are bounded independently of the sequence length T:

* ``ghost_inner``: Σ_{t,s} = Σ_{blocks p, q} Σ_{t∈p, s∈q}; the (nL', nR', bL, bR)
  intermediates of the pairs of blocks, sliced over examples of both sides, hold at most
  ``max(max_elements, bL·bR)`` elements (a single pair of blocks cannot be split further).
* ``self_inner``: the same over pairs p ≤ q (off-diagonal pairs twice: the Gram matrices
  are symmetric).
* ``materialize``: G_i = Σ_p D_{i,p}ᵀ A_{i,p} accumulated into the (n, out, in) result;
  only one block of the factors is cast to the compute dtype at a time.
* ``kron_project`` / ``project_factors``: (D_i Poᵀ)ᵀ(A_i Piᵀ) = Σ_p (D_{i,p} Poᵀ)ᵀ(A_{i,p} Piᵀ),
  one (n, b, k) block of projected factors at a time.

Sums over blocks are the same sums in another order: results agree with the unblocked
kernels to the compute dtype's rounding (tests/test_token_blocks.py).

Precision
---------
Factors keep the model's dtype (a bf16 model records bf16 ``A`` and ``D``: half the
memory). Every kernel here computes in :func:`compute_dtype` of the factors — float32
for bfloat16 / float16, their own dtype otherwise — so inner products, materialized
gradients and projections are float32 sums of the half-precision entries, never sums
rounded to 8 (bf16) or 11 (fp16) bits. Statistics (Fisher, K-FAC covariances) are summed
in float64 downstream (``plan/jobs/``, ``curvature/kron.py``; Kronecker factors
wider than ``ga.options(kron_float64_width)`` in float32 with a Kahan compensation).
"""
from __future__ import annotations

from ..errors import OptionError

from dataclasses import dataclass

import torch

__all__ = ["OneHot", "Factors", "ghost_inner", "materialize", "kron_project", "project_factors", "self_inner",
           "ghost_flops", "dense_flops", "compute_dtype", "HALF_DTYPES", "token_slices", "ghost_workspace_elements"]

HALF_DTYPES = (torch.float16, torch.bfloat16)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype kernels compute in for factors of ``dtype``: float32 for half precision."""
    return torch.float32 if dtype in HALF_DTYPES else dtype


def token_slices(T: int, token_block: int | None) -> list[slice]:
    """Positions ``0..T`` in consecutive blocks of ``token_block`` (one block when None)."""
    if token_block is not None and (not isinstance(token_block, int) or token_block < 1):
        raise OptionError(f"token_block must be a positive int or None, got {token_block!r}")
    b = T if not token_block else token_block
    return [slice(t, min(t + b, T)) for t in range(0, max(T, 1), max(b, 1))]


def ghost_workspace_elements(nL: int, nR: int, TL: int, TR: int, max_elements: int,
                             token_block: int | None) -> int:
    """Elements of the largest intermediate of :func:`ghost_inner` (each of the activation
    Gram, the gradient Gram and their product has this many): pairs of token blocks
    (bL, bR), sliced over examples of both sides under ``max_elements``."""
    bL, bR = (min(TL, token_block), min(TR, token_block)) if token_block else (TL, TR)
    step_L, step_R = _example_steps(nL, nR, bL, bR, max_elements)
    return step_L * step_R * bL * bR


def _example_steps(nL: int, nR: int, bL: int, bR: int, max_elements: int) -> tuple[int, int]:
    """Examples per slice of each side so that (step_L, step_R, bL, bR) ≤ max_elements
    (at least one example each)."""
    pair = max(1, bL * bR)
    step_L = max(1, min(nL, max_elements // pair))
    step_R = max(1, min(nR, max_elements // (pair * step_L)))
    return step_L, step_R


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

    def tokens(self, positions: slice) -> "Factors":
        """Positions ``positions`` of every example: ``A[:, positions]``, ``D[:, positions]``."""
        return Factors(self.A[:, positions], self.D[:, positions])

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


def ghost_inner(L: Factors, R: Factors, max_elements: int = 2**26, token_block: int | None = None) -> torch.Tensor:
    """⟨G_i, G_j⟩ for every pair, from factors only.   Returns (nL, nR).

        ⟨G_i, G_j⟩ = Σ_{t,s} (a_it·a_js)(d_it·d_js) = Σ_{p,q} Σ_{t∈p, s∈q} (a_it·a_js)(d_it·d_js)

    over pairs (p, q) of token blocks of ``token_block`` positions. Cost:
    nL·nR·TL·TR·(in + out) multiply-adds; never forms the (out, in) gradients. Each pair
    of blocks is computed in slices of examples of both sides so that the
    (nL', nR', bL, bR) intermediate stays under ``max_elements``
    (:func:`ghost_workspace_elements`).
    """
    dtype = compute_dtype(torch.promote_types(L.D.dtype, R.D.dtype))
    out = torch.zeros(L.n, R.n, dtype=dtype, device=L.D.device)
    for tl in token_slices(L.T, token_block):
        Lb = L.tokens(tl)
        LA, LD = _up(Lb.A, dtype), _up(Lb.D, dtype)
        for tr in token_slices(R.T, token_block):
            Rb = R.tokens(tr)
            RA, RD = _up(Rb.A, dtype), _up(Rb.D, dtype)
            step_L, step_R = _example_steps(L.n, R.n, Lb.T, Rb.T, max_elements)
            for i in range(0, L.n, step_L):
                la, ld = LA[i:i + step_L], LD[i:i + step_L]
                for j in range(0, R.n, step_R):
                    a = _act_gram(la, RA[j:j + step_R], dtype)                       # (nL', nR', bL, bR)
                    d = torch.einsum("qto,rso->qrts", ld, RD[j:j + step_R])           # (nL', nR', bL, bR)
                    out[i:i + step_L, j:j + step_R] += (a * d).sum(dim=(2, 3))
    return out


def _self_gram(A, B, dtype) -> torch.Tensor:
    """(n, bT, bS) of a_it · b_is for the same examples (A, B: blocks of one factor)."""
    if isinstance(A, OneHot):
        eq = (A.idx[:, :, None] == B.idx[:, None, :]).to(dtype)
        return eq * A.weights(dtype)[:, :, None] * B.weights(dtype)[:, None, :]
    return torch.einsum("nti,nsi->nts", A, B)


def self_inner(F: Factors, max_elements: int = 2**26, token_block: int | None = None) -> torch.Tensor:
    """‖G_i‖² for each example, by ghost products of an example with itself. (n,)

        ‖G_i‖² = Σ_{t,s} (a_it·a_is)(d_it·d_is) = Σ_p S_pp + 2 Σ_{p<q} S_pq

    over token blocks p, q (the Gram matrices are symmetric), in slices of examples
    whose (n', bT, bS) intermediates stay under ``max_elements``."""
    dtype = compute_dtype(F.D.dtype)
    out = torch.zeros(F.n, dtype=dtype, device=F.D.device)
    blocks = token_slices(F.T, token_block)
    for p, tp in enumerate(blocks):
        Fp = F.tokens(tp)
        Ap, Dp = _up(Fp.A, dtype), _up(Fp.D, dtype)
        for tq in blocks[p:]:
            Fq = F.tokens(tq)
            Aq, Dq = _up(Fq.A, dtype), _up(Fq.D, dtype)
            weight = 1.0 if tq == tp else 2.0
            step = max(1, max_elements // max(1, Fp.T * Fq.T))
            for i in range(0, F.n, step):
                a = _self_gram(Ap[i:i + step], Aq[i:i + step], dtype)                  # (n', bT, bS)
                d = torch.einsum("nto,nso->nts", Dp[i:i + step], Dq[i:i + step])      # (n', bT, bS)
                out[i:i + step] += weight * (a * d).sum(dim=(1, 2))
    return out


def materialize(F: Factors, token_block: int | None = None) -> torch.Tensor:
    """G_i = D_iᵀ A_i = Σ_p D_{i,p}ᵀ A_{i,p} for each example, summed over token blocks p of
    ``token_block`` positions, in :func:`compute_dtype`.   Returns (n, out, in)."""
    dtype = compute_dtype(F.D.dtype)
    n, out = F.n, F.out_features
    blocks = token_slices(F.T, token_block)
    if isinstance(F.A, OneHot):
        G = F.D.new_zeros(n, out, F.A.size, dtype=dtype)
        for tp in blocks:
            Fp = F.tokens(tp)
            D = _up(Fp.D, dtype) * Fp.A.weights(dtype).unsqueeze(-1)
            index = Fp.A.idx.unsqueeze(1).expand(n, out, Fp.T)
            G.scatter_add_(2, index, D.transpose(1, 2))
        return G
    if len(blocks) == 1:
        return torch.einsum("nto,nti->noi", _up(F.D, dtype), _up(F.A, dtype))
    G = F.D.new_zeros(n, out, F.in_features, dtype=dtype)
    for tp in blocks:
        Fp = F.tokens(tp)
        G.baddbmm_(_up(Fp.D, dtype).transpose(1, 2), _up(Fp.A, dtype))    # += D_pᵀ A_p   (n, out, in)
    return G


def kron_project(F: Factors, P_out: torch.Tensor, P_in: torch.Tensor, token_block: int | None = None) -> torch.Tensor:
    """P_out G_i P_inᵀ computed as Σ_p (D_{i,p} P_outᵀ)ᵀ (A_{i,p} P_inᵀ) over token blocks p.
    Returns (n, k_out, k_in).

    P_out : (k_out, out), P_in : (k_in, in). Cost n·T·(in·k_in + out·k_out + k_out·k_in);
    temporaries: one (n, b, k_in + k_out) block of projected factors.
    """
    G = None
    for tp in token_slices(F.T, token_block):
        part = materialize(project_factors(F.tokens(tp), P_out, P_in))
        G = part if G is None else G.add_(part)
    return G


def project_factors(F: Factors, P_out: torch.Tensor, P_in: torch.Tensor, token_block: int | None = None) -> Factors:
    """Factors of P_out G_i P_inᵀ: ``(A_i P_inᵀ, D_i P_outᵀ)``, shapes (n, T, k_in), (n, T, k_out),
    in the wider of the factors' :func:`compute_dtype` and the matrices' dtype; computed one
    token block at a time into the result (half-precision factors are cast a block at a time)."""
    dtype = torch.promote_types(compute_dtype(F.D.dtype), P_in.dtype)
    P_in, P_out = P_in.to(dtype), P_out.to(dtype)
    blocks = token_slices(F.T, token_block)
    if len(blocks) > 1:
        A = F.D.new_empty(F.n, F.T, P_in.shape[0], dtype=dtype)
        D = F.D.new_empty(F.n, F.T, P_out.shape[0], dtype=dtype)
        for tp in blocks:
            part = project_factors(F.tokens(tp), P_out, P_in)
            A[:, tp], D[:, tp] = part.A, part.D
        return Factors(A, D)
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
