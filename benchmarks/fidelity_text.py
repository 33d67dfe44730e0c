"""Fidelity on real text: LDS against retraining for a small GPT-2 on the Python standard library.

Two settings on text nobody here wrote: the ``.py`` sources of ``STDLIB_FILES`` (a fixed
list of modules that ship with every CPython ≥ 3.9, read from
``sysconfig.get_paths()["stdlib"]``, in that order). A byte-level BPE tokenizer
(``tokenizers``: ByteLevel pre-tokenizer, ``BpeTrainer`` with the 256 byte symbols as the
initial alphabet, one special token ``<|endoftext|>`` = id 0, used as padding) is trained
on those sources and cached as JSON under ``build/fidelity/text-bpe-<vocab>-<digest>.json``
(the digest is of the sources' text, so another Python's stdlib gets its own tokenizer).

    text      each file tokenized whole; its tokens cut into consecutive chunks whose
              lengths are drawn uniformly in [32, 48] (seeded); the chunks of all files
              shuffled (seed ``corpus_seed``), the first ``n_train`` are the training
              sequences and the next ``n_query`` the queries (held out: never trained on).
              Training loss: the per-sequence mean token NLL (fidelity_lm's recipe);
              target: a query's Σ_t −log p(x_t | x_<t).
    instruct  (prompt, completion) pairs from the same sources (``ast``): for every
              function or method with a docstring, prompt = its signature line
              ``def name(args):`` + newline, completion = the first line of its docstring;
              pairs deduplicated, kept when the prompt has ≤ 40 tokens and the completion
              3–24, shuffled (seed ``corpus_seed``), split into ``n_train`` training pairs
              and ``n_query`` queries. Prompt and completion are tokenized apart and
              concatenated (``ga.tasks.queries_from_prompts``'s convention); each item
              carries ``completion_mask`` (0 on the prompt, 1 on the completion).
              Training and query loss through ``ga.tasks.causal_lm(model,
              completion_only=True)``: L_i = Σ_{t ∈ completion} −log p(x_t | x_<t), the
              training step minimises the batch mean of L_i; the target is the query's
              completion loss only; every method scores with that task.

The model: a GPT-2 from a config (random init; the vocabulary of the tokenizer; tied
embedding and head, no dropout), trained by Adam (lr 3e-3, batches of 16 drawn with
replacement from a seeded stream, a fixed number of steps: fidelity_lm's recipe at half
its batch, so that one run costs a few seconds of one core). Sizes (``SETTINGS``): both
settings 2 layers, n_embd 32, 2 heads, vocabulary 1024 (≈ 25 k coordinates in the
default layers), 256 training items, 64 queries, 80 Adam steps.

Ground truth (``ga.eval.retrain``): ``N_SUBSETS`` (32) random 50 % subsets, each trained afresh
``--seeds-per-subset`` times (default 3; run r with seed r: the same initialisation and
batch-index stream for every subset's run r), targets averaged over the runs;
``ga.eval.reliability`` gives the ground truth's test–retest correlation and the LDS
ceiling. Every catalogue method runs AT ITS DEFAULTS, called as ``method(task, train,
queries)`` (the task's default layers: the linear layers inside the transformer blocks and,
the vocabulary of 1,024 being under ``ga.options(vocabulary_layers_max)``, the tied
embedding/head ``transformer.wte``: 57,920 coordinates; 25,152 before 2026-12-06);
the variant rows (``EK-FAC``, ``K-FAC``, ``DataInf``, RelatIF's ``EK-FAC, damping=0.001``, LESS's
sparse map) name the blocks only, ``layers=["transformer.h.*"]`` (fidelity_lm's ``LAYERS``);
the methods that need checkpoints (TracIn, LESS, TrackStar) score 3 snapshots of the
full-data run and their Adam states, taken every ⌊T/3⌋ steps (fidelity_lm's rule: steps
26, 52, 78 of 80; TrackStar's "final Adam state" is the last of them). Not run:
self-influence (no query × train scores), MAGIC (its replays are over this benchmark's
time on 2 shared cores) and SOURCE (an SGD run's segments); rows saying so are written. LDS: ``ga.eval.lds(...,
target="loss", resample="both")``, 95 % percentile bootstrap over queries and subsets.
Cost: wall time of ``Scores.compute()`` over one plain forward + backward pass over the
training set in batches of 32, measured in the same process (scores are cached with both
times under ``build/fidelity/scores-*.npz``, so ``--scores-only`` can run beside the
retraining). Results (the format
``benchmarks/fidelity_report.py`` renders): ``build/fidelity/results-<setting>-k<K>.json``.

    PYTHONPATH=. OMP_NUM_THREADS=1 nice -n 10 python benchmarks/fidelity_text.py --settings text,instruct
    ... --retrain-only          # only the ground truth (resumable, cached under build/fidelity/)
    ... --scores-only           # only the methods' scores (cached: build/fidelity/scores-*.npz)
    ... --methods trak,logra    # rows whose method name is in the list
    ... --configs 'defaults|EK-FAC, blocks +'   # rows whose configuration starts with one of these
    python benchmarks/fidelity_report.py --settings text-k3,instruct-k3
"""
from __future__ import annotations

