"""The device profile: the record of one device's speeds and memory, and how it prices a Cost.

A :class:`DeviceProfile` prices the counts of a :class:`~gradalg.plan.cost.Cost`:

* **GEMMs by shape.** ``gemm_rates`` holds the measured FLOP/s of square float32
  matmuls of a few sizes (16 … 512 here); a GEMM ``(m, k) @ (k, n)`` is priced at the
  rate interpolated (log-log) at its geometric-mean size ``(m·n·k)^(1/3)`` (∝ size below
  the smallest measured one: such products come batched), and never
  faster than moving its three matrices through memory once (an outer product,
  ``k = 1``, is bandwidth-bound). Small GEMMs are several times slower per FLOP than
  large ones on every machine; a single peak rate priced the per-example products of
  capture 5–20× too cheap.
* **Batched GEMMs** (``b`` independent products ``(m, k) @ (k, n)`` in one call: a
  ``torch.bmm``, an einsum over examples): ``bmm_rates`` holds the measured FLOP/s of
  square batched products of a few sizes (4 … 64) in batches large enough that the
  call's fixed cost is amortized; one call is priced at ``bmm_call_seconds`` (an einsum
  over examples of tiny matrices, as gradalg's kernels issue them: its parsing and
  permutes cost several small ops) plus its total FLOPs at the batched rate interpolated at the products' geometric-mean size (the
  single-GEMM rate where that is faster: a large product), never faster than moving its
  matrices once. A single small GEMM's measured rate is mostly its call's fixed cost
  (a (16, 16, 16) product: ~4 µs, about 2 GFLOP/s); pricing each product of a batch at
  it made a pass of per-example products 2–3× too slow.
* **Memory traffic**: copies, casts and materialized rows at ``bandwidth`` bytes/s (a
  copy larger than the last-level cache); a model's elementwise work (activations,
  GELU, norms, products) at ``elementwise_bandwidth`` (a GELU forward and backward and
  a product: transcendental ops run below the copy bandwidth on a CPU); a captured
  batch's working set (the planner's per-example bytes × batch size) is touched fresh
  each batch at ``fault_bandwidth`` (large tensors come from the system page by page).
* **Eigendecompositions** (``torch.linalg.eigh``, float64) by size: ``eigh_times``,
  measured at a few sizes and interpolated log-log (cubic beyond the largest).
* **Fixed costs**: ``call_seconds`` per module forward or backward (a forward hook and
  autograd's bookkeeping per module call), ``op_seconds`` per small tensor operation
  of gradalg's own per-chunk work (dispatch of a torch op), and ``batch_seconds`` +
  ``layer_seconds`` × recorded layers per captured batch (the Python of one capture:
  installing hooks, ``autograd.grad`` over the recorded outputs, building factors).
  ``block_seconds`` per block of gradalg's own per-chunk work, by kind: measured by
  running the kernels a job runs on one block (EK-FAC's rotation, K-FAC's Grams, a score
  block, a Kronecker preconditioner applied and inverted) on tiny blocks, less the
  batched-GEMM calls the cost model prices by shape. A pass over rows in memory is
  mostly these: GPT-2 small's 48 projected blocks cost 30–300 µs each in casts, views and
  small products, where ``op_seconds`` (a chain of ops on 4 × 4 tensors) priced 14 µs.
* **Random numbers**: ``random_seconds`` per float64 normal number drawn by torch's CPU
  generator (a dense projection's matrix is drawn there on every device).
* **Calibration** (nominal on every device, fitted with ``benchmarks/estimates.py``):
  ``elementwise_sweeps``, memory sweeps over a layer's inputs and outputs per forward and
  per backward (nonlinearities, norms, the loss head, saved tensors read back);
  ``ops_per_pass``, small ops per job of a pass over data (sinks, the task's fingerprint,
  hooks, held rows concatenated); ``ops_per_memory_pass``, of a pass over rows in memory
  (LESS's re-reads of two grouped rows: 20–40 µs); ``ops_per_batch``, per captured batch
  (finite checks, ids, chunk records, the allocator's trim). Measured where the profile is
  measured (:mod:`gradalg.devices.measure`), nominal elsewhere (the
  CPU fit below): ``sjlt_bytes``, a sparse-JL product's random access in bytes at the
  elementwise bandwidth, per non-zero and call (its row and sign read, the bin index
  formed) and per non-zero and row (one weighted ``bincount`` step on the CPU, an
  ``index_add_`` on a GPU) — nominal (20, 15), fitted on one CPU thread (2.36 M
  non-zeros, k = 2048: 0.022 s for 2 examples, 0.042 for 8, 0.14 for 32; the old
  4·elem·n bytes at the copy bandwidth gave a tenth of the product's time and TRAK's
  GPT-2-small pass 14× its estimate); ``sjlt_build_randoms``, drawing a sparse-JL table
  (on the CPU, once per process: :mod:`gradalg.proj.sparse_tables`) in float64 normal
  draws per non-zero — nominal 1 (24 ms for 2.36 M non-zeros, ≈ 0.75 draws of 14 ns);
  ``ts_bytes_per_bin``, a TensorSketch's two real FFTs of k and their product per position
  and output bin, in bytes at the elementwise bandwidth (:mod:`gradalg.devices.measure`, the
  runs' kernel) — nominal 100, the old CPU fit; about 18 on this machine's one thread, which
  priced GPT-2's c_fc (3072 × 769, 8 × 64 positions, k = 2048) at 10.0 ms against 11.3 ms
  measured. ``ts_flat_bytes``, a TensorSketch of flat rows (each row of an (out, in) block
  count-sketched, one real FFT of k, times its phase shift, summed: the rows Adam's
  preconditioning makes dense), in bytes at the elementwise bandwidth per row, example and
  bin, and per row and bin (the shift σ_o e^(−2πi h_o f/k), made once per call for every
  example) — :mod:`gradalg.devices.measure`, the runs' kernel at two example counts;
  nominal (100, 30), fitted on this machine's one thread with two cores shared (load ~15). Priced before as half a factored position per row
  (k/2 bins at ``ts_bytes_per_bin``), it was 6–10× below its time (768 × 769, k = 4096:
  110 ms for 4 examples against 18.5 ms), and TrackStar's training pass at GPT-2-small
  widths 1.7–2.7× its estimate (issue 28). **Curvature products** through torch.func (HVP, Gauss-Newton: CG, LiSSA,
  Arnoldi; :mod:`gradalg.plan.jobs.products`) dispatch every op through its ``vmap`` /
  ``jvp`` / ``grad`` levels: ``product_seconds`` = (seconds per batch, per leaf module of
  the model), measured on tiny MLPs (the products job's fit, :func:`gradalg.plan.jobs.products.fit_products`; about 4 ms and
  80–170 µs here, one thread), and ``product_work``, the products' GEMM and elementwise work
  over its price as plain ops, measured on an MLP of width 512 (the same fit;
  about 1.8–1.9 here) — nominal (4 ms, 100 µs) and 2 (this machine's fit; assumed for GPUs).
  Without them a products pass was priced 5–35× below its measured time on small models.
  ``explain()`` shows them all.

Where a profile comes from (measured, cached, nominal): :mod:`gradalg.devices`.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

import torch

__all__ = ["DeviceProfile", "CALIBRATION", "PROFILE_VERSION", "OUTER_K"]

# the cost model's version: a cached profile without every number this one prices is
# measured again (1: matmul, copy and module call; 2: GEMMs by shape, eigh by size,
# per-op and per-batch overheads; 3: medians, elementwise and page-fault bandwidths;
# 4: random numbers; 5: batched GEMMs; 6: fixed costs per block of a job's work; 7: the
# sparse-JL product and table rates; 8: curvature products through torch.func; 9: the
# TensorSketch of flat rows)
PROFILE_VERSION = 9
"""The cost model's version: a cached profile of another version is measured again."""


