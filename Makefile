# Two commands on a fresh machine: `make demo` and `make test`.
# Both bootstrap .venv: torch first (the pinned CPU wheel; a bare `torch` requirement
# would pull a multi-GB CUDA build), then the package with its dev extra.
PY      := .venv/bin/python
STAMP   := .venv/.moetrain-installed
TORCH   ?= torch==2.13.0

.PHONY: demo test venv bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m moetrain.cli demo

test: $(STAMP)
	$(PY) -m pytest -q tests

bench: $(STAMP)
	$(PY) benchmarks/moe_layer.py

clean:
	rm -rf .venv build *.egg-info
