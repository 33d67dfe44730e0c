"""``PlanExplorer``: change projection size, damping, memory budget and executor, and
watch the plan and its cost breakdown update before anything runs.

    ga.widgets.PlanExplorer(S)        # S: Scores / GradientSet / Operator

The explorer rebuilds the expression with the new settings (:func:`with_settings`:
every projector gets the new ``k``, every damping the new ``λ``), plans it, and shows
the plan's HTML and a bar chart of estimated seconds per pass. Planning reads shapes
only, so exploring costs nothing on the model. The plan and chart are an ordinary HTML
output beside the controls, so a saved notebook shows them without a kernel or network.
"""
from __future__ import annotations

import base64
import html
import io
import uuid
from dataclasses import replace

from ..expr import Damp, Project
from ..expr.base import transform
from ..options import get_options
from ..plan.budget import budget_bytes
from ..plan.explain import Explain
from ..plan.planner import plan
from ..units import format_bytes

__all__ = ["PlanExplorer", "with_settings"]

EXECUTORS = {"local": "local PyTorch executor"}


def with_settings(node, *, k: int | None = None, damping: float | None = None):
    """``node`` with every projector's size set to ``k`` and every damping set to ``damping``
    (a relative damping, ``H.damp(d, relative=True)``, keeps its meaning: d · mean eigenvalue)."""
    def change(x):
        if k is not None and isinstance(x, Project) and x.projector.k != k:
            p = x.projector
            return Project(x.grads, replace(p, k=k, k_out=None, k_in=None) if p.kind == "kron" else replace(p, k=k))
        if damping is not None and isinstance(x, Damp) and x.damping != damping:
            return Damp(x.op, damping, x.relative)   # a relative damping stays relative
        return None
    return transform(node, change)


def _first(node, kind):
    for x in node.walk():
        if isinstance(x, kind):
            return x
    return None


def cost_chart(p, ax=None):
    """Bar chart of estimated seconds per pass of plan ``p`` (matplotlib Axes)."""
    import matplotlib.pyplot as plt
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 2.4))
    labels = [f"{i}: {q.label[:28]}" for i, q in enumerate(p.passes)]
    ax.barh(labels, [q.seconds for q in p.passes], color="#2a7ab0")
    ax.invert_yaxis()
    ax.set_xlabel("estimated seconds")
    ax.set_title(f"{p.data_passes} pass(es) over data, peak ~{format_bytes(p.peak_bytes)}")
    ax.figure.tight_layout()
    return ax


