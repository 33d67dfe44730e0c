"""Fidelity benchmark: LDS of every method in ``ga.methods.list()`` against retraining.

Two settings on ``sklearn.datasets.load_digits`` (bundled with scikit-learn, nothing is
downloaded), in float64, each with 500 training examples and 100 queries:

    logreg   multinomial logistic regression, nn.Linear(64, 10)
    mlp      64 → 32 → 10 with tanh

and three more dense settings for issue 31's curvature rule (``influence(curvature="near_minimum")``,
``"auto"``'s dense choice), each on its own split of the digits and a 50-subset ground truth:

    mlp_gelu 64 → 24 → 24 → 10 with GELU, L-BFGS to convergence (as mlp)
    mlp_adam 64 → 32 → 10 with tanh, 100 Adam steps from its initialisation (not at a minimum;
             every subset retrained by the same recipe from the same start)
    conv_wd  Conv2d(1, 4, 3) → tanh → Conv2d(4, 8, 3) → tanh → AvgPool2d(2) → Linear(128, 10), L-BFGS

Both minimise  (1/n) Σ_{i ∈ S} CE(f(x_i), y_i) + (wd/2) ‖θ‖²  with n = 500 for every
subset S (removal is a change of weight 1 → 0: the counterfactual influence functions
linearise). Ground truth: 100 subsets of 50% (``ga.eval.retrain``), each trained to
convergence warm-started from the full-data solution (Newton's method for logreg,
L-BFGS for the MLP); targets are the 100 query losses. The rows "at the subsets' centre"
score a second model, trained with every example at weight FRACTION (the subsets' mean
weights; ``Setting.centred``), with ``influence(..., data_weight=FRACTION)``; their seconds
include training it. The row "one Newton step to the subsets' centre" estimates that model
from the trained one instead (``ga.methods.newton_centre``, its seconds in the row). LDS (``ga.eval.lds``,
target="loss") with a 95% bootstrap interval over queries, and the wall time of
``Scores.compute()``.

Retraining results are cached (resumable) under ``benchmarks/.cache/``. Each method runs
with the configuration in ``CONFIG`` below; a method that fails (or that the catalogue
gained since this script was written and cannot be called as
``method(task, train, queries)``) is listed with the reason.

    .venv/bin/python benchmarks/fidelity.py                  # both settings, all methods
    .venv/bin/python benchmarks/fidelity.py --threads 1 --write docs/fidelity.md
    .venv/bin/python benchmarks/fidelity.py --settings logreg --methods influence,trak
"""
from __future__ import annotations

import argparse
import copy
import datetime
import os
import platform
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import gradalg as ga  # noqa: E402
from ground_truths import seed_store  # noqa: E402

HERE = Path(__file__).resolve().parent
CACHE = HERE.parent / "build" / "fidelity"     # retrained targets (resumable) and results-<setting>.json

N_TRAIN, N_QUERY = 500, 100
N_SUBSETS, FRACTION = 100, 0.5
WD = 1e-3                       # weight decay of the training objective (both settings)

# ---------------------------------------------------------------------------------------
# Method configurations: method name -> {variant label: kwargs}. kwargs may depend on the
# setting through a callable(setting) -> dict. Methods missing here run with no kwargs.
# Damping: curvature methods get the objective's true weight decay (H + wd·I is the
# Hessian of the regularised objective) and no extra damping.
# Projections: k at least about a third of the parameter dimension (logreg 650, mlp 2410).
# ---------------------------------------------------------------------------------------
def _defaults(method: str, *names) -> str:
    """'defaults (k=512, ...)': the label names the default values it runs with."""
    import inspect
    params = inspect.signature(getattr(ga.methods, method)).parameters
    return "defaults (" + ", ".join(f"{n}={_value(params[n].default)}" for n in names) + ")"


def _value(v) -> str:
    """A default as a label shows it: numbers by :g, anything else (damping="auto") by repr."""
    return f"{v:g}" if isinstance(v, (int, float)) and not isinstance(v, bool) else repr(v)


