# Two commands do everything on a fresh machine:
#   make demo   - creates .venv, installs gradalg, runs the quickstart notebook headless
#   make test   - creates .venv, installs gradalg[dev], runs the whole test suite
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.gradalg-installed
OUTDIR ?= build/quickstart

.PHONY: demo test venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	# The CPU build of torch first: an unpinned torch would pull a multi-GB CUDA build.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m gradalg.notebook_runner notebooks/01_quickstart.ipynb --out $(OUTDIR)

test: $(STAMP)
	OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 $(PY) -m pytest -n 2 --dist loadfile -q

clean:
	rm -rf $(VENV) build