import argparse
import ast
import copy
import hashlib
import json
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from transformers import GPT2Config, GPT2LMHeadModel

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
import gradalg as ga  # noqa: E402
from fidelity_lm import LAYERS, _read, defaults, tied_rows  # noqa: E402
from ground_truths import seed_store  # noqa: E402

BUILD = ROOT / "build" / "fidelity"
N_SUBSETS, FRACTION, SUBSET_SEED, TRAINING_SEED, SEEDS_PER_SUBSET = 32, 0.5, 0, 0, 3
EOT, PAD = "<|endoftext|>", 0
CHUNK = (32, 48)                      # a text chunk's length in tokens, drawn uniformly (inclusive)
PROMPT_MAX, COMPLETION = 40, (3, 24)  # instruct: the longest prompt, the completion's length range (tokens)

#: modules of the standard library read as the corpus, in this order (each a single file
#: in every CPython ≥ 3.9: none became a package since)
STDLIB_FILES = ("argparse.py", "textwrap.py", "string.py", "shlex.py", "fnmatch.py", "glob.py",
                "heapq.py", "bisect.py", "calendar.py", "configparser.py", "csv.py", "difflib.py",
                "fractions.py", "gettext.py", "pprint.py", "random.py", "statistics.py", "tokenize.py",
                "shutil.py", "tempfile.py", "queue.py", "sched.py", "dataclasses.py", "enum.py",
                "functools.py", "operator.py")


@dataclass(frozen=True)
class TextSetting:
    name: str
    kind: str                 # "text" or "instruct"
    n_train: int
    n_query: int
    train_steps: int
    n_layer: int = 2
    n_embd: int = 32
    n_head: int = 2
    vocab_size: int = 1024
    batch_size: int = 16
    corpus_seed: int = 0

    def describe(self) -> str:
        data = (f"chunks of {CHUNK[0]}–{CHUNK[1]} BPE tokens of {len(STDLIB_FILES)} stdlib modules"
                if self.kind == "text" else
                "(signature line → first docstring line) pairs of stdlib functions, completion loss only")
        return (f"GPT-2 {self.n_layer} layers, n_embd {self.n_embd}, {self.n_head} heads, byte-level BPE vocabulary "
                f"{self.vocab_size}; {data}; {self.n_train} training items, {self.n_query} queries, "
                f"{self.train_steps} Adam steps")


SETTINGS = {
    "text": TextSetting("text", "text", 256, 64, 80),
    "instruct": TextSetting("instruct", "instruct", 256, 64, 80, corpus_seed=1),
}


# --------------------------------------------------------------------------------- data
def stdlib_sources(files=STDLIB_FILES, root: str | None = None) -> list[tuple[str, str]]:
    """(file name, text) of each module of ``files``, read from the running Python's stdlib."""
    base = Path(root or sysconfig.get_paths()["stdlib"])
    return [(name, (base / name).read_text(encoding="utf-8")) for name in files]


