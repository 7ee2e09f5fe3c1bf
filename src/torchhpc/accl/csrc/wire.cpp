// The wire protocol's C++ side: dtype/op codes, a call in words, and the mismatch text (the same words as
// torchhpc/accl/wire.py's describe / describe_mismatch, so the errors users see do not change).
#include "accl.hpp"

#include <map>
#include <sstream>

namespace torchhpc::accl {

[[noreturn]] void valueError(const std::string& msg) {
  throw c10::ValueError(msg);
}

[[noreturn]] void typeError(const std::string& msg) {
  throw c10::TypeError(msg);
}

namespace wire {
namespace {

// wire.DTYPES, numbered from 1 in this order
const at::ScalarType kDtypes[] = {
    at::kFloat, at::kDouble, at::kHalf, at::kBFloat16, at::kChar, at::kShort, at::kInt, at::kLong, at::kByte,
    at::kBool, at::kComplexFloat, at::kComplexDouble, at::kUInt16, at::kUInt32, at::kUInt64};
const char* const kDtypeNames[] = {"float32", "float64", "float16", "bfloat16", "int8",   "int16",
                                   "int32",   "int64",   "uint8",   "bool",     "complex64", "complex128",
                                   "uint16",  "uint32",  "uint64"};
const char* const kKinds[] = {"all_reduce", "broadcast", "reduce", "all_gather", "gather", "scatter",
                              "reduce_scatter", "all_to_all", "barrier", "all_reduce_coalesced"};
const char* const kOps[] = {"SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"};
const char* const kFields[] = {"magic", "kind", "seq", "dtype", "op", "root", "nbytes", "numel", "extra"};

std::string kindName(int64_t code) {
  if (code > 0 && code <= 10) return kKinds[code - 1];
  return "kind#" + std::to_string(code);
}

std::string opNameOf(int64_t code) {
  if (code > 0 && code <= 8) return kOps[code - 1];
  return code == 0 ? "none" : "op#" + std::to_string(code);
}

std::string valueOf(int field, int64_t v) {
  switch (field) {
    case 0: {
      if (v == kMagic) return "valid";
      std::ostringstream s;
      s << "garbled (0x" << std::hex << v << ")";
      return s.str();
    }
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

int64_t fieldOf(const Header& h, int i) {
  const int64_t* f = &h.magic;
  return f[i];
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
    std::vector<std::pair<std::string, std::vector<int>>> values;  // in order of first appearance
    for (size_t r = 0; r < heads.size(); ++r) {
      std::string v = valueOf(i, fieldOf(heads[r], i));
      auto it = std::find_if(values.begin(), values.end(), [&](auto& e) { return e.first == v; });
      if (it == values.end()) values.push_back({v, {static_cast<int>(r)}});
      else it->second.push_back(static_cast<int>(r));
    }
    if (values.size() > 1) {
      std::string f = std::string(kFields[i]) + ": ";
      for (size_t k = 0; k < values.size(); ++k)
        f += (k ? ", " : "") + ranksText(values[k].second) + " " + values[k].first;
      fields.push_back(f);
    }
  }
  std::vector<std::pair<std::string, std::vector<int>>> calls;
  for (size_t r = 0; r < heads.size(); ++r) {
    std::string d = describe(heads[r]);
    auto it = std::find_if(calls.begin(), calls.end(), [&](auto& e) { return e.first == d; });
    if (it == calls.end()) calls.push_back({d, {static_cast<int>(r)}});
    else it->second.push_back(static_cast<int>(r));
  }
  std::string out = "accl: ranks disagree on a collective";
  if (!group.empty()) out += " in group '" + group + "'";
  out += ": ";
  if (fields.empty()) out += "(no field differs)";
  for (size_t k = 0; k < fields.size(); ++k) out += (k ? "; " : "") + fields[k];
  out += " (";
  for (size_t k = 0; k < calls.size(); ++k) out += (k ? "; " : "") + ranksText(calls[k].second) + ": " + calls[k].first;
  return out + ")";
}

}  // namespace wire
}  // namespace torchhpc::accl
