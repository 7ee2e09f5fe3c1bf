// accl's calls in torch's own flight recorder (torch/csrc/distributed/c10d/FlightRecorder.hpp), so that a dump is
// the format torch's analyzer (torchfrtrace) reads.  libtorch exports neither its recorder's singleton nor its
// event instantiations, so accl instantiates the template over its own event type (what a CUDA event is to NCCL's
// recorder: a time set once, when the call started or completed) and keeps a recorder of its own; dumps go through
// torch's exported DebugInfoWriter: TORCH_FR_DUMP_TEMP_FILE (default /tmp/nccl_trace_rank_) + the global rank.
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
template struct FlightRecorder<torchhpc::accl::FrEvent>;
}  // namespace c10d
namespace torchhpc::accl {
namespace {
c10d::FlightRecorder<FrEvent>& recorder() { return *c10d::FlightRecorder<FrEvent>::get(); }
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

void ProcessGroupACCL::record(FrRecord& r, const std::string& op, const std::vector<at::Tensor>& in,
                              const std::vector<at::Tensor>& out, int64_t collSeq, bool p2p) {
  auto& fr = recorder();
  if (!fr.enabled_) return;
  std::lock_guard<std::mutex> lock(frMu_);
  std::tuple<std::string, std::string> pg{groupName(), getGroupDesc()};
  if (pg != frNamed_) {  // torch names the group after creating it: the ranks go under the name entries carry
    fr.record_pg_ranks(pg, std::vector<uint64_t>(globalRanks_.begin(), globalRanks_.end()));
    frNamed_ = pg;
  }
  if (!frStatus_) frStatus_ = std::make_shared<c10d::ProcessGroupStatus>();
  r.id = fr.record(frPgId_, pg, p2p ? 0 : collSeq + 1, p2p ? ++p2pSeq_ : 0, ++opId_, "accl:" + op, in, out,
                   &r.start, &r.end, opts_.timeout, frStatus_, p2p);
  if (!p2p) {
    r.status = frStatus_;
    r.seq = collSeq + 1;
    frStatus_->lastEnqueuedSeq = r.seq;
  }
}

std::string frWrite(int globalRank) {
  auto& writer = c10d::DebugInfoWriter::getWriter(globalRank);
  writer.write(recorder().dump(std::nullopt, true, false, false));
  return writer.getWriterTarget();
}
#else
bool frBuilt() { return false; }
void FrRecord::started() { start.mark(); }
void FrRecord::completed() { end.mark(); }
FrRecord::~FrRecord() = default;
void ProcessGroupACCL::record(FrRecord&, const std::string&, const std::vector<at::Tensor>&,
                              const std::vector<at::Tensor>&, int64_t, bool) {}
std::string frWrite(int) {
  throw std::runtime_error("accl was built without torch's flight recorder: its header needs nlohmann/json.hpp "
                           "(apt install nlohmann-json3-dev, or spack's nlohmann-json), then rebuild accl");
}
#endif

void ProcessGroupACCL::setGlobalRanks(std::vector<int64_t> ranks) {
  if (static_cast<int>(ranks.size()) != size_) valueError("accl: global ranks do not match the group's size");
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

const char* frOpName(c10d::OpType type) {
  switch (type) {
    case c10d::OpType::BROADCAST: return "broadcast";
    case c10d::OpType::ALLREDUCE: case c10d::OpType::_ALLREDUCE_SPARSE: return "all_reduce";
    case c10d::OpType::ALLREDUCE_COALESCED: return "allreduce_coalesced";
    case c10d::OpType::REDUCE: return "reduce";
    case c10d::OpType::ALLGATHER: return "all_gather";
    case c10d::OpType::_ALLGATHER_BASE: return "_all_gather_base";
    case c10d::OpType::GATHER: return "gather";
    case c10d::OpType::SCATTER: return "scatter";
    case c10d::OpType::REDUCE_SCATTER: return "reduce_scatter";
    case c10d::OpType::_REDUCE_SCATTER_BASE: return "_reduce_scatter_base";
    case c10d::OpType::ALLTOALL_BASE: return "all_to_all_single";
    case c10d::OpType::ALLTOALL: return "all_to_all";
    case c10d::OpType::BARRIER: return "barrier";
    default: return "unknown";
  }
}

}  // namespace torchhpc::accl
