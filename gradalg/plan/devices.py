"""Device speeds for the cost model: measured once per machine, or taken from a table.

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
  measured (:func:`_measure_sjlt`, :func:`_measure_sjlt_build`), nominal elsewhere (the
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
  and output bin, in bytes at the elementwise bandwidth (:func:`_measure_tensorsketch`, the
  runs' kernel) — nominal 100, the old CPU fit; about 18 on this machine's one thread, which
  priced GPT-2's c_fc (3072 × 769, 8 × 64 positions, k = 2048) at 10.0 ms against 11.3 ms
  measured. ``ts_flat_bytes``, a TensorSketch of flat rows (each row of an (out, in) block
  count-sketched, one real FFT of k, times its phase shift, summed: the rows Adam's
  preconditioning makes dense), in bytes at the elementwise bandwidth per row, example and
  bin, and per row and bin (the shift σ_o e^(−2πi h_o f/k), made once per call for every
  example) — :func:`_measure_tensorsketch_flat`, the runs' kernel at two example counts;
  nominal (100, 30), fitted on this machine's one thread with two cores shared (load ~15). Priced before as half a factored position per row
  (k/2 bins at ``ts_bytes_per_bin``), it was 6–10× below its time (768 × 769, k = 4096:
  110 ms for 4 examples against 18.5 ms), and TrackStar's training pass at GPT-2-small
  widths 1.7–2.7× its estimate (issue 28). **Curvature products** through torch.func (HVP, Gauss-Newton: CG, LiSSA,
  Arnoldi; :mod:`gradalg.plan.jobs.products`) dispatch every op through its ``vmap`` /
  ``jvp`` / ``grad`` levels: ``product_seconds`` = (seconds per batch, per leaf module of
  the model), measured on tiny MLPs (:func:`_measure_products_fixed`; about 4 ms and
  80–170 µs here, one thread), and ``product_work``, the products' GEMM and elementwise work
  over its price as plain ops, measured on an MLP of width 512 (:func:`_measure_product_work`;
  about 1.8–1.9 here) — nominal (4 ms, 100 µs) and 2 (this machine's fit; assumed for GPUs).
  Without them a products pass was priced 5–35× below its measured time on small models.
  ``explain()`` shows them all.

``local_profile()`` measures this machine's CPU the first time (about three seconds;
medians of repeated runs in process CPU time, so that other processes competing for
the cores are not cached as this machine's speed) and caches the numbers in
``~/.cache/gradalg/devices.json`` (override the folder with ``GRADALG_CACHE``), keyed
by host, architecture, torch version, thread count and :data:`PROFILE_VERSION` (an
entry of another cost model is measured again, and left alone for the gradalg that
wrote it).
A model on a CUDA device is priced with that device's profile (``profile("cuda:0")``,
:mod:`gradalg.plan.accelerators`): measured there once and cached in the same file, or
the nominal preset of its name. GPU profiles for planning runs you have not started yet
come from ``PRESETS``: numbers from NVIDIA's spec sheets (not measured by gradalg) times
stated sustained fractions, see :data:`PRESETS`. ``profile("h200", count=4)`` asks for four of them: ``explain()`` then
gives (or refuses, with the arithmetic) the time and memory per GPU of a data-parallel
run with sharded weights (:mod:`gradalg.plan.scale`). Displays never
measure: :func:`cached_local_profile` (or ``profile(measure=False)``) returns the cached
numbers or :data:`UNMEASURED_CPU`.
"""
from __future__ import annotations

import json
import math
import os
import platform
import time
from dataclasses import asdict, dataclass, fields, replace

import torch
from pathlib import Path

from ..errors import OptionError

__all__ = ["DeviceProfile", "CALIBRATION", "PRESETS", "PROFILE_VERSION", "UNMEASURED_CPU", "cached_local_profile",
           "local_profile", "profile", "read_cached", "write_cached"]

#: the cost model's version: a cached profile without every number this one prices is
#: measured again (1: matmul, copy and module call; 2: GEMMs by shape, eigh by size,
#: per-op and per-batch overheads; 3: medians, elementwise and page-fault bandwidths;
#: 4: random numbers; 5: batched GEMMs; 6: fixed costs per block of a job's work; 7: the
#: sparse-JL product and table rates; 8: curvature products through torch.func; 9: the
#: TensorSketch of flat rows)
PROFILE_VERSION = 9


