"""Every projection kind's estimates, pinned to the numbers main's code gave before the
kinds became classes (``gradalg.proj.kinds``, session 44).

``tests/data/projection_estimates_main.json`` was written by :func:`estimates` run on
main at 675cd4a (``python tests/test_projection_estimates_pinned.py --write``). The test
prices the same projectors on the same blocks with the code as it is and asserts every
field of every :class:`~gradalg.plan.cost.Cost` (and every block's kept-table bytes) is
*equal* (``==`` on floats, so bit-identical), not close: moving a formula must not move a
number. The blocks: two (out, in) layer blocks as factors, the same as flat rows, and two
1-D flat blocks, with and without a plan's ``drawn`` set (a second call draws nothing).
"""
from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import gradalg as ga
from gradalg.plan import estimates as E
from gradalg.space import Block, ParamSpace

DATA = Path(__file__).parent / "data" / "projection_estimates_main.json"

PROJECTORS = {
    "gaussian": ga.proj.gaussian(4, seed=0), "gaussian-pb": ga.proj.gaussian(4, seed=1, per_block=True),
    "rademacher": ga.proj.rademacher(6, seed=0), "kron": ga.proj.kron(4, seed=0),
    "kron-2x3": ga.proj.kron(6, seed=0, k_out=2, k_in=3), "sparse": ga.proj.sparse(8, seed=0),
    "sparse-s2-pb": ga.proj.sparse(8, seed=0, s=2, per_block=True), "mask": ga.proj.mask(5, seed=0),
    "mask-global": ga.proj.mask(5, seed=0, per_block=False), "grass": ga.proj.grass(2, seed=0),
    "grass-m20-s2": ga.proj.grass(3, seed=0, mask_k=20, s=2), "factgrass": ga.proj.factgrass(4, seed=0),
    "factgrass-3x4-s2": ga.proj.factgrass(4, seed=0, k_out=3, k_in=4, s=2),
    "tensorsketch": ga.proj.tensorsketch(16, seed=0), "tensorsketch-pb": ga.proj.tensorsketch(16, seed=0, per_block=True),
}
LAYER_BLOCKS = (Block("a", (16, 9), "linear"), Block("b", (3, 17), "linear"), Block("c", (300, 200), "linear"))
FLAT_BLOCKS = (Block("x", (30,), "param"), Block("y", (7,), "param"))
#: (name, blocks, representation of every block)
LAYOUTS = (("factored", LAYER_BLOCKS, "factored"), ("flat2d", LAYER_BLOCKS, "dense"), ("flat1d", FLAT_BLOCKS, "dense"))
#: (n, T, elem, chunk)
SETTINGS = ((20, 1, 8, 8), (7, 5, 4, None), (33, 3, 2, 16))
LAYER_ONLY = ("kron", "factgrass")      # need (out, in) blocks


def _node(p, blocks, rep):
    grads = SimpleNamespace(source=None, space=ParamSpace(blocks), representation={b.name: rep for b in blocks})
    return SimpleNamespace(projector=p, grads=grads)


def _plain(cost) -> dict:
    """The cost's fields that are not zero or empty, as JSON gives them back (tuples as
    lists; a float's repr round-trips exactly)."""
    return json.loads(json.dumps({k: v for k, v in dataclasses.asdict(cost).items() if v not in (0.0, ())}))


def estimates() -> dict:
    out = {}
    for pname, p in PROJECTORS.items():
        for lname, blocks, rep in LAYOUTS:
            if lname == "flat1d" and p.kind in LAYER_ONLY:
                continue
            node = _node(p, blocks, rep)
            for n, T, elem, chunk in SETTINGS:
                drawn = set()
                first = E.project_cost(node, n, T, elem, chunk, drawn)
                second = E.project_cost(node, n, T, elem, chunk, drawn)
                alone = E.project_cost(node, n, T, elem, chunk)
                out[f"{pname}/{lname}/{n},{T},{elem},{chunk}"] = [_plain(first), _plain(second), _plain(alone)]
            out[f"{pname}/{lname}/tables"] = [E.sparse_table_bytes(p, b) for b in blocks]
    return out


def test_every_kind_prices_every_layout_exactly_as_main_did():
    pinned = json.loads(DATA.read_text())
    now = estimates()
    assert sorted(now) == sorted(pinned)
    different = [key for key in pinned if now[key] != pinned[key]]
    assert not different, f"{len(different)} estimates moved, e.g. {different[0]}: {now[different[0]]} != {pinned[different[0]]}"


if __name__ == "__main__" and "--write" in sys.argv:
    DATA.write_text(json.dumps(estimates(), indent=None, sort_keys=True) + "\n")
    print(f"wrote {DATA}")
