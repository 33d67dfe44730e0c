"""Ready-made tasks for common losses.

``classification(model)`` builds a :class:`~gradalg.task.Task` for a classifier trained
with cross-entropy on batches ``(x, y)``, with everything the methods need:

* ``loss``          Σ_i −log p(y_i | x_i)
* ``sampled_loss``  Σ_i −log p(ŷ_i | x_i), ŷ_i ~ p(· | x_i): its gradients give the true
                    Fisher = Gauss-Newton matrix of the cross-entropy
* ``output``        Σ_i log(p_i / (1 − p_i)), p_i = p(y_i | x_i): TRAK's margin
* ``output_weight`` 1 − p_i: TRAK's Q
* ``expected_terms`` −Σ_i √p_ic log p_ic for each class c: their per-example gradients
                    give the exact Gauss-Newton matrix Σ_c p_c g_c g_cᵀ
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from .task import Task

__all__ = ["classification"]


def classification(model: nn.Module, *, inputs: Callable[[Any], Any] = lambda b: b[0],
                   targets: Callable[[Any], torch.Tensor] = lambda b: b[1],
                   name: str | None = None) -> Task:
    """A cross-entropy classification task over batches from which ``inputs(batch)`` and
    ``targets(batch)`` extract the model input and the (B,) integer labels."""

    def logits_of(m, batch):
        return m(inputs(batch))

    def loss(m, batch):
        return F.cross_entropy(logits_of(m, batch), targets(batch), reduction="sum")

    def sampled_loss(m, batch, rng):
        logits = logits_of(m, batch)
        probs = torch.softmax(logits.detach().to(torch.float64), dim=-1)
        return F.cross_entropy(logits, rng.sample(probs), reduction="sum")

    def margin(m, batch):
        logp = torch.log_softmax(logits_of(m, batch), dim=-1)
        y = targets(batch)
        correct = logp.gather(-1, y.unsqueeze(-1)).squeeze(-1)
        others = logp.scatter(-1, y.unsqueeze(-1), float("-inf")).logsumexp(-1)
        return (correct - others).sum()

    def one_minus_p(m, batch):
        p = torch.softmax(logits_of(m, batch), dim=-1).gather(-1, targets(batch).unsqueeze(-1)).squeeze(-1)
        return 1 - p

    def expected_terms(m, batch):
        logp = torch.log_softmax(logits_of(m, batch), dim=-1)
        weight = logp.detach().exp().sqrt()
        return [-(weight[:, c] * logp[:, c]).sum() for c in range(logp.shape[-1])]

    def loss_from_outputs(logits, batch):
        return F.cross_entropy(logits, targets(batch), reduction="sum")

    return Task(model, loss, sampled_loss=sampled_loss, output=margin, output_weight=one_minus_p,
                expected_terms=expected_terms, forward=logits_of, loss_from_outputs=loss_from_outputs, name=name or type(model).__name__)
