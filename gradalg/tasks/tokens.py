"""Per-token building blocks shared by the sequence tasks.

Shapes: a batch holds ``B`` rows of ``T`` positions; ``targets`` (B, T') hold the
token each logit row predicts, ``-100`` where nothing is predicted (padding, prompt,
ignored labels); ``logits`` (B, T', V).

For a counted position with target y and p = softmax(logits)_y:

* loss           ℓ = −log p
* TRAK's margin  f = log p − log Σ_{c≠y} p_c = log p/(1 − p)
* TRAK's weight  w = 1 − p = −∂ℓ/∂f     (so w ∇f = ∇ log p = −∇ℓ exactly)
"""
from __future__ import annotations

import zlib
from collections.abc import Mapping

import torch
import torch.nn.functional as F

from ..errors import BatchContentError, OptionError
from .validation import not_a_dict, values_known

IGNORE = -100
PADDING_SIDES = ("right", "left")

__all__ = ["IGNORE", "PADDING_SIDES", "field", "real_mask", "check_padding", "check_counted",
           "position_ids", "token_nll", "token_margin", "sampled_targets", "content_keys", "model_logits"]


def _named(rows, ids) -> list:
    rows = [int(r) for r in rows]
    return [ids[r] for r in rows] if ids is not None else rows


def _id_text(rows, ids) -> str:
    shown = _named(rows, ids)
    more = "" if len(shown) <= 10 else f" (and {len(shown) - 10} more)"
    return ("example ids " if ids is not None else "batch rows ") + str(shown[:10]) + more


def field(batch, name: str, task: str, hint: str = "") -> torch.Tensor:
    """``batch[name]``, or a :class:`BatchContentError` naming the fields there are."""
    if not isinstance(batch, Mapping):
        raise not_a_dict(batch, task)
    if name not in batch:
        raise BatchContentError(f"ga.tasks.{task}: the batch has no {name!r} field (it has "
                                f"{sorted(batch)}){hint}")
    return batch[name]


def real_mask(batch) -> torch.Tensor:
    """(B, T) bool: real tokens (``attention_mask``; all positions when there is none)."""
    ids = batch["input_ids"]
    mask = batch.get("attention_mask")
    return torch.ones(ids.shape[:2], dtype=torch.bool, device=ids.device) if mask is None else mask.bool()


def check_padding(mask: torch.Tensor, padding_side: str, ids=None, task: str = "causal_lm") -> None:
    """Refuse rows with no real token, and rows padded on the other side than assumed.

    ``mask`` (B, T) bool. Right padding: real tokens first (1…1 0…0); left padding: the
    padding first (0…0 1…1). A row of neither form (a hole) is refused either way.
    Skipped where the values are unknown (meta tensors of the planner's shape measurement,
    a torch.func transform: :func:`~gradalg.tasks.validation.values_known`).
    """
    if not values_known(mask):
        return
    empty = torch.nonzero(~mask.any(1)).flatten()
    if len(empty):
        raise BatchContentError(f"ga.tasks.{task}: {_id_text(empty, ids)} have no real token "
                                "(attention_mask all 0): drop them from the data", _named(empty, ids))
    rises = (mask[:, 1:] & ~mask[:, :-1]).sum(1)     # 0 → 1 steps
    falls = (~mask[:, 1:] & mask[:, :-1]).sum(1)     # 1 → 0 steps
    left = torch.nonzero((rises == 1) & (falls == 0)).flatten()
    right = torch.nonzero((falls == 1) & (rises == 0)).flatten()
    holes = torch.nonzero((rises + falls) > 1).flatten()
    if len(holes):
        raise BatchContentError(f"ga.tasks.{task}: {_id_text(holes, ids)} have padding inside the sequence "
                                "(attention_mask 1…0…1): pad on one side only", _named(holes, ids))
    if padding_side == "right" and len(left):
        raise BatchContentError(
            f"ga.tasks.{task}: {_id_text(left, ids)} are left-padded but the task assumes right padding "
            "(the model would number their positions from the padding, so their gradients would differ "
            f"from the unpadded sequences'): pass ga.tasks.{task}(model, padding_side='left') (positions "
            "are then counted from each row's first real token) or pad on the right", _named(left, ids))
    if padding_side == "left" and len(right):
        raise BatchContentError(
            f"ga.tasks.{task}: {_id_text(right, ids)} are right-padded but the task assumes left padding: "
            f"pass ga.tasks.{task}(model, padding_side='right') (the default) or pad on the left",
            _named(right, ids))