CONFIG = {
    "grad_dot": {"": {}},
    "grad_cos": {"": {}},
    "tracin": {"5 SGD checkpoints": {}},
    "influence": {
        # the method as a user calls it (issue 31: the default every row below departs from)
        "defaults (curvature='auto')": {},
        "Gauss-Newton, direct": dict(curvature="gauss_newton", damping=0.0, weight_decay=WD),
        "empirical Fisher, direct": dict(curvature="empirical", damping=0.0, weight_decay=WD),
        "Hessian, CG (rtol 1e-6)": dict(curvature="hessian", solver="cg", damping=0.0, weight_decay=WD,
                                        solver_settings=dict(rtol=1e-6)),
        "Hessian, LiSSA (depth 200)": lambda s: dict(curvature="hessian", solver="lissa", damping=0.0,
                                                    weight_decay=WD,
                                                    solver_settings=dict(scale=s.lissa_scale, depth=200)),
        "Gauss-Newton, Arnoldi r=64": dict(curvature="gauss_newton", solver="arnoldi", rank=64, damping=0.0,
                                           weight_decay=WD),
        "K-FAC": dict(curvature="kfac", damping=0.0, weight_decay=WD),
        "EK-FAC": dict(curvature="ekfac", damping=0.0, weight_decay=WD),
        "DataInf": dict(curvature="datainf", damping=0.0, weight_decay=WD),
        "Gauss-Newton, Gaussian k=512": dict(curvature="gauss_newton", damping=0.0, weight_decay=WD,
                                             projector=ga.proj.gaussian(512, seed=0)),
        # at the counterfactuals' centre: a second model trained with every example at weight
        # FRACTION (the mean of the subsets' weights), scored with data_weight=FRACTION; the
        # row's seconds include training it (Setting.centred)
        "Hessian, CG, at the subsets' centre": dict(curvature="hessian", solver="cg", damping=0.0,
                                                    weight_decay=WD, solver_settings=dict(rtol=1e-6),
                                                    centre=True),
        "Gauss-Newton, direct, at the subsets' centre": dict(curvature="gauss_newton", damping=0.0,
                                                             weight_decay=WD, centre=True),
        "EK-FAC, at the subsets' centre": dict(curvature="ekfac", damping=0.0, weight_decay=WD, centre=True),
        # issue 31 (fiddig): the Hessian formed from dim products at its default damping (shifted to
        # PSD + 0.3 × mean eigenvalue), as a user calls it (no weight decay given)
        "Hessian, direct (default damping)": dict(curvature="dense_hessian"),
        # one Newton step from the trained model to the subsets' centre (ga.methods.newton_centre, the
        # objective's weight decay given), scored there by the formed Hessian at data_weight=FRACTION;
        # the row's seconds include the step
        "Hessian, direct, one Newton step to the subsets' centre": dict(curvature="dense_hessian",
                                                                        weight_decay=WD, newton=True),
    },
    # TRAK's kernel is Φᵀ Φ = n·F: the objective's weight decay enters as n·wd
    "trak": {"1 model, k=2048": dict(k=2048, damping=N_TRAIN * WD), _defaults("trak", "k", "damping"): {},
             _defaults("trak", "k") + " + weight_decay": dict(weight_decay=WD)},
    "logra": {"EK-FAC, k=256": dict(k=256, damping=WD), _defaults("logra", "k", "damping"): {}},
    "grass": {"FactGraSS, k=256": dict(k=256, damping=WD), "GraSS, k=256": dict(k=256, damping=WD, factored=False),
              _defaults("grass", "k", "damping"): {}},
    "less": {_defaults("less", "k") + ", 5 Adam checkpoints": {}, "5 Adam checkpoints, k=2048": dict(k=2048)},
    "relatif": {_defaults("relatif", "damping"): {}, "Gauss-Newton": dict(damping=WD)},
    "trackstar": {"defaults, last of 5 Adam checkpoints": {}},
}
# Methods that do not produce (query, train) scores.
NOT_PAIRWISE = {"self_influence": "gives each training example's self-influence (n_train,), not query × train scores",
                # both differentiate a ga.unroll.TrainingRun (SGD / Adam steps); these settings are
                # trained to convergence by Newton / L-BFGS, which has no such run
                "magic": "differentiates a replayable SGD/Adam run (ga.unroll.TrainingRun); these settings train by "
                         "Newton / L-BFGS to convergence: measured on the MLP's SGD and AdamW runs in docs/unrolled.md",
                "source": "segments an SGD run (ga.unroll.TrainingRun); these settings train by Newton / L-BFGS to "
                          "convergence: measured on the MLP's SGD runs in docs/unrolled.md"}


