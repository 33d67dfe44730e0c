"""``gradalg inspect``: what a store holds, from its metadata (no rows are read).

Gradient, score and operator stores: kind, rows, blocks and their shapes, projector,
layers, model fingerprint, dtype, chunks written, size on disk, and the config and
versions it was made with (``gradalg build`` / ``query`` / ``score`` record them).
``--verify`` also reads every chunk and checks its checksum (exit 4 if damaged).
"""
from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

from ..units import format_bytes
from .common import command_parser

__all__ = ["add_parser", "run", "describe_store"]

log = logging.getLogger("gradalg.cli")

EXAMPLE = """\
  $ gradalg inspect out/train.zarr
  $ gradalg inspect -c run.toml            # the config's store.path
  $ gradalg inspect out/scores.zarr --json --verify
"""


def add_parser(sub):
    p = command_parser(sub, "inspect", help="show what a store holds", description=__doc__, example=EXAMPLE)
    p.add_argument("store", nargs="?", default=None, help="the store folder (default: the config's store.path)")
    from .common import add_common
    add_common(p, config_required=False)
    p.add_argument("--json", action="store_true", help="print the description as JSON")
    p.add_argument("--verify", action="store_true", help="read every chunk and check its checksum")
    p.set_defaults(run=run)
    return p


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def describe_store(path) -> dict:
    """A JSON-able description of the store at ``path`` (its attributes and progress)."""
    from ..errors import StoreNotFoundError
    from ..store import layout
    from .provenance import ATTRIBUTE

    path = Path(path)
    if not path.exists():
        raise StoreNotFoundError(f"no store at {path}")
    attrs = layout.read_attrs(path)
    if attrs is None:
        try:
            attrs = dict(layout.open_dataset(path).attrs)
        except Exception:  # noqa: BLE001 - not a Zarr group
            attrs = {}
    kind = attrs.get("gradalg_store")
    if kind is None and ATTRIBUTE in attrs:     # a top-k or whole-matrix output of query / score
        ds = layout.open_dataset(path)
        return {"path": str(path), "kind": "top_k" if "rank" in ds.dims else "scores (one array)",
                "size_bytes": _size(path), "dims": {k: int(v) for k, v in ds.sizes.items()},
                "provenance": attrs[ATTRIBUTE]}
    if kind is None:
        from ..errors import StoreMismatchError
        raise StoreMismatchError([f"{path} is not a gradalg store"], "pass the folder written by gradalg build, "
                                 "query or score (or ga.store.write)")
    out = {"path": str(path), "kind": kind, "size_bytes": _size(path)}
    keys = ("n", "n_query", "n_train", "chunk_rows", "dtype", "kind", "expression", "projector", "layers",
            "objective", "backend", "model_fingerprint", "gradalg_version", "format_version")
    out.update({("operator_kind" if k == "kind" else k): attrs[k] for k in keys if k in attrs})
    if "blocks" in attrs:
        out["blocks"] = [{"name": b["name"], "shape": b["shape"], "representation": b.get("representation")}
                         for b in attrs["blocks"]]
    if kind in ("gradients", "scores"):
        flags = layout.done_flags(path)
        out["chunks"] = {"done": int(flags.sum()), "total": int(len(flags))}
        out["complete"] = bool(flags.all())
    if ATTRIBUTE in attrs:
        out["provenance"] = attrs[ATTRIBUTE]
    return out


def _text(d: dict) -> str:
    lines = [f"{d['path']}: {d['kind']} store"]
    if "dims" in d:
        lines.append(f"  dims        {d['dims']}")
    elif d["kind"] == "gradients":
        lines.append(f"  rows        {d.get('n'):,} examples × {sum(_prod(b['shape']) for b in d.get('blocks', [])):,} "
                     f"coordinates, {d.get('dtype')}")
    elif d["kind"] == "scores":
        lines.append(f"  scores      {d.get('n_query'):,} queries × {d.get('n_train'):,} training examples, "
                     f"{d.get('dtype')}")
    else:
        lines.append(f"  operator    {d.get('operator_kind')}")
    if "chunks" in d:
        state = "complete" if d["complete"] else "UNFINISHED (run the same command again to finish it)"
        lines.append(f"  chunks      {d['chunks']['done']}/{d['chunks']['total']} written ({d.get('chunk_rows')} "
                     f"rows each): {state}")
    lines.append(f"  on disk     {format_bytes(d['size_bytes'])}")
    if d.get("expression"):
        lines.append(f"  expression  {d['expression']}")
    for key in ("projector", "layers", "objective", "backend", "model_fingerprint"):
        if d.get(key):
            value = d[key][0] if isinstance(d[key], list) and len(d[key]) == 1 else d[key]
            lines.append(f"  {key.removesuffix('_fingerprint'):<11} {value}")
    for b in d.get("blocks", []):
        lines.append(f"  block       {b['name']}  {tuple(b['shape'])}  {b.get('representation')}")
    prov = d.get("provenance")
    if prov:
        versions = ", ".join(f"{k} {v}" for k, v in prov.get("versions", {}).items())
        lines.append(f"  made by     {prov.get('command')} -c {prov.get('config_file')} "
                     f"(sha256 {prov.get('config_sha256')}) on {prov.get('created')}")
        lines.append(f"  versions    {versions}")
    else:
        lines.append(f"  made by     the Python API (gradalg {d.get('gradalg_version')}); no config recorded")
    if "verify" in d:
        lines.append(f"  verify      {d['verify']}")
    return "\n".join(lines)


def _prod(shape) -> int:
    out = 1
    for s in shape:
        out *= int(s)
    return out


def run(args) -> int:
    import gradalg as ga

    path = args.store
    if path is None:
        if args.config is None:
            from .errors import ConfigError
            raise ConfigError("give the store's path (gradalg inspect out/train.zarr) or --config with a [store]")
        from .common import load
        cfg = load(args)
        cfg.require("store", command="inspect")
        path = cfg.resolve(cfg.store.path)
    d = describe_store(path)
    report = None
    if args.verify:
        report = ga.store.verify(path)
        d["verify"] = "intact" if report.ok else "; ".join(report.problems[:10])
    if args.json:
        json.dump(d, sys.stdout, indent=2, default=str)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(_text(d) + "\n")
    if report is not None and not report.ok:
        report.raise_if_damaged()
    return 0
