"""``PlanExplorer``: change projection size, damping, memory budget and executor, and
watch the plan and its cost breakdown update before anything runs.

    ga.widgets.PlanExplorer(S)        # S: Scores / GradientSet / Operator

The explorer rebuilds the expression with the new settings (:func:`with_settings`:
every projector gets the new ``k``, every damping the new ``λ``), plans it, and shows
the plan's HTML and a bar chart of estimated seconds per pass. Planning reads shapes
only, so exploring costs nothing on the model.
"""
from __future__ import annotations

import io
from dataclasses import replace

from ..expr import Damp, Project
from ..expr.base import transform
from ..options import get_options
from ..plan.explain import Explain
from ..plan.planner import plan

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
    ax.set_title(f"{p.data_passes} pass(es) over data, peak ~{p.peak_bytes / 2**20:.1f} MiB")
    ax.figure.tight_layout()
    return ax


class PlanExplorer:
    """An ipywidgets panel over an expression (or its ``.expr`` node)."""

    def __init__(self, expr, *, device=None):
        import ipywidgets as w

        self.node = getattr(expr, "expr", expr)
        self.device = device
        proj = _first(self.node, Project)
        damp = _first(self.node, Damp)
        budget = get_options().memory_budget
        self.k = w.IntSlider(value=proj.projector.k if proj else 64, min=4, max=max(8192, proj.projector.k if proj else 0),
                             step=4, description="projection k", disabled=proj is None, continuous_update=False)
        self.damping = w.FloatLogSlider(value=damp.damping if damp else 1e-3, base=10, min=-8, max=2,
                                        description="damping λ", disabled=damp is None, continuous_update=False)
        self.budget = w.FloatLogSlider(value=budget / 2**20, base=2, min=0, max=20, description="budget MiB",
                                       continuous_update=False)
        self.executor = w.Dropdown(options=list(EXECUTORS), value="local", description="executor")
        self.html = w.HTML()
        self.chart = w.Output()
        for control in (self.k, self.damping, self.budget, self.executor):
            control.observe(lambda _change: self.update(), names="value")
        self.widget = w.VBox([w.HBox([self.k, self.damping]), w.HBox([self.budget, self.executor]),
                              self.chart, self.html])
        self.update()

    def current(self):
        """(node, plan) for the settings now shown."""
        node = with_settings(self.node, k=None if self.k.disabled else self.k.value,
                             damping=None if self.damping.disabled else self.damping.value)
        options = replace(get_options(), memory_budget=int(self.budget.value * 2**20))
        return node, plan(node, options=options, device=self.device)

    def update(self):
        import matplotlib.pyplot as plt
        from ..errors import GradalgError
        try:
            _, p = self.current()
        except GradalgError as err:
            self.html.value = f"<b>No plan:</b> {err}"
            return
        self.html.value = Explain(p)._repr_html_()
        self.chart.clear_output(wait=True)
        with self.chart:
            fig, ax = plt.subplots(figsize=(6, 2.4))
            cost_chart(p, ax)
            buf = io.BytesIO()
            fig.savefig(buf, format="png")
            plt.close(fig)
            from IPython.display import Image, display
            display(Image(buf.getvalue()))

    def _ipython_display_(self):
        from IPython.display import display
        display(self.widget)
