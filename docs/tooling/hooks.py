"""MkDocs hooks for the gradalg site (``hooks:`` in ``mkdocs.yml``).

**Notebooks with their outputs, without executing anything.** ``notebooks/*.ipynb`` and
``tutorials/*.ipynb`` are committed without outputs and live outside ``docs/``. This
hook adds each to the site at the same path (``notebooks/01_quickstart.ipynb`` becomes
the page ``notebooks/01_quickstart.html``, rendered by mkdocs-jupyter), with the
outputs of its executed copy ``docs/executed/<folder>/<name>.ipynb`` (written by
``make docs-notebooks``, i.e. ``docs/tooling/execute_notebooks.py``, and committed, so
that ``mkdocs build`` with only the ``[docs]`` extra shows every figure; the environment
variable ``GRADALG_DOCS_EXECUTED`` names another folder). Outputs are
grafted onto the *source* notebook only when every code cell's source is identical to
the executed copy's: edited markdown shows at once, and a notebook whose code changed
since its last run is rendered without outputs (and says so in the build log) rather
than with outputs of other code. So ``mkdocs build`` never runs a kernel and takes
seconds; ``make docs`` executes first, once per changed notebook.

**Links that work on GitHub and on the site.** Pages link to notebooks as
``../notebooks/05_training_time.ipynb`` and notebooks to each other as
``02_evaluating_attribution.ipynb`` (right in the repository); links that resolve to a
notebook or a ``docs/`` page are rewritten to the page's place in the site.

**Math that renders offline.** Formulas (``$…$`` in notebooks, ``$…$`` / ``\\(…\\)`` in
pages through ``pymdownx.arithmatex``) are typeset in the browser by KaTeX, served from
the site itself: the hook adds the KaTeX files vendored in the package
(``gradalg/report/katex/``: the report inlines the same files) to the site as
``assets/katex/``, which ``extra_javascript`` / ``extra_css`` of ``mkdocs.yml`` load. No
page asks a CDN for anything (``tests/test_docs_math.py`` checks it in headless Chromium).

**The nav.** A page of ``docs/`` missing from ``nav`` is appended under "More" (and
``tests/test_docs.py`` asks for it to be listed properly); a nav entry whose page does
not exist yet (``cli.md`` before the command line's branch merges) is dropped, logged.
"""
from __future__ import annotations

import logging
import os
import posixpath
import re
import shutil
import tempfile
from pathlib import Path

from mkdocs.plugins import event_priority
from mkdocs.structure.files import File

log = logging.getLogger("mkdocs.hooks.gradalg")

NOTEBOOK_FOLDERS = ("notebooks", "tutorials")
EXECUTED_DEFAULT = Path("docs") / "executed"
KATEX_DIR = Path("gradalg") / "report" / "katex"      # vendored KaTeX, served as assets/katex/
KATEX_SITE = "assets/katex"
_LINK = re.compile(r"(\]\()([^)\s#]+)(#[^)\s]*)?(\))")

_state: dict = {}


def repo_root(config) -> Path:
    return Path(config.config_file_path).resolve().parent


def executed_dir(config) -> Path:
    env = os.environ.get("GRADALG_DOCS_EXECUTED")
    return Path(env).resolve() if env else repo_root(config) / EXECUTED_DEFAULT


def source_notebooks(root: Path) -> list[str]:
    """Repository-relative paths of the notebooks the site renders."""
    return sorted(f"{folder}/{p.name}" for folder in NOTEBOOK_FOLDERS for p in (root / folder).glob("*.ipynb"))


def _nav_paths(nav) -> list[str]:
    out = []
    for item in nav or []:
        value = next(iter(item.values())) if isinstance(item, dict) else item
        if isinstance(value, list):
            out += _nav_paths(value)
        elif isinstance(value, str) and "://" not in value:
            out.append(value)
    return out


def _drop_missing(nav, exists) -> list:
    kept = []
    for item in nav:
        title, value = next(iter(item.items())) if isinstance(item, dict) else (None, item)
        if isinstance(value, list):
            value = _drop_missing(value, exists)
            if value:
                kept.append({title: value})
        elif isinstance(value, str) and "://" not in value and not exists(value):
            log.info("nav entry %r (%s) left out: the page does not exist", title, value)
        else:
            kept.append(item)
    return kept


def on_config(config):
    root = repo_root(config)
    docs = Path(config.docs_dir)
    notebooks = set(source_notebooks(root))

    def exists(path):
        return (docs / path).is_file() or path in notebooks

    config.nav = _drop_missing(config.nav or [], exists)
    listed = set(_nav_paths(config.nav))
    pages = sorted(p.relative_to(docs).as_posix() for p in docs.rglob("*.md") if "tooling" not in p.parts)
    unlisted = [p for p in pages if p not in listed]
    if unlisted:
        log.info("pages not in the nav of mkdocs.yml, appended under 'More': %s", ", ".join(unlisted))
        config.nav.append({"More": unlisted})
    return config


