/* torchhpc.accl's front: torch's process-group calls read in C++, for the compiled core.
 *
 * torch.distributed hands a Python process group its tensors and options as Python objects; reading them
 * from Python (the tensor's dtype, device, layout, address and size; the options' asyncOp and reduceOp)
 * costs about a microsecond per call before anything reaches MPI.  A Front reads them in C++ from torch's
 * own objects (THPVariable_Unpack, the pybind11-bound c10d options) and, for the common case only (a
 * synchronous call of contiguous CPU tensors whose dtype and reduction the group has already seen), makes
 * the core's Call and runs it through the core's Group.run_idle, exactly as the Python adapter
 * (torchhpc.accl.process_group) would.  Everything else (async calls, other devices, strided or sparse
 * tensors, explicit split sizes, a busy or aborted group, bad arguments and their errors) goes to the
 * adapter's method unchanged: the Front decides nothing the adapter does not, and its calls' wire
 * behaviour is the core's, written once.
 *
 * Built once per torch (not per MPI: it calls the core through Python's vectorcall) by
 * torchhpc.accl.corebuild; loaded by torchhpc.accl.core.load_front, which checks the torch version.
 */
#include <Python.h>
#include <structmember.h>

#include <pybind11/pybind11.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include <cstddef>
#include <cstdint>
#include <cstring>

#ifndef TORCH_BUILT_FOR
#error "build with -DTORCH_BUILT_FOR='\"<torch.__version__>\"' (torchhpc.accl.corebuild does)"
#endif

namespace py = pybind11;

