"""Models that Dask workers build or load themselves, so that a task ships a reference
to the model instead of its weights.

A :class:`WorkerModel` says how to make the model: a function (``"pkg.module:build"`` or
a callable) with its arguments, a Hugging Face ``from_pretrained`` directory, or a torch
state dict and the function that builds the empty model. The Dask executor
(``ga.exec.DaskExecutor(client, model_fn=...)``) pickles each pass's payload with the
client's model — the module, its submodules, parameters and buffers, wherever they
appear — replaced by a :class:`ModelRef` (the factory, the client's architecture and
weight fingerprint: 155 kB for a 70B Llama configuration, whose 1,772 architecture lines
are most of it, against 141 GB of bfloat16 weights). On a worker, unpickling the
reference builds the model **once per worker process** (cached under
:attr:`WorkerModel.key`, a fingerprint of the factory and its arguments), moves it to the
worker's device and checks it:

* the architecture — every module's type and ``extra_repr``, every parameter's and
  buffer's name, shape and dtype — must equal the client's;
* the weights — :func:`gradalg.fingerprint.model_digest`, a digest of every byte — must
  equal the client's model's digest, or the ``fingerprint`` given to the factory when
  the client holds the model on the ``meta`` device (no weights). With neither, every
  worker must report the same digest (the executor compares them as shards finish).

Any difference is refused with a :class:`~gradalg.errors.ModelMismatchError` naming both
fingerprints: a model that differs silently would give silently wrong scores.

Results travel back the same way: rows a worker returns (``Chunk`` objects point at
their task) are pickled with the worker's model replaced by the key, which the client
resolves to its own model; tensors on an accelerator come back on the CPU.

Example::

    spec = ga.exec.WorkerModel("mypkg.models:build_gpt2", n_layer=4, seed=0)
    model = spec.meta()                    # the client plans on the meta device: no weights here
    task = ga.tasks.causal_lm(model)
    with ga.exec.DaskExecutor(client, model_fn=spec) as dx:
        scores = ga.methods.grad_dot(task, train, queries).compute(executor=dx)
"""
from __future__ import annotations

import functools
import hashlib
import importlib
import io
import os
import pickle
import threading
import weakref
from collections import Counter
from dataclasses import dataclass

import torch
from torch import nn

from ..errors import ModelMismatchError, OptionError
from ..fingerprint import callable_fingerprint, is_meta_model, model_digest, model_structure, stable_token

__all__ = ["WorkerModel", "ModelRef", "as_worker_model", "worker_device",
           "worker_model_builds", "pack", "unpack"]


def _h(*parts) -> str:
    return hashlib.blake2b("|".join(map(str, parts)).encode(), digest_size=12).hexdigest()


