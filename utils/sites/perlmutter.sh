# shellcheck shell=bash disable=SC2034  # SITE_* are read by config_env.sh, which sources this file
# Site profile "perlmutter": NERSC Perlmutter GPU nodes (HPE Cray EX, 1 AMD EPYC 7763 (64 cores, 128 hardware
# threads) and 4x A100 per node, 4 Slingshot 11 NICs, Slurm, Cray MPICH).  The names this file must define are
# listed in utils/sites/generic.sh.  From NERSC's public documentation:
#   https://docs.nersc.gov/systems/perlmutter/architecture/          (nodes)
#   https://docs.nersc.gov/jobs/                                      (sbatch, -C gpu, QOS, srun)
#   https://docs.nersc.gov/development/languages/python/using-python-perlmutter/ (mpi4py on cray-mpich)
#   https://docs.nersc.gov/machinelearning/pytorch/                   (NCCL, libfabric)
# Module names and versions change with NERSC's software updates: check them with `module avail` before a build.

# shellcheck source=utils/lib/slingshot.sh
source "$(dirname "${BASH_SOURCE[0]}")/../lib/slingshot.sh"

site_matches() {
  [[ "${NERSC_HOST:-}" == perlmutter ]]
}

SITE_DESCRIPTION="NERSC Perlmutter: PrgEnv-gnu + cray-mpich + cudatoolkit, A100 (sm_80), Slingshot/CXI libfabric, Slurm"
# CUDA_MODULE picks another CUDA (PyTorch >= 2.12 was released for CUDA 12.6 or later: `make cluster-versions`).
SITE_MODULES=(PrgEnv-gnu "${CUDA_MODULE:-cudatoolkit/12.9}" cray-mpich conda)
SITE_MODULE_PURGE=0
SITE_ENV_KIND="conda"
SITE_SCHEDULER=slurm
SITE_SUBMIT="qsub"
# NERSC charges every job to a project (sbatch -A); GPU jobs ask for GPU nodes with -C gpu and a QOS
SITE_SLURM_ACCOUNT=""
SITE_SLURM_ACCOUNT_REQUIRED=1
SITE_SLURM_PARTITION=""
SITE_SLURM_NODES_BUILD=1
SITE_SLURM_CPUS_BUILD=128
SITE_SLURM_GPUS_BUILD=4
SITE_SLURM_TIME_BUILD="04:00:00"
SITE_SLURM_NODES_TEST=2
# one rank per GPU, each with a quarter of the node's 128 hardware threads
SITE_SLURM_CPUS_TEST=32
SITE_SLURM_GPUS_TEST=4
SITE_SLURM_TIME_TEST="00:20:00"
SITE_SLURM_EXTRA="--constraint=gpu --qos=regular"
SITE_GPUS_PER_NODE=4
# srun with Cray's PMI plugin starts cray-mpich's ranks (NERSC's default --mpi on Perlmutter)
SITE_LAUNCHER=srun
SITE_SRUN_MPI=cray_shasta

site_configure() {
  SITE_CC=$(command -v gcc || true)
  SITE_CXX=$(command -v g++ || true)
  # PrgEnv-gnu's compiler wrappers add cray-mpich's headers and libraries
  SITE_MPICC=${MPICC:-$(command -v cc || true)}
  SITE_MPICXX=${MPICXX:-$(command -v CC || true)}
  SITE_CUDA_HOME=${CUDA_HOME:-}
  SITE_CUDNN_ROOT=${CUDNN_ROOT:-$SITE_CUDA_HOME}
  SITE_TORCH_CUDA_ARCH_LIST="8.0"
  SITE_LIBFABRIC_ROOT=$(pkg-config --variable=prefix libfabric 2>/dev/null || echo /opt/cray/libfabric/1.20.1)
  SITE_GDRCOPY_ROOT=/usr
  SITE_BLAS=OpenBLAS
  SITE_MAX_JOBS=64
}

site_runtime_env() {
  site_slingshot_env
  cat <<HOOK
# Cray MPICH: each rank uses the Slingshot NIC nearest to its GPU.
export MPICH_OFI_NIC_POLICY=GPU
# NCCL: bootstrap and socket traffic on the Slingshot interfaces hsn0..hsn3, never the management network.
export NCCL_SOCKET_IFNAME=hsn
HOOK
}
