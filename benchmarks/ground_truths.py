"""Committed ground truths: the retraining stores of the fidelity settings, one archive each.

A setting's ground truth is the costly part of its fidelity table (``lm``'s 50 subsets × 4
runs are ≈ 20 minutes of one core, ``text`` and ``llama`` longer), and ``build/`` does not
survive a fresh clone. Each archive here is a ``tar.gz`` of one :func:`gradalg.eval.retrain`
store (``meta.json`` and one ``.npz`` per finished run: its subset's indices, its training
seed and its query targets), named by the setting's store key::

    benchmarks/results/ground_truths/lm-L2-d64-n256-q64-s300-ts0.tar.gz

:func:`seed_store` unpacks an archive into the store directory a benchmark is about to pass
to ``retrain``, adding only the runs the directory lacks; ``retrain`` then loads those runs
instead of training them. Nothing is trusted blindly: ``retrain`` refuses a store whose
``meta.json`` differs from the run's settings, a run whose stored indices differ from the
subset it draws, or whose training seed differs — so an archive of another version of a
setting is refused with that error, never served. A run missing from the archive is trained.

Pack a store after building it (``--retrain-only`` of the setting's benchmark)::

    python benchmarks/ground_truths.py pack build/fidelity/lm-L2-d64-n256-q64-s300-ts0
    python benchmarks/ground_truths.py list
"""
from __future__ import annotations

import argparse
import gzip
import io
import tarfile
from pathlib import Path

ARCHIVES = Path(__file__).resolve().parent / "results" / "ground_truths"


def _members(tar: tarfile.TarFile) -> list[tarfile.TarInfo]:
    """The archive's regular files, flat names only (``meta.json``, ``subset-*.npz``)."""
    out = []
    for m in tar.getmembers():
        name = Path(m.name).name
        if not m.isfile() or m.name != name or not (name == "meta.json" or name.endswith(".npz")):
            raise ValueError(f"unexpected member {m.name!r} in a ground-truth archive: rebuild it with "
                             "`python benchmarks/ground_truths.py pack <store>`")
        out.append(m)
    return out


def seed_store(store, *, archives: Path = ARCHIVES) -> int:
    """Unpack the archive of ``store`` (if there is one) into it, skipping files it already has.

    Returns the number of files written. Each is written under a temporary name and renamed,
    so an interrupted unpack leaves no partial run.
    """
    store = Path(store)
    archive = archives / f"{store.name}.tar.gz"
    if not archive.exists():
        return 0
    store.mkdir(parents=True, exist_ok=True)
    written = 0
    with tarfile.open(archive, "r:gz") as tar:
        for member in _members(tar):
            target = store / member.name
            if target.exists():
                continue
            tmp = store / f".{member.name}.unpack"
            tmp.write_bytes(tar.extractfile(member).read())
            tmp.replace(target)
            written += 1
    return written


def pack(store, *, archives: Path = ARCHIVES) -> Path:
    """Write the archive of the store directory ``store``: its ``meta.json`` and finished runs
    (sorted names, zeroed times and owners, so packing the same runs twice gives the same bytes)."""
    store = Path(store)
    files = sorted(p for p in store.iterdir() if p.name == "meta.json" or
                   (p.suffix == ".npz" and not p.name.startswith(".")))
    if not any(p.name == "meta.json" for p in files):
        raise ValueError(f"{store} has no meta.json: is it a store written by gradalg.eval.retrain?")
    archives.mkdir(parents=True, exist_ok=True)
    out = archives / f"{store.name}.tar.gz"
    buf = io.BytesIO()
    with gzip.GzipFile(fileobj=buf, mode="wb", compresslevel=9, mtime=0) as gz, \
            tarfile.open(fileobj=gz, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for p in files:
            info = tarfile.TarInfo(p.name)
            data = p.read_bytes()
            info.size, info.mtime, info.mode = len(data), 0, 0o644
            tar.addfile(info, io.BytesIO(data))
    tmp = out.with_suffix(".tmp")
    tmp.write_bytes(buf.getvalue())
    tmp.replace(out)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack", help="archive retraining stores (directories) into benchmarks/results/ground_truths/")
    p.add_argument("stores", nargs="+")
    sub.add_parser("list", help="the archives and how many runs each holds")
    args = ap.parse_args(argv)
    if args.cmd == "pack":
        for s in args.stores:
            out = pack(s)
            print(f"{out.relative_to(Path.cwd()) if out.is_relative_to(Path.cwd()) else out}: "
                  f"{out.stat().st_size / 1024:.0f} KiB")
    else:
        for a in sorted(ARCHIVES.glob("*.tar.gz")):
            with tarfile.open(a, "r:gz") as tar:
                runs = sum(m.name.endswith(".npz") for m in tar.getmembers())
            print(f"{a.name}: {runs} runs, {a.stat().st_size / 1024:.0f} KiB")


if __name__ == "__main__":
    main()