# ------------------------------------------------------------------ the factory
class WorkerModel:
    """How a worker makes the model: ``fn(*args, **kwargs)``, moved to ``device``.

    Parameters
    ----------
    fn : a callable returning an ``nn.Module``, or its import path ``"pkg.module:name"``
        (resolved on the worker; the client need not import it). A callable is pickled by
        reference when its module is importable on the workers (cloudpickle otherwise).
    *args, **kwargs : passed to ``fn``; part of :attr:`key`.
    device : where the worker places the model: ``"auto"`` (the worker's accelerator,
        ``torch.accelerator.current_accelerator()``, when one is visible; else the CPU),
        or a device string (``"cpu"``, ``"cuda"``).
    fingerprint : the expected :func:`~gradalg.fingerprint.model_digest` of the built
        model. Needed only when the client holds the model on the ``meta`` device and the
        digest is known (from a store's metadata, or ``model_digest(spec.build())`` once).

    Example::

        WorkerModel("mypkg.models:mlp", d_in=8, seed=0)
        WorkerModel.from_pretrained("/ckpt/qwen2-7b", torch_dtype=torch.bfloat16)
        WorkerModel.from_state_dict("/ckpt/model.pt", "mypkg.models:mlp", d_in=8)
    """

    def __init__(self, fn, *args, device: str = "auto", fingerprint: str | None = None, **kwargs):
        if not (callable(fn) or (isinstance(fn, str) and ":" in fn)):
            raise OptionError(f"WorkerModel needs a callable or an import path 'pkg.module:name', got {fn!r}")
        self.fn = fn
        self.args = tuple(args)
        self.kwargs = dict(kwargs)
        self.device = device
        self.fingerprint = fingerprint
        self._meta_fn = None

    @classmethod
    def from_pretrained(cls, path, model_class=None, *, device: str = "auto", fingerprint: str | None = None,
                        **kwargs) -> "WorkerModel":
        """A Hugging Face checkpoint directory, loaded on each worker with
        ``model_class.from_pretrained(path, **kwargs)``. ``model_class``: a class, an import
        path ``"transformers:GPT2LMHeadModel"``, or None (the first of the config's
        ``architectures``). Pass ``torch_dtype`` when the weights are not float32: the
        client's meta model (:meth:`meta`) is built from the config with that dtype."""
        spec = cls(_load_pretrained, os.fspath(path), _class_path(model_class), device=device,
                   fingerprint=fingerprint, **kwargs)
        spec._meta_fn = _meta_pretrained
        return spec

    @classmethod
    def from_state_dict(cls, path, build, *args, device: str = "auto", fingerprint: str | None = None,
                        **kwargs) -> "WorkerModel":
        """A ``torch.save``d state dict at ``path``, loaded (``weights_only=True``, strict)
        into ``build(*args, **kwargs)`` on each worker. ``build`` is a callable or
        ``"pkg.module:name"``."""
        spec = cls(_load_state_dict, os.fspath(path), build, args, kwargs, device=device, fingerprint=fingerprint)
        spec._meta_fn = _meta_state_dict
        return spec

    @property
    def key(self) -> str:
        """Fingerprint of the factory and its arguments (and a checkpoint file's size and
        modification time where this process can see it): the worker's cache key."""
        fn = self.fn if isinstance(self.fn, str) else callable_fingerprint(self.fn)
        files = [_file_stamp(a) for a in self.args if isinstance(a, str)]
        return "workermodel-" + _h(fn, stable_token(self.args), stable_token(self.kwargs), self.device, files)

    def build(self) -> nn.Module:
        """Make the model in this process (on the device ``fn`` puts it on)."""
        model = _resolve_callable(self.fn)(*self.args, **self.kwargs)
        if not isinstance(model, nn.Module):
            raise OptionError(f"the model factory {self.fn!r} returned {type(model).__name__}, not an nn.Module")
        return model

    def meta(self) -> nn.Module:
        """The model on the ``meta`` device: its architecture, shapes and dtypes and no
        weights (no memory), for planning on a client that never holds the weights."""
        with torch.device("meta"):
            return self._meta_fn(*self.args, **self.kwargs) if self._meta_fn is not None else self.build()

    def __repr__(self):
        name = self.fn if isinstance(self.fn, str) else getattr(self.fn, "__qualname__", repr(self.fn))
        return f"WorkerModel({name}, key={self.key})"


def as_worker_model(spec) -> WorkerModel:
    """A :class:`WorkerModel` from what ``DaskExecutor(model_fn=...)`` accepts: a
    WorkerModel, a callable, ``"pkg.module:name"``, or a Hugging Face checkpoint directory."""
    if isinstance(spec, WorkerModel):
        return spec
    if isinstance(spec, (str, os.PathLike)) and os.path.isdir(spec):
        return WorkerModel.from_pretrained(spec)
    if isinstance(spec, (str, os.PathLike)) and os.path.isfile(spec):
        raise OptionError(f"{os.fspath(spec)!r} is a file: a state dict needs the function that builds its model, "
                        "WorkerModel.from_state_dict(path, 'pkg.module:build', ...)")
    if callable(spec) or (isinstance(spec, str) and ":" in spec):
        return WorkerModel(spec)
    raise OptionError(f"model_fn must be a WorkerModel, a callable, 'pkg.module:name' or a checkpoint directory, "
                    f"got {spec!r}")


def _resolve_callable(fn):
    if callable(fn):
        return fn
    module, _, name = fn.partition(":")
    return functools.reduce(getattr, name.split("."), importlib.import_module(module))


def _class_path(model_class):
    if model_class is None or isinstance(model_class, str):
        return model_class
    return f"{model_class.__module__}:{model_class.__qualname__}"


def _hf_class(path: str, model_class):
    if model_class is not None:
        return _resolve_callable(model_class)
    import transformers
    config = transformers.AutoConfig.from_pretrained(path)
    names = getattr(config, "architectures", None) or []
    if not names:
        raise OptionError(f"{path}: the config names no architecture; pass model_class=")
    return getattr(transformers, names[0])


