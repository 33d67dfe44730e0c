"""Typed prompts against a built gradient store: the model's generation and the training
documents that score highest and lowest for it.

    qs = ga.widgets.QuerySession("train.zarr", model, tokenizer, k=5)
    answer = qs.ask("The capital of France is")   # generates, scores, ranks
    answer.completion, answer.top, answer.bottom    # str, DataFrames (rank, train, score, text)
    qs.save("session.csv")                           # every answer so far, one row per document

What one ``ask`` computes. The prompt p is completed greedily by the model
(:func:`gradalg.tasks.queries_from_prompts`, ``max_new_tokens``), giving the query item
x = (p, c) whose loss counts only the completion's tokens,
L(x) = Σ_j −log p_θ'(c_j | p, c_<j). Its gradient is taken like the stored rows were:
the store's layers, objective and backend, then the store's projector P (read back from
the store's metadata), so that for the stored rows P g_θ(z_i), i = 1…n,

* ``similarity="dot"``:       s_i = ⟨P g_θ'(x), P g_θ(z_i)⟩
* ``similarity="cos"``:       s_i = the same of the two rows normalized to unit length
* ``similarity="influence"``: s_i = P g_θ'(x)ᵀ (F + λI)⁻¹ P g_θ(z_i), F the Fisher of the stored rows

and the answer lists the ``k`` highest and the ``k`` lowest s_i (ties: the training
example that comes first in the store ranks first, as ``S.topk``) with each document's text.

**Another checkpoint than the store's.** θ' is ``model``'s weights, θ those the store was
built from (its recorded ``model_fingerprint``). By default θ' must equal θ: a store
built from another model is refused (:class:`~gradalg.errors.StoreMismatchError`), the
fix named. ``other_checkpoint=True`` allows θ' ≠ θ (same architecture, layers and
projector: still checked) and then s_i has this meaning, and no other: the first-order
change of the query's loss *at θ'* from a gradient step on z_i *taken at θ*,
−η⟨g_θ'(x), g_θ(z_i)⟩ up to the step size, the mixed-checkpoint inner product Bergson's
``query --model`` computes. It is the exact influence at neither checkpoint; it is close
to the one at θ when θ' is near θ (a later checkpoint of the same run, a light
fine-tune), and it is the single-checkpoint term of TracIn when θ' = θ. Each answer
records both fingerprints (``answer.query_model``, ``answer.store_model``).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import DataError, OptionError, StoreMismatchError

__all__ = ["QuerySession", "Answer", "SIMILARITIES", "answers_frame", "format_answer"]

SIMILARITIES = ("dot", "cos", "influence")
COLUMNS = ["query", "prompt", "completion", "side", "rank", "train", "score", "text"]


@dataclass
class Answer:
    """One prompt's result: the generation and its top and bottom ``k`` training documents.

    ``top`` / ``bottom``: DataFrames of ``rank`` (0 = the highest score, resp. the
    lowest), ``train`` (the stored example's id), ``score`` and ``text``.
    """

    query: str
    prompt: str
    completion: str
    k: int
    top: object            # pandas.DataFrame (k rows)
    bottom: object         # pandas.DataFrame (k rows)
    similarity: str
    query_model: str       # model_fingerprint of the model that generated and was differentiated (θ')
    store_model: str       # model_fingerprint the store recorded (θ)
    item: dict = field(repr=False, default_factory=dict)   # the query item (input_ids, labels, ...)

    @property
    def other_checkpoint(self) -> bool:
        """Whether the query's model differs from the store's (mixed-checkpoint scores)."""
        return self.query_model != self.store_model

    def frame(self):
        """Both lists as one long table: :data:`COLUMNS`, ``side`` "top" or "bottom"."""
        import pandas as pd

        parts = []
        for side, table in (("top", self.top), ("bottom", self.bottom)):
            t = table.copy()
            t.insert(0, "side", side)
            t.insert(0, "completion", self.completion)
            t.insert(0, "prompt", self.prompt)
            t.insert(0, "query", self.query)
            parts.append(t)
        return pd.concat(parts, ignore_index=True)[COLUMNS]

    def __str__(self) -> str:
        return format_answer(self)

    def _repr_html_(self) -> str:
        import html

        def rows(table):
            return "".join(f"<tr><td>{r.rank}</td><td>{html.escape(str(r.train))}</td><td>{r.score:+.4g}</td>"
                           f"<td style='text-align:left'>{html.escape(_one_line(r.text, 400))}</td></tr>"
                           for r in table.itertuples())

        head = "<tr><th>rank</th><th>train</th><th>score</th><th style='text-align:left'>text</th></tr>"
        note = (" <em>(query at another checkpoint than the store's)</em>" if self.other_checkpoint else "")
        return (f"<div class='gradalg-answer'><p><b>{html.escape(self.prompt)}</b>"
                f"<span style='background:#fff3c4'>{html.escape(self.completion)}</span>{note}</p>"
                f"<p>top {self.k} ({self.similarity})</p><table>{head}{rows(self.top)}</table>"
                f"<p>bottom {self.k}</p><table>{head}{rows(self.bottom)}</table></div>")


def _one_line(text, width: int) -> str:
    s = "" if text is None else (" ".join(text) if isinstance(text, tuple) else str(text))
    s = " ".join(s.split())
    return s if len(s) <= width else s[:width - 1] + "…"


def format_answer(answer: Answer, width: int = 100) -> str:
    """The answer as plain text (what ``gradalg query --interactive`` prints): the
    generation, then the top and bottom documents, each on one line cut at ``width``
    characters."""
    lines = [f"[{answer.query}] {answer.prompt!r} → {answer.completion!r}"]
    if answer.other_checkpoint:
        lines.append(f"  (query at {answer.query_model}, store built at {answer.store_model}: mixed-checkpoint "
                     "scores)")
    for title, table in ((f"top {answer.k} (highest {answer.similarity} scores)", answer.top),
                         (f"bottom {answer.k} (lowest)", answer.bottom)):
        lines.append(f"  {title}:")
        for r in table.itertuples():
            lines.append(f"  {r.rank:>4}  {r.score:+.6g}  train {r.train}  {_one_line(r.text, width)}")
    return "\n".join(lines)


def answers_frame(answers) -> object:
    """Every answer's :meth:`Answer.frame`, stacked (an empty table of :data:`COLUMNS` if none)."""
    import pandas as pd

    frames = [a.frame() for a in answers]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=COLUMNS)


