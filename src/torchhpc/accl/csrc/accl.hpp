// torchhpc.accl: the "accl" backend as one c10d::Backend over MPI (or an ACCL engine).
//
// Every declaration of the backend: the errors, the wire protocol, the reduction rules, the engines, the Work and
// ProcessGroupACCL itself.  Built per MPI family against the installed torch as one translation unit (accl.cpp;
// python -m torchhpc.accl.corebuild).  module.cpp holds the Python bindings; besides it only the blocking data
// phase touches Python (it releases the caller's GIL, ProcessGroupACCL.cpp).
#pragma once

#if !defined(ACCL_BACKOFF_POLLS) || !defined(ACCL_BACKOFF_YIELD_US) || !defined(ACCL_BACKOFF_NAP_US) || \
    !defined(ACCL_BACKOFF_CAP_US)
#error "build with torchhpc.runtime.waiting.Backoff's numbers as -DACCL_BACKOFF_* (torchhpc.accl.corebuild does)"
#endif

#include <mpi.h>

#include <ATen/ATen.h>
#include <c10/core/Stream.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

namespace c10d {
struct ProcessGroupStatus;
}

namespace torchhpc::accl {

using Clock = std::chrono::steady_clock;
using RedOpType = c10d::ReduceOp::RedOpType;
using OpType = c10d::OpType;
using Tensors = std::vector<at::Tensor>;
using WorkPtr = c10::intrusive_ptr<c10d::Work>;

// ------------------------------------------------------------------------------------------ errors
// Each becomes the torchhpc.runtime.errors class of the same name in Python (module.cpp's translator).

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
// an MPI call returned `rc`; the group turns it into its error (ProcessGroupACCL::mpiFailure)
struct MpiCallError : c10::DistBackendError {
  MpiCallError(int code, const char* fn);
  int rc;
  const char* call;
};

// The one way to call MPI: a return code other than MPI_SUCCESS throws MpiCallError naming the function.
inline void mpiCheck(int rc, const char* fn) {
  if (rc != MPI_SUCCESS) throw MpiCallError(rc, fn);
}
#define ACCL_MPI(fn, ...) ::torchhpc::accl::mpiCheck(fn(__VA_ARGS__), #fn)
std::string mpiErrorText(int rc);

// ------------------------------------------------------------------------------------------ wire
// The one definition of the wire protocol (a test build shows it to Python: module.cpp's `wire`).
// Collective header: nine int64 fields.  It travels in a Prefix (the header combined so far, a mismatch flag and
// the data that follows) in every message of the header exchange (exchange.cpp), followed by a small call's data
// up to carryBytes(): the exchange is then the whole collective.
// P2P envelope: four int64 fields in a slot of kSlotBytes (kHeaderBytes, then up to kPayloadBytes of payload);
// larger payloads follow on their own.
namespace wire {
constexpr int64_t kMagic = 0x4ACC1;
constexpr int64_t kHeaderBytes = 128;
constexpr int64_t kPayloadBytes = 1024;
constexpr int64_t kSlotBytes = kHeaderBytes + kPayloadBytes;
// the most data a collective carries through the header exchange (all ranks' blocks together): across nodes what
// Open MPI's TCP transport sends in one eager message (a second message costs a second trip through the network:
// 32 KiB all_gather at 10 Gbit/s, raw + 10.6 -> + 4.2 us); within a node less, measured at 2 ranks against builds
// that carried up to 4 and 64 KiB (docs/accl.md, "How accl chooses"): carried, all_reduce at 8-16 KiB took 0.86x the
// header and MPI's call, and from 32 KiB broadcast, all_gather and reduce_scatter took 1.4-2.6x
constexpr int64_t kCarryBytes = (64 << 10) - 256;
constexpr int64_t kNodeCarryBytes = 16 << 10;
inline int64_t carryBytes(bool spansNodes) { return spansNodes ? kCarryBytes : kNodeCarryBytes; }
constexpr int kCompareAll = 8;   // every field but `extra`
constexpr int kCompareCall = 4;  // magic, kind, seq, dtype (all_to_all: sizes checked on its byte matrix)
struct Header {  // kind: the c10d::OpType (its name: collName)
  int64_t magic = kMagic, kind = 0, seq = 0, dtype = 0, op = 0, root = 0, nbytes = 0, numel = 0, extra = 0;
};
// One message of the header exchange starts with it (kHeaderBytes); `bytes` of data follow in the same message.
struct Prefix {
  Header head;        // the sender's header (every rank it has heard from agreed with it)
  int64_t bad = 0;    // 1: some rank's header differs from another's
  int64_t bytes = 0;  // the data after the prefix
  int64_t lo = 0, hi = 0;  // gathering: the data is the blocks of ranks [lo, hi)
};
struct Envelope {
  int64_t magic = kMagic, dtype = 0, nbytes = 0, numel = 0;
};
extern const char* const kDtypeNames[15];
extern const char* const kOpNames[8];
#ifdef ACCL_TEST_HOOKS  // a test build (corebuild --test-hooks, as make env builds): never in an install's module
// the next header-exchange prefix this process sends has its size off by this much (wire.garble_next): a peer that
// garbles a message, the one place a wrong size is made on purpose, to test that readers refuse it
extern std::atomic<int64_t> garble;
#endif
int64_t dtypeCode(at::ScalarType t);  // 1.. in kDtypeNames' order; 99 for a dtype outside the table
int64_t opCode(RedOpType op);         // 1.. in kOpNames' order; 0 for none
std::string dtypeName(int64_t code);
at::ScalarType scalarTypeOf(int64_t code);  // (uint8 for a code outside the table)
std::string torchName(at::ScalarType t);    // "torch.float32"
std::string describe(const Header& h);      // "all_reduce(float32, 4 elements, SUM) as call #3"
// the error text for gathered headers whose first `compare` fields differ
std::string describeMismatch(const std::vector<Header>& heads, int compare, const std::string& group);
// the receiver's error text when `env` from rank `peer` does not fit `t` ("" when it fits); `from`: "from rank 1"
bool envelopeConsistent(const Envelope& env);  // magic, a known dtype, numel x element size = nbytes
std::string envelopeMismatch(const Envelope& env, int peer, const at::Tensor& t, const std::string& from, int tag);
}  // namespace wire

// ------------------------------------------------------------------------------------------ reduction
// What a (dtype, op) reduction is on MPI, checked once per pair (gloo's rules).
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

// ------------------------------------------------------------------------------------------ engines
// Every collective by torch's name for it (the flight-record analyzer's; the header's kind, a c10d::OpType, in
// words): "unknown" outside accl's.  The first kEngineOps are what an engine may do (AcclOptions.sidestep's names).
struct Named {
  OpType type;
  const char* name;
};
constexpr int kNamed = 16, kEngineOps = 11;
extern const Named kCollectives[kNamed];
const char* collName(OpType type);
struct Stats {
  std::atomic<int64_t> engineCalls{0}, sidestepCalls{0}, maxCallBytes{0};
  std::atomic<int64_t> queuedCalls{0};  // collectives that went to the queue (not run inline by their caller)
  void count(int64_t bytes);
};

// One segment of a buffer as an engine sees it: `count` elements of `dtype` per row, `rows` rows `stride` bytes
// apart (rows > 1: every rank's block of the segment).  Plain pointers: no tensor is made on the MPI path.
struct Seg {
  char* data = nullptr;  // null: no buffer on this rank (a gather's or scatter's rows off the root)
  int64_t count = 0;
  at::ScalarType dtype = at::kByte;
  int64_t rows = 1, stride = 0;
  int64_t bytes() const { return count * static_cast<int64_t>(c10::elementSize(dtype)); }  // one row's
  char* row(int64_t r) const { return data + r * stride; }
};

// What moves a collective's data, one segment per call (the group stages and segments).  The ACCL engine
// implements it in Python (module.cpp's trampoline); MpiEngine is MPI's.
class Engine {
 public:
  explicit Engine(std::string name) : name_(std::move(name)) {}
  virtual ~Engine() = default;
  const std::string& name() const { return name_; }
  // whether it does `coll` for this dtype and op (none: a data move)
  virtual bool supports(OpType coll, at::ScalarType dtype, std::optional<RedOpType> op) const = 0;
  virtual void allreduce(const Seg& buf, const Reduction& r) = 0;
  virtual void reduce(const Seg& buf, const Reduction& r, int root) = 0;
  virtual void broadcast(const Seg& buf, int root) = 0;
  virtual void allgather(const Seg& send, const Seg& rows) = 0;
  virtual void gather(const Seg& send, const Seg& rows, int root) = 0;
  virtual void scatter(const Seg& rows, const Seg& recv, int root) = 0;
  virtual void reduceScatter(const Seg& rows, const Seg& recv, const Reduction& r) = 0;
  // blocking point-to-point (MPI's are the group's own nonblocking messages, not an engine call)
  virtual void send(const Seg& buf, int dst, int tag);
  virtual void recv(const Seg& buf, int src, int tag);