def train_tokenizer(sources, vocab_size: int = 1024, cache: Path | None = BUILD):
    """A byte-level BPE ``tokenizers.Tokenizer`` trained on the sources' text (``EOT`` = id 0),
    loaded from ``cache/text-bpe-<vocab>-<digest>.json`` when it is there (written otherwise;
    ``cache=None``: neither)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    digest = hashlib.sha256("\0".join(t for _, t in sources).encode()).hexdigest()[:12]
    path = None if cache is None else Path(cache) / f"text-bpe-{vocab_size}-{digest}.json"
    if path is not None and path.exists():
        return Tokenizer.from_file(str(path))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=[EOT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([t for _, t in sources], trainer=trainer)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tok.save(str(tmp))
        tmp.replace(path)
    return tok


def encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False).ids


def text_chunks(tok, sources, seed: int) -> list[dict]:
    """Every file's tokens cut into consecutive chunks of ``CHUNK`` lengths (drawn with
    ``torch.Generator().manual_seed(seed)``), all files' chunks shuffled by the same
    generator: items ``input_ids``, ``attention_mask`` (T,) int64."""
    g = torch.Generator().manual_seed(seed)
    chunks = []
    for _, text in sources:
        ids = encode(tok, text)
        start = 0
        while True:
            length = int(torch.randint(CHUNK[0], CHUNK[1] + 1, (1,), generator=g))
            if start + length > len(ids):
                break
            chunks.append(torch.tensor(ids[start:start + length], dtype=torch.long))
            start += length
    order = torch.randperm(len(chunks), generator=g).tolist()
    return [{"input_ids": chunks[i], "attention_mask": torch.ones_like(chunks[i])} for i in order]


def instruct_pairs(sources) -> list[tuple[str, str]]:
    """(prompt, completion) of every function with a docstring, in file and source order,
    first occurrence of each pair kept: prompt ``"def name(args):\\n"`` (``ast.unparse`` of
    the arguments, annotations included), completion the docstring's first line, stripped."""
    pairs, seen = [], set()
    for _, text in sources:
        for node in ast.walk(ast.parse(text)):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            doc = ast.get_docstring(node)
            first = doc.strip().splitlines()[0].strip() if doc and doc.strip() else ""
            if not first:
                continue
            pair = (f"def {node.name}({ast.unparse(node.args)}):\n", first)
            if pair not in seen:
                seen.add(pair)
                pairs.append(pair)
    return pairs


def instruct_items(tok, sources, seed: int) -> list[dict]:
    """Items ``input_ids``, ``attention_mask``, ``completion_mask`` (T,) int64 of the pairs whose
    prompt has ≤ ``PROMPT_MAX`` tokens and completion ``COMPLETION`` tokens, shuffled with
    ``torch.Generator().manual_seed(seed)``."""
    items = []
    for prompt, completion in instruct_pairs(sources):
        head, tail = encode(tok, prompt), encode(tok, completion)
        if len(head) > PROMPT_MAX or not COMPLETION[0] <= len(tail) <= COMPLETION[1]:
            continue
        ids = torch.tensor(head + tail, dtype=torch.long)
        mask = torch.zeros_like(ids)
        mask[len(head):] = 1
        items.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "completion_mask": mask})
    order = torch.randperm(len(items), generator=torch.Generator().manual_seed(seed)).tolist()
    return [items[i] for i in order]


def make_data(setting: TextSetting, sources=None, cache: Path | None = BUILD):
    """(tokenizer, training items, query items) of the setting: the first ``n_train`` items
    and the next ``n_query``. Raises ValueError when the sources give too few."""
    sources = stdlib_sources() if sources is None else sources
    tok = train_tokenizer(sources, setting.vocab_size, cache)
    items = (text_chunks if setting.kind == "text" else instruct_items)(tok, sources, setting.corpus_seed)
    need = setting.n_train + setting.n_query
    if len(items) < need:
        raise ValueError(f"{setting.name}: the sources give {len(items)} items, {need} needed")
    return tok, items[:setting.n_train], items[setting.n_train:need]


