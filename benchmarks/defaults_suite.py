"""Defaults chosen across the whole fidelity suite: each method's candidate configurations
on all nine settings, LDS with bootstrap intervals, worst case and mean.

The nine settings and their ground truths are the fidelity scripts' own (imported, never
copied): ``benchmarks/fidelity.py`` (logreg, mlp), ``benchmarks/fidelity_lm.py`` (lm, lm2,
``layers=["transformer.h.*"]``), ``benchmarks/fidelity_text.py`` (text, instruct) and
``benchmarks/fidelity_more.py`` (llama, conv, seqcls). Every candidate is a method called as
a user would (``method(task, train, queries, **kwargs)``; checkpoint methods on the
settings' own snapshots), differing from the method's previous default only in
``CANDIDATES``' keyword arguments, which are explicit values (the rows do not move when a
default changes). No candidate reads the ground truth.

Two steps, each resumable:

    scores   each (setting, method, candidate)'s scores computed once and cached (the
             scripts' own caches where they have one: ``build/fidelity/scores-…``, keyed by
             method and configuration, shared with their rows; a candidate that *is* a
             standard row uses that row's label), with the wall time of ``compute()`` and of
             one plain forward + backward over the training set measured in the same process.
             Every cache entry is checked against the expression's content token kept beside
             it (``scores.expr.token``, every resolved argument and default included;
             ``fidelity_lm.cache_is_current``): one written under another default, or before
             tokens were kept, is recomputed, not served under its label.
             The row goes to ``build/fidelity/defaults-<setting>.json`` without an LDS. Never
             retrains a ground truth of the LM / text / more settings. A candidate that is
             another row's computation on a setting (``SAME_WHEN_AUTO_IS_EKFAC`` /
             ``_DENSE``, ``SAME_WHEN_ONE_BLOCK``) copies that row, its note says why.
    lds      for every row without an LDS whose setting's ground truth is complete in its
             store: ``ga.eval.lds(scores, truth, target="loss", bootstrap=1000,
             resample="both")`` (95 % percentile interval over queries and subsets).

``--report`` prints, per method, the table candidate × setting (LDS [interval]) with each
candidate's worst case and mean over the settings, and the choice by the rule of
issue 31 (``choose``): the candidate with the best worst case, then the best mean, among
those no worse than the previous default by more than the previous default's bootstrap
interval (its lower half-width) on any setting. A method's default changes only when the
chosen candidate is not the previous default.

    PYTHONPATH=. OMP_NUM_THREADS=1 nice -n 10 python benchmarks/defaults_suite.py --settings logreg,mlp,conv
    ... --methods influence,trak     # only these methods' candidates
    ... --candidates 2,3             # only these candidates (indices into each method's list)
    ... --lds                        # only the LDS of rows already scored (no training, no scoring)
    python benchmarks/defaults_suite.py --report [--markdown]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
import gradalg as ga  # noqa: E402
from gradalg.expr.curvature import PROBES  # noqa: E402
from gradalg.linalg.autodamp import DampingRule  # noqa: E402

BUILD = ROOT / "build" / "fidelity"
SETTINGS = ("logreg", "mlp", "lm", "lm2", "text", "instruct", "llama", "conv", "seqcls")
#: settings where influence's / RelatIF's curvature="auto" is EK-FAC (the default layers have more
#: than ga.options(dense_curvature_dim) coordinates); logreg, mlp and conv (and issue 31's mlp_gelu,
#: mlp_adam, conv_wd) get the dense choice, "gauss_newton" in these tables' keys (650 / 2,410 / 3,818
#: coordinates; since issue 31 the near-minimum rule: NEAR_MINIMUM_LABEL). Checked at run time
#: (``_auto_curvature``).
MEAN_01 = DampingRule("mean", 0.1)


class ByForm(tuple):
    """A damping that depends on which curvature ``curvature="auto"`` takes on the setting, as
    ``damping="auto"``'s own rule does (``influence.AUTO_DAMPING``): ``ByForm((dense, kronecker))``
    passes ``dense`` where it is the dense Gauss-Newton, ``kronecker`` where it is EK-FAC."""

    def __repr__(self):
        return f"ByForm(dense={self[0]!r}, kronecker={self[1]!r})"


#: issue 31 item 3: ``damping="auto"``'s rules (mass 0.95 dense, 0.99 Kronecker) with one λ from
#: the pooled spectrum, or per block at least the relative default's λ (1 / 0.1 × mean eigenvalue)
AUTO_POOLED = ByForm((DampingRule("mass", 0.95, per_block=False), DampingRule("mass", 0.99, per_block=False)))
AUTO_FLOORED = ByForm((DampingRule("mass", 0.95, floor=1.0), DampingRule("mass", 0.99, floor=0.1)))
AUTO_BY_STRUCTURE = ByForm((AUTO_POOLED[0], "auto"))
AUTO_IF_KRONECKER = ByForm(("previous", "auto"))
DENSE_HESSIAN_LABEL = "Hessian (shifted to PSD + 0.3 × mean) if dense, else EK-FAC 'auto'"
NEAR_MINIMUM_LABEL = "Hessian if near a minimum (r = 1), else Gauss-Newton, if dense; else EK-FAC 'auto'"
RELATIF_NEAR_MINIMUM_LABEL = ("Hessian (PSD + 0.3 × mean) if near a minimum, else Gauss-Newton (pooled), if dense; "
                              "else EK-FAC 'auto'")

#: issue 31, the dense-H reading for TRAK's kernel, GraSS's H and TrackStar's R: ``damping="auto"``'s
#: q = 0.95 with one λ from the pooled spectrum (RelatIF's ``DENSE_DAMPING``) instead of one per block
AUTO_ONE_LAMBDA = DampingRule("mass", 0.95, per_block=False)
POOLED_LABEL = "damping='auto', one λ (pooled)"

# --------------------------------------------------------------------------- candidates
# method -> [(label, kwargs, standard row's label or None)]. The first is the previous default,
# with its values spelled out (TRAK's and GraSS's relative rule needs damping=None since their
# default became "auto"). ``standard`` names the row of fidelity_text / fidelity_more that
# computes the same scores (shared cache).
CANDIDATES = {
    # influence's default since issue 31's evening run: the row "damping='auto' if Kronecker, else
    # 1 × mean eigenvalue" (the first row stays the default before, the rule's reference)
    "influence": [
        # the previous default: relative_damping 1 for the dense Gauss-Newton, 0.1 for (E)K-FAC
        ("defaults (curvature='auto')", dict(relative_damping="previous"), "defaults (curvature='auto')"),
        ("damping='auto'", dict(damping="auto"), None),
        ("EK-FAC", dict(curvature="ekfac", relative_damping=0.1), "EK-FAC"),
        ("K-FAC", dict(curvature="kfac", relative_damping=0.1), "K-FAC"),
        ("EK-FAC, damping='auto'", dict(curvature="ekfac", damping="auto"), None),
        ("K-FAC, damping='auto'", dict(curvature="kfac", damping="auto"), None),
        ("damping=mean 0.1", dict(damping=MEAN_01), None),
        ("damping='auto', pooled", dict(damping=AUTO_POOLED), None),
        ("damping='auto', floor at the relative default", dict(damping=AUTO_FLOORED), None),
        # per block only where H is block-diagonal (Kronecker: its blocks' spectra are H's spectrum);
        # a dense H keeps one λ: from its own spectrum (mass 0.95), or the relative 1 × mean eigenvalue
        ("damping='auto' per block if Kronecker, pooled if dense", dict(damping=AUTO_BY_STRUCTURE), None),
        ("damping='auto' if Kronecker, else 1 × mean eigenvalue", dict(damping=AUTO_IF_KRONECKER), None),
        # issue 31 (fiddig): where "auto" is dense, the formed Hessian at its default damping (shifted
        # to PSD + 0.3 × its mean eigenvalue, influence.DENSE_HESSIAN_DAMPING); EK-FAC as by default elsewhere
        (DENSE_HESSIAN_LABEL, dict(curvature=ByForm(("dense_hessian", "auto"))), None),
        # issue 31 (fidauto): where "auto" is dense, the formed Hessian if the model is near a minimum
        # (−μ_min ≤ r × the Gauss-Newton's mean eigenvalue, r = 1 fixed before the new settings were
        # scored), else the dense Gauss-Newton at 1 × mean; EK-FAC as by default elsewhere
        (NEAR_MINIMUM_LABEL, dict(curvature=ByForm(("near_minimum", "auto"))), None),
    ],
    "trak": [
        ("defaults (k=2048, relative_damping=1)", dict(k=2048, damping=None, relative_damping=1.0),
         "defaults (k=2048, relative_damping=1)"),
        ("relative_damping=0.1", dict(k=2048, damping=None, relative_damping=0.1), None),
        ("damping='auto'", dict(k=2048, damping="auto"), None),
        (POOLED_LABEL, dict(k=2048, damping=AUTO_ONE_LAMBDA), None),
    ],
    "logra": [
        ("defaults (k=4096, damping=0.001)", dict(k=4096, damping=1e-3), "defaults (k=4096, damping=0.001)"),
        ("damping=mean 0.1", dict(k=4096, damping=MEAN_01), None),
        ("damping='auto'", dict(k=4096, damping="auto"), None),
    ],
    "grass": [
        ("defaults (k=256, relative_damping=0.1)", dict(k=256, damping=None, relative_damping=0.1),
         "defaults (k=256, relative_damping=0.1)"),
        ("relative_damping=1", dict(k=256, damping=None, relative_damping=1.0), None),
        ("damping='auto'", dict(k=256, damping="auto"), None),
        (POOLED_LABEL, dict(k=256, damping=AUTO_ONE_LAMBDA), None),
    ],
    # RelatIF's default since issue 31's evening run: "damping='auto' per block if Kronecker, pooled if dense"
    "relatif": [
        ("defaults (damping=0.001)", dict(damping=1e-3), "defaults (damping=0.001)"),
        ("damping='auto'", dict(damping="auto"), None),
        ("damping='auto' per block if Kronecker, pooled if dense", dict(damping=AUTO_BY_STRUCTURE), None),
        ("damping=mean 0.1", dict(damping=MEAN_01), None),
        # issue 31 (relatif, session 43): influence's near-minimum rule where "auto" is dense, each side at
        # RelatIF's default for it (the formed Hessian: DENSE_HESSIAN_DAMPING; the Gauss-Newton: DENSE_DAMPING)
        (RELATIF_NEAR_MINIMUM_LABEL, dict(curvature=ByForm(("near_minimum", "auto"))), None),
    ],
    "trackstar": [
        ("defaults (k=4096, relative_damping=0.1)", dict(k=4096, relative_damping=0.1),
         "defaults (k=4096, relative_damping=0.1), final Adam state"),
        ("damping='auto'", dict(k=4096, damping="auto"), None),
        ("relative_damping=1", dict(k=4096, relative_damping=1.0), None),
        (POOLED_LABEL, dict(k=4096, damping=AUTO_ONE_LAMBDA), None),
    ],
    "less": [
        ("defaults (k=8192)", dict(k=8192), "defaults (k=8192), 3 Adam checkpoints"),
        ("sparse k=8192", dict(projector=("sparse", 8192)), "3 Adam checkpoints, sparse k=8192"),
        ("k=2048", dict(k=2048), None),
    ],
}
PREVIOUS_DEFAULT = {m: rows[0][0] for m, rows in CANDIDATES.items()}
#: defaults adopted since (issue 31): the rule's reference for the next choice is the default a
#: candidate would replace. (The tables of docs/fidelity.md that chose these defaults were made with
#: the first rows as the reference.)
PREVIOUS_DEFAULT.update({"trak": "damping='auto'", "grass": "damping='auto'", "trackstar": "damping='auto'",
                         # influence's default since issue 31's evening run (fiddig's reference)
                         "influence": "damping='auto' if Kronecker, else 1 × mean eigenvalue",
                         # RelatIF's default since issue 31's evening run
                         "relatif": "damping='auto' per block if Kronecker, pooled if dense"})
#: candidates that are another row's computation wherever the matrix they damp has ONE block (an
#: unprojected one-layer model, or a projection into one k-block): one λ from the pooled spectrum is
#: then the block's own λ. Checked per setting (``damped_blocks``); the row is copied, its note says so.
SAME_WHEN_ONE_BLOCK = {("trak", POOLED_LABEL): "damping='auto'", ("grass", POOLED_LABEL): "damping='auto'",
                       ("trackstar", POOLED_LABEL): "damping='auto'"}
#: where curvature="auto" is EK-FAC these influence rows are the same computation as another:
#: scored once, the row copied (its note says so)
SAME_WHEN_AUTO_IS_EKFAC = {("influence", "EK-FAC"): "defaults (curvature='auto')",
                           ("influence", "EK-FAC, damping='auto'"): "damping='auto'",
                           ("influence", "damping='auto' per block if Kronecker, pooled if dense"): "damping='auto'",
                           ("influence", "damping='auto' if Kronecker, else 1 × mean eigenvalue"): "damping='auto'",
                           ("influence", DENSE_HESSIAN_LABEL): "damping='auto'",
                           ("influence", NEAR_MINIMUM_LABEL): "damping='auto'",
                           ("relatif", "damping='auto' per block if Kronecker, pooled if dense"): "damping='auto'",
                           ("relatif", RELATIF_NEAR_MINIMUM_LABEL): "damping='auto'"}
#: the same where it is the dense Gauss-Newton
SAME_WHEN_AUTO_IS_DENSE = {
    ("influence", "damping='auto' per block if Kronecker, pooled if dense"): "damping='auto', pooled",
    ("influence", "damping='auto' if Kronecker, else 1 × mean eigenvalue"): "defaults (curvature='auto')"}


def _kwargs(kwargs: dict) -> dict:
    out = dict(kwargs)
    if isinstance(out.get("projector"), tuple):
        kind, k = out["projector"]
        out["projector"] = getattr(ga.proj, kind)(k, seed=0)
    return out


# ------------------------------------------------------------------------------ settings
class Pending(Exception):
    """The setting's ground truth is not complete in its store yet."""