namespace {

constexpr int kTypes = static_cast<int>(c10::ScalarType::NumOptions);
constexpr int kOps = 16;  // c10d::ReduceOp::RedOpType values are below this

enum Coll { ALL_REDUCE, BROADCAST, ALL_GATHER, REDUCE_SCATTER, ALL_TO_ALL, N_COLL };
const char *const kSlow[N_COLL] = {"allreduce", "broadcast", "all_gather_single", "reduce_scatter_single",
                                   "all_to_all_single"};
const char *const kCoreMethod[N_COLL] = {"all_reduce", "broadcast", "all_gather", "reduce_scatter", "all_to_all"};
PyObject *slow_name[N_COLL];
PyObject *S_run_idle;

struct Front {
    PyObject_HEAD
    PyObject *pg;          // weak reference to the ProcessGroupACCL: its methods take what the Front leaves
    PyObject *ex;          // the group's Executor (Group.run_idle reads its lock, queue and state)
    PyObject *eng;         // the group's MpiEngine (the Calls' engine)
    PyObject *make[N_COLL];  // the core Group's factories, bound
    PyObject *run_idle;    // the core Group's run_idle, bound
    PyObject *kind[N_COLL];  // wire kind codes
    PyObject *tensor_type; // torch.Tensor: exactly this type takes the fast path (not subclasses)
    int size;
    PyObject *dcode[kTypes];      // wire dtype codes by ScalarType (NULL: outside wire.DTYPES)
    PyObject *red[kTypes][kOps];  // the core's reduction tuples by (ScalarType, RedOpType), as learnt
};

/* The tensor behind ``obj`` when it is exactly a torch.Tensor, strided, on the CPU and contiguous: the
 * core then reads and writes its memory directly.  NULL for anything else. */
const at::Tensor *host_tensor(const Front *f, PyObject *obj) {
    if (Py_TYPE(obj) != reinterpret_cast<PyTypeObject *>(f->tensor_type))
        return nullptr;
    const at::Tensor &t = THPVariable_Unpack(obj);
    if (t.layout() != c10::kStrided || !t.device().is_cpu() || !t.is_contiguous())
        return nullptr;
    return &t;
}

/* torch's options object as its C++ struct, or NULL (another type) */
template <typename Opts>
Opts *options(PyObject *obj) {
    try {
        return py::handle(obj).cast<Opts *>();
    } catch (const py::cast_error &) {
        return nullptr;
    }
}

PyObject *dcode_of(const Front *f, c10::ScalarType st) {
    int i = static_cast<int>(st);
    return i >= 0 && i < kTypes ? f->dcode[i] : nullptr;
}

PyObject *reduction_of(const Front *f, c10::ScalarType st, int op) {
    int i = static_cast<int>(st);
    return i >= 0 && i < kTypes && op >= 0 && op < kOps ? f->red[i][op] : nullptr;
}

/* The process group (a new reference), or NULL with an error once it is gone. */
PyObject *group_of(Front *f) {
    PyObject *pg;
#if PY_VERSION_HEX >= 0x030D0000
    if (PyWeakref_GetRef(f->pg, &pg) < 0)
        return nullptr;
#else
    pg = PyWeakref_GetObject(f->pg);  // borrowed
    pg = pg == Py_None ? nullptr : Py_NewRef(pg);
#endif
    if (!pg && !PyErr_Occurred())
        PyErr_SetString(PyExc_RuntimeError, "accl: the process group of this call was destroyed");
    return pg;
}

/* The adapter's own method for what the Front leaves: ProcessGroupACCL.<name>(pg, *args, **kw). */
PyObject *slow(Front *f, Coll which, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    PyObject *pg = group_of(f);
    if (!pg)
        return nullptr;
    PyObject *method = PyObject_GetAttr(reinterpret_cast<PyObject *>(Py_TYPE(pg)), slow_name[which]);
    if (!method) {
        Py_DECREF(pg);
        return nullptr;
    }
    Py_ssize_t n = PyVectorcall_NARGS(nargsf), nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    PyObject *small[8];
    PyObject **argv = n + nkw + 1 <= 8 ? small : static_cast<PyObject **>(PyMem_Malloc(sizeof(PyObject *) *
                                                                                      static_cast<size_t>(n + nkw + 1)));
    if (!argv) {
        Py_DECREF(method);
        Py_DECREF(pg);
        return PyErr_NoMemory();
    }
    argv[0] = pg;
    for (Py_ssize_t i = 0; i < n + nkw; i++)
        argv[i + 1] = args[i];
    PyObject *r = PyObject_Vectorcall(method, argv, static_cast<size_t>(n + 1), kwnames);
    if (argv != small)
        PyMem_Free(argv);
    Py_DECREF(method);
    Py_DECREF(pg);
    return r;
}

/* Make the core Call with ``argv`` (its factory's arguments) and run it inline; when the group is busy the
 * adapter's method takes the whole call over (it queues it). */
PyObject *run(Front *f, Coll which, PyObject *const *argv, size_t argc, PyObject *const *args, size_t nargsf,
              PyObject *kwnames) {
    PyObject *call = PyObject_Vectorcall(f->make[which], argv, argc, nullptr);
    if (!call)
        return nullptr;
    PyObject *ra[2] = {call, f->ex};
    PyObject *r = PyObject_Vectorcall(f->run_idle, ra, 2, nullptr);
    Py_DECREF(call);
    if (r == Py_NotImplemented) {
        Py_DECREF(r);
        return slow(f, which, args, nargsf, kwnames);
    }
    return r;
}

/* Addresses and counts as the core's factories take them (new references; NULL with an error set). */
struct Ints {
    PyObject *v[4] = {nullptr, nullptr, nullptr, nullptr};
    int n = 0;
    bool add(PyObject *o) {
        v[n++] = o;
        return o != nullptr;
    }
    ~Ints() {
        for (int i = 0; i < n; i++)
            Py_XDECREF(v[i]);
    }
};

PyObject *addr(const at::Tensor &t) {
    return PyLong_FromVoidPtr(const_cast<void *>(t.const_data_ptr()));
}

PyObject *Front_all_reduce(Front *f, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    if (kwnames || PyVectorcall_NARGS(nargsf) != 2)
        return slow(f, ALL_REDUCE, args, nargsf, kwnames);
    try {
        PyObject *ts = args[0];
        auto *o = options<c10d::AllreduceOptions>(args[1]);
        if (!o || o->asyncOp || !PyList_CheckExact(ts) || PyList_GET_SIZE(ts) != 1)
            return slow(f, ALL_REDUCE, args, nargsf, kwnames);
        PyObject *tobj = PyList_GET_ITEM(ts, 0);
        const at::Tensor *t = host_tensor(f, tobj);
        PyObject *red = t ? reduction_of(f, t->scalar_type(), static_cast<int>(o->reduceOp.op_)) : nullptr;
        if (!red)
            return slow(f, ALL_REDUCE, args, nargsf, kwnames);
        Ints i;
        if (!i.add(addr(*t)) || !i.add(PyLong_FromLongLong(t->numel())))
            return nullptr;
        PyObject *argv[] = {f->kind[ALL_REDUCE], tobj, ts, f->eng, Py_None, i.v[0], i.v[1], red, Py_None, Py_None};
        return run(f, ALL_REDUCE, argv, 10, args, nargsf, kwnames);
    } catch (const std::exception &) {  // torch refused a query: the adapter reports it properly
        return slow(f, ALL_REDUCE, args, nargsf, kwnames);
    }
}

PyObject *Front_broadcast(Front *f, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    if (kwnames || PyVectorcall_NARGS(nargsf) != 2)
        return slow(f, BROADCAST, args, nargsf, kwnames);
    try {
        PyObject *ts = args[0];
        auto *o = options<c10d::BroadcastOptions>(args[1]);
        if (!o || o->asyncOp || o->rootTensor != 0 || o->rootRank < 0 || o->rootRank >= f->size ||
            !PyList_CheckExact(ts) || PyList_GET_SIZE(ts) != 1)
            return slow(f, BROADCAST, args, nargsf, kwnames);
        PyObject *tobj = PyList_GET_ITEM(ts, 0);
        const at::Tensor *t = host_tensor(f, tobj);
        PyObject *dcode = t ? dcode_of(f, t->scalar_type()) : nullptr;
        if (!dcode)
            return slow(f, BROADCAST, args, nargsf, kwnames);
        Ints i;
        if (!i.add(addr(*t)) || !i.add(PyLong_FromLongLong(t->numel())) ||
            !i.add(PyLong_FromLongLong(static_cast<long long>(t->element_size()))) ||
            !i.add(PyLong_FromLongLong(o->rootRank)))
            return nullptr;
        PyObject *argv[] = {f->kind[BROADCAST], tobj, ts,     f->eng,  Py_None, i.v[0],
                            i.v[1],             i.v[2], dcode, i.v[3], Py_None, Py_None};
        return run(f, BROADCAST, argv, 12, args, nargsf, kwnames);
    } catch (const std::exception &) {
        return slow(f, BROADCAST, args, nargsf, kwnames);
    }
}

/* all_gather_single(output, input, opts) and reduce_scatter_single(output, input, opts): ``output`` holds
 * p blocks of ``input`` (all_gather), or ``input`` p blocks of ``output`` (reduce_scatter). */
PyObject *two_buffer(Front *f, Coll which, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    if (kwnames || PyVectorcall_NARGS(nargsf) != 3)
        return slow(f, which, args, nargsf, kwnames);
    try {
        bool ag = which == ALL_GATHER;
        PyObject *oobj = args[0], *iobj = args[1];
        const at::Tensor *out = host_tensor(f, oobj), *in = out ? host_tensor(f, iobj) : nullptr;
        if (!in || in->scalar_type() != out->scalar_type())
            return slow(f, which, args, nargsf, kwnames);
        const at::Tensor &rows = ag ? *out : *in, &block = ag ? *in : *out;
        if (rows.numel() != block.numel() * f->size)
            return slow(f, which, args, nargsf, kwnames);
        PyObject *what;  // all_gather: the dtype code; reduce_scatter: the reduction
        if (ag) {
            auto *o = options<c10d::AllgatherOptions>(args[2]);
            what = o && !o->asyncOp ? dcode_of(f, in->scalar_type()) : nullptr;
        } else {
            auto *o = options<c10d::ReduceScatterOptions>(args[2]);
            what = o && !o->asyncOp ? reduction_of(f, in->scalar_type(), static_cast<int>(o->reduceOp.op_)) : nullptr;
        }
        if (!what)
            return slow(f, which, args, nargsf, kwnames);
        Ints i;
        if (!i.add(addr(*in)) || !i.add(addr(*out)) || !i.add(PyLong_FromLongLong(block.numel())) ||
            !i.add(PyTuple_Pack(2, iobj, oobj)))
            return nullptr;
        PyObject *outputs = PyList_New(1);
        if (!outputs)
            return nullptr;
        PyList_SET_ITEM(outputs, 0, Py_NewRef(oobj));
        PyObject *r;
        if (ag) {
            PyObject *esz = PyLong_FromLongLong(static_cast<long long>(in->element_size()));
            if (!esz) {
                Py_DECREF(outputs);
                return nullptr;
            }
            PyObject *argv[] = {f->kind[ALL_GATHER], i.v[3], outputs, f->eng, Py_None, i.v[0],
                                i.v[1],              i.v[2], esz,     what,   Py_None, Py_None};
            r = run(f, which, argv, 12, args, nargsf, kwnames);
            Py_DECREF(esz);
        } else {
            PyObject *argv[] = {f->kind[REDUCE_SCATTER], i.v[3], outputs, f->eng,  Py_None, i.v[0],
                                i.v[1],                  i.v[2], what,    Py_None, Py_None};
            r = run(f, which, argv, 11, args, nargsf, kwnames);
        }
        Py_DECREF(outputs);
        return r;
    } catch (const std::exception &) {
        return slow(f, which, args, nargsf, kwnames);
    }
}

PyObject *Front_all_gather(Front *f, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    return two_buffer(f, ALL_GATHER, args, nargsf, kwnames);
}

PyObject *Front_reduce_scatter(Front *f, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    return two_buffer(f, REDUCE_SCATTER, args, nargsf, kwnames);
}

/* all_to_all_single(output, input, output_split_sizes, input_split_sizes, opts): even splits only (both
 * lists empty, dim 0 divisible by the group size, equal trailing shapes), as the adapter's common case. */
PyObject *Front_all_to_all(Front *f, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    if (kwnames || PyVectorcall_NARGS(nargsf) != 5)
        return slow(f, ALL_TO_ALL, args, nargsf, kwnames);
    try {
        PyObject *oobj = args[0], *iobj = args[1];
        auto *o = options<c10d::AllToAllOptions>(args[4]);
        if (!o || o->asyncOp || !PyList_CheckExact(args[2]) || PyList_GET_SIZE(args[2]) != 0 ||
            !PyList_CheckExact(args[3]) || PyList_GET_SIZE(args[3]) != 0)
            return slow(f, ALL_TO_ALL, args, nargsf, kwnames);
        const at::Tensor *out = host_tensor(f, oobj), *in = out ? host_tensor(f, iobj) : nullptr;
        PyObject *dcode = in && in->scalar_type() == out->scalar_type() ? dcode_of(f, in->scalar_type()) : nullptr;
        if (!dcode || in->dim() == 0 || out->dim() == 0)
            return slow(f, ALL_TO_ALL, args, nargsf, kwnames);
        int p = f->size;
        bool same_rows = (in->dim() == 1 && out->dim() == 1) || in->sizes().slice(1) == out->sizes().slice(1);
        if (in->size(0) % p || out->size(0) % p || !same_rows)
            return slow(f, ALL_TO_ALL, args, nargsf, kwnames);
        long long esz = static_cast<long long>(in->element_size());
        Ints i;
        if (!i.add(addr(*in)) || !i.add(addr(*out)) || !i.add(PyLong_FromLongLong(in->numel() * esz / p)) ||
            !i.add(PyLong_FromLongLong(out->numel() * esz / p)))
            return nullptr;
        PyObject *keep = PyTuple_Pack(2, iobj, oobj), *outputs = PyList_New(1);
        if (!keep || !outputs) {
            Py_XDECREF(keep);
            Py_XDECREF(outputs);
            return nullptr;
        }
        PyList_SET_ITEM(outputs, 0, Py_NewRef(oobj));
        PyObject *argv[] = {f->kind[ALL_TO_ALL], keep, outputs, f->eng, Py_None, i.v[0],
                            i.v[1],              dcode, i.v[2], i.v[3], Py_None};
        PyObject *r = run(f, ALL_TO_ALL, argv, 11, args, nargsf, kwnames);
        Py_DECREF(keep);
        Py_DECREF(outputs);
        return r;
    } catch (const std::exception &) {
        return slow(f, ALL_TO_ALL, args, nargsf, kwnames);
    }
}

c10::ScalarType scalar_type_of(PyObject *dtype) {
    if (!THPDtype_Check(dtype)) {
        PyErr_SetString(PyExc_TypeError, "accl front: expected a torch.dtype");
        return c10::ScalarType::Undefined;
    }
    return reinterpret_cast<THPDtype *>(dtype)->scalar_type;
}

/* learn_dtype(dtype, code): the wire code of ``dtype`` (torchhpc.accl.wire.dtype_code) */
PyObject *Front_learn_dtype(Front *f, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "accl front: learn_dtype(dtype, code)");
        return nullptr;
    }
    int st = static_cast<int>(scalar_type_of(args[0]));
    if (PyErr_Occurred())
        return nullptr;
    if (st >= 0 && st < kTypes)
        Py_XSETREF(f->dcode[st], Py_NewRef(args[1]));
    Py_RETURN_NONE;
}

