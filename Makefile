# `make test` and `make train` set themselves up: they create .venv and install on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: test test-slow test-gpu venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

# Default suite: CPU only, 8 fake devices, excludes tests marked slow or gpu.
test: $(STAMP)
	$(PY) -m pytest -n 2 -m "not slow and not gpu" $(PYTEST_ARGS)

test-slow: $(STAMP)
	$(PY) -m pytest -n 2 -m "slow" $(PYTEST_ARGS)

# On a GPU machine (install with the gpu extra: pip install -e '.[test,gpu]').
test-gpu: $(STAMP)
	$(PY) -m pytest -m "gpu" $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache *.egg-info
