"""Stable fingerprints: names for tensors, models, functions and datasets that are the
same in every process and on every machine that holds the same thing.

A node's token (``gradalg.expr.base``) is built from these, so a job pickled to a Dask
worker, or an expression rebuilt in another process, keeps its identity.

* **tensors**: a blake2b digest of the shape, dtype and *every* byte (no size
  threshold). Digests are cached per tensor object and invalidated by the tensor's
  version counter (bumped by every in-place op, ``optimizer.step()`` included) and its
  storage pointer (``p.data = ...``). The one change the cache cannot see is an
  in-place write through ``p.data`` / ``p.detach()`` (they bypass the version
  counter): call :func:`forget` after such a write, or set
  ``ga.options(fingerprint_cache=False)``.
* **models**: the module tree (types and ``extra_repr``) plus the digest of every
  parameter and buffer. The first fingerprint of a model reads its weights once
  (``benchmarks/fingerprint.py`` measures it); later ones only check versions.
* **functions**: module, qualified name, bytecode and constants, defaults and the
  fingerprints of the closure's cells (a loss closing over a temperature differs from
  one closing over another).
* **datasets and other objects**: ``__gradalg_fingerprint__()`` or
  ``__dask_tokenize__()`` when defined, Hugging Face's ``_fingerprint``, else a digest
  of the object's pickle in which tensors, arrays, modules and functions are replaced
  by their fingerprints. An object that cannot be pickled gets a random name kept for
  its lifetime (:func:`is_stable` says so): equal to itself, never to another object.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import hashlib
import itertools
import inspect
import io
import pickle
import types
import uuid
import weakref

import torch

from .dtensor import local_shard

__all__ = ["tensor_digest", "model_digest", "digests_held", "stable_model_digest", "is_meta_model", "model_structure", "callable_fingerprint", "object_fingerprint", "stable_token",
           "forget", "is_stable"]

_DIGEST_SIZE = 12
_CHUNK_BYTES = 1 << 26        # tensors are hashed 64 MiB at a time (bounded extra memory on a GPU)


def _h(*parts) -> str:
    h = hashlib.blake2b(digest_size=_DIGEST_SIZE)
    for p in parts:
        h.update(p if isinstance(p, bytes) else str(p).encode())
        h.update(b"|")
    return h.hexdigest()


def _cache_enabled() -> bool:
    from .options import get_options
    return get_options().fingerprint_cache


# ------------------------------------------------------------------ per-object caches
class _Cache:
    """id(obj) -> (weakref, stamp, value); an entry is valid while the object lives and
    its stamp (version counter, storage pointer) is unchanged."""

    def __init__(self):
        self._entries: dict[int, tuple] = {}

    def get(self, obj, stamp):
        entry = self._entries.get(id(obj))
        if entry is None:
            return None
        ref, old_stamp, value = entry
        if ref() is not obj or old_stamp != stamp:
            return None
        return value

    def put(self, obj, stamp, value):
        key = id(obj)
        try:
            ref = weakref.ref(obj, lambda _r, key=key: self._entries.pop(key, None))
        except TypeError:
            return
        self._entries[key] = (ref, stamp, value)

    def drop(self, obj):
        self._entries.pop(id(obj), None)

    def clear(self):
        self._entries.clear()


_tensor_cache = _Cache()
_random_names = _Cache()


def forget(obj=None) -> None:
    """Drop cached fingerprints: of ``obj`` (a tensor, or a model's parameters and
    buffers), or of everything when ``obj`` is None. Needed only after writing into a
    tensor through ``.data`` (a write its version counter does not see)."""
    if obj is None:
        _tensor_cache.clear()
        return
    if isinstance(obj, torch.nn.Module):
        for t in list(obj.parameters()) + list(obj.buffers()):
            _tensor_cache.drop(t)
    else:
        _tensor_cache.drop(obj)


# ------------------------------------------------------------------ tensors
def _tensor_stamp(t: torch.Tensor):
    """What a cached digest of ``t`` is valid for: its version counter, storage and layout.
    A DTensor (FSDP2) is written through either of two counters: its own (an optimizer's
    step on the DTensor) or its local shard's (``p.to_local().copy_(...)``, as a checkpoint
    loader writes this rank's shard), each not bumping the other; both are in the stamp,
    and the shard's storage (the DTensor's ``data_ptr()`` is 0)."""
    local = local_shard(t)
    try:
        ptr = local.data_ptr()
    except RuntimeError:
        ptr = None
    return (t._version, local._version if local is not t else None, ptr, tuple(t.shape),
            tuple(t.stride()) if t.layout == torch.strided else None,
            t.storage_offset() if t.layout == torch.strided else None, t.dtype, str(t.device))


def _hash_tensor(t: torch.Tensor) -> str:
    h = hashlib.blake2b(digest_size=_DIGEST_SIZE)
    h.update(f"{tuple(t.shape)}|{t.dtype}|".encode())
    t = t.detach()
    # a DTensor (FSDP2 / tensor parallel): this rank's shard (with one rank, the whole
    # tensor: the same digest as the unsharded parameter; the header has the global shape)
    t = local_shard(t)
    if t.is_sparse:
        t = t.coalesce()
        h.update(b"sparse|")
        h.update(bytes.fromhex(_hash_tensor(t.indices())))
        t = t.values()
    if t.is_quantized:
        t = t.dequantize()
    flat = t.reshape(-1)
    if flat.numel() == 0:
        return h.hexdigest()
    step = max(1, _CHUNK_BYTES // max(1, flat.element_size()))
    for a in range(0, flat.numel(), step):
        part = flat[a:a + step].contiguous().cpu()
        if part.untyped_storage().data_ptr() == t.untyped_storage().data_ptr():
            # a view of the tensor's own storage: NumPy would pin it (a storage exported to
            # NumPy can no longer be resized, and FSDP2 frees unsharded weights by resizing)
            part = part.clone()
        h.update(part.view(torch.uint8).numpy().tobytes() if part.dtype != torch.uint8 else part.numpy().tobytes())
    return h.hexdigest()


def tensor_digest(t: torch.Tensor) -> str:
    """Digest of ``t``'s shape, dtype and every value (cached per tensor version).

    Tensors on the ``meta`` device have no values: their name is random (per object),
    see :func:`is_stable`."""
    if t.device.type == "meta":
        return "meta" + str(tuple(t.shape)) + str(t.dtype) + "-" + _random_name(t)
    if not _cache_enabled():
        return _hash_tensor(t)
    stamp = _tensor_stamp(t)
    value = _tensor_cache.get(t, stamp)
    if value is None:
        value = _hash_tensor(t)
        _tensor_cache.put(t, stamp, value)
    return value


# ------------------------------------------------------------------ models
def _unsharded_class(cls: type) -> type:
    """The module class under FSDP2's ``fully_shard``, which swaps a module's class for a
    generated ``FSDP<Class>`` subclass (sharding does not change the model)."""
    for base in cls.__mro__:
        if not (base.__name__.startswith("FSDP") and base.__module__.startswith("torch.distributed")):
            return base
    return cls


def _fsdp_sharded_params(model: torch.nn.Module) -> dict[int, torch.Tensor]:
    """``{id(unsharded parameter): its sharded DTensor}`` for the FSDP2 units of ``model``.

    Between a forward and the reshard that follows it (the root unit keeps its weights
    gathered after a forward), FSDP2 registers the whole weights as the module's
    parameters; the digest reads the shard instead, so a model's token does not depend
    on where it is in a forward/backward."""
    out = {}
    for m in model.modules():
        get_state = getattr(m, "_get_fsdp_state", None)
        if get_state is None:
            continue
        try:
            group = get_state()._fsdp_param_group
            params = group.fsdp_params if group is not None else ()
            for p in params:
                unsharded = getattr(p, "_unsharded_param", None)
                if unsharded is not None:
                    out[id(unsharded)] = p.sharded_param
        except Exception:  # noqa: BLE001 - another torch's FSDP internals: digest what is registered
            continue
    return out


#: ``{id(module): (module, digest)}`` inside :func:`digests_held`, else None
_HELD: contextvars.ContextVar[dict | None] = contextvars.ContextVar("gradalg_model_digests", default=None)


@contextlib.contextmanager
def digests_held():
    """Within the block each module's :func:`model_digest` is computed once, for work during
    which no model changes (one plan; one task token, whose loss closures hold the model
    again). Walking an 80-layer module tree (types, ``extra_repr``, a version check per
    tensor) took 0.06 s, and planning a 70B model walked it 120 times. Nested blocks
    share the outermost's digests; outside any block every call walks the model."""
    if _HELD.get() is not None:
        yield
        return
    token = _HELD.set({})
    try:
        yield
    finally:
        _HELD.reset(token)


