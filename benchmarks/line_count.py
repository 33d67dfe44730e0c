"""Line counts of gradalg's packages: raw lines, code lines, and the longest functions.

A line is *code* when it is not blank, not a comment-only line, and not inside a docstring
(a string constant standing alone as a statement: module, class and function docstrings and
the attribute docstrings under dataclass fields). This is the count of
``../shared/reviews/architecture-2026-12-04.md`` (its appendix), the one issue 30 item 8
sets its targets in (``plan/`` + ``exec/`` at most 5.5 k; no function longer than 60 lines).

    .venv/bin/python benchmarks/line_count.py                     # plan and exec
    .venv/bin/python benchmarks/line_count.py plan exec expr --top 20

Prints one row per package (files, raw lines, code lines, docstring lines, comment lines,
blank lines), their total, then the ``--top`` longest functions (lines from ``def`` to the
function's last line, as ``ast`` gives them) with their file and line.
"""
from __future__ import annotations

import argparse
import ast
import io
import os
import tokenize

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "gradalg")


def classify(source: str) -> dict[str, int]:
    """Counts of ``raw``, ``code``, ``doc``, ``comment`` and ``blank`` lines of one file."""
    lines = source.splitlines()
    doc: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)):
            doc.update(range(node.lineno, node.end_lineno + 1))
    comment: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT and lines[tok.start[0] - 1].strip().startswith("#"):
            comment.add(tok.start[0])
    counts = dict(raw=len(lines), code=0, doc=0, comment=0, blank=0)
    for number, line in enumerate(lines, start=1):
        kind = ("blank" if not line.strip() else "doc" if number in doc
                else "comment" if number in comment else "code")
        counts[kind] += 1
    return counts


def functions(path: str, source: str) -> list[tuple[int, str, str]]:
    """``(length, 'file:line', qualified name)`` of every function in one file."""
    found = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found.append((child.end_lineno - child.lineno + 1,
                              f"{path}:{child.lineno}", prefix + child.name))
                visit(child, prefix + child.name + ".")
            elif isinstance(child, ast.ClassDef):
                visit(child, prefix + child.name + ".")

    visit(ast.parse(source), "")
    return found


def package_files(package: str) -> list[str]:
    paths = []
    for folder, _, names in os.walk(os.path.join(ROOT, package)):
        paths += [os.path.join(folder, n) for n in names if n.endswith(".py")]
    return sorted(paths)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("packages", nargs="*", default=["plan", "exec"])
    parser.add_argument("--top", type=int, default=10, help="longest functions to list")
    args = parser.parse_args()
    columns = ("raw", "code", "doc", "comment", "blank")
    print(f"{'package':<10}{'files':>7}" + "".join(f"{c:>9}" for c in columns))
    total = dict.fromkeys(columns, 0)
    longest = []
    for package in args.packages:
        paths = package_files(package)
        sums = dict.fromkeys(columns, 0)
        for path in paths:
            source = open(path, encoding="utf-8").read()
            for key, value in classify(source).items():
                sums[key] += value
            longest += functions(os.path.relpath(path, os.path.dirname(ROOT)), source)
        for key in columns:
            total[key] += sums[key]
        print(f"{package:<10}{len(paths):>7}" + "".join(f"{sums[c]:>9}" for c in columns))
    print(f"{'total':<10}{'':>7}" + "".join(f"{total[c]:>9}" for c in columns))
    print(f"\nlongest functions ({args.top}):")
    for length, where, name in sorted(longest, reverse=True)[:args.top]:
        print(f"{length:>5}  {where:<40} {name}")


if __name__ == "__main__":
    main()
