// torchhpc.mpi_upstream: PyTorch's own ProcessGroupMPI (upstream's ProcessGroupMPI.cpp with our patches,
// see torchhpc/mpi_upstream/build.py) built as an extension module against an installed torch.
//
// The patched upstream file is compiled as part of this translation unit (MPI_UPSTREAM_SOURCE names it),
// so the module can also call the file's own cudaAwareMpiCheck() (in its anonymous namespace): what the
// backend answers for a CUDA tensor is what `cuda_aware()` returns.  Nothing of upstream's code is changed
// here; this file only adds the Python entry points.
#ifndef USE_C10D_MPI
#error "build with -DUSE_C10D_MPI (torch's ProcessGroupMPI.hpp is empty without it)"
#endif
#ifndef MPI_UPSTREAM_SOURCE
#error "build with -DMPI_UPSTREAM_SOURCE=\"<patched ProcessGroupMPI.cpp>\""
#endif
#ifndef MPI_UPSTREAM_MODULE
#error "build with -DMPI_UPSTREAM_MODULE=<module name>"
#endif
#ifndef MPI_UPSTREAM_TORCH
#error "build with -DMPI_UPSTREAM_TORCH=\"<torch version built against>\""
#endif

#include MPI_UPSTREAM_SOURCE

#include <torch/csrc/utils/pybind.h>

#include <string>
#include <vector>

namespace {

namespace py = pybind11;

// A process group over MPI_COMM_WORLD (ranks empty) or the world ranks `ranks`, made by upstream's
// createProcessGroupMPI (which initializes MPI when nobody has).  Null for a process outside `ranks`.
c10::intrusive_ptr<c10d::Backend> create(const std::vector<int>& ranks) {
  return c10d::ProcessGroupMPI::createProcessGroupMPI(ranks);
}

// The library's MPI_Get_library_version, first line.
std::string libraryVersion() {
  char buf[MPI_MAX_LIBRARY_VERSION_STRING] = {};
  int len = 0;
  if (MPI_Get_library_version(buf, &len) != MPI_SUCCESS) {
    return "";
  }
  std::string text(buf, static_cast<size_t>(len));
  auto end = text.find('\n');
  return end == std::string::npos ? text : text.substr(0, end);
}

bool mpiInitialized() {
  int flag = 0;
  MPI_Initialized(&flag);
  return flag != 0;
}

} // namespace

#define MPI_UPSTREAM_STR2(x) #x
#define MPI_UPSTREAM_STR(x) MPI_UPSTREAM_STR2(x)

PYBIND11_MODULE(MPI_UPSTREAM_MODULE, m) {
  m.doc() = "PyTorch's ProcessGroupMPI (patched upstream source) for torchhpc.mpi_upstream";
  m.def("create", &create, py::arg("ranks") = std::vector<int>{},
        py::call_guard<py::gil_scoped_release>(),
        "upstream's ProcessGroupMPI::createProcessGroupMPI(ranks) as a c10d Backend (None outside ranks)");
  m.def("cuda_aware", []() { return c10d::cudaAwareMpiCheck(); },
        "the patched file's own cudaAwareMpiCheck(): whether CUDA tensors may be passed to this MPI");
  m.def("library_version", &libraryVersion, "MPI_Get_library_version, first line");
  m.def("initialized", &mpiInitialized, "MPI_Initialized");
  m.attr("torch_version") = MPI_UPSTREAM_TORCH;
  m.attr("module") = MPI_UPSTREAM_STR(MPI_UPSTREAM_MODULE);
}
