"""T = 4096 within the budget: a tiny GPT-2 (SDPA attention, ReLU MLP) on 4096-token
sequences, measured in a fresh process (tests/budget_scripts/long_sequences.py), for the
ghost kernel forced (T² = 1.7·10⁷ pairs of positions per pair of examples, in pairs of
256-position blocks) and K-FAC influence. The plan fits the budget it was given and the
peak resident memory above model, data and warm-up stays within 1.5× of it.

(Without token blocks the same ghost plan is refused: its (nL, nR', T, T) intermediates
alone take 209 MB. tests/test_token_blocks.py checks that refusal in process.)
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

SCRIPT = os.path.join(os.path.dirname(__file__), "budget_scripts", "long_sequences.py")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MiB = 2**20
T = 4096
BUDGET = 64 * MiB


def run(cases: str, **env_extra):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GRADALG_PROGRESS": "0", **env_extra,
           "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, SCRIPT, cases, str(BUDGET), str(T)], capture_output=True, text=True,
                          env=env, timeout=600)


def test_long_sequences_stay_within_the_budget():
    out = run("ghost,kfac")
    assert out.returncode == 0, out.stderr[-3000:]
    results = [json.loads(line) for line in out.stdout.strip().splitlines() if line.startswith("{")]
    assert [r["case"] for r in results] == ["ghost", "kfac"]
    for r in results:
        assert r["finite"]
        assert r["estimated"] <= BUDGET, r
        assert r["peak_growth"] <= 1.5 * BUDGET, (
            f"{r['case']}: peak {r['peak_growth'] / MiB:.1f} MiB above the model and data at T={T}, budget "
            f"{BUDGET / MiB:.0f} MiB (estimated {r['estimated'] / MiB:.1f} MiB), batches {r['batch_sizes']}")

