"""What ``ga.check_model`` found: typed findings, shown as text and HTML.

A :class:`Finding` is one statement about the model, the task or the data:

* ``kind``: which check made it (:data:`KINDS`);
* ``severity``: ``"fail"`` (per-example gradients would be wrong or would depend on the
  batch: :attr:`ModelCheck.ok` is False), ``"warning"`` (likely a problem, the numbers are
  not wrong by themselves), ``"info"`` (what was measured: coverage, what was skipped),
  or ``"ok"`` (a check that ran and passed, with its numbers);
* ``message`` and ``fix``: what is wrong, and what to change (empty for ``"ok"``);
* ``numbers``: the values measured (relative differences, tolerances, counts, seconds);
* ``examples`` / ``where``: the example ids and the modules or layers concerned.

:class:`ModelCheck` holds the findings of one call, with ``ok``, ``failed``,
``raise_if_failed()``, ``to_dict()``, a text repr and ``_repr_html_``.
"""
from __future__ import annotations

import html
from dataclasses import dataclass, field

from ..errors import GradalgError, OptionError

__all__ = ["Finding", "ModelCheck", "ModelCheckError", "KINDS", "SEVERITIES"]

#: the checks, in the order they run and are shown
KINDS = ("finite", "train_mode", "special_tokens", "loss_sum", "batch_independence", "tied_weights", "coverage",
         "refused")
SEVERITIES = ("fail", "warning", "info", "ok")
_MARK = {"fail": "FAIL", "warning": "warn", "info": "info", "ok": " ok "}


class ModelCheckError(GradalgError, ValueError):
    """``ga.check_model(...).raise_if_failed()`` found per-example gradients that depend on
    the batch, a loss that is not a sum, uses of a weight that capture misses, or non-finite
    values. ``findings``: the failed :class:`Finding` objects, each naming its fix."""

    def __init__(self, findings):
        self.findings = list(findings)
        lines = [f"ga.check_model: {len(self.findings)} check(s) failed:"]
        for f in self.findings:
            lines.append(f"- {f.kind}: {f.message}")
            lines.append(f"  fix: {f.fix}")
        super().__init__("\n".join(lines))

    def __reduce__(self):
        return type(self), (self.findings,)


@dataclass(frozen=True)
class Finding:
    """One result of a check (see the module docstring for the fields)."""

    kind: str
    severity: str
    message: str
    fix: str = ""
    numbers: dict = field(default_factory=dict)
    examples: tuple = ()
    where: tuple = ()

    def __post_init__(self):
        if self.kind not in KINDS:
            raise OptionError(f"unknown finding kind {self.kind!r}; use one of {KINDS}")
        if self.severity not in SEVERITIES:
            raise OptionError(f"unknown severity {self.severity!r}; use one of {SEVERITIES}")

    def to_dict(self) -> dict:
        return {"kind": self.kind, "severity": self.severity, "message": self.message, "fix": self.fix,
                "numbers": dict(self.numbers), "examples": [_plain(i) for i in self.examples],
                "where": list(self.where)}

    def text(self) -> str:
        line = f"[{_MARK[self.severity]}] {self.kind}: {self.message}"
        return line + (f"\n       fix: {self.fix}" if self.fix else "")


def _plain(value):
    """An example id as JSON can hold it (numpy and torch scalars as Python numbers)."""
    item = getattr(value, "item", None)
    return item() if callable(item) else value


@dataclass(frozen=True)
class ModelCheck:
    """The findings of ``ga.check_model(task, data)``.

    ``findings``: every :class:`Finding`, in check order (passed checks as ``"ok"``);
    ``model``: the model's class name; ``layers``: the blocks checked; ``examples``: the ids
    of the examples used; ``seconds``: the check's wall time; ``tolerance``: the relative
    tolerance the comparisons used (from the parameters' dtype unless given).
    """

    findings: tuple
    model: str
    layers: tuple
    examples: tuple
    seconds: float
    tolerance: float

    @property
    def ok(self) -> bool:
        """True when no finding failed (warnings and infos do not count)."""
        return not self.failed

    @property
    def failed(self) -> list:
        """The findings of severity ``"fail"``."""
        return [f for f in self.findings if f.severity == "fail"]

    @property
    def warnings(self) -> list:
        return [f for f in self.findings if f.severity == "warning"]

    def __getitem__(self, kind: str) -> list:
        """The findings of one ``kind`` (``check["batch_independence"]``)."""
        if kind not in KINDS:
            raise KeyError(f"no check {kind!r}; the checks are {KINDS}")
        return [f for f in self.findings if f.kind == kind]

    def raise_if_failed(self) -> "ModelCheck":
        """Raise :class:`ModelCheckError` listing the failed findings and their fixes;
        return ``self`` when none failed (``ga.check_model(task, data).raise_if_failed()``)."""
        if self.failed:
            raise ModelCheckError(self.failed)
        return self

    def to_dict(self) -> dict:
        return {"ok": self.ok, "model": self.model, "layers": list(self.layers),
                "examples": [_plain(i) for i in self.examples], "seconds": self.seconds,
                "tolerance": self.tolerance, "findings": [f.to_dict() for f in self.findings]}

    def summary(self) -> str:
        verdict = "ok" if self.ok else f"{len(self.failed)} check(s) FAILED"
        return (f"ga.check_model({self.model}): {verdict}; {len(self.examples)} examples, "
                f"{len(self.layers)} blocks, tolerance {self.tolerance:.0e}, {self.seconds:.1f} s")

    def __str__(self) -> str:
        return "\n".join([self.summary()] + [f.text() for f in self.findings])

    __repr__ = __str__

    def _repr_html_(self) -> str:
        rows = "".join(_html_row(f) for f in self.findings)
        color = "#1a7f37" if self.ok else "#cf222e"
        return (f"<div class='gradalg-check'><p style='color:{color}'><b>{html.escape(self.summary())}</b></p>"
                "<table><thead><tr><th>check</th><th>result</th><th>finding</th><th>fix</th></tr></thead>"
                f"<tbody>{rows}</tbody></table></div>")


def _html_row(f: Finding) -> str:
    color = {"fail": "#cf222e", "warning": "#9a6700", "info": "#57606a", "ok": "#1a7f37"}[f.severity]
    numbers = ", ".join(f"{k}={_number(v)}" for k, v in f.numbers.items())
    detail = html.escape(f.message) + (f"<br><small>{html.escape(numbers)}</small>" if numbers else "")
    return (f"<tr><td>{html.escape(f.kind)}</td><td style='color:{color}'>{f.severity}</td>"
            f"<td>{detail}</td><td>{html.escape(f.fix)}</td></tr>")


def _number(value) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)