def _never(indices):
    raise Pending


class Context:
    """One setting: the user's call pieces, the scores cache and the ground truth's store."""

    def __init__(self, name, task, train, queries, n_query, base, layers=None, snapshots=None,
                 cache=None, truth_spec=None, truth_fn=None):
        self.name, self.task, self.train, self.queries, self.n_query = name, task, train, queries, n_query
        self.base, self.layers, self.snapshots = base, layers, snapshots     # snapshots: (tasks, optimizers, lrs)
        self.cache, self.truth_spec, self.truth_fn = cache, truth_spec, truth_fn

    def thunk(self, method: str, kwargs: dict):
        m, task, tr, qu, kw = ga.methods, self.task, self.train, self.queries, _kwargs(kwargs)
        if self.layers is not None:
            kw["layers"] = self.layers
        if kw.get("relative_damping") == "previous":          # influence's default before issue 31
            kw["relative_damping"] = 1.0 if self.auto == "gauss_newton" else 0.1
            if self.auto == "gauss_newton" and method == "influence":   # the dense Gauss-Newton, by name
                kw.setdefault("curvature", "gauss_newton")
        if isinstance(kw.get("curvature"), ByForm):            # a curvature by what "auto" takes here
            kw["curvature"] = kw["curvature"][0 if self.auto == "gauss_newton" else 1]
        if isinstance(kw.get("damping"), ByForm):
            kw["damping"] = kw["damping"][0 if self.auto == "gauss_newton" else 1]
            if kw["damping"] == "previous":
                kw.pop("damping")
                kw["relative_damping"] = 1.0 if self.auto == "gauss_newton" else 0.1
                if self.auto == "gauss_newton" and method == "influence":
                    kw.setdefault("curvature", "gauss_newton")
        if method in ("influence", "trak", "logra", "grass", "relatif"):
            return lambda: getattr(m, method)(task, tr, qu, **kw)
        tasks, optimizers, lrs = self.snapshots()
        if method == "trackstar":
            return lambda: m.trackstar(tasks[-1], tr, qu, optimizer=optimizers[-1], **kw)
        if method == "less":
            return lambda: m.less(tasks, optimizers, lrs, tr, qu, np.arange(self.n_query), **kw)
        raise ValueError(method)


