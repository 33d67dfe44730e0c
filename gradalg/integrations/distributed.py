"""Capture under data parallelism (DDP, FSDP2 ``fully_shard``): helpers and gathering.

Why per-example capture needs nothing special under DDP or FSDP2: the hooks sit on the
model's own modules, which see this rank's local batch. Module inputs and outputs are
whole tensors on every rank (FSDP2 shards parameters, not activations: it all-gathers a
module's weight before its forward and reduce-scatters its gradient after its
backward), and the gradient all-reduce acts on parameter gradients, never on the module
output gradients ``D`` the hooks receive. So each rank's factors are exactly the
per-example gradients of its own examples, for the loss that rank backpropagates; with a
sum loss they equal a single-process capture of the same examples.

What differs is the *step's* gradient: DDP and FSDP average over ranks, so an example's
contribution to ``p.grad`` after backward is its local gradient divided by the world
size. :func:`gather` collects every rank's rows into one GradientSet;
:func:`apply_correction` subtracts per-example contributions from (possibly sharded)
parameter gradients consistently on every rank.
"""
from __future__ import annotations

from ..dtensor import is_dtensor
from ..errors import OptionError

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["unwrap_model", "is_distributed", "world_size", "rank", "gather", "all_gather_scores",
           "all_reduce_sum", "apply_correction", "scale_grads"]


def unwrap_model(model: nn.Module) -> nn.Module:
    """The user's module under a DDP / DataParallel / FSDP1 wrapper (FSDP2 modules are the model)."""
    for _ in range(4):
        inner = getattr(model, "module", None)
        wrapped = type(model).__name__ in ("DistributedDataParallel", "DataParallel", "FullyShardedDataParallel")
        if wrapped and isinstance(inner, nn.Module):
            model = inner
        else:
            break
    return model


def is_distributed(group=None) -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def world_size(group=None) -> int:
    return dist.get_world_size(group) if is_distributed(group) else 1


def rank(group=None) -> int:
    return dist.get_rank(group) if is_distributed(group) else 0


def _to_cpu(value):
    from ..capture.factors import Factors, OneHot

    if isinstance(value, Factors):
        return Factors(_to_cpu(value.A), _to_cpu(value.D))
    if isinstance(value, OneHot):
        return OneHot(value.idx.cpu(), value.size, None if value.valid is None else value.valid.cpu())
    return value.detach().cpu()


def _local_chunks(grads) -> tuple[list, object, object]:
    """The chunks (in memory), space and model (None: unknown) behind a GradientSet,
    StepGrads or TrainingCapture."""
    from ..api import GradientSet
    from ..expr import Captured
    from .training import StepGrads, TrainingCapture

    if isinstance(grads, TrainingCapture):
        grads = grads.grads
    if isinstance(grads, StepGrads):
        return list(grads.chunks), grads.space, grads.model
    if isinstance(grads, GradientSet) and isinstance(grads.expr, Captured):
        return list(grads.expr.store.chunks()), grads.space, getattr(grads.expr.store, "model", None)
    raise OptionError("gather takes the gradients a capture recorded (cap.grads, a TrainingCapture or a "
                    f"StepGrads), got {type(grads).__name__}; compute other sets on each rank instead")