CALIBRATION = ("elementwise_sweeps", "ops_per_pass", "ops_per_memory_pass", "ops_per_batch", "sjlt_bytes",
               "sjlt_build_randoms", "ts_bytes_per_bin", "ts_flat_bytes", "product_seconds", "product_work")
"""The profile's calibration fields (module docstring), shown by ``explain()``."""

#: GEMMs with a smaller inner dimension k are outer products (see ``gemm_seconds``)
OUTER_K = 8
#: a GEMM's dtype by its element size in bytes (float32 otherwise)
_DTYPE_OF = {8: torch.float64, 2: torch.bfloat16}


def _interp_loglog(table, x: float, high_power: float, low_power: float) -> float:
    """y(x) from ``table`` ((x, y), … increasing x), linear in log-log between points;
    beyond the ends y scales as x**high_power (above) and x**low_power (below)."""
    xs = [p[0] for p in table]
    if x >= xs[-1]:
        return table[-1][1] * (x / xs[-1]) ** high_power
    if x <= xs[0]:
        return table[0][1] * (x / xs[0]) ** low_power
    for (x0, y0), (x1, y1) in zip(table, table[1:]):
        if x0 <= x <= x1:
            w = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
            return math.exp(math.log(y0) + w * (math.log(y1) - math.log(y0)))
    return table[-1][1]


