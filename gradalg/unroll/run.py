"""A deterministic training run, described so that it can be replayed and differentiated.

    run = ga.unroll.TrainingRun(model, per_example_loss, (X, y), ga.unroll.SGD(lr=0.1, momentum=0.9),
                                batch_size=32, epochs=3, seed=0)
    run.train()                         # the model after the run (weights ε = 1)
    run.train(weights=w)                # the same run with per-example weights w (n_train,)

The run minimises, at step t with mini-batch B_t (a fixed list of training indices),

    L_t(θ; ε) = (1/|B_t|) Σ_{i ∈ B_t} ε_i ℓ_i(θ)             reduction="mean" (default)
    L_t(θ; ε) = Σ_{i ∈ B_t} ε_i ℓ_i(θ) / Σ_{i ∈ B_t} ε_i      reduction="weighted_mean"
    L_t(θ; ε) = Σ_{i ∈ B_t} ε_i ℓ_i(θ)                        reduction="sum"

with the optimizer's update rule (:mod:`gradalg.unroll.optimizers`). ``ε_i = 0`` is
training without example i, the counterfactual of ``ga.eval.retrain`` with
``train_fn = lambda idx: run.train(weights=mask(idx))``: its batches keep their order;
with "mean" they keep their normaliser |B_t| too (dropping half the data halves the
gradient), with "weighted_mean" they become smaller batches of the same mean (as
training on the subset with the same batch order would). At ε = 1 all three runs
are the same run (up to the scale of "sum").

Everything that makes a run reproducible is part of its description: the initial
parameters (the model's, copied at construction), the data as tensors, the batch order
(``batches`` or a ``seed``), the optimizer and its schedule, and — for a model that
draws random numbers in training mode (dropout) — a ``random_seed`` from which each
step's draws are seeded. What is missing is refused (:class:`NonDeterministicTrainingError`).
"""
from __future__ import annotations

import contextlib
import copy
import math
from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch import nn
from torch.func import functional_call, grad

from ..errors import NonFiniteGradientError
from ..finite import check_model, nonfinite_examples
from ..options import get_options
from .errors import NonDeterministicTrainingError, UnsupportedOptimizerError, UnsupportedTrainingError
from .optimizers import OptimizerSpec, from_torch

__all__ = ["TrainingRun"]

REDUCTIONS = ("mean", "weighted_mean", "sum")
_STOCHASTIC = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)


class _LossOf(nn.Module):
    """``forward(batch) = loss(model, batch)``, so ``functional_call`` can swap the
    model's parameters while the user's loss calls ``model(x)``."""

    def __init__(self, model: nn.Module, loss: Callable):
        super().__init__()
        self.model = model
        self.loss = loss

    def forward(self, batch):
        return self.loss(self.model, batch)


def _as_tensors(data) -> tuple | dict:
    if isinstance(data, torch.utils.data.DataLoader):
        raise NonDeterministicTrainingError(
            "a DataLoader does not fix the batch order: pass the training tensors (a tuple, a dict or a "
            "TensorDataset) and the order as batches=[indices, ...] or batch_size=... with seed=...")
    if isinstance(data, torch.utils.data.TensorDataset):
        return tuple(data.tensors)
    if isinstance(data, dict):
        if not data or not all(isinstance(v, torch.Tensor) for v in data.values()):
            raise UnsupportedTrainingError("data as a dict must map names to tensors (one row per example)")
        return dict(data)
    if isinstance(data, (tuple, list)) and data and all(isinstance(v, torch.Tensor) for v in data):
        return tuple(data)
    if isinstance(data, torch.Tensor):
        return (data,)
    raise UnsupportedTrainingError(f"data must be a tensor, a tuple or dict of tensors or a TensorDataset, "
                                   f"got {type(data).__name__}")


def _rows(data) -> int:
    values = list(data.values()) if isinstance(data, dict) else list(data)
    sizes = {int(v.shape[0]) for v in values}
    if len(sizes) != 1:
        raise UnsupportedTrainingError(f"the data tensors have different numbers of rows {sorted(sizes)}")
    return sizes.pop()


def _all_finite(params: dict) -> bool:
    return all(bool(torch.isfinite(v).all()) for v in params.values())


def _take(data, idx: torch.Tensor):
    if isinstance(data, dict):
        return {k: v[idx] for k, v in data.items()}
    return tuple(v[idx] for v in data)


