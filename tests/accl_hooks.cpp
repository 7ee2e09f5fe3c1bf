// accl's test hooks, compiled into a test build only (python -m torchhpc.accl.corebuild --test-hooks, as make
// env builds it: csrc/module.cpp includes this file before the module's definition): the wire protocol's tables
// and texts shown to Python from their one definition (csrc/accl.hpp, csrc/wire.cpp), and a peer that garbles one
// message on purpose.
namespace torchhpc::accl::wire {
std::atomic<int64_t> garble{0};
}  // namespace torchhpc::accl::wire

namespace {
namespace py = pybind11;
namespace accl = torchhpc::accl;

constexpr size_t kFields = sizeof(accl::wire::Header) / sizeof(int64_t);  // the header's int64 fields
accl::wire::Header headerOf(const std::array<int64_t, kFields>& f) {
  return {f[0], f[1], f[2], f[3], f[4], f[5], f[6], f[7], f[8]};
}

// the wire protocol as Python sees it: sizes, tables and texts, from the one definition (accl.hpp, wire.cpp)
void defineWire(py::module_ m) {
  namespace wire = accl::wire;
  auto w = m.def_submodule("wire", "accl's wire protocol: the collective header and the p2p envelope");
  w.attr("MAGIC") = wire::kMagic;
  w.attr("HEADER_BYTES") = wire::kHeaderBytes;
  w.attr("COMPARE_CALL") = wire::kCompareCall;
  w.def("garble_next", [](int64_t delta) { wire::garble = delta; }, "test hook: next prefix's size off by delta");
  w.attr("DTYPES") = std::vector<std::string>(std::begin(wire::kDtypeNames), std::end(wire::kDtypeNames));
  w.attr("OPS") = std::vector<std::string>(std::begin(wire::kOpNames), std::end(wire::kOpNames));
  w.def("dtype_code", &wire::dtypeCode, "a dtype's code (99: not in DTYPES)");
  w.def("op_code", [](const std::string& op) {
    for (int i = 0; i < 8; ++i)
      if (op == wire::kOpNames[i]) return wire::opCode(static_cast<accl::RedOpType>(i));
    return int64_t{0};
  }, "a reduce op's code by name (0: none)");
  w.def("describe", [](const std::array<int64_t, kFields>& f) { return wire::describe(headerOf(f)); },
        "one rank's call in words, from its header's nine fields");
  w.def("describe_mismatch", [](const std::vector<std::array<int64_t, kFields>>& rows, int compare,
                                const std::string& group) {
    std::vector<wire::Header> heads;
    for (const auto& f : rows) heads.push_back(headerOf(f));
    return wire::describeMismatch(heads, compare, group);
  }, py::arg("headers"), py::arg("compare") = wire::kCompareAll, py::arg("group") = "",
        "the error text for every rank's header when their first `compare` fields differ");
  w.def("envelope_mismatch", [](const std::array<int64_t, 4>& e, int peer, const at::Tensor& t,
                                const std::string& from, int tag) {
    return wire::envelopeMismatch({e[0], e[1], e[2], e[3]}, peer, t, from, tag);
  }, "the receiver's error text when an envelope from `peer` does not fit `t` ('' when it fits)");
}
}  // namespace
