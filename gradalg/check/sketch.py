"""One batch through the real capture path, and the same gradients from autograd, sketched.

For a batch of n examples and the blocks ``refs``, :func:`capture_sketch` runs the task's
summed loss once with :class:`~gradalg.capture.hooks.ForwardRecorder` and
:func:`~gradalg.capture.hooks.capture_batch` (what ``ga.grads`` does per batch), then asks
autograd for the gradient of the same loss w.r.t. each block's parameters. Both are
reduced by a fixed random sketch per block (:class:`Sketch`)::

    rows[b]  = vec(P_out G_{b,i} P_inᵀ)              (n, k_out·k_in)   G_{b,i} = D_{b,i}ᵀ A_{b,i}
    total[b] = vec(P_out (∂L/∂θ_b) P_inᵀ)           (k_out·k_in,)     in the block's (out, in) layout

with ``P_out`` (k_out, out) and ``P_in`` (k_in, in) Gaussian with entries of variance 1/k
(the identity where out ≤ k or in ≤ k: that side is exact). The sketch is linear, so
``Σ_i rows[b][i] = total[b]`` exactly when capture sees every use of the block's
parameters and the loss is a sum, and two batches' rows of one example are equal when its
gradient does not depend on its batch; by Johnson–Lindenstrauss, relative differences of
sketches estimate those of the gradients (k = 16: a few tens of percent of spread on
differences that are either at rounding level or far above it).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..capture.factors import Factors, compute_dtype, kron_project
from ..capture.hooks import ForwardRecorder, capture_batch
from ..data import batch_size_of, move_batch

__all__ = ["Sketch", "Sketched", "capture_sketch", "relative"]


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a − b‖ / max(‖a‖, ‖b‖) (0 when both are 0)."""
    scale = max(float(a.norm()), float(b.norm()))
    return float((a - b).norm()) / scale if scale > 0 else 0.0


class Sketch:
    """Fixed random projections, one pair per block and shape, drawn from ``seed``."""

    def __init__(self, k: int = 16, seed: int = 0):
        self.k, self.seed = k, seed
        self._mats: dict = {}

    def _side(self, size: int, index: int, dtype, device) -> torch.Tensor:
        if size <= self.k:
            return torch.eye(size, dtype=dtype, device=device)
        g = torch.Generator().manual_seed(self.seed * 1000003 + index)
        return (torch.randn(self.k, size, generator=g, dtype=torch.float64) / math.sqrt(self.k)).to(dtype=dtype,
                                                                                                 device=device)

    def mats(self, name: str, out: int, inp: int, dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
        """``(P_out, P_in)`` of block ``name`` with shape (out, in)."""
        key = (name, out, inp, dtype, device)
        if key not in self._mats:
            index = len({k[0] for k in self._mats})
            self._mats[key] = (self._side(out, 2 * index, dtype, device), self._side(inp, 2 * index + 1, dtype, device))
        return self._mats[key]

    def rows(self, name: str, F: Factors) -> torch.Tensor:
        """Sketches of the n per-example gradients of a factored block.   (n, k_out·k_in)"""
        dtype = compute_dtype(F.D.dtype)
        P_out, P_in = self.mats(name, F.out_features, F.in_features, dtype, F.D.device)
        return kron_project(F, P_out, P_in).flatten(1)

    def matrix(self, name: str, M: torch.Tensor) -> torch.Tensor:
        """The sketch of one (out, in) gradient matrix.   (k_out·k_in,)"""
        dtype = compute_dtype(M.dtype)
        P_out, P_in = self.mats(name, M.shape[0], M.shape[1], dtype, M.device)
        return (P_out @ M.to(dtype) @ P_in.T).flatten()


@dataclass
class Sketched:
    """One batch's sketches: ``rows`` {block: (n, K)} from capture, ``total`` {block: (K,)
    or None where the block's layout could not be rebuilt} from autograd, ``loss`` the
    summed loss."""

    rows: dict
    total: dict
    loss: float

    def flat_rows(self) -> torch.Tensor:
        """Every block's row sketches side by side.   (n, Σ K)"""
        return torch.cat([r.to(torch.float64) for r in self.rows.values()], dim=1)

    def flat_total(self) -> torch.Tensor:
        """Autograd's total gradient, sketched, every block side by side (captured sums where
        a block's autograd layout is unknown).   (Σ K,)"""
        return torch.cat([(t if t is not None else self.rows[b].sum(0)).to(torch.float64)
                          for b, t in self.total.items()])


def _block_total(ref, grads: dict, like: Factors, sketch: Sketch):
    """Autograd's gradient of block ``ref`` in its (out, in) layout, sketched (None when the
    block's rule cannot rebuild it or its shape differs from the captured factors)."""
    try:
        params = {n: (g if g is not None else torch.zeros_like(getattr(ref.module, n))).unsqueeze(0)
                  for n, g in grads.items()}
        M = ref.rule.from_params(ref.module, params)[0]
    except (KeyError, AttributeError, RuntimeError, TypeError):
        return None
    if M.dim() != 2 or tuple(M.shape) != (like.out_features, like.in_features):
        return None
    return sketch.matrix(ref.name, M)


def capture_sketch(task, batch, refs, sketch: Sketch, device) -> Sketched:
    """Capture ``batch`` (already checked by the task) and sketch its gradients (module
    docstring). Runs in the model's current mode; the caller chooses it."""
    model = task.model
    batch = move_batch(batch, device)
    n = batch_size_of(batch)
    with torch.enable_grad(), ForwardRecorder(list(refs), model=model) as recorder:
        loss = task.summed_loss(model, batch)
        mask = task.token_mask(batch) if task.token_mask is not None else None
        blocks = capture_batch(loss, recorder, token_mask=mask, n_examples=n, retain_graph=True)
        named = [(ref, pname, getattr(ref.module, pname)) for ref in refs for pname in ref.param_names()]
        grads = torch.autograd.grad(loss, [p for _, _, p in named], allow_unused=True)
    per_ref: dict = {ref.name: {} for ref in refs}
    for (ref, pname, _), g in zip(named, grads):
        per_ref[ref.name][pname] = g
    rows, total = {}, {}
    for ref in refs:
        F = blocks[ref.name]
        if not isinstance(F, Factors):          # a dense block: (n, dim) as one column
            F = Factors(F.new_ones(F.shape[0], 1, 1), F.reshape(F.shape[0], 1, -1))
        rows[ref.name] = sketch.rows(ref.name, F)
        total[ref.name] = _block_total(ref, per_ref[ref.name], F, sketch)
    return Sketched(rows, total, float(loss.detach()))
