"""Estimate ÷ measured seconds per call of the curvature-products passes of ``ga.methods.influence``
at its defaults on a digits setting of ``benchmarks/fidelity.py`` (``explain(analyze=True)``):
one JSON line per products pass, with the pass's line of ``explain()`` (its vmap chunks).

Old against new: the first argument names the tree whose ``gradalg`` to import (another worktree:
the code before a change); run one process per tree:

    for tree in /work/main .; do OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 nice -n 10 \\
        .venv/bin/python benchmarks/products_estimate.py $tree conv_wd; done
"""
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main(tree: str, setting: str) -> None:
    tree = str(Path(tree).resolve())
    sys.path.insert(0, tree)
    import torch

    import gradalg as ga                       # the named tree's, before fidelity.py adds its own
    assert Path(ga.__file__).resolve().is_relative_to(tree), ga.__file__
    sys.path.insert(1, str(HERE))
    import fidelity as F

    torch.set_num_threads(1)
    ga.options(progress=False)
    s = F.SETTINGS[setting]
    s.prepare()
    S = ga.methods.influence(s.task(), s.train, s.queries)
    t0 = time.perf_counter()
    shown = S.explain(analyze=True)
    wall = time.perf_counter() - t0
    for r in shown.passes():
        if "measured_calls" in r:
            print(json.dumps({"tree": tree, "setting": setting, "jobs": r["jobs"], "calls": r["measured_calls"],
                              "est_call_s": r["estimated_call_seconds"], "meas_call_s": r["measured_call_seconds"],
                              "est/meas": r["estimated_call_seconds"] / r["measured_call_seconds"],
                              "load": os.getloadavg()[0], "wall": wall}, ensure_ascii=False), flush=True)


if __name__ == "__main__":
    main(*(sys.argv[1:3] if len(sys.argv) > 2 else (str(HERE.parent), sys.argv[1] if len(sys.argv) > 1 else "mlp")))
