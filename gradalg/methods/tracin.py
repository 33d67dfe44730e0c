"""TracIn-CP (Pruthi et al., "Estimating training data influence by tracing gradient
descent", NeurIPS 2020):

    S_qz = Σ_c η_c ⟨∇L(q; θ_c), ∇L(z; θ_c)⟩

over saved checkpoints θ_c with the learning rate η_c in force there. With
``curvature=`` each checkpoint's inner product is preconditioned by that checkpoint's own
inverse curvature (an influence function per checkpoint, summed along the trajectory):

    S_qz = Σ_c η_c ∇L(q; θ_c)ᵀ (H_c + λ_c I + wd_c)⁻¹ ∇L(z; θ_c)

with H_c any curvature of :func:`~gradalg.methods.influence.curvature_operator` (default
damping relative to each H_c's own spectrum, so checkpoints of different sharpness are
damped alike).
"""
from __future__ import annotations

import math

from typing import Sequence

from ..api import Scores, grads, sum_scores
from ..expr.projection import Projector, check_projector
from ..task import Task
from .influence import curvature_operator
from .registry import method
from ..errors import OptionError
from ..options import plain


@method('TracIn-CP: Σ_c η_c ⟨∇L(q; θ_c), ∇L(z; θ_c)⟩ over checkpoints (Pruthi et al. 2020); curvature= '
        'preconditions each checkpoint by its own H_c⁻¹')
def tracin(checkpoints: Sequence[Task], learning_rates: Sequence[float], train, queries, *, layers=None,
           projector: Projector | None = None, normalize: bool = False, curvature: str | None = None,
           damping: float | None = None, relative_damping: float | None = None,
           optimizers: Sequence | None = None, curvature_data=None, seed: int = 0,
           covariance_max_examples: int | None = None, lambda_max_examples: int | None = None) -> Scores:
    """``Σ_c η_c · P(Q_c) @ [H_c⁻¹ @] P(G_c).T``; one Task per checkpoint (same architecture).

    normalize : use cosine similarities per checkpoint (as in TracIn's "TracInCP-cos").
    curvature : None (plain TracIn) or a curvature of ``ga.methods.influence`` ("gauss_newton",
        "ekfac", "kfac", "empirical", ...) estimated at each checkpoint on ``curvature_data``
        (default ``train``), damped by ``damping`` or ``relative_damping`` × its mean eigenvalue
        (default: influence's default for that curvature: 1 × the mean eigenvalue for a dense
        one, λ_b per Kronecker block for K-FAC / EK-FAC).
    optimizers : with ``curvature``, the optimizer at each checkpoint: its weight decay enters
        H_c (see :mod:`gradalg.objective`).
    covariance_max_examples / lambda_max_examples : with ``curvature="kfac"`` / ``"ekfac"``, its
        statistics on the first m examples of the curvature data (``ga.methods.influence``).
    """
    if curvature is None and (covariance_max_examples is not None or lambda_max_examples is not None):
        raise OptionError("covariance_max_examples / lambda_max_examples need curvature='kfac' or 'ekfac'")
    checkpoints = list(checkpoints)
    if len(checkpoints) != len(learning_rates):
        raise OptionError(f"got {len(checkpoints)} checkpoints and {len(learning_rates)} learning rates")
    if not all(isinstance(plain(lr), (int, float)) and math.isfinite(plain(lr)) for lr in learning_rates):
        raise OptionError(f"learning_rates must be finite numbers, got {list(learning_rates)!r:.120}")
    if optimizers is not None and (curvature is None or len(optimizers) != len(checkpoints)):
        raise OptionError("optimizers= needs curvature= and one optimizer per checkpoint")
    if curvature is not None and normalize:
        raise OptionError("normalize=True is TracInCP-cos, a plain inner product: drop curvature= or normalize=")
    terms = []
    for c, task in enumerate(checkpoints):
        G, Q = grads(task, train, layers), grads(task, queries, layers)
        if projector is not None:
            G, Q = check_projector(projector)(G), projector(Q)
        if normalize:
            G, Q = G.normalize(), Q.normalize()
        if curvature is None:
            terms.append(Q @ G.T)
            continue
        Hinv = curvature_operator(task, train if curvature_data is None else curvature_data, layers=layers,
                                  projector=projector, curvature=curvature, damping=damping,
                                  relative_damping=relative_damping, seed=seed,
                                  optimizer=None if optimizers is None else optimizers[c],
                                  train_grads=G if curvature_data is None else None,
                                  covariance_max_examples=covariance_max_examples,
                                  lambda_max_examples=lambda_max_examples)
        terms.append(Q @ Hinv @ G.T)
    return sum_scores(terms, weights=learning_rates)
