"""What every result of the command line records about where it came from.

``record(cfg, command)`` is kept as the ``gradalg_cli`` attribute of the stores it
writes, in the schema metadata of parquet files, and in a ``<output>.gradalg.json``
sidecar beside CSV and parquet files:

    {"command": "gradalg build", "config_file": "/abs/c.toml", "config_sha256": "…",
     "config": {…validated config…}, "versions": {"gradalg": "0.1.0", "torch": "2.13.0",
     "transformers": "…", "python": "3.11.7"}, "created": "2026-12-02T00:41:00Z"}
"""
from __future__ import annotations

import datetime
import json
import platform
import sys
from pathlib import Path

__all__ = ["record", "versions", "ATTRIBUTE", "sidecar_path", "write_sidecar"]

ATTRIBUTE = "gradalg_cli"
SIDECAR_SUFFIX = ".gradalg.json"


def versions() -> dict:
    """gradalg, torch, python, and the versions of the optional libraries in use."""
    import torch

    from ..version import __version__

    out = {"gradalg": __version__, "torch": torch.__version__, "python": platform.python_version()}
    for name in ("transformers", "datasets", "zarr", "numpy"):
        module = sys.modules.get(name)
        if module is not None and getattr(module, "__version__", None):
            out[name] = module.__version__
    return out


def record(cfg, command: str) -> dict:
    """The provenance of a result of ``gradalg <command>`` run on ``cfg``."""
    return {
        "command": f"gradalg {command}",
        "config_file": str(Path(cfg.source).resolve()) if cfg.source else None,
        "config_sha256": cfg.text_digest,
        "config": cfg.as_record(),
        "versions": versions(),
        "created": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }


def sidecar_path(output) -> Path:
    return Path(str(output) + SIDECAR_SUFFIX)


def write_sidecar(output, prov: dict) -> Path:
    path = sidecar_path(output)
    path.write_text(json.dumps(prov, indent=2, sort_keys=True, default=str) + "\n")
    return path
