"""Operator stores: the resolved numbers of an Operator (curvature, preconditioner).

    H = ga.fisher(P(G)).damp(1e-3)
    ga.store.write_operator(H, "fisher.zarr")       # runs the passes H needs, once
    H = ga.store.open_operator("fisher.zarr")       # an Operator; .inv(), @, ... as usual

What is kept is what the executor resolved: a diagonal ``diag`` (dim,), one matrix per
block ``block`` (d_b, d_b), a ``dense`` (dim, dim) matrix, a Kronecker eigenbasis
(``kron``: Q_S (out, out), Q_A (in, in) and eigenvalues (out, in) per block) or a
low-rank one (``lowrank``: eigenvalues (r,), vectors (dim, r)). Operators known only
through products (Hessian products, iterative inverses) have no numbers to keep.

The store is written into a temporary directory that is renamed into place, so a
path holds either the whole store or nothing.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from ..errors import GradalgError, StoreCorruptError, StoreIncompleteError, StoreMismatchError, OptionError
from ..linalg import KronOp, LinearOp, LowRankOp, ResolvedOp
from ..space import Block, ParamSpace
from ..expr.stored import StoredOp
from . import integrity, layout
from .describe import digest, store_attrs
from .gradients import _variables
from .rows import executor_for
from .layout import store_path

__all__ = ["write_operator", "open_operator", "OperatorStore"]

KIND = "operator"


def _np(t: torch.Tensor) -> np.ndarray:
    """The tensor's values; column-major tensors (eigenvectors from ``eigh``) stay column-major,
    so that products with the loaded numbers round exactly as with the originals."""
    a = t.detach().cpu().numpy()
    return np.asfortranarray(a) if t.dim() == 2 and not t.is_contiguous() and t.T.is_contiguous() else a


def _variables_of(resolved: LinearOp, space: ParamSpace) -> tuple[str, dict]:
    """(kind, {variable: (dims, values)}) of a resolved operator, by its form."""
    names = _variables(space)
    form = getattr(resolved, "form", None)
    if form == "kronecker":
        out = {}
        for b in space.blocks:
            v = names[b.name]
            Q_S, Q_A = resolved.bases[b.name]
            # an identity basis (a diagonal, vocabulary-wide factor) is not stored: absent on load
            if Q_S is not None:
                out[f"{v}.Q_S"] = ((f"{v}.out", f"{v}.out_eig"), _np(Q_S))
            if Q_A is not None:
                out[f"{v}.Q_A"] = ((f"{v}.in", f"{v}.in_eig"), _np(Q_A))
            out[f"{v}.eigenvalues"] = ((f"{v}.out_eig", f"{v}.in_eig"), _np(resolved.eigenvalues[b.name]))
        return "kron", out
    if form == "low-rank":
        return "lowrank", {"eigenvalues": (("rank",), _np(resolved.eigenvalues)),
                           "vectors": (("coord", "rank"), _np(resolved.vectors))}
    if form in ("diagonal", "block", "dense"):
        if resolved.kind == "diag":
            return "diag", {"diag": (("coord",), _np(resolved.data))}
        if resolved.kind == "dense":
            return "dense", {"dense": (("row", "col"), _np(resolved.data))}
        return "block", {names[n]: ((f"{names[n]}.row", f"{names[n]}.col"), _np(m))
                         for n, m in resolved.data.items()}
    raise GradalgError(
        f"{type(resolved).__name__} has no numbers to store: operators known only through "
        "products (ga.hessian, ga.gauss_newton, ga.datainf, iterative inverses) are recomputed, "
        "not stored. Store an explicit curvature (ga.fisher, ga.kfac, ga.ekfac) or ga.arnoldi(H, rank)")


def _describe(H) -> dict:
    blocks = [{"name": b.name, "shape": list(b.shape), "kind": b.kind, "basis": b.basis} for b in H.space.blocks]
    return dict(store_attrs(KIND, H.expr), blocks=blocks)



def _read_attrs(path) -> dict | None:
    try:
        attrs = dict(layout.open_dataset(path).attrs)
    except Exception:  # noqa: BLE001 - not a Zarr group
        return None
    return attrs if "gradalg_store" in attrs else None


def write_operator(H, path, *, executor=None, overwrite: bool = False):
    """Resolve the Operator ``H`` (running the passes its statistics need) and keep its
    numbers at ``path``; return :func:`open_operator` of it.

    A store of the same operator (same expression, model fingerprints and data) already
    at ``path`` is returned as it is; one of another operator raises
    :class:`StoreMismatchError` unless ``overwrite=True``.
    """
    path = store_path(path)   # a str or os.PathLike, else an OptionError
    from ..api import Operator

    layout.require()
    if not isinstance(H, Operator):
        raise OptionError(f"ga.store.write_operator takes an Operator, got {type(H).__name__}")
    attrs = _describe(H)
    if overwrite and Path(path).exists() and not layout.is_gradalg_store(path) and \
            not (Path(path).is_dir() and not any(Path(path).iterdir())):
        raise StoreMismatchError([f"{path} exists and is not a gradalg store"],
                                 "overwrite=True replaces only gradalg stores: choose another path, or "
                                 "delete it yourself")
    if Path(path).exists() and not overwrite:
        old = _read_attrs(path)
        if old is None:
            raise StoreMismatchError([f"{path} exists and is not a gradalg store"],
                                     "choose another path, or pass overwrite=True to replace it")
        layout.compare(old, attrs, ("gradalg_store", "projector", "layers", "objective", "model_fingerprint",
                                    "model_digest", "blocks", "expression_digest"), "this operator",
                       "pass overwrite=True to replace the store, or write to another path")
        return open_operator(path)
    with executor_for(executor) as ex:
        resolved = ex.operator(H.expr)
    kind, variables = _variables_of(resolved, H.space)
    attrs["kind"] = kind
    attrs["dtype"] = str(next(iter(variables.values()))[1].dtype)
    if kind == "kron" and resolved.eigenvalue_errors:
        # float32 factors' eigenvalue error bounds: a loaded operator refuses the inverses
        # they cannot certify, as the operator that was written does
        attrs["eigenvalue_errors"] = {name: float(e) for name, e in resolved.eigenvalue_errors.items()}
        attrs["float32_rtol"] = float(resolved.float32_rtol)

    def build(tmp):
        import xarray as xr
        ds = xr.Dataset(variables, attrs=integrity.seal(attrs))
        for name, (_, values) in variables.items():
            ds[name].attrs["order"] = "F" if values.ndim == 2 and not values.flags.c_contiguous else "C"
        ds.to_zarr(tmp, mode="w", consolidated=False, encoding=integrity.checksum_encoding(ds),
                   write_empty_chunks=True)

    layout.atomic_directory(path, build, overwrite=True)
    return open_operator(path)


class OperatorStore:
    """Loads an operator store's numbers (once per process; picklable)."""

    def __init__(self, path, attrs: dict):
        self.path = str(Path(path).resolve())
        self.attrs = attrs
        self.token = f"zarrop-{digest([self.path, attrs.get('expression_digest'), attrs.get('kind')])}"
        self.label = os.path.basename(self.path)
        self.description = {"operator": attrs.get("expression_digest")}
        self.summary = {k: attrs.get(k, []) for k in ("projector", "layers", "objective", "backend",
                                                      "model_fingerprint", "model_digest")}
        self._loaded = None

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_loaded"] = None
        return state

    @property
    def space(self) -> ParamSpace:
        return ParamSpace(tuple(Block(b["name"], tuple(b["shape"]), b["kind"], b["basis"])
                                for b in self.attrs["blocks"]))

    def load(self):
        if self._loaded is None:
            try:
                self._loaded = self._read()
            except (KeyError, OSError, ValueError, RuntimeError) as err:
                report = integrity.scan(self.path, full=True)
                report.raise_if_damaged("Write the operator again: ga.store.write_operator(H, path, overwrite=True)")
                raise StoreCorruptError(f"{self.path}: the operator store cannot be read ({type(err).__name__}: "
                                        f"{err}); write it again with overwrite=True") from err
        return self._loaded

    def _read(self):
        ds = layout.open_dataset(self.path)
        space, kind = self.space, self.attrs["kind"]

        def t(name):
            values = ds[name].values
            order = ds[name].attrs.get("order", "C")
            return torch.from_numpy(np.asfortranarray(values) if order == "F" else np.ascontiguousarray(values))

        names = _variables(space)
        if kind == "kron":
            def basis(name):   # absent: the identity basis of a diagonal factor
                return t(name) if name in ds.variables else None
            bases = {b.name: (basis(f"{names[b.name]}.Q_S"), basis(f"{names[b.name]}.Q_A")) for b in space.blocks}
            evals = {b.name: t(f"{names[b.name]}.eigenvalues") for b in space.blocks}
            if "eigenvalue_errors" in self.attrs:
                return KronOp(space, bases, evals, eigenvalue_errors=dict(self.attrs["eigenvalue_errors"]),
                              float32_rtol=float(self.attrs["float32_rtol"]))
            return KronOp(space, bases, evals)
        if kind == "lowrank":
            return LowRankOp(space, t("eigenvalues"), t("vectors"))
        if kind == "diag":
            return ResolvedOp(space, "diag", t("diag"))
        if kind == "dense":
            return ResolvedOp(space, "dense", t("dense"))
        return ResolvedOp(space, "block", {b.name: t(names[b.name]) for b in space.blocks})


def open_operator(path):
    """The Operator kept at ``path`` (see :func:`write_operator`): a leaf that the executor
    resolves by loading the numbers, usable like any Operator (``.inv()``, ``.damp()``,
    ``Q @ H @ G.T``)."""
    path = store_path(path)   # a str or os.PathLike, else an OptionError
    from ..api import Operator

    layout.require()
    attrs = _read_attrs(path)
    if attrs is None:
        if not Path(path).exists():
            raise FileNotFoundError(f"no operator store at {path}")
        raise StoreIncompleteError(f"{path} is not a gradalg operator store")
    if attrs["gradalg_store"] != KIND:
        raise StoreMismatchError([f"{path} is a {attrs['gradalg_store']} store, not an operator store"],
                                 "open it with ga.store.open or ga.store.open_scores")
    integrity.scan(path, full=False).raise_if_damaged(
        "Write the operator again: ga.store.write_operator(H, path, overwrite=True)")
    store = OperatorStore(path, attrs)
    structure = {"diag": "diag", "block": "block", "dense": "dense", "kron": "kron",
                 "lowrank": "lowrank"}[attrs["kind"]]
    return Operator(StoredOp(store, store.space, structure))