/* learn_reduction(dtype, op, core): the core's reduction tuple for (dtype, RedOpType value ``op``), or None
 * to leave that pair to the adapter (AVG: its division runs after the call) */
PyObject *Front_learn_reduction(Front *f, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "accl front: learn_reduction(dtype, op, core)");
        return nullptr;
    }
    int st = static_cast<int>(scalar_type_of(args[0]));
    long op = PyLong_AsLong(args[1]);
    if (PyErr_Occurred())
        return nullptr;
    if (st >= 0 && st < kTypes && op >= 0 && op < kOps) {
        PyObject *v = args[2] == Py_None ? nullptr : Py_NewRef(args[2]);
        Py_XSETREF(f->red[st][op], v);
    }
    Py_RETURN_NONE;
}

/* Front(pg, executor, engine, core_group, kinds, tensor_type): kinds are the wire kind codes of
 * (all_reduce, broadcast, all_gather, reduce_scatter, all_to_all) */
int Front_init(Front *f, PyObject *args, PyObject *kw) {
    PyObject *pg, *ex, *eng, *core, *kinds, *ttype;
    (void)kw;
    if (!PyArg_ParseTuple(args, "OOOOO!O!", &pg, &ex, &eng, &core, &PyTuple_Type, &kinds, &PyType_Type, &ttype))
        return -1;
    if (PyTuple_GET_SIZE(kinds) != N_COLL) {
        PyErr_SetString(PyExc_ValueError, "accl front: one kind code per collective");
        return -1;
    }
    Py_XSETREF(f->pg, PyWeakref_NewRef(pg, nullptr));
    if (!f->pg)
        return -1;
    Py_XSETREF(f->ex, Py_NewRef(ex));
    Py_XSETREF(f->eng, Py_NewRef(eng));
    Py_XSETREF(f->tensor_type, Py_NewRef(ttype));
    for (int i = 0; i < N_COLL; i++) {
        Py_XSETREF(f->kind[i], Py_NewRef(PyTuple_GET_ITEM(kinds, i)));
        Py_XSETREF(f->make[i], PyObject_GetAttrString(core, kCoreMethod[i]));
        if (!f->make[i])
            return -1;
    }
    Py_XSETREF(f->run_idle, PyObject_GetAttr(core, S_run_idle));
    if (!f->run_idle)
        return -1;
    PyObject *size = PyObject_GetAttrString(core, "size");
    f->size = size ? static_cast<int>(PyLong_AsLong(size)) : -1;
    Py_XDECREF(size);
    if (PyErr_Occurred())
        return -1;
    if (f->size < 1) {
        PyErr_SetString(PyExc_ValueError, "accl front: bad group size");
        return -1;
    }
    return 0;
}

