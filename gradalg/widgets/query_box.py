"""``QueryBox``: type a prompt in a notebook, see the generation and the training
documents that score highest and lowest for it.

    box = ga.widgets.QueryBox("train.zarr", model, tokenizer, k=5)
    box                                   # a text box; Enter asks
    box.ask("def fibonacci(n):")          # the same without a kernel: returns the Answer
    box.save("session.csv")               # every answer so far

The computation is :class:`~gradalg.widgets.query_session.QuerySession`'s (its docstring
has the math, and the meaning of ``other_checkpoint=True``); the box is a Text input, an
``ask`` button, a ``k`` field and an Output area showing each answer's HTML. Like ``PlanExplorer``, the
last answer is also an ordinary HTML output, so a saved notebook shows it without a
kernel.
"""
from __future__ import annotations

import html
import uuid

from .query_session import QuerySession

__all__ = ["QueryBox"]


class QueryBox(QuerySession):
    """A :class:`QuerySession` with a notebook front end (ipywidgets, built when displayed).

    ``ask(prompt)`` works without a kernel or ipywidgets: it returns the
    :class:`~gradalg.widgets.query_session.Answer` and, when the box is displayed, shows
    it. Arguments: :class:`QuerySession`.
    """

    def __init__(self, store, model, tokenizer, **kwargs):
        super().__init__(store, model, tokenizer, **kwargs)
        self._widget = None
        self._display_id = f"gradalg-query-box-{uuid.uuid4().hex}"
        self._shown = False
        self.last_error: str | None = None

    @property
    def widget(self):
        """The ipywidgets panel: a prompt Text (Enter asks), an "ask" button, a k field, an Output area."""
        if self._widget is None:
            import ipywidgets as w

            # continuous_update=False: the value changes on Enter (or leaving the box), not per keystroke
            self.prompt = w.Text(placeholder="type a prompt, press Enter", description="prompt",
                                 continuous_update=False, layout=w.Layout(width="70%"))
            self.button = w.Button(description="ask")
            self.k_field = w.BoundedIntText(value=self.k, min=1, max=10_000, description="k")
            self.output = w.Output()
            self.prompt.observe(lambda change: change["new"].strip() and self._submit(change["new"]), names="value")
            self.button.on_click(lambda _button: self._submit(self.prompt.value))
            self.k_field.observe(lambda change: setattr(self, "k", change["new"]), names="value")
            self._widget = w.VBox([w.HBox([self.prompt, self.button, self.k_field]), self.output])
        return self._widget

    def _submit(self, prompt: str) -> None:
        from ..errors import GradalgError
        try:
            self.ask(prompt)
        except GradalgError as err:            # shown in the box, the session goes on
            self.last_error = str(err)
            self._show(f"<p style='color:#b00020'><b>error:</b> {html.escape(str(err))}</p>")

    def ask(self, prompt: str, completion: str | None = None):
        """:meth:`QuerySession.ask`, and the answer shown in the box (when displayed)."""
        answer = super().ask(prompt, completion)
        self.last_error = None
        self._show(answer._repr_html_())
        return answer

    def snapshot_html(self) -> str:
        """The last answer as self-contained HTML (or a line saying none was asked yet)."""
        if not self.answers:
            return f"<p><b>QueryBox</b> over {html.escape(str(self.path))}: no prompt asked yet</p>"
        return self.answers[-1]._repr_html_()

    def _show(self, body: str) -> None:
        if self._widget is not None:
            from IPython.display import HTML, display
            self.output.clear_output()
            with self.output:
                display(HTML(body))
        if self._shown:
            from IPython.display import update_display
            update_display({"text/html": body, "text/plain": "QueryBox"}, raw=True, display_id=self._display_id)

    def _repr_mimebundle_(self, include=None, exclude=None):
        return {"text/html": self.snapshot_html(), "text/plain": f"QueryBox({str(self.path)!r}, k={self.k})"}

    def _ipython_display_(self):
        from IPython.display import display
        try:
            display(self.widget)
        except ImportError:                    # no ipywidgets: the static snapshot only (ask() still works)
            pass
        display(self._repr_mimebundle_(), raw=True, display_id=self._display_id)
        self._shown = True