def _graft(source: Path, executed: Path):
    """The notebook at ``source`` with the outputs of ``executed`` when their code cells
    agree; and a word on what was done."""
    import nbformat

    nb = nbformat.read(source, as_version=4)
    if not executed.is_file():
        return nb, "no executed copy"
    ran = nbformat.read(executed, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    ran_code = [c for c in ran.cells if c.cell_type == "code"]
    if [c.source for c in code] != [c.source for c in ran_code]:
        return nb, "its code changed since it was executed"
    for cell, done in zip(code, ran_code):
        cell.outputs = done.get("outputs", [])
        cell.execution_count = done.get("execution_count")
    if "widgets" in ran.metadata:          # saved widget state, for the live views
        nb.metadata["widgets"] = ran.metadata["widgets"]
    return nb, None


def _rewrite_links(text: str, here: str, targets: dict[str, str]) -> str:
    """Markdown ``text`` of a page whose repository path is ``here`` with every relative
    link that resolves (from the repository) to a key of ``targets`` pointed at that
    target's site path, relative to the page's own site path ``targets[here]``."""
    page_dir = posixpath.dirname(targets.get(here, here))

    def fix(m):
        link = m.group(2)
        if "://" in link or link.startswith(("/", "mailto:")):
            return m.group(0)
        resolved = posixpath.normpath(posixpath.join(posixpath.dirname(here), link))
        if resolved not in targets:
            return m.group(0)
        new = posixpath.relpath(targets[resolved], page_dir or ".")
        return f"{m.group(1)}{new}{m.group(3) or ''}{m.group(4)}"
    return _LINK.sub(fix, text)


def _site_paths(config, files, *, urls: bool = False) -> dict[str, str]:
    """Repository path -> site source path (what Markdown pages link to), or with
    ``urls`` the page's URL (what rendered notebooks, plain HTML, must link to)."""
    root = repo_root(config)
    docs_rel = Path(config.docs_dir).resolve().relative_to(root).as_posix()
    out = {f"{docs_rel}/{f.src_uri}": f.src_uri for f in files if f.src_uri.endswith(".md")}
    out.update({nb: nb for nb in source_notebooks(root)})
    if urls:
        def url(path):
            stem = posixpath.splitext(path)[0]
            if not config.use_directory_urls:
                return stem + ".html"
            return stem[: -len("index")] if posixpath.basename(stem) == "index" else stem + "/"
        out = {k: url(v) for k, v in out.items()}
    return out


@event_priority(50)   # before mkdocs-jupyter turns .ipynb files into pages
def on_files(files, config):
    import nbformat

    root = repo_root(config)
    tmp = Path(tempfile.mkdtemp(prefix="gradalg-docs-notebooks-"))
    _state["tmp"] = tmp
    targets = _site_paths(config, files, urls=True)
    ran_dir = executed_dir(config)
    for rel in source_notebooks(root):
        nb, missing = _graft(root / rel, ran_dir / rel)
        if missing:
            log.info("%s rendered without outputs (%s in %s): `make docs-notebooks` executes it",
                     rel, missing, ran_dir)
        for cell in nb.cells:
            if cell.cell_type == "markdown":
                cell.source = _rewrite_links(cell.source, rel, targets)
        out = tmp / rel
        out.parent.mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, out)
        files.append(File(rel, src_dir=str(tmp), dest_dir=config.site_dir,
                          use_directory_urls=config.use_directory_urls))
    for path in sorted((root / KATEX_DIR).rglob("*")):
        if path.is_file() and path.suffix in (".js", ".css", ".woff2", "") and "__pycache__" not in path.parts:
            rel = f"{KATEX_SITE}/{path.relative_to(root / KATEX_DIR).as_posix()}"
            files.append(File.generated(config, rel, abs_src_path=str(path)))
    return files


def on_page_markdown(markdown, page, config, files):
    root = repo_root(config)
    docs_rel = Path(config.docs_dir).resolve().relative_to(root).as_posix()
    return _rewrite_links(markdown, f"{docs_rel}/{page.file.src_uri}", _site_paths(config, files))


_MATHJAX = re.compile(r"<!-- Load mathjax -->.*?<!-- End of mathjax configuration -->", re.S)


def on_post_page(output, page, config):
    """Drop the MathJax loader nbconvert writes into notebook pages (an empty ``src`` and
    its configuration): KaTeX typesets the math instead."""
    return _MATHJAX.sub("", output)


def on_post_build(config):
    tmp = _state.pop("tmp", None)
    if tmp is not None:
        shutil.rmtree(tmp, ignore_errors=True)