def gather(grads, *, order: str = "step", group=None):
    """Every rank's captured rows in one GradientSet, on every rank.

    order : "step" (default): for each recorded chunk (micro-batch), rank 0's rows, then
        rank 1's, ... — the order of the global batch when each step's global batch is
        split across ranks in rank order. "rank": all of rank 0's rows, then rank 1's.

    Rows labelled with dataset indices (the trainer integrations) keep them; rows numbered
    by position on each rank are numbered again over the gathered set. Rows are
    moved to CPU and sent with ``all_gather_object`` (gloo or NCCL). Outside a
    distributed run this returns the rows unchanged.
    """
    from ..capture.chunks import Chunk
    from ..loop_capture import captured_grads

    if order not in ("step", "rank"):
        raise OptionError(f"order must be 'step' or 'rank', got {order!r}")
    chunks, space, model = _local_chunks(grads)
    mine = [(tuple(c.ids) if c.meta.get("labelled") else None, {k: _to_cpu(v) for k, v in c.blocks.items()})
            for c in chunks]
    if is_distributed(group):
        everyone = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, mine, group=group)
    else:
        everyone = [mine]
    counts = {len(r) for r in everyone}
    if order == "step" and len(counts) != 1:
        raise OptionError(f"ranks recorded different numbers of micro-batches {sorted(counts)}; "
                         "use order='rank'")
    if order == "step":
        blocks = [r[k] for k in range(len(everyone[0])) for r in everyone]
    else:
        blocks = [b for r in everyone for b in r]
    # rows labelled with dataset indices (the trainer integrations) keep them; rows numbered by
    # position on their rank (plain ga.capture) are numbered again over the gathered set
    labelled = all(ids is not None for ids, _ in blocks)
    out, start = [], 0
    for ids, b in blocks:
        n = next(iter(b.values())).n if b else 0
        out.append(Chunk(ids, b, meta={"labelled": True}) if labelled else Chunk(tuple(range(start, start + n)), b))
        start += n
    return captured_grads(out, space, model)


def all_gather_scores(local: torch.Tensor, group=None) -> tuple[torch.Tensor, slice]:
    """Concatenate every rank's (n_r,) vector in rank order.   Returns (N,), this rank's slice."""
    if not is_distributed(group):
        return local, slice(0, local.numel())
    parts = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, local.detach().cpu())
    start = sum(p.numel() for p in parts[: dist.get_rank(group)])
    full = torch.cat(parts).to(local.device)
    return full, slice(start, start + local.numel())


def all_reduce_sum(tensors: list[torch.Tensor], group=None) -> list[torch.Tensor]:
    """Sum each tensor over ranks (one flat all-reduce)."""
    if not is_distributed(group) or not tensors:
        return tensors
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, group=group)
    out, start = [], 0
    for t in tensors:
        out.append(flat[start:start + t.numel()].view_as(t))
        start += t.numel()
    return out


def apply_correction(corrections: dict, *, world_reduction: str = "mean", group=None) -> None:
    """``p.grad ← p.grad − Δ_p``, with Δ_p the ranks' local corrections combined.

    corrections : {parameter: Δ_p}, Δ_p of the parameter's full shape: this rank's sum of
        the per-example contributions to remove. Every rank must pass the same parameters
        in the same order (one flat all-reduce). Under DDP/FSDP ``p.grad`` holds the mean
        (``world_reduction="mean"``, their default) or the sum of the ranks' local
        gradients, so the Δ_p are combined the same way. A sharded gradient (an FSDP2
        DTensor) gets its own shard of Δ_p. Parameters without a gradient are skipped.
    """
    if world_reduction not in ("mean", "sum"):
        raise OptionError(f"world_reduction must be 'mean' or 'sum', got {world_reduction!r}")
    params = list(corrections)
    deltas = all_reduce_sum([corrections[p] for p in params], group)
    if world_reduction == "mean" and is_distributed(group):
        deltas = [d / dist.get_world_size(group) for d in deltas]
    for p, d in zip(params, deltas):
        g = p.grad
        if g is None:
            continue
        if is_dtensor(g):
            from torch.distributed.tensor import distribute_tensor

            d = distribute_tensor(d.to(device=g.device, dtype=g.dtype), g.device_mesh, g.placements,
                                  src_data_rank=None)
        with torch.no_grad():
            g.sub_(d.to(device=g.device, dtype=g.dtype))


def scale_grads(params, factor: float) -> None:
    """``p.grad ← factor · p.grad`` for every parameter with a gradient."""
    if factor == 1.0:
        return
    with torch.no_grad():
        for p in params:
            if p.grad is not None:
                p.grad.mul_(factor)
