"""LESS and TrackStar (the checkpoint methods) at their defaults and a few candidate
configurations on the nine fidelity settings (issue 31 item 2: their defaults had been
measured on two settings each).

Runs ``benchmarks/defaults_suite.py``'s machinery unchanged — the same settings, the same
calls (``method(task, train, queries, **kwargs)`` on each setting's own checkpoints), the
same shared scores caches (a candidate that is a standard row reuses that row's scores),
the same LDS (``ga.eval.lds(..., target="loss", bootstrap=1000, resample="both")``) and the
same rule (``defaults_suite.choose``: the best worst case, then the best mean, among the
candidates never below the previous default's interval) — with this module's
``CANDIDATES`` and its own results files, ``build/fidelity/checkpoint-<setting>.json``
(``defaults-<setting>.json`` stay ``defaults_suite``'s).

    PYTHONPATH=. OMP_NUM_THREADS=1 nice -n 10 python benchmarks/fidelity_checkpoint_methods.py \\
        --settings logreg,mlp,lm2,text --methods less
    ... --lds                 # only the LDS of rows already scored
    python benchmarks/fidelity_checkpoint_methods.py --report [--compact]

TrackStar on the LM settings costs 100–500× one forward + backward per candidate: run its
settings cheapest first (``--settings``) and read the blanks of ``--report`` as "not run".
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
import gradalg as ga  # noqa: E402
import defaults_suite as D  # noqa: E402

#: method -> [(label, kwargs, standard row's label or None)]; the first is the current default,
#: its values spelled out (the rows do not move when a default changes)
CANDIDATES = {
    "less": [
        ("defaults (k=8192)", dict(k=8192), "defaults (k=8192), 3 Adam checkpoints"),
        ("sparse k=8192", dict(projector=("sparse", 8192)), "3 Adam checkpoints, sparse k=8192"),
        ("k=2048", dict(k=2048), None),
    ],
    "trackstar": [
        ("defaults (k=4096, relative_damping=0.1)", dict(k=4096, relative_damping=0.1),
         "defaults (k=4096, relative_damping=0.1), final Adam state"),
        ("damping='auto'", dict(k=4096, damping="auto"), None),
        ("relative_damping=1", dict(k=4096, relative_damping=1.0), None),
    ],
}


def results_path(name: str) -> Path:
    return D.BUILD / f"checkpoint-{name}.json"


def install() -> None:
    """Point defaults_suite at this module's candidates and results files."""
    D.CANDIDATES.clear()
    D.CANDIDATES.update(CANDIDATES)
    D.PREVIOUS_DEFAULT.clear()
    D.PREVIOUS_DEFAULT.update({m: rows[0][0] for m, rows in CANDIDATES.items()})
    D.results_path = results_path


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--settings", default=",".join(D.SETTINGS))
    ap.add_argument("--methods", default=",".join(CANDIDATES))
    ap.add_argument("--candidates", default=None, help="only these candidates' labels (comma-separated "
                    "indices into each method's list, e.g. 0,1)")
    ap.add_argument("--lds", action="store_true", help="only the LDS of rows already scored")
    ap.add_argument("--report", action="store_true", help="print the tables and the choices")
    ap.add_argument("--compact", action="store_true", help="with --report: LDS without intervals")
    args = ap.parse_args(argv)
    install()
    if args.candidates:
        keep = [int(i) for i in args.candidates.split(",")]
        for m in D.CANDIDATES:
            D.CANDIDATES[m] = [c for i, c in enumerate(CANDIDATES[m]) if i in keep]
    names, methods = args.settings.split(","), args.methods.split(",")
    if args.report:
        install()
        print(D.report(methods, tuple(names), args.compact))
        return
    torch.set_num_threads(1)
    ga.options(progress=False)
    if not args.lds:
        D.score(names, methods)
    D.lds(names)


if __name__ == "__main__":
    main()
