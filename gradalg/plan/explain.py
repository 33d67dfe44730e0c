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

One model, two renderers. ``operators()``, ``decisions()``, ``passes()`` and ``scale()`` are
the plan's records as plain rows (``to_dict()`` exports them); :meth:`Explain.sections` builds
each stage shown once from them, as a :class:`Section`: its title, then tables of rows ×
named columns (:class:`Table`, :class:`Column`), trees and lines (the display model and its
two layouts are :mod:`gradalg.viz.sections`). ``__str__`` and ``_repr_html_`` only lay the
sections out: every column of a table is in both, so ``stage=`` shows the same single stage
in both, with the same cells.
"""
from __future__ import annotations

import html
from dataclasses import dataclass, field

import torch

from ..capture.coverage import layer_coverage
from ..errors import GradalgError
from ..linalg.rules import describe_rule
from ..viz.describe import block_label, operator_chain
from ..viz.sections import Column, Section, Table, html_part, text_part
from .cost import _si
from .decisions import Decision
from ..devices import CALIBRATION, profile
from .placement import place_passes
from .planner import STAGES, Plan
from .resolution import operator_rules
from .scale import scale_estimates

__all__ = ["Explain"]


def decision_title(d: Decision, nodes: dict) -> str:
    """What ``d`` decided, as a reader names it, from its fields: its kind's title with its
    subject's label, and its block named by module path, kind and shape
    (``block 0 (linear 16×9)``) when ``nodes`` ({token: node}) knows the space of the
    subject's blocks (a score's: its operands')."""
    node = nodes.get(d.subject) if isinstance(d.subject, str) else None
    space = getattr(node, "space", None)
    space = getattr(getattr(node, "left", None), "space", None) if space is None else space
    try:
        return d.title(block_label(space[d.block]) if d.block is not None and space is not None else None)
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
    """Seconds in the largest unit they reach: ``1.50 h``, ``2.5 min``, ``3.20 s``, else ``12.3 ms``."""
    for unit, size, spec in (("h", 3600, ".2f"), ("min", 60, ".1f"), ("s", 1, ".2f")):
        if s >= size:
            return f"{s / size:{spec}} {unit}"
    return f"{s * 1e3:.3g} ms"


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

    # ---- the plan's records as plain rows ----------------------------------------
    def coverage(self) -> list:
        """The :class:`~gradalg.capture.coverage.Coverage` of each distinct (model, layers)
        the plan captures gradients of: attributed trainable parameters (each counted once)
        against the model's, and what is left out. Recomputed from module shapes, no data."""
        captured = {}   # (model id, layers, backend) -> (model, layers, backend, the task's default selection)
        for node in self.plan.logical.walk():
            task, layers = getattr(node, "task", None), getattr(node, "layers", None)
            model, backend = getattr(task, "model", None), getattr(node, "backend", "hooks")
            if isinstance(model, torch.nn.Module) and isinstance(layers, tuple):
                selection = getattr(task, "default_layers", None)
                captured.setdefault((id(model), layers, backend), (model, layers, backend, selection))
        out = []
        for args in captured.values():
            try:
                out.append(layer_coverage(*args))
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
        nodes = {}   # every node of the plan's trees by token (to name a decision's blocks)
        for node in (*self.plan.logical.walk(), *self.plan.simplified.walk()):
            nodes.setdefault(node.token, node)
        return [{**d.to_dict(), "what": decision_title(d, nodes)} for d in self.plan.decisions]

    def passes(self) -> list[dict]:
        """Each pass with its estimates and, where it was measured (``analyze=True``), its measurements."""
        out = []
        for i, p in enumerate(self.plan.passes):
            row = {"pass": i, "reads": p.label, "reads_data": p.reads_data, "jobs": [j.describe() for j in p.jobs],
                   "batch_size": p.batch_size, "trim_after_batches": p.trim_after_batches, "flops": p.cost.flops,
                   "seconds": p.seconds, "peak_bytes": p.cost.peak_bytes, "note": p.note}
            if hasattr(self.executor, "describe_pass"):   # where the plan placed it
                row["distributed"] = self.executor.describe_pass(p, dict(enumerate(self.plan.placement)).get(i))
            if i < len(self.analyzed):
                stats = self.analyzed[i]
                # ratio, measured / estimated: 1 is a true estimate, 2 a pass twice as slow as planned;
                # rss_is_bound: an earlier peak hid this pass's own, its growth is at most the number given
                row.update(measured_seconds=stats["seconds"],
                           ratio=stats["seconds"] / p.seconds if p.seconds > 0 else float("inf"),
                           measured_held_bytes=stats["held_bytes"],
                           measured_rss_growth_bytes=stats["peak_rss_growth_bytes"],
                           measured_rss_is_bound=stats.get("peak_rss_is_bound", False))
                row.update({f"measured_{k}": stats[k] for k in ("cpu_seconds", "calls") if k in stats})
                if "calls" in stats:   # a products pass: its seconds are over every call of its solver
                    # its estimate is for the solver's bound on the calls: compare one call with one
                    row["estimated_call_seconds"] = p.seconds / max(1, getattr(p.jobs[0], "calls", 1))
                    if stats["calls"]:
                        row["measured_call_seconds"] = stats["seconds"] / stats["calls"]
                        row["ratio"] = row["measured_call_seconds"] / max(row["estimated_call_seconds"], 1e-12)
            out.append(row)
        return out

    def scale(self) -> list[dict]:
        """Time and memory per GPU for each count of ``gpus`` on ``device`` (:mod:`~gradalg.plan.scale`)."""
        return scale_estimates(self.plan, self.gpus, self.device) if self.device else []

    def to_dict(self) -> dict:
        p = self.plan
        return {
            "device": p.device.name, "device_measured": p.device.measured,
            "device_calibration": {k: getattr(p.device, k) for k in CALIBRATION},
            "memory_budget": p.options.memory_budget, "memory_budget_source": p.budget.to_dict() if p.budget else None,
            "rules_fired": [f.__dict__ for f in p.fired], "decisions": self.decisions(),
            "operator_rules": self.operators(), "coverage": [c.to_dict() for c in self.coverage()],
            "passes": self.passes(), "passes_over_data": p.data_passes, "budget_headroom": p.options.budget_headroom,
            "estimated_seconds": p.seconds, "estimated_peak_bytes": p.peak_bytes, "scale": self.scale(),
            "warning": self.warning,
        }

    def summary(self) -> str:
        """The header line: device, budget, passes over data and the plan's estimates."""
        p, above = self.plan, self.plan.options.release_memory_above   # when rows dropped block by block free pages
        budget = p.budget.describe() if p.budget else f"{_si(p.options.memory_budget)}B"
        return (f"device {p.device.name}, memory budget {budget}, refusals suggest "
                f"{1 + p.options.budget_headroom:g}× the need (budget_headroom), {p.data_passes} pass(es) over data, est. {_fmt_seconds(p.seconds)}, peak ~{_si(p.peak_bytes)}B; free "
                f"pages returned past {p.options.release_growth:g}× a batch's growth (release_growth) and "
                f"{'never per dropped block' if above == float('inf') else f'per {_si(above)}B of dropped blocks'}"
                " (release_memory_above)")

    # ---- the sections: one table model per stage ---------------------------------
    def stages(self) -> list[str]:
        """The stages shown, in order: all of them, or only ``stage`` (``"scale"`` needs ``device``)."""
        keys = ["logical", "simplified", "costed", "physical"] + (["scale"] if self.device else [])
        return [k for k in keys if self.stage in (None, k)]

    def sections(self) -> list[Section]:
        """The stages shown (:meth:`stages`), each built once from the rows above as a
        :class:`Section`, and with a planner ``stage=`` (``"decide"``, ...) its record."""
        shown = [getattr(self, f"_{key}")() for key in self.stages()]
        if self.stage in STAGES:   # one of the planner's own stages: its record
            shown.append(Section(f"planner stage {self.stage}", (self.plan.explain(self.stage),)))
        return shown

    def _cost_line(self) -> str:
        """The trees' header: this plan's estimate (its options and device), not a re-plan."""
        return "estimated cost: " + self.plan.total.describe()

    def _logical(self) -> Section:
        return Section("1. logical", ((self.plan.logical, "expression", self._cost_line()),), bool(self.stage))

    def _simplified(self) -> Section:
        p, operators = self.plan, self.operators()
        fired = Table((Column("rule", "- {}"), Column("before", ": {}"), Column("after", " → {}"),
                       Column("why", "  ({})")), [(f.rule, f.before, f.after, f.why) for f in p.fired])
        tree = ((p.simplified, "simplified", self._cost_line()),) if p.fired else ()
        rules = Table((Column("operator", "- {}"), Column("rules", ": {}", sep=", ")),
                      [(r["operator"], f"refused: {r['refused']}" if r["refused"] else tuple(r["rules"]) or "no rule")
                       for r in operators],
                      caption="operator rules (by structure, applied when each operator is resolved):",
                      hover={name: math for r in operators for name, math in r["math"].items()})
        return Section(f"2. simplified (rules fired: {', '.join(f.rule for f in p.fired) or 'none'})",
                       (fired, *tree, rules), bool(self.stage))

    def _costed(self) -> Section:
        columns = (Column("what", "- {}"), Column("chosen", ": chose {}"), Column("alternatives (est.)", "  [{}]"),
                   Column("why", "    {}", below=True))
        rows = [(d["what"], d["chosen"], tuple(f"{k}: {_fmt_seconds(v) if isinstance(v, (int, float)) else v}"
                                               for k, v in d["alternatives"].items()), d["reason"])
                for d in self.decisions()]
        return Section("3. costed decisions", (Table(columns, rows),))

    def _physical(self) -> Section:
        columns = [Column("#", "{:>2}"), Column("reads", "  {:<38}"),
                   Column("batch", " {:>5}", hover="examples per batch; -: reads no data (rows kept in their chunks)"),
                   Column("trim", " {:>4}", hover="free memory returned after each batch (its TRIM decision)"),
                   Column("est FLOP", " {:>10}"), Column("est time", " {:>10}"), Column("est peak", " {:>9}")]
        if self.analyzed:
            columns += [Column("measured", " {:>10}", hover="measured time of the pass"),
                        Column("meas/est", " {:>8}", hover="measured / est.: 1.00× is a true estimate"),
                        Column("held", " {:>9}", hover="bytes of rows held in memory after the pass"),
                        Column("meas peak", " {:>10}", hover="measured peak: resident growth over the pass; ≤: an "
                                                             "earlier peak hid this pass's own (an upper bound)")]
        rows = [(str(r["pass"]), r["reads"], str(r["batch_size"] or "-"),
                 ("yes" if r["trim_after_batches"] else "no") if r["reads_data"] else "-", f"{_si(r['flops'])}FLOP",
                 _fmt_seconds(r["seconds"]), f"{_si(r['peak_bytes'])}B", *(_measured(r) if self.analyzed else ()),
                 (*(f"· {job}" for job in r["jobs"]), *_measured_calls(r), *([f"! {r['note']}"] if r["note"] else []),
                  *([f"⇉ {r['distributed']}"] if r.get("distributed") else []))) for r in self.passes()]
        table = Table((*columns, Column("jobs", "     {}", below=True)), rows, header=True)
        return Section("4. physical passes", (self.plan.device.calibration(), table))

    def _scale(self) -> Section:
        columns = (Column("GPUs", "{} GPU(s)"), Column("time", ": {}"), Column("memory per GPU", ", {} per GPU"),
                   Column("note", "  ({})"), Column("why", "   {}", below=True))
        rows = [(str(r["gpus"]), _fmt_seconds(r["seconds"]), f"{_si(r['memory_per_gpu'])}B",
                 *(("", "") if r["fits"] else ("does not fit", r["why"]))) for r in self.scale()]
        return Section(f"5. at scale on {profile(self.device).name} (estimates)", (Table(columns, rows),))

    # ---- the two renderers ---------------------------------------------------------
    def __str__(self) -> str:
        lines = [f"gradalg plan — {self.summary()}", *([f"! {self.warning}"] if self.warning else []),
                 *(c.describe() for c in self.coverage())]
        for section in self.sections():
            lines += ["", section.title, *(line for part in section.parts for line in text_part(part))]
        return "\n".join(lines)

    __repr__ = __str__

    def _repr_html_(self) -> str:
        from ..viz.html import _css
        esc = html.escape
        parts = [f"<style>{_css()}</style><div class='ga-expr'>",
                 f"<div class='ga-head'>gradalg plan <span class='ga-cost'>{esc(self.summary())}</span></div>",
                 *([f"<div class='ga-warning'>⚠ {esc(self.warning)}</div>"] if self.warning else []),
                 *(f"<div class='ga-coverage'>{'<br>'.join(map(esc, c.describe().splitlines()))}</div>"
                   for c in self.coverage())]
        parts += [f"<details{' open' if s.open else ''}><summary>{esc(s.title)}</summary>"
                  + "".join(map(html_part, s.parts)) + "</details>" for s in self.sections()]
        return "".join(parts) + "</div>"


