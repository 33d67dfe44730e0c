"""Differentiable optimizer steps, the update rules of ``torch.optim.SGD`` / ``Adam`` /
``AdamW`` written as pure functions of (parameters, state, gradient).

A training step ``s_{t+1} = Φ_t(s_t, g_t)`` with state ``s = (θ, optimizer state)``
must be differentiable in ``s`` and in the gradient ``g_t`` for the metagradient
(:mod:`gradalg.unroll.metagradient`); ``torch.optim`` updates its tensors in place,
outside autograd, so the rules are restated here and checked against ``torch.optim``
in the tests. All state tensors exist from step 0 (momentum buffers and Adam moments
start at zero), so every step has the same pytree structure.

SGD (``torch.optim.SGD``, dampening d, Nesterov optional)
    g ← g + wd·θ;  b ← g at t = 0, else μ·b + (1 − d)·g;  u = g + μ·b (Nesterov) or b;
    θ ← θ − η_t·u
Adam / AdamW (``torch.optim.Adam`` couples weight decay into g, ``AdamW`` decouples it)
    AdamW: θ ← θ·(1 − η_t·wd);   Adam: g ← g + wd·θ
    m ← β₁m + (1 − β₁)g;  v ← β₂v + (1 − β₂)g²
    θ ← θ − η_t · (m / (1 − β₁^{t+1})) / (√(v / (1 − β₂^{t+1})) + eps)

The square root's derivative is taken as 0 where v = 0 (a coordinate whose gradient
has always been exactly zero, such as the weight of a constant-zero input pixel):
there √v ≡ 0 along every reweighting, so 0 is the exact derivative, where autograd
would give 0·∞ = NaN.

Learning rates are a number, a sequence (one per step) or a callable ``step -> lr``.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Callable, Sequence, Union

import torch

from .errors import UnsupportedOptimizerError

__all__ = ["SGD", "Adam", "AdamW", "from_torch", "OptimizerSpec"]

LearningRate = Union[float, Sequence[float], Callable[[int], float]]


def _lr_at(lr: LearningRate, step: int) -> float:
    if callable(lr):
        return float(lr(step))
    if isinstance(lr, numbers.Real):
        return float(lr)
    if step >= len(lr):
        raise UnsupportedOptimizerError(f"the learning-rate sequence has {len(lr)} entries, but step {step} "
                                        "was asked: give one learning rate per step")
    return float(lr[step])


def _check_number(name, value, low=0.0, high=float("inf"), high_open=False):
    if not isinstance(value, numbers.Real) or isinstance(value, bool) or not (
            low <= value < high if high_open else low <= value <= high):
        raise UnsupportedOptimizerError(f"{name} must be a number in [{low}, {high}{')' if high_open else ']'}, "
                                        f"got {value!r}")


class OptimizerSpec:
    """An update rule: ``init(params) -> state`` and ``step(params, state, grads, t)``."""

    name = "optimizer"

    def lr_at(self, step: int) -> float:
        return _lr_at(self.lr, step)

    def init(self, params: dict) -> dict:
        raise NotImplementedError(f"{type(self).__name__} does not define init(params) -> state: an OptimizerSpec "
                                  "subclass implements init and step")

    def step(self, params: dict, state: dict, grads: dict, t: int) -> tuple[dict, dict]:
        raise NotImplementedError(f"{type(self).__name__} does not define step(params, state, grads, t): an "
                                  "OptimizerSpec subclass implements init and step")


@dataclass(frozen=True)
class SGD(OptimizerSpec):
    """``torch.optim.SGD``'s rule (momentum μ, dampening d, coupled weight decay wd)."""

    lr: LearningRate
    momentum: float = 0.0
    dampening: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False
    name = "SGD"

    def __post_init__(self):
        _check_number("momentum", self.momentum, 0.0, 1.0, high_open=True)
        _check_number("dampening", self.dampening, 0.0, 1.0)
        _check_number("weight_decay", self.weight_decay)
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise UnsupportedOptimizerError("Nesterov momentum needs momentum > 0 and dampening 0 (as torch.optim.SGD)")

    def init(self, params):
        if self.momentum == 0:
            return {}
        return {"momentum": {k: torch.zeros_like(v) for k, v in params.items()}}

    def step(self, params, state, grads, t):
        lr = self.lr_at(t)
        new_params, new_buf = {}, {}
        for k, p in params.items():
            g = grads[k]
            if self.weight_decay:
                g = g + self.weight_decay * p
            if self.momentum:
                b = g if t == 0 else self.momentum * state["momentum"][k] + (1 - self.dampening) * g
                new_buf[k] = b
                g = g + self.momentum * b if self.nesterov else b
            new_params[k] = p - lr * g
        return new_params, ({"momentum": new_buf} if self.momentum else {})


