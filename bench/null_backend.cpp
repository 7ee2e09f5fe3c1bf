// A c10d::Backend that does nothing and returns completed Work: what torch's Python wrapper, its dispatcher and
// the Work cost any C++ backend per call (bench/accl_overhead.py's "C++ floor").  Built by the bench itself with
// torch.utils.cpp_extension; not part of the package.
#include <torch/extension.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

namespace {

class DoneWork : public c10d::Work {
 public:
  explicit DoneWork(c10d::OpType type) : c10d::Work(0, type) {}
  bool isCompleted() override { return true; }
  bool isSuccess() const override { return true; }
  bool wait(std::chrono::milliseconds) override { return true; }
};

class NullBackend : public c10d::Backend {
 public:
  NullBackend() : c10d::Backend(0, 1) {}
  const std::string getBackendName() const override { return "null_cpp"; }
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>&, const c10d::AllreduceOptions&) override {
    return done(c10d::OpType::ALLREDUCE);
  }
  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>&, const c10d::BroadcastOptions&) override {
    return done(c10d::OpType::BROADCAST);
  }
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor&, at::Tensor&, const c10d::AllgatherOptions&) override {
    return done(c10d::OpType::_ALLGATHER_BASE);
  }
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor&, at::Tensor&,
                                                      const c10d::ReduceScatterOptions&) override {
    return done(c10d::OpType::_REDUCE_SCATTER_BASE);
  }
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor&, at::Tensor&, std::vector<int64_t>&, std::vector<int64_t>&,
                                               const c10d::AllToAllOptions&) override {
    return done(c10d::OpType::ALLTOALL_BASE);
  }
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions&) override {
    return done(c10d::OpType::BARRIER);
  }

 private:
  static c10::intrusive_ptr<c10d::Work> done(c10d::OpType type) { return c10::make_intrusive<DoneWork>(type); }
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<NullBackend, c10d::Backend, c10::intrusive_ptr<NullBackend>>(m, "NullBackend").def(py::init<>());
}
