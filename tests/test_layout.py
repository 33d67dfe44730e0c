"""The package layout: imports run down the floors of docs/design.md "Layers", never up,
and no two packages import each other (directly or round a longer circle).

Every module of ``gradalg/`` is parsed with :mod:`ast`; every ``import`` counts, at module
level or inside a function (a function-local import is a dependency that only hides its
cost), and ``if TYPE_CHECKING:`` ones too. A *unit* is a subpackage (``gradalg/exec/``) or
a top-level module (``gradalg/api.py``); ``gradalg`` itself is the package's
``__init__.py``. Imports inside one unit are that unit's own business.
"""
from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "gradalg"

# The floors, bottom to top, as in docs/design.md "Layers". A unit may import its own
# floor and the floors below it; imports within a floor must not form a circle.
FLOORS: tuple[tuple[str, ...], ...] = (
    ("bytefmt", "errors", "version", "options", "units", "fingerprint", "finite", "dtensor", "own_hooks",
     "eval_mode", "collate", "notebook_runner"),  # foundation
    ("data", "task", "tasks", "space", "unroll", "eval"),  # inputs, shapes, torch-only math
    ("capture",),                                       # recording per-example factors
    ("linalg",),                                        # resolved operators (on flat or factored rows)
    ("proj",),                                          # projectors: one class per kind, tables, kernels
    ("expr",),                                          # immutable expression nodes
    ("curvature", "viz", "report", "devices"),          # kernels, displays and the machine model over nodes
    ("plan",),                                          # the planner
    ("exec",),                                          # the executors
    ("api", "objective", "token_scores"),               # user objects over nodes
    ("loop_capture", "compiled", "methods", "store", "integrations", "widgets", "check"),  # above api
    ("gradalg",),                                       # the package's re-exports
    ("cli", "testing"),                                 # users of the public package
)
FLOOR = {unit: level for level, units in enumerate(FLOORS) for unit in units}


def _module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str, root: Path) -> bool:
    base = root.joinpath(*name.split("."))
    return base.with_suffix(".py").exists() or (base / "__init__.py").exists()


def _unit(module: str) -> str:
    parts = module.split(".")
    return "gradalg" if len(parts) == 1 else parts[1]


def _imported_modules(path: Path, root: Path):
    """(line, module) for every gradalg module ``path`` imports, anywhere in the file.

    ``from pkg import name`` depends on ``pkg.name`` when that is a module, else on ``pkg``
    (a name ``pkg``'s ``__init__`` defines or re-exports).
    """
    module = _module_name(path, root)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = parts[: len(parts) - node.level + 1] + ([node.module] if node.module else [])
                source = ".".join(base)
            else:
                source = node.module or ""
            for alias in node.names:
                full = f"{source}.{alias.name}"
                yield node.lineno, full if _is_module(full, root) else source


def package_imports(root: Path = ROOT) -> dict[tuple[str, str], list[str]]:
    """{(importing unit, imported unit): ["module:line", ...]} over all of root/gradalg/."""
    edges: dict[tuple[str, str], list[str]] = defaultdict(list)
    for path in sorted((root / "gradalg").rglob("*.py")):
        source = _module_name(path, root)
        for line, target in _imported_modules(path, root):
            if target != "gradalg" and not target.startswith("gradalg."):
                continue
            a, b = _unit(source), _unit(target)
            if a != b:
                edges[(a, b)].append(f"{path.relative_to(root)}:{line}")
    return edges


def _circles(edges) -> list[list[str]]:
    """Strongly connected components with more than one unit (Tarjan)."""
    graph = defaultdict(set)
    for a, b in edges:
        graph[a].add(b)
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_every_unit_has_a_floor():
    units = {_unit(_module_name(p)) for p in PACKAGE.rglob("*.py")}
    missing = sorted(units - set(FLOOR))
    assert not missing, (f"{missing} have no floor: add them to FLOORS here and to docs/design.md "
                         "'Layers'")
    gone = sorted(set(FLOOR) - units)
    assert not gone, f"FLOORS names units that no longer exist: {gone}"


