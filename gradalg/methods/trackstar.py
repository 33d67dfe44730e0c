"""TrackStar (Chang, Rajagopal, Bolukbasi, Dixon & Tenney, "Scalable influence and fact
tracing for large language model pretraining", ICLR 2025, arXiv:2410.17413):

    g̃(z)  = ∇_θ L(z) / (√v̂ + ε)                 optimizer second-moment correction (Adam's
                                                  bias-corrected v̂ and ε at the checkpoint)
    Φ(z)  = P g̃(z)                               (k,) random projection
    Ḡ(z)  = R^{-1/2} Φ(z)                         R: autocorrelation of the projected,
                                                  corrected gradients (a Gauss-Newton proxy)
    G(z)  = Ḡ(z) / ‖Ḡ(z)‖                         unit normalization
    S_qz  = ⟨G(q), G(z)⟩

R = (1/n) Σ_z Φ(z)Φ(z)ᵀ over the training examples. The paper's task-specific correction
mixes in the same matrix over examples of the evaluation task,

    R = (1 − λ) R_train + λ R_task

so that directions common to the task's examples (shared templates, formatting) are
down-weighted by R^{-1/2}; ``task_data`` and ``mix`` = λ give it. ``mix="auto"`` applies
the paper's rule for λ (its appendix A.1.3): with σ_train and σ_task the eigenvalues of
R_train and R_task, each sorted in decreasing order, and c = ``downweight_components``,

    λ · σ_task[c] = (1 − λ) · σ_train[c]    ⇒    λ = σ_train[c] / (σ_task[c] + σ_train[c])

so that R_task dominates the mixture on its top c components and R_train beyond them
(c ≈ 1000 of 2¹⁶ dimensions in the paper: λ ≈ 0.90 on T-REx, 0.99 on C4).

R is damped before its inverse square root: by default one λ from R's own spectrum
(:data:`DEFAULT_RULE`; needed when k exceeds the examples R is estimated on), or
``relative_damping`` × its mean eigenvalue, or an absolute ``damping``, or
``damping="auto"`` / a ``ga.linalg.DampingRule`` (λ_b per block from R's own spectrum, as
``ga.methods.influence``'s).

Checked against the public implementation in EleutherAI's Bergson
(github.com/EleutherAI/bergson: ``bergson/utils/math.py`` ``compute_lambda`` — the rule
for λ above, citing §A.1.3 — and ``damped_psd_power``; ``bergson/process_grads.py``
``mix_preconditioners`` — λ·R_task + (1 − λ)·R_train; ``bergson/gradients.py``
``AdamNormalizer`` — g / (√v + ε), ε outside the root, applied before the projection;
``bergson/hessians/autocorrelation.py`` — R as the Gram of the projected gradients).
Where that implementation differs from this module, the difference is a choice, not the
formula:

* the second moment: Bergson divides by the raw ``exp_avg_sq`` v with ε = 1e-8, this
  module by the bias-corrected v̂ = v / (1 − β₂ᵗ) with the optimizer's own ε. The
  factor 1 / (1 − β₂ᵗ) is the same for every coordinate, so the cosines differ only
  through the relative size of ε (and not at all once t ≫ 1 / (1 − β₂));
* R: Bergson keeps one R per module by default (block-diagonal; a "joint" option keeps
  one over all modules, as here) and damps it by 0.1 × the mean |R_ij|; this module
  damps by 0.1 × the mean eigenvalue (Kronfluence's scale-free rule), which is the
  same kind of scale-free damping on a different statistic;
* the projection: Bergson projects each module's (corrected) gradient matrix with two
  small matrices, A G Bᵀ (optionally reshaped to the nearest square first); the default
  here is :func:`~gradalg.methods.trak.default_projector` (a dense Gaussian, or a
  sparse JL projection for large models). Any ``ga.proj`` projector can be passed.

The second moment is read from ``optimizer`` (a torch Adam / AdamW, or a transformers
Trainer) by :mod:`gradalg.objective`; the plan shows it as the diagonal's note.
"""
from __future__ import annotations

import numbers

import torch

from ..api import Scores, diagonal, fisher, grads
from ..expr.projection import Projector, check_projector
from ..objective import training_objective
from ..task import Task
from ..linalg.autodamp import DampingRule
from .influence import auto_note, damping_rule
from .registry import method
from .relatif import _DefaultDamping
from .trak import default_projector
from ..errors import OptionError

