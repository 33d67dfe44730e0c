"""Notebook widgets: ``ga.widgets.PlanExplorer``, ``ga.widgets.QueryBox`` (and its
kernel-free core, ``ga.widgets.QuerySession``)."""
from .explorer import PlanExplorer, with_settings
from .query_box import QueryBox
from .query_session import Answer, QuerySession

__all__ = ["PlanExplorer", "with_settings", "QueryBox", "QuerySession", "Answer"]
