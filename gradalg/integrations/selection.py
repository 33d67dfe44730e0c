"""Online data selection: score each example of a step, drop or re-weight, correct the step.

    sel = ga.integrations.OnlineSelection(
        target=ga.integrations.ValidationTarget(loss, val_batch),   # or BatchMean(), FixedTarget(...)
        policy=ga.integrations.DropFraction(0.3),                   # or Threshold(0.0), Reweight(fn)
    )
    with sel.attach(model, optimizer=opt):
        for x, y in loader:
            opt.zero_grad()
            loss(model, (x, y)).backward()      # per-example factors recorded by hooks
            opt.step()                           # step pre-hook: score, weigh, correct p.grad
    sel.history[-1].weights                      # what the last step kept

The math
--------
With per-example gradients ``g_i`` (each example's contribution to the backpropagated
loss) the step's gradient is ``g = Σ_i g_i``. Each example gets a score against a
target direction ``t``::

    s_i = ⟨g_i, t⟩        (or ⟨g_i, t⟩ / (‖g_i‖ ‖t‖) with similarity="cosine")

computed per layer from the factors alone (``G_i = D_iᵀA_i``), by ghost products
``⟨G_i, G_j⟩ = Σ_ts (a_it·a_js)(d_it·d_js)`` when the target is a few factored
gradients, or as ``Σ_t d_itᵀ V a_it`` when the target is a dense matrix ``V`` — whichever
costs fewer multiply-adds (``SelectionRecord.routes`` says which ran). A policy turns
scores into weights ``w_i`` (0 = drop), and the step's gradient becomes::

    g' = c · (g − Σ_i (1 − w_i) g_i),     c = N / Σ_i w_i if renormalize else 1

``Σ_i u_i G_i = (u ⊙ D)ᵀ A`` is one GEMM per layer, so the correction is exact and costs
about one weight-gradient GEMM. It must reach *every* trainable parameter: captured layers
through their factors, element-wise-affine norms (LayerNorm, RMSNorm) through
:mod:`.affine`, anything else is refused unless ``uncovered="ignore"``.

Under DDP / FSDP2 every rank scores its own examples; scores are gathered so that the
policy sees the whole global batch (a bottom fraction is a fraction of the global batch),
the batch-mean target is the global mean, and the corrections are all-reduced and
averaged like the gradients themselves (:func:`.distributed.apply_correction`), so the
corrected step equals a single-process step over the kept examples.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import math
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from ..capture.experts import FusedExpertsRule, add_param
from ..capture.factors import Factors, OneHot, ghost_flops, ghost_inner, self_inner
from ..capture.layers import rule_class
from ..capture.wrappers import sharding
from ..errors import UnsupportedLayerError, OptionError
from . import distributed as _dist
from .affine import AffineRecorder, affine_kind
from .training import StepGrads, TrainingCapture

__all__ = ["Target", "BatchMean", "FixedTarget", "ValidationTarget", "Policy", "Threshold", "DropFraction",
           "Reweight", "RandomDrop", "KeepAll", "OnlineSelection", "SelectionRecord", "factor_sum",
           "dense_inner"]


# ---------------------------------------------------------------------------------- kernels
def factor_sum(F: Factors, u: torch.Tensor | None = None) -> torch.Tensor:
    """Σ_i u_i G_i = (u ⊙ D)ᵀ A over examples and positions, one GEMM.   Returns (out, in)."""
    D = F.D if u is None else F.D * u.to(F.D.dtype).view(-1, 1, 1)
    out = D.shape[-1]
    if isinstance(F.A, OneHot):
        D = D * F.A.weights(D.dtype).unsqueeze(-1)
        res = D.new_zeros(out, F.A.size)
        return res.index_add_(1, F.A.idx.reshape(-1), D.reshape(-1, out).T)
    return D.reshape(-1, out).T @ F.A.reshape(-1, F.A.shape[-1]).to(D.dtype)


def dense_inner(F: Factors, V: torch.Tensor) -> torch.Tensor:
    """⟨G_i, V⟩ = Σ_t d_itᵀ V a_it for each example (V: (out, in)).   Returns (n,)."""
    V = V.to(F.D.dtype)
    if isinstance(F.A, OneHot):
        AV = V.T[F.A.idx] * F.A.weights(V.dtype).unsqueeze(-1)  # (n, T, out)
    else:
        AV = F.A.to(V.dtype) @ V.T
    return (AV * F.D).sum(dim=(1, 2))


def _dense_cost(n, T, m, Tm, n_in, n_out, target_ready=False):
    """Multiply-adds of forming the target Σ_j c_j G_j once (unless ready) and Σ_t d_itᵀ V a_it."""
    return (0 if target_ready else m * Tm * n_in * n_out) + n * T * n_in * n_out


# ---------------------------------------------------------------------------------- targets
@dataclass
class TargetSpec:
    """One layer's target: a dense ``(out, in)`` matrix, or ``Σ_j c_j G_j`` over factored chunks."""

    dense: torch.Tensor | None = None
    factors: list = field(default_factory=list)   # [Factors]
    coeffs: list = field(default_factory=list)    # [(m_k,) tensor]


