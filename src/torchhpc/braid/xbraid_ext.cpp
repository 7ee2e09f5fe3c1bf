// _torchhpc_xbraid: XBraid's C library driven from Python, with torch tensors (Python objects) as braid vectors.
//
// A braid vector holds one reference to an immutable Python object (a tensor): step and sum store a new object
// instead of writing into the old one, so clone only shares the reference and no tensor a caller passed in is
// ever modified.  Every tensor operation is a method of the Python adaptor (torchhpc.braid.xbraid.Adaptor).
//
// GIL: braid_Drive and braid_Destroy run with the GIL released (other Python threads go on while XBraid waits
// on MPI); every callback takes it back for its Python calls.
//
// Errors: a Python exception in a callback is kept (the first one) and never crosses the C frames.  From then on
// the callbacks on this rank do no Python work, and the spatial norm is NaN, so the space-time residual that
// XBraid reduces over all ranks is NaN on every rank and XBraid stops at the end of the cycle ("diverged").
// run() returns the exception to the Python side, which agrees on errors over the ranks and raises.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <mpi.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "braid.h"

namespace py = pybind11;

struct _braid_App_struct {
  PyObject *adaptor = nullptr;  // borrowed: run() holds a reference for the whole solve
  bool failed = false;
  py::object error;              // the first exception raised by a callback
  braid_Int bufsize = 0;
};

struct _braid_Vector_struct {
  PyObject *obj;  // one owned reference
};

