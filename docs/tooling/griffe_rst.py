"""A griffe extension: gradalg's reStructuredText-flavoured docstrings as Markdown.

gradalg's docstrings are written to read well in ``help()`` and in an editor: Sphinx
roles (``:class:`~gradalg.api.Scores```), doctest blocks (``>>> ...``), RST simple
tables and ``::`` before literal blocks. mkdocstrings renders docstrings as Markdown,
where those come out as raw punctuation, so :func:`rst_to_markdown` rewrites them
before rendering (the source docstrings are unchanged):

* a role becomes inline code, linked to the object's API entry when the target is
  documented (an *optional* cross-reference: an undocumented target is plain code,
  never a broken link);
* a doctest block at the margin becomes a fenced ``pycon`` block;
* an RST simple table becomes a Markdown table;
* a paragraph ending in ``::`` ends in ``:`` (the indented block after it is already a
  Markdown code block);
* ``name : text`` lines outside numpy sections (gradalg's short argument lists) become
  a bullet list; in numpy sections, a parameter's type loses its inline markup (it is
  shown verbatim);
* a paragraph at the margin after the entries of a numpy ``Parameters`` (or
  ``Attributes``) section, which numpy style would read as one more parameter, gets a
  ``Notes`` heading of its own.

Loaded by ``mkdocs.yml`` (``plugins.mkdocstrings.handlers.python.options.extensions``).
"""
from __future__ import annotations

import html
import re

import griffe

__all__ = ["RstToMarkdown", "rst_to_markdown"]

_ROLE = re.compile(r":(?:py:)?(class|func|meth|mod|attr|data|exc|obj|const|math|ref):`([^`]+)`")
_BORDER = re.compile(r"^( *)(=+)( +=+)+ *$")
_ENTRY_SECTIONS = ("Parameters", "Other Parameters", "Attributes", "Keyword Arguments", "Args", "Arguments")
_ENTRY = re.compile(r"^\*{0,2}\w+(\s*,\s*\*{0,2}\w+)*(\s+:(\s.*)?)?$")   # "name", "a, b : type"


def _role(match: re.Match, scope: str) -> str:
    kind, target = match.groups()
    if kind in ("math", "ref"):
        return f"`{target}`"
    explicit = re.fullmatch(r"(.*?)\s*<([^>]+)>", target)   # :class:`title <target>`
    if explicit:
        title, target = explicit.groups()
    else:
        title = None
    short = target.startswith("~")
    target = target.lstrip("~.").rstrip("()")
    if title is None:
        title = target.rsplit(".", 1)[-1] if short else target
    identifier = target if target.startswith("gradalg") or not scope else f"{scope}.{target}"
    code = f"<code>{html.escape(title)}</code>"
    return f'<autoref identifier="{html.escape(identifier)}" optional>{code}</autoref>'


def _table(lines: list[str]) -> list[str]:
    """An RST simple table (its lines, borders included) as a Markdown table."""
    border = lines[0]
    indent = len(border) - len(border.lstrip())
    spans = [(m.start(), m.end()) for m in re.finditer(r"=+", border)]
    borders = [i for i, line in enumerate(lines) if _BORDER.match(line)]
    header_end = borders[1] if len(borders) >= 3 else None

    def cells(line: str) -> list[str]:
        out = []
        for j, (start, end) in enumerate(spans):
            stop = spans[j + 1][0] if j + 1 < len(spans) else len(line)
            out.append(line[start:stop].strip())
        return out

    header: list[list[str]] = []
    body: list[list[str]] = []
    for i, line in enumerate(lines):
        if i in borders or not line.strip():
            continue
        target = header if header_end is not None and i < header_end else body
        row = cells(line)
        if target and not row[0]:          # a continuation line: first column blank
            target[-1] = [f"{a} {b}".strip() for a, b in zip(target[-1], row)]
        else:
            target.append(row)
    if not header:
        header = [[""] * len(spans)]
    pad = " " * indent

    def fmt(row):
        return pad + "| " + " | ".join(c.replace("|", r"\|") for c in row) + " |"

    out = [fmt(r) for r in header[:1]]
    out.append(pad + "|" + "|".join("---" for _ in spans) + "|")
    out += [fmt(r) for r in header[1:] + body]
    return out


