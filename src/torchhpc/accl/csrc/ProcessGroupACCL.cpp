// ProcessGroupACCL: the group itself.  Staging helpers, the Work, the group's communicators, the argument checks
// (written once), and how a call runs: start -> the caller's thread or the worker -> execute() -> the header
// exchange -> the engine calls -> the copy-back; every wait polled against the group deadline, every MPI error
// turned into the package's errors in one place (mpiFailure).  The collectives are in collectives.cpp,
// point-to-point in p2p.cpp.
#include <Python.h>  // the GIL, released around MPI's blocking calls

#include "accl.hpp"


#if defined(OPEN_MPI) && __has_include(<mpi-ext.h>)
#include <mpi-ext.h>  // Open MPI's ULFM (MPIX_Comm_revoke, MPIX_Comm_get_failed); MPICH declares them in mpi.h
#endif

#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <cstdio>
#include <cstring>

namespace torchhpc::accl {
namespace {

std::atomic<bool> gPeersDied{false};
std::atomic<double> gPeersSilentTimeout{0.0};

// raises `a` to at least `v`
template <typename T>
void atomicMax(std::atomic<T>& a, T v) {
  T seen = a.load(std::memory_order_relaxed);
  while (seen < v && !a.compare_exchange_weak(seen, v)) {
  }
}

// The watchdog: MPI cannot interrupt a blocking call, and a peer lost after the header proved that every rank
// arrived (stopped, cut off, dead without ULFM) holds the data phase for ever.  One thread per process looks at
// every group's blocked call and ends the job once one overstays its deadline.
// (never destroyed: the detached thread may still look at them while the process exits)
std::mutex& gWatchMu = *new std::mutex;
std::vector<ProcessGroupACCL*>& gWatched = *new std::vector<ProcessGroupACCL*>;

void watch(ProcessGroupACCL* pg, bool on) {
  static std::once_flag started;
  std::call_once(started, [] {
    std::thread([] {
      while (true) {
        std::this_thread::sleep_for(std::chrono::milliseconds(200));
        std::lock_guard<std::mutex> lock(gWatchMu);
        for (auto* g : gWatched) g->checkBlocked();
      }
    }).detach();
  });
  std::lock_guard<std::mutex> lock(gWatchMu);
  if (on) gWatched.push_back(pg);
  else gWatched.erase(std::remove(gWatched.begin(), gWatched.end(), pg), gWatched.end());
}

// torchhpc.runtime.waiting.Backoff's policy, its numbers compiled in from there (corebuild's -DACCL_BACKOFF_*):
// poll back to back (at least ACCL_BACKOFF_POLLS times, and for `spin`: Config::spin, AcclOptions.spin_us), yield
// the core until ACCL_BACKOFF_YIELD_US, then sleep from ACCL_BACKOFF_NAP_US doubling to ACCL_BACKOFF_CAP_US.  The
// spin is timed: when compute threads hold every core (a DDP bucket's all_reduce under the backward pass), a waiter
// that yields at once falls out of step with its peer, which then spins in MPI's blocking call for its time slice.
struct Backoff {
  explicit Backoff(std::chrono::microseconds spin) : spin(spin) {}
  std::chrono::microseconds spin;
  int polls = 0;
  Clock::time_point start = Clock::now();
  std::chrono::microseconds nap{ACCL_BACKOFF_NAP_US};
  void pause() {
    if (++polls <= ACCL_BACKOFF_POLLS) return;
    const auto waited = Clock::now() - start;
    if (waited < spin) return;
    if (waited < std::chrono::microseconds(ACCL_BACKOFF_YIELD_US)) {
      std::this_thread::yield();
      return;
    }
    std::this_thread::sleep_for(nap);
    nap = std::min(nap * 2, std::chrono::microseconds(ACCL_BACKOFF_CAP_US));
  }
};

MPI_Comm dup(MPI_Comm comm) {
  MPI_Comm out = MPI_COMM_NULL;
  ACCL_MPI(MPI_Comm_dup, comm, &out);
  ACCL_MPI(MPI_Comm_set_errhandler, out, MPI_ERRORS_RETURN);
  return out;
}

// MPI_Comm_rank or MPI_Comm_size of `comm` (one body, the query passed in)
int commInt(int (*query)(MPI_Comm, int*), const char* name, MPI_Comm comm) {
  int v = 0;
  mpiCheck(query(comm, &v), name);
  return v;
}

}  // namespace

// ============================================================================================== staging

bool direct(const at::Tensor& t) {
  return t.is_cpu() && t.is_contiguous();
}

at::Tensor host(const at::Tensor& t, bool copy) {
  if (direct(t)) return t;  // its own memory, any shape: engines see pointers and element counts
  auto h = at::empty({t.numel()}, t.options().device(at::kCPU).pinned_memory(!t.is_cpu()));
  if (copy) h.copy_(t.reshape({-1}));
  return h;
}

at::Tensor flatHost(const Tensors& ts) {
  if (ts.size() == 1) return host(ts[0], true);
  Tensors flat;
  for (const auto& x : ts) flat.push_back(x.reshape({-1}).cpu());
  return at::cat(flat);
}

void deliver(const at::Tensor& buf, const at::Tensor& t) {
  if (direct(t) && buf.data_ptr() == t.data_ptr()) return;
  at::Tensor(t).copy_(buf.view(t.sizes()));
}

void deliverEach(const at::Tensor& buf, const Tensors& ts) {
  if (ts.size() == 1) return deliver(buf, ts[0]);
  int64_t off = 0;
  for (const auto& t : ts) {
    deliver(buf.narrow(0, off, t.numel()), t);
    off += t.numel();
  }
}

// c10's device-generic guard: no CUDA header is needed, and a module built on a CPU-only torch works on a CUDA one
std::optional<c10::Stream> callerStream(const Tensors& ts) {
  for (const auto& t : ts)
    if (t.defined() && !t.is_cpu()) return c10::impl::VirtualGuardImpl(t.device().type()).getStream(t.device());
  return std::nullopt;
}

char* ptr(const at::Tensor& t) {
  return t.defined() ? static_cast<char*>(t.data_ptr()) : nullptr;
}

Seg seg(const at::Tensor& t, int64_t off, int64_t cnt, int64_t rows, int64_t n) {
  if (!t.defined()) return {nullptr, cnt, at::kByte, rows, 0};
  const int64_t esz = t.element_size();
  return {ptr(t) + off * esz, cnt, t.scalar_type(), rows, n * esz};
}

std::string seconds(std::chrono::milliseconds ms) {
  return c10::str(static_cast<double>(ms.count()) / 1000.0);
}

// ============================================================================================== Work

WorkACCL::WorkACCL(int rank, OpType type, std::string what, Tensors outputs,
                   ProcessGroupACCL* p2pOwner)
    : c10d::Work(rank, type),
      what_(std::move(what)),
      outputs_(std::move(outputs)),
      p2pOwner_(p2pOwner != nullptr ? c10::intrusive_ptr<c10d::Backend>::unsafe_reclaim_from_nonowning(
                                          static_cast<c10d::Backend*>(p2pOwner))
                                    : c10::intrusive_ptr<c10d::Backend>()),
      isP2P_(p2pOwner != nullptr), spin_(p2pOwner ? p2pOwner->spin() : std::chrono::microseconds(0)) {}

void WorkACCL::progressOwner() {
  if (auto owner = p2pOwner_.lock()) static_cast<ProcessGroupACCL*>(owner.get())->progressP2P();
}

bool WorkACCL::isCompleted() {
  progressOwner();
  std::lock_guard<std::mutex> lock(mutex_);
  return completed_;
}

int WorkACCL::sourceRank() const {
  int s = source_.load();
  TORCH_CHECK_VALUE(s >= 0, "accl: source_rank() is only defined for a completed recv from any source");
  return s;
}

Tensors WorkACCL::result() {
  wait();
  return outputs_;
}

bool WorkACCL::wait(std::chrono::milliseconds timeout) {
  auto limit = timeout.count() > 0 ? Clock::now() + timeout : Clock::time_point::max();
  Backoff backoff(spin_);  // a point-to-point waiter progresses its own ops, as the group's waits poll
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
  finish(error);  // c10d::Work's: completed, with the error, and its waiters woken
}

// ============================================================================================== group

ProcessGroupACCL::ProcessGroupACCL(MPI_Comm comm, Config config, std::shared_ptr<Engine> engine)
    : c10d::Backend(commInt(MPI_Comm_rank, "MPI_Comm_rank", comm), commInt(MPI_Comm_size, "MPI_Comm_size", comm)),
      opts_(std::move(config)), engine_(std::move(engine)) {
  coll_ = dup(comm);
  ctl_ = dup(comm);
  p2pHead_ = dup(comm);
  p2pData_ = dup(comm);
  mpi_ = std::make_unique<MpiEngine>(coll_);
  // whether the ranks span nodes: plan() then carries more per call and runs large all_reduces on accl's ring
  MPI_Comm node = MPI_COMM_NULL;
  ACCL_MPI(MPI_Comm_split_type, coll_, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node);
  spansNodes_ = commInt(MPI_Comm_size, "MPI_Comm_size", node) < size_;
  ACCL_MPI(MPI_Comm_free, &node);
  out_.assign(wire::kHeaderBytes + wire::carryBytes(spansNodes_), 0);
  in_.assign(out_.size(), 0);  // a peer's size is checked against it before use
  void* ub = nullptr;
  int flag = 0;
  ACCL_MPI(MPI_Comm_get_attr, MPI_COMM_WORLD, MPI_TAG_UB, &ub, &flag);
  if (flag && ub != nullptr) tagUb_ = *static_cast<int*>(ub);
  static std::atomic<size_t> groups{0};
  frPgId_ = groups++;
  for (int r = 0; r < size_; ++r) globalRanks_.push_back(r);
  watch(this, true);
}

ProcessGroupACCL::~ProcessGroupACCL() {
  watch(this, false);
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
  const auto down = std::make_exception_ptr(c10::DistBackendError("accl: process group shut down"));
  for (auto& c : queue_) c->work->complete(down);
  queue_.clear();
  if (!aborted_.empty()) return;  // requests given up at a deadline may still use the communicators
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized) return;  // a group never destroyed, collected at interpreter exit after MPI_Finalize
  // best effort in a destructor: a failure to free is not worth an exception here
  for (MPI_Comm* c : {&coll_, &ctl_, &p2pHead_, &p2pData_})
    if (*c != MPI_COMM_NULL) MPI_Comm_free(c);
}

