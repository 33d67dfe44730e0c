"""Texts of the examples a report shows: a list (by position), a dict (by id) or a callable.

    lookup = text_lookup(texts, ids, what="texts")   # ids: (n,) the examples' ids, in order
    lookup(ids[3])                                   # → str, or None when no text is known

A list must have one entry per example, in the order of ``ids`` (the order of the data
the scores were computed on); a dict maps an example's id to its text (missing ids show
no text); a callable takes an id and returns the text (or None). A text may also be a
``(prompt, completion)`` pair: the report shows the prompt and marks the completion.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from ..errors import DataError, OptionError

__all__ = ["text_lookup"]


def _key(i):
    """An id as a hashable plain value (numpy scalars read as their Python value)."""
    return i.item() if hasattr(i, "item") else i


def text_lookup(texts, ids: Sequence, *, what: str) -> Callable[[object], object]:
    """A function id → text (``None``: no text known) for ``texts`` as a list (one per id,
    in order), a dict {id: text} or a callable id → text; ``texts=None`` knows no text."""
    if texts is None:
        return lambda i: None
    if callable(texts) and not isinstance(texts, (Mapping, Sequence)):
        return lambda i: texts(_key(i))
    if isinstance(texts, Mapping):
        return lambda i: texts.get(_key(i))
    if isinstance(texts, (str, bytes)) or not isinstance(texts, Sequence):
        raise OptionError(f"{what}= takes a list of texts (one per example, in data order), a dict "
                          f"{{id: text}} or a function id -> text; got {type(texts).__name__}")
    if len(texts) != len(ids):
        raise DataError(f"{what}= has {len(texts)} texts for {len(ids)} examples: give one per example in data "
                        f"order, or a dict {{id: text}} for some of them")
    position = {_key(i): p for p, i in enumerate(ids)}
    return lambda i: texts[position[_key(i)]] if _key(i) in position else None