# --------------------------------------------------------------------------------- data
def digits(split_seed: int = 0):
    from sklearn.datasets import load_digits

    X, y = load_digits(return_X_y=True)
    X, y = torch.tensor(X / 16.0, dtype=torch.float64), torch.tensor(y)
    order = np.random.default_rng(split_seed).permutation(len(X))
    train = (X[order[:N_TRAIN]], y[order[:N_TRAIN]])
    queries = (X[order[N_TRAIN:N_TRAIN + N_QUERY]], y[order[N_TRAIN:N_TRAIN + N_QUERY]])
    return train, queries


def objective(model, X, y, data_weight=1.0):
    """(c/N_TRAIN) Σ CE + (wd/2)‖θ‖² over the given examples, every one at weight c."""
    return (data_weight * F.cross_entropy(model(X), y, reduction="sum") / N_TRAIN
            + WD / 2 * sum((p ** 2).sum() for p in model.parameters()))


def newton_logreg(model: nn.Linear, X, y, tol=1e-11, max_iter=50, data_weight=1.0):
    """Newton's method for multinomial logistic regression, θ = [W | b] (10, 65), on
    ``objective`` (examples at weight ``data_weight``)."""
    n, c = X.shape[0], model.out_features
    Xa = torch.cat([X, torch.ones(n, 1, dtype=X.dtype)], 1)
    Y = F.one_hot(y, c).to(X.dtype)
    theta = torch.cat([model.weight, model.bias[:, None]], 1).detach().clone()
    d = theta.numel()
    XX = (Xa[:, :, None] * Xa[:, None, :]).reshape(n, -1)
    eye = torch.eye(d, dtype=X.dtype)

    def f(t):
        logits = Xa @ t.T
        return (data_weight * (torch.logsumexp(logits, 1) - (logits * Y).sum(1)).sum() / N_TRAIN
                + WD / 2 * (t ** 2).sum())

    for _ in range(max_iter):
        P = torch.softmax(Xa @ theta.T, 1)
        grad = data_weight * (P - Y).T @ Xa / N_TRAIN + WD * theta
        if grad.abs().max() < tol:
            break
        W = torch.diag_embed(P) - P[:, :, None] * P[:, None, :]
        H = (W.reshape(n, -1).T @ XX).reshape(c, c, -1, Xa.shape[1]).permute(0, 2, 1, 3).reshape(d, d)
        step = torch.linalg.solve(data_weight * H / N_TRAIN + WD * eye, grad.reshape(-1)).reshape(theta.shape)
        f0, t = f(theta), 1.0
        while f(theta - t * step) > f0 and t > 1e-10:
            t /= 2
        theta = theta - t * step
    else:
        raise RuntimeError("Newton's method did not converge")
    with torch.no_grad():
        model.weight.copy_(theta[:, :-1])
        model.bias.copy_(theta[:, -1])
    return model


