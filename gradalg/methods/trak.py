"""TRAK (Park et al., "TRAK: Attributing model behavior at scale", ICML 2023).

For each model m of an ensemble (independently trained, or checkpoints):

    Φ_m = P ∇_θ f(z)              (n, k)  projected gradients of the output function
    φ_m = P ∇_θ f(q)              (n_q, k)                        f = log p/(1−p)
    S_m = φ_m (Φ_mᵀ Φ_m + λI)⁻¹ Φ_mᵀ diag(1 − p_z)

    S = (1/M) Σ_m S_m

The projection seed is shared by the ensemble, the kernel is per model, and the
(1 − p) weighting is TRAK's Q matrix. (The paper's final soft-thresholding is left out:
it is a post-processing choice, easy to apply to the returned DataArray.)
"""
from __future__ import annotations

from typing import Sequence

from ..api import Scores, fisher, grads, mean_scores, row_weights
from ..expr.projection import Projector, gaussian
from ..task import Task


def trak(tasks: Task | Sequence[Task], train, queries, *, layers=None, projector: Projector | None = None,
         k: int = 512, seed: int = 0, damping: float = 1e-6, weight_decay: float = 0.0) -> Scores:
    """TRAK scores for one task or an ensemble of tasks (same architecture, other weights).

    weight_decay : the L2 coefficient of the (mean-loss) training objective; it adds
        n·wd to the kernel's damping, the curvature weight decay gives the summed
        objective. Measured on digits (docs/fidelity.md), leaving it out of a weight-
        decayed model's kernel cost TRAK most of its LDS.
    """
    tasks = [tasks] if isinstance(tasks, Task) else list(tasks)
    P = projector or gaussian(k, seed)
    per_model = []
    for task in tasks:
        if task.output is None or task.output_weight is None:
            raise ValueError("TRAK needs Task(..., output=..., output_weight=...); "
                             "ga.tasks.classification(model) provides them")
        Phi = P(grads(task, train, layers, objective="output"))
        phi = P(grads(task, queries, layers, objective="output"))
        n = Phi.n
        kernel = (fisher(Phi) * n).damp(damping + n * weight_decay).inv()   # (ΦᵀΦ + λI)⁻¹
        weights = row_weights(task.output_weight, "1 - p")
        per_model.append(phi @ kernel @ (Phi * weights).T)
    return mean_scores(per_model)
