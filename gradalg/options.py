"""Validated global options, usable as a context manager.

>>> import gradalg as ga
>>> with ga.options(batch_size=64, ghost="never"):
...     ga.get_options().batch_size
64
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import math
import os
from dataclasses import dataclass, field, fields, replace

from .errors import OptionError
from .units import UNITS_HELP, parse_bytes

__all__ = ["Options", "options", "get_options", "plain"]


def plain(value):
    """``value`` as a plain Python number when it is a numpy scalar (``np.int64``,
    ``np.float32``, ``np.bool_``) or a 0-d array; anything else unchanged. Options and
    the public numeric arguments (batch sizes, ``k``, ranks, seeds, chunk sizes) pass
    through it, so numpy values work wherever Python numbers do."""
    if type(value).__module__ == "numpy" and getattr(value, "shape", None) == ():
        return value.item()
    return value


PROGRESS_MODES = (True, False, "auto", "bar", "lines", "off")
_PROGRESS_ENV = {"0": False, "off": False, "false": False, "no": False, "1": True, "on": True, "true": True,
                 "yes": True, "auto": "auto", "bar": "bar", "lines": "lines", "": True}


def _progress_from_env():
    value = os.environ.get("GRADALG_PROGRESS", "1")
    if value.strip().lower() not in _PROGRESS_ENV:
        import warnings
        warnings.warn(f"GRADALG_PROGRESS={value!r} is not one of 0, 1, off, auto, bar, lines: using auto",
                      stacklevel=2)
        return True
    return _PROGRESS_ENV[value.strip().lower()]


def _interval_from_env() -> float:
    value = os.environ.get("GRADALG_PROGRESS_INTERVAL", "30")
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not 0 <= seconds < float("inf"):
        import warnings
        warnings.warn(f"GRADALG_PROGRESS_INTERVAL={value!r} is not a number of seconds >= 0: using 30",
                      stacklevel=2)
        return 30.0
    return seconds


@dataclass(frozen=True)
class Options:
    """Settings that change how (never what) gradalg computes.

    Attributes
    ----------
    batch_size : int
        The most examples per chunk when gradalg builds a DataLoader from a Dataset (the
        planner uses fewer under ``memory_budget`` or ``batch_tokens``; a DataLoader's or
        ``ga.grads(..., batch_size=)``'s own batch size is used as it is).
    memory_budget : int or None
        Bytes a run may add to what the process already holds when it is planned: held
        rows, stored rows, curvature statistics, projection matrices and tables, and each
        batch's captured factors, activations and working rows (the planner's counted
        bytes; the model's weights, the data and the framework are already resident, and
        not counted). Accepts strings in one convention with every byte count gradalg prints
        (:mod:`gradalg.units`, dask's): ``"4GB"`` is 4·10⁹ bytes, ``"4GiB"`` 4·2³⁰, so a
        budget copied from a plan or a refusal is the number shown. ``None`` (default):
        ``memory_fraction`` of the memory available when the plan is made — the device's
        free memory (``torch.cuda.mem_get_info``) for a model on CUDA, else ``MemAvailable``
        of ``/proc/meminfo`` (``psutil``'s available memory where there is no
        ``/proc/meminfo``; 2 GB where neither exists). The plan shows the budget and where
        it came from (:mod:`gradalg.plan.budget`; ``ga.plan.budget.resolve_budget(
        ga.get_options()).describe()`` is the one a plan made now would get), and
        ``TorchDistributed`` ranks take the smallest rank's.
    memory_fraction : float in (0, 1]
        The fraction of the available memory that a budget from the machine
        (``memory_budget=None``) takes; default 0.5. A run's resident growth measured up to
        1.31× its planned bytes (``tests/test_budgets.py``, ``docs/planner.md``), so half of
        what is free leaves a quarter of it, even at 1.5× the budget, to the page cache,
        the rest of the process and other processes. Shown in the plan's header.
    measure_devices : bool
        Measure a device's speeds the first time a run is planned on it (about 3 s on a
        CPU, under a second on a GPU), cached on disk (:mod:`gradalg.devices`).
        ``False``: a CPU never measured is priced with a modest default, a GPU never
        measured with the nominal profile of its name (H200 / H100 / A100 spec sheets,
        labelled "nominal" in the plan).
    ghost : {"auto", "always", "never"}
        Factored ("ghost") inner products: chosen by cost, forced, or disabled.
    check_finite : bool
        Raise :class:`NonFiniteGradientError` naming the examples whose gradients are
        NaN/inf, and, before a pass (or ``ga.capture``, or a ``TrainingRun``),
        :class:`NonFiniteWeightError` naming a parameter or buffer that holds NaN/inf
        (:mod:`gradalg.finite`).
    check_reduction : bool
        On the first batch of a computation, verify that the task's loss is summed over
        examples (forward passes without gradients of a few examples: one forward of the
        batch when the capture's own loss of a 2–4 example batch is reused, two otherwise).
    share_forward : bool
        Sources of one pass that differ only in their objective (the training loss and
        labels drawn from the model, say) are captured from one forward per batch and
        one backward each. ``False`` runs one forward per source (for a loss function
        that modifies the model's outputs in place).
    progress : bool or {"auto", "bar", "lines", "off"}
        Progress on passes over data (:mod:`gradalg.exec.progress`). ``True`` / ``"auto"``:
        a widget in Jupyter, a bar on a terminal, and plain lines (rows done, rate, ETA)
        every ``progress_interval`` seconds when stderr is not a terminal (nohup, SLURM,
        CI logs); ``"bar"`` or ``"lines"`` force one form; ``False`` / ``"off"`` silence
        them. Default from the environment variable ``GRADALG_PROGRESS`` (``0``/``off``,
        ``1``/``auto``, ``bar``, ``lines``; the headless notebook runner sets ``0``).
    progress_interval : float
        Seconds between two plain progress lines (default 30; environment variable
        ``GRADALG_PROGRESS_INTERVAL``).
    check_models : bool
        Refuse scores and preconditioned products whose two sides come from different
        models (no model object or fingerprint in common): see :mod:`gradalg.expr.models`.
    fingerprint_cache : bool
        Cache the content digests behind node identities per tensor, invalidated by the
        tensor's version counter (see :mod:`gradalg.fingerprint`). ``False`` rehashes
        every tensor on each use (for code that writes weights through ``.data``).

    Thresholds the planner decides with (each shown in ``explain()`` where it decides):

    store_fraction : float in (0, 1]
        Rows a later pass needs again are stored (not re-read) only if they fit this
        fraction of ``memory_budget`` (default a quarter: the rest is for the pass that
        reads them back, its held side and its batches). The "second use" decisions; also
        the rows of a window read outside a pass (DataInf applied on its own:
        ``Executor.window_rows``), each window a plan of its own.
    row_storage : {"auto", "factors", "flat"}
        How kept rows of a factored block are stored: the smaller of its factors
        (T·(in + out) numbers per row) and its flat gradient (out·in), or forced. The
        "storage of" decisions.
    ghost_slice_elements : int
        The ghost kernel computes ⟨G_i, G_j⟩ in slices of streamed examples so that its
        (n_left, n_slice, T_left, T_right) intermediate has at most this many elements.
        Shown in each ghost kernel decision.
    token_block : int
        Kernels over factors (ghost products, norms, materialization, Kronecker and sparse
        projections, K-FAC / EK-FAC statistics) take at most this many positions of an
        example at once (default 512), so their temporaries do not grow with the sequence
        length T: a pair of blocks of the ghost kernel is token_block² per example pair.
        Shown in each ghost kernel decision and counted in the plan's memory.
    kron_float64_width : int
        Kronecker factors (K-FAC / EK-FAC) of at most this width are summed and
        eigendecomposed in float64; wider ones (an MLP's 14336 or 28672) in float32: Kahan-
        compensated sums (8·d² bytes, as float64) and a float32 eigendecomposition on the
        factor's device (16·d² bytes at its peak instead of 32·d²), checked to
        ``kron_float32_rtol`` (:mod:`gradalg.curvature.kron`). Default 8192. Shown per
        wide factor in the plan, with its bytes.
    kron_float32_rtol : float
        The relative accuracy float32 Kronecker eigendecompositions must reach: their
        residual and orthogonality, and the error of an inverse's eigenvalues
        (δ_Λ / min |Λ + damping|); beyond it ``CurvatureError`` (default 1e-2).
    kron_diagonal_width : int
        Kronecker factors (K-FAC / EK-FAC) wider than this are kept as their diagonal, with
        the identity as eigenbasis, instead of a dense d × d matrix and its eigendecomposition
        (default 16384: a vocabulary's 32k–152k side of an embedding or LM head is diagonal,
        the widest MLP factors of common models, 14336, stay dense). Exact for an embedding's
        one-hot inputs (token counts); for other factors (a head's output gradients) it drops
        the off-diagonal covariances. Shown per block in the plan's decisions and in the
        operator rules (``kronecker.diagonal_factor``).
    vocabulary_layers_max : int
        The largest vocabulary whose **vocabulary layers** (the input embedding and the LM
        head, one block when tied) the ``ga.tasks`` language tasks attribute by default
        (``ga.TransformerBlocks(vocabulary="auto")``); above it the default is the linear
        layers inside the transformer blocks alone. Default 4096. On a tied GPT-2 with a
        1,024-token vocabulary trained on real text they carry most of what attribution
        measures (EK-FAC influence LDS 0.353 → 0.664, RelatIF 0.354 → 0.667, every method
        up: docs/fidelity.md, "The vocabulary layers in the LM default"); their cost grows
        with V alone: a V × V K-FAC / EK-FAC factor (8·V² bytes, V² multiply-adds per token,
        its float64 eigendecomposition 0.14 / 12 / 86 CPU s at V = 1k / 4k / 8k) and V·d
        gradient coordinates per example (``benchmarks/vocabulary_layers.py``: on that
        32-wide model K-FAC / EK-FAC cost about 2× their blocks-only run at V = 1k, 17–19× at
        4k (a 128 MiB factor), EK-FAC over 30× (unfinished, 4.4 GB resident) at 8k; Grad-Dot, LoGra, TRAK ≤ 2× at
        every V measured; on wider models the same V costs relatively less). 4096 covers
        CPU-sized models' vocabularies and leaves every real one (32k–262k) out by a factor
        of 8. Lower it for speed over fidelity; 0: never. Shown in ``explain()``'s coverage
        line (which vocabulary layers are in or out, and why).
    projection_slice_elements : int
        A sparse (SJLT / mask) projection of a factored block materializes the block in
        slices of examples of at most this many elements (a block larger than this: one
        example at a time, in slices of output rows).
    dense_curvature_dim : int
        ``curvature="auto"`` (the default of ``ga.methods.influence`` and ``relatif`` with the
        direct solver) is the dense Gauss-Newton when the (projected) gradient space has at
        most this many coordinates, EK-FAC above it (default 4096, chosen by cost: a dense
        float64 H of 4,096² is 128 MiB and its eigendecomposition ~0.6 TFLOP, seconds on one
        CPU core; at 16,384 coordinates it is ~40 TFLOP, and a 2-layer BERT's 14.8 k block
        coordinates were planned at 12 minutes; GPT-2 small's block linears are 85 M
        coordinates, whose dense H would be 58 PB). Every measured fidelity setting keeps its
        curvature (the digits MLP's 2.4 k coordinates are dense, the LMs' ≥ 24 k EK-FAC). The
        choice and this threshold are named in the plan (the damping's note).
    hessian_negative_ratio : float
        ``curvature="auto"``'s dense choice of ``ga.methods.influence`` (issue 31): the Hessian
        formed from its products (``curvature="dense_hessian"``) where the model is near a
        minimum of its objective, −μ_min(H̄ + decay) ≤ r · tr(G)/dim with r this ratio (μ_min the
        Hessian's smallest eigenvalue, G the Gauss-Newton matrix, its mean eigenvalue the scale),
        else the dense Gauss-Newton. Default 1.0, fixed before the settings it was validated on
        were scored (docs/fidelity.md, "The formed Hessian where the model is near a minimum"):
        a converged weight-decayed model has −μ_min ≈ wd (0.29–0.51 × the Gauss-Newton's mean on
        the four minima measured), an MLP / conv net stopped by Adam ≥ 1.6 / 25 ×. 0: the Hessian
        only where H̄ + decay is PSD (round-off counts: give the weight decay); ``inf``: always.
    hessian_probe_iterations : int
        Lanczos iterations (Hessian-vector products on one vector each) that estimate μ_min
        before the Hessian is formed for that choice: a Ritz value is never below μ_min, so an
        estimate already past the ratio proves the Gauss-Newton side and skips forming the
        Hessian (dim products); otherwise the formed Hessian's exact μ_min decides. Never more
        steps than forming takes passes over the data (⌈dim/256⌉ calls of 256 vectors): the
        probe costs at most what it can save. Default 32; 0: always form the Hessian and decide
        from its eigenvalues. The choice is the same either way (the bound only skips work).
    products_vmap_elements : int
        The most activation elements one ``vmap`` call of the curvature products
        (:mod:`gradalg.curvature.hvp`) carries: the m vectors of a call go through ``vmap`` in
        chunks of max(1, this // (activation elements of the batch's forward)) vectors, all m at
        once when that is m or more. Default 2**21 (16 MiB of float64): a float64 conv net (its
        convolutions on torch's unfused CPU path) ran its Hessian's products 2× faster in chunks of
        ~16 vectors than 256 at once, where an MLP's (74 activations per example) stay in one call
        (issue 31; docs/fidelity.md "The formed Hessian where the model is near a minimum"). Each
        vector's product is computed alone either way: the numbers do not change. 0: never chunk.
    products_batching : str
        How the m vectors of a curvature products call run: ``"auto"`` (default) as the plan decides
        before any run, from a probe on the meta device (``torch.func.vmap`` of 2 vectors' products,
        no weight or example read: :func:`gradalg.curvature.hvp.probe_batching`): one ``vmap`` where
        it runs, a loop of one product per vector where only one vector runs; where the meta device
        cannot run the model (a ``.item()``, a branch on a tensor's value) the same probe on the first
        example with the real weights, and the loop where that cannot run either (the safe side);
        ``"vmap"`` or ``"loop"`` force one.
        ``explain()`` shows the decision (``DecisionKind.PRODUCTS_BATCHING``) and prices the loop as
        m calls of one vector. The numbers are the same either way.
    dense_projection_bytes : int
        The largest dense (k, d) float64 projection matrix a method draws by default
        (``ga.methods.trak``, ``ga.methods.less``; default 1 GiB: d ≤ 65,536 at k = 2048,
        d ≤ 16,384 at k = 8192). Above it they project with a sparse JL transform (SJLT)
        of the same k, block by block: no matrix, d·s additions per example instead of
        k·d multiply-adds. Shown in the plan's "projection map" decision.
    sjlt_table_bytes : int
        The largest tables (5·d bytes: int32 rows, int8 signs) of the SJLT such a default
        builds for factored gradients (default 256 MiB: d ≤ 53 M). Above it ``trak``
        projects with a TensorSketch of the same k (``ga.proj.tensorsketch``: the SJLT
        with a hash factored over each layer's outputs and inputs, applied to the
        factors by FFT, without forming any layer's gradient): GPT-2 small's 85 M block
        coordinates would need 425 MB of SJLT tables and each layer's gradient formed.
        Shown in the same decision.
    reuse_buffer_bytes : int
        (This and the two ``..._bytes`` options above also take strings like ``"1GiB"``,
        as ``memory_budget`` does.) Streamed factored blocks at least this large are materialized into one buffer
        reused across blocks and chunks (fresh tensors above the allocator's mmap
        threshold cost page faults); smaller ones are allocated as usual. Shown in each
        dense kernel decision over factored rows.
    batch_tokens : int or None
        A pass over sequences reads batches of at most ``max(1, ⌈batch_tokens / T⌉)``
        examples of T positions (and at most ``batch_size``). The forward and backward of
        a batch of B·T positions already run GEMMs of B·T rows, efficient from a few
        hundred rows on a CPU, while the model's activations — most of a pass's memory for
        long sequences — grow with B: measured on the peer harness's GPT-2 (4 × 256,
        T = 128, 1 thread), batches of 4 instead of 16 took the same time (7.45 s vs
        7.47 s projected Grad-Dot; 12.7 s vs 13.4 s full) at 595 MB instead of 939 MB
        peak (1238 vs 1442 MB). None (default): 512 when the model is on the CPU, no
        limit on an accelerator (whose throughput keeps growing with the batch); 0: no
        limit. Shown in the plan's batch-size decision.
    release_growth : float >= 1
        After a batch of a pass, free memory is returned to the system (glibc
        ``malloc_trim``) only when the pass's resident growth (the resident set now less
        its size as the pass started) exceeds this multiple of its growth after the pass's
        first batch, or after the first batch since the last return (default 1.25; 1.0
        returns it after every batch: fewest resident pages, but every large tensor of
        the next batch faults its pages in again, 20 % of a GPT-2 pass); and once after
        each pass's last batch. Not Linux (no resident-set reading): only after each pass.
        :class:`gradalg.exec.allocator.ResidentGuard`; shown in the plan's header.
    device_memory_fraction : float in (0, 1]
        ``explain(device=...)`` on hardware one does not have plans under this fraction of
        one device's memory (the rest for the model, its optimizer and the framework).
        Shown in the plan's header as its memory budget.
    budget_headroom : float >= 0
        A refusal for memory (:class:`~gradalg.errors.MemoryBudgetError`) suggests a budget
        of ``(1 + budget_headroom) ×`` what the refused step needs, rounded up (default
        0.25: a run's resident growth measured up to 1.31× its planned bytes, so the
        suggestion leaves room for what the planner's count leaves out); 0: exactly the
        need. Shown in the plan's header beside the budget
        (:func:`gradalg.plan.budget.refusal_note`).

    How an executor runs a plan (each shown in ``explain()``):

    dask_shards : int or None
        Shard tasks of each pass a Dask executor places on its workers (at most one per
        example). None (default): ``shards_per_worker`` per worker, none under
        ``min_shard_examples`` examples (:class:`gradalg.exec.DaskExecutor`). Decided when
        the plan is made: the plan's ``SHARDS`` decision per pass, with both counts weighed.
    release_memory_above : float >= 0
        Bytes (default 1 MiB; ``"1MB"``-style strings accepted): after each batch of a pass
        whose planned working set is at least this many bytes, free memory is returned to
        the system (:mod:`gradalg.exec.allocator`; smaller batches free too little to be
        worth the call), and rows joined or preconditioned block by block return it each
        time the blocks dropped since the last return reach this many bytes
        (:class:`~gradalg.exec.allocator.FreedBytes`). 0: after every batch and block;
        ``float("inf")``: never. Shown in the plan's header, and per pass over data as its
        ``TRIM`` decision (``Pass.trim_after_batches``, the ``trim`` column of ``explain()``).
    """

    batch_size: int = 32
    memory_budget: int | str | None = None
    memory_fraction: float = 0.5
    measure_devices: bool = True
    ghost: str = "auto"
    check_finite: bool = True
    check_reduction: bool = True
    share_forward: bool = True
    progress: bool | str = field(default_factory=lambda: _progress_from_env())
    progress_interval: float = field(default_factory=lambda: _interval_from_env())
    check_models: bool = True
    fingerprint_cache: bool = True
    store_fraction: float = 0.25
    row_storage: str = "auto"
    ghost_slice_elements: int = 2**26
    token_block: int = 512
    kron_float64_width: int = 8192
    kron_float32_rtol: float = 1e-2
    kron_diagonal_width: int = 16384
    vocabulary_layers_max: int = 4096
    projection_slice_elements: int = 2**26
    dense_curvature_dim: int = 4096
    hessian_negative_ratio: float = 1.0
    hessian_probe_iterations: int = 32
    products_vmap_elements: int = 2**21
    products_batching: str = "auto"
    dense_projection_bytes: int | str = 2**30
    sjlt_table_bytes: int | str = 2**28
    reuse_buffer_bytes: int | str = 2**20
    release_growth: float = 1.25
    batch_tokens: int | None = None
    device_memory_fraction: float = 0.4
    budget_headroom: float = 0.25
    dask_shards: int | None = None
    release_memory_above: float = 2**20

    def __post_init__(self):
        for f in fields(self):   # numpy scalars (np.int64(8), np.float32(0.5)) as Python numbers
            object.__setattr__(self, f.name, plain(getattr(self, f.name)))
        if not isinstance(self.batch_size, int) or isinstance(self.batch_size, bool) or self.batch_size < 1:
            raise OptionError(f"batch_size must be a positive int, got {self.batch_size!r}")
        for name in BYTE_OPTIONS:   # "8GB" = 8·10⁹, "8GiB" = 8·2³⁰, a number: bytes (gradalg.units)
            if getattr(self, name) is not None:
                object.__setattr__(self, name, parse_bytes(getattr(self, name), name))
        if self.memory_budget is not None and self.memory_budget <= 0:
            raise OptionError(f"memory_budget must be positive ({UNITS_HELP}) or None (a fraction of the "
                              f"machine's memory), got {self.memory_budget!r}")
        if not isinstance(self.ghost, str) or self.ghost not in ("auto", "always", "never"):
            raise OptionError(f"ghost must be 'auto', 'always' or 'never', got {self.ghost!r}")
        if self.progress not in PROGRESS_MODES or not isinstance(self.progress, (bool, str)):
            raise OptionError(f"progress must be True, False, 'auto', 'bar', 'lines' or 'off', got {self.progress!r}")
        if self.progress == "off":
            object.__setattr__(self, "progress", False)
        interval = self.progress_interval
        if isinstance(interval, bool) or not isinstance(interval, (int, float)) or not 0 <= interval < float("inf"):
            raise OptionError(f"progress_interval must be a number of seconds >= 0, got {interval!r}")
        growth = self.release_growth
        if isinstance(growth, bool) or not isinstance(growth, (int, float)) or not 1 <= growth < float("inf"):
            raise OptionError(f"release_growth must be a number >= 1 (1.0: return free memory after every "
                              f"batch), got {growth!r}")
        headroom = self.budget_headroom
        if isinstance(headroom, bool) or not isinstance(headroom, (int, float)) or not 0 <= headroom < float("inf"):
            raise OptionError(f"budget_headroom must be a number >= 0 (0.25: a refusal suggests 1.25 × the need), "
                              f"got {headroom!r}")
        for name in ("store_fraction", "device_memory_fraction", "memory_fraction"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
                raise OptionError(f"{name} must be a fraction in (0, 1], got {value!r}")
        if not isinstance(self.products_batching, str) or self.products_batching not in ("auto", "vmap", "loop"):
            raise OptionError(f"products_batching must be 'auto' (the plan's probe decides), 'vmap' or 'loop', "
                              f"got {self.products_batching!r}")
        if not isinstance(self.row_storage, str) or self.row_storage not in ("auto", "factors", "flat"):
            raise OptionError(f"row_storage must be 'auto', 'factors' or 'flat', got {self.row_storage!r}")
        rtol = self.kron_float32_rtol
        if isinstance(rtol, bool) or not isinstance(rtol, (int, float)) or not 0 < rtol < 1:
            raise OptionError(f"kron_float32_rtol must be a number in (0, 1), got {rtol!r}")
        for name in ("ghost_slice_elements", "projection_slice_elements", "reuse_buffer_bytes", "token_block",
                     "kron_float64_width", "kron_diagonal_width", "dense_curvature_dim", "dense_projection_bytes",
                     "sjlt_table_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise OptionError(f"{name} must be a positive int, got {value!r}")
        ratio = self.hessian_negative_ratio
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or math.isnan(ratio) or ratio < 0:
            raise OptionError(f"hessian_negative_ratio must be a number >= 0 (r in −μ_min ≤ r × the Gauss-Newton's "
                              f"mean eigenvalue; 0: the Hessian only where PSD, inf: always), got {ratio!r}")
        for name, meaning in (("hessian_probe_iterations", "Lanczos steps; 0: form the Hessian and decide from its "
                                                            "eigenvalues"),
                              ("products_vmap_elements", "activation elements per vmap call of the curvature products; "
                                                          "0: all vectors in one call"),
                              ("vocabulary_layers_max", "a vocabulary size; 0: never include the vocabulary layers by "
                                                         "default")):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise OptionError(f"{name} must be an int >= 0 ({meaning}), got {value!r}")
        tokens = self.batch_tokens
        if tokens is not None and (not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 0):
            raise OptionError(f"batch_tokens must be None (the device's default), 0 (no limit) or a positive "
                              f"int, got {tokens!r}")
        self._check_run_options()
        for f in fields(self):
            if f.type in ("bool", bool) and not isinstance(getattr(self, f.name), bool):
                raise OptionError(f"{f.name} must be True or False, got {getattr(self, f.name)!r}")


    def _check_run_options(self) -> None:
        """Validate (and parse) the options of how an executor runs a plan."""
        shards = self.dask_shards
        if shards is not None and (not isinstance(shards, int) or isinstance(shards, bool) or shards < 1):
            raise OptionError(f"dask_shards must be None (shards_per_worker per worker) or a positive int, "
                              f"got {shards!r}")
        above = self.release_memory_above
        if isinstance(above, str):
            try:
                above = parse_bytes(above, "release_memory_above")
            except (TypeError, ValueError, OverflowError, OptionError):
                above = None
        if isinstance(above, bool) or not isinstance(above, (int, float)) or not 0 <= above <= float("inf"):
            raise OptionError(f"release_memory_above must be a number of bytes >= 0, a string like '1MB', or "
                              f"float('inf') (never return free memory), got {self.release_memory_above!r}")
        object.__setattr__(self, "release_memory_above", above)


#: the options that are byte quantities: each accepts a number or a string in
#: :mod:`gradalg.units`' convention (``"8GB"``, ``"8GiB"``) and holds an int
BYTE_OPTIONS = ("memory_budget", "dense_projection_bytes", "sjlt_table_bytes", "reuse_buffer_bytes")


#: ``batch_tokens``'s default for a model on the CPU (``Options.batch_tokens``)
CPU_BATCH_TOKENS = 512


_current: contextvars.ContextVar[Options] = contextvars.ContextVar("gradalg_options", default=Options())


def get_options() -> Options:
    """The options in force here."""
    return _current.get()


class options(contextlib.ContextDecorator):
    """Set options globally, or for a ``with`` block only.

    ``ga.options(batch_size=8)`` changes them for the rest of the session;
    ``with ga.options(batch_size=8): ...`` changes them inside the block only.
    Unknown names raise ``TypeError`` listing the valid ones.
    """

    def __init__(self, **changes):
        valid = {f.name for f in fields(Options)}
        unknown = set(changes) - valid
        if unknown:
            raise OptionError(f"unknown option(s) {sorted(unknown)}; valid options: {sorted(valid)}")
        self._changes = changes
        self._previous = _current.get()
        self._token = _current.set(replace(self._previous, **changes))

    def __repr__(self) -> str:   # shown when a notebook cell ends with ga.options(...)
        changes = ", ".join(f"{k}={v!r}" for k, v in self._changes.items())
        return f"ga.options({changes}) -> {_current.get()!r}"

    def __call__(self, func):
        """As a decorator: the options hold inside each call of ``func`` only."""
        _current.reset(self._token)  # decorating alone changes nothing
        changes = self._changes

        @functools.wraps(func)
        def wrapper(*args, **kwargs):
            with options(**changes):
                return func(*args, **kwargs)
        return wrapper

    def __enter__(self):
        return get_options()

    def __exit__(self, *exc):
        _current.reset(self._token)
        return False
