# On a fresh machine, each command installs what it needs into .venv and runs:
#   make demo        - gradalg[notebook] only; runs the quickstart notebook headless
#   make test        - gradalg[dev] (every extra + pytest); runs the whole test suite
#   make docs        - gradalg[dev]; executes changed notebooks into docs/executed/, builds site/
#                      (FORCE="01_quickstart tutorials/02_..." re-executes only those, FORCE=--all all)
#   make docs-serve  - the same site, served with live reload (http://127.0.0.1:8000)
VENV     ?= .venv
PY       := $(VENV)/bin/python
TORCH    := $(VENV)/.torch-installed
NOTEBOOK := $(VENV)/.gradalg-notebook-installed
DEV      := $(VENV)/.gradalg-dev-installed
OUTDIR   ?= build/quickstart

.PHONY: demo test docs docs-notebooks docs-serve venv clean

venv: $(DEV)

$(TORCH):
	python3 -m venv $(VENV)
	# The CPU build of torch first: an unpinned torch would pull a multi-GB CUDA build.
	$(PY) -m pip install --quiet torch==2.13.0
	touch $@

$(NOTEBOOK): pyproject.toml $(TORCH)
	$(PY) -m pip install --quiet -e '.[notebook]'
	touch $@

$(DEV): pyproject.toml $(TORCH)
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $@

demo: $(NOTEBOOK)
	$(PY) -m gradalg.notebook_runner notebooks/01_quickstart.ipynb --out $(OUTDIR)

test: $(DEV)
	OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 $(PY) -m pytest -n 2 --dist loadfile -q

# docs/executed/<folder>/<name>.ipynb: each notebook with its outputs, committed; the site
# shows them (docs/tooling/hooks.py). Only notebooks whose code changed are executed again,
# unless FORCE names some (stems or <folder>/<file>: only those run) or is --all.
FORCE ?=
docs-notebooks: $(DEV)
	OMP_NUM_THREADS=1 $(PY) docs/tooling/execute_notebooks.py $(if $(filter --all,$(FORCE)),--all,$(if $(FORCE),--force $(FORCE)))

docs: docs-notebooks
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict
	@echo "the site: site/index.html"

docs-serve: docs-notebooks
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs serve

clean:
	rm -rf $(VENV) build site
