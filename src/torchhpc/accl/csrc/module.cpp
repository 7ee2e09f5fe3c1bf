// The Python face of the C++ backend: the class (a c10d::Backend torch's ProcessGroup dispatches to), its
// counters, the translation of accl's C++ errors into torchhpc.errors' classes, and the library's identity.
#include "accl.hpp"

#include <torch/csrc/utils/pybind.h>

#ifndef ACCL_MODULE
#error "build with -DACCL_MODULE=_backend_<family> (torchhpc.accl.corebuild does)"
#endif
#ifndef TORCH_BUILT_FOR
#error "build with -DTORCH_BUILT_FOR=\"<torch version>\""
#endif

namespace py = pybind11;
using torchhpc::accl::ProcessGroupACCL;

namespace {

std::string libraryVersion() {
  char buf[MPI_MAX_LIBRARY_VERSION_STRING] = {};
  int len = 0;
  if (MPI_Get_library_version(buf, &len) != MPI_SUCCESS) return "";
  return std::string(buf, static_cast<size_t>(len));
}

// an MPI handle as mpi4py gives it (MPI._handleof): a pointer (Open MPI) or an int (MPICH)
template <typename H>
H handleOf(uintptr_t v) {
  if constexpr (std::is_pointer_v<H>) return reinterpret_cast<H>(v);
  else return static_cast<H>(v);
}

// the engine interface as Python implements it (torchhpc.accl.accl_engine.AcclEngine); its `name` is a plain
// attribute, as `ProcessGroupACCL.engine.name` always was
class PyEngine : public torchhpc::accl::Engine {
 public:
  using Engine::Engine;
  std::string name() const override {
    py::gil_scoped_acquire gil;
    py::handle self = py::detail::get_object_handle(this, py::detail::get_type_info(typeid(torchhpc::accl::Engine)));
    return self ? py::str(self.attr("name")).cast<std::string>() : std::string("engine");
  }
  bool supports(const std::string& coll, int64_t dcode, int64_t ocode) const override {
    PYBIND11_OVERRIDE_PURE(bool, Engine, supports, coll, dcode, ocode);
  }
  void allreduce(at::Tensor buf, int64_t ocode) override { PYBIND11_OVERRIDE_PURE(void, Engine, allreduce, buf, ocode); }
  void reduce(at::Tensor buf, int64_t ocode, int64_t root) override {
    PYBIND11_OVERRIDE_PURE(void, Engine, reduce, buf, ocode, root);
  }
  void broadcast(at::Tensor buf, int64_t root) override { PYBIND11_OVERRIDE_PURE(void, Engine, broadcast, buf, root); }
  void allgather(at::Tensor send, at::Tensor recv) override {
    PYBIND11_OVERRIDE_PURE(void, Engine, allgather, send, recv);
  }
  void gather(at::Tensor send, at::Tensor recv, int64_t root) override {
    PYBIND11_OVERRIDE_PURE(void, Engine, gather, send, recv, root);
  }
  void scatter(at::Tensor send, at::Tensor recv, int64_t root) override {
    PYBIND11_OVERRIDE_PURE(void, Engine, scatter, send, recv, root);
  }
  void reduceScatter(at::Tensor send, at::Tensor recv, int64_t ocode) override {
    PYBIND11_OVERRIDE_PURE_NAME(void, Engine, "reduce_scatter", reduceScatter, send, recv, ocode);
  }
  void send(at::Tensor buf, int64_t dst, int64_t tag) override { PYBIND11_OVERRIDE_PURE(void, Engine, send, buf, dst, tag); }
  void recv(at::Tensor buf, int64_t src, int64_t tag) override { PYBIND11_OVERRIDE_PURE(void, Engine, recv, buf, src, tag); }
};

c10::intrusive_ptr<ProcessGroupACCL> create(uintptr_t comm, int64_t maxSegmentBytes, bool check,
                                            int64_t thresholdBytes, double timeoutS, std::string name,
                                            std::shared_ptr<torchhpc::accl::Engine> engine,
                                            std::vector<std::string> sidestep) {
  torchhpc::accl::Config o;
  o.maxSegmentBytes = maxSegmentBytes;
  o.check = check;
  o.thresholdBytes = thresholdBytes;
  o.timeout = std::chrono::milliseconds(static_cast<int64_t>(timeoutS * 1000.0));
  o.groupName = std::move(name);
  o.sidestep = std::move(sidestep);
  return c10::make_intrusive<ProcessGroupACCL>(handleOf<MPI_Comm>(comm), std::move(o), std::move(engine));
}

std::atomic<int64_t>& counter(ProcessGroupACCL& pg, const std::string& name) {
  auto& s = pg.stats();
  if (name == "engine_calls") return s.engineCalls;
  if (name == "sidestep_calls") return s.sidestepCalls;
  if (name == "max_call_bytes") return s.maxCallBytes;
  if (name == "queued_calls") return s.queuedCalls;
  throw py::key_error(name);
}

// accl's C++ errors as torchhpc.errors' classes (the suites and users catch those)
void translate(std::exception_ptr p) {
  static py::handle timeout, failed, mismatch;
  if (!timeout) {
    py::module_ errors = py::module_::import("torchhpc.errors");
    timeout = py::object(errors.attr("PeerTimeoutError")).release();
    failed = py::object(errors.attr("PeerFailedError")).release();
    mismatch = py::object(errors.attr("MismatchError")).release();
  }
  try {
    if (p) std::rethrow_exception(p);
  } catch (const torchhpc::accl::PeerTimeoutError& e) {
    PyErr_SetObject(timeout.ptr(), timeout(e.msg()).ptr());
  } catch (const torchhpc::accl::PeerFailedError& e) {
    // MPI_Finalize would wait for the dead rank forever: this process ends with MPI_Abort at exit instead
    py::module_::import("mpi4py.run").attr("set_abort_status")(1);
    PyErr_SetObject(failed.ptr(), failed(e.msg(), e.failedRanks).ptr());
  } catch (const torchhpc::accl::MismatchError& e) {
    PyErr_SetObject(mismatch.ptr(), mismatch(e.msg()).ptr());
  }
}

}  // namespace

