"""The products job: products with the loss curvature (Hessian or Gauss-Newton, known only
through them: :class:`~gradalg.expr.curvature.CurvatureProducts`) as a planned pass over raw
batches of the curvature data, with its accumulator.

The operator says so with ``Statistic("products", H, None)``: each product of H
with a batch of vectors V (m, dim) reads every batch of H's data once, a forward and the
product's backward(s), and an iterative solver above H (CG, LiSSA: :class:`~gradalg.expr.Inverse`;
Arnoldi: :class:`~gradalg.expr.curvature.Arnoldi`) asks for one product per iteration, at
most its iteration bound; the statistic's ``groups`` of calls
(:class:`~gradalg.expr.operators.ProductCalls`) say how many calls of how many vectors (a
near-minimum probe's one-vector calls, then a formation's 256-vector ones: two groups). The
decide stage plans them as a :class:`ProductsJob` in a pass of its own (key
:class:`~gradalg.plan.passkeys.ProductsPassKey`: H's token, task name, n, calls), priced per
group as one call of its vectors times its bound, which ``explain()`` shows. How a call's m vectors run is decided
there too, before any run (a ``PRODUCTS_BATCHING`` decision): one ``torch.func.vmap`` over them where a
probe runs it (:func:`~gradalg.curvature.hvp.probe_batching`: on the meta device, or on the first
example where the meta device cannot run the model), else a loop of one
product per vector, priced as m calls of one vector (:meth:`ProductsJob.vmap_calls`); the run
follows it. When the plan runs, the pass reads nothing: it
publishes a :class:`ProductPass`, the matvec the solver calls, and each call runs the pass
(every batch, a :class:`ProductSums` accumulating the per-batch products), timed into the
pass's measured seconds (``explain(analyze=True)``: seconds over every call, and the calls).

class        reads                                   produces
ProductsJob  raw batches of H's data, once per call  V ↦ H V (a matvec), for the solver
"""
from __future__ import annotations

import operator
import time
import weakref
from dataclasses import dataclass, replace
from functools import reduce
from types import SimpleNamespace
from typing import ClassVar

import torch

from ...curvature.hvp import BatchingProbe, ParamCoords, Products, decide_batching, held_per_example, vmap_chunk_size
from ...eval_mode import eval_mode
from ...data import as_data
from ...devices import DeviceProfile
from ...devices.measure import FITS, warm_timer
from ...tasks import classification
from ...options import get_options
from ..cost import Cost, _si, bmm_cost, data_tokens_hint, gemm_cost
from ..decisions import Decision, DecisionKind, DecisionSource
from ..estimates import leaf_modules
from ..passkeys import ProductsPassKey
from ..rules import PlanError
from ..shapes import _layers, _measure_on_meta, activation_bytes, attention_shape, element_size, weight_layers
from .base import Job

__all__ = ["ProductsJob", "ProductSums", "ProductPass", "PRODUCT_SWEEPS", "FIXED_SCALE", "ATTENTION_MODULES", "product_work",
           "product_fixed", "weighed"]

#: per kind of product, ``(primal, tangent)``: forward-equivalents of GEMM work per batch
#: (one forward of a weight layer = one GEMM (B·T, out, in); its backward = two, the input
#: and the weight gradient), the primal once per batch, the tangent once per vector.
#: By the product rule, the tangent of a bilinear op y = W x is Ẇ x + W ẋ: two GEMMs.
#:
#: ``hessian`` (forward-over-reverse, ``jvp(grad(loss))``): primal forward + backward = 3;
#: tangent of the forward (2) and of the backward's two GEMMs (2 × 2) = 6.
#: ``gauss_newton`` (``jvp`` of the outputs, the output Hessian, ``vjp``): primal two
#: forwards (the jvp's and the vjp's) = 2; tangent of the forward (2) and the vjp's
#: backward (2) = 4. (Under ``vmap`` the primal runs once for the m vectors; the loop the plan
#: decides for a model ``vmap`` cannot batch runs it per vector: :attr:`ProductsJob.batching`.)
PRODUCT_SWEEPS = {"hessian": (3, 6), "gauss_newton": (2, 4)}

#: {products target's token: (activation elements of one example's forward, positions per weight
#: layer, held bytes, input shapes), or None} (:meth:`ProductsJob._measured`: one meta forward
#: each, and a Hessian's two meta products; at most 256 kept)
_ACTIVATIONS: dict = {}


def _memo(table: dict, key, find):
    """``table[key]``, found by ``find()`` the first time (at most 256 kept, the oldest dropped)."""
    if key not in table:
        if len(table) >= 256:
            table.pop(next(iter(table)))
        table[key] = find()
    return table[key]


