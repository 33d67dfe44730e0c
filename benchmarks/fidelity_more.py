"""Fidelity on three more settings nobody tuned on: a Llama-shaped LM, a conv net, a fine-tune.

Each setting is trained from a seeded start by Adam (batches of 32 drawn with replacement,
``fidelity_lm.batch_stream``: the same stream for every subset, drawn over the subset) for
a fixed number of steps, on the mean over a batch of each example's training loss:

    llama   ``transformers.LlamaForCausalLM`` from a random-init ``LlamaConfig``: 2 layers,
            hidden 64, 4 query heads sharing 2 key/value heads (GQA), SwiGLU MLP 128,
            RMSNorm, RoPE, untied head; fidelity_lm's synthetic languages with other steps
            s ∈ {+3, −4, +11, −13}; 256 training sequences, 64 queries; 120 steps, lr 5e-3;
            per-sequence mean token loss (fidelity_lm's recipe). Target: a query's Σ_t NLL.
            Scored with ``ga.tasks.causal_lm(model)`` at its default layers.
    conv    ``load_digits`` as 1×8×8 images (float32): Conv2d(1, 8, 3, pad 1) → ReLU →
            Conv2d(8, 16, 3, pad 1) → ReLU → MaxPool2d(2) → Linear(256, 10); 500 training
            images, 100 queries; 300 steps, lr 3e-3; cross-entropy. Target: a query's
            cross-entropy. Scored with ``ga.tasks.classification(model)``.
    seqcls  a tiny BERT (2 layers, hidden 64, 4 heads, intermediate 128) pre-trained once
            (masked LM, 15 % masking, 600 steps, seed 0, cached: every subset run starts
            from it) on source lines of the Python standard library's top-level modules,
            then fine-tuned as ``BertForSequenceClassification`` (the pooler and classifier
            initialised from the run's seed) to tell which of argparse, tarfile, imaplib,
            difflib a source line comes from; 256 training lines, 64 queries; 100 steps,
            lr 3e-4; cross-entropy. Target: a query's cross-entropy. Scored with
            ``ga.tasks.sequence_classification(model)`` at its default layers. Tokens: a
            whitespace/punctuation split (``\\w+|[^\\w\\s]``), the 1000 most frequent tokens of
            the pre-training lines, lines cut at 24 tokens. The text is the running
            Python's standard library (``sysconfig.get_paths()["stdlib"]``; measured on
            CPython 3.11.7): another Python gives other lines.

Ground truth (``ga.eval.retrain``): ``N_SUBSETS`` random 50 % subsets, each trained
``--seeds-per-subset`` times (default 3), run r with seed TRAINING_SEED + r (the
initialisation — for seqcls the fine-tuning head — and the batch stream) for every
subset; the targets are averaged over the runs, and ``ga.eval.reliability`` gives the
ground truth's test–retest correlation and its LDS ceiling. The retraining repeats only
the fine-tuning for seqcls. Targets are cached (resumable) under ``build/fidelity/``.

Every method runs at its defaults, called as a user would (``method(task, train, queries)``
with ``layers=None``; for seqcls also with the word embedding added,
``layers=TransformerBlocks(head=True, vocabulary="auto")``, rows labelled ``… + the word
embedding``); TracIn, LESS and TrackStar use 3 evenly spaced checkpoints of the
full-data run (the last with its Adam state for TrackStar); MAGIC and SOURCE (a replayable
run) and self-influence are listed, not run. LDS: ``ga.eval.lds(..., target="loss",
resample="both")``, 95 % bootstrap over queries and subsets. Cost: the wall time of
``Scores.compute()`` over one plain forward + backward over the training set in batches of
32 (the same process, right before); the scores, both times, are cached under
``build/fidelity/scores-<key>/`` (``--scores-only`` computes them beside a ``--retrain-only``
process, and the LDS is then computed from the cache; the cache does not see a change to
gradalg: ``--recompute`` computes the scores afresh). Rows go to
``build/fidelity/results-<setting>-k<K>.json`` (``fidelity_lm``'s format; tables by
``benchmarks/fidelity_report.py``).

    PYTHONPATH=. OMP_NUM_THREADS=1 nice -n 10 python benchmarks/fidelity_more.py --settings llama,conv,seqcls
    ... --retrain-only           # only the ground truth (resumable)
    ... --scores-only            # only the methods' scores (cached), beside a --retrain-only process
    ... --methods trak,logra     # rows whose method name is in the list
    ... --n-subsets 24           # LDS on the first 24 subsets (the masks do not depend on the count)
    ... --cached-only            # LDS rows from the scores cached so far (no training, no scoring)
    ... --summary                # one table: each row's LDS on every setting, worst and mean
"""
from __future__ import annotations

