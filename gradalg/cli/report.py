"""``gradalg report``: a method's scores as one self-contained HTML page (no network).

Runs ``[method]`` on the queries and the training set of the config as a streaming
top-k (``ga.methods.<name>(...).to_html``) and writes, per query, its text and the top
and bottom ``--k`` training documents with their scores and texts, plus the method's
formula, its fidelity note (docs/fidelity.md) and the plan. The texts come from the
data's ``text`` column when the config tokenizes one, or from ``--texts`` /
``--query-texts``: a .jsonl file with a ``text`` field per line, or a .txt file with one
text per line, in data order.
"""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from .common import add_common, command_parser, load, options_for
from .errors import ConfigError, OutputExistsError

__all__ = ["add_parser", "run", "read_texts"]

log = logging.getLogger("gradalg.cli")

EXAMPLE = """\
  # run.toml (the [model], [data.train], [data.queries] and [method] of `gradalg score`)
  [data.train]
  path = "data/train.jsonl"
  text = "text"                          # the documents shown are this column
  tokenizer = "tokenizer/"

  $ gradalg report -c run.toml -o out/report.html --k 5
  $ gradalg report -c run.toml -o out/report.html --texts data/train_texts.jsonl
"""


def add_parser(sub):
    p = command_parser(sub, "report", help="write a self-contained HTML report of a method's scores",
                       description=__doc__, example=EXAMPLE)
    add_common(p)
    p.add_argument("-o", "--output", required=True, metavar="FILE", help="the HTML file to write")
    p.add_argument("--k", type=int, default=5, help="top and bottom training documents per query (default 5)")
    p.add_argument("--texts", metavar="FILE", help="the training texts (.jsonl with a 'text' field, or .txt: "
                   "one per line), in data order; default: [data.train].text")
    p.add_argument("--query-texts", metavar="FILE", help="the queries' texts, as --texts; default: "
                   "[data.queries].text")
    p.add_argument("--no-math", action="store_true", help="write the formula as TeX instead of inlining KaTeX "
                   "(0.6 MB smaller)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output")
    p.set_defaults(run=run)
    return p


def read_texts(path: str | Path, where: str) -> list[str]:
    """Texts in data order from ``path``: .jsonl (a ``text`` field per line) or .txt (one
    per line)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{where} {path}: no such file; give a .jsonl file with a 'text' field per line or a "
                          ".txt file with one text per line")
    lines = path.read_text(encoding="utf-8").splitlines()
    if path.suffix in (".jsonl", ".json", ".ndjson"):
        texts = []
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                texts.append(json.loads(line)["text"])
            except (ValueError, KeyError, TypeError):
                raise ConfigError(f"{where} {path} line {n}: not a JSON object with a 'text' field") from None
        return texts
    return lines


def _config_texts(cfg, which: str):
    """The ``text`` column of ``[data.<which>]`` in data order (None when the config has none)."""
    from . import loaders

    section = getattr(cfg.data, which)
    if section is None or section.text is None or section.path is None:
        return None
    records = loaders._records(section, Path(cfg.resolve(section.path)), f"data.{which}")
    if section.limit is not None:
        records = records.select(range(min(section.limit, len(records)))) if hasattr(records, "select") \
            else records[:section.limit]
    return [rec[section.text] for rec in records]


def run(args) -> int:
    from .session import Session

    cfg = load(args)
    cfg.require("model", "data.train", "data.queries", "method", command="report")
    out = Path(args.output)
    if out.exists() and not args.overwrite:
        raise OutputExistsError(f"{out} exists: pass --overwrite to replace it, or choose another --output")
    texts = read_texts(args.texts, "--texts") if args.texts else _config_texts(cfg, "train")
    queries = read_texts(args.query_texts, "--query-texts") if args.query_texts else _config_texts(cfg, "queries")
    session = Session(cfg)
    with options_for(cfg, args):
        S = session.method_scores()
        start = time.monotonic()
        with session.executor() as executor:
            S.to_html(out, texts=texts, queries=queries, k=args.k, method=cfg.method.name,
                      math=not args.no_math, executor=executor)
    log.info("%s: report of %d queries × %d training examples → %s in %.1f s", cfg.method.name, S.shape[0],
             S.shape[1], out, time.monotonic() - start)
    return 0
