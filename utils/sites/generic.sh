# shellcheck shell=bash disable=SC2034  # SITE_* are read by config_env.sh, which sources this file
# Site profile "generic": any Linux cluster (or workstation) with a CUDA toolkit and an MPI on PATH.
#
# A site profile is sourced by config_env.sh; it only sets SITE_* variables and defines functions, so
# sourcing it has no side effects.  A new site is one new file in utils/sites/ defining the same names:
#
#   site_matches          returns 0 when this machine belongs to the site (used when SITE is not given)
#   SITE_DESCRIPTION      one line shown by config_env.sh and `torchhpc doctor`
#   SITE_MODULES          modules loaded in order (after `module --force purge` when SITE_MODULE_PURGE=1)
#   SITE_ENV_KIND         conda | venv: what kind of build environment config_env.sh creates
#   site_configure        runs after the modules are loaded: sets SITE_CC/CXX/MPICC/MPICXX, SITE_CUDA_HOME,
#                         SITE_CUDNN_ROOT, SITE_TORCH_CUDA_ARCH_LIST, SITE_LIBFABRIC_ROOT, SITE_GDRCOPY_ROOT,
#                         SITE_BLAS, SITE_MAX_JOBS and exports extra build flags the site needs
#   SITE_SUBMIT           qcmd | qsub: how `make *-pbs` submits (qcmd is NCAR's blocking qsub wrapper)
#   SITE_PBS_*            scheduler defaults: ACCOUNT (ACCOUNT_REQUIRED=1: no submission without one), QUEUE, SELECT_BUILD, WALLTIME_BUILD, SELECT_TEST,
#                         WALLTIME_TEST, EXTRA (more qsub arguments); every one overridable as PBS_* variables
#   SITE_SCHEDULER        pbs | slurm | auto (auto: sbatch on PATH means Slurm, else qsub/qcmd means PBS)
#   SITE_SLURM_*          Slurm defaults: ACCOUNT (ACCOUNT_REQUIRED=1: no submission without one), PARTITION,
#                         NODES_BUILD, CPUS_BUILD (per task), GPUS_BUILD (per node), TIME_BUILD, NODES_TEST,
#                         CPUS_TEST, GPUS_TEST, TIME_TEST, EXTRA (more #SBATCH lines, one option each);
#                         every one overridable as SLURM_* variables
#   SITE_LAUNCHER         mpiexec | srun: how `make test-slurm` starts ranks inside the allocation
#   SITE_SRUN_MPI         the srun --mpi plugin when SITE_LAUNCHER=srun (pmix, pmi2, cray_shasta; `srun --mpi=list`)
#   SITE_GPUS_PER_NODE    GPUs (= ranks) per node for test jobs
#   SITE_DETECT_GPUS      1: `torchhpc jobscript` without --gpus asks the scheduler whether the nodes have GPUs
#   site_runtime_env      prints the activation hook body: `export NAME=value` lines, each after a comment
#                         saying why; expanded when the hook is written, so it may use SITE_* and NCCL_OFI_PREFIX

site_matches() { return 0; }

SITE_DESCRIPTION="generic Linux: CUDA and MPI found on PATH, venv build environment"
SITE_MODULES=()
SITE_MODULE_PURGE=0
SITE_ENV_KIND="venv"
SITE_SUBMIT="qsub"
SITE_PBS_ACCOUNT=""
SITE_PBS_ACCOUNT_REQUIRED=0
SITE_PBS_QUEUE="workq"
SITE_PBS_SELECT_BUILD="1:ncpus=32"
SITE_PBS_WALLTIME_BUILD="04:00:00"
SITE_PBS_SELECT_TEST="2:ncpus=32:mpiprocs=4:ngpus=4"  # 8 cores per rank, as SITE_SLURM_CPUS_TEST
SITE_PBS_WALLTIME_TEST="00:15:00"
SITE_PBS_EXTRA=""
SITE_GPUS_PER_NODE=4
# any cluster: a user's job without --gpus asks the scheduler (sinfo's GRES, pbsnodes' ngpus) whether there are GPUs
SITE_DETECT_GPUS=1
SITE_SCHEDULER=auto
SITE_SLURM_ACCOUNT=""
SITE_SLURM_ACCOUNT_REQUIRED=0
SITE_SLURM_PARTITION=""
SITE_SLURM_NODES_BUILD=1
SITE_SLURM_CPUS_BUILD=32
SITE_SLURM_GPUS_BUILD=0
SITE_SLURM_TIME_BUILD="04:00:00"
SITE_SLURM_NODES_TEST=2
SITE_SLURM_CPUS_TEST=8
SITE_SLURM_GPUS_TEST=4
SITE_SLURM_TIME_TEST="00:15:00"
SITE_SLURM_EXTRA=""
# Open MPI's or MPICH's own mpiexec reads the Slurm allocation; `srun --mpi=pmix` needs an MPI built
# against the same PMIx as Slurm (see docs/cluster.md).
SITE_LAUNCHER=mpiexec
SITE_SRUN_MPI=pmix

site_configure() {
  local nvcc mpicc
  SITE_CC=$(command -v gcc || command -v cc || true)
  SITE_CXX=$(command -v g++ || command -v c++ || true)
  mpicc=${MPICC:-$(command -v mpicc || true)}
  SITE_MPICC=$mpicc
  SITE_MPICXX=${MPICXX:-$(command -v mpicxx || command -v mpic++ || true)}
  nvcc=$(command -v nvcc || true)
  if [[ -n "${CUDA_HOME:-}" ]]; then
    SITE_CUDA_HOME=$CUDA_HOME
  elif [[ -n "$nvcc" ]]; then
    nvcc=$(readlink -f "$nvcc")
    SITE_CUDA_HOME=$(cd "$(dirname "$nvcc")/.." && pwd)
  elif [[ -d /usr/local/cuda ]]; then
    SITE_CUDA_HOME=/usr/local/cuda
  else
    SITE_CUDA_HOME=""
  fi
  SITE_CUDNN_ROOT=${CUDNN_ROOT:-$SITE_CUDA_HOME}
  # Compute capability of the GPUs on this node when a driver is present, else Ampere + Hopper.
  SITE_TORCH_CUDA_ARCH_LIST=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null \
                                | sort -u | paste -sd';' - || true)
  SITE_TORCH_CUDA_ARCH_LIST=${SITE_TORCH_CUDA_ARCH_LIST:-8.0;9.0}
  SITE_LIBFABRIC_ROOT=$(pkg-config --variable=prefix libfabric 2>/dev/null || true)
  SITE_LIBFABRIC_ROOT=${SITE_LIBFABRIC_ROOT:-/usr}
  SITE_GDRCOPY_ROOT=/usr
  SITE_BLAS=OpenBLAS
  SITE_MAX_JOBS=$(nproc 2>/dev/null || echo 8)
}

site_runtime_env() {
  cat <<HOOK
# NCCL: find the plugin (libnccl-net.so) and the NCCL that PyTorch was built against before any other copy.
export LD_LIBRARY_PATH="${NCCL_OFI_PREFIX}/lib:${NCCL_OFI_PREFIX}/plugin/lib\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
# NCCL: print warnings and errors only (set INFO to see which transport and plugin were chosen).
export NCCL_DEBUG=WARN
HOOK
}