def _own_cache(key: str):
    """fidelity_more's cache layout for the settings whose script has none (digits, lm), keyed by
    method and label and checked, as the standard rows' caches are, against the expression's
    content token kept beside the scores (``scores.expr.token``: every resolved argument, a
    method's defaults included): an entry written under another default, or before tokens were
    kept, is recomputed with the reason printed, not served under its label
    (:func:`fidelity_lm.cache_is_current`)."""
    from fidelity_lm import cache_is_current, expression_token

    def cache(method, config, thunk, base):
        path = BUILD / f"scores-{key}" / (re.sub(r"[^\w.=-]+", "_", f"{method}-{config}").strip("_") + ".npz")
        scores = thunk()                                   # lazy: building it computes nothing
        token = expression_token(scores)
        if path.exists():
            with np.load(path) as z:
                if cache_is_current(z, token, path):
                    return z["values"], float(z["seconds"]), float(z["base"]), str(path)
        t0 = time.perf_counter()
        values = np.asarray(scores.compute().transpose("query", "train").values)
        seconds = time.perf_counter() - t0
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp.npz")
        np.savez(tmp, values=values, seconds=seconds, base=base, token=token)
        tmp.replace(path)
        return values, seconds, base, str(path)
    return cache


def digits(name: str) -> Context:
    import fidelity as F
    s = F.SETTINGS[name]
    s.prepare()
    n_subsets = {"logreg": 100, "mlp": 50}.get(name, s.n_subsets)   # issue 31's dense settings: their own
    store = F.CACHE / f"{s.name}-n{F.N_TRAIN}-q{F.N_QUERY}-wd{F.WD:g}-tol{s.tol_subset:g}"

    def truth():          # deterministic and cheap: trained here when missing
        return ga.eval.retrain(s.train_fn, F.N_TRAIN, n_subsets=n_subsets, fraction=F.FRACTION, seed=0,
                               targets_fn=s.query_losses, target="loss", store=store)

    def snapshots():
        models, optimizers, lrs = s.trajectory("adam")
        return [s.task(x) for x in models], optimizers, lrs

    return Context(name, s.task(), s.train, s.queries, F.N_QUERY, F.fwd_bwd_seconds(s), snapshots=snapshots,
                   cache=_own_cache(f"{name}-n{F.N_TRAIN}-q{F.N_QUERY}-wd{F.WD:g}"),
                   truth_spec=dict(store=str(store), n_train=F.N_TRAIN, n_subsets=n_subsets, fraction=F.FRACTION,
                                   seed=0, training_seed=None, seeds_per_subset=1, n_query=F.N_QUERY),
                   truth_fn=truth)


