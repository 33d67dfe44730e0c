"""The training texts recorded with a gradient store: ``<store>.texts.jsonl`` beside it.

    ga.store.write(P(G), "train.zarr", texts=train_texts)   # a list in data order, dict, callable, JSONL
    ga.store.texts("train.zarr")                            # {id: text} (None: none recorded)
    ga.store.index("train.zarr").search(P(Q), k=5)          # a ``text`` coordinate, from the store

One JSON object per line, in the store's row order: ``{"id": <example id>, "text": <str>}``
(a ``(prompt, completion)`` pair is stored as a two-element list and read back as a tuple).
Every row needs its text: a missing one is refused when writing (DataError), so a result
read with the store's texts never shows a row without its document. The file is written to
a temporary sibling and renamed into place; rewriting the store (``overwrite=True``) without
``texts=`` removes it. It lies beside the store, not in it (Zarr warns of foreign files in a
store's directory): move or copy the two together.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from ..report.texts import texts_for

__all__ = ["write_texts", "texts", "texts_path", "remove_texts"]


def texts_path(path) -> Path:
    """Where the texts of the store at ``path`` are recorded: ``<store>.texts.jsonl``."""
    path = Path(path)
    return path.with_name(f"{path.name}.texts.jsonl")


def remove_texts(path) -> None:
    """Forget the texts recorded with the store at ``path`` (a store rewritten without them)."""
    texts_path(path).unlink(missing_ok=True)


def _plain(i):
    return i.item() if hasattr(i, "item") else i


def write_texts(path, ids, texts) -> Path:
    """Write the text of each of ``ids`` (the store's example ids, in row order) to
    ``<store>.texts.jsonl``; ``texts`` as for :func:`gradalg.report.with_texts`."""
    ids = [_plain(i) for i in ids]
    values = texts_for(texts, ids, ids, what="texts")
    target = texts_path(path)
    tmp = target.with_name(f".{target.name}.partial")
    with tmp.open("w", encoding="utf-8") as f:
        for i, t in zip(ids, values):
            if not isinstance(t, (str, tuple)):
                t = str(t)
            f.write(json.dumps({"id": i, "text": list(t) if isinstance(t, tuple) else t}, ensure_ascii=False))
            f.write("\n")
    os.replace(tmp, target)
    return target


def texts(path) -> dict | None:
    """The texts recorded with the store at ``path``: {id: text}, or None when none were."""
    target = texts_path(path)
    if not target.is_file():
        return None
    out = {}
    with target.open(encoding="utf-8") as f:
        for line in f:
            if line.strip():
                r = json.loads(line)
                out[r["id"]] = tuple(r["text"]) if isinstance(r["text"], list) else r["text"]
    return out
