"""Exit codes of the ``gradalg`` command, and which error gives which.

======  ==================================================================================
0       success (also: nothing to do, the result exists and matches)
1       unexpected error: a bug or an environment problem (the traceback is printed)
2       usage or config error: bad arguments, an invalid config field, a file the config
        names that does not exist, unknown layers or options
3       refused: an existing store or output was made from something else
        (``StoreMismatchError``: the fields that differ are listed), or an output file
        exists (``--overwrite`` replaces it)
4       a store cannot be used: unfinished (``StoreIncompleteError``: run ``build``
        again), damaged (``StoreCorruptError``) or missing
5       gradalg refused the computation (any other ``GradalgError``: the data, the model
        or the memory budget; the message says what to change)
6       a library an optional feature needs is not installed (the message names the extra)
7       ``gradalg check`` ran and a check failed (each finding names its fix)
130     interrupted (Ctrl-C); a store being built resumes at the next run
143     terminated by SIGTERM (a SLURM time limit or preemption); resumes likewise
======  ==================================================================================
"""
from __future__ import annotations

__all__ = ["EXIT_CODES", "exit_code", "OK", "FAILED", "USAGE", "REFUSED", "STORE_UNUSABLE", "RUN_REFUSED",
           "MISSING_LIBRARY", "CHECK_FAILED"]

OK, FAILED, USAGE, REFUSED, STORE_UNUSABLE, RUN_REFUSED, MISSING_LIBRARY = 0, 1, 2, 3, 4, 5, 6
CHECK_FAILED = 7

EXIT_CODES = {
    OK: "success (or nothing to do: the result exists and matches the config)",
    FAILED: "unexpected error (a bug: the traceback is printed)",
    USAGE: "usage or config error (the field at fault is named)",
    REFUSED: "an existing store or output does not match the config (or exists: --overwrite)",
    STORE_UNUSABLE: "the store is unfinished, damaged or missing",
    RUN_REFUSED: "gradalg refused the computation (data, model, memory budget)",
    MISSING_LIBRARY: "an optional library is missing (the message names the pip extra)",
    CHECK_FAILED: "gradalg check: a check failed (each finding names its fix)",
    130: "interrupted (Ctrl-C); run the same command again to resume",
    143: "terminated (SIGTERM: a scheduler's time limit); run the same command again to resume",
}


def exit_code(err: BaseException) -> int:
    """The exit code of an error raised by a command."""
    from ..errors import (GradalgError, MissingLibraryError, OptionError, StoreCorruptError, StoreIncompleteError,
                          StoreMismatchError, StoreNotFoundError, UnsupportedLayerError)
    from .errors import ConfigError, OutputExistsError

    if isinstance(err, SystemExit):
        return int(err.code or 0)
    if isinstance(err, (ConfigError, OptionError, UnsupportedLayerError)):
        return USAGE
    if isinstance(err, (StoreMismatchError, OutputExistsError)):
        return REFUSED
    if isinstance(err, (StoreIncompleteError, StoreCorruptError, StoreNotFoundError)):
        return STORE_UNUSABLE
    if isinstance(err, MissingLibraryError):     # by type: gradalg's own, naming the pip extra
        return MISSING_LIBRARY
    if isinstance(err, GradalgError):
        return RUN_REFUSED
    if isinstance(err, ImportError) and "pip install" in str(err):   # another library's own install hint
        return MISSING_LIBRARY
    return FAILED
