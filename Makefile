# The two set-up commands of the README: `make demo` and `make test`. Both create .venv and
# install what they need; every install goes through constraints.txt (torch==2.13.0, CPU).
# `make demo` installs only what the demo runs (tokenmill and torch); `make test` every extra
# the suite uses (frameworks, peers for bench, megatron-core, transformers, moto, ...).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
DEMO_STAMP := $(VENV)/.demo-installed
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
# tests/test_integration_torchtitan.py: torchtitan 0.3.0 pins datasets<4.8, which would move datasets,
# fsspec, s3fs and huggingface_hub back for everything; installed without its dependencies, with
# those its data loader, optimizer and checkpointer import (tyro's own two included)
TORCHTITAN := torchtitan==0.3.0 spmd_types==0.2.3 tyro==1.0.17 docstring_parser==0.18.0 typeguard==4.6.1

.PHONY: demo test soak bench clean

$(STAMP): pyproject.toml constraints.txt src/tokenmill/load/fastfill.pyx src/tokenmill/load/fastpack.pyx
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[dev,fast,torch,jax,grain,ray]'
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --no-deps -c constraints.txt $(TORCHTITAN)
	touch $(STAMP)

$(DEMO_STAMP): pyproject.toml constraints.txt src/tokenmill/load/fastfill.pyx src/tokenmill/load/fastpack.pyx
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -c constraints.txt -e . torch
	touch $(DEMO_STAMP)

demo: $(DEMO_STAMP)
	$(BIN)/tokenmill demo

# two xdist workers (-n 2; worksteal: a worker that runs out takes half of another's queue):
# 2 cores, and one test process alone leaves one of them idle most of the time
test: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 --dist worksteal

soak: $(STAMP)
	TOKENMILL_FAULTS_SIZE=soak $(BIN)/python -m pytest -q tests/faults

bench: $(STAMP)
	$(BIN)/python benchmarks/prepare.py

clean:
	rm -rf $(VENV) demo-out bench-data .pytest_cache
