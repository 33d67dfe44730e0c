"""Displays: text and HTML trees of expressions; a heat map of per-token scores; scores over
training time (``plot_trajectory``)."""
from .html import html_tree
from .tokens import token_heatmap
from .trajectory import plot_trajectory
from .tree import text_tree

__all__ = ["html_tree", "text_tree", "token_heatmap", "plot_trajectory"]