int Front_clear(Front *f) {
    Py_CLEAR(f->pg);
    Py_CLEAR(f->ex);
    Py_CLEAR(f->eng);
    Py_CLEAR(f->run_idle);
    Py_CLEAR(f->tensor_type);
    for (int i = 0; i < N_COLL; i++) {
        Py_CLEAR(f->make[i]);
        Py_CLEAR(f->kind[i]);
    }
    for (int i = 0; i < kTypes; i++) {
        Py_CLEAR(f->dcode[i]);
        for (int j = 0; j < kOps; j++)
            Py_CLEAR(f->red[i][j]);
    }
    return 0;
}

int Front_traverse(Front *f, visitproc visit, void *arg) {
    Py_VISIT(f->pg);
    Py_VISIT(f->ex);
    Py_VISIT(f->eng);
    Py_VISIT(f->run_idle);
    for (int i = 0; i < N_COLL; i++)
        Py_VISIT(f->make[i]);
    return 0;
}

void Front_dealloc(Front *f) {
    PyObject_GC_UnTrack(f);
    Front_clear(f);
    Py_TYPE(f)->tp_free(reinterpret_cast<PyObject *>(f));
}

/* A Front's entry point as the group's attribute.  Not a builtin function on purpose: torch's C++ calls
 * into a Python process group (PyProcessGroup, through pybind11's override lookup) take a builtin
 * function found on the instance for the C++ base's own method and skip it; an object of this type is
 * taken as the Python override it is. */
