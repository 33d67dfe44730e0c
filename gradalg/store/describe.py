"""Stable descriptions of models and expressions, for a store's metadata.

A node's ``token`` names it within one process (datasets and tasks by object identity);
a store outlives the process. What a store records instead is the same in every
process that builds the same thing:

* :func:`model_fingerprint`: a digest of a model's parameter and buffer names, shapes,
  dtypes and values (a strided sample of at most ``sample`` values per tensor; shapes
  only for tensors on the ``meta`` device);
* :func:`describe`: a JSON-able description of an expression (node types and their
  fields; a ``Source`` by its model fingerprint, loss, layers, objective, example ids
  and a digest of its first example; tensors by a digest of their values);
* :func:`summary`: the readable part of it that a store's attributes show (projector,
  layers, objective, model fingerprint, blocks).
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, fields, is_dataclass

import torch

from ..capture.wrappers import unwrap
from ..data import DataRef
from ..fingerprint import stable_model_digest
from ..expr import Captured, Node, Project, Projector, Source
from ..space import ParamSpace
from ..expr.stored import Stored, StoredOp

__all__ = ["model_fingerprint", "model_identity", "tensor_digest", "describe", "digest", "summary"]

SAMPLE = 65_536


def _update(h, tensor: torch.Tensor, sample: int | None) -> None:
    h.update(f"{tuple(tensor.shape)}|{tensor.dtype}|".encode())
    if tensor.device.type == "meta":
        h.update(b"meta")
        return
    flat = tensor.detach().reshape(-1)
    if sample is not None and flat.numel() > sample:
        stride = math.ceil(flat.numel() / sample)
        flat = flat[::stride]
        h.update(f"stride{stride}|".encode())
    h.update(flat.contiguous().cpu().view(torch.uint8).numpy().tobytes())


def tensor_digest(tensor: torch.Tensor, sample: int = 1 << 22) -> str:
    """A digest of a tensor's shape, dtype and values (strided sample above ``sample``)."""
    h = hashlib.blake2b(digest_size=12)
    _update(h, tensor, sample)
    return h.hexdigest()


def model_fingerprint(model: torch.nn.Module, sample: int = SAMPLE) -> str:
    """A digest of ``model``'s parameters and buffers: names, shapes, dtypes and values.

    Tensors over ``sample`` elements contribute a strided sample of about ``sample``
    values (two checkpoints of one run differ in essentially every value, so a sample
    tells them apart); tensors on the ``meta`` device contribute their shape only.

    >>> ga.store.model_fingerprint(model)
    'model-3f1c9a0b5e7d2c4a81f0e6d9'
    """
    h = hashlib.blake2b(digest_size=12)
    for kind, named in (("param", model.named_parameters()), ("buffer", model.named_buffers())):
        for name, tensor in named:
            h.update(f"{kind}|{name}|".encode())
            _update(h, tensor, sample)
    return f"model-{h.hexdigest()}"


def model_identity(model: torch.nn.Module) -> str | None:
    """The model's identity as the in-memory check of two operands reads it
    (:func:`gradalg.expr.models.check_same_models`): :func:`gradalg.fingerprint.model_digest`
    of the unwrapped model (module tree and every value, not a sample); None for a model
    on the ``meta`` device. A store records it as ``model_digest``, so that its rows and
    operators are refused next to another model's gradients."""
    return stable_model_digest(unwrap(model)[0])


def digest(value) -> str:
    """A short digest of a JSON-able value (key order does not matter)."""
    text = json.dumps(value, sort_keys=True, default=str)
    return hashlib.blake2b(text.encode(), digest_size=12).hexdigest()


def _ids_digest(ids) -> str:
    return digest([repr(i) for i in ids])


def _batch_digest(batch, sample: int | None = 1 << 20) -> str:
    """A digest of a batch's values (tensors: shape, dtype and bytes, strided down to
    ``sample`` values when larger; None: every byte)."""
    h = hashlib.blake2b(digest_size=12)

    def go(x):
        if isinstance(x, torch.Tensor):
            _update(h, x, sample)
        elif isinstance(x, dict):
            for k in sorted(x, key=str):
                h.update(str(k).encode())
                go(x[k])
        elif isinstance(x, (tuple, list)):
            for v in x:
                go(v)
        else:
            h.update(repr(x).encode())

    go(batch)
    return h.hexdigest()


def content_digest(data: DataRef) -> str | None:
    """A digest of every example's values, in order: ``blake2b`` over each example collated
    alone (batch of one, so that padding and batching do not enter), its tensors hashed
    byte for byte. Two sources holding the same examples (a JSONL file read by the
    ``gradalg`` command, the same records in a list) agree; an edit of any one example
    (not only the first or last) changes it. Costs one read of the data (no forward);
    None when the examples cannot be read one by one (then ids and size identify it).
    A dataset's own name (``__gradalg_fingerprint__()``) does not replace this read: the
    digest must agree between containers of the same values (the ``gradalg`` command's
    JSONL dataset and the same records in a list), which a container's name cannot.
    """
    if data.n == 0:
        return None
    h = hashlib.blake2b(digest_size=12)
    try:
        for i, example in enumerate(data.examples()):
            if i >= data.n:
                break
            h.update(_batch_digest(example, sample=None).encode())
    except Exception:  # noqa: BLE001 - an unusual dataset: ids and size still identify it
        return None
    return h.hexdigest()