def model_digest(model: torch.nn.Module) -> str:
    """Digest of a module tree (types, ``extra_repr``) and all its parameters and buffers.

    An FSDP2 (``fully_shard``) parameter is digested as this rank's shard (its DTensor),
    also while FSDP has the whole weight registered: a sharded model's digest is per rank.
    Inside :func:`digests_held` a module is walked once."""
    held = _HELD.get()
    if held is not None:
        kept = held.get(id(model))
        if kept is not None and kept[0] is model:
            return kept[1]
        held[id(model)] = (model, _model_digest(model))
        return held[id(model)][1]
    return _model_digest(model)


def _model_digest(model: torch.nn.Module) -> str:
    # one walk of the module tree collects what named_modules / named_parameters /
    # named_buffers would list (same names, order and de-duplication of shared tensors):
    # three walks of an 80-layer model were most of planning a 70B model's time
    parts, params, buffers = [], [], []
    sharded = _fsdp_sharded_params(model)
    seen_params, seen_buffers = set(), set()
    for name, m in model.named_modules():
        cls = _unsharded_class(type(m))
        parts.append(f"{name}:{cls.__module__}.{cls.__qualname__}({m.extra_repr()})")
        prefix = name + "." if name else ""
        for out, seen, kind, members in ((params, seen_params, "p", m._parameters),
                                         (buffers, seen_buffers, "b", m._buffers)):
            for key, t in members.items():
                if t is None or id(t) in seen:
                    continue
                seen.add(id(t))
                out.append(f"{kind}:{prefix}{key}:{tensor_digest(sharded.get(id(t), t))}")
    return "model-" + _h(*parts, *params, *buffers)