RELATIVE_DAMPING = 0.1   # λ_R / mean eigenvalue of R with damping=None (the default before issue 31)
#: the default damping (issue 31; its marker equals ``"auto"``, a given ``damping="auto"`` is told
#: apart by identity): :data:`DEFAULT_RULE`, chosen by the suite rule across the nine fidelity
#: settings (``benchmarks/defaults_suite.py``; docs/fidelity.md, "How the defaults were chosen")
DEFAULT_DAMPING = _DefaultDamping("auto")
#: the default λ of R: the eigenvalue where R's largest eigenvalues hold 0.95 of its trace, one λ
#: from the pooled spectrum. R is dense (it couples the layers' blocks where the gradients are not
#: projected); projected into one k-block, as on every LM setting, it is ``damping="auto"``'s λ
DEFAULT_RULE = DampingRule("mass", 0.95, per_block=False, note="TrackStar's default (issue 31)")
DOWNWEIGHT_COMPONENTS = 1000   # c of mix="auto": the paper's ≈ 1000 task components (of 2¹⁶ dimensions)


def mixing_coefficient(train_eigenvalues: torch.Tensor, task_eigenvalues: torch.Tensor, components: int) -> float:
    """TrackStar's λ for R = (1 − λ) R_train + λ R_task (Chang et al. 2024, §A.1.3):
    ``λ = σ_train[c] / (σ_task[c] + σ_train[c])`` at the ``components``-th (1-based) largest
    eigenvalue of each matrix, so that λ·R_task and (1 − λ)·R_train cross there.

    train_eigenvalues, task_eigenvalues : (k,) eigenvalues of R_train and R_task (any order;
        negative rounding errors are clipped to 0).
    Raises ``ValueError`` when the c-th eigenvalues are both 0 (c above both ranks: no
    crossing to place) or c is not in [1, k].
    """
    train = torch.sort(train_eigenvalues.double().clamp(min=0), descending=True).values
    task = torch.sort(task_eigenvalues.double().clamp(min=0), descending=True).values
    if not isinstance(components, numbers.Integral) or isinstance(components, bool) or \
            not 1 <= components <= min(len(train), len(task)):
        raise OptionError(f"downweight_components must be an int in [1, {min(len(train), len(task))}] (the projected "
                         f"dimension), got {components!r}")
    s_train, s_task = float(train[components - 1]), float(task[components - 1])
    if s_train + s_task == 0.0:
        raise OptionError(f"the {components}-th eigenvalues of R_train and R_task are both 0 (the component count is "
                         "above both matrices' ranks): pass a smaller downweight_components or mix=λ")
    return s_train / (s_task + s_train)


