"""Texts of the training examples: a list (by position), a dict (by id), a callable, a JSONL file.

    lookup = text_lookup(texts, ids, what="texts")   # ids: (n,) the examples' ids, in order
    lookup(ids[3])                                   # → str, or None when no text is known
    top = with_texts(S.topk(5), texts, ids=train_ids)  # a ``text`` coordinate (query, rank)
    documents_frame(top)                             # DataFrame: query, rank, train, score, text

A list (or any sequence: a ``datasets.Dataset`` column ``ds["text"]``, a positional
:func:`jsonl_texts`) must have one entry per example, in the order of ``ids`` (the order
of the data the scores were computed on); a dict (or a keyed :func:`jsonl_texts`) maps an
example's id to its text; a callable takes an id and returns the text (or None). A text may
also be a ``(prompt, completion)`` pair: the report shows the prompt and marks the completion.

The report shows "(no text given)" for an id without text; :func:`with_texts` refuses it
(:class:`~gradalg.errors.DataError`), since a result row without its document is a wrong row.
"""
from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np

from ..errors import DataError, OptionError

__all__ = ["text_lookup", "texts_for", "check_texts", "with_texts", "documents_frame", "jsonl_texts", "JsonlTexts",
           "KeyedJsonlTexts", "highlight", "HighlightedHTML"]


def _key(i):
    """An id as a hashable plain value (numpy scalars read as their Python value)."""
    return i.item() if hasattr(i, "item") else i


def text_lookup(texts, ids: Sequence, *, what: str) -> Callable[[object], object]:
    """A function id → text (``None``: no text known) for ``texts`` as a sequence (one per
    id, in order), a mapping {id: text} or a callable id → text; ``texts=None`` knows no text."""
    if texts is None:
        return lambda i: None
    if callable(texts) and not isinstance(texts, (Mapping, Sequence)):
        return lambda i: texts(_key(i))
    if isinstance(texts, Mapping):
        return lambda i: texts.get(_key(i))
    if isinstance(texts, (str, bytes)) or not isinstance(texts, Sequence):
        raise OptionError(f"{what}= takes a list of texts (one per example, in data order), a dict "
                          f"{{id: text}}, a function id -> text or ga.report.jsonl_texts(path, field=...); got "
                          f"{type(texts).__name__}")
    if len(texts) != len(ids):
        raise DataError(f"{what}= has {len(texts)} texts for {len(ids)} examples: give one per example in data "
                        f"order, or a dict {{id: text}} for some of them")
    position = {_key(i): p for p, i in enumerate(ids)}
    return lambda i: texts[position[_key(i)]] if _key(i) in position else None


def texts_for(texts, ids: Sequence, wanted, *, what: str = "texts") -> list:
    """The texts of the ids ``wanted`` (any iterable, in its order), every one required:
    an id without text (absent from a dict, None from a callable, not among ``ids`` for a
    list) raises :class:`DataError` naming it and the fix."""
    lookup = text_lookup(texts, ids, what=what)
    out, missing = [], []
    for i in wanted:
        t = lookup(i)
        if t is None:
            missing.append(_key(i))
        out.append(t)
    if missing:
        raise DataError(f"{what}= has no text for training example{'s' if len(missing) > 1 else ''} "
                        f"{missing[:5]}{' ...' if len(missing) > 5 else ''} ({len(missing)} of the "
                        f"{len(out)} shown): give a text for every training id (a list in data order, "
                        f"or a dict / function / JSONL keyed by the ids the scores carry)")
    return out


def check_texts(texts, ids: Sequence, *, what: str = "texts") -> None:
    """Refuse, before any pass, texts that cannot serve these training ``ids``: a sequence
    of another length, a mapping without some id (a callable is asked only for the ids a
    result shows: :func:`texts_for` refuses its missing ones then)."""
    text_lookup(texts, ids, what=what)          # the type and a sequence's length
    if isinstance(texts, Mapping):
        missing = [_key(i) for i in ids if _key(i) not in texts]
        if missing:
            raise DataError(f"{what}= has no text for {len(missing)} of the {len(ids)} training examples, e.g. "
                            f"{missing[:5]}: give a text for every training id (a dict keyed by the ids "
                            f"the data carries, or a list in data order)")


def with_texts(result, texts, *, ids: Sequence | None = None, what: str = "texts"):
    """``result`` (a top-k DataArray, dims ("query", "rank") with a ``train`` coordinate, or
    a score matrix with dim "train") with a ``text`` coordinate: the training document of
    each entry, aligned by training id. ``ids``: the training ids in data order, needed
    when ``texts`` is a list (positions); a dict, callable or keyed JSONL is looked up by id."""
    if "train" not in result.coords:
        raise OptionError("with_texts takes S.topk(k), an index's search(...) or S.compute(): a result with "
                          "a 'train' coordinate")
    train = result.coords["train"]
    if isinstance(texts, Sequence) and not isinstance(texts, (str, bytes)) and ids is None:
        # a result's own order is not the data's (a selection, a ranking): never guess it
        raise OptionError(f"{what}= as a list is by position in the training data: pass ids= (the training "
                          "ids in data order), or give a dict {id: text} / a function id -> text")
    values = np.asarray(train.values)
    flat = texts_for(texts, list(ids) if ids is not None else [], values.ravel().tolist(), what=what)
    text = np.empty(values.size, dtype=object)
    text[:] = flat
    return result.assign_coords(text=(train.dims, text.reshape(values.shape)))


