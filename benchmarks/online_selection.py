"""Online data selection on a task with injected label noise, against random selection.

    python benchmarks/online_selection.py                 # 3 seeds, prints curves and ratios
    python benchmarks/online_selection.py --seeds 5 --steps 600 --noise 0.5

Task: 5-class classification of 32-d inputs labelled by a fixed random teacher network;
40% of the training labels are replaced by a different random class. A small clean
"target" batch (64 examples, apart from the evaluation set) defines the validation gradient.

Every method trains the same MLP from the same initialization on the same sequence of
batches (64 examples, SGD with momentum, mean cross-entropy) and keeps half of each batch:

- online selection   scores each example by ⟨g_i, g_val⟩ (ghost products on the captured
                     factors), drops the lower half, corrects the step exactly
                     (``OnlineSelection(ValidationTarget(...), DropFraction(0.5), renormalize=True)``);
- batch-mean target  the same against the batch's own mean gradient;
- random             drops a random half (``RandomDrop(0.5)``: same examples per step);
- no selection       keeps all 64 (reference, twice the examples per step).

Printed: clean validation loss every ``--every`` steps (mean over seeds), the ratio of online
selection's validation loss to random selection's at the last step and averaged over the
curve, and the fraction of dropped examples that had a corrupted label.
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn

from gradalg.integrations import BatchMean, DropFraction, KeepAll, OnlineSelection, RandomDrop, ValidationTarget


def make_task(seed: int, n_train=4000, n_val=1000, n_target=64, d=32, classes=5, noise=0.4):
    g = torch.Generator().manual_seed(1000 + seed)
    teacher = [torch.randn(d, 64, generator=g) / d ** 0.5, torch.randn(64, classes, generator=g) / 8]

    def label(x):
        return (torch.tanh(x @ teacher[0]) @ teacher[1]).argmax(1)

    x = torch.randn(n_train + n_val + n_target, d, generator=g)
    y = label(x)
    xtr, ytr = x[:n_train], y[:n_train].clone()
    corrupt = torch.rand(n_train, generator=g) < noise
    shift = torch.randint(1, classes, (n_train,), generator=g)
    ytr[corrupt] = (ytr[corrupt] + shift[corrupt]) % classes          # always a wrong class
    val = (x[n_train:n_train + n_val], y[n_train:n_train + n_val])
    target = (x[n_train + n_val:], y[n_train + n_val:])
    return (xtr, ytr), corrupt, val, target


def make_model(seed, d=32, classes=5):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d, 128), nn.Tanh(), nn.Linear(128, classes))


def sum_ce(model, batch):
    return F.cross_entropy(model(batch[0]), batch[1], reduction="sum")


def train(method: str, seed: int, steps: int, every: int, batch_size=64, lr=0.1):
    train_set, corrupt, val, target = make_task(seed)
    model = make_model(seed)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    policy = {"online": DropFraction(0.5), "batch_mean": DropFraction(0.5), "random": RandomDrop(0.5, seed=seed),
              "all": KeepAll()}[method]
    tgt = ValidationTarget(sum_ce, target) if method == "online" else BatchMean()
    sel = OnlineSelection(tgt, policy, renormalize=True)
    order = torch.Generator().manual_seed(seed)
    curve, dropped_noisy, dropped = [], 0, 0
    t0 = time.perf_counter()
    with sel.attach(model, optimizer=opt):
        for step in range(steps + 1):
            if step % every == 0:
                with torch.no_grad():
                    curve.append(float(F.cross_entropy(model(val[0]), val[1])))
            if step == steps:
                break
            idx = torch.randint(0, train_set[0].shape[0], (batch_size,), generator=order)
            opt.zero_grad()
            F.cross_entropy(model(train_set[0][idx]), train_set[1][idx]).backward()
            opt.step()                                   # selection + exact correction run here
            w = sel.last.weights
            dropped += int((w == 0).sum())
            dropped_noisy += int(corrupt[idx][w == 0].sum())
    return {"curve": curve, "noisy_among_dropped": dropped_noisy / max(dropped, 1),
            "seconds": time.perf_counter() - t0}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--every", type=int, default=25)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    methods = ["online", "batch_mean", "random", "all"]
    runs = {m: [train(m, s, args.steps, args.every) for s in range(args.seeds)] for m in methods}
    curves = {m: torch.tensor([r["curve"] for r in runs[m]]) for m in methods}   # (seeds, points)
    print(f"clean validation loss, mean over {args.seeds} seeds (label noise 40%, keep 32 of 64 per step)")
    print("step   " + "".join(f"{m:>12}" for m in methods))
    for j in range(curves["online"].shape[1]):
        print(f"{j * args.every:<7d}" + "".join(f"{float(curves[m][:, j].mean()):12.4f}" for m in methods))
    final = {m: curves[m][:, -1] for m in methods}
    ratio_final = float(final["online"].mean() / final["random"].mean())
    ratio_curve = float(curves["online"][:, 1:].mean() / curves["random"][:, 1:].mean())
    per_seed = (final["online"] / final["random"]).tolist()
    print()
    for m in methods:
        noisy = sum(r["noisy_among_dropped"] for r in runs[m]) / args.seeds
        secs = sum(r["seconds"] for r in runs[m]) / args.seeds
        print(f"{m:>11}: final val loss {float(final[m].mean()):.4f} ± {float(final[m].std()):.4f}   "
              f"corrupted among dropped {noisy:6.1%}   {secs:5.1f} s/run")
    print(f"\nratio online / random validation loss: final {ratio_final:.3f} "
          f"(per seed {', '.join(f'{r:.3f}' for r in per_seed)}), averaged over the curve {ratio_curve:.3f}")
    return {"ratio_final": ratio_final, "ratio_curve": ratio_curve, "per_seed": per_seed}


if __name__ == "__main__":
    main()
