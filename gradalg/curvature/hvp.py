"""Curvature-vector products over a dataset with ``torch.func``.

``dataset_matvec(task, data, layers, kind)`` returns ``matvec(V) -> H V`` for rows ``V``
(m, dim) in the canonical block coordinates of a gradient space, where

    hessian      H = (1/n) Σ_i ∇²_θ L_i                       (forward-over-reverse)
    gauss_newton H = (1/n) Σ_i J_iᵀ ∇²_f ℓ(f_i) J_i           (jvp, output Hessian, vjp)

Each call is one pass over ``data`` (forward and backward per batch, vectorized over
the m rows with ``vmap`` when the model allows it, looped otherwise; ``vmap``-ed in chunks of
vectors whose activations stay under ``ga.options(products_vmap_elements)`` elements,
:meth:`Products.vmap_chunk`: speed only, each vector's product is computed alone). The Gauss-Newton
product needs ``Task(forward=..., loss_from_outputs=...)``, which
``ga.tasks.classification`` provides.
"""
from __future__ import annotations

import warnings
from typing import Callable

import torch
from torch import nn
from torch.func import functional_call, grad, jvp, vjp, vmap

from ..capture.experts import add_param
from ..capture.hooks import resolve_layers
from ..data import DataRef, batch_size_of, move_batch
from ..eval_mode import eval_mode
from ..errors import NoForwardADError, NonFiniteGradientError, OptionError
from ..finite import check_model, nonfinite_examples
from ..options import get_options
from ..tasks.validation import no_forward_ad

__all__ = ["ParamCoords", "Products", "dataset_matvec"]


