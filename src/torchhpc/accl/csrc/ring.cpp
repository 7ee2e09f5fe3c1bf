// accl's own algorithm for large reductions: the pipelined ring (gloo's and NCCL's shape) over point-to-point
// messages on the collective communicator.
//
// The buffer is cut into p blocks.  Reduce-scatter: in step s (0..p-2) rank r sends block r-s-1 to rank r+1 and
// receives block r-s-2 from rank r-1, adding its own contribution to it; after p-1 steps block r holds every rank's
// sum.  All-gather: in step s it sends block r-s and receives block r-s-1 into place.  Every rank sends and
// receives 2(p-1)/p of the buffer, the least any algorithm moves, and no rank sends more than its link carries at
// once, where MPI's recursive doubling moves the whole buffer log2(p) times.  Each block travels in chunks: a
// window of receives stays posted and each chunk is reduced as it lands, while the next ones are on the wire.
// Every wait is against the call's deadline.
#include "accl.hpp"

#include <cstring>

namespace torchhpc::accl {
namespace {

constexpr int kTagRing = 32;
constexpr int kWindow = 16;  // chunks in flight per step

// elements [first(b), first(b + 1)) of n in p blocks (sizes differ by at most one element)
int64_t first(int64_t b, int64_t n, int p) {
  return b * n / p;
}

int mod(int64_t a, int p) {
  return static_cast<int>(((a % p) + p) % p);
}

}  // namespace

bool ProcessGroupACCL::usesRing(const Engine* eng, Coll coll, int64_t bytes) const {
  if (!onMpi(eng) || mpi_->mode != Mode::kBlocking || size_ == 1) return false;
  if (opts_.ringMinBytes >= 0) return bytes >= opts_.ringMinBytes;
  // reduce_scatter: always (Open MPI's allocates and faults in a buffer of the whole input per call);
  // all_reduce: across nodes from kRingAcrossNodes (on one node MPI's segmented calls are as fast or faster)
  return coll == Coll::kReduceScatter || (spansNodes_ && bytes >= kRingAcrossNodes);
}

int64_t ProcessGroupACCL::ringChunk(Coll coll) const {
  return std::min(kRingChunk, segmentFor(coll));
}

void ProcessGroupACCL::ringStep(const RingStep& st) {
  // one step: the chunks of `send` (this rank's block for the right neighbour) all posted; those of `recv` from
  // the left neighbour through a window of kWindow scratch chunks, each handed to `land(offset, chunk, count)`
  const int right = (rank_ + 1) % size_, left = (rank_ - 1 + size_) % size_;
  const int64_t esz = static_cast<int64_t>(c10::elementSize(st.dtype)), per = std::max<int64_t>(1, st.chunk / esz);
  const int64_t sends = (st.sendCount + per - 1) / per, recvs = (st.recvCount + per - 1) / per;
  std::vector<MPI_Request> out(sends, MPI_REQUEST_NULL), in(kWindow, MPI_REQUEST_NULL);
  for (int64_t k = 0; k < sends; ++k) {
    const int64_t cnt = std::min(per, st.sendCount - k * per);
    stats_.count(cnt * esz);  // each chunk counts as one engine call
    ACCL_MPI(MPI_Isend, st.send + k * per * esz, static_cast<int>(cnt * esz), MPI_BYTE, right, kTagRing, coll_,
             &out[k]);
  }
  auto post = [&](int64_t k) {
    const int64_t cnt = std::min(per, st.recvCount - k * per);
    char* into = st.into ? st.into + k * per * esz : ringScratch_.data() + (k % kWindow) * per * esz;
    ACCL_MPI(MPI_Irecv, into, static_cast<int>(cnt * esz), MPI_BYTE, left, kTagRing, coll_, &in[k % kWindow]);
  };
  for (int64_t k = 0; k < std::min<int64_t>(kWindow, recvs); ++k) post(k);
  for (int64_t k = 0; k < recvs; ++k) {
    if (!testUntil(&in[k % kWindow], 1, deadline_)) expire(wire::describe(current_->head));
    const int64_t cnt = std::min(per, st.recvCount - k * per);
    if (st.land) st.land(k * per, ringScratch_.data() + (k % kWindow) * per * esz, cnt);
    if (k + kWindow < recvs) post(k + kWindow);
  }
  if (!testUntil(out.data(), static_cast<int>(sends), deadline_)) expire(wire::describe(current_->head));
}

void ProcessGroupACCL::ringReduce(char* data, int64_t n, const Reduction& red, char* own, char* out) {
  // reduce-scatter over `n` elements; with `own` (reduce_scatter: the caller's input, left as it is) the partial
  // sums go through two scratch blocks and block `rank` ends in `out`; without, `data` is reduced in place
  const int p = size_;
  const int64_t esz = static_cast<int64_t>(red.esz), biggest = n / p + 1;
  const int64_t chunk = ringChunk(Coll::kReduceScatter);
  ringScratch_.resize(std::max<size_t>(ringScratch_.size(), kWindow * std::max<int64_t>(chunk, esz)));
  if (own) ringPartial_.resize(std::max<size_t>(ringPartial_.size(), 2 * biggest * esz));  // kept: no fault-in per call
  char* const partial = ringPartial_.data();
  auto block = [&](int64_t b) { return first(mod(b, p), n, p); };
  auto len = [&](int64_t b) { return first(mod(b, p) + 1, n, p) - first(mod(b, p), n, p); };
  for (int s = 0; s < p - 1; ++s) {
    const int64_t sb = rank_ - s - 1, rb = rank_ - s - 2;
    // what this step sends: the block reduced in the step before (at step 0 this rank's own contribution)
    const char* send = !own ? data + block(sb) * esz
                     : s == 0 ? own + block(sb) * esz : partial + ((s - 1) % 2) * biggest * esz;
    char* acc = !own ? data + block(rb) * esz
              : s == p - 2 ? out : partial + (s % 2) * biggest * esz;
    const char* mine = own ? own + block(rb) * esz : nullptr;
    ringStep({red.dtype, chunk, send, len(sb), nullptr, len(rb), [&](int64_t off, const char* got, int64_t cnt) {
                if (mine) std::memcpy(acc + off * esz, mine + off * esz, cnt * esz);
                ACCL_MPI(MPI_Reduce_local, got, acc + off * esz, static_cast<int>(cnt), red.type, red.mpiOp);
              }});
  }
  if (own && p == 1) std::memcpy(out, own, n * esz);
}

void ProcessGroupACCL::ringGather(char* data, int64_t n, at::ScalarType dtype) {
  // all-gather of the blocks a reduce-scatter left: block rank-s to the right, block rank-s-1 from the left
  const int p = size_;
  const int64_t esz = static_cast<int64_t>(c10::elementSize(dtype));
  auto block = [&](int64_t b) { return data + first(mod(b, p), n, p) * esz; };
  auto len = [&](int64_t b) { return first(mod(b, p) + 1, n, p) - first(mod(b, p), n, p); };
  const int64_t chunk = ringChunk(Coll::kAllgather);
  for (int s = 0; s < p - 1; ++s)
    ringStep({dtype, chunk, block(rank_ - s), len(rank_ - s), block(rank_ - s - 1), len(rank_ - s - 1), nullptr});
}

}  // namespace torchhpc::accl
