"""Fidelity on a language model: LDS against retraining for a small GPT-2.

Two settings of tutorial 03's kind ("language recovery"): synthetic languages over 30
number tokens, ``x_{t+1} = x_t + s_k (mod 30)``, random start, 5 % token noise, lengths
8–16, dict items of unequal length (no glue). A GPT-2 from a random-init config is trained
briefly (Adam, lr 3e-3, batch 32, a fixed number of steps, the mean over sequences of the
per-sequence *mean* token loss: the tutorial's recipe).

    lm      2 layers, n_embd 64, 4 heads; steps s ∈ {+1, −1, +7, −7}; 256 training
            sequences, 64 queries, 300 steps           (the setting defaults are chosen on)
    lm2     2 layers, n_embd 32, 2 heads; steps s ∈ {+2, −3, +5, −5}; 256 training
            sequences, 48 queries, 250 steps           (held out: defaults checked here)

Ground truth (``ga.eval.retrain``): ``N_SUBSETS`` random 50 % subsets; the target is each
query's loss L_q = Σ_t −log p(x_t | x_<t) (the sum over its tokens, ``ga.tasks.causal_lm``'s
loss). Two protocols (``--protocol``), named in every results file:

    subset-retrain  (default) each subset is trained afresh with **one training seed for
                    every subset**: the same initialisation and the same batch-index
                    stream, drawn over the *subset* (batches of 32 of its examples), so
                    the targets differ through the data only. Results:
                    ``results-<setting>.json``.
    unrolled        the full run as a replayable ``ga.unroll.TrainingRun`` (same
                    initialisation, the full set's batch-index stream, ``ga.unroll.Adam``,
                    batch loss Σ_B ε_i ℓ_i / Σ_B ε_i); subset S retrains *that run* with
                    ε = 1 on S and 0 elsewhere (its batches keep their order and become
                    the ≈ 16 of their 32 examples in S). The counterfactual MAGIC
                    differentiates (as the MAGIC paper's LDS). Methods other than MAGIC
                    score the run's own final model. Results:
                    ``results-<setting>-unrolled.json``.

``--seeds-per-subset K`` (subset-retrain only) trains every subset K times, run r with
seed TRAINING_SEED + r (every subset's run r shares it), and scores against the mean of
the K runs; the header then prints ``ga.eval.reliability`` of the ground truth (the
test–retest correlation between runs, and the LDS ceiling it implies). Results:
``results-<setting>-k<K>.json``. Run 0 is the one-run ground truth, so the runs it
already stored are kept.

MAGIC (``ga.methods.magic``, checkpointing "sqrt") differentiates the replayable run
under both protocols: the full runs of the two protocols are the same recipe (the
replayable one uses ``ga.unroll.Adam`` and eager attention — a twice-differentiable
attention, which PyTorch's fused CPU attention is not — so its weights differ from
the subset-retrain model's by float rounding). Its scores (the costly part) are cached
under ``build/fidelity/magic-<setting>….npz``; its cost is ≈ linear in the queries, so
``--queries N`` scores every row on the first N queries only (results files then end in
``-qN``; the rows are then a short list beside MAGIC). Why MAGIC's LDS is low on these
runs: ``benchmarks/fidelity_lm_linearity.py``. LDS:
``ga.eval.lds(..., target="loss")``, Spearman per query over subsets, averaged over
queries, 95 % percentile-bootstrap intervals over queries *and* subsets
(``resample="both"``). Every method scores with ``ga.tasks.causal_lm(model)``.

Layers. Each method's **defaults** row (its configuration starts with ``defaults``, is
empty, or is TracIn's "3 checkpoints of the Adam run") passes no ``layers=``: it measures
the task's default layers, what a user gets — ``ga.TransformerBlocks(vocabulary="auto")``,
here the linear layers of the blocks and the tied ``transformer.wte`` / ``lm_head`` (a
31-token vocabulary, within ``ga.options(vocabulary_layers_max)``; since 2026-12-06).
Beside it, the same call on the blocks only, ``layers=["transformer.h.*"]``, labelled
``…, blocks only (layers=['transformer.h.*'])``: what these rows measured before (never a
default point of the frontier). **Every other row** — the variants (K-FAC, DataInf, the
sparse references, "EK-FAC (default damping)", …), ``--rows sweeps`` and ``--rows
ensembles``, and the rows scored beside MAGIC on the first ``--queries`` — names the blocks
only (``LAYERS``); ``--rows tied`` names its layers in each label.

Retrained models' targets are cached (resumable) under ``build/fidelity/``; rows are
written to ``build/fidelity/results-<setting>.json``.

Cost is the wall time of ``Scores.compute()`` divided by the wall time of one plain
forward + backward pass over the training set in batches of 32 (measured in the same
process, right before).

    PYTHONPATH=. OMP_NUM_THREADS=1 nice -n 10 python benchmarks/fidelity_lm.py --settings lm
    ... --retrain-only          # only the ground truth (resumable)
    ... --methods trak,logra    # rows whose method name is in the list
    ... --rows sweeps           # the knob sweeps behind the defaults
    ... --rows ensembles        # influence / RelatIF averaged over 5 and 10 seeds, over 5, 10, 20
                                # models trained on random 50 % subsets, and over the last 5 / 10 of
                                # 10 checkpoints of 1 or 10 runs (cost counts training the extra models)
    ... --rows tied             # K-FAC / EK-FAC with the tied embedding/head (layers="all") in the curvature
    ... --protocol unrolled --queries 16   # MAGIC's cost is ≈ linear in the queries
    ... --seeds-per-subset 4    # each subset trained 4 times; the reliability and LDS ceiling printed
"""
from __future__ import annotations