import argparse
import collections
import copy
import json
import re
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
import gradalg as ga  # noqa: E402
from fidelity_lm import LMSetting, batch_stream, label_value, make_corpus, token_losses  # noqa: E402
from ground_truths import seed_store  # noqa: E402

BUILD = ROOT / "build" / "fidelity"
N_SUBSETS, FRACTION, SUBSET_SEED, TRAINING_SEED, SEEDS_PER_SUBSET = 40, 0.5, 0, 0, 3
CHECKPOINTS = 3           # evenly spaced snapshots of the full-data run (TracIn, LESS, TrackStar)


# ------------------------------------------------------------------------------ training
def take(data, index):
    """Rows ``index`` of a collated batch: a dict of tensors or a tuple of tensors."""
    if isinstance(data, dict):
        return {k: v[index] for k, v in data.items()}
    return tuple(v[index] for v in data)


def fit(model: nn.Module, data, loss, *, steps: int, lr: float, seed: int, checkpoints: int = 0):
    """Adam from ``model``'s weights over ``batch_stream(n, steps, seed)`` (32 rows drawn
    with replacement per step) on the batch mean of ``loss(model, batch)`` (B,). With
    ``checkpoints`` > 0 also returns that many evenly spaced (model, Adam) snapshots."""
    n = len(data["input_ids"]) if isinstance(data, dict) else len(data[0])
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    every = steps // checkpoints if checkpoints else 0
    snapshots = []
    model.train()
    for step, b in enumerate(batch_stream(n, steps, seed), start=1):
        value = loss(model, take(data, b)).mean()
        opt.zero_grad()
        value.backward()
        opt.step()
        if every and step % every == 0:
            snap = copy.deepcopy(model).eval()
            snap_opt = torch.optim.Adam(snap.parameters(), lr=lr)
            snap_opt.load_state_dict(opt.state_dict())
            snapshots.append((snap, snap_opt))
    return (model.eval(), snapshots) if checkpoints else model.eval()


class Setting:
    """One setting: ``train`` / ``queries`` as a user passes them to a method, ``data`` /
    ``query_data`` collated, and the recipe (``new_model``, ``loss``, ``target``, ``task``)."""

    name = description = ""
    steps, lr = 300, 3e-3

    def __init__(self, n_train: int, n_query: int):
        self.n_train, self.n_query = n_train, n_query

    # the recipe --------------------------------------------------------------------------
    def new_model(self, seed: int) -> nn.Module:
        raise NotImplementedError

    def loss(self, model, batch) -> torch.Tensor:          # (B,) each example's training loss
        raise NotImplementedError

    def target(self, model, batch) -> torch.Tensor:        # (B,) each query's LDS target
        return self.loss(model, batch)

    def task(self, model):
        raise NotImplementedError

    # derived -----------------------------------------------------------------------------
    @property
    def key(self) -> str:
        return f"{self.name}-n{self.n_train}-q{self.n_query}-s{self.steps}"

    def train_model(self, indices=None, *, seed: int = TRAINING_SEED, checkpoints: int = 0):
        """The model trained from seed ``seed`` on ``indices`` (default: every example)."""
        data = self.data if indices is None else take(self.data, torch.as_tensor(np.asarray(indices)))
        return fit(self.new_model(seed), data, self.loss, steps=self.steps, lr=self.lr, seed=seed,
                   checkpoints=checkpoints)

    def train_fn(self, indices):
        """``ga.eval.retrain``'s callback: the seed is the one it seeded torch with."""
        return self.train_model(indices, seed=torch.initial_seed())

    def query_targets(self, model) -> torch.Tensor:
        with torch.no_grad():
            return self.target(model, self.query_data)     # (n_query,)

    def fwd_bwd_seconds(self, model, repeats: int = 3) -> float:
        """Wall time of one plain forward + backward over the training set, batches of 32."""
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            for start in range(0, self.n_train, 32):
                model.zero_grad()
                self.loss(model, take(self.data, slice(start, start + 32))).sum().backward()
            best = min(best, time.perf_counter() - t0)
        model.zero_grad()
        return best


# --------------------------------------------------------------------------------- llama
LLAMA_LANGUAGES = (+3, -4, +11, -13)


