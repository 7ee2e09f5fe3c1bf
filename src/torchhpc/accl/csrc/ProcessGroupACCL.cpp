// ProcessGroupACCL: the "accl" backend as one c10d::Backend.  Each entry point is one screen: the argument
// checks (helpers, written once), the Call (header words, engine calls segment by segment, copy-back), enqueue.
#include "accl.hpp"

#if defined(OPEN_MPI) && __has_include(<mpi-ext.h>)
#include <mpi-ext.h>  // Open MPI's ULFM (MPIX_Comm_revoke, MPIX_Comm_get_failed); MPICH declares them in mpi.h
#endif

#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <algorithm>
#include <cstring>
#include <sstream>

namespace torchhpc::accl {
namespace {

using WaitFn = std::function<void(MPI_Request)>;
constexpr size_t kHdr = wire::kHeaderBytes;
constexpr size_t kPay = wire::kPayloadBytes;
constexpr size_t kSlot = wire::kSlotBytes;

// torchhpc.waiting.Backoff: spin 64 polls, yield the core until 20 ms, then sleep from 50 us doubling to 1 ms
struct Backoff {
  int polls = 0;
  Clock::time_point start = Clock::now();
  std::chrono::microseconds nap{50};
  void pause() {
    if (++polls <= 64) return;
    if (Clock::now() - start < std::chrono::milliseconds(20)) {
      std::this_thread::yield();
      return;
    }
    std::this_thread::sleep_for(nap);
    nap = std::min(nap * 2, std::chrono::microseconds(1000));
  }
};

// a contiguous CPU tensor the engine can touch: `t`'s own memory when possible, else a host copy
// (copy=false: an uninitialised buffer, for outputs)
bool direct(const at::Tensor& t) {
  return t.is_cpu() && t.is_contiguous();
}

// Device tensors are staged through pinned host memory, copied on the current stream, which the call has set to
// the caller's stream of the time of issue (Call::stream): the copy out waits for the kernels queued before the
// call, and the blocking copy back is ordered before the caller's later kernels.
at::Tensor host(const at::Tensor& t, bool copy) {
  if (direct(t)) return t.view({-1});
  auto h = at::empty({t.numel()}, t.options().device(at::kCPU).pinned_memory(!t.is_cpu()));
  if (copy) h.copy_(t.reshape({-1}));
  return h;
}

// the caller's current stream on the device of the first device tensor in `ts`, else none (host tensors).
// c10's device-generic guard: no CUDA header is needed, and a module built on a CPU-only torch works on a CUDA one
std::optional<c10::Stream> callerStream(const std::vector<at::Tensor>& ts) {
  for (const auto& t : ts) {
    if (t.defined() && !t.is_cpu()) return c10::impl::VirtualGuardImpl(t.device().type()).getStream(t.device());
  }
  return std::nullopt;
}

// copy `buf` (from host()) into `t` unless it is `t`'s own memory
void deliver(const at::Tensor& buf, const at::Tensor& t) {
  if (direct(t) && buf.data_ptr() == t.data_ptr()) return;
  at::Tensor(t).copy_(buf.view(t.sizes()));
}

char* ptr(const at::Tensor& t) {
  return static_cast<char*>(t.data_ptr());
}

std::string torchName(at::ScalarType t) {
  return "torch." + wire::dtypeName(wire::dtypeCode(t));
}

std::string seconds(std::chrono::milliseconds ms) {
  std::ostringstream s;
  s << static_cast<double>(ms.count()) / 1000.0;
  return s.str();
}

std::string shape(const at::Tensor& t) {
  std::string s = "(";
  for (int64_t i = 0; i < t.dim(); ++i) s += std::to_string(t.size(i)) + (t.dim() == 1 ? "," : i + 1 < t.dim() ? ", " : "");
  return s + ")";
}

MPI_Comm dup(MPI_Comm comm) {
  MPI_Comm out = MPI_COMM_NULL;
  if (MPI_Comm_dup(comm, &out) != MPI_SUCCESS) throw c10::DistBackendError("accl: MPI_Comm_dup failed");
  MPI_Comm_set_errhandler(out, MPI_ERRORS_RETURN);
  return out;
}

}  // namespace

// ============================================================================================== Work

WorkACCL::WorkACCL(int rank, c10d::OpType type, std::string what, std::vector<at::Tensor> outputs,
                   ProcessGroupACCL* p2pOwner)
    : c10d::Work(rank, type),
      what_(std::move(what)),
      outputs_(std::move(outputs)),
      p2pOwner_(p2pOwner != nullptr ? c10::intrusive_ptr<c10d::Backend>::unsafe_reclaim_from_nonowning(
                                          static_cast<c10d::Backend*>(p2pOwner))
                                    : c10::intrusive_ptr<c10d::Backend>()),
      isP2P_(p2pOwner != nullptr) {}

void WorkACCL::progressOwner() {
  if (auto owner = p2pOwner_.lock()) static_cast<ProcessGroupACCL*>(owner.get())->progressP2P();
}

bool WorkACCL::isCompleted() {
  progressOwner();
  std::lock_guard<std::mutex> lock(mutex_);
  return completed_;
}

bool WorkACCL::isSuccess() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return completed_ && !exception_;
}

std::exception_ptr WorkACCL::exception() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return exception_;
}

int WorkACCL::sourceRank() const {
  int s = source_.load();
  TORCH_CHECK_VALUE(s >= 0, "accl: source_rank() is only defined for a completed recv from any source");
  return s;
}

std::vector<at::Tensor> WorkACCL::result() {
  wait();
  return outputs_;
}

bool WorkACCL::wait(std::chrono::milliseconds timeout) {
  auto limit = timeout.count() > 0 ? Clock::now() + timeout : Clock::time_point::max();
  Backoff backoff;
  std::unique_lock<std::mutex> lock(mutex_);
  while (!completed_) {
    if (Clock::now() > limit)
      throw PeerTimeoutError("accl: Work.wait(" + seconds(timeout) + " s) expired before " + what() +
                             " completed in group '" + (group_ ? *group_ : std::string()) + "'");
    if (isP2P_) {  // point-to-point: the waiter progresses them
      lock.unlock();
      progressOwner();
      backoff.pause();
      lock.lock();
    } else {
      cv_.wait_until(lock, std::min(limit, Clock::now() + std::chrono::milliseconds(100)));
    }
  }
  if (exception_) std::rethrow_exception(exception_);
  return true;
}

c10::intrusive_ptr<c10::ivalue::Future> WorkACCL::getFuture() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!future_) {
    future_ = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()));
    if (settling_) settle(future_, outcome_);  // a new future has no callbacks yet: settled under the lock
  }
  return future_;
}

void WorkACCL::settle(const c10::intrusive_ptr<c10::ivalue::Future>& fut, std::exception_ptr error) {
  if (error) fut->setError(error);
  else fut->markCompleted(c10::IValue(outputs_));
}

void WorkACCL::complete(std::exception_ptr error, int source) {
  // the future is settled before the Work reads as completed: whoever waited on the Work finds its future done
  source_ = source;
  c10::intrusive_ptr<c10::ivalue::Future> fut;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    settling_ = true;
    outcome_ = error;
    fut = future_;
  }
  if (fut) settle(fut, error);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    completed_ = true;
    exception_ = error;
  }
  cv_.notify_all();
}

// ============================================================================================== group

ProcessGroupACCL::ProcessGroupACCL(MPI_Comm comm, Config config, std::shared_ptr<Engine> engine)
    : c10d::Backend([&] { int r = 0; MPI_Comm_rank(comm, &r); return r; }(),
                    [&] { int s = 0; MPI_Comm_size(comm, &s); return s; }()),
      opts_(std::move(config)),
      engine_(std::move(engine)) {
  coll_ = dup(comm);
  ctl_ = dup(comm);
  p2pHead_ = dup(comm);
  p2pData_ = dup(comm);
  mpi_ = std::make_unique<MpiEngine>(coll_, stats_);
  mine_.assign(kSlot, 0);
  all_.assign(kSlot * static_cast<size_t>(size_), 0);
#if MPI_VERSION >= 4 || (defined(OMPI_MAJOR_VERSION) && OMPI_MAJOR_VERSION >= 5)
  persistent_ = MPI_Allgather_init(mine_.data(), kSlot, MPI_BYTE, all_.data(), kSlot, MPI_BYTE, ctl_, MPI_INFO_NULL,
                                   &hreq_) == MPI_SUCCESS;
#endif
  void* ub = nullptr;
  int flag = 0;
  MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_TAG_UB, &ub, &flag);
  if (flag && ub != nullptr) tagUb_ = *static_cast<int*>(ub);
}

ProcessGroupACCL::~ProcessGroupACCL() {
  shutdown();
}

void ProcessGroupACCL::shutdown() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stop_) return;
    stop_ = true;
  }
  cv_.notify_all();
  if (worker_.joinable()) worker_.join();
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& c : queue_) c->work->complete(std::make_exception_ptr(AbortedError("accl: process group shut down")));
  queue_.clear();
  if (!aborted_.empty()) return;  // requests given up at a deadline may still use the communicators
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized) return;  // a group never destroyed, collected at interpreter exit after MPI_Finalize
  if (persistent_) MPI_Request_free(&hreq_);
  for (MPI_Comm* c : {&coll_, &ctl_, &p2pHead_, &p2pData_})
    if (*c != MPI_COMM_NULL) MPI_Comm_free(c);
}

std::string ProcessGroupACCL::groupName() const {
  return getGroupUid().empty() ? opts_.groupName : getGroupUid();
}

