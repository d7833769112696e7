# `make test` and `make demo` install what they need into .venv first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install test protos demo clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest -q

protos: $(STAMP)
	$(BIN)/python protos/generate.py

demo: $(STAMP)
	$(BIN)/python -m kvcache.demo

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
