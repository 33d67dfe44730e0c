"""Run a notebook headless and keep what it produced.

    python -m gradalg.notebook_runner notebooks/01_quickstart.ipynb --out build/quickstart

executes every cell with a Jupyter kernel on **this** interpreter (``sys.executable``,
so the kernel sees the same virtual environment and needs no global Jupyter install),
then writes

* ``OUT/<name>.ipynb``      the executed notebook, outputs included
* ``OUT/<name>_figN.png``   every PNG image output, numbered from 1 in cell order

and prints where they are. A failing cell stops the run: the partly executed notebook
is still written (so the error can be read in context), the cell's error is printed
and the exit status is 1.

From Python (tests): :func:`run_notebook` returns a :class:`NotebookRun` or raises
:class:`NotebookCellError`.
"""
from __future__ import annotations

import argparse
import base64
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["NotebookRun", "NotebookCellError", "run_notebook", "kernel_spec_dir", "main"]

KERNEL_NAME = "gradalg-python"


@dataclass
class NotebookRun:
    """What one execution produced."""

    source: Path              # the notebook that was run
    notebook: Path            # the executed copy, OUT/<name>.ipynb
    figures: list[Path] = field(default_factory=list)   # OUT/<name>_figN.png, in cell order
    seconds: float = 0.0      # wall-clock time of the execution (kernel start included)


class NotebookCellError(RuntimeError):
    """A cell raised. ``cell_index`` counts every cell from 0; ``notebook`` is the partly
    executed copy that was written anyway."""

    def __init__(self, source: Path, cell_index: int | None, message: str, notebook: Path | None):
        self.source = source
        self.cell_index = cell_index
        self.notebook = notebook
        where = f"cell {cell_index}" if cell_index is not None else "a cell"
        super().__init__(f"{source}: {where} failed\n{message}")


def kernel_spec_dir(root: Path) -> Path:
    """Write a kernelspec named :data:`KERNEL_NAME` that starts ``sys.executable -m
    ipykernel_launcher``, under ``root/kernels/``. Returns the spec's directory."""
    spec = root / "kernels" / KERNEL_NAME
    spec.mkdir(parents=True, exist_ok=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": f"Python ({Path(sys.executable).parent.parent.name})",
        "language": "python",
        # the debugger's frozen-modules warning is noise in a headless run
        "env": {"PYDEVD_DISABLE_FILE_VALIDATION": "1", "GRADALG_PROGRESS": "0"},  # no bars in saved outputs
    }))
    return spec


def _figures(nb) -> list[bytes]:
    """The PNG bytes of every image output, in cell order."""
    out = []
    for cell in nb.cells:
        for output in cell.get("outputs", []):
            data = output.get("data", {})
            png = data.get("image/png")
            if png:
                out.append(base64.b64decode(png if isinstance(png, str) else "".join(png)))
    return out


def _failed_cell(nb) -> tuple[int | None, str]:
    """Index and error text of the first cell whose outputs hold an error."""
    for i, cell in enumerate(nb.cells):
        for output in cell.get("outputs", []):
            if output.get("output_type") == "error":
                return i, f"{output.get('ename')}: {output.get('evalue')}"
    return None, ""


def run_notebook(path: str | os.PathLike, out_dir: str | os.PathLike, *, timeout: int = 600,
                 cwd: str | os.PathLike | None = None) -> NotebookRun:
    """Execute the notebook at ``path``; write it and its PNG figures to ``out_dir``.

    timeout : seconds any one cell may run before the run fails.
    cwd : directory the kernel starts in (default: the notebook's own directory).
    Raises :class:`NotebookCellError` if a cell fails (after writing the partial notebook).
    """
    import nbformat
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import KernelManager
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError

    source = Path(path)
    if not source.is_file():
        raise FileNotFoundError(f"no notebook at {source}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    name = source.stem
    executed = out / f"{name}.ipynb"
    nb = nbformat.read(source, as_version=4)

    start = time.perf_counter()
    error: BaseException | None = None
    with tempfile.TemporaryDirectory(prefix="gradalg-kernel-") as tmp:
        kernel_spec_dir(Path(tmp))
        ksm = KernelSpecManager(kernel_dirs=[str(Path(tmp) / "kernels")], ensure_native_kernel=False)
        # IPC sockets where available: local only, and no plain-TCP warning from ipykernel
        # (an absolute socket path: the kernel starts in the notebook's directory, not ours)
        if os.name == "nt":
            km = KernelManager(kernel_name=KERNEL_NAME, kernel_spec_manager=ksm)
        else:
            km = KernelManager(kernel_name=KERNEL_NAME, kernel_spec_manager=ksm, transport="ipc",
                               ip=str(Path(tmp) / "kernel-ipc"))
        client = NotebookClient(
            nb, km=km, kernel_name=KERNEL_NAME, timeout=timeout,
            resources={"metadata": {"path": str(Path(cwd) if cwd is not None else source.parent.resolve())}},
        )
        try:
            client.execute(cleanup_kc=True)  # a km we pass in is not shut down by default
        except (CellExecutionError, CellTimeoutError, DeadKernelError) as err:
            error = err
    seconds = time.perf_counter() - start

    # record the kernel the notebook really ran on, not the temporary spec's name
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, executed)
    for stale in out.glob(f"{name}_fig*.png"):   # figures of an earlier run of this notebook
        stale.unlink()
    figures = []
    for i, png in enumerate(_figures(nb), start=1):
        fig = out / f"{name}_fig{i}.png"
        fig.write_bytes(png)
        figures.append(fig)

    if error is not None:
        index, _ = _failed_cell(nb)
        raise NotebookCellError(source, index, str(error), executed) from error
    return NotebookRun(source, executed, figures, seconds)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gradalg.notebook_runner",
                                     description="Execute a notebook headless; save it and its figures.")
    parser.add_argument("notebook", help="path of the .ipynb to run")
    parser.add_argument("--out", required=True, help="directory for the executed notebook and PNG figures")
    parser.add_argument("--timeout", type=int, default=600, help="seconds any one cell may run (default 600)")
    args = parser.parse_args(argv)
    try:
        run = run_notebook(args.notebook, args.out, timeout=args.timeout)
    except NotebookCellError as err:
        print(f"FAILED {err}", file=sys.stderr)
        if err.notebook is not None:
            print(f"partly executed notebook: {err.notebook}", file=sys.stderr)
        return 1
    except FileNotFoundError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except RuntimeError as err:  # the kernel did not start or died outside a cell
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(f"ran {run.source} in {run.seconds:.1f} s")
    print(f"  notebook: {run.notebook}")
    for fig in run.figures:
        print(f"  figure:   {fig}")
    if not run.figures:
        print("  (no figures)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