std::shared_ptr<const std::string> ProcessGroupACCL::groupNameShared() {
  const std::string& now = getGroupUid().empty() ? opts_.groupName : getGroupUid();
  if (!nameShared_ || *nameShared_ != now) nameShared_ = std::make_shared<const std::string>(now);
  return nameShared_;
}

// ---------------------------------------------------------------------------------------- argument checks

const at::Tensor& ProcessGroupACCL::one(const std::vector<at::Tensor>& ts, const char* what) const {
  if (ts.size() != 1)
    valueError(std::string("accl: ") + what + " takes exactly one tensor per call, got " + std::to_string(ts.size()));
  if (ts[0].is_sparse()) typeError(std::string("accl: ") + what + " does not support sparse tensors");
  return ts[0];
}

void ProcessGroupACCL::checkRoot(int64_t root, const char* what) const {
  if (root < 0 || root >= size_)
    valueError("accl: " + std::string(what) + " root " + std::to_string(root) + " is not a rank of this group (size " +
               std::to_string(size_) + ")");
}

void ProcessGroupACCL::checkPeer(int peer, const char* what, const char* name) const {
  if (peer < 0 || peer >= size_)
    valueError("accl: " + std::string(what) + " " + name + "=" + std::to_string(peer) +
               " is not a rank of this group (size " + std::to_string(size_) + ")");
}

void ProcessGroupACCL::checkTag(int tag) const {
  if (tag < 0 || tag > tagUb_)
    valueError("accl: tag " + std::to_string(tag) + " out of range [0, " + std::to_string(tagUb_) + "] (MPI_TAG_UB)");
}

void ProcessGroupACCL::checkSameDtype(const at::Tensor& out, const at::Tensor& in, const char* what) const {
  if (out.scalar_type() != in.scalar_type())
    typeError(std::string("accl: ") + what + " dtypes differ: output " + torchName(out.scalar_type()) + ", input " +
              torchName(in.scalar_type()));
}

void ProcessGroupACCL::checkList(const std::vector<at::Tensor>& list, const at::Tensor& ref, const char* what,
                                 const char* name) const {
  std::string w = std::string("accl: ") + what + " " + name;
  if (static_cast<int>(list.size()) != size_)
    valueError(w + " has " + std::to_string(list.size()) + " tensors, world_size is " + std::to_string(size_));
  for (size_t i = 0; i < list.size(); ++i) {
    if (list[i].scalar_type() != ref.scalar_type())
      typeError(w + "[" + std::to_string(i) + "] is " + torchName(list[i].scalar_type()) + ", expected " +
                torchName(ref.scalar_type()));
    if (list[i].numel() != ref.numel())
      valueError(w + "[" + std::to_string(i) + "] has " + std::to_string(list[i].numel()) + " elements, expected " +
                 std::to_string(ref.numel()) + " (all ranks' tensors must have the same size)");
  }
}

void ProcessGroupACCL::checkOpen() const {
  std::lock_guard<std::mutex> lock(const_cast<std::mutex&>(mu_));
  if (!aborted_.empty())
    throw AbortedError("accl: process group is aborted (" + aborted_ +
                       "); create a new one (or restart) to communicate again");
}

const Reduction& ProcessGroupACCL::reduction(const at::Tensor& t, const c10d::ReduceOp& op, const char* what) const {
  return reductionFor(t.scalar_type(), op.op_, what);
}

Engine* ProcessGroupACCL::engineFor(const std::string& coll, int64_t dcode, int64_t ocode) {
  if (!engine_) return nullptr;
  if (engine_->supports(coll, dcode, ocode)) return engine_.get();
  if (std::find(opts_.sidestep.begin(), opts_.sidestep.end(), coll) != opts_.sidestep.end()) {
    stats_.sidestepCalls.fetch_add(1);
    return nullptr;
  }
  std::string what = coll;
  if (dcode) what += " of torch." + wire::dtypeName(dcode);
  if (ocode) what += " with " + opName(static_cast<RedOpType>(ocode - 1));
  throw c10::NotImplementedError("accl: the " + engine_->name() + " engine cannot do " + what +
                                 " and sidestep to MPI is disabled for '" + coll +
                                 "' (AcclOptions.sidestep / TORCHHPC_ACCL_SIDESTEP)");
}

// ---------------------------------------------------------------------------------------- the one rule

bool ProcessGroupACCL::needsHeader(int64_t bytes) const {
  // always when checked; unchecked, when the call does not fit one nonblocking call: the header then proves
  // that every rank arrived before MPI's blocking calls
  int64_t unchecked = std::min(opts_.maxSegmentBytes, opts_.thresholdBytes - 1);
  return opts_.check || bytes > unchecked;
}

int64_t ProcessGroupACCL::perSegment(size_t esz, int parts) const {
  return std::max<int64_t>(1, opts_.maxSegmentBytes / static_cast<int64_t>(esz * parts));
}

// ---------------------------------------------------------------------------------------- running calls

std::unique_ptr<Call> ProcessGroupACCL::newCall(wire::Kind kind, int64_t dcode, int64_t ocode, int64_t root,
                                                int64_t nbytes, int64_t numel, std::vector<at::Tensor> outputs,
                                                c10d::OpType type) {
  auto c = std::make_unique<Call>();
  c->head.kind = kind;
  c->head.dtype = dcode;
  c->head.op = ocode;
  c->head.root = root;
  c->head.nbytes = nbytes;
  c->head.numel = numel;
  c->stream = callerStream(outputs);
  c->work = c10::make_intrusive<WorkACCL>(rank_, type, "", std::move(outputs));
  return c;
}

std::string ProcessGroupACCL::describe(const Call& c) const {
  return wire::describe(c.head);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupACCL::enqueue(std::unique_ptr<Call> call, bool asyncOp) {
  auto work = call->work;
  std::unique_lock<std::mutex> lock(mu_);
  if (!aborted_.empty())
    throw AbortedError("accl: process group is aborted (" + aborted_ +
                       "); create a new one (or restart) to communicate again");
  call->head.seq = seq_++;
  work->name(call->head, groupNameShared());
  if (!asyncOp && queue_.empty() && !running_) {  // idle group, synchronous call: the caller's thread runs it
    running_ = true;
    lock.unlock();
    execute(std::move(call));
    lock.lock();
    running_ = false;
    lock.unlock();
    cv_.notify_all();
    return work;
  }
  queue_.push_back(std::move(call));
  stats_.queuedCalls.fetch_add(1, std::memory_order_relaxed);
  ensureWorker();
  lock.unlock();
  cv_.notify_all();
  return work;
}

void ProcessGroupACCL::ensureWorker() {
  if (!worker_.joinable()) worker_ = std::thread([this] { workerLoop(); });
}

void ProcessGroupACCL::workerLoop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    auto ready = [&] { return stop_ || (!queue_.empty() && !running_); };
    if (p2pPending_.load() > 0) cv_.wait_for(lock, std::chrono::microseconds(200), ready);
    else cv_.wait_for(lock, std::chrono::milliseconds(100), ready);
    if (stop_) return;
    if (!queue_.empty() && !running_) {
      auto call = std::move(queue_.front());
      queue_.pop_front();
      running_ = true;
      lock.unlock();
      execute(std::move(call));
      lock.lock();
      running_ = false;
      cv_.notify_all();
    }
    if (p2pPending_.load() > 0) {
      lock.unlock();
      progressP2P();
      lock.lock();
    }
  }
}

void ProcessGroupACCL::execute(std::unique_ptr<Call> call) {
  auto work = call->work;
  std::exception_ptr error;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!aborted_.empty()) error = abortError_;  // queued behind the call that aborted the group: its error
  }
  if (!error) {
    try {
      run(*call);
    } catch (const PeerTimeoutError&) {
      error = std::current_exception();
      abandoned_.push_back(std::move(call));  // MPI may still complete the given-up requests into its buffers
    } catch (const MpiCallError& e) {
      error = mpiFailure(e.rc, describe(*call));
    } catch (...) {
      error = std::current_exception();
    }
  }
  work->complete(error);
}

void ProcessGroupACCL::run(Call& c) {
  deadline_ = Clock::now() + opts_.timeout;
  c10::OptionalStreamGuard onCallerStream(c.stream);  // staging copies of device tensors (host())
  if (c.stage) c.stage();
  if (c.header) {
    exchangeHeader(c);
    if (c.fused && c.fused(all_.data())) {
      if (c.finish) c.finish();
      return;
    }
  }
  Mode mode = c.header ? Mode::kBlocking : Mode::kNonblocking;
  if (c.data) {
    WaitFn wait = [&](MPI_Request r) {
      if (r != MPI_REQUEST_NULL) {
        waitRequest(r, c);
      }
    };
    c.data(mode, wait);
  }
  if (c.finish) c.finish();
}

void ProcessGroupACCL::exchangeHeader(Call& c) {
  c.head.magic = wire::kMagic;
  std::memset(mine_.data(), 0, kHdr);
  std::memcpy(mine_.data(), &c.head, sizeof(wire::Header));
  if (c.pack) c.pack(mine_.data() + kHdr);
  int rc = persistent_ ? MPI_Start(&hreq_)
                       : MPI_Iallgather(mine_.data(), kSlot, MPI_BYTE, all_.data(), kSlot, MPI_BYTE, ctl_, &hreq_);
  if (rc != MPI_SUCCESS) throw c10::DistBackendError("accl: starting the header exchange failed");
  waitRequest(hreq_, c);
  const int64_t* me = &c.head.magic;
  bool same = true;
  std::vector<wire::Header> heads(size_);
  for (int r = 0; r < size_; ++r) {
    std::memcpy(&heads[r], all_.data() + r * kSlot, sizeof(wire::Header));
    const int64_t* f = &heads[r].magic;
    for (int i = 0; i < c.compare; ++i) same = same && f[i] == me[i];
  }
  if (!same) throw MismatchError(wire::describeMismatch(heads, c.compare, groupName()));
}