# -------------------------------------------------------------------------------- model
def new_model(setting: TextSetting, n_positions: int = 64, attention: str = "sdpa") -> GPT2LMHeadModel:
    """The setting's GPT-2 from the current torch seed (tied embedding and head, no dropout)."""
    cfg = GPT2Config(n_layer=setting.n_layer, n_embd=setting.n_embd, n_head=setting.n_head,
                     vocab_size=setting.vocab_size, n_positions=n_positions, resid_pdrop=0.0, embd_pdrop=0.0,
                     attn_pdrop=0.0, bos_token_id=PAD, eos_token_id=PAD, attn_implementation=attention)
    return GPT2LMHeadModel(cfg)


def token_losses(model, batch, completion_only: bool = False):
    """(B, T-1) next-token NLL, zero on padding (and on the prompt with ``completion_only``):
    the hand-written reference of ``ga.tasks.causal_lm``'s loss."""
    ids, mask = batch["input_ids"], batch["attention_mask"]
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
    counted = mask[:, 1:].bool() & mask[:, :-1].bool()
    if completion_only:
        counted &= batch["completion_mask"][:, 1:].bool()
    targets = ids[:, 1:].masked_fill(~counted, -100)
    return torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets, reduction="none")


def training_loss(setting: TextSetting, model, batch) -> torch.Tensor:
    """The scalar a training step minimises: text, the mean over sequences of each one's mean
    token NLL; instruct, the mean over items of the completion loss ``causal_lm(model,
    completion_only=True)`` gives (its loss is the batch's sum)."""
    if setting.kind == "text":
        return (token_losses(model, batch).sum(1) / batch["attention_mask"][:, 1:].sum(1)).mean()
    return task_of(setting, model).loss(model, batch) / batch["input_ids"].shape[0]


def task_of(setting: TextSetting, model) -> "ga.Task":
    """The task every method scores with (and, for instruct, the training and target loss)."""
    return ga.tasks.causal_lm(model, completion_only=setting.kind == "instruct", name=f"gpt2-{setting.name}")


def batch_stream(n: int, steps: int, size: int, seed: int = TRAINING_SEED) -> list:
    """The training batches' indices into a set of n examples: ``size`` drawn with replacement
    per step from ``torch.Generator().manual_seed(seed + 1)`` (fidelity_lm's stream, any size)."""
    g = torch.Generator().manual_seed(seed + 1)
    return [torch.randint(0, n, (size,), generator=g) for _ in range(steps)]


def train_model(setting: TextSetting, items, *, checkpoints: int = 0, seed: int = TRAINING_SEED):
    """Train from the seeded random init (Adam lr 3e-3, ``batch_stream``'s batches). With
    ``checkpoints`` > 0 also return that many (model, optimizer) snapshots evenly spaced."""
    torch.manual_seed(seed)
    model = new_model(setting)
    batch = ga.collate.pad_collate(items)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    every = setting.train_steps // checkpoints if checkpoints else 0
    snapshots = []
    for step, b in enumerate(batch_stream(len(items), setting.train_steps, setting.batch_size, seed), start=1):
        loss = training_loss(setting, model, trim({k: v[b] for k, v in batch.items()}))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if every and step % every == 0:
            snap = copy.deepcopy(model).eval()
            snap_opt = torch.optim.Adam(snap.parameters(), lr=3e-3)
            snap_opt.load_state_dict(opt.state_dict())
            snapshots.append((snap, snap_opt))
    return (model.eval(), snapshots) if checkpoints else model.eval()


def trim(batch: dict) -> dict:
    """The batch cut to its longest real row (right padding): the same losses, less compute."""
    width = int(batch["attention_mask"].sum(1).max())
    return {k: v[:, :width] for k, v in batch.items()}


