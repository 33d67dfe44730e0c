"""Notebook widgets: ``ga.widgets.PlanExplorer``."""
from .explorer import PlanExplorer, with_settings

__all__ = ["PlanExplorer", "with_settings"]
