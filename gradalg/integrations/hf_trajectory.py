"""A ``transformers.Trainer`` callback that scores every step of a :class:`~.trajectory.Trajectory`.

    traj = ga.trajectory(model, task, queries, layers=layers, precondition="adam")
    trainer = Trainer(model, args, train_dataset=ds, callbacks=[traj.hf_callback(scale="sum")])
    trainer.train()
    traj.scores.total()

It is a :class:`~gradalg.integrations.hf.GradientCallback` (``keep=False``) over the
trajectory's layers, whose ``on_step`` is the trajectory's; rows are labelled with the
dataset indices the Trainer's sampler yields (``ids="auto"``). At ``on_train_begin`` it
takes the Trainer's optimizer when the trajectory has none (its learning rates and, for
``precondition="adam"``, Adam's moments), and numbers steps from the Trainer's
``global_step`` (a run resumed from a checkpoint continues the step axis). The rows' scale follows ``scale=`` (default
``"loss"``: each example's contribution to the step's gradient; ``"sum"``: the gradient
of its summed token loss). Trainer clips gradients (``max_grad_norm``) before the step:
the rows are the unclipped gradients (see :mod:`gradalg.integrations.trajectory`).
"""
from __future__ import annotations

from ..errors import OptionError
from .hf import GradientCallback
from .trajectory import Trajectory, _check_adam, _torch_optimizer

__all__ = ["TrajectoryCallback"]


class TrajectoryCallback(GradientCallback):
    """Per-step TracIn scores inside ``Trainer.train()``. Build it with ``traj.hf_callback()``."""

    def __init__(self, trajectory: Trajectory, **kwargs):
        if "layers" in kwargs:
            raise OptionError("hf_callback(layers=...): the layers are the trajectory's; pass them to "
                              "ga.trajectory(..., layers=...)")
        kwargs.setdefault("keep", False)
        super().__init__(layers=list(trajectory.layers), **kwargs)
        self.trajectory = trajectory
        self.on_step(trajectory.on_step)

    def on_train_begin(self, args, state, control, model=None, train_dataloader=None, **kwargs):
        traj = self.trajectory
        optimizer = kwargs.get("optimizer")
        if traj.optimizer is None and optimizer is not None:
            traj.optimizer = _torch_optimizer(optimizer)
            if traj.precondition == "adam":
                _check_adam(traj.optimizer)
        traj.step_offset = int(state.global_step)      # a resumed run numbers its steps on
        super().on_train_begin(args, state, control, model=model, train_dataloader=train_dataloader, **kwargs)
