"""Capture of per-example gradient factors: layer rules, hooks, the loop recorder, the torch.func reference."""
from .factors import Factors, OneHot, ghost_inner, kron_project, materialize, self_inner
from .hooks import resolve_layers
from .layers import SUPPORTED_LAYERS, LayerRule, register_layer, rule_for
from .reference import per_example_grads
from .session import CaptureStore, LoopRecorder

__all__ = ["Factors", "OneHot", "ghost_inner", "kron_project", "materialize", "self_inner",
           "resolve_layers", "SUPPORTED_LAYERS", "LayerRule", "register_layer", "rule_for", "per_example_grads", "CaptureStore",
           "LoopRecorder"]
