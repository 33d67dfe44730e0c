"""Planning: an expression → its passes, jobs, typed decisions and cost estimates."""
from ..errors import PlanError
from .choices import Choices
from .cost import Cost
from .decisions import Decision, DecisionKind, DecisionSource
from .jobs import TopK
from .planner import estimate

__all__ = ["Choices", "Cost", "Decision", "DecisionKind", "DecisionSource", "PlanError", "TopK", "estimate"]