class PlanExplorer:
    """An ipywidgets panel over an expression (or its ``.expr`` node).

    Displayed, it is two outputs: the controls (a widget: projection ``k``, damping λ,
    memory budget, executor) and, below them, the plan's HTML with a bar chart of its
    estimated seconds per pass as an inline PNG: an *ordinary* output (``text/html``),
    redrawn in place whenever a control moves. A notebook saved and opened without a
    kernel or network (GitHub, nbviewer, ``nbconvert``, the docs site) still shows the
    plan and chart of the settings last shown; only the sliders need a live kernel.

    ``current()`` is the (node, plan) pair for the settings shown, ``html.value`` the
    plan's HTML, ``snapshot_html()`` the static rendering.
    """

    def __init__(self, expr, *, device=None):
        import ipywidgets as w

        self.node = getattr(expr, "expr", expr)
        self.device = device
        proj = _first(self.node, Project)
        damp = _first(self.node, Damp)
        budget = budget_bytes(get_options())
        self.k = w.IntSlider(value=proj.projector.k if proj else 64, min=4, max=max(8192, proj.projector.k if proj else 0),
                             step=4, description="projection k", disabled=proj is None, continuous_update=False)
        self.damping = w.FloatLogSlider(value=damp.damping if damp else 1e-3, base=10, min=-8, max=2,
                                        description="damping λ", disabled=damp is None, continuous_update=False)
        self.budget = w.FloatLogSlider(value=budget / 1e6, base=2, min=0, max=20, description="budget MB",
                                       continuous_update=False)
        self.executor = w.Dropdown(options=list(EXECUTORS), value="local", description="executor")
        self.html = w.HTML()            # the plan's HTML (shown in the snapshot output below the controls)
        self.summary = w.HTML()         # one line inside the widget: passes, FLOPs, peak memory
        for control in (self.k, self.damping, self.budget, self.executor):
            control.observe(lambda _change: self.update(), names="value")
        self.widget = w.VBox([w.HBox([self.k, self.damping]), w.HBox([self.budget, self.executor]), self.summary])
        self._display_id = f"gradalg-plan-explorer-{uuid.uuid4().hex}"
        self._shown = False
        self._chart_png = b""
        self.update()

    def current(self):
        """(node, plan) for the settings now shown."""
        node = with_settings(self.node, k=None if self.k.disabled else self.k.value,
                             damping=None if self.damping.disabled else self.damping.value)
        options = replace(get_options(), memory_budget=int(self.budget.value * 1e6))
        return node, plan(node, options=options, device=self.device)

    def settings(self) -> str:
        """The settings shown, in one line (the snapshot's heading)."""
        parts = [] if self.k.disabled else [f"projection k = {self.k.value}"]
        parts += [] if self.damping.disabled else [f"damping λ = {self.damping.value:.3g}"]
        parts += [f"memory budget {format_bytes(self.budget.value * 1e6)}", f"executor {self.executor.value}"]
        return " · ".join(parts)

    def update(self):
        """Re-plan with the settings shown and redraw: the plan HTML, the chart and the
        snapshot output (in place, when the explorer is displayed)."""
        from ..errors import GradalgError
        try:
            _, p = self.current()
        except GradalgError as err:
            self.html.value = f"<b>No plan:</b> {html.escape(str(err))}"
            self.summary.value = self.html.value
            self._chart_png = b""
        else:
            self.html.value = Explain(p)._repr_html_()
            self.summary.value = (f"{p.data_passes} pass(es) over data · ~{p.total.flops / 1e9:.3g} GFLOP · "
                                  f"peak ~{format_bytes(p.peak_bytes)}")
            self._chart_png = _chart_png(p)
        if self._shown:
            from IPython.display import update_display
            update_display(self._snapshot_bundle(), raw=True, display_id=self._display_id)

    def snapshot_html(self) -> str:
        """The explorer's current state as self-contained HTML: the settings, the cost
        chart as an inline ``<img>`` (base64 PNG) and the plan; no script, no network."""
        chart = ""
        if self._chart_png:
            data = base64.b64encode(self._chart_png).decode("ascii")
            chart = (f'<img alt="estimated seconds per pass" src="data:image/png;base64,{data}" '
                     'style="max-width:100%;height:auto"/>')
        return (f'<div class="ga-plan-explorer"><p><b>PlanExplorer</b>: {html.escape(self.settings())}</p>'
                f"{chart}{self.html.value}</div>")

    def _snapshot_bundle(self) -> dict:
        return {"text/html": self.snapshot_html(), "text/plain": f"PlanExplorer({self.settings()})"}

    def _repr_mimebundle_(self, include=None, exclude=None):
        """The static snapshot (``text/html``, ``text/plain``): what frontends without
        widget support show, and what ``IPython.display`` falls back to."""
        return self._snapshot_bundle()

    def _ipython_display_(self):
        from IPython.display import display
        display(self.widget)
        display(self._snapshot_bundle(), raw=True, display_id=self._display_id)
        self._shown = True


def _chart_png(p) -> bytes:
    """PNG bytes of :func:`cost_chart` of plan ``p`` (empty without matplotlib). Drawn on a
    bare ``Figure``: no pyplot state, nothing shown by the notebook's inline backend."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return b""
    fig = Figure(figsize=(6, 2.4))
    cost_chart(p, fig.add_subplot())
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=96)
    return buf.getvalue()
