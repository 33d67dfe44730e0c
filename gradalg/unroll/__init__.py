"""Unrolled differentiation of training runs: replay a deterministic run and take
exact metagradients through it (``ga.methods.magic``), or approximate the unrolling
segment by segment (``ga.methods.source``).

    run = ga.unroll.TrainingRun(model, per_example_loss, (X, y), ga.unroll.SGD(0.1, momentum=0.9),
                                batch_size=32, epochs=2, seed=0)
    S = ga.methods.magic(run, (Xq, yq)).compute()      # (query, train)

See docs/unrolled.md for the math, the memory of the checkpointing schedules and the limits.
"""
from .errors import NonDeterministicTrainingError, UnsupportedOptimizerError, UnsupportedTrainingError
from .metagradient import Metagradients, metagradients
from .optimizers import SGD, Adam, AdamW, OptimizerSpec, from_torch
from .replay import SCHEDULES, Ledger, reverse_states, schedule_bound
from .run import TrainingRun

__all__ = ["TrainingRun", "SGD", "Adam", "AdamW", "OptimizerSpec", "from_torch", "metagradients", "Metagradients",
           "reverse_states", "schedule_bound", "Ledger", "SCHEDULES", "NonDeterministicTrainingError",
           "UnsupportedOptimizerError", "UnsupportedTrainingError"]