class ParamCoords:
    """Rows in a gradient space's canonical coordinates ↔ per-parameter tensors."""

    def __init__(self, model: nn.Module, layers, backend: str = "hooks"):
        self.model = model
        self.refs = resolve_layers(model, list(layers), backend=backend)
        self.backend = backend
        # parameter names as model.named_parameters() gives them (a wrapper's prefix, one
        # name for a tied parameter), per block: {local name in ref.module: full name}
        canonical = {id(p): n for n, p in model.named_parameters()}
        self.local = [{pname: canonical[id(ref.module.get_parameter(pname))] for pname in ref.param_names()}
                      for ref in self.refs]
        self.param_names = list(dict.fromkeys(full for names in self.local for full in names.values()))

    def to_params(self, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        """(m, dim) → {param_name: (m, *shape)}."""
        out, start, m = {}, 0, rows.shape[0]
        for ref, names in zip(self.refs, self.local):
            if self.backend == "func":
                for pname, full in names.items():
                    p = ref.module.get_parameter(pname)
                    out[full] = rows[:, start:start + p.numel()].reshape(m, *p.shape)
                    start += p.numel()
                continue
            out_f, in_f = ref.rule.block_shape(ref.module)
            block = rows[:, start:start + out_f * in_f].reshape(m, out_f, in_f)
            start += out_f * in_f
            for pname, value in ref.rule.to_params(ref.module, block).items():
                add_param(out, names[pname], value)   # a fused experts' blocks add up
        return out

    def from_params(self, params: dict[str, torch.Tensor]) -> torch.Tensor:
        """{param_name: (m, *shape)} → (m, dim)."""
        parts = []
        for ref, names in zip(self.refs, self.local):
            local = {pname: params[full] for pname, full in names.items()}
            if self.backend == "func":
                parts.extend(v.flatten(1) for v in local.values())
            else:
                parts.append(ref.rule.from_params(ref.module, local).flatten(1))
        return torch.cat(parts, dim=1)


class Products:
    """The curvature products of ``kind`` over ``data``, a batch at a time: what one call of
    :func:`dataset_matvec` (and one run of a planned products pass,
    :class:`~gradalg.plan.jobs.products.ProductsJob`) computes per batch.

    ``batch_rows(batch, V, start)`` gives Σ_{i in batch} H_i V, rows (m, dim) in the
    canonical block coordinates (the per-example products summed, not averaged), with the
    finite check naming the batch's examples (``start``: the batch's first position in
    ``data``); H V is the sum over every batch divided by ``data.n``.
    """

    def __init__(self, task, data: DataRef, layers, kind: str = "hessian", backend: str = "hooks"):
        if kind not in ("hessian", "gauss_newton"):
            raise OptionError(f"kind must be 'hessian' or 'gauss_newton', got {kind!r}")
        if kind == "gauss_newton" and (task.forward is None or task.loss_from_outputs is None):
            raise OptionError("Gauss-Newton products need Task(forward=..., loss_from_outputs=...); "
                             "ga.tasks.classification(model) provides both")
        self.task, self.data, self.kind = task, data, kind
        self.model = task.model
        self.coords = ParamCoords(self.model, layers, backend)
        self.device = next(self.model.parameters()).device
        self.check = get_options().check_finite
        self.vmap_elements = get_options().products_vmap_elements
        self.example_elements = None     # activation elements of one example's forward (measured on the first batch)
        if self.check:   # a NaN weight is named here, not a NaN product (or a failed eigensolver) later
            check_model(self.model)

    def batches(self, batch_size: int):
        """``(start, batch)`` of ``data`` on the model's device, in order."""
        start = 0
        for batch in self.data.loader(batch_size):
            batch = move_batch(batch, self.device)
            yield start, batch
            start += batch_size_of(batch)

    def vmap_chunk(self, batch, m: int) -> int | None:
        """Vectors per ``vmap`` call for ``m`` vectors on ``batch``: max(1, ⌊E / (b · a)⌋), E =
        ``ga.options(products_vmap_elements)``, b the batch's examples, a the activation elements
        of one example's forward (every module's tensor outputs, counted once on the first batch);
        None (all m in one call) when that is m or more, or E = 0. Speed only: each vector's
        product is computed alone either way."""
        if not self.vmap_elements or m <= 1:
            return None
        b = batch_size_of(batch)
        if self.example_elements is None:
            self.example_elements = _activation_elements(self.model, lambda: self.task.summed_loss(self.model, batch)) / max(b, 1)
        return vmap_chunk_size(self.vmap_elements, b, self.example_elements, m)

    def batch_rows(self, batch, V: torch.Tensor, start: int) -> torch.Tensor:
        """Σ_{i in batch} H_i V: (m, dim) for V (m, dim), ``vmap``-ed in chunks of :meth:`vmap_chunk` vectors."""
        part = _batch_product(self.task, batch, self.coords.to_params(V), self.coords.param_names, self.kind,
                              self.vmap_chunk(batch, V.shape[0]))
        rows = self.coords.from_params(part)
        if self.check and not bool(torch.isfinite(rows).all()) and bool(torch.isfinite(V).all()):
            _name_examples(batch, self.data.ids[start:start + batch_size_of(batch)], self.kind)
        return rows


def vmap_chunk_size(budget: int, examples: int, per_example: float, m: int) -> int | None:
    """Vectors per ``vmap`` call of the products of ``m`` vectors on a batch of ``examples``
    examples whose forward leaves ``per_example`` activation elements each: max(1, ⌊E / (b · a)⌋),
    E = ``budget`` (``ga.options(products_vmap_elements)``); None (all m in one call) when that is
    m or more, E = 0 or m ≤ 1. The run (:meth:`Products.vmap_chunk`) and the products pass's
    price (:meth:`~gradalg.plan.jobs.products.ProductsJob.vmap_calls`) both count by it."""
    if not budget or m <= 1:
        return None
    chunk = int(budget // max(examples * per_example, 1))
    return None if chunk >= m else max(1, chunk)


def dataset_matvec(task, data: DataRef, layers, *, kind: str = "hessian", batch_size: int = 64,
                   backend: str = "hooks") -> Callable[[torch.Tensor], torch.Tensor]:
    """``matvec(V)`` = H V for the curvature ``kind`` of ``task`` averaged over ``data``
    (one pass over ``data`` per call, outside any plan; a plan runs the same products as a
    planned pass, :class:`~gradalg.plan.jobs.products.ProductsJob`)."""
    products = Products(task, data, layers, kind, backend)

    def matvec(V: torch.Tensor) -> torch.Tensor:
        total = None
        with eval_mode(products.model):
            for start, batch in products.batches(batch_size):
                rows = products.batch_rows(batch, V, start)
                total = rows if total is None else total + rows
        return total / data.n

    matvec.coords = products.coords
    return matvec


def _name_examples(batch, ids, kind: str) -> None:
    """A batch whose products with finite vectors are NaN/inf: raise
    :class:`NonFiniteGradientError` naming its examples with NaN/inf inputs (else all of
    them: their labels or the loss are at fault)."""
    held = nonfinite_examples(batch)
    what = kind.replace("_", "-")
    if held:
        raise NonFiniteGradientError([ids[i] for i in held], [], f"NaN/inf {what}-vector products: NaN/inf in the inputs")
    raise NonFiniteGradientError(
        list(ids), [], f"NaN/inf {what}-vector products of a batch whose inputs are finite",
        "Check these examples' labels and the loss (a log of zero, an empty target, an overflow in "
        "half precision), or compute in float64")


def _activation_elements(model: nn.Module, forward) -> int:
    """Σ numel of the tensor outputs of every leaf module of ``model`` in one call of ``forward``
    (no gradients): the activations a product's tangents ride on, per vector."""
    total = [0]

    def count(_module, _args, out):
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor):
                total[0] += t.numel()
    handles = [m.register_forward_hook(count) for m in model.modules() if next(m.children(), None) is None]
    try:
        with torch.no_grad():
            forward()
    finally:
        for h in handles:
            h.remove()
    return total[0]


def _batch_product(task, batch, V: dict, free_names: list[str], kind: str, chunk: int | None = None) -> dict:
    """Σ_{i in batch} H_i v for each v of ``V`` ({param: (m, *shape)}), by ``vmap`` over the m
    vectors, ``chunk`` of them per call (None: all at once)."""
    model = task.model
    free = {n: model.get_parameter(n).detach() for n in free_names}
    fixed = {n: p.detach() for n, p in model.named_parameters() if n not in free}
    fixed.update(dict(model.named_buffers()))

    def call(fn, params, *args):
        return functional_call(_Call(model, fn), {**{f"model.{k}": v for k, v in params.items()},
                                                  **{f"model.{k}": v for k, v in fixed.items()}}, args)

    if kind == "hessian":
        def product(v):
            g = grad(lambda p: call(task.summed_loss, p, batch))
            return jvp(g, (free,), (v,))[1]
    else:
        def product(v):
            outputs, Jv = jvp(lambda p: call(task.forward, p, batch), (free,), (v,))
            out_grad = grad(lambda o: task.loss_from_outputs(o, batch))
            HJv = jvp(out_grad, (outputs.detach(),), (Jv,))[1]
            _, pullback = vjp(lambda p: call(task.forward, p, batch), free)
            return pullback(HJv)[0]

    try:
        return vmap(product, randomness="different", chunk_size=chunk)(V)
    except Exception as err:  # data-dependent control flow (HF attention masks) defeats vmap
        if no_forward_ad(err):
            raise _no_forward_ad(kind, err) from err
        if not _warned:
            _warned.append(True)
            warnings.warn(f"curvature products fall back to a loop over vectors ({type(err).__name__}: "
                          f"{str(err)[:120]}); results are the same, only slower", RuntimeWarning, stacklevel=2)
    m = next(iter(V.values())).shape[0]
    try:
        rows = [product({k: v[i] for k, v in V.items()}) for i in range(m)]
    except NotImplementedError as err:
        if no_forward_ad(err):
            raise _no_forward_ad(kind, err) from err
        raise
    return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}


