"""TrackStar (Chang et al., "Scalable influence and fact tracing for large language model
pretraining", ICLR 2025):

    g̃(z)  = ∇_θ L(z) / (√v̂ + ε)                 optimizer second-moment correction (Adam's
                                                  bias-corrected v̂ and ε at the final checkpoint)
    Φ(z)  = P g̃(z)                               (k,) random projection
    Ḡ(z)  = R^{-1/2} Φ(z)                         R: autocorrelation of the projected,
                                                  corrected gradients (a Gauss-Newton proxy)
    G(z)  = Ḡ(z) / ‖Ḡ(z)‖                         unit normalization
    S_qz  = ⟨G(q), G(z)⟩

R = (1/n) Σ_z Φ(z)Φ(z)ᵀ over the training examples. The paper's task-specific correction
mixes in the same matrix over examples of the evaluation task,

    R = (1 − λ) R_train + λ R_task

so that directions common to the task's examples (shared templates, formatting) are
down-weighted by R^{-1/2}; ``task_data`` and ``mix`` = λ give it (the paper chooses λ so that
R_task's leading components dominate the mixture; there is no default: choose it for your
task). R is damped before its inverse square root: ``relative_damping`` × its mean
eigenvalue (needed when k exceeds the examples R is estimated on), or an absolute ``damping``.

The second moment is read from ``optimizer`` (a torch Adam / AdamW, or a transformers
Trainer) by :mod:`gradalg.objective`; the plan shows it as the diagonal's note.
"""
from __future__ import annotations

from ..api import Scores, diagonal, fisher, grads
from ..expr.projection import Projector
from ..objective import training_objective
from ..task import Task
from .trak import default_projector

RELATIVE_DAMPING = 0.1   # λ_R / mean eigenvalue of R: Kronfluence's factor (chosen, not measured for TrackStar)


def trackstar(task: Task, train, queries, *, optimizer, layers=None, k: int = 4096, seed: int = 0,
              projector: Projector | None = None, task_data=None, mix: float | None = None,
              damping: float | None = None, relative_damping: float = RELATIVE_DAMPING,
              correction: bool = True) -> Scores:
    """TrackStar scores (n_query, n_train): cosines of R^{-1/2}-whitened, projected,
    second-moment-corrected loss gradients.

    optimizer : the Adam/AdamW optimizer (or Trainer) at the checkpoint attributed; its
        bias-corrected second moment v̂ and ε give the correction. ``correction=False``
        leaves it out (then ``optimizer`` may be None).
    k : projection size (the paper uses 2¹⁶ for 8B models); projector : default
        :func:`~gradalg.methods.trak.default_projector` (dense Gaussian while the matrix is
        small, sparse JL beyond).
    task_data, mix : examples of the evaluation task and λ for R = (1 − λ)R_train + λR_task.
    """
    if task_data is not None and mix is None:
        raise ValueError("task_data= needs mix= (λ in R = (1 − λ) R_train + λ R_task, e.g. 0.5)")
    if mix is not None and (task_data is None or not 0.0 <= mix <= 1.0):
        raise ValueError(f"mix must be in [0, 1] and comes with task_data=, got mix={mix!r}")
    G, Q = grads(task, train, layers), grads(task, queries, layers)
    if correction:
        if optimizer is None:
            raise ValueError("TrackStar's correction divides by Adam's √v̂ + ε: pass optimizer= (the Adam/AdamW "
                             "optimizer at this checkpoint), or correction=False")
        objective = training_objective(optimizer)
        v_hat, eps = objective.second_moment(G)
        D = diagonal(1.0 / (v_hat.sqrt() + eps), G, note=objective.second_moment_note())   # (dim,) elementwise

        def corrected(X):
            return X @ D
    else:
        def corrected(X):
            return X
    P = projector or default_projector(k, G.space.dim, seed)
    Phi, phi = P(corrected(G)), P(corrected(Q))                       # (n, k), (n_q, k)
    R = fisher(Phi)                                                    # (1/n) Σ Φ Φᵀ   (k, k)
    if task_data is not None:
        R = (1.0 - mix) * R + mix * fisher(P(corrected(grads(task, task_data, layers))))
    R = R.damp(damping, note="damping (given)") if damping is not None else R.damp(
        relative_damping, relative=True, note=f"default: {relative_damping:g} × mean eigenvalue")
    W = R.pow(-0.5)                                                    # R^{-1/2}
    return (phi @ W).normalize() @ (Phi @ W).normalize().T
