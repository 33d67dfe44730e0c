"""The docs site: ``mkdocs build --strict`` passes, the API reference has every public
name, every public name has a docstring, notebooks render with their executed outputs.

One site build (module fixture, ~15 s of CPU) serves the checks of the built pages.
"""
from __future__ import annotations

import base64
import dataclasses
import importlib
import inspect
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

import gradalg as ga

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
sys.path.insert(0, str(DOCS / "tooling"))

# ga.<name> subpackages with an API page each, and what the page is called
SUBPACKAGES = ["methods", "tasks", "proj", "exec", "store", "eval", "plan", "devices", "viz", "widgets", "integrations",
               "collate", "fingerprint", "errors", "options", "units", "testing", "report"]
# nav entries whose page arrives with another branch of issue 16 (the hook leaves them out until then)
PENDING_PAGES: set = set()


# ---------------------------------------------------------------------------------- docstrings
def _own_doc(obj) -> str:
    """The docstring ``obj`` itself has: not inherited, not dataclasses' generated signature."""
    doc = obj.__dict__.get("__doc__") if isinstance(obj, type) else getattr(obj, "__doc__", None)
    if isinstance(obj, type) and dataclasses.is_dataclass(obj) and doc and doc.startswith(obj.__name__ + "("):
        return ""
    return (doc or "").strip()


def _members(cls) -> list[tuple[str, object]]:
    """Public methods and properties defined in ``cls`` itself (conformance tests excluded)."""
    out = []
    for name, value in vars(cls).items():
        if name.startswith("_") or (cls.__module__.startswith("gradalg.testing") and name.startswith("test_")):
            continue
        if isinstance(value, (staticmethod, classmethod)):
            value = value.__func__
        if isinstance(value, property) or inspect.isfunction(value):
            out.append((name, value))
    return out


def public_objects() -> list[tuple[str, object, type | None]]:
    """(documented path, object, owning class or None) of every name in ``gradalg.__all__``
    and in each public subpackage's ``__all__``, and of every public method / property
    those classes define."""
    out = [(f"gradalg.{name}", getattr(ga, name), None) for name in ga.__all__]
    for sub in SUBPACKAGES:
        module = importlib.import_module(f"gradalg.{sub}")
        out.append((f"gradalg.{sub}", module, None))
        for name in module.__all__:
            try:
                out.append((f"gradalg.{sub}.{name}", getattr(module, name), None))
            except ImportError as err:          # an optional dependency (dask) not installed
                pytest.skip(f"gradalg.{sub}.{name} needs an optional dependency: {err}")
    members = []
    for path, obj, _ in out:
        if inspect.isclass(obj) and obj.__module__.startswith("gradalg"):
            members += [(f"{path}.{name}", value, obj) for name, value in _members(obj)]
    return out + members


def _has_docstring(obj, owner) -> bool:
    if isinstance(obj, property):
        return bool((obj.fget.__doc__ or "").strip())
    if isinstance(obj, types.ModuleType) or inspect.isclass(obj) or inspect.isfunction(obj):
        if _own_doc(obj):
            return True
    elif callable(obj) and (getattr(obj, "__doc__", None) or "").strip():
        return True
    # a method overriding a documented one inherits its docstring
    return owner is not None and bool(inspect.getdoc(getattr(owner, obj.__name__, None)))


def test_every_public_symbol_has_a_docstring():
    missing = [path for path, obj, owner in public_objects()
               if (callable(obj) or isinstance(obj, (property, types.ModuleType))) and not _has_docstring(obj, owner)]
    assert not missing, "public names without a docstring (write one, with the math and shapes):\n  " + \
        "\n  ".join(missing)


def test_the_docstring_check_can_fail():
    """The check above sees a class, a function and a property without docstrings."""
    class Undocumented:
        def method(self):
            return 1

        @property
        def prop(self):
            return 2

    @dataclasses.dataclass
    class Data:
        x: int = 0

    def function():
        return 3

    assert not _own_doc(Undocumented) and not _own_doc(Data) and not _own_doc(function)
    names = dict(_members(Undocumented))
    assert set(names) == {"method", "prop"}
    assert not (names["prop"].fget.__doc__ or "") and not _own_doc(names["method"])


