"""gradalg's own forward hooks, known by their handles (``gradalg.own_hooks``, marked by
capture's recorders and the trainer integrations), and the context that turns them off
while a user's hooks keep running (``suspended``).

``tasks.validation.own_forward_error`` runs a model's plain forward inside ``suspended``
to tell a broken model from a bad batch; its end-to-end tests are in ``test_arch_probe.py``.
"""
from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn
from torch.nn.modules import module as mm

import gradalg as ga
from gradalg.capture.hooks import ForwardRecorder, resolve_layers
from gradalg.own_hooks import _OURS, ours, suspended


def _all_hooks(model) -> list[list]:
    """Every forward hook dict's (id, hook) pairs, in order: the global ones, then each module's."""
    dicts = [mm._global_forward_hooks, mm._global_forward_pre_hooks]
    dicts += [d for m in model.modules() for d in (m._forward_hooks, m._forward_pre_hooks)]
    return [list(d.items()) for d in dicts]


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()


def test_suspended_runs_the_users_hooks_only_and_puts_gradalgs_back_in_place_after_an_error():
    """Within the block only the user's hooks run (a module's pre and post hooks, a global
    one, registered before and after gradalg's); after the block, left by an exception,
    every hook dict holds the same hooks in the same order (the same dict objects), and
    every hook, gradalg's included, runs again, with_kwargs and always_call as registered."""
    model = _net()
    calls = []

    def hook(tag):
        return lambda *a, **k: calls.append(tag)
    handles = [model[0].register_forward_pre_hook(hook("user pre")),
               ours(model[0].register_forward_pre_hook(hook("ga pre"))),
               ours(model[0].register_forward_hook(hook("ga post"), with_kwargs=True, always_call=True)),
               model[0].register_forward_hook(hook("user post")),
               ours(mm.register_module_forward_pre_hook(hook("ga global"))),
               mm.register_module_forward_hook(hook("user global"))]
    try:
        dicts = [mm._global_forward_hooks, model[0]._forward_hooks, model[0]._forward_pre_hooks]
        before, order = _all_hooks(model), [id(d) for d in dicts]
        with pytest.raises(KeyError, match="inside"):
            with suspended(model):
                model(torch.zeros(1, 3, dtype=torch.float64))
                assert len(model[0]._forward_hooks) == 1 and len(model[0]._forward_pre_hooks) == 1
                raise KeyError("inside")
        # torch runs the global hooks before a module's own (Sequential, Linear, Tanh, Linear)
        assert calls == ["user pre", "user global", "user post"] + ["user global"] * 3
        assert _all_hooks(model) == before and [id(d) for d in dicts] == order
        calls.clear()
        model(torch.zeros(1, 3, dtype=torch.float64))
        assert calls == ["ga global", "ga global", "user pre", "ga pre", "user global", "ga post", "user post"] \
            + ["ga global", "user global"] * 2 + ["user global"]
    finally:
        for h in handles:
            h.remove()


def test_a_hook_the_model_registers_inside_the_block_stays():
    """A model that registers a hook of its own during a forward (lazy set-up on its first
    call) keeps it: the dicts are edited in place, not swapped for copies (which lost it)."""
    from gradalg.tasks.validation import own_forward_error

    class Lazy(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.calls, self.handle = nn.Linear(3, 2), [], None

        def forward(self, x):
            if self.handle is None:
                self.handle = self.lin.register_forward_hook(lambda *a: self.calls.append("lazy"))
            return self.lin(x)
    model = Lazy()
    mine = ours(model.lin.register_forward_hook(lambda *a: model.calls.append("gradalg")))
    try:
        assert own_forward_error(model, (torch.zeros(1, 3),)) is None and model.calls == ["lazy"]
        model(torch.zeros(1, 3))
        assert model.calls == ["lazy", "gradalg", "lazy"]
    finally:
        mine.remove()


@pytest.mark.parametrize("recorder", ["ForwardRecorder", "ga.capture"])
def test_every_hook_a_recorder_installs_is_gradalgs_and_suspended_silences_it(recorder):
    """Every forward hook the batch recorder (with its call stack and weight-use check) and
    the loop recorder install is marked as gradalg's: inside ``suspended`` the hook dicts
    are those the model had before the recorder, and a forward records nothing; after
    the block, the recorder records the next forward as usual."""
    model = _net()
    x = torch.randn(2, 3, dtype=torch.float64)
    with contextlib.ExitStack() as stack:
        before = _all_hooks(model)
        if recorder == "ForwardRecorder":
            rec = stack.enter_context(ForwardRecorder(resolve_layers(model), model=model))
            recorded = lambda: sum(len(c) for c in rec.calls.values())  # noqa: E731
        else:
            cap = stack.enter_context(ga.capture(model, reduction="sum"))
            recorded = lambda: cap.steps  # noqa: E731
        known = {k for d in before for k, _ in d}
        added = [k for d in _all_hooks(model) for k, _ in d if k not in known]
        assert len(added) >= 2 and set(added) <= {h.id for h in _OURS}
        with suspended(model):
            assert _all_hooks(model) == before
            model(x).sum().backward()
        assert recorded() == 0
        model(x).sum().backward()
        assert recorded() == (2 if recorder == "ForwardRecorder" else 1)