def _batch_order(n: int, batches, batch_size, epochs, steps, seed) -> list[torch.Tensor]:
    if batches is not None:
        if batch_size is not None or seed is not None:
            raise UnsupportedTrainingError("give either batches=[...] or batch_size= with seed=, not both")
        order = [torch.as_tensor(np.asarray(b), dtype=torch.long).reshape(-1) for b in batches]
    else:
        if batch_size is None:
            raise NonDeterministicTrainingError(
                "the batch order is not given: pass batches=[indices, ...] (one entry per step) or "
                "batch_size=... with seed=... (a reshuffle per epoch, drawn from torch.Generator(seed))")
        if seed is None:
            raise NonDeterministicTrainingError(
                "batch_size= without seed=: the batch order must be reproducible to be replayed; pass seed=0 "
                "(or any int), or the batches themselves")
        if (epochs is None) == (steps is None):
            raise UnsupportedTrainingError("with batch_size=, give exactly one of epochs= or steps=")
        gen = torch.Generator().manual_seed(int(seed))
        per_epoch = math.ceil(n / batch_size)
        total = steps if steps is not None else epochs * per_epoch
        order = []
        while len(order) < total:
            perm = torch.randperm(n, generator=gen)
            order.extend(perm[i:i + batch_size] for i in range(0, n, batch_size))
        order = order[:total]
    if not order:
        raise UnsupportedTrainingError("the run has no steps")
    for t, b in enumerate(order):
        if b.numel() == 0:
            raise UnsupportedTrainingError(f"batch {t} is empty")
        if int(b.min()) < 0 or int(b.max()) >= n:
            raise UnsupportedTrainingError(f"batch {t} holds indices outside [0, {n}): "
                                           f"{[int(i) for i in b if not 0 <= int(i) < n][:5]}")
    return order