struct Entry {
    PyObject_HEAD
    vectorcallfunc call;  // the CPython entry (PEP 590)
    Front *f;
    PyObject *(*fn)(Front *, PyObject *const *, size_t, PyObject *);
    const char *name;
};

PyObject *Entry_call(PyObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    Entry *e = reinterpret_cast<Entry *>(self);
    return e->fn(e->f, args, nargsf, kwnames);
}

PyObject *Entry_repr(Entry *e) {
    return PyUnicode_FromFormat("<accl front %s>", e->name);
}

int Entry_traverse(Entry *e, visitproc visit, void *arg) {
    Py_VISIT(reinterpret_cast<PyObject *>(e->f));
    return 0;
}

int Entry_clear(Entry *e) {
    Py_CLEAR(e->f);
    return 0;
}

void Entry_dealloc(Entry *e) {
    PyObject_GC_UnTrack(e);
    Entry_clear(e);
    Py_TYPE(e)->tp_free(reinterpret_cast<PyObject *>(e));
}

PyTypeObject EntryType = [] {
    PyTypeObject t{PyVarObject_HEAD_INIT(nullptr, 0)};
    t.tp_name = "torchhpc.accl.core.FrontEntry";
    t.tp_basicsize = sizeof(Entry);
    t.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL;
    t.tp_vectorcall_offset = offsetof(Entry, call);
    t.tp_call = PyVectorcall_Call;
    t.tp_repr = reinterpret_cast<reprfunc>(Entry_repr);
    t.tp_traverse = reinterpret_cast<traverseproc>(Entry_traverse);
    t.tp_clear = reinterpret_cast<inquiry>(Entry_clear);
    t.tp_dealloc = reinterpret_cast<destructor>(Entry_dealloc);
    t.tp_doc = "a process-group method taken by the accl front";
    return t;
}();