def _load_pretrained(path: str, model_class=None, **kwargs) -> nn.Module:
    return _hf_class(path, model_class).from_pretrained(path, **kwargs)


def _meta_pretrained(path: str, model_class=None, **kwargs) -> nn.Module:
    import transformers
    config = transformers.AutoConfig.from_pretrained(path)
    model = _hf_class(path, model_class)(config)
    # the dtype from_pretrained loads in: the one asked for, else the checkpoint's (transformers
    # >= 5 loads with dtype="auto"; older versions in float32: the worker's check says so)
    dtype = kwargs.get("dtype", kwargs.get("torch_dtype", getattr(config, "dtype", None)))
    return model.to(dtype) if isinstance(dtype, torch.dtype) else model


def _meta_state_dict(path: str, build, args=(), kwargs=None) -> nn.Module:
    return _resolve_callable(build)(*args, **(kwargs or {}))


def _load_state_dict(path: str, build, args=(), kwargs=None) -> nn.Module:
    model = _meta_state_dict(path, build, args, kwargs)
    model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True), strict=True)
    return model


def _file_stamp(path: str):
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return None
    if os.path.isdir(path):
        return [(name, _file_stamp(os.path.join(path, name))) for name in sorted(os.listdir(path))]
    return (st.st_size, st.st_mtime_ns)


# ------------------------------------------------------------------ the worker's device and the reference
def worker_device(device: str = "auto") -> torch.device:
    """The device a worker places its model on: ``"auto"`` is the accelerator this process
    sees (one per worker when ``CUDA_VISIBLE_DEVICES`` is pinned), else the CPU."""
    if device != "auto":
        return torch.device(device)
    acc = getattr(torch, "accelerator", None)
    if acc is not None and acc.is_available():
        return torch.device(acc.current_accelerator().type, acc.current_device_index())
    return torch.device("cpu")


@dataclass(frozen=True)
class ModelRef:
    """What a task ships instead of a model: the factory, the client's architecture and
    (when the client holds weights, or the factory declares them) its weights' digest."""

    factory: WorkerModel
    key: str                     # factory.key as the client computed it (a worker may see other file times)
    structure: tuple[str, ...]
    expected: str | None
    name: str = "model"


def make_ref(model: nn.Module, factory: WorkerModel, name: str = "model") -> ModelRef:
    """The reference to the client's ``model`` made by ``factory``; checks here what can be
    checked here (a declared fingerprint against the client's weights)."""
    structure, key = model_structure(model), factory.key
    if is_meta_model(model):
        return ModelRef(factory, key, structure, factory.fingerprint, name)
    digest = model_digest(model)
    if factory.fingerprint is not None and factory.fingerprint != digest:
        raise ModelMismatchError(
            f"the client's model {name} has fingerprint {digest}, but its factory {factory!r} declares "
            f"fingerprint={factory.fingerprint}: pass the fingerprint of these weights, or build the client's "
            "model with the factory (spec.build(), or spec.meta() to hold no weights here)")
    return ModelRef(factory, key, structure, digest, name)


# ------------------------------------------------------------------ the worker's cache
_LOCK = threading.Lock()
_MODELS: dict[str, tuple[nn.Module, str, tuple]] = {}   # key -> (model, digest, structure)
_BUILDS: Counter = Counter()


def worker_model_builds() -> dict[str, int]:
    """How many times this process built each factory's model, by :attr:`WorkerModel.key`
    (once per worker: ``client.run(worker_model_builds)``)."""
    return dict(_BUILDS)


def worker_models_seen() -> dict[str, str]:
    """Key -> weights digest of the models this process holds."""
    return {key: entry[1] for key, entry in _MODELS.items()}


def forget_worker_models() -> None:
    """Drop this process's built models (frees their memory; the next task builds again)."""
    with _LOCK:
        _MODELS.clear()


