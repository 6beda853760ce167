# Two commands on a fresh machine: `make demo` and `make test`.
# Both bootstrap .venv: torch first (the pinned version, whose CPU build comes from the machine's pip
# configuration; elsewhere TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu", as
# PyPI's torch is the multi-GB CUDA build), then the package with its dev extra.
#   make test-fast   unit tests only (tests/conftest.py marks tests/distributed and tests/integration slow)
#   make test        lint, then the whole suite (CI); the cuda tests are deselected without a GPU
#   make test-gpu    the cuda tests (tests/gpu) on a machine with CUDA; benchmarks/gpu.sh runs them first
PY      := .venv/bin/python
STAMP   := .venv/.moetrain-installed
TORCH   ?= torch==2.13.0

.PHONY: demo test test-fast test-gpu lint venv bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m moetrain.cli demo

lint: $(STAMP)
	$(PY) -m ruff check moetrain tests benchmarks
	$(PY) -m mypy moetrain

test: lint
	$(PY) -m pytest -q tests

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow and not cuda" tests

test-gpu: $(STAMP)
	$(PY) -m pytest -q -m cuda tests/gpu

bench: $(STAMP)
	$(PY) benchmarks/moe_layer.py

clean:
	rm -rf .venv build *.egg-info
