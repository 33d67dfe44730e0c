"""gradalg's own forward hooks, known by their handles, and a context that turns them off.

Every forward hook gradalg installs on a user's model (the batch recorder's, the loop
recorder's, the call stack's global pre/post hooks, the replay recorder's, the training
integrations') is registered as usual and its handle kept in an :class:`OwnHooks`, which
marks it as gradalg's (:func:`ours`: a weak reference) and removes them all on exit.
:func:`suspended` takes exactly those hooks out of the model's hook dicts and torch's
global ones for the duration of a block, and puts them back, in their places, on exit
(an exception included); a user's own hooks stay on.

One use: :func:`gradalg.tasks.validation.own_forward_error` runs the model's plain
forward on a batch the capture could not read, to tell a broken model from a bad batch.
"""
from __future__ import annotations

import contextlib
import weakref

import torch
from torch.nn.modules import module as _mm
from torch.utils.hooks import RemovableHandle

__all__ = ["ours", "OwnHooks", "suspended"]

#: handles of the forward hooks gradalg installed and has not removed yet (a removed
#: handle is dropped with its owner's list)
_OURS: "weakref.WeakSet[RemovableHandle]" = weakref.WeakSet()


def ours(handle: RemovableHandle) -> RemovableHandle:
    """Mark ``handle`` (from ``register_forward_hook``, ``register_forward_pre_hook`` or
    torch's ``register_module_forward_*hook``) as gradalg's, for :func:`suspended`;
    returns it. The caller keeps the handle (and removes it) as before."""
    _OURS.add(handle)
    return handle


class OwnHooks:
    """The hooks one gradalg object puts on a model (a recorder's, a trainer callback's):
    each handle marked as gradalg's when added (:func:`ours`), all removed at once.

    Example (a recorder)::

        self._hooks = OwnHooks()                                   # __init__
        self._hooks.add(module.register_forward_hook(self._hook))  # __enter__
        self._hooks.remove()                                       # __exit__
    """

    def __init__(self):
        self._handles: list[RemovableHandle] = []

    def add(self, handle: RemovableHandle) -> RemovableHandle:
        """Keep ``handle``, marked as gradalg's; returns it."""
        self._handles.append(ours(handle))
        return handle

    def remove(self) -> None:
        """Remove every hook added (each once: the list is emptied)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def __bool__(self) -> bool:
        """Whether hooks are installed."""
        return bool(self._handles)


def _hook_dicts(model: torch.nn.Module) -> list[dict]:
    dicts = [_mm._global_forward_hooks, _mm._global_forward_pre_hooks]
    for module in model.modules():
        dicts += [module._forward_hooks, module._forward_pre_hooks]
    return dicts


@contextlib.contextmanager
def suspended(model: torch.nn.Module):
    """Within the block, ``model``'s modules and torch's global module hooks run without
    gradalg's forward hooks (those marked by :func:`ours`); other hooks keep running.

    A handle's id is unique in the process (torch counts them), so a hook is gradalg's
    exactly when its id is one of :func:`ours`' live handles. The hooks are taken out of
    the dicts in place (the dict objects stay, so a user's handle removed inside the
    block still finds its dict) and put back in their original order on exit, an
    exception included; hooks registered inside the block stay, after them. A gradalg
    hook must not be removed inside the block (none of gradalg's code runs there to do
    so): it would come back on exit.

    Example::

        >>> lin = torch.nn.Linear(2, 2)
        >>> seen = []
        >>> h = ours(lin.register_forward_hook(lambda m, a, o: seen.append("gradalg")))
        >>> with suspended(lin):
        ...     _ = lin(torch.zeros(1, 2))
        >>> _ = lin(torch.zeros(1, 2)); seen
        ['gradalg']
        >>> h.remove()
    """
    ids = {handle.id for handle in list(_OURS)}
    taken = []      # (dict, its keys in order before, {id: gradalg's hook})
    for hooks in _hook_dicts(model) if ids else ():
        mine = {k: hooks[k] for k in hooks if k in ids}
        if mine:
            taken.append((hooks, list(hooks), mine))
            for k in mine:
                del hooks[k]
    try:
        yield
    finally:
        for hooks, order, mine in taken:
            rest = dict(hooks)
            hooks.clear()
            for k in order:
                if k in mine:
                    hooks[k] = mine[k]
                elif k in rest:
                    hooks[k] = rest.pop(k)
            hooks.update(rest)       # registered inside the block