const std::string& ProcessGroupACCL::groupName() const {
  return getGroupUid().empty() ? opts_.groupName : getGroupUid();
}

std::shared_ptr<const std::string> ProcessGroupACCL::groupNameShared() {
  const std::string& now = groupName();
  if (!nameShared_ || *nameShared_ != now) nameShared_ = std::make_shared<const std::string>(now);
  return nameShared_;
}

// ---------------------------------------------------------------------------------------- argument checks

const at::Tensor& ProcessGroupACCL::one(const Tensors& ts, const char* what) const {
  TORCH_CHECK_VALUE(ts.size() == 1, "accl: ", what, " takes exactly one tensor per call, got ", ts.size());
  TORCH_CHECK_TYPE(!ts[0].is_sparse(), "accl: ", what, " does not support sparse tensors");
  return ts[0];
}

void ProcessGroupACCL::checkRank(int64_t rank, const char* what, const char* name) const {
  TORCH_CHECK_VALUE(rank >= 0 && rank < size_, "accl: ", what, " ", name, "=", rank,
                    " is not a rank of this group (size ", size_, ")");
}

void ProcessGroupACCL::checkTag(int tag) const {
  TORCH_CHECK_VALUE(tag >= 0 && tag <= tagUb_, "accl: tag ", tag, " out of range [0, ", tagUb_, "] (MPI_TAG_UB)");
}

