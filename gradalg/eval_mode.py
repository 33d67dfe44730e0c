"""A user's model in eval mode for a while, every module's own training flag put back after.

``model.train(was_training)`` after ``model.eval()`` sets *every* module to the model's
flag: a model fine-tuned in train mode with a frozen batch norm (``model.train();
model.bn.eval()``, the usual way to keep its running statistics) came back with that
norm in train mode, and the user's next training step moved the statistics they had
frozen. :func:`eval_mode` keeps each module's flag instead. Every place gradalg runs a
user's model in eval mode reads it: the capture passes and curvature products
(``curvature.hvp.eval_mode``), the loss-reduction check (``Task.check_reduction``), the
plain-forward check of a batch (``tasks.validation``), completions (``tasks.prompts``),
the model check (``ga.check``) and the trajectory's query check.
"""
from __future__ import annotations

import contextlib

from torch import nn

__all__ = ["eval_mode"]


@contextlib.contextmanager
def eval_mode(model: nn.Module):
    """``model`` in eval mode within the block (dropout off, batch norms reading their
    running statistics, none updated); on exit, an exception included, each module's
    ``training`` flag is what it was before, module by module."""
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        yield model
    finally:
        for module, training in modes:
            module.training = training