def query_losses(setting: TextSetting, model, query_batch) -> torch.Tensor:
    """(n_query,) each query's target: Σ_t NLL over its tokens (text) or its completion (instruct)."""
    with torch.no_grad():
        return token_losses(model, query_batch, completion_only=setting.kind == "instruct").sum(1)


class Prepared:
    """A setting's data, full-data model and ground truth (``seeds_per_subset`` runs per subset);
    the interface ``benchmarks/fidelity_lm.py``'s rows expect (``train``, ``queries``,
    ``n_query``, ``model``, ``task()``, ``truth``, ``reliability``, ``fwd_bwd_seconds()``)."""

    protocol = "subset-retrain"

    def __init__(self, setting: TextSetting, n_subsets: int = N_SUBSETS, progress: bool = False,
                 seeds_per_subset: int = SEEDS_PER_SUBSET, retrain: bool = True):
        torch.set_num_threads(1)
        self.setting, self.n_query = setting, setting.n_query
        self.tokenizer, self.train, self.queries = make_data(setting)
        self.query_batch = trim(ga.collate.pad_collate(self.queries))
        self.model = train_model(setting, self.train)
        # the hand-written target is causal_lm's loss (completion only for instruct): checked here too
        with torch.no_grad():
            mine = float(self.query_losses(self.model).sum())
            theirs = float(self.task().loss(self.model, self.query_batch))
        if abs(mine - theirs) > 1e-4 * abs(theirs):
            raise AssertionError(f"query targets {mine} ≠ the task's loss {theirs}")
        self.key = (f"{setting.name}-L{setting.n_layer}-d{setting.n_embd}-v{setting.vocab_size}-n{setting.n_train}"
                    f"-q{setting.n_query}-s{setting.train_steps}-b{setting.batch_size}-ts{TRAINING_SEED}"
                    f"-{self.tokenizer_digest()}")
        self.truth, self.truth_seconds, self.reliability = None, 0.0, None
        if not retrain:
            return
        t0 = time.perf_counter()
        seed_store(BUILD / self.key)                      # the committed runs (benchmarks/ground_truths.py)
        self.truth = ga.eval.retrain(self.train_fn, setting.n_train, n_subsets=n_subsets, fraction=FRACTION,
                                     seed=SUBSET_SEED, training_seed=TRAINING_SEED, targets_fn=self.query_losses,
                                     target="loss", store=BUILD / self.key, progress=progress,
                                     seeds_per_subset=seeds_per_subset)
        self.truth_seconds = time.perf_counter() - t0
        if seeds_per_subset > 1:
            self.reliability = ga.eval.reliability(self.truth)

    def tokenizer_digest(self) -> str:
        return hashlib.sha256(self.tokenizer.to_str().encode()).hexdigest()[:8]

    def train_fn(self, indices):
        """A subset's model, seeded by ``ga.eval.retrain`` (TRAINING_SEED + r for run r)."""
        return train_model(self.setting, [self.train[i] for i in indices], seed=torch.initial_seed())

    def query_losses(self, model):
        return query_losses(self.setting, model, self.query_batch)        # (n_query,)

    def task(self, model=None):
        return task_of(self.setting, model if model is not None else self.model)

    def fwd_bwd_seconds(self, repeats: int = 3) -> float:
        """Wall time of one plain forward + backward of the task's loss over the training set
        (batches of 32)."""
        task, best = self.task(), float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            for start in range(0, len(self.train), 32):
                batch = ga.collate.pad_collate(self.train[start:start + 32])
                self.model.zero_grad()
                task.loss(self.model, batch).backward()
            best = min(best, time.perf_counter() - t0)
        self.model.zero_grad()
        return best


# ------------------------------------------------------------------------------ methods
_CHECKPOINTS = {}