def stable_model_digest(model: torch.nn.Module) -> str | None:
    """:func:`model_digest`, or None for a model with tensors on the ``meta`` device (no
    values: its digest names this object only, so it cannot be compared with one written
    by another process, a store's)."""
    return None if is_meta_model(model) else model_digest(model)


def is_meta_model(model: torch.nn.Module) -> bool:
    """Whether any parameter or buffer of ``model`` is on the ``meta`` device (no weights)."""
    return any(t.is_meta for t in itertools.chain(model.parameters(), model.buffers()))


def model_structure(model: torch.nn.Module) -> tuple[str, ...]:
    """The model's architecture without its values: each module's path, type and
    ``extra_repr``, and each parameter's and buffer's name, shape and dtype. Equal for a
    model and its ``meta``-device twin (:func:`model_digest` adds the values)."""
    lines = [f"{name}:{type(m).__module__}.{type(m).__qualname__}({m.extra_repr()})"
             for name, m in model.named_modules()]
    for kind, named in (("p", model.named_parameters()), ("b", model.named_buffers())):
        lines += [f"{kind}:{name}:{tuple(t.shape)}:{t.dtype}" for name, t in named]
    return tuple(lines)


# ------------------------------------------------------------------ functions
def code_digest(code: types.CodeType) -> str:
    consts = [(code_digest(c) if isinstance(c, types.CodeType) else repr(c)) for c in code.co_consts]
    return _h(code.co_code, consts, code.co_names, code.co_varnames, code.co_freevars)


def callable_fingerprint(fn, _depth: int = 0) -> str:
    """Fingerprint of a function (code, defaults, closure), a bound method (function and
    its object), a ``functools.partial``, or any other callable object (by its state)."""
    if isinstance(fn, functools.partial):
        return "partial-" + _h(callable_fingerprint(fn.func, _depth + 1),
                               stable_token(fn.args, _depth + 1), stable_token(fn.keywords, _depth + 1))
    if inspect.ismethod(fn):
        return "method-" + _h(callable_fingerprint(fn.__func__, _depth + 1), stable_token(fn.__self__, _depth + 1))
    code = getattr(fn, "__code__", None)
    if isinstance(code, types.CodeType):
        cells = []
        for cell in fn.__closure__ or ():
            try:
                cells.append(stable_token(cell.cell_contents, _depth + 1))
            except ValueError:           # an empty cell
                cells.append("empty")
        return "fn-" + _h(getattr(fn, "__module__", ""), getattr(fn, "__qualname__", ""), code_digest(code),
                          stable_token(fn.__defaults__, _depth + 1),
                          stable_token(fn.__kwdefaults__, _depth + 1), cells)
    if isinstance(fn, (types.BuiltinFunctionType, types.BuiltinMethodType)):
        return f"builtin-{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', repr(fn))}"
    return object_fingerprint(fn, _depth + 1)