/* entry(name): the Front's entry point for ProcessGroup.<name> (all_reduce, broadcast, all_gather_single,
 * reduce_scatter_single, all_to_all_single) */
PyObject *Front_entry(Front *f, PyObject *name) {
    static const struct {
        const char *name;
        PyObject *(*fn)(Front *, PyObject *const *, size_t, PyObject *);
    } table[] = {{"all_reduce", Front_all_reduce}, {"broadcast", Front_broadcast},
                 {"all_gather_single", Front_all_gather}, {"reduce_scatter_single", Front_reduce_scatter},
                 {"all_to_all_single", Front_all_to_all}};
    const char *want = PyUnicode_AsUTF8(name);
    if (!want)
        return nullptr;
    for (const auto &row : table)
        if (std::strcmp(row.name, want) == 0) {
            Entry *e = PyObject_GC_New(Entry, &EntryType);
            if (!e)
                return nullptr;
            e->call = Entry_call;
            e->f = reinterpret_cast<Front *>(Py_NewRef(reinterpret_cast<PyObject *>(f)));
            e->fn = row.fn;
            e->name = row.name;
            PyObject_GC_Track(e);
            return reinterpret_cast<PyObject *>(e);
        }
    PyErr_Format(PyExc_ValueError, "accl front: no entry '%s'", want);
    return nullptr;
}