 private:
  std::string name_;
};

// MPI's blocking calls, made once the header exchange proved that every rank entered the call (the group's
// watchdog ends the job if a peer is lost inside one).
class MpiEngine final : public Engine {
 public:
  explicit MpiEngine(MPI_Comm comm);
  bool supports(OpType, at::ScalarType, std::optional<RedOpType>) const override { return true; }
  void allreduce(const Seg& buf, const Reduction& r) override;
  void reduce(const Seg& buf, const Reduction& r, int root) override;
  void broadcast(const Seg& buf, int root) override;
  void allgather(const Seg& send, const Seg& rows) override;
  void gather(const Seg& send, const Seg& rows, int root) override;
  void scatter(const Seg& rows, const Seg& recv, int root) override;
  void reduceScatter(const Seg& rows, const Seg& recv, const Reduction& r) override;
  // MPI only: byte counts and displacements
  void alltoall(const void* src, int bytes, void* dst);  // `bytes` to and from every rank
  void alltoallv(const void* src, const int* sc, const int* sd, void* dst, const int* rc, const int* rd);
  void allgatherv(const void* src, int bytes, void* dst, const int* counts, const int* displs);

 private:
  // rank r's row of `rows` as byte counts and displacements for the v-variant calls (not a resized datatype:
  // Open MPI 5.0's hierarchical all_gather across nodes mis-delivered the last blocks of one)
  void blocks(const Seg& rows, int bytes);
  MPI_Comm comm_;
  int rank_ = 0, size_ = 1;
  std::vector<int> counts_, displs_;
  at::Tensor scratch_;  // reduce_scatter's rows, copied together (one segment, kept)
};

// Whether a group of this process saw peers die, and the longest timeout of its groups aborted because peers fell
// silent (0: none).  MPI_Finalize would wait for such peers for ever: at exit torchhpc.accl ends the job with
// MPI_Abort at once after a death, and otherwise after that long (or the default group's timeout) at a barrier.
bool peersDied();
double peersSilentTimeout();
// MPI_Abort asks the launcher to end the job and waits for its answer, for ever where the launcher is out of reach
// (this node's link cut: PMIx_Abort under srun): armed before any abort, SIGALRM ends the process this much later
constexpr unsigned kAbortGraceS = 10;
void armAbortGrace();

// ------------------------------------------------------------------------------------------ staging
// Device and strided tensors are staged through contiguous host buffers (pinned for device tensors), copied on the
// caller's stream of issue (Call::stream): the copy out waits for the kernels queued before the call, and the
// blocking copy back is ordered before the caller's later kernels.
bool direct(const at::Tensor& t);                            // a contiguous CPU tensor: engines use its own memory
at::Tensor host(const at::Tensor& t, bool copy);             // t when direct, else a 1-D host buffer (copy: filled)
at::Tensor flatHost(const Tensors& ts);                      // every tensor of ts end to end in one host buffer
void deliver(const at::Tensor& buf, const at::Tensor& t);    // buf into t unless it is t's memory
void deliverEach(const at::Tensor& buf, const Tensors& ts);  // buf's elements in order into each
std::optional<c10::Stream> callerStream(const Tensors& ts);  // of the first device tensor
char* ptr(const at::Tensor& t);                              // (nullptr when undefined)
// elements [off, off + cnt) of a 1-D host buffer; of each of `rows` rows of `n` elements (rows > 1)
Seg seg(const at::Tensor& t, int64_t off, int64_t cnt, int64_t rows = 1, int64_t n = 0);
std::string seconds(std::chrono::milliseconds ms);

// ------------------------------------------------------------------------------------------ work
class ProcessGroupACCL;
struct Xchg;     // one header exchange's state (exchange.cpp)
struct RingRun;  // one ring's state (ring.cpp)

class WorkACCL : public c10d::Work {
 public:
  // `p2pOwner`: the group whose point-to-point ops a waiter progresses (null: a collective)
  WorkACCL(int rank, OpType type, std::string what, Tensors outputs,
           ProcessGroupACCL* p2pOwner = nullptr);
  bool isCompleted() override;
  int sourceRank() const override;
  Tensors result() override;
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;
  // completion, by whoever ran the call
  void complete(std::exception_ptr error, int source = -1);
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
  void progressOwner();
  std::string what_;
  wire::Header head_;
  bool hasHead_ = false;
  std::shared_ptr<const std::string> group_;
  Tensors outputs_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  bool settling_ = false;  // the outcome is known (the future is being settled)
  std::exception_ptr outcome_;
  // the group progressed while waiting; may be gone: a Work can outlive its group
  c10::weak_intrusive_ptr<c10d::Backend> p2pOwner_;
  bool isP2P_;
  std::chrono::microseconds spin_;  // the group's AcclOptions.spin_us
  std::atomic<int> source_{-1};
};

// ------------------------------------------------------------------------------------------ flight recorder
// Every call in torch's FlightRecorder (flight.cpp), in the format torch's analyzer reads.
struct FrEvent {  // what a CUDA event is to NCCL's recorder: a time, set once
  std::atomic<int64_t> ns{0};
  bool query() const { return ns.load(std::memory_order_acquire) != 0; }
  void mark();
};
struct FrRecord {  // one call's entry, retired when the call is destroyed (the recorder points at its events)
  std::optional<size_t> id;
  FrEvent start, end;
  std::shared_ptr<c10d::ProcessGroupStatus> status;  // collectives: the group's status they advance
  int64_t seq = -1;
  void started();
  void completed();
  ~FrRecord();
};
bool frBuilt();                       // whether accl was built with torch's recorder
std::string frWrite(int globalRank);  // the whole record through torch's DebugInfoWriter; its file

// ------------------------------------------------------------------------------------------ calls
// How a call moves its data: chosen once per call by plan() (collectives.cpp), the rows of docs/accl.md's plan.
enum class Path {
  kCarried,      // whole in the header exchange: the exchange is the call (small calls on MPI)
  kMpi,          // the header exchange, then the engine's blocking calls segment by segment
  kRing,         // the header exchange, then accl's pipelined ring (large reductions, ring.cpp)
};
extern const char* const kPathNames[3];

// How a small call's data rides in the header exchange (exchange.cpp): reduced (all_reduce, reduce_scatter), sent
// from the root (broadcast), or every rank's block gathered (all_gather, all_to_all's byte matrix).
enum class Ride { kNone, kReduce, kBroadcast, kGather };
struct Carry {
  Ride ride = Ride::kNone;
  char* data = nullptr;  // reduced in place; the root's data or where it lands; p blocks of `bytes`
  int64_t bytes = 0;     // kGather: one rank's block (this rank's filled before); else all of data's
  const Reduction* red = nullptr;
  int root = 0;
};

// One collective as the group runs it: what the caller passed, the path plan() chose, and the one function that
// runs it top to bottom (stage, header exchange, data, copy-back).  Made by a ProcessGroupACCL method, run inline
// or queued.  It owns its staged buffers: a call given up at its deadline is kept while MPI may still write them.
struct Call {
  wire::Header head;                       // kind, dtype, op, root, nbytes, numel, extra
  int compare = wire::kCompareAll;         // the header fields every rank must agree on
  Path path = Path::kMpi;
  void (ProcessGroupACCL::*body)(Call&) = nullptr;
  Tensors inputs, outputs;  // the caller's tensors (in place: inputs are the outputs)
  const Reduction* red = nullptr;
  Engine* eng = nullptr;                    // what moves the data (MPI's engine, or the group's)
  std::vector<int64_t> sendBytes, recvBytes;  // all_to_all: bytes to and from each rank
  at::Tensor src, dst;                      // the staged host buffers
  std::optional<c10::Stream> stream;  // device tensors: the caller's current stream at issue (staging runs on it)
  c10::intrusive_ptr<WorkACCL> work;
  FrRecord fr;
};

// A point-to-point op in flight: an envelope request, then (large payloads) the payload's requests.
struct P2P {
  enum Stage { kEnvelope, kPayload, kDrain };
  bool send = false;
  int peer = -1, tag = 0;
  at::Tensor tensor, host;              // the caller's tensor and the contiguous host buffer used
  std::vector<unsigned char> envelope;  // slot-sized: envelope + small payload
  std::vector<MPI_Request> reqs;        // the envelope's, then the payload's segments
  Stage stage = kEnvelope;
  int source = -1;
  std::exception_ptr error;
  std::vector<unsigned char> drain;     // a mismatched payload, received so that no later receive matches it
  Clock::time_point deadline;
  bool expired = false;                 // given up at the deadline (its requests may still complete)
  Engine* eng = nullptr;                // the payload's engine (null: MPI); the envelope is always MPI's
  std::optional<c10::Stream> stream;    // a device tensor: the caller's current stream at issue
  c10::intrusive_ptr<WorkACCL> work;
  FrRecord fr;
  int waitedOn() const { return send || source < 0 ? peer : source; }  // the rank a timeout names
};

// ------------------------------------------------------------------------------------------ the backend
// The group's options as torchhpc.accl.AcclOptions gives them (module.cpp binds this struct as Options): their
// defaults, ranges and reasons live there and in torchhpc.settings, none here.
struct Config {
  std::optional<int64_t> maxSegmentBytes;  // the user's cap on one engine call's buffer (none: segmentFor)
  std::optional<int64_t> ringMinBytes;     // reductions from this size run accl's ring (none: plan()'s choice)
  std::chrono::milliseconds timeout{0};    // the group's deadline for every wait on peers
  std::string groupName;
  std::vector<std::string> sidestep;       // collectives an engine lacks that may fall back to MPI
  bool flightStacks = false;               // flight records carry the caller's Python stack
  std::chrono::microseconds spin{0};       // a wait on peers spins this long before yielding the core
};

// The one choice: the path of a `type` call moving `bytes` in all (every rank's block for the gathers, scatters
// and reduce_scatter) on `ranks` ranks, `spansNodes` or not, on MPI or another engine, under options `o`.
Path plan(OpType type, int64_t bytes, int ranks, bool spansNodes, bool onMpi, const Config& o);

class ProcessGroupACCL : public c10d::Backend {
 public:
  // `engine`: the group's engine when it is not MPI (null: MPI)
  ProcessGroupACCL(MPI_Comm comm, Config config, std::shared_ptr<Engine> engine = nullptr);
  ~ProcessGroupACCL() override;