def lm(name: str) -> Context:
    import fidelity_lm as FL
    p = FL.Prepared(FL.SETTINGS[name], retrain=False)
    p.model = FL.train_model(p.setting, p.train)
    spec = dict(store=str(FL.BUILD / p.key), n_train=p.setting.n_train, n_subsets=FL.N_SUBSETS,
                fraction=FL.FRACTION, seed=FL.SUBSET_SEED, training_seed=FL.TRAINING_SEED, seeds_per_subset=1,
                n_query=p.n_query)
    return Context(name, p.task(), p.train, p.queries[:p.n_query], p.n_query, p.fwd_bwd_seconds(),
                   layers=FL.LAYERS, snapshots=lambda: FL._checkpoints(p, "less"), cache=_own_cache(p.key),
                   truth_spec=spec)


def text(name: str) -> Context:
    import fidelity_text as FT
    p = FT.Prepared(FT.SETTINGS[name], retrain=False)

    def cache(method, config, thunk, base):
        values, seconds, base = FT.cached_scores(p, method, config, thunk, base)
        slug = hashlib.sha256(f"{method}|{config}".encode()).hexdigest()[:10]
        return np.asarray(values.values), seconds, base, str(FT.BUILD / f"scores-{p.key}-{method}-{slug}.npz")

    spec = dict(store=str(FT.BUILD / p.key), n_train=p.setting.n_train, n_subsets=FT.N_SUBSETS,
                fraction=FT.FRACTION, seed=FT.SUBSET_SEED, training_seed=FT.TRAINING_SEED,
                seeds_per_subset=FT.SEEDS_PER_SUBSET, n_query=p.n_query)
    return Context(name, p.task(), p.train, p.queries, p.n_query, p.fwd_bwd_seconds(),
                   snapshots=lambda: FT.checkpoints(p), cache=cache, truth_spec=spec)


