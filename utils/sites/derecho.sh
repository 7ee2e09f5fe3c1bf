# shellcheck shell=bash disable=SC2034  # SITE_* are read by config_env.sh, which sources this file
# Site profile "derecho": NCAR Derecho (HPE Cray EX, Slingshot 11, 4x A100-40GB per GPU node, PBS Pro).
# The names this file must define are listed in utils/sites/generic.sh.

# shellcheck source=utils/lib/slingshot.sh
source "$(dirname "${BASH_SOURCE[0]}")/../lib/slingshot.sh"

site_matches() {
  [[ "${NCAR_HOST:-}" == derecho ]] && return 0
  case "$(hostname 2>/dev/null)" in derecho* | dec[0-9]* | deg[0-9]*) return 0 ;; esac
  return 1
}

SITE_DESCRIPTION="NCAR Derecho: gcc 12 + cray-mpich 8 + CUDA 12.2, A100 (sm_80), Slingshot/CXI libfabric, PBS Pro (qcmd)"
# Cray PE modules; ncarcompilers lets plain gcc/mpicc find the module headers and libraries.
# CUDA_MODULE picks another CUDA module (PyTorch 2.7 and later were released for CUDA 12.6 or 12.8).
SITE_MODULES=(ncarenv/23.09 gcc/12.2.0 ncarcompilers cray-mpich/8.1.27 "${CUDA_MODULE:-cuda/12.2.1}" cudnn/9.2.0.82-12
              mkl/2024.0.0 conda/latest)
SITE_MODULE_PURGE=1
SITE_ENV_KIND="conda"
SITE_SCHEDULER=pbs
SITE_SUBMIT="qcmd"
# No default account: every Derecho job must name its project code (PBS_ACCOUNT=XXXX0000).
SITE_PBS_ACCOUNT=""
SITE_PBS_ACCOUNT_REQUIRED=1
SITE_PBS_QUEUE=main
# Builds run on one GPU node (64 cores, 4 A100s) so the CUDA kernels compile on the target hardware.
SITE_PBS_SELECT_BUILD="1:ncpus=64:mpiprocs=1:ngpus=4"
SITE_PBS_WALLTIME_BUILD="04:00:00"
SITE_PBS_SELECT_TEST="2:ncpus=64:mpiprocs=4:ngpus=4"
SITE_PBS_WALLTIME_TEST="00:20:00"
SITE_PBS_EXTRA="-l job_priority=regular"
SITE_GPUS_PER_NODE=4

site_configure() {
  SITE_CC=$(command -v gcc || true)
  SITE_CXX=$(command -v g++ || true)
  SITE_MPICC=${MPICC:-$(command -v mpicc || true)}
  SITE_MPICXX=${MPICXX:-$(command -v mpicxx || true)}
  # NCAR modules export NCAR_ROOT_<PACKAGE>; fall back to CUDA_HOME when run outside the module system.
  SITE_CUDA_HOME=${NCAR_ROOT_CUDA:-${CUDA_HOME:-}}
  SITE_CUDNN_ROOT=${NCAR_ROOT_CUDNN:-${CUDNN_ROOT:-}}
  SITE_TORCH_CUDA_ARCH_LIST="8.0"
  SITE_LIBFABRIC_ROOT=/opt/cray/libfabric/1.15.2.0
  SITE_GDRCOPY_ROOT=/usr
  SITE_BLAS=MKL
  SITE_MAX_JOBS=64
  # With MPICH_GPU_SUPPORT_ENABLED=1 Cray MPICH aborts in MPI_Init unless the GPU transport layer (GTL) is
  # linked into the program; python is not, so link it into libtorch (and mpi4py) here, kept with
  # --no-as-needed because nothing references its symbols directly.
  local gtl="${CRAY_MPICH_ROOTDIR:-/opt/cray/pe/mpich/8.1.27}/gtl/lib"
  if [[ -e "$gtl/libmpi_gtl_cuda.so" ]]; then
    TORCHHPC_GTL_LDFLAGS="-L$gtl -Wl,-rpath,$gtl -Wl,--no-as-needed -lmpi_gtl_cuda -Wl,--as-needed"
    case " ${LDFLAGS:-} " in *" -lmpi_gtl_cuda "*) ;; *) export LDFLAGS="${LDFLAGS:+$LDFLAGS }$TORCHHPC_GTL_LDFLAGS" ;; esac
  fi
  # gcc 12 warns (as errors in some third_party targets) on code PyTorch does not own.
  local quiet="-Wno-maybe-uninitialized -Wno-uninitialized -Wno-nonnull"
  case " ${CFLAGS:-} " in *" $quiet "*) ;; *) export CFLAGS="${CFLAGS:+$CFLAGS }$quiet" ;; esac
  case " ${CXXFLAGS:-} " in *" $quiet "*) ;; *) export CXXFLAGS="${CXXFLAGS:+$CXXFLAGS }$quiet" ;; esac
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
