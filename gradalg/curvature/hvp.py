"""Curvature-vector products over a dataset with ``torch.func``.

``dataset_matvec(task, data, layers, kind)`` returns ``matvec(V) -> H V`` for rows ``V``
(m, dim) in the canonical block coordinates of a gradient space, where

    hessian      H = (1/n) Σ_i ∇²_θ L_i                       (forward-over-reverse)
    gauss_newton H = (1/n) Σ_i J_iᵀ ∇²_f ℓ(f_i) J_i           (jvp, output Hessian, vjp)

Each call is one pass over ``data`` (forward and backward per batch). The m rows of a call
go through one ``torch.func.vmap`` (the primal sweeps once per batch, the tangents as GEMMs m
times as tall) or a loop, one product per vector (the primal m times): decided before any
run by :func:`decide_batching` from a probe on the meta device (:func:`probe_batching`: no
weight or example is read; on the first example where meta cannot run the model), or forced by ``ga.options(products_batching)``; never switched at
run time (a model the probe passed and the real batch fails raises
:class:`~gradalg.errors.UnsupportedLayerError` naming the failure and the option). ``vmap``-ed
in chunks of vectors whose activations stay under ``ga.options(products_vmap_elements)``
elements (:meth:`Products.vmap_chunk`: speed only, each vector's product is computed alone). The Gauss-Newton
product needs ``Task(forward=..., loss_from_outputs=...)``, which
``ga.tasks.classification`` provides.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace
from typing import Callable

import torch
from torch import nn
from torch.func import functional_call, grad, jvp, vjp, vmap
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

from ..capture.experts import add_param
from ..capture.hooks import resolve_layers
from .held import HeldBytes
from ..data import DataRef, batch_size_of, meta_batch, move_batch
from ..eval_mode import eval_mode
from ..errors import NoForwardADError, NonFiniteGradientError, OptionError, UnsupportedLayerError
from ..finite import check_model, nonfinite_examples
from ..fingerprint import code_digest, is_meta_model, model_structure
from ..options import get_options
from ..tasks.validation import no_forward_ad

__all__ = ["ParamCoords", "Products", "dataset_matvec", "BatchingProbe", "probe_batching", "decide_batching",
           "held_per_example"]


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

    def __init__(self, task, data: DataRef, layers, kind: str = "hessian", backend: str = "hooks",
                 batching: str | None = None):
        check_kind(task, kind)
        self.task, self.data, self.kind = task, data, kind
        self.model = task.model
        self.coords = ParamCoords(self.model, layers, backend)
        # "vmap" or "loop" as planned (ProductsJob.batching), else decided here as a plan would
        self.batching = batching or decide_batching(task, data.first_example_batch(), self.coords.param_names, kind)[0]
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
        None (all m in one call) when that is m or more, or E = 0, or the products loop. Speed only:
        each vector's product is computed alone either way."""
        if not self.vmap_elements or m <= 1 or self.batching == "loop":
            return None
        b = batch_size_of(batch)
        if self.example_elements is None:
            self.example_elements = _activation_elements(self.model, lambda: self.task.summed_loss(self.model, batch)) / max(b, 1)
        return vmap_chunk_size(self.vmap_elements, b, self.example_elements, m)

    def batch_rows(self, batch, V: torch.Tensor, start: int) -> torch.Tensor:
        """Σ_{i in batch} H_i V: (m, dim) for V (m, dim), ``vmap``-ed in chunks of :meth:`vmap_chunk` vectors
        (or a vector at a time: :attr:`batching` ``"loop"``); computed and returned in the parameters'
        dtype whatever V's (:func:`_batch_product`: a formation's float64 columns give float32 rows
        on a float32 model, which :class:`~gradalg.expr.curvature.Formed` converts to float64)."""
        part = _batch_product(self.task, batch, self.coords.to_params(V), self.coords.param_names, self.kind,
                              self.vmap_chunk(batch, V.shape[0]), self.batching)
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


def _product(task, batch, free: dict, fixed: dict, kind: str):
    """``product(v)`` = Σ_{i in batch} H_i v for one vector ``v`` ({param: tensor}, the ``free``
    parameters' shapes), the other parameters and buffers ``fixed``: forward-over-reverse for the
    Hessian, jvp / output Hessian / vjp for the Gauss-Newton."""
    model = task.model

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
    return product