# ---------------------------------------------------------------------------------- the site
def _fake_png() -> str:
    """A valid 1 × 1 PNG, base64 (a figure output without running a kernel)."""
    import struct
    import zlib

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 1, 1, 8, 2, 0, 0, 0)) \
        + chunk(b"IDAT", zlib.compress(b"\x00\xff\x00\x00")) + chunk(b"IEND", b"")
    return base64.b64encode(png).decode()


def _executed_copies(folder: Path) -> None:
    """Executed copies as ``make docs-notebooks`` leaves them: the quickstart with an
    output on its first code cell (text and a PNG); the plans notebook with a code cell
    changed since it was run (its outputs must not be shown)."""
    import nbformat

    quick = nbformat.read(ROOT / "notebooks" / "01_quickstart.ipynb", as_version=4)
    first = next(c for c in quick.cells if c.cell_type == "code")
    first.outputs = [nbformat.v4.new_output("stream", name="stdout", text="grafted-output-7f3a\n"),
                     nbformat.v4.new_output("display_data", data={"image/png": _fake_png(), "text/plain": "<fig>"})]
    plans = nbformat.read(ROOT / "notebooks" / "02_plans.ipynb", as_version=4)
    code = next(c for c in plans.cells if c.cell_type == "code")
    code.source += "\n# edited after the run"
    code.outputs = [nbformat.v4.new_output("stream", name="stdout", text="stale-output-91bd\n")]
    (folder / "notebooks").mkdir(parents=True)
    nbformat.write(quick, folder / "notebooks" / "01_quickstart.ipynb")
    nbformat.write(plans, folder / "notebooks" / "02_plans.ipynb")


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    pytest.importorskip("mkdocs", reason="the docs extra is not installed: pip install -e '.[docs]'")
    pytest.importorskip("mkdocstrings_handlers.python", reason="the docs extra is not installed")
    pytest.importorskip("mkdocs_jupyter", reason="the docs extra is not installed")
    tmp = tmp_path_factory.mktemp("docs")
    _executed_copies(tmp / "executed")
    env = {**os.environ, "GRADALG_DOCS_EXECUTED": str(tmp / "executed"), "NO_MKDOCS_2_WARNING": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"),
                          "-d", str(tmp / "site")], cwd=tmp, env=env, capture_output=True, text=True, timeout=600)
    log = run.stdout + run.stderr
    assert run.returncode == 0, f"mkdocs build --strict failed:\n{log[-6000:]}"
    return tmp / "site", log


def _ids(html: str) -> set[str]:
    """Every element id of a page (mkdocstrings gives each entry its dotted path)."""
    return set(re.findall(r'\bid="([^"]+)"', html))


def test_build_is_strict_and_clean(site):
    _, log = site
    assert "WARNING" not in log


def _canonical(obj) -> str:
    if isinstance(obj, types.ModuleType):
        return obj.__name__
    return f"{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', '')}"


def test_api_reference_has_every_public_symbol(site):
    """Each public object has an entry under one of its public paths or its defining path
    (``ga.get_options`` is also ``ga.options.get_options``: one entry is enough; names that
    shadow a submodule, like ``ga.methods.grad_dot``, are documented where they are defined)."""
    root, _ = site
    ids = set()
    for page in (root / "api").glob("*.html"):
        ids |= _ids(page.read_text())
    paths: dict[int, tuple[object, set]] = {}
    for path, obj, owner in public_objects():
        if owner is None:                              # methods: shown with their class
            paths.setdefault(id(obj), (obj, set()))[1].add(path)
    absent = sorted(min(names) for obj, names in paths.values() if not (names | {_canonical(obj)}) & ids)
    assert not absent, ("public names missing from the API reference (docs/api/*.md; a constant needs a "
                        "docstring, a string literal on the line after it):\n  " + "\n  ".join(absent))
    assert "gradalg.GradientSet.to_dense" in ids               # and their methods
    assert "gradalg.methods.influence.influence" in ids and "gradalg.loop_capture.capture" in ids


