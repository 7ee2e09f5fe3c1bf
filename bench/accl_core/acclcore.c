/* A compiled core for accl's synchronous calls, built only to measure what one would gain (issue 13).
 *
 * It does, in C, what accl's executor does in Python for a checked synchronous call on an MPI group:
 * write the nine-word header (the layout of torchhpc/accl/wire.py: magic, kind, seq, dtype, op, root,
 * nbytes, numel, extra) into this rank's slot, carry small data in the slot's payload, all-gather the
 * slots with one persistent MPI_Allgather_init request polled against a deadline, compare the leading
 * words of every slot, and then either reduce/copy the payloads (the data rode in the slots) or make
 * the blocking MPI call on the data communicator.  The Python side (bench/accl_compiled_core.py) keeps
 * torch's adapter; everything after it is here.  Built with the environment's mpicc, for one MPI
 * family (the one mpi4py has loaded); never imported by torchhpc itself.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <mpi.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#define HEADER_BYTES 128
#define PAYLOAD_BYTES 1024
#define SLOT_BYTES (HEADER_BYTES + PAYLOAD_BYTES)
#define MAGIC 0x4ACC1
#define COMPARE_ALL 8

typedef struct {
    PyObject_HEAD
    MPI_Comm comm, ctl;
    int rank, size;
    double timeout_s;
    unsigned char *mine, *all;
    MPI_Request req;
} Core;

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* wire dtype code (torchhpc.accl.wire.DTYPES order, from 1) -> MPI datatype for SUM */
static MPI_Datatype mpi_type(long code) {
    switch (code) {
    case 1: return MPI_FLOAT;
    case 2: return MPI_DOUBLE;
    case 7: return MPI_INT32_T;
    case 8: return MPI_INT64_T;
    case 9: return MPI_UINT8_T;
    default: return MPI_DATATYPE_NULL;
    }
}

static int Core_init(Core *self, PyObject *args, PyObject *kw) {
    unsigned long long comm_h, ctl_h;
    double timeout_s;
    (void)kw;
    if (!PyArg_ParseTuple(args, "KKd", &comm_h, &ctl_h, &timeout_s))
        return -1;
    /* handles as mpi4py's MPI._handleof gives them: a pointer (Open MPI) or an int (MPICH) */
    self->comm = (MPI_Comm)(uintptr_t)comm_h;
    self->ctl = (MPI_Comm)(uintptr_t)ctl_h;
    self->timeout_s = timeout_s;
    MPI_Comm_rank(self->comm, &self->rank);
    MPI_Comm_size(self->comm, &self->size);
    self->mine = PyMem_Calloc(SLOT_BYTES, 1);
    self->all = PyMem_Calloc((size_t)SLOT_BYTES * (size_t)self->size, 1);
    if (!self->mine || !self->all) {
        PyErr_NoMemory();
        return -1;
    }
    if (MPI_Allgather_init(self->mine, SLOT_BYTES, MPI_BYTE, self->all, SLOT_BYTES, MPI_BYTE, self->ctl,
                           MPI_INFO_NULL, &self->req) != MPI_SUCCESS) {
        PyErr_SetString(PyExc_RuntimeError, "MPI_Allgather_init failed");
        return -1;
    }
    return 0;
}

static void Core_dealloc(Core *self) {
    if (self->req != MPI_REQUEST_NULL && self->req != 0)
        MPI_Request_free(&self->req);
    PyMem_Free(self->mine);
    PyMem_Free(self->all);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Exchange the header (and payload): 0 agreed, -1 error set (timeout, MPI error, mismatch). */
static int exchange(Core *self, long kind, long seq, long dtype, long op, long root, long nbytes, long numel,
                    const void *payload, size_t payload_bytes) {
    int64_t *w = (int64_t *)self->mine;
    w[0] = MAGIC; w[1] = kind; w[2] = seq; w[3] = dtype; w[4] = op; w[5] = root;
    w[6] = nbytes; w[7] = numel; w[8] = 0;
    if (payload_bytes)
        memcpy(self->mine + HEADER_BYTES, payload, payload_bytes);
    MPI_Start(&self->req);
    int flag = 0;
    MPI_Test(&self->req, &flag, MPI_STATUS_IGNORE);
    if (!flag) {
        double deadline = now() + self->timeout_s;
        for (unsigned n = 1; !flag; n++) {
            MPI_Test(&self->req, &flag, MPI_STATUS_IGNORE);
            if ((n & 1023) == 0 && now() > deadline) {
                PyErr_Format(PyExc_TimeoutError, "accl core: header exchange did not complete within %g s",
                             self->timeout_s);
                return -1;
            }
        }
    }
    for (int r = 0; r < self->size; r++) {
        if (memcmp(self->all + (size_t)r * SLOT_BYTES, self->mine, COMPARE_ALL * 8) != 0) {
            PyErr_Format(PyExc_ValueError, "accl core: rank %d's header differs from rank %d's", r, self->rank);
            return -1;
        }
    }
    return 0;
}

/* The result of a blocking MPI data call (made with the GIL released): 0, or -1 with the error set. */
static int data_call(int rc, const char *what) {
    if (rc == MPI_SUCCESS)
        return 0;
    PyErr_Format(PyExc_RuntimeError, "%s failed", what);
    return -1;
}

/* The arguments of the two-buffer calls: (src, dst, nbytes, dtype_code, numel, seq); 0, or -1 with the error set. */
typedef struct {
    char *src, *dst;
    long nbytes, dcode, numel, seq;
} Pair;

static int parse_pair(PyObject *const *args, Py_ssize_t nargs, const char *what, Pair *a) {
    if (nargs != 6) {
        PyErr_Format(PyExc_TypeError, "%s(src, dst, nbytes, dtype_code, numel, seq)", what);
        return -1;
    }
    a->src = (char *)PyLong_AsVoidPtr(args[0]);
    a->dst = (char *)PyLong_AsVoidPtr(args[1]);
    a->nbytes = PyLong_AsLong(args[2]);
    a->dcode = PyLong_AsLong(args[3]);
    a->numel = PyLong_AsLong(args[4]);
    a->seq = PyLong_AsLong(args[5]);
    return PyErr_Occurred() ? -1 : 0;
}

/* all_reduce(addr, numel, dtype_code, seq): SUM in place */
static PyObject *Core_all_reduce(Core *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "all_reduce(addr, numel, dtype_code, seq)");
        return NULL;
    }
    char *addr = (char *)PyLong_AsVoidPtr(args[0]);
    long numel = PyLong_AsLong(args[1]), dcode = PyLong_AsLong(args[2]), seq = PyLong_AsLong(args[3]);
    MPI_Datatype dt = mpi_type(dcode);
    if (dt == MPI_DATATYPE_NULL) {
        PyErr_SetString(PyExc_TypeError, "accl core prototype: unsupported dtype");
        return NULL;
    }
    int esz;
    MPI_Type_size(dt, &esz);
    long nbytes = numel * esz;
    int fused = nbytes <= PAYLOAD_BYTES;
    if (exchange(self, 1, seq, dcode, 1, 0, nbytes, numel, addr, fused ? (size_t)nbytes : 0) < 0)
        return NULL;
    if (fused) {
        unsigned char *acc = self->all + HEADER_BYTES;
        for (int r = 1; r < self->size; r++)
            MPI_Reduce_local(self->all + (size_t)r * SLOT_BYTES + HEADER_BYTES, acc, (int)numel, dt, MPI_SUM);
        memcpy(addr, acc, (size_t)nbytes);
    } else {
        int rc;
        Py_BEGIN_ALLOW_THREADS
        rc = MPI_Allreduce(MPI_IN_PLACE, addr, (int)numel, dt, MPI_SUM, self->comm);
        Py_END_ALLOW_THREADS
        if (data_call(rc, "MPI_Allreduce") < 0)
            return NULL;
    }
    Py_RETURN_NONE;
}