void ProcessGroupACCL::waitRequest(MPI_Request& req, const Call& call) {
  Backoff backoff;
  int done = 0;
  while (true) {
    int rc = MPI_Test(&req, &done, MPI_STATUS_IGNORE);
    if (rc != MPI_SUCCESS) raiseMpi(rc, describe(call));
    if (done) return;
    if (Clock::now() > deadline_) expire(describe(call));
    backoff.pause();
  }
}

std::vector<int> ProcessGroupACCL::failedRanks() {
  std::vector<int> out;
#ifdef MPIX_ERR_PROC_FAILED
  for (MPI_Comm comm : {coll_, ctl_, p2pHead_, p2pData_}) {
    MPI_Group failed, mine;
    if (MPIX_Comm_get_failed(comm, &failed) != MPI_SUCCESS) continue;
    MPI_Comm_group(comm, &mine);
    int n = 0;
    MPI_Group_size(failed, &n);
    std::vector<int> in(n), ranks(n);
    for (int i = 0; i < n; ++i) in[i] = i;
    MPI_Group_translate_ranks(failed, n, in.data(), mine, ranks.data());
    for (int r : ranks)
      if (r >= 0 && std::find(out.begin(), out.end(), r) == out.end()) out.push_back(r);
    MPI_Group_free(&failed);
    MPI_Group_free(&mine);
  }
  std::sort(out.begin(), out.end());
#endif
  return out;
}

void ProcessGroupACCL::abortWith(const std::string& why, std::exception_ptr error) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!aborted_.empty()) return;
  aborted_ = why;
  abortError_ = std::move(error);
}

std::exception_ptr ProcessGroupACCL::mpiFailure(int rc, const std::string& what) {
  char text[MPI_MAX_ERROR_STRING] = {};
  int len = 0, cls = 0;
  MPI_Error_string(rc, text, &len);
  MPI_Error_class(rc, &cls);
  const std::string mpiText(text, static_cast<size_t>(len));
#ifdef MPIX_ERR_PROC_FAILED
  if (cls == MPIX_ERR_PROC_FAILED || cls == MPIX_ERR_PROC_FAILED_PENDING || cls == MPIX_ERR_REVOKED) {
    // revoke every communicator of the group, so that every survivor's pending and next calls fail at once
    for (MPI_Comm comm : {coll_, ctl_, p2pHead_, p2pData_}) MPIX_Comm_revoke(comm);
    // a rank told only by a revocation may learn who died from the runtime's notice a moment later
    std::vector<int> ranks = failedRanks();
    for (auto until = Clock::now() + std::chrono::milliseconds(250);
         ranks.empty() && cls == MPIX_ERR_REVOKED && Clock::now() < until; ranks = failedRanks())
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    std::string who = "a peer rank (a survivor revoked the group after seeing it die)";
    if (!ranks.empty()) {
      who = ranks.size() > 1 ? "peer ranks " : "peer rank ";
      for (size_t i = 0; i < ranks.size(); ++i) who += (i ? ", " : "") + std::to_string(ranks[i]);
    }
    const std::string msg = "accl: " + who + " of group '" + groupName() + "' died during " + what + " on rank " +
                            std::to_string(rank_) + " of " + std::to_string(size_) + " (MPI: " + mpiText +
                            "). The group is aborted; later calls on it raise at once. Restart the job (e.g. "
                            "from a checkpoint) or rebuild the group from the survivors.";
    auto error = std::make_exception_ptr(PeerFailedError(msg, ranks));
    abortWith(msg, error);
    return error;
  }
#endif
  return std::make_exception_ptr(c10::DistBackendError("accl: MPI error during " + what + ": " + mpiText));
}

void ProcessGroupACCL::expire(const std::string& what) {
  std::string msg = "accl: " + what + " in group '" + groupName() + "' (rank " + std::to_string(rank_) + " of " +
                    std::to_string(size_) + ") did not complete within the group timeout of " +
                    seconds(opts_.timeout) +
                    " s: a peer rank died, hung, or did not make the matching call. The group is aborted; later "
                    "calls on it raise at once.";
  PeerTimeoutError error(msg);
  abortWith(msg, std::make_exception_ptr(error));
  throw error;
}

void ProcessGroupACCL::reduceRows(const Reduction& red, int64_t count, int64_t nbytes, int64_t offset, void* dst) {
  // every rank's payload from byte `offset`, reduced in rank order with MPI's own op (as the large path)
  unsigned char* acc = all_.data() + kHdr + offset;
  for (int r = 1; r < size_; ++r) {
    int rc = MPI_Reduce_local(all_.data() + r * kSlot + kHdr + offset, acc, static_cast<int>(count), red.type,
                              red.mpiOp);
    if (rc != MPI_SUCCESS) throw MpiCallError(rc, "accl: MPI_Reduce_local failed");
  }
  std::memcpy(dst, acc, static_cast<size_t>(nbytes));
}

// ============================================================================================== collectives

std::unique_ptr<Call> ProcessGroupACCL::allreduceCall(std::vector<at::Tensor> ts, const Reduction& red,
                                                      wire::Kind kind, c10d::OpType type) {
  int64_t numel = 0;
  for (auto& x : ts) numel += x.numel();
  const int64_t nbytes = numel * static_cast<int64_t>(red.esz);
  auto c = newCall(kind, red.dcode, red.ocode, 0, nbytes, numel, ts, type);
  c->header = needsHeader(nbytes);
  Engine* eng = engineFor("allreduce", red.dcode, red.ocode);
  auto buf = std::make_shared<at::Tensor>();
  const Reduction* r = &red;
  c->stage = [ts, buf] {
    if (ts.size() == 1) {
      *buf = host(ts[0], true);
      return;
    }
    std::vector<at::Tensor> flat;
    for (auto& x : ts) flat.push_back(x.reshape({-1}).cpu());
    *buf = at::cat(flat);
  };
  if (!eng && c->header && nbytes <= static_cast<int64_t>(kPay)) {  // the data ride in the header slot
    c->pack = [buf, nbytes](unsigned char* slot) { std::memcpy(slot, buf->data_ptr(), nbytes); };
    c->fused = [this, buf, numel, nbytes, r](const unsigned char*) {
      if (numel) reduceRows(*r, numel, nbytes, 0, buf->data_ptr());
      return true;
    };
  }
  c->data = [this, buf, numel, r, eng](Mode m, const WaitFn& wait) {
    for (int64_t off = 0, per = perSegment(r->esz); off < numel; off += per) {
      const int64_t cnt = std::min(per, numel - off);
      if (eng) {
        stats_.count(cnt * r->esz);
        eng->allreduce(buf->narrow(0, off, cnt), r->ocode);
      } else {
        wait(mpi_->allreduce(ptr(*buf) + off * r->esz, static_cast<int>(cnt), *r, m));
      }
    }
  };
  c->finish = [ts, buf, r, p = size_] {
    if (r->avg) buf->div_(p);
    int64_t off = 0;
    for (auto& x : ts) {
      deliver(ts.size() == 1 ? *buf : buf->narrow(0, off, x.numel()), x);
      off += x.numel();
    }
  };
  return c;
}