#: the profile's calibration fields (module docstring), shown by ``explain()``
CALIBRATION = ("elementwise_sweeps", "ops_per_pass", "ops_per_memory_pass", "ops_per_batch", "sjlt_bytes",
               "sjlt_build_randoms", "ts_bytes_per_bin", "ts_flat_bytes", "product_seconds", "product_work")

#: GEMMs with a smaller inner dimension k are outer products (see ``gemm_seconds``)
OUTER_K = 8


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
        dtype = {8: torch.float64, 2: torch.bfloat16}.get(elem, torch.float32)
        rate = self.flops(dtype)
        if self.gemm_rates:
            size = (m * n * k) ** (1.0 / 3.0)
            # below the smallest measured size the rate falls ∝ size: such products come
            # in batches (one bmm of many small matrices) that share one call's overhead
            rate *= min(1.0, _interp_loglog(self.gemm_rates, size, 0.0, 1.0) / self.flops_fp32)
        # an inner dimension below OUTER_K makes the product a batch of outer products:
        # elementwise work, priced at the elementwise bandwidth rather than a copy's
        moving = (self.elementwise_bandwidth or self.bandwidth) if k < OUTER_K else self.bandwidth
        return max(flops / rate, elem * (m * k + k * n + m * n) / moving)

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
        dtype = {8: torch.float64, 2: torch.bfloat16}.get(elem, torch.float32)
        size = (m * n * k) ** (1.0 / 3.0)
        batched = _interp_loglog(self.bmm_rates, size, 0.0, 1.0)
        single = _interp_loglog(self.gemm_rates, size, 0.0, 1.0) if self.gemm_rates else self.flops_fp32
        rate = self.flops(dtype) * min(1.0, max(batched, single) / self.flops_fp32)
        moving = (self.elementwise_bandwidth or self.bandwidth) if k < OUTER_K else self.bandwidth
        call = self.bmm_call_seconds or self.op_seconds
        return call + max(flops / rate, elem * b * (m * k + k * n + m * n) / moving)

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


_EFF = 0.6        # sustained fraction of a spec-sheet peak FLOP rate (assumed, not measured)
_BW_EFF = 0.8     # sustained fraction of a spec-sheet memory or link bandwidth (assumed)
_MEM_EFF = 0.9    # fraction of the memory left for tensors (CUDA context, allocator slack; assumed)
# curvature products through torch.func on a GPU: their fixed costs are the host's dispatch
# (this machine's CPU fit) and their work the CPU's measured multiple, both nominal (assumed,
# not measured on a GPU): a measured GPU profile (accelerators) measures them there
_GPU_FIXED = dict(call_seconds=1e-5, op_seconds=1e-5, batch_seconds=5e-4, layer_seconds=5e-5,
                  product_seconds=(4e-3, 1e-4), product_work=2.0)
PRESETS = {
    # Spec-sheet numbers of the SXM parts (NVIDIA data sheets; dense, i.e. without the 2:4
    # sparsity that doubles the headline tensor-core numbers), none measured by gradalg:
    #   H200: FP32 67 TFLOP/s (no tensor cores: torch's default for float32 matmuls),
    #         BF16 tensor core 989 TFLOP/s, HBM3e 141 GB at 4.8 TB/s, NVLink 900 GB/s
    #         (both directions: 450 GB/s received per GPU)
    #   H100: FP32 67, BF16 989 TFLOP/s, HBM3 80 GB at 3.35 TB/s, NVLink 900 GB/s
    #   A100: FP32 19.5, BF16 312 TFLOP/s, HBM2e 80 GB at 2.0 TB/s, NVLink 600 GB/s
    # times the sustained fractions above; a module call, an op: a few kernel launches of
    # ~5 µs, asynchronous once the queue is full (assumed)
    "h200": DeviceProfile("H200", 67e12 * _EFF, 989e12 * _EFF, 4.8e12 * _BW_EFF, 141e9 * _MEM_EFF,
                          link_bandwidth=450e9 * _BW_EFF, **_GPU_FIXED),
    "h100": DeviceProfile("H100", 67e12 * _EFF, 989e12 * _EFF, 3.35e12 * _BW_EFF, 80e9 * _MEM_EFF,
                          link_bandwidth=450e9 * _BW_EFF, **_GPU_FIXED),
    "a100": DeviceProfile("A100", 19.5e12 * _EFF, 312e12 * _EFF, 2.0e12 * _BW_EFF, 80e9 * _MEM_EFF,
                          link_bandwidth=300e9 * _BW_EFF, **_GPU_FIXED),
}


