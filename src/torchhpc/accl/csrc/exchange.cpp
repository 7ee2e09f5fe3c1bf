// The header exchange: how every checked collective starts, and the whole of a small one.
//
// Recursive doubling over point-to-point messages on the control communicator (the shape of MPICH's small
// all-reduce): with p2 the largest power of two <= p and rem = p - p2, each even rank below 2*rem first hands its
// part to the odd rank above it and gets the result from it after the rounds; the other p2 ranks, numbered
// 0..p2-1, run log2(p2) rounds, in each of which every rank sends one message to the partner whose number differs
// in one bit and receives one from it.  A message is a wire::Prefix (the sender's header, whether any rank
// disagreed so far, the data that follows) and a small call's data: its partial reduction, the root's payload
// once the sender has it, or the blocks it has gathered.  Agreement is itself reduced (equal stays equal, anything
// else is a mismatch), so every rank ends with the same verdict; data is taken only from a peer whose header
// agreed with this rank's (its layout is then this rank's).  On a mismatch every rank gathers every header the
// same way and raises the same MismatchError.  Every call kind runs the same pattern, so ranks that disagree on
// the kind still meet.
#include "accl.hpp"

#include <cstring>

namespace torchhpc::accl {

struct Xchg {
  Xchg(Carry what, const wire::Header& h, int cmp, int rank)
      : carry(what), head(h), compare(cmp), data(carry.data),
        have(carry.ride == Ride::kBroadcast && rank == carry.root), lo(rank), hi(rank + 1) {}
  Carry carry;               // what rides (Ride::kNone: the header only)
  wire::Header head;         // this rank's header
  int compare = wire::kCompareAll;
  bool bad = false;          // some rank's header differs from another's
  char* data = nullptr;      // carry.data
  bool have = false;         // broadcast: this rank holds the root's data
  int64_t lo = 0, hi = 0;    // gather: this rank holds the blocks of ranks [lo, hi)
};

namespace {

constexpr int kTagPrefix = 16;  // on the control communicator, which carries nothing else
static_assert(sizeof(wire::Prefix) <= wire::kHeaderBytes);

// the data this rank sends now (none once a mismatch is known: only the verdict matters then)
std::pair<const char*, int64_t> outgoing(const Xchg& x) {
  if (x.bad) return {nullptr, 0};
  switch (x.carry.ride) {
    case Ride::kReduce: return {x.data, x.carry.bytes};
    case Ride::kBroadcast: return {x.data, x.have ? x.carry.bytes : 0};
    case Ride::kGather: return {x.data + x.lo * x.carry.bytes, (x.hi - x.lo) * x.carry.bytes};
    case Ride::kNone: break;
  }
  return {nullptr, 0};
}

// whether an agreed peer's data has the size and layout this rank expects: a size from a peer is checked
// before anything is copied (a corrupt prefix becomes a refusal on every rank, never a write past a buffer)
bool layoutAgrees(const Xchg& x, const wire::Prefix& pre, int p) {
  if (x.carry.ride == Ride::kGather)
    return pre.lo >= 0 && pre.hi <= p && pre.lo <= pre.hi && pre.bytes == (pre.hi - pre.lo) * x.carry.bytes;
  const int64_t want = x.carry.ride == Ride::kNone ? 0 : x.carry.bytes;  // a broadcast's non-root may send none
  return pre.bytes == want || (x.carry.ride == Ride::kBroadcast && pre.bytes == 0);
}

// an agreed peer's data, arrived at `src`, into this rank's state (`result`: it is the finished reduction)
void absorb(Xchg& x, const wire::Prefix& pre, const char* src, bool result) {
  switch (x.carry.ride) {
    case Ride::kReduce:
      if (result) std::memcpy(x.data, src, pre.bytes);
      else ACCL_MPI(MPI_Reduce_local, src, x.data, static_cast<int>(pre.bytes / x.carry.red->esz),
                    x.carry.red->type, x.carry.red->mpiOp);
      break;
    case Ride::kBroadcast:
      if (src != x.data) std::memcpy(x.data, src, pre.bytes);
      x.have = true;
      break;
    case Ride::kGather:
      if (src != x.data + pre.lo * x.carry.bytes) std::memcpy(x.data + pre.lo * x.carry.bytes, src, pre.bytes);
      x.lo = std::min(x.lo, pre.lo);
      x.hi = std::max(x.hi, pre.hi);
      break;
    case Ride::kNone: break;
  }
}

}  // namespace

void ProcessGroupACCL::exchange(const Call& c, const Carry& carry) {
  Xchg x(carry, c.head, c.compare, rank_);
  doubling(x);
  if (x.bad) refuse(c);
}

void ProcessGroupACCL::doubling(Xchg& x) {
  const int me = rank_;
  int p2 = 1;
  while (p2 * 2 <= size_) p2 *= 2;
  const int rem = size_ - p2;
  if (me < 2 * rem && me % 2 == 0) {  // folded: its part to the odd rank above, the result back from it
    step(x, me + 1, true, false);
    return step(x, me + 1, false, true, true);
  }
  if (me < 2 * rem) step(x, me - 1, false, true);
  const int v = me < 2 * rem ? me / 2 : me - rem;
  for (int mask = 1; mask < p2; mask <<= 1) {
    const int pv = v ^ mask;
    step(x, pv < rem ? 2 * pv + 1 : pv + rem, true, true);
  }
  if (me < 2 * rem) step(x, me - 1, true, false);
}

void ProcessGroupACCL::step(Xchg& x, int peer, bool send, bool recv, bool result) {
  MPI_Request in = MPI_REQUEST_NULL, out = MPI_REQUEST_NULL;
  if (recv) ACCL_MPI(MPI_Irecv, in_.data(), static_cast<int>(in_.size()), MPI_BYTE, peer, kTagPrefix, ctl_, &in);
  if (send) post(x, peer, &out);
  if (recv) take(x, peer, &in, &out, result);
  waitRequest(&out, 1, peer);
}

void ProcessGroupACCL::post(const Xchg& x, int peer, MPI_Request* out) {
  const auto [src, bytes] = outgoing(x);
#ifdef ACCL_TEST_HOOKS
  const int64_t garbled = wire::garble.load(std::memory_order_relaxed) ? wire::garble.exchange(0) : 0;
#else
  const int64_t garbled = 0;
#endif
  const wire::Prefix pre{x.head, x.bad ? 1 : 0, bytes + garbled, x.lo, x.hi};
  std::memcpy(out_.data(), &pre, sizeof pre);
  if (bytes) std::memcpy(out_.data() + wire::kHeaderBytes, src, bytes);
  ACCL_MPI(MPI_Isend, out_.data(), static_cast<int>(wire::kHeaderBytes + bytes), MPI_BYTE, peer, kTagPrefix, ctl_,
           out);
}

void ProcessGroupACCL::take(Xchg& x, int peer, MPI_Request* in, MPI_Request* out, bool result) {
  waitRequest(in, 1, peer);
  wire::Prefix pre;
  std::memcpy(&pre, in_.data(), sizeof pre);
  // a size from a peer is used only once checked: with the same header it must be exactly what this rank expects,
  // else (a disagreeing peer's, ignored) fit the buffer; one that does neither is garbled, and nothing of it is read
  const bool same = !x.bad && !pre.bad && std::memcmp(&pre.head, &x.head, x.compare * sizeof(int64_t)) == 0;
  const bool agreed = same && layoutAgrees(x, pre, size_);
  checkReadable(peer, pre.bytes, same, agreed, out);
  waitRequest(out, 1, peer);  // this rank's data is sent before it is reduced into
  x.bad = !agreed;
  if (agreed && pre.bytes) absorb(x, pre, in_.data() + wire::kHeaderBytes, result);
}

void ProcessGroupACCL::checkReadable(int peer, int64_t bytes, bool same, bool agreed, MPI_Request* out) {
  const int64_t room = static_cast<int64_t>(in_.size()) - wire::kHeaderBytes;
  if (same == agreed && bytes >= 0 && bytes <= room) return;
  // garbled, not a disagreement: only this rank saw it, so it cannot be refused together; this rank's sends
  // complete, then it leaves the group (its peers meet their deadline, as with a rank that died)
  waitRequest(out, 1, peer);
  const c10::DistBackendError e("accl: garbled header-exchange message from rank " + std::to_string(peer) + " (" +
                                std::to_string(bytes) + " bytes); group '" + groupName() + "' aborted on this rank");
  abortWith(e.what(), std::make_exception_ptr(e));
  throw e;
}

void ProcessGroupACCL::refuse(const Call& c) {
  // every rank's header, gathered through the same pattern under a header every rank shares
  constexpr int64_t hb = sizeof(wire::Header);
  std::vector<wire::Header> heads(size_);
  heads[rank_] = c.head;
  Xchg x({Ride::kGather, reinterpret_cast<char*>(heads.data()), hb}, wire::Header{}, wire::kCompareAll, rank_);
  doubling(x);
  dumpFlightRecord();
  throw MismatchError(wire::describeMismatch(heads, c.compare, groupName()));
}

}  // namespace torchhpc::accl
