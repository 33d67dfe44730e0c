"""TRAK (Park et al., "TRAK: Attributing model behavior at scale", ICML 2023).

For each model m of an ensemble (independently trained, or checkpoints):

    Φ_m = P ∇_θ f(z)              (n, k)  projected gradients of the output function
    φ_m = P ∇_θ f(q)              (n_q, k)                        f = log p/(1−p)
    S_m = φ_m (Φ_mᵀ Φ_m + λI)⁻¹ Φ_mᵀ diag(1 − p_z)

    S = (1/M) Σ_m S_m

The projection seed is shared by the ensemble, the kernel is per model, and the
(1 − p) weighting is TRAK's Q matrix. For sequences (``ga.tasks.causal_lm``: f = Σ_t f_t,
one margin per counted token) Q is applied **per token**: the training side is
P ∇ Σ_t (1 − p_t) f_t (the task's ``weighted_output``, 1 − p_t detached), which equals
−P ∇L(z) exactly because (1 − p_t) ∇f_t = ∇ log p_t; one weight per sequence would
weigh a sequence's well-predicted tokens like its surprising ones. (The paper's final soft-thresholding is left out:
it is a post-processing choice, easy to apply to the returned DataArray.)
"""
from __future__ import annotations

from typing import Sequence

from ..api import Scores, fisher, grads, mean_scores, row_weights
from ..expr.projection import Projector, dense_or_sparse, check_projector
from ..task import Task
from .influence import auto_note, damping_rule
from .registry import method
from ..errors import OptionError

RELATIVE_DAMPING = 1.0    # λ / mean eigenvalue of TRAK's kernel with damping=None (the default before issue 31)
#: the default damping (issue 31): λ from the kernel's own spectrum (``damping="auto"``: the
#: eigenvalue where the top ones hold 0.95 of its trace), chosen by benchmarks/defaults_suite.py
#: across the nine fidelity settings (docs/fidelity.md, "How the defaults were chosen")
DEFAULT_DAMPING = "auto"
K = 2048                  # default projection dimension (docs/fidelity.md, "How the defaults were chosen")


def default_projector(k: int, dim: int, seed: int = 0) -> Projector | None:
    """TRAK's projection when none is given: none at all when the gradients have at most
    ``k`` coordinates (a projection up to k ≥ dim adds cost and reduces nothing); else, by
    width (:func:`~gradalg.expr.projection.dense_or_sparse`), the paper's dense Gaussian
    while its (k, dim) float64 matrix is within ``ga.options(dense_projection_bytes)``
    (1 GiB: dim ≤ 65,536 at k = 2048), a sparse Johnson–Lindenstrauss projection (SJLT)
    with the same k while its tables are within ``ga.options(sjlt_table_bytes)`` (256 MiB:
    dim ≤ 53 M, the GPT-2s of docs/fidelity.md), and a TensorSketch above (an SJLT with a
    hash factored over each layer's outputs and inputs, applied to the factors by FFT).
    All preserve inner products in expectation. At width nothing is formed for the
    whole model: each block is projected on its own (seeded per block) and the blocks
    summed into the k coordinates; the TensorSketch never forms a layer's gradient either
    (on GPT-2 small, 85 M coordinates, TRAK then costs 1.1× LoGra; with the SJLT 3.2×)."""
    if dim <= k:
        return None
    return dense_or_sparse("gaussian", k, dim, seed)


