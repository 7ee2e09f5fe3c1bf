# shellcheck shell=bash
# Cluster build environment for torchhpc.  SOURCE it (bash), do not run it:
#
#   [SITE=derecho] [PYTORCH_VERSION=2.5.1] source config_env.sh
#
# 1. picks the site profile: $SITE, else the site of a previous source ($TORCHHPC_SITE), else the first
#    utils/sites/*.sh whose site_matches succeeds, else utils/sites/generic.sh;
# 2. loads the site's modules and asks the profile for compilers, CUDA/cuDNN, GPU architectures, libfabric;
# 3. exports the PyTorch source-build variables (USE_MPI, USE_CUDA, USE_CUDNN, USE_SYSTEM_NCCL + NCCL_ROOT/
#    NCCL_LIB_DIR/NCCL_INCLUDE_DIR, USE_DISTRIBUTED, MAX_JOBS, CMAKE_PREFIX_PATH, BLAS, TORCH_CUDA_ARCH_LIST,
#    PYTORCH_BUILD_VERSION=X.Y.Z+torchhpc.<site>) and the scheduler defaults (TORCHHPC_SCHEDULER,
#    TORCHHPC_PBS_*, TORCHHPC_SLURM_*, TORCHHPC_LAUNCHER);
# 4. creates (once) and activates the build environment, conda where the site has it, venv otherwise,
#    with an activation hook that exports the site's runtime settings (see utils/write_activation_hook.sh).
#
# Knobs: SITE, PYTORCH_VERSION (default: newest in utils/pytorch_versions.tsv), TORCHHPC_PREFIX (build/),
# ENV_KIND (conda|venv), TORCHHPC_ENV_PREFIX_OVERRIDE, NCCL_OFI_PREFIX_OVERRIDE, NCCL_VERSION_OVERRIDE,
# TORCH_CUDA_ARCH_LIST_OVERRIDE,
# MAX_JOBS, SCHEDULER (pbs|slurm|auto), PBS_ACCOUNT/PBS_QUEUE/PBS_SELECT_BUILD/..., SLURM_ACCOUNT/
# SLURM_PARTITION/SLURM_NODES_TEST/SLURM_TIME_BUILD/..., LAUNCHER, SRUN_MPI (override the site's defaults),
# TORCHHPC_NO_MODULES=1 (skip module loads), TORCHHPC_NO_ENV=1 (do not create/activate the environment),
# TORCHHPC_CREATE_ENV=1|0 (create a missing environment even inside a batch job | never; default: only outside
# one), TORCHHPC_QUIET=1 (no summary).
#
# Safe to source again (re-selects, re-loads, re-activates; nothing is duplicated) and it never changes
# the caller's shell options: errors are reported and `return`ed, never `exit`ed.

if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
  echo "config_env.sh sets variables in your shell, so it must be sourced: source $0" >&2
  exit 2
fi

_torchhpc_say() { [[ "${TORCHHPC_QUIET:-0}" == 1 ]] || printf 'config_env: %s\n' "$*" >&2; }
_torchhpc_err() { printf 'config_env: error: %s\n' "$*" >&2; }

# Leave the environment this file activated before (so re-sourcing starts from the caller's state).
_torchhpc_leave_env() {
  if [[ -n "${TORCHHPC_ENV_PREFIX:-}" && "${VIRTUAL_ENV:-}" == "$TORCHHPC_ENV_PREFIX" ]] \
     && declare -F deactivate >/dev/null; then
    deactivate
  elif [[ -n "${TORCHHPC_ENV_PREFIX:-}" && "${CONDA_PREFIX:-}" == "$TORCHHPC_ENV_PREFIX" ]] \
     && declare -F conda >/dev/null; then
    conda deactivate
  fi
}

