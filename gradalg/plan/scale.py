"""Time and memory per GPU of a plan run data-parallel on ``g`` GPUs with sharded weights.

An estimate from the plan's own counts and a device profile (for the presets: NVIDIA's
spec sheets, :mod:`gradalg.devices`), never a measurement. Per GPU, for each pass
of the plan (the largest over passes is the GPU's memory):

    memory = W / g                the model's weights, sharded FSDP-style (``fully_shard``):
                                  each GPU keeps 1/g of every parameter
           + min(2·U, W − W/g)    the unsharded weights of the FSDP unit computing and the
                                  one prefetched; U = the largest element of the model's
                                  ``nn.ModuleList`` (a decoder layer), else the whole model
           + H                    the pass's held rows and curvature statistics, a full copy
                                  on every GPU (as gradalg's executors keep them)
           + b · E                b examples of the GPU's micro-batch: activations kept for
                                  the backward, captured factors and the jobs' working rows
                                  (the planner's bytes per example); b = the plan's batch
                                  size, lowered until the sum fits, at least 1

    time   = Σ_passes max(C_p / g, m_p · 2·W·(g − 1)/g / link)

C_p is the pass's estimated seconds on one GPU (the planner's cost on the profile), split
evenly over g data-parallel workers; with g > 1 every micro-batch (m_p of them per GPU in
a pass over data) all-gathers the weights for its forward and again for its backward over
the GPU interconnect (``link_bandwidth``), overlapped with the compute (FSDP prefetch).

No parameter gradients and no optimizer state are counted: attribution captures output
gradients, not weight gradients. Not modelled: tensor, sequence or pipeline parallelism,
activation checkpointing, the one-off all-reduce of curvature statistics, load imbalance
between GPUs, passes that do not split (an eigendecomposition is divided by g like the
rest: optimistic for them), and the host side (data loading, Python).

A configuration that does not fit (the sum above with b = 1 exceeds the profile's memory)
is marked ``fits=False`` with the arithmetic in ``why``; :func:`check_fits` refuses it
with a :class:`~gradalg.errors.MemoryBudgetError`.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from torch import nn

from ..errors import MemoryBudgetError, OptionError
from .cost import _si
from ..devices import positive_integer, profile

__all__ = ["GPUEstimate", "scale_estimates", "check_fits", "model_bytes", "fsdp_unit_bytes"]


@dataclass(frozen=True)
class GPUEstimate:
    """The estimate for one GPU count (all bytes per GPU, seconds for the whole plan)."""

    gpus: int
    device: str
    seconds: float               # the plan's passes, split over the GPUs
    communication_seconds: float  # of which: the weights' all-gathers, when they exceed compute
    memory_per_gpu: float        # the largest pass's sum below
    weights: float               # W / g
    gathered: float              # unsharded FSDP units (computing and prefetched)
    held: float                  # held rows and statistics (a full copy)
    per_example: float           # E: bytes of one example of the micro-batch
    batch_per_gpu: int           # b
    capacity: float              # the profile's memory
    fits: bool
    passes_over_data: int
    why: str                     # the arithmetic of the largest pass


def _models(plan) -> list[nn.Module]:
    """The distinct models (by identity) of the plan's sources, in the order they appear."""
    from ..expr import Source
    nodes = plan.simplified.walk() if hasattr(plan.simplified, "walk") else ()
    return list({id(n.task.model): n.task.model for n in nodes if isinstance(n, Source)}.values())


def model_bytes(model: nn.Module) -> float:
    """Bytes of a model's parameters (on any device, ``meta`` included: shapes only)."""
    return float(sum(p.numel() * p.element_size() for p in model.parameters()))


def fsdp_unit_bytes(model: nn.Module) -> float:
    """Bytes of the largest FSDP unit: the largest element of any ``nn.ModuleList`` (the
    decoder layers of a transformer), else the whole model (one unit)."""
    largest = max((model_bytes(child) for module in model.modules() if isinstance(module, nn.ModuleList)
                   for child in module), default=0.0)
    return largest or model_bytes(model)


def scale_estimates(plan, gpus=(1, 4, 8), device="h200") -> list[dict]:
    """``[asdict(GPUEstimate), …]`` for each GPU count in ``gpus`` (module docstring)."""
    prof, models = profile(device, measure=False), _models(plan)   # a DeviceProfile as given
    W = sum(model_bytes(m) for m in models)
    U = sum(fsdp_unit_bytes(m) for m in models)
    rows = []
    for g in gpus:
        if not positive_integer(g):
            raise OptionError(f"GPU counts must be positive integers, got {g!r}: e.g. explain(gpus=(1, 4, 8))")
        g = int(g)
        weights = W / g
        gathered = min(2.0 * U, W - weights)
        seconds = comm_total = 0.0
        sums = []   # (memory, held, per_example, batch, fits) of each pass
        for p in plan.passes:
            held, per_ex = p.fixed_bytes, p.per_example_bytes
            room = prof.memory - weights - gathered - held
            b = p.batch_size or 1     # the largest micro-batch up to the plan's that fits in room (0: none)
            b = max(0, min(b, int(room // per_ex))) if per_ex > 0 else b
            sums.append((weights + gathered + held + max(b, 1) * per_ex, held, per_ex, max(b, 1), b >= 1))
            compute = p.cost.scaled(1.0 / g).seconds(prof, plan.dtype)
            comm = 0.0
            if g > 1 and p.reads_data and prof.link_bandwidth > 0:
                micro_batches = -(-p.key.n // (g * max(b, 1)))   # ceil(n / (g b)), 0 for n = 0
                comm = micro_batches * 2.0 * W * (g - 1) / g / prof.link_bandwidth
            seconds += max(compute, comm)
            comm_total += comm if comm > compute else 0.0
        # the largest pass: one that does not fit before any that does, then the most memory (the first of equals)
        memory, held, per_ex, b, fits = max(sums, key=lambda s: (not s[4], s[0]),
                                            default=(weights, 0.0, 0.0, 1, weights <= prof.memory))
        why = (f"{_si(W)}B weights / {g} + {_si(gathered)}B unsharded FSDP units + {_si(held)}B held rows "
               f"and statistics + {b} × {_si(per_ex)}B per example = {_si(memory)}B "
               f"{'≤' if fits else '>'} {_si(prof.memory)}B of one {prof.name}")
        rows.append(asdict(GPUEstimate(g, prof.name, seconds, comm_total, memory, weights, gathered, held, per_ex, b,
                                       prof.memory, fits, plan.data_passes, why)))
    return rows


def check_fits(plan, gpus: int, device="h200") -> dict:
    """The estimate for ``gpus`` GPUs, or :class:`MemoryBudgetError` with the arithmetic
    when one example per GPU does not fit next to the weights and held rows (``needed``:
    the memory per GPU, ``budget``: one GPU's memory; no budget is suggested: more GPUs or
    a smaller run is the fix)."""
    row = scale_estimates(plan, (gpus,), device)[0]
    if not row["fits"]:
        b = row["batch_per_gpu"]
        raise MemoryBudgetError(
            f"each GPU of {gpus} × {row['device']}", row["memory_per_gpu"], row["capacity"],
            parts=[(f"its share of the weights (W / {gpus})", row["weights"]), ("unsharded FSDP units", row["gathered"]),
                   ("held rows and statistics", row["held"]), (f"{b} × one example's work", b * row["per_example"])],
            limit=f"the memory of one {row['device']}", fits_under=None,
            fixes=["use more GPUs", "shorter sequences", "project the gradients (ga.proj.kron)",
                   "fewer queries per call", "attribute fewer layers"])
    return row
