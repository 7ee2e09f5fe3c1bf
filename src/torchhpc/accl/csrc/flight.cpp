// accl's calls in torch's own flight recorder (torch/csrc/distributed/c10d/FlightRecorder.hpp), so that a dump is
// the format torch's analyzer (torchfrtrace) reads.  libtorch exports neither its recorder's singleton nor its
// event instantiations, so accl instantiates the template over its own event type (what a CUDA event is to NCCL's
// recorder: a time set once, when the call started or completed) and keeps a recorder of its own; dumps go through
// torch's exported DebugInfoWriter to TORCH_FR_DUMP_TEMP_FILE + the global rank, which torchhpc sets to a directory
// only this user can write (accl/core.py: torch's default is a fixed name in the shared /tmp).
// The template's detail header needs nlohmann/json.hpp, which the torch wheel does not ship: without it accl
// builds without the recorder, and dump_flight_record() says so.
#include "accl.hpp"

#if __has_include(<nlohmann/json.hpp>)
#include <torch/csrc/distributed/c10d/FlightRecorderDetail.hpp>
#define ACCL_FLIGHT 1
#endif

namespace torchhpc::accl {

void FrEvent::mark() { ns.store(c10::getTime(), std::memory_order_release); }

#ifdef ACCL_FLIGHT
}  // namespace torchhpc::accl
namespace c10d {
template <>
float getDurationFromEvent<torchhpc::accl::FrEvent>(torchhpc::accl::FrEvent& start, torchhpc::accl::FrEvent& end) {
  return static_cast<float>(end.ns.load() - start.ns.load()) / 1e6f;
}
// (members instantiated as used: not the JSON dump, which accl never writes)
}  // namespace c10d
namespace torchhpc::accl {
namespace {
c10d::FlightRecorder<FrEvent>& recorder() { return *c10d::FlightRecorder<FrEvent>::get(); }
std::atomic<bool> stacksRecorded{false};  // some group records stacks: dumps then symbolize them
}  // namespace

bool frBuilt() { return true; }

void FrRecord::started() {
  start.mark();
  if (status && seq >= 0) status->lastStartedSeq = seq;
}

void FrRecord::completed() {
  end.mark();
  if (status && seq >= 0) status->lastCompletedSeq = seq;
}

FrRecord::~FrRecord() {
  if (id) recorder().retire_id(id, true);  // the recorder lets go of the events before they go
}

namespace {
// What torch's record() stores beside the call, at the cost accl can afford per call: the thread's name is read
// once per thread (torch asks the kernel on every call), and the caller's Python stack is gathered only where the
// group asks for it (flight_stacks): walking it takes the GIL back from the released call (0.3 us per call from a
// shallow call site, 0.7 us from 40 frames deep).
const std::string& threadName() {
  thread_local const std::string name = c10::getThreadName();
  return name;
}

const std::shared_ptr<torch::CapturedTraceback>& noStack() {
  static const auto empty = torch::CapturedTraceback::gather(false, false, false);
  return empty;
}

void describe(const Tensors& ts, c10::SmallVector<int64_t, 4>& dims, std::vector<c10::ScalarType>& dtypes,
              c10::SmallVector<int64_t, 8>& sizes) {
  for (const auto& t : ts) {
    dtypes.push_back(t.scalar_type());
    dims.push_back(t.dim());
    sizes.append(t.sizes().begin(), t.sizes().end());
  }
}
}  // namespace

void ProcessGroupACCL::record(FrRecord& r, std::string_view op, const Tensors& in, const Tensors& out, int64_t collSeq,
                              bool p2p) {
  auto& fr = recorder();
  if (!fr.enabled_) return;
  std::lock_guard<std::mutex> lock(frMu_);
  if (!frStatus_ || std::get<0>(frNamed_) != groupName() || std::get<1>(frNamed_) != getGroupDesc()) {
    // torch names the group after creating it: the ranks go under the name entries carry
    if (!frStatus_) frStatus_ = std::make_shared<c10d::ProcessGroupStatus>();
    frNamed_ = {groupName(), getGroupDesc()};
    fr.record_pg_ranks(frNamed_, std::vector<uint64_t>(globalRanks_.begin(), globalRanks_.end()));
    std::lock_guard<std::mutex> frLock(fr.mutex_);
    fr.all_pg_status_.emplace(frPgId_, frStatus_);
  }
  c10d::FlightRecorder<FrEvent>::Entry e{};
  e.pg_id_ = frPgId_;
  e.pg_name_ = frNamed_;
  e.collective_seq_id_ = p2p ? 0 : collSeq + 1;
  e.p2p_seq_id_ = p2p ? ++p2pSeq_ : 0;
  e.op_id_ = ++opId_;
  e.profiling_name_.reserve(5 + op.size());
  e.profiling_name_.append("accl:").append(op);
  if (opts_.flightStacks) stacksRecorded.store(true, std::memory_order_relaxed);
  e.traceback_ = opts_.flightStacks ? torch::CapturedTraceback::gather(true, true, fr.capture_cpp_stack_) : noStack();
  e.start_ = &r.start;
  e.end_ = &r.end;
  e.time_created_ = c10::getTime();
  e.timeout_ms_ = opts_.timeout.count();
  e.isP2P_ = p2p;
  describe(in, e.input_dims_, e.input_dtypes_, e.sizes_);
  describe(out, e.output_dims_, e.output_dtypes_, e.sizes_);
  e.thread_id_ = std::this_thread::get_id();
  e.thread_name_ = threadName();
  {  // into torch's ring, as its record() does (its fields are public; libtorch exports no record of its own)
    std::lock_guard<std::mutex> frLock(fr.mutex_);
    e.id_ = fr.id_;
    e.reset_epoch_ = fr.reset_epoch_;
    if (fr.entries_.size() < fr.max_entries_) fr.entries_.push_back(std::move(e));
    else std::swap(fr.entries_[fr.next_], e);  // the entry it replaces is destroyed below, outside the lock
    if (++fr.next_ == fr.max_entries_) fr.next_ = 0;
    r.id = fr.id_++;
  }
  if (!p2p) {
    r.status = frStatus_;
    r.seq = collSeq + 1;
    frStatus_->lastEnqueuedSeq = r.seq;
  }
}

std::string frWrite(int globalRank) {
  auto& writer = c10d::DebugInfoWriter::getWriter(globalRank);
  writer.write(recorder().dump(std::nullopt, true, stacksRecorded.load(), false));
  return writer.getWriterTarget();
}
#else
bool frBuilt() { return false; }
void FrRecord::started() { start.mark(); }
void FrRecord::completed() { end.mark(); }
FrRecord::~FrRecord() = default;
void ProcessGroupACCL::record(FrRecord&, std::string_view, const Tensors&, const Tensors&, int64_t, bool) {}
std::string frWrite(int) {
  throw std::runtime_error("accl was built without torch's flight recorder: its header needs nlohmann/json.hpp "
                           "(apt install nlohmann-json3-dev, or spack's nlohmann-json), then rebuild accl");
}
#endif

void ProcessGroupACCL::setGlobalRanks(std::vector<int64_t> ranks) {
  TORCH_CHECK_VALUE(static_cast<int>(ranks.size()) == size_, "accl: global ranks do not match the group's size");
  std::lock_guard<std::mutex> lock(frMu_);
  globalRanks_ = std::move(ranks);
}

void ProcessGroupACCL::dumpFlightRecord() {
  if (!frBuilt()) return;
  try {
    frWrite(static_cast<int>(globalRanks_[rank_]));
  } catch (const std::exception& e) {  // a failed dump must not hide the error that asked for it
    TORCH_WARN("accl: could not write the flight record: ", e.what());
  }
}

}  // namespace torchhpc::accl