  const std::string getBackendName() const override { return "accl"; }
  std::string engineName() const { return engine_ ? engine_->name() : mpi_->name(); }

  WorkPtr allreduce(Tensors& tensors, const c10d::AllreduceOptions& opts) override;
  // sparse COO tensors (torch routes SparseCPU all_reduce to allreduce, SparseCUDA to allreduce_sparse)
  WorkPtr allreduce_sparse(Tensors& tensors, const c10d::AllreduceOptions& opts) override;
  WorkPtr allreduce_coalesced(Tensors& tensors, const c10d::AllreduceCoalescedOptions& opts) override;
  WorkPtr broadcast(Tensors& tensors, const c10d::BroadcastOptions& opts) override;
  WorkPtr _allgather_base(at::Tensor& output, at::Tensor& input, const c10d::AllgatherOptions& opts) override;
  WorkPtr allgather(std::vector<Tensors>& outputs, Tensors& inputs, const c10d::AllgatherOptions& opts) override;
  // the coalesced variants: one call per (output, input) pair, in order; the last one's Work covers them all
  // (collectives complete in issue order)
  WorkPtr allgather_coalesced(std::vector<Tensors>& outputLists, Tensors& inputs,
                              const c10d::AllgatherOptions& opts) override;
  WorkPtr allgather_into_tensor_coalesced(Tensors& outputs, Tensors& inputs,
                                          const c10d::AllgatherOptions& opts) override;
  WorkPtr reduce_scatter_tensor_coalesced(Tensors& outputs, Tensors& inputs,
                                          const c10d::ReduceScatterOptions& opts) override;
  WorkPtr _reduce_scatter_base(at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) override;
  WorkPtr reduce_scatter(Tensors& outputs, std::vector<Tensors>& inputs,
                         const c10d::ReduceScatterOptions& opts) override;
  WorkPtr alltoall_base(at::Tensor& output, at::Tensor& input, std::vector<int64_t>& outputSplits,
                        std::vector<int64_t>& inputSplits, const c10d::AllToAllOptions& opts) override;
  WorkPtr reduce(Tensors& tensors, const c10d::ReduceOptions& opts) override;
  WorkPtr gather(std::vector<Tensors>& outputs, Tensors& inputs, const c10d::GatherOptions& opts) override;
  WorkPtr scatter(Tensors& outputs, std::vector<Tensors>& inputs, const c10d::ScatterOptions& opts) override;
  WorkPtr alltoall(Tensors& outputs, Tensors& inputs, const c10d::AllToAllOptions& opts) override;
  WorkPtr barrier(const c10d::BarrierOptions& opts) override;
  WorkPtr send(Tensors& tensors, int dst, int tag) override;
  WorkPtr recv(Tensors& tensors, int src, int tag) override;
  WorkPtr recvAnysource(Tensors& tensors, int tag) override;