/* all_gather(src, dst, nbytes_per_rank, dtype_code, numel, seq) */
static PyObject *Core_all_gather(Core *self, PyObject *const *args, Py_ssize_t nargs) {
    Pair a;
    if (parse_pair(args, nargs, "all_gather", &a) < 0)
        return NULL;
    int fused = a.nbytes <= PAYLOAD_BYTES;
    if (exchange(self, 4, a.seq, a.dcode, 0, 0, a.nbytes, a.numel, a.src, fused ? (size_t)a.nbytes : 0) < 0)
        return NULL;
    if (fused) {
        for (int r = 0; r < self->size; r++)
            memcpy(a.dst + (size_t)r * (size_t)a.nbytes, self->all + (size_t)r * SLOT_BYTES + HEADER_BYTES,
                   (size_t)a.nbytes);
    } else {
        int rc;
        Py_BEGIN_ALLOW_THREADS
        rc = MPI_Allgather(a.src, (int)a.nbytes, MPI_BYTE, a.dst, (int)a.nbytes, MPI_BYTE, self->comm);
        Py_END_ALLOW_THREADS
        if (data_call(rc, "MPI_Allgather") < 0)
            return NULL;
    }
    Py_RETURN_NONE;
}

/* all_to_all(src, dst, nbytes_total, dtype_code, numel, seq): even split */
static PyObject *Core_all_to_all(Core *self, PyObject *const *args, Py_ssize_t nargs) {
    Pair a;
    if (parse_pair(args, nargs, "all_to_all", &a) < 0)
        return NULL;
    long block = a.nbytes / self->size;
    int fused = a.nbytes <= PAYLOAD_BYTES;
    if (exchange(self, 8, a.seq, a.dcode, 0, 0, a.nbytes, a.numel, a.src, fused ? (size_t)a.nbytes : 0) < 0)
        return NULL;
    if (fused) {
        for (int r = 0; r < self->size; r++)
            memcpy(a.dst + (size_t)r * (size_t)block,
                   self->all + (size_t)r * SLOT_BYTES + HEADER_BYTES + (size_t)self->rank * (size_t)block,
                   (size_t)block);
    } else {
        int rc;
        Py_BEGIN_ALLOW_THREADS
        rc = MPI_Alltoall(a.src, (int)block, MPI_BYTE, a.dst, (int)block, MPI_BYTE, self->comm);
        Py_END_ALLOW_THREADS
        if (data_call(rc, "MPI_Alltoall") < 0)
            return NULL;
    }
    Py_RETURN_NONE;
}

static PyMethodDef Core_methods[] = {
    {"all_reduce", (PyCFunction)(void (*)(void))Core_all_reduce, METH_FASTCALL, "checked SUM all_reduce"},
    {"all_gather", (PyCFunction)(void (*)(void))Core_all_gather, METH_FASTCALL, "checked all_gather"},
    {"all_to_all", (PyCFunction)(void (*)(void))Core_all_to_all, METH_FASTCALL, "checked even all_to_all"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject CoreType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "acclcore.Core",
    .tp_basicsize = sizeof(Core),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Core_init,
    .tp_dealloc = (destructor)Core_dealloc,
    .tp_methods = Core_methods,
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "acclcore", NULL, -1, NULL, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit_acclcore(void) {
    if (PyType_Ready(&CoreType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m)
        return NULL;
    Py_INCREF(&CoreType);
    if (PyModule_AddObject(m, "Core", (PyObject *)&CoreType) < 0) {
        Py_DECREF(&CoreType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
