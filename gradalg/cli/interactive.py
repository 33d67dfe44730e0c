"""``gradalg query --interactive``: a prompt loop over a built store.

Each line read from stdin (a terminal or a pipe: ``printf 'prompt\\n:save s.csv\\n' |
gradalg query -c run.toml -i``) is a prompt or a command:

==================  ===========================================================================
a prompt            generate its completion (greedy, ``--max-new-tokens``), score it against
                    the store (``[query].similarity``), print the top and bottom k documents
``:k N``            list N documents at each end from now on
``:save FILE``      write every answer of the session to FILE (``.csv`` or ``.parquet``: one
                    row per document: query, prompt, completion, side, rank, train, score, text)
``:help``           the commands
``:quit``, ``:q``   end (so does the end of the input)
==================  ===========================================================================

The computation is :class:`gradalg.widgets.QuerySession`'s (the notebook's ``QueryBox``
is the same), with the config's model, task, layers and projector, and the store's texts
(``ga.store.texts``; else ``--texts``, else ``[data.train].text``). A line that fails
(an empty completion, a bad command, an existing file) prints ``error: …`` and the loop
goes on; the exit status is then that failure's code (the first one), 0 when every line
succeeded.
"""
from __future__ import annotations

import logging
import sys
from pathlib import Path

from .common import load, options_for
from ..errors import MissingLibraryError
from .errors import ConfigError, OutputExistsError

__all__ = ["run_interactive", "loop", "HELP"]

log = logging.getLogger("gradalg.cli")

HELP = """\
type a prompt, or a command:
  :k N          documents listed at each end (now {k})
  :save FILE    save the session's answers (.csv or .parquet)
  :help         this text
  :quit         end (or end of input)"""


def _tokenizer(cfg, args):
    """The local tokenizer of ``--tokenizer``, else of ``[data.train]`` / ``[data.queries]``."""
    where, path = "--tokenizer", args.tokenizer
    if path is None:
        for which in ("train", "queries"):
            section = getattr(cfg.data, which)
            if section is not None and section.tokenizer is not None:
                where, path = f"data.{which}.tokenizer", cfg.resolve(section.tokenizer)
                break
    if path is None:
        raise ConfigError("gradalg query --interactive needs the model's tokenizer: pass --tokenizer DIR (a local "
                          "folder saved with save_pretrained), or set [data.train].tokenizer")
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise MissingLibraryError("gradalg query --interactive tokenizes with transformers: "
                                  "pip install 'gradalg[hf]'") from None
    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as err:
        raise ConfigError(f"{where} = {path}: cannot load a tokenizer ({err})") from None


def _texts(cfg, args, path):
    """The training texts: recorded with the store, else ``--texts``, else ``[data.train].text``."""
    import gradalg as ga
    from .report import _config_texts, read_texts

    if args.texts:
        return read_texts(args.texts, "--texts")
    texts = ga.store.texts(path)
    if texts is None:
        texts = _config_texts(cfg, "train")
    if texts is None:
        raise ConfigError(f"the store {path} has no texts recorded (gradalg build records them when [data.train] "
                          "has a text column) and [data.train] has no text column: pass --texts FILE (.jsonl with "
                          "a 'text' field, or .txt, in store order)")
    return texts


