"""Copies of the trained model perturbed around it: an ensemble that trains nothing.

The LDS's ground truth averages the outcomes of retraining, and on a language model trained
by Adam those outcomes scatter widely around the trained model θ* (a second retraining of the
same subsets predicts the first with an LDS of only ≈ 0.5: docs/fidelity.md, "How repeatable
the ground truth is"). A method linearised at θ* alone answers for θ*'s neighbourhood of one
point. An ensemble over seeds or checkpoints averages over that scatter, at the price of
other runs; this averages over a neighbourhood of θ* itself. Each member is θ* with Gaussian
noise scaled to each parameter tensor's own size:

    θ_m,t = θ*_t + s · rms(θ*_t) · ε_m,t,     ε_m,t ~ N(0, I),     rms(x) = √(mean(x²)),

for every floating-point parameter tensor t that requires a gradient (a tied tensor once),
m = 1 … M, s = ``scale``. Scoring them with any method and averaging,

    S = (1/M) Σ_m method(task(θ_m), train, queries)       (``ga.methods.ensemble``),

costs M times the method and needs neither the run's checkpoints nor its optimizer.

Measured against the multi-run ground truths (docs/fidelity.md, "Perturbed copies of the
model"; ``benchmarks/explore_perturbed.py``): RelatIF at its defaults over M = 6 copies at
s = 0.3 raises every setting of the suite trained by Adam and stopped early (`lm` 0.466 →
0.545, `llama` 0.491 → 0.536, `text` 0.668 → 0.711, `instruct` 0.706 → 0.736, `lm2` 0.568 →
0.580 (0.604 at s = 0.2), the fine-tuned `seqcls` 0.405 → 0.473, `conv` 0.357 → 0.379); s = 0.3
has the best worst case and mean over the five language settings of s ∈ {0.1, 0.2, 0.3, 0.5}.
It is a recipe, not a default: M times the cost, and on models trained to a minimum (the
digits MLP 0.867 → 0.823, the logistic regression 0.940 → 0.897, influence at s = 0.3) the
noise moves the linearisation off the point the retrained models start from.
"""
from __future__ import annotations

import copy
import math
from numbers import Real

import torch

from ..api import _int, _positive_int
from ..errors import OptionError
from ..task import Task

__all__ = ["perturbed"]


def perturbed(task: Task, *, members: int = 6, scale: float = 0.3, seed: int = 0) -> list[Task]:
    """``members`` tasks over copies of ``task.model``, each parameter tensor moved by
    Gaussian noise of standard deviation ``scale`` × its own root-mean-square (module docs).

    task : the trained model and its loss; its model is copied, never changed.
    members : M, the number of copies (default 6).
    scale : s, the noise's size relative to each tensor's rms (default 0.3, chosen across the
        five language settings of the suite; docs/fidelity.md).
    seed : the noise's seed: the same seed gives the same copies.

    Returns a list of :class:`~gradalg.task.Task` with the task's loss and options; average a
    method over them with ``ga.methods.ensemble(method, tasks, train, queries)``. The M copies
    are held in memory at once (M × the model's size).
    """
    if not isinstance(task, Task):
        raise OptionError(f"perturbed takes a ga.Task (its model is copied), got {type(task).__name__}")
    members = _positive_int("members", members, "(the number of perturbed copies)")
    if not isinstance(scale, Real) or isinstance(scale, bool) or not math.isfinite(scale) or scale <= 0:
        raise OptionError(f"scale must be a positive finite number (the noise's size relative to each "
                          f"parameter tensor's rms, e.g. 0.3), got {scale!r}")
    generator = torch.Generator().manual_seed(_int("seed", seed))
    tasks = []
    for _ in range(members):
        model = copy.deepcopy(task.model)
        with torch.no_grad():
            for p in model.parameters():
                if p.requires_grad and p.is_floating_point():
                    noise = torch.randn(p.shape, generator=generator, dtype=p.dtype)
                    p.add_(noise.to(p.device) * (float(scale) * p.pow(2).mean().sqrt()))
        member = copy.copy(task)
        member.model = model
        tasks.append(member)
    return tasks
