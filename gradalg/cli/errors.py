"""The command line's own errors (importable without pydantic, so that ``--help`` and
the exit codes work whatever is installed)."""
from __future__ import annotations

from ..errors import GradalgError

__all__ = ["ConfigError", "OutputExistsError"]


class ConfigError(GradalgError, ValueError):
    """A config file is missing, unreadable or invalid. The message names the file, each
    field at fault (``data.train.path``) and what it accepts."""


class OutputExistsError(GradalgError, FileExistsError):
    """An output file exists already and ``--overwrite`` was not given."""