import argparse
import json
import sys
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
from ground_truths import seed_store  # noqa: E402

BUILD = ROOT / "build" / "fidelity"
N_NUM, PAD, T_MAX = 30, 0, 16
N_SUBSETS, FRACTION, SUBSET_SEED, TRAINING_SEED = 50, 0.5, 0, 0
LAYERS = ["transformer.h.*"]


@dataclass(frozen=True)
class LMSetting:
    name: str
    n_layer: int
    n_embd: int
    n_head: int
    steps: tuple
    n_train: int
    n_query: int
    train_steps: int = 300
    corpus_seed: int = 0

    def describe(self) -> str:
        return (f"GPT-2 {self.n_layer} layers, n_embd {self.n_embd}, {self.n_head} heads; languages "
                f"{self.steps}; {self.n_train} training sequences, {self.n_query} queries, "
                f"{self.train_steps} Adam steps")


SETTINGS = {
    "lm": LMSetting("lm", 2, 64, 4, (+1, -1, +7, -7), 256, 64),
    "lm2": LMSetting("lm2", 2, 32, 2, (+2, -3, +5, -5), 256, 48, train_steps=250, corpus_seed=10),
}


# --------------------------------------------------------------------------------- data
def make_corpus(setting: LMSetting, n_per_lang: int, seed: int, noise: float = 0.05):
    """Dict items (input_ids, attention_mask) of unequal length, and each one's language."""
    g = torch.Generator().manual_seed(seed)
    rows, langs = [], []
    for k, step in enumerate(setting.steps):
        for _ in range(n_per_lang):
            length = int(torch.randint(8, T_MAX + 1, (1,), generator=g))
            start = int(torch.randint(0, N_NUM, (1,), generator=g))
            seq = (start + step * torch.arange(length)) % N_NUM
            noisy = torch.rand(length, generator=g) < noise
            seq = torch.where(noisy, torch.randint(0, N_NUM, (length,), generator=g), seq)
            rows.append({"input_ids": seq + 1, "attention_mask": torch.ones(length, dtype=torch.long)})
            langs.append(k)
    order = torch.randperm(len(rows), generator=g).tolist()
    return [rows[i] for i in order], np.array(langs)[order]


def new_model(setting: LMSetting, attention: str = "sdpa") -> GPT2LMHeadModel:
    """The setting's GPT-2 from the current torch seed. ``attention="eager"`` for a run
    that is differentiated through (MAGIC differentiates the gradient; the fused CPU
    attention has no second derivative)."""
    cfg = GPT2Config(n_layer=setting.n_layer, n_embd=setting.n_embd, n_head=setting.n_head,
                     vocab_size=N_NUM + 1, n_positions=T_MAX, resid_pdrop=0.0, embd_pdrop=0.0,
                     attn_pdrop=0.0, bos_token_id=PAD, eos_token_id=PAD, attn_implementation=attention)
    return GPT2LMHeadModel(cfg)


def sequence_losses(model, batch):
    """(B,) each sequence's mean token NLL: the training loss of one example."""
    return token_losses(model, batch).sum(1) / batch["attention_mask"][:, 1:].sum(1)


def query_token_loss_sums(model, batch):
    """(B,) each query's Σ_t NLL: the LDS target."""
    return token_losses(model, batch).sum(1)


def batch_stream(n: int, steps: int, seed: int = TRAINING_SEED) -> list:
    """The training batches' indices into a set of n examples: 32 drawn with replacement
    per step from ``torch.Generator().manual_seed(seed + 1)`` (train_model's stream)."""
    g = torch.Generator().manual_seed(seed + 1)
    return [torch.randint(0, n, (32,), generator=g) for _ in range(steps)]


def replayable_run(setting: LMSetting, items, *, seed=TRAINING_SEED) -> "ga.unroll.TrainingRun":
    """train_model's run on ``items`` as a ``ga.unroll.TrainingRun``: the same seeded
    init, the same batch stream, Adam lr 3e-3, per-sequence mean token loss averaged
    over the batch (reduction "weighted_mean": Σ_B ε_i ℓ_i / Σ_B ε_i)."""
    torch.manual_seed(seed)
    model = new_model(setting, attention="eager")
    data = ga.collate.pad_collate(items)                       # (n, T_MAX) input_ids, attention_mask
    return ga.unroll.TrainingRun(model, sequence_losses, data, ga.unroll.Adam(3e-3),
                                 batches=batch_stream(len(items), setting.train_steps, seed),
                                 reduction="weighted_mean")


def token_losses(model, batch):
    """(B, T-1) next-token NLL, zero on padding."""
    ids, mask = batch["input_ids"], batch["attention_mask"]
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
    targets = ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
    return torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets, reduction="none")


