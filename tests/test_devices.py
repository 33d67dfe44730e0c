"""The machine model's package, ``gradalg.devices``: the planner's cost-model fits reach
every measured profile, though the package cannot import the planner.

``devices/`` stands below ``plan/`` (``tests/test_layout.py`` fails on an upward import), so
the products job registers its fit (``product_seconds``, ``product_work``) in
``devices.measure.FITS``; these tests check that ``import gradalg`` registers it in a fresh
process and that a measurement applies the registered fits before it is returned (and so
before it is cached).
"""
from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import torch

from gradalg.devices import measure


def test_importing_the_package_registers_the_products_fit():
    code = ("import gradalg.devices.measure as m; from gradalg.plan.jobs.products import fit_products; "
            "assert m.FITS == [fit_products], m.FITS; print('ok')")
    root = str(Path(__file__).resolve().parents[1])            # this checkout's gradalg, not an installed one
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_a_measured_profile_has_the_fits_applied(monkeypatch):
    seen = []

    def fit(prof, timed, device):
        seen.append((prof.measured, str(device)))
        return replace(prof, product_work=7.5)

    monkeypatch.setattr(measure, "FITS", [fit])
    prof = measure.measure_profile(torch.device("cpu"), gemm_sizes=(8,), bmm_sizes=(4,), eigh_sizes=(8,),
                                   copy_bytes=2**16, batch_elements=2**10, seconds=0.002)
    assert seen == [(True, "cpu")] and prof.product_work == 7.5
    monkeypatch.setattr(measure, "FITS", [])
    assert measure.measure_profile(torch.device("cpu"), gemm_sizes=(8,), bmm_sizes=(4,), eigh_sizes=(8,),
                                   copy_bytes=2**16, batch_elements=2**10, seconds=0.002).product_work == 2.0
