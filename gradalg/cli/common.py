"""What every command shares: the common flags, reading the config, ga.options."""
from __future__ import annotations

import argparse
import contextlib
import logging

__all__ = ["add_common", "command_parser", "load", "options_for"]

log = logging.getLogger("gradalg.cli")


def add_common(parser: argparse.ArgumentParser, *, config_required: bool = True) -> None:
    parser.add_argument("-c", "--config", required=config_required, metavar="FILE",
                        help="the config file (.toml, or .yaml / .yml)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config field, value read as TOML: --set store.chunk_rows=64 "
                             "(repeatable)")
    loud = parser.add_mutually_exclusive_group()
    loud.add_argument("-q", "--quiet", action="store_true", help="warnings and errors only, no progress")
    loud.add_argument("-v", "--verbose", action="store_true", help="debug messages, and tracebacks with errors")


def command_parser(sub, name: str, *, help: str, description: str, example: str, **kwargs):
    """A subcommand whose ``--help`` ends with an example."""
    return sub.add_parser(name, help=help, description=doc_description(description), epilog="example:\n" + example,
                          formatter_class=argparse.RawDescriptionHelpFormatter, **kwargs)


def doc_description(doc: str) -> str:
    """A module docstring as ``--help`` text: without its ``gradalg cmd``: prefix and
    with plain quotes."""
    text = doc.strip()
    if text.startswith("``gradalg"):
        text = text.split(": ", 1)[1]
    text = text.replace("``", "`")
    return text[0].upper() + text[1:]


def load(args):
    """The validated config of ``--config`` with the ``--set`` overrides."""
    try:
        from .config import load_config
    except ImportError as err:
        from ..errors import MissingLibraryError
        raise MissingLibraryError(f"the gradalg command line reads configs with pydantic ({err.name} is missing): "
                                  "pip install 'gradalg[cli]'") from err

    cfg = load_config(args.config, args.overrides)
    log.debug("config %s (sha256 %s)", cfg.source, cfg.text_digest)
    return cfg


@contextlib.contextmanager
def options_for(cfg, args, **defaults):
    """``ga.options`` of the config's ``[options]`` for the command (``--quiet``: no
    progress bars); ``defaults`` apply unless the config sets them. A refusal for memory
    inside names the budget's fix as this command takes it (``--set options.memory_budget=...``:
    :func:`gradalg.plan.budget.budget_setting`)."""
    from .. import options
    from ..plan.budget import budget_setting

    values = dict(defaults)
    values.update(cfg.options)
    if getattr(args, "quiet", False):
        values["progress"] = False
    with budget_setting("cli"), (options(**values) if values else contextlib.nullcontext()) as entered:
        yield entered