  void shutdown() override;
  void abort() override { shutdown(); }

  Stats& stats() { return stats_; }
  std::chrono::microseconds spin() const { return opts_.spin; }
  // torch's global rank of each group rank, for the flight record's group membership (default: the group ranks)
  void setGlobalRanks(std::vector<int64_t> ranks);
  // this process's flight record to TORCH_FR_DUMP_TEMP_FILE + global rank (on timeouts, deaths, mismatches)
  void dumpFlightRecord();
  // one round of point-to-point progress (Work::wait and the worker call it)
  void progressP2P();
  // the watchdog's look (every 200 ms): a blocking data phase a second past its deadline ends the job
  void checkBlocked();

 private:
  // ---- argument checks, written once
  const at::Tensor& one(const Tensors& ts, const char* what) const;
  void checkRank(int64_t rank, const char* what, const char* name) const;  // a root, src or dst of this group
  void checkTag(int tag) const;
  void checkSameDtype(const at::Tensor& a, const at::Tensor& b, const char* what) const;
  void checkList(const Tensors& list, const at::Tensor& ref, const char* what, const char* name) const;
  // `whole` has world_size times `part`'s elements (all_gather_into_tensor's output, reduce_scatter_tensor's input)
  void checkWhole(const at::Tensor& whole, const at::Tensor& part, const char* what, const char* wholeName,
                  const char* partName) const;
  void checkPairs(size_t outputs, size_t inputs, const char* what) const;
  void checkOpen() const;
  [[noreturn]] void throwAborted() const;  // (caller holds mu_)
  // gather/scatter's list: the root's one list, checked against `ref`; {} on the others, which must pass none
  Tensors rootList(const std::vector<Tensors>& lists, const at::Tensor& ref, int64_t root, const char* what,
                   const char* name) const;
  // all_to_all_single's split sizes: checked against `t` (ours names the values; c10d's computes the lengths)
  void checkSplits(const std::vector<int64_t>& sizes, const at::Tensor& t, const char* name) const;