def checkpoints(p: Prepared):
    """3 evenly spaced (task, Adam optimizer) snapshots of the full-data run (cached)."""
    if p.setting.name not in _CHECKPOINTS:
        _, snaps = train_model(p.setting, p.train, checkpoints=3)
        _CHECKPOINTS[p.setting.name] = snaps
    snaps = _CHECKPOINTS[p.setting.name]
    return [p.task(s) for s, _ in snaps], [o for _, o in snaps], [3e-3] * len(snaps)


def method_rows(p: Prepared):
    """(method, configuration, thunk -> lazy Scores): every catalogue method at its defaults,
    called as ``method(task, train, queries)`` (checkpoint methods on the run's snapshots),
    then the variants fidelity_lm also reports, on the blocks only as there (``LAYERS``; the
    rows of 2026-12-05 with the same labels ran there too, the default layers then), and the
    tied-embedding rows (``tied_rows``)."""
    m, task, tr, qu = ga.methods, p.task(), p.train, p.queries
    yield "grad_dot", "defaults", lambda: m.grad_dot(task, tr, qu)
    yield "grad_cos", "defaults", lambda: m.grad_cos(task, tr, qu)
    yield "influence", "defaults (curvature='auto')", lambda: m.influence(task, tr, qu)
    yield "trak", defaults(m.trak, "k", "damping"), lambda: m.trak(task, tr, qu)
    yield "logra", defaults(m.logra, "k", "damping"), lambda: m.logra(task, tr, qu)
    yield "grass", defaults(m.grass, "k", "damping"), lambda: m.grass(task, tr, qu)
    yield "relatif", defaults(m.relatif, "damping"), lambda: m.relatif(task, tr, qu)
    yield "tracin", "defaults, 3 checkpoints of the Adam run", lambda: m.tracin(
        checkpoints(p)[0], checkpoints(p)[2], tr, qu)
    yield "less", defaults(m.less, "k") + ", 3 Adam checkpoints", lambda: m.less(
        *checkpoints(p), tr, qu, np.arange(len(qu)))
    yield "trackstar", defaults(m.trackstar, "k", "damping") + ", final Adam state", lambda: m.trackstar(
        checkpoints(p)[0][-1], tr, qu, optimizer=checkpoints(p)[1][-1])
    # fidelity_lm's variants, on the blocks only as there (``LAYERS``: the task's default layers
    # until 2026-12-06, what these rows measured then; the default since adds transformer.wte)
    L = LAYERS
    yield "influence", "EK-FAC", lambda: m.influence(task, tr, qu, layers=L, curvature="ekfac")
    yield "influence", "K-FAC", lambda: m.influence(task, tr, qu, layers=L, curvature="kfac")
    yield "influence", "DataInf", lambda: m.influence(task, tr, qu, layers=L, curvature="datainf")
    # RelatIF's previous default (an absolute 1e-3; "auto" since issue 31), kept for comparison
    yield "relatif", "EK-FAC, damping=0.001", lambda: m.relatif(task, tr, qu, layers=L, curvature="ekfac",
                                                              damping=1e-3)
    yield "less", "3 Adam checkpoints, sparse k=8192", lambda: m.less(
        *checkpoints(p), tr, qu, np.arange(len(qu)), layers=L, projector=ga.proj.sparse(8192, seed=0))
    # issue 31 item 4: the tied embedding / head in the curvature (block-only rows above)
    yield from tied_rows(task, tr, qu, LAYERS)


NOT_RUN = {
    "self_influence": "gives each training example's self-influence (n_train,), not query × train scores",
    "magic": "not run here: differentiates a replayable run, one replay per 8 queries (the LM settings' "
             "MAGIC section); over this benchmark's time on 2 shared cores",
    "source": "not run here: segments an SGD run (ga.unroll.TrainingRun); these runs use torch.optim.Adam",
}


