"""Every notebook in notebooks/ and tutorials/ runs end to end, headless.

They run through :mod:`gradalg.notebook_runner`, the same code as ``make demo``.
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")
pytest.importorskip("sklearn")

from gradalg.notebook_runner import NotebookCellError, run_notebook  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted(p for folder in ("notebooks", "tutorials") for p in (ROOT / folder).glob("*.ipynb"))

pytestmark = [pytest.mark.notebook, pytest.mark.slow]


def test_there_are_notebooks():
    assert (ROOT / "notebooks" / "01_quickstart.ipynb") in NOTEBOOKS


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_notebook_runs(path, tmp_path):
    try:
        run = run_notebook(path, tmp_path, timeout=300)
    except NotebookCellError as err:
        pytest.fail(str(err), pytrace=False)
    assert run.notebook == tmp_path / path.name
    assert run.notebook.is_file()
    if path.name == "01_quickstart.ipynb":
        assert run.figures, "the quickstart should plot at least one figure"
        for fig in run.figures:
            assert fig.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
            assert fig.name.startswith("01_quickstart_fig")


def test_failing_cell_is_reported(tmp_path):
    import nbformat
    from nbformat.v4 import new_code_cell, new_notebook

    nb = new_notebook(cells=[new_code_cell("x = 1"), new_code_cell("raise ValueError('boom ' + str(x))")])
    path = tmp_path / "broken.ipynb"
    nbformat.write(nb, path)
    with pytest.raises(NotebookCellError) as info:
        run_notebook(path, tmp_path / "out", timeout=60)
    assert info.value.cell_index == 1
    assert "boom 1" in str(info.value)
    assert (tmp_path / "out" / "broken.ipynb").is_file()   # the partial notebook is kept


def test_command_line(tmp_path, capsys):
    import nbformat
    from nbformat.v4 import new_code_cell, new_notebook

    from gradalg.notebook_runner import main

    nb = new_notebook(cells=[new_code_cell("print('hello')")])
    path = tmp_path / "tiny.ipynb"
    nbformat.write(nb, path)
    assert main([str(path), "--out", str(tmp_path / "out"), "--timeout", "60"]) == 0
    assert str(tmp_path / "out" / "tiny.ipynb") in capsys.readouterr().out

    bad = tmp_path / "bad.ipynb"
    nbformat.write(new_notebook(cells=[new_code_cell("1 / 0")]), bad)
    assert main([str(bad), "--out", str(tmp_path / "out")]) == 1
    assert "ZeroDivisionError" in capsys.readouterr().err


def test_kernel_is_shut_down(tmp_path):
    import nbformat
    from nbformat.v4 import new_code_cell, new_notebook

    path = tmp_path / "pid.ipynb"
    nbformat.write(new_notebook(cells=[new_code_cell("import os, sys; print(os.getpid(), sys.executable)")]), path)
    run = run_notebook(path, tmp_path / "out", timeout=60)
    out = nbformat.read(run.notebook, as_version=4).cells[0].outputs[0].text.split()
    pid, executable = int(out[0]), out[1]
    assert executable == sys.executable      # the kernel runs on this interpreter
    for _ in range(50):                      # the kernel manager waits for it; allow a moment
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        status = f"/proc/{pid}/status"
        if os.path.exists(status) and "zombie" in open(status).read().lower():
            return                           # exited, not yet reaped
        time.sleep(0.1)
    raise AssertionError(f"the kernel (pid {pid}) is still running after the notebook finished")