def _split(model, free_names, as_tensor=lambda t: t.detach()) -> tuple[dict, dict]:
    """``(free, fixed)``: the parameters named ``free_names``, and every other parameter and
    buffer, each through ``as_tensor``."""
    free = {n: as_tensor(model.get_parameter(n)) for n in free_names}
    fixed = {n: as_tensor(p) for n, p in model.named_parameters() if n not in free}
    fixed.update({n: as_tensor(b) for n, b in model.named_buffers()})
    return free, fixed


def _batch_product(task, batch, V: dict, free_names: list[str], kind: str, chunk: int | None = None,
                   batching: str = "vmap") -> dict:
    """Σ_{i in batch} H_i v for each v of ``V`` ({param: (m, *shape)}): by ``vmap`` over the m
    vectors, ``chunk`` of them per call (None: all at once), or one vector at a time
    (``batching="loop"``), as the plan decided (:func:`decide_batching`). Each tangent is cast to
    its parameter's dtype (a formation's float64 identity columns on a float32 model: torch cast
    them on some paths, the loop's, and on others failed: ``vmap`` of a bias-free ``F.linear``,
    "expected scalar type Double but found Float"); each product comes back in its parameter's dtype."""
    free, fixed = _split(task.model, free_names)
    product = _product(task, batch, free, fixed, kind)
    V = {k: v.to(free[k].dtype) for k, v in V.items()}
    try:
        if batching == "vmap":
            try:
                return vmap(product, randomness="different", chunk_size=chunk)(V)
            except Exception as err:
                if no_forward_ad(err) or isinstance(err, (MemoryError, torch.OutOfMemoryError)):
                    raise           # no forward-mode rule (below), or out of memory: not vmap's failure
                product({k: v[0] for k, v in V.items()})   # a failure of the model itself raises here, as it is
                raise _no_vmap(kind, err) from err
        rows = [product({k: v[i] for k, v in V.items()}) for i in range(next(iter(V.values())).shape[0])]
    except NotImplementedError as err:
        if no_forward_ad(err):
            raise _no_forward_ad(kind, err) from err
        raise
    return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}


@dataclass(frozen=True)
class BatchingProbe:
    """What :func:`probe_batching` found: ``batching`` ``"vmap"`` (``vmap`` of the products of 2
    vectors ran), ``"loop"`` (the product of one vector ran, its ``vmap`` did not: ``error``), or
    None, undecided (not even one vector's product ran: ``error``). ``where``: ``"meta"`` (shapes
    only) or ``"first example"`` (the real weights and the data's first example, tried where the
    meta device could not run the model; ``meta_error`` says why)."""

    batching: str | None
    error: str = ""
    where: str = "meta"
    meta_error: str = ""


def _try_batching(product, free: dict, where: str) -> BatchingProbe:
    """``vmap`` of ``product`` over 2 vectors of ``free``'s shapes; where that fails, one vector's
    product alone, which tells a failure of ``vmap`` (``"loop"``) from one of the model itself on
    this device (undecided)."""
    try:
        vmap(product, randomness="different")({k: v.expand(2, *v.shape) for k, v in free.items()})
        return BatchingProbe("vmap", where=where)
    except Exception as err:  # noqa: BLE001 - the probe's answer; told from the device's own failures below
        batched = _root(err)
    try:
        product(free)
    except Exception as err:  # noqa: BLE001 - this device cannot run one product: undecided here
        return BatchingProbe(None, _named(_root(err)), where=where)
    return BatchingProbe("loop", _named(batched), where=where)


