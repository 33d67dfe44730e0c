"""What the training objective says about attribution, read from the optimizer that trained
the model: weight decay (a curvature term of the objective) and Adam's second moment.

    obj = ga.training_objective(optimizer, model)       # or ga.training_objective(trainer)
    obj.describe()                  # "AdamW: weight_decay 0.01 (4 tensors), 0 (4 tensors) ..."
    ga.methods.influence(task, train, queries, optimizer=optimizer)   # reads it itself

Weight decay and the Hessian
----------------------------
Influence functions invert the Hessian of the objective the run minimised. What weight
decay adds to it depends on how the optimizer applies it (per parameter: param groups may
differ, e.g. Trainer exempts biases and norms):

``coupled`` (``torch.optim.SGD``, ``torch.optim.Adam`` with ``weight_decay``): the update
    uses ∇L + wd·θ, the gradient of  L(θ) + (wd/2)‖θ‖².  Its Hessian adds **wd·I** (wd_j per
    coordinate): exact.
``decoupled`` (``torch.optim.AdamW``, ``Adam(decoupled_weight_decay=True)``): the update is
    θ ← θ − η (m̂/(√v̂ + ε) + wd·θ), not a gradient step on any fixed objective. At a point
    where the update vanishes (m̂ = ∇L), ∇L(θ) + wd·(√v̂ + ε)⊙θ = 0: the stationarity
    condition of  L(θ) + (wd/2) Σ_j (√v̂_j + ε) θ_j²  with Adam's second moment v̂ held at
    its final value. gradalg uses that objective's term, **wd·diag(√v̂ + ε)** (v̂ bias-corrected,
    as AdamW's step divides by it), which needs the optimizer's state (one step taken). It is
    a diagonal in parameter coordinates, so it has no exact form after a random projection:
    such a combination is refused (pass ``weight_decay=`` yourself to choose an isotropic term).

Both readings assume the optimizer's loss is the mean over examples of the task's per-example
loss (gradalg's curvature averages over examples): a loss averaged over tokens while the task
sums them per example scales L, not the decay; rescale ``weight_decay`` by the mean token
count then.

Adam's second moment
--------------------
:meth:`TrainingObjective.second_moment` gives v̂ = v / (1 − β₂ᵗ) and ε per coordinate of a
gradient space (TrackStar's correction ∇L / (√v̂ + ε); LESS reads the raw moments with
``ga.adam_state``).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .errors import ObjectiveError

__all__ = ["TrainingObjective", "training_objective", "DecayTerm", "ObjectiveError"]


_COUPLED = ("SGD", "Adam")        # weight_decay added to the gradient (L2 in the objective)
_DECOUPLED = ("AdamW",)           # weight_decay applied to θ outside the adaptive step


def _unwrap_optimizer(opt):
    """accelerate's AcceleratedOptimizer (what Trainer holds) wraps the torch optimizer."""
    while not type(opt).__module__.startswith("torch.optim") and isinstance(
            getattr(opt, "optimizer", None), torch.optim.Optimizer):
        opt = opt.optimizer
    return opt


def _kind(opt) -> str:
    for cls in type(opt).__mro__:
        if cls.__module__.startswith("torch.optim") and cls.__name__ in _DECOUPLED:
            return "decoupled"
        if cls.__module__.startswith("torch.optim") and cls.__name__ in _COUPLED:
            if cls.__name__ == "Adam" and any(g.get("decoupled_weight_decay") for g in opt.param_groups):
                return "decoupled"
            return "coupled"
    raise ObjectiveError(
        f"gradalg reads weight decay and Adam state from torch.optim.SGD, Adam and AdamW (and their "
        f"subclasses), got {type(opt).__name__}: pass weight_decay= (and damping=) to the method yourself")


@dataclass(frozen=True)
class DecayTerm:
    """The weight-decay term of the objective's curvature in one gradient space.

    ``value``: one number when it is the same on every coordinate (wd·I), else None and
    ``values`` (dim,) per coordinate. ``note`` says where it came from (shown in plans).
    """

    value: float | None
    values: torch.Tensor | None
    note: str

    @property
    def uniform(self) -> bool:
        return self.value is not None

    @property
    def zero(self) -> bool:
        return self.value == 0.0

    def scaled(self, factor: float, why: str) -> "DecayTerm":
        """The same term times ``factor`` (per coordinate too), ``why`` added to the note."""
        return DecayTerm(None if self.value is None else self.value * factor,
                         None if self.values is None else self.values * factor, f"{self.note} {why}")