class Target(ABC):
    """The direction examples are scored against. Subclasses implement :meth:`specs`."""

    @abstractmethod
    def specs(self, sel: "OnlineSelection", step: StepGrads, layers: tuple[str, ...]) -> dict[str, TargetSpec]:
        """Per layer, the target direction as dense rows or factors."""


class BatchMean(Target):
    """The mean gradient of the step's (global) batch: keeps examples that agree with the batch."""

    def specs(self, sel, step, layers):
        N = step.n
        if _dist.is_distributed(sel.group):
            sums = [sum(factor_sum(c.blocks[name]) for c in step.chunks) for name in layers]
            count = torch.tensor([float(N)], dtype=sums[0].dtype, device=sums[0].device)
            *sums, count = _dist.all_reduce_sum(sums + [count], sel.group)
            return {name: TargetSpec(dense=s / count) for name, s in zip(layers, sums)}
        out = {}
        for name in layers:
            parts = [c.blocks[name] for c in step.chunks]
            coeffs = [torch.full((p.n,), 1.0 / N, dtype=p.D.dtype, device=p.D.device) for p in parts]
            out[name] = TargetSpec(factors=parts, coeffs=coeffs)
        return out


class FixedTarget(Target):
    """A fixed direction: ``{layer: (out, in) tensor}`` or the mean row of a GradientSet."""

    def __init__(self, target):
        self.target = target
        self._dense: dict | None = None

    def specs(self, sel, step, layers):
        if self._dense is None:
            t = self.target
            if isinstance(t, dict):
                dense = {k: torch.as_tensor(v) for k, v in t.items()}
            else:  # a GradientSet over the same layers
                dense = {k: v.mean(0) for k, v in t.to_dense().items()}
            missing = [name for name in layers if name not in dense]
            if missing:
                raise KeyError(f"the fixed target has no block for layers {missing}; it has {sorted(dense)}")
            for name in layers:
                shape = sel.capture.space[name].shape
                if tuple(dense[name].shape) != tuple(shape):
                    raise OptionError(f"target block {name!r} has shape {tuple(dense[name].shape)}, the layer's "
                                     f"gradient block is {tuple(shape)} (out, in + bias)")
            self._dense = dense
        return {name: TargetSpec(dense=self._dense[name]) for name in layers}


class ValidationTarget(Target):
    """The mean gradient of a validation batch, recomputed at the current parameters.

    loss : ``(model, batch) -> summed loss`` (or a :class:`gradalg.Task`).
    batch : the validation batch (same on every rank).
    every : recompute every ``every`` steps (one extra forward and a backward to the score
        layers' outputs only: no weight-gradient GEMMs).
    """

    def __init__(self, loss, batch, *, every: int = 1, token_mask: Callable | None = None):
        from ..task import Task

        if isinstance(loss, Task):
            token_mask = token_mask or loss.token_mask
            loss = loss.summed_loss
        self.loss = loss
        self.batch = batch
        self.every = int(every)
        self.token_mask = token_mask
        self._factors: dict | None = None
        self._m = 0

    def refresh(self, sel: "OnlineSelection", layers) -> None:
        """Recompute the validation batch's gradient factors at the current parameters (one
        forward and one backward to the layers' outputs, with training capture paused)."""
        from ..capture.hooks import ForwardRecorder, capture_batch
        from ..data import batch_size_of

        refs = [r for r in sel.capture.refs if r.name in layers]
        with sel.paused():
            with ForwardRecorder(refs) as rec:
                loss = self.loss(sel.model, self.batch)
            mask = self.token_mask(self.batch) if self.token_mask is not None else None
            self._factors = capture_batch(loss, rec, token_mask=mask)
        self._m = batch_size_of(self.batch)

    def specs(self, sel, step, layers):
        if self._factors is None or step.index % self.every == 0:
            self.refresh(sel, layers)
        out = {}
        for name in layers:
            F = self._factors[name]
            out[name] = TargetSpec(factors=[F], coeffs=[torch.full((F.n,), 1.0 / self._m, dtype=F.D.dtype,
                                                                   device=F.D.device)])
        return out


