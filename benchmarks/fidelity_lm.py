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

Ground truth (``ga.eval.retrain``): ``N_SUBSETS`` random 50 % subsets, **one training
seed for every subset** (the same initialisation and the same batch-index stream, so
the targets differ through the data only); the target is each query's loss L_q = Σ_t
−log p(x_t | x_<t) (the sum over its tokens, ``ga.tasks.causal_lm``'s loss). LDS:
``ga.eval.lds(..., target="loss")``, Spearman per query over subsets, averaged over
queries, 95 % percentile-bootstrap intervals over queries *and* subsets
(``resample="both"``). Every method scores with ``ga.tasks.causal_lm(model)`` on
``layers=["transformer.h.*"]``. Retrained models' targets are cached (resumable) under
``build/fidelity/``; rows are written to ``build/fidelity/results-<setting>.json``.

Cost is the wall time of ``Scores.compute()`` divided by the wall time of one plain
forward + backward pass over the training set in batches of 32 (measured in the same
process, right before).

    PYTHONPATH=. OMP_NUM_THREADS=1 nice -n 10 python benchmarks/fidelity_lm.py --settings lm
    ... --retrain-only          # only the ground truth (resumable)
    ... --methods trak,logra    # rows whose method name is in the list
    ... --rows sweeps           # the knob sweeps behind the defaults
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
import gradalg as ga  # noqa: E402

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


def new_model(setting: LMSetting) -> GPT2LMHeadModel:
    cfg = GPT2Config(n_layer=setting.n_layer, n_embd=setting.n_embd, n_head=setting.n_head,
                     vocab_size=N_NUM + 1, n_positions=T_MAX, resid_pdrop=0.0, embd_pdrop=0.0,
                     attn_pdrop=0.0, bos_token_id=PAD, eos_token_id=PAD)
    return GPT2LMHeadModel(cfg)


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
    g = torch.Generator().manual_seed(seed + 1)
    every = setting.train_steps // checkpoints if checkpoints else 0
    snapshots = []
    for step in range(1, setting.train_steps + 1):
        b = torch.randint(0, len(items), (32,), generator=g)
        part = {k: v[b] for k, v in batch.items()}
        loss = (token_losses(model, part).sum(1) / part["attention_mask"][:, 1:].sum(1)).mean()
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


class Prepared:
    """A setting's corpus, full-data model and ground truth."""

    def __init__(self, setting: LMSetting, n_subsets: int = N_SUBSETS, progress: bool = False):
        self.setting = setting
        self.train, self.lang = make_corpus(setting, setting.n_train // len(setting.steps), setting.corpus_seed)
        self.queries, self.lang_q = make_corpus(setting, setting.n_query // len(setting.steps),
                                                setting.corpus_seed + 1)
        self.query_batch = ga.collate.pad_collate(self.queries)
        torch.set_num_threads(1)
        self.model = train_model(setting, self.train)
        store = BUILD / (f"{setting.name}-L{setting.n_layer}-d{setting.n_embd}-n{setting.n_train}"
                         f"-q{setting.n_query}-s{setting.train_steps}-ts{TRAINING_SEED}")
        t0 = time.perf_counter()
        self.truth = ga.eval.retrain(self.train_fn, setting.n_train, n_subsets=n_subsets, fraction=FRACTION,
                                     seed=SUBSET_SEED, training_seed=TRAINING_SEED, targets_fn=self.query_losses,
                                     target="loss", store=store, progress=progress)
        self.truth_seconds = time.perf_counter() - t0

    def train_fn(self, indices):
        return train_model(self.setting, [self.train[i] for i in indices])

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
    return "defaults (" + ", ".join(f"{n}={params[n].default:g}" for n in names) + ")"


def method_rows(p: Prepared):
    """(method, configuration, thunk -> lazy Scores): defaults first, then variants."""
    m, task, tr, qu, L = ga.methods, p.task(), p.train, p.queries, LAYERS
    yield "influence", "EK-FAC (default damping)", lambda: m.influence(task, tr, qu, layers=L, curvature="ekfac")
    yield "trak", defaults(m.trak, "k", "relative_damping"), lambda: m.trak(task, tr, qu, layers=L)
    yield "logra", defaults(m.logra, "k", "damping"), lambda: m.logra(task, tr, qu, layers=L)
    yield "grass", defaults(m.grass, "k", "relative_damping"), lambda: m.grass(task, tr, qu, layers=L)
    yield "grad_dot", "", lambda: m.grad_dot(task, tr, qu, layers=L)
    yield "influence", "K-FAC", lambda: m.influence(task, tr, qu, layers=L, curvature="kfac")
    # the plain references of TRAK's and GraSS's math: influence in a 2048-d sparse projection
    yield "influence", "empirical Fisher, sparse k=2048", lambda: m.influence(
        task, tr, qu, layers=L, curvature="empirical", projector=ga.proj.sparse(2048, seed=0))
    yield "influence", "Gauss-Newton, sparse k=2048", lambda: m.influence(
        task, tr, qu, layers=L, projector=ga.proj.sparse(2048, seed=0))
    yield "relatif", "EK-FAC", lambda: m.relatif(task, tr, qu, layers=L, curvature="ekfac")
    yield "grad_cos", "", lambda: m.grad_cos(task, tr, qu, layers=L)
    yield "influence", "DataInf", lambda: m.influence(task, tr, qu, layers=L, curvature="datainf")
    yield "grass", "GraSS (unfactored)", lambda: m.grass(task, tr, qu, layers=L, factored=False)
    yield "tracin", "3 checkpoints of the Adam run", lambda: m.tracin(*_checkpoints(p, "tracin"), tr, qu, layers=L)
    # LESS's default dense k=8192 projection of ~100k coordinates is over the memory budget
    yield "less", "3 Adam checkpoints, sparse k=8192", lambda: m.less(
        *_checkpoints(p, "less"), tr, qu, np.arange(len(qu)), layers=L, projector=ga.proj.sparse(8192, seed=0))


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
        progress=False, retrain_only=False):
    p = Prepared(setting, n_subsets, progress)
    print(f"[{setting.name}] {setting.describe()}; ground truth {n_subsets} subsets ready in "
          f"{p.truth_seconds:.0f} s", flush=True)
    if retrain_only:
        return []
    base = p.fwd_bwd_seconds()
    print(f"  plain forward+backward over the training set: {base:.3f} s", flush=True)
    rows = []
    out = BUILD / f"results-{setting.name}.json"
    done = {(r["method"], r["config"]) for r in _read(out)} if not recompute else set()
    generators = [{"methods": method_rows, "sweeps": knob_rows}[r](p) for r in rows_of]
    for gen in generators:
        for method, config, thunk in gen:
            if (only and method not in only) or (method, config) in done:
                continue
            row = {"setting": setting.name, "method": method, "config": config}
            try:
                scores = thunk()
                t0 = time.perf_counter()
                values = scores.compute()
                row["seconds"] = time.perf_counter() - t0
                row["cost"] = row["seconds"] / base
                if not np.isfinite(values.values).all():
                    raise ValueError("non-finite scores")
                result = ga.eval.lds(values, p.truth, target="loss", bootstrap=1000, resample="both")
                row.update(lds=result.mean, low=result.interval[0], high=result.interval[1])
                print(f"  {method:10s} {config:36s} LDS {row['lds']:6.3f} [{row['low']:.3f}, {row['high']:.3f}]"
                      f"  {row['seconds']:6.2f} s ({row['cost']:.0f}× fwd+bwd)", flush=True)
            except Exception as exc:  # noqa: BLE001 - reported, not fatal
                row["skipped"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:160]
                print(f"  {method:10s} {config:36s} skipped: {row['skipped']}", flush=True)
            rows.append(row)
            _write(out, setting, n_subsets, base, row)       # after every row: an interrupted run keeps them
    return rows


def _read(out: Path) -> list:
    return json.loads(out.read_text())["rows"] if out.exists() else []


def _write(out: Path, setting: LMSetting, n_subsets: int, base: float, row: dict) -> None:
    """Add (or replace) ``row`` in ``out``, read afresh: another process may have added rows."""
    rows = [r for r in _read(out) if (r["method"], r["config"]) != (row["method"], row["config"])] + [row]
    BUILD.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps({"setting": setting.name, "description": setting.describe(),
                               "protocol": {"n_subsets": n_subsets, "fraction": FRACTION,
                                            "seeds_per_subset": 1, "training_seed": TRAINING_SEED,
                                            "target": "query loss (sum of token NLL)",
                                            "interval": "95% percentile bootstrap over queries and subsets"},
                               "fwd_bwd_seconds": base, "rows": rows}, indent=1))
    tmp.replace(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--settings", default="lm,lm2")
    ap.add_argument("--methods", default=None, help="comma-separated method names")
    ap.add_argument("--rows", default="methods", help="'methods' (every method, defaults first), 'sweeps' "
                    "(the knob sweeps behind the defaults) or 'methods,sweeps'")
    ap.add_argument("--n-subsets", type=int, default=N_SUBSETS)
    ap.add_argument("--retrain-only", action="store_true")
    ap.add_argument("--recompute", action="store_true", help="rerun rows already in results-<setting>.json")
    ap.add_argument("--progress", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    ga.options(progress=False)
    only = set(args.methods.split(",")) if args.methods else None
    for name in args.settings.split(","):
        run(SETTINGS[name], rows_of=tuple(args.rows.split(",")), recompute=args.recompute, only=only,
            n_subsets=args.n_subsets, progress=args.progress,
            retrain_only=args.retrain_only)


if __name__ == "__main__":
    main()
