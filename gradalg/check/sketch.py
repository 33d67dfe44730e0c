"""One batch through the real capture path, sketched; and, for a batch of one example,
the same gradient from autograd.

For a batch of n examples and the blocks ``refs``, :func:`capture_sketch` runs the task's
summed loss once with :class:`~gradalg.capture.hooks.ForwardRecorder` and
:func:`~gradalg.capture.hooks.capture_batch` (what ``ga.grads`` does per batch) and
reduces each example's gradient of each block by a fixed random sketch (:class:`Sketch`)::

    rows[b] = vec(P_out G_{b,i} P_inᵀ)              (n, k_out·k_in)   G_{b,i} = D_{b,i}ᵀ A_{b,i}

with ``P_out`` (k_out, out) and ``P_in`` (k_in, in) Gaussian with entries of variance 1/k
(the identity where out ≤ k or in ≤ k: that side is exact). The sketch is linear, so two
batches' rows of one example are equal when its gradient does not depend on its batch,
and a batch's rows sum to the sketch of the batch's gradient; by Johnson–Lindenstrauss,
relative differences of sketches estimate those of the gradients (k = 16: a spread of a
few tens of percent on differences that are either at rounding level or far above it).

With ``autograd=True`` it also asks autograd for the gradient of the same loss w.r.t. each
block's parameters and compares it with Σ_i G_{b,i} = D_allᵀ A_all read in the
parameters' layout, both sketched by the same matrices in that layout (P_a X P_bᵀ per
parameter, exact for 1-D ones): they are equal when capture sees every use of the
block's parameters.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..capture.factors import Factors, OneHot, compute_dtype, kron_project, materialize
from ..capture.hooks import ForwardRecorder, capture_batch
from ..data import batch_size_of, move_batch
from ..errors import GradalgError

__all__ = ["Sketch", "Sketched", "capture_sketch", "relative", "LossFailedError"]


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
    """One batch's sketches: ``rows`` {block: (n, K)} from capture, ``loss`` the summed
    loss, and (when asked for) ``autograd`` {block: relative difference between Σ_i of the
    captured gradients and autograd's gradient of the block's parameters, or None where
    the block's layout could not be read}."""

    rows: dict
    loss: float
    autograd: dict | None = None

    def flat_rows(self) -> torch.Tensor:
        """Every block's row sketches side by side.   (n, Σ K)"""
        return torch.cat([r.to(torch.float64) for r in self.rows.values()], dim=1)


def _summed(F: Factors) -> Factors:
    """The n examples' factors as one example: Σ_i D_iᵀA_i = D_allᵀ A_all.   (1, n·T, ·)"""
    D = F.D.reshape(1, -1, F.D.shape[-1])
    if isinstance(F.A, OneHot):
        valid = None if F.A.valid is None else F.A.valid.reshape(1, -1)
        return Factors(OneHot(F.A.idx.reshape(1, -1), F.A.size, valid), D)
    return Factors(F.A.reshape(1, -1, F.A.shape[-1]), D)


def _param_sketch(x: torch.Tensor, sketch: "Sketch", key: str) -> torch.Tensor:
    """A parameter-shaped gradient ``x`` sketched: P_a X P_bᵀ for X = x as (a, b) (a 2-D view
    is used as it is, strided or not: one GEMM reads it once), ``x`` itself when 1-D."""
    if x.dim() <= 1:
        return x.reshape(-1)
    X = x if x.dim() == 2 else x.reshape(x.shape[0], -1)
    P_a, P_b = sketch.mats(key, X.shape[0], X.shape[1], X.dtype, X.device)
    return (P_a @ X @ P_b.T).flatten()


def _against_autograd(ref, F: Factors, grads: dict, sketch: "Sketch") -> float | None:
    """‖Σ_i G_i − ∂L/∂θ‖ / max(‖·‖) over the block's parameters, both sketched in the
    parameters' layout by the same random matrices (:func:`_param_sketch`), Σ_i G_i =
    D_allᵀA_all read in that layout (``rule.to_params``: views). None when the rule cannot
    split the block into these parameters."""
    if getattr(ref.rule, "partial_params", False):    # a slice of its parameters (one fused expert)
        if any(g is None for g in grads.values()):
            return None
        ours = materialize(_summed(F))[0]
        theirs = ref.rule.from_params(ref.module, {n: g[None] for n, g in grads.items()})[0].to(ours.dtype)
        return relative(_param_sketch(ours, sketch, ref.name), _param_sketch(theirs, sketch, ref.name))
    try:
        captured = ref.rule.to_params(ref.module, materialize(_summed(F)))
    except (KeyError, AttributeError, RuntimeError, TypeError, IndexError):
        return None
    ours, theirs = [], []
    for name, g in grads.items():
        if name not in captured:
            return None
        c = captured[name][0]
        g = torch.zeros_like(c) if g is None else g.to(c.dtype)
        if c.shape != g.shape:
            return None
        key = f"{ref.name}.{name}"
        ours.append(_param_sketch(c, sketch, key))
        theirs.append(_param_sketch(g, sketch, key))
    return relative(torch.cat(ours), torch.cat(theirs)) if ours else None


class LossFailedError(GradalgError, RuntimeError):
    """The task's loss raised a non-gradalg error on a batch of the check: ``error`` is that
    exception, ``example_ids`` the batch's examples."""

    def __init__(self, error: BaseException, example_ids=()):
        self.error, self.example_ids = error, list(example_ids)
        super().__init__(f"the task's loss raised {type(error).__name__}: {error} on example ids "
                         f"{self.example_ids[:8]}")

    def __reduce__(self):
        return type(self), (self.error, self.example_ids)


def capture_sketch(task, batch, refs, sketch: Sketch, device, *, autograd: bool = False, ids=()) -> Sketched:
    """Capture ``batch`` (already checked by the task) and sketch its rows (module
    docstring). ``autograd``: also compare Σ_i of the captured gradients with autograd's
    gradient of the same loss w.r.t. each block's parameters (a second backward). Runs in
    the model's current mode; the caller chooses it. ``ids``: the batch's example ids, named
    by :class:`LossFailedError` when the loss raises an error of its own."""
    model = task.model
    batch = move_batch(batch, device)
    n = batch_size_of(batch)
    with torch.enable_grad(), ForwardRecorder(list(refs), model=model) as recorder:
        try:
            loss = task.summed_loss(model, batch)
        except GradalgError:
            raise
        except Exception as err:  # noqa: BLE001 - the user's loss or model failed on these examples
            raise LossFailedError(err, ids) from err
        mask = task.token_mask(batch) if task.token_mask is not None else None
        blocks = capture_batch(loss, recorder, token_mask=mask, n_examples=n, retain_graph=autograd)
        if autograd:
            named = [(ref, pname, getattr(ref.module, pname)) for ref in refs for pname in ref.param_names()]
            grads = torch.autograd.grad(loss, [p for _, _, p in named], allow_unused=True)
    rows, compared = {}, {}
    for ref in refs:
        F = blocks[ref.name]
        if not isinstance(F, Factors):          # a dense block: (n, dim) as one column
            F = Factors(F.new_ones(F.shape[0], 1, 1), F.reshape(F.shape[0], 1, -1))
        rows[ref.name] = sketch.rows(ref.name, F)
        if autograd:
            own = {pname: g for (r, pname, _), g in zip(named, grads) if r is ref}
            compared[ref.name] = _against_autograd(ref, F, own, sketch)
    return Sketched(rows, float(loss.detach()), compared if autograd else None)
