"""Planning: an expression → its passes, jobs, typed decisions and cost estimates."""
from ..errors import PlanError
from .choices import Choices
from .cost import Cost
from .decisions import Decision, DecisionKind
from .jobs import TopK
from .planner import estimate

__all__ = ["Choices", "Cost", "Decision", "DecisionKind", "PlanError", "TopK", "estimate"]
