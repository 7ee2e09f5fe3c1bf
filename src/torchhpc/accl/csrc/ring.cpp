// accl's own algorithm for large reductions: the pipelined ring (gloo's and NCCL's shape) over point-to-point
// messages on the collective communicator.
//
// The buffer is cut into p blocks.  Reduce-scatter: in step t (0..p-2) rank r sends block r-t-1 to rank r+1 and
// receives block r-t-2 from rank r-1, adding its own contribution; after p-1 steps block r holds every rank's sum.
// All-gather (all_reduce only): in step p-1+t it sends block r-t and receives block r-t-1 into place.  Every rank
// sends and receives 2(p-1)/p of the buffer, the least any algorithm moves, where recursive doubling moves all of
// it log2(p) times.  Each block travels in chunks, reduced as they land while a window of receives stays posted
// within the step; a step's sends finish before the next step starts.  Every wait is against the call's deadline.
#include "accl.hpp"

#include <cstring>

namespace torchhpc::accl {

struct RingRun {
  const Reduction* red;
  int p, r, steps;              // steps: p-1 (reduce_scatter) or 2(p-1) (all_reduce)
  int64_t n, esz, per, biggest;  // elements; element size; elements per chunk; the largest block
  char* data;                   // all_reduce: the buffer, reduced and gathered in place
  const char* own;              // reduce_scatter: this rank's input (left as it is) ...
  char* out;                    // ... and its block of the result
  std::vector<MPI_Request> recvs;  // the window's receives (chunk k in slot k % kWindow)
  int64_t mod(int64_t b) const { return ((b % p) + p) % p; }
  int64_t at(int64_t b) const { return mod(b) * n / p; }  // block b's first element (blocks differ by one at most)
  int64_t len(int64_t b) const { return (mod(b) + 1) * n / p - at(b); }
  int64_t chunks(int64_t b) const { return (len(b) + per - 1) / per; }
  int64_t count(int64_t b, int64_t k) const { return std::min(per, len(b) - k * per); }
  int64_t sendBlock(int t) const { return t < p - 1 ? r - t - 1 : r - (t - (p - 1)); }
  int64_t recvBlock(int t) const { return sendBlock(t) - 1; }
  bool gathers() const { return own == nullptr; }
  bool inPlace(int t) const { return gathers() && t >= p - 1; }  // an all-gather step: copied into the buffer
  // where step t's reduction lands (reduce_scatter: two kept blocks in turn, the last step in `out`)
  char* acc(int t, char* partial) const {
    if (gathers()) return data + at(recvBlock(t)) * esz;
    return t == p - 2 ? out : partial + (t % 2) * biggest * esz;
  }
  // what step t sends: this rank's own block first, then what the step before reduced or received
  const char* source(int t, char* partial) const {
    if (t == 0) return (gathers() ? data : own) + at(sendBlock(0)) * esz;
    if (t < p) return acc(t - 1, partial);
    return data + at(sendBlock(t)) * esz;
  }
};

namespace {
constexpr int kTagRing = 32;
constexpr int kWindow = 16;  // receives posted ahead in a step (a 1 Gbit/s link held 0.086 GB/s of 0.12 with 4)
}  // namespace

void ProcessGroupACCL::ring(const Reduction& red, int64_t n, char* data, const char* own, char* out) {
  const int64_t esz = static_cast<int64_t>(red.esz);
  const int left = (rank_ - 1 + size_) % size_, right = (rank_ + 1) % size_;
  RingRun x{&red, size_, rank_, own ? size_ - 1 : 2 * (size_ - 1), n, esz,
            std::max<int64_t>(1, std::min(kRingChunk, segmentFor(OpType::ALLREDUCE)) / esz), n / size_ + 1, data,
            own, out, std::vector<MPI_Request>(kWindow, MPI_REQUEST_NULL)};
  ringScratch_.resize(std::max<size_t>(ringScratch_.size(), kWindow * x.per * esz));
  if (own) ringPartial_.resize(std::max<size_t>(ringPartial_.size(), 2 * x.biggest * esz));  // kept: no faults
  std::vector<MPI_Request> sends;
  for (int t = 0; t < x.steps; ++t) {
    const int64_t sendChunks = x.chunks(x.sendBlock(t)), recvChunks = x.chunks(x.recvBlock(t));
    sends.assign(sendChunks, MPI_REQUEST_NULL);
    for (int64_t k = 0; k < sendChunks; ++k) {  // each chunk counts as one engine call
      const int64_t cnt = x.count(x.sendBlock(t), k);
      stats_.count(cnt * esz);
      ACCL_MPI(MPI_Isend, x.source(t, ringPartial_.data()) + k * x.per * esz, static_cast<int>(cnt * esz), MPI_BYTE,
               right, kTagRing, coll_, &sends[k]);
    }
    int64_t posted = 0;  // receives posted, up to kWindow ahead of the chunk landing
    for (; posted < std::min<int64_t>(recvChunks, kWindow); ++posted) ringRecv(x, t, posted);
    for (int64_t k = 0; k < recvChunks; ++k) {
      waitRequest(&x.recvs[k % kWindow], 1, left);
      ringLand(x, t, k);
      if (posted < recvChunks) ringRecv(x, t, posted++);
    }
    // the step's sends done before the next step reuses their blocks.  Measured across a 1 Gbit/s link at 2
    // ranks: receives posted ahead into the next step, or each chunk sent on as soon as it landed, ran at
    // 0.72-0.85x of this (at 4 ranks the latter was 0.97-1.0x of gloo where this is 0.93-1.0x); sent on as they
    // land, at most 1 send in flight: 0.93-0.97x of this at 4-16 MiB and 10 Gbit/s, no steadier at 4 ranks
    waitRequest(sends.data(), static_cast<int>(sendChunks), right);
  }
}

void ProcessGroupACCL::ringRecv(RingRun& x, int t, int64_t k) {
  ACCL_MPI(MPI_Irecv, ringScratch_.data() + (k % kWindow) * x.per * x.esz,
           static_cast<int>(x.count(x.recvBlock(t), k) * x.esz), MPI_BYTE, (rank_ - 1 + size_) % size_, kTagRing,
           coll_, &x.recvs[k % kWindow]);
}

void ProcessGroupACCL::ringLand(RingRun& x, int t, int64_t k) {
  // a chunk from the left: an all-gather chunk copied into place, a reduce-scatter chunk added to this rank's
  // contribution (the blocks it lands in were sent, if at all, in steps already done)
  const int64_t b = x.recvBlock(t), cnt = x.count(b, k), off = k * x.per * x.esz;
  const char* got = ringScratch_.data() + (k % kWindow) * x.per * x.esz;
  if (x.inPlace(t)) {
    std::memcpy(x.data + x.at(b) * x.esz + off, got, cnt * x.esz);
    return;
  }
  char* dst = x.acc(t, ringPartial_.data()) + off;
  if (x.own) std::memcpy(dst, x.own + x.at(b) * x.esz + off, cnt * x.esz);
  ACCL_MPI(MPI_Reduce_local, got, dst, static_cast<int>(cnt), x.red->type, x.red->mpiOp);
}

}  // namespace torchhpc::accl
