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


def test_the_cpu_and_an_accelerator_profile_are_built_by_one_builder(monkeypatch):
    """``measure_cpu`` and ``measure_profile`` build their profiles in one place
    (``measure._measured_profile``): both measure every number the benchmarks shared by all
    devices give (none left at its nominal default), and differ only in the fields of their
    kind — the CPU's page faults, random numbers, block costs and table draws are measured;
    an accelerator's come from the host's profile (nominal here: no cache) and its fault
    bandwidth stays 0. About 3 s of CPU for ``measure_cpu``."""
    monkeypatch.setattr(measure, "FITS", [])
    monkeypatch.setattr(measure, "cached_local_profile", lambda: measure.DeviceProfile("host", 1.0, 1.0, 1.0, 1.0))
    built = []
    one = measure._measured_profile
    monkeypatch.setattr(measure, "_measured_profile", lambda *a, **k: built.append(a[2]) or one(*a, **k))
    cpu = measure.measure_cpu()
    acc = measure.measure_profile(torch.device("cpu"), gemm_sizes=(16, 32), bmm_sizes=(4, 8), eigh_sizes=(8, 16),
                                  copy_bytes=2**20, batch_elements=2**12, seconds=0.005)
    assert built == [cpu.name, acc.name] and acc.name == "cpu (cpu, measured)"
    nominal = measure.DeviceProfile("nominal", 1.0, 1.0, 1.0, 1.0)
    shared = ("call_seconds", "op_seconds", "batch_seconds", "layer_seconds", "elementwise_bandwidth",
              "gemm_rates", "bmm_rates", "bmm_call_seconds", "eigh_times", "sjlt_bytes", "ts_bytes_per_bin",
              "ts_flat_bytes")
    for prof in (cpu, acc):
        assert prof.measured and prof.flops_fp32 == max(rate for _, rate in prof.gemm_rates) > 0
        assert prof.flops_bf16 >= prof.flops_fp32 and prof.bandwidth > 0 and prof.memory == measure.host_memory()
        for name in shared:
            assert getattr(prof, name) != getattr(nominal, name), (prof.name, name)
    assert cpu.flops_bf16 == cpu.flops_fp32 and [n for n, _ in cpu.gemm_rates] == list(measure.GEMM_SIZES)
    assert [d for d, _ in cpu.eigh_times] == list(measure.EIGH_SIZES) and cpu.fault_bandwidth > 0
    assert [kind for kind, _ in cpu.block_seconds] == ["ekfac", "kfac", "scores", "ghost", "precondition", "resolve"]
    assert cpu.random_seconds != nominal.random_seconds and cpu.sjlt_build_randoms != nominal.sjlt_build_randoms
    assert (acc.fault_bandwidth, acc.block_seconds, acc.link_bandwidth) == (0.0, (), 0.0)
    assert (acc.random_seconds, acc.sjlt_build_randoms) == (nominal.random_seconds, nominal.sjlt_build_randoms)
