"""Measuring a device's profile: micro-benchmarks of the work gradalg's passes do.

:func:`measure_cpu` measures this machine's CPU (about three seconds; medians of repeated
runs in process CPU time with one thread, so that other processes competing for the cores
are not cached as this machine's speed); :func:`measure_profile` any torch device (a GPU
in well under a second: float32 GEMMs of a few square sizes, a bfloat16 GEMM of the
largest, batched products, float64 ``eigh`` — Kronecker factors are decomposed on their
device —, a copy, a GELU forward and backward, and the fixed costs of a module call, a
small op and a captured batch, with a synchronized timer). Random numbers are drawn by
torch's CPU generator on every device: that rate is the CPU profile's. Each benchmark
runs the package's own kernel where one exists (capture, sparse JL, TensorSketch, the
per-block work of the jobs), so the profile prices what the runs do.

Calibration fields that are fits of the planner's cost model (the measured time over the
model's price for the same work) need that model, which sits above this package: the
planner registers them in :data:`FITS` (the products job:
:func:`gradalg.plan.jobs.products.fit_products`), and every measurement applies them
before it is cached. ``import gradalg`` registers them (``tests/test_devices.py`` checks).
"""
from __future__ import annotations

import os
import time

import torch

from .cache import cached_local_profile
from .nominal import _MEM_EFF, PRESETS, nominal_key
from .record import DeviceProfile

__all__ = ["measure_cpu", "measure_profile", "FITS", "warm_timer", "physical_memory", "host_memory",
           "GEMM_SIZES", "BMM_SIZES", "EIGH_SIZES", "GPU_GEMM_SIZES", "GPU_BMM_SIZES", "GPU_EIGH_SIZES"]

#: ``[fit(profile, timed, device) -> profile]``: calibrations of the planner's cost model
#: applied, in order, to every freshly measured profile (module docstring)
FITS: list = []

