"""Per-layer rules: how a module's per-example gradient factors as ``D_iᵀ A_i``.

For every supported layer the weight gradient of example ``i`` is a sum over its
positions ``t`` (tokens, or spatial positions of a convolution)::

    G_i = Σ_t d_{i,t} a_{i,t}ᵀ = D_iᵀ A_i          # (out, in)

with ``A_i`` (T, in) the layer's inputs (a ones column appended when the layer has a
bias, so the bias gradient is the last column of ``G_i``) and ``D_i`` (T, out) the
gradients of the summed loss with respect to the layer's outputs. Every block of a
:class:`~gradalg.expr.space.ParamSpace` is stored in this canonical ``(out, in)``
orientation; :meth:`LayerRule.to_params` maps it back to the module's parameters.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import UnsupportedLayerError
from .factors import OneHot

__all__ = ["LayerRule", "rule_for", "SUPPORTED_LAYERS"]


def _hf_conv1d_type():
    try:
        from transformers.pytorch_utils import Conv1D
    except Exception:  # transformers not installed
        return None
    return Conv1D


@dataclass(frozen=True)
class LayerRule(ABC):
    """How to record one module kind. Subclasses implement the abstract methods below."""

    kind: str = "linear"

    @abstractmethod
    def block_shape(self, module: nn.Module) -> tuple[int, int]:
        """``(out, in)`` of the canonical gradient block (``in`` counts the bias column)."""

    @abstractmethod
    def activations(self, module: nn.Module, x: torch.Tensor):
        """``A``: (B, T, in) tensor, or :class:`OneHot` for embeddings."""

    @abstractmethod
    def output_grads(self, module: nn.Module, g: torch.Tensor) -> torch.Tensor:
        """``D``: (B, T, out) from the gradient w.r.t. the module's output."""

    @abstractmethod
    def to_params(self, module: nn.Module, block: torch.Tensor) -> dict[str, torch.Tensor]:
        """Split ``block`` (n, out, in) into ``{param_name: (n, *param.shape)}``."""

    @abstractmethod
    def from_params(self, module: nn.Module, params: dict[str, torch.Tensor]) -> torch.Tensor:
        """Inverse of :meth:`to_params`: ``{param_name: (n, *param.shape)}`` → (n, out, in)."""

    def param_names(self, module: nn.Module) -> tuple[str, ...]:
        return tuple(name for name, p in module.named_parameters(recurse=False) if p is not None)


def _with_ones(x: torch.Tensor) -> torch.Tensor:
    return torch.cat([x, x.new_ones(*x.shape[:-1], 1)], dim=-1)


def _as_btf(x: torch.Tensor) -> torch.Tensor:
    """(B, ..., F) -> (B, T, F), folding every middle dim into T (T = 1 for 2-D input)."""
    if x.dim() == 2:
        return x.unsqueeze(1)
    return x.reshape(x.shape[0], -1, x.shape[-1])


@dataclass(frozen=True)
class LinearRule(LayerRule):
    kind: str = "linear"

    def block_shape(self, module):
        return module.out_features, module.in_features + (module.bias is not None)

    def activations(self, module, x):
        x = _as_btf(x)
        return _with_ones(x) if module.bias is not None else x

    def output_grads(self, module, g):
        return _as_btf(g)

    def to_params(self, module, block):
        out = {"weight": block[:, :, : module.in_features]}
        if module.bias is not None:
            out["bias"] = block[:, :, -1]
        return out

    def from_params(self, module, params):
        if module.bias is None:
            return params["weight"]
        return torch.cat([params["weight"], params["bias"].unsqueeze(-1)], dim=-1)


@dataclass(frozen=True)
class HFConv1DRule(LayerRule):
    """HF ``Conv1D`` (GPT-2): ``y = x @ W + b`` with ``W`` stored (in, out)."""

    kind: str = "conv1d"

    def block_shape(self, module):
        n_in, n_out = module.weight.shape
        return n_out, n_in + 1

    def activations(self, module, x):
        return _with_ones(_as_btf(x))

    def output_grads(self, module, g):
        return _as_btf(g)

    def to_params(self, module, block):
        return {"weight": block[:, :, :-1].transpose(1, 2), "bias": block[:, :, -1]}

    def from_params(self, module, params):
        return torch.cat([params["weight"].transpose(1, 2), params["bias"].unsqueeze(-1)], dim=-1)