def _cache_file() -> Path:
    root = Path(os.environ.get("GRADALG_CACHE", Path.home() / ".cache" / "gradalg"))
    return root / "devices.json"


def _key() -> str:
    # the cost model's version is part of the key: processes running another version of
    # gradalg on the same machine keep their own entry instead of overwriting this one
    return (f"{platform.node()}|{platform.machine()}|torch{torch.__version__}|threads{torch.get_num_threads()}"
            f"|cost-model{PROFILE_VERSION}")


def _fastest(fn, seconds: float, least: int = 3, sync=None) -> float:
    """The typical time of one call of ``fn``: the median over ``seconds`` of repetitions
    (at least ``least``). With one thread the time is this process's CPU time, which does
    not count the waits for a core that other processes of a busy machine cause; the
    median, not the fastest, because a pass runs at the sustained speed, not the best.
    ``sync`` (a device's synchronize, :mod:`gradalg.plan.accelerators`) is called after
    each call, and the time is then the wall time."""
    clock = time.process_time if sync is None and torch.get_num_threads() == 1 else time.perf_counter
    times, start = [], time.perf_counter()
    while time.perf_counter() - start < seconds or len(times) < least:
        t = clock()
        fn()
        if sync is not None:
            sync()
        times.append(clock() - t)
    times.sort()
    return max(times[len(times) // 2], 1e-9)


def _warm_fastest(fn, seconds: float, least: int = 3) -> float:
    """:func:`_fastest` after one call (warm-up); accelerators pass their synchronized timer."""
    fn()
    return _fastest(fn, seconds, least)


def physical_memory() -> float:
    """The machine's physical memory in bytes (inf where the platform does not say)."""
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return float("inf")


def host_memory() -> float:
    """Bytes of this machine's memory for tensors: 80 % of it (8 GB when unknown)."""
    memory = physical_memory()
    return 0.8 * memory if memory < float("inf") else 8e9


#: square GEMM sizes and eigh sizes measured on the CPU (about 0.5 s and 0.4 s); the fixed
#: costs, page faults and elementwise work get 0.15–0.3 s windows each: medians of shorter
#: windows varied 2–3× between runs a few minutes apart on a loaded shared machine
#: (call_seconds 17 vs 45 µs, fault bandwidth 3.0 vs 1.4 GB/s)
GEMM_SIZES = (16, 64, 256, 512)
#: square batched-GEMM sizes, each in a batch of about 2²⁰ multiply-adds (at least 8
#: products), so that the call's fixed cost is a few per cent of it (about 0.3 s in all)
BMM_SIZES = (4, 8, 16, 32, 64)
EIGH_SIZES = (32, 128, 384)


def _measure_gemms(sizes=GEMM_SIZES, timed=_warm_fastest, device="cpu", seconds: float = 0.12,
                   dtype=torch.float32) -> tuple:
    """``((n, FLOP/s), …)`` of square (n, n) GEMMs."""
    rates = []
    for n in sizes:
        a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
        rates.append((n, 2.0 * n ** 3 / timed(lambda: a @ b, seconds)))
    return tuple(rates)


def _measure_bmms(sizes=BMM_SIZES, timed=_warm_fastest, device="cpu", seconds: float = 0.06,
                  elements: int = 2**20) -> tuple:
    """``((n, FLOP/s), …)`` of batched square products, ``elements`` multiply-adds a call."""
    rates = []
    for n in sizes:
        b = max(8, elements // n ** 3)
        x, y = torch.randn(b, n, n, device=device), torch.randn(b, n, n, device=device)
        rates.append((n, 2.0 * b * n ** 3 / timed(lambda: torch.bmm(x, y), seconds)))
    return tuple(rates)


def _measure_bmm_call(timed=_warm_fastest, device="cpu", seconds: float = 0.1) -> float:
    """Seconds of one batched-GEMM call when the arithmetic is negligible: the einsum
    over examples that materializes per-example gradients (``capture.factors``), on
    tiny (2, 4, 4) factors."""
    d, a = torch.randn(2, 4, 4, device=device), torch.randn(2, 4, 4, device=device)
    return timed(lambda: torch.einsum("nto,nti->noi", d, a), seconds)


def _measure_eighs(sizes=EIGH_SIZES, timed=_warm_fastest, device="cpu", seconds: float = 0.12,
                   least: int = 3) -> tuple:
    """``((d, seconds), …)`` of float64 symmetric eigendecompositions."""
    out = []
    g = torch.Generator().manual_seed(0)
    for d in sizes:
        x = torch.randn(d, d, dtype=torch.float64, generator=g).to(device)
        m = x @ x.T + torch.eye(d, dtype=torch.float64, device=device)
        out.append((d, timed(lambda: torch.linalg.eigh(m), seconds, least)))
    return tuple(out)


def _measure_cpu() -> DeviceProfile:
    rates = _measure_gemms()
    flops = max(r for _, r in rates)
    bw = _measure_copy()
    call = _measure_call()
    batch, layer = _measure_capture(call)
    elementwise, randoms = _measure_elementwise(), _measure_randoms()
    prof = DeviceProfile(f"cpu ({torch.get_num_threads()} threads)", flops, flops, bw, host_memory(), measured=True,
                         call_seconds=call, op_seconds=_measure_op(), batch_seconds=batch, layer_seconds=layer,
                         elementwise_bandwidth=elementwise, fault_bandwidth=_measure_faults(),
                         gemm_rates=rates, bmm_rates=_measure_bmms(), bmm_call_seconds=_measure_bmm_call(),
                         eigh_times=_measure_eighs(),
                         random_seconds=randoms, block_seconds=_measure_blocks(),
                         sjlt_bytes=_measure_sjlt(elementwise), sjlt_build_randoms=_measure_sjlt_build(randoms),
                         ts_bytes_per_bin=_measure_tensorsketch(elementwise),
                         ts_flat_bytes=_measure_tensorsketch_flat(elementwise))
    return _with_products(prof)


def _with_products(prof: DeviceProfile, timed=_warm_fastest, device="cpu") -> DeviceProfile:
    """``prof`` with its curvature products measured (:func:`_measure_products`)."""
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
    from ..curvature.hvp import Products
    from ..data import as_data
    from ..tasks import classification

    g = torch.Generator().manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.Tanh()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(width, 4)).to(device).eval()
    X, y = torch.randn(n, width, generator=g).to(device), torch.randint(0, 4, (n,), generator=g).to(device)
    products = Products(classification(model), as_data((X, y)), [str(i) for i in range(0, 2 * depth + 1, 2)],
                        "gauss_newton")
    _, batch = next(products.batches(n))
    dim = sum(p.numel() for p in model.parameters())
    V = torch.randn(1, dim, generator=g).to(device)
    return (lambda: products.batch_rows(batch, V, 0)), model, n, dim


def _measure_products_fixed(timed=_warm_fastest, device="cpu", seconds: float = 0.15) -> tuple:
    """``(seconds per batch, per leaf module)`` of Gauss-Newton products through torch.func
    when their arithmetic is negligible: one batch through tiny MLPs of 2 and 6 layers
    (:data:`PRODUCT_DEPTHS`; 5 and 13 leaf modules), the difference per module."""
    from .estimates import _leaf_modules

    times = {}
    for depth in PRODUCT_DEPTHS:
        run, model, _, _ = _product_batch(4, depth, 2, device)
        times[_leaf_modules(model)] = timed(run, seconds)
    (few, t_few), (many, t_many) = sorted(times.items())
    per_module = max((t_many - t_few) / (many - few), 1e-7)
    return max(t_few - few * per_module, 1e-6), per_module


def _measure_product_work(prof: DeviceProfile, timed=_warm_fastest, device="cpu", seconds: float = 0.2) -> float:
    """The products' work through torch.func over its price as plain ops: one batch of
    Gauss-Newton products through an MLP of :data:`PRODUCT_WORK_SHAPE`, less its fixed cost
    (``prof.product_seconds``), over :func:`~gradalg.plan.jobs.products.product_work`
    priced by ``prof``."""
    from .estimates import _leaf_modules
    from .jobs.products import product_work

    width, depth, n = PRODUCT_WORK_SHAPE
    run, model, n, dim = _product_batch(width, depth, n, device)
    measured = timed(run, seconds) - prof.block_fixed_seconds("products", _leaf_modules(model))
    priced = prof.time_of(product_work(model, n, 1, 1, "gauss_newton", dim, 4))
    return max(measured / max(priced, 1e-9), 0.1)


def _measure_copy(timed=_warm_fastest, device="cpu", nbytes: int = 64 * 2**20, seconds: float = 0.1) -> float:
    """Bytes/s of a copy of ``nbytes`` (larger than a CPU's last-level cache: memory, not
    cache), read and written."""
    x = torch.empty(nbytes // 4, device=device)
    y = torch.empty_like(x)
    return 2 * x.numel() * 4 / timed(lambda: y.copy_(x), seconds)


def _measure_faults() -> float:
    """Bytes/s of touching fresh memory: filling a new 32 MiB tensor (large allocations
    come from the system, page by page) minus filling one already touched."""
    n = 8 * 2**20
    old = torch.empty(n)
    old.fill_(1.0)
    fresh = _fastest(lambda: torch.empty(n).fill_(1.0), 0.3)
    warm = _fastest(lambda: old.fill_(1.0), 0.15)
    return 4 * n / max(fresh - warm, 1e-6)


def _measure_randoms() -> float:
    """Seconds per float64 normal number drawn by torch's CPU generator (2²⁰ at a time,
    as ``gradalg.proj.matrices`` draws a dense projection's matrix)."""
    g = torch.Generator().manual_seed(0)
    n = 2**20
    return _fastest(lambda: torch.randn(n, generator=g, dtype=torch.float64), 0.05) / n


def _measure_elementwise(timed=_warm_fastest, device="cpu", numel: int = 2**20, seconds: float = 0.3) -> float:
    """Bytes/s of a model's elementwise work: a tanh-approximated GELU forward and
    backward and a product on ``numel`` float32 numbers (4 MiB, an activation's size), each
    op counted as reading its inputs and writing its output."""
    x = torch.randn(numel, device=device, requires_grad=True)
    y = torch.randn(numel, device=device)

    def step():
        (torch.nn.functional.gelu(x, approximate="tanh") * y).backward(y)

    # forward: gelu (read x, write), product (read 2, write); backward: product (read 2,
    # write), gelu's gradient (read 2, write): 11 numbers of 4 bytes moved per element
    return 11 * 4 * numel / timed(step, seconds)


#: the sparse-JL product timed by :func:`_measure_sjlt`: ``SJLT_COLUMNS`` input coordinates
#: (s = 1; as many as a GPT-2 MLP weight, beyond the caches) into k = ``SJLT_BINS``, on 2 and on 8
#: rows (about 0.6 s on one CPU thread)
SJLT_COLUMNS, SJLT_BINS = 2**21, 2048


def _measure_sjlt(elementwise: float, timed=_warm_fastest, device="cpu", seconds: float = 0.06) -> tuple:
    """``(per non-zero and call, per non-zero and row)``: the sparse-JL product
    (:func:`gradalg.proj.kernels.sjlt_apply`, the kernel the runs use) as bytes at the
    ``elementwise`` bandwidth. One call on n rows of d columns takes d·(a + b·n) seconds;
    timed at n = 2 and 8, b = (t₈ − t₂)/(6d), a = t₂/d − 2b."""
    from ..proj.kernels import sjlt_apply
    from ..proj.sparse_tables import SJLT

    d, k = SJLT_COLUMNS, SJLT_BINS
    g = torch.Generator().manual_seed(0)
    S = SJLT(torch.randint(0, k, (d, 1), generator=g, dtype=torch.int32),
             torch.randint(0, 2, (d, 1), generator=g, dtype=torch.int8) * 2 - 1, k).to(device)
    times = {}
    for n in (2, 8):
        x = torch.ones(n, d, device=device)      # the kernel's time does not depend on the values
        times[n] = timed(lambda: sjlt_apply(x, S), seconds)
    row = max((times[8] - times[2]) / (6 * d), 1e-12)
    nonzero = max(times[2] / d - 2 * row, 1e-12)
    return nonzero * elementwise, row * elementwise


#: the TensorSketch timed by :func:`_measure_tensorsketch`: factors of ``TS_SHAPE`` = (rows,
#: positions, width) into k = :data:`SJLT_BINS` (its count sketches negligible beside its FFTs)
TS_SHAPE = (2, 64, 8)


def _measure_tensorsketch(elementwise: float, timed=_warm_fastest, device="cpu", seconds: float = 0.1) -> float:
    """Bytes per position and output bin of a TensorSketch on factors (the runs' kernel,
    :func:`gradalg.proj.kernels.tensor_sketch`: two real FFTs of k and their product per
    position, summed), at the ``elementwise`` bandwidth. Nominal 100, the old CPU fit
    (GPT-2 c_fc 3072 × 769, n = 8, T = 64, k = 2048: 13 ms on one thread)."""
    from ..capture.factors import Factors
    from ..expr.projection import Projector
    from ..proj.kernels import tensor_sketch
    from ..proj.sparse_tables import tensorsketch_tables

    n, T, w = TS_SHAPE
    g = torch.Generator().manual_seed(0)
    F = Factors(torch.randn(n, T, w, generator=g).to(device), torch.randn(n, T, w, generator=g).to(device))
    tables = tensorsketch_tables(Projector("tensorsketch", SJLT_BINS), "calibration", w, w, device=device)
    per_bin = timed(lambda: tensor_sketch(F, (w, w), tables, SJLT_BINS), seconds) / (n * T * SJLT_BINS)
    return per_bin * elementwise


#: the flat rows timed by :func:`_measure_tensorsketch_flat`: (out, in) = ``TS_FLAT_SHAPE`` into
#: k = :data:`SJLT_BINS`, at 1 and :data:`TS_FLAT_ROWS` examples (in small: the count sketch's
#: scatter, priced apart, negligible beside the FFTs and the shift)
TS_FLAT_SHAPE, TS_FLAT_ROWS = (256, 8), 4


def _measure_tensorsketch_flat(elementwise: float, timed=_warm_fastest, device="cpu", seconds: float = 0.1) -> tuple:
    """``(per row, example and bin, per row and bin)`` bytes of a TensorSketch of flat rows
    (:func:`gradalg.proj.kernels.tensor_sketch` on an (n, out·in) tensor) at the
    ``elementwise`` bandwidth, from its time at n = 1 and n = :data:`TS_FLAT_ROWS`: the
    slope is each example's count sketch, FFT and product per row; the rest the phase
    shift made once per row for all examples (256 rows: at 64 the shift was lost in the
    timing noise of a shared machine). Nominal (100, 30)."""
    from ..expr.projection import Projector
    from ..proj.kernels import tensor_sketch
    from ..proj.sparse_tables import tensorsketch_tables

    (out, w), n, k = TS_FLAT_SHAPE, TS_FLAT_ROWS, SJLT_BINS
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, out * w, generator=g).to(device)
    tables = tensorsketch_tables(Projector("tensorsketch", k), "calibration-flat", out, w, device=device)
    one = timed(lambda: tensor_sketch(x[:1], (out, w), tables, k), seconds)
    many = timed(lambda: tensor_sketch(x, (out, w), tables, k), seconds)
    bins = out * (k // 2 + 1)
    per_row = max((many - one) / ((n - 1) * bins), 1e-13)
    per_shift = max(one / bins - per_row, 1e-13)
    return per_row * elementwise, per_shift * elementwise


def _measure_sjlt_build(random_seconds: float, columns: int = 2**19, seconds: float = 0.05) -> float:
    """Float64 normal draws per non-zero of drawing a sparse-JL table on the CPU (the
    package's own draw, :mod:`gradalg.proj.sparse_tables`; ``columns``, s = 2)."""
    from ..expr.projection import Projector
    from ..proj.sparse_tables import _sjlt_cpu

    projector = Projector("sparse", SJLT_BINS, s=2)
    build = _sjlt_cpu.__wrapped__       # the draw itself, not its per-process cache
    per_nonzero = _fastest(lambda: build(projector, "calibration", columns, "sjlt"), seconds) / (2 * columns)
    return per_nonzero / random_seconds


def _measure_call(timed=_warm_fastest, device="cpu", seconds: float = 0.25) -> float:
    """Seconds per module forward or backward when the arithmetic is negligible: a forward
    and backward through 8 tiny layers, divided by their 16 calls."""
    layers = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(8)]).to(device)
    x = torch.randn(2, 4, device=device)
    return timed(lambda: layers(x).sum().backward(), seconds) / 16


def _measure_op(timed=_warm_fastest, device="cpu", seconds: float = 0.15) -> float:
    """Seconds per small tensor op (dispatch, allocation): a chain of 20 tiny ops / 20."""
    x = torch.randn(4, 4, device=device)

    def step():
        y = x
        for _ in range(10):
            y = (y * 0.5).add_(x)
        return y

    return timed(step, seconds) / 20


def _measure_capture(call: float, timed=_warm_fastest, device="cpu", seconds: float = 0.2) -> tuple[float, float]:
    """(seconds per captured batch, seconds per recorded layer of it) beyond the module
    calls: gradalg's own capture (hooks, ``autograd.grad`` to the outputs, factors) of
    one tiny batch through 2 and through 6 recorded layers."""
    from ..capture.hooks import ForwardRecorder, capture_batch, resolve_layers

    def timing(n_layers: int) -> float:
        model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(n_layers)]).to(device)
        refs = resolve_layers(model)
        x = torch.randn(2, 4, device=device)

        def step():
            with torch.enable_grad(), ForwardRecorder(refs) as recorder:
                capture_batch(model(x).sum(), recorder)

        return timed(step, seconds) - 2 * n_layers * call

    two, six = timing(2), timing(6)
    layer = max((six - two) / 4, 1e-6)
    return max(two - 2 * layer, 1e-6), layer


