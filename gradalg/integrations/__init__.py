"""Capture inside real training stacks, training-time callbacks and online data selection.

Core (no optional dependency):

- :func:`training_capture` / :class:`TrainingCapture`: each optimizer step's per-example
  gradients handed to ``on_step`` callbacks before the step (gradient accumulation aware);
- :class:`OnlineSelection` with targets (:class:`BatchMean`, :class:`FixedTarget`,
  :class:`ValidationTarget`) and policies (:class:`DropFraction`, :class:`Threshold`,
  :class:`Reweight`, :class:`RandomDrop`, :class:`KeepAll`): score, drop or re-weight,
  correct the step's gradient exactly;
- :func:`gather`: every DDP/FSDP rank's captured rows in one GradientSet;
- :class:`StoreStream` / :func:`open_stream`: project each step's rows and append them to
  a store on disk as training goes (bounded memory; resumes with the run);
- :func:`trajectory` / :class:`Trajectory` (``ga.trajectory``): TracIn per (query, example,
  step) along the run, the queries' gradients taken at each step's parameters.

Trainer integrations (import the submodule; each needs its library):

- :mod:`gradalg.integrations.hf`: ``GradientCallback`` for ``transformers.Trainer`` and
  TRL trainers (``SFTTrainer``);
- :mod:`gradalg.integrations.olmo`: ``OLMoCoreCallback`` for OLMo-core's ``Trainer``.

See docs/training_time.md.
"""
from .distributed import gather, unwrap_model
from .selection import (BatchMean, DropFraction, FixedTarget, KeepAll, OnlineSelection, Policy, RandomDrop,
                        Reweight, SelectionRecord, Target, Threshold, ValidationTarget)
from .repeats import combine_repeats
from .stream import StoreStream, open_stream, stream_steps
from .training import StepGrads, TrainingCapture, training_capture
from .trajectory import StepScores, Trajectory, TrajectoryScores, trajectory
from ..errors import CaptureStateError, ExampleIdsError

__all__ = ["training_capture", "TrainingCapture", "StepGrads", "OnlineSelection", "SelectionRecord", "Target",
           "BatchMean", "FixedTarget", "ValidationTarget", "Policy", "DropFraction", "Threshold", "Reweight",
           "RandomDrop", "KeepAll", "gather", "unwrap_model", "StoreStream", "open_stream", "stream_steps",
           "ExampleIdsError", "CaptureStateError", "combine_repeats", "trajectory", "Trajectory",
           "TrajectoryScores", "StepScores"]