# --------------------------------------------------------------------------------- run
def run(setting: TextSetting, *, only=None, configs=None, recompute=False, n_subsets=N_SUBSETS, progress=False,
        retrain_only=False, scores_only=False, seeds_per_subset=SEEDS_PER_SUBSET):
    """Ground truth, then every row of ``method_rows`` scored and written to the results file.
    ``scores_only``: no ground truth, the rows' scores computed into their cache only (to run
    beside a ``retrain_only`` process)."""
    p = Prepared(setting, n_subsets, progress, seeds_per_subset, retrain=not scores_only)
    label = setting.name + (f"-k{seeds_per_subset}" if seeds_per_subset > 1 else "")
    if not scores_only:
        print(f"[{label}] {setting.describe()}; ground truth {n_subsets} subsets × {seeds_per_subset} run(s) "
              f"ready in {p.truth_seconds:.0f} s", flush=True)
    if p.reliability is not None:
        print(f"  {p.reliability!r}", flush=True)
    if retrain_only:
        return []
    base = p.fwd_bwd_seconds()
    print(f"  plain forward+backward over the training set: {base:.3f} s", flush=True)
    out, rows = BUILD / f"results-{label}.json", []
    done = {(r["method"], r["config"]) for r in _read(out)} if not recompute else set()
    for method, config, thunk in method_rows(p):
        if (only and method not in only) or (method, config) in done or (
                configs and not config.startswith(configs)):
            continue
        row = {"setting": label, "method": method, "config": config}
        try:
            values, row["seconds"], row["fwd_bwd_seconds"] = cached_scores(p, method, config, thunk, base)
            row["cost"] = row["seconds"] / row["fwd_bwd_seconds"]
            if scores_only:
                print(f"  {method:10s} {config:44s} scores cached ({row['seconds']:.1f} s)", flush=True)
                continue
            if not np.isfinite(values.values).all():
                raise ValueError("non-finite scores")
            result = ga.eval.lds(values, p.truth, target="loss", bootstrap=1000, resample="both")
            row.update(lds=result.mean, low=result.interval[0], high=result.interval[1])
            print(f"  {method:10s} {config:44s} LDS {row['lds']:6.3f} [{row['low']:.3f}, {row['high']:.3f}]"
                  f"  {row['seconds']:6.2f} s ({row['cost']:.0f}× fwd+bwd)", flush=True)
        except Exception as exc:  # noqa: BLE001 - reported, not fatal
            row["skipped"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:160]
            print(f"  {method:10s} {config:44s} skipped: {row['skipped']}", flush=True)
            if scores_only:
                continue
        rows.append(row)
        _write(out, label, p, n_subsets, seeds_per_subset, base, row)      # an interrupted run keeps them
    for method, why in NOT_RUN.items():
        if not scores_only and (not only or method in only) and (method, "") not in done:
            _write(out, label, p, n_subsets, seeds_per_subset, base,
                   {"setting": label, "method": method, "config": "", "skipped": why})
    return rows


def cached_scores(p: Prepared, method: str, config: str, thunk, base: float):
    """(scores (n_query, n_train) DataArray, seconds of ``compute()``, the forward + backward
    seconds measured beside it) of one row, from ``build/fidelity/scores-<key>-<row>.npz`` when
    there (written otherwise): the costly part, computed once, resumable. Checked against
    the expression's content token kept beside the scores: after a default changes, the old
    expression's scores are recomputed, not served (:func:`fidelity_lm.cache_is_current`)."""
    import xarray as xr
    from fidelity_lm import cache_is_current, expression_token
    slug = hashlib.sha256(f"{method}|{config}".encode()).hexdigest()[:10]
    path = BUILD / f"scores-{p.key}-{method}-{slug}.npz"
    scores = thunk()
    token = expression_token(scores)
    current = False
    if path.exists():
        with np.load(path) as z:
            if (current := cache_is_current(z, token, path)):
                values, seconds, base = z["values"], float(z["seconds"]), float(z["fwd_bwd_seconds"])
    if not current:
        t0 = time.perf_counter()
        computed = scores.compute()                                         # (n_query, n_train)
        seconds = time.perf_counter() - t0
        for dim, n in (("query", p.n_query), ("train", len(p.train))):     # positions, as the truth's
            if computed.sizes[dim] != n or (dim in computed.coords and not np.array_equal(
                    np.asarray(computed[dim]), np.arange(n))):
                raise ValueError(f"scores' {dim} labels are not 0..{n - 1}")
        values = np.asarray(computed.transpose("query", "train").values)
        BUILD.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp.npz")
        np.savez(tmp, values=values, seconds=seconds, fwd_bwd_seconds=base, token=token)
        tmp.replace(path)
    return xr.DataArray(values, dims=("query", "train"), name=method), seconds, base