class Llama(Setting):
    name = "llama"
    steps, lr = 120, 5e-3

    def __init__(self, n_train=256, n_query=64, hidden=64, layers=2, steps=120):
        super().__init__(n_train, n_query)
        self.hidden, self.layers, self.steps = hidden, layers, steps
        lm = LMSetting("llama", layers, hidden, 4, LLAMA_LANGUAGES, n_train, n_query, corpus_seed=20)
        self.train, _ = make_corpus(lm, n_train // len(LLAMA_LANGUAGES), 20)
        self.queries, _ = make_corpus(lm, n_query // len(LLAMA_LANGUAGES), 21)
        self.data, self.query_data = ga.collate.pad_collate(self.train), ga.collate.pad_collate(self.queries)
        self.description = (f"Llama ({layers} layers, hidden {hidden}, 4 heads / 2 KV heads, SwiGLU "
                            f"{2 * hidden}, RMSNorm, RoPE, untied head), random init; languages "
                            f"{LLAMA_LANGUAGES}; {n_train} training sequences, {n_query} queries, {steps} "
                            f"Adam steps, lr {self.lr:g}")

    @property
    def key(self):
        return super().key + f"-d{self.hidden}-L{self.layers}"

    def new_model(self, seed):
        from transformers import LlamaConfig, LlamaForCausalLM
        torch.manual_seed(seed)
        cfg = LlamaConfig(vocab_size=31, hidden_size=self.hidden, intermediate_size=2 * self.hidden,
                          num_hidden_layers=self.layers, num_attention_heads=4, num_key_value_heads=2,
                          max_position_embeddings=16, pad_token_id=0, bos_token_id=0, eos_token_id=0,
                          tie_word_embeddings=False, attn_implementation="sdpa")
        return LlamaForCausalLM(cfg)

    def loss(self, model, batch):              # (B,) per-sequence mean token NLL
        return token_losses(model, batch).sum(1) / batch["attention_mask"][:, 1:].sum(1)

    def target(self, model, batch):            # (B,) Σ_t NLL: causal_lm's loss
        return token_losses(model, batch).sum(1)

    def task(self, model):
        return ga.tasks.causal_lm(model, name="llama")


# ---------------------------------------------------------------------------------- conv
class Conv(Setting):
    name = "conv"
    steps, lr = 300, 3e-3

    def __init__(self, n_train=500, n_query=100, channels=8, steps=300):
        super().__init__(n_train, n_query)
        from sklearn.datasets import load_digits
        self.channels, self.steps = channels, steps
        X, y = load_digits(return_X_y=True)
        X = torch.tensor(X / 16.0, dtype=torch.float32).reshape(-1, 1, 8, 8)
        order = np.random.default_rng(1).permutation(len(X))            # not fidelity.py's split (seed 0)
        tr, qu = order[:n_train], order[n_train:n_train + n_query]
        self.train = self.data = (X[tr], torch.tensor(y[tr]))
        self.queries = self.query_data = (X[qu], torch.tensor(y[qu]))
        self.description = (f"conv net on load_digits 1×8×8: Conv2d(1, {channels}, 3) → ReLU → "
                            f"Conv2d({channels}, {2 * channels}, 3) → ReLU → MaxPool2d(2) → "
                            f"Linear({2 * channels * 16}, 10), random init; {n_train} training images, "
                            f"{n_query} queries, {steps} Adam steps, lr {self.lr:g}")

    @property
    def key(self):
        return super().key + f"-c{self.channels}"

    def new_model(self, seed):
        torch.manual_seed(seed)
        c = self.channels
        return nn.Sequential(nn.Conv2d(1, c, 3, padding=1), nn.ReLU(), nn.Conv2d(c, 2 * c, 3, padding=1),
                             nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(2 * c * 16, 10))

    def loss(self, model, batch):
        x, y = batch
        return F.cross_entropy(model(x), y, reduction="none")

    def task(self, model):
        return ga.tasks.classification(model, name="conv")


# -------------------------------------------------------------------------------- seqcls
SEQCLS_MODULES = ("argparse", "tarfile", "imaplib", "difflib")
TOKEN = re.compile(r"\w+|[^\w\s]")
SPECIAL = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
PAD_ID, UNK_ID, CLS_ID, SEP_ID, MASK_ID = range(5)


def stdlib_lines(module: str) -> list[str]:
    """The stripped source lines of a top-level stdlib module with ≥ 4 tokens, in file order."""
    path = Path(sysconfig.get_paths()["stdlib"]) / f"{module}.py"
    lines = [line.strip() for line in path.read_text(encoding="utf-8").splitlines()]
    return [line for line in lines if len(TOKEN.findall(line)) >= 4]


def pretraining_lines(n_modules: int = 40) -> list[str]:
    """Lines of the first ``n_modules`` top-level stdlib modules (sorted by name), those of
    the classification task left out."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    names = sorted(p.stem for p in stdlib.glob("*.py") if not p.stem.startswith("_")
                   and p.stem not in SEQCLS_MODULES)[:n_modules]
    return [line for name in names for line in stdlib_lines(name)]


class Vocabulary:
    """Token ids: the special tokens, then the ``size`` most frequent tokens of ``lines``
    (ties by first appearance); anything else is [UNK]."""

    def __init__(self, lines: list[str], size: int = 1000):
        counts = collections.Counter(t for line in lines for t in TOKEN.findall(line))
        self.words = list(SPECIAL) + [w for w, _ in counts.most_common(size)]
        self.ids = {w: i for i, w in enumerate(self.words)}

    def __len__(self):
        return len(self.words)

    def encode(self, line: str, max_len: int) -> torch.Tensor:
        """[CLS] tokens… [SEP], at most ``max_len`` ids."""        # (T,) int64
        ids = [self.ids.get(t, UNK_ID) for t in TOKEN.findall(line)][:max_len - 2]
        return torch.tensor([CLS_ID, *ids, SEP_ID])


class SeqCls(Setting):
    name = "seqcls"
    steps, lr = 100, 3e-4
    pretrain_steps, pretrain_lr, max_len = 600, 1e-3, 24

    def __init__(self, n_train=256, n_query=64, hidden=64, layers=2, steps=100, pretrain_steps=600,
                 pretrain_modules=40, cache: bool = True):
        super().__init__(n_train, n_query)
        self.hidden, self.layers, self.steps, self.pretrain_steps = hidden, layers, steps, pretrain_steps
        self.pretrain_modules, self.cache = pretrain_modules, cache
        self.corpus = pretraining_lines(pretrain_modules)
        self.vocab = Vocabulary(self.corpus)
        rng = np.random.default_rng(2)
        per_class = (n_train + n_query) // len(SEQCLS_MODULES)
        items = []
        for label, module in enumerate(SEQCLS_MODULES):
            lines = stdlib_lines(module)
            for i in rng.choice(len(lines), per_class, replace=False):
                ids = self.vocab.encode(lines[i], self.max_len)
                items.append({"input_ids": ids, "attention_mask": torch.ones_like(ids),
                              "labels": torch.tensor(label)})
        items = [items[i] for i in rng.permutation(len(items))]
        self.train, self.queries = items[:n_train], items[n_train:n_train + n_query]
        self.data, self.query_data = ga.collate.pad_collate(self.train), ga.collate.pad_collate(self.queries)
        self._pretrained = None
        self.description = (f"BERT ({layers} layers, hidden {hidden}, 4 heads), masked-LM pre-trained once "
                            f"({pretrain_steps} steps on {len(self.corpus)} stdlib source lines, vocabulary "
                            f"{len(self.vocab)}), fine-tuned to tell which of {', '.join(SEQCLS_MODULES)} a "
                            f"source line is from; {n_train} training lines, {n_query} queries, {steps} Adam "
                            f"steps, lr {self.lr:g}")

    @property
    def key(self):
        return super().key + f"-d{self.hidden}-L{self.layers}-p{self.pretrain_steps}m{self.pretrain_modules}"

    def config(self):
        from transformers import BertConfig
        return BertConfig(vocab_size=len(self.vocab), hidden_size=self.hidden, num_hidden_layers=self.layers,
                          num_attention_heads=4, intermediate_size=2 * self.hidden, max_position_embeddings=32,
                          hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=len(SEQCLS_MODULES),
                          pad_token_id=PAD_ID, attn_implementation="eager")

    def pretrained(self) -> dict:
        """The BERT encoder's weights after masked-LM pre-training (seed 0, one run, cached
        under ``build/fidelity/``): every fine-tuning run starts from them."""
        if self._pretrained is not None:
            return self._pretrained
        path = BUILD / (f"pretrained-seqcls-d{self.hidden}-L{self.layers}-p{self.pretrain_steps}"
                        f"m{self.pretrain_modules}.pt")
        if self.cache and path.exists():
            self._pretrained = torch.load(path)
            return self._pretrained
        from transformers import BertForMaskedLM
        torch.manual_seed(0)
        model = BertForMaskedLM(self.config())
        data = ga.collate.pad_collate([{"input_ids": self.vocab.encode(line, self.max_len)} for line in self.corpus])
        opt = torch.optim.Adam(model.parameters(), lr=self.pretrain_lr)
        g = torch.Generator().manual_seed(0)
        for _ in range(self.pretrain_steps):
            b = torch.randint(0, len(self.corpus), (32,), generator=g)
            ids, mask = data["input_ids"][b], data["attention_mask"][b]
            chosen = (torch.rand(ids.shape, generator=g) < 0.15) & (ids > MASK_ID)
            labels = ids.masked_fill(~chosen, -100)
            out = model(input_ids=ids.masked_fill(chosen, MASK_ID), attention_mask=mask, labels=labels)
            opt.zero_grad()
            out.loss.backward()
            opt.step()
        self._pretrained = {k.removeprefix("bert."): v.detach().clone() for k, v in model.state_dict().items()
                            if k.startswith("bert.")}
        if self.cache:
            BUILD.mkdir(parents=True, exist_ok=True)
            torch.save(self._pretrained, path)
        return self._pretrained

    def new_model(self, seed):
        from transformers import BertForSequenceClassification
        weights = self.pretrained()
        torch.manual_seed(seed)
        model = BertForSequenceClassification(self.config())       # pooler and classifier from the seed
        missing, unexpected = model.bert.load_state_dict(weights, strict=False)
        if unexpected or any(not k.startswith("pooler.") for k in missing):
            raise RuntimeError(f"pre-trained weights do not fit: missing {missing}, unexpected {unexpected}")
        return model

    def loss(self, model, batch):
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        return F.cross_entropy(logits, batch["labels"], reduction="none")

    def task(self, model):
        return ga.tasks.sequence_classification(model, name="seqcls")


SETTINGS = {"llama": Llama, "conv": Conv, "seqcls": SeqCls}


# ------------------------------------------------------------------------------- methods
NOT_RUN = {"magic": "differentiates a replayable run (ga.unroll.TrainingRun): not built for these settings",
           "source": "segments a replayable SGD run (ga.unroll.TrainingRun): not built for these settings",
           "self_influence": "gives each training example's self-influence (n_train,), not query × train scores"}


def _defaults(name: str, *knobs) -> str:
    import inspect
    params = inspect.signature(getattr(ga.methods, name)).parameters
    return "defaults" + (" (" + ", ".join(f"{k}={label_value(params[k].default)}" for k in knobs) + ")" if knobs else "")


def method_rows(s: Setting, model, snapshots):
    """(method, configuration, thunk -> lazy Scores): every catalogue method at its defaults,
    called as ``method(task, train, queries)``; checkpoint methods on ``snapshots``; then
    EK-FAC / K-FAC influence and RelatIF with ``layers="all"``."""
    m, task, tr, qu = ga.methods, s.task(model), s.train, s.queries
    tasks, optimizers, lrs = [s.task(x) for x, _ in snapshots], [o for _, o in snapshots], [s.lr] * len(snapshots)
    yield "grad_dot", "defaults", lambda: m.grad_dot(task, tr, qu)
    yield "grad_cos", "defaults", lambda: m.grad_cos(task, tr, qu)
    yield "influence", "defaults (curvature='auto')", lambda: m.influence(task, tr, qu)
    yield "influence", "EK-FAC", lambda: m.influence(task, tr, qu, curvature="ekfac")
    yield "influence", "K-FAC", lambda: m.influence(task, tr, qu, curvature="kfac")
    yield "trak", _defaults("trak", "k", "damping"), lambda: m.trak(task, tr, qu)
    yield "logra", _defaults("logra", "k", "damping"), lambda: m.logra(task, tr, qu)
    yield "grass", _defaults("grass", "k", "damping"), lambda: m.grass(task, tr, qu)
    yield "relatif", _defaults("relatif", "damping"), lambda: m.relatif(task, tr, qu)
    yield "tracin", f"defaults, {len(tasks)} Adam checkpoints", lambda: m.tracin(tasks, lrs, tr, qu)
    yield "less", _defaults("less", "k") + f", {len(tasks)} Adam checkpoints", \
        lambda: m.less(tasks, optimizers, lrs, tr, qu, np.arange(s.n_query))
    yield "trackstar", _defaults("trackstar", "k", "damping") + ", final Adam state", \
        lambda: m.trackstar(tasks[-1], tr, qu, optimizer=optimizers[-1])
    # issue 31 item 4: every parameter the capture can attribute (embeddings, an untied head,
    # norms) in the curvature, beside the default layers' rows above
    yield "influence", "EK-FAC, layers='all'", lambda: m.influence(task, tr, qu, layers="all", curvature="ekfac")
    yield "influence", "K-FAC, layers='all'", lambda: m.influence(task, tr, qu, layers="all", curvature="kfac")
    # damping=1e-3: RelatIF's default when this row was measured (2026-12-05; "auto" since), pinned
    yield "relatif", "EK-FAC, layers='all'", lambda: m.relatif(task, tr, qu, layers="all", curvature="ekfac",
                                                               damping=1e-3)
    if s.name == "seqcls":
        # the default layers and the word embedding (V = 1,005 ≤ ga.options(vocabulary_layers_max)):
        # sequence_classification's default if it took a small vocabulary's embedding as the language
        # tasks do since 2026-12-06 (measured, not adopted: docs/fidelity.md, "The vocabulary layers")
        vocab, plus = ga.TransformerBlocks(head=True, vocabulary="auto"), \
            " + the word embedding (layers=TransformerBlocks(head=True, vocabulary='auto'))"
        yield "grad_dot", "defaults" + plus, lambda: m.grad_dot(task, tr, qu, layers=vocab)
        yield "influence", "defaults (curvature='auto')" + plus, lambda: m.influence(task, tr, qu, layers=vocab)
        yield "trak", _defaults("trak", "k", "damping") + plus, lambda: m.trak(task, tr, qu, layers=vocab)
        yield "logra", _defaults("logra", "k", "damping") + plus, lambda: m.logra(task, tr, qu, layers=vocab)
        yield "grass", _defaults("grass", "k", "damping") + plus, lambda: m.grass(task, tr, qu, layers=vocab)
        yield "relatif", _defaults("relatif", "damping") + plus, lambda: m.relatif(task, tr, qu, layers=vocab)
        yield "less", _defaults("less", "k") + f", {len(tasks)} Adam checkpoints" + plus, \
            lambda: m.less(tasks, optimizers, lrs, tr, qu, np.arange(s.n_query), layers=vocab)


# ---------------------------------------------------------------------------------- run
def ground_truth(s: Setting, *, n_subsets=N_SUBSETS, seeds_per_subset=SEEDS_PER_SUBSET, progress=False,
                 store=True):
    """``ga.eval.retrain`` of ``s`` (targets cached under build/fidelity/<key>, seeded from the
    committed runs of ``benchmarks/ground_truths.py``)."""
    if store:
        seed_store(BUILD / s.key)
    return ga.eval.retrain(s.train_fn, s.n_train, n_subsets=n_subsets, fraction=FRACTION, seed=SUBSET_SEED,
                           training_seed=TRAINING_SEED, targets_fn=s.query_targets, target="loss",
                           store=(BUILD / s.key) if store else None, progress=progress,
                           seeds_per_subset=seeds_per_subset)


def scores_path(s: Setting, method: str, config: str) -> Path:
    return BUILD / f"scores-{s.key}" / (re.sub(r"[^\w.=-]+", "_", f"{method}-{config}").strip("_") + ".npz")


def cached_scores(s: Setting, method: str, config: str, thunk, base: float, refresh: bool = False):
    """(values (n_query, n_train), seconds, base): the scores of one row, computed once and
    kept in ``build/fidelity/scores-<key>/`` with the wall time of ``compute()`` and the
    forward + backward time measured beside it, so that the ground truth and the scores can
    be computed in separate (resumable) processes. The cache is keyed by the setting and
    the row's label, and checked against the expression's content token (``expr.token``:
    the method's resolved arguments, its defaults included), kept beside the scores: after a
    default changes, the cached scores of the old expression are recomputed, not served
    (:func:`fidelity_lm.cache_is_current`). ``--recompute`` (``refresh``) recomputes anyway."""
    from fidelity_lm import cache_is_current, expression_token
    path = scores_path(s, method, config)
    scores = thunk()
    token = expression_token(scores)
    if path.exists() and not refresh:
        with np.load(path) as cached:
            if cache_is_current(cached, token, path):
                return cached["values"], float(cached["seconds"]), float(cached["base"])
    t0 = time.perf_counter()
    values = np.asarray(scores.compute().values)
    seconds = time.perf_counter() - t0
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.npz")
    np.savez(tmp, values=values, seconds=seconds, base=base, token=token)
    tmp.replace(path)
    return values, seconds, base


def run(s: Setting, *, only=None, configs=None, recompute=False, n_subsets=N_SUBSETS, seeds_per_subset=SEEDS_PER_SUBSET,
        progress=False, retrain_only=False, scores_only=False, cached_only=False) -> list:
    """The ground truth (unless ``scores_only``), then every row of ``method_rows`` (unless
    ``retrain_only``): its scores (cached), LDS and cost, written to the results file."""
    import xarray as xr
    torch.set_num_threads(1)
    label = s.name + (f"-k{seeds_per_subset}" if seeds_per_subset > 1 else "")
    truth = reliability = None
    if not scores_only:
        t0 = time.perf_counter()
        truth = ground_truth(s, n_subsets=n_subsets, seeds_per_subset=seeds_per_subset, progress=progress)
        reliability = ga.eval.reliability(truth) if seeds_per_subset > 1 else None
        print(f"[{label}] {s.description}; ground truth {n_subsets} subsets × {seeds_per_subset} run(s) ready "
              f"in {time.perf_counter() - t0:.0f} s", flush=True)
        if reliability is not None:
            print(f"  {reliability!r}", flush=True)
    if retrain_only:
        return []
    if cached_only:          # rows from cached scores only: the thunks are never called, no training
        model = s.new_model(TRAINING_SEED)
        snapshots = [(model, torch.optim.Adam(model.parameters()))] * CHECKPOINTS
        base = float("nan")
    else:
        model, snapshots = s.train_model(checkpoints=CHECKPOINTS)
        base = s.fwd_bwd_seconds(model)
        print(f"  plain forward+backward over the training set: {base:.3f} s", flush=True)
    out = BUILD / f"results-{label}.json"
    done = set() if recompute or scores_only else {(r["method"], r["config"]) for r in _read(out)}
    header = None if scores_only else _header(s, label, n_subsets, seeds_per_subset, reliability, base)
    rows = []
    for method, config, thunk in method_rows(s, model, snapshots):
        if (only and method not in only) or (method, config) in done or (
                configs and not config.startswith(configs)):
            continue
        if cached_only and not scores_path(s, method, config).exists():
            print(f"  {method:10s} {config:44s} no cached scores", flush=True)
            continue
        row = {"setting": label, "method": method, "config": config}
        try:
            values, row["seconds"], row_base = cached_scores(s, method, config, thunk, base,
                                                             refresh=recompute and not cached_only)
            if header is not None and not np.isfinite(header["fwd_bwd_seconds"]):
                header["fwd_bwd_seconds"] = row_base
            row["cost"] = row["seconds"] / row_base
            if not np.isfinite(values).all():
                raise ValueError("non-finite scores")
            if scores_only:
                print(f"  {method:10s} {config:44s} scores in {row['seconds']:6.2f} s ({row['cost']:.0f}× fwd+bwd)",
                      flush=True)
                continue
            values = xr.DataArray(values, dims=("query", "train"), name=method)       # (n_query, n_train)
            result = ga.eval.lds(values, truth, target="loss", bootstrap=1000, resample="both")
            row.update(lds=result.mean, low=result.interval[0], high=result.interval[1])
            print(f"  {method:10s} {config:44s} LDS {row['lds']:6.3f} [{row['low']:.3f}, {row['high']:.3f}]"
                  f"  {row['seconds']:6.2f} s ({row['cost']:.0f}× fwd+bwd)", flush=True)
        except Exception as exc:  # noqa: BLE001 - reported, not fatal
            row["skipped"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:160]
            print(f"  {method:10s} {config:44s} skipped: {row['skipped']}", flush=True)
        if not scores_only:
            rows.append(row)
            _write(out, header, row)                            # an interrupted run keeps its rows
    if not scores_only:
        for method, reason in NOT_RUN.items():
            if not only or method in only:
                _write(out, header, {"setting": label, "method": method, "config": "", "skipped": reason})
    return rows


def _header(s: Setting, label, n_subsets, seeds_per_subset, reliability, base) -> dict:
    seeds = (f"{TRAINING_SEED} + r for run r = 0 … {seeds_per_subset - 1}" if seeds_per_subset > 1
             else TRAINING_SEED)
    start = "the pre-trained encoder and a seeded head" if isinstance(s, SeqCls) else "a seeded init"
    head = {"setting": label, "description": s.description,
            "protocol": {"name": "subset-retrain",
                         "counterfactual": f"each subset trained afresh from {start}, same batch-index stream "
                                           f"drawn over the subset; {seeds_per_subset} runs per subset, run r "
                                           f"with seed {TRAINING_SEED} + r (init and batch stream), targets "
                                           "averaged",
                         "n_subsets": n_subsets, "fraction": FRACTION, "queries": f"all {s.n_query}",
                         "seeds_per_subset": seeds_per_subset, "training_seed": seeds,
                         "target": "query loss (sum of token NLL)" if isinstance(s, Llama) else
                         "query loss (cross-entropy)",
                         "interval": "95% percentile bootstrap over queries and subsets"},
            "fwd_bwd_seconds": base}
    if reliability is not None:
        head["reliability"] = {"test_retest": reliability.retest, "test_retest_interval": list(reliability.interval),
                               "ceiling": reliability.ceiling, "ceiling_one_run": reliability.ceiling_with(1)}
    return head


def _read(out: Path) -> list:
    return json.loads(out.read_text())["rows"] if out.exists() else []


def _write(out: Path, header: dict, row: dict) -> None:
    """Add (or replace) ``row`` in ``out``, read afresh: another process may have added rows."""
    rows = [r for r in _read(out) if (r["method"], r["config"]) != (row["method"], row["config"])] + [row]
    BUILD.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps({**header, "rows": rows}, indent=1, default=float))
    tmp.replace(out)


def summary(labels=("llama-k3", "conv-k3", "seqcls-k3")) -> str:
    """The rows present in every results file, one column of LDS per setting, with the
    worst and the mean over the settings; sorted by the worst, best first (markdown)."""
    lds = {}
    for label in labels:
        for r in _read(BUILD / f"results-{label}.json"):
            if "lds" in r:
                lds.setdefault((r["method"], r["config"]), {})[label] = r["lds"]
    rows = sorted(((min(v.values()), key, [v[x] for x in labels]) for key, v in lds.items() if len(v) == len(labels)),
                  key=lambda t: -t[0])
    head = "| method, configuration | " + " | ".join(f"`{x.removesuffix('-k3')}`" for x in labels) + " | worst | mean |"
    lines = [head, "|---|" + "---:|" * (len(labels) + 2)]
    for worst, (method, config), values in rows:
        lines.append(f"| {method}, {config} | " + " | ".join(f"{x:.3f}" for x in values)
                     + f" | {worst:.3f} | {sum(values) / len(values):.3f} |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--settings", default="llama,conv,seqcls")
    ap.add_argument("--methods", default=None, help="comma-separated method names")
    ap.add_argument("--configs", default=None, help="'|'-separated prefixes: only the rows whose configuration "
                    "starts with one (e.g. 'defaults|EK-FAC, blocks +')")
    ap.add_argument("--n-subsets", type=int, default=N_SUBSETS)
    ap.add_argument("--seeds-per-subset", type=int, default=SEEDS_PER_SUBSET)
    ap.add_argument("--retrain-only", action="store_true")
    ap.add_argument("--scores-only", action="store_true", help="only the methods' scores (cached; no ground "
                    "truth): to run beside a --retrain-only process")
    ap.add_argument("--cached-only", action="store_true", help="rows from the cached scores only (no "
                    "training, no scoring): the LDS of what --scores-only has computed so far")
    ap.add_argument("--recompute", action="store_true", help="rerun rows already in the results file, "
                    "their scores computed afresh (with --cached-only: from the cached scores)")
    ap.add_argument("--progress", action="store_true")
    ap.add_argument("--summary", action="store_true", help="print the table of every setting's LDS per row "
                    "(from the results files) and stop")
    args = ap.parse_args(argv)
    if args.summary:
        print(summary(tuple(f"{n}-k{args.seeds_per_subset}" for n in args.settings.split(","))))
        return
    torch.set_num_threads(1)
    ga.options(progress=False)
    only = set(args.methods.split(",")) if args.methods else None
    configs = tuple(args.configs.split("|")) if args.configs else None
    for name in args.settings.split(","):
        run(SETTINGS[name](), only=only, configs=configs, recompute=args.recompute, n_subsets=args.n_subsets,
            seeds_per_subset=args.seeds_per_subset, progress=args.progress, retrain_only=args.retrain_only,
            scores_only=args.scores_only, cached_only=args.cached_only)


if __name__ == "__main__":
    main()
