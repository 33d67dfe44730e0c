"""Projector specifications: seeded, deterministic, pure data.

A projector maps each per-example gradient to a few coordinates with a random matrix
whose expectation preserves inner products: ``E[⟨Px, Py⟩] = ⟨x, y⟩``.

* ``gaussian`` / ``rademacher``: a dense (k, d) matrix with N(0, 1/k) or ±1/√k
  entries. ``per_block=False`` (default) projects the whole concatenated gradient to one
  block of k coordinates (TRAK); ``per_block=True`` gives every layer its own k.
* ``kron`` (LoGra): ``P_out ⊗ P_in`` per layer, applied to the factors
  ``(D_i P_outᵀ)ᵀ (A_i P_inᵀ)`` without materializing the layer's gradient; each layer
  gets ``k_out × k_in`` coordinates.

The matrices are drawn from ``torch.Generator(seed ⊕ block name)`` on the CPU, so the
same projector gives the same numbers on every machine and every process.
"""
from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

__all__ = ["Projector", "gaussian", "rademacher", "kron"]


@dataclass(frozen=True)
class Projector:
    """A seeded random projection. Call it on a GradientSet: ``P(G)``.

    kind : "gaussian", "rademacher" or "kron"
    k : output coordinates (per block if ``per_block``; for "kron", per layer, split
        as evenly as possible into k_out × k_in unless ``k_out``/``k_in`` are given)
    seed : the random seed
    """

    kind: str
    k: int
    seed: int = 0
    per_block: bool = False
    k_out: int | None = None
    k_in: int | None = None

    def __post_init__(self):
        if self.kind not in ("gaussian", "rademacher", "kron"):
            raise ValueError(f"unknown projector kind {self.kind!r}")
        if self.k < 1:
            raise ValueError(f"projection size k must be positive, got {self.k}")
        if self.kind == "kron" and (self.k_out is None) != (self.k_in is None):
            raise ValueError("give both k_out and k_in, or neither")
        if self.kind == "kron" and self.k_out is not None and self.k_out * self.k_in != self.k:
            raise ValueError(f"k_out * k_in = {self.k_out * self.k_in} must equal k = {self.k}")

    @property
    def token(self) -> str:
        return f"{self.kind}-k{self.k}-s{self.seed}" + ("-pb" if self.per_block else "") + (
            f"-{self.k_out}x{self.k_in}" if self.k_out else "")

    def block_seed(self, block_name: str, part: str = "") -> int:
        """The seed of one block's matrix: stable across processes (crc32, not hash())."""
        return (self.seed * 1_000_003 + zlib.crc32(f"{block_name}/{part}".encode())) % (2**63)

    def kron_shape(self, out: int, n_in: int) -> tuple[int, int]:
        """(k_out, k_in) for a layer of shape (out, in): given, else the most even split of k."""
        if self.k_out is not None:
            return min(self.k_out, out), min(self.k_in, n_in)
        best = None
        for a in range(1, self.k + 1):
            if self.k % a:
                continue
            b = self.k // a
            score = abs(math.log(a) - math.log(b))
            if best is None or score < best[0]:
                best = (score, a, b)
        return best[1], best[2]

    def __call__(self, grads):
        """``P(G)``: the lazy projection of a GradientSet."""
        project = getattr(grads, "project", None)
        if project is None:
            raise TypeError(f"a projector applies to a GradientSet, not a {type(grads).__name__}")
        return project(self)

    def __repr__(self):
        extra = ", per_block=True" if self.per_block else ""
        if self.k_out:
            extra += f", k_out={self.k_out}, k_in={self.k_in}"
        return f"ga.proj.{self.kind}(k={self.k}, seed={self.seed}{extra})"


def gaussian(k: int, seed: int = 0, *, per_block: bool = False) -> Projector:
    """Dense Gaussian projection: entries N(0, 1/k)."""
    return Projector("gaussian", k, seed, per_block)


def rademacher(k: int, seed: int = 0, *, per_block: bool = False) -> Projector:
    """Dense Rademacher projection: entries ±1/√k."""
    return Projector("rademacher", k, seed, per_block)


def kron(k: int, seed: int = 0, *, k_out: int | None = None, k_in: int | None = None) -> Projector:
    """Kronecker (LoGra) projection ``P_out ⊗ P_in`` applied factor-wise, per layer."""
    return Projector("kron", k, seed, True, k_out, k_in)