def documents_frame(result):
    """A top-k result with texts (:func:`with_texts`) as a pandas DataFrame, one row per
    (query, rank): columns ``query``, ``rank``, ``train``, ``score`` and ``text`` (when the
    result has texts)."""
    import pandas as pd

    if tuple(result.dims) != ("query", "rank"):
        raise OptionError(f"documents_frame takes a top-k result, dims ('query', 'rank'); got {tuple(result.dims)}")
    nq, k = result.shape
    cols = {"query": np.repeat(np.asarray(result["query"].values), k), "rank": np.tile(np.arange(k), nq),
            "train": np.asarray(result["train"].values).ravel(), "score": np.asarray(result.values).ravel()}
    if "text" in result.coords:
        cols["text"] = np.asarray(result["text"].values).ravel()
    return pd.DataFrame(cols)


class JsonlTexts(Sequence):
    """The texts of a JSONL file, one object per line, line i = example i in data order;
    ``field`` names the text. Lines are read when asked for (byte offsets kept)."""

    def __init__(self, path, field: str = "text"):
        self.path, self.field = Path(path), field
        if not self.path.is_file():
            raise OptionError(f"no JSONL file at {self.path}: give the path of a file with one JSON object per line")
        self._offsets = []
        with self.path.open("rb") as f:
            pos = f.tell()
            for line in iter(f.readline, b""):
                if line.strip():
                    self._offsets.append(pos)
                pos = f.tell()

    def _record(self, offset: int) -> dict:
        with self.path.open("rb") as f:
            f.seek(offset)
            record = json.loads(f.readline())
        if not isinstance(record, dict) or self.field not in record:
            raise DataError(f"{self.path}: a line has no field {self.field!r}: name the text's field "
                            "(ga.report.jsonl_texts(path, field=...))")
        return record

    def __len__(self):
        return len(self._offsets)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        return self._record(self._offsets[i])[self.field]

    def __repr__(self):
        return f"jsonl_texts({str(self.path)!r}, field={self.field!r}): {len(self)} texts by position"


class KeyedJsonlTexts(Mapping):
    """The texts of a JSONL file keyed by each line's ``id_field`` (``field``: the text)."""

    def __init__(self, path, field: str = "text", id_field: str = "id"):
        self.lines = JsonlTexts(path, field)
        self.id_field = id_field
        self._where = {}
        with self.lines.path.open("rb") as f:          # one pass: each line's id and offset
            pos = f.tell()
            for line in iter(f.readline, b""):
                if line.strip():
                    record = json.loads(line)
                    if not isinstance(record, dict) or id_field not in record:
                        raise DataError(f"{self.lines.path}: a line has no id field {id_field!r}: name it "
                                        "(id_field=...) or leave id_field out to read the lines in data order")
                    self._where[_key(record[id_field])] = pos
                pos = f.tell()

    def __contains__(self, i):
        return _key(i) in self._where

    def __getitem__(self, i):
        return self.lines._record(self._where[_key(i)])[self.lines.field]

    def __iter__(self):
        return iter(self._where)

    def __len__(self):
        return len(self._where)

    def __repr__(self):
        return (f"jsonl_texts({str(self.lines.path)!r}, field={self.lines.field!r}, id_field={self.id_field!r}): "
                f"{len(self)} texts by id")


def jsonl_texts(path, field: str = "text", id_field: str | None = None):
    """The texts of a JSONL file (one JSON object per line): by position (line i = example
    i in data order) or, with ``id_field``, by each line's id. Read lazily, line by line."""
    return JsonlTexts(path, field) if id_field is None else KeyedJsonlTexts(path, field, id_field)


class HighlightedHTML(str):
    """HTML that a notebook displays as HTML (a ``str``: write it into a page as is)."""

    def _repr_html_(self):
        return str(self)


def highlight(tokens, scores) -> HighlightedHTML:
    """A document's tokens coloured by their per-token scores: red where a token helped the
    query (positive), blue where it hurt, strength ``|v| / max |v|``; NaN (padding) left
    white. ``tokens``: (T,) strings; ``scores``: (T,) e.g. one ``(query, train)`` row of
    ``(Q @ H @ G.per_token().T).compute()`` over ``train_token``. Returns HTML (escaped)."""
    from .page import tokens_html

    tokens = list(tokens)
    scores = np.asarray(getattr(scores, "values", scores), dtype=float)
    if scores.ndim != 1:
        raise OptionError(f"highlight takes one document's per-token scores, shape (T,); got shape {scores.shape}: "
                          "select one query and training example, e.g. T.sel(query=q, train=t)")
    return HighlightedHTML("<div style='white-space:pre-wrap;font-family:ui-monospace,monospace'>"
                           + tokens_html(tokens, scores) + "</div>")

