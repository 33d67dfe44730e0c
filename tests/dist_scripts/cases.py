"""The ``__main__`` of a torchrun case script: run the named cases on every rank, report each
as "ok" or the first rank's traceback, and write ``{case: result}`` to ``sys.argv[1]`` from
rank 0 (``sys.argv[2]``: optional comma-separated case names). ``tests/torchrun.py`` launches
such scripts and reads the file."""
from __future__ import annotations

import json
import os
import sys
import traceback

import torch.distributed as dist


def run_and_report(cases: dict, traceback_limit: int = 8) -> None:
    """Run ``cases`` ({name: callable}) in order, a barrier after each (a failed case is
    reported and the others still run: every rank runs the same collectives), merge the
    ranks' results on rank 0, write them, and leave without running the process groups'
    C++ destructors (with several gloo groups they sometimes abort at interpreter exit:
    "terminate called without an active exception")."""
    wanted = sys.argv[2].split(",") if len(sys.argv) > 2 else None
    results = {}
    for name, case in cases.items():
        if wanted and name not in wanted:
            continue
        try:
            case()
            results[name] = "ok"
        except Exception:  # noqa: BLE001 - report, keep going
            results[name] = traceback.format_exc(limit=traceback_limit)
        dist.barrier()
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, results)
    if dist.get_rank() == 0:
        merged = {k: next((r[k] for r in everyone if r[k] != "ok"), "ok") for k in results}
        with open(sys.argv[1], "w") as f:
            json.dump(merged, f, indent=1)
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
