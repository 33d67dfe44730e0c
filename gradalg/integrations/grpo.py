"""TRL ``GRPOTrainer``: each completion's row labelled with its prompt's dataset index.

    cb = GradientCallback(layers=[...])
    trainer = GRPOTrainer(model, reward_funcs, args=GRPOConfig(...), train_dataset=ds, callbacks=[cb])
    grpo_ids(trainer)                 # before train()
    trainer.train()
    cb.grads.ids                      # the prompt's dataset index of every completion row

What a row is. GRPO samples each prompt ``num_generations`` times (its ``RepeatSampler``),
generates one completion per sample, and backpropagates the group-normalized-advantage
policy-gradient loss over a buffer of completions that it *shuffles* before splitting it
into micro-batches. Row ``r`` of a micro-batch is the gradient of completion ``r``'s term
of that loss (``scale="loss"``: its contribution to the step's gradient, with the
trainer's own token normalization); its id is the dataset index of the prompt it
completes, so each prompt has ``num_generations`` rows per generation round (summed by
``ga.integrations.combine_repeats(G, "sum")``: the prompt's total contribution). The
advantage, which depends on the other completions of the group, enters as the constant
it is in the loss.

How. The indices ride *with* the completions through GRPO's shuffle: ``_prepare_inputs``
takes the sampled index batch of the dataloader batch it receives (or, with
``column=``, the dataset's index column of the prompts), ``_generate_and_score_completions``
adds them to its output as a tensor (shuffled and split with the others), and
``compute_loss`` hands the micro-batch's to the capture before its forward. Counts are
checked at each stage (:class:`~gradalg.errors.ExampleIdsError`).
"""
from __future__ import annotations

import torch

from ..errors import ExampleIdsError, OptionError

__all__ = ["grpo_ids", "IDS_KEY"]

IDS_KEY = "gradalg_example_ids"


def _callback(trainer):
    from .hf import GradientCallback

    found = [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, GradientCallback)]
    if len(found) != 1:
        raise OptionError(f"grpo_ids needs exactly one GradientCallback among the trainer's callbacks, found "
                         f"{len(found)}: pass callbacks=[GradientCallback(...)] to GRPOTrainer")
    return found[0]


def grpo_ids(trainer, *, column: str | None = None) -> None:
    """Label ``trainer``'s (a TRL ``GRPOTrainer``) captured rows with their prompt's dataset index.

    column : a dataset column holding the index (e.g. from ``ds.map(lambda x, i: {"idx": i},
        with_indices=True)``); default: the indices GRPO's sampler yields.
    """
    cb = _callback(trainer)
    cb.ids, cb._mode, cb._grpo_column = "grpo", "grpo", column
    prepare, generate, loss = trainer._prepare_inputs, trainer._generate_and_score_completions, trainer.compute_loss
    current: dict = {}

    def _prepare_inputs(generation_batch):
        if trainer.model.training and column is None and cb.sampled is not None:
            if not cb.sampled.queue:
                raise ExampleIdsError("GRPOTrainer prepared a training batch that its train dataloader's sampler "
                                      "did not yield: pass grpo_ids(trainer, column='<index column>')")
            current["ids"] = cb.sampled.queue.popleft()
        return prepare(generation_batch)

    def _generate_and_score_completions(inputs):
        out = generate(inputs)
        if not trainer.model.training:
            return out
        if column is not None:
            missing = [k for k, x in enumerate(inputs) if column not in x]
            if missing:
                raise ExampleIdsError(f"grpo_ids(column={column!r}): prompt {missing[0]} of the batch has no "
                                      f"{column!r} (its keys: {sorted(inputs[missing[0]])})")
            ids = [int(x[column]) for x in inputs]
        else:
            ids = current.pop("ids", None)
        n = int(out["completion_ids"].shape[0])
        if ids is None or len(ids) != n or len(inputs) != n:
            raise ExampleIdsError(
                f"GRPOTrainer generated {n} completions for {len(inputs)} prompts but {0 if ids is None else len(ids)} "
                "dataset indices were sampled for them: the sampler and the generation batch are out of step. "
                "Pass grpo_ids(trainer, column='<index column>')")
        out[IDS_KEY] = torch.tensor(ids, dtype=torch.long, device=out["completion_ids"].device)
        return out

    def compute_loss(model, inputs, *args, **kwargs):
        ids = inputs.get(IDS_KEY)   # not popped: GRPO reuses a buffered batch over num_iterations
        if ids is not None and model.training and cb.capture is not None:
            if ids.shape[0] != inputs["completion_ids"].shape[0]:
                raise ExampleIdsError(f"a GRPO micro-batch has {inputs['completion_ids'].shape[0]} completions "
                                      f"but {ids.shape[0]} ids")
            cb.capture.ids_next(ids.tolist())
        return loss(model, inputs, *args, **kwargs)

    trainer._prepare_inputs = _prepare_inputs
    trainer._generate_and_score_completions = _generate_and_score_completions
    trainer.compute_loss = compute_loss
