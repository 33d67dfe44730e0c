"""Progress bars for passes over data (``ga.options(progress=...)``).

``tqdm.auto`` picks a notebook widget in Jupyter and a text bar elsewhere; with
``disable=None`` it stays silent when output is not a terminal (CI logs, pipes).
"""
from __future__ import annotations

import contextlib


class _Silent:
    def update(self, n: int = 1) -> None:
        pass


@contextlib.contextmanager
def progress_bar(enabled: bool, total: int, description: str):
    if not enabled:
        yield _Silent()
        return
    try:
        from tqdm.auto import tqdm
    except ImportError:  # tqdm is optional: no bar, same results
        yield _Silent()
        return
    bar = tqdm(total=total, desc=description[:40], unit="ex", disable=None, leave=False)
    try:
        yield bar
    finally:
        bar.close()


def in_notebook() -> bool:
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and type(shell).__name__ == "ZMQInteractiveShell"