def test_nav_lists_every_page():
    import yaml

    class Loader(yaml.SafeLoader):
        pass
    Loader.add_multi_constructor("tag:yaml.org,2002:python/", lambda loader, suffix, node: None)
    config = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=Loader)

    def paths(nav):
        for item in nav:
            value = next(iter(item.values())) if isinstance(item, dict) else item
            yield from paths(value) if isinstance(value, list) else [value]
    listed = set(paths(config["nav"]))
    pages = {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md") if not {"tooling", "executed"} & set(p.parts)}
    notebooks = {f"{f}/{p.name}" for f in ("notebooks", "tutorials") for p in (ROOT / f).glob("*.ipynb")}
    assert not pages - listed, f"docs pages missing from nav in mkdocs.yml: {sorted(pages - listed)}"
    assert not notebooks - listed, f"notebooks missing from nav in mkdocs.yml: {sorted(notebooks - listed)}"
    dangling = listed - pages - notebooks - PENDING_PAGES
    assert not dangling, f"nav entries in mkdocs.yml without a page: {sorted(dangling)}"


def test_every_page_is_built(site):
    root, _ = site
    for page in DOCS.rglob("*.md"):
        if "tooling" in page.parts:
            continue
        assert (root / page.relative_to(DOCS).with_suffix(".html")).is_file(), page
    for folder in ("notebooks", "tutorials"):
        for nb in (ROOT / folder).glob("*.ipynb"):
            assert (root / folder / nb.with_suffix(".html").name).is_file(), nb


def test_notebooks_render_with_their_executed_outputs(site):
    root, log = site
    quick = (root / "notebooks" / "01_quickstart.html").read_text()
    assert "grafted-output-7f3a" in quick
    assert re.search(r'<img[^>]+src="data:image/png;base64,', quick), "the figure is not embedded in the page"
    plans = (root / "notebooks" / "02_plans.html").read_text()
    assert "stale-output-91bd" not in plans          # code changed since the run: no outputs of other code
    assert "notebooks/02_plans.ipynb rendered without outputs (its code changed" in log
    assert "Plans: how gradalg decides what to compute" in plans   # the notebook's own text is there


def test_links_point_into_the_site(site):
    root, _ = site
    training = (root / "training_time.html").read_text()
    assert 'href="notebooks/05_training_time.html"' in training
    tutorial = (root / "tutorials" / "01_attribution_from_scratch.html").read_text()
    assert 'href="02_evaluating_attribution.html"' in tutorial


def test_docs_extra_installs_the_site_tools():
    tomllib = pytest.importorskip("tomllib")

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    names = {re.split(r"[<>=\[ ]", req)[0] for req in extras["docs"]}
    assert {"mkdocs", "mkdocs-material", "mkdocstrings", "mkdocs-jupyter"} <= names
    assert any("docs" in req for req in extras["dev"]), "dev should pull the docs extra (the tests build the site)"


# ---------------------------------------------------------------------------------- RST -> Markdown
def test_rst_roles_become_optional_crossrefs():
    from griffe_rst import rst_to_markdown

    out = rst_to_markdown("See :class:`~gradalg.api.Scores` and :func:`pad_collate`.", "gradalg.collate")
    assert '<autoref identifier="gradalg.api.Scores" optional><code>Scores</code></autoref>' in out
    assert '<autoref identifier="gradalg.collate.pad_collate" optional><code>pad_collate</code></autoref>' in out


def test_rst_tables_doctests_and_literal_blocks():
    from griffe_rst import rst_to_markdown

    text = "\n".join([
        "Intro::", "", "    code()", "",
        "=====  =====", "a      b", "=====  =====", "1      2", "=====  =====", "",
        ">>> x = 1", ">>> x", "1", "",
        "Parameters", "----------", "k : int", "    size.", "", "See the guide for more.",
    ])
    out = rst_to_markdown(text)
    assert "Intro:\n" in out and "Intro::" not in out
    assert "| a | b |\n|---|---|\n| 1 | 2 |" in out
    assert "```pycon\n>>> x = 1\n>>> x\n1\n```" in out
    assert "Notes\n-----\nSee the guide for more." in out
    headerless = rst_to_markdown("====  ====\nx     y\n====  ====\n\nafter the table")
    assert "| x | y |" in headerless and "after the table" in headerless.split("|")[-1]


# ---------------------------------------------------------------------------------- make
def _make_dry_run(target: str, tmp_path) -> str:
    import shutil

    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    # a make outside (CI's .ci/run) passes MAKELEVEL/MAKEFLAGS down: "make[1]: Entering directory" lines
    env = {k: v for k, v in os.environ.items() if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS")}
    run = subprocess.run(["make", "--no-print-directory", "-n", target, f"VENV={tmp_path / 'venv'}"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60, env=env)
    assert run.returncode == 0, run.stderr
    return run.stdout


def test_each_make_command_installs_what_it_needs(tmp_path):
    demo = _make_dry_run("demo", tmp_path)
    assert "-e '.[notebook]'" in demo and "[dev]" not in demo and "notebook_runner notebooks/01_quickstart" in demo
    assert "torch==2.13.0" in demo                    # the CPU wheel first
    test = _make_dry_run("test", tmp_path)
    assert "-e '.[dev]'" in test and "pytest" in test
    docs = _make_dry_run("docs", tmp_path)
    assert "-e '.[dev]'" in docs and "docs/tooling/execute_notebooks.py" in docs and "mkdocs build --strict" in docs


def test_executed_copies_are_current_by_their_code(tmp_path):
    """``make docs-notebooks`` re-runs a notebook when its code changed, not its markdown."""
    import nbformat
    from execute_notebooks import is_current

    source = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# T"), nbformat.v4.new_code_cell("x = 1")])
    nbformat.write(source, tmp_path / "a.ipynb")
    assert not is_current(tmp_path / "a.ipynb", tmp_path / "missing.ipynb")
    ran = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# Old title"), nbformat.v4.new_code_cell("x = 1")])
    ran.cells[1].outputs = [nbformat.v4.new_output("stream", name="stdout", text="1\n")]
    nbformat.write(ran, tmp_path / "ran.ipynb")
    assert is_current(tmp_path / "a.ipynb", tmp_path / "ran.ipynb")
    ran.cells[1].source = "x = 2"
    nbformat.write(ran, tmp_path / "ran.ipynb")
    assert not is_current(tmp_path / "a.ipynb", tmp_path / "ran.ipynb")


def test_force_names_the_notebooks_to_execute(tmp_path):
    """``--force NAME...``: a stem, a file name or ``<folder>/<file>`` picks one notebook;
    a name matching none or several is refused, naming the choices."""
    from execute_notebooks import notebooks, resolve

    available = notebooks()
    assert "notebooks/01_quickstart.ipynb" in available and "tutorials/02_evaluating_attribution.ipynb" in available
    assert resolve(["01_quickstart", "tutorials/02_evaluating_attribution.ipynb", "01_quickstart.ipynb"],
                   available) == ["notebooks/01_quickstart.ipynb", "tutorials/02_evaluating_attribution.ipynb"]
    two = ["notebooks/01_a.ipynb", "tutorials/01_a.ipynb"]
    assert resolve(["tutorials/01_a"], two) == ["tutorials/01_a.ipynb"]
    with pytest.raises(ValueError, match=r"matches 2 notebooks .*name one of"):
        resolve(["01_a"], two)
    with pytest.raises(ValueError, match="'01' matches no notebook"):
        resolve(["01"], available)
    run = subprocess.run([sys.executable, str(DOCS / "tooling" / "execute_notebooks.py"), "--force", "nope",
                          "--out", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "'nope' matches no notebook" in run.stderr
    assert not any(tmp_path.iterdir())                # refused before anything ran
    make = _make_dry_run("docs-notebooks", tmp_path)
    assert make.rstrip().endswith("execute_notebooks.py")
    forced = subprocess.run(["make", "-n", "docs-notebooks", f"VENV={tmp_path / 'venv'}", "FORCE=01_quickstart 02_plans"],
                            cwd=ROOT, capture_output=True, text=True, timeout=60).stdout
    assert "execute_notebooks.py --force 01_quickstart 02_plans" in forced
    every = subprocess.run(["make", "-n", "docs-notebooks", f"VENV={tmp_path / 'venv'}", "FORCE=--all"],
                           cwd=ROOT, capture_output=True, text=True, timeout=60).stdout
    assert "execute_notebooks.py --all" in every and "--force" not in every


def test_readme_lists_every_doc_page_and_the_cli():
    readme = (ROOT / "README.md").read_text()
    pages = sorted(p.name for p in DOCS.glob("*.md")) + ["cli.md"]
    missing = [p for p in pages if f"(docs/{p})" not in readme]
    assert not missing, f"README.md's Documentation list lacks {missing}"
    assert "make docs" in readme and "make docs-serve" in readme
