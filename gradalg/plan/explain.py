"""``expr.explain()``: the plan, stage by stage, as text and as notebook HTML.

:class:`Explain` displays itself (``print`` it, or leave it last in a notebook cell):

1. logical      the expression tree as written (``stage="lower"``, ``"facts"``, ``"decide"``,
                ``"schedule"`` or ``"size"`` shows one of the planner's own records instead)
2. simplified   after the rewrite rules, with each rule that fired and why, and the
                named operator rules (``kronecker.invert_eigenvalues``, ...) that
                resolving each operator will apply, from its structure labels alone
3. costed       every decision with its alternatives and their estimated costs
4. physical     the passes over data: jobs, chunk size, estimated FLOPs, time, memory
                (and, with ``analyze=True``, measured time and memory per pass)

Under the header, the coverage of each captured model: which parameters are attributed,
their share of the trainable parameters, and what is left out (:meth:`Explain.coverage`).
Plus, for planning at scale, estimated time and memory per GPU for 1, 4 and 8 GPUs
(``gpus=``, ``device=``). ``to_dict()`` exports everything as plain data.

One row model, two renderers: ``summary()``, ``stages()``, ``operators()``, ``decisions()``,
``passes()`` and ``scale()`` build the content once; ``__str__`` and ``_repr_html_`` only lay it out
(a ``_text_<stage>`` and an ``_html_<stage>`` method per stage), so ``stage=`` keeps the
same single stage in both.
"""
from __future__ import annotations

import html
from dataclasses import dataclass, field

import torch

from ..capture.coverage import layer_coverage
from ..errors import GradalgError
from ..linalg.rules import describe_rule
from ..viz.describe import block_label, operator_chain
from ..viz.tree import text_tree
from .cost import _si
from .decisions import Decision
from ..devices import CALIBRATION, profile
from .placement import place_passes
from .planner import STAGES, Plan
from .resolution import operator_rules
from .scale import scale_estimates

__all__ = ["Explain"]


def _space_of(node):
    """The parameter space a node's blocks live in (a score's: its operands'), or None."""
    space = getattr(node, "space", None)
    if space is None and hasattr(node, "left"):
        space = getattr(node.left, "space", None)
    return space


def decision_title(d: Decision, nodes: dict) -> str:
    """What ``d`` decided, as a reader names it, from its fields: its kind's title with its
    subject's label, and its block named by module path, kind and shape
    (``block 0 (linear 16×9)``) when ``nodes`` ({token: node}) knows the subject's space."""
    if d.block is None:
        return d.title()
    space = _space_of(nodes.get(d.subject)) if isinstance(d.subject, str) else None
    try:
        return d.title(block_label(space[d.block]) if space is not None else None)
    except KeyError:    # a block its subject's space does not name: shown by its name
        return d.title()


def _rule_math(name: str) -> str:
    """The math of an operator rule, or "" for a name this version does not know (a rule
    recorded in an operator stored by another version: a display never raises)."""
    try:
        return describe_rule(name)
    except KeyError:
        return ""


def _fmt_seconds(s: float) -> str:
    if s >= 3600:
        return f"{s / 3600:.2f} h"
    if s >= 60:
        return f"{s / 60:.1f} min"
    if s >= 1:
        return f"{s:.2f} s"
    return f"{s * 1e3:.3g} ms"


def _pages(above: float) -> str:
    """When rows dropped block by block return free pages (``release_memory_above``)."""
    return "never per dropped block" if above == float("inf") else f"per {_si(above)}B of dropped blocks"


def _fmt_ratio(r: float) -> str:
    """measured / estimated, as ``1.3×``."""
    return f"{r:.2f}×" if r == r and r != float("inf") else "-"


def _fmt_alt(v) -> str:
    return _fmt_seconds(v) if isinstance(v, (int, float)) else str(v)