class TrainingRun:
    """A training run that gradalg can replay exactly (see the module docstring).

    Parameters
    ----------
    model : nn.Module
        Its current parameters are θ₀ (copied now; later changes to ``model`` do not
        affect the run). Parameters with ``requires_grad=False`` (or, for a
        ``torch.optim`` optimizer, not in it) are held fixed.
    loss : callable ``(model, batch) -> (B,)``
        Each example's loss (no reduction), e.g.
        ``lambda m, b: F.cross_entropy(m(b[0]), b[1], reduction="none")``.
    data : tuple / dict of tensors, or a TensorDataset
        The n training examples (rows), on the model's device;
        ``batch = tuple(t[idx] for t in data)``.
    optimizer : ``ga.unroll.SGD`` / ``Adam`` / ``AdamW``, or a ``torch.optim`` SGD /
        Adam / AdamW instance over the model's parameters (its settings are read).
    batches : sequence of index sequences, one per step — or ``batch_size`` with
        ``seed`` and ``epochs`` or ``steps`` (a reshuffle per epoch from
        ``torch.Generator().manual_seed(seed)``; the last batch of an epoch may be short).
    reduction : "mean" (default), "weighted_mean" or "sum" over the batch (above).
    random_seed : seeds torch's RNG before each step (from (random_seed, t)), so a model
        with dropout in training mode is replayed with the same draws. Without it such a
        model is refused.
    """

    def __init__(self, model: nn.Module, loss: Callable[[nn.Module, Any], torch.Tensor], data,
                 optimizer, *, batches: Sequence | None = None, batch_size: int | None = None,
                 epochs: int | None = None, steps: int | None = None, seed: int | None = None,
                 reduction: str = "mean", random_seed: int | None = None):
        if not isinstance(model, nn.Module):
            raise UnsupportedTrainingError(f"model must be an nn.Module, got {type(model).__name__}")
        if not callable(loss):
            raise UnsupportedTrainingError("loss must be a callable (model, batch) -> per-example losses (B,)")
        if reduction not in REDUCTIONS:
            raise UnsupportedTrainingError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
        trainable = self._trainable(model, optimizer)
        if isinstance(optimizer, torch.optim.Optimizer):
            optimizer = from_torch(optimizer)
        if not isinstance(optimizer, OptimizerSpec):
            raise UnsupportedOptimizerError(
                f"optimizer must be ga.unroll.SGD / Adam / AdamW or a torch.optim SGD / Adam / AdamW, got "
                f"{type(optimizer).__name__}")
        self._refuse_unreplayable(model, random_seed)
        if get_options().check_finite:   # θ₀ with a NaN: named here, not a NaN metagradient later
            check_model(model)
        self.model = copy.deepcopy(model)
        self.loss = loss
        self.data = _as_tensors(data)
        self.n_train = _rows(self.data)
        self.optimizer = optimizer
        self.reduction = reduction
        self.random_seed = random_seed
        self.batches = _batch_order(self.n_train, batches, batch_size, epochs, steps, seed)
        self._module = _LossOf(self.model, loss)
        self._modes = [(m, m.training) for m in self.model.modules()]   # replayed at every step
        named = dict(self.model.named_parameters())
        self.param_names = tuple(n for n in named if n in trainable)
        if not self.param_names:
            raise UnsupportedTrainingError("the model has no trainable parameters")
        self._fixed = {f"model.{n}": p.detach() for n, p in named.items() if n not in trainable}
        ref = named[self.param_names[0]]
        self.dtype, self.device = ref.dtype, ref.device

    # ------------------------------------------------------------------ set-up checks
    @staticmethod
    def _trainable(model, optimizer) -> set:
        named = dict(model.named_parameters())
        if isinstance(optimizer, torch.optim.Optimizer):
            ids = {id(p) for g in optimizer.param_groups for p in g["params"]}
            return {n for n, p in named.items() if id(p) in ids}
        return {n for n, p in named.items() if p.requires_grad}

    @staticmethod
    def _refuse_unreplayable(model, random_seed) -> None:
        for name, m in model.named_modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training:
                raise UnsupportedTrainingError(
                    f"module {name!r} ({type(m).__name__}) is in training mode: its batch statistics and running "
                    "buffers are not replayed. Put it in eval mode (model.eval() or the module's .eval()) or use "
                    "LayerNorm / GroupNorm")
            if isinstance(m, _STOCHASTIC) and m.training and m.p > 0 and random_seed is None:
                raise NonDeterministicTrainingError(
                    f"module {name!r} ({type(m).__name__}, p={m.p}) draws random numbers in training mode: pass "
                    "random_seed=... so every step's draws are replayed, or put the model in eval mode")

    # ------------------------------------------------------------------ the run
    @property
    def n_steps(self) -> int:
        return len(self.batches)

    def initial_params(self) -> dict:
        named = dict(self.model.named_parameters())
        return {n: named[n].detach().clone() for n in self.param_names}

    def initial_state(self) -> tuple[dict, dict]:
        params = self.initial_params()
        return params, self.optimizer.init(params)

    def batch(self, t: int):
        return _take(self.data, self.batches[t].to(self._first_data_device()))

    def _first_data_device(self):
        values = self.data.values() if isinstance(self.data, dict) else self.data
        return next(iter(values)).device

    def losses(self, params: dict, batch) -> torch.Tensor:
        """Per-example losses (B,) at ``params`` (a dict over ``param_names``)."""
        full = {**self._fixed, **{f"model.{n}": v for n, v in params.items()}}
        return functional_call(self._module, full, (batch,))

    @contextlib.contextmanager
    def _rng(self, t: int):
        if self.random_seed is None:
            yield
            return
        with torch.random.fork_rng(devices=[self.device.index or 0] if self.device.type == "cuda" else []):
            torch.manual_seed(int(np.random.SeedSequence([int(self.random_seed), t]).generate_state(1)[0]))
            yield

    def step(self, params: dict, opt_state: dict, batch_weights: torch.Tensor, t: int) -> tuple[dict, dict]:
        """One differentiable step ``(θ_{t+1}, state_{t+1}) = Φ_t(θ_t, state_t; ε_{B_t})``."""
        batch = self.batch(t)
        size = self.batches[t].numel()
        self.training_mode()

        def objective(p):
            per = self.losses(p, batch)
            if per.shape != (size,):
                raise UnsupportedTrainingError(
                    f"loss must return one value per example, shape ({size},); got {tuple(per.shape)} at step {t} "
                    "(use reduction='none')")
            w = batch_weights.to(per.dtype)
            total = (w * per).sum()
            if self.reduction == "mean":
                return total / size
            if self.reduction == "weighted_mean":      # Σ ε ℓ / Σ ε (0 for a batch of zero weights)
                norm = w.sum()
                return total / torch.where(norm > 0, norm, torch.ones_like(norm))
            return total

        with self._rng(t):
            g = grad(objective)(params)
        return self.optimizer.step(params, opt_state, g, t)

    def training_mode(self) -> None:
        """Put every module back in the train/eval mode it had when the run was described
        (a query scored in eval mode in between does not change the replay)."""
        for m, training in self._modes:
            m.training = training

    def final_params(self, weights: torch.Tensor | None = None) -> dict:
        weights = self._weights(weights)
        params, state = self.initial_state()
        with torch.no_grad():
            for t in range(self.n_steps):
                params, state = self.step(params, state, weights[self.batches[t]], t)
        return params

    def train(self, weights=None) -> nn.Module:
        """A copy of the model after the run with per-example ``weights`` (default: ones), in eval mode."""
        params = self.final_params(weights)
        if get_options().check_finite and not _all_finite(params):
            self.name_nonfinite(self._weights(weights))
        return self.model_with(params, checked=True).eval()

    def model_with(self, params: dict, checked: bool = False) -> nn.Module:
        """A copy of the model holding ``params``. Parameters of the run (ε = 1) that are
        NaN/inf are traced to their source first (:meth:`name_nonfinite`)."""
        if not checked and get_options().check_finite and not _all_finite(params):
            self.name_nonfinite()
        model = copy.deepcopy(self.model)
        named = dict(model.named_parameters())
        with torch.no_grad():
            for n, v in params.items():
                named[n].copy_(v)
        return model

    def name_nonfinite(self, weights: torch.Tensor | None = None) -> None:
        """Replay the run (data weights ``weights``, default ones) and raise
        :class:`~gradalg.errors.NonFiniteGradientError` at the first step whose
        per-example losses are NaN/inf (naming its training examples: their inputs hold
        NaN/inf, or their labels or the loss are at fault; or, for losses finite at the
        start, a run that diverges), or after which a parameter is NaN/inf (naming the
        examples of the step whose inputs hold NaN/inf, else the parameter of a diverging
        run). Returns when every step is finite. Called only on failure: one forward run."""
        eps = self._weights(weights)
        params, state = self.initial_state()
        with torch.no_grad():
            for t in range(self.n_steps):
                idx = self.batches[t]
                self.training_mode()
                per = self.losses(params, self.batch(t)).detach()
                bad = sorted({int(idx[i]) for i in (~torch.isfinite(per)).nonzero().flatten().tolist()})
                inputs = [int(idx[i]) for i in nonfinite_examples(self.batch(t))]
                if bad and t > 0 and not inputs and self._finite_at_start(bad):
                    top = max(float(v.abs().max()) for v in params.values())
                    raise NonFiniteGradientError(
                        [], [], f"the training run diverges: at step {t} the losses of examples {bad[:20]} are "
                        f"NaN/inf though they were finite at the start (largest |parameter| now {top:.3g})",
                        "Lower the learning rate (or clip gradients in the loss), or compute in float64")
                if bad:
                    held = sorted(set(inputs) & set(bad))
                    cause = (f"the inputs of examples {held} hold NaN/inf" if held else
                             "their inputs are finite: check their labels and the loss (a log of zero, an "
                             "empty target, an overflow)")
                    raise NonFiniteGradientError(
                        bad, [], f"NaN/inf training losses at step {t} of the run",
                        f"Every metagradient and checkpoint after it would be NaN: {cause}. Remove these "
                        "examples from the run's data (and its batches), or fix them")
                params, state = self.step(params, state, eps[idx], t)
                broken = [n for n, v in params.items() if not bool(torch.isfinite(v).all())]
                if broken and inputs:
                    raise NonFiniteGradientError(
                        sorted(set(inputs)), [], f"NaN/inf gradients at step {t} of the run (their inputs hold "
                        f"NaN/inf; parameter {broken[0]!r} is NaN/inf after the step)",
                        "Every metagradient and checkpoint after it would be NaN. Remove these examples from "
                        "the run's data (and its batches), or fix their inputs")
                if broken:
                    raise NonFiniteGradientError(
                        [], [broken[0]], f"the training run diverges: parameter {broken[0]!r} is NaN/inf after "
                        f"step {t} though every loss and input up to that step is finite",
                        "Lower the learning rate (or clip gradients in the loss), or compute in float64")

    def _finite_at_start(self, ids: list) -> bool:
        """Whether examples ``ids`` have finite losses at the run's initial parameters."""
        self.training_mode()
        per = self.losses(self.initial_params(), _take(self.data, torch.tensor(ids, device=self._first_data_device())))
        return bool(torch.isfinite(per.detach()).all())

    def _weights(self, weights) -> torch.Tensor:
        if weights is None:
            return torch.ones(self.n_train, dtype=self.dtype, device=self.device)
        w = torch.as_tensor(np.asarray(weights) if not isinstance(weights, torch.Tensor) else weights)
        if w.shape != (self.n_train,):
            raise UnsupportedTrainingError(f"weights must have shape ({self.n_train},), got {tuple(w.shape)}")
        return w.to(self.dtype).to(self.device)

    def __repr__(self):
        sizes = sorted({b.numel() for b in self.batches})
        return (f"TrainingRun({type(self.model).__name__}, n_train={self.n_train}, steps={self.n_steps}, "
                f"batch={sizes[0] if len(sizes) == 1 else sizes}, optimizer={self.optimizer.name})")