c10::intrusive_ptr<c10d::Work> ProcessGroupACCL::allreduce(std::vector<at::Tensor>& tensors,
                                                           const c10d::AllreduceOptions& opts) {
  if (tensors.size() == 1 && tensors[0].is_sparse()) return allreduce_sparse(tensors, opts);
  const at::Tensor& t = one(tensors, "all_reduce");
  const Reduction& red = reduction(t, opts.reduceOp, "all_reduce");
  checkOpen();
  return enqueue(allreduceCall(tensors, red, wire::kAllReduce, c10d::OpType::ALLREDUCE), opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupACCL::allreduce_sparse(std::vector<at::Tensor>& tensors,
                                                                  const c10d::AllreduceOptions& opts) {
  if (tensors.size() != 1)
    valueError("accl: all_reduce takes exactly one tensor per call, got " + std::to_string(tensors.size()));
  const at::Tensor& t = tensors[0];
  if (t.layout() != at::kSparse) typeError("accl: sparse all_reduce needs a sparse COO tensor");
  if (opts.reduceOp.op_ != RedOpType::SUM)
    valueError("accl: sparse all_reduce supports ReduceOp.SUM only (as gloo), got ReduceOp." +
               opName(opts.reduceOp.op_));
  checkOpen();
  return enqueue(sparseCall(t, opts.reduceOp), opts.asyncOp);
}

std::unique_ptr<Call> ProcessGroupACCL::sparseCall(const at::Tensor& t, const c10d::ReduceOp& op) {
  // every rank's (indices, values) all-gathered, then summed by coalescing (gloo's algorithm): the header
  // checks dtype and dense size; the nnz counts travel first
  const int p = size_;
  auto c = newCall(wire::kAllReduce, wire::dtypeCode(t.scalar_type()), wire::opCode(op.op_), 0, 0, t.numel(), {t},
                   c10d::OpType::_ALLREDUCE_SPARSE);
  c->head.extra = t.sparse_dim();
  struct State {
    at::Tensor indices, values;  // this rank's, coalesced: [nnz, sparse_dim] and [nnz, dense...]
    at::Tensor result;
  };
  auto st = std::make_shared<State>();
  c->stage = [t, st] {
    at::Tensor mine = t.cpu().coalesce();
    st->indices = mine.indices().t().contiguous();
    st->values = mine.values().contiguous();
  };
  c->data = [this, t, st, p](Mode m, const WaitFn& wait) {
    std::vector<int64_t> nnz(p);
    int64_t mineNnz = st->indices.size(0);
    MPI_Allgather(&mineNnz, 1, MPI_INT64_T, nnz.data(), 1, MPI_INT64_T, coll_);
    int64_t total = 0;
    for (int64_t n : nnz) total += n;
    const int64_t sd = t.sparse_dim(), row = st->values.numel() / std::max<int64_t>(1, mineNnz);
    std::vector<int64_t> valueShape{total};
    for (int64_t d = 1; d < st->values.dim(); ++d) valueShape.push_back(st->values.size(d));
    at::Tensor indices = at::empty({total, sd}, st->indices.options());
    at::Tensor values = at::empty(valueShape, st->values.options());
    const int64_t valueRow = total ? values.numel() / total : row;
    std::vector<int> counts(p), displs(p);
    auto gatherRows = [&](const at::Tensor& mine, at::Tensor& all, int64_t rowBytes) {
      int64_t off = 0;
      for (int r = 0; r < p; ++r) {
        counts[r] = static_cast<int>(nnz[r] * rowBytes);
        displs[r] = static_cast<int>(off);
        off += counts[r];
      }
      wait(mpi_->allgatherv(mine.data_ptr(), counts[rank_], all.data_ptr(), counts.data(), displs.data(), m));
    };
    gatherRows(st->indices, indices, sd * 8);
    gatherRows(st->values, values, valueRow * static_cast<int64_t>(values.element_size()));
    st->result = at::sparse_coo_tensor(indices.t(), values, t.sizes()).coalesce();
  };
  c->finish = [t, st] { at::Tensor(t).copy_(st->result.to(t.device())); };
  return c;
}

c10::intrusive_ptr<c10d::Work> ProcessGroupACCL::allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                                     const c10d::AllreduceCoalescedOptions& opts) {
  if (tensors.empty()) valueError("accl: all_reduce_coalesced needs at least one tensor");
  for (auto& t : tensors) {
    if (t.scalar_type() != tensors[0].scalar_type())
      typeError("accl: all_reduce_coalesced needs tensors of one dtype, got " + torchName(tensors[0].scalar_type()) +
                " and " + torchName(t.scalar_type()));
    if (t.device() != tensors[0].device()) valueError("accl: all_reduce_coalesced needs tensors on one device");
  }
  const Reduction& red = reduction(tensors[0], opts.reduceOp, "all_reduce_coalesced");
  checkOpen();
  return enqueue(allreduceCall(tensors, red, wire::kAllReduceCoalesced, c10d::OpType::ALLREDUCE_COALESCED),
                 opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupACCL::broadcast(std::vector<at::Tensor>& tensors,
                                                           const c10d::BroadcastOptions& opts) {
  const at::Tensor& t = one(tensors, "broadcast");
  if (opts.rootTensor != 0) valueError("accl: broadcast rootTensor must be 0, got " + std::to_string(opts.rootTensor));
  checkRoot(opts.rootRank, "broadcast");
  checkOpen();
  const int root = static_cast<int>(opts.rootRank);
  const bool isRoot = rank_ == root;
  const int64_t nbytes = static_cast<int64_t>(t.nbytes());
  auto c = newCall(wire::kBroadcast, wire::dtypeCode(t.scalar_type()), 0, root, nbytes, t.numel(), {t},
                   c10d::OpType::BROADCAST);
  c->header = needsHeader(nbytes);
  Engine* eng = engineFor("broadcast", c->head.dtype);
  auto buf = std::make_shared<at::Tensor>();
  c->stage = [t, buf, isRoot] { *buf = host(t, isRoot); };
  if (!eng && c->header && nbytes <= static_cast<int64_t>(kPay)) {
    c->pack = [buf, nbytes, isRoot](unsigned char* slot) {
      if (isRoot) std::memcpy(slot, buf->data_ptr(), nbytes);
    };
    c->fused = [buf, nbytes, isRoot, root](const unsigned char* all) {
      if (!isRoot && nbytes) std::memcpy(buf->data_ptr(), all + root * kSlot + kHdr, nbytes);
      return true;
    };
  }
  c->data = [this, buf, nbytes, root, eng](Mode m, const WaitFn& wait) {
    const int64_t esz = buf->element_size(), numel = nbytes / std::max<int64_t>(esz, 1);
    for (int64_t off = 0, per = perSegment(esz); eng && off < numel; off += per) {
      stats_.count(std::min(per, numel - off) * esz);
      eng->broadcast(buf->narrow(0, off, std::min(per, numel - off)), root);
    }
    for (int64_t off = 0, per = opts_.maxSegmentBytes; !eng && off < nbytes; off += per)
      wait(mpi_->bcast(ptr(*buf) + off, static_cast<int>(std::min(per, nbytes - off)), root, m));
  };
  c->finish = [t, buf, isRoot] {
    if (!isRoot) deliver(*buf, t);
  };
  return enqueue(std::move(c), opts.asyncOp);
}

std::unique_ptr<Call> ProcessGroupACCL::allgatherCall(const at::Tensor& input, const at::Tensor& output,
                                                      std::function<void(const at::Tensor&)> deliverRows,
                                                      std::vector<at::Tensor> outputs, c10d::OpType type) {
  const int p = size_;
  const int64_t nbytes = static_cast<int64_t>(input.nbytes()), esz = input.element_size();
  auto c = newCall(wire::kAllGather, wire::dtypeCode(input.scalar_type()), 0, 0, nbytes, input.numel(),
                   std::move(outputs), type);
  c->header = needsHeader(nbytes * p);
  Engine* eng = engineFor("allgather", c->head.dtype);
  auto src = std::make_shared<at::Tensor>(), dst = std::make_shared<at::Tensor>();
  c->stage = [input, output, src, dst, p] {
    *src = host(input, true);
    *dst = output.defined() && direct(output) ? output.view({-1})
                                              : at::empty({input.numel() * p}, input.options().device(at::kCPU));
  };
  if (!eng && c->header && nbytes <= static_cast<int64_t>(kPay)) {
    c->pack = [src, nbytes](unsigned char* slot) { std::memcpy(slot, src->data_ptr(), nbytes); };
    c->fused = [dst, nbytes, p](const unsigned char* all) {
      for (int r = 0; r < p && nbytes; ++r) std::memmove(ptr(*dst) + r * nbytes, all + r * kSlot + kHdr, nbytes);
      return true;
    };
  }
  c->data = [this, src, dst, nbytes, esz, p, eng](Mode m, const WaitFn& wait) {
    const int64_t n = nbytes / std::max<int64_t>(esz, 1);
    for (int64_t off = 0, per = perSegment(esz, p); eng && off < n; off += per) {
      const int64_t cnt = std::min(per, n - off);
      at::Tensor rows = at::empty({p, cnt}, src->options());
      stats_.count(p * cnt * esz);
      eng->allgather(src->narrow(0, off, cnt), rows);
      dst->view({p, n}).narrow(1, off, cnt).copy_(rows);
    }
    for (int64_t off = 0, per = perSegment(esz, p) * esz; !eng && off < nbytes; off += per)
      wait(mpi_->allgather(ptr(*src) + off, ptr(*dst) + off, static_cast<int>(std::min(per, nbytes - off)), nbytes, m));
  };
  c->finish = [output, dst, deliverRows] {
    if (output.defined()) deliver(*dst, output);
    if (deliverRows) deliverRows(*dst);
  };
  return c;
}

c10::intrusive_ptr<c10d::Work> ProcessGroupACCL::_allgather_base(at::Tensor& output, at::Tensor& input,
                                                                 const c10d::AllgatherOptions& opts) {
  checkSameDtype(output, input, "all_gather_into_tensor");
  const int64_t p = size_, n = input.numel();
  if (output.numel() != p * n)
    valueError("accl: all_gather_into_tensor output has " + std::to_string(output.numel()) +
               " elements, needs world_size * input = " + std::to_string(p) + " * " + std::to_string(n) + " = " +
               std::to_string(p * n));
  checkOpen();
  return enqueue(allgatherCall(input, output, nullptr, {output}, c10d::OpType::_ALLGATHER_BASE), opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupACCL::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                                           std::vector<at::Tensor>& inputs,
                                                           const c10d::AllgatherOptions& opts) {
  const at::Tensor& input = one(inputs, "all_gather");
  if (outputs.size() != 1)
    valueError("accl: all_gather takes one output list, got " + std::to_string(outputs.size()));
  checkList(outputs[0], input, "all_gather", "output_tensor_list");
  checkOpen();
  std::vector<at::Tensor> outs = outputs[0];
  const int64_t n = input.numel();
  auto rows = [outs, n](const at::Tensor& all) {
    for (size_t r = 0; r < outs.size(); ++r) deliver(all.narrow(0, static_cast<int64_t>(r) * n, n), outs[r]);
  };
  return enqueue(allgatherCall(input, at::Tensor(), rows, outs, c10d::OpType::ALLGATHER), opts.asyncOp);
}

void ProcessGroupACCL::checkPairs(const std::vector<at::Tensor>& outputs, const std::vector<at::Tensor>& inputs,
                                  const char* what) const {
  if (outputs.size() != inputs.size() || inputs.empty())
    valueError(std::string("accl: ") + what + "_coalesced needs matching, non-empty lists");
}

c10::intrusive_ptr<c10d::Work> ProcessGroupACCL::allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                                 std::vector<at::Tensor>& inputs,
                                                                                 const c10d::AllgatherOptions& opts) {
  checkPairs(outputs, inputs, "all_gather_into_tensor");
  c10::intrusive_ptr<c10d::Work> last;
  for (size_t i = 0; i < inputs.size(); ++i) last = _allgather_base(outputs[i], inputs[i], opts);
  return last;
}

c10::intrusive_ptr<c10d::Work> ProcessGroupACCL::allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputLists,
                                                                     std::vector<at::Tensor>& inputs,
                                                                     const c10d::AllgatherOptions& opts) {
  // outputLists[r][j] receives rank r's inputs[j] (torch's layout: one list per rank)
  if (inputs.empty()) valueError("accl: all_gather_coalesced needs at least one input tensor");
  bool shaped = static_cast<int>(outputLists.size()) == size_;
  for (auto& l : outputLists) shaped = shaped && l.size() == inputs.size();
  if (!shaped)
    valueError("accl: all_gather_coalesced needs " + std::to_string(size_) +
               " output lists (one per rank), each with one tensor per input tensor (" +
               std::to_string(inputs.size()) + ")");
  c10::intrusive_ptr<c10d::Work> last;
  for (size_t j = 0; j < inputs.size(); ++j) {
    std::vector<std::vector<at::Tensor>> outs(1);
    for (auto& l : outputLists) outs[0].push_back(l[j]);
    std::vector<at::Tensor> in{inputs[j]};
    last = allgather(outs, in, opts);
  }
  return last;
}

c10::intrusive_ptr<c10d::Work> ProcessGroupACCL::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs, const c10d::ReduceScatterOptions& opts) {
  checkPairs(outputs, inputs, "reduce_scatter_tensor");
  c10::intrusive_ptr<c10d::Work> last;
  for (size_t i = 0; i < inputs.size(); ++i) last = _reduce_scatter_base(outputs[i], inputs[i], opts);
  return last;
}

std::unique_ptr<Call> ProcessGroupACCL::reduceScatterCall(std::function<at::Tensor()> rows, const at::Tensor& output,
                                                          const Reduction& red, c10d::OpType type) {
  const int p = size_;
  const int64_t n = output.numel(), esz = static_cast<int64_t>(red.esz), nbytes = n * esz;
  auto c = newCall(wire::kReduceScatter, red.dcode, red.ocode, 0, nbytes, n, {output}, type);
  c->header = needsHeader(nbytes * p);
  Engine* eng = engineFor("reduce_scatter", red.dcode, red.ocode);
  const Reduction* r = &red;
  auto src = std::make_shared<at::Tensor>(), dst = std::make_shared<at::Tensor>();
  c->stage = [rows, output, src, dst] {
    *src = rows();
    *dst = host(output, false);
  };
  if (!eng && c->header && nbytes * p <= static_cast<int64_t>(kPay)) {
    c->pack = [src, nbytes, p](unsigned char* slot) { std::memcpy(slot, src->data_ptr(), nbytes * p); };
    c->fused = [this, dst, n, nbytes, r](const unsigned char*) {
      if (n) reduceRows(*r, n, nbytes, rank_ * nbytes, dst->data_ptr());
      return true;
    };
  }
  c->data = [this, src, dst, n, esz, p, r, eng](Mode m, const WaitFn& wait) {
    const int64_t per = perSegment(esz, p);
    for (int64_t off = 0; eng && off < n; off += per) {
      const int64_t cnt = std::min(per, n - off);
      stats_.count(p * cnt * esz);
      eng->reduceScatter(src->view({p, n}).narrow(1, off, cnt).contiguous(), dst->narrow(0, off, cnt), r->ocode);
    }
    if (eng) return;
    if (per >= n) {
      if (n) wait(mpi_->reduceScatter(ptr(*src), ptr(*dst), static_cast<int>(n), *r, m));
      return;
    }
    // each segment's rows copied together, into torch's allocator (not zero-filled; huge pages where torch uses them)
    at::Tensor rows = at::empty({per * esz * p}, at::TensorOptions().dtype(at::kByte));
    for (int64_t off = 0; off < n; off += per) {
      const int64_t cnt = std::min(per, n - off);
      for (int k = 0; k < p; ++k) std::memcpy(ptr(rows) + k * cnt * esz, ptr(*src) + (k * n + off) * esz, cnt * esz);
      wait(mpi_->reduceScatter(ptr(rows), ptr(*dst) + off * esz, static_cast<int>(cnt), *r, m));
    }
  };
  c->finish = [output, dst, r, p] {
    if (r->avg) dst->div_(p);
    deliver(*dst, output);
  };
  return c;
}

c10::intrusive_ptr<c10d::Work> ProcessGroupACCL::_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                                      const c10d::ReduceScatterOptions& opts) {
  checkSameDtype(output, input, "reduce_scatter_tensor");
  const int64_t p = size_, n = output.numel();
  if (input.numel() != p * n)
    valueError("accl: reduce_scatter_tensor input has " + std::to_string(input.numel()) +
               " elements, needs world_size * output = " + std::to_string(p) + " * " + std::to_string(n) + " = " +
               std::to_string(p * n));
  const Reduction& red = reduction(output, opts.reduceOp, "reduce_scatter");
  checkOpen();
  auto rows = [input] { return host(input, true); };
  return enqueue(reduceScatterCall(rows, output, red, c10d::OpType::_REDUCE_SCATTER_BASE), opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupACCL::reduce_scatter(std::vector<at::Tensor>& outputs,
                                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                                const c10d::ReduceScatterOptions& opts) {
  const at::Tensor& output = one(outputs, "reduce_scatter");
  if (inputs.size() != 1) valueError("accl: reduce_scatter takes one input list");
  checkList(inputs[0], output, "reduce_scatter", "input_list");
  const Reduction& red = reduction(output, opts.reduceOp, "reduce_scatter");
  checkOpen();
  std::vector<at::Tensor> ins = inputs[0];
  auto rows = [ins] {
    std::vector<at::Tensor> flat;
    for (auto& x : ins) flat.push_back(x.reshape({-1}).cpu());
    return at::cat(flat);
  };
  return enqueue(reduceScatterCall(rows, output, red, c10d::OpType::REDUCE_SCATTER), opts.asyncOp);
}

std::vector<int64_t> ProcessGroupACCL::splits(const std::vector<int64_t>& sizes, const at::Tensor& t,
                                              const char* name) const {
  const int64_t p = size_, rows = t.dim() ? t.size(0) : 1;
  const std::string w = std::string("accl: all_to_all_single ") + name;
  if (sizes.empty()) {
    if (t.dim() == 0 || t.size(0) % p)
      valueError(w + " dim 0 (" + shape(t) + ") is not divisible by world_size " + std::to_string(p) +
                 "; pass split sizes");
    return std::vector<int64_t>(p, t.size(0) / p);
  }
  if (static_cast<int64_t>(sizes.size()) != p)
    valueError(w + "_split_sizes has " + std::to_string(sizes.size()) + " entries, world_size is " + std::to_string(p));
  int64_t sum = 0;
  for (int64_t s : sizes) {
    if (s < 0) valueError(w + "_split_sizes must be >= 0");
    sum += s;
  }
  if (sum != rows)
    valueError(w + "_split_sizes sum to " + std::to_string(sum) + " but " + name + " has " + std::to_string(rows) +
               " rows");
  return sizes;
}

c10::intrusive_ptr<c10d::Work> ProcessGroupACCL::alltoall_base(at::Tensor& output, at::Tensor& input,
                                                               std::vector<int64_t>& outputSplits,
                                                               std::vector<int64_t>& inputSplits,
                                                               const c10d::AllToAllOptions& opts) {
  checkSameDtype(output, input, "all_to_all_single");
  const int64_t p = size_, esz = input.element_size();
  std::vector<int64_t> sb, rb;
  const bool sameRows = (input.dim() == 1 && output.dim() == 1) ||
                        (input.dim() > 0 && output.dim() > 0 && input.sizes().slice(1) == output.sizes().slice(1));
  if (inputSplits.empty() && outputSplits.empty() && input.dim() && output.dim() && input.size(0) % p == 0 &&
      output.size(0) % p == 0 && sameRows) {  // even splits: equal blocks
    sb.assign(p, input.numel() * esz / p);
    rb.assign(p, output.numel() * esz / p);
  } else {
    const int64_t rowIn = input.dim() > 0 && input.size(0) ? input.numel() / input.size(0) : 0;
    const int64_t rowOut = output.dim() > 0 && output.size(0) ? output.numel() / output.size(0) : 0;
    const int64_t row = input.dim() > 1 || output.dim() > 1 ? std::max({rowIn, rowOut, int64_t{1}}) : 1;
    for (int64_t s : splits(inputSplits, input, "input")) sb.push_back(s * row * esz);
    for (int64_t s : splits(outputSplits, output, "output")) rb.push_back(s * row * esz);
  }
  checkOpen();
  engineFor("alltoallv", wire::dtypeCode(input.scalar_type()));  // no engine has it: MPI's, if allowed
  return enqueue(alltoallCall(input, output, sb, rb, c10d::OpType::ALLTOALL_BASE), opts.asyncOp);
}

namespace {

// the agreed byte matrix: rows[i * stride + j] is what rank i sends to rank j, rows[j * stride + p + i] what j
// expects from i; a mismatch names the first pair. Returns the largest send, which fixes the segment rounds.
int64_t checkAlltoallMatrix(const int64_t* rows, int64_t stride, int p) {
  int64_t bad = 0, bi = 0, bj = 0, most = 0;
  for (int i = 0; i < p; ++i)
    for (int j = 0; j < p; ++j) {
      int64_t s = rows[i * stride + j], r = rows[j * stride + p + i];
      if (s != r && bad++ == 0) {
        bi = i;
        bj = j;
      }
      most = std::max(most, s);
    }
  if (bad)
    throw MismatchError("accl: all_to_all split sizes do not match across ranks: rank " + std::to_string(bi) +
                        " sends " + std::to_string(rows[bi * stride + bj]) + " bytes to rank " + std::to_string(bj) +
                        ", which expects " + std::to_string(rows[bj * stride + p + bi]) + " bytes from it (" +
                        std::to_string(bad) + " mismatched pairs)");
  return most;
}

// the sends that rode in the header slots after every rank's matrix row, into `dst` in rank order; false (nothing
// taken) unless every rank's sends fit its slot's `room`
bool alltoallFromSlots(const unsigned char* all, int p, int me, int64_t room, char* dst) {
  const auto* rows = reinterpret_cast<const int64_t*>(all + kHdr);
  const int64_t stride = kSlot / 8;
  for (int i = 0; i < p; ++i) {
    int64_t s = 0;
    for (int j = 0; j < p; ++j) s += rows[i * stride + j];
    if (s > room) return false;
  }
  for (int r = 0; r < p; ++r) {
    const int64_t* row = rows + r * stride;
    int64_t off = 16 * p;
    for (int j = 0; j < me; ++j) off += row[j];
    std::memcpy(dst, all + r * kSlot + kHdr + off, row[me]);
    dst += row[me];
  }
  return true;
}

// one MPI_Alltoallv per round of at most `per` bytes to and from each rank (counts and displacements in bytes)
void alltoallvRounds(MpiEngine& mpi, const std::vector<int64_t>& sb, const std::vector<int64_t>& rb, int64_t rounds,
                     int64_t per, char* src, char* dst, Mode m, const WaitFn& wait) {
  const int p = static_cast<int>(sb.size());
  std::vector<int> sc(p), sd(p), rc(p), rd(p);
  for (int64_t k = 0; k < rounds; ++k) {
    int64_t so = 0, ro = 0;
    for (int j = 0; j < p; ++j) {
      const int64_t a = std::min(k * per, sb[j]), b = std::min(k * per, rb[j]);
      sc[j] = static_cast<int>(std::min(per, sb[j] - a));
      sd[j] = static_cast<int>(so + a);
      rc[j] = static_cast<int>(std::min(per, rb[j] - b));
      rd[j] = static_cast<int>(ro + b);
      so += sb[j];
      ro += rb[j];
    }
    wait(mpi.alltoallv(src, sc.data(), sd.data(), dst, rc.data(), rd.data(), m));
  }
}

}  // namespace

std::unique_ptr<Call> ProcessGroupACCL::alltoallCall(const at::Tensor& input, const at::Tensor& output,
                                                     std::vector<int64_t> sb, std::vector<int64_t> rb,
                                                     c10d::OpType type, std::vector<at::Tensor> outputs,
                                                     std::function<void(const at::Tensor&)> deliverRows) {
  const int p = size_;
  auto c = newCall(wire::kAllToAll, wire::dtypeCode(input.scalar_type()), 0, 0, 0, 0,
                   outputs.empty() ? std::vector<at::Tensor>{output} : std::move(outputs), type);
  c->head.extra = p;
  c->compare = wire::kCompareCall;  // sizes are checked on the byte matrix
  c->header = true;                 // always: the matrix fixes the rounds and checks sends against receives
  struct State {
    std::vector<int64_t> sb, rb;
    int64_t rounds = 1;
    at::Tensor src, dst;
  };
  auto st = std::make_shared<State>();
  st->sb = std::move(sb);
  st->rb = std::move(rb);
  int64_t sent = 0;
  for (int64_t s : st->sb) sent += s;
  const bool inSlot = 16 * p <= static_cast<int64_t>(kPay);  // the matrix row rides in the slot
  const int64_t room = static_cast<int64_t>(kPay) - 16 * p, per = std::max<int64_t>(1, opts_.maxSegmentBytes / p);
  auto agree = [st, p, per](const int64_t* rows, int64_t stride) {
    st->rounds = std::max<int64_t>(1, (checkAlltoallMatrix(rows, stride, p) + per - 1) / per);
  };
  c->stage = [input, output, st] {
    st->src = host(input, true);
    st->dst = direct(output) ? output.view({-1}) : at::empty({output.numel()}, output.options().device(at::kCPU));
  };
  if (inSlot) {
    c->pack = [st, p, sent, room](unsigned char* slot) {
      std::memcpy(slot, st->sb.data(), 8 * p);
      std::memcpy(slot + 8 * p, st->rb.data(), 8 * p);
      if (sent <= room) std::memcpy(slot + 16 * p, st->src.data_ptr(), sent);
    };
    c->fused = [this, st, p, room, agree](const unsigned char* all) {
      agree(reinterpret_cast<const int64_t*>(all + kHdr), kSlot / 8);
      return alltoallFromSlots(all, p, rank_, room, ptr(st->dst));
    };
  }
  c->data = [this, st, p, per, inSlot, agree](Mode m, const WaitFn& wait) {
    if (!inSlot) {  // many ranks: the byte matrix by a second all-gather, then its check
      std::vector<int64_t> mine(st->sb), matrix(2 * p * p);
      mine.insert(mine.end(), st->rb.begin(), st->rb.end());
      MPI_Allgather(mine.data(), 2 * p, MPI_INT64_T, matrix.data(), 2 * p, MPI_INT64_T, coll_);
      agree(matrix.data(), 2 * p);
    }
    alltoallvRounds(*mpi_, st->sb, st->rb, st->rounds, per, ptr(st->src), ptr(st->dst), m, wait);
  };
  c->finish = [output, st, deliverRows] {
    if (deliverRows) deliverRows(st->dst);
    else if (output.numel()) deliver(st->dst, output);
  };
  return c;
}

c10::intrusive_ptr<c10d::Work> ProcessGroupACCL::alltoall(std::vector<at::Tensor>& outputs,
                                                          std::vector<at::Tensor>& inputs,
                                                          const c10d::AllToAllOptions& opts) {
  const size_t p = static_cast<size_t>(size_);
  if (outputs.size() != p || inputs.size() != p)
    valueError("accl: all_to_all needs " + std::to_string(p) + " input and " + std::to_string(p) +
               " output tensors, got " + std::to_string(inputs.size()) + " and " + std::to_string(outputs.size()));
  for (auto* list : {&inputs, &outputs})
    for (auto& t : *list)
      if (t.scalar_type() != inputs[0].scalar_type()) typeError("accl: all_to_all needs every tensor of one dtype");
  checkOpen();
  std::vector<int64_t> sb, rb;
  std::vector<at::Tensor> flat;
  int64_t total = 0;
  for (auto& t : inputs) {
    sb.push_back(static_cast<int64_t>(t.nbytes()));
    flat.push_back(t.reshape({-1}).cpu());
  }
  for (auto& t : outputs) {
    rb.push_back(static_cast<int64_t>(t.nbytes()));
    total += t.numel();
  }
  engineFor("alltoallv", wire::dtypeCode(inputs[0].scalar_type()));
  at::Tensor send = at::cat(flat), recv = at::empty({total}, inputs[0].options().device(at::kCPU));
  auto rows = [outputs](const at::Tensor& all) {
    int64_t off = 0;
    for (auto& t : outputs) {
      deliver(all.narrow(0, off, t.numel()), t);
      off += t.numel();
    }
  };
  return enqueue(alltoallCall(send, recv, sb, rb, c10d::OpType::ALLTOALL, outputs, rows), opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupACCL::reduce(std::vector<at::Tensor>& tensors,
                                                        const c10d::ReduceOptions& opts) {
  const at::Tensor& t = one(tensors, "reduce");
  checkRoot(opts.rootRank, "reduce");
  const Reduction& red = reduction(t, opts.reduceOp, "reduce");
  checkOpen();
  const int root = static_cast<int>(opts.rootRank);
  const bool isRoot = rank_ == root;
  const int64_t numel = t.numel(), nbytes = numel * static_cast<int64_t>(red.esz);
  auto c = newCall(wire::kReduce, red.dcode, red.ocode, root, nbytes, numel, {t}, c10d::OpType::REDUCE);
  c->header = needsHeader(nbytes);
  Engine* eng = engineFor("reduce", red.dcode, red.ocode);
  const Reduction* r = &red;
  auto buf = std::make_shared<at::Tensor>();
  c->stage = [t, buf, isRoot] { *buf = isRoot ? host(t, true) : t.reshape({-1}).cpu().contiguous(); };
  c->data = [this, buf, numel, r, root, eng](Mode m, const WaitFn& wait) {
    for (int64_t off = 0, per = perSegment(r->esz); off < numel; off += per) {
      const int64_t cnt = std::min(per, numel - off);
      if (eng) {
        stats_.count(cnt * r->esz);
        eng->reduce(buf->narrow(0, off, cnt), r->ocode, root);
      } else {
        wait(mpi_->reduce(ptr(*buf) + off * r->esz, static_cast<int>(cnt), *r, root, m));
      }
    }
  };
  c->finish = [t, buf, r, isRoot, p = size_] {
    if (!isRoot) return;  // the others' tensors are left as they were
    if (r->avg) buf->div_(p);
    deliver(*buf, t);
  };
  return enqueue(std::move(c), opts.asyncOp);
}

std::vector<at::Tensor> ProcessGroupACCL::rootList(const std::vector<std::vector<at::Tensor>>& lists,
                                                   const at::Tensor& ref, int64_t root, const char* what,
                                                   const char* name) const {
  if (rank_ == root) {
    if (lists.size() != 1) valueError(std::string("accl: ") + what + " on the root takes one " + name);
    checkList(lists[0], ref, what, name);
    return lists[0];
  }
  for (auto& l : lists)
    if (!l.empty()) valueError(std::string("accl: ") + name + " must be empty/None on non-root ranks");
  return {};
}

c10::intrusive_ptr<c10d::Work> ProcessGroupACCL::gather(std::vector<std::vector<at::Tensor>>& outputs,
                                                        std::vector<at::Tensor>& inputs,
                                                        const c10d::GatherOptions& opts) {
  const at::Tensor& input = one(inputs, "gather");
  checkRoot(opts.rootRank, "gather");
  std::vector<at::Tensor> outs = rootList(outputs, input, opts.rootRank, "gather", "gather_list");
  checkOpen();
  const int root = static_cast<int>(opts.rootRank), p = size_;
  const int64_t n = input.numel(), esz = input.element_size(), nbytes = n * esz;
  auto c = newCall(wire::kGather, wire::dtypeCode(input.scalar_type()), 0, root, nbytes, n, outs,
                   c10d::OpType::GATHER);
  if (!c->stream) c->stream = callerStream({input});  // off the root: no outputs
  c->header = needsHeader(nbytes * p);
  Engine* eng = engineFor("gather", c->head.dtype);
  auto src = std::make_shared<at::Tensor>(), dst = std::make_shared<at::Tensor>();
  c->stage = [input, src, dst, p, n, root, me = rank_] {
    *src = host(input, true);
    if (me == root) *dst = at::empty({p * n}, input.options().device(at::kCPU));
  };
  c->data = [this, src, dst, nbytes, esz, p, root, n, eng](Mode m, const WaitFn& wait) {
    for (int64_t off = 0, per = perSegment(esz, p); eng && off < n; off += per) {
      const int64_t cnt = std::min(per, n - off);
      at::Tensor rows = dst->defined() ? at::empty({p, cnt}, src->options()) : at::empty({0}, src->options());
      stats_.count(p * cnt * esz);
      eng->gather(src->narrow(0, off, cnt), rows, root);
      if (dst->defined()) dst->view({p, n}).narrow(1, off, cnt).copy_(rows);
    }
    for (int64_t off = 0, per = perSegment(esz, p) * esz; !eng && off < nbytes; off += per)
      wait(mpi_->gather(ptr(*src) + off, dst->defined() ? ptr(*dst) + off : nullptr,
                        static_cast<int>(std::min(per, nbytes - off)), nbytes, root, m));
  };
  c->finish = [outs, dst, n] {
    for (size_t r = 0; r < outs.size(); ++r) deliver(dst->narrow(0, static_cast<int64_t>(r) * n, n), outs[r]);
  };
  return enqueue(std::move(c), opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupACCL::scatter(std::vector<at::Tensor>& outputs,
                                                         std::vector<std::vector<at::Tensor>>& inputs,
                                                         const c10d::ScatterOptions& opts) {
  const at::Tensor& output = one(outputs, "scatter");
  checkRoot(opts.rootRank, "scatter");
  std::vector<at::Tensor> ins = rootList(inputs, output, opts.rootRank, "scatter", "scatter_list");
  checkOpen();
  const int root = static_cast<int>(opts.rootRank), p = size_;
  const int64_t n = output.numel(), esz = output.element_size(), nbytes = n * esz;
  auto c = newCall(wire::kScatter, wire::dtypeCode(output.scalar_type()), 0, root, nbytes, n, {output},
                   c10d::OpType::SCATTER);
  c->header = needsHeader(nbytes * p);
  Engine* eng = engineFor("scatter", c->head.dtype);
  auto src = std::make_shared<at::Tensor>(), dst = std::make_shared<at::Tensor>();
  c->stage = [ins, output, src, dst] {
    if (!ins.empty()) {
      std::vector<at::Tensor> flat;
      for (auto& x : ins) flat.push_back(x.reshape({-1}).cpu());
      *src = at::cat(flat);
    }
    *dst = host(output, false);
  };
  c->data = [this, src, dst, nbytes, esz, p, root, n, eng](Mode m, const WaitFn& wait) {
    for (int64_t off = 0, per = perSegment(esz, p); eng && off < n; off += per) {
      const int64_t cnt = std::min(per, n - off);
      at::Tensor rows = src->defined() ? src->view({p, n}).narrow(1, off, cnt).contiguous()
                                       : at::empty({0}, dst->options());
      stats_.count(p * cnt * esz);
      eng->scatter(rows, dst->narrow(0, off, cnt), root);
    }
    for (int64_t off = 0, per = perSegment(esz, p) * esz; !eng && off < nbytes; off += per)
      wait(mpi_->scatter(src->defined() ? ptr(*src) + off : nullptr, nbytes, ptr(*dst) + off,
                         static_cast<int>(std::min(per, nbytes - off)), root, m));
  };
  c->finish = [output, dst] { deliver(*dst, output); };
  return enqueue(std::move(c), opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupACCL::barrier(const c10d::BarrierOptions& opts) {
  checkOpen();
  engineFor("barrier");
  auto c = newCall(wire::kBarrier, 0, 0, 0, 0, 0, {}, c10d::OpType::BARRIER);
  c->header = opts_.check;  // checked: the header exchange is itself a full synchronisation
  c->data = [this](Mode m, const WaitFn& wait) {
    if (m == Mode::kNonblocking) wait(mpi_->barrier(m));
  };
  return enqueue(std::move(c), opts.asyncOp);
}

void ProcessGroupACCL::monitoredBarrier(const c10d::BarrierOptions& opts, bool waitAllRanks) {
  // every other rank sends a token to rank 0 and waits for its release; rank 0 waits for every token until the
  // deadline, then releases everyone (the p2p header communicator, on a tag no user message can carry)
  checkOpen();
  const auto timeout = opts.timeout.count() >= 0 ? opts.timeout : opts_.timeout;  // unset (-1): the group's
  const auto deadline = Clock::now() + timeout;
  const int tag = 0x7FFF0000 % tagUb_, release = (tag + 1) % tagUb_;
  int64_t token = 0;
  auto poll = [&](std::vector<MPI_Request>& reqs) {  // until all done or the deadline; true when all done
    Backoff backoff;
    while (Clock::now() <= deadline) {
      int done = 0;
      MPI_Testall(static_cast<int>(reqs.size()), reqs.data(), &done, MPI_STATUSES_IGNORE);
      if (done) return true;
      backoff.pause();
    }
    return false;
  };
  if (rank_ != 0) {
    int64_t ack = 0;
    std::vector<MPI_Request> send(1), recv(1);
    MPI_Isend(&token, 1, MPI_INT64_T, 0, tag, p2pHead_, &send[0]);
    MPI_Irecv(&ack, 1, MPI_INT64_T, 0, release, p2pHead_, &recv[0]);
    if (!poll(recv)) {
      MPI_Cancel(&recv[0]);
      MPI_Wait(&recv[0], MPI_STATUS_IGNORE);
      throw PeerTimeoutError("accl: Rank " + std::to_string(rank_) +
                             " successfully reached monitoredBarrier, but got no release from rank 0 within " +
                             seconds(timeout) + " s. Please check rank 0's error for the faulty ranks.");
    }
    MPI_Wait(&send[0], MPI_STATUS_IGNORE);
    return;
  }
  std::vector<int64_t> tokens(size_);
  std::vector<MPI_Request> reqs(size_ > 1 ? size_ - 1 : 0);
  for (int r = 1; r < size_; ++r) MPI_Irecv(&tokens[r], 1, MPI_INT64_T, r, tag, p2pHead_, &reqs[r - 1]);
  if (!poll(reqs)) {
    std::vector<int> missing;
    for (int r = 1; r < size_; ++r) {
      int done = 0;
      if (reqs[r - 1] != MPI_REQUEST_NULL) MPI_Test(&reqs[r - 1], &done, MPI_STATUS_IGNORE);
      if (reqs[r - 1] == MPI_REQUEST_NULL) continue;
      missing.push_back(r);
      MPI_Cancel(&reqs[r - 1]);  // withdrawn, so that no later message matches it
      MPI_Wait(&reqs[r - 1], MPI_STATUS_IGNORE);
    }
    std::string list, words;
    for (size_t i = 0; i < missing.size(); ++i) {
      list += (i ? ", " : "") + std::to_string(missing[i]);
    }
    const std::string ms = std::to_string(timeout.count());
    if (waitAllRanks) words = "[Rank 0]: Ranks " + list + " failed to pass monitoredBarrier in " + ms + " ms";
    else if (timeout.count() == 0)  // gloo checks the time left before each rank's wait: none was left for any
      words = "Rank 0 timed out in monitoredBarrier after 0 ms. No ranks successfully processed in "
              "monitoredBarrier. Failing rank: " + std::to_string(missing.empty() ? -1 : missing[0]);
    else words = "[Rank 0]: Rank " + std::to_string(missing.empty() ? -1 : missing[0]) +
                 " failed to pass monitoredBarrier in " + ms + " ms";
    throw PeerTimeoutError("accl: " + words + " (missing: ranks [" + list + "])");
  }
  for (int r = 1; r < size_; ++r) MPI_Send(&token, 1, MPI_INT64_T, r, release, p2pHead_);
}

// ============================================================================================== point-to-point
// A send is an envelope (wire::Envelope, then the payload up to kPayloadBytes) on the header communicator;
// larger payloads follow in segments on the data communicator, received only after the envelope checked out
// (a mismatched message is drained, never matched by a later receive).

c10::intrusive_ptr<c10d::Work> ProcessGroupACCL::send(std::vector<at::Tensor>& tensors, int dst, int tag) {
  const at::Tensor& t = one(tensors, "send");
  checkPeer(dst, "send", "dst");
  checkTag(tag);
  checkOpen();
  auto op = std::make_unique<P2P>();
  op->send = true;
  op->peer = dst;
  op->tag = tag;
  op->tensor = t;
  op->host = host(t, true);
  const int64_t nbytes = static_cast<int64_t>(t.nbytes());
  wire::Envelope env{wire::kMagic, wire::dtypeCode(t.scalar_type()), nbytes, t.numel()};
  op->envelope.assign(kSlot, 0);
  std::memcpy(op->envelope.data(), &env, sizeof env);
  const bool small = nbytes <= static_cast<int64_t>(kPay);
  if (small && nbytes) std::memcpy(op->envelope.data() + kHdr, op->host.data_ptr(), nbytes);
  op->eng = engineFor("send", env.dtype);
  op->reqs.push_back(MPI_REQUEST_NULL);
  MPI_Isend(op->envelope.data(), static_cast<int>(kHdr + (small ? nbytes : 0)), MPI_BYTE, dst, tag, p2pHead_,
            &op->reqs.back());
  const int64_t esz = t.element_size();
  for (int64_t off = 0, per = perSegment(esz); op->eng && !small && off < t.numel(); off += per) {
    stats_.count(std::min(per, t.numel() - off) * esz);  // the engine's calls block: made here, in order
    op->eng->send(op->host.narrow(0, off, std::min(per, t.numel() - off)), dst, tag);
  }
  for (int64_t off = 0, per = opts_.maxSegmentBytes; !op->eng && !small && off < nbytes; off += per) {
    op->reqs.push_back(MPI_REQUEST_NULL);
    stats_.count(std::min(per, nbytes - off));
    MPI_Isend(ptr(op->host) + off, static_cast<int>(std::min(per, nbytes - off)), MPI_BYTE, dst, tag, p2pData_,
              &op->reqs.back());
  }
  op->work = c10::make_intrusive<WorkACCL>(rank_, c10d::OpType::SEND, "send(to rank " + std::to_string(dst) + ", tag " +
                                               std::to_string(tag) + ")", std::vector<at::Tensor>{t}, this);
  return startP2P(std::move(op));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupACCL::recv(std::vector<at::Tensor>& tensors, int src, int tag) {
  const at::Tensor& t = one(tensors, "recv");
  checkPeer(src, "recv", "src");
  return recvFrom(t, src, tag);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupACCL::recvAnysource(std::vector<at::Tensor>& tensors, int tag) {
  return recvFrom(one(tensors, "recv"), -1, tag);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupACCL::recvFrom(const at::Tensor& t, int src, int tag) {
  checkTag(tag);
  checkOpen();
  auto op = std::make_unique<P2P>();
  op->peer = src;
  op->tag = tag;
  op->tensor = t;
  op->stream = callerStream({t});
  op->eng = engineFor("recv", wire::dtypeCode(t.scalar_type()));
  op->envelope.assign(kSlot, 0);
  op->reqs.push_back(MPI_REQUEST_NULL);
  MPI_Irecv(op->envelope.data(), static_cast<int>(kSlot), MPI_BYTE, src < 0 ? MPI_ANY_SOURCE : src, tag, p2pHead_,
            &op->reqs.back());
  const std::string from = src < 0 ? "from any source" : "from rank " + std::to_string(src);
  op->work = c10::make_intrusive<WorkACCL>(rank_, src < 0 ? c10d::OpType::RECVANYSOURCE : c10d::OpType::RECV,
                                           "recv(" + from + ", tag " + std::to_string(tag) + ")",
                                           std::vector<at::Tensor>{t}, this);
  return startP2P(std::move(op));
}

std::string ProcessGroupACCL::envelopeMismatch(const wire::Envelope& env, int peer, const P2P& op) const {
  const at::Tensor& t = op.tensor;
  const std::string head = "accl: recv " + std::string(op.peer < 0 ? "from any source" : "from rank " +
                           std::to_string(op.peer)) + " tag " + std::to_string(op.tag);
  if (env.magic != wire::kMagic) {
    std::ostringstream s;
    s << head << ": garbled message envelope from rank " << peer << " (magic 0x" << std::hex << env.magic << ")";
    return s.str();
  }
  const int64_t want = static_cast<int64_t>(t.nbytes()), dcode = wire::dtypeCode(t.scalar_type());
  if (env.nbytes == want && env.dtype == dcode) return "";
  std::string diffs;
  if (env.dtype != dcode)
    diffs = "dtype: sent " + wire::dtypeName(env.dtype) + ", expected " + wire::dtypeName(dcode);
  if (env.nbytes != want)
    diffs += (diffs.empty() ? "" : "; ") + std::string("nbytes: sent ") + std::to_string(env.nbytes) + ", expected " +
             std::to_string(want);
  return head + " expects " + std::to_string(t.numel()) + " x " + torchName(t.scalar_type()) + " (" +
         std::to_string(want) + " bytes) but rank " + std::to_string(peer) + " sent " + std::to_string(env.numel) +
         " x " + wire::dtypeName(env.dtype) + " (" + std::to_string(env.nbytes) + " bytes): " + diffs;
}

c10::intrusive_ptr<c10d::Work> ProcessGroupACCL::startP2P(std::unique_ptr<P2P> op) {
  op->deadline = Clock::now() + opts_.timeout;
  auto work = op->work;
  {
    std::lock_guard<std::mutex> lock(mu_);
    work->name(groupNameShared());
    ensureWorker();
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
  for (auto& op : done) op->work->complete(op->error, op->source);
}

bool ProcessGroupACCL::advanceP2P(P2P& op) {
  c10::OptionalStreamGuard onCallerStream(op.stream);  // a received device tensor is copied back on it
  int flag = 0;
  if (op.stage == 0 && !op.send) {  // the envelope
    MPI_Status st;
    if (int rc = MPI_Test(&op.reqs[0], &flag, &st); rc != MPI_SUCCESS) {
      op.error = mpiFailure(rc, op.work->what());
      return true;
    }
    if (flag) {
      op.source = st.MPI_SOURCE;
      wire::Envelope env;
      std::memcpy(&env, op.envelope.data(), sizeof env);
      const std::string bad = envelopeMismatch(env, op.source, op);
      const bool small = env.nbytes <= static_cast<int64_t>(kPay);
      char* into = nullptr;
      if (op.eng && !small && env.magic == wire::kMagic) {  // the payload on the engine (its calls block)
        at::Tensor buf = bad.empty() ? (op.host = host(op.tensor, false))
                                     : at::empty({env.numel}, op.tensor.options().dtype(wire::scalarTypeOf(env.dtype)));
        const int64_t esz = buf.element_size();
        for (int64_t off = 0, per = perSegment(esz); off < buf.numel(); off += per) {
          stats_.count(std::min(per, buf.numel() - off) * esz);
          op.eng->recv(buf.narrow(0, off, std::min(per, buf.numel() - off)), op.source, op.tag);
        }
        if (!bad.empty()) op.error = std::make_exception_ptr(MismatchError(bad));
        else deliver(op.host, op.tensor);
        return true;
      }
      if (!bad.empty()) {
        op.error = std::make_exception_ptr(MismatchError(bad));
        if (env.magic != wire::kMagic || small) return true;
        op.drain.resize(static_cast<size_t>(env.nbytes));  // drained, so that no later receive matches it
        into = reinterpret_cast<char*>(op.drain.data());
        op.stage = 2;
      } else {
        op.host = host(op.tensor, false);
        if (small) {
          if (env.nbytes) std::memcpy(op.host.data_ptr(), op.envelope.data() + kHdr, env.nbytes);
          deliver(op.host, op.tensor);
          return true;
        }
        into = ptr(op.host);
        op.stage = 1;
      }
      op.reqs.clear();
      for (int64_t off = 0, per = opts_.maxSegmentBytes; off < env.nbytes; off += per) {
        op.reqs.push_back(MPI_REQUEST_NULL);
        stats_.count(std::min(per, env.nbytes - off));
        MPI_Irecv(into + off, static_cast<int>(std::min(per, env.nbytes - off)), MPI_BYTE, op.source, op.tag, p2pData_,
                  &op.reqs.back());
      }
    }
  }
  if (op.stage != 0 || op.send) {
    if (int rc = MPI_Testall(static_cast<int>(op.reqs.size()), op.reqs.data(), &flag, MPI_STATUSES_IGNORE);
        rc != MPI_SUCCESS) {
      op.error = mpiFailure(rc, op.work->what());
      return true;
    }
    if (flag) {
      if (op.stage == 1) deliver(op.host, op.tensor);
      return true;
    }
  }
  if (Clock::now() > op.deadline) {
    try {
      expire(op.work->what());
    } catch (...) {
      op.error = std::current_exception();
    }
    return true;
  }
  return false;
}

}  // namespace torchhpc::accl