#: the per-block kernels timed by :func:`_measure_blocks`: a block of ``BLOCK_WIDTH`` ×
#: ``BLOCK_WIDTH`` (out, in) of ``BLOCK_ROWS`` examples of ``BLOCK_POSITIONS`` positions, so
#: small that their arithmetic is negligible beside their fixed cost
BLOCK_WIDTH, BLOCK_ROWS, BLOCK_POSITIONS = 4, 2, 4


def _measure_blocks() -> tuple:
    """``((kind, seconds), …)``: the fixed cost of one block of gradalg's per-chunk work,
    each kind the kernels of its job run on one tiny block (:data:`BLOCK_WIDTH`), less
    the batched-GEMM calls (einsums over examples) the cost model prices by shape
    (``bmm_call_seconds`` each):

    * ``ekfac``: EK-FAC's rotation of a chunk's factors into float64 K-FAC eigenbases
      (``rotate_factors``, as ``torch.linalg.eigh`` returns them) and its squares summed
      into float64 (one einsum);
    * ``kfac``: K-FAC's statistics of a chunk (``KronStats.update``: both Grams, the
      running sums);
    * ``scores``: a dense score block, the streamed factors materialized (one einsum),
      one GEMM with the held rows, added to the chunk's scores;
    * ``ghost``: a ghost score block (``ghost_inner``: two einsums);
    * ``precondition``: a Kronecker preconditioner applied to one block of rows (rotated
      in, scaled by Λ, rotated back, cast: two batched products);
    * ``resolve``: a Kronecker operator's inverse on one block (its eigenvalues checked
      and inverted in float64).
    """
    from ..capture.factors import Factors, ghost_inner, materialize
    from ..curvature.kron import KronStats
    from ..linalg.kron import rotate_back as _rotate_back, rotate_factors, rotate_rows
    from ..linalg.base import reciprocal

    w, n, T = BLOCK_WIDTH, BLOCK_ROWS, BLOCK_POSITIONS
    g = torch.Generator().manual_seed(0)
    F = Factors(torch.randn(n, T, w, generator=g), torch.randn(n, T, w, generator=g))
    held = torch.randn(n, w * w, generator=g)
    M = torch.randn(w, w, dtype=torch.float64, generator=g)
    Q = torch.linalg.eigh(M @ M.T + torch.eye(w, dtype=torch.float64))[1]     # (w, w), column-major
    lam = torch.rand(w, w, generator=g) + 1.0
    sums = torch.zeros(w, w, dtype=torch.float64)
    G = torch.randn(n, w, w, generator=g)
    bmm_call = _measure_bmm_call()

    def ekfac():
        sums.add_((rotate_factors(F, Q, Q) ** 2).sum(0).to(torch.float64))

    def kfac():
        KronStats(float64_width=w).update(F)

    def scores():
        return torch.zeros(n, n) + held @ materialize(F).flatten(1).T

    def ghost():
        return torch.zeros(n, n) + ghost_inner(F, F)

    def precondition():
        return _rotate_back(rotate_rows(G, Q, Q) * lam, Q, Q).flatten(1).to(torch.float32)

    def resolve():
        return reciprocal(lam.to(torch.float64), "a block").to(lam.dtype)

    kernels = {"ekfac": (ekfac, 1), "kfac": (kfac, 0), "scores": (scores, 1), "ghost": (ghost, 2),
               "precondition": (precondition, 2), "resolve": (resolve, 0)}
    out = []
    for kind, (fn, calls) in kernels.items():
        fn()
        out.append((kind, max(_fastest(fn, 0.05) - calls * bmm_call, 1e-7)))
    return tuple(out)