# ---------------------------------------------------------------------------------- policies
class Policy(ABC):
    """Turns the step's (global) scores into per-example weights (0 drops an example)."""

    @abstractmethod
    def weights(self, scores: torch.Tensor, step: int) -> torch.Tensor:  # (N,) -> (N,)
        """Per-example weights from the step's scores."""


@dataclass(frozen=True)
class KeepAll(Policy):
    """Weight 1 for every example (scores are still computed and recorded)."""

    def weights(self, scores, step):
        return torch.ones_like(scores)


@dataclass(frozen=True)
class Threshold(Policy):
    """Drop examples whose score is below ``min_score``."""

    min_score: float = 0.0

    def weights(self, scores, step):
        return (scores >= self.min_score).to(scores.dtype)


@dataclass(frozen=True)
class DropFraction(Policy):
    """Drop the ``floor(fraction · N)`` examples with the lowest scores (ties: lowest index first)."""

    fraction: float

    def __post_init__(self):
        if not 0.0 <= self.fraction < 1.0:
            raise OptionError(f"fraction must be in [0, 1), got {self.fraction}")

    def weights(self, scores, step):
        k = int(math.floor(self.fraction * scores.numel()))
        w = torch.ones_like(scores)
        if k:
            order = torch.argsort(scores, stable=True)
            w[order[:k]] = 0
        return w


@dataclass(frozen=True)
class RandomDrop(Policy):
    """Drop a random ``floor(fraction · N)`` examples (a baseline with the same cost)."""

    fraction: float
    seed: int = 0

    def weights(self, scores, step):
        k = int(math.floor(self.fraction * scores.numel()))
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        w = torch.ones_like(scores)
        w[torch.randperm(scores.numel(), generator=g)[:k].to(scores.device)] = 0
        return w


@dataclass(frozen=True)
class Reweight(Policy):
    """Weights from a function of the scores: ``w = fn(scores)`` ((N,) -> (N,), w ≥ 0)."""

    fn: Callable[[torch.Tensor], torch.Tensor]

    def weights(self, scores, step):
        w = torch.as_tensor(self.fn(scores), dtype=scores.dtype, device=scores.device)
        if w.shape != scores.shape:
            raise OptionError(f"the re-weighting function returned shape {tuple(w.shape)} for "
                             f"{tuple(scores.shape)} scores")
        return w

    @staticmethod
    def softmax(temperature: float = 1.0) -> "Reweight":
        """``w = N · softmax(s / temperature)``: mean weight 1, larger for higher scores."""
        return Reweight(lambda s: s.numel() * torch.softmax(s / temperature, 0))


# ---------------------------------------------------------------------------------- selection
@dataclass
class SelectionRecord:
    """What one step did: global scores and weights (N,), examples kept, routes per layer."""

    step: int
    scores: torch.Tensor
    weights: torch.Tensor
    routes: dict
    local: slice

    @property
    def kept(self) -> int:
        """Examples with a positive weight this step."""
        return int((self.weights > 0).sum())