@dataclass
class Explain:
    """A plan ready to display. ``analyzed`` holds measured per-pass stats, if run."""

    plan: Plan
    analyzed: list = field(default_factory=list)
    gpus: tuple = (1, 4, 8)
    device: str | None = None
    stage: str | None = None
    executor: object = None
    warning: str | None = None   # e.g. the plan does not fit one GPU of ``device``

    def __post_init__(self):   # a plan made without its executor (explain(executor=...)): placed by it, once
        if len(self.plan.placement) != len(self.plan.passes) and hasattr(self.executor, "shards"):
            self.plan = place_passes(self.plan, self.executor.shards)

    # ---- data -------------------------------------------------------------------
    def _nodes(self) -> dict:
        """Every node of the plan's trees by token (to name a decision's blocks)."""
        out = {}
        for tree in (self.plan.logical, self.plan.simplified):
            for node in tree.walk():
                out.setdefault(node.token, node)
        return out

    def coverage(self) -> list:
        """The :class:`~gradalg.capture.coverage.Coverage` of each distinct (model, layers)
        the plan captures gradients of: attributed trainable parameters (each counted once)
        against the model's, and what is left out. Recomputed from module shapes, no data."""
        out, seen = [], set()
        for node in self.plan.logical.walk():
            task, layers = getattr(node, "task", None), getattr(node, "layers", None)
            model = getattr(task, "model", None)
            if not isinstance(model, torch.nn.Module) or not isinstance(layers, tuple):
                continue
            backend = getattr(node, "backend", "hooks")
            key = (id(model), layers, backend)
            if key in seen:
                continue
            seen.add(key)
            try:
                out.append(layer_coverage(model, layers, backend, getattr(task, "default_layers", None)))
            except (GradalgError, KeyError):   # a display never raises: the plan itself reports bad layers
                continue
        return out

    def operators(self) -> list[dict]:
        """Each operator of the simplified expression with the named rules that will resolve
        it (:func:`gradalg.plan.resolution.operator_rules`: structure labels, no data) and
        each rule's math (:func:`gradalg.linalg.rules.describe_rule`), or the refusal its
        structure gets."""
        return [{"operator": operator_chain(r.op), "rules": list(r.rules),
                 "math": {name: _rule_math(name) for name in r.rules}, "refused": r.refusal}
                for r in operator_rules(self.plan.simplified)]

    def decisions(self) -> list[dict]:
        """Each decision as plain data (:meth:`~gradalg.plan.decisions.Decision.to_dict`:
        kind, subject, block, chosen, alternatives, reason), with ``what`` its title as the
        displays show it (blocks named by module path, kind and shape)."""
        nodes = self._nodes()
        return [{**d.to_dict(), "what": decision_title(d, nodes)} for d in self.plan.decisions]

    def passes(self) -> list[dict]:
        out = []
        for i, p in enumerate(self.plan.passes):
            row = {"pass": i, "reads": p.label, "jobs": [j.describe() for j in p.jobs],
                   "batch_size": p.batch_size, "flops": p.cost.flops, "seconds": p.seconds,
                   "peak_bytes": p.cost.peak_bytes, "note": p.note}
            if hasattr(self.executor, "describe_pass"):   # where the plan placed it
                row["distributed"] = self.executor.describe_pass(p, dict(enumerate(self.plan.placement)).get(i))
            if i < len(self.analyzed):
                stats = self.analyzed[i]
                row["measured_seconds"] = stats["seconds"]
                if "cpu_seconds" in stats:
                    row["measured_cpu_seconds"] = stats["cpu_seconds"]
                # measured / estimated: 1 is a true estimate, 2 a pass twice as slow as planned
                row["ratio"] = stats["seconds"] / p.seconds if p.seconds > 0 else float("inf")
                row["measured_held_bytes"] = stats["held_bytes"]
                row["measured_rss_growth_bytes"] = stats["peak_rss_growth_bytes"]
                # True: an earlier peak hid this pass's own; its growth is at most the number above
                row["measured_rss_is_bound"] = stats.get("peak_rss_is_bound", False)
                if "calls" in stats:   # a products pass: its seconds are over every call of its solver
                    row["measured_calls"] = stats["calls"]
                    # its estimate is for the solver's bound on the calls: compare one call with one
                    bound = max(1, getattr(p.jobs[0], "calls", 1))
                    row["estimated_call_seconds"] = p.seconds / bound
                    if stats["calls"]:
                        row["measured_call_seconds"] = stats["seconds"] / stats["calls"]
                        row["ratio"] = row["measured_call_seconds"] / max(row["estimated_call_seconds"], 1e-12)
            out.append(row)
        return out

    def to_dict(self) -> dict:
        return {
            "device": self.plan.device.name, "device_measured": self.plan.device.measured,
            "device_calibration": {k: getattr(self.plan.device, k) for k in CALIBRATION},
            "memory_budget": self.plan.options.memory_budget,
            "memory_budget_source": self.plan.budget.to_dict() if self.plan.budget else None,
            "rules_fired": [f.__dict__ for f in self.plan.fired], "decisions": self.decisions(),
            "operator_rules": self.operators(),
            "coverage": [c.to_dict() for c in self.coverage()],
            "passes": self.passes(), "passes_over_data": self.plan.data_passes,
            "budget_headroom": self.plan.options.budget_headroom, "estimated_seconds": self.plan.seconds, "estimated_peak_bytes": self.plan.peak_bytes,
            "scale": self.scale(),
            "warning": self.warning,
        }

    def _cost_line(self) -> str:
        """The trees' header: this plan's estimate (its options and device), not a re-plan."""
        return "estimated cost: " + self.plan.total.describe()

    # ---- the row model both renderers read --------------------------------------
    def summary(self) -> str:
        """The header line: device, budget, passes over data and the plan's estimates."""
        p = self.plan
        budget = p.budget.describe() if p.budget else f"{_si(p.options.memory_budget)}B"
        return (f"device {p.device.name}, memory budget {budget}, refusals suggest "
                f"{1 + p.options.budget_headroom:g}× the need (budget_headroom), {p.data_passes} pass(es) over data, est. {_fmt_seconds(p.seconds)}, peak ~{_si(p.peak_bytes)}B; free "
                f"pages returned past {p.options.release_growth:g}× a batch's (release_growth) and "
                f"{_pages(p.options.release_memory_above)} (release_memory_above)")

    def stages(self) -> list[str]:
        """The stages shown, in order: all of them, or only ``stage`` (``"scale"`` needs ``device``)."""
        keys = ["logical", "simplified", "costed", "physical"] + (["scale"] if self.device else [])
        return [k for k in keys if self.stage in (None, k)]

    def scale(self) -> list[dict]:
        return scale_estimates(self.plan, self.gpus, self.device) if self.device else []

    # ---- text -------------------------------------------------------------------
    def __str__(self) -> str:
        lines = [f"gradalg plan — {self.summary()}"]
        if self.warning:
            lines.append(f"! {self.warning}")
        lines += [c.describe() for c in self.coverage()]
        for key in self.stages():
            lines += ["", *getattr(self, f"_text_{key}")()]
        if self.stage in STAGES:   # one of the planner's own stages: its record
            lines += ["", f"planner stage {self.stage}", self.plan.explain(self.stage)]
        return "\n".join(lines)

    __repr__ = __str__

    def _text_logical(self) -> list[str]:
        return ["1. logical", text_tree(self.plan.logical, "expression", self._cost_line())]

    def _text_simplified(self) -> list[str]:
        p = self.plan
        fired = ", ".join(f"{f.rule}" for f in p.fired) or "none"
        lines = [f"2. simplified (rules fired: {fired})"]
        lines += [f"   - {f.rule}: {f.before} → {f.after}  ({f.why})" for f in p.fired]
        if p.fired:
            lines.append(text_tree(p.simplified, "simplified", self._cost_line()))
        operators = self.operators()
        if operators:
            lines.append("   operator rules (by structure, applied when each operator is resolved):")
        for row in operators:
            lines.append(f"   - {row['operator']}: "
                         + (f"refused: {row['refused']}" if row["refused"] else ", ".join(row["rules"]) or "no rule"))
        return lines

    def _text_costed(self) -> list[str]:
        lines = ["3. costed decisions"]
        for d in self.decisions():
            alts = "; ".join(f"{k}: {_fmt_alt(v)}" for k, v in d["alternatives"].items())
            lines.append(f"   - {d['what']}: chose {d['chosen']}  [{alts}]")
            if d["reason"]:
                lines.append(f"       {d['reason']}")
        return lines

    def _text_physical(self) -> list[str]:
        lines = ["4. physical passes", f"   {self.plan.device.calibration()}"]
        header = f"   {'#':>2}  {'reads':<38} {'batch':>5} {'est FLOP':>10} {'est time':>10} {'est peak':>9}"
        if self.analyzed:
            header += f" {'measured':>10} {'meas/est':>8} {'held':>9} {'meas peak':>10}"
        lines.append(header)
        for row in self.passes():
            line = (f"   {row['pass']:>2}  {row['reads'][:38]:<38} {str(row['batch_size'] or '-'):>5} "
                    f"{_si(row['flops']) + 'FLOP':>10} {_fmt_seconds(row['seconds']):>10} "
                    f"{_si(row['peak_bytes']) + 'B':>9}")
            if "measured_seconds" in row:
                line += (f" {_fmt_seconds(row['measured_seconds']):>10} {_fmt_ratio(row['ratio']):>8}"
                         f" {_si(row['measured_held_bytes']) + 'B':>9} {_measured_peak(row):>10}")
            lines.append(line)
            lines += [f"        · {job}" for job in row["jobs"]]
            if "measured_calls" in row:
                lines.append(f"        {_measured_calls(row)}")
            if row["note"]:
                lines.append(f"        ! {row['note']}")
            if row.get("distributed"):
                lines.append(f"        ⇉ {row['distributed']}")
        return lines

    def _text_scale(self) -> list[str]:
        lines = [f"5. at scale on {profile(self.device).name} (estimates)"]
        for r in self.scale():
            lines.append(f"   {r['gpus']} GPU(s): {_fmt_seconds(r['seconds'])}, {_si(r['memory_per_gpu'])}B per GPU"
                         + ("" if r["fits"] else "  (does not fit)"))
            if not r["fits"]:
                lines.append(f"      {r['why']}")
        return lines

    # ---- HTML -------------------------------------------------------------------
    def _repr_html_(self) -> str:
        from ..viz.html import _css
        esc = html.escape
        parts = [f"<style>{_css()}</style><div class='ga-expr'>",
                 f"<div class='ga-head'>gradalg plan <span class='ga-cost'>{esc(self.summary())}</span></div>"]
        if self.warning:
            parts.append(f"<div class='ga-warning'>⚠ {esc(self.warning)}</div>")
        parts += [f"<div class='ga-coverage'>{'<br>'.join(esc(x) for x in c.describe().splitlines())}</div>"
                  for c in self.coverage()]
        parts += [getattr(self, f"_html_{key}")() for key in self.stages()]
        if self.stage in STAGES:
            parts.append(f"<details open><summary>planner stage {self.stage}</summary>"
                         f"<pre>{html.escape(self.plan.explain(self.stage))}</pre></details>")
        parts.append("</div>")
        return "".join(parts)

    def _html_logical(self) -> str:
        from ..viz.html import html_tree
        return (f"<details{' open' if self.stage else ''}><summary>1. logical</summary>"
                f"{html_tree(self.plan.logical, 'expression', self._cost_line())}</details>")

    def _html_simplified(self) -> str:
        from ..viz.html import html_tree
        p, esc = self.plan, html.escape
        fired = "".join(f"<li><b>{esc(f.rule)}</b>: {esc(f.before)} → {esc(f.after)} <i>{esc(f.why)}</i></li>"
                        for f in p.fired) or "<li>no rule fired</li>"
        operators = "".join(
            f"<li>{esc(row['operator'])}: "
            + (f"<i>refused: {esc(row['refused'])}</i>" if row["refused"]
               else ", ".join(f"<b title='{esc(row['math'][r])}'>{esc(r)}</b>" for r in row["rules"]) or "no rule") + "</li>"
            for row in self.operators())
        if operators:
            operators = ("<div>operator rules (by structure, applied when each operator is resolved):</div>"
                         f"<ul>{operators}</ul>")
        return (f"<details{' open' if self.stage else ''}><summary>2. simplified ({len(p.fired)} rewrites)"
                f"</summary><ul>{fired}</ul>"
                f"{html_tree(p.simplified, 'simplified', self._cost_line()) if p.fired else ''}{operators}"
                "</details>")

    def _html_costed(self) -> str:
        esc = html.escape
        rows = "".join(
            f"<tr><td>{esc(d['what'])}</td><td><b>{esc(d['chosen'])}</b></td><td>"
            + "<br>".join(f"{esc(k)}: {esc(_fmt_alt(v))}" for k, v in d["alternatives"].items())
            + f"</td><td>{esc(d['reason'])}</td></tr>" for d in self.decisions())
        return ("<details open><summary>3. costed decisions</summary><table class='ga-table'><tr><th>what"
                "</th><th>chosen</th><th>alternatives (est.)</th><th>why</th></tr>" + rows + "</table></details>")

    def _html_physical(self) -> str:
        esc = html.escape
        measured = bool(self.analyzed)
        head_row = ("<tr><th>#</th><th>reads</th><th>jobs</th><th>batch</th><th>est FLOP</th><th>est time</th>"
                    "<th>est peak</th>" + ("<th>measured time</th><th>measured / est.</th><th>held</th>"
                                           "<th title='resident growth over the pass; ≤: an earlier peak hid "
                                           "this pass&#39;s own'>measured peak</th>"
                                           if measured else "") + "</tr>")
        body = ""
        for row in self.passes():
            body += (f"<tr><td>{row['pass']}</td><td>{esc(row['reads'])}</td><td>"
                     + "<br>".join(esc(j) for j in row["jobs"])
                     + (f"<br><i>{esc(row['note'])}</i>" if row["note"] else "")
                     + (f"<br>⇉ {esc(row['distributed'])}" if row.get("distributed") else "")
                     + (f"<br>{esc(_measured_calls(row))}" if "measured_calls" in row else "")
                     + f"</td><td>{row['batch_size'] or '-'}</td><td>{_si(row['flops'])}FLOP</td>"
                     f"<td>{_fmt_seconds(row['seconds'])}</td><td>{_si(row['peak_bytes'])}B</td>")
            if measured:
                body += (f"<td>{_fmt_seconds(row.get('measured_seconds', 0))}</td>"
                         f"<td>{_fmt_ratio(row.get('ratio', float('nan')))}</td>"
                         f"<td>{_si(row.get('measured_held_bytes', 0))}B</td>"
                         f"<td>{html.escape(_measured_peak(row))}</td>")
            body += "</tr>"
        return (f"<details open><summary>4. physical passes</summary><table class='ga-table'>{head_row}{body}"
                f"</table><div class='ga-cost'>{esc(self.plan.device.calibration())}</div></details>")

    def _html_scale(self) -> str:
        esc = html.escape
        rows = "".join(f"<tr><td>{r['gpus']}</td><td>{_fmt_seconds(r['seconds'])}</td>"
                       f"<td>{_si(r['memory_per_gpu'])}B</td><td>{'yes' if r['fits'] else 'no: ' + esc(r['why'])}</td></tr>"
                       for r in self.scale())
        return (f"<details open><summary>5. at scale on {esc(profile(self.device).name)}</summary>"
                "<table class='ga-table'><tr><th>GPUs</th><th>time</th><th>memory per GPU</th><th>fits"
                f"</th></tr>{rows}</table></details>")


def _measured_calls(row: dict) -> str:
    """A products pass's measured calls (its seconds are over every call of its solver):
    ``measured: 9 call(s), 0.12 s per call against 0.10 s estimated (the ratio is per call)``."""
    per_call = (f", {_fmt_seconds(row['measured_call_seconds'])} per call against "
                f"{_fmt_seconds(row['estimated_call_seconds'])} estimated (the ratio is per call)"
                if "measured_call_seconds" in row else "")
    return f"measured: {row['measured_calls']:,} call(s){per_call}"


def _measured_peak(row: dict) -> str:
    """A pass's measured peak resident growth: ``87MB``, ``≤87MB`` when an earlier pass's
    peak hid this one's (an upper bound), ``-`` when it was not measured."""
    growth = row.get("measured_rss_growth_bytes")
    if growth is None:
        return "-"
    return ("≤" if row.get("measured_rss_is_bound") else "") + _si(growth) + "B"