#: forward-equivalents of the fixed cost (:func:`product_fixed`) per kind, relative to the
#: Gauss-Newton product the device profile measures (``product_seconds``): the primal and
#: tangent sweeps of :data:`PRODUCT_SWEEPS`, ``(3 + 6) / (2 + 4)`` for the Hessian (measured
#: on MLPs of 2 to 16 layers, one CPU thread: 1.3–1.6× the Gauss-Newton's fixed cost)
FIXED_SCALE = {kind: sum(sweeps) / sum(PRODUCT_SWEEPS["gauss_newton"]) for kind, sweeps in PRODUCT_SWEEPS.items()}


#: one attention layer's fixed cost in leaf modules' (:func:`product_fixed`): its functional ops
#: outside leaf modules (heads split and merged, scores, mask, softmax) each dispatched
#: through every torch.func level. Measured with Gauss-Newton products of GPT-2 (eager
#: attention, width 64, T = 16, one CPU thread): 4 layers cost 29 ms per batch more than 1,
#: 9.6 ms a layer, about 118 leaf modules' worth at the 81 µs measured per module, less the
#: layer's 10 leaf modules counted already.
ATTENTION_MODULES = 110


def product_work(model, B: int, T: int, m: int, kind: str, dim: int, elem: int, positions=None, unfolds=()) -> Cost:
    """The work of one batch of products, as plain ops would do it: B examples of T
    positions, m vectors, each weight layer ``(in, out)``
    (:func:`~gradalg.plan.shapes.weight_layers`) at its P positions per example
    (``positions``, one per weight layer in that order: a convolution's output pixels,
    measured by :meth:`ProductsJob.layer_positions`; None: P = T for every layer)
    ``primal`` GEMMs (B·P, out, in) and ``tangent`` GEMMs (m·B·P, out, in)
    (:data:`PRODUCT_SWEEPS`: ``vmap`` runs each tangent GEMM once for the m vectors, one GEMM
    m times as tall, not m small ones; the same FLOPs), each GEMM of a layer whose kernel unfolds
    (``unfolds``, per weight layer: :meth:`ProductsJob.layer_unfolds`, a CPU float64 convolution's
    im2col) writing and reading its columns (in, P) per example: 2·in·P·elem bytes of elementwise
    traffic; attention (a transformer config) two
    batched (T, T, d_head) products per forward-equivalent (the tangents' m·B·heads of them);
    elementwise traffic the activations once per forward-equivalent
    (:func:`~gradalg.plan.shapes.activation_bytes` at T, plus ``activation_numbers``·(P − T)·elem
    bytes per example for a weight layer at P ≠ T positions); the sum of the products
    (m, dim): V to parameters, back, and the running sum (5·m·dim numbers).
    Under torch.func this work takes the device profile's ``product_work`` times as long
    (tangent formulas of every elementwise op, transposed copies: :func:`weighed`)."""
    primal, tangent = PRODUCT_SWEEPS[kind]
    cost = Cost()
    layers = weight_layers(model)
    positions = [T] * len(layers) if positions is None else list(positions)
    if len(positions) != len(layers):
        raise PlanError(f"product_work: {len(positions)} positions for {len(layers)} weight layers (a planner bug: "
                        "report it)")
    unfolds = tuple(unfolds) + (False,) * (len(layers) - len(unfolds))
    for (n_in, n_out), P in zip(layers, positions):      # vmap: each tangent GEMM one of m·B·P rows
        cost = cost + gemm_cost(B * P, n_out, n_in, primal, elem) + gemm_cost(m * B * P, n_out, n_in, tangent, elem)
    columns = 2.0 * elem * sum(n_in * P for (n_in, _), P, u in zip(layers, positions, unfolds) if u)
    layers, width, heads = attention_shape(model)
    if layers and T > 1:
        d_head = max(1, width // heads)
        cost = (cost + bmm_cost(B * heads, T, T, d_head, 2 * layers * primal, elem)
                + bmm_cost(m * B * heads, T, T, d_head, 2 * layers * tangent, elem))
    per_example = activation_bytes(model, T, elem)
    if any(P != T for P in positions):     # a weight layer at P positions, not T: its activations P/T times
        per_example += float(sum(rule.activation_numbers(layer) * (P - T)  # its numbers per position
                                 for (layer, rule), P in zip(_weight_modules(model), positions))) * elem
    cost = cost + Cost(elementwise=per_example * B * (primal + tangent * m), bytes=columns * B * (primal + tangent * m))
    return cost + Cost(bytes=5.0 * elem * m * dim)


def _weight_modules(model) -> list:
    """``(module, rule)`` of every weight layer (:func:`~gradalg.plan.shapes.weight_layers`'s, in its order)."""
    return [(m, rule) for m, rule in _layers(model) if rule.weight_gemm(m) is not None]


def weighed(work: Cost, factor: float) -> Cost:
    """``work`` priced ``factor`` times over: its GEMMs, batched GEMMs, elementwise and
    memory traffic counted ``factor`` times, its FLOPs unchanged (they are the products'
    arithmetic, which ``explain()`` shows)."""
    return replace(work.scaled(factor), flops=work.flops)


def product_fixed(model, kind: str, batches: int) -> Cost:
    """torch.func's fixed cost of ``batches`` batches of products: per batch, the
    functional call, ``vmap`` / ``jvp`` / ``grad`` set up and the rows to parameters and
    back, plus every leaf module's dispatched ops (``leaf_modules``; an attention layer
    counts :data:`ATTENTION_MODULES` more), in the Gauss-Newton product's units
    (:data:`FIXED_SCALE`), priced by the device profile's measured ``product_seconds`` (a
    block of kind ``"products"`` whose ``ops`` are the modules;
    :meth:`~gradalg.devices.DeviceProfile.block_fixed_seconds`)."""
    modules = leaf_modules(model) + ATTENTION_MODULES * attention_shape(model)[0]
    return Cost(blocks=(("products", float(batches) * FIXED_SCALE[kind], float(modules)),))


_FREE_NAMES = weakref.WeakKeyDictionary()


def free_names(node) -> list[str]:
    """The parameters ``node``'s products differentiate (its ``layers``: :class:`ParamCoords`), found once
    per node: the batching probe and the meta measurement share them (``expr`` may not import ``curvature``)."""
    if node not in _FREE_NAMES:
        _FREE_NAMES[node] = ParamCoords(node.task.model, node.layers).param_names
    return _FREE_NAMES[node]


@dataclass(eq=False, frozen=True)
class ProductsJob(Job):
    """The products of ``target`` (a :class:`~gradalg.expr.curvature.CurvatureProducts`) in
    ``groups`` of calls ``((calls, vectors, why), ...)``: ``calls`` calls at most of ``vectors``
    rows each (``why``: the setting that bounds them; a near-minimum probe's one-vector calls and
    a formation's 256-vector ones are two groups, :class:`~gradalg.expr.operators.ProductCalls`),
    each call a pass over its data in batches of ``batch`` (``ga.options(batch_size)``, as the
    products always read it), each group priced at its own vectors (:meth:`stream_cost`).
    ``streams`` is empty: it reads raw batches, not gradient rows."""

    kind: ClassVar[str] = "products"
    phase: ClassVar[str] = "statistics"
    ops_per_block: ClassVar[int] = 0

    groups: tuple[tuple[int, int, str], ...] = ((1, 1, ""),)
    batch: int = 64
    #: how a call's m vectors run: ``"vmap"`` (one torch.func.vmap over them, in chunks) or ``"loop"``
    #: (one product per vector); ``probe``: the meta probe that decided it (None: forced by
    #: ``ga.options(products_batching)``)
    batching: str = "vmap"
    probe: BatchingProbe | None = None
    #: bytes per number of the vectors its calls are passed (the most of its groups' ``dtype``: a formation's
    #: float64 columns; 0: the parameters', :meth:`_elem`), what :meth:`fixed_bytes` holds of V
    vector_elem: int = 0
    #: bytes its caller keeps beside each call (the most of its groups' ``held``: a formation's d × d
    #: float64 rows, 8·d²), in :meth:`fixed_bytes`
    beside: float = 0.0

    @classmethod
    def for_statistic(cls, statistic, deps: set, options=None, vectors: int | None = None) -> "ProductsJob":
        """The job of a ``"products"`` statistic: its groups of calls
        (:class:`~gradalg.expr.operators.ProductCalls`), each on its vectors (the group's, else
        ``vectors``: the rows the operator is applied to, else one), and how their vectors run
        (:func:`~gradalg.curvature.hvp.decide_batching`: ``ga.options(products_batching)``, else the
        meta probe on the first example's shapes); ``vector_elem`` the most of its groups' vectors' dtypes."""
        made = [g for g in statistic.groups if g.calls > 0]
        groups = tuple((max(1, int(g.calls)), int(g.vectors or vectors or 1), g.why) for g in made) or \
            ((1, int(vectors or 1), ""),)
        t = statistic.node
        batching, probe = decide_batching(t.task, t.data.first_example_batch(), free_names(t), t.kind,
                                          (options or get_options()).products_batching)
        return cls(t, (), set(deps), groups=groups, batch=options.batch_size if options is not None else 64,
                   batching=batching, probe=probe,
                   vector_elem=max((element_size(g.dtype) for g in made if g.dtype), default=0),
                   beside=max((g.held for g in made), default=0.0))

    def first_decisions(self, options) -> list:
        """The batching of the vectors (``PRODUCTS_BATCHING``): the chosen one, both alternatives with
        their FLOPs and torch.func calls over the bound on the calls, and why (the probe's error class)."""
        t, fix = self.target, "ga.options(products_batching='vmap' or 'loop') forces one"
        alternatives = {}
        for way in ("vmap", "loop"):
            job = replace(self, batching=way)
            dtype = next((p.dtype for p in t.task.model.parameters()), torch.float32)
            flops = sum(job.call_cost(dtype, None, m).flops * calls for calls, m, _ in self.groups)
            funcs = sum(calls * count * k for calls, m, _ in self.groups
                        for _, count, sizes in job.vmap_calls(m) for _, k in sizes)
            alternatives[way] = (f"~{_si(flops)}FLOP in {funcs:,} torch.func calls"
                                 + (" (the primal sweeps once per vector)" if way == "loop" else ""))
        probe = self.probe
        if probe is None:
            return [Decision(DecisionKind.PRODUCTS_BATCHING, t.token, self.batching, alternatives, self.memory_source(),
                             label=t.label, source=DecisionSource.OPTIONS, setting=f"products_batching={self.batching!r}")]
        on = ("a probe on the meta device (no weight or example read)" if probe.where == "meta" else
              f"a probe on the first example with the real weights (the meta device cannot run the model: "
              f"{probe.meta_error})")
        if probe.batching == "vmap":
            why = f"{on} ran torch.func.vmap over the products of 2 vectors: each call's vectors go through vmap together"
        elif probe.batching == "loop":
            why = (f"{on} ran one vector's product but not vmap over 2 ({probe.error}): "
                   "each vector's product runs alone, priced as m calls of one vector")
        else:
            why = (f"undecided: {on} could not run one vector's product ({probe.error}), so whether vmap "
                   "batches the model is not known; the loop is priced and run (the safe side)")
        return [Decision(DecisionKind.PRODUCTS_BATCHING, t.token, self.batching, alternatives,
                         f"{why}; {fix}; {self.memory_source()}", label=t.label)]

    @property
    def calls(self) -> int:
        """Every group's calls: the bound on the pass's calls."""
        return sum(c for c, _, _ in self.groups)

    @property
    def calls_why(self) -> str:
        """The groups' settings, `` + ``-joined."""
        return " + ".join(why for _, _, why in self.groups if why)

    @property
    def vectors(self) -> int:
        """The most vectors of a call (what its memory holds)."""
        return max(m for _, m, _ in self.groups)

    def pass_key(self) -> ProductsPassKey:
        """Its own pass: :class:`~gradalg.plan.passkeys.ProductsPassKey` (H's token, task name, n, calls)."""
        t = self.target
        return ProductsPassKey(t.token, t.task.name, t.data.n, self.calls)

    def describe(self) -> str:
        t = self.target
        if len(self.groups) == 1:
            [(calls, m, why)] = self.groups
            bound = f"up to {calls:,} calls" + (f" ({why})" if why else "")
            return (f"{t.label}: {m:,} vector(s) per call over {len(t.layers)} layer(s){self._vmap_note(m)}, "
                    f"{bound}, each one pass")
        parts = " + ".join(f"up to {calls:,} calls of {m:,} vector(s){self._vmap_note(m)}" + (f" ({why})" if why else "")
                           for calls, m, why in self.groups)
        return (f"{t.label}: over {len(t.layers)} layer(s), up to {self.calls:,} calls in {len(self.groups)} groups, "
                f"each one pass, each group priced at its vectors: {parts}")

    def _vmap_note(self, m: int | None = None) -> str:
        """How the m vectors of a call (default: :attr:`vectors`) go through ``vmap``: whole, or the
        chunks :meth:`vmap_calls` counts."""
        m = self.vectors if m is None else m
        vmap = get_options().products_vmap_elements
        if m <= 1:
            return ""
        if self.batching == "loop":
            return f", looped: {m:,} calls of one vector per batch (not vmapped: the plan's PRODUCTS_BATCHING)"
        if not vmap:
            return ", vmapped whole (ga.options(products_vmap_elements=0))"
        a = self.example_activations()
        if a is None:
            return (f", vmapped whole in the estimate (chunks of ga.options(products_vmap_elements={vmap:,}) "
                    "activation elements not known: the model does not run on the meta device)")
        groups = self.vmap_calls(m)
        per_call = sum(count * sum(k for _, k in sizes) for _, count, sizes in groups)
        b, _, sizes = groups[0]
        if per_call == sum(count for _, count, _ in groups):
            return (f", vmapped whole ({a:,.0f} activation elements per example × {b:,} × {m:,} vectors "
                    f"within ga.options(products_vmap_elements={vmap:,}))")
        return (f", vmapped in chunks of {sizes[0][0]:,} vectors ({sum(k for _, k in sizes):,} per batch of {b:,}: "
                f"{a:,.0f} activation elements per example, ga.options(products_vmap_elements={vmap:,})), "
                f"{per_call:,} vmap calls per call")

    def example_activations(self) -> float | None:
        """Activation elements of one example's forward (every leaf module's tensor outputs, what
        the run counts on its first batch, :meth:`~gradalg.curvature.hvp.Products.vmap_chunk`), from
        one meta-device forward of the first example, as the plan's facts measure a source's
        (:class:`~gradalg.plan.shapes.ForwardShapes` ``activations``); None where the model cannot
        run on meta (:meth:`_measured`)."""
        return None if (measured := self._measured()) is None else measured[0]

    def layer_positions(self) -> tuple[int, ...] | None:
        """Positions per example of each weight layer of the model (in
        :func:`~gradalg.plan.shapes.weight_layers`' order): the rows its GEMM multiplies, a
        convolution's output pixels (H_out·W_out), T for a Linear on T tokens
        (:meth:`~gradalg.capture.layers.LayerRule.positions` of its output), from the same meta
        forward as :meth:`example_activations`; T where a layer did not run in it; None where
        the model cannot run on meta (every layer priced at T)."""
        return None if (measured := self._measured()) is None else measured[1]

    def held_bytes(self) -> tuple[tuple[int, int, int] | None, float | None] | None:
        """``(saved, product)`` per example, in bytes, from the same meta forward as
        :meth:`example_activations`: ``saved`` = ``(plain, dual, working)``, what autograd saves for the
        backward of the function the products differentiate (the loss for the Hessian, the outputs
        for the Gauss-Newton's ``vjp``), without and with a tangent, and the most bytes alive at
        once beside it (:class:`~gradalg.curvature.held.HeldBytes`; None where that forward does not
        run with gradients on meta); ``product``: a Hessian target's one-vector product's own peak on
        meta per example and vector (:func:`~gradalg.curvature.hvp.held_per_example`; None for the
        Gauss-Newton, or where meta cannot run it). None where the model cannot run on meta."""
        return None if (measured := self._measured()) is None else measured[2]

    def memory_source(self) -> str:
        """What :meth:`per_example_bytes` is measured from, as the ``PRODUCTS_BATCHING`` decision says
        it: the Hessian product's own peak on meta, autograd's saved tensors and the forward's working
        set, or the named fallback (today's rule where meta cannot run the model)."""
        saved, product = self.held_bytes() or (None, None)
        if product:
            return f"memory: one vector's Hessian product on the meta device holds {_si(product)}B per example and vector"
        return ("memory: autograd's saved tensors and the forward's working set, measured on the meta device"
                if saved is not None else
                "memory: fallback, activation_bytes (the forward does not run with gradients on the meta device)")

    def layer_unfolds(self, b: int) -> tuple[bool, ...]:
        """Per weight layer (:func:`~gradalg.plan.shapes.weight_layers`' order), whether its kernel
        on a batch of ``b`` examples unfolds its input (:meth:`~gradalg.capture.layers.LayerRule.unfolds`:
        torch's own choice of convolution kernel, at the input shape the meta forward saw); all
        False where the model cannot run on meta."""
        measured = self._measured()
        return () if measured is None else tuple(
            shape is not None and rule.unfolds(m, shape, b) for (m, rule), shape in zip(_weight_modules(
                self.target.task.model), measured[3]))

    def _measured(self):
        """``(activations, positions, (saved, product), input shapes)`` of one meta forward of the first example
        (:meth:`example_activations`, :meth:`layer_positions`, :meth:`held_bytes`; a Hessian's two meta products), or None.
        Memoised by the target's token (at most 256 kept)."""
        t = self.target
        return _memo(_ACTIVATIONS, t.token, lambda: _meta_measure(t))


    def vmap_calls(self, m: int | None = None) -> tuple[tuple[int, int, tuple[tuple[int, int], ...]], ...]:
        """One call's batches and their ``vmap`` calls: ``((b, batches, ((vectors, vmap calls), ...)), ...)``
        for the full batches of ``batch`` examples and the last, smaller one; each batch's m rows
        (default :attr:`vectors`, a group's) go through ``vmap`` in chunks of
        :func:`~gradalg.curvature.hvp.vmap_chunk_size` (E = ``ga.options(products_vmap_elements)``, b,
        :meth:`example_activations`), the run's rule: ⌈m / c⌉ calls, the last one with the rest (one
        call of m where unchunked or not known); where the vectors loop (:attr:`batching`), m calls of one."""
        n, m = self.target.data.n, self.vectors if m is None else m
        B = self.target.data.largest_batch(self.batch)   # the data's own batch where it fixes one
        full, rest = divmod(n, B)
        a, E = self.example_activations(), get_options().products_vmap_elements
        out = []
        for b, count in ((B, full), (rest, 1)):
            if not (b and count):
                continue
            c = 1 if self.batching == "loop" else vmap_chunk_size(E, b, a, m) if a is not None else None
            if c is None:
                sizes = ((m, 1),)
            else:
                k, r = divmod(m, c)
                sizes = tuple(x for x in ((c, k), (r, 1)) if x[0] and x[1])
            out.append((b, count, sizes))
        return tuple(out)

    # ------------------------------------------------------------------ cost
    def stream_cost(self, n_stream, chunk, facts, layout_of, storage_of=None, options=None, resolved=None) -> Cost:
        """Per group of ``groups``, its ``calls`` × one call of its m vectors (:meth:`call_cost`;
        one group: that call × ``calls``, as before groups): per batch of b examples (``batch``, the
        last one the rest) of T positions, per ``vmap`` call of c of the m vectors (:meth:`vmap_calls`: c = m unless
        ``ga.options(products_vmap_elements)`` chunks them), each weight layer ``(in, out)``
        (:func:`~gradalg.plan.shapes.weight_layers`) at its P positions per example (:meth:`layer_positions`:
        a convolution's output pixels, T for a Linear) runs ``primal`` GEMMs (b·P, out, in) and ``tangent``
        GEMMs (c·b·P, out, in), ``vmap`` batching the c vectors into one (:data:`PRODUCT_SWEEPS`); attention (a transformer config) two batched (T, T, d_head)
        products per forward-equivalent; elementwise traffic the activations
        (:func:`~gradalg.plan.shapes.activation_bytes`) once per forward-equivalent; the sum of
        the products (c, dim) read and written (:func:`product_work`, weighed by the device's
        measured ``product_work``); and torch.func's fixed cost per ``vmap`` call (:func:`product_fixed`)."""
        device = getattr(facts, "device", None)
        return reduce(operator.add, (self.call_cost(facts.dtype, device, m).scaled(calls) for calls, m, _ in self.groups))

    def call_cost(self, dtype, device=None, vectors: int | None = None) -> Cost:
        """One call of ``vectors`` rows (default :attr:`vectors`, the most of a group's): one pass
        over the data (:meth:`stream_cost`), each batch's ``vmap`` calls
        (:meth:`vmap_calls`: a chunk of c vectors repeats the primal sweeps, :func:`product_work`
        of c vectors on the batch's b examples) weighed by ``device``'s measured ``product_work``
        (at its plain price without a device), and torch.func's fixed costs per ``vmap`` call
        (:func:`product_fixed`), which a profile prices by its ``product_seconds``."""
        t, elem = self.target, element_size(dtype)
        model, T = t.task.model, data_tokens_hint(t.data)
        work, calls, positions = Cost(), 0, self.layer_positions()
        for b, count, sizes in self.vmap_calls(vectors):
            unfolds = self.layer_unfolds(b)        # torch's kernel choice per batch size, not per chunk
            for c, k in sizes:
                work = work + product_work(model, b, T, c, t.kind, t.space.dim, elem, positions,
                                           unfolds).scaled(count * k)
                calls += count * k
        factor = device.product_work if device is not None else 1.0
        return weighed(work, factor) + product_fixed(model, t.kind, calls)

    # ------------------------------------------------------------------ memory
    def _elem(self, facts) -> int:
        """Bytes per number of the products: the model's parameters' dtype (the products run in
        it), else the plan's (``facts.elem``: an expression of the operator alone reads no source's)."""
        dtype = next((p.dtype for p in self.target.task.model.parameters()), None)
        return element_size(dtype) if dtype is not None else facts.elem

    def fixed_bytes(self, facts) -> float:
        """m·dim·(4·elem + v) (m the most vectors of a call): at once, at the parameters' elem bytes a
        number (:meth:`_elem`: the products run in it) the vectors V, the running sum, and a batch's
        products twice: per parameter as ``vmap`` returns them and as rows in block coordinates
        (:meth:`~gradalg.curvature.hvp.ParamCoords.from_params`, a concatenation; then the new sum
        beside the old one and the rows); and where the caller passes V in another dtype (v =
        :attr:`vector_elem` ≠ elem: a formation's float64 identity columns on a float32 model), V itself
        at v beside its copy cast to the parameters' (:func:`~gradalg.curvature.hvp._batch_product`).
        Before, 3·m·dim·elem: an MLP's products, whose parameters outweigh its activations, held 1.2×
        the estimate; before session 49, 4·m·dim·elem whatever V's dtype: a float32 MLP's formation
        held 5·m·dim·4 bytes beside a batch of one (``benchmarks/products_conv.py --formation``). Plus
        what the caller keeps beside each call (:attr:`beside`: a formation's rows, 8·dim², live while
        the products run, whichever pass resolves the formed matrix; before session 49 in no estimate)."""
        elem = self._elem(facts)
        return self.beside + self.vectors * self.target.space.dim * (
            4.0 * elem + (self.vector_elem if self.vector_elem != elem else 0))

    def per_example_bytes(self, facts) -> float:
        """What one example holds at a products call's peak, for the primal and each of the c
        vectors of the largest ``vmap`` chunk a call makes (:meth:`vmap_calls` over every group:
        the chunk, not the call's m vectors, is what is live at once), in bytes measured on the meta
        device (:meth:`held_bytes`):

            hessian        H · (1 + c)              H: what one vector's product holds per example,
                                                    for the primal and for the vector alike (the
                                                    forward's saved tensors and the backward's
                                                    temporaries, and their tangents)
            gauss_newton   P + D + W · (1 + c)      the vjp's saved forward (P plain, D needing the
                                                    gradient), the forward's working set W for the
                                                    primal and, in forward mode, per vector

        A Hessian whose product meta cannot run: P + (D + W) · (1 + c) (each saved tensor that
        needs the gradient carries a tangent per vector). Where the forward does not run with
        gradients on meta (:meth:`memory_source` names it): the weight layers' activations once for
        the primal and once per vector (:func:`~gradalg.plan.shapes.activation_bytes`, a lower
        bound: today's rule). Measured with torch.profiler's memory events on one batch of 32
        (``benchmarks/products_conv.py``): 0.93–1.3× what the run holds on a tiny GPT-2, a tiny
        Llama, an MLP and the conv nets, 1.4–1.5× for one-vector Gauss-Newton calls on the conv nets
        and a conv net's Hessian whose first layer alone is free."""
        t = self.target
        saved, product = self.held_bytes() or (None, None)
        if saved is None and not product:
            return activation_bytes(t.task.model, data_tokens_hint(t.data), self._elem(facts)) * (1 + self.vectors)
        c = max((c for _, m, _ in self.groups for _, _, sizes in self.vmap_calls(m) for c, _ in sizes), default=1)
        if product:
            return product * (1 + c)
        plain, dual, W = saved
        return plain + (dual + W) * (1 + c) if t.kind == "hessian" else plain + dual + W * (1 + c)

    def output_bytes(self, n: int) -> float:
        return 8.0 * self.vectors * self.target.space.dim

    # ------------------------------------------------------------------ running
    def accumulator(self, ctx) -> "ProductsOpened":
        return ProductsOpened(self, ctx)

    def publish(self, result, state) -> None:
        state.results[self.key] = result


def _meta_measure(t):
    """:meth:`ProductsJob._measured` of the products target ``t``, measured."""
    handles, inputs = [], {}

    def hook(module, args, out):
        if args and isinstance(args[0], torch.Tensor):
            inputs.setdefault(id(module), tuple(args[0].shape[1:]))
    try:
        model = t.task.model
        modules = _weight_modules(model)
        handles = [m.register_forward_hook(hook) for m, _ in modules]
        refs = [SimpleNamespace(name=str(i), module=m, rule=rule) for i, (m, rule) in enumerate(modules)]
        batch, free, T = t.data.first_example_batch(), free_names(t), data_tokens_hint(t.data)
        fn = t.task.summed_loss if t.kind == "hessian" else t.task.forward    # what grad / vjp differentiate
        seen, activations, saved = _measure_on_meta(t.task, batch, refs, fn, free)
        product = held_per_example(t.task, batch, free) if t.kind == "hessian" else None
        return (float(activations), tuple(int(seen.get(str(i), T)) for i in range(len(modules))),
                (saved, product), tuple(inputs.get(id(m)) for m, _ in modules))
    except Exception:  # noqa: BLE001 - a hint: a model meta cannot run is priced unchunked, at T
        return None
    finally:
        for h in handles:
            h.remove()


class ProductSums:
    """One call's accumulator: ``update(rows)`` adds a batch's Σ_i H_i V (m, dim);
    ``finish()`` is H V = the sum / n. ``export`` / ``absorb``: the partial sum of a shard."""

    def __init__(self, n: int):
        self.n, self.total = n, None

    def update(self, rows: torch.Tensor) -> None:
        self.total = rows if self.total is None else self.total + rows

    def export(self):
        return self.total

    def absorb(self, part) -> None:
        if part is not None:
            self.update(part)

    def finish(self) -> torch.Tensor:
        return self.total / self.n


class ProductsOpened:
    """The products pass as the runner opens it when the plan runs: it is fed nothing then
    (its batches are read on each call); ``finish()`` gives the :class:`ProductPass`."""

    def __init__(self, job: ProductsJob, ctx):
        self.job, self.ctx = job, ctx

    def update(self, *chunks) -> None:
        raise PlanError(f"{self.job.describe()} reads its own batches on each call; a pass fed it chunks "
                        "(a planner bug: report it)")

    def export(self):
        return None

    def absorb(self, part) -> None:
        """Nothing: the pass is never sharded (its calls come from the solver here)."""

    def finish(self) -> "ProductPass":
        return ProductPass(self.job, self.ctx)


class ProductPass:
    """``V (m, dim) ↦ H V (m, dim)``: each call one run of the products pass of ``job`` (every
    batch of its data, the per-batch products summed by a :class:`ProductSums`). Each call's
    seconds (wall and this process's CPU) are added to its pass's measured entry
    (``ctx.pass_stats``, the entry whose ``key`` is the pass's), with the number of calls.
    It holds the executor ``ctx`` weakly: the run state keeps it (``publish``), so a strong
    reference closed a cycle with the run state in it, freed only by the cyclic GC; a call
    made once the executor is gone (an operator kept beyond it) is not recorded."""

    def __init__(self, job: ProductsJob, ctx):
        t = job.target
        self.job, self.ctx = job, weakref.ref(ctx)
        self.products = Products(t.task, t.data, t.layers, t.kind, batching=job.batching)
        self.coords = self.products.coords
        self.calls = 0

    def __call__(self, V: torch.Tensor) -> torch.Tensor:
        start, cpu = time.perf_counter(), time.process_time()
        sums = ProductSums(self.job.target.data.n)
        with eval_mode(self.products.model):
            for first, batch in self.products.batches(self.job.batch):
                sums.update(self.products.batch_rows(batch, V, first))
        self.calls += 1
        self._record(time.perf_counter() - start, time.process_time() - cpu)
        return sums.finish()

    def _record(self, seconds: float, cpu_seconds: float) -> None:
        key = self.job.pass_key()
        for entry in reversed(getattr(self.ctx(), "pass_stats", [])):
            if entry.get("key") == key:
                entry["seconds"] += seconds
                if "cpu_seconds" in entry:
                    entry["cpu_seconds"] += cpu_seconds
                entry["calls"] = entry.get("calls", 0) + 1
                return


# ------------------------------------------------------------------ calibration on a measured device
def fit_products(prof: DeviceProfile, timed=None, device="cpu") -> DeviceProfile:
    """``prof`` with its curvature products measured (``product_seconds``,
    :func:`_measure_products_fixed`) and this job's price of their work fitted to their time
    (``product_work``, :func:`_measure_product_work`): a calibration of the planner's cost
    model, registered in :data:`gradalg.devices.measure.FITS`, which every measured profile
    applies (the device package cannot import the planner)."""
    timed = timed or warm_timer()
    fixed = _measure_products_fixed(timed, device)
    return replace(prof, product_seconds=fixed,
                   product_work=_measure_product_work(replace(prof, product_seconds=fixed), timed, device))


#: the products timed by :func:`_measure_products_fixed`: Gauss-Newton products of one vector
#: through MLPs of ``PRODUCT_DEPTHS`` Linear(4, 4) + Tanh layers on 2 examples (their
#: arithmetic negligible); by :func:`_measure_product_work`, through one of
#: ``PRODUCT_WORK_SHAPE`` = (width, depth, batch), whose GEMMs and elementwise work dominate
PRODUCT_DEPTHS, PRODUCT_WORK_SHAPE = (2, 6), (512, 2, 128)


def _product_batch(width: int, depth: int, n: int, device="cpu"):
    """``(run one batch of Gauss-Newton products, the model, its batch size, its dim)``:
    the package's own products (:class:`gradalg.curvature.hvp.Products`, the runs' code)
    through an MLP of ``depth`` Linear(width, width) + Tanh layers and a Linear(width, 4)
    head, classification with cross-entropy, on ``n`` random examples."""
    g = torch.Generator().manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.Tanh()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(width, 4)).to(device).eval()
    X, y = torch.randn(n, width, generator=g).to(device), torch.randint(0, 4, (n,), generator=g).to(device)
    products = Products(classification(model), as_data((X, y)), [str(i) for i in range(0, 2 * depth + 1, 2)],
                        "gauss_newton", batching="vmap")
    _, batch = next(products.batches(n))
    dim = sum(p.numel() for p in model.parameters())
    V = torch.randn(1, dim, generator=g).to(device)
    return (lambda: products.batch_rows(batch, V, 0)), model, n, dim