@method('TrackStar: Adam-√v̂-corrected, projected, R^{-1/2}-whitened, unit-normalized gradients (Chang et al. 2024)')
def trackstar(task: Task, train, queries, *, optimizer, layers=None, k: int = 4096, seed: int = 0,
              projector: Projector | None = None, task_data=None, mix: float | str | None = None,
              downweight_components: int = DOWNWEIGHT_COMPONENTS, damping=DEFAULT_DAMPING,
              relative_damping: float | None = None, correction: bool = True) -> Scores:
    """TrackStar scores (n_query, n_train): cosines of R^{-1/2}-whitened, projected,
    second-moment-corrected loss gradients.

    optimizer : the Adam/AdamW optimizer (or Trainer) at the checkpoint attributed; its
        bias-corrected second moment v̂ and ε give the correction. ``correction=False``
        leaves it out (then ``optimizer`` may be None).
    k : projection size (the paper uses 2¹⁶ for 8B models); projector : default
        :func:`~gradalg.methods.trak.default_projector` (dense Gaussian while the matrix is
        small, sparse JL beyond).
    task_data, mix : examples of the evaluation task and λ for R = (1 − λ)R_train + λR_task;
        ``mix="auto"``: the paper's λ from the two matrices' spectra at
        ``downweight_components`` (:func:`mixing_coefficient`; c = 1000 by default, which
        needs at least 1000 task examples and k ≥ 1000). "auto" computes R_train and
        R_task once, when the scores are built (one pass over ``train`` and one over
        ``task_data``), to read their eigenvalues; λ is then a number in the expression
        and its value is shown in the plan.
    damping : λ_R, added to R before R^{-1/2}. Default (issue 31; the marker shows as
        ``'auto'``) :data:`DEFAULT_RULE`: one λ from R's own pooled spectrum, the eigenvalue where
        its top eigenvalues hold 0.95 of the trace (RelatIF's rule for a dense H; shown in the
        plan). Projected into one k-block (k < the gradients' dimension: every LM setting) that
        is ``damping="auto"``'s λ; unprojected over several layers R is dense and couples their
        blocks, where ``"auto"`` takes λ_b from each diagonal block. Chosen by issue 31's rule
        (best worst case, then best mean LDS across the nine fidelity settings of
        docs/fidelity.md, no setting below the previous default's bootstrap interval;
        ``benchmarks/defaults_suite.py --methods trackstar``): ``"auto"`` first (2026-12-05
        evening, higher than 0.1 × the mean eigenvalue on all nine), then one λ (night: the two
        differ on ``mlp`` (2 layers, 2,410 coordinates ≤ k) and ``conv`` (3 layers, 3,818); one
        λ has the same worst case and the better mean):

        ===============================  ======  =====  =====  =====  =====  ========  =====  =====  ======  =====  =====
        damping                          logreg  mlp    lm     lm2    text   instruct  llama  conv   seqcls  worst  mean
        ===============================  ======  =====  =====  =====  =====  ========  =====  =====  ======  =====  =====
        one λ, pooled (default)          0.579   0.451  0.374  0.399  0.203  0.304     0.438  0.287  0.356   0.203  0.377
        ``"auto"``, per block (evening)  0.579   0.438  0.374  0.399  0.203  0.304     0.438  0.291  0.356   0.203  0.376
        0.1 × mean eigenvalue (before)   0.462   0.313  0.330  0.303  0.172  0.223     0.314  0.265  0.258   0.172  0.293
        1 × mean eigenvalue              0.593   0.412  0.370  0.381  0.189  0.271     0.401  0.307  0.324   0.189  0.361
        ===============================  ======  =====  =====  =====  =====  ========  =====  =====  ======  =====  =====

        (``conv`` −0.004 is inside the previous default's interval [0.225, 0.345]. The LM columns
        are at the block-only layers; with a small vocabulary's embedding/head in the language
        tasks' default layers, ``text`` / ``instruct`` / ``llama`` at the default: 0.342 / 0.386 /
        0.438.) ``"auto"``
        given: λ_b per block. ``None``: λ = ``relative_damping`` (0.1 if not given) × R's mean
        eigenvalue, the default before issue 31. A number: an absolute λ; a
        ``ga.linalg.DampingRule``: another rule.
    relative_damping : c: λ = c × R's mean eigenvalue, used when given (instead of the
        default damping) or with ``damping=None``.
    """
    if task_data is not None and mix is None:
        raise OptionError("task_data= needs mix= (λ in R = (1 − λ) R_train + λ R_task, e.g. 0.5, or 'auto' for the "
                         "paper's rule)")
    if mix is not None and (task_data is None or not (mix == "auto" or (
            isinstance(mix, numbers.Real) and not isinstance(mix, bool) and 0.0 <= mix <= 1.0))):
        raise OptionError(f"mix must be in [0, 1] or 'auto' and comes with task_data=, got mix={mix!r}")
    G, Q = grads(task, train, layers), grads(task, queries, layers)
    if correction:
        if optimizer is None:
            raise OptionError("TrackStar's correction divides by Adam's √v̂ + ε: pass optimizer= (the Adam/AdamW "
                             "optimizer at this checkpoint), or correction=False")
        objective = training_objective(optimizer)
        v_hat, eps = objective.second_moment(G)                      # (dim,) float64 each
        # 1/(√v̂ + ε) in place: at 10⁸ coordinates each (dim,) float64 is 0.8 GB, and the
        # expression 1.0 / (v̂.sqrt() + ε) held five of them at once (3.4 GB on GPT-2 small)
        inv = v_hat.sqrt_().add_(eps).reciprocal_()
        del eps
        D = diagonal(inv, G, note=objective.second_moment_note())       # (dim,) elementwise

        def corrected(X):
            return X @ D
    else:
        def corrected(X):
            return X
    P = check_projector(projector) or default_projector(k, G.space.dim, seed) or (lambda X: X)     # k ≥ dim: none
    Phi, phi = P(corrected(G)), P(corrected(Q))                       # (n, k), (n_q, k)
    R = fisher(Phi)                                                    # (1/n) Σ Φ Φᵀ   (k, k)
    if task_data is not None:
        R_task = fisher(P(corrected(grads(task, task_data, layers))))  # (1/n_task) Σ Φ Φᵀ   (k, k)
        if mix == "auto":
            mix = mixing_coefficient(torch.linalg.eigvalsh(R.to_dense().double()),
                                     torch.linalg.eigvalsh(R_task.to_dense().double()), downweight_components)
        R = (1.0 - mix) * R + mix * R_task
    if relative_damping is not None and (damping is None or damping is DEFAULT_DAMPING):
        R = R.damp(relative_damping, relative=True, note=f"relative_damping: {relative_damping:g} × mean eigenvalue")
    elif damping is None:
        R = R.damp(RELATIVE_DAMPING, relative=True, note=f"damping=None: {RELATIVE_DAMPING:g} × mean eigenvalue")
    elif damping is DEFAULT_DAMPING:
        R = R.damp(DEFAULT_RULE, note=f"default: {DEFAULT_RULE.describe()}, from R's own spectrum (chosen on nine "
                                      "fidelity settings)")
    elif (rule := damping_rule(damping)) is not None:
        R = R.damp(rule, note=auto_note(damping, rule))
    else:
        R = R.damp(damping, note="damping (given)")
    W = R.pow(-0.5)                                                    # R^{-1/2}
    return (phi @ W).normalize() @ (Phi @ W).normalize().T