def _safe_sqrt(v: torch.Tensor) -> torch.Tensor:
    """√v with derivative 0 where v == 0 (see the module docstring)."""
    positive = v > 0
    return torch.where(positive, torch.where(positive, v, torch.ones_like(v)).sqrt(), torch.zeros_like(v))


@dataclass(frozen=True)
class Adam(OptimizerSpec):
    """``torch.optim.Adam`` (weight decay coupled into the gradient); ``decoupled=True``
    is ``torch.optim.AdamW``'s rule (use :class:`AdamW`)."""

    lr: LearningRate
    betas: tuple = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    decoupled: bool = False

    @property
    def name(self):
        return "AdamW" if self.decoupled else "Adam"

    def __post_init__(self):
        if len(self.betas) != 2:
            raise UnsupportedOptimizerError(f"betas must be a pair, got {self.betas!r}")
        for i, b in enumerate(self.betas):
            _check_number(f"betas[{i}]", b, 0.0, 1.0, high_open=True)
        _check_number("eps", self.eps)
        _check_number("weight_decay", self.weight_decay)

    def init(self, params):
        return {"exp_avg": {k: torch.zeros_like(v) for k, v in params.items()},
                "exp_avg_sq": {k: torch.zeros_like(v) for k, v in params.items()}}

    def step(self, params, state, grads, t):
        lr = self.lr_at(t)
        b1, b2 = self.betas
        c1, c2 = 1 - b1 ** (t + 1), 1 - b2 ** (t + 1)
        out_p, out_m, out_v = {}, {}, {}
        for k, p in params.items():
            g = grads[k]
            if self.weight_decay and self.decoupled:
                p = p * (1 - lr * self.weight_decay)
            elif self.weight_decay:
                g = g + self.weight_decay * p
            m = b1 * state["exp_avg"][k] + (1 - b1) * g
            v = b2 * state["exp_avg_sq"][k] + (1 - b2) * g * g
            denom = _safe_sqrt(v) / math.sqrt(c2) + self.eps
            out_p[k] = p - (lr / c1) * m / denom
            out_m[k], out_v[k] = m, v
        return out_p, {"exp_avg": out_m, "exp_avg_sq": out_v}


def AdamW(lr: LearningRate, betas: tuple = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2) -> Adam:
    """``torch.optim.AdamW``'s rule: decoupled weight decay θ ← θ(1 − η·wd) (default 1e-2, as torch)."""
    return Adam(lr, tuple(betas), eps, weight_decay, decoupled=True)


def from_torch(optimizer: torch.optim.Optimizer) -> OptimizerSpec:
    """The rule of a ``torch.optim.SGD`` / ``Adam`` / ``AdamW`` instance (one parameter
    group, or groups with equal settings); anything else is refused."""
    kinds = {torch.optim.SGD: "SGD", torch.optim.AdamW: "AdamW", torch.optim.Adam: "Adam"}
    kind = kinds.get(type(optimizer))
    if kind is None:
        raise UnsupportedOptimizerError(
            f"{type(optimizer).__name__} is not supported by the unrolled replay: use torch.optim.SGD "
            "(momentum, Nesterov, weight decay), Adam or AdamW, or ga.unroll.SGD / Adam / AdamW")
    keys = {"SGD": ("lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize"),
            "Adam": ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize"),
            "AdamW": ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize")}[kind]
    settings = [{k: g.get(k) for k in keys} for g in optimizer.param_groups]
    if any(s != settings[0] for s in settings[1:]):
        raise UnsupportedOptimizerError(
            f"the {kind} optimizer has parameter groups with different settings ({settings}); the replay "
            "supports one setting for all parameters")
    s = settings[0]
    if s.get("maximize"):
        raise UnsupportedOptimizerError(f"{kind}(maximize=True) is not supported")
    if s.get("amsgrad"):
        raise UnsupportedOptimizerError(f"{kind}(amsgrad=True) is not supported: its running maximum has no "
                                        "useful derivative; use amsgrad=False")
    lr = s["lr"]
    if isinstance(lr, torch.Tensor):
        lr = float(lr)
    if kind == "SGD":
        return SGD(lr, s["momentum"], s["dampening"], s["weight_decay"], bool(s["nesterov"]))
    betas = tuple(float(b) for b in s["betas"])
    if kind == "AdamW":
        return AdamW(lr, betas, s["eps"], s["weight_decay"])
    return Adam(lr, betas, s["eps"], s["weight_decay"])
