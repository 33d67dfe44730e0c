"""Exact metagradients of query functions with respect to per-example data weights.

For a run ``s_{t+1} = Φ_t(s_t; ε)`` (state s = (θ, optimizer state), t = 0 … T−1) and
query functions f_q(θ_T), reverse mode gives, with the adjoint ``λ_t = ∂f_q/∂s_t``:

    λ_T = (∇_θ f_q(θ_T), 0)
    λ_t = (∂Φ_t/∂s_t)ᵀ λ_{t+1}                         (vjp in the state)
    ∂f_q/∂ε_i = Σ_{t : i ∈ B_t} [(∂Φ_t/∂ε_{B_t})ᵀ λ_{t+1}]_i   (vjp in the batch's weights)

Each step's vector-Jacobian product is one ``torch.func.vjp`` of the step function (it
contains ``torch.func.grad`` of the weighted batch loss, so it differentiates through
the gradient: a Hessian-vector product and per-example gradient-vector products, never
per-example gradients themselves). All queries are carried together: the vjp is
``vmap``-ed over the stack of adjoints, (n_query, *state).

The states s_t are visited backwards by a schedule of :mod:`gradalg.unroll.replay`
(memory O(T), O(√T) or O(log T) states). Every replayed step is checked against the
state it must reproduce (the primal output of step t's vjp against s_{t+1} of the
first run or of the recomputation that produced it): a run that does not replay
exactly raises :class:`NonDeterministicTrainingError` naming the step.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch.func import jacrev, vjp, vmap

from ..errors import NonFiniteGradientError, OptionError
from ..options import get_options
from .errors import NonDeterministicTrainingError, UnsupportedTrainingError
from .replay import Ledger, reverse_states
from .run import TrainingRun

__all__ = ["metagradients", "Metagradients"]


@dataclass
class Metagradients:
    """Result of :func:`metagradients`."""

    values: torch.Tensor          # (n_query, n_train)  ∂f_q(θ_T)/∂ε_i at ε = weights
    targets: torch.Tensor         # (n_query,)          f_q(θ_T)
    ledger: Ledger                # states held (peak) and forward steps run
    initial: dict                 # name -> (n_query, *shape): ∂f_q/∂θ_0


def _max_rel_diff(a: dict, b: dict) -> float:
    worst = 0.0
    for k in a:
        scale = float(b[k].abs().max()) if b[k].numel() else 0.0
        diff = float((a[k] - b[k]).abs().max()) if a[k].numel() else 0.0
        worst = max(worst, diff / max(scale, 1e-300) if diff else 0.0)
    return worst


def _check_replay(t: int, got, expected, tolerance: float) -> None:
    (p1, o1), (p2, o2) = got, expected
    flat_got = {**{f"θ.{k}": v for k, v in p1.items()}, **_flatten_state(o1)}
    flat_exp = {**{f"θ.{k}": v for k, v in p2.items()}, **_flatten_state(o2)}
    if tolerance == 0.0:
        same = all(torch.equal(flat_got[k], flat_exp[k]) for k in flat_got)
        if same:
            return
    diff = _max_rel_diff(flat_got, flat_exp)
    if diff > tolerance:
        raise NonDeterministicTrainingError(
            f"step {t} of the training run does not replay exactly (largest relative difference {diff:.3g} "
            f"> replay_tolerance {tolerance:g}): the loss or the model draws random numbers (pass "
            "random_seed= to TrainingRun) or runs non-deterministic kernels (on a GPU: "
            "torch.use_deterministic_algorithms(True), or a replay_tolerance such as 1e-6)")


def _flatten_state(state: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in state.items():
        if isinstance(v, dict):
            out.update(_flatten_state(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def metagradients(run: TrainingRun, query_fn: Callable[[dict], torch.Tensor], *, weights=None,
                  checkpointing="sqrt", replay_tolerance: float = 0.0) -> Metagradients:
    """∂f_q(θ_T)/∂ε_i for every query q and training example i, through the whole run.

    query_fn : ``query_fn(params) -> (n_query,)``, differentiable in ``params`` (a dict
        over ``run.param_names``), e.g. the query losses at θ_T.
    weights : the data weights ε (n_train,) at which to differentiate (default ones).
    checkpointing : "all", "sqrt" (default), "log" or an int interval
        (:mod:`gradalg.unroll.replay`).
    replay_tolerance : largest relative difference allowed between a replayed step and
        the state it must reproduce (0: bit-identical).

    Memory: the schedule's states (at most ``replay.schedule_bound(checkpointing, T)``
    copies of θ and the optimizer state) plus the adjoints, ``n_query`` copies of the
    state. Compute: one vjp per step (≈ 3–4 forward-backward passes of a batch, for all
    queries at once) plus the schedule's recomputed steps.
    """
    eps = run._weights(weights)
    ledger = Ledger()

    def advance(state, t):
        params, opt = state
        return run.step(params, opt, eps[run.batches[t]], t)

    final, backwards = reverse_states(run.initial_state(), run.n_steps, advance, checkpointing, ledger)
    final_params = final[0]
    targets = query_fn(final_params)
    if targets.ndim != 1:
        raise OptionError(f"query_fn must return a vector (n_query,), got shape {tuple(targets.shape)}")
    n_query = targets.shape[0]
    lam_params = jacrev(query_fn)(final_params)                         # name -> (n_query, *shape)
    lam_state = _zeros_like_batched(final[1], n_query)
    out = torch.zeros(n_query, run.n_train, dtype=run.dtype, device=run.device)
    expected = final
    for t, (params, opt) in backwards:
        idx = run.batches[t].to(run.device)

        def step(p, o, w, t=t):
            return run.step(p, o, w, t)

        primal, vjp_fn = vjp(step, params, opt, eps[idx])
        _check_replay(t, primal, expected, replay_tolerance)
        lam_params, lam_state, lam_w = _second_order(vmap(vjp_fn), (lam_params, lam_state), t)
        out.index_add_(1, idx, lam_w.to(out.dtype))
        expected = (params, opt)
    if get_options().check_finite and not (bool(torch.isfinite(out).all()) and bool(torch.isfinite(targets).all())):
        _name_nonfinite(run, query_fn, eps, targets)
    return Metagradients(out, targets.detach(), ledger, lam_params)


def _name_nonfinite(run: TrainingRun, query_fn, eps: torch.Tensor, targets: torch.Tensor) -> None:
    """NaN/inf metagradients: find where they start and raise
    :class:`~gradalg.errors.NonFiniteGradientError` naming it. Runs only on failure: the
    run's forward once more (:meth:`TrainingRun.name_nonfinite`: a training example's
    loss, inputs or gradient, or a run that diverges), then the queries' losses at θ_T."""
    run.name_nonfinite(eps)
    bad = (~torch.isfinite(targets.detach())).nonzero().flatten().tolist()
    if bad:
        raise NonFiniteGradientError(
            bad, [], "NaN/inf query losses at the run's final parameters (MAGIC; ids are query positions)",
            "Check these queries' inputs and labels, or remove them from the queries")
    raise NonFiniteGradientError(
        [], [], "the MAGIC metagradients hold NaN/inf though the run's losses, its parameters and the query "
        "losses are finite: an overflow in the backward through the steps (second derivatives)",
        "Compute in float64 (model.double() and float64 data), or use a smaller learning rate")


def _second_order(vjp_fn, adjoints, t: int):
    """Step t's vjp (it differentiates the step's gradient: a second derivative of the
    loss). An operation of the model with no second derivative is refused by name."""
    try:
        return vjp_fn(adjoints)
    except RuntimeError as exc:
        text = str(exc)
        if "derivative for" not in text or "not implemented" not in text:
            raise
        raise UnsupportedTrainingError(
            f"the loss of the training run cannot be differentiated twice (step {t}): {text.splitlines()[0]}. "
            "MAGIC differentiates each step's gradient; use twice-differentiable operations — for fused "
            "attention kernels (F.scaled_dot_product_attention on CPU, a transformers model's default "
            "'sdpa'), the plain attention: attn_implementation=\"eager\" in the model's config") from exc


def _zeros_like_batched(state: dict, n: int) -> dict:
    return {k: (_zeros_like_batched(v, n) if isinstance(v, dict) else
                torch.zeros((n, *v.shape), dtype=v.dtype, device=v.device)) for k, v in state.items()}
