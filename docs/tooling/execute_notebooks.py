"""Execute the notebooks whose executed copy in ``docs/executed/`` is missing or stale.

    python docs/tooling/execute_notebooks.py            # what `make docs-notebooks` runs
    python docs/tooling/execute_notebooks.py --all      # every notebook, current or not

A copy is *current* when its code cells are the source notebook's, cell for cell (the
same rule the site's hook uses to show its outputs): edited markdown needs no run, edited
code does. Staleness is decided by content, not file times, so a fresh clone re-runs
nothing. Each run goes through :func:`gradalg.notebook_runner.run_notebook` (the kernel
is this interpreter); the figures it also writes as PNG files are removed, since the
notebook holds them. Exit status 1 if a notebook fails (its partial copy is removed, so
the site shows the source without outputs rather than a broken run).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("notebooks", "tutorials")


def code_cells(path: Path) -> list[str]:
    """The sources of a notebook's code cells, in order."""
    import nbformat

    return [c.source for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"]


def is_current(source: Path, executed: Path) -> bool:
    """True when ``executed`` exists and has exactly ``source``'s code cells."""
    return executed.is_file() and code_cells(source) == code_cells(executed)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--all", action="store_true", help="execute every notebook, current or not")
    parser.add_argument("--out", default=str(ROOT / "docs" / "executed"), help="folder of the executed copies")
    parser.add_argument("--timeout", type=int, default=900, help="seconds any one cell may run")
    args = parser.parse_args(argv)

    from gradalg.notebook_runner import NotebookCellError, run_notebook

    out = Path(args.out)
    failed = []
    for folder in FOLDERS:
        for source in sorted((ROOT / folder).glob("*.ipynb")):
            target = out / folder / source.name
            rel = f"{folder}/{source.name}"
            if not args.all and is_current(source, target):
                print(f"current   {rel}")
                continue
            try:
                run = run_notebook(source, target.parent, timeout=args.timeout)
            except NotebookCellError as err:
                print(f"FAILED    {rel}: {err}", file=sys.stderr)
                target.unlink(missing_ok=True)
                failed.append(rel)
            else:
                print(f"executed  {rel} in {run.seconds:.0f} s")
            for png in target.parent.glob(f"{source.stem}_fig*.png"):
                png.unlink()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