_torchhpc_load_modules() {
  ((${#SITE_MODULES[@]})) || return 0
  if [[ "${TORCHHPC_NO_MODULES:-0}" == 1 ]]; then
    _torchhpc_say "TORCHHPC_NO_MODULES=1: not loading ${SITE_MODULES[*]}"
    return 0
  fi
  if ! type module >/dev/null 2>&1; then
    _torchhpc_say "warning: no 'module' command here; not loading ${SITE_MODULES[*]}"
    return 0
  fi
  if [[ "${SITE_MODULE_PURGE:-0}" == 1 ]]; then
    module --force purge || { _torchhpc_err "module --force purge failed"; return 1; }
  fi
  module load "${SITE_MODULES[@]}" || { _torchhpc_err "module load ${SITE_MODULES[*]} failed"; return 1; }
}

_torchhpc_create_env() {
  local prefix=$1 kind=$2 python_version=$3 py cand
  if [[ "$kind" == conda ]]; then
    if ! declare -F conda >/dev/null; then
      command -v conda >/dev/null || { _torchhpc_err "SITE_ENV_KIND=conda but no conda command"; return 1; }
      eval "$(conda shell.bash hook)" || { _torchhpc_err "conda shell.bash hook failed"; return 1; }
    fi
    if [[ ! -x "$prefix/bin/python" ]]; then
      _torchhpc_say "creating conda environment $prefix (python $python_version)"
      conda create --yes --quiet --prefix "$prefix" --override-channels -c conda-forge \
        "python=$python_version" pip cmake ninja ccache pkg-config \
        || { _torchhpc_err "conda create --prefix $prefix failed"; return 1; }
    fi
  else
    if [[ ! -x "$prefix/bin/python" ]]; then
      # the first that runs: a pyenv shim can name a version that is installed but not enabled
      py=""
      for cand in "python$python_version" python3; do
        cand=$(command -v "$cand") && "$cand" -c 'import venv' >/dev/null 2>&1 && { py=$cand; break; }
      done
      [[ -n "$py" ]] || { _torchhpc_err "no python$python_version or python3 (with venv) to create the venv"; return 1; }
      _torchhpc_say "creating venv $prefix with $py"
      # shellcheck disable=SC2086  # TORCHHPC_VENV_ARGS is a list of options
      "$py" -m venv ${TORCHHPC_VENV_ARGS:-} "$prefix" || { _torchhpc_err "python -m venv $prefix failed"; return 1; }
    fi
  fi
  if [[ "${TORCHHPC_QUIET:-0}" == 1 ]]; then
    bash "$TORCHHPC_ROOT/utils/write_activation_hook.sh" "$kind" "$prefix" >/dev/null
  else
    bash "$TORCHHPC_ROOT/utils/write_activation_hook.sh" "$kind" "$prefix" >&2
  fi || { _torchhpc_err "writing the activation hook into $prefix failed"; return 1; }
}

_torchhpc_activate_env() {
  local prefix=$1 kind=$2
  if [[ "$kind" == conda ]]; then
    conda activate "$prefix" || { _torchhpc_err "conda activate $prefix failed"; return 1; }
  else
    # shellcheck disable=SC1091  # the venv's own activate script
    source "$prefix/bin/activate" || { _torchhpc_err "activating $prefix failed"; return 1; }
  fi
}

_torchhpc_config_env() {
  local root site profile name f version cuda_ok=0 cudnn_ok=0
  root=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd) || return 1
  export TORCHHPC_ROOT=$root

  _torchhpc_leave_env
  unset -f site_matches site_configure site_runtime_env site_slingshot_env 2>/dev/null
  unset "${!SITE_@}"

  # --- 1. site profile -----------------------------------------------------------------------------
  site=${SITE:-${TORCHHPC_SITE:-}}
  if [[ -z "$site" ]]; then
    site=generic
    for f in "$root"/utils/sites/*.sh; do
      name=$(basename "$f" .sh)
      [[ "$name" == generic ]] && continue
      # shellcheck disable=SC1090  # each profile in turn
      if (source "$f" && site_matches) >/dev/null 2>&1; then site=$name; break; fi
    done
  fi
  profile="$root/utils/sites/$site.sh"
  if [[ ! -f "$profile" ]]; then
    local available=()
    for f in "$root"/utils/sites/*.sh; do available+=("$(basename "$f" .sh)"); done
    _torchhpc_err "no site profile '$site' (utils/sites/$site.sh); available: ${available[*]}"
    return 1
  fi
  # shellcheck source=utils/sites/generic.sh
  source "$profile" || { _torchhpc_err "sourcing $profile failed"; return 1; }
  export TORCHHPC_SITE=$site TORCHHPC_SITE_PROFILE=$profile
  _torchhpc_say "site '$site': $SITE_DESCRIPTION"

  # --- 2. modules, then what the profile derives from them ----------------------------------------
  _torchhpc_load_modules || return 1
  site_configure || { _torchhpc_err "site_configure of $profile failed"; return 1; }

  # --- 3. PyTorch version and build variables ----------------------------------------------------
  version=${PYTORCH_VERSION:-$("$root/utils/pytorch_version.sh" --latest)}
  version=${version#v}
  TORCHVISION_VERSION=$("$root/utils/pytorch_version.sh" "$version" torchvision) || return 1
  export PYTORCH_VERSION=$version TORCHVISION_VERSION
  TORCHHPC_PYTHON_VERSION=$("$root/utils/pytorch_version.sh" "$version" python) || return 1
  NCCL_VERSION=${NCCL_VERSION_OVERRIDE:-$("$root/utils/pytorch_version.sh" "$version" nccl)} || return 1
  TORCHHPC_PATCH_DIR="$root/patches/pytorch/$("$root/utils/pytorch_version.sh" "$version" patches)" || return 1
  export TORCHHPC_PYTHON_VERSION NCCL_VERSION TORCHHPC_PATCH_DIR

  export TORCHHPC_PREFIX=${TORCHHPC_PREFIX:-$root/build}
  export TORCHHPC_ENV_KIND=${ENV_KIND:-$SITE_ENV_KIND}
  export TORCHHPC_ENV_PREFIX=${TORCHHPC_ENV_PREFIX_OVERRIDE:-$TORCHHPC_PREFIX/envs/torch-$version-$site}
  export NCCL_OFI_PREFIX=${NCCL_OFI_PREFIX_OVERRIDE:-$TORCHHPC_PREFIX/opt/nccl-$NCCL_VERSION-ofi-$site}
  export TORCHHPC_LIBFABRIC_ROOT=$SITE_LIBFABRIC_ROOT TORCHHPC_GDRCOPY_ROOT=$SITE_GDRCOPY_ROOT

  [[ -n "$SITE_CC" ]] && export CC=$SITE_CC
  [[ -n "$SITE_CXX" ]] && export CXX=$SITE_CXX
  [[ -n "$SITE_MPICC" ]] && export MPICC=$SITE_MPICC
  [[ -n "$SITE_MPICXX" ]] && export MPICXX=$SITE_MPICXX
  [[ -n "$SITE_CUDA_HOME" && -d "$SITE_CUDA_HOME" ]] && cuda_ok=1
  [[ -n "$SITE_CUDNN_ROOT" && -d "$SITE_CUDNN_ROOT" ]] && cudnn_ok=$cuda_ok
  if ((cuda_ok)); then
    export CUDA_HOME=$SITE_CUDA_HOME CUDA_PATH=$SITE_CUDA_HOME
  else
    _torchhpc_say "warning: no CUDA toolkit found (CUDA_HOME unset, no nvcc): USE_CUDA=0"
  fi
  if ((cudnn_ok)); then
    export CUDNN_ROOT=$SITE_CUDNN_ROOT CUDNN_LIB_DIR=$SITE_CUDNN_ROOT/lib CUDNN_INCLUDE_DIR=$SITE_CUDNN_ROOT/include
  fi
  export USE_CUDA=$cuda_ok USE_CUDNN=$cudnn_ok USE_NCCL=$cuda_ok USE_SYSTEM_NCCL=$cuda_ok
  export FORCE_CUDA=$cuda_ok   # torchvision: build its CUDA ops even where no GPU is visible (login node)
  export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST_OVERRIDE:-$SITE_TORCH_CUDA_ARCH_LIST}
  export NCCL_ROOT=$NCCL_OFI_PREFIX NCCL_LIB_DIR=$NCCL_OFI_PREFIX/lib NCCL_INCLUDE_DIR=$NCCL_OFI_PREFIX/include
  export USE_MPI=1 USE_DISTRIBUTED=1 USE_GLOO=1 BUILD_TEST=0
  export MAX_JOBS=${MAX_JOBS:-$SITE_MAX_JOBS}
  export BLAS=$SITE_BLAS
  case ":${CMAKE_PREFIX_PATH:-}:" in
    *":$TORCHHPC_ENV_PREFIX:"*) ;;
    *) export CMAKE_PREFIX_PATH="$TORCHHPC_ENV_PREFIX${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}" ;;
  esac
  export PYTORCH_BUILD_VERSION="$version+torchhpc.$site" PYTORCH_BUILD_NUMBER=1
  export BUILD_VERSION="$TORCHVISION_VERSION+torchhpc.$site"   # read by torchvision's setup.py

  # Scheduler defaults, each overridable by the PBS_* variable of the same name.
  export TORCHHPC_SUBMIT=${PBS_SUBMIT:-$SITE_SUBMIT}
  export TORCHHPC_PBS_ACCOUNT=${PBS_ACCOUNT:-$SITE_PBS_ACCOUNT}
  export TORCHHPC_PBS_ACCOUNT_REQUIRED=$SITE_PBS_ACCOUNT_REQUIRED
  export TORCHHPC_PBS_QUEUE=${PBS_QUEUE:-$SITE_PBS_QUEUE}
  export TORCHHPC_PBS_SELECT_BUILD=${PBS_SELECT_BUILD:-$SITE_PBS_SELECT_BUILD}
  export TORCHHPC_PBS_WALLTIME_BUILD=${PBS_WALLTIME_BUILD:-$SITE_PBS_WALLTIME_BUILD}
  export TORCHHPC_PBS_SELECT_TEST=${PBS_SELECT_TEST:-$SITE_PBS_SELECT_TEST}
  export TORCHHPC_PBS_WALLTIME_TEST=${PBS_WALLTIME_TEST:-$SITE_PBS_WALLTIME_TEST}
  export TORCHHPC_PBS_EXTRA=${PBS_EXTRA-$SITE_PBS_EXTRA}
  export TORCHHPC_GPUS_PER_NODE=${GPUS_PER_NODE:-$SITE_GPUS_PER_NODE}
  # 1: a user's job without --gpus asks the scheduler whether its nodes have GPUs (a profile for any cluster)
  export TORCHHPC_DETECT_GPUS=${SITE_DETECT_GPUS:-0}
  # Which batch scheduler: SCHEDULER, else the profile's; "auto" looks for sbatch, then qsub, on PATH.
  TORCHHPC_SCHEDULER=${SCHEDULER:-${SITE_SCHEDULER:-auto}}
  if [[ "$TORCHHPC_SCHEDULER" == auto ]]; then
    if command -v sbatch >/dev/null 2>&1; then TORCHHPC_SCHEDULER=slurm
    elif command -v qsub >/dev/null 2>&1 || command -v qcmd >/dev/null 2>&1; then TORCHHPC_SCHEDULER=pbs
    else TORCHHPC_SCHEDULER=none; fi
  fi
  export TORCHHPC_SCHEDULER
  # Slurm defaults, each overridable by the SLURM_* variable of the same name.
  export TORCHHPC_SLURM_ACCOUNT=${SLURM_ACCOUNT:-${SITE_SLURM_ACCOUNT:-}}
  export TORCHHPC_SLURM_ACCOUNT_REQUIRED=${SITE_SLURM_ACCOUNT_REQUIRED:-0}
  export TORCHHPC_SLURM_PARTITION=${SLURM_PARTITION:-${SITE_SLURM_PARTITION:-}}
  export TORCHHPC_SLURM_NODES_BUILD=${SLURM_NODES_BUILD:-${SITE_SLURM_NODES_BUILD:-1}}
  export TORCHHPC_SLURM_CPUS_BUILD=${SLURM_CPUS_BUILD:-${SITE_SLURM_CPUS_BUILD:-32}}
  export TORCHHPC_SLURM_GPUS_BUILD=${SLURM_GPUS_BUILD:-${SITE_SLURM_GPUS_BUILD:-0}}
  export TORCHHPC_SLURM_TIME_BUILD=${SLURM_TIME_BUILD:-${SITE_SLURM_TIME_BUILD:-04:00:00}}
  export TORCHHPC_SLURM_NODES_TEST=${SLURM_NODES_TEST:-${SITE_SLURM_NODES_TEST:-2}}
  export TORCHHPC_SLURM_CPUS_TEST=${SLURM_CPUS_TEST:-${SITE_SLURM_CPUS_TEST:-8}}
  export TORCHHPC_SLURM_GPUS_TEST=${SLURM_GPUS_TEST:-${SITE_SLURM_GPUS_TEST:-$TORCHHPC_GPUS_PER_NODE}}
  export TORCHHPC_SLURM_TIME_TEST=${SLURM_TIME_TEST:-${SITE_SLURM_TIME_TEST:-00:15:00}}
  export TORCHHPC_SLURM_EXTRA=${SLURM_EXTRA-${SITE_SLURM_EXTRA:-}}
  # How test jobs start ranks: mpiexec inside the allocation, or srun with the MPI plugin SRUN_MPI.
  export TORCHHPC_LAUNCHER=${LAUNCHER:-${SITE_LAUNCHER:-mpiexec}}
  export TORCHHPC_SRUN_MPI=${SRUN_MPI:-${SITE_SRUN_MPI:-pmix}}
  export TORCHHPC_SITE_MODULES="${SITE_MODULES[*]}"

  # --- 4. build environment ----------------------------------------------------------------------
  # Created where a person or a build asks for it (sourced outside a batch job, or TORCHHPC_CREATE_ENV=1 from the
  # build and install steps); a job that finds none stops here rather than run in an empty one.
  if [[ "${TORCHHPC_NO_ENV:-0}" == 1 ]]; then
    _torchhpc_say "TORCHHPC_NO_ENV=1: environment $TORCHHPC_ENV_PREFIX not created/activated"
  elif [[ ! -x "$TORCHHPC_ENV_PREFIX/bin/python" && "${TORCHHPC_CREATE_ENV:-}" != 1 \
          && ( -n "${SLURM_JOB_ID:-}" || -n "${PBS_JOBID:-}" || "${TORCHHPC_CREATE_ENV:-}" == 0 ) ]]; then
    _torchhpc_err "no environment at $TORCHHPC_ENV_PREFIX: build it first (make build-pytorch-v$PYTORCH_VERSION-pbs" \
      "or -slurm, then make install-packages), or run the job in your own: torchhpc jobscript --env current"
    return 1
  else
    mkdir -p "$(dirname "$TORCHHPC_ENV_PREFIX")" || return 1
    _torchhpc_create_env "$TORCHHPC_ENV_PREFIX" "$TORCHHPC_ENV_KIND" "$TORCHHPC_PYTHON_VERSION" || return 1
    _torchhpc_activate_env "$TORCHHPC_ENV_PREFIX" "$TORCHHPC_ENV_KIND" || return 1
    # what the environment holds, as its python says (never the build's targets in its place)
    [[ "${TORCHHPC_QUIET:-0}" == 1 ]] || _torchhpc_say "environment $TORCHHPC_ENV_PREFIX: $(python -c \
      'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda or "none")' 2>/dev/null \
      || echo "no torch installed yet")"
  fi
  _torchhpc_say "build targets: PyTorch $PYTORCH_VERSION (torchvision $TORCHVISION_VERSION) USE_CUDA=$USE_CUDA" \
    "TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST NCCL $NCCL_VERSION into $NCCL_ROOT"
}

_torchhpc_config_env
_torchhpc_rc=$?
unset -f site_matches site_configure site_runtime_env site_slingshot_env _torchhpc_config_env _torchhpc_load_modules \
  _torchhpc_create_env _torchhpc_activate_env _torchhpc_leave_env _torchhpc_say _torchhpc_err
unset "${!SITE_@}"
eval "unset _torchhpc_rc; return $_torchhpc_rc"
