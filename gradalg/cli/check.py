"""``gradalg check``: before a long run, check the config's model, task and data with
``ga.check_model``.

A few examples of ``[data.train]`` (``--data queries`` for the queries) are captured
alone and in batches (padded on each side the task accepts): their per-example
gradients must not depend on the batch, the loss must be a sum over examples, tied and
reused weights must be seen by capture, and the coverage of the layers is shown. Each
finding names its fix. Exit 0 when every check passes (warnings allowed), 7 when one
fails; `--json` prints the findings as JSON, `--html FILE` writes them as a page.
"""
from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

from .codes import CHECK_FAILED, OK
from .common import add_common, command_parser, load, options_for

__all__ = ["add_parser", "run"]

log = logging.getLogger("gradalg.cli")

EXAMPLE = """\
  # run.toml (with [model], [task], [data.train] and optionally layers)
  $ gradalg check -c run.toml                  # 8 examples of data.train; exit 7 if a check fails
  $ gradalg check -c run.toml --examples 4 --data queries --json
"""


def add_parser(sub):
    p = command_parser(sub, "check", help="check the model, task and data before a long run",
                       description=__doc__, example=EXAMPLE)
    add_common(p)
    p.add_argument("--data", choices=("train", "queries"), default="train",
                   help="the dataset whose first examples are checked (default train)")
    p.add_argument("--examples", type=int, default=8, metavar="N", help="examples to check (default 8, at least 2)")
    out = p.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", help="print the findings as JSON")
    out.add_argument("--html", metavar="FILE", default=None, help="write the findings as an HTML page")
    p.set_defaults(run=run)
    return p


def run(args) -> int:
    from .. import check_model
    from ..data import as_data
    from .errors import ConfigError
    from .explain import html_page
    from .session import Session

    cfg = load(args)
    cfg.require("model", f"data.{args.data}", command="check")
    if args.examples < 2:
        raise ConfigError(f"--examples must be at least 2 (one example alone and in a batch), got {args.examples}")
    session = Session(cfg)
    data, ids = session.data(args.data)
    if ids is not None:
        data = as_data(data, ids)
    with options_for(cfg, args):
        try:
            result = check_model(session.task, data, layers=session.layers, n_examples=args.examples)
        except KeyError as err:
            raise ConfigError(f"layers: {err.args[0] if err.args else err}") from None
    if args.json:
        json.dump(result.to_dict(), sys.stdout, indent=2, default=str)
        sys.stdout.write("\n")
    elif args.html:
        Path(args.html).write_text(html_page(result._repr_html_(), f"gradalg check ({cfg.source})"))
        log.info("findings written to %s", args.html)
    else:
        sys.stdout.write(str(result) + "\n")
    if not result.ok:
        log.error("%d check(s) failed: each finding above names its fix", len(result.failed))
        return CHECK_FAILED
    return OK
