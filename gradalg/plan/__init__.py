"""Planning: kernel routing and cost estimates (the full planner builds on these)."""
from .choices import Choices
from .cost import Cost
from .planner import estimate
from .routing import choose_kernel

__all__ = ["Choices", "Cost", "estimate", "choose_kernel"]