def loop(qs, lines, out, *, overwrite: bool = False, interactive: bool = False) -> int:
    """Answer each of ``lines`` with ``qs`` (a QuerySession), writing to ``out``; the exit
    status: 0, or the code of the first line that failed."""
    from ..errors import GradalgError
    from .codes import USAGE, exit_code

    status = 0

    def fail(err, code):
        nonlocal status
        print(f"error: {err}", file=out, flush=True)
        status = status or code

    if interactive:
        print(HELP.format(k=qs.k), file=out, flush=True)
    for raw in lines:
        line = raw.strip()
        if not line:
            continue
        if line.startswith(":"):
            command, _, rest = line.partition(" ")
            rest = rest.strip()
            if command in (":quit", ":q", ":exit"):
                break
            if command == ":help":
                print(HELP.format(k=qs.k), file=out, flush=True)
            elif command == ":k":
                try:
                    qs.k = int(rest)
                except (ValueError, GradalgError):
                    fail(f":k takes a positive integer, got {rest!r}", USAGE)
                else:
                    print(f"k = {qs.k}", file=out, flush=True)
            elif command == ":save":
                if not rest:
                    fail(":save takes a file name: :save out.csv (or .parquet)", USAGE)
                    continue
                target = Path(rest).expanduser()
                try:
                    if target.exists() and not overwrite:
                        raise OutputExistsError(f"{target} exists: :save another file, or run with --overwrite")
                    qs.save(target)
                except GradalgError as err:
                    fail(err, exit_code(err))
                else:
                    print(f"saved {len(qs.answers)} answer(s) to {target}", file=out, flush=True)
            else:
                fail(f"unknown command {command}; the commands are :k, :save, :help, :quit", USAGE)
            continue
        try:
            answer = qs.ask(line)
        except GradalgError as err:
            fail(err, exit_code(err))
        else:
            print(answer, file=out, flush=True)
    return status


def run_interactive(args) -> int:
    """``gradalg query --interactive``: see the module docstring."""
    from ..widgets.query_session import QuerySession
    from .query import open_store
    from .session import Session

    cfg = load(args)
    cfg.require("model", "store", command="query --interactive")
    if args.k is not None and args.k < 1:
        raise ConfigError(f"--k must be a positive integer, got {args.k}")
    if args.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens must be a positive integer, got {args.max_new_tokens}")
    path = cfg.resolve(cfg.store.path)
    q = cfg.query
    k = args.k or (q.top_k if q is not None and q.top_k else 5)
    session = Session(cfg)
    with options_for(cfg, args, progress=False):
        open_store(path, cfg)                     # the shell's fixes for a missing or unfinished store
        tokenizer = _tokenizer(cfg, args)
        texts = _texts(cfg, args, path)
        other = bool(q and q.other_checkpoint)
        if not other:
            _check_checkpoint(session.model, path)
        qs = QuerySession(path, session.model, tokenizer, texts=texts, task=session.task, k=k,
                          max_new_tokens=args.max_new_tokens, similarity=q.similarity if q else "dot",
                          damping=q.damping if q else 1e-3, other_checkpoint=other,
                          projector=session.projector, layers=session.layers)
        tty = sys.stdin.isatty()
        log.info("%s: %d training documents; type a prompt (:help for the commands)", path, qs.stored.n)
        passes = logging.getLogger("gradalg.exec.progress")   # a pass per prompt: its lines only with -v
        level = passes.level
        if not args.verbose:
            passes.setLevel(logging.WARNING)
        try:
            return loop(qs, _lines(tty), sys.stdout, overwrite=args.overwrite, interactive=tty)
        finally:
            passes.setLevel(level)


def _check_checkpoint(model, path) -> None:
    """Refuse (exit 3) a config model whose weights are not the store's, before any prompt."""
    import gradalg as ga
    from ..errors import StoreMismatchError
    from ..store import layout

    stored = (layout.read_attrs(path) or {}).get("model_fingerprint") or []
    ours = ga.store.model_fingerprint(model)
    if stored and ours not in stored:
        raise StoreMismatchError(
            [f"model_fingerprint: the store was built from {', '.join(stored)}, the config's model is {ours}"],
            f"point [model] at the checkpoint {path} was built from, rebuild the store from this model (gradalg "
            "build --overwrite), or set query.other_checkpoint = true to score this model's query gradients "
            "against the stored ones (their meaning: docs/cli.md, 'Another checkpoint')")


def _lines(tty: bool):
    """stdin's lines; at a terminal, with a ``query> `` prompt (readline editing when available)."""
    if not tty:
        yield from sys.stdin
        return
    try:
        import readline  # noqa: F401 - line editing and history for input()
    except ImportError:
        pass
    while True:
        try:
            yield input("query> ")
        except EOFError:
            print()
            return