class OnlineSelection:
    """Score each step's examples against a target, re-weight them, correct ``p.grad``.

    Parameters
    ----------
    target : :class:`BatchMean` (default), :class:`FixedTarget` or :class:`ValidationTarget`.
    policy : :class:`DropFraction`, :class:`Threshold`, :class:`Reweight`, :class:`RandomDrop`
        or :class:`KeepAll`.
    layers : layers whose factors are recorded (default: every supported layer). Every
        trainable parameter must be in one of them or in a LayerNorm/RMSNorm.
    score_layers : the layers scores are computed on (default: ``layers``).
    similarity : "dot" (default) or "cosine".
    renormalize : multiply the corrected gradient by N / Σ w (the mean over kept examples,
        for a mean-reduced loss).
    uncovered : "error" (default) refuses trainable parameters whose per-example gradients
        are unknown; "ignore" leaves their gradient uncorrected.
    world_reduction : how DDP/FSDP combined the ranks' gradients: "mean" (their default) or "sum".
    route : "auto" (default: fewer multiply-adds), "ghost" or "dense" — how scores against a
        factored target are computed (a dense target is always "dense").
    """

    def __init__(self, target: Target | None = None, policy: Policy | None = None, *, layers=None,
                 score_layers=None, similarity: str = "dot", renormalize: bool = False,
                 uncovered: str = "error", world_reduction: str = "mean", group=None,
                 keep_history: bool = True, route: str = "auto"):
        if route not in ("auto", "ghost", "dense"):
            raise OptionError(f"route must be 'auto', 'ghost' or 'dense', got {route!r}")
        self.route = route
        if similarity not in ("dot", "cosine"):
            raise OptionError(f"similarity must be 'dot' or 'cosine', got {similarity!r}")
        if uncovered not in ("error", "ignore"):
            raise OptionError(f"uncovered must be 'error' or 'ignore', got {uncovered!r}")
        self.target = target if target is not None else BatchMean()
        self.policy = policy if policy is not None else KeepAll()
        self.layers = layers
        self.score_layers = None if score_layers is None else tuple(
            [score_layers] if isinstance(score_layers, str) else score_layers)
        self.similarity = similarity
        self.renormalize = renormalize
        self.uncovered = uncovered
        self.world_reduction = world_reduction
        self.group = group
        self.keep_history = keep_history
        self.history: list[SelectionRecord] = []
        self._last: SelectionRecord | None = None
        self.capture: TrainingCapture | None = None
        self.model: nn.Module | None = None
        self._affine: AffineRecorder | None = None
        self._params: list = []

    # ------------------------------------------------------------------ setup
    def attach(self, model: nn.Module, *, optimizer=None, step_on: str = "auto", keep: bool = False):
        """Record ``model``; with ``optimizer`` the correction runs in its step pre-hook.

        ``step_on="manual"``: call :meth:`apply` yourself after the step's last backward
        (before gradient clipping, if any). Returns ``self`` (use it in a ``with``).
        """
        if sharding(model) == "fsdp1":
            raise UnsupportedLayerError(
                "online selection under FSDP1 (FullyShardedDataParallel) is not supported: it flattens "
                "parameters into shards whose layout the correction would need; use FSDP2 "
                "(torch.distributed.fsdp.fully_shard) or DDP. Capture alone works under FSDP1"
            )
        if step_on == "auto":
            step_on = "optimizer" if optimizer is not None else "manual"
        if step_on == "backward":
            raise OptionError("online selection corrects p.grad after the step's last backward has finished; "
                             "use step_on='optimizer' (with the optimizer) or 'manual' (call sel.apply())")
        self.capture = TrainingCapture(model, self.layers, optimizer=optimizer, keep=keep, step_on=step_on)
        self.model = self.capture.model
        names = self.capture.space.names
        if self.score_layers is None:
            self.score_layers = names
        missing = [s for s in self.score_layers if s not in names]
        if missing:
            raise KeyError(f"score_layers {missing} are not recorded layers {list(names)}")
        self.capture.on_step(self._on_step)
        self._setup_coverage()
        return self

    def _setup_coverage(self):
        captured = {id(u.module) for r in self.capture.refs for u in r.uses}  # a tied block: every use
        affine, uncovered, experts = {}, [], []
        for name, module in self.model.named_modules():
            own = [(pn, p) for pn, p in module.named_parameters(recurse=False) if p.requires_grad]
            if not own or id(module) in captured:
                continue
            if affine_kind(module) is not None:
                affine[name] = module
            else:
                uncovered.extend(f"{name}.{pn}" if name else pn for pn, _ in own)
                if rule_class(module) is FusedExpertsRule:
                    experts.append(name)
        if uncovered and self.uncovered == "error":
            shown = ", ".join(uncovered[:8]) + (f" (and {len(uncovered) - 8} more)" if len(uncovered) > 8 else "")
            fused = (f" ({len(experts)} fused experts module(s), e.g. {experts[0]!r}, are recorded by ga.grads "
                     "only, not by a training loop's capture: freeze them or pass uncovered='ignore')"
                     if experts else "")
            raise UnsupportedLayerError(
                f"online selection corrects the step's gradient exactly, which needs each example's "
                f"gradient for every trainable parameter; these are neither in a recorded layer nor in a "
                f"LayerNorm/RMSNorm: {shown}. Add their layers to `layers`, freeze them "
                f"(requires_grad=False), or pass uncovered='ignore' to leave them uncorrected{fused}"
            )
        self._affine = AffineRecorder(affine, lambda: self.capture.pending) if affine else None
        if self._affine is not None:
            self.capture._discard_callbacks.append(self._affine.clear)
        self._params = [p for p in self.model.parameters() if p.requires_grad]

    @property
    def last(self) -> SelectionRecord | None:
        """The last step's record (kept even with ``keep_history=False``)."""
        return self._last

    def apply(self):
        """Close the step now (``step_on="manual"``): score, weigh and correct ``p.grad``."""
        return self.capture.end_step()

    def paused(self):
        """Forwards/backwards inside this context are not recorded."""
        return _PausedSelection(self)

    def __enter__(self):
        if self.capture is None:
            raise RuntimeError("attach the selection to a model first: with sel.attach(model, optimizer=opt): ...")
        self.capture.__enter__()
        if self._affine is not None:
            self._affine.__enter__()
        return self

    def __exit__(self, *exc):
        if self._affine is not None:
            self._affine.__exit__(*exc)
        self.capture.__exit__(*exc)
        return False

    # ------------------------------------------------------------------ the step
    def scores(self, step: StepGrads) -> tuple[torch.Tensor, dict]:
        """This rank's scores (n,) of the step's examples, and the route taken per layer."""
        layers = tuple(self.score_layers)
        specs = self.target.specs(self, step, layers)
        total = None
        routes = {}
        sq = None
        t_sq = 0.0
        for name in layers:
            s, route, tn = _score_layer([c.blocks[name] for c in step.chunks], specs[name],
                                        need_target_norm=self.similarity == "cosine", route=self.route)
            routes[name] = route
            total = s if total is None else total + s
            if self.similarity == "cosine":
                part = torch.cat([self_inner(c.blocks[name]) for c in step.chunks])
                sq = part if sq is None else sq + part
                t_sq = t_sq + tn
        if self.similarity == "cosine":
            denom = (sq.clamp_min(0).sqrt() * math.sqrt(max(float(t_sq), 0.0))).clamp_min(1e-30)
            total = total / denom
        return total, routes

    def _on_step(self, step: StepGrads):
        local_scores, routes = self.scores(step)
        scores, mine = _dist.all_gather_scores(local_scores.detach(), self.group)
        weights = self.policy.weights(scores, step.index).to(scores.dtype)
        if bool((weights < 0).any()):
            raise OptionError("policy returned negative weights")
        u = (1.0 - weights[mine]).to(local_scores.device)
        if bool((weights != 1).any()):
            self._correct(step, u)
        if self.renormalize:
            kept = float(weights.sum())
            if kept <= 0:
                raise OptionError("every example of the step was dropped; cannot renormalize")
            _dist.scale_grads(self._params, scores.numel() / kept)
        if self._affine is not None:
            self._affine.clear()
        rec = SelectionRecord(step.index, scores.cpu(), weights.cpu(), routes, mine)
        if self.keep_history:
            self.history.append(rec)
        self._last = rec

    def _correct(self, step: StepGrads, u: torch.Tensor):
        corrections: dict = {}
        parts: dict = {}      # a fused experts' blocks add into one tensor per parameter (add_param)
        offsets = [0]
        for c in step.chunks:
            offsets.append(offsets[-1] + c.n)
        for ref in self.capture.refs:
            delta = None
            for k, c in enumerate(step.chunks):
                uk = u[offsets[k]:offsets[k + 1]]
                rows = (uk != 0).nonzero().flatten()
                if rows.numel() == 0:
                    continue
                F = c.blocks[ref.name]
                part = factor_sum(F, uk) if rows.numel() == uk.numel() else factor_sum(F[rows], uk[rows])
                delta = part if delta is None else delta + part
            if delta is None:  # nothing to remove on this rank: still join the all-reduce
                out, n_in = ref.rule.block_shape(ref.module)
                F = step.chunks[0].blocks[ref.name]
                delta = F.D.new_zeros(out, n_in)
            for pname, value in ref.rule.to_params(ref.module, delta.unsqueeze(0)).items():
                p = ref.module.get_parameter(pname)
                if p.requires_grad:
                    add_param(parts, p, value)
        for p, value in parts.items():
            _add(corrections, p, value[0])
        if self._affine is not None:
            for name, module in self._affine.modules.items():
                for k, c in enumerate(step.chunks):
                    uk = u[offsets[k]:offsets[k + 1]]
                    if "row_scale" in c.meta:  # the rows' scale applies to the norms' rows too
                        uk = uk * c.meta["row_scale"].to(uk.device, uk.dtype)
                    per = self._affine.per_example(k, name, c.n)
                    for pname, value in per.items():
                        p = getattr(module, pname)
                        if p.requires_grad:
                            _add(corrections, p, torch.einsum("n,n...->...", uk.to(value.dtype), value))
        _dist.apply_correction(corrections, world_reduction=self.world_reduction, group=self.group)


