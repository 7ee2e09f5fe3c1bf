# shellcheck shell=bash
# The runtime settings every HPE Slingshot site with Cray MPICH needs for GPU-aware MPI and NCCL over libfabric's
# CXI provider, written once for the profiles of such sites (derecho, polaris, perlmutter), whose
# site_runtime_env prints these lines and then its own.  Expanded when the activation hook is written.

site_slingshot_env() {
  cat <<HOOK
# Cray MPICH: accept CUDA device buffers (GPU-aware MPI). The patched ProcessGroupMPI asks MPICH for this.
export MPICH_GPU_SUPPORT_ENABLED=1
# libfabric: memory-registration cache monitor; NCCL can deadlock with the default (memhooks) per HPE.
export FI_MR_CACHE_MONITOR=userfaultfd
# libfabric CXI: stop the provider registering host memory through CUDA calls (another NCCL deadlock).
export FI_CXI_DISABLE_HOST_REGISTER=1
# libfabric CXI: completion queue sized for large jobs (provider default 1024; HPE recommends 131072).
export FI_CXI_DEFAULT_CQ_SIZE=131072
# NCCL: use the AWS OFI plugin over libfabric and fail loudly if it cannot load, instead of silently
# falling back to TCP sockets (which is how NCCL performance collapses on Slingshot).
export NCCL_NET="AWS Libfabric"
# NCCL: allow a ring to leave a node on a different NIC than it entered (better on 4-NIC nodes).
export NCCL_CROSS_NIC=1
# NCCL: GPUDirect RDMA whenever GPU and NIC share a PCIe host bridge.
export NCCL_NET_GDR_LEVEL=PHB
# NCCL: warnings and errors only (INFO shows the chosen transport, e.g. "NET/AWS Libfabric").
export NCCL_DEBUG=WARN
# Our NCCL and its plugin (libnccl-net.so) first, before the copies other modules put on the path.
export LD_LIBRARY_PATH="${NCCL_OFI_PREFIX}/lib:${NCCL_OFI_PREFIX}/plugin/lib\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
HOOK
}