def _measure_products_fixed(timed=None, device="cpu", seconds: float = 0.15) -> tuple:
    """``(seconds per batch, per leaf module)`` of Gauss-Newton products through torch.func
    when their arithmetic is negligible: one batch through tiny MLPs of 2 and 6 layers
    (:data:`PRODUCT_DEPTHS`; 5 and 13 leaf modules), the difference per module."""
    timed = timed or warm_timer()
    times = {}
    for depth in PRODUCT_DEPTHS:
        run, model, _, _ = _product_batch(4, depth, 2, device)
        times[leaf_modules(model)] = timed(run, seconds)
    (few, t_few), (many, t_many) = sorted(times.items())
    per_module = max((t_many - t_few) / (many - few), 1e-7)
    return max(t_few - few * per_module, 1e-6), per_module


def _measure_product_work(prof: DeviceProfile, timed=None, device="cpu", seconds: float = 0.2) -> float:
    """The products' work through torch.func over its price as plain ops: one batch of
    Gauss-Newton products through an MLP of :data:`PRODUCT_WORK_SHAPE`, less its fixed cost
    (``prof.product_seconds``), over :func:`~gradalg.plan.jobs.products.product_work`
    priced by ``prof``."""
    timed = timed or warm_timer()
    width, depth, n = PRODUCT_WORK_SHAPE
    run, model, n, dim = _product_batch(width, depth, n, device)
    measured = timed(run, seconds) - prof.block_fixed_seconds("products", leaf_modules(model))
    priced = prof.time_of(product_work(model, n, 1, 1, "gauss_newton", dim, 4))
    return max(measured / max(priced, 1e-9), 0.1)


FITS.append(fit_products)