def more(name: str) -> Context:
    import fidelity_more as FM
    s = FM.SETTINGS[name]()
    if name == "seqcls":
        pretrained = FM.BUILD / (f"pretrained-seqcls-d{s.hidden}-L{s.layers}-p{s.pretrain_steps}"
                                 f"m{s.pretrain_modules}.pt")
        if not pretrained.exists():            # written by the ground truth's process: not raced here
            raise Pending
    model, snaps = s.train_model(checkpoints=FM.CHECKPOINTS)

    def cache(method, config, thunk, base):
        values, seconds, base = FM.cached_scores(s, method, config, thunk, base)
        return values, seconds, base, str(FM.scores_path(s, method, config))

    spec = dict(store=str(FM.BUILD / s.key), n_train=s.n_train, n_subsets=FM.N_SUBSETS, fraction=FM.FRACTION,
                seed=FM.SUBSET_SEED, training_seed=FM.TRAINING_SEED, seeds_per_subset=FM.SEEDS_PER_SUBSET,
                n_query=s.n_query)
    return Context(name, s.task(model), s.train, s.queries, s.n_query, s.fwd_bwd_seconds(model),
                   snapshots=lambda: ([s.task(x) for x, _ in snaps], [o for _, o in snaps], [s.lr] * len(snaps)),
                   cache=cache, truth_spec=spec)


def context(name: str) -> Context:
    import fidelity as F
    if name in F.SETTINGS:                  # logreg, mlp and issue 31's dense settings (mlp_gelu, mlp_adam, conv_wd)
        return digits(name)
    if name in ("lm", "lm2"):
        return lm(name)
    if name in ("text", "instruct"):
        return text(name)
    return more(name)


def cached(path) -> Path:
    """A path the rows recorded (a store, a scores file), in this tree's ``build/fidelity``: rows
    written from another worktree name theirs, and the shared cache is the same directory."""
    path = Path(path)
    if path.exists() or "build/fidelity/" not in str(path):
        return path
    return BUILD / str(path).split("build/fidelity/", 1)[1]