def train_model(setting: LMSetting, items, *, checkpoints=0, seed=TRAINING_SEED):
    """Train from the seeded random init. With ``checkpoints`` > 0, also return that
    many (model, optimizer) snapshots evenly spaced over the run (for TracIn / LESS)."""
    torch.manual_seed(seed)
    model = new_model(setting)
    batch = ga.collate.pad_collate(items)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    every = setting.train_steps // checkpoints if checkpoints else 0
    snapshots = []
    for step, b in enumerate(batch_stream(len(items), setting.train_steps, seed), start=1):
        part = {k: v[b] for k, v in batch.items()}
        loss = sequence_losses(model, part).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if every and step % every == 0:
            import copy
            snap = copy.deepcopy(model).eval()
            snap_opt = torch.optim.Adam(snap.parameters(), lr=3e-3)
            snap_opt.load_state_dict(opt.state_dict())
            snapshots.append((snap, snap_opt))
    return (model.eval(), snapshots) if checkpoints else model.eval()


PROTOCOLS = ("subset-retrain", "unrolled")


class Prepared:
    """A setting's corpus, full-data model and ground truth under ``protocol``."""

    def __init__(self, setting: LMSetting, n_subsets: int = N_SUBSETS, progress: bool = False,
                 protocol: str = "subset-retrain", queries: int | None = None, retrain: bool = True,
                 seeds_per_subset: int = 1):
        if protocol not in PROTOCOLS:
            raise ValueError(f"protocol must be one of {PROTOCOLS}, got {protocol!r}")
        if protocol == "unrolled" and seeds_per_subset != 1:
            raise ValueError("the unrolled protocol replays the one full run: --seeds-per-subset must be 1 there")
        self.setting, self.protocol = setting, protocol
        self.n_query = setting.n_query if queries is None else min(int(queries), setting.n_query)   # LDS queries
        self.train, self.lang = make_corpus(setting, setting.n_train // len(setting.steps), setting.corpus_seed)
        self.queries, self.lang_q = make_corpus(setting, setting.n_query // len(setting.steps),
                                                setting.corpus_seed + 1)
        self.query_batch = ga.collate.pad_collate(self.queries)
        torch.set_num_threads(1)
        self._run = None
        self.model = (None if not retrain else self.run.train() if protocol == "unrolled"
                      else train_model(setting, self.train))
        self.key = (f"{setting.name}-L{setting.n_layer}-d{setting.n_embd}-n{setting.n_train}"
                    f"-q{setting.n_query}-s{setting.train_steps}-ts{TRAINING_SEED}")
        store = BUILD / (self.key + ("-unrolled" if protocol == "unrolled" else ""))
        self.truth, self.truth_seconds, self.reliability = None, 0.0, None
        if not retrain:
            return
        t0 = time.perf_counter()
        seed_store(store)                                 # the committed runs (benchmarks/ground_truths.py)
        self.truth = ga.eval.retrain(self.train_fn, setting.n_train, n_subsets=n_subsets, fraction=FRACTION,
                                     seed=SUBSET_SEED, training_seed=TRAINING_SEED, targets_fn=self.query_losses,
                                     target="loss", store=store, progress=progress,
                                     seeds_per_subset=seeds_per_subset)
        self.truth_seconds = time.perf_counter() - t0
        if seeds_per_subset > 1:
            self.reliability = ga.eval.reliability(self.truth.isel(query=slice(0, self.n_query)))

    @property
    def run(self) -> "ga.unroll.TrainingRun":
        """The full training run, replayable (built on first use)."""
        if self._run is None:
            self._run = replayable_run(self.setting, self.train)
        return self._run

    def train_fn(self, indices):
        """A subset's model; its training seed is the one ``ga.eval.retrain`` seeded torch with
        (TRAINING_SEED for a subset's first run, TRAINING_SEED + r for its run r)."""
        if self.protocol == "unrolled":                   # the same run, ε = 1 on the subset, 0 elsewhere
            weights = torch.zeros(len(self.train))
            weights[torch.as_tensor(indices)] = 1.0
            return self.run.train(weights)
        return train_model(self.setting, [self.train[i] for i in indices], seed=torch.initial_seed())

    def query_losses(self, model):
        with torch.no_grad():
            return token_losses(model, self.query_batch).sum(1)          # (n_query,) Σ_t NLL

    def task(self, model=None):
        return ga.tasks.causal_lm(model if model is not None else self.model, name=f"gpt2-{self.setting.name}")

    def fwd_bwd_seconds(self, repeats: int = 3) -> float:
        """Wall time of one plain forward + backward over the training set (batches of 32)."""
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            for start in range(0, len(self.train), 32):
                batch = ga.collate.pad_collate(self.train[start:start + 32])
                self.model.zero_grad()
                token_losses(self.model, batch).sum().backward()
            best = min(best, time.perf_counter() - t0)
        self.model.zero_grad()
        return best


# ------------------------------------------------------------------------------ methods
def defaults(fn, *names) -> str:
    """'defaults (k=512, ...)': the label names the default values it ran with."""
    import inspect
    params = inspect.signature(fn).parameters
    return "defaults (" + ", ".join(f"{n}={label_value(params[n].default)}" for n in names) + ")"


def expression_token(scores) -> str | None:
    """The content token of a row's lazy scores (``scores.expr.token``): it names the
    expression with every resolved argument, a method's defaults included, so a cache
    entry written under another default no longer matches. None for scores that are not a
    lazy expression (MAGIC's replay). A :class:`WithOptions` row's token is its expression's
    with the planner options it is computed under (``…|ga.options(kron_diagonal_width=512)``):
    without it such a row had no token, and its cache was served whatever the default
    (issue 31: the vocabulary-factor-diagonal rows of 2026-12-05 kept the 0.1 × mean damping
    of K-FAC / EK-FAC after the per-block default, while their dense twins were rerun)."""
    if isinstance(scores, WithOptions):
        inner = expression_token(scores.scores)
        changes = ", ".join(f"{k}={v!r}" for k, v in sorted(scores.changes.items()))
        return None if inner is None else f"{inner}|ga.options({changes})"
    return getattr(getattr(scores, "expr", None), "token", None)


def cache_is_current(cached, token: str | None, path) -> bool:
    """Whether a cached ``.npz`` holds the scores of the expression ``token`` names: its
    stored ``token`` equals it. An entry without a token (written before tokens were kept)
    or under another token is stale: it is recomputed, and the reason printed."""
    if token is None:
        return True
    stored = str(cached["token"]) if "token" in cached.files else None
    if stored == token:
        return True
    why = "no expression token (written before tokens were kept)" if stored is None else \
        f"written for {stored}, the row is now {token} (a default or the method changed)"
    print(f"    recomputing {Path(path).name}: {why}", flush=True)
    return False


def label_value(v) -> str:
    """A default as a label shows it: numbers by :g, anything else (damping="auto") by repr."""
    return f"{v:g}" if isinstance(v, (int, float)) and not isinstance(v, bool) else repr(v)


class CachedMagic:
    """MAGIC's scores for the setting's replayable run on the first ``n_query`` queries,
    computed in chunks of ``MAGIC_CHUNK`` queries (one replay each: the cost is ≈ linear
    in the queries carried) and kept in ``build/fidelity/magic-<key>-<schedule>-q<a>-<b>.npz``
    (scores and the seconds they took): the same scores serve both protocols, and an
    interrupted benchmark resumes at the next chunk. ``seconds`` is the sum over the chunks."""

    def __init__(self, p: Prepared, n_query: int, checkpointing="sqrt"):
        self.p, self.n_query, self.checkpointing = p, n_query, checkpointing
        self.seconds = None

    def _chunk(self, a: int, b: int) -> tuple[np.ndarray, float]:
        path = BUILD / f"magic-{self.p.key}-{self.checkpointing}-q{a}-{b}.npz"
        if path.exists():
            cached = np.load(path)
            return cached["values"], float(cached["seconds"])
        queries = {k: v[a:b] for k, v in self.p.query_batch.items()}
        lazy = ga.methods.magic(self.p.run, queries, query_loss=query_token_loss_sums,
                                checkpointing=self.checkpointing)
        t0 = time.perf_counter()
        values = lazy.compute().values                                   # (b - a, n_train)
        seconds = time.perf_counter() - t0
        BUILD.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp.npz")
        np.savez(tmp, values=values, seconds=seconds, stored_states_peak=lazy.metagradients.ledger.peak,
                 forward_steps=lazy.metagradients.ledger.forward_steps)
        tmp.replace(path)
        print(f"    magic queries {a}–{b}: {seconds:.0f} s", flush=True)
        return values, seconds

    def compute(self):
        import xarray as xr
        parts = [self._chunk(a, min(a + MAGIC_CHUNK, self.n_query)) for a in range(0, self.n_query, MAGIC_CHUNK)]
        self.seconds = sum(sec for _, sec in parts)
        return xr.DataArray(np.concatenate([v for v, _ in parts]), dims=("query", "train"), name="magic")


MAGIC_CHUNK = 8


def default_layer_rows(rows):
    """Each (method, defaults label, thunk(layers) -> lazy Scores) twice: at the task's default
    layers (``layers=None``: what a user gets; for these GPT-2s the blocks and the tied
    ``transformer.wte``, V = 31 ≤ ``ga.options(vocabulary_layers_max)``), labelled as given,
    then on the blocks only, labelled ``<label>`` + ``BLOCKS_ONLY`` (the rows' layers before
    2026-12-06, kept as a named variant)."""
    for method, config, thunk in rows:
        yield method, config, lambda thunk=thunk: thunk(None)
        yield method, (config or "defaults") + BLOCKS_ONLY, lambda thunk=thunk: thunk(LAYERS)


#: the label suffix of a row that names the blocks only (never a default point: it names ``layers=``)
BLOCKS_ONLY = ", blocks only (layers=['transformer.h.*'])"


def method_rows(p: Prepared):
    """(method, configuration, thunk -> lazy Scores): defaults first, then variants. Each
    method's defaults row runs at the task's default layers and again on the blocks only
    (``default_layer_rows``); every other row names the blocks (``LAYERS``)."""
    m, task, tr, qu, L = ga.methods, p.task(), p.train, p.queries[:p.n_query], LAYERS
    magic = ("magic", "replayable run, checkpointing='sqrt'", lambda: CachedMagic(p, p.n_query))
    if p.protocol == "unrolled" or p.n_query < p.setting.n_query:   # beside MAGIC: the few that place it
        yield "influence", "EK-FAC (default damping)", lambda: m.influence(task, tr, qu, layers=L, curvature="ekfac")
        yield "relatif", "EK-FAC", lambda: m.relatif(task, tr, qu, layers=L, curvature="ekfac")
        yield "trak", defaults(m.trak, "k", "damping"), lambda: m.trak(task, tr, qu, layers=L)
        yield "logra", defaults(m.logra, "k", "damping"), lambda: m.logra(task, tr, qu, layers=L)
        yield "grad_dot", "", lambda: m.grad_dot(task, tr, qu, layers=L)
        yield magic
        return
    yield from default_layer_rows([
        ("influence", defaults(m.influence, "curvature"), lambda L: m.influence(task, tr, qu, layers=L)),
        ("trak", defaults(m.trak, "k", "damping"), lambda L: m.trak(task, tr, qu, layers=L)),
        ("logra", defaults(m.logra, "k", "damping"), lambda L: m.logra(task, tr, qu, layers=L)),
        ("grass", defaults(m.grass, "k", "damping"), lambda L: m.grass(task, tr, qu, layers=L)),
        ("grad_dot", "", lambda L: m.grad_dot(task, tr, qu, layers=L)),
        ("relatif", defaults(m.relatif, "damping"), lambda L: m.relatif(task, tr, qu, layers=L)),
        ("grad_cos", "", lambda L: m.grad_cos(task, tr, qu, layers=L)),
        ("tracin", "3 checkpoints of the Adam run", lambda L: m.tracin(*_checkpoints(p, "tracin"), tr, qu, layers=L)),
        # LESS at its defaults: the dense k=8192 Rademacher map within ga.options(dense_projection_bytes),
        # else an SJLT (refused here before 2026-12-05, when the default was always dense)
        ("less", defaults(m.less, "k") + ", 3 Adam checkpoints", lambda L: m.less(
            *_checkpoints(p, "less"), tr, qu, np.arange(len(qu)), layers=L)),
        # TrackStar at the run's last checkpoint (the final model and its Adam state), train R only
        ("trackstar", defaults(m.trackstar, "k", "damping") + ", final Adam state", lambda L: m.trackstar(
            _checkpoints(p, "less")[0][-1], tr, qu, optimizer=_checkpoints(p, "less")[1][-1], layers=L)),
    ])
    # the variants, on the blocks only
    yield "influence", "EK-FAC (default damping)", lambda: m.influence(task, tr, qu, layers=L, curvature="ekfac")
    yield "influence", "K-FAC", lambda: m.influence(task, tr, qu, layers=L, curvature="kfac")
    # the plain references of TRAK's and GraSS's math: influence in a 2048-d sparse projection
    yield "influence", "empirical Fisher, sparse k=2048", lambda: m.influence(
        task, tr, qu, layers=L, curvature="empirical", projector=ga.proj.sparse(2048, seed=0))
    yield "influence", "Gauss-Newton, sparse k=2048", lambda: m.influence(
        task, tr, qu, layers=L, projector=ga.proj.sparse(2048, seed=0))
    # RelatIF's previous default (an absolute 1e-3; "auto" since issue 31), kept for comparison
    yield "relatif", "EK-FAC, damping=0.001", lambda: m.relatif(task, tr, qu, layers=L, curvature="ekfac",
                                                              damping=1e-3)
    yield "influence", "DataInf", lambda: m.influence(task, tr, qu, layers=L, curvature="datainf")
    yield "grass", "GraSS (unfactored)", lambda: m.grass(task, tr, qu, layers=L, factored=False)
    yield "less", "3 Adam checkpoints, sparse k=8192", lambda: m.less(
        *_checkpoints(p, "less"), tr, qu, np.arange(len(qu)), layers=L, projector=ga.proj.sparse(8192, seed=0))
    yield magic


def knob_rows(p: Prepared):
    """The sweeps behind the defaults: each method's main knob on this setting."""
    m, task, tr, qu, L = ga.methods, p.task(), p.train, p.queries, LAYERS
    token = ga.tasks.causal_lm(p.model, trak_output="token")
    for k in (128, 2048):
        yield "trak", f"k={k}", lambda k=k: m.trak(task, tr, qu, layers=L, k=k)
    for r in (0.01, 0.1, 10.0):
        yield "trak", f"relative_damping={r:g}", lambda r=r: m.trak(task, tr, qu, layers=L, relative_damping=r)
    yield "trak", "trak_output='token'", lambda: m.trak(token, tr, qu, layers=L)
    for k in (256, 1024, 4096):
        yield "logra", f"k={k}", lambda k=k: m.logra(task, tr, qu, layers=L, k=k)
    for d in (1e-1, 1e-2):
        yield "logra", f"damping={d:g}", lambda d=d: m.logra(task, tr, qu, layers=L, damping=d)
    for r in (1.0, 10.0, 0.01):
        yield "grass", f"relative_damping={r:g}", lambda r=r: m.grass(task, tr, qu, layers=L, relative_damping=r)
    for k in (64, 1024):
        yield "grass", f"k={k}", lambda k=k: m.grass(task, tr, qu, layers=L, k=k)
    yield "grass", "k=1024, relative_damping=1", lambda: m.grass(task, tr, qu, layers=L, k=1024, relative_damping=1.0)


class TimedEnsemble:
    """``ga.methods.ensemble`` of ``method`` over M models (× checkpoints); ``seconds``
    counts training the models beyond the full-data run as well as the scores: what a
    user of the ensemble pays.

    kind "seeds": the full-data model and M − 1 more trained on the whole training set
    with their own seeds (initialisation and batch stream: ``train_model(seed=TRAINING_SEED
    + m)``). kind "subsets" (TRAK's recipe): M models each trained on a random 50 % subset
    (``ga.eval.subset_masks(n, M, FRACTION, seed=ENSEMBLE_SUBSET_SEED)``: drawn
    independently of the ground truth's subsets, seed ``SUBSET_SEED``) with its own seed.
    ``checkpoints=c``: every seed's run contributes its last c of ``CHECKPOINTS`` evenly
    spaced snapshots (the full-data run's own checkpoints are free: a user saves them while
    training), each a member."""

    def __init__(self, p: Prepared, method, members: int, kind: str = "seeds", checkpoints: int = 1, **kwargs):
        self.p, self.method, self.members, self.kind, self.checkpoints = p, method, members, kind, checkpoints
        self.kwargs, self.seconds = kwargs, None

    def compute(self):
        models, train_seconds = (_ensemble_models(self.p, self.members, self.kind) if self.checkpoints == 1
                                 else _checkpoint_models(self.p, self.members, self.checkpoints))
        tasks = [self.p.task(m) for m in models]
        t0 = time.perf_counter()
        out = ga.methods.ensemble(self.method, tasks, self.p.train, self.p.queries[:self.p.n_query],
                                  layers=LAYERS, **self.kwargs).compute()
        self.seconds = train_seconds + time.perf_counter() - t0
        return out


_ENSEMBLE_MODELS = {}
ENSEMBLE_SUBSET_SEED = 1
CHECKPOINTS = 10          # snapshots per run for the checkpoint ensembles (every 1/10 of the steps)


def _ensemble_models(p: Prepared, members: int, kind: str = "seeds"):
    """The ensemble's models (cached per setting and kind) and the seconds training them took
    (kind "seeds": the full-data model and ``members`` − 1 retrained with other seeds; kind
    "subsets": ``members`` models on random 50 % subsets, each with its own seed)."""
    have = _ENSEMBLE_MODELS.setdefault((p.setting.name, kind), [])
    extra = members - 1 if kind == "seeds" else members
    if kind == "subsets" and len(have) < extra:     # row m does not depend on how many are drawn
        masks = ga.eval.subset_masks(len(p.train), extra, FRACTION, seed=ENSEMBLE_SUBSET_SEED)
    while len(have) < extra:
        m = len(have)
        items = p.train if kind == "seeds" else [p.train[i] for i in np.flatnonzero(masks[m])]
        t0 = time.perf_counter()
        model = train_model(p.setting, items, seed=TRAINING_SEED + m + 1)
        have.append((model, time.perf_counter() - t0))
    trained = have[:extra]
    models = [m for m, _ in trained]
    return ([p.model] + models if kind == "seeds" else models), sum(sec for _, sec in trained)


def _checkpoint_models(p: Prepared, seeds: int, last: int):
    """The last ``last`` of ``CHECKPOINTS`` snapshots of each of ``seeds`` full-data runs
    (seed TRAINING_SEED + s; s = 0 is the setting's own run), and the seconds training the
    runs other than s = 0 took."""
    runs = _ENSEMBLE_MODELS.setdefault((p.setting.name, "checkpoints"), [])
    while len(runs) < seeds:
        t0 = time.perf_counter()
        _, snaps = train_model(p.setting, p.train, checkpoints=CHECKPOINTS, seed=TRAINING_SEED + len(runs))
        runs.append(([m for m, _ in snaps], time.perf_counter() - t0))
    return [m for snaps, _ in runs[:seeds] for m in snaps[-last:]], sum(sec for _, sec in runs[1:seeds])


def ensemble_rows(p: Prepared):
    """Influence and RelatIF (EK-FAC) averaged over M models trained with other seeds, over
    M models trained on random 50 % subsets, and over checkpoints of M runs."""
    m = ga.methods
    for M in (5, 10):
        for name, fn in (("relatif", m.relatif), ("influence", m.influence)):
            yield name, f"EK-FAC, ensemble of {M} seeds", lambda fn=fn, M=M: TimedEnsemble(p, fn, M,
                                                                                           curvature="ekfac")
    for M in (5, 10, 20):
        for name, fn in (("relatif", m.relatif), ("influence", m.influence)):
            yield name, f"EK-FAC, ensemble of {M} models on 50 % subsets", lambda fn=fn, M=M: TimedEnsemble(
                p, fn, M, kind="subsets", curvature="ekfac")
    for M, last in ((1, 5), (1, 10), (10, 5), (10, 10)):
        for name, fn in (("relatif", m.relatif), ("influence", m.influence)):
            yield name, f"EK-FAC, {M} seed(s) × last {last} of {CHECKPOINTS} checkpoints", \
                lambda fn=fn, M=M, last=last: TimedEnsemble(p, fn, M, checkpoints=last, curvature="ekfac")



class WithOptions:
    """Lazy scores computed (and explained) under ``ga.options(**changes)``: a row whose
    configuration is an option of the planner, not an argument of the method. Its cache
    token names the options too (:func:`expression_token`)."""

    def __init__(self, scores, **changes):
        self.scores, self.changes = scores, changes

    def compute(self):
        with ga.options(**self.changes):
            return self.scores.compute()

    def explain(self):
        with ga.options(**self.changes):
            return self.scores.explain()


def tied_rows(task, tr, qu, blocks, tied: str = "transformer.wte", diagonal: bool = True):
    """K-FAC / EK-FAC influence with the tied embedding / head in the curvature (issue 31 item 4),
    beside the block-only rows: ``layers="all"`` (also the norms), the blocks and the tied
    embedding by name, RelatIF (EK-FAC) with ``layers="all"``; as references without a
    Kronecker factorisation, Gauss-Newton influence in a sparse k = 2048 projection on the
    blocks only and with ``layers="all"``, Grad-Dot and LoGra with ``layers="all"``; and
    ``layers="all"`` with the vocabulary-wide output factor S (V×V) kept
    diagonal as the planner does past ``ga.options(kron_diagonal_width)`` (16,384 by default;
    set to 512 here so a vocabulary of 1,024 takes that path; ``diagonal=False`` leaves
    these rows out, for a vocabulary under 512 where they equal the dense ones)."""
    m = ga.methods
    yield "influence", "K-FAC, layers='all' (tied embedding/head included)", lambda: m.influence(
        task, tr, qu, layers="all", curvature="kfac")
    yield "influence", "EK-FAC, layers='all' (tied embedding/head included)", lambda: m.influence(
        task, tr, qu, layers="all", curvature="ekfac")
    yield "influence", f"EK-FAC, blocks + {tied} (tied) by name", lambda: m.influence(
        task, tr, qu, layers=list(blocks) + [tied], curvature="ekfac")
    # damping=1e-3: RelatIF's default when these rows were measured (2026-12-05; "auto" since),
    # pinned so that the cached scores and the tied-embedding table stay what they say
    yield "relatif", "EK-FAC, layers='all' (tied embedding/head included)", lambda: m.relatif(
        task, tr, qu, layers="all", curvature="ekfac", damping=1e-3)
    # references without a Kronecker factorisation: what including the embedding does to the
    # Gauss-Newton influence in a 2048-d sparse projection, and to the plain inner product
    yield "influence", "Gauss-Newton, sparse k=2048, blocks only (reference)", lambda: m.influence(
        task, tr, qu, layers=list(blocks), projector=ga.proj.sparse(2048, seed=0))
    yield "influence", "Gauss-Newton, sparse k=2048, layers='all' (reference)", lambda: m.influence(
        task, tr, qu, layers="all", projector=ga.proj.sparse(2048, seed=0))
    yield "grad_dot", "layers='all'", lambda: m.grad_dot(task, tr, qu, layers="all")
    yield "logra", "layers='all' (defaults otherwise)", lambda: m.logra(task, tr, qu, layers="all")
    if not diagonal:
        return
    yield "influence", "EK-FAC, layers='all', vocabulary factor diagonal (kron_diagonal_width=512)", \
        lambda: WithOptions(m.influence(task, tr, qu, layers="all", curvature="ekfac"), kron_diagonal_width=512)
    yield "influence", "K-FAC, layers='all', vocabulary factor diagonal (kron_diagonal_width=512)", \
        lambda: WithOptions(m.influence(task, tr, qu, layers="all", curvature="kfac"), kron_diagonal_width=512)

_CHECKPOINTS = {}


def _checkpoints(p: Prepared, kind: str):
    key = p.setting.name
    if key not in _CHECKPOINTS:
        _, snaps = train_model(p.setting, p.train, checkpoints=3)
        _CHECKPOINTS[key] = snaps
    snaps = _CHECKPOINTS[key]
    tasks = [p.task(s) for s, _ in snaps]
    lrs = [3e-3] * len(snaps)
    return (tasks, lrs) if kind == "tracin" else (tasks, [o for _, o in snaps], lrs)


# --------------------------------------------------------------------------------- run
def run(setting: LMSetting, *, rows_of=("methods",), only=None, recompute=False, n_subsets=N_SUBSETS,
        progress=False, retrain_only=False, protocol="subset-retrain", queries=None, seeds_per_subset=1):
    p = Prepared(setting, n_subsets, progress, protocol, queries, seeds_per_subset=seeds_per_subset)
    label = setting.name if protocol == "subset-retrain" else f"{setting.name}-{protocol}"
    label += f"-q{p.n_query}" if p.n_query < setting.n_query else ""
    label += f"-k{seeds_per_subset}" if seeds_per_subset > 1 else ""
    print(f"[{label}] {setting.describe()}; protocol {protocol}; ground truth {n_subsets} subsets × "
          f"{seeds_per_subset} run(s) ready in {p.truth_seconds:.0f} s", flush=True)
    if p.reliability is not None:
        print(f"  {p.reliability!r}", flush=True)
    if retrain_only:
        return []
    base = p.fwd_bwd_seconds()
    print(f"  plain forward+backward over the training set: {base:.3f} s", flush=True)
    rows = []
    out = BUILD / f"results-{label}.json"
    done = {(r["method"], r["config"]) for r in _read(out)} if not recompute else set()
    generators = [{"methods": method_rows, "sweeps": knob_rows, "ensembles": ensemble_rows,
                   "tied": lambda p: tied_rows(p.task(), p.train, p.queries[:p.n_query], LAYERS,
                                              diagonal=False)}[r](p)
                  for r in rows_of]
    for gen in generators:
        for method, config, thunk in gen:
            if (only and method not in only) or (method, config) in done:
                continue
            row = {"setting": label, "method": method, "config": config}
            try:
                scores = thunk()
                t0 = time.perf_counter()
                values = scores.compute()[:p.n_query]           # (n_query, n_train)
                row["seconds"] = time.perf_counter() - t0
                if getattr(scores, "seconds", None) is not None:     # cached: the time it took when computed
                    row["seconds"] = scores.seconds
                row["cost"] = row["seconds"] / base
                if not np.isfinite(values.values).all():
                    raise ValueError("non-finite scores")
                truth = p.truth.isel(query=slice(0, p.n_query))
                result = ga.eval.lds(values, truth, target="loss", bootstrap=1000, resample="both")
                row.update(lds=result.mean, low=result.interval[0], high=result.interval[1])
                print(f"  {method:10s} {config:36s} LDS {row['lds']:6.3f} [{row['low']:.3f}, {row['high']:.3f}]"
                      f"  {row['seconds']:6.2f} s ({row['cost']:.0f}× fwd+bwd)", flush=True)
            except Exception as exc:  # noqa: BLE001 - reported, not fatal
                row["skipped"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:160]
                print(f"  {method:10s} {config:36s} skipped: {row['skipped']}", flush=True)
            rows.append(row)
            _write(out, label, setting, protocol, n_subsets, p.n_query, base, row,
                   seeds_per_subset, p.reliability)                          # an interrupted run keeps them
    return rows


COUNTERFACTUAL = {
    "subset-retrain": "each subset trained afresh: same init and batch-index stream, batches drawn from the subset",
    "unrolled": "the full run replayed with weight 0 on the examples left out (same init, same batches, "
                "batch loss Σεℓ/Σε)",
}


def _read(out: Path) -> list:
    return json.loads(out.read_text())["rows"] if out.exists() else []


def _write(out: Path, label: str, setting: LMSetting, protocol: str, n_subsets: int, n_query: int,
           base: float, row: dict, seeds_per_subset: int = 1, reliability=None) -> None:
    """Add (or replace) ``row`` in ``out``, read afresh: another process may have added rows."""
    rows = [r for r in _read(out) if (r["method"], r["config"]) != (row["method"], row["config"])] + [row]
    BUILD.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps({"setting": label, "description": setting.describe(),
                               "protocol": {"name": protocol, "counterfactual": COUNTERFACTUAL[protocol] + (
                                   f"; {seeds_per_subset} runs per subset, run r with seed {TRAINING_SEED} + r "
                                   "(init and batch stream), targets averaged" if seeds_per_subset > 1 else ""),
                                            "n_subsets": n_subsets, "fraction": FRACTION,
                                            "queries": f"the first {n_query} of {setting.n_query}",
                                            "seeds_per_subset": seeds_per_subset,
                                            "training_seed": TRAINING_SEED if seeds_per_subset == 1 else
                                            f"{TRAINING_SEED} + r for run r = 0 … {seeds_per_subset - 1}",
                                            "target": "query loss (sum of token NLL)",
                                            "interval": "95% percentile bootstrap over queries and subsets"},
                               **({"reliability": {"test_retest": reliability.retest,
                                                   "test_retest_interval": list(reliability.interval),
                                                   "ceiling": reliability.ceiling,
                                                   "ceiling_one_run": reliability.ceiling_with(1)}}
                                  if reliability is not None else {}),
                               "fwd_bwd_seconds": base, "rows": rows}, indent=1))
    tmp.replace(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--settings", default="lm,lm2")
    ap.add_argument("--methods", default=None, help="comma-separated method names")
    ap.add_argument("--rows", default="methods", help="'methods' (every method, defaults first), 'sweeps' "
                    "(the knob sweeps behind the defaults), 'ensembles' (influence and RelatIF over 5 and "
                    "10 seeds, over 5, 10, 20 models on 50 % subsets, over checkpoints of 1 or 10 runs), 'tied' (K-FAC / "
                    "EK-FAC with the tied embedding/head in the curvature), or several, comma-separated")
    ap.add_argument("--n-subsets", type=int, default=N_SUBSETS)
    ap.add_argument("--seeds-per-subset", type=int, default=1,
                    help="training runs per subset (seeds TRAINING_SEED + r), targets averaged; ≥ 2 also "
                         "measures the ground truth's test–retest correlation and LDS ceiling "
                         "(ga.eval.reliability); results go to results-<setting>-k<K>.json")
    ap.add_argument("--retrain-only", action="store_true")
    ap.add_argument("--magic-only", action="store_true", help="only MAGIC's scores for the first --queries "
                    "queries (cached; no ground truth): to run beside a --retrain-only process")
    ap.add_argument("--recompute", action="store_true", help="rerun rows already in results-<setting>.json")
    ap.add_argument("--progress", action="store_true")
    ap.add_argument("--queries", type=int, default=None,
                    help="score the LDS on the first N queries only (MAGIC's cost is ≈ linear in them)")
    ap.add_argument("--protocol", default="subset-retrain", choices=PROTOCOLS,
                    help="the counterfactual the ground truth retrains (module docstring)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    ga.options(progress=False)
    only = set(args.methods.split(",")) if args.methods else None
    for name in args.settings.split(","):
        if args.magic_only:
            p = Prepared(SETTINGS[name], protocol="unrolled", queries=args.queries, retrain=False)
            magic = CachedMagic(p, p.n_query)
            magic.compute()
            print(f"[{name}] MAGIC scores for {p.n_query} queries cached ({magic.seconds:.0f} s)", flush=True)
            continue
        run(SETTINGS[name], rows_of=tuple(args.rows.split(",")), recompute=args.recompute, only=only,
            n_subsets=args.n_subsets, progress=args.progress,
            retrain_only=args.retrain_only, protocol=args.protocol,
            queries=args.queries, seeds_per_subset=args.seeds_per_subset)


if __name__ == "__main__":
    main()
