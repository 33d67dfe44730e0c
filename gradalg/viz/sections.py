"""Sections of a display laid out as text and as notebook HTML, from one model: a
:class:`Section` is a title and parts — tables of rows × named columns (:class:`Table`,
:class:`Column`), expression trees and plain text — and :func:`text_part` /
:func:`html_part` lay each part out, every column of a table in both, with the same cells.
``explain()`` (:class:`gradalg.plan.explain.Explain`) builds its stages as sections; this
module only renders what it is given (it plans nothing)."""
from __future__ import annotations

import html
import textwrap
from dataclasses import dataclass, field

from .html import html_tree
from .tree import text_tree

__all__ = ["Column", "Table", "Section", "text_part", "html_part"]


@dataclass(frozen=True)
class Column:
    """A named column of a :class:`Table`. A text line shows a non-empty cell as
    ``text.format(cell)`` (``": chose {}"``, ``" {:>10}"``), a cell's parts joined by ``sep``;
    a ``below`` column shows each part on a line of its own under the row. ``hover``: the
    HTML header's explanation on mouse-over."""

    name: str
    text: str = "{}"
    sep: str = "; "
    below: bool = False
    hover: str = ""


@dataclass(frozen=True)
class Table:
    """Rows × named columns: each row a tuple of cells in ``columns``' order, a cell a string
    or a tuple of parts (``hover``: part → its math, shown on mouse-over in the HTML). The
    text shows one line per row (under a line of the columns' names when ``header``), the
    HTML a table."""

    columns: tuple[Column, ...]
    rows: list[tuple]
    header: bool = False
    caption: str = ""
    hover: dict = field(default_factory=dict)

    def shown(self) -> list[tuple[Column, list[tuple]]]:
        """What both renderers show: each column with a non-empty cell, and its cells as tuples of parts."""
        columns = [(c, [row[i] if isinstance(row[i], tuple) else (row[i],) for row in self.rows])
                   for i, c in enumerate(self.columns)]
        return [(c, cells) for c, cells in columns if any(any(cell) for cell in cells)]


@dataclass(frozen=True)
class Section:
    """One stage as shown: its title and its parts, in order: tables (:class:`Table`), trees
    (``(node, name, cost line)``) and plain text (a record, a calibration line)."""

    title: str
    parts: tuple
    open: bool = True


def text_part(part) -> list[str]:
    """A section's part as text lines: a table's rows, a tree, or text indented by three spaces."""
    if isinstance(part, str):
        return [textwrap.indent(part, "   ")]
    if not isinstance(part, Table):
        return [text_tree(*part)]
    shown = part.shown()
    if not shown:
        return []
    lines = [f"   {part.caption}"] if part.caption else []
    if part.header:
        lines.append("   " + "".join(c.text.format(c.name) for c, _ in shown if not c.below))
    for j in range(len(part.rows)):
        lines.append("   " + "".join(c.text.format(c.sep.join(cells[j])) for c, cells in shown
                                     if not c.below and any(cells[j])))
        lines += ["   " + c.text.format(x) for c, cells in shown if c.below for x in cells[j] if x]
    return lines


def html_part(part) -> str:
    """A section's part as HTML: a table (the same columns and cells as the text), a tree, or text."""
    esc = html.escape
    if isinstance(part, str):
        return f"<pre class='ga-cost' style='white-space: pre-wrap'>{esc(part)}</pre>"
    if not isinstance(part, Table):
        return html_tree(*part)
    shown = part.shown()
    if not shown:
        return ""

    def hovered(x: str) -> str:   # a part with its math on mouse-over (an operator rule)
        return f"<b title='{esc(part.hover[x])}'>{esc(x)}</b>" if x in part.hover else esc(x)
    head = "".join((f"<th title='{esc(c.hover)}'>" if c.hover else "<th>") + f"{esc(c.name)}</th>" for c, _ in shown)
    body = "".join("<tr>" + "".join(f"<td>{'<br>'.join(map(hovered, cells[j]))}</td>" for _, cells in shown)
                   + "</tr>" for j in range(len(part.rows)))
    caption = f"<div>{esc(part.caption)}</div>" if part.caption else ""
    return f"{caption}<table class='ga-table'><tr>{head}</tr>{body}</table>"