#define ACCL_STR2(x) #x
#define ACCL_STR(x) ACCL_STR2(x)

PYBIND11_MODULE(ACCL_MODULE, m) {
  m.doc() = "torchhpc.accl's C++ backend (c10d::Backend over MPI), built for one MPI family and one torch";
  py::module_::import("torch.distributed");  // c10d::Backend's Python type
  py::class_<torchhpc::accl::Engine, PyEngine, std::shared_ptr<torchhpc::accl::Engine>>(
      m, "Engine", "an engine other than MPI, implemented in Python: blocking calls on contiguous host tensors")
      .def(py::init<>());
  py::class_<ProcessGroupACCL, c10d::Backend, c10::intrusive_ptr<ProcessGroupACCL>>(m, "ProcessGroupACCL")
      .def(py::init(&create), py::arg("comm"), py::arg("max_segment_bytes"), py::arg("check"),
           py::arg("threshold_bytes"), py::arg("timeout_s"), py::arg("group_name"), py::arg("engine") = nullptr,
           py::arg("sidestep") = std::vector<std::string>{},
           py::call_guard<py::gil_scoped_release>(),
           "a group over a duplicate of the MPI communicator `comm` (mpi4py's handle); collective: every rank "
           "of the communicator constructs it")
      .def(
          "monitored_barrier",
          [](ProcessGroupACCL& pg, double timeoutS, bool waitAllRanks) {
            c10d::BarrierOptions o;
            o.timeout = std::chrono::milliseconds(static_cast<int64_t>(timeoutS * 1000.0 + 0.5));
            pg.monitoredBarrier(o, waitAllRanks);
          },
          py::arg("timeout_s"), py::arg("wait_all_ranks") = false, py::call_guard<py::gil_scoped_release>())
      .def("stat", [](ProcessGroupACCL& pg, const std::string& name) { return counter(pg, name).load(); })
      .def("set_stat", [](ProcessGroupACCL& pg, const std::string& name, int64_t v) { counter(pg, name).store(v); });
  // the Work of every call (torch's pybind11 bindings return the most derived registered type)
  py::class_<torchhpc::accl::WorkACCL, c10d::Work, c10::intrusive_ptr<torchhpc::accl::WorkACCL>>(m, "AcclWork")
      // torch binds Work.result without releasing the GIL; ours waits, and a worker thread completing a future
      // may need the GIL for the Python callbacks chained on it (Future.then)
      .def("result", &torchhpc::accl::WorkACCL::result, py::call_guard<py::gil_scoped_release>())
      .def("__repr__", [](torchhpc::accl::WorkACCL& w) {
        return "AcclWork(" + w.what() + ", " + (w.isCompleted() ? "done" : "pending") + ")";
      });
  py::register_exception_translator(&translate);
  m.def("library_version", &libraryVersion, "MPI_Get_library_version");
  m.def("cuda_aware", &torchhpc::accl::cudaAwareMpi,
        "whether this MPI library takes CUDA device buffers (the query of our PyTorch patch)");
  m.attr("torch_version") = TORCH_BUILT_FOR;
  m.attr("module") = ACCL_STR(ACCL_MODULE);
}
