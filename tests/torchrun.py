"""One launch of a ``tests/dist_scripts`` script under ``torchrun --nproc_per_node 2`` (gloo on
CPU): the script runs every case and writes ``{case: "ok" | traceback}`` as JSON, which each
test of the calling module reads (a launch costs seconds of start-up)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

DIST_SCRIPTS = os.path.join(os.path.dirname(__file__), "dist_scripts")


def run_cases(script: str, out, *, timeout: float) -> dict:
    """Run ``dist_scripts/<script>`` on two ranks, its results written to ``out``; a failed
    launch (not a failed case: those are reported in the results) is retried once, then
    fails the calling test with the launch's output."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           os.path.join(DIST_SCRIPTS, script), str(out)]
    for _ in range(2):
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        if proc.returncode == 0 and out.exists():
            return json.loads(out.read_text())
    pytest.fail(f"torchrun exited with {proc.returncode}\n--- stdout\n{proc.stdout[-3000:]}\n"
                f"--- stderr\n{proc.stderr[-6000:]}")
