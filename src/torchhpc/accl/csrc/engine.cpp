// The MPI engine: one MPI call per segment on host buffers (or device buffers where MPI is CUDA-aware),
// blocking after a header exchange, nonblocking (the request handed back) without one.
#include "accl.hpp"

#include <climits>

#if defined(OPEN_MPI) && __has_include(<mpi-ext.h>)
#include <mpi-ext.h>  // MPIX_CUDA_AWARE_SUPPORT, MPIX_Query_cuda_support
#endif

#include <cstdlib>

namespace torchhpc::accl {

bool cudaAwareMpi() {
#if !defined(MPIX_CUDA_AWARE_SUPPORT) && defined(MPICH_VERSION) && defined(MPIX_GPU_SUPPORT_CUDA)
  int supported = 0;
  return MPIX_GPU_query_support(MPIX_GPU_SUPPORT_CUDA, &supported) == MPI_SUCCESS && supported != 0;
#elif !defined(MPIX_CUDA_AWARE_SUPPORT) && defined(MPICH_VERSION)
  const char* enabled = std::getenv("MPICH_GPU_SUPPORT_ENABLED");
  return enabled != nullptr && std::string(enabled) == "1";
#elif defined(MPIX_CUDA_AWARE_SUPPORT)
  return MPIX_Query_cuda_support() == 1;
#else
  return false;
#endif
}

void Stats::count(int64_t bytes) {
  engineCalls.fetch_add(1, std::memory_order_relaxed);
  int64_t seen = maxCallBytes.load(std::memory_order_relaxed);
  while (bytes > seen && !maxCallBytes.compare_exchange_weak(seen, bytes)) {
  }
}

void MpiEngine::check(int rc, const char* what) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING] = {};
  int len = 0;
  MPI_Error_string(rc, text, &len);
  throw MpiCallError(rc, std::string("accl: MPI error in ") + what + ": " + std::string(text, len));
}

MPI_Request MpiEngine::allreduce(void* buf, int count, const Reduction& r, Mode m) {
  stats_.count(static_cast<int64_t>(count) * static_cast<int64_t>(r.esz));
  MPI_Request req = MPI_REQUEST_NULL;
  if (m == Mode::kBlocking) check(MPI_Allreduce(MPI_IN_PLACE, buf, count, r.type, r.mpiOp, comm_), "MPI_Allreduce");
  else check(MPI_Iallreduce(MPI_IN_PLACE, buf, count, r.type, r.mpiOp, comm_, &req), "MPI_Iallreduce");
  return req;
}

MPI_Request MpiEngine::bcast(void* buf, int bytes, int root, Mode m) {
  stats_.count(bytes);
  MPI_Request req = MPI_REQUEST_NULL;
  if (m == Mode::kBlocking) check(MPI_Bcast(buf, bytes, MPI_BYTE, root, comm_), "MPI_Bcast");
  else check(MPI_Ibcast(buf, bytes, MPI_BYTE, root, comm_, &req), "MPI_Ibcast");
  return req;
}

void MpiEngine::blocks(int bytes, int64_t stride) {
  int size = 1;
  MPI_Comm_size(comm_, &size);
  if (stride * (size - 1) > INT_MAX) throw c10::ValueError("accl: a strided block lies beyond MPI's int displacements");
  counts_.assign(size, bytes);
  displs_.resize(size);
  for (int r = 0; r < size; ++r) displs_[r] = static_cast<int>(r * stride);
}

MPI_Request MpiEngine::allgather(const void* src, void* dst, int bytes, int64_t stride, Mode m) {
  int rank = 0, size = 1;
  MPI_Comm_rank(comm_, &rank);
  MPI_Comm_size(comm_, &size);
  stats_.count(static_cast<int64_t>(bytes) * size);
  // the input already in place (all_gather_into_tensor of a shard of the output, as FSDP calls it)
  const void* s = src == static_cast<char*>(dst) + rank * stride ? MPI_IN_PLACE : src;
  MPI_Request req = MPI_REQUEST_NULL;
  int rc;
  if (stride == bytes) {
    rc = m == Mode::kBlocking ? MPI_Allgather(s, bytes, MPI_BYTE, dst, bytes, MPI_BYTE, comm_)
                              : MPI_Iallgather(s, bytes, MPI_BYTE, dst, bytes, MPI_BYTE, comm_, &req);
  } else {  // rank r's block lands at dst + r * stride
    blocks(bytes, stride);
    rc = m == Mode::kBlocking
             ? MPI_Allgatherv(s, bytes, MPI_BYTE, dst, counts_.data(), displs_.data(), MPI_BYTE, comm_)
             : MPI_Iallgatherv(s, bytes, MPI_BYTE, dst, counts_.data(), displs_.data(), MPI_BYTE, comm_, &req);
  }
  check(rc, "MPI_Allgather");
  return req;
}

