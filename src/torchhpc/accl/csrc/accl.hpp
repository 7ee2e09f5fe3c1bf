// torchhpc.accl as one C++ c10d::Backend (issue 24; design: docs/accl-cpp-design.md).
//
// Every declaration of the backend: the wire layout, the reduction rules, the MPI engine, the Work, the
// error classes and ProcessGroupACCL itself.  Built per MPI family against the installed torch
// (torchhpc.accl.corebuild --backend); module.cpp is the only file that knows Python.
#pragma once

#include <mpi.h>

#include <ATen/ATen.h>
#include <c10/core/Stream.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace torchhpc::accl {

using Clock = std::chrono::steady_clock;
using RedOpType = c10d::ReduceOp::RedOpType;

// ------------------------------------------------------------------------------------------ errors
// Each becomes the torchhpc.errors class of the same name in Python (module.cpp's translator).

struct PeerTimeoutError : c10::DistBackendError {
  explicit PeerTimeoutError(std::string msg) : c10::DistBackendError(std::move(msg)) {}
};
struct PeerFailedError : c10::DistBackendError {
  PeerFailedError(std::string msg, std::vector<int> ranks)
      : c10::DistBackendError(std::move(msg)), failedRanks(std::move(ranks)) {}
  std::vector<int> failedRanks;
};
struct MismatchError : c10::ValueError {
  explicit MismatchError(std::string msg) : c10::ValueError(std::move(msg)) {}
};
// an MPI call returned an error (the group turns it into PeerFailedError or DistBackendError)
struct MpiCallError : c10::DistBackendError {
  MpiCallError(int code, std::string msg) : c10::DistBackendError(std::move(msg)), rc(code) {}
  int rc;
};
// a group that was aborted (timeout, dead peer, shutdown): torch's DistBackendError
struct AbortedError : c10::DistBackendError {
  explicit AbortedError(std::string msg) : c10::DistBackendError(std::move(msg)) {}
};

[[noreturn]] void valueError(const std::string& msg);
[[noreturn]] void typeError(const std::string& msg);

// ------------------------------------------------------------------------------------------ wire
// The collective header (torchhpc/accl/wire.py documents the same layout): nine int64 fields in a slot of
// kSlotBytes, the first kHeaderBytes for the header, then kPayloadBytes of payload (small calls ride there).
namespace wire {
constexpr int64_t kMagic = 0x4ACC1;
constexpr size_t kHeaderBytes = 128;
constexpr size_t kPayloadBytes = 1024;
constexpr size_t kSlotBytes = kHeaderBytes + kPayloadBytes;
constexpr int kCompareAll = 8;   // every field but `extra`
constexpr int kCompareCall = 4;  // magic, kind, seq, dtype (all_to_all: sizes checked on its byte matrix)
enum Kind : int64_t {
  kAllReduce = 1, kBroadcast, kReduce, kAllGather, kGather, kScatter, kReduceScatter, kAllToAll, kBarrier,
  kAllReduceCoalesced
};
struct Header {
  int64_t magic = kMagic, kind = 0, seq = 0, dtype = 0, op = 0, root = 0, nbytes = 0, numel = 0, extra = 0;
};
int64_t dtypeCode(at::ScalarType t);
int64_t opCode(RedOpType op);
std::string dtypeName(int64_t code);
at::ScalarType scalarTypeOf(int64_t code);  // (uint8 for a code outside the table)
std::string describe(const Header& h);
// the error text for gathered headers whose first `compare` fields differ (wire.describe_mismatch's text)
std::string describeMismatch(const std::vector<Header>& heads, int compare, const std::string& group);
// the p2p envelope: magic, dtype code, payload bytes, element count, then the payload up to kPayloadBytes
struct Envelope {
  int64_t magic = kMagic, dtype = 0, nbytes = 0, numel = 0;
};
}  // namespace wire

// ------------------------------------------------------------------------------------------ reduction
// What a (dtype, op) reduction is on MPI, checked once per pair (gloo's rules, reduction.py's texts).
struct Reduction {
  at::ScalarType dtype;
  RedOpType op;
  size_t esz;
  bool avg;           // AVG runs as SUM and divides afterwards
  MPI_Datatype type;  // float16/bfloat16: 16-bit words reduced by a user op
  MPI_Op mpiOp;
  int64_t dcode, ocode;
};
// the reduction for (dtype, op), or a ValueError/TypeError naming `what`
const Reduction& reductionFor(at::ScalarType dtype, RedOpType op, const char* what);
std::string opName(RedOpType op);

