"""Execute the notebooks whose executed copy in ``docs/executed/`` is missing or stale.

    python docs/tooling/execute_notebooks.py                   # what `make docs-notebooks` runs
    python docs/tooling/execute_notebooks.py --all             # every notebook, current or not
    python docs/tooling/execute_notebooks.py --force 01_quickstart tutorials/02_evaluating_attribution
                                                               # only these, current or not


A copy is *current* when its code cells are the source notebook's, cell for cell (the
same rule the site's hook uses to show its outputs): edited markdown needs no run, edited
code does. Staleness is decided by content, not file times, so a fresh clone re-runs
nothing. A copy can be current by this rule and still show what *older library code*
printed (a default changed, a unit's spelling changed): ``--force NAME...`` re-executes
just the named notebooks (a NAME is a file's stem, its file name or ``<folder>/<file>``;
a name that matches no notebook, or two, is an error that lists them), one after the
other, and leaves every other copy alone; ``--all`` re-executes all of them. Each run goes through :func:`gradalg.notebook_runner.run_notebook` (the kernel
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


def notebooks(root: Path = ROOT) -> list[str]:
    """``<folder>/<file>`` of every source notebook, in the order they are executed."""
    return [f"{folder}/{p.name}" for folder in FOLDERS for p in sorted((root / folder).glob("*.ipynb"))]


def resolve(names: list[str], available: list[str]) -> list[str]:
    """The notebooks ``names`` mean, each a stem (``01_quickstart``), a file name
    (``01_quickstart.ipynb``) or ``<folder>/<file>``; raises ``ValueError`` naming the
    choices when a name matches none or several."""
    chosen = []
    for name in names:
        key = name.strip("/").removesuffix(".ipynb")
        hits = [rel for rel in available if key in (rel.removesuffix(".ipynb"), Path(rel).stem)]
        if len(hits) != 1:
            what = "matches no notebook" if not hits else f"matches {len(hits)} notebooks ({', '.join(hits)})"
            raise ValueError(f"--force {name!r} {what}; name one of: {', '.join(available)}")
        if hits[0] not in chosen:
            chosen.append(hits[0])
    return chosen


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    runs = parser.add_mutually_exclusive_group()
    runs.add_argument("--all", action="store_true", help="execute every notebook, current or not")
    runs.add_argument("--force", nargs="+", metavar="NAME", default=None,
                      help="execute only these notebooks, current or not (stem, file name or <folder>/<file>)")
    parser.add_argument("--out", default=str(ROOT / "docs" / "executed"), help="folder of the executed copies")
    parser.add_argument("--timeout", type=int, default=900, help="seconds any one cell may run")
    args = parser.parse_args(argv)
    available = notebooks()
    try:
        forced = resolve(args.force, available) if args.force else None
    except ValueError as err:
        parser.error(str(err))

    from gradalg.notebook_runner import NotebookCellError, run_notebook

    out = Path(args.out)
    failed = []
    for rel in available:
        source, target = ROOT / rel, out / rel
        if forced is not None and rel not in forced:
            print(f"{'current' if is_current(source, target) else 'STALE':9} {rel} (not named)")
            continue
        if forced is None and not args.all and is_current(source, target):
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
