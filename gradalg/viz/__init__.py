"""Displays: text and HTML trees of expressions."""
from .html import html_tree
from .tree import text_tree

__all__ = ["html_tree", "text_tree"]
