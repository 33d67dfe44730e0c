"""Planning: kernel routing and cost estimates (the full planner builds on these)."""
from .cost import Cost, estimate
from .routing import choose_kernel, shared_grad_nodes

__all__ = ["Cost", "estimate", "choose_kernel", "shared_grad_nodes"]