def load_truth(spec: dict):
    """The ground truth from its store, or raise Pending when a run is missing (never trains)."""
    spec = dict(spec)
    store, n_query = cached(spec.pop("store")), spec.pop("n_query")
    if not (store / "meta.json").exists():
        raise Pending
    truth = ga.eval.retrain(_never, spec.pop("n_train"), targets_fn=_never, target="loss", store=store, **spec)
    return truth.isel(query=slice(0, n_query))


def damped_blocks(ctx: Context, method: str, kwargs: dict) -> int | None:
    """How many blocks the matrix that ``method``'s damping acts on has on this setting, as the
    method builds it: TRAK's kernel and TrackStar's R live in the space of the projected gradients
    (:func:`gradalg.methods.trak.default_projector` with the candidate's ``k``: one k-block, or
    the layers' blocks when the gradients have at most k coordinates and are not projected);
    GraSS's H in one projected block per layer. None for another method."""
    from gradalg.methods.trak import K as TRAK_K, default_projector
    if method not in ("trak", "trackstar", "grass"):
        return None
    G = ga.grads(ctx.task, ctx.train, ctx.layers)
    if method == "grass":
        return len(ga.proj.factgrass(kwargs.get("k", 256), 0)(G).space.blocks)
    k = kwargs.get("k", TRAK_K if method == "trak" else 4096)
    P = default_projector(k, G.space.dim, kwargs.get("seed", 0))
    return len((P(G) if P is not None else G).space.blocks)


def _auto_curvature(ctx: Context) -> str:
    """Which curvature influence's ``curvature="auto"`` takes here (from the plan's note)."""
    text = str(ga.methods.influence(ctx.task, ctx.train, ctx.queries,
                                    **({"layers": ctx.layers} if ctx.layers else {})).explain())
    return "ekfac" if "curvature='auto': EK-FAC" in text else "gauss_newton"


# ---------------------------------------------------------------------------------- rows
def results_path(name: str) -> Path:
    return BUILD / f"defaults-{name}.json"


def _read(name: str) -> dict:
    path = results_path(name)
    return json.loads(path.read_text()) if path.exists() else {"setting": name, "rows": []}


def _write_row(name: str, row: dict, header: dict | None = None) -> None:
    """Add (or replace) ``row`` in the setting's results, read afresh (another process may write)."""
    data = _read(name)
    if header:
        data.update(header)
    data["rows"] = [r for r in data["rows"] if (r["method"], r["config"]) != (row["method"], row["config"])] + [row]
    BUILD.mkdir(parents=True, exist_ok=True)
    tmp = results_path(name).with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1, default=float))
    tmp.replace(results_path(name))


def _twin(name: str, method: str, label: str, auto: str):
    """The row whose scores ``label``'s are on a setting where curvature='auto' is ``auto``, or None."""
    same = (SAME_WHEN_AUTO_IS_EKFAC if auto == "ekfac" else SAME_WHEN_AUTO_IS_DENSE).get((method, label))
    return next((r for r in _read(name)["rows"] if (r["method"], r["config"]) == (method, same)
                 and "scores" in r), None) if same else None


def copy_twins(name: str, method: str, auto: str) -> bool:
    """Write the rows that repeat another's scores (with its LDS); True when none is left to compute."""
    done = {(r["method"], r["config"]) for r in _read(name)["rows"] if "seconds" in r or "skipped" in r}
    left = False
    for label, kwargs, _ in CANDIDATES[method]:
        if (method, label) in done:
            continue
        twin = _twin(name, method, label, auto)
        if twin is None:
            left = True
            continue
        row = {"method": method, "config": label, "kwargs": repr(kwargs),
               "note": f"curvature='auto' is {auto} here: the scores of {twin['config']!r}"}
        row.update({k: twin[k] for k in ("seconds", "fwd_bwd_seconds", "cost", "scores", "lds", "low", "high",
                                         "n_subsets") if k in twin})
        _write_row(name, row)
    return not left


def copy_one_block_twin(name: str, ctx: Context, method: str, label: str, kwargs: dict) -> bool:
    """Write ``label``'s row as a copy of its :data:`SAME_WHEN_ONE_BLOCK` twin (scores, LDS) where
    the damped matrix has one block on this setting and the twin is scored; True when written."""
    same = SAME_WHEN_ONE_BLOCK.get((method, label))
    if same is None:
        return False
    twin = next((r for r in _read(name)["rows"] if (r["method"], r["config"]) == (method, same) and "scores" in r),
                None)
    if twin is None or damped_blocks(ctx, method, kwargs) != 1:
        return False
    row = {"method": method, "config": label, "kwargs": repr(kwargs),
           "note": f"the damped matrix has one block here: one λ from the pooled spectrum is the block's own; "
                   f"the scores of {same!r}"}
    row.update({k: twin[k] for k in ("seconds", "fwd_bwd_seconds", "cost", "scores", "lds", "low", "high",
                                     "n_subsets") if k in twin})
    _write_row(name, row)
    print(f"  [{name}] {method:10s} {label:40s} one block: the row of {same!r}", flush=True)
    return True