def describe(value, fingerprints: dict | None = None):
    """A JSON-able description of ``value`` (usually an expression node) that does not
    depend on the process: see the module docstring."""
    fp = {} if fingerprints is None else fingerprints

    def model_fp(model):
        if id(model) not in fp:
            fp[id(model)] = model_fingerprint(model)
        return fp[id(model)]

    def go(x):
        if isinstance(x, Source):
            return {"node": "Source", "model": model_fp(x.task.model), "task": x.task.name,
                    "loss": getattr(x.task.loss, "__qualname__", type(x.task.loss).__name__),
                    "reduction": x.task.reduction, "layers": list(x.layers), "backend": x.backend,
                    "objective": x.objective, "seed": x.seed, "data": go(x.data)}
        if isinstance(x, Stored):
            return {"node": "Stored", "store": x.store.description}
        if isinstance(x, StoredOp):
            return {"node": "StoredOp", "store": x.store.description}
        if isinstance(x, Captured):   # rows in this process's memory: no stable name
            return {"node": "Captured", "token": x.token}
        if isinstance(x, Node):
            return {"node": type(x).__name__, **{f.name: go(getattr(x, f.name)) for f in fields(x)}}
        if isinstance(x, DataRef):
            return {"n": x.n, "ids": _ids_digest(x.ids), "content": content_digest(x)}
        if isinstance(x, torch.nn.Module):
            return {"model": model_fp(x)}
        if hasattr(x, "model") and hasattr(x, "objective_fn"):   # a Task outside a Source
            return {"task": x.name, "model": model_fp(x.model)}
        if isinstance(x, Projector):
            return projector_dict(x)
        if isinstance(x, torch.Tensor):
            return {"tensor": tensor_digest(x)}
        if isinstance(x, ParamSpace):
            return [asdict(b) for b in x.blocks]
        if is_dataclass(x) and not isinstance(x, type):
            if type(x).__name__ == "RowWeights":
                return {"row_weights": x.name}
            return {type(x).__name__: {f.name: go(getattr(x, f.name)) for f in fields(x)}}
        if isinstance(x, (tuple, list)):
            return [go(v) for v in x]
        if isinstance(x, dict):
            return {str(k): go(v) for k, v in x.items()}
        if x is None or isinstance(x, (bool, int, float, str)):
            return x
        return repr(x)

    return go(value)


def projector_dict(p: Projector) -> dict:
    """The projector's fields (kind, k, seed, per_block, k_out, k_in, s, mask_k)."""
    return {f.name: getattr(p, f.name) for f in fields(p)}


def summary(node, fingerprints: dict | None = None) -> dict:
    """The readable metadata of an expression: projectors, layers, objectives, backends
    and model fingerprints of its leaves (each a list, usually of one), and its blocks.

    Leaves that are stores contribute what their own metadata says.
    """
    fp = {} if fingerprints is None else fingerprints
    out = {"projector": [], "layers": [], "objective": [], "backend": [], "model_fingerprint": [],
           "model_digest": []}

    def add(key, value):
        if value not in out[key]:
            out[key].append(value)

    for x in node.walk():
        if isinstance(x, Project):
            add("projector", projector_dict(x.projector))
        elif isinstance(x, Source):
            if id(x.task.model) not in fp:
                fp[id(x.task.model)] = model_fingerprint(x.task.model)
            add("layers", list(x.layers))
            add("objective", x.objective)
            add("backend", x.backend)
            add("model_fingerprint", fp[id(x.task.model)])
            identity = model_identity(x.task.model)
            if identity is not None:
                add("model_digest", identity)
        elif isinstance(x, (Stored, StoredOp)):
            inner = getattr(x.store, "summary", None) or {}
            for key in out:
                for value in inner.get(key, []):
                    add(key, value)
    return out


def store_attrs(kind: str, node) -> dict:
    """The attributes every store records about what it holds: kind, versions, projector,
    layers, objective, backend, model fingerprint and the expression (label and digest)."""
    from ..version import __version__
    from .layout import FORMAT_VERSION

    fingerprints: dict = {}
    info = summary(node, fingerprints)
    return {
        "gradalg_store": kind,
        "format_version": FORMAT_VERSION,
        "gradalg_version": __version__,
        **{k: info[k] for k in ("projector", "layers", "objective", "backend", "model_fingerprint", "model_digest")},
        "expression": node.label,
        "expression_digest": digest(describe(node, fingerprints)),
    }
