"""What ``curvature="auto"``'s near-minimum rule costs (issue 31): ``ga.methods.influence`` at its
defaults on a digits setting of ``benchmarks/fidelity.py`` (its full-data model, trained once and
kept in ``build/near_minimum_cost/``), CPU and wall seconds of ``compute()`` in this process, the
decision it took, the number of full-size eigendecompositions and the Hessian-product calls.

Old against new: run it with ``--gradalg`` naming the tree whose ``gradalg`` to import (another
worktree: the code before a change), alternating processes, and compare the JSON lines:

    for r in 1 2 3; do
      for tree in /work/main .; do
        OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 nice -n 10 .venv/bin/python benchmarks/near_minimum_cost.py \\
            --setting mlp --gradalg $tree --out build/near_minimum_cost/mlp.jsonl; done; done

``--scores`` saves the scores (``.npy``) to compare the two trees' numbers; ``--profile N`` prints
the N most expensive functions by cumulative time (cProfile).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--setting", default="mlp")
    ap.add_argument("--gradalg", default=str(HERE.parent), help="the tree whose gradalg is imported")
    ap.add_argument("--out", default=None, help="append one JSON line here")
    ap.add_argument("--scores", default=None, help="save the scores here (.npy)")
    ap.add_argument("--profile", type=int, default=0)
    ap.add_argument("--label", default="")
    args = ap.parse_args(argv)

    tree = Path(args.gradalg).resolve()
    sys.path.insert(0, str(tree))
    import numpy as np
    import torch

    import gradalg as ga                          # the named tree's, before fidelity.py adds its own
    assert Path(ga.__file__).resolve().is_relative_to(tree), ga.__file__
    sys.path.insert(1, str(HERE))
    import fidelity
    from gradalg.expr.curvature import PROBES

    setting = fidelity.SETTINGS[args.setting]
    cache = HERE.parent / "build" / "near_minimum_cost" / f"{args.setting}-full.pt"
    setting.train, setting.queries = fidelity.digits(setting.split_seed)
    model = setting.make_model()
    if cache.exists():
        model.load_state_dict(torch.load(cache))
    else:
        model = setting.fit(model, *setting.train, tol=setting.tol_full)
        cache.parent.mkdir(parents=True, exist_ok=True)
        torch.save(model.state_dict(), cache)
    setting.full = model

    counts = {"eigh": 0, "eigvalsh": 0}
    dim = setting.dim
    for name in counts:
        real = getattr(torch.linalg, name)

        def counted(A, *a, _real=real, _name=name, **k):
            if A.shape[-1] == dim:
                counts[_name] += 1
            return _real(A, *a, **k)
        setattr(torch.linalg, name, counted)

    PROBES.clear()
    S = ga.methods.influence(setting.task(), setting.train, setting.queries)
    prof = None
    if args.profile:
        import cProfile
        prof = cProfile.Profile()
        prof.enable()
    t0, c0 = time.perf_counter(), time.process_time()
    values = np.asarray(S.compute().transpose("query", "train").values)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    if prof is not None:
        import pstats
        prof.disable()
        pstats.Stats(prof).sort_stats("cumulative").print_stats(args.profile)
    probe = next(iter(PROBES.values()), None)
    row = {"setting": args.setting, "tree": str(tree), "label": args.label, "dim": dim, "cpu_s": round(cpu, 3),
           "wall_s": round(wall, 3), "full_size_eigh": counts["eigh"], "full_size_eigvalsh": counts["eigvalsh"],
           "chosen": probe.chosen if probe else None, "decision": probe.describe() if probe else None,
           "threads": torch.get_num_threads(), "load": os.getloadavg()[0]}
    print(json.dumps(row), flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        with open(args.out, "a") as f:
            f.write(json.dumps(row) + "\n")
    if args.scores:
        np.save(args.scores, values)


if __name__ == "__main__":
    main()