def _measured(row: dict) -> tuple[str, ...]:
    """A pass's measured cells: its time, measured / estimated, the bytes held after it and its
    peak resident growth (``≤87MB`` when an earlier pass's peak hid this one's: an upper bound);
    ``-`` for what was not measured (never 0)."""
    if "measured_seconds" not in row:
        return ("-",) * 4
    ratio, growth = row["ratio"], row["measured_rss_growth_bytes"]
    return (_fmt_seconds(row["measured_seconds"]), f"{ratio:.2f}×" if 0 <= ratio < float("inf") else "-",
            f"{_si(row['measured_held_bytes'])}B",
            "-" if growth is None else ("≤" if row["measured_rss_is_bound"] else "") + f"{_si(growth)}B")


def _measured_calls(row: dict) -> list[str]:
    """A products pass's measured calls (its seconds are over every call of its solver):
    ``measured: 9 call(s), 0.12 s per call against 0.10 s estimated (the ratio is per call)``;
    none for another pass."""
    if "measured_calls" not in row:
        return []
    per_call = (f", {_fmt_seconds(row['measured_call_seconds'])} per call against "
                f"{_fmt_seconds(row['estimated_call_seconds'])} estimated (the ratio is per call)"
                if "measured_call_seconds" in row else "")
    return [f"measured: {row['measured_calls']:,} call(s){per_call}"]
