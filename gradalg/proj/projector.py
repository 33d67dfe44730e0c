"""Projector specifications: seeded, deterministic, pure data.

A projector maps each per-example gradient to a few coordinates with a random matrix
whose expectation preserves inner products: ``E[⟨Px, Py⟩] = ⟨x, y⟩``.

* ``gaussian`` / ``rademacher``: a dense (k, d) matrix with N(0, 1/k) or ±1/√k
  entries. ``per_block=False`` (default) projects the whole concatenated gradient to one
  block of k coordinates (TRAK); ``per_block=True`` gives every layer its own k.
* ``kron`` (LoGra): ``P_out ⊗ P_in`` per layer, applied to the factors
  ``(D_i P_outᵀ)ᵀ (A_i P_inᵀ)`` without materializing the layer's gradient; each layer
  gets ``k_out × k_in`` coordinates.
* ``sparse`` (SJLT, sparse Johnson–Lindenstrauss): a (k, d) matrix with ``s`` non-zeros
  ``±1/√s`` per column, at distinct rows (column j's c-th non-zero lies in the c-th of
  ``s`` equal bands of rows). It is applied by scatter-adds, never as a dense matrix:
  ``(Px)_r = Σ_{j,c: h_c(j)=r} σ_c(j) x_j / √s``, n·d·s additions per example set.
  ``E[⟨Px, Py⟩] = Σ_{j,c} x_j y_j / s = ⟨x, y⟩`` because the signs are independent.
  ``per_block`` as for ``gaussian``.
* ``mask``: k of a block's d coordinates, uniformly without replacement, scaled by
  ``√(d/k)``: coordinate j survives with probability k/d, so ``E[⟨Mx, My⟩] = ⟨x, y⟩``.
  Blocks with d ≤ k are kept whole. ``per_block=True`` (default) masks each block to
  min(k, d) coordinates; ``per_block=False`` draws k of the concatenated gradient.
* ``grass`` (GraSS, Hu et al. 2025): ``S ∘ M``: a mask to ``mask_k`` coordinates
  (default ``GRASS_BLOWUP · k`` = 4k) followed by an SJLT to k, per block. On factors the
  mask needs only the selected entries ``Σ_t d_{t,o} a_{t,i}``: n·T·mask_k work, and
  the whole (out, in) gradient is never formed.
* ``factgrass`` (FactGraSS): for an (out, in) layer block, mask the *factors*: keep
  ``k_out`` of the out rows and ``k_in`` of the in columns (scaled by
  ``√(out·in / (k_out·k_in))``), form the small (k_out, k_in) gradient
  ``D[:, :, O]ᵀ A[:, :, I]`` (n·T·k_out·k_in work), then SJLT it to k. By default
  ``k_out · k_in ≈ GRASS_BLOWUP · k`` split as evenly as the layer allows (k = 4096 gives
  128 × 128, as in the paper's code); each side is capped at the layer's size and
  the other side takes up the slack.
* ``tensorsketch`` (Pham & Pagh 2013): an SJLT of each (out, in) block whose hash and
  sign factor over the two sides, ``h(o, i) = (h_out(o) + h_in(i)) mod k`` and
  ``σ(o, i) = σ_out(o) σ_in(i)``. On factors ``G_i = Σ_t d_t a_tᵀ`` it is
  ``Σ_t CS_out(d_t) ⊛ CS_in(a_t)`` (count sketches of the two factors, circularly
  convolved by FFT): n·T·(out + in + O(k log k)) work, the (out, in) gradient never
  formed and tables of out + in entries. Unbiased (the signs are independent per side);
  its variance can exceed a plain SJLT's (up to about (2 + 3²)/k against 2/k of
  ‖x‖²‖y‖² in the worst case). ``per_block`` as for ``gaussian``; a flat block of shape
  (d,) is taken as (1, d).

Every random choice is independent of the data, so the expectation over the
projector's randomness preserves inner products for all kinds. The matrices and
index tables are drawn from ``torch.Generator(seed ⊕ block name)`` on the CPU, so the
same projector gives the same numbers on every machine and every process.
"""
from __future__ import annotations

