// The wire protocol, defined once: dtype/op/kind codes and names, a call in words, and the mismatch texts.
// Python reads the tables and texts from the built module (module.cpp's `wire`).
#include "accl.hpp"

#include <map>

namespace torchhpc::accl {

// torch's names (its analyzer's): the engine's collectives first (kEngineOps), then the variants of the first rows
const Named kCollectives[kNamed] = {
    {OpType::ALLREDUCE, "all_reduce"}, {OpType::BROADCAST, "broadcast"}, {OpType::REDUCE, "reduce"},
    {OpType::ALLGATHER, "all_gather"}, {OpType::GATHER, "gather"}, {OpType::SCATTER, "scatter"},
    {OpType::REDUCE_SCATTER, "reduce_scatter"}, {OpType::ALLTOALL, "all_to_all"}, {OpType::SEND, "send"},
    {OpType::RECV, "recv"}, {OpType::BARRIER, "barrier"}, {OpType::ALLREDUCE_COALESCED, "allreduce_coalesced"},
    {OpType::_ALLREDUCE_SPARSE, "all_reduce"}, {OpType::_ALLGATHER_BASE, "_all_gather_base"},
    {OpType::_REDUCE_SCATTER_BASE, "_reduce_scatter_base"}, {OpType::ALLTOALL_BASE, "all_to_all_single"}};

const char* collName(OpType type) {
  for (const auto& [t, name] : kCollectives)
    if (t == type) return name;
  return "unknown";
}

namespace wire {
const char* const kDtypeNames[15] = {"float32", "float64", "float16", "bfloat16", "int8", "int16", "int32",
                                     "int64", "uint8", "bool", "complex64", "complex128", "uint16", "uint32",
                                     "uint64"};
const char* const kOpNames[8] = {"SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"};

namespace {

const char* const kFieldNames[] = {"magic", "kind", "seq", "dtype", "op", "root", "nbytes", "numel", "extra"};
// numbered from 1 in this order (kDtypeNames names them)
const at::ScalarType kDtypes[] = {
    at::kFloat, at::kDouble, at::kHalf, at::kBFloat16, at::kChar, at::kShort, at::kInt, at::kLong, at::kByte,
    at::kBool, at::kComplexFloat, at::kComplexDouble, at::kUInt16, at::kUInt32, at::kUInt64};

std::string kindName(int64_t code) {  // collName of the header's kind, or the raw code (OpType is 8 bits)
  const std::string name = code >= 0 && code <= 255 ? collName(static_cast<OpType>(code)) : "unknown";
  return name != "unknown" ? name : "kind#" + std::to_string(code);
}

std::string opNameOf(int64_t code) {
  if (code > 0 && code <= 8) return kOpNames[code - 1];
  return code == 0 ? "none" : "op#" + std::to_string(code);
}

std::string valueOf(int field, int64_t v) {
  switch (field) {
    case 0: return v == kMagic ? "valid" : "garbled (" + std::to_string(v) + ")";
    case 1: return kindName(v);
    case 3: return dtypeName(v);
    case 4: return opNameOf(v);
    default: return std::to_string(v);
  }
}

std::string ranksText(const std::vector<int>& rs) {
  std::string out = rs.size() > 1 ? "ranks " : "rank ";
  for (size_t i = 0; i < rs.size(); ++i) out += (i ? "," : "") + std::to_string(rs[i]);
  return out;
}

// each distinct value of `of(header)` with the ranks that have it, in order of first appearance
using Ranked = std::vector<std::pair<std::string, std::vector<int>>>;
template <typename F>
Ranked byValue(const std::vector<Header>& heads, F of) {
  Ranked out;
  for (size_t r = 0; r < heads.size(); ++r) {
    std::string v = of(heads[r]);
    auto it = std::find_if(out.begin(), out.end(), [&](const auto& e) { return e.first == v; });
    if (it == out.end()) out.push_back({v, {static_cast<int>(r)}});
    else it->second.push_back(static_cast<int>(r));
  }
  return out;
}

// "ranks 0,1 <value><sep>rank 2 <value>" (`mid` between the ranks and their value)
std::string joined(const Ranked& values, const char* mid, const char* sep) {
  std::string out;
  for (size_t k = 0; k < values.size(); ++k) out += (k ? sep : "") + ranksText(values[k].second) + mid + values[k].first;
  return out;
}

}  // namespace

int64_t dtypeCode(at::ScalarType t) {
  for (int i = 0; i < 15; ++i)
    if (kDtypes[i] == t) return i + 1;
  return 99;
}

int64_t opCode(RedOpType op) {
  return op <= RedOpType::BXOR ? static_cast<int64_t>(op) + 1 : 0;
}

at::ScalarType scalarTypeOf(int64_t code) {
  return code > 0 && code <= 15 ? kDtypes[code - 1] : at::kByte;
}

std::string dtypeName(int64_t code) {
  if (code > 0 && code <= 15) return kDtypeNames[code - 1];
  return code == 0 ? "none" : "dtype#" + std::to_string(code);
}

std::string torchName(at::ScalarType t) {
  return "torch." + dtypeName(dtypeCode(t));
}

std::string describe(const Header& h) {
  std::string kind = kindName(h.kind);
  std::string parts = dtypeName(h.dtype) + ", " + std::to_string(h.numel) + " elements";
  if (h.op) parts += ", " + opNameOf(h.op);
  if (kind == "broadcast" || kind == "reduce" || kind == "gather" || kind == "scatter")
    parts += ", root " + std::to_string(h.root);
  return kind + "(" + parts + ") as call #" + std::to_string(h.seq);
}

std::string describeMismatch(const std::vector<Header>& heads, int compare, const std::string& group) {
  std::vector<std::string> fields;
  for (int i = 0; i < compare; ++i) {
    const Ranked values = byValue(heads, [i](const Header& h) { return valueOf(i, (&h.magic)[i]); });
    if (values.size() > 1) fields.push_back(std::string(kFieldNames[i]) + ": " + joined(values, " ", ", "));
  }
  std::string out = "accl: ranks disagree on a collective" + (group.empty() ? "" : " in group '" + group + "'");
  out += ": " + (fields.empty() ? std::string("no field differs: a message between ranks was garbled") : fields[0]);
  for (size_t k = 1; k < fields.size(); ++k) out += "; " + fields[k];
  return out + " (" + joined(byValue(heads, describe), ": ", "; ") + ")";
}

bool envelopeConsistent(const Envelope& env) {  // a size from a peer is used only once it is consistent
  const int64_t esz = env.dtype > 0 && env.dtype <= 15 ? c10::elementSize(scalarTypeOf(env.dtype)) : 0;
  return env.magic == kMagic && esz && env.numel >= 0 && env.numel <= int64_t{1} << 50 && env.nbytes == env.numel * esz;
}

std::string envelopeMismatch(const Envelope& env, int peer, const at::Tensor& t, const std::string& from, int tag) {
  const std::string head = "accl: recv " + from + " tag " + std::to_string(tag);
  if (!envelopeConsistent(env))
    return head + ": garbled message envelope from rank " + std::to_string(peer) + " (magic " +
           valueOf(0, env.magic) + ", " + std::to_string(env.numel) + " x " + dtypeName(env.dtype) + " in " +
           std::to_string(env.nbytes) + " B)";
  const int64_t want = static_cast<int64_t>(t.nbytes()), dcode = dtypeCode(t.scalar_type());
  if (env.nbytes == want && env.dtype == dcode) return "";
  std::string diffs;
  if (env.dtype != dcode) diffs = "dtype: sent " + dtypeName(env.dtype) + ", expected " + dtypeName(dcode);
  if (env.nbytes != want)
    diffs += (diffs.empty() ? "" : "; ") + std::string("nbytes: sent ") + std::to_string(env.nbytes) + ", expected " +
             std::to_string(want);
  return head + " expects " + std::to_string(t.numel()) + " x " + torchName(t.scalar_type()) + " (" +
         std::to_string(want) + " bytes) but rank " + std::to_string(peer) + " sent " + std::to_string(env.numel) +
         " x " + dtypeName(env.dtype) + " (" + std::to_string(env.nbytes) + " bytes): " + diffs;
}

}  // namespace wire
}  // namespace torchhpc::accl