  // the engine for `coll`: the group's engine where it does it, else MPI where AcclOptions.sidestep allows,
  // else NotImplementedError.  Collectives no engine has (all_to_all, barrier, sparse) ask with no dtype.
  Engine* engineFor(OpType coll, std::optional<at::ScalarType> dtype = std::nullopt,
                    std::optional<RedOpType> op = std::nullopt);
  bool onMpi(const Engine* eng) const { return eng == mpi_.get(); }

  // the largest buffer one engine call of `coll` touches: max_segment_bytes where the user set it; else 4 MiB for
  // the reductions on MPI (Open MPI's own reduction algorithms are slower on one larger call, measured:
  // docs/accl.md), one call up to 1 GiB for data movement (segmenting it only adds calls)
  int64_t segmentFor(OpType coll) const;
  // the one segment loop: `step(offset, count)` over [0, n) in pieces whose largest buffer (`unitBytes` per
  // element) stays within segmentFor(coll); each piece is one engine call, counted in stats_
  template <typename F>
  void forSegments(OpType coll, int64_t n, int64_t unitBytes, F step);

  // ---- running calls
  // `made` (a new Call: its header words, body and tensors) with its engine, the path plan() chooses for `bytes`
  // moved in all, the caller's stream and its Work; numbered, recorded, then run now or queued
  WorkPtr start(Call* made, OpType type, Engine* eng, int64_t bytes, bool asyncOp);
  void workerLoop();
  // runs `call` with the group marked busy (the caller holds `lock`, released meanwhile and while the call's
  // tensors are let go): its body on the caller's stream against the group deadline, then its Work completed (a
  // timeout keeps the call: MPI may still write it)
  void execute(std::unique_lock<std::mutex>& lock, std::unique_ptr<Call> call);
  // the call's header exchange, carrying `carry` on the carried path; true when the data rode with it (the
  // exchange was the call)
  bool header(Call& c, const Carry& carry = {});
  // the data phase after a header: MPI's blocking calls, watched against the deadline, without the caller's GIL
  template <typename F>
  void blocking(const Call& c, F phase);
  char* carryBuffer();  // the group's kept buffer for carried data the call does not hold (calls run one at a time)
  // ---- the flight recorder (flight.cpp): `op` in the analyzer's words ("all_reduce", "send 0->1")
  void record(FrRecord& r, std::string_view op, const Tensors& in, const Tensors& out, int64_t collSeq, bool p2p);
  // ---- the header exchange (exchange.cpp)
  void exchange(const Call& c, const Carry& carry);  // raises the MismatchError when the ranks' headers differ
  void doubling(Xchg& x);                    // recursive doubling, the ranks past a power of two folded in
  // one message each way with `peer` (or one way), merged into x (`result`: the data received is the result)
  void step(Xchg& x, int peer, bool send, bool recv, bool result = false);
  void post(const Xchg& x, int peer, MPI_Request* out);  // this rank's message to `peer`
  void take(Xchg& x, int peer, MPI_Request* in, MPI_Request* out, bool result);  // the peer's, then this rank's
  // a peer's size that is neither what this rank expects nor (a disagreeing peer's) within the buffer: raise, leave
  void checkReadable(int peer, int64_t bytes, bool same, bool agreed, MPI_Request* out);
  [[noreturn]] void refuse(const Call& call);         // every rank's header gathered, then the MismatchError
  // tests `reqs` until all complete (true) or `deadline` passes (false); a past deadline tests once
  bool testUntil(MPI_Request* reqs, int n, Clock::time_point deadline);
  // the running call's requests against its deadline; ``peer``: the group rank they wait on, if one
  void waitRequest(MPI_Request* reqs, int n = 1, int peer = -1);
  [[noreturn]] void expire(const std::string& what, int peer = -1);
  // the error for a failed MPI call during `what`: a dead peer (ULFM) revokes the group's communicators, names
  // the dead ranks and aborts the group (PeerFailedError); anything else is a DistBackendError
  std::exception_ptr mpiFailure(const MpiCallError& e, const std::string& what);
  std::vector<int> failedRanks();
  void abortWith(const std::string& why, std::exception_ptr error);
  const std::string& groupName() const;  // torch's name for the group once set, else ours
  std::shared_ptr<const std::string> groupNameShared();  // for Works (made again only when torch renames the group)

