# Two entry points: `make demo` (the main job) and `make test`.
# Both build .venv from scratch if needed, installing the CPU torch pin first
# so the `reference` extra's torch range is already satisfied (a bare torch
# requirement would pull the CUDA build).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test bench venv clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[reference,test]'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m atom_kv.demo

test: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider tests

clean:
	rm -rf $(VENV)