def score(names, methods, progress=True) -> None:
    """Every candidate's scores (cached) on each setting, method-major (the first methods on
    every setting before the next ones); rows written without an LDS."""
    contexts = {}
    for method in methods:
        for name in names:
            auto = _read(name).get("influence_auto_curvature")
            if name not in contexts and auto and copy_twins(name, method, auto):
                continue
            if name not in contexts:
                try:
                    contexts[name] = context(name)
                except Pending:
                    print(f"[{name}] not ready (its pre-trained weights are being written): later", flush=True)
                    contexts[name] = None
                    continue
                ctx = contexts[name]
                auto = ctx.auto = _auto_curvature(ctx)
                header = {"description": f"fidelity setting {name}", "truth": ctx.truth_spec,
                          "influence_auto_curvature": auto, "fwd_bwd_seconds": ctx.base}
                _write_row(name, {"method": "_header", "config": ""}, header)
                print(f"[{name}] ready: forward+backward {ctx.base:.3f} s; curvature='auto' is {auto}", flush=True)
                if ctx.truth_fn is not None:
                    ctx.truth_fn()                              # digits: train what is missing (cheap)
            ctx = contexts[name]
            if ctx is None:
                continue
            done = {(r["method"], r["config"]) for r in _read(name)["rows"] if "seconds" in r or "skipped" in r}
            for label, kwargs, standard in CANDIDATES[method]:
                if (method, label) in done:
                    continue
                row = {"method": method, "config": label, "kwargs": repr(kwargs)}
                if _twin(name, method, label, ctx.auto) is not None:
                    copy_twins(name, method, ctx.auto)
                    continue
                if copy_one_block_twin(name, ctx, method, label, kwargs):
                    continue
                try:
                    PROBES.clear()
                    values, seconds, base, path = ctx.cache(method, standard or f"defaults-suite {label}",
                                                            ctx.thunk(method, kwargs), ctx.base)
                    if not np.isfinite(values).all():
                        raise ValueError("non-finite scores")
                    row.update(seconds=seconds, fwd_bwd_seconds=base, cost=seconds / base, scores=path)
                    if PROBES:      # curvature="near_minimum" (issue 31): what decided, measured
                        row["near_minimum"] = [{**vars(p), "describe": p.describe()} for p in PROBES.values()]
                        print(f"  [{name}] {label}: {row['near_minimum'][0]['describe']}", flush=True)
                    print(f"  [{name}] {method:10s} {label:40s} {seconds:7.1f} s ({seconds / base:.0f}× fwd+bwd)",
                          flush=True)
                except Exception as exc:  # noqa: BLE001 - a refusal is a result
                    row["skipped"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:200]
                    print(f"  [{name}] {method:10s} {label:40s} skipped: {row['skipped']}", flush=True)
                _write_row(name, row)


def lds(names) -> None:
    """The LDS of every scored row without one, where the setting's ground truth is complete."""
    import xarray as xr
    for name in names:
        data = _read(name)
        todo = [r for r in data["rows"] if "scores" in r and "lds" not in r]
        if not todo:
            continue
        try:
            truth = load_truth(data["truth"])
        except Pending:
            print(f"[{name}] ground truth not complete yet: {len(todo)} rows wait", flush=True)
            continue
        for row in todo:
            with np.load(cached(row["scores"])) as z:
                values = xr.DataArray(np.asarray(z["values"])[:truth.sizes["query"]], dims=("query", "train"))
            r = ga.eval.lds(values, truth, target="loss", bootstrap=1000, resample="both")
            row.update(lds=float(r.mean), low=float(r.interval[0]), high=float(r.interval[1]),
                       n_subsets=int(truth.sizes["subset"]))
            _write_row(name, row)
            print(f"  [{name}] {row['method']:10s} {row['config']:40s} LDS {row['lds']:.3f} "
                  f"[{row['low']:.3f}, {row['high']:.3f}]", flush=True)


# -------------------------------------------------------------------------------- report
def table(method: str, settings=SETTINGS) -> tuple[dict, list[str]]:
    """{candidate: {setting: row}} for ``method`` and the settings that have every candidate's LDS."""
    by = {}
    for name in settings:
        for r in _read(name)["rows"]:
            if r["method"] == method:
                by.setdefault(r["config"], {})[name] = r
    return by, settings


