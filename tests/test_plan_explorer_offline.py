"""PlanExplorer offline: its state is an ordinary HTML output (plan + inline PNG chart)
beside the widget, redrawn in place, needing no kernel, script or network to show."""
from __future__ import annotations

import base64
import re

import pytest
from torch.utils.data import TensorDataset

import gradalg as ga
from gradalg.plan.explain import Explain
from gradalg.plan.planner import plan

from models import classification_data, mlp

pytest.importorskip("ipywidgets")
pytest.importorskip("matplotlib")
pytest.importorskip("IPython")


def influence():
    task = ga.tasks.classification(mlp())
    x, y = classification_data(20, seed=1)
    xq, yq = classification_data(4, seed=2)
    P = ga.proj.gaussian(8, seed=0)
    G, Q = P(ga.grads(task, TensorDataset(x, y))), P(ga.grads(task, TensorDataset(xq, yq)))
    return Q @ ga.fisher(G).damp(1e-3).inv() @ G.T


def _png_in(html: str) -> bytes:
    match = re.search(r'<img[^>]*src="data:image/png;base64,([A-Za-z0-9+/=]+)"', html)
    assert match, "no inline PNG chart in the snapshot"
    return base64.b64decode(match.group(1))


def test_snapshot_is_self_contained_html():
    S = influence()
    explorer = ga.widgets.PlanExplorer(S)
    bundle = explorer._repr_mimebundle_()
    html = bundle["text/html"]
    assert Explain(plan(S.expr))._repr_html_() in html           # the plan of the settings shown
    assert "costed decisions" in html and "projection k = 8" in html
    assert _png_in(html)[:8] == b"\x89PNG\r\n\x1a\n"
    assert "<script" not in html.lower()
    assert not re.search(r'(src|href)="(https?:)?//', html), "the snapshot loads something from the network"
    assert bundle["text/plain"].startswith("PlanExplorer(")


def test_snapshot_follows_the_controls():
    explorer = ga.widgets.PlanExplorer(influence())
    before = explorer.snapshot_html()
    explorer.k.value = 16
    after = explorer.snapshot_html()
    assert "projection k = 16" in after and after != before
    node, p = explorer.current()
    assert Explain(p)._repr_html_() in after


def test_displayed_beside_the_widget_and_updated_in_place():
    from IPython.core.interactiveshell import InteractiveShell
    from IPython.display import display
    from IPython.utils.capture import capture_output

    InteractiveShell.instance()
    explorer = ga.widgets.PlanExplorer(influence())
    with capture_output() as shown:
        display(explorer)
        explorer.damping.value = 0.1
    widget, snapshot, update = shown.outputs
    assert "application/vnd.jupyter.widget-view+json" in widget.data
    assert "costed decisions" in snapshot.data["text/html"] and _png_in(snapshot.data["text/html"])
    display_id = snapshot.transient["display_id"]
    assert update.update and update.transient["display_id"] == display_id
    assert "damping λ = 0.1" in update.data["text/html"] and "damping λ = 0.001" in snapshot.data["text/html"]


def test_no_plan_is_shown_as_text():
    explorer = ga.widgets.PlanExplorer(influence())

    def refuse():
        raise ga.MemoryBudgetError("held rows take 1.8 kB <over> the budget of 2 B")
    explorer.current = refuse
    explorer.update()
    html = explorer.snapshot_html()
    assert "No plan:" in html and "&lt;over&gt;" in html       # the reason, escaped
    assert "<img" not in html                                  # no chart of an earlier plan
