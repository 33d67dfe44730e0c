"""Tasks of the heads that are not single-label classifiers: regression (squared error)
and multi-label classification (one sigmoid per label), as HF's
``*ForSequenceClassification`` computes them for ``problem_type="regression"`` (or
``num_labels=1``) and ``"multi_label_classification"``.

With outputs ``f_i`` (C,) and labels ``y_i`` (C,), the loss of example ``i`` is HF's loss
of that example alone (a mean over the C outputs), and the task's loss their **sum**:

* regression    ℓ_i = (1/C) Σ_c (f_ic − y_ic)²                  Gauss-Newton: (2/C) JᵀJ
* multi-label   ℓ_i = (1/C) Σ_c BCE(σ(f_ic), y_ic)               Gauss-Newton: (1/C) Jᵀ diag(p(1−p)) J

and what the methods need comes with it:

* ``expected_terms``  one term per output c: √(2/C) f_c (regression), √(p_c(1−p_c)/C) f_c
                      with the weight detached (multi-label): Σ_c g_c g_cᵀ is the exact
                      Gauss-Newton matrix above
* ``sampled_loss``    ℓ at sampled labels (per example, seeded by id), scaled so that
                      E[ĝ ĝᵀ] is that Gauss-Newton matrix: ŷ = f + √(C/2) ε, ε ~ N(0, 1)
                      (regression); √C ℓ with ŷ_c ~ Bernoulli(p_c) (multi-label)
* ``output``          f_i = −ℓ_i, with ``output_weight`` 1: w ∇f = −∇ℓ exactly, as for the
                      classification margin (TRAK's training side is the negative loss gradient)

Labels: regression takes (B,) or (B, C) numbers of any dtype (integer labels are cast to
the outputs' dtype: they are targets, not class ids); multi-label takes (B, C) 0/1 labels.
"""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import HeadMismatchError
from ..task import ExampleRandom, Task

__all__ = ["regression_task", "multilabel_task"]


def _float_targets(outputs: torch.Tensor, y: torch.Tensor, task: str) -> torch.Tensor:
    """``y`` as (B, C) in the outputs' dtype, or a :class:`BatchContentError` naming the shapes."""
    if not isinstance(y, torch.Tensor):
        y = torch.as_tensor(y)
    B, C = outputs.shape
    if y.dim() == 1 and C == 1 and y.shape[0] == B:
        y = y.unsqueeze(1)
    if tuple(y.shape) != (B, C):
        raise HeadMismatchError(
            f"ga.tasks.{task}: labels of shape {tuple(y.shape)} for outputs of shape ({B}, {C}): give one "
            f"target per output, labels ({B}, {C})" + (f" or ({B},)" if C == 1 else ""))
    return y.to(device=outputs.device, dtype=outputs.dtype)


def regression_task(model: nn.Module, outputs_of: Callable, targets: Callable, *, check_batch=None,
                    token_mask=None, default_layers=None, name: str | None = None) -> Task:
    """Squared error of ``outputs_of(model, batch)`` (B, C) against ``targets(batch)``
    ((B,) or (B, C)): ℓ_i = mean_c (f_ic − y_ic)² (module docstring)."""

    def per_example(f, y):
        return ((f - _float_targets(f, y, "sequence_classification")) ** 2).mean(1)     # (B,)

    def sampled_loss(m, batch, rng: ExampleRandom):
        f = outputs_of(m, batch)
        u = rng.uniform(f.shape[1]).to(f.device).clamp(1e-12, 1 - 1e-12)
        y = f.detach() + math.sqrt(f.shape[1] / 2) * torch.special.ndtri(u).to(f.dtype)
        return per_example(f, y).sum()

    def expected_terms(m, batch):
        f = outputs_of(m, batch)
        scale = math.sqrt(2 / f.shape[1])
        return [scale * f[:, c].sum() for c in range(f.shape[1])]

    return _loss_task(model, outputs_of, targets, per_example, sampled_loss, expected_terms, check_batch,
                      token_mask, default_layers, name)


def multilabel_task(model: nn.Module, logits_of: Callable, targets: Callable, *, check_batch=None,
                    token_mask=None, default_layers=None, name: str | None = None) -> Task:
    """Binary cross-entropy of ``logits_of(model, batch)`` (B, C) against 0/1 ``targets(batch)``
    (B, C): ℓ_i = mean_c BCE(σ(f_ic), y_ic) (module docstring)."""

    def per_example(f, y):
        y = _float_targets(f, y, "sequence_classification")
        return F.binary_cross_entropy_with_logits(f, y, reduction="none").mean(1)        # (B,)

    def sampled_loss(m, batch, rng: ExampleRandom):
        f = logits_of(m, batch)
        u = rng.uniform(f.shape[1]).to(f.device)
        y = (u < torch.sigmoid(f.detach().to(torch.float64))).to(f.dtype)
        return math.sqrt(f.shape[1]) * per_example(f, y).sum()

    def expected_terms(m, batch):
        f = logits_of(m, batch)
        p = torch.sigmoid(f.detach())
        w = (p * (1 - p) / f.shape[1]).sqrt()
        return [(w[:, c] * f[:, c]).sum() for c in range(f.shape[1])]

    return _loss_task(model, logits_of, targets, per_example, sampled_loss, expected_terms, check_batch,
                      token_mask, default_layers, name)


def _loss_task(model, forward, targets, per_example, sampled_loss, expected_terms, check_batch, token_mask,
               default_layers, name) -> Task:
    """The Task of ℓ = Σ_i per_example(forward(m, b), targets(b))_i, with output f_i = −ℓ_i and
    output weight 1 (w ∇f = −∇ℓ exactly)."""

    def loss(m, batch):
        return per_example(forward(m, batch), targets(batch)).sum()

    def output(m, batch):
        return -loss(m, batch)

    def weight(m, batch):
        f = forward(m, batch)
        return torch.ones(f.shape[0], dtype=f.dtype, device=f.device)

    return Task(model, loss, sampled_loss=sampled_loss, output=output, output_weight=weight,
                expected_terms=expected_terms, forward=forward,
                loss_from_outputs=lambda f, b: per_example(f, targets(b)).sum(), check_batch=check_batch,
                token_mask=token_mask, default_layers=default_layers, name=name or type(model).__name__)
