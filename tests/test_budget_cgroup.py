"""The default memory budget inside a container: a cgroup memory limit below the host's
``MemAvailable`` bounds ``available`` (cgroup v2 and v1, nested groups, page cache counted
as reclaimable), and no limit leaves ``MemAvailable`` in force."""
import pytest

import gradalg as ga
from gradalg.plan import budget as B

GB = 10**9


def _meminfo(tmp_path, available_bytes):
    path = tmp_path / "meminfo"
    path.write_text(f"MemTotal: 64000000 kB\nMemAvailable: {available_bytes // 1024} kB\n")
    return str(path)


def _group(folder, **files):
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name.replace("_", ".", 1)).write_text(text)


@pytest.fixture
def fake(tmp_path, monkeypatch):
    root = tmp_path / "cgroup"
    proc = tmp_path / "proc-self-cgroup"
    monkeypatch.setattr(B, "CGROUP_ROOT", str(root))
    monkeypatch.setattr(B, "PROC_CGROUP", str(proc))
    monkeypatch.setattr(B, "MEMINFO", _meminfo(tmp_path, 40 * GB))
    return root, proc


def _resolve():
    with ga.options(memory_budget=None, memory_fraction=0.5):
        return B.resolve_budget(ga.get_options())


def test_v2_limit_bounds_available(fake):
    root, proc = fake
    proc.write_text("0::/job/step\n")
    _group(root / "job", memory_max=str(12 * GB), memory_current=str(5 * GB),
           memory_stat=f"anon {4 * GB}\ninactive_file {1 * GB}\n")
    _group(root / "job" / "step", memory_max="max", memory_current=str(4 * GB), memory_stat="")
    budget = _resolve()
    # room = 12 − (5 − 1) = 8 GB, under the host's 40 GB
    assert budget.available == 8 * GB and budget.bytes == 4 * GB
    assert budget.source == "cgroup memory limit"
    assert "0.5 × 8 GB available (cgroup memory limit; memory_fraction)" in budget.describe()


def test_v2_innermost_smaller_limit_wins(fake):
    root, proc = fake
    proc.write_text("0::/job/step\n")
    _group(root / "job", memory_max=str(12 * GB), memory_current=str(5 * GB))
    _group(root / "job" / "step", memory_max=str(6 * GB), memory_current=str(5 * GB))
    assert _resolve().available == 1 * GB


def test_v1_limit_and_namespace_root(fake):
    root, proc = fake
    # inside a cgroup namespace the listed path does not exist under the mount: the mount is the group
    proc.write_text("4:memory:/docker/abc\n3:cpu:/docker/abc\n")
    _group(root / "memory", memory_limit_in_bytes=str(10 * GB), memory_usage_in_bytes=str(3 * GB),
           memory_stat=f"cache {2 * GB}\ntotal_inactive_file {2 * GB}\n")
    assert _resolve().available == 9 * GB


def test_no_limit_keeps_memavailable(fake):
    root, proc = fake
    proc.write_text("4:memory:/\n0::/\n")
    _group(root / "memory", memory_limit_in_bytes="9223372036854771712", memory_usage_in_bytes=str(GB))
    _group(root, memory_max="max", memory_current=str(GB))
    budget = _resolve()
    assert (budget.available, budget.source) == (40 * GB, "MemAvailable")
    assert B.cgroup_room() is None


def test_limit_above_host_keeps_memavailable(fake):
    root, proc = fake
    proc.write_text("0::/\n")
    _group(root, memory_max=str(100 * GB), memory_current=str(GB))
    assert _resolve().source == "MemAvailable"


def test_unreadable_cgroup_is_ignored(fake, tmp_path):
    _root, proc = fake
    proc.write_text("garbage line\n0::/missing\n")
    assert B.cgroup_room() is None and _resolve().available == 40 * GB
