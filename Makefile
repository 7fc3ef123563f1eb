# Set-up, demo, tests and benchmarks. Everything installs into .venv.
# torch is pinned for set-up: 2.13.0 (CPU) installs from local disk here;
# an unpinned torch would pull a multi-GB CUDA build.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH ?= torch==2.13.0
# The oldest and the newest torch tested; each gets its own venv (CUDA builds from the registry, GBs).
TORCH_RANGE ?= 2.0.1 2.6.0 2.15.0

.PHONY: setup demo lint test test-fast test-range bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e '.[test]'
	touch $@

demo: setup
	$(BIN)/python scripts/demo.py

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

test: setup lint
	$(BIN)/python -m pytest -q

# The edit-run cycle: everything but the tests marked slow (real multi-process FSDP runs each session).
test-fast: setup
	$(BIN)/python -m pytest -q -m "not slow"

# tests/test_torch_range.py on each torch of TORCH_RANGE, in .venv-torch<version>.
# RANGE_KEEP=0 removes each venv after its tests, so that one CUDA build at a time is on disk (CI).
RANGE_KEEP ?= 1
test-range:
	for v in $(TORCH_RANGE); do scripts/torch_venv.sh $$v .venv-torch$$v && \
	  .venv-torch$$v/bin/python -m pytest -q tests/test_torch_range.py || exit 1; \
	  [ "$(RANGE_KEEP)" = 1 ] || rm -rf .venv-torch$$v; done

bench: setup
	$(BIN)/pip install -q matplotlib
	$(BIN)/python scripts/bench.py

clean:
	rm -rf demo bench-out
