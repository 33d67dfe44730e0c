"""Uses of a recorded weight outside the modules that record it.

Hook capture sees a parameter through the calls of the modules holding it. A weight also
used by other code — a hand-written tied head ``logits = h @ emb.weight.T`` or
``F.linear(h, emb.weight)`` in the model's own forward — has the gradient

    G_i = Σ_{recorded calls} D_iᵀ A_i  +  (the gradient through the other uses)

and hooks would return the first term only: a silently partial gradient. While the first
batch of a (model, layers) pair is recorded, :class:`OutsideUses` (a
``TorchFunctionMode``) watches every torch function whose arguments include a recorded
parameter and whose result carries a gradient (``grad_fn`` set: ``.detach()``, reads of
``dtype`` / ``device`` and ``no_grad`` code do not count); such a use is legitimate when a
module recording that parameter is in the chain of module calls in progress
(:class:`~gradalg.capture.provenance.CallStack`): its own forward (``nn.Linear``), the
replayed module around it (``nn.MultiheadAttention``'s ``out_proj``), any holder of a tied
block. Any other use is refused (:class:`~gradalg.errors.PartialGradientError`), naming
the parameter, the function and the fix.

Checked once per model and layer selection (a weak reference to the model keeps the
record); compiled models are not traced (a function mode would change their graphs).
"""
from __future__ import annotations

import contextlib
import weakref

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from ..errors import PartialGradientError
from .layers import replaying

__all__ = ["OutsideUses", "needs_check", "mark_checked"]

_CHECKED: "weakref.WeakKeyDictionary[nn.Module, set]" = weakref.WeakKeyDictionary()


def _key(layers) -> tuple:
    return tuple(ref.name for ref in layers)


def needs_check(model: nn.Module | None, layers) -> bool:
    """Whether this (model, layers) pair has not been traced yet (and can be)."""
    if model is None or any(getattr(m, "_compiled_call_impl", None) is not None or type(m).__name__ == "OptimizedModule"
                            for m in model.modules()):
        return False
    try:
        return _key(layers) not in _CHECKED.get(model, set())
    except TypeError:           # a model that cannot be weakly referenced: trace every batch
        return True


def mark_checked(model: nn.Module, layers) -> None:
    try:
        _CHECKED.setdefault(model, set()).add(_key(layers))
    except TypeError:
        pass


@contextlib.contextmanager
def untraced(model: nn.Module, layers):
    """Skip the first-batch trace of (model, layers) inside the block, and restore it after:
    ``ga.check_model`` compares the captured gradients with autograd's itself and reports the
    difference as a finding (with its numbers) instead of this refusal."""
    try:
        had = _key(layers) in _CHECKED.get(model, set())
    except TypeError:
        had = True
    mark_checked(model, layers)
    try:
        yield
    finally:
        if not had:
            _CHECKED.get(model, set()).discard(_key(layers))


def _function_name(func) -> str:
    owner = getattr(func, "__self__", None)
    if getattr(func, "__name__", "") == "__get__" and hasattr(owner, "__name__"):
        return f"Tensor.{owner.__name__}"          # a property: emb.weight.T
    return getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or str(func)


class OutsideUses(TorchFunctionMode):
    """Records differentiable uses of the ``layers``' parameters made while no module that
    records them is running. ``stack``: the recorder's :class:`CallStack`."""

    def __init__(self, layers, stack):
        super().__init__()
        self.stack = stack
        self.owners: dict[int, tuple[str, set]] = {}
        for ref in layers:
            modules = {id(ref.module)} | {id(use.module) for use in ref.uses}
            own = dict(ref.module.named_parameters())
            for pname in ref.param_names():
                if pname in own:
                    entry = self.owners.setdefault(id(own[pname]), (f"{ref.name}.{pname}", set()))
                    entry[1].update(modules)
        self.found: dict[str, str] = {}      # parameter -> the function that used it

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        try:
            out = func(*args, **kwargs)
        except Exception as err:
            if err.__traceback__ is not None and err.__traceback__.tb_next is None:
                err.raised_by_torch_op = True    # the op's own error (the model's), passed through this mode
            raise
        if replaying() is not None or not torch.is_grad_enabled():
            return out
        hits = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor) and id(t) in self.owners]
        if hits and any(isinstance(o, torch.Tensor) and o.grad_fn is not None for o in tree_flatten(out)[0]):
            active = {id(f.module) for f in self.stack.frames}
            for t in hits:
                name, modules = self.owners[id(t)]
                if not modules & active and name not in self.found:
                    self.found[name] = _function_name(func)
        return out

    def check(self, func_backend: bool = True) -> None:
        """Raise :class:`PartialGradientError` for the uses found (``func_backend``: name
        ``backend='func'`` among the fixes; ``ga.capture`` has none)."""
        if not self.found:
            return
        uses = ", ".join(f"{name!r} (by {fn})" for name, fn in self.found.items())
        layers = sorted({name.rsplit(".", 1)[0] for name in self.found})
        raise PartialGradientError(
            f"recorded parameters are also used outside the modules that hold them: {uses}. Hooks record "
            "only those modules' own calls, so these parameters' per-example gradients would miss the "
            "other use (a hand-written tied head, `h @ emb.weight.T` or `F.linear(h, emb.weight)`). Make "
            "the reuse a module call (an nn.Linear head sharing the weight, `head.weight = emb.weight`: "
            "gradalg records every holder of a tied weight as one block), "
            + ("use backend='func', " if func_backend else "") + f"or leave {layers} out of `layers`")