def probe_batching(task, batch, free_names, kind: str) -> BatchingProbe:
    """Whether ``torch.func.vmap`` batches the ``kind`` products of ``task``'s model over vectors.

    First on the meta device (shapes only: no weight or example value is read, nothing is
    computed): every parameter and buffer and the one-example ``batch`` as meta tensors, the
    products of 2 vectors of the parameters ``free_names`` through ``vmap`` (what a run does, at
    m = 2), and where that fails the product of one vector alone, which tells a failure of
    ``vmap`` (an op without a batching rule that cannot fall back, a custom autograd.Function
    without a vmap rule, an in-place write of a batched tensor into an unbatched one) from one of
    the meta device. ``torch.tensor(data, device="meta")`` (a Hugging Face cache's empty tensors)
    is made on the CPU and its shape put on meta, which torch.func does not allow inside its
    transforms otherwise.

    Where the meta device cannot run the model (a branch on a tensor's value, a ``.item()``: a
    Hugging Face attention mask's builder), the same two tries run for real on the model's own
    device, weights and the one-example ``batch`` (in eval mode, as the run): 2 products of one
    example, the cost of a few forward and backward passes of it. A model whose weights are on
    the meta device stays undecided."""
    free, fixed = _split(task.model, free_names, lambda t: torch.empty_like(t, device="meta"))
    with _MetaFactories():
        meta = _try_batching(_product(task, meta_batch(batch), free, fixed, kind), free, "meta")
    if meta.batching is not None or is_meta_model(task.model):
        return meta
    free, fixed = _split(task.model, free_names)
    device = next((t.device for t in free.values()), torch.device("cpu"))
    with eval_mode(task.model):
        real = _try_batching(_product(task, move_batch(batch, device), free, fixed, kind), free, "first example")
    return replace(real, meta_error=meta.error)


def held_per_example(task, batch, free_names, kind: str = "hessian") -> float | None:
    """Bytes per example that one vector's ``kind`` product holds at its peak, for the primal
    and for the vector alike (half the total): the product of one vector run twice on the meta
    device (shapes only), on the one-example ``batch`` and on it twice over, every op's outputs
    tracked until freed (:class:`~gradalg.curvature.held.HeldBytes`), the difference of the two
    peaks halved. The difference leaves out what does not grow with the batch (the gradient, its
    tangent, anything shaped like the parameters). Forward-over-reverse holds, per example, the
    forward's saved tensors and the backward's temporaries once for the primal and once per
    vector of a ``vmap`` call (their tangents): the products job prices ``held · (1 + c)``
    (:meth:`~gradalg.plan.jobs.products.ProductsJob.per_example_bytes`). None where the meta
    device cannot run the product (or its peak does not grow with the batch). Memoised as the
    probe is (:func:`_probe_key`: the architecture, not the weights; at most 256 kept)."""
    key = _probe_key(task, batch, free_names, kind)
    if key not in _HELD:
        if len(_HELD) >= 256:
            _HELD.pop(next(iter(_HELD)))
        _HELD[key] = _held_per_example(task, batch, free_names, kind)
    return _HELD[key]


#: {:func:`_probe_key`: bytes or None}: :func:`held_per_example`'s measurements (at most 256 kept)
_HELD: dict = {}


def _held_per_example(task, batch, free_names, kind: str) -> float | None:
    """:func:`held_per_example`, measured."""
    free, fixed = _split(task.model, free_names, lambda t: torch.empty_like(t, device="meta"))
    vector, peaks = {k: torch.empty_like(t) for k, t in free.items()}, []
    try:
        for copies in (1, 2):
            meta = tree_map(lambda t: torch.cat([t] * copies) if isinstance(t, torch.Tensor) and t.dim() else t,
                            meta_batch(batch))
            known = [*free.values(), *fixed.values(), *vector.values(), *tree_flatten(meta)[0]]
            with eval_mode(task.model), _MetaFactories(), HeldBytes(known, saved=False) as held:
                _product(task, meta, free, fixed, kind)(vector)
            peaks.append(held.peak)
    except Exception:  # noqa: BLE001 - the meta device cannot run it: the caller's fallback
        return None
    return (peaks[1] - peaks[0]) / 2 if peaks[1] > peaks[0] else None


def check_kind(task, kind: str) -> None:
    """Refuse a ``kind`` of products the task cannot give (before a plan probes or a run starts)."""
    if kind not in ("hessian", "gauss_newton"):
        raise OptionError(f"kind must be 'hessian' or 'gauss_newton', got {kind!r}")
    if kind == "gauss_newton" and (task.forward is None or task.loss_from_outputs is None):
        raise OptionError("Gauss-Newton products need Task(forward=..., loss_from_outputs=...); "
                          "ga.tasks.classification(model) provides both")