def lbfgs(model, X, y, tol=1e-7, max_iter=5000, data_weight=1.0):
    params = list(model.parameters())
    opt = torch.optim.LBFGS(params, lr=1, max_iter=max_iter, max_eval=2 * max_iter, tolerance_grad=tol,
                            tolerance_change=1e-16, history_size=100, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = objective(model, X, y, data_weight)
        loss.backward()
        return loss

    opt.step(closure)
    closure()
    worst = max(float(p.grad.abs().max()) for p in params)
    if worst > 100 * tol:
        print(f"  warning: L-BFGS stopped at max |grad| {worst:.2e}", flush=True)
    return model


ADAM_STEPS, ADAM_LR, ADAM_BATCH = 100, 1e-2, 32


def adam_steps(model, X, y, tol=None, data_weight=1.0):
    """ADAM_STEPS steps of Adam (lr ADAM_LR) on batches of ADAM_BATCH drawn with replacement
    (the same seeded stream for every subset) of the batch mean CE + (wd/2)‖θ‖²: a model *not*
    trained to a minimum (``tol`` and ``data_weight`` are ignored: a fixed recipe)."""
    g = torch.Generator().manual_seed(0)
    opt = torch.optim.Adam(model.parameters(), lr=ADAM_LR)
    for _ in range(ADAM_STEPS):
        b = torch.randint(len(X), (ADAM_BATCH,), generator=g)
        opt.zero_grad()
        (F.cross_entropy(model(X[b]), y[b]) + WD / 2 * sum((p ** 2).sum() for p in model.parameters())).backward()
        opt.step()
    return model


# ----------------------------------------------------------------------------- settings
@dataclass
class Setting:
    name: str
    description: str
    make_model: callable          # () -> fresh initialised model (seeded)
    fit: callable                 # (model, X, y, tol) -> model trained in place
    tol_full: float               # max |gradient| of the full-data solution
    tol_subset: float             # ... of each retrained model (warm-started from it)
    lissa_scale: float            # > λ_max of the Hessian
    split_seed: int = 0           # the permutation of load_digits into train / queries
    warm_start: bool = True       # subsets start from the full-data solution (else from make_model())
    n_subsets: int = N_SUBSETS    # the ground truth's subsets (the store is resumable whatever the count)
    train: tuple = None
    queries: tuple = None
    full: nn.Module = None
    _trajectories: dict = field(default_factory=dict)
    _centred: tuple = None

    @property
    def dim(self):
        return sum(p.numel() for p in self.full.parameters())

    def prepare(self):
        self.train, self.queries = digits(self.split_seed)
        self.full = self.fit(self.make_model(), *self.train, tol=self.tol_full)

    def train_fn(self, indices):
        # warm start from the full-data solution (a minimiser's neighbour), or the recipe from its start
        model = copy.deepcopy(self.full) if self.warm_start else self.make_model()
        return self.fit(model, self.train[0][indices], self.train[1][indices], tol=self.tol_subset)

    def centred(self):
        """(model, wall seconds, CPU seconds): the model at the subsets' centre, every
        example at weight FRACTION (E[1_S] for α-subsets), warm-started from the full-data
        solution; trained once per setting, its time counted in each row that uses it."""
        if self._centred is None:
            t0, c0 = time.perf_counter(), time.process_time()
            model = self.fit(copy.deepcopy(self.full), *self.train, tol=self.tol_full, data_weight=FRACTION)
            self._centred = (model, time.perf_counter() - t0, time.process_time() - c0)
        return self._centred

    def query_losses(self, model):
        with torch.no_grad():
            return F.cross_entropy(model(self.queries[0]), self.queries[1], reduction="none")

    def task(self, model=None):
        return ga.tasks.classification(model if model is not None else self.full)

    def trajectory(self, kind):
        """5 checkpoints of minibatch training from the initialisation on the full set:
        (models, optimizers, learning rates). kind: "sgd" (TracIn) or "adam" (LESS)."""
        if kind in self._trajectories:
            return self._trajectories[kind]
        torch.manual_seed(1)
        model = self.make_model()
        lr = 0.2 if kind == "sgd" else 3e-3
        opt = (torch.optim.SGD if kind == "sgd" else torch.optim.Adam)(model.parameters(), lr=lr)
        X, y = self.train
        models, optimizers = [], []
        for epoch in range(1, 26):
            for batch in torch.randperm(N_TRAIN).split(50):
                opt.zero_grad()
                (F.cross_entropy(model(X[batch]), y[batch]) + WD / 2 * sum((p ** 2).sum() for p in model.parameters())
                 ).backward()
                opt.step()
            if epoch % 5 == 0:
                snapshot = copy.deepcopy(model)
                snap_opt = type(opt)(snapshot.parameters(), lr=lr)
                snap_opt.load_state_dict(opt.state_dict())
                models.append(snapshot)
                optimizers.append(snap_opt)
        self._trajectories[kind] = (models, optimizers, [lr] * len(models))
        return self._trajectories[kind]


def _logreg():
    torch.manual_seed(0)
    model = nn.Linear(64, 10).double()
    with torch.no_grad():
        model.weight.zero_()
        model.bias.zero_()
    return model


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 10)).double()


def _mlp_gelu():
    torch.manual_seed(2)
    return nn.Sequential(nn.Linear(64, 24), nn.GELU(), nn.Linear(24, 24), nn.GELU(), nn.Linear(24, 10)).double()


def _mlp_adam():
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 10)).double()


def _conv_wd():
    torch.manual_seed(4)
    return nn.Sequential(nn.Unflatten(1, (1, 8, 8)), nn.Conv2d(1, 4, 3, padding=1), nn.Tanh(),
                         nn.Conv2d(4, 8, 3, padding=1), nn.Tanh(), nn.AvgPool2d(2), nn.Flatten(),
                         nn.Linear(128, 10)).double()


