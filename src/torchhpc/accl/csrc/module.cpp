// The Python face of the C++ backend: the class (a c10d::Backend torch's ProcessGroup dispatches to), its
// counters, the translation of accl's C++ errors into torchhpc.runtime.errors' classes, and the library's identity.
#include "accl.hpp"

#include <torch/csrc/utils/pybind.h>

#include <pybind11/chrono.h>  // Options.timeout and .spin as datetime.timedelta

#ifndef ACCL_MODULE
#error "build with -DACCL_MODULE=_backend_<family> (torchhpc.accl.corebuild does)"
#endif
#ifndef TORCH_BUILT_FOR
#error "build with -DTORCH_BUILT_FOR=\"<torch version>\""
#endif

namespace py = pybind11;
namespace accl = torchhpc::accl;
using accl::ProcessGroupACCL;

namespace {

std::string libraryVersion() {
  char buf[MPI_MAX_LIBRARY_VERSION_STRING] = {};
  int len = 0;
  if (MPI_Get_library_version(buf, &len) != MPI_SUCCESS) return "";
  return std::string(buf, static_cast<size_t>(len));
}

// the engine interface as Python implements it (torchhpc.accl.accl_engine.AcclEngine): dtypes as torch dtypes, ops
// by name ("SUM")
class PyEngine : public accl::Engine {
 public:
  using Engine::Engine;
  bool supports(accl::OpType coll, at::ScalarType dtype, std::optional<accl::RedOpType> op) const override {
    const std::optional<std::string> opName = op ? std::optional(accl::opName(*op)) : std::nullopt;
    PYBIND11_OVERRIDE_PURE(bool, Engine, supports, accl::collName(coll), dtype, opName);
  }
  void allreduce(const accl::Seg& b, const accl::Reduction& r) override {
    PYBIND11_OVERRIDE_PURE(void, Engine, allreduce, tensorOf(b), accl::opName(r.op));
  }
  void reduce(const accl::Seg& b, const accl::Reduction& r, int root) override {
    PYBIND11_OVERRIDE_PURE(void, Engine, reduce, tensorOf(b), accl::opName(r.op), root);
  }
  void broadcast(const accl::Seg& b, int root) override {
    PYBIND11_OVERRIDE_PURE(void, Engine, broadcast, tensorOf(b), root);
  }
  void allgather(const accl::Seg& send, const accl::Seg& rows) override {
    PYBIND11_OVERRIDE_PURE(void, Engine, allgather, tensorOf(send), tensorOf(rows));
  }
  void gather(const accl::Seg& send, const accl::Seg& rows, int root) override {
    PYBIND11_OVERRIDE_PURE(void, Engine, gather, tensorOf(send), tensorOf(rows), root);
  }
  void scatter(const accl::Seg& rows, const accl::Seg& recv, int root) override {
    PYBIND11_OVERRIDE_PURE(void, Engine, scatter, tensorOf(rows), tensorOf(recv), root);
  }
  void reduceScatter(const accl::Seg& rows, const accl::Seg& recv, const accl::Reduction& r) override {
    PYBIND11_OVERRIDE_PURE_NAME(void, Engine, "reduce_scatter", reduceScatter, tensorOf(rows), tensorOf(recv),
                                accl::opName(r.op));
  }
  void send(const accl::Seg& b, int dst, int tag) override { PYBIND11_OVERRIDE_PURE(void, Engine, send, tensorOf(b), dst, tag); }
  void recv(const accl::Seg& b, int src, int tag) override { PYBIND11_OVERRIDE_PURE(void, Engine, recv, tensorOf(b), src, tag); }

 private:
  // a segment as a tensor over the same memory (rows: p x count, strided); None where this rank has no buffer
  static at::Tensor tensorOf(const accl::Seg& s) {
    if (!s.data) return at::Tensor();
    const auto options = at::TensorOptions().dtype(s.dtype);
    if (s.rows == 1) return at::from_blob(s.data, {s.count}, options);
    return at::from_blob(s.data, {s.rows, s.count}, {s.stride / static_cast<int64_t>(c10::elementSize(s.dtype)), 1},
                         options);
  }
};

// `comm`: the communicator's Fortran handle (mpi4py's Comm.py2f()), one integer under every MPI
c10::intrusive_ptr<ProcessGroupACCL> create(MPI_Fint comm, accl::Config options, std::shared_ptr<accl::Engine> engine) {
  return c10::make_intrusive<ProcessGroupACCL>(MPI_Comm_f2c(comm), std::move(options), std::move(engine));
}

// the group's options, one struct: torchhpc.accl.AcclOptions fills every field (options.py), and plan() reads them
void defineOptions(py::module_ m) {
  py::class_<accl::Config>(m, "Options")
      .def(py::init<>())
      .def_readwrite("max_segment_bytes", &accl::Config::maxSegmentBytes)
      .def_readwrite("ring_min_bytes", &accl::Config::ringMinBytes)
      .def_readwrite("timeout", &accl::Config::timeout)
      .def_readwrite("group_name", &accl::Config::groupName)
      .def_readwrite("sidestep", &accl::Config::sidestep)
      .def_readwrite("flight_stacks", &accl::Config::flightStacks)
      .def_readwrite("spin", &accl::Config::spin);
  m.def("plan", [](const std::string& collective, int64_t bytes, int ranks, bool spansNodes, const accl::Config& o,
                   bool onMpi) {
    for (const auto& [t, name] : accl::kCollectives)
      if (collective == name && t != accl::OpType::SEND && t != accl::OpType::RECV)
        return std::string(accl::kPathNames[static_cast<int>(accl::plan(t, bytes, ranks, spansNodes, onMpi, o))]);
    throw py::value_error("accl: no collective named '" + collective + "'");
  }, py::arg("collective"), py::arg("bytes"), py::arg("ranks"), py::arg("spans_nodes"), py::arg("options"),
        py::arg("on_mpi") = true, "the path plan() chooses for a call (collectives by the flight recorder's names)");
}

// accl's C++ errors as torchhpc.runtime.errors' classes (the suites and users catch those)
void translate(std::exception_ptr p) {
  static py::handle timeout, failed, mismatch;
  if (!timeout) {
    py::module_ errors = py::module_::import("torchhpc.runtime.errors");
    timeout = py::object(errors.attr("PeerTimeoutError")).release();
    failed = py::object(errors.attr("PeerFailedError")).release();
    mismatch = py::object(errors.attr("MismatchError")).release();
  }
  try {
    if (p) std::rethrow_exception(p);
  } catch (const accl::PeerTimeoutError& e) {
    PyErr_SetObject(timeout.ptr(), timeout(e.msg()).ptr());
  } catch (const accl::PeerFailedError& e) {
    PyErr_SetObject(failed.ptr(), failed(e.msg(), e.failedRanks).ptr());
  } catch (const accl::MismatchError& e) {
    PyErr_SetObject(mismatch.ptr(), mismatch(e.msg()).ptr());
  }
}

}  // namespace

