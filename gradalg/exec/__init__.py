"""Executors: run expression nodes."""
from .local import LocalExecutor
from .operators import ResolvedOp

__all__ = ["LocalExecutor", "ResolvedOp"]