import functools
import math
import zlib
from dataclasses import dataclass

from ..errors import OptionError
from ..options import get_options, plain
from .kinds import GRASS_BLOWUP, REGISTRY, ProjectionKind

__all__ = ["Projector", "gaussian", "rademacher", "kron", "sparse", "mask", "grass", "factgrass",
           "tensorsketch", "dense_or_sparse", "KINDS", "GRASS_BLOWUP"]

#: the kinds' names, as :data:`gradalg.proj.kinds.REGISTRY` registers them
KINDS = tuple(REGISTRY)


@functools.lru_cache(maxsize=4096)
def _even_kron_split(k: int, out: int, n_in: int) -> tuple[int, int]:
    """The split (a, b) of ``k`` for an (out, in) layer with a ≤ out, b ≤ in, the most
    coordinates a·b ≤ k and, among those, the least |log a − log b|. A search over a
    (up to min(k, out) steps), cached: a model repeats a handful of layer shapes over
    its blocks, and planning a 70B model asks for each block's split several times."""
    best = None
    for a in range(1, min(k, out) + 1):
        b = min(k // a, n_in)
        if b < 1:
            continue
        key = (a * b, -abs(math.log(a) - math.log(b)))
        if best is None or key > best[0]:
            best = (key, a, b)
    return best[1], best[2]


@dataclass(frozen=True)
class Projector:
    """A seeded random projection. Call it on a GradientSet: ``P(G)``.

    kind : one of ``KINDS``: "gaussian", "rademacher", "kron", "sparse", "mask",
        "grass", "factgrass", "tensorsketch" (see the module docstring for the math of each)
    k : output coordinates (per block if ``per_block``; for "kron", per layer, split
        as evenly as possible into k_out × k_in unless ``k_out``/``k_in`` are given;
        for "mask", at most the block's size)
    seed : the random seed
    per_block : one projection per block (True) or one of the concatenated gradient;
        always True for "kron", "grass" and "factgrass"
    k_out, k_in : "kron": the factor sizes (k_out·k_in = k); "factgrass": how many
        output / input features the factor mask keeps (k_out·k_in ≥ k)
    s : non-zeros per column of the sparse JL transform ("sparse", "grass", "factgrass")
    mask_k : "grass": coordinates the mask keeps before the SJLT (default 4k)
    """

    kind: str
    k: int
    seed: int = 0
    per_block: bool = False
    k_out: int | None = None
    k_in: int | None = None
    s: int = 1
    mask_k: int | None = None

    def __post_init__(self):
        for name in ("k", "seed", "k_out", "k_in", "s", "mask_k"):   # np.int64 works as an int
            value = plain(getattr(self, name))
            object.__setattr__(self, name, value)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
                raise OptionError(f"the projector's {name} must be an int, got {value!r}")
        if not isinstance(plain(self.per_block), bool):
            raise OptionError(f"per_block must be True or False, got {self.per_block!r}")
        object.__setattr__(self, "per_block", plain(self.per_block))
        if self.kind not in REGISTRY:
            raise OptionError(f"unknown projector kind {self.kind!r}; expected one of {KINDS}")
        kind = self.kind_object
        if self.k < 1:
            raise OptionError(f"projection size k must be positive, got {self.k}")
        if kind.per_layer and not self.per_block:
            raise OptionError(f"a {self.kind} projection is per layer: use per_block=True")
        if (self.k_out is not None or self.k_in is not None) and not kind.factor_sizes:
            raise OptionError(f"k_out/k_in apply to {_names('factor_sizes', ' and ')} projections, not {self.kind}")
        if (self.k_out is None) != (self.k_in is None):
            raise OptionError("give both k_out and k_in, or neither")
        if self.k_out is not None and (self.k_out < 1 or self.k_in < 1):
            raise OptionError(f"k_out and k_in must be positive, got {self.k_out} and {self.k_in}")
        if self.s != 1 and not kind.sjlt:
            raise OptionError(f"s (non-zeros per column) applies to {_names('sjlt')}, not {self.kind}")
        if not 1 <= self.s <= self.k:
            raise OptionError(f"s must be between 1 and k = {self.k}, got {self.s}")
        if self.mask_k is not None and not kind.masked:
            raise OptionError(f"mask_k applies to {_names('masked', ' and ')} projections, not {self.kind}")
        kind.check(self)

    @property
    def kind_object(self) -> ProjectionKind:
        """The registered kind (:mod:`gradalg.proj.kinds`): this projector's kernel, cost
        formula, tables and the options it takes."""
        return REGISTRY[self.kind]

    @property
    def token(self) -> str:
        """The projector's identity: kind, ``k``, seed and options, e.g. ``"kron-k64-s0"``.
        Gradients projected by projectors with equal tokens share a basis (so they can meet in
        one score or one curvature estimate)."""
        return f"{self.kind}-k{self.k}-s{self.seed}" + ("-pb" if self.per_block else "") + (
            f"-{self.k_out}x{self.k_in}" if self.k_out else "") + (
            f"-nnz{self.s}" if self.s != 1 else "") + (f"-m{self.mask_k}" if self.mask_k else "")

    @property
    def map(self) -> str | None:
        """The map the plan's "projection map" decision names for this projector: ``"dense"``
        (a (k, d) float64 matrix: gaussian, rademacher), ``"sparse JL"`` (sparse) or
        ``"tensorsketch"``; None for the per-layer maps of factors (kron, mask, grass,
        factgrass), which keep neither a matrix of d nor tables of d."""
        return self.kind_object.map

    def block_seed(self, block_name: str, part: str = "") -> int:
        """The seed of one block's matrix: stable across processes (crc32, not hash())."""
        return (self.seed * 1_000_003 + zlib.crc32(f"{block_name}/{part}".encode())) % (2**63)

    def kron_shape(self, out: int, n_in: int) -> tuple[int, int]:
        """(k_out, k_in) for a layer of shape (out, in).

        Given sizes are clipped to the layer. Otherwise the split of k that never
        projects *up* (k_out ≤ out, k_in ≤ in) with the most coordinates (k_out·k_in ≤ k),
        the most even one among those: a 10-output layer with k=256 gets 10 × 25, not
        16 × 16 (which would make its projected Fisher rank-deficient).

        A side that comes out the layer's own size (k above out or in: ``k_out = out``)
        is projected by the identity (:func:`gradalg.proj.kron_matrices`), not by a random
        square map; a layer with out·in ≤ k is kept exact.
        """
        if self.k_out is not None:
            return min(self.k_out, out), min(self.k_in, n_in)
        return _even_kron_split(self.k, out, n_in)

    def mask_size(self, dim: int) -> int:
        """Coordinates a "mask" projection keeps of ``dim``: min(k, dim)."""
        return min(self.k, dim)

    def grass_mask_size(self, dim: int) -> int:
        """Coordinates the "grass" mask keeps of a block of ``dim``: min(mask_k or 4k, dim)."""
        return min(self.mask_k or GRASS_BLOWUP * self.k, dim)

    def factgrass_shape(self, out: int, n_in: int) -> tuple[int, int]:
        """(k_out, k_in) features the "factgrass" mask keeps of an (out, in) layer.

        Given ``k_out``/``k_in`` (capped at the layer), else k_out·k_in ≈ 4k split evenly:
        k_out = min(out, ⌈√(4k)⌉), k_in = min(in, ⌈4k / k_out⌉), then k_out is raised
        to ⌈4k / k_in⌉ (capped at out) when the input side was capped. A layer with
        out·in ≤ 4k is kept whole.
        """
        if self.k_out is not None:
            return min(self.k_out, out), min(self.k_in, n_in)
        target = GRASS_BLOWUP * self.k
        k_out = min(out, math.isqrt(target - 1) + 1)
        k_in = min(n_in, -(-target // k_out))
        return min(out, -(-target // k_in)), k_in

    def block_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The projected shape of one block of ``shape`` under a per-block projector."""
        return self.kind_object.block_shape(self, shape)

    def check_block(self, block) -> None:
        """Refuse a block this projector cannot project (kron and factgrass: a block that is
        not an (out, in) layer in parameter coordinates), naming the kinds that can."""
        self.kind_object.check_block(self, block)

    def __call__(self, grads):
        """``P(G)``: the lazy projection of a GradientSet."""
        project = getattr(grads, "project", None)
        if project is None:
            raise OptionError(f"a projector applies to a GradientSet, not a {type(grads).__name__}")
        return project(self)

    def __repr__(self):
        extra = ""
        kind = self.kind_object
        if not kind.per_layer and self.per_block != kind.default_per_block:
            extra += f", per_block={self.per_block}"
        if self.s != 1:
            extra += f", s={self.s}"
        if self.mask_k:
            extra += f", mask_k={self.mask_k}"
        if self.k_out:
            extra += f", k_out={self.k_out}, k_in={self.k_in}"
        return f"ga.proj.{self.kind}(k={self.k}, seed={self.seed}{extra})"


def _names(flag: str, sep: str | None = None):
    """The registered kinds with class attribute ``flag`` set: a tuple, or joined by ``sep``."""
    names = tuple(name for name, kind in REGISTRY.items() if getattr(kind, flag))
    return names if sep is None else sep.join(names)


def check_projector(projector):
    """``projector`` when it is None or a projector (anything callable on a GradientSet,
    e.g. ``ga.proj.kron(k=64)``); otherwise an OptionError naming the fix."""
    if projector is not None and not callable(projector):
        raise OptionError(f"projector must be a ga.proj projector (e.g. ga.proj.kron(k=64)) or None, got "
                          f"{projector!r:.80}")
    return projector


def gaussian(k: int, seed: int = 0, *, per_block: bool = False) -> Projector:
    """Dense Gaussian projection: entries N(0, 1/k)."""
    return Projector("gaussian", k, seed, per_block)


def rademacher(k: int, seed: int = 0, *, per_block: bool = False) -> Projector:
    """Dense Rademacher projection: entries ±1/√k."""
    return Projector("rademacher", k, seed, per_block)


def kron(k: int, seed: int = 0, *, k_out: int | None = None, k_in: int | None = None) -> Projector:
    """Kronecker (LoGra) projection ``P_out ⊗ P_in`` applied factor-wise, per layer.

    Each layer (out, in) gets k_out × k_in ≤ k coordinates (:meth:`Projector.kron_shape`);
    a side that k does not reduce (k_out = out, or k_in = in) is kept exact (the identity),
    so a layer with out·in ≤ k is not projected at all.
    """
    return Projector("kron", k, seed, True, k_out, k_in)


def sparse(k: int, seed: int = 0, *, s: int = 1, per_block: bool = False) -> Projector:
    """Sparse Johnson–Lindenstrauss transform (SJLT): ``s`` entries ±1/√s per column.

    Each input coordinate is added, with a random sign, to ``s`` random output
    coordinates (one in each of ``s`` bands of k/s rows): n·d·s additions for n
    examples of d coordinates, no (k, d) matrix. ``E[⟨Px, Py⟩] = ⟨x, y⟩``. Factored
    blocks are materialized (in slices of rows) first: use ``grass`` or ``factgrass``
    to avoid that.

    >>> P = ga.proj.sparse(k=1024, seed=0)
    >>> P(G).space.describe()      # one block of 1024 coordinates for the whole model
    'projected 1024'
    """
    return Projector("sparse", k, seed, per_block, s=s)


def tensorsketch(k: int, seed: int = 0, *, per_block: bool = False) -> Projector:
    """TensorSketch: an SJLT of each (out, in) block with the factored hash
    ``(h_out(o) + h_in(i)) mod k`` and sign ``σ_out(o) σ_in(i)``, applied to the factors
    by FFT (``CS(d_t) ⊛ CS(a_t)`` summed over positions): no (out, in) gradient, tables of
    out + in entries per block. A fixed linear map with one ±1 per coordinate, like
    ``sparse``, unbiased, at a fraction of its cost on wide layers (see the module
    docstring for its variance).

    >>> P = ga.proj.tensorsketch(k=2048, seed=0)
    >>> P(G).space.describe()
    'projected 2048'
    """
    return Projector("tensorsketch", k, seed, per_block)


def dense_or_sparse(kind: str, k: int, dim: int, seed: int = 0, *, factored: bool = True) -> Projector:
    """A method's default projection of ``dim`` coordinates to ``k``, by width:

    * the dense ``kind`` ("gaussian" or "rademacher", the papers' maps) while its (k, dim)
      float64 matrix is within ``ga.options(dense_projection_bytes)`` (1 GiB);
    * else ``sparse(k, seed)``, an SJLT of the same k (one ±1 per coordinate: no matrix,
      ``dim`` additions per example instead of ``k·dim`` multiply-adds), while its tables
      (5·dim bytes) are within ``ga.options(sjlt_table_bytes)`` (256 MiB), or whenever the
      rows are not factored (``factored=False``: LESS's Adam-preconditioned rows);
    * else ``tensorsketch(k, seed)``: the SJLT whose hash factors over each layer's outputs
      and inputs, applied to the factors by FFT (no layer's gradient formed, tables of
      out + in per layer). On a trained GPT-2's per-example gradients its inner-product
      error matched the SJLT's and the Gaussian's at k = 256 and 1024 (docs/projections.md).

    All are fixed linear maps drawn block by block (seeded per block), with
    ``E[⟨Px, Py⟩] = ⟨x, y⟩``; the plan shows the choice and both options (the
    "projection map" decision).

    >>> dense_or_sparse("gaussian", 2048, 85_000_000)          # GPT-2 small's blocks
    ga.proj.tensorsketch(k=2048, seed=0)
    >>> dense_or_sparse("rademacher", 8192, 85_000_000, factored=False)
    ga.proj.sparse(k=8192, seed=0)
    """
    if kind not in ("gaussian", "rademacher"):
        raise OptionError(f"kind must be 'gaussian' or 'rademacher', got {kind!r}")
    o = get_options()
    if k * dim * 8 <= o.dense_projection_bytes:
        return Projector(kind, k, seed)
    if not factored or 5 * dim <= o.sjlt_table_bytes:
        return sparse(k, seed)
    return tensorsketch(k, seed)


def mask(k: int, seed: int = 0, *, per_block: bool = True) -> Projector:
    """Random coordinate mask: k of a block's d coordinates, scaled by √(d/k).

    Unbiased (``E[⟨Mx, My⟩] = ⟨x, y⟩``) but high-variance on its own; it is the first
    stage of ``grass``. On factors it costs n·T·k, without forming the (out, in) gradient.
    """
    return Projector("mask", k, seed, per_block)


def grass(k: int, seed: int = 0, *, mask_k: int | None = None, s: int = 1) -> Projector:
    """GraSS: a random mask to ``mask_k`` coordinates (default 4k), then an SJLT to k, per layer.

    Cost per example: T·mask_k on factors (or mask_k gathers on a dense block) plus
    mask_k·s additions; no (out, in) gradient and no dense matrix.
    """
    return Projector("grass", k, seed, True, s=s, mask_k=mask_k)


def factgrass(k: int, seed: int = 0, *, k_in: int | None = None, k_out: int | None = None,
              s: int = 1) -> Projector:
    """FactGraSS: mask each layer's factors to k_in input and k_out output features, form
    the (k_out, k_in) gradient, SJLT it to k.

    Default k_out·k_in ≈ 4k, split evenly (see :meth:`Projector.factgrass_shape`).
    Cost per example: T·k_out·k_in multiply-adds plus k_out·k_in·s additions, against
    T·(in·k_in + out·k_out + k_in·k_out) for ``kron`` with the same k_out × k_in.

    >>> P = ga.proj.factgrass(k=4096)
    >>> P.factgrass_shape(768, 3073)   # a GPT-2 c_fc layer: 128 × 128 masked features
    (128, 128)
    """
    return Projector("factgrass", k, seed, True, k_out, k_in, s=s)