// ------------------------------------------------------------------------------------------ engine
struct Stats {
  std::atomic<int64_t> engineCalls{0}, sidestepCalls{0}, maxCallBytes{0};
  std::atomic<int64_t> queuedCalls{0};  // collectives that went to the queue (not run inline by their caller)
  void count(int64_t bytes);
};

// How a data call is made: blocking (after a header exchange proved every rank arrived) or nonblocking
// (unchecked small calls: polled against the deadline).
enum class Mode { kBlocking, kNonblocking };

// The MPI engine: MPI's collectives on host (or, CUDA-aware, device) buffers, one call per segment.  Each
// returns MPI_REQUEST_NULL when blocking, else the request to poll.  Throws on MPI errors.
class MpiEngine {
 public:
  MpiEngine(MPI_Comm comm, Stats& stats) : comm_(comm), stats_(stats) {}
  MPI_Request allreduce(void* buf, int count, const Reduction& r, Mode m);
  MPI_Request bcast(void* buf, int bytes, int root, Mode m);
  // `bytes` from each rank into dst at rank * stride
  MPI_Request allgather(const void* src, void* dst, int bytes, int64_t stride, Mode m);
  MPI_Request reduceScatter(const void* src, void* dst, int count, const Reduction& r, Mode m);
  MPI_Request alltoallv(const void* src, const int* sc, const int* sd, void* dst, const int* rc, const int* rd,
                        Mode m);
  MPI_Request barrier(Mode m);
  // every rank's `bytes` (counts[r] bytes from rank r, at displs[r] of dst)
  MPI_Request allgatherv(const void* src, int bytes, void* dst, const int* counts, const int* displs, Mode m);
  // rooted: reduce into the root's buffer (in place there), gather rows at `stride`, scatter rows at `stride`
  MPI_Request reduce(void* buf, int count, const Reduction& r, int root, Mode m);
  MPI_Request gather(const void* src, void* dst, int bytes, int64_t stride, int root, Mode m);
  MPI_Request scatter(const void* src, int64_t stride, void* dst, int bytes, int root, Mode m);
  MPI_Comm comm() const { return comm_; }

 private:
  void check(int rc, const char* what);
  // `bytes` per rank at `stride` apart, as byte counts and displacements for the v-variant calls (not a resized
  // datatype: Open MPI 5.0's hierarchical all_gather across nodes mis-delivered the last blocks of one). Kept
  // here until the call completes: every caller waits on a call before making the next.
  void blocks(int bytes, int64_t stride);
  // a rooted call's accounting (the root moves every rank's block) and its blocks
  void rooted(int bytes, int64_t stride, int root);
  std::vector<int> counts_, displs_;
  MPI_Comm comm_;
  Stats& stats_;
};

// The interface of an engine other than MPI: the ACCL hardware engine lives in Python (pyaccl is Python) and
// implements it through module.cpp's trampoline.  Blocking calls on contiguous host tensors (the group stages
// and segments); dtypes and ops as wire codes (0: none).
class Engine {
 public:
  virtual ~Engine() = default;
  virtual std::string name() const = 0;
  // whether it does `coll` (an AcclOptions.sidestep name: "allreduce", "broadcast", ...) for dtype and op
  virtual bool supports(const std::string& coll, int64_t dcode, int64_t ocode) const = 0;
  virtual void allreduce(at::Tensor buf, int64_t ocode) = 0;
  virtual void reduce(at::Tensor buf, int64_t ocode, int64_t root) = 0;
  virtual void broadcast(at::Tensor buf, int64_t root) = 0;
  virtual void allgather(at::Tensor send, at::Tensor recv) = 0;            // recv: p x n
  virtual void gather(at::Tensor send, at::Tensor recv, int64_t root) = 0;   // recv: p x n on the root, else empty
  virtual void scatter(at::Tensor send, at::Tensor recv, int64_t root) = 0;  // send: p x n on the root, else empty
  virtual void reduceScatter(at::Tensor send, at::Tensor recv, int64_t ocode) = 0;  // send: p x n
  virtual void send(at::Tensor buf, int64_t dst, int64_t tag) = 0;
  virtual void recv(at::Tensor buf, int64_t src, int64_t tag) = 0;
};

