"""``ga.check_model(task, data)``: a check of per-example gradients before a long run
(batch independence, a summed loss, tied and reused weights, coverage; module
:mod:`gradalg.check.model_check`)."""
from .model_check import TOLERANCES, check_model
from .result import Finding, ModelCheck, ModelCheckError

__all__ = ["check_model", "ModelCheck", "Finding", "ModelCheckError", "TOLERANCES"]