namespace {

braid_Vector new_vector(py::object obj) {
  auto *v = new _braid_Vector_struct;
  v->obj = obj.release().ptr();
  return v;
}

void set_obj(braid_Vector v, py::object obj) {
  PyObject *old = v->obj;
  v->obj = obj.release().ptr();
  Py_XDECREF(old);
}

py::handle obj(braid_Vector v) { return py::handle(v->obj); }

// Run f (Python work) unless an earlier callback failed; keep the first exception.
template <class F>
braid_Int guarded(braid_App app, F &&f) {
  if (app->failed) return 1;
  try {
    f();
    return 0;
  } catch (py::error_already_set &e) {
    app->failed = true;
    app->error = e.value();
    return 1;
  } catch (std::exception &e) {
    app->failed = true;
    app->error = py::reinterpret_steal<py::object>(PyObject_CallFunction(PyExc_RuntimeError, "s", e.what()));
    return 1;
  }
}

py::object adaptor(braid_App app) { return py::reinterpret_borrow<py::object>(app->adaptor); }

braid_Int cb_step(braid_App app, braid_Vector /*ustop*/, braid_Vector /*fstop*/, braid_Vector u,
                  braid_StepStatus status) {
  py::gil_scoped_acquire gil;
  braid_Real tstart = 0, tstop = 0;
  braid_Int level = 0;
  braid_StepStatusGetTstartTstop(status, &tstart, &tstop);
  braid_StepStatusGetLevel(status, &level);
  return guarded(app, [&] { set_obj(u, adaptor(app).attr("step")(obj(u), tstart, tstop, level)); });
}

braid_Int cb_init(braid_App app, braid_Real t, braid_Vector *u_ptr) {
  py::gil_scoped_acquire gil;
  *u_ptr = new_vector(py::none());
  return guarded(app, [&] { set_obj(*u_ptr, adaptor(app).attr("init")(t)); });
}

braid_Int cb_clone(braid_App /*app*/, braid_Vector u, braid_Vector *v_ptr) {
  py::gil_scoped_acquire gil;
  *v_ptr = new_vector(py::reinterpret_borrow<py::object>(obj(u)));
  return 0;
}

braid_Int cb_free(braid_App /*app*/, braid_Vector u) {
  py::gil_scoped_acquire gil;
  Py_XDECREF(u->obj);
  delete u;
  return 0;
}

braid_Int cb_sum(braid_App app, braid_Real alpha, braid_Vector x, braid_Real beta, braid_Vector y) {
  py::gil_scoped_acquire gil;
  return guarded(app, [&] { set_obj(y, adaptor(app).attr("sum")(alpha, obj(x), beta, obj(y))); });
}

braid_Int cb_norm(braid_App app, braid_Vector u, braid_Real *norm_ptr) {
  py::gil_scoped_acquire gil;
  *norm_ptr = std::numeric_limits<double>::quiet_NaN();
  return guarded(app, [&] { *norm_ptr = adaptor(app).attr("norm")(obj(u)).cast<double>(); });
}

braid_Int cb_access(braid_App app, braid_Vector u, braid_AccessStatus status) {
  py::gil_scoped_acquire gil;
  braid_Real t = 0;
  braid_Int level = 0, done = 0;
  braid_AccessStatusGetT(status, &t);
  braid_AccessStatusGetLevel(status, &level);
  braid_AccessStatusGetDone(status, &done);
  return guarded(app, [&] { adaptor(app).attr("access")(t, obj(u), level, done); });
}

braid_Int cb_bufsize(braid_App app, braid_Int *size_ptr, braid_BufferStatus /*status*/) {
  *size_ptr = app->bufsize;
  return 0;
}

braid_Int cb_bufpack(braid_App app, braid_Vector u, void *buffer, braid_BufferStatus status) {
  py::gil_scoped_acquire gil;
  braid_BufferStatusSetSize(status, 0);
  if (app->failed) {  // keep the message well formed: an empty header unpacks as "nothing" on the peer
    std::memset(buffer, 0, std::min<braid_Int>(app->bufsize, 64));
    braid_BufferStatusSetSize(status, std::min<braid_Int>(app->bufsize, 64));
    return 1;
  }
  return guarded(app, [&] {
    auto view = py::memoryview::from_memory(buffer, app->bufsize, false);
    braid_Int n = adaptor(app).attr("pack")(obj(u), view).cast<braid_Int>();
    braid_BufferStatusSetSize(status, n);
  });
}

braid_Int cb_bufunpack(braid_App app, void *buffer, braid_Vector *u_ptr, braid_BufferStatus /*status*/) {
  py::gil_scoped_acquire gil;
  *u_ptr = new_vector(py::none());
  return guarded(app, [&] {
    auto view = py::memoryview::from_memory(buffer, app->bufsize, true);
    set_obj(*u_ptr, adaptor(app).attr("unpack")(view));
  });
}

void check(braid_Int rc, const char *what) {
  if (rc != 0) throw std::runtime_error(std::string("XBraid: ") + what + " failed");
}

// One XBraid solve over fine points 0..ntime (times 0.0 .. ntime), options as torchhpc.braid names them.
py::dict run(std::uintptr_t comm_address, py::object adapt, int ntime, int max_levels, int min_coarse,
             std::vector<int> cfactor, std::vector<int> nrelax, std::vector<double> cweight, double tol,
             bool relative, int max_iter, bool skip, bool fmg, int tnorm, bool reverted_ranks, int bufsize,
             int print_level) {
  if (ntime < 1) throw py::value_error("ntime must be >= 1");
  if (cfactor.empty() || nrelax.empty() || cweight.empty()) throw py::value_error("per-level lists must not be empty");
  MPI_Comm comm = *reinterpret_cast<MPI_Comm *>(comm_address);
  _braid_App_struct app;
  app.adaptor = adapt.ptr();
  app.bufsize = bufsize;
  braid_Core core = nullptr;
  check(braid_Init(comm, comm, 0.0, static_cast<double>(ntime), ntime, &app, cb_step, cb_init, cb_clone, cb_free,
                   cb_sum, cb_norm, cb_access, cb_bufsize, cb_bufpack, cb_bufunpack, &core),
        "braid_Init");
  braid_SetPrintLevel(core, print_level);  // 1: XBraid's per-iteration residual line on rank 0
  braid_SetFileIOLevel(core, 0);
  braid_SetAccessLevel(core, 1);
  braid_SetMaxLevels(core, max_levels);
  braid_SetMinCoarse(core, min_coarse);
  // a per-level list repeats its last entry on deeper levels: that entry is XBraid's default (level -1)
  braid_SetCFactor(core, -1, cfactor.back());
  braid_SetNRelax(core, -1, nrelax.back());
  braid_SetCRelaxWt(core, -1, cweight.back());
  for (int l = 0; l < max_levels; ++l) {
    if (l < static_cast<int>(cfactor.size())) braid_SetCFactor(core, l, cfactor[l]);
    if (l < static_cast<int>(nrelax.size())) braid_SetNRelax(core, l, nrelax[l]);
    if (l < static_cast<int>(cweight.size())) braid_SetCRelaxWt(core, l, cweight[l]);
  }
  if (relative)
    braid_SetRelTol(core, tol);
  else
    braid_SetAbsTol(core, tol);
  braid_SetMaxIter(core, max_iter);
  braid_SetSkip(core, skip ? 1 : 0);
  if (fmg) braid_SetFMG(core);
  braid_SetTemporalNorm(core, tnorm);
  if (reverted_ranks) braid_SetRevertedRanks(core, 1);

  braid_Int rc;
  {
    py::gil_scoped_release nogil;
    rc = braid_Drive(core);
  }
  braid_Int niter = 0, nlevels = 0;
  braid_GetNumIter(core, &niter);
  braid_GetNLevels(core, &nlevels);
  std::vector<double> rnorms(static_cast<size_t>(std::max<braid_Int>(niter, 1)), 0.0);
  braid_Int nreq = niter;
  if (niter > 0) braid_GetRNorms(core, &nreq, rnorms.data());
  {
    py::gil_scoped_release nogil;
    braid_Destroy(core);
  }
  py::list res;
  for (braid_Int i = 0; i < nreq; ++i) res.append(rnorms[static_cast<size_t>(i)]);
  py::dict out;
  out["residuals"] = res;
  out["iterations"] = niter;
  out["levels"] = nlevels;
  out["rc"] = rc;
  out["error"] = app.failed ? app.error : py::none();
  return out;
}

}  // namespace

PYBIND11_MODULE(_torchhpc_xbraid, m) {
  m.doc() = "XBraid (MGRIT, C library) with torch tensors as braid vectors; used by torchhpc.braid engine='xbraid'";
  m.attr("XBRAID_VERSION") = TORCHHPC_XBRAID_VERSION;
  m.attr("INVALID_RNORM") = static_cast<double>(braid_INVALID_RNORM);
  m.def("run", &run, py::arg("comm_address"), py::arg("adaptor"), py::arg("ntime"), py::arg("max_levels"),
        py::arg("min_coarse"), py::arg("cfactor"), py::arg("nrelax"), py::arg("cweight"), py::arg("tol"),
        py::arg("relative"), py::arg("max_iter"), py::arg("skip"), py::arg("fmg"), py::arg("tnorm"),
        py::arg("reverted_ranks"), py::arg("bufsize"), py::arg("print_level") = 0,
        "Run one XBraid solve; returns residuals (braid_GetRNorms), iterations, levels and a callback error.");
}
