"""Planning: kernel routing and cost estimates (the full planner builds on these)."""
from .choices import Choices
from .cost import Cost
from .jobs import TopK
from .planner import estimate
from .routing import choose_kernel

__all__ = ["Choices", "Cost", "TopK", "estimate", "choose_kernel"]