// Whether the MPI library takes CUDA device buffers: the same query as our PyTorch patch
// (patches/pytorch/*/0001-c10d-mpi-ask-mpich-for-cuda-support.patch): Open MPI's MPIX_Query_cuda_support, MPICH's
// MPIX_GPU_query_support, else MPICH_GPU_SUPPORT_ENABLED=1 for MPICH derivatives without the query.
bool cudaAwareMpi();

// ------------------------------------------------------------------------------------------ work
class ProcessGroupACCL;

class WorkACCL : public c10d::Work {
 public:
  // `p2pOwner`: the group whose point-to-point ops a waiter progresses (null: a collective)
  WorkACCL(int rank, c10d::OpType type, std::string what, std::vector<at::Tensor> outputs,
           ProcessGroupACCL* p2pOwner = nullptr);
  bool isCompleted() override;
  bool isSuccess() const override;
  std::exception_ptr exception() const override;
  int sourceRank() const override;
  std::vector<at::Tensor> result() override;
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  void synchronize() override {}
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;
  // completion, by whoever ran the call
  void complete(std::exception_ptr error, int source = -1);
  // the call in words and its group, for errors (set when the call is numbered)
  // the call in words, made only when asked (errors, repr): from its header, or the text it was made with
  std::string what() const { return hasHead_ ? wire::describe(head_) : what_; }
  void name(const wire::Header& head, std::shared_ptr<const std::string> group) {
    head_ = head;
    hasHead_ = true;
    group_ = std::move(group);
  }
  void name(std::shared_ptr<const std::string> group) { group_ = std::move(group); }

 private:
  void settle(const c10::intrusive_ptr<c10::ivalue::Future>& fut, std::exception_ptr error);
  std::string what_;
  wire::Header head_;
  bool hasHead_ = false;
  std::shared_ptr<const std::string> group_;
  std::vector<at::Tensor> outputs_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  bool settling_ = false;        // the outcome is known (the future is being settled)
  std::exception_ptr outcome_;
  // the group progressed while waiting (a ProcessGroupACCL); may be gone: a Work can outlive its group
  c10::weak_intrusive_ptr<c10d::Backend> p2pOwner_;
  void progressOwner();
  bool isP2P_;
  std::atomic<int> source_{-1};
};

// ------------------------------------------------------------------------------------------ calls
// One collective as the group runs it: its header words, whether its data ride in the slot, its engine calls
// segment by segment and its copy-back.  Made by a ProcessGroupACCL method, run by run() inline or queued.
struct Call {
  wire::Header head;                       // kind, dtype, op, root, nbytes, numel, extra (seq set when run)
  bool header = true;                      // exchanges the header first
  int compare = wire::kCompareAll;
  std::function<void()> stage;             // staging when the call's turn comes (may be empty)
  std::function<void(unsigned char*)> pack;                       // this rank's payload into its slot
  std::function<bool(const unsigned char* all)> fused;            // take results from every slot: done?
  std::function<void(Mode, const std::function<void(MPI_Request)>& wait)> data;  // engine calls
  std::function<void()> finish;            // copy back, AVG's division (may be empty)
  std::optional<c10::Stream> stream;       // device tensors: the caller's current stream at issue (staging runs on it)
  c10::intrusive_ptr<WorkACCL> work;
};

// A point-to-point op in flight: an envelope request, then (large payloads) a data request.
struct P2P {
  bool send = false;
  int peer = -1, tag = 0;
  at::Tensor tensor, host;                 // the caller's tensor and the contiguous host buffer used
  std::vector<unsigned char> envelope;     // slot-sized: envelope + small payload
  std::vector<MPI_Request> reqs;           // the envelope's, then the payload's segments
  int stage = 0;                           // 0 envelope, 1 payload, 2 drain of a bad payload
  int source = -1;
  std::exception_ptr error;
  std::vector<unsigned char> drain;
  Clock::time_point deadline;
  Engine* eng = nullptr;                   // the payload's engine (null: MPI); the envelope is always MPI's
  std::optional<c10::Stream> stream;       // a device tensor: the caller's current stream at issue
  c10::intrusive_ptr<WorkACCL> work;
};