def read_cached(key: str) -> DeviceProfile | None:
    """The profile cached under ``key`` (:func:`_key`, or a GPU's key in
    :mod:`gradalg.plan.accelerators`), or None: none, unreadable, another cost model's."""
    try:
        entry = json.loads(_cache_file().read_text()).get(key)
        return DeviceProfile.from_json(entry) if entry else None
    except (OSError, ValueError, TypeError, AttributeError):
        return None


def write_cached(key: str, prof: DeviceProfile) -> None:
    """Cache ``prof`` under ``key`` beside the other entries (a read-only home: not cached)."""
    path = _cache_file()
    try:
        cached = json.loads(path.read_text()) if path.exists() else {}
    except (OSError, ValueError):
        cached = {}
    cached = cached if isinstance(cached, dict) else {}
    cached[key] = prof.to_json()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(cached, indent=1))
        os.replace(tmp, path)
    except OSError:
        pass  # read-only home: measure again next time


def local_profile(refresh: bool = False) -> DeviceProfile:
    """This machine's CPU profile, measured once and cached on disk."""
    key = _key()
    found = None if refresh else read_cached(key)
    if found is not None:
        return found
    prof = _measure_cpu()
    write_cached(key, prof)
    return prof


# a modest laptop core, for displays before this machine was measured
UNMEASURED_CPU = DeviceProfile("cpu (not measured yet: ga.plan.devices.local_profile() measures it)",
                               2e10, 2e10, 1e10, 8e9, measured=False, call_seconds=2e-5, op_seconds=5e-6,
                               batch_seconds=5e-4, layer_seconds=1e-4)