SETTINGS = {
    "logreg": Setting("logreg", "multinomial logistic regression, Linear(64, 10)", _logreg, newton_logreg,
                      tol_full=1e-11, tol_subset=1e-11, lissa_scale=10.0),
    "mlp": Setting("mlp", "MLP 64 → 32 → 10, tanh", _mlp, lbfgs, tol_full=1e-9, tol_subset=1e-7,
                   lissa_scale=50.0),
    # issue 31 (fidauto): dense settings the formed-Hessian rule of curvature="auto" was not read
    # off (another split of load_digits each, 50 subsets): two trained to a minimum of the weight-
    # decayed objective, one by a few Adam steps from its initialisation (not at a minimum)
    "mlp_gelu": Setting("mlp_gelu", "MLP 64 → 24 → 24 → 10, GELU, L-BFGS to convergence", _mlp_gelu, lbfgs,
                        tol_full=1e-9, tol_subset=1e-7, lissa_scale=50.0, split_seed=2, n_subsets=50),
    "mlp_adam": Setting("mlp_adam", f"MLP 64 → 32 → 10, tanh, {ADAM_STEPS} Adam steps (lr {ADAM_LR:g}, batch "
                        f"{ADAM_BATCH}) from its initialisation, not converged", _mlp_adam, adam_steps,
                        tol_full=0.0, tol_subset=0.0, lissa_scale=50.0, split_seed=3, warm_start=False,
                        n_subsets=50),
    "conv_wd": Setting("conv_wd", "conv net 1×8×8: Conv2d(1, 4, 3) → tanh → Conv2d(4, 8, 3) → tanh → AvgPool2d(2) "
                       "→ Linear(128, 10), L-BFGS to convergence", _conv_wd, lbfgs, tol_full=1e-9,
                       tol_subset=1e-7, lissa_scale=50.0, split_seed=4, n_subsets=50),
}


# -------------------------------------------------------------------------------- calls
def call_method(name, setting: Setting, kwargs):
    """Lazy Scores of method ``name`` on ``setting`` (special signatures handled here)."""
    fn = getattr(ga.methods, name)
    train, queries = setting.train, setting.queries
    if name == "tracin":
        models, _, lrs = setting.trajectory("sgd")
        return fn([setting.task(m) for m in models], lrs, train, queries, **kwargs)
    if name == "less":
        models, optimizers, lrs = setting.trajectory("adam")
        return fn([setting.task(m) for m in models], optimizers, lrs, train, queries,
                  np.arange(N_QUERY), **kwargs)
    if name == "trak":
        return fn([setting.task()], train, queries, **kwargs)
    if name == "trackstar":                   # the Adam run's last checkpoint and its optimizer state
        models, optimizers, _ = setting.trajectory("adam")
        return fn(setting.task(models[-1]), train, queries, optimizer=optimizers[-1], **kwargs)
    if kwargs.pop("newton", False):
        centred = ga.methods.newton_centre(setting.task(), train, data_weight=FRACTION, weight_decay=WD)
        return fn(centred, train, queries, data_weight=FRACTION, **kwargs)
    if kwargs.pop("centre", False):
        return fn(setting.task(setting.centred()[0]), train, queries, data_weight=FRACTION, **kwargs)
    return fn(setting.task(), train, queries, **kwargs)


def variants(name, setting):
    for label, kwargs in CONFIG.get(name, {"": {}}).items():
        yield label, (kwargs(setting) if callable(kwargs) else dict(kwargs))


@dataclass
class Row:
    setting: str
    method: str
    variant: str
    lds: float = float("nan")
    low: float = float("nan")
    high: float = float("nan")
    seconds: float = float("nan")
    cpu: float = float("nan")
    cost: float = float("nan")      # seconds / one plain forward + backward over the training set
    skipped: str = ""


def ground_truth(setting: Setting, n_subsets: int | None = None, progress=False):
    """The setting's retrained ground truth (``ga.eval.retrain``, cached and resumable under
    ``build/fidelity/``, seeded from the committed runs of ``benchmarks/ground_truths.py``);
    ``setting.prepare()`` must have run."""
    store = CACHE / f"{setting.name}-n{N_TRAIN}-q{N_QUERY}-wd{WD:g}-tol{setting.tol_subset:g}"
    seed_store(store)
    return ga.eval.retrain(setting.train_fn, N_TRAIN, n_subsets=n_subsets or setting.n_subsets, fraction=FRACTION,
                           seed=0, targets_fn=setting.query_losses, target="loss", progress=progress,
                           store=store)