def _add(acc: dict, p, value):
    if p in acc:
        acc[p] = acc[p] + value.to(acc[p].dtype)
    else:
        acc[p] = value


def _score_layer(parts: list, spec: TargetSpec, need_target_norm: bool, route: str = "auto"):
    """(scores (n,), route taken, ‖target‖²) of one layer's chunks against ``spec``.

    route "auto" takes the cheaper of "ghost" (pairwise factor products) and "dense"
    (form Σ_j c_j G_j once, then Σ_t d_itᵀ V a_it) by multiply-adds.
    """
    if spec.dense is not None:
        V = spec.dense.to(parts[0].D.device)
        s = torch.cat([dense_inner(F, V) for F in parts])
        tn = float((V.double() ** 2).sum()) if need_target_norm else 0.0
        return s, "dense", tn
    n, T = sum(F.n for F in parts), max(F.T for F in parts)
    m, Tm = sum(F.n for F in spec.factors), max(F.T for F in spec.factors)
    n_in, n_out = parts[0].in_features, parts[0].out_features
    if route == "auto":
        cheaper = ghost_flops(n, m, T, Tm, n_in, n_out) <= _dense_cost(n, T, m, Tm, n_in, n_out)
        route = "ghost" if cheaper else "dense"
    if route == "ghost":
        cols = []
        for F in parts:
            acc = None
            for Ft, c in zip(spec.factors, spec.coeffs):
                v = ghost_inner(F, Ft) @ c.to(F.D.dtype)
                acc = v if acc is None else acc + v
            cols.append(acc)
        tn = 0.0
        if need_target_norm:
            for Fa, ca in zip(spec.factors, spec.coeffs):
                for Fb, cb in zip(spec.factors, spec.coeffs):
                    tn += float(ca.double() @ ghost_inner(Fa, Fb).double() @ cb.double())
        return torch.cat(cols), "ghost", tn
    V = sum(factor_sum(Ft, c) for Ft, c in zip(spec.factors, spec.coeffs))
    s = torch.cat([dense_inner(F, V) for F in parts])
    tn = float((V.double() ** 2).sum()) if need_target_norm else 0.0
    return s, "dense", tn


class _PausedSelection:
    def __init__(self, sel: OnlineSelection):
        self.sel = sel

    def __enter__(self):
        self.inner = self.sel.capture.paused()
        self.inner.__enter__()
        self.affine_on = self.sel._affine is not None and bool(self.sel._affine._handles)
        if self.affine_on:
            self.sel._affine.__exit__(None, None, None)
        return self.sel

    def __exit__(self, *exc):
        if self.affine_on:
            self.sel._affine.__enter__()
        self.inner.__exit__(*exc)
        return False