@method('TRAK: projected output-function gradients, Gauss-Newton kernel, ensembles (Park et al. 2023)', cli=True)
def trak(tasks: Task | Sequence[Task], train, queries, *, layers=None, projector: Projector | None = None,
         k: int = K, seed: int = 0, damping=DEFAULT_DAMPING, relative_damping: float | None = None,
         weight_decay: float = 0.0) -> Scores:
    """TRAK scores for one task or an ensemble of tasks (same architecture, other weights).

    projector : default :func:`default_projector` — none when the gradients have at most
        ``k`` coordinates, a dense Gaussian (the paper's) for small models, a sparse JL
        projection once the dense matrix would pass ``ga.options(dense_projection_bytes)``
        (1 GiB: GPT-2-sized layers), a TensorSketch once its tables would pass
        ``ga.options(sjlt_table_bytes)`` (10⁸-parameter models), with the same ``k`` and
        ``seed``, applied block by block (the plan's "projection map" decision says which
        and why).
    k : projection dimension of the default projector, 2048. Measured (docs/fidelity.md,
        LDS on 50 retrained halves of a 2-layer GPT-2, one model): k = 128 / 512 / 2048
        scored 0.20 / 0.31 / 0.36 (EK-FAC influence 0.36), and 2048 was also the cheaper
        (sparse projection: 24× a forward+backward pass against 41× for the dense 512).
        Held out: another GPT-2 0.40 (EK-FAC 0.44); digits logistic regression 0.79 →
        0.85 (its 650 coordinates ≤ k: no projection).
    damping : λ of the kernel (ΦᵀΦ + λI)⁻¹. Default ``"auto"`` (issue 31): λ from the
        kernel's own spectrum, the eigenvalue where its top eigenvalues hold 0.95 of the trace
        (``ga.methods.influence``'s ``damping="auto"`` for a dense H; shown in the plan), plus
        n·wd when ``weight_decay`` is given. Chosen by issue 31's rule (best worst case, then
        mean, LDS across the nine fidelity settings of docs/fidelity.md, never worse than the
        previous default by more than its bootstrap interval): worst / mean 0.218 / 0.453
        against 0.212 / 0.447 for relative 1 × the mean eigenvalue (the previous default) and
        0.195 / 0.385 for 0.1
        (``benchmarks/defaults_suite.py``). Where the kernel spans several layers' blocks (no
        projection: at most ``k`` coordinates over several layers) ``"auto"`` takes λ_b per
        block; one λ from the pooled spectrum (``DampingRule("mass", 0.95, per_block=False)``,
        RelatIF's rule for a dense H) was measured against it on the nine settings (issue 31):
        there the kernel has ONE block everywhere (``logreg``: one layer, 650 coordinates,
        unprojected; the other eight projected into one k-block), so both rules give the same λ
        and the same LDS (worst / mean 0.218 / 0.453); per block is kept (the rule keeps the
        default on a tie), and the choice for a multi-layer unprojected kernel is unmeasured.
        ``None``: λ = ``relative_damping`` (1 if not given) × the kernel's
        mean eigenvalue tr(ΦᵀΦ)/k, computed with the kernel — unless ``weight_decay`` is
        given, whose n·wd is then the damping (the training objective's own curvature, as
        measured on digits). A number: an absolute λ; a ``ga.linalg.DampingRule``: another
        rule. An absolute default cannot work across models (the kernel's eigenvalues
        scale with n, the gradients' size and 1/k), and a tiny one fails when k ≥ n: the
        kernel then has rank ≤ n and φ_q(ΦᵀΦ + λI)⁻¹Φᵀ interpolates (measured in
        docs/fidelity.md: chance-level scores on a 256-sequence LM at k = 512, λ = 1e-6).
    relative_damping : c: λ = c × the kernel's mean eigenvalue, used when given (instead of
        the default ``"auto"``) or with ``damping=None`` (then c = 1, the default before issue 31).
    weight_decay : the L2 coefficient of the (mean-loss) training objective; it adds
        n·wd to the kernel's damping, the curvature weight decay gives the summed
        objective. Measured on digits logistic regression (docs/fidelity.md, 100
        subsets): TRAK scored 0.62 with it and 0.85 with the default relative damping,
        so pass it only to match that objective on purpose.
    """
    tasks = [tasks] if isinstance(tasks, Task) else list(tasks)
    if not tasks or not all(isinstance(t, Task) for t in tasks):
        raise OptionError(f"trak takes a ga.Task or a non-empty list of them (an ensemble), got {tasks!r:.80}")
    P = check_projector(projector) or default_projector(k, grads(tasks[0], train, layers).space.dim, seed) or (lambda G: G)
    per_model = []
    for task in tasks:
        if task.output is None or (task.output_weight is None and task.weighted_output is None):
            raise OptionError("TRAK needs Task(..., output=..., output_weight=...) or weighted_output=...; "
                             "ga.tasks.classification(model) and ga.tasks.causal_lm(model) provide them")
        Phi = P(grads(task, train, layers, objective="output"))
        phi = P(grads(task, queries, layers, objective="output"))
        n = Phi.n
        gram = fisher(Phi) * n                                               # ΦᵀΦ
        rule, lam = damping_rule(damping), damping
        if relative_damping is not None and (damping is None or damping is DEFAULT_DAMPING):
            gram, lam = gram.damp(relative_damping, relative=True), None           # asked for: the relative rule
        elif rule is not None:                                                 # λ from the kernel's spectrum
            note = (f"default: damping='auto', {rule.describe()}, from the kernel's own spectrum (chosen on nine "
                    "fidelity settings)" if damping is DEFAULT_DAMPING else auto_note(damping, rule))
            gram, lam = gram.damp(rule, note=note), None
        elif damping is None and not weight_decay:
            gram = gram.damp(RELATIVE_DAMPING, relative=True)
        kernel = gram.damp((lam or 0.0) + n * weight_decay).inv()           # (ΦᵀΦ + λI)⁻¹
        if task.weighted_output is not None:     # Q per token: ΦᵀQ = P ∇ Σ_t (1 − p_t) f_t
            train_side = P(grads(task, train, layers, objective="weighted_output"))
        else:                                    # Q per example
            train_side = Phi * row_weights(task.output_weight, "1 - p")
        per_model.append(phi @ kernel @ train_side.T)
    return mean_scores(per_model)