def _fastest(fn, seconds: float, least: int = 3, sync=None) -> float:
    """The typical time of one call of ``fn``: the median over ``seconds`` of repetitions
    (at least ``least``). With one thread the time is this process's CPU time, which does
    not count the waits for a core that other processes of a busy machine cause; the
    median, not the fastest, because a pass runs at the sustained speed, not the best.
    ``sync`` (a device's synchronize, :func:`warm_timer`) is called after
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



def warm_timer(sync=None):
    """``timed(fn, seconds, least=3)``: :func:`_fastest` of ``fn`` after one warm-up call;
    with ``sync`` (a GPU's synchronize, or a no-op for wall time) called after each call."""
    def timed(fn, seconds: float, least: int = 3) -> float:
        fn()
        if sync is not None:
            sync()
        return _fastest(fn, seconds, least, sync)
    return timed


_warm_fastest = warm_timer()    # the CPU's: process time with one thread


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



def measure_cpu() -> DeviceProfile:
    """This machine's CPU profile, measured now (:func:`gradalg.devices.local_profile` caches it)."""
    randoms = _measure_randoms()
    return _measured_profile(torch.device("cpu"), _warm_fastest, f"cpu ({torch.get_num_threads()} threads)",
                             host_memory(), random_seconds=randoms, fault_bandwidth=_measure_faults(),
                             block_seconds=_measure_blocks(), sjlt_build_randoms=_measure_sjlt_build(randoms))


def _measured_profile(device: torch.device, timed, name: str, memory: float, *, gemm_sizes=GEMM_SIZES,
                      bmm_sizes=BMM_SIZES, eigh_sizes=EIGH_SIZES, copy_bytes: int = 64 * 2**20,
                      elementwise_numel: int = 2**20, batch_elements: int = 2**20, seconds: float | None = None,
                      eigh_least: int = 3, flops_bf16: float = 0.0, **own) -> DeviceProfile:
    """The profile of ``device`` from the benchmarks every device runs (its GEMMs, batched
    GEMMs, eigh, copy, elementwise work, fixed costs, capture, sparse JL and TensorSketch,
    timed by ``timed``), with the fields measured or set per kind of device in ``own`` (the
    CPU's page faults, random numbers, block costs and table draws; an accelerator's host
    rates and link bandwidth) and the fits applied (:data:`FITS`): the one place a
    measured profile is built, for :func:`measure_cpu` and :func:`measure_profile`.

    ``seconds``: one time window for every benchmark (an accelerator's); None: each
    benchmark its own (the CPU's, see :data:`GEMM_SIZES`). ``flops_fp32`` is the fastest
    measured GEMM's rate; ``flops_bf16`` a measured bfloat16 rate (0: none, the float32 one)."""
    window = {} if seconds is None else {"seconds": seconds}
    gemm_rates = _measure_gemms(gemm_sizes, timed, device, **window)
    flops = max(rate for _, rate in gemm_rates)
    elementwise = _measure_elementwise(timed, device, elementwise_numel, **window)
    call = _measure_call(timed, device, **window)
    batch, layer = _measure_capture(call, timed, device, **window)
    prof = DeviceProfile(name, flops, max(flops_bf16, flops), _measure_copy(timed, device, copy_bytes, **window),
                         memory, measured=True, call_seconds=call, op_seconds=_measure_op(timed, device, **window),
                         batch_seconds=batch, layer_seconds=layer, elementwise_bandwidth=elementwise,
                         gemm_rates=gemm_rates, bmm_rates=_measure_bmms(bmm_sizes, timed, device, **window,
                                                                        elements=batch_elements),
                         bmm_call_seconds=_measure_bmm_call(timed, device, **window),
                         eigh_times=_measure_eighs(eigh_sizes, timed, device, **window, least=eigh_least),
                         sjlt_bytes=_measure_sjlt(elementwise, timed, device, **window),
                         ts_bytes_per_bin=_measure_tensorsketch(elementwise, timed, device, **window),
                         ts_flat_bytes=_measure_tensorsketch_flat(elementwise, timed, device, **window), **own)
    return _fitted(prof, timed, device)


def _fitted(prof: DeviceProfile, timed=_warm_fastest, device="cpu") -> DeviceProfile:
    """``prof`` with the cost model's calibration fits applied (:data:`FITS`)."""
    for fit in FITS:
        prof = fit(prof, timed, device)
    return prof


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


GPU_GEMM_SIZES = (256, 1024, 4096)
GPU_BMM_SIZES = (16, 64, 256)
GPU_EIGH_SIZES = (64, 256, 1024)


def measure_profile(device: torch.device, *, gemm_sizes=GPU_GEMM_SIZES, bmm_sizes=GPU_BMM_SIZES,
                    eigh_sizes=GPU_EIGH_SIZES, copy_bytes: int = 256 * 2**20, batch_elements: int = 2**24,
                    seconds: float = 0.05) -> DeviceProfile:
    """Measure ``device``'s speeds (module docstring). Any device torch runs on; the sizes
    are small enough for a GPU's fraction of a second, and smaller ones test it on a CPU."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    timed = warm_timer(torch.cuda.synchronize if cuda else (lambda: None))
    bf16 = _measure_gemms(gemm_sizes[-1:], timed, device, seconds, torch.bfloat16)[0][1]
    name = torch.cuda.get_device_name(device) if cuda else str(device)
    host = cached_local_profile()
    memory = torch.cuda.get_device_properties(device).total_memory * _MEM_EFF if cuda else host_memory()
    return _measured_profile(device, timed, f"{name} ({device}, measured)", memory, gemm_sizes=gemm_sizes,
                             bmm_sizes=bmm_sizes, eigh_sizes=eigh_sizes, copy_bytes=copy_bytes,
                             elementwise_numel=max(copy_bytes // 64, 2**10), batch_elements=batch_elements,
                             seconds=seconds, eigh_least=2, flops_bf16=bf16,
                             random_seconds=host.random_seconds,
                             sjlt_build_randoms=host.sjlt_build_randoms,   # tables are drawn on the CPU
                             link_bandwidth=PRESETS[nominal_key(name)].link_bandwidth if cuda else 0.0)