def _no_forward_ad(kind: str, err: NotImplementedError) -> NoForwardADError:
    """The error for a model torch.func cannot push a tangent through (``err``)."""
    text = str(err)
    if "autograd.Function" in text:
        op, fix = ("a custom torch.autograd.Function without a jvp staticmethod",
                   "give the Function a jvp staticmethod (with setup_context), ")
    else:
        op = text.split("with ", 1)[-1].split(" that ", 1)[0] if "with " in text else "an operation"
        op += " (on CPU, the fused attention of scaled_dot_product_attention)"
        fix = ("switch a transformers model to eager attention, model.set_attn_implementation('eager') (or load it "
               "with attn_implementation='eager'), ")
    return NoForwardADError(
        f"{kind.replace('_', '-')}-vector products push a tangent through the model (torch.func.jvp, "
        f"forward-mode AD), and torch has no forward-AD rule for {op}, which the model runs. Fix: {fix}"
        "or use a curvature that needs no products: curvature='gauss_newton' (formed from per-example "
        "Jacobians, dense models), 'ekfac' or 'kfac' (built from captured factors)")


_warned: list = []


class _Call(nn.Module):
    """``forward(*args) = fn(model, *args)`` so that functional_call can swap parameters."""

    def __init__(self, model, fn):
        super().__init__()
        self.model = model
        self._fn = fn

    def forward(self, *args):
        return self._fn(self.model, *args)
