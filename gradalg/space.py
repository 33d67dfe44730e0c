"""Parameter spaces: the ordered blocks that gradients live in.

A block is one captured layer (canonical ``(out, in)`` orientation, bias folded into
``in``) or one projected block (``k`` coordinates in a projector's basis). Two gradient
sets can be multiplied only when their spaces are equal: same blocks, same shapes,
same basis.

Pure shape types on the floor below ``capture/`` and ``expr/``: the layer rules give a
block its shape, the expression nodes carry the spaces, and both import them from here.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .errors import LayerNameError, SpaceMismatchError

__all__ = ["Block", "ParamSpace", "AliasDict"]


@dataclass(frozen=True)
class Block:
    """One block of a parameter space.

    name : layer name (or ``"projected"`` for a projection of the whole space)
    shape : ``(out, in)`` for a layer, ``(k_out, k_in)`` for a Kronecker projection,
        ``(k,)`` for a dense projection
    kind : the layer kind ("linear", "conv1d", "conv2d", "embedding", "expert", "param") or
        "projected"
    basis : "params" for the model's own coordinates, else the projector's token
    aliases : other module names that select this block (a tied parameter's other
        holders); not part of the block's identity
    """

    name: str
    shape: tuple[int, ...]
    kind: str
    basis: str = "params"
    # other module names of a tied block (gradalg.capture.tying); they select it too
    aliases: tuple[str, ...] = field(default=(), compare=False, repr=False)

    @property
    def dim(self) -> int:
        out = 1
        for s in self.shape:
            out *= s
        return out


@dataclass(frozen=True)
class ParamSpace:
    """Ordered blocks; ``dim`` is the total number of coordinates."""

    blocks: tuple[Block, ...]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(b.name for b in self.blocks)

    @property
    def dim(self) -> int:
        return sum(b.dim for b in self.blocks)

    def __getitem__(self, name: str) -> Block:
        for b in self.blocks:
            if b.name == name:
                return b
        for b in self.blocks:
            if name in b.aliases:
                return b
        raise LayerNameError(f"no block {name!r} in this space; blocks: {list(self.names)}")

    def canonical(self, name: str) -> str:
        """The block name ``name`` stands for (itself, or the block it is an alias of)."""
        return self[name].name

    def select(self, names) -> "ParamSpace":
        return ParamSpace(tuple(self[n] for n in names))

    def offsets(self) -> dict[str, slice]:
        """Where each block sits in a flattened row of length ``dim``."""
        out, start = {}, 0
        for b in self.blocks:
            out[b.name] = slice(start, start + b.dim)
            start += b.dim
        return out

    def check_same(self, other: "ParamSpace", what: str = "these operands") -> None:
        """Raise :class:`SpaceMismatchError` that says how the two spaces differ."""
        if self == other:
            return
        a, b = {x.name: x for x in self.blocks}, {x.name: x for x in other.blocks}
        problems = []
        if set(a) != set(b):
            problems.append(f"blocks only on the left: {sorted(set(a) - set(b))}, only on the "
                            f"right: {sorted(set(b) - set(a))}")
        for name in sorted(set(a) & set(b)):
            if a[name].shape != b[name].shape:
                problems.append(f"block {name!r} has shape {a[name].shape} vs {b[name].shape}")
            elif a[name].basis != b[name].basis:
                problems.append(f"block {name!r} is in basis {a[name].basis} vs {b[name].basis}")
        if not problems and self.names != other.names:
            problems.append(f"block order differs: {list(self.names)} vs {list(other.names)}")
        raise SpaceMismatchError(
            f"{what} live in different parameter spaces: " + "; ".join(problems) + ". Capture both "
            "sides with the same `layers`, and apply the same projector object (same kind, k "
            "and seed) to both."
        )

    def describe(self) -> str:
        if len(self.blocks) == 1:
            b = self.blocks[0]
            return f"{b.name} {'×'.join(map(str, b.shape))}"
        return f"{len(self.blocks)} blocks, {self.dim:,} coords"


class AliasDict(dict):
    """A dict keyed by block (or parameter) names that also answers to aliases: a tied
    block's other module names (``d["lm_head"]`` is ``d["transformer.wte"]``).

    ``aliases`` maps each alias key to its canonical key; iteration and ``len`` see the
    canonical keys only, so nothing is counted twice.
    """

    def __init__(self, data=(), aliases: dict | None = None):
        super().__init__(data)
        self.aliases = dict(aliases or {})

    def __missing__(self, key):
        if key in self.aliases:
            return self[self.aliases[key]]
        raise KeyError(key)

    def __contains__(self, key):
        return super().__contains__(key) or (key in self.aliases and super().__contains__(self.aliases[key]))

    def get(self, key, default=None):
        return self[key] if key in self else default

    @staticmethod
    def blocks(data: dict, space: "ParamSpace") -> "AliasDict":
        return AliasDict(data, {a: b.name for b in space.blocks for a in b.aliases})

    @staticmethod
    def params(data: dict, space: "ParamSpace") -> "AliasDict":
        """Parameter names ``"<block>.<param>"``: an alias module's name stands for the block's."""
        out = {}
        for b in space.blocks:
            for key in data:
                if b.name and key.startswith(b.name + "."):
                    out.update({alias + key[len(b.name):]: key for alias in b.aliases if alias != b.name})
        return AliasDict(data, out)