@dataclass(frozen=True)
class DeviceProfile:
    """The speeds and memory of one device (module docstring: what each number prices).

    ``link_bandwidth`` is what one GPU receives per second from its peers (NVLink), used
    for the weights' all-gathers of a sharded run; ``count`` is how many devices of this
    kind a run may use (:func:`profile`, ``count=``): planning is per device, the scale
    estimates (:mod:`gradalg.plan.scale`) split the work over them."""

    name: str
    flops_fp32: float      # sustained matmul FLOP/s in float32 (large GEMMs)
    flops_bf16: float      # sustained matmul FLOP/s in bfloat16 (tensor cores on GPUs)
    bandwidth: float       # bytes/s
    memory: float          # bytes available for tensors
    measured: bool = False
    call_seconds: float = 2e-5   # fixed cost of one module forward or backward (hook, autograd node)
    op_seconds: float = 5e-6     # fixed cost of one small tensor op of gradalg's per-chunk work
    batch_seconds: float = 5e-4  # fixed Python cost of capturing one batch
    layer_seconds: float = 1e-4  # … and per recorded layer of that batch
    elementwise_bandwidth: float = 0.0   # bytes/s of a model's elementwise ops (GELU, products); 0: bandwidth
    fault_bandwidth: float = 0.0   # bytes/s of first touches of fresh memory (page faults); 0: free
    gemm_rates: tuple = ()       # ((size, FLOP/s), …): square float32 GEMMs; () = flops_fp32 for all
    bmm_rates: tuple = ()        # ((size, FLOP/s), …): square float32 batched GEMMs; () = gemm_rates
    bmm_call_seconds: float = 0.0  # fixed cost of one batched-GEMM call (an einsum); 0: op_seconds
    eigh_times: tuple = ()       # ((d, seconds), …): float64 eigh; () = 9 d³ FLOPs at the float64 rate
    random_seconds: float = 3e-8  # one float64 normal number from torch's CPU generator
    block_seconds: tuple = ()    # ((kind, seconds), …): fixed cost per block of gradalg's work; () = ops each
    version: int = PROFILE_VERSION
    link_bandwidth: float = 0.0  # bytes/s one GPU receives from its peers (NVLink); 0: not modelled
    count: int = 1               # devices of this kind a run may use (scale estimates; planning is per device)
    elementwise_sweeps: tuple = (3.0, 4.0)   # (forward, backward) sweeps over a layer's inputs and outputs
    ops_per_pass: float = 800          # small-op equivalents per job of a pass over data
    ops_per_memory_pass: float = 10    # … of a pass over rows in memory
    ops_per_batch: float = 300         # … per captured batch beyond the capture itself
    sjlt_bytes: tuple = (20.0, 15.0)   # sparse-JL product: bytes at the elementwise rate per non-zero (call, row)
    sjlt_build_randoms: float = 1.0    # sparse-JL tables drawn: normal draws per non-zero
    product_seconds: tuple = (4e-3, 1e-4)   # curvature products (torch.func): fixed s per batch, per leaf module
    product_work: float = 2.0          # … their GEMM and elementwise work: × its price as plain ops
    ts_bytes_per_bin: float = 100.0    # TensorSketch: bytes at the elementwise rate per position and bin
    ts_flat_bytes: tuple = (100.0, 30.0)   # … of flat rows: per row, example and bin; per row and bin (its shift)

    def calibration(self) -> str:
        """The calibrated counts (module docstring), one line for plans."""
        forward, backward = self.elementwise_sweeps
        per_call, per_row = self.sjlt_bytes
        per_batch, per_module = self.product_seconds
        return (f"calibration: {forward:g}/{backward:g} elementwise sweeps per forward/backward, "
                f"{self.ops_per_pass:g} ops per job of a pass over data ({self.ops_per_memory_pass:g} in memory), "
                f"{self.ops_per_batch:g} per captured batch, sparse JL {per_call:.3g}/{per_row:.3g} B per "
                f"non-zero and call/row, its tables {self.sjlt_build_randoms:.3g} normal draws per non-zero, "
                f"TensorSketch {self.ts_bytes_per_bin:.3g} B per position and bin "
                f"(flat rows {self.ts_flat_bytes[0]:.3g} B per row, example and bin + {self.ts_flat_bytes[1]:.3g} per row "
                f"and bin), "
                f"curvature products {per_batch * 1e3:.3g} ms per batch + {per_module * 1e6:.3g} µs per module, "
                f"their work ×{self.product_work:.3g}")

    def flops(self, dtype: torch.dtype) -> float:
        """Sustained matmul FLOP/s in ``dtype``: bfloat16 and float16 at ``flops_bf16``,
        float64 at half the float32 rate."""
        if dtype in (torch.bfloat16, torch.float16):
            return self.flops_bf16
        if dtype == torch.float64:
            return self.flops_fp32 / 2
        return self.flops_fp32

    @property
    def _elementwise(self) -> float:
        return self.elementwise_bandwidth or self.bandwidth

    def gemm_seconds(self, m: float, n: float, k: float, elem: int = 4) -> float:
        """One ``(m, k) @ (k, n)`` GEMM in numbers of ``elem`` bytes (8: float64, 2: half)."""
        flops = 2.0 * m * n * k
        if flops <= 0:
            return 0.0
        rate = self.flops(_DTYPE_OF.get(elem, torch.float32))
        if self.gemm_rates:
            size = (m * n * k) ** (1.0 / 3.0)
            # below the smallest measured size the rate falls ∝ size: such products come
            # in batches (one bmm of many small matrices) that share one call's overhead
            rate *= min(1.0, _interp_loglog(self.gemm_rates, size, 0.0, 1.0) / self.flops_fp32)
        return max(flops / rate, elem * (m * k + k * n + m * n) / self._moving(k))

    def _moving(self, k: float) -> float:
        """Bytes/s of moving a product's matrices: an inner dimension below :data:`OUTER_K`
        makes it a batch of outer products, elementwise work priced at the elementwise
        bandwidth rather than a copy's."""
        return self._elementwise if k < OUTER_K else self.bandwidth

    def bmm_seconds(self, b: float, m: float, n: float, k: float, elem: int = 4) -> float:
        """One call of a batched GEMM: ``b`` independent ``(m, k) @ (k, n)`` products.

        ``bmm_call_seconds`` (the call; ``op_seconds`` when not measured) plus the ``b`` products' FLOPs at the batched rate at
        their size ``(m·n·k)^(1/3)`` (``bmm_rates``, log-log; ∝ size below the smallest
        measured, constant above the largest; the single-GEMM rate where that is faster),
        never faster than moving the ``b`` triples of matrices once. Without ``bmm_rates``
        (the presets) the products are priced as ``b`` single GEMMs of that shape."""
        flops = 2.0 * b * m * n * k
        if flops <= 0:
            return 0.0
        if not self.bmm_rates:
            return b * self.gemm_seconds(m, n, k, elem)
        size = (m * n * k) ** (1.0 / 3.0)
        batched = _interp_loglog(self.bmm_rates, size, 0.0, 1.0)
        single = _interp_loglog(self.gemm_rates, size, 0.0, 1.0) if self.gemm_rates else self.flops_fp32
        rate = self.flops(_DTYPE_OF.get(elem, torch.float32)) * min(1.0, max(batched, single) / self.flops_fp32)
        call = self.bmm_call_seconds or self.op_seconds
        return call + max(flops / rate, elem * b * (m * k + k * n + m * n) / self._moving(k))

    def eigh_seconds(self, d: float) -> float:
        """One float64 symmetric eigendecomposition of a (d, d) matrix."""
        if d <= 0:
            return 0.0
        if self.eigh_times:
            return _interp_loglog(self.eigh_times, d, 3.0, 1.0)
        return 9.0 * d ** 3 / self.flops(torch.float64) + self.op_seconds

    def time_of(self, cost, dtype=torch.float32) -> float:
        """Seconds of a :class:`~gradalg.plan.cost.Cost`: its GEMMs by shape, its batched
        GEMMs by shape and batch, its eigendecompositions by size, the remaining FLOPs at the large-GEMM rate, its
        memory traffic, its random numbers, and its fixed costs (module calls, ops,
        batches, layers). Products of one shape are priced once (a 70B model lists thousands)."""
        shaped, gemm_time, gemms, bmms = 0.0, 0.0, {}, {}
        for m, n, k, count, elem in cost.gemms:
            gemms[m, n, k, elem] = gemms.get((m, n, k, elem), 0.0) + count
        for b, m, n, k, count, elem in getattr(cost, "bmms", ()):
            bmms[b, m, n, k, elem] = bmms.get((b, m, n, k, elem), 0.0) + count
        for (m, n, k, elem), count in gemms.items():
            shaped += 2.0 * m * n * k * count
            gemm_time += count * self.gemm_seconds(m, n, k, elem)
        for (b, m, n, k, elem), count in bmms.items():
            shaped += 2.0 * b * m * n * k * count
            gemm_time += count * self.bmm_seconds(b, m, n, k, elem)
        eigh_time = 0.0
        for d, count in cost.eighs:
            shaped += 9.0 * d ** 3 * count
            eigh_time += count * self.eigh_seconds(d)
        rest = max(0.0, cost.flops - shaped)
        faults = cost.faulted / self.fault_bandwidth if self.fault_bandwidth else 0.0
        scatter = cost.scatter * self.sjlt_bytes[0] + cost.scatter_rows * self.sjlt_bytes[1]
        randoms = cost.randoms + cost.sjlt_draws * self.sjlt_build_randoms
        return (gemm_time + eigh_time + rest / self.flops(dtype) + cost.bytes / self.bandwidth
                + (cost.elementwise + scatter) / self._elementwise + faults + randoms * self.random_seconds
                + cost.calls * self.call_seconds + cost.ops * self.op_seconds
                + cost.batches * self.batch_seconds + cost.layer_batches * self.layer_seconds
                + sum(count * self.block_fixed_seconds(kind, ops) for kind, count, ops in getattr(cost, "blocks", ())))

    def block_fixed_seconds(self, kind: str, ops: float = 0.0) -> float:
        """The fixed cost of one block of gradalg's per-block work of ``kind``: measured
        (``block_seconds``), else ``ops`` small ops (``op_seconds`` each). Kind
        ``"products"`` is one batch of curvature products through torch.func whose
        ``ops`` are the model's leaf modules: ``product_seconds`` (per batch, per module);
        ``"tensorsketch"`` one position and output bin of a TensorSketch (its FFTs and
        product): ``ts_bytes_per_bin`` bytes at the elementwise bandwidth; ``"tensorsketch_rows"``
        one row, example and bin of a TensorSketch of flat rows and ``"tensorsketch_shift"``
        one row and bin of its phase shift (``ts_flat_bytes``)."""
        if kind == "products":
            per_batch, per_module = self.product_seconds
            return per_batch + ops * per_module
        if kind == "tensorsketch":
            return self.ts_bytes_per_bin / self._elementwise
        if kind in ("tensorsketch_rows", "tensorsketch_shift"):
            per_row, per_shift = self.ts_flat_bytes
            return (per_row if kind == "tensorsketch_rows" else per_shift) / self._elementwise
        return dict(self.block_seconds).get(kind, ops * self.op_seconds)

    def to_json(self) -> dict:
        """The profile as a JSON-ready dict (the disk cache's entry; :meth:`from_json` reads it)."""
        return asdict(self)

    @classmethod
    def from_json(cls, entry: dict) -> "DeviceProfile":
        """A cached profile; raises ``ValueError`` for one of another cost model's version."""
        if entry.get("version") != PROFILE_VERSION:
            raise ValueError("cached device profile of another cost-model version")
        values = {f.name: entry[f.name] for f in fields(cls) if f.name in entry}
        for key in ("gemm_rates", "bmm_rates", "eigh_times", "block_seconds"):   # JSON lists back to tuples
            values[key] = tuple(tuple(p) for p in values.get(key, ()))
        for key in ("elementwise_sweeps", "sjlt_bytes", "product_seconds", "ts_flat_bytes"):
            if key in values:
                values[key] = tuple(values[key])
        return cls(**values)