def _write(out: Path, label: str, p: Prepared, n_subsets: int, seeds_per_subset: int, base: float,
           row: dict) -> None:
    """Add (or replace) ``row`` in ``out``, read afresh, in fidelity_lm's results format
    (``fwd_bwd_seconds``: the median of the rows' own, which their costs divide by)."""
    rows = [r for r in _read(out) if (r["method"], r["config"]) != (row["method"], row["config"])] + [row]
    bases = [r["fwd_bwd_seconds"] for r in rows if "fwd_bwd_seconds" in r]   # each row's cost divides by its own
    base = float(np.median(bases)) if bases else base                      # (measured where its scores ran)
    rel = p.reliability
    BUILD.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps({
        "setting": label, "description": p.setting.describe(),
        "protocol": {"name": "subset-retrain",
                     "counterfactual": "each subset trained afresh: same init and batch-index stream, batches "
                                       "drawn from the subset" + (
                                           f"; {seeds_per_subset} runs per subset, run r with seed "
                                           f"{TRAINING_SEED} + r (init and batch stream), targets averaged"
                                           if seeds_per_subset > 1 else ""),
                     "n_subsets": n_subsets, "fraction": FRACTION,
                     "queries": f"the first {p.n_query} of {p.setting.n_query}",
                     "seeds_per_subset": seeds_per_subset,
                     "training_seed": TRAINING_SEED if seeds_per_subset == 1 else
                     f"{TRAINING_SEED} + r for run r = 0 … {seeds_per_subset - 1}",
                     "target": ("query completion loss (sum of the completion tokens' NLL)"
                                if p.setting.kind == "instruct" else "query loss (sum of token NLL)"),
                     "interval": "95% percentile bootstrap over queries and subsets"},
        **({"reliability": {"test_retest": rel.retest, "test_retest_interval": list(rel.interval),
                            "ceiling": rel.ceiling, "ceiling_one_run": rel.ceiling_with(1)}}
           if rel is not None else {}),
        "fwd_bwd_seconds": base, "rows": rows}, indent=1))
    tmp.replace(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--settings", default="text,instruct")
    ap.add_argument("--methods", default=None, help="comma-separated method names")
    ap.add_argument("--configs", default=None, help="'|'-separated prefixes: only the rows whose configuration "
                    "starts with one (e.g. 'defaults|EK-FAC, blocks +')")
    ap.add_argument("--n-subsets", type=int, default=N_SUBSETS)
    ap.add_argument("--seeds-per-subset", type=int, default=SEEDS_PER_SUBSET,
                    help="training runs per subset (seeds TRAINING_SEED + r), targets averaged; ≥ 2 also "
                         "measures the ground truth's test–retest correlation and LDS ceiling")
    ap.add_argument("--retrain-only", action="store_true")
    ap.add_argument("--scores-only", action="store_true", help="only the rows' scores, into their cache "
                    "(no ground truth): to run beside a --retrain-only process")
    ap.add_argument("--recompute", action="store_true",
                    help="rerun rows already in the results file (their scores from the cache)")
    ap.add_argument("--progress", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    ga.options(progress=False)
    only = set(args.methods.split(",")) if args.methods else None
    configs = tuple(args.configs.split("|")) if args.configs else None
    for name in args.settings.split(","):
        run(SETTINGS[name], only=only, configs=configs, recompute=args.recompute, n_subsets=args.n_subsets,
            progress=args.progress, retrain_only=args.retrain_only, scores_only=args.scores_only,
            seeds_per_subset=args.seeds_per_subset)


if __name__ == "__main__":
    main()