def _one(attrs: dict, key: str, path):
    values = attrs.get(key) or []
    if len(values) != 1:
        raise OptionError(f"the store at {path} records {len(values)} values of {key!r} ({values}); a prompt is "
                          "queried against a store of one gradient source (one model, layers, projector)")
    return values[0]


class QuerySession:
    """Prompts queried one at a time against the gradient store at ``store``.

    Parameters
    ----------
    store : path of a finished store written by ``ga.store.write`` / ``gradalg build``.
    model : a Hugging Face causal LM (``generate``); its weights are θ' (module docstring).
    tokenizer : the model's tokenizer.
    texts : the training documents (list in store order, dict {id: text}, callable); default
        those recorded with the store (``ga.store.texts(store)``). Refused when neither.
    task : the query's task (default ``ga.tasks.causal_lm(model)``): the loss the store's rows
        were taken of.
    k : documents listed at each end (``session.k = 20`` changes it).
    max_new_tokens : the longest generated completion (greedy).
    similarity, damping : "dot", "cos" or "influence" with damping λ (module docstring).
    other_checkpoint : allow a model whose weights differ from the store's (module docstring).
    projector, layers : default those the store recorded; given (the ``gradalg`` config's),
        they are checked against the store like every query is.
    executor : as ``S.compute``.
    """

    def __init__(self, store, model, tokenizer, *, texts=None, task=None, k: int = 5, max_new_tokens: int = 32,
                 similarity: str = "dot", damping: float = 1e-3, other_checkpoint: bool = False, projector=None,
                 layers=None, executor=None):
        from ..expr import Projector
        from ..store import open_gradients, texts as stored_texts
        from ..tasks import causal_lm

        self.path = Path(store)
        if not self.path.exists():
            raise DataError(f"no store at {self.path}: build it first (ga.store.write(P(G), path) or `gradalg build`)")
        self.stored = open_gradients(self.path)
        self.attrs = dict(self.stored.expr.store.attrs)
        if similarity not in SIMILARITIES:
            raise OptionError(f"similarity must be one of {list(SIMILARITIES)}, got {similarity!r}")
        if not isinstance(other_checkpoint, bool):
            raise OptionError(f"other_checkpoint must be True or False, got {other_checkpoint!r}")
        self.model, self.tokenizer = model, tokenizer
        self.task = task if task is not None else causal_lm(model)
        self.k = k
        self.max_new_tokens = max_new_tokens
        self.similarity, self.damping = similarity, damping
        self.other_checkpoint = other_checkpoint
        self.executor = executor
        self.layers = list(_one(self.attrs, "layers", self.path)) if layers is None else layers
        self.objective = _one(self.attrs, "objective", self.path)
        self.backend = _one(self.attrs, "backend", self.path)
        self.store_model = _one(self.attrs, "model_fingerprint", self.path)
        projectors = self.attrs.get("projector") or []
        self.projector = projector if projector is not None else \
            Projector(**_one(self.attrs, "projector", self.path)) if projectors else None
        ids = list(self.stored.ids)
        if texts is None:
            texts = stored_texts(self.path)
            if texts is None:
                raise DataError(f"the store at {self.path} has no texts recorded and texts= was not given: pass "
                                "texts= (a list in store order, a dict {id: text}), or write the store with "
                                "ga.store.write(..., texts=...) (gradalg build records [data.train].text)")
        from ..report.texts import check_texts, text_lookup
        check_texts(texts, ids)
        self._text = text_lookup(texts, ids, what="texts")
        self.answers: list[Answer] = []

    @property
    def k(self) -> int:
        """Documents listed at each end of the next answers (a positive int; OptionError otherwise)."""
        return self._k

    @k.setter
    def k(self, value) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise OptionError(f"k must be a positive integer (documents listed at each end), got {value!r}")
        self._k = int(value)

    # ------------------------------------------------------------------ one prompt
    def item(self, prompt: str, completion: str | None = None) -> dict:
        """The query item of ``prompt`` (its completion generated unless given)."""
        from ..tasks.prompts import queries_from_prompts

        return queries_from_prompts(self.task, [prompt], None if completion is None else [completion],
                                    tokenizer=self.tokenizer, max_new_tokens=self.max_new_tokens)[0]

    def grads(self, items, ids=None):
        """``P(ga.grads(task, items))`` taken like the stored rows (layers, objective, backend,
        projector), checked against the store's metadata (StoreMismatchError, the fix named)."""
        from ..api import grads
        from ..store import layout
        from ..store.gradients import describe_gradients

        Q = grads(self.task, items, self.layers, ids=ids, backend=self.backend, objective=self.objective)
        if self.projector is not None:
            Q = self.projector(Q)
        expected = describe_gradients(Q)
        keys = ("projector", "layers", "objective", "backend", "blocks")
        layout.compare(self.attrs, expected, keys, "the query", f"query {self.path} with the model it was built "
                       "from (same layers), or build a store from this model")
        if not self.other_checkpoint and expected["model_fingerprint"] != self.attrs.get("model_fingerprint"):
            raise StoreMismatchError(
                [f"model_fingerprint: the store was built from {self.store_model}, the query's model is "
                 f"{expected['model_fingerprint'][0]} (same shapes, other weights)"],
                "query with the model the store was built from, rebuild the store from this model, or pass "
                "other_checkpoint=True to score this model's query gradient against the stored ones (the "
                "mixed-checkpoint meaning: docs/cli.md, 'Another checkpoint than the store's')")
        return Q, expected["model_fingerprint"][0]

    def scores(self, Q):
        """The lazy Scores of the query rows ``Q`` against the store, by ``similarity``."""
        from ..api import fisher

        stored = self.stored
        if self.similarity == "dot":
            return Q @ stored.T
        if self.similarity == "cos":
            return Q.normalize() @ stored.normalize().T
        return Q @ fisher(stored).damp(self.damping).inv() @ stored.T

    def _allow(self):
        from ..options import options
        return options(check_models=False) if self.other_checkpoint else contextlib.nullcontext()

    def ask(self, prompt: str, completion: str | None = None) -> Answer:
        """Generate ``prompt``'s completion (unless given), score it against every stored
        row, and return (and keep, for :meth:`save`) the top and bottom ``k`` documents."""
        import pandas as pd

        if not isinstance(prompt, str) or not prompt.strip():
            raise DataError(f"a prompt is a non-empty string, got {prompt!r}")
        qid = f"q{len(self.answers)}"
        item = self.item(prompt, completion)
        with self._allow():
            Q, query_model = self.grads([item], ids=[qid])
            dense = self.scores(Q).compute(self.executor)
        row = np.asarray(dense.values, dtype=np.float64)[0]            # (n_train,)
        train = np.asarray(dense["train"].values)
        k = min(self.k, row.shape[0])
        tables = []
        for order in (np.argsort(-row, kind="stable")[:k], np.argsort(row, kind="stable")[:k]):
            tables.append(pd.DataFrame({"rank": np.arange(k), "train": train[order], "score": row[order],
                                        "text": [self._text(train[j]) for j in order]}))
        done = item["completion_mask"].bool()
        text = self.tokenizer.decode(item["input_ids"][done].tolist(), skip_special_tokens=True)
        answer = Answer(qid, prompt, text, k, tables[0], tables[1], self.similarity, query_model, self.store_model,
                        item)
        self.answers.append(answer)
        return answer

    # ------------------------------------------------------------------ the session
    def frame(self):
        """Every answer so far as one long table (:data:`COLUMNS`)."""
        return answers_frame(self.answers)

    def save(self, path, *, overwrite: bool = True) -> Path:
        """Write :meth:`frame` to ``path`` (``.csv`` or ``.parquet``); returns the path."""
        path = Path(path)
        if path.suffix not in (".csv", ".parquet"):
            raise OptionError(f"save to a .csv or .parquet file, got {str(path)!r}")
        if path.exists() and not overwrite:
            from ..errors import GradalgError
            raise GradalgError(f"{path} exists: save to another path, or overwrite it")
        path.parent.mkdir(parents=True, exist_ok=True)
        table = self.frame()
        table["text"] = [None if t is None else (" ".join(t) if isinstance(t, tuple) else str(t))
                         for t in table["text"]]
        if path.suffix == ".csv":
            table.to_csv(path, index=False)
        else:
            table.to_parquet(path, index=False)
        return path
