"""Cost accounting for plans: exact operation counts from shapes, no tensors.

A :class:`Cost` counts floating-point operations (``flops``; a multiply-add is 2),
bytes moved through memory (``bytes``), the largest simultaneous footprint
(``peak_bytes``), forward/backward ``passes`` over datasets and module ``calls`` (each
forward or backward of a module costs a fixed overhead — Python dispatch, a kernel
launch — that dominates small models). :func:`model_flops`
counts a model's forward FLOPs per token from its module shapes (meta-device models
work: nothing is allocated). The per-kernel formulas are those of the kernels in
:mod:`gradalg.capture.factors`; unit tests pin them to exact numbers.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..capture.factors import dense_flops, ghost_flops
from ..expr.tokens import token_rows

__all__ = ["Cost", "activation_bytes", "model_flops", "tokens_hint", "ghost_cost", "dense_cost", "kron_project_cost",
           "dense_project_cost", "fisher_cost", "eigh_cost"]


@dataclass(frozen=True)
class Cost:
    """An estimated cost: counts from shapes alone, no data read.

    flops : floating-point operations, a multiply-add counted as 2.
    bytes : bytes moved (read and written) through memory.
    peak_bytes : the largest working set held at once (adding two costs takes the max).
    passes : passes over a dataset (forward + backward of each example).
    calls : kernel launches / framework calls (their fixed overhead on a device)."""
    flops: float = 0.0
    bytes: float = 0.0
    peak_bytes: float = 0.0
    passes: float = 0.0
    calls: float = 0.0

    def __add__(self, other: "Cost") -> "Cost":
        return Cost(self.flops + other.flops, self.bytes + other.bytes,
                    max(self.peak_bytes, other.peak_bytes), self.passes + other.passes,
                    self.calls + other.calls)

    def scaled(self, c: float) -> "Cost":
        """This cost repeated ``c`` times: every count times ``c`` except ``peak_bytes``
        (repetitions run one after another and reuse the memory)."""
        return Cost(self.flops * c, self.bytes * c, self.peak_bytes, self.passes * c, self.calls * c)

    def seconds(self, profile, dtype=torch.float32) -> float:
        """Estimated seconds on a device ``profile`` (:mod:`gradalg.plan.devices`): compute
        (flops / FLOP/s at ``dtype``) plus memory traffic (bytes / bandwidth), assumed not
        to overlap, plus the fixed overhead of each call."""
        return profile.seconds(self.flops, self.bytes, dtype, calls=self.calls)

    def __repr__(self) -> str:
        return f"Cost({self.describe()}, {_si(self.bytes)}B moved)"

    def describe(self) -> str:
        """One line for plans: FLOPs, peak memory and passes over data."""
        return (f"~{_si(self.flops)}FLOP, peak ~{_si(self.peak_bytes)}B, "
                f"{self.passes:g} pass(es) over data")


def _si(x: float) -> str:
    for unit, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if x >= scale:
            return f"{x / scale:.3g} {unit}"
    return f"{x:.3g} "


# ------------------------------------------------------------------ kernel formulas (FLOPs)
def ghost_cost(nL, nR, TL, TR, n_in, n_out) -> Cost:
    """Ghost inner products of nL × nR examples (2 FLOPs per multiply-add)."""
    return Cost(flops=2.0 * ghost_flops(nL, nR, TL, TR, n_in, n_out))


def dense_cost(nL, nR, TL, TR, n_in, n_out, left_ready=True) -> Cost:
    """Materialize the streamed side (and the held side unless ready), then one GEMM."""
    flops = 2.0 * dense_flops(nL, nR, TL, TR, n_in, n_out, left_ready=left_ready)
    return Cost(flops=flops, bytes=4.0 * nR * n_in * n_out)


def kron_project_cost(n, T, n_in, n_out, k_in, k_out) -> Cost:
    """(A P_inᵀ, D P_outᵀ): factor-wise Kronecker projection, factors kept."""
    return Cost(flops=2.0 * n * T * (n_in * k_in + n_out * k_out))


def dense_project_cost(n, T, dim, k, factored=True) -> Cost:
    """Materialize (if factored: n·T·dim MACs) then a (k, dim) GEMM."""
    return Cost(flops=2.0 * n * ((T * dim if factored else 0) + dim * k), bytes=4.0 * k * dim)


def fisher_cost(n, block_dims, structure) -> Cost:
    if structure == "dense":
        d = sum(block_dims)
        return Cost(flops=2.0 * n * d * d, peak_bytes=8.0 * d * d)
    if structure == "block":
        return Cost(flops=2.0 * n * sum(d * d for d in block_dims), peak_bytes=8.0 * sum(d * d for d in block_dims))
    return Cost(flops=2.0 * n * sum(block_dims), peak_bytes=8.0 * sum(block_dims))


def eigh_cost(d) -> Cost:
    """Symmetric eigendecomposition ≈ 9 d³ FLOPs (tridiagonalization + QR iterations)."""
    return Cost(flops=9.0 * d ** 3, peak_bytes=16.0 * d * d)


# ------------------------------------------------------------------ models and data
_WEIGHT_TYPES = (nn.Linear, nn.Conv2d, nn.Conv1d)


def model_flops(model: nn.Module, tokens: int) -> float:
    """Forward FLOPs for one example of ``tokens`` positions, from module shapes.

    Linear-type layers (incl. HF Conv1D) cost 2·in·out per token; attention adds
    4·T·d per token per layer when the model has a transformer config. Convolutions
    are counted per output position as if T positions (a lower bound for images).
    """
    per_token = 0.0
    for module in model.modules():
        w = getattr(module, "weight", None)
        if not isinstance(w, torch.Tensor) or isinstance(module, (nn.Embedding, nn.LayerNorm)):
            continue
        if isinstance(module, _WEIGHT_TYPES) or type(module).__name__ == "Conv1D":
            per_token += 2.0 * w.numel()
    config = getattr(model, "config", None)
    if config is not None:
        layers = getattr(config, "num_hidden_layers", None) or getattr(config, "n_layer", None) or 0
        width = getattr(config, "hidden_size", None) or getattr(config, "n_embd", None) or 0
        per_token += 4.0 * tokens * width * layers
    return per_token * tokens


def activation_bytes(model: nn.Module, tokens: int, elem: int = 4) -> float:
    """Bytes autograd keeps per example for a forward/backward: the inputs and outputs of
    every Linear-type layer at every position (a lower bound; nonlinearities add a few)."""
    total = 0.0
    for module in model.modules():
        w = getattr(module, "weight", None)
        if isinstance(w, torch.Tensor) and w.dim() >= 2 and not isinstance(module, nn.Embedding):
            total += sum(w.shape[:2])
    return total * tokens * elem


def tokens_hint(node) -> int:
    """Positions per example T, read off the first example's shape (1 when unknown).

    Reads the shape of one example of the data (no model is run), once per dataset:
    cached on the data reference and the source node.
    """
    if token_rows(node) > 1:
        return 1  # per-token rows (ga.GradientSet.per_token): one position each
    src = node.source
    data = getattr(src, "data", None)
    if data is None:
        return 1
    cached = getattr(src, "_tokens_hint", None)
    if cached is None:   # known once per dataset: every source over it shares the first read
        cached = getattr(data, "_tokens_hint", None)
    if cached is not None:
        return cached
    T = 1
    try:
        batch = data.first_example_batch()
        first = batch
        while not isinstance(first, torch.Tensor):
            first = next(iter(first.values())) if isinstance(first, dict) else first[0]
        if first.dim() == 2 and not first.is_floating_point():
            T = int(first.shape[1])
    except Exception:
        T = 1
    object.__setattr__(src, "_tokens_hint", T)
    object.__setattr__(data, "_tokens_hint", T)
    return T