def decide_batching(task, batch, free_names, kind: str, forced: str | None = None) -> tuple[str, BatchingProbe | None]:
    """``(batching, probe)``: ``forced`` (default ``ga.options(products_batching)``) where it is
    ``"vmap"`` or ``"loop"`` (no probe), else the probe's (:func:`probe_batching`, memoised by the
    model's architecture: :func:`_probe_key`), the loop where it is undecided (the safe side: a
    loop is never slower than priced)."""
    check_kind(task, kind)     # else the probe's TypeError would read as "undecided"
    forced = get_options().products_batching if forced is None else forced
    if forced != "auto":
        return forced, None
    key = _probe_key(task, batch, free_names, kind)
    if key not in _PROBES:
        if len(_PROBES) >= 256:
            _PROBES.pop(next(iter(_PROBES)))
        _PROBES[key] = probe_batching(task, batch, free_names, kind)
    return _PROBES[key].batching or "loop", _PROBES[key]


#: {:func:`_probe_key`: :class:`BatchingProbe`}: :func:`decide_batching`'s probes (at most 256 kept)
_PROBES: dict = {}


def _probe_key(task, batch, free_names, kind: str) -> tuple:
    """What :func:`probe_batching` depends on, without any weight's or example's value (the
    model's architecture fingerprint): the model's structure
    (:func:`~gradalg.fingerprint.model_structure`: modules, parameter and buffer shapes and
    dtypes), its train/eval mode and a transformers config's attention implementation, the code of
    the task's functions, ``kind``, the free parameters, and the meta batch's layout, shapes and
    dtypes. The same model after an optimizer step is not probed again (measured: one probe takes
    0.06 s for an MLP, 0.8 s for a two-layer transformer, 4 s for GPT-2 small at T = 128, on a
    loaded CPU)."""
    model = task.model
    leaves, spec = tree_flatten(meta_batch(batch))
    code = tuple(code_digest(f.__code__) if hasattr(f, "__code__") else type(f).__qualname__
                 for f in (task.loss, task.forward, task.loss_from_outputs))
    structure = hashlib.blake2b("\n".join(model_structure(model)).encode(), digest_size=16).hexdigest()
    attention = getattr(getattr(model, "config", None), "_attn_implementation", None)
    return (structure, model.training, str(attention), code, kind, tuple(free_names), str(spec),
            tuple((tuple(x.shape), str(x.dtype)) if isinstance(x, torch.Tensor) else repr(x) for x in leaves))


class _MetaFactories(TorchFunctionMode):
    """``torch.tensor(data, device="meta")`` as an empty meta tensor of its shape and dtype (made on
    the CPU): torch.func refuses the in-place ``detach_`` that the meta path of ``torch.tensor`` runs."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.tensor and str(kwargs.get("device", "")) == "meta":
            return torch.empty_like(torch.tensor(*args, **{**kwargs, "device": "cpu"}), device="meta")
        return func(*args, **kwargs)


def _root(err: BaseException) -> BaseException:
    """The innermost cause of ``err`` (a task's :class:`~gradalg.errors.BatchContentError` wraps
    the model's own error)."""
    while err.__cause__ is not None:
        err = err.__cause__
    return err


def _named(err: BaseException) -> str:
    """``"Class: first line of the message"`` (at most 160 characters of it)."""
    first = (str(err).strip().splitlines() or [""])[0]
    return f"{type(err).__name__}: {first[:160]}"


def _no_vmap(kind: str, err: BaseException) -> UnsupportedLayerError:
    """The error for a model whose real batch ``vmap`` fails though the plan chose ``vmap`` (its
    meta probe ran, or ``ga.options(products_batching='vmap')`` forced it) and one vector's
    product runs."""
    return UnsupportedLayerError(
        f"{kind.replace('_', '-')}-vector products were planned through torch.func.vmap over the vectors "
        f"(ga.options(products_batching={get_options().products_batching!r}): "
        + ("forced" if get_options().products_batching == "vmap" else "the meta-device probe ran")
        + f"), but vmap fails on the model's real batch while one vector's product runs: {_named(_root(err))}. "
        "Fix: ga.options(products_batching='loop') (each vector's product alone; the plan prices m calls of "
        "one vector), or give the failing operation a batching rule (a custom autograd.Function: a vmap "
        "staticmethod or generate_vmap_rule=True)")


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


class _Call(nn.Module):
    """``forward(*args) = fn(model, *args)`` so that functional_call can swap parameters."""

    def __init__(self, model, fn):
        super().__init__()
        self.model = model
        self._fn = fn

    def forward(self, *args):
        return self._fn(self.model, *args)