void ProcessGroupACCL::checkSameDtype(const at::Tensor& out, const at::Tensor& in, const char* what) const {
  TORCH_CHECK_TYPE(out.scalar_type() == in.scalar_type(), "accl: ", what, " dtypes differ: output ",
                   wire::torchName(out.scalar_type()), ", input ", wire::torchName(in.scalar_type()));
}

void ProcessGroupACCL::checkList(const Tensors& list, const at::Tensor& ref, const char* what, const char* name) const {
  TORCH_CHECK_VALUE(static_cast<int>(list.size()) == size_, "accl: ", what, " ", name, " has ", list.size(),
                    " tensors, world_size is ", size_);
  for (size_t i = 0; i < list.size(); ++i) {
    TORCH_CHECK_TYPE(list[i].scalar_type() == ref.scalar_type(), "accl: ", what, " ", name, "[", i, "] is ",
                     wire::torchName(list[i].scalar_type()), ", expected ", wire::torchName(ref.scalar_type()));
    TORCH_CHECK_VALUE(list[i].numel() == ref.numel(), "accl: ", what, " ", name, "[", i, "] has ", list[i].numel(),
                      " elements, expected ", ref.numel(), " (all ranks' tensors must have the same size)");
  }
}

void ProcessGroupACCL::checkWhole(const at::Tensor& whole, const at::Tensor& part, const char* what,
                                  const char* wholeName, const char* partName) const {
  TORCH_CHECK_VALUE(whole.numel() == size_ * part.numel(), "accl: ", what, " ", wholeName, " has ", whole.numel(),
                    " elements, needs world_size * ", partName, " = ", size_, " * ", part.numel(), " = ",
                    size_ * part.numel());
}

