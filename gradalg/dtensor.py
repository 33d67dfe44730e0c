"""DTensors (FSDP2 ``fully_shard``, tensor parallel): whether a tensor is one, and this rank's shard.

The one test every caller reads: the finiteness check of a model's weights
(:mod:`gradalg.finite`), the digest of a tensor (:mod:`gradalg.fingerprint`), whether a
model is split across ranks (:func:`gradalg.capture.wrappers.sharding`) and the trainer
integrations. On the foundation floor: imports nothing of gradalg. A DTensor is
recognized by its attributes (``placements`` and ``to_local``), without importing
``torch.distributed.tensor`` (no import cost for a plain model, and a torch built without
distributed support needs no special case).
"""
from __future__ import annotations

import torch

__all__ = ["is_dtensor", "local_shard", "write_version"]


def is_dtensor(t) -> bool:
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor`` (a parameter of an FSDP2
    or tensor-parallel model: each rank holds a shard): it has ``placements`` and
    ``to_local``."""
    return hasattr(t, "placements") and hasattr(t, "to_local")


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (``t.to_local()``: the local shape, e.g.
    ``(out / world, in)`` for a weight ``(out, in)`` sharded on dim 0); any other tensor
    as it is. With one rank the shard is the whole tensor."""
    return t.to_local() if is_dtensor(t) else t


def write_version(t: torch.Tensor) -> tuple:
    """What changes when ``t`` is written in place: its version counter and, for a DTensor,
    its local shard's too. A DTensor is written through either counter without bumping the
    other (an optimizer's step on the DTensor bumps its own; a checkpoint loader's
    ``t.to_local().copy_(...)`` only the shard's), so a check that records one counter
    misses the other kind of write."""
    local = local_shard(t)
    return (t._version, local._version if local is not t else None)