def test_design_md_layers_names_every_unit_in_floor_order():
    """docs/design.md "Layers" draws the same floors, top to bottom: each unit appears there
    (``exec/``, ``api.py``), and a higher floor's units before a lower floor's."""
    text = (ROOT / "docs" / "design.md").read_text()
    layers = text[text.index("## Layers"):text.index("\n## ", text.index("## Layers") + 1)]
    first = {}
    for unit in FLOOR:
        name = "gradalg/__init__.py" if unit == "gradalg" else (
            f"{unit}/" if (PACKAGE / unit).is_dir() else f"{unit}.py")
        assert name in layers, f"docs/design.md 'Layers' does not name {name}"
        first[unit] = layers.index(name)
    for a in FLOOR:
        for b in FLOOR:
            if FLOOR[a] > FLOOR[b]:
                assert first[a] < first[b], f"design.md draws {a} (higher) below {b}"


def test_no_upward_import():
    upward = [f"{a} (floor {FLOOR[a]}) imports {b} (floor {FLOOR[b]}) at {', '.join(where)}"
              for (a, b), where in sorted(package_imports().items())
              if a in FLOOR and b in FLOOR and FLOOR[b] > FLOOR[a]]
    assert not upward, "upward imports:\n" + "\n".join(upward)


def _shortest_circle(component: list[str], edges) -> list[str]:
    """The shortest circle through the units of ``component`` (breadth-first), for the message."""
    circles = []
    for start in component:
        paths, seen = [[start]], {start}
        while paths:
            path = paths.pop(0)
            nexts = sorted(u for u in component if (path[-1], u) in edges)
            if start in nexts:
                circles.append(path + [start])
                break
            for b in nexts:
                if b not in seen:
                    seen.add(b)
                    paths.append(path + [b])
    return min(circles, key=len)


def test_no_import_circle_between_packages():
    edges = package_imports()
    circles = _circles(edges)
    detail = []
    for component in circles:
        circle = _shortest_circle(component, edges)
        detail.append(f"{' ↔ '.join(component)}, e.g. " + ", ".join(
            f"{a} → {b} at {edges[(a, b)][0]}" for a, b in zip(circle, circle[1:])))
    assert not circles, "import circles:\n" + "\n".join(detail)


@pytest.mark.parametrize("snippet, expected", [
    ("from ..api import GradientSet\n", ("capture", "api")),                      # relative, a name
    ("def f():\n    from .. import fingerprint\n", ("capture", "fingerprint")),    # function-local module
    ("import gradalg.exec.local as local\n", ("capture", "exec")),                 # absolute
    ("if TYPE_CHECKING:\n    from gradalg.exec import local\n", ("capture", "exec")),
    ("from . import factors\n", None),                                             # within the unit
])
def test_the_parser_sees_every_form_of_import(tmp_path, snippet, expected):
    """The checks above are only as good as the parser: each form of import is found, in a
    small package laid out like gradalg/."""
    for name in ("__init__.py", "api.py", "fingerprint.py", "capture/__init__.py", "capture/factors.py",
                 "exec/__init__.py", "exec/local.py"):
        (tmp_path / "gradalg" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "gradalg" / name).write_text("")
    (tmp_path / "gradalg" / "capture" / "probe.py").write_text(snippet)
    edges = set(package_imports(tmp_path))
    assert edges == ({expected} if expected else set())


def test_a_circle_is_found():
    edges = {("capture", "expr"): ["a:1"], ("expr", "plan"): ["b:1"], ("plan", "capture"): ["c:1"],
             ("api", "exec"): ["d:1"]}
    assert _circles(edges) == [["capture", "expr", "plan"]]
    assert _shortest_circle(["capture", "expr", "plan"], edges) == ["capture", "expr", "plan", "capture"]


def test_xarray_loads_only_when_a_result_is_made():
    """``import gradalg`` and the passes of a run do not load xarray (and pandas under it:
    about 76 MB resident, which would add to the run's peak); the result's DataArray does."""
    import subprocess
    import sys

    script = """
import sys, torch
import gradalg as ga
from gradalg.exec.runner import PassRunner
assert "xarray" not in sys.modules and "pandas" not in sys.modules, "loaded by import gradalg"
loaded_in_a_pass = []
run_pass = PassRunner.run_pass
def watched(self, step, *where):
    run_pass(self, step, *where)
    loaded_in_a_pass.append("xarray" in sys.modules)
PassRunner.run_pass = watched
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
X, y = torch.randn(20, 4), torch.randint(0, 3, (20,))
S = ga.methods.influence(ga.tasks.classification(model), (X, y), (X[:3], y[:3]), curvature="ekfac")
S.explain()
with ga.options(progress=False):
    out = S.compute()
assert loaded_in_a_pass and not any(loaded_in_a_pass), loaded_in_a_pass
assert type(out).__name__ == "DataArray" and out.shape == (3, 20)
print("ok")
"""
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=root, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]