void ProcessGroupACCL::checkPairs(size_t outputs, size_t inputs, const char* what) const {
  TORCH_CHECK_VALUE(outputs == inputs && inputs > 0, "accl: ", what, "_coalesced needs matching, non-empty lists");
}

void ProcessGroupACCL::checkOpen() const {
  std::lock_guard<std::mutex> lock(mu_);
  if (!aborted_.empty()) throwAborted();
}

void ProcessGroupACCL::throwAborted() const {
  throw c10::DistBackendError("accl: process group is aborted (" + aborted_ +
                              "); create a new one (or restart) to communicate again");
}

Tensors ProcessGroupACCL::rootList(const std::vector<Tensors>& lists, const at::Tensor& ref, int64_t root,
                                   const char* what, const char* name) const {
  if (rank_ != root) {
    for (const auto& l : lists) TORCH_CHECK_VALUE(l.empty(), "accl: ", name, " must be empty/None on non-root ranks");
    return {};
  }
  TORCH_CHECK_VALUE(lists.size() == 1, "accl: ", what, " on the root takes one ", name);
  checkList(lists[0], ref, what, name);
  return lists[0];
}

Engine* ProcessGroupACCL::engineFor(OpType coll, std::optional<at::ScalarType> dtype, std::optional<RedOpType> op) {
  if (!engine_) return mpi_.get();
  if (dtype && engine_->supports(coll, *dtype, op)) return engine_.get();
  const std::string name = collName(coll);
  if (std::find(opts_.sidestep.begin(), opts_.sidestep.end(), name) != opts_.sidestep.end()) {
    stats_.sidestepCalls.fetch_add(1);
    return mpi_.get();
  }
  std::string what = name;
  if (dtype) what += " of " + wire::torchName(*dtype);
  if (op) what += " with " + opName(*op);
  throw c10::NotImplementedError("accl: the " + engine_->name() + " engine cannot do " + what +
                                 " and sidestep to MPI is disabled for '" + name +
                                 "' (AcclOptions.sidestep / TORCHHPC_ACCL_SIDESTEP)");
}

// ---------------------------------------------------------------------------------------- running calls

int64_t ProcessGroupACCL::segmentFor(OpType coll) const {
  if (opts_.maxSegmentBytes) return *opts_.maxSegmentBytes;
  const bool reduces = coll == OpType::ALLREDUCE || coll == OpType::REDUCE || coll == OpType::REDUCE_SCATTER;
  return reduces && !engine_ ? int64_t{4} << 20 : int64_t{1} << 30;
}

void Stats::count(int64_t bytes) {
  engineCalls.fetch_add(1, std::memory_order_relaxed);
  atomicMax(maxCallBytes, bytes);
}

WorkPtr ProcessGroupACCL::start(Call* made, OpType type, Engine* eng, int64_t bytes, bool asyncOp) {
  std::unique_ptr<Call> call(made);
  call->eng = eng;
  call->path = plan(type, bytes, size_, spansNodes_, onMpi(eng), opts_);
  if (call->inputs.empty()) call->inputs = call->outputs;  // for the flight record: a scatter off the root
  call->stream = callerStream(call->outputs);
  if (!call->stream) call->stream = callerStream(call->inputs);  // a gather's input off the root
  auto work = call->work = c10::make_intrusive<WorkACCL>(rank_, type, "", call->outputs);
  std::unique_lock<std::mutex> lock(mu_);
  if (!aborted_.empty()) throwAborted();
  call->head.seq = seq_++;
  work->name(call->head, groupNameShared());
  record(call->fr, collName(type), call->inputs, call->outputs, call->head.seq, false);
  if (!asyncOp && queue_.empty() && !running_) {  // idle group, synchronous call: the caller's thread runs it
    execute(lock, std::move(call));
    return work;
  }
  queue_.push_back(std::move(call));
  stats_.queuedCalls.fetch_add(1, std::memory_order_relaxed);
  if (!worker_.joinable()) worker_ = std::thread([this] { workerLoop(); });
  lock.unlock();
  cv_.notify_all();
  return work;
}

