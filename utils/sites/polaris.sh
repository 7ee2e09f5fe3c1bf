# shellcheck shell=bash disable=SC2034  # SITE_* are read by config_env.sh, which sources this file
# Site profile "polaris": ALCF Polaris (HPE Apollo 6500, 1 AMD EPYC 7543P (32 cores, 64 hardware threads) and
# 4x A100-40GB per node, Slingshot 11, PBS Pro with PALS' mpiexec, Cray MPICH).  The names this file must define
# are listed in utils/sites/generic.sh.  From ALCF's public user guide:
#   https://docs.alcf.anl.gov/polaris/hardware-overview/machine-overview/   (nodes)
#   https://docs.alcf.anl.gov/polaris/running-jobs/                          (queues, select, filesystems, mpiexec)
#   https://docs.alcf.anl.gov/polaris/data-science/frameworks/pytorch/       (NCCL and libfabric settings)
# Module names and versions change with ALCF's software updates: check them with `module avail` before a build.

# shellcheck source=utils/lib/slingshot.sh
source "$(dirname "${BASH_SOURCE[0]}")/../lib/slingshot.sh"

site_matches() {
  case "$(hostname -f 2>/dev/null || hostname)" in polaris-login-* | x3[0-9][0-9][0-9]c0s*) return 0 ;; esac
  [[ "${PBS_O_HOST:-}" == polaris-* ]]
}

SITE_DESCRIPTION="ALCF Polaris: PrgEnv-gnu + cray-mpich + CUDA, A100 (sm_80), Slingshot/CXI libfabric, PBS Pro + PALS"
# CUDA_MODULE picks another CUDA (PyTorch >= 2.12 was released for CUDA 12.6 or later: `make cluster-versions`).
SITE_MODULES=(PrgEnv-gnu "${CUDA_MODULE:-cudatoolkit-standalone/12.6.1}" cray-mpich conda)
SITE_MODULE_PURGE=0
SITE_ENV_KIND="conda"
SITE_SCHEDULER=pbs
SITE_SUBMIT="qsub"
SITE_PBS_ACCOUNT=""
SITE_PBS_ACCOUNT_REQUIRED=1
# preemptable: 1-10 nodes for up to 72 hours, what a build of several hours needs (a demand job may kill it:
# the build resumes from its stamps); PBS_QUEUE=debug (1-2 nodes, 1 hour) starts tests and short jobs sooner
SITE_PBS_QUEUE=preemptable
SITE_PBS_SELECT_BUILD="1:ncpus=64:mpiprocs=1:ngpus=4:system=polaris"
SITE_PBS_WALLTIME_BUILD="04:00:00"
SITE_PBS_SELECT_TEST="2:ncpus=64:mpiprocs=4:ngpus=4:system=polaris"
SITE_PBS_WALLTIME_TEST="00:20:00"
# every job names the file systems it reads (home plus the project's: eagle, grand)
SITE_PBS_EXTRA="-l filesystems=home:eagle"
SITE_GPUS_PER_NODE=4
SITE_LAUNCHER=mpiexec

site_configure() {
  SITE_CC=$(command -v gcc || true)
  SITE_CXX=$(command -v g++ || true)
  # PrgEnv-gnu's compiler wrappers add cray-mpich's headers and libraries
  SITE_MPICC=${MPICC:-$(command -v cc || true)}
  SITE_MPICXX=${MPICXX:-$(command -v CC || true)}
  SITE_CUDA_HOME=${CUDA_HOME:-}
  SITE_CUDNN_ROOT=${CUDNN_ROOT:-$SITE_CUDA_HOME}
  SITE_TORCH_CUDA_ARCH_LIST="8.0"
  SITE_LIBFABRIC_ROOT=$(pkg-config --variable=prefix libfabric 2>/dev/null || echo /opt/cray/libfabric/1.15.2.0)
  SITE_GDRCOPY_ROOT=/usr
  SITE_BLAS=OpenBLAS
  SITE_MAX_JOBS=32
}

site_runtime_env() {
  site_slingshot_env
}
