# Two entry points: `make run` and `make test`. Both create .venv on first use.
# TORCH picks the torch build: the default is the CPU wheel; GPU users pass e.g.
#   make run TORCH='torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128'
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
PYTEST_ARGS ?=
# Workers for `make test` (pytest-xdist), one test file per worker at a time: module fixtures are built
# once, and a serial run (TEST_WORKERS=0) keeps every test's wall clock to itself.
TEST_WORKERS ?= 2
BIN := $(VENV)/bin

.PHONY: run test clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# torch first, alone: an unpinned torch pulled in as a dependency would be a multi-GB CUDA build.
$(VENV)/.torch: | $(BIN)/python
	$(BIN)/pip install --disable-pip-version-check $(TORCH)
	touch $@

$(VENV)/.run: pyproject.toml $(VENV)/.torch
	$(BIN)/pip install --disable-pip-version-check -e .
	touch $@

$(VENV)/.test: pyproject.toml $(VENV)/.torch
	$(BIN)/pip install --disable-pip-version-check -e '.[test]'
	touch $@ $(VENV)/.run

run: $(VENV)/.run
	$(BIN)/job train

test: $(VENV)/.test
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) checkpoints .pytest_cache