void ProcessGroupACCL::workerLoop() {
  std::unique_lock<std::mutex> lock(mu_);
  auto ready = [&] { return stop_ || (!queue_.empty() && !running_); };
  while (true) {
    // point-to-point ops in flight are progressed here too, every 200 us
    if (p2pPending_.load() > 0) cv_.wait_for(lock, std::chrono::microseconds(200), ready);
    else cv_.wait_for(lock, std::chrono::milliseconds(100), ready);
    if (stop_) return;
    if (!queue_.empty() && !running_) {
      auto call = std::move(queue_.front());
      queue_.pop_front();
      execute(lock, std::move(call));
    }
    if (p2pPending_.load() > 0) {
      lock.unlock();
      progressP2P();
      lock.lock();
    }
  }
}

void ProcessGroupACCL::execute(std::unique_lock<std::mutex>& lock, std::unique_ptr<Call> call) {
  running_ = true;
  std::exception_ptr error = abortError_;  // set: queued behind the call that aborted the group, its error
  lock.unlock();
  auto work = call->work;
  if (!error) {
    try {
      current_ = call.get();
      call->fr.started();
      deadline_ = Clock::now() + opts_.timeout;
      c10::OptionalStreamGuard onCallerStream(call->stream);  // staging copies of device tensors (host())
      (this->*call->body)(*call);
      call->fr.completed();
    } catch (const PeerTimeoutError&) {
      error = std::current_exception();
      abandoned_.push_back(std::move(call));  // MPI may still complete the given-up requests into its buffers
    } catch (const MpiCallError& e) {
      error = mpiFailure(e, wire::describe(call->head));
    } catch (...) {
      error = std::current_exception();
    }
  }
  current_ = nullptr;
  work->complete(error);
  // released before the lock is taken again: dropping the last reference to a caller's tensor may take the GIL,
  // which a caller waiting for the lock in start() holds
  call.reset();
  work.reset();
  lock.lock();
  running_ = false;
  cv_.notify_all();
}

template <typename F>
void ProcessGroupACCL::blocking(const Call& c, F phase) {
  blockedHead_ = c.head;
  blockedUntil_.store((deadline_ + std::chrono::seconds(1)).time_since_epoch().count());
  struct Unblock {
    std::atomic<Clock::rep>& until;
    PyThreadState* gil;
    ~Unblock() {
      until.store(0);
      if (gil) PyEval_RestoreThread(gil);
    }
  } unblock{blockedUntil_, Py_IsInitialized() && PyGILState_Check() ? PyEval_SaveThread() : nullptr};
  phase();
}

char* ProcessGroupACCL::carryBuffer() {
  if (!carry_.defined()) carry_ = at::empty({wire::carryBytes(spansNodes_)}, at::kByte);
  return ptr(carry_);
}

void ProcessGroupACCL::checkBlocked() {
  const Clock::rep until = blockedUntil_.load(std::memory_order_acquire);
  if (until == 0 || Clock::now().time_since_epoch().count() < until) return;
  std::fprintf(stderr, "accl: %s in group '%s' (rank %d of %d) is still inside MPI's blocking collective a second "
               "past the group timeout of %s s: a peer stopped, died or was cut off after every rank had entered "
               "the call, and MPI cannot interrupt a blocking call. Ending the job (MPI_Abort).\n",
               wire::describe(blockedHead_).c_str(), groupName().c_str(), rank_, size_, seconds(opts_.timeout).c_str());
  std::fflush(stderr);
  atomicMax(gPeersSilentTimeout, std::chrono::duration<double>(opts_.timeout).count());
  dumpFlightRecord();
  armAbortGrace();
  MPI_Abort(MPI_COMM_WORLD, 1);
  std::_Exit(1);
}