def check_counted(targets: torch.Tensor, ids=None, task: str = "causal_lm", why: str = "") -> None:
    """Refuse rows none of whose targets count (all ``-100``): their loss is 0 by
    construction, so their gradient would be a silent zero. Skipped where the values are
    unknown (as :func:`check_padding`)."""
    if not values_known(targets):
        return
    empty = torch.nonzero(~(targets != IGNORE).any(1)).flatten()
    if len(empty):
        raise BatchContentError(f"ga.tasks.{task}: {_id_text(empty, ids)} have no label that counts "
                                f"(every target is -100{why}): drop them or fix their labels",
                                _named(empty, ids))


def position_ids(mask: torch.Tensor) -> torch.Tensor:
    """(B, T) positions counted from each row's first real token (0 on the padding before it)."""
    return (mask.long().cumsum(1) - 1).clamp_min(0)


def model_logits(out) -> torch.Tensor:
    """The logits of a model's output: ``.logits`` (HF), the first of a tuple, or a tensor."""
    if isinstance(out, torch.Tensor):
        return out
    if hasattr(out, "logits"):
        return out.logits
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    raise OptionError(f"cannot find logits in a {type(out).__name__}: pass logits=fn(model, batch) -> (B, T, V)")


def token_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """(B, T') −log p(target) per position, 0 where the target is ``-100``."""
    nll = F.cross_entropy(logits.flatten(0, -2), targets.flatten(), reduction="none", ignore_index=IGNORE)
    return nll.view(targets.shape)


def token_margin(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """TRAK's per-token margin f = log p − logsumexp_{c≠y} log p_c and p, 0 where not counted.

    Returns (margin (B, T'), p (B, T')).
    """
    counted = targets != IGNORE
    y = targets.clamp_min(0).unsqueeze(-1)
    logp = torch.log_softmax(logits, dim=-1)
    correct = logp.gather(-1, y).squeeze(-1)
    others = logp.scatter(-1, y, float("-inf")).logsumexp(-1)
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    return torch.where(counted, correct - others, zero), torch.where(counted, correct.exp(), zero)


def sampled_targets(logits: torch.Tensor, targets: torch.Tensor, uniforms: list[torch.Tensor]) -> torch.Tensor:
    """Targets drawn from the model at the counted positions, ``-100`` elsewhere.   (B, T')

    ``uniforms[i]`` holds one draw in [0, 1) per counted position of row i (in order):
    the target is the first class whose cumulative probability exceeds it.
    """
    counted = targets != IGNORE
    probs = torch.softmax(logits.detach()[counted].to(torch.float64), dim=-1)    # (N_tok, V)
    cdf = probs.cumsum(-1)
    u = torch.cat(uniforms).to(cdf.device) if uniforms else cdf.new_zeros(0)
    drawn = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(-1)).squeeze(-1).clamp_max(probs.shape[-1] - 1)
    out = torch.full_like(targets, IGNORE)
    out[counted] = drawn
    return out


def content_keys(targets: torch.Tensor, salt: str) -> list[str]:
    """A key per row from its counted targets (for draws that need no example id)."""
    rows = []
    for row in targets:
        kept = row[row != IGNORE].cpu().numpy().tobytes()
        rows.append(f"{salt}/{zlib.crc32(kept)}/{len(kept)}")
    return rows