MPI_Request MpiEngine::reduceScatter(const void* src, void* dst, int count, const Reduction& r, Mode m) {
  int size = 1;
  MPI_Comm_size(comm_, &size);
  stats_.count(static_cast<int64_t>(count) * static_cast<int64_t>(r.esz) * size);
  MPI_Request req = MPI_REQUEST_NULL;
  if (m == Mode::kBlocking)
    check(MPI_Reduce_scatter_block(src, dst, count, r.type, r.mpiOp, comm_), "MPI_Reduce_scatter_block");
  else
    check(MPI_Ireduce_scatter_block(src, dst, count, r.type, r.mpiOp, comm_, &req), "MPI_Ireduce_scatter_block");
  return req;
}

MPI_Request MpiEngine::alltoallv(const void* src, const int* sc, const int* sd, void* dst, const int* rc,
                                 const int* rd, Mode m) {
  int size = 1;
  MPI_Comm_size(comm_, &size);
  int64_t sent = 0, got = 0;
  for (int i = 0; i < size; ++i) {
    sent += sc[i];
    got += rc[i];
  }
  stats_.count(std::max(sent, got));
  MPI_Request req = MPI_REQUEST_NULL;
  if (m == Mode::kBlocking)
    check(MPI_Alltoallv(src, sc, sd, MPI_BYTE, dst, rc, rd, MPI_BYTE, comm_), "MPI_Alltoallv");
  else
    check(MPI_Ialltoallv(src, sc, sd, MPI_BYTE, dst, rc, rd, MPI_BYTE, comm_, &req), "MPI_Ialltoallv");
  return req;
}

MPI_Request MpiEngine::reduce(void* buf, int count, const Reduction& r, int root, Mode m) {
  int rank = 0;
  MPI_Comm_rank(comm_, &rank);
  stats_.count(static_cast<int64_t>(count) * static_cast<int64_t>(r.esz));
  // the root reduces in place; the others' buffers are only read
  const void* s = rank == root ? MPI_IN_PLACE : buf;
  void* d = rank == root ? buf : nullptr;
  MPI_Request req = MPI_REQUEST_NULL;
  if (m == Mode::kBlocking) check(MPI_Reduce(s, d, count, r.type, r.mpiOp, root, comm_), "MPI_Reduce");
  else check(MPI_Ireduce(s, d, count, r.type, r.mpiOp, root, comm_, &req), "MPI_Ireduce");
  return req;
}

void MpiEngine::rooted(int bytes, int64_t stride, int root) {
  int rank = 0, size = 1;
  MPI_Comm_rank(comm_, &rank);
  MPI_Comm_size(comm_, &size);
  stats_.count(rank == root ? static_cast<int64_t>(bytes) * size : bytes);
  blocks(bytes, stride);
}

MPI_Request MpiEngine::gather(const void* src, void* dst, int bytes, int64_t stride, int root, Mode m) {
  rooted(bytes, stride, root);  // rank r's block at dst + r * stride on the root
  MPI_Request req = MPI_REQUEST_NULL;
  int rc = m == Mode::kBlocking
               ? MPI_Gatherv(src, bytes, MPI_BYTE, dst, counts_.data(), displs_.data(), MPI_BYTE, root, comm_)
               : MPI_Igatherv(src, bytes, MPI_BYTE, dst, counts_.data(), displs_.data(), MPI_BYTE, root, comm_, &req);
  check(rc, "MPI_Gather");
  return req;
}

MPI_Request MpiEngine::scatter(const void* src, int64_t stride, void* dst, int bytes, int root, Mode m) {
  rooted(bytes, stride, root);  // rank r's block at src + r * stride on the root
  MPI_Request req = MPI_REQUEST_NULL;
  int rc = m == Mode::kBlocking
               ? MPI_Scatterv(src, counts_.data(), displs_.data(), MPI_BYTE, dst, bytes, MPI_BYTE, root, comm_)
               : MPI_Iscatterv(src, counts_.data(), displs_.data(), MPI_BYTE, dst, bytes, MPI_BYTE, root, comm_, &req);
  check(rc, "MPI_Scatter");
  return req;
}

MPI_Request MpiEngine::allgatherv(const void* src, int bytes, void* dst, const int* counts, const int* displs,
                                  Mode m) {
  int size = 1;
  MPI_Comm_size(comm_, &size);
  int64_t total = 0;
  for (int r = 0; r < size; ++r) total += counts[r];
  stats_.count(total);
  MPI_Request req = MPI_REQUEST_NULL;
  if (m == Mode::kBlocking)
    check(MPI_Allgatherv(src, bytes, MPI_BYTE, dst, counts, displs, MPI_BYTE, comm_), "MPI_Allgatherv");
  else
    check(MPI_Iallgatherv(src, bytes, MPI_BYTE, dst, counts, displs, MPI_BYTE, comm_, &req), "MPI_Iallgatherv");
  return req;
}

MPI_Request MpiEngine::barrier(Mode m) {
  stats_.count(0);
  MPI_Request req = MPI_REQUEST_NULL;
  if (m == Mode::kBlocking) check(MPI_Barrier(comm_), "MPI_Barrier");
  else check(MPI_Ibarrier(comm_, &req), "MPI_Ibarrier");
  return req;
}

}  // namespace torchhpc::accl
