# The README's two commands: `make demo` (the main job) and `make test` (the whole suite).
# Both bootstrap everything they need: a virtualenv with the Python dependencies, and Apache
# Kafka's jars through Maven (cached in ~/.cache/switchyard); Java 17 and Maven come with the machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-faults lint install broker clean

demo: $(STAMP)
	$(PY) -m streams.demo $(ARGS)

test: $(STAMP)
	$(PY) -m streams.broker fetch
	$(PY) -m pytest $(ARGS)

# Unused imports and names, undefined names: what a review would catch by eye.
lint: $(STAMP)
	$(PY) -m pyflakes app.py streams replay benchmarks tests

# The fault tests (kill -9 of the router x20, broker restart, 100k-message fuzz, overload, ...):
# ~15 min, skipped by `make test` (docs/reliability.md).
test-faults: $(STAMP)
	$(PY) -m streams.broker fetch
	$(PY) -m pytest -m slow tests/faults $(ARGS)

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test,replay]'
	touch $(STAMP)

broker: $(STAMP)
	$(PY) -m streams.broker run

clean:
	rm -rf $(VENV) var out .pytest_cache
