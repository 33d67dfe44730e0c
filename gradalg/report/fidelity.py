"""What each method's score means, and how faithful it measured: the report's method note.

``FORMULAS[name]`` is the method's score in TeX (typeset by KaTeX in the report), for the
methods whose score is one line (damping, projections and ensembles left out: the
method's docstring has the rest);
``FIDELITY[name]`` quotes docs/fidelity.md: the method's linear datamodeling score (LDS,
the Spearman correlation of its predicted effect of dropping half the training set with
the effect measured by retraining, higher is better, 1 at best) with its 95 % bootstrap
interval, on multinomial logistic regression (``logreg``: digits) and on a 2-layer GPT-2
(``lm``), in the default configuration (on ``lm`` at the language tasks' default layers,
the blocks and the tied embedding, since 2026-12-06). ``tests/test_report.py`` checks that every quoted
interval is still in docs/fidelity.md.
"""
from __future__ import annotations

__all__ = ["FIDELITY", "FORMULAS", "LM_CEILING", "fidelity_note"]

_G = r"\nabla_\theta L"
FORMULAS = {
    "grad_dot": rf"\tau(q, z) = {_G}(q)^\top {_G}(z)",
    "grad_cos": rf"\tau(q, z) = \cos\big({_G}(q), {_G}(z)\big)",
    "tracin": rf"\tau(q, z) = \textstyle\sum_c \eta_c\, {_G}(q; \theta_c)^\top {_G}(z; \theta_c)",
    "influence": rf"\tau(q, z) = {_G}(q)^\top (H + \lambda I)^{{-1}} {_G}(z)",
    "logra": rf"\tau(q, z) = (P {_G}(q))^\top (\hat H_P + \lambda I)^{{-1}} P {_G}(z)",
    "grass": rf"\tau(q, z) = (P {_G}(q))^\top (\hat H_P + \lambda I)^{{-1}} P {_G}(z)",
    "relatif": rf"\tau(q, z) = \frac{{{_G}(q)^\top H^{{-1}} {_G}(z)}}{{\sqrt{{{_G}(z)^\top H^{{-1}} {_G}(z)}}}}",
    "magic": r"\tau(q, z) = -\partial f_q(\theta_T(\varepsilon)) / \partial \varepsilon_z",
}
"""method → its score as a LaTeX formula (KaTeX), shown on a report page; only methods whose
score fits on one line."""

#: method → (logreg LDS [95 % CI], lm LDS [95 % CI], configuration), quoted from docs/fidelity.md
_MEASURED = {
    "grad_dot": ("0.428 [0.381, 0.464]", "0.274 [0.189, 0.347]", "no curvature"),
    "grad_cos": ("0.382 [0.337, 0.419]", "0.323 [0.232, 0.393]", "no curvature"),
    "tracin": ("0.446 [0.402, 0.479]", "0.342 [0.251, 0.418]", "checkpoints of the training run"),
    "influence": ("0.922 [0.908, 0.926]", "0.360 [0.268, 0.437]",
                  "defaults: the dense Gauss-Newton on logreg, EK-FAC on the LM"),
    "trak": ("0.849 [0.823, 0.863]", "0.346 [0.245, 0.425]", "defaults"),
    "logra": ("0.859 [0.838, 0.869]", "0.352 [0.258, 0.430]", "defaults"),
    "grass": ("0.815 [0.789, 0.829]", "0.282 [0.201, 0.355]", "defaults"),
    "less": ("0.404 [0.358, 0.441]", "0.375 [0.293, 0.443]", "defaults, Adam checkpoints"),
    "relatif": ("0.653 [0.618, 0.677]", "0.394 [0.301, 0.466]", "defaults"),
    "trackstar": ("0.579 [0.540, 0.607]", "0.373 [0.279, 0.449]", "defaults"),
}
LM_CEILING = "one retraining of the LMs' subsets repeats only to ρ₁ ≈ 0.50, which caps every method near 0.69"

FIDELITY = {name: (f"LDS against retraining ({config}): {logreg} on logistic regression (digits), {lm} on a "
                   f"2-layer GPT-2; on the LM, {LM_CEILING} (docs/fidelity.md).")
            for name, (logreg, lm, config) in _MEASURED.items()}
"""method → its fidelity note: the LDS quoted from docs/fidelity.md, shown on a report page."""
FIDELITY.update({
    "magic": "Exact metagradients of a replayed SGD / Adam run: measured on the MLP's SGD and AdamW runs "
             "(docs/unrolled.md), not in the LDS tables of docs/fidelity.md.",
    "source": "Segment-wise approximate unrolling of an SGD run: measured on the MLP's SGD runs "
              "(docs/unrolled.md), not in the LDS tables of docs/fidelity.md.",
    "ensemble": "An average of another method over models, seeds or checkpoints: see \"Ensembles on the LM\" "
                "in docs/fidelity.md for what averaging gains.",
})


def fidelity_note(method: str | None) -> str:
    """The fidelity note of ``method`` (a ``ga.methods`` name); a word on where to look when
    the method is not named or not measured."""
    if method is None:
        return ("The method was not named (pass method='trak', ...): its fidelity against retraining is in "
                "docs/fidelity.md.")
    return FIDELITY.get(method, f"{method!r} has no measured fidelity in docs/fidelity.md.")