  // ---- accl's own algorithm for large reductions (ring.cpp)
  static constexpr int64_t kRingChunk = 512 << 10;  // bytes per message
  // all_reduce in place over `data` (own null), or reduce_scatter of `own` with block `rank` into `out`; on 2 or more
  // ranks (plan() never rings one)
  void ring(const Reduction& red, int64_t n, char* data, const char* own, char* out);
  void ringRecv(RingRun& x, int t, int64_t k);  // step t's k-th chunk received, into a scratch chunk
  void ringLand(RingRun& x, int t, int64_t k);  // ... reduced or copied into place

  // ---- the collectives (collectives.cpp): each one's body, and the starts that entry points share
  void allreduceBody(Call& c);
  void sparseBody(Call& c);
  void broadcastBody(Call& c);
  void reduceBody(Call& c);
  void allgatherBody(Call& c);
  void reduceScatterBody(Call& c);
  void rootedBody(Call& c);  // gather (rows to the root) and scatter (rows from the root)
  void alltoallBody(Call& c);
  void barrierBody(Call& c);
  WorkPtr allreduceStart(const Tensors& tensors, RedOpType op, OpType type, bool asyncOp);
  WorkPtr allgatherStart(const at::Tensor& input, Tensors outputs, OpType type, bool asyncOp);
  WorkPtr reduceScatterStart(Tensors inputs, const at::Tensor& output, c10d::ReduceOp op, OpType type, bool asyncOp);
  // `mineList`: every rank's one tensor; `lists`: the root's list of rows (none elsewhere)
  WorkPtr rootedStart(OpType kind, const Tensors& mineList, const std::vector<Tensors>& lists, int64_t root,
                      bool asyncOp);
  WorkPtr alltoallStart(Tensors inputs, Tensors outputs, std::vector<int64_t> sendBytes, std::vector<int64_t> recvBytes,
                        OpType type, bool asyncOp);

