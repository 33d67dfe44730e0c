"""Per-example gradients of element-wise affine norm layers (LayerNorm, RMSNorm).

Their parameters are not ``(out, in)`` factor blocks, so hook capture does not score
them; but an exact correction of a step's gradient (online selection) must remove a
dropped example's contribution from *every* trainable parameter. For
``y = x̂ ⊙ w + b`` with ``x̂`` the normalized input::

    ∂L_i/∂w = Σ_t d_it ⊙ x̂_it        ∂L_i/∂b = Σ_t d_it        (d = ∂L/∂y)

A forward hook recomputes ``x̂`` (the norm without its affine) and keeps it; a tensor
hook on the output receives ``d`` during backward. Supported: ``nn.LayerNorm``,
``nn.RMSNorm``, and modules whose class name contains ``LayerNorm`` or ``RMSNorm``
(HF ``LlamaRMSNorm``, OLMo-core ``LayerNorm``/``RMSNorm``, ...) with a 1-D or
broadcastable ``weight``; the first call checks ``x̂ ⊙ w + b`` against the module's
output and refuses a module that computes something else (Gemma's ``1 + w``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..dtensor import is_dtensor
from ..errors import UnsupportedLayerError
from ..own_hooks import OwnHooks

__all__ = ["affine_kind", "AffineRecorder"]


def affine_kind(module: nn.Module) -> str | None:
    """"layer" or "rms" for an element-wise affine norm with trainable weight, else None."""
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() == 0:
        return None
    names = {n for n, _ in module.named_parameters(recurse=False)}
    if not names or not names <= {"weight", "bias"}:
        return None
    if isinstance(module, nn.LayerNorm):
        return "layer"
    if isinstance(module, getattr(nn, "RMSNorm", ())):
        return "rms"
    cls = type(module).__name__
    if "RMSNorm" in cls:
        return "rms"
    if "LayerNorm" in cls:
        return "layer"
    return None


def _eps(module, x):
    for attr in ("eps", "variance_epsilon", "epsilon"):
        value = getattr(module, attr, None)
        if isinstance(value, (int, float)):
            return float(value)
    return float(torch.finfo(x.dtype).eps)


def _normalized(module: nn.Module, kind: str, x: torch.Tensor) -> torch.Tensor:
    """x̂ in float32 (or float64 for float64 inputs)."""
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    x = x.to(dtype)
    shape = getattr(module, "normalized_shape", None)
    if shape is None:
        shape = tuple(module.weight.shape)
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    eps = _eps(module, x)
    if kind == "layer":
        return F.layer_norm(x, shape, eps=eps)
    dims = tuple(range(-len(shape), 0))
    return x * torch.rsqrt(x.pow(2).mean(dims, keepdim=True) + eps)


class AffineRecorder:
    """Records x̂ and d of the given norm modules; sums per-example gradients on demand.

    ``records[k][name]`` holds ``[(x̂, d), ...]`` for forward pass ``k`` (one micro-batch)
    of module ``name``; ``micro_index()`` tells which micro-batch a forward belongs to.
    """

    def __init__(self, modules: dict[str, nn.Module], micro_index):
        self.modules = modules
        self.kinds = {name: affine_kind(m) for name, m in modules.items()}
        self.micro_index = micro_index
        self.records: dict[int, dict[str, list]] = {}
        self._checked: set[str] = set()
        self._handles = OwnHooks()

    def __enter__(self):
        for name, module in self.modules.items():
            self._handles.add(module.register_forward_hook(self._hook(name)))
        return self

    def __exit__(self, *exc):
        self._handles.remove()
        return False

    def clear(self):
        self.records = {}

    def _hook(self, name):
        kind = self.kinds[name]

        def hook(module, args, output):
            if not torch.is_grad_enabled() or not isinstance(output, torch.Tensor) or not output.requires_grad:
                return
            k = self.micro_index()
            slots = self.records.setdefault(k, {}).setdefault(name, [])
            if torch._C._current_graph_task_id() != -1 and any(s[1] is None for s in slots):
                return  # activation checkpointing recomputing this call inside backward
            with torch.no_grad():
                xhat = _normalized(module, kind, args[0].detach())
                if name not in self._checked:
                    self._check(name, module, xhat, output)
            slot = [xhat, None]
            slots.append(slot)

            def grad_hook(g):
                slot[1] = g.detach()
            output.register_hook(grad_hook)
        return hook

    def _check(self, name, module, xhat, output):
        w, b = module.weight, getattr(module, "bias", None)
        if is_dtensor(w) or (b is not None and is_dtensor(b)):
            self._checked.add(name)  # sharded outside its forward (FSDP2): trust the class
            return
        expect = xhat * w.detach().to(xhat.dtype)
        if b is not None:
            expect = expect + b.detach().to(xhat.dtype)
        got = output.detach().to(xhat.dtype)
        tol = 1e-2 if output.dtype in (torch.float16, torch.bfloat16) else 1e-4
        err = (got - expect).norm() / expect.norm().clamp_min(1e-12)
        if not bool(err <= tol):
            raise UnsupportedLayerError(
                f"{type(module).__name__} {name!r} is not y = x̂ ⊙ weight + bias (relative mismatch "
                f"{float(err):.2g}), so its per-example gradients are unknown and a step cannot be "
                "corrected exactly; freeze its parameters (requires_grad=False) or pass "
                "uncovered='ignore'"
            )
        self._checked.add(name)

    def per_example(self, k: int, name: str, n: int) -> dict[str, torch.Tensor]:
        """``{param_name: (n, *param.shape)}`` per-example gradients of micro-batch ``k``."""
        module = self.modules[name]
        wshape = tuple(module.weight.shape)
        slots = self.records.get(k, {}).get(name, [])
        gw, gb = None, None
        for xhat, d in slots:
            if d is None:
                continue  # the output did not reach the loss
            d = d.to(xhat.dtype).reshape(n, -1, *wshape)
            x = xhat.reshape(n, -1, *wshape)
            pw, pb = (d * x).sum(1), d.sum(1)
            gw = pw if gw is None else gw + pw
            gb = pb if gb is None else gb + pb
        if gw is None:
            dtype = torch.float32
            gw = torch.zeros(n, *wshape, dtype=dtype)
            gb = torch.zeros(n, *wshape, dtype=dtype)
        out = {"weight": gw}
        if getattr(module, "bias", None) is not None:
            out["bias"] = gb
        return out
