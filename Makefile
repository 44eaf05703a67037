# `make demo` and `make test` each create or reuse .venv and install what they need.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-slow lint bench clean browser

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet -c constraints.txt torch==2.13.0
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/diloco demo

# Bytecode first: with PYTHONDONTWRITEBYTECODE set (as on this machine) nothing caches it, and
# each of the suite's ~200 server, worker and CLI processes compiled the package anew (0.4 s).
test: $(STAMP) browser
	$(BIN)/ruff check src tests benchmarks examples
	$(BIN)/python -m compileall -q src
	$(BIN)/python -m pytest

# The dashboard's browser test drives Debian's chromium (no browser download at run time).
browser:
	@command -v chromium >/dev/null || { test "$$(id -u)" = 0 && command -v apt-get >/dev/null \
		&& { apt-get install -y -q chromium >/dev/null 2>&1 \
		|| { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q chromium >/dev/null 2>&1; }; }; } \
		|| echo "chromium is not installed (apt-get install chromium): the dashboard's browser test will be skipped"

# Every real process a fresh interpreter here (tests/zygote.py forks them in `make test`).
test-slow: $(STAMP)
	$(BIN)/python -m compileall -q src
	DILOCO_TESTS_FRESH_PROCESSES=1 $(BIN)/python -m pytest -m slow

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks examples
	$(BIN)/ruff format --check src tests benchmarks examples

bench: $(STAMP)
	$(BIN)/python benchmarks/convergence.py

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .pytest_cache .ruff_cache