bool ProcessGroupACCL::testUntil(MPI_Request* reqs, int n, Clock::time_point deadline) {
  Backoff backoff(opts_.spin);
  std::vector<MPI_Status> st(n > 1 ? n : 0);  // MPI_Testall reports a failed request in its status
  while (true) {
    int done = 0;
    if (n == 1) ACCL_MPI(MPI_Test, reqs, &done, MPI_STATUS_IGNORE);
    else if (int rc = MPI_Testall(n, reqs, &done, st.data()); rc == MPI_ERR_IN_STATUS) {
      for (const auto& s : st)
        if (s.MPI_ERROR != MPI_SUCCESS && s.MPI_ERROR != MPI_ERR_PENDING) mpiCheck(s.MPI_ERROR, "MPI_Testall");
    } else {
      mpiCheck(rc, "MPI_Testall");
    }
    if (done) return true;
    if (Clock::now() > deadline) return false;
    backoff.pause();
  }
}

void ProcessGroupACCL::waitRequest(MPI_Request* reqs, int n, int peer) {
  if (!testUntil(reqs, n, deadline_)) expire(current_ ? wire::describe(current_->head) : "a collective", peer);
}

void armAbortGrace() {
  std::signal(SIGALRM, SIG_DFL);
  alarm(kAbortGraceS);
}

bool peersDied() { return gPeersDied.load(); }
double peersSilentTimeout() { return gPeersSilentTimeout.load(); }

void ProcessGroupACCL::expire(const std::string& what, int peer) {
  const std::string who = peer >= 0 ? "rank " + std::to_string(peer) + " (this rank was waiting on it)" : "a peer rank";
  std::string msg = "accl: " + what + " in group '" + groupName() + "' (rank " + std::to_string(rank_) + " of " +
                    std::to_string(size_) + ") did not complete within the group timeout of " +
                    seconds(opts_.timeout) + " s: " + who +
                    " died, hung, or did not make the matching call. The group is aborted; later calls on it raise "
                    "at once.";
  PeerTimeoutError error(msg);
  atomicMax(gPeersSilentTimeout, std::chrono::duration<double>(opts_.timeout).count());
  abortWith(msg, std::make_exception_ptr(error));
  dumpFlightRecord();
  throw error;
}

// ---------------------------------------------------------------------------------------- MPI errors

std::string mpiErrorText(int rc) {
  char text[MPI_MAX_ERROR_STRING] = {};
  int len = 0;
  if (MPI_Error_string(rc, text, &len) != MPI_SUCCESS) return "error code " + std::to_string(rc);
  return std::string(text, static_cast<size_t>(len));
}

MpiCallError::MpiCallError(int code, const char* fn)
    : c10::DistBackendError(std::string("accl: ") + fn + " failed: " + mpiErrorText(code)), rc(code), call(fn) {}

std::vector<int> ProcessGroupACCL::failedRanks() {
  std::vector<int> out;
#ifdef MPIX_ERR_PROC_FAILED
  // the runtime's knowledge of failed processes, which every communicator of the group shares
  MPI_Group failed, mine;
  if (MPIX_Comm_get_failed(coll_, &failed) != MPI_SUCCESS) return out;  // best effort: the error says "a peer"
  MPI_Comm_group(coll_, &mine);
  int n = 0;
  MPI_Group_size(failed, &n);
  std::vector<int> in(n);
  out.resize(n);
  for (int i = 0; i < n; ++i) in[i] = i;
  MPI_Group_translate_ranks(failed, n, in.data(), mine, out.data());
  MPI_Group_free(&failed);
  MPI_Group_free(&mine);
  out.erase(std::remove(out.begin(), out.end(), MPI_UNDEFINED), out.end());
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

std::exception_ptr ProcessGroupACCL::mpiFailure(const MpiCallError& e, const std::string& what) {
  const std::string where = what + " in group '" + groupName() + "' on rank " + std::to_string(rank_) + " of " +
                            std::to_string(size_) + " (" + e.call + ": " + mpiErrorText(e.rc) + ")";
  int cls = 0;
  MPI_Error_class(e.rc, &cls);
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
    if (!ranks.empty()) who = ranks.size() > 1 ? "peer ranks " : "peer rank ";
    for (size_t i = 0; i < ranks.size(); ++i) who += (i ? ", " : "") + std::to_string(ranks[i]);
    const std::string msg = "accl: " + who + " died during " + where +
                            ". The group is aborted; later calls on it raise at once. Restart the job (e.g. "
                            "from a checkpoint) or rebuild the group from the survivors.";
    auto error = std::make_exception_ptr(PeerFailedError(msg, ranks));
    gPeersDied = true;
    abortWith(msg, error);
    dumpFlightRecord();
    return error;
  }
#endif
  return std::make_exception_ptr(c10::DistBackendError("accl: MPI error during " + where));
}

}  // namespace torchhpc::accl