def _close_entry_sections(lines: list[str]) -> list[str]:
    """A ``Notes`` heading before a margin paragraph that follows a blank line inside a
    parameter-like numpy section."""
    out: list[str] = []
    section = None
    for i, line in enumerate(lines):
        underline = i + 1 < len(lines) and re.fullmatch(r"-{3,}", lines[i + 1].strip() or "x")
        if underline and line.strip():
            section = line.strip()
        elif (section in _ENTRY_SECTIONS and line and not line[0].isspace() and i > 0
              and not lines[i - 1].strip() and not re.fullmatch(r"-{3,}", line.strip())
              and not _ENTRY.match(line)):
            out += ["Notes", "-----"]
            section = "Notes"
        elif section in _ENTRY_SECTIONS and line and not line[0].isspace() and " : " in line:
            name, _, kind = line.partition(" : ")        # the type is shown verbatim: plain text
            line = f"{name} : {_plain(kind)}"
        out.append(line)
    return out


def _plain(text: str) -> str:
    """``text`` without inline markup: ``code`` and roles as their bare words."""
    text = _ROLE.sub(lambda m: m.group(2).lstrip("~.").rsplit(".", 1)[-1] if m.group(2).startswith("~")
                     else m.group(2), text)
    return text.replace("``", "")


_FIELD = re.compile(r"^(\*{0,2}[A-Za-z_][\w.]*(?:\s*,\s*\*{0,2}[A-Za-z_][\w.]*)*) : (.*)$")


def _field_lists(lines: list[str]) -> list[str]:
    """Free-form ``name : text`` lines (outside numpy sections), as gradalg writes its
    arguments in short docstrings, as a bullet list (continuation lines kept with their
    item); Markdown would run them into one paragraph."""
    out: list[str] = []
    section = None
    i = 0
    while i < len(lines):
        line = lines[i]
        if i + 1 < len(lines) and line.strip() and re.fullmatch(r"-{3,}", lines[i + 1].strip() or "x"):
            section = line.strip()
        if section is None and _FIELD.match(line):
            if out and out[-1].strip() and not out[-1].startswith(("* ", "  ")):
                out.append("")                           # a list needs a blank line before it
            name, text = _FIELD.match(line).groups()
            names = ", ".join(f"`{n.strip()}`" for n in name.split(","))
            out.append(f"* {names}: {text}")
            i += 1
            while i < len(lines) and lines[i].strip() and lines[i][0].isspace():
                out.append("  " + lines[i].strip())
                i += 1
            if i < len(lines) and lines[i].strip() and not _FIELD.match(lines[i]):
                out.append("")                           # the paragraph after the list is not an item
            continue
        out.append(line)
        i += 1
    return out


def rst_to_markdown(text: str, scope: str = "") -> str:
    """``text`` (a docstring) with RST constructs rewritten as Markdown; ``scope`` is the
    dotted path relative role targets are resolved against (the object's module)."""
    lines = _field_lists(_close_entry_sections(text.splitlines()))
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        stripped = line.lstrip()
        indent = len(line) - len(stripped)
        if _BORDER.match(line):                          # RST simple table
            j, borders = i + 1, 1
            while j < len(lines) and borders < 3:
                if _BORDER.match(lines[j]):
                    borders += 1
                    if borders == 2 and (j + 1 == len(lines) or not lines[j + 1].strip()):
                        j += 1
                        break          # a table without a header row ends at its second border
                elif not lines[j].strip() and borders == 1:
                    break
                j += 1
            if borders >= 2:
                if out and out[-1].strip():
                    out.append("")
                out += _table(lines[i:j])
                out.append("")
                i = j
                continue
        if stripped.startswith(">>>") and indent < 4:    # doctest block at the margin
            j = i
            while j < len(lines) and lines[j].strip():
                j += 1
            pad = " " * indent
            if out and out[-1].strip():
                out.append("")
            out += [pad + "```pycon"] + [ln[indent:] if ln[:indent].isspace() else ln.lstrip() for ln in lines[i:j]]
            out += [pad + "```"]
            i = j
            continue
        if stripped == "::":
            i += 1
            continue
        if stripped.endswith("::") and not stripped.startswith(("..", ">>>")):
            line = line[:-1]
        out.append(line)
        i += 1
    text = "\n".join(out)
    # roles last, and outside fenced blocks and code spans they do not occur anyway
    return _ROLE.sub(lambda m: _role(m, scope), text)


class RstToMarkdown(griffe.Extension):
    """Rewrite every docstring griffe loads with :func:`rst_to_markdown`."""

    def on_instance(self, *, node, obj, agent, **kwargs) -> None:   # noqa: ARG002 - griffe's signature
        if obj.docstring is not None:
            scope = obj.path if obj.is_module else obj.module.path
            obj.docstring.value = rst_to_markdown(obj.docstring.value, scope)
