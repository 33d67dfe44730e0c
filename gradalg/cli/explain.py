"""``gradalg explain``: the plan of the config's computation, without running it.

No data are read: each dataset is a stand-in of ``data.<x>.n`` examples of
``data.<x>.seq_len`` tokens (set them in the config; an importable data function is
called, and should return a lazy Dataset). A transformers model is built on the meta
device (shapes only, no memory; a checkpoint's config.json is read, not its weights), a
factory model as usual; nothing is run on it. ``--what`` chooses the computation: ``score``
(the ``[method]``; default when there is one), ``build`` (the training gradients of
``gradalg build``) or ``query`` (queries against the built store: its metadata only).
Text on stdout (every stage: rewrites, decisions, passes with estimated FLOPs, time and
memory), ``--html FILE`` for a page, ``--json`` for the plan's data.
"""
from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

from .common import add_common, command_parser, load, options_for
from .errors import ConfigError

__all__ = ["add_parser", "run", "html_page"]

log = logging.getLogger("gradalg.cli")

EXAMPLE = """\
  # run.toml: the sizes explain plans for (nothing is opened)
  [data.train]
  path = "data/train.jsonl"
  n = 100000
  seq_len = 512
  [data.queries]
  path = "data/queries.jsonl"
  n = 100
  seq_len = 512

  $ gradalg explain -c run.toml                        # the [method]'s plan, as text
  $ gradalg explain -c run.toml --what build --html plan.html
  $ gradalg explain -c run.toml --device h100 --stage scale   # on other hardware, per GPU count
"""

STAGES = ("logical", "simplified", "costed", "physical", "scale")


def add_parser(sub):
    p = command_parser(sub, "explain", help="show the plan of the config's computation (no data read)",
                       description=__doc__, example=EXAMPLE)
    add_common(p)
    p.add_argument("--what", choices=("score", "build", "query"), default=None,
                   help="the computation to plan (default: score with a [method], else build)")
    p.add_argument("--stage", choices=STAGES, default=None, help="show one stage only")
    p.add_argument("--device", default=None, metavar="NAME",
                   help="plan for this device (h200, h100, a100) and add time and memory per GPU count")
    out = p.add_mutually_exclusive_group()
    out.add_argument("--html", metavar="FILE", default=None, help="write the plan as an HTML page")
    out.add_argument("--json", action="store_true", help="print the plan's data as JSON")
    p.set_defaults(run=run)
    return p


def html_page(body: str, title: str) -> str:
    """A whole HTML document around the plan's HTML (it carries its own style)."""
    import html

    return (f"<!doctype html>\n<html><head><meta charset='utf-8'><title>{html.escape(title)}</title></head>"
            f"<body>\n{body}\n</body></html>\n")


def expression(session, what: str):
    """The lazy object whose plan is shown."""
    cfg = session.cfg
    if what == "score":
        cfg.require("model", "data.train", "data.queries", "method", command="explain --what score")
        return session.method_scores()
    if what == "build":
        cfg.require("model", "data.train", command="explain --what build")
        return session.grads("train")
    cfg.require("model", "data.queries", "store", "query", command="explain --what query")
    path = cfg.resolve(cfg.store.path)
    if not Path(path).exists():
        raise ConfigError(f"store.path: no store at {path}: `explain --what query` reads the built store's "
                          "metadata; run `gradalg build` first, or explain the build (--what build)")
    from .query import check_store, open_store, other_models

    stored = open_store(path, cfg)
    Q = session.grads("queries")
    check_store(dict(stored.expr.store.attrs), Q, path, weights=not session.planning,
                other_checkpoint=cfg.query.other_checkpoint)
    with other_models(cfg.query.other_checkpoint):
        return session.query_scores(stored)


def run(args) -> int:
    from .session import Session

    cfg = load(args)
    what = args.what or ("score" if cfg.method is not None else "build")
    session = Session(cfg, planning=True)
    with options_for(cfg, args):
        obj = expression(session, what)
        # on a device planned for, the config's budget is explain's (ga.options' does not apply)
        budget = cfg.options.get("memory_budget") if args.device else None
        plan = obj.explain(stage=args.stage, device=args.device, memory_budget=budget)
        if args.html:
            Path(args.html).write_text(html_page(plan._repr_html_(), f"gradalg plan: {what} ({cfg.source})"))
            log.info("plan of %s written to %s", what, args.html)
        elif args.json:
            json.dump(plan.to_dict(), sys.stdout, indent=2, default=str)
            sys.stdout.write("\n")
        else:
            sys.stdout.write(str(plan) + "\n")
    return 0