  // ---- point-to-point
  // one op, checked and recorded, its first messages posted, then handed to progress (peer -1: any source)
  WorkPtr startP2P(const at::Tensor& t, int peer, int tag, OpType type);
  void postSend(P2P& op);  // staged; the envelope (and a small payload), then a large payload's segments
  void postRecv(P2P& op);  // the envelope's receive
  bool advanceP2P(P2P& op);                              // true when done
  bool openEnvelope(P2P& op);                            // the envelope arrived: true when the op is done
  void postPayload(P2P& op, char* into, const wire::Envelope& env);  // the payload's segments, as the sender's
  void recvOnEngine(P2P& op, const wire::Envelope& env, const std::string& bad);

  // ---- state
  Config opts_;
  Stats stats_;
  // collectives' data (MPI's calls, the ring); the header exchange, on its own (measured: on coll_, carried calls took
  // 0.99-1.27x as long at 2 ranks, median 1.09x); p2p envelopes; payloads.  No user message travels on the first two.
  MPI_Comm coll_ = MPI_COMM_NULL, ctl_ = MPI_COMM_NULL, p2pHead_ = MPI_COMM_NULL, p2pData_ = MPI_COMM_NULL;
  std::unique_ptr<MpiEngine> mpi_;
  std::shared_ptr<Engine> engine_;         // null: MPI
  std::vector<char> out_, in_;  // the exchange's messages: sent, received (a header and up to carryBytes())
  std::vector<char> ringScratch_, ringPartial_;  // the ring's chunks in flight; reduce_scatter's partial sums
  at::Tensor carry_;                              // carryBuffer()'s memory
  bool spansNodes_ = false;                       // the group's ranks are on more than one node
  int tagUb_ = 32767;

