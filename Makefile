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

# `make test-engines`: the tests that drive real engines' schedulers through our
# adapters (tests/integrations/), in their own environment: vLLM 0.32 from PyPI
# (about 6 GB; the CPU torch pin first, then vLLM, whose torchvision/torchaudio/
# torchcodec do not load against the CPU torch and are removed). Built once,
# like .venv; VLLM_VENV=/path reuses an environment built elsewhere.
VLLM_VENV ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

.PHONY: test-engines

$(VLLM_STAMP): pyproject.toml
	$(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet torch==2.13.0
	$(VLLM_VENV)/bin/pip install --quiet "vllm<0.33"
	$(VLLM_VENV)/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/pip install --quiet -e '.[test]'
	touch $(VLLM_STAMP)

test-engines: $(VLLM_STAMP)
	$(VLLM_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/integrations