#define FASTCALL(fn) reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(fn)), METH_FASTCALL

PyMethodDef Front_methods[] = {
    {"entry", reinterpret_cast<PyCFunction>(Front_entry), METH_O,
     "entry(name): the callable for ProcessGroup.<name>: all_reduce(tensors, opts), broadcast(tensors, opts), "
     "all_gather_single(output, input, opts), reduce_scatter_single(output, input, opts), "
     "all_to_all_single(output, input, output_split_sizes, input_split_sizes, opts)"},
    {"learn_dtype", FASTCALL(Front_learn_dtype), "learn_dtype(dtype, wire_code)"},
    {"learn_reduction", FASTCALL(Front_learn_reduction), "learn_reduction(dtype, op_value, core_tuple_or_None)"},
    {nullptr, nullptr, 0, nullptr},
};

PyTypeObject FrontType = [] {
    PyTypeObject t{PyVarObject_HEAD_INIT(nullptr, 0)};
    t.tp_name = "torchhpc.accl.core.Front";
    t.tp_basicsize = sizeof(Front);
    t.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC;
    t.tp_new = PyType_GenericNew;
    t.tp_init = reinterpret_cast<initproc>(Front_init);
    t.tp_dealloc = reinterpret_cast<destructor>(Front_dealloc);
    t.tp_traverse = reinterpret_cast<traverseproc>(Front_traverse);
    t.tp_clear = reinterpret_cast<inquiry>(Front_clear);
    t.tp_methods = Front_methods;
    t.tp_doc = "one process group's C++ reading of torch's calls for the compiled core";
    return t;
}();

PyModuleDef front_module = {PyModuleDef_HEAD_INIT, "_front", "torchhpc.accl's front (one torch version)", -1,
                            nullptr, nullptr, nullptr, nullptr, nullptr};

}  // namespace

PyMODINIT_FUNC PyInit__front() {
    if (PyType_Ready(&FrontType) < 0 || PyType_Ready(&EntryType) < 0)
        return nullptr;
    for (int i = 0; i < N_COLL; i++)
        if (!(slow_name[i] = PyUnicode_InternFromString(kSlow[i])))
            return nullptr;
    if (!(S_run_idle = PyUnicode_InternFromString("run_idle")))
        return nullptr;
    PyObject *m = PyModule_Create(&front_module);
    if (!m)
        return nullptr;
    if (PyModule_AddObjectRef(m, "Front", reinterpret_cast<PyObject *>(&FrontType)) < 0 ||
        PyModule_AddStringConstant(m, "torch_version", TORCH_BUILT_FOR) < 0) {
        Py_DECREF(m);
        return nullptr;
    }
    return m;
}