@dataclass(frozen=True)
class EmbeddingRule(LayerRule):
    """``nn.Embedding``: ``A`` is the one-hot of the token ids, never materialized.

    The block is (embedding_dim, num_embeddings), the transpose of ``weight``. Positions
    holding ``padding_idx`` get no gradient, as in PyTorch.
    """

    kind: str = "embedding"

    def block_shape(self, module):
        return module.embedding_dim, module.num_embeddings

    def activations(self, module, x):
        if module.scale_grad_by_freq:
            raise UnsupportedLayerError(
                "nn.Embedding(scale_grad_by_freq=True) scales gradients by batch-level token "
                "counts, so its gradient is not a sum of per-example gradients; set "
                "scale_grad_by_freq=False or leave this layer out of `layers`"
            )
        idx = x.reshape(x.shape[0], -1)
        valid = None if module.padding_idx is None else idx != module.padding_idx
        return OneHot(idx, module.num_embeddings, valid)

    def output_grads(self, module, g):
        return _as_btf(g)

    def to_params(self, module, block):
        return {"weight": block.transpose(1, 2)}

    def from_params(self, module, params):
        return params["weight"].transpose(1, 2)


@dataclass(frozen=True)
class Conv2dRule(LayerRule):
    """``nn.Conv2d`` as a Linear over unfolded patches: T = output positions."""

    kind: str = "conv2d"

    def _check(self, module):
        if module.groups != 1:
            raise UnsupportedLayerError(
                f"Conv2d with groups={module.groups} is not supported by hook capture (its "
                "gradient is block-sparse per group); use backend='func' or leave it out"
            )
        if module.padding_mode != "zeros" or isinstance(module.padding, str):
            raise UnsupportedLayerError(
                f"Conv2d with padding_mode={module.padding_mode!r} / padding={module.padding!r} "
                "is not supported by hook capture; use numeric zero padding, "
                "backend='func', or leave it out"
            )

    def block_shape(self, module):
        self._check(module)
        kh, kw = module.kernel_size
        return module.out_channels, module.in_channels * kh * kw + (module.bias is not None)

    def activations(self, module, x):
        self._check(module)
        cols = F.unfold(x, module.kernel_size, dilation=module.dilation,
                        padding=module.padding, stride=module.stride)  # (B, C*kh*kw, L)
        cols = cols.transpose(1, 2)
        return _with_ones(cols) if module.bias is not None else cols

    def output_grads(self, module, g):
        return g.flatten(2).transpose(1, 2)  # (B, out, H', W') -> (B, L, out)

    def to_params(self, module, block):
        n = block.shape[0]
        n_w = block.shape[2] - (module.bias is not None)
        out = {"weight": block[:, :, :n_w].reshape(n, *module.weight.shape)}
        if module.bias is not None:
            out["bias"] = block[:, :, -1]
        return out

    def from_params(self, module, params):
        w = params["weight"].flatten(2)
        if module.bias is None:
            return w
        return torch.cat([w, params["bias"].unsqueeze(-1)], dim=-1)


SUPPORTED_LAYERS = ("nn.Linear", "transformers Conv1D", "nn.Embedding", "nn.Conv2d")


def rule_for(name: str, module: nn.Module) -> LayerRule:
    """The rule recording ``module``, or an :class:`UnsupportedLayerError` naming the fix."""
    conv1d = _hf_conv1d_type()
    if isinstance(module, nn.Linear):
        return LinearRule()
    if conv1d is not None and isinstance(module, conv1d):
        return HFConv1DRule()
    if isinstance(module, nn.Embedding):
        return EmbeddingRule()
    if isinstance(module, nn.Conv2d):
        rule = Conv2dRule()
        rule.block_shape(module)
        return rule
    raise UnsupportedLayerError(
        f"layer {name!r} is a {type(module).__name__}, which hook capture does not support "
        f"(supported: {', '.join(SUPPORTED_LAYERS)}). Pass backend='func' to ga.grads to "
        "capture any module with torch.func (slower), or leave it out of `layers`."
    )
