# Two commands for a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast lint bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/puf demo

test: $(STAMP)
	$(PY) -m pytest -q tests

# the unit layer: no Prefect flow or server, whole release chain, Dask, PostgreSQL or subprocess run
test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not flow" tests

lint: $(STAMP)
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

bench: $(STAMP)
	$(PY) bench/variance.py

clean:
	rm -rf $(VENV) releases .pytest_cache
