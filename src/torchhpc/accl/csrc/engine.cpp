// The MPI engine: one blocking MPI call per segment on host tensors, after the header exchange; and the one MPI
// error path (MpiCallError).
#include "accl.hpp"

#include <climits>
#include <cstring>

namespace torchhpc::accl {

std::string mpiErrorText(int rc) {
  char text[MPI_MAX_ERROR_STRING] = {};
  int len = 0;
  if (MPI_Error_string(rc, text, &len) != MPI_SUCCESS) return "error code " + std::to_string(rc);
  return std::string(text, static_cast<size_t>(len));
}

MpiCallError::MpiCallError(int code, const char* fn)
    : c10::DistBackendError(std::string("accl: ") + fn + " failed: " + mpiErrorText(code)), rc(code), call(fn) {}

void Stats::count(int64_t bytes) {
  engineCalls.fetch_add(1, std::memory_order_relaxed);
  int64_t seen = maxCallBytes.load(std::memory_order_relaxed);
  while (bytes > seen && !maxCallBytes.compare_exchange_weak(seen, bytes)) {
  }
}

void Engine::send(const Seg&, int, int) {
  throw c10::NotImplementedError("accl: the " + name() + " engine has no send");
}

void Engine::recv(const Seg&, int, int) {
  throw c10::NotImplementedError("accl: the " + name() + " engine has no recv");
}

MpiEngine::MpiEngine(MPI_Comm comm) : Engine("mpi"), comm_(comm) {
  ACCL_MPI(MPI_Comm_rank, comm, &rank_);
  ACCL_MPI(MPI_Comm_size, comm, &size_);
}

void MpiEngine::allreduce(const Seg& b, const Reduction& r) {
  ACCL_MPI(MPI_Allreduce, MPI_IN_PLACE, b.data, static_cast<int>(b.count), r.type, r.mpiOp, comm_);
}

void MpiEngine::reduce(const Seg& b, const Reduction& r, int root) {
  // the root reduces in place; the others' buffers are only read
  const void* s = rank_ == root ? MPI_IN_PLACE : b.data;
  void* d = rank_ == root ? b.data : nullptr;
  ACCL_MPI(MPI_Reduce, s, d, static_cast<int>(b.count), r.type, r.mpiOp, root, comm_);
}

void MpiEngine::broadcast(const Seg& b, int root) {
  ACCL_MPI(MPI_Bcast, b.data, static_cast<int>(b.bytes()), MPI_BYTE, root, comm_);
}

void MpiEngine::blocks(const Seg& rows, int bytes) {
  const int64_t stride = rows.data ? rows.stride : bytes;
  if (stride * (size_ - 1) > INT_MAX) valueError("accl: a strided block lies beyond MPI's int displacements");
  counts_.assign(size_, bytes);
  displs_.resize(size_);
  for (int r = 0; r < size_; ++r) displs_[r] = static_cast<int>(r * stride);
}

void MpiEngine::allgather(const Seg& send, const Seg& rows) {
  const int bytes = static_cast<int>(send.bytes());
  // the input already in place (all_gather_into_tensor of a shard of the output, as FSDP calls it)
  const void* s = send.data == rows.row(rank_) ? MPI_IN_PLACE : send.data;
  if (rows.stride == bytes) {
    ACCL_MPI(MPI_Allgather, s, bytes, MPI_BYTE, rows.data, bytes, MPI_BYTE, comm_);
    return;
  }
  blocks(rows, bytes);  // rank r's block at rows.row(r)
  ACCL_MPI(MPI_Allgatherv, s, bytes, MPI_BYTE, rows.data, counts_.data(), displs_.data(), MPI_BYTE, comm_);
}

void MpiEngine::gather(const Seg& send, const Seg& rows, int root) {
  const int bytes = static_cast<int>(send.bytes());
  blocks(rows, bytes);
  ACCL_MPI(MPI_Gatherv, send.data, bytes, MPI_BYTE, rows.data, counts_.data(), displs_.data(), MPI_BYTE, root, comm_);
}

void MpiEngine::scatter(const Seg& rows, const Seg& recv, int root) {
  const int bytes = static_cast<int>(recv.bytes());
  blocks(rows, bytes);
  ACCL_MPI(MPI_Scatterv, rows.data, counts_.data(), displs_.data(), MPI_BYTE, recv.data, bytes, MPI_BYTE, root, comm_);
}

void MpiEngine::reduceScatter(const Seg& rows, const Seg& recv, const Reduction& r) {
  const int64_t bytes = recv.bytes();
  char* src = rows.data;
  if (rows.stride != bytes) {  // a segment of every rank's block: its rows copied together, into a kept buffer
    if (!scratch_.defined() || static_cast<int64_t>(scratch_.nbytes()) < bytes * size_)
      scratch_ = at::empty({bytes * size_}, at::TensorOptions().dtype(at::kByte));
    src = ptr(scratch_);
    for (int k = 0; k < size_; ++k) std::memcpy(src + k * bytes, rows.row(k), bytes);
  }
  ACCL_MPI(MPI_Reduce_scatter_block, src, recv.data, static_cast<int>(recv.count), r.type, r.mpiOp, comm_);
}

void MpiEngine::alltoall(const void* src, int bytes, void* dst) {
  ACCL_MPI(MPI_Alltoall, src, bytes, MPI_BYTE, dst, bytes, MPI_BYTE, comm_);
}

void MpiEngine::alltoallv(const void* src, const int* sc, const int* sd, void* dst, const int* rc, const int* rd) {
  ACCL_MPI(MPI_Alltoallv, src, sc, sd, MPI_BYTE, dst, rc, rd, MPI_BYTE, comm_);
}

void MpiEngine::allgatherv(const void* src, int bytes, void* dst, const int* counts, const int* displs) {
  ACCL_MPI(MPI_Allgatherv, src, bytes, MPI_BYTE, dst, counts, displs, MPI_BYTE, comm_);
}

}  // namespace torchhpc::accl