def run_setting(setting: Setting, methods, progress=False, n_subsets=None, exclude=()) -> tuple[list[Row], float]:
    n_subsets = n_subsets or setting.n_subsets
    start = time.perf_counter()
    setting.prepare()
    gt = ground_truth(setting, n_subsets, progress)
    truth_seconds = time.perf_counter() - start
    base = fwd_bwd_seconds(setting)
    print(f"\n[{setting.name}] {setting.description}: {setting.dim} parameters; ground truth "
          f"({n_subsets} subsets, α={FRACTION}) ready in {truth_seconds:.1f} s", flush=True)
    rows = []
    for name in methods:
        if name in NOT_PAIRWISE:
            rows.append(Row(setting.name, name, "", skipped=NOT_PAIRWISE[name]))
            print(f"  {name:16s} skipped: {NOT_PAIRWISE[name]}", flush=True)
            continue
        for label, kwargs in variants(name, setting):
            if any(x and x in label for x in exclude):
                continue
            row = Row(setting.name, name, label)
            try:
                _, wall, cpu = setting.centred() if kwargs.get("centre") else (None, 0.0, 0.0)   # its training
                t0, c0 = time.perf_counter(), time.process_time()
                scores = call_method(name, setting, kwargs)     # eager only for newton=True (its step)
                values = scores.compute()
                row.seconds, row.cpu = time.perf_counter() - t0 + wall, time.process_time() - c0 + cpu
                row.cost = row.seconds / base
                if values.shape != (N_QUERY, N_TRAIN) or not np.isfinite(values.values).all():
                    raise ValueError(f"returned {values.shape} scores with "
                                     f"{int((~np.isfinite(values.values)).sum())} non-finite values")
                result = ga.eval.lds(values, gt, target="loss", bootstrap=2000, resample="both")
                row.lds, (row.low, row.high) = result.mean, result.interval
                print(f"  {name:16s} {label:30s} LDS {row.lds:6.3f} [{row.low:.3f}, {row.high:.3f}]  "
                      f"{row.seconds:7.2f} s ({row.cpu:.2f} s CPU)", flush=True)
            except Exception as exc:  # noqa: BLE001 - a failing method is reported, not fatal
                row.skipped = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:160]
                print(f"  {name:16s} {label:30s} skipped: {row.skipped}", flush=True)
                if progress:
                    traceback.print_exc()
            rows.append(row)
    write_results(setting, rows, base, n_subsets)
    return rows, truth_seconds


def fwd_bwd_seconds(setting: Setting, repeats: int = 5) -> float:
    """Wall time of one plain forward + backward of the summed loss over the training set."""
    model, (X, y) = copy.deepcopy(setting.full), setting.train
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        model.zero_grad()
        F.cross_entropy(model(X), y, reduction="sum").backward()
        best = min(best, time.perf_counter() - t0)
    return best


def write_results(setting: Setting, rows: list[Row], base: float, n_subsets: int) -> None:
    """Rows as ``build/fidelity/results-<setting>.json`` (read by notebook 03's chart)."""
    import json
    from dataclasses import asdict
    out = CACHE / f"results-{setting.name}.json"
    previous = json.loads(out.read_text())["rows"] if out.exists() else []
    new = [{**{k: v for k, v in asdict(r).items() if k != "variant"}, "config": r.variant} for r in rows]
    seen = {(r["method"], r["config"]) for r in new}
    merged = [r for r in previous if (r["method"], r["config"]) not in seen] + new
    CACHE.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"setting": setting.name, "description": setting.description,
                               "protocol": {"n_subsets": n_subsets, "fraction": FRACTION, "seeds_per_subset": 1,
                                            "target": "query loss (cross-entropy)",
                                            "interval": "95% percentile bootstrap over queries and subsets"},
                               "fwd_bwd_seconds": base, "rows": merged}, indent=1, default=float))


