"""``gradalg``: the command line (console script ``gradalg = gradalg.cli:main``).

    gradalg build   -c run.toml        # training gradients → a Zarr store (resumable)
    gradalg query   -c run.toml        # new queries against the store → zarr / csv / parquet
    gradalg query   -c run.toml -i     # a prompt loop: generation, top and bottom documents
    gradalg score   -c run.toml        # a method end to end (ga.methods.<name>)
    gradalg explain -c run.toml        # the plan, no data read
    gradalg inspect out/train.zarr     # what a store holds
    gradalg check   -c run.toml        # per-example gradients checked before a long run
    gradalg report  -c run.toml -o report.html   # a method's top / bottom documents as one HTML page

Every command takes ``--config`` (a TOML or YAML file, :mod:`gradalg.cli.config`),
``--set KEY=VALUE`` overrides, ``--quiet`` and ``--verbose``. Exit codes are in
:data:`EXIT_CODES` (docs/cli.md).
"""
from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading

from .codes import EXIT_CODES, exit_code

__all__ = ["main", "build_parser", "EXIT_CODES", "exit_code"]

COMMANDS = ("build", "query", "score", "explain", "inspect", "check", "report")

DESCRIPTION = """\
gradalg: training data attribution from the shell.

Each command reads one config file (TOML or YAML) naming the model, the data, the
layers, the projector and the method; `gradalg <command> --help` shows an example.
"""

EPILOG = """\
exit codes:
""" + "\n".join(f"  {code:<4}{text}" for code, text in EXIT_CODES.items()) + """

example:
  gradalg build -c examples/gpt2_tiny.toml && gradalg query -c examples/gpt2_tiny.toml
"""


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every command (imports no model library)."""
    from . import build, check, explain, inspect_store, query, report, score

    parser = argparse.ArgumentParser(prog="gradalg", description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    from ..version import __version__
    parser.add_argument("--version", action="version", version=f"gradalg {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    for module in (build, query, score, explain, inspect_store, check, report):
        module.add_parser(sub)
    return parser


def _configure_logging(args):
    """Send the ``gradalg`` logger's records to stderr for one command; return the function
    that restores the logger as it was (``main`` called in-process, from a notebook or a
    test, leaves no handler behind on a stream that may be closed later)."""
    level = logging.WARNING if getattr(args, "quiet", False) else \
        logging.DEBUG if getattr(args, "verbose", False) else logging.INFO
    log = logging.getLogger("gradalg")
    saved = (list(log.handlers), log.level, log.propagate)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    log.addHandler(handler)
    log.setLevel(level)
    log.propagate = False

    def restore():
        log.removeHandler(handler)
        log.handlers[:] = saved[0]
        log.setLevel(saved[1])
        log.propagate = saved[2]
    return restore


class Terminated(BaseException):
    """SIGTERM (a batch scheduler's time limit or preemption), raised in the main thread."""


def _terminate(signum, frame):
    raise Terminated()


def main(argv=None) -> int:
    """Run ``gradalg`` with ``argv`` (default ``sys.argv[1:]``); return the exit code.

    A :class:`~gradalg.GradalgError` (and a missing file or optional library) is printed
    as ``error: <message>`` without a traceback unless ``--verbose``; anything else is a
    bug and prints its traceback (exit 1).
    """
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as stop:   # --help, --version (0) or a usage error (2)
        return int(stop.code or 0)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    restore_logging = _configure_logging(args)
    log = logging.getLogger("gradalg.cli")
    in_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _terminate) if in_main else None
    try:
        return int(args.run(args) or 0)
    except (KeyboardInterrupt, Terminated) as err:
        what = "terminated (SIGTERM)" if isinstance(err, Terminated) else "interrupted"
        log.error("%s: a store being built resumes where it stopped: run the same command again", what)
        return 143 if isinstance(err, Terminated) else 130
    except BaseException as err:  # noqa: BLE001 - every error becomes an exit code
        code = exit_code(err)
        if code == 1 or args.verbose:
            log.error("", exc_info=err)
        log.error("error: %s", err if code != 1 else f"{type(err).__name__}: {err}")
        if code == 1:
            log.error("(this is unexpected: please report it with the traceback above)")
        elif not args.verbose:
            log.error("(run with --verbose for the traceback)")
        return code
    finally:
        restore_logging()
        if in_main:
            signal.signal(signal.SIGTERM, previous)