def cached_local_profile() -> DeviceProfile:
    """This machine's profile if it was measured before (the disk cache), else
    :data:`UNMEASURED_CPU`. Never measures: displays (``repr``, ``explain()``) use it."""
    return read_cached(_key()) or UNMEASURED_CPU


def profile(device: str | DeviceProfile | torch.device | None = None, *, measure: bool = True,
            count: int | None = None) -> DeviceProfile:
    """A profile by name ("cpu" = this machine, "h100", "h200", "a100"), for a CUDA device
    (``"cuda"``, ``"cuda:1"``, a ``torch.device``: :func:`gradalg.plan.accelerators.cuda_profile`,
    measured, or nominal by its name), or as given.

    count : devices of this kind (default: the profile's own, 1). ``explain(device=
        profile("h200", count=4))`` estimates, or refuses with the arithmetic, a run on
        four H200s (:mod:`gradalg.plan.scale`).
    ``measure=False`` never benchmarks a device: the cached measurement, else
    :data:`UNMEASURED_CPU` (the CPU) or the GPU's nominal profile."""
    if count is not None and not positive_integer(count):
        raise OptionError(f"count must be a positive integer (devices of this kind), got {count!r}")
    if isinstance(device, DeviceProfile):
        found = device
    elif device is None or device == "cpu" or (isinstance(device, torch.device) and device.type == "cpu"):
        found = local_profile() if measure else cached_local_profile()
    elif isinstance(device, torch.device) or (isinstance(device, str) and device.lower().startswith("cuda")):
        from .accelerators import cuda_profile
        try:
            dev = torch.device(device)
        except RuntimeError as err:
            raise OptionError(f"unknown device {device!r}: {err}; use 'cpu', 'cuda', 'cuda:0', one of "
                              f"{sorted(PRESETS)}, or a DeviceProfile") from err
        if dev.type != "cuda":
            raise OptionError(f"no profile for a model on {dev}: use 'cpu', 'cuda', one of {sorted(PRESETS)}, "
                              "or a DeviceProfile")
        found = cuda_profile(dev.index, measure=measure)
    elif isinstance(device, str) and device.lower() in PRESETS:
        found = PRESETS[device.lower()]
    else:
        raise OptionError(f"unknown device {device!r}: use 'cpu', 'cuda', one of {sorted(PRESETS)}, "
                          "or a DeviceProfile")
    return found if count is None or count == found.count else replace(found, count=int(count))


def positive_integer(x) -> bool:
    """Whether ``x`` is a whole number ≥ 1 (an int, a numpy integer, or a float like 4.0)."""
    try:
        return not isinstance(x, (bool, str)) and int(x) == x and x >= 1
    except (TypeError, ValueError, OverflowError):
        return False