// ------------------------------------------------------------------------------------------ the backend
struct Config {
  int64_t maxSegmentBytes = 4 << 20;
  bool check = true;
  int64_t thresholdBytes = 64 << 10;       // threaded_min_bytes: unchecked calls above it exchange the header
  std::chrono::milliseconds timeout{1800 * 1000};
  std::string groupName;
  std::vector<std::string> sidestep;       // collectives an engine lacks that may fall back to MPI
};

class ProcessGroupACCL : public c10d::Backend {
 public:
  // `engine`: the group's engine when it is not MPI (null: MPI)
  ProcessGroupACCL(MPI_Comm comm, Config config, std::shared_ptr<Engine> engine = nullptr);
  ~ProcessGroupACCL() override;

  const std::string getBackendName() const override { return "accl"; }

  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override;
  // sparse COO tensors (torch routes SparseCPU all_reduce to allreduce, SparseCUDA to allreduce_sparse)
  c10::intrusive_ptr<c10d::Work> allreduce_sparse(std::vector<at::Tensor>& tensors,
                                                  const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                     const c10d::AllreduceCoalescedOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override;
  // the coalesced variants: one call per (output, input) pair, in order; the last one's Work covers them all
  // (collectives complete in issue order)
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputLists,
                                                     std::vector<at::Tensor>& inputs,
                                                     const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                 std::vector<at::Tensor>& inputs,
                                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                 std::vector<at::Tensor>& inputs,
                                                                 const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& outputSplits,
                                               std::vector<int64_t>& inputSplits,
                                               const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst, int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src, int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override;

  // gloo's protocol and reports (ProcessGroupGloo::monitoredBarrier): rank 0 names the ranks that did not arrive
  void monitoredBarrier(const c10d::BarrierOptions& opts, bool waitAllRanks = false) override;

  void shutdown() override;
  void abort() override { shutdown(); }

  Stats& stats() { return stats_; }
  const Config& config() const { return opts_; }
  // one round of point-to-point progress (Work::wait and the worker call it)
  void progressP2P();

 private:
  // ---- argument checks, written once
  const at::Tensor& one(const std::vector<at::Tensor>& ts, const char* what) const;
  void checkRoot(int64_t root, const char* what) const;
  void checkPeer(int peer, const char* what, const char* name) const;
  void checkTag(int tag) const;
  void checkSameDtype(const at::Tensor& a, const at::Tensor& b, const char* what) const;
  void checkList(const std::vector<at::Tensor>& list, const at::Tensor& ref, const char* what,
                 const char* name) const;
  void checkOpen() const;
  void checkPairs(const std::vector<at::Tensor>& outputs, const std::vector<at::Tensor>& inputs,
                  const char* what) const;
  // gather/scatter's list: the root's one list, checked against `ref`; {} on the others, which must pass none
  std::vector<at::Tensor> rootList(const std::vector<std::vector<at::Tensor>>& lists, const at::Tensor& ref,
                                   int64_t root, const char* what, const char* name) const;
  const Reduction& reduction(const at::Tensor& t, const c10d::ReduceOp& op, const char* what) const;

  // the engine for `coll` on (dcode, ocode): the group's engine where it does it, else null (MPI) where
  // AcclOptions.sidestep allows, else NotImplementedError
  Engine* engineFor(const std::string& coll, int64_t dcode = 0, int64_t ocode = 0);

  // ---- the one rule: whether a call moving `bytes` exchanges the header
  bool needsHeader(int64_t bytes) const;
  int64_t perSegment(size_t esz, int parts = 1) const;

  // ---- running calls
  c10::intrusive_ptr<c10d::Work> enqueue(std::unique_ptr<Call> call, bool asyncOp);
  void run(Call& call);                    // header, data, finish; throws
  void execute(std::unique_ptr<Call> call);  // run + complete the Work (+ abort on timeout)
  void exchangeHeader(Call& call);
  void waitRequest(MPI_Request& req, const Call& call);  // polled against deadline_; `call` names it in errors
  void workerLoop();
  [[noreturn]] void expire(const std::string& what);
  std::string describe(const Call& c) const;
  std::unique_ptr<Call> newCall(wire::Kind kind, int64_t dcode, int64_t ocode, int64_t root, int64_t nbytes,
                                int64_t numel, std::vector<at::Tensor> outputs, c10d::OpType type);
  c10::intrusive_ptr<c10d::Work> startP2P(std::unique_ptr<P2P> op);
  c10::intrusive_ptr<c10d::Work> recvFrom(const at::Tensor& t, int src, int tag);  // src -1: any source
  std::string envelopeMismatch(const wire::Envelope& env, int peer, const P2P& op) const;
  bool advanceP2P(P2P& op);  // true when done
  void ensureWorker();        // (caller holds mu_)
  std::string groupName() const;
  std::shared_ptr<const std::string> groupNameShared();  // for Works (made again only when torch renames the group)
  // the pieces the collectives share
  std::unique_ptr<Call> allreduceCall(std::vector<at::Tensor> ts, const Reduction& red, wire::Kind kind,
                                      c10d::OpType type);
  std::unique_ptr<Call> allgatherCall(const at::Tensor& input, const at::Tensor& output,
                                      std::function<void(const at::Tensor&)> deliver,
                                      std::vector<at::Tensor> outputs, c10d::OpType type);
  std::unique_ptr<Call> reduceScatterCall(std::function<at::Tensor()> rows, const at::Tensor& output,
                                          const Reduction& red, c10d::OpType type);
  std::unique_ptr<Call> alltoallCall(const at::Tensor& input, const at::Tensor& output, std::vector<int64_t> sb,
                                     std::vector<int64_t> rb, c10d::OpType type,
                                     std::vector<at::Tensor> outputs = {},
                                     std::function<void(const at::Tensor&)> deliverRows = nullptr);
  std::unique_ptr<Call> sparseCall(const at::Tensor& t, const c10d::ReduceOp& op);
  std::vector<int64_t> splits(const std::vector<int64_t>& sizes, const at::Tensor& t, const char* name) const;
  void reduceRows(const Reduction& red, int64_t count, int64_t nbytes, int64_t offset, void* dst);
  // the error for MPI's return code `rc` during `what`: a dead peer (ULFM) revokes the group's communicators,
  // names the dead ranks and aborts the group (PeerFailedError); anything else is a DistBackendError
  std::exception_ptr mpiFailure(int rc, const std::string& what);
  [[noreturn]] void raiseMpi(int rc, const std::string& what) { std::rethrow_exception(mpiFailure(rc, what)); }
  std::vector<int> failedRanks();
  void abortWith(const std::string& why, std::exception_ptr error);

  // ---- state
  Config opts_;
  Stats stats_;
  MPI_Comm coll_ = MPI_COMM_NULL, ctl_ = MPI_COMM_NULL, p2pHead_ = MPI_COMM_NULL, p2pData_ = MPI_COMM_NULL;
  std::unique_ptr<MpiEngine> mpi_;
  std::shared_ptr<Engine> engine_;         // null: MPI
  std::vector<unsigned char> mine_, all_;  // this rank's slot, every rank's slots
  MPI_Request hreq_ = MPI_REQUEST_NULL;
  bool persistent_ = false;
  int tagUb_ = 32767;

  std::mutex mu_;                          // queue, running_, aborted_, seq_
  std::condition_variable cv_;
  std::deque<std::unique_ptr<Call>> queue_;
  bool running_ = false;                   // a collective is running (inline or on the worker)
  bool stop_ = false;
  int64_t seq_ = 0;
  std::string aborted_;                    // why the group is aborted ("" while usable)
  std::shared_ptr<const std::string> nameShared_;
  std::exception_ptr abortError_;          // the error that aborted it: queued calls fail with it
  std::thread worker_;

  std::mutex p2pMu_;
  std::vector<std::unique_ptr<P2P>> p2p_;
  std::atomic<int> p2pPending_{0};
  std::vector<std::unique_ptr<Call>> abandoned_;  // calls given up at a deadline: MPI may still write them
  Clock::time_point deadline_;                     // of the collective running now
};

}  // namespace torchhpc::accl