def choose(method: str, by: dict, settings) -> tuple[str | None, dict]:
    """Issue 31's rule on ``settings`` (those where the previous default has a number; a
    candidate without a number on one of them is not eligible): among candidates
    never worse than the previous default by more than its interval's lower half-width
    (LDS − low) on any setting, the best worst case, then the best mean. A refused
    candidate (skipped) on a setting counts as −1 there. Returns (choice, summary per candidate)."""
    previous = PREVIOUS_DEFAULT[method]
    if not settings:
        return None, {}
    summary = {}
    for label, rows in by.items():
        values = {}
        for s in settings:
            r = rows.get(s)
            if r is None or ("lds" not in r and "skipped" not in r):
                values = None
                break
            values[s] = r.get("lds", -1.0)
        summary[label] = values
    base = by.get(previous, {})
    eligible = []
    for label, values in summary.items():
        if values is None:
            continue
        ok = True
        for s, v in values.items():
            b = base.get(s, {})
            if "lds" in b and v < b["lds"] - (b["lds"] - b["low"]):
                ok = False
        if ok:
            eligible.append((min(values.values()), float(np.mean(list(values.values()))), label))
    if not eligible or summary.get(previous) is None:
        return None, summary
    eligible.sort(key=lambda t: (-round(t[0], 3), -round(t[1], 3), t[2] != previous))
    return eligible[0][2], summary


def report(methods, settings=SETTINGS, compact: bool = False) -> str:
    """Per method: candidate × setting (LDS [95 % interval]; ``compact``: LDS only), worst,
    mean, cost range, and the candidate ``choose`` picks marked."""
    lines = []
    for method in methods:
        by, _ = table(method, settings)
        if not by:
            continue
        present = [s for s in settings if any(s in rows for rows in by.values())]
        previous = by.get(PREVIOUS_DEFAULT[method], {})
        complete = [s for s in present if "lds" in previous.get(s, {})]
        choice, summary = choose(method, by, complete)
        lines += [f"\n**{method}** (previous default: {PREVIOUS_DEFAULT[method]}; worst / mean over the "
                  f"{len(complete)} settings where it has an LDS: {', '.join(complete)}; blank: not run)\n",
                  "| candidate | " + " | ".join(present) + " | worst | mean | cost (× fwd+bwd, range) |",
                  "|---|" + "---:|" * (len(present) + 3)]
        for label, _, _ in CANDIDATES[method]:
            rows = by.get(label)
            if rows is None:
                continue
            cells, costs = [], []
            for s in present:
                r = rows.get(s)
                if r is None:
                    cells.append("")
                elif "skipped" in r:
                    cells.append("refused")
                elif "lds" in r:
                    cells.append(f"{r['lds']:.3f}" if compact else f"{r['lds']:.3f} [{r['low']:.3f}, {r['high']:.3f}]")
                else:
                    cells.append("(scored)")
                if r is not None and "cost" in r:
                    costs.append(r["cost"])
            values = summary.get(label)
            tail = ([f"{min(values.values()):.3f}", f"{np.mean(list(values.values())):.3f}"]
                    if values else ["", ""])
            cost = f"{min(costs):.0f}–{max(costs):.0f}" if costs else ""
            mark = " **(chosen)**" if label == choice else ""
            lines.append(f"| {label}{mark} | " + " | ".join(cells) + " | " + " | ".join(tail) + f" | {cost} |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--settings", default=",".join(SETTINGS))
    ap.add_argument("--methods", default=",".join(CANDIDATES))
    ap.add_argument("--candidates", default=None, help="only these candidates (comma-separated indices into "
                    "each method's CANDIDATES list, e.g. 2,3); when scoring")
    ap.add_argument("--lds", action="store_true", help="only the LDS of rows already scored")
    ap.add_argument("--report", action="store_true", help="print the tables and the choices")
    ap.add_argument("--compact", action="store_true", help="with --report: LDS without intervals")
    args = ap.parse_args(argv)
    names, methods = args.settings.split(","), args.methods.split(",")
    if args.candidates and not args.report:
        keep = {int(i) for i in args.candidates.split(",")}
        for m in CANDIDATES:
            CANDIDATES[m] = [c for i, c in enumerate(CANDIDATES[m]) if i in keep]
    if args.report:
        print(report(methods, tuple(names), args.compact))
        return
    torch.set_num_threads(1)
    ga.options(progress=False)
    if not args.lds:
        score(names, methods)
    lds(names)


if __name__ == "__main__":
    main()
