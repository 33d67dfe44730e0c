"""What one forward holds for its backward, and what it holds only while it runs, counted
on any device (the ``meta`` device included: shapes, no numbers).

:class:`HeldBytes` is a context manager around a grad-enabled forward. It counts

    saved    the distinct storages autograd saves for the backward (its
             ``saved_tensors_hooks``), split into ``dual`` (a saved tensor that needs the
             free parameters' gradient: under ``jvp`` of the gradient each carries a
             tangent per vector) and ``plain`` (a free layer's input, a mask, an index);
    working  the most bytes alive at once beside the saved ones: after each op (a
             ``TorchDispatchMode``: every op's outputs, freed when their last tensor is),
             the live storages that autograd has not saved. A forward without gradients
             holds about this much at its peak; forward-mode AD holds it once per vector
             (the tangents ride the same ops);
    peak     the most bytes alive at once, saved or not: around a whole ``torch.func``
             product (:func:`gradalg.curvature.hvp.held_per_example`), what it holds.

Storages, not tensors: a view of a saved tensor, or a tensor saved twice, counts once (its
storage is what stays in memory); storages of ``fixed`` tensors (parameters, buffers, the
batch: not made by the forward) never count. Used by the products job's memory
(:meth:`gradalg.plan.jobs.products.ProductsJob.per_example_bytes`, through
:func:`gradalg.plan.shapes._measure_on_meta`).
"""
from __future__ import annotations

import contextlib
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["HeldBytes"]


class HeldBytes(TorchDispatchMode):
    """``with HeldBytes(fixed) as held: fn(...)`` (``fixed``: tensors, or batches holding them); then ``held.plain``, ``held.dual`` (bytes
    saved for the backward), ``held.working`` (the most bytes alive at once that are not
    saved) and ``held.peak`` (the most bytes alive at once), storages of the tensors ``fixed``
    left out. ``saved=False``: no saved-tensor hooks (``torch.func``'s ``grad`` and ``vjp``
    refuse them), the live bytes only (``peak``)."""

    def __init__(self, fixed=(), saved: bool = True):
        super().__init__()
        self.fixed = {t.untyped_storage()._cdata for t in tree_flatten(list(fixed))[0] if isinstance(t, torch.Tensor)}
        self.live: dict = {}      # {storage id: [bytes, tensors alive on it, saved: None | dual flag]}
        self.now = self.saved_now = self.working = self.peak = 0
        self.plain = self.dual = 0
        # torch.func's grad / vjp refuse saved_tensors_hooks: ``saved=False`` counts the live bytes only
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t) if saved \
            else contextlib.nullcontext()

    def __enter__(self):
        self._hooks.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._hooks.__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._track(t)
        self.working = max(self.working, self.now - self.saved_now)
        self.peak = max(self.peak, self.now)
        return out

    def _track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self.fixed:
            return
        entry = self.live.get(key)
        if entry is None:
            entry = self.live[key] = [storage.nbytes(), 0, None]
            self.now += entry[0]
        entry[1] += 1
        weakref.finalize(t, self._drop, key)

    def _drop(self, key) -> None:
        entry = self.live.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] <= 0:
            del self.live[key]
            self.now -= entry[0]
            if entry[2] is not None:
                self.saved_now -= entry[0]

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        """Autograd's pack hook: the saved tensor's storage counted once, as dual if any tensor
        saved on it needs the free parameters' gradient."""
        key = t.untyped_storage()._cdata
        if key in self.fixed:
            return t
        entry = self.live.get(key)
        if entry is None:                 # made outside an op this mode saw: counted from here
            self._track(t)
            entry = self.live[key]
        if entry[2] is None:
            self.saved_now += entry[0]
            self.plain += entry[0]
            entry[2] = False
        if t.requires_grad and not entry[2]:
            self.plain -= entry[0]
            self.dual += entry[0]
            entry[2] = True
        return t