# ------------------------------------------------------------------ generic objects
_MAX_DEPTH = 8


class _FingerprintPickler(pickle.Pickler):
    """Pickles an object with tensors, arrays, modules and functions replaced by their
    fingerprints (so the stream does not depend on memory addresses)."""

    def __init__(self, file, depth: int):
        super().__init__(file, protocol=4)
        self._depth = depth

    def persistent_id(self, obj):
        if isinstance(obj, (torch.Tensor, torch.nn.Module, types.FunctionType, types.MethodType,
                            functools.partial)):
            return stable_token(obj, self._depth + 1)
        if type(obj).__module__ == "numpy" and type(obj).__name__ == "ndarray":
            if obj.dtype == object:
                return None
            return "ndarray" + str(obj.shape) + str(obj.dtype) + _h(obj.tobytes())
        if obj is not self._root and hasattr(obj, "__len__") and hasattr(obj, "__getitem__") \
                and not isinstance(obj, (str, bytes, tuple, list, dict, set, frozenset, range)):
            special = _declared_fingerprint(obj)
            if special is not None:
                return special
        return None

    def dump(self, obj):
        self._root = obj
        return super().dump(obj)


def _declared_fingerprint(obj) -> str | None:
    for attr in ("__gradalg_fingerprint__", "__dask_tokenize__"):
        method = getattr(type(obj), attr, None)
        if method is not None:
            return f"{type(obj).__qualname__}-" + _h(repr(method(obj)))
    hf = getattr(obj, "_fingerprint", None)     # Hugging Face datasets
    if isinstance(hf, str):
        return f"hf-{hf}"
    return None


def _random_name(obj) -> str:
    name = _random_names.get(obj, None)
    if name is None:
        name = "!obj" + uuid.uuid4().hex[:16]
        _random_names.put(obj, None, name)
    return name


def is_stable(token: str) -> bool:
    """Whether ``token`` is the same in other processes (no random per-object name in it)."""
    return "!obj" not in token


def object_fingerprint(obj, _depth: int = 0) -> str:
    """Fingerprint of an arbitrary object (a dataset): see the module docstring."""
    special = _declared_fingerprint(obj)
    if special is not None:
        return special
    name = f"{type(obj).__module__}.{type(obj).__qualname__}"
    if _depth <= _MAX_DEPTH:
        buf = io.BytesIO()
        try:
            _FingerprintPickler(buf, _depth).dump(obj)
            return f"{type(obj).__name__}-" + _h(name, buf.getvalue())
        except Exception:  # noqa: BLE001 - unpicklable: a random name for its lifetime
            pass
    return f"{type(obj).__name__}-{_random_name(obj)}"


def stable_token(value, _depth: int = 0) -> str:
    """A string standing for ``value`` that is the same in every process holding it."""
    if value is None or isinstance(value, (bool, int, float, complex, str, bytes)):
        return repr(value)
    if isinstance(value, torch.Tensor):
        return f"tensor{tuple(value.shape)}{value.dtype}-{tensor_digest(value)}"
    if isinstance(value, (torch.dtype, torch.device)):
        return str(value)
    if isinstance(value, torch.nn.Module):
        return model_digest(value)
    if isinstance(value, (tuple, list)):
        return "(" + ",".join(stable_token(v, _depth + 1) for v in value) + ")"
    if isinstance(value, dict):
        return "{" + ",".join(f"{stable_token(k, _depth + 1)}:{stable_token(v, _depth + 1)}"
                              for k, v in value.items()) + "}"
    if isinstance(value, (set, frozenset)):
        return "{" + ",".join(sorted(stable_token(v, _depth + 1) for v in value)) + "}"
    token = getattr(value, "token", None)
    if isinstance(token, str):
        return token
    if callable(value) and not isinstance(value, type):
        return callable_fingerprint(value, _depth)
    if isinstance(value, type):
        return f"type-{value.__module__}.{value.__qualname__}"
    return object_fingerprint(value, _depth)
