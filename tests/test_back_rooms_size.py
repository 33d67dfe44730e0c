"""Issue 30 item 8, "smaller and plainer": no function of the planner (``gradalg/plan/``) or
the executors (``gradalg/exec/``) is longer than 60 lines, docstring included (a longer one
does several things: split it into named steps). The other half of the item, ``plan/`` +
``exec/`` at most 5.5 k lines, is not met yet and is not pinned here; the count is
``find gradalg/plan gradalg/exec -name '*.py' | xargs wc -l``: on 2026-12-06 (session 40,
merged) 7,799 in ``plan/`` + 3,351 in ``exec/`` = 11,150 (11,178 before it)."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 60


def _functions(folder: Path):
    """``(path, name, first line, lines)`` of every function and method under ``folder``."""
    for path in sorted(folder.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield path.as_posix(), node.name, node.lineno, node.end_lineno - node.lineno + 1


def test_no_function_of_the_planner_or_the_executors_is_longer_than_60_lines():
    long = [f"{Path(path).relative_to(ROOT)}:{line} {name} ({size} lines)"
            for folder in ("plan", "exec") for path, name, line, size in _functions(ROOT / "gradalg" / folder)
            if size > MAX_LINES]
    assert not long, "split these into named steps: " + "; ".join(long)


def test_the_check_sees_a_long_function(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES))
    (tmp_path / "m.py").write_text(f"def f():\n{body}\n")
    assert [(name, size) for _, name, _, size in _functions(tmp_path)] == [("f", MAX_LINES + 1)]