def resolve(ref: ModelRef) -> nn.Module:
    """The worker's model for ``ref``: built once per process, placed on the worker's
    device, and checked against the client's architecture and weights."""
    with _LOCK:
        entry = _MODELS.get(ref.key)
        if entry is None:
            model = ref.factory.build()
            digest, structure = model_digest(model), model_structure(model)   # before the move: no copies back
            model = model.to(worker_device(ref.factory.device))
            _BUILDS[ref.key] += 1
            entry = _MODELS[ref.key] = (model, digest, structure)
    model, digest, structure = entry
    if structure != ref.structure:
        client, worker = set(ref.structure), set(structure)
        only_client = [s for s in ref.structure if s not in worker][:3]
        only_worker = [s for s in structure if s not in client][:3]
        raise ModelMismatchError(
            f"the worker's model {ref.name} built by {ref.factory!r} (architecture "
            f"{_h(*structure)}) is not the client's (architecture {_h(*ref.structure)}): the client has "
            f"{only_client or 'nothing else'}, the worker {only_worker or 'nothing else'}. Build both from the "
            "same factory and arguments (dtype included): spec.meta() or spec.build() on the client")
    if ref.expected is not None and digest != ref.expected:
        raise ModelMismatchError(
            f"the worker's model {ref.name} built by {ref.factory!r} has fingerprint {digest}, the client's "
            f"has {ref.expected}: same architecture, different weights. Make the factory deterministic (seed "
            "its initialization, load the checkpoint the client's weights come from), or build the client's "
            "model with the same factory (spec.build(), or spec.meta() to hold no weights on the client)")
    return model


# ------------------------------------------------------------------ pickling with references
def _worker_part(ref: ModelRef, getter: str, name: str):
    return getattr(resolve(ref), getter)(name)


_CLIENT: weakref.WeakValueDictionary[str, nn.Module] = weakref.WeakValueDictionary()


def register_client_model(key: str, model: nn.Module) -> None:
    """Results that name ``key`` resolve to ``model`` in this process (the client)."""
    _CLIENT[key] = model


def _client_part(key: str, getter: str, name: str):
    model = _CLIENT.get(key)
    if model is None:
        raise ModelMismatchError(f"a result names the model {key}, which this process no longer holds")
    return getattr(model, getter)(name)


def model_parts(model: nn.Module):
    """(object, getter, name) of a model (the module named ""), its submodules, parameters and
    buffers: ``getattr(model, getter)(name)`` is the object (``get_submodule``, ...)."""
    yield from ((m, "get_submodule", name) for name, m in model.named_modules())
    yield from ((p, "get_parameter", name) for name, p in model.named_parameters())
    yield from ((b, "get_buffer", name) for name, b in model.named_buffers())


def _unchanged(t):
    return t


try:
    import cloudpickle
    _Base = cloudpickle.Pickler
except ImportError:          # dask installs cloudpickle; plain pickle elsewhere
    _Base = pickle.Pickler


class _RefPickler(_Base):
    """Pickles with registered objects replaced by ``(function, args)`` references, and
    (``to_cpu``) tensors off the CPU copied to it."""

    def __init__(self, file, refs: dict, to_cpu: bool):
        super().__init__(file, protocol=5)
        self._refs = refs
        self._to_cpu = to_cpu

    def reducer_override(self, obj):
        hit = self._refs.get(id(obj))
        if hit is not None and hit[0] is obj:
            return hit[1]
        if self._to_cpu and isinstance(obj, torch.Tensor) and obj.device.type not in ("cpu", "meta"):
            return _unchanged, (obj.detach().cpu(),)
        parent = getattr(super(), "reducer_override", None)
        return parent(obj) if parent is not None else NotImplemented


def pack(obj, models=(), *, to_cpu: bool = False) -> bytes:
    """Pickle ``obj`` with each ``(model, reduce)`` in ``models`` replaced by a reference:
    ``reduce(getter, name)`` gives the ``(function, args)`` that rebuilds each part (the
    model, a submodule, a parameter, a buffer: :func:`model_parts`) where the bytes are loaded."""
    refs = {}
    for model, reduce in models:
        for part, getter, name in model_parts(model):
            refs.setdefault(id(part), (part, reduce(getter, name)))
    buf = io.BytesIO()
    _RefPickler(buf, refs, to_cpu).dump(obj)
    return buf.getvalue()


def unpack(blob: bytes):
    """Load what :func:`pack` wrote (references resolve to this process's models)."""
    return pickle.loads(blob)


def to_workers(model: nn.Module, ref: ModelRef):
    """``(model, reduce)`` for :func:`pack`: the client's ``model`` travels as ``ref``."""
    return model, lambda getter, name: (_worker_part, (ref, getter, name))


def to_client(model: nn.Module, key: str):
    """``(model, reduce)`` for :func:`pack`: the worker's ``model`` travels back as ``key``."""
    return model, lambda getter, name: (_client_part, (key, getter, name))
