"""Progress a person can read anywhere: plain lines (rows, rate, ETA) when stderr is not a
terminal, forms forced by ``ga.options(progress=...)`` / ``GRADALG_PROGRESS``, logging
through ``logging.getLogger("gradalg")``."""
from __future__ import annotations

import io
import logging

import pytest
import torch
from torch.utils.data import TensorDataset

import gradalg as ga
from gradalg.exec.progress import LineProgress, progress_bar, progress_mode
from gradalg.options import Options
from models import classification_data, mlp


class FakeStream(io.StringIO):
    """A text stream that says whether it is a terminal."""

    def __init__(self, tty: bool = False):
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def lines(stream) -> list[str]:
    return stream.getvalue().splitlines()


def test_lines_say_rows_rate_elapsed_and_eta():
    stream, clock = FakeStream(), Clock()
    bar = LineProgress(100, "capture Sequential", stream=stream, interval=10, clock=clock)
    clock.t += 4
    bar.update(10)                                   # 4 s < interval: nothing yet
    assert lines(stream) == []
    clock.t += 6
    bar.update(10)                                   # 20 rows in 10 s
    clock.t += 5
    bar.update(30)                                   # 5 s after the last line: nothing
    clock.t += 10
    bar.update(40)                                   # 90 rows in 25 s
    clock.t += 2
    bar.update(10)
    bar.close()
    bar.close()                                      # closing twice writes once
    assert lines(stream) == [
        "[gradalg] capture Sequential: 20/100 rows (20.0%), 2 rows/s, elapsed 10.0 s, ETA 40.0 s",
        "[gradalg] capture Sequential: 90/100 rows (90.0%), 3.6 rows/s, elapsed 25.0 s, ETA 2.8 s",
        "[gradalg] capture Sequential: done, 100 rows in 27.0 s (3.7 rows/s)",
    ]


def test_long_durations_and_an_interrupted_pass():
    stream, clock = FakeStream(), Clock()
    bar = LineProgress(1_000_000, "pass", stream=stream, interval=60, clock=clock)
    clock.t += 125
    bar.update(1000)                                 # 8 rows/s: 999,000 left ≈ 34.7 h
    clock.t += 3600
    bar.close()
    assert lines(stream) == [
        "[gradalg] pass: 1,000/1,000,000 rows (0.1%), 8 rows/s, elapsed 2 min 05 s, ETA 34 h 41 min",
        "[gradalg] pass: stopped, 1,000 rows in 1 h 02 min (0.268 rows/s)",
    ]


def test_a_pass_shorter_than_the_interval_writes_nothing():
    stream, clock = FakeStream(), Clock()
    bar = LineProgress(20, "pass", stream=stream, interval=30, clock=clock)
    for _ in range(4):
        clock.t += 1
        bar.update(5)
    bar.close()
    assert stream.getvalue() == ""


def test_the_form_follows_the_stream_and_the_option():
    assert progress_mode(True, FakeStream(tty=False)) == "lines"      # nohup, SLURM, a pipe
    assert progress_mode("auto", FakeStream(tty=True)) == "bar"       # a terminal
    assert progress_mode("lines", FakeStream(tty=True)) == "lines"    # forced
    assert progress_mode("bar", FakeStream(tty=False)) == "bar"
    assert progress_mode(False, FakeStream(tty=True)) == "off"
    assert progress_mode("off", FakeStream(tty=True)) == "off"
    assert progress_mode(True, object()) == "lines"                   # no isatty: not a terminal


def test_progress_bar_writes_lines_to_a_non_terminal(monkeypatch):
    stream = FakeStream()
    with progress_bar(True, 30, "capture MLP", interval=0, stream=stream) as bar:
        for _ in range(3):
            bar.update(10)
    out = lines(stream)
    assert [line.split(":")[0] for line in out] == ["[gradalg] capture MLP"] * 3
    assert out[0].startswith("[gradalg] capture MLP: 10/30 rows (33.3%), ") and "ETA" in out[0]
    assert out[-1].startswith("[gradalg] capture MLP: done, 30 rows in ")
    silent = FakeStream()
    with progress_bar(False, 30, "capture MLP", interval=0, stream=silent) as bar:
        bar.update(30)
    assert silent.getvalue() == ""
    tty = FakeStream(tty=True)
    with progress_bar("auto", 30, "capture MLP", interval=0, stream=tty) as bar:
        bar.update(30)
    assert "[gradalg]" not in tty.getvalue() and "| 0/30 [" in tty.getvalue()   # a tqdm bar, not lines


def test_options_and_environment(monkeypatch):
    with ga.options(progress="lines", progress_interval=5):
        assert ga.get_options().progress == "lines" and ga.get_options().progress_interval == 5
    with ga.options(progress="off"):
        assert ga.get_options().progress is False
    for bad in ("yes", 1, None):
        with pytest.raises(ga.OptionError, match="progress"):
            ga.options(progress=bad)
    for bad in (-1, "10", float("inf"), True):
        with pytest.raises(ga.OptionError, match="progress_interval"):
            ga.options(progress_interval=bad)
    for value, expected in (("0", False), ("off", False), ("1", True), ("auto", "auto"), ("lines", "lines"),
                            ("BAR", "bar")):
        monkeypatch.setenv("GRADALG_PROGRESS", value)
        assert Options().progress == expected, value
    monkeypatch.setenv("GRADALG_PROGRESS", "loud")
    with pytest.warns(UserWarning, match="GRADALG_PROGRESS='loud'"):
        assert Options().progress is True
    monkeypatch.setenv("GRADALG_PROGRESS", "1")
    monkeypatch.setenv("GRADALG_PROGRESS_INTERVAL", "7.5")
    assert Options().progress_interval == 7.5
    monkeypatch.setenv("GRADALG_PROGRESS_INTERVAL", "often")
    with pytest.warns(UserWarning, match="GRADALG_PROGRESS_INTERVAL"):
        assert Options().progress_interval == 30.0


def test_a_computation_reports_its_passes_and_logs_them(monkeypatch, caplog):
    task = ga.tasks.classification(mlp())
    x, y = classification_data(20, seed=1)
    xq, yq = classification_data(3, seed=2)
    S = ga.grads(task, TensorDataset(xq, yq)) @ ga.grads(task, TensorDataset(x, y)).T
    with ga.options(progress=False, batch_size=8):
        quiet = S.compute()
    stream = FakeStream()
    monkeypatch.setattr("sys.stderr", stream)
    with caplog.at_level(logging.INFO, logger="gradalg"):
        with ga.options(progress="lines", progress_interval=0, batch_size=8):
            shown = S.compute()
    torch.testing.assert_close(torch.as_tensor(shown.values), torch.as_tensor(quiet.values), rtol=0, atol=0)
    out = lines(stream)
    assert out and all(line.startswith("[gradalg] ") for line in out)
    assert any("/20 rows" in line and "ETA" in line for line in out)       # the training pass, batch by batch
    assert any(": done, 20 rows in " in line for line in out)
    messages = [r.getMessage() for r in caplog.records if r.name == "gradalg.exec.progress"]
    assert any(m.startswith("pass started: ") and m.endswith(", 20 rows") for m in messages)
    assert any(m.startswith("pass finished: ") for m in messages)


def test_the_library_logger_prints_nothing_unless_configured():
    logger = logging.getLogger("gradalg")
    assert any(isinstance(h, logging.NullHandler) for h in logger.handlers)
    assert logging.getLogger("gradalg.exec.progress").parent.name in ("gradalg.exec", "gradalg")
