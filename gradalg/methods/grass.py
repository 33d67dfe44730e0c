"""GraSS and FactGraSS (Hu et al., "GraSS: Scalable data attribution with gradient
sparsification and sparse projection", 2025):

    GraSS      Φ(z) = SJLT(M ∇L(z))               random mask M, then a sparse JL map
    FactGraSS  Φ(z) = SJLT((M_out D)ᵀ (M_in A))    the mask applied to the factors

followed by the TRAK/LoGra-style influence in the k-dimensional space (Gauss-Newton
gradients by the task's ``curvature_objective``: sampled labels for LM tasks):

    S_qz = Φ(q)ᵀ (Φᵀ Φ / n + λI)⁻¹ Φ(z)       (Gauss-Newton features when available)

λ defaults to ``relative_damping`` (0.1) × the mean eigenvalue of the projected
Gauss-Newton matrix (Kronfluence's heuristic): an absolute default cannot suit every
model's gradient scale (docs/fidelity.md, language recovery: 1e-3 scored 0.30, the
relative 0.1 0.37 and 1 0.39, chance 0.25). Measured by LDS (docs/fidelity.md): on a
2-layer GPT-2 relative 0.01 / 0.1 / 1 / 10 scored 0.21 / 0.25 / 0.27 / 0.25 (within
noise of each other above 0.01), while on the held-out settings 1 lost to 0.1
(digits logistic regression 0.77 against 0.81, another GPT-2 0.35 against 0.36):
0.1 stays.
"""
from __future__ import annotations

from ..proj import factgrass as factgrass_projector, grass as grass_projector
from ..api import Scores, fisher, grads
from ..task import Task
from .influence import auto_note, damping_rule, gauss_newton_objective
from .registry import method


RELATIVE_DAMPING = 0.1   # λ / mean eigenvalue with damping=None (the default before issue 31)
#: the default damping (issue 31): λ_b per layer block from its own spectrum (``damping="auto"``:
#: the eigenvalue where the top ones hold 0.95 of the block's trace), chosen by
#: benchmarks/defaults_suite.py across the nine fidelity settings (docs/fidelity.md)
DEFAULT_DAMPING = "auto"


@method('GraSS / FactGraSS: mask then sparse JL projection, influence in k dims (Hu et al. 2025)', cli=True)
def grass(task: Task, train, queries, *, layers=None, k: int = 256, seed: int = 0, damping=DEFAULT_DAMPING,
          relative_damping: float | None = None, factored: bool = True) -> Scores:
    """(Fact)GraSS influence scores with ``k`` coordinates per layer.

    k : coordinates per layer (256). Measured on the GPT-2 (LDS, relative damping 0.1):
        k = 64 / 256 / 1024 scored 0.24 / 0.25 / 0.20: more coordinates than training
        examples make the projected Gauss-Newton rank-deficient, and k = 1024 cost 6×
        more (docs/fidelity.md).
    damping : default ``"auto"`` (issue 31): λ_b for each layer's block of the projected
        Gauss-Newton from its own spectrum, the eigenvalue where its top eigenvalues hold 0.95
        of the block's trace (``ga.methods.influence``'s ``damping="auto"``; shown in the
        plan). Chosen by issue 31's rule (best worst case, then mean, LDS across the nine
        fidelity settings, never worse than the previous default by more than its bootstrap
        interval; ``benchmarks/defaults_suite.py``, docs/fidelity.md): worst / mean 0.256 /
        0.431 against 0.249 / 0.434 for the previous default (relative 0.1) and 0.236 / 0.414
        for relative 1. Per block against one λ from the pooled spectrum (issue 31, the reading
        that gave influence and RelatIF one λ on a dense H; same rule and suite): H here is
        block-diagonal (one projected block per layer, each block's spectrum is H's own), and
        per block stays ahead on seven of the nine settings:

        ====================  ======  =====  =====  =====  =====  ========  =====  =====  ======  =====  =====
        damping (mass 0.95)   logreg  mlp    lm     lm2    text   instruct  llama  conv   seqcls  worst  mean
        ====================  ======  =====  =====  =====  =====  ========  =====  =====  ======  =====  =====
        per block (default)   0.815   0.710  0.281  0.358  0.256  0.352     0.381  0.321  0.404   0.256  0.431
        one λ, pooled         0.815   0.697  0.265  0.359  0.243  0.341     0.375  0.327  0.409   0.243  0.426
        ====================  ======  =====  =====  =====  =====  ========  =====  =====  ======  =====  =====

        (``logreg`` has one layer: one block, the same λ. The LM columns are at the block-only
        layers; with a small vocabulary's embedding/head in the language tasks' default layers,
        ``text`` / ``instruct`` / ``llama`` at the default: 0.283 / 0.387 / 0.394.) ``None``: ``relative_damping`` (0.1
        if not given) × the mean eigenvalue of the projected Gauss-Newton matrix, computed with
        it; a number: an absolute λ; a ``ga.linalg.DampingRule``: another rule (one λ:
        ``DampingRule("mass", 0.95, per_block=False)``).
    relative_damping : c: λ = c × the mean eigenvalue, used when given (instead of the default
        ``"auto"``) or with ``damping=None`` (then c = 0.1, the default before issue 31: 1
        measured a little higher on a GPT-2, within noise, and lower on held-out logistic
        regression).
    factored : FactGraSS (default) or GraSS. At width neither forms a per-example
        gradient of a layer, let alone of the model: FactGraSS masks each layer's factors
        and forms only the (k_out, k_in) ≈ 4k masked gradient, GraSS gathers its mask_k
        coordinates from the factors; each layer's tables (about 4k entries) are seeded
        per layer (docs/projections.md, "At width").
    """
    P = factgrass_projector(k, seed) if factored else grass_projector(k, seed)
    G, Q = P(grads(task, train, layers)), P(grads(task, queries, layers))
    C = P(grads(task, train, layers, objective=gauss_newton_objective(task), seed=seed))
    H = fisher(C, structure="block")
    rule = damping_rule(damping, "block")
    if relative_damping is not None and (damping is None or damping is DEFAULT_DAMPING):
        H = H.damp(relative_damping, relative=True)                         # asked for: the relative rule
    elif rule is not None:
        H = H.damp(rule, note=(f"default: damping='auto', {rule.describe()}, from H's own spectrum (chosen on nine "
                               "fidelity settings)" if damping is DEFAULT_DAMPING else auto_note(damping, rule)))
    else:
        H = H.damp(RELATIVE_DAMPING, relative=True) if damping is None else H.damp(damping)
    return Q @ H.inv() @ G.T
