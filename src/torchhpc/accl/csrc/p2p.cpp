// Point-to-point of ProcessGroupACCL.
//
// A send is an envelope (wire::Envelope, then the payload up to kPayloadBytes) on the envelope communicator; a
// larger payload follows in segments on the payload communicator, received only after the envelope checked out
// (a mismatched payload is drained, never matched by a later receive).  Ops in flight are progressed by whoever
// waits on them and by the group's worker; each has the group deadline.
#include "accl.hpp"

#include <c10/core/StreamGuard.h>

#include <cstring>

namespace torchhpc::accl {
namespace {

std::string fromText(int src) {
  return src < 0 ? "from any source" : "from rank " + std::to_string(src);
}

// the element size a sender segmented its payload by (the envelope carries bytes and elements)
int64_t unitOf(const wire::Envelope& env) {
  return env.numel > 0 ? env.nbytes / env.numel : 1;
}

}  // namespace

// ============================================================================================== starting ops

WorkPtr ProcessGroupACCL::send(Tensors& tensors, int dst, int tag) {
  const at::Tensor& t = one(tensors, "send");
  checkRank(dst, "send", "dst");
  return startP2P(t, dst, tag, OpType::SEND);
}

WorkPtr ProcessGroupACCL::recv(Tensors& tensors, int src, int tag) {
  const at::Tensor& t = one(tensors, "recv");
  checkRank(src, "recv", "src");
  return startP2P(t, src, tag, OpType::RECV);
}

WorkPtr ProcessGroupACCL::recvAnysource(Tensors& tensors, int tag) {
  return startP2P(one(tensors, "recv"), -1, tag, OpType::RECVANYSOURCE);
}

// One op: checked, recorded, its first messages posted (a send's envelope and payload, a receive's envelope), then
// handed to progress.
WorkPtr ProcessGroupACCL::startP2P(const at::Tensor& t, int peer, int tag, OpType type) {
  checkTag(tag);
  checkOpen();
  auto op = std::make_unique<P2P>();
  op->send = type == OpType::SEND;
  op->peer = peer;
  op->tag = tag;
  op->tensor = t;
  op->eng = engineFor(op->send ? OpType::SEND : OpType::RECV, t.scalar_type());  // any source: RECV's engine
  const std::string me = std::to_string(rank_), them = std::to_string(peer);
  const std::string tagged = ", tag " + std::to_string(tag) + ")";
  op->work = c10::make_intrusive<WorkACCL>(
      rank_, type, op->send ? "send(to rank " + them + tagged : "recv(" + fromText(peer) + tagged, Tensors{t}, this);
  record(op->fr, op->send ? "send " + me + "->" + them : "recv " + me + "<-" + them, {t}, {t}, -1, true);
  op->deadline = Clock::now() + opts_.timeout;
  op->fr.started();
  try {
    op->send ? postSend(*op) : postRecv(*op);
  } catch (const MpiCallError& e) {
    std::rethrow_exception(mpiFailure(e, op->work->what()));
  }
  auto work = op->work;
  {
    std::lock_guard<std::mutex> lock(mu_);
    work->name(groupNameShared());
    if (!worker_.joinable()) worker_ = std::thread([this] { workerLoop(); });
  }
  {
    std::lock_guard<std::mutex> lock(p2pMu_);
    p2p_.push_back(std::move(op));
    p2pPending_.fetch_add(1);
  }
  cv_.notify_all();
  progressP2P();
  return work;
}

// The envelope, with the payload when it fits the slot; else the payload's segments after it (on the payload
// communicator, or the engine's blocking sends, made in order).
void ProcessGroupACCL::postSend(P2P& op) {
  op.host = host(op.tensor, true);
  const wire::Envelope env{wire::kMagic, wire::dtypeCode(op.tensor.scalar_type()),
                           static_cast<int64_t>(op.tensor.nbytes()), op.tensor.numel()};
  const bool small = env.nbytes <= wire::kPayloadBytes;
  op.envelope.assign(wire::kSlotBytes, 0);
  std::memcpy(op.envelope.data(), &env, sizeof env);
  if (small && env.nbytes) std::memcpy(op.envelope.data() + wire::kHeaderBytes, op.host.data_ptr(), env.nbytes);
  op.reqs.push_back(MPI_REQUEST_NULL);
  ACCL_MPI(MPI_Isend, op.envelope.data(), static_cast<int>(wire::kHeaderBytes + (small ? env.nbytes : 0)), MPI_BYTE,
           op.peer, op.tag, p2pHead_, &op.reqs.back());
  if (small) return;
  forSegments(OpType::SEND, env.numel, unitOf(env), [&](int64_t off, int64_t cnt) {
    const Seg part = seg(op.host, off, cnt);
    if (!onMpi(op.eng)) return op.eng->send(part, op.peer, op.tag);
    op.reqs.push_back(MPI_REQUEST_NULL);
    ACCL_MPI(MPI_Isend, part.data, static_cast<int>(part.bytes()), MPI_BYTE, op.peer, op.tag, p2pData_,
             &op.reqs.back());
  });
}

// A slot-sized receive for the envelope; the payload's receives are posted once it checked out (openEnvelope).
void ProcessGroupACCL::postRecv(P2P& op) {
  op.stream = callerStream({op.tensor});  // a device tensor is copied back on the caller's stream of issue
  op.envelope.assign(wire::kSlotBytes, 0);
  op.reqs.push_back(MPI_REQUEST_NULL);
  ACCL_MPI(MPI_Irecv, op.envelope.data(), static_cast<int>(wire::kSlotBytes), MPI_BYTE,
           op.peer < 0 ? MPI_ANY_SOURCE : op.peer, op.tag, p2pHead_, &op.reqs.back());
}

// ============================================================================================== progress

void ProcessGroupACCL::progressP2P() {
  std::vector<std::unique_ptr<P2P>> done;
  {
    std::unique_lock<std::mutex> lock(p2pMu_, std::try_to_lock);
    if (!lock.owns_lock()) return;  // someone else is progressing them
    for (auto& op : p2p_)
      if (advanceP2P(*op)) done.push_back(std::move(op));
    p2p_.erase(std::remove(p2p_.begin(), p2p_.end(), nullptr), p2p_.end());
    p2pPending_.fetch_sub(static_cast<int>(done.size()));
  }
  for (auto& op : done) {
    if (!op->error) op->fr.completed();
    op->work->complete(op->error, op->source);
    if (op->expired) {  // given up at the deadline: MPI may still complete its requests into its buffers
      std::lock_guard<std::mutex> lock(p2pMu_);
      p2pAbandoned_.push_back(std::move(op));
    }
  }
}

bool ProcessGroupACCL::advanceP2P(P2P& op) {
  c10::OptionalStreamGuard onCallerStream(op.stream);  // a received device tensor is copied back on it
  try {
    if (op.stage == P2P::kEnvelope && !op.send) {
      MPI_Status st;
      int arrived = 0;
      ACCL_MPI(MPI_Test, &op.reqs[0], &arrived, &st);
      if (arrived) op.source = st.MPI_SOURCE;
      if (arrived && openEnvelope(op)) return true;
    }
    const bool posted = op.send || op.stage != P2P::kEnvelope;
    if (posted && testUntil(op.reqs.data(), static_cast<int>(op.reqs.size()), Clock::time_point::min())) {
      if (op.stage == P2P::kPayload) deliver(op.host, op.tensor);
      return true;
    }
  } catch (const MpiCallError& e) {
    op.error = mpiFailure(e, op.work->what());
    return true;
  } catch (...) {  // an engine's or a copy's error ends this op alone
    op.error = std::current_exception();
    return true;
  }
  if (Clock::now() <= op.deadline) return false;
  op.expired = true;
  try {
    expire(op.work->what(), op.waitedOn());
  } catch (...) {
    op.error = std::current_exception();
  }
  return true;
}

bool ProcessGroupACCL::openEnvelope(P2P& op) {
  wire::Envelope env;
  std::memcpy(&env, op.envelope.data(), sizeof env);
  const std::string bad = wire::envelopeMismatch(env, op.source, op.tensor, fromText(op.peer), op.tag);
  if (!bad.empty()) op.error = std::make_exception_ptr(MismatchError(bad));
  if (!wire::envelopeConsistent(env)) return true;  // garbled: nothing more can be trusted to follow
  if (env.nbytes <= wire::kPayloadBytes) {  // the payload came with the envelope
    if (bad.empty()) {
      op.host = host(op.tensor, false);
      if (env.nbytes) std::memcpy(op.host.data_ptr(), op.envelope.data() + wire::kHeaderBytes, env.nbytes);
      deliver(op.host, op.tensor);
    }
    return true;
  }
  if (!onMpi(op.eng)) {
    recvOnEngine(op, env, bad);
    return true;
  }
  char* into = nullptr;
  if (bad.empty()) {
    op.host = host(op.tensor, false);
    into = ptr(op.host);
    op.stage = P2P::kPayload;
  } else {
    op.drain.resize(static_cast<size_t>(env.nbytes));
    into = reinterpret_cast<char*>(op.drain.data());
    op.stage = P2P::kDrain;
  }
  postPayload(op, into, env);
  return false;
}

void ProcessGroupACCL::postPayload(P2P& op, char* into, const wire::Envelope& env) {
  op.reqs.clear();
  const int64_t unit = unitOf(env);
  forSegments(OpType::SEND, env.numel, unit, [&](int64_t off, int64_t cnt) {  // the sender's segments
    op.reqs.push_back(MPI_REQUEST_NULL);
    ACCL_MPI(MPI_Irecv, into + off * unit, static_cast<int>(cnt * unit), MPI_BYTE, op.source, op.tag, p2pData_,
             &op.reqs.back());
  });
}

void ProcessGroupACCL::recvOnEngine(P2P& op, const wire::Envelope& env, const std::string& bad) {
  // the engine's calls block; a mismatched payload is received into a buffer of what was sent, then dropped
  const auto sent = op.tensor.options().device(at::kCPU).dtype(wire::scalarTypeOf(env.dtype));
  at::Tensor buf = bad.empty() ? (op.host = host(op.tensor, false)) : at::empty({env.numel}, sent);
  forSegments(OpType::SEND, env.numel, unitOf(env),
              [&](int64_t off, int64_t cnt) { op.eng->recv(seg(buf, off, cnt), op.source, op.tag); });
  if (bad.empty()) deliver(op.host, op.tensor);
}

}  // namespace torchhpc::accl