@dataclass
class TrainingObjective:
    """Weight decay per parameter and Adam's state, read from a torch optimizer."""

    optimizer_name: str
    kind: str                          # "coupled" | "decoupled"
    decay: dict                        # id(param) -> weight decay of its param group
    group: dict                        # id(param) -> index of its param group
    state: dict = field(repr=False)    # id(param) -> optimizer state dict
    betas: dict = field(default_factory=dict)   # group index -> (β₁, β₂)
    eps: dict = field(default_factory=dict)     # group index -> ε

    # ------------------------------------------------------------------ reading
    @classmethod
    def from_optimizer(cls, optimizer) -> "TrainingObjective":
        opt = _unwrap_optimizer(optimizer)
        if not isinstance(opt, torch.optim.Optimizer):
            raise ObjectiveError(f"expected a torch.optim optimizer or a transformers Trainer, got "
                                 f"{type(optimizer).__name__}")
        kind = _kind(opt)
        decay, group, betas, eps = {}, {}, {}, {}
        for g, pg in enumerate(opt.param_groups):
            for p in pg["params"]:
                decay[id(p)] = float(pg.get("weight_decay", 0.0))
                group[id(p)] = g
            if "betas" in pg:
                betas[g] = tuple(float(b) for b in pg["betas"])
                eps[g] = float(pg["eps"])
        return cls(type(opt).__name__, kind, decay, group, {id(p): s for p, s in opt.state.items()}, betas, eps)

    # ------------------------------------------------------------------ per space
    def _coords(self, like):
        from .curvature.hvp import ParamCoords
        from .expr import Source
        src = like.expr.source if hasattr(like, "expr") else None
        if not isinstance(src, Source):
            raise ObjectiveError("the optimizer's settings are mapped to gradients captured with ga.grads "
                                 "(parameter coordinates); got gradients without a model")
        coords = ParamCoords(src.task.model, src.layers, src.backend)
        params = dict(src.task.model.named_parameters())
        missing = [n for n in coords.param_names if id(params[n]) not in self.decay]
        if missing:
            raise ObjectiveError(
                f"the {self.optimizer_name} optimizer does not hold parameter(s) {missing[:4]} of the model whose "
                "gradients are attributed: pass the optimizer that trained this model (a checkpoint's own "
                "optimizer), or weight_decay= yourself")
        return coords, params

    def _per_coordinate(self, like, value_of) -> torch.Tensor:
        coords, params = self._coords(like)
        rows = {n: value_of(params[n]).to(torch.float64).expand_as(params[n]).unsqueeze(0)
                for n in coords.param_names}
        return coords.from_params(rows)[0]

    def _groups_note(self, like) -> str:
        coords, params = self._coords(like)
        by_group: dict = {}
        for n in coords.param_names:
            g = self.group[id(params[n])]
            by_group.setdefault(g, []).append(n)
        parts = [f"param_groups[{g}] weight_decay={self.decay[id(params[names[0]])]:g} ({len(names)} tensors)"
                 for g, names in sorted(by_group.items())]
        return f"{self.optimizer_name} " + ", ".join(parts)

    def decay_term(self, like) -> DecayTerm:
        """The curvature term of the objective's weight decay in the coordinates of ``like``
        (gradients from ``ga.grads``): wd·I (coupled) or wd·diag(√v̂ + ε) (decoupled)."""
        note = self._groups_note(like)
        coords, params = self._coords(like)
        wds = {self.decay[id(params[n])] for n in coords.param_names}
        if self.kind == "coupled":
            if len(wds) == 1:
                wd = wds.pop()
                return DecayTerm(wd, None, f"weight_decay={wd:g} from {note}")
            values = self._per_coordinate(like, lambda p: torch.tensor(self.decay[id(p)], dtype=torch.float64))
            return DecayTerm(None, values, f"weight decay per coordinate from {note}")
        if wds == {0.0}:
            return DecayTerm(0.0, None, f"weight_decay=0 from {note}")
        v_hat, eps = self.second_moment(like)
        wd = self._per_coordinate(like, lambda p: torch.tensor(self.decay[id(p)], dtype=torch.float64))
        return DecayTerm(None, wd * (v_hat.sqrt() + eps),
                         f"decoupled weight decay wd·(√v̂+ε) from {note} (its stationary objective)")

    def second_moment(self, like) -> tuple[torch.Tensor, torch.Tensor]:
        """(v̂, ε) per coordinate of ``like``: v̂ = exp_avg_sq / (1 − β₂^step), Adam's bias-corrected
        second moment, and the ε of each parameter's group. Both (dim,) float64."""
        coords, params = self._coords(like)
        for n in coords.param_names:
            st = self.state.get(id(params[n]), {})
            if "exp_avg_sq" not in st:
                raise ObjectiveError(
                    f"the {self.optimizer_name} optimizer has no second moment for {n!r}: it needs an Adam/AdamW "
                    "optimizer that has taken at least one step over this model's parameters")

        def v_hat(p):
            st = self.state[id(p)]
            step = float(st["step"]) if "step" in st else 1.0
            beta2 = self.betas[self.group[id(p)]][1]
            return st["exp_avg_sq"].detach().to(torch.float64).cpu() / (1.0 - beta2 ** step)

        v = self._per_coordinate(like, v_hat)
        eps = self._per_coordinate(like, lambda p: torch.tensor(self.eps[self.group[id(p)]], dtype=torch.float64))
        return v, eps

    def second_moment_note(self) -> str:
        groups = sorted(set(self.group.values()))
        return f"1/(√v̂ + ε) from {self.optimizer_name} state (ε={', '.join(f'{self.eps[g]:g}' for g in groups)})"


def training_objective(optimizer_or_trainer, model=None) -> TrainingObjective:
    """Read weight decay and Adam's state from a torch optimizer or a ``transformers.Trainer``
    (its ``.optimizer``, made by ``train()`` / ``create_optimizer()``). ``model`` is unused
    (parameters are matched by identity) and accepted for readability."""
    opt = optimizer_or_trainer
    if not isinstance(opt, torch.optim.Optimizer) and hasattr(opt, "args") and hasattr(opt, "optimizer"):
        if opt.optimizer is None:
            raise ObjectiveError("the Trainer has no optimizer yet: it is made by trainer.train() or "
                                 "trainer.create_optimizer(); pass it after either")
        opt = opt.optimizer
    return TrainingObjective.from_optimizer(opt)
