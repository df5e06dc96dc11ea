# `make repro` runs the whole DVC pipeline; `make test` runs the test suite. Each one creates .venv and
# installs the pinned dependencies first when they are missing or out of date.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.composer2-installed
PROFILE ?= default
export PATH := $(CURDIR)/$(BIN):$(PATH)

.PHONY: install test test-fast repro nbcheck export clean-nbs bench report sysdeps

$(STAMP): requirements.lock settings.ini setup.py
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip==26.3 wheel setuptools
	$(BIN)/python -m pip install -q -r requirements.lock
	$(BIN)/python -m pip install -q --no-deps --no-build-isolation -e .
	@touch $(STAMP)

install: $(STAMP) sysdeps

# System packages the harness uses (bubblewrap). Best effort: without apt the sandbox tests skip and say why.
sysdeps:
	@if ! command -v bwrap >/dev/null 2>&1; then \
	  if command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
	    (apt-get update -qq && apt-get install -y -qq bubblewrap >/dev/null) || echo "warning: could not install bubblewrap"; \
	  else echo "warning: bubblewrap missing and apt-get unavailable: sandbox tests will skip"; fi; fi

# The notebooks are the source: exporting and cleaning them must change nothing that is committed.
nbcheck: $(STAMP)
	$(BIN)/nbdev_export
	$(BIN)/nbdev_clean
	@if [ -n "$$(git status --porcelain -- composer2 nbs)" ]; then \
	  git status --porcelain -- composer2 nbs; git --no-pager diff --stat -- composer2 nbs; \
	  echo "error: nbdev_export/nbdev_clean changed committed files: export and clean the notebooks, then commit"; exit 1; fi

test: install nbcheck
	$(BIN)/python -m pytest -q tests
	$(BIN)/nbdev_test --n_workers 2 --timing

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -x tests -m "not slow"

export: $(STAMP)
	$(BIN)/nbdev_export && $(BIN)/nbdev_clean

repro: install
	@if [ "$(PROFILE)" = default ]; then $(BIN)/dvc repro; \
	else $(BIN)/composer2 workspace $(PROFILE) runs/$(PROFILE) && cd runs/$(PROFILE) && $(CURDIR)/$(BIN)/dvc repro; fi

bench: $(STAMP)
	@for f in benchmarks/bench_*.py; do echo "== $$f"; $(BIN)/python $$f || exit 1; done