#ifdef ACCL_TEST_HOOKS  // a test build: the file corebuild --test-hooks names (tests/accl_hooks.cpp), defineWire
#include ACCL_TEST_HOOKS
#endif

#define ACCL_STR2(x) #x
#define ACCL_STR(x) ACCL_STR2(x)

PYBIND11_MODULE(ACCL_MODULE, m) {
  m.doc() = "torchhpc.accl's C++ backend (c10d::Backend over MPI), built for one MPI family and one torch";
  py::module_::import("torch.distributed");  // c10d::Backend's Python type
  py::class_<accl::Engine, PyEngine, std::shared_ptr<accl::Engine>>(
      m, "Engine", "an engine other than MPI, implemented in Python: blocking calls on host tensors")
      .def(py::init<std::string>(), py::arg("name"));
  py::class_<accl::Stats> stats(m, "Stats", "the group's counters, settable (group.py shows them as a mapping)");
  for (auto [name, field] : {std::pair{"engine_calls", &accl::Stats::engineCalls},
                             {"sidestep_calls", &accl::Stats::sidestepCalls},
                             {"max_call_bytes", &accl::Stats::maxCallBytes},
                             {"queued_calls", &accl::Stats::queuedCalls}})
    stats.def_property(name, [field](accl::Stats& s) { return (s.*field).load(); },
                       [field](accl::Stats& s, int64_t v) { (s.*field).store(v); });
  defineOptions(m);
  py::class_<ProcessGroupACCL, c10d::Backend, c10::intrusive_ptr<ProcessGroupACCL>>(m, "ProcessGroupACCL")
      .def(py::init(&create), py::arg("comm"), py::arg("options"), py::arg("engine") = nullptr,
           py::call_guard<py::gil_scoped_release>(),
           "a group over a duplicate of the MPI communicator `comm` (its Fortran handle, mpi4py's Comm.py2f()); "
           "collective: every rank of the communicator constructs it")
      .def("set_global_ranks", &ProcessGroupACCL::setGlobalRanks, py::arg("ranks"),
           "torch's global rank of each group rank (the flight record's group membership)")
      .def_property_readonly("engine_name", &ProcessGroupACCL::engineName)
      .def_property_readonly("stats", &ProcessGroupACCL::stats, py::return_value_policy::reference_internal);
  // the Work of every call (torch's pybind11 bindings return the most derived registered type)
  py::class_<accl::WorkACCL, c10d::Work, c10::intrusive_ptr<accl::WorkACCL>>(m, "AcclWork")
      // torch binds Work.result without releasing the GIL; ours waits, and a worker thread completing a future
      // may need the GIL for the Python callbacks chained on it (Future.then)
      .def("result", &accl::WorkACCL::result, py::call_guard<py::gil_scoped_release>())
      .def("__repr__", [](accl::WorkACCL& w) {
        return "AcclWork(" + w.what() + ", " + (w.isCompleted() ? "done" : "pending") + ")";
      });
  py::register_exception_translator(&translate);
#ifdef ACCL_TEST_HOOKS
  defineWire(m);
#endif
  py::tuple collectives(accl::kEngineOps);
  for (int i = 0; i < accl::kEngineOps; ++i) collectives[i] = accl::kCollectives[i].name;
  m.attr("COLLECTIVES") = collectives;
  m.def("library_version", &libraryVersion, "MPI_Get_library_version");
  m.def("peers_lost", [] { return py::make_tuple(accl::peersDied(), accl::peersSilentTimeout()); },
        "(whether a group of this process saw peers die, the longest timeout of its groups aborted because peers "
        "fell silent or 0)");
  m.def("arm_abort_grace", &accl::armAbortGrace,
        "before an MPI_Abort: the process ends itself (SIGALRM) if the launcher has not ended it in time "
        "(kAbortGraceS)");
  m.def("flight_recorder_built", &accl::frBuilt, "whether accl records its calls in torch's flight recorder");
  m.def("dump_flight_record", &accl::frWrite, py::arg("global_rank"), py::call_guard<py::gil_scoped_release>(),
        "every recorded call of this process, in torch's format, through torch's DebugInfoWriter; the file");
  m.attr("torch_version") = TORCH_BUILT_FOR;
  m.attr("module") = ACCL_STR(ACCL_MODULE);
}