  mutable std::mutex mu_;                  // queue_, running_, aborted_, seq_
  std::condition_variable cv_;
  std::deque<std::unique_ptr<Call>> queue_;
  bool running_ = false;                   // a collective is running (inline or on the worker)
  bool stop_ = false;
  int64_t seq_ = 0;
  std::string aborted_;                    // why the group is aborted ("" while usable)
  std::shared_ptr<const std::string> nameShared_;
  std::exception_ptr abortError_;          // the error that aborted it: queued calls fail with it
  std::thread worker_;
  const Call* current_ = nullptr;          // the collective running now, and its deadline
  Clock::time_point deadline_;
  // while MPI's blocking data phase runs (after the header): when the watchdog gives up on it (else 0), and the call
  std::atomic<Clock::rep> blockedUntil_{0};
  wire::Header blockedHead_{};

  std::mutex p2pMu_;
  std::vector<std::unique_ptr<P2P>> p2p_, p2pAbandoned_;  // in flight; given up at a deadline (kept, as calls)
  std::atomic<int> p2pPending_{0};
  std::vector<std::unique_ptr<Call>> abandoned_;  // calls given up at a deadline: MPI may still write them

  std::mutex frMu_;                            // the recorder's per-group fields below
  std::vector<int64_t> globalRanks_;           // torch's global rank of each group rank
  size_t frPgId_ = 0;
  std::tuple<std::string, std::string> frNamed_;  // (name, description) the ranks were recorded under
  std::shared_ptr<c10d::ProcessGroupStatus> frStatus_;
  int64_t p2pSeq_ = 0, opId_ = 0;
};

template <typename F>
void ProcessGroupACCL::forSegments(OpType coll, int64_t n, int64_t unitBytes, F step) {
  const int64_t per = std::max<int64_t>(1, segmentFor(coll) / std::max<int64_t>(unitBytes, 1));
  for (int64_t off = 0; off < n; off += per) {
    const int64_t cnt = std::min(per, n - off);
    stats_.count(cnt * unitBytes);
    step(off, cnt);
  }
}

}  // namespace torchhpc::accl