# ------------------------------------------------------------------------------ report
def table(rows: list[Row], settings: list[str]) -> str:
    keys = []
    for r in rows:
        if (r.method, r.variant) not in keys:
            keys.append((r.method, r.variant))
    by = {(r.setting, r.method, r.variant): r for r in rows}
    head = "| method | configuration | " + " | ".join(f"{s}: LDS [95% CI] | {s}: wall (CPU)" for s in settings) + " |"
    sep = "|---|---|" + "---:|---:|" * len(settings)
    lines = [head, sep]
    for method, variant in keys:
        cells = []
        for s in settings:
            r = by.get((s, method, variant))
            if r is None:
                cells += ["", ""]
            elif r.skipped:
                cells += [f"skipped: {r.skipped.replace('|', '/')}", ""]
            else:
                cells += [f"{r.lds:.3f} [{r.low:.3f}, {r.high:.3f}]", f"{r.seconds:.2f} s ({r.cpu:.2f} s)"]
        lines.append(f"| {method} | {variant} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settings", default="logreg,mlp")
    parser.add_argument("--methods", default=None, help="comma-separated (default: ga.methods.list())")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument("--write", default=None, help="also write the table into this markdown file")
    parser.add_argument("--progress", action="store_true", help="print each retraining and tracebacks")
    parser.add_argument("--note", default="", help="a sentence about the machine, for --write")
    parser.add_argument("--n-subsets", type=int, default=None, help=f"retrained subsets (default {N_SUBSETS})")
    parser.add_argument("--exclude", default="", help="skip configurations whose label contains one of these "
                        "comma-separated words (e.g. 'CG,LiSSA')")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    settings = [s for s in args.settings.split(",") if s]
    methods = args.methods.split(",") if args.methods else list(ga.methods.list())
    start = time.perf_counter()
    rows, truth = [], {}
    for name in settings:
        setting_rows, truth[name] = run_setting(SETTINGS[name], methods, args.progress, args.n_subsets,
                                                tuple(args.exclude.split(",")))
        rows += setting_rows
    total = time.perf_counter() - start
    text = table(rows, settings)
    print("\n" + text)
    print(f"\ntotal {total:.0f} s (ground truth: " + ", ".join(f"{k} {v:.0f} s" for k, v in truth.items()) + ")")
    if args.write:
        write_markdown(Path(args.write), text, total, truth, args.note)


def write_markdown(path: Path, text: str, total: float, truth: dict, note: str = ""):
    machine = (f"{platform.machine()}, {os.cpu_count()} CPU cores, torch {torch.__version__} "
               f"with {torch.get_num_threads()} intra-op thread(s), Python {platform.python_version()}")
    body = f"""# Fidelity: LDS against retraining

Generated by `benchmarks/fidelity.py` on {datetime.date.today().isoformat()} ({machine}).{" " + note if note else ""}
Total run time {total:.0f} s, of which retraining for the ground truth
{", ".join(f"{k} {v:.0f} s" for k, v in truth.items())} (cached in `benchmarks/.cache/`:
a rerun only recomputes the scores).

**Setup.** `load_digits` (scikit-learn), {N_TRAIN} training examples and {N_QUERY} queries, float64.
`logreg`: multinomial logistic regression `nn.Linear(64, 10)`; `mlp`: 64 → 32 → 10 with tanh.
Objective (1/n) Σ_(i∈S) CE + (wd/2)‖θ‖², wd = {WD:g}, n = {N_TRAIN} for every subset S.
Ground truth: {N_SUBSETS} random subsets of {FRACTION:.0%} (`ga.eval.retrain`, seed 0), each
trained to convergence warm-started from the full-data solution (Newton for logreg,
L-BFGS for the MLP); the target is each query's cross-entropy loss. LDS is
`ga.eval.lds(..., target="loss")`: per query the Spearman correlation over subsets of
−Σ_(i∈S) τ_qi with the retrained loss, averaged over queries, with a 95% percentile
bootstrap interval over queries. Time is the wall time of `Scores.compute()`, and in
parentheses its process CPU time, steadier on a shared machine (training the TracIn/LESS
checkpoints is excluded). Method configurations are `CONFIG` at
the top of the script: curvature methods use the objective's weight decay as their
damping; TracIn uses 5 checkpoints of minibatch SGD and LESS 5 checkpoints of Adam
(25 epochs from the initialisation, batch 50); TRAK uses the one full-data model.

{text}
"""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(body)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
