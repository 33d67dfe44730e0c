"""The generated parts of docs/cli.md: every command's ``--help`` and the config
schema's tables (from the pydantic models' fields and descriptions).

    python -m gradalg.cli.reference docs/cli.md     # rewrite the generated blocks in place

Blocks sit between ``<!-- generated: NAME -->`` and ``<!-- end generated -->``
(NAME: ``help``, ``help build``, …, ``schema``); tests/test_cli.py checks they are
current.
"""
from __future__ import annotations

import contextlib
import io
import os
import re
import sys
import typing
from pathlib import Path

__all__ = ["help_text", "schema_markdown", "render", "WIDTH"]

WIDTH = 88   # columns of the --help text in the docs


def help_text(command: str | None = None, width: int = WIDTH) -> str:
    """``gradalg [command] --help`` as printed on a terminal ``width`` columns wide."""
    from . import build_parser

    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(width)
    try:
        parser = build_parser()
        if command is not None:
            parser = parser._subparsers._group_actions[0].choices[command]
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            parser.print_help()
        return out.getvalue().rstrip() + "\n"
    finally:
        if old is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = old


def _tables():
    from . import config as c

    return [(c.Config, "top level"), (c.ModelSection, "[model]"), (c.TaskSection, "[task]"),
            (c.DataSection, "[data.train] and [data.queries]"), (c.ProjectorSection, "[projector]"),
            (c.StoreSection, "[store]"), (c.QuerySection, "[query]"), (c.MethodSection, "[method]"),
            (c.ScoreSection, "[score]"), (c.ExecutorSection, "[executor]")]


def _default(field) -> str:
    if field.is_required():
        return "**required**"
    value = field.get_default(call_default_factory=True)
    if value is None:
        return "—"
    if isinstance(value, str):
        return f'`"{value}"`'
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    return f"`{value!r}`".replace("'", '"')


def schema_markdown() -> str:
    """One markdown table per config section: field, default, meaning."""
    from pydantic import BaseModel

    parts = []
    for model, title in _tables():
        rows = []
        for name, field in model.model_fields.items():
            ann = field.annotation
            nested = [a for a in typing.get_args(ann) or (ann,) if isinstance(a, type) and issubclass(a, BaseModel)]
            if nested:
                continue
            text = (field.description or "").replace("|", "\\|")
            rows.append(f"| `{field.alias or name}` | {_default(field)} | {text} |")
        parts.append(f"**{title}**\n\n| field | default | meaning |\n|---|---|---|\n" + "\n".join(rows) + "\n")
    return "\n".join(parts)


def _block(name: str) -> str:
    if name == "schema":
        return schema_markdown()
    command = name.split(" ", 1)[1] if " " in name else None
    return "```text\n" + help_text(command) + "```\n"


PATTERN = re.compile(r"(<!-- generated: (?P<name>[^>]+?) -->\n)(?P<body>.*?)(<!-- end generated -->)", re.S)


def render(text: str) -> str:
    """``text`` with every generated block rewritten."""
    return PATTERN.sub(lambda m: m.group(1) + _block(m.group("name")) + m.group(4), text)


if __name__ == "__main__":
    target = Path(sys.argv[1] if len(sys.argv) > 1 else "docs/cli.md")
    target.write_text(render(target.read_text()))
    print(f"updated {target}")
