/* torchhpc.accl's compiled core: the MPI engine's collective calls and the header exchange, in C.
 *
 * One module per MPI family (built as _core_openmpi / _core_mpich by torchhpc.accl.corebuild, loaded by
 * torchhpc.accl.core for the library mpi4py has loaded), as mpi4py builds its MPI module per family.
 *
 * Group: one process group's header exchange.  Every rank's slot (wire.SLOT_BYTES: a header of nine
 * int64 words in wire.FIELDS order, then the payload area) is all-gathered on the control communicator
 * by one persistent MPI_Allgather_init request (MPI-4; MPI_Iallgather where the library lacks it).  The
 * layout constants come from torchhpc.accl.wire at construction: this file defines no layout of its own.
 *
 * Call: one collective on the MPI engine (all_reduce, broadcast, all_gather, reduce_scatter,
 * all_to_all, barrier) on contiguous buffers the Python side staged.  It implements the plan protocol
 * of torchhpc.accl.plans (pack, verified, stage, finish), so the executor drives it from its queue like
 * any plan, and Group.run drives the same methods inline in the caller's thread: a call's wire behaviour
 * (its header words, whether its data ride in the slot, its MPI calls and segments) is written once,
 * here.  Blocking MPI calls release the GIL; inline waits follow torchhpc.waiting.Backoff's policy (its
 * constants are read at construction) against the group timeout.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <mpi.h>
#include <limits.h>
#include <sched.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#ifndef CORE_NAME
#error "build with -DCORE_NAME=_core_<family> (torchhpc.accl.corebuild does)"
#endif
#define CAT_(a, b) a##b
#define CAT(a, b) CAT_(a, b)
#define STR_(x) #x
#define STR(x) STR_(x)

/* MPI-4's persistent collectives; Open MPI 5 has them while it still reports MPI 3.1 */
#if MPI_VERSION >= 4 || (defined(OMPI_MAJOR_VERSION) && OMPI_MAJOR_VERSION >= 5)
#define HAVE_ALLGATHER_INIT 1
#else
#define HAVE_ALLGATHER_INIT 0
#endif

/* engine modes (torchhpc.accl.engine.Mode) */
enum { NONBLOCKING = 0, BLOCKING = 1, WORKER = 2 };
/* what a Call does */
enum { C_ALLREDUCE, C_BCAST, C_ALLGATHER, C_REDSCAT, C_ALLTOALL, C_BARRIER };

/* Python objects the core raises or calls, set once by set_hooks() */
static PyObject *MpiException;   /* mpi4py.MPI.Exception(errorcode) */
static PyObject *MismatchError;  /* torchhpc.errors.MismatchError */
static PyObject *Expired;        /* raised when an inline wait passes the group timeout */
static PyObject *Describe;       /* describe(kind, dtype, op, root, nbytes, numel, extra, seq) -> str */
static PyObject *S_engine_calls, *S_sidestep_calls, *S_max_call_bytes;

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int mpi_error(int rc) {
    PyObject *code = PyLong_FromLong(rc);
    if (code) {
        PyErr_SetObject(MpiException ? MpiException : PyExc_RuntimeError, code);
        Py_DECREF(code);
    }
    return -1;
}

/* ------------------------------------------------------------------------------------------ Group */

typedef struct {
    PyObject_HEAD
    MPI_Comm coll, ctl;
    int rank, size;
    Py_ssize_t hdr, pay, slot;
    int64_t magic;
    long long seg;
    int sidestep;            /* the group's engine is not MPI: every call here is a sidestep */
    long long seq;           /* the next collective's call number (the executor's queue takes them here too) */
    int check;               /* AcclOptions.check: every collective exchanges the header */
    long long unchecked;     /* unchecked groups skip the header up to this many bytes (one nonblocking call) */
    long long bigmin;        /* AcclOptions.threaded_min_bytes: blocking MPI on the worker when async */
    PyObject *mine_obj, *all_obj, *stats;
    unsigned char *mine, *all;
    MPI_Request hreq;
    int persistent, active;
    /* the back-off policy (torchhpc.waiting.Backoff) */
    int spins;
    double yield_s, sleep_s, cap_s;
} Group;

static PyTypeObject GroupType;

static int Group_init(Group *self, PyObject *args, PyObject *kw) {
    unsigned long long coll_h, ctl_h;
    long long magic, seg;
    Py_ssize_t hdr, pay;
    PyObject *stats;
    int spins;
    double yield_s, sleep_s, cap_s;
    (void)kw;
    if (!PyArg_ParseTuple(args, "KKnnLLO!iddd", &coll_h, &ctl_h, &hdr, &pay, &magic, &seg, &PyDict_Type, &stats,
                          &spins, &yield_s, &sleep_s, &cap_s))
        return -1;
    if (hdr < 72 || pay < 0 || seg < 1) {
        PyErr_SetString(PyExc_ValueError, "accl core: bad slot layout or segment size");
        return -1;
    }
    /* handles as mpi4py's MPI._handleof gives them: a pointer (Open MPI) or an int (MPICH) */
    self->coll = (MPI_Comm)(uintptr_t)coll_h;
    self->ctl = (MPI_Comm)(uintptr_t)ctl_h;
    self->hdr = hdr;
    self->pay = pay;
    self->slot = hdr + pay;
    self->magic = magic;
    self->seg = seg;
    self->spins = spins;
    self->yield_s = yield_s;
    self->sleep_s = sleep_s;
    self->cap_s = cap_s;
    Py_INCREF(stats);
    self->stats = stats;
    int rc = MPI_Comm_rank(self->ctl, &self->rank);
    if (rc == MPI_SUCCESS)
        rc = MPI_Comm_size(self->ctl, &self->size);
    if (rc != MPI_SUCCESS)
        return mpi_error(rc);
    self->mine_obj = PyByteArray_FromStringAndSize(NULL, self->slot);
    self->all_obj = PyByteArray_FromStringAndSize(NULL, self->slot * self->size);
    if (!self->mine_obj || !self->all_obj)
        return -1;
    self->mine = (unsigned char *)PyByteArray_AS_STRING(self->mine_obj);
    self->all = (unsigned char *)PyByteArray_AS_STRING(self->all_obj);
    memset(self->mine, 0, (size_t)self->slot);
    memset(self->all, 0, (size_t)(self->slot * self->size));
    self->hreq = MPI_REQUEST_NULL;
    self->persistent = 0;
#if HAVE_ALLGATHER_INIT
    if (MPI_Allgather_init(self->mine, (int)self->slot, MPI_BYTE, self->all, (int)self->slot, MPI_BYTE, self->ctl,
                           MPI_INFO_NULL, &self->hreq) == MPI_SUCCESS)
        self->persistent = 1;
    else
        self->hreq = MPI_REQUEST_NULL;
#endif
    return 0;
}

static void Group_drop_persistent(Group *self) {
    int finalized = 0;
    MPI_Finalized(&finalized);  /* a group never destroyed is collected after mpi4py finalized MPI at exit */
    if (self->persistent && !self->active && self->hreq != MPI_REQUEST_NULL && !finalized)
        MPI_Request_free(&self->hreq);
    self->persistent = 0;
    self->hreq = MPI_REQUEST_NULL;
}

static void Group_dealloc(Group *self) {
    Group_drop_persistent(self);
    Py_XDECREF(self->mine_obj);
    Py_XDECREF(self->all_obj);
    Py_XDECREF(self->stats);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* stats[key] = stats[key] + by (or = by when ``max`` and larger) */
static int bump(PyObject *d, PyObject *key, long long by, int max) {
    PyObject *v = PyDict_GetItemWithError(d, key);
    if (!v && PyErr_Occurred())
        return -1;
    long long was = v ? PyLong_AsLongLong(v) : 0;
    if (max && was >= by)
        return 0;
    PyObject *n = PyLong_FromLongLong(max ? by : was + by);
    int rc = n ? PyDict_SetItem(d, key, n) : -1;
    Py_XDECREF(n);
    return rc;
}

/* count one engine call of nbytes in the group's stats (the dict the executor shows as ``stats``) */
static int count_call(Group *g, long long nbytes) {
    if (bump(g->stats, S_engine_calls, 1, 0) < 0 || (g->sidestep && bump(g->stats, S_sidestep_calls, 1, 0) < 0))
        return -1;
    return bump(g->stats, S_max_call_bytes, nbytes, 1);
}

static int hx_start(Group *g) {
    int rc;
    if (g->persistent)
        rc = MPI_Start(&g->hreq);
    else
        rc = MPI_Iallgather(g->mine, (int)g->slot, MPI_BYTE, g->all, (int)g->slot, MPI_BYTE, g->ctl, &g->hreq);
    if (rc != MPI_SUCCESS)
        return mpi_error(rc);
    g->active = 1;
    return 0;
}

/* 1 done, 0 not yet, -1 error */
static int hx_test(Group *g) {
    if (!g->active)
        return 1;
    int flag = 0;
    int rc = MPI_Test(&g->hreq, &flag, MPI_STATUS_IGNORE);
    if (rc != MPI_SUCCESS)
        return mpi_error(rc);
    if (flag)
        g->active = 0;
    return flag;
}

static int hx_agrees(Group *g, int compare) {
    size_t n = (size_t)compare * 8;
    for (int r = 0; r < g->size; r++)
        if (r != g->rank && memcmp(g->all + (size_t)r * (size_t)g->slot, g->mine, n) != 0)
            return 0;
    return 1;
}

static void hx_pack(Group *g, int kind, long long seq, const int64_t f[6]) {
    int64_t w[9] = {g->magic, kind, seq, f[0], f[1], f[2], f[3], f[4], f[5]};
    memcpy(g->mine, w, sizeof w);
}

/* Wait until ``test(arg)`` is 1, against ``deadline``, under the back-off policy: 0, or -1 (Expired or an
 * MPI error set).  Polls hold the GIL; pauses release it. */
static int wait_for(Group *g, int (*test)(void *), void *arg, double deadline) {
    int n = 0, done;
    double t0 = 0.0, sleep_s = g->sleep_s;
    while ((done = test(arg)) == 0) {
        if (++n <= g->spins)
            continue;
        double t = now();
        if (t > deadline) {
            PyErr_SetString(Expired, "inline wait");
            return -1;
        }
        if (t0 == 0.0)
            t0 = t;
        Py_BEGIN_ALLOW_THREADS
        if (t - t0 < g->yield_s) {
            sched_yield();
        } else {
            struct timespec ts = {(time_t)sleep_s, (long)((sleep_s - (double)(time_t)sleep_s) * 1e9)};
            nanosleep(&ts, NULL);
            sleep_s = sleep_s * 2 < g->cap_s ? sleep_s * 2 : g->cap_s;
        }
        Py_END_ALLOW_THREADS
    }
    return done < 0 ? -1 : 0;
}

static int hx_test_v(void *g) {
    return hx_test((Group *)g);
}

static PyObject *Group_start(Group *self, PyObject *unused) {
    (void)unused;
    if (hx_start(self) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *Group_test(Group *self, PyObject *unused) {
    (void)unused;
    int r = hx_test(self);
    if (r < 0)
        return NULL;
    return PyBool_FromLong(r);
}

static PyObject *Group_agrees(Group *self, PyObject *arg) {
    long compare = PyLong_AsLong(arg);
    if (compare == -1 && PyErr_Occurred())
        return NULL;
    if (compare < 0 || compare * 8 > self->hdr) {
        PyErr_SetString(PyExc_ValueError, "accl core: compare out of range");
        return NULL;
    }
    return PyBool_FromLong(hx_agrees(self, (int)compare));
}

static PyObject *Group_drop(Group *self, PyObject *unused) {
    (void)unused;
    Group_drop_persistent(self);
    Py_RETURN_NONE;
}

/* every rank's ``nbytes`` of payload from byte ``offset``, reduced in rank order with MPI's own op (as the
 * large path does), written to ``addr`` */
static int reduce_rows(Group *g, MPI_Datatype dt, MPI_Op op, int count, Py_ssize_t nbytes, char *addr,
                       Py_ssize_t offset) {
    unsigned char *acc = g->all + g->hdr + offset;
    for (int r = 1; r < g->size; r++) {
        int rc = MPI_Reduce_local(g->all + (size_t)r * (size_t)g->slot + g->hdr + offset, acc, count, dt, op);
        if (rc != MPI_SUCCESS)
            return PyErr_Occurred() ? -1 : mpi_error(rc);
        if (PyErr_Occurred())  /* a user-defined op (float16/bfloat16) that raised */
            return -1;
    }
    memcpy(addr, acc, (size_t)nbytes);
    return 0;
}

static PyMemberDef Group_members[] = {
    {"mine", T_OBJECT_EX, offsetof(Group, mine_obj), READONLY, "this rank's slot (bytearray)"},
    {"all", T_OBJECT_EX, offsetof(Group, all_obj), READONLY, "every rank's slot after an exchange"},
    {"rank", T_INT, offsetof(Group, rank), READONLY, NULL},
    {"size", T_INT, offsetof(Group, size), READONLY, NULL},
    {"persistent", T_INT, offsetof(Group, persistent), READONLY, "1 while a persistent all-gather is used"},
    {"sidestep", T_INT, offsetof(Group, sidestep), 0, "1 when the group's engine is not MPI"},
    {"seq", T_LONGLONG, offsetof(Group, seq), 0, "the next collective's call number"},
    {"check", T_INT, offsetof(Group, check), 0, "1: every collective exchanges the header"},
    {"unchecked", T_LONGLONG, offsetof(Group, unchecked), 0, "unchecked: no header up to this many bytes"},
    {"big", T_LONGLONG, offsetof(Group, bigmin), 0, "bytes from which async calls block on the worker"},
    {NULL, 0, 0, 0, NULL},
};

/* The one rule for a collective moving ``total`` bytes: whether it exchanges the header (always when
 * checked; unchecked, when it does not fit one nonblocking call, so that the header proves every rank
 * arrived before MPI's blocking calls) and whether it is big (blocking MPI on the worker when async). */
static void rule(const Group *g, long long total, int *header, int *big) {
    *header = g->check || total > g->unchecked;
    *big = total >= g->bigmin;
}

static PyObject *Group_flags(Group *g, PyObject *arg) {
    long long total = PyLong_AsLongLong(arg);
    if (total == -1 && PyErr_Occurred())
        return NULL;
    int header, big;
    rule(g, total, &header, &big);
    return Py_BuildValue("(OO)", header ? Py_True : Py_False, big ? Py_True : Py_False);
}

/* ------------------------------------------------------------------------------------------- Call */

typedef struct {
    PyObject_HEAD
    Group *g;
    PyObject *keep, *post, *outputs, *eng;
    int ck, kind, header, fused, big, compare;
    int64_t f[6];                 /* dtype, op, root, nbytes, numel, extra */
    char *src, *dst;
    long long count, esz;         /* elements (per rank block for all_gather/reduce_scatter), element size */
    MPI_Datatype dt;
    MPI_Op op;
    int root;
    /* all_to_all */
    long long *sb, *rb, *mat;     /* byte counts to / from each rank; the gathered matrix (many ranks) */
    int in_slot, packs_data, rounds, uniform, mat_done;
    /* progress */
    MPI_Request *reqs;
    int nreq, capreq;
    int *ints;                    /* count / displacement arrays of v-collectives (live until completion) */
    unsigned char *tmp;           /* reduce_scatter's segment rows */
} Call;

static PyTypeObject CallType;
static PyTypeObject ReqsType;

static void Call_dealloc(Call *self) {
    Py_XDECREF(self->g);
    Py_XDECREF(self->keep);
    Py_XDECREF(self->post);
    Py_XDECREF(self->outputs);
    Py_XDECREF(self->eng);
    PyMem_Free(self->sb);
    PyMem_Free(self->mat);
    PyMem_Free(self->reqs);
    PyMem_Free(self->ints);
    PyMem_Free(self->tmp);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static Call *new_call(Group *g, int ck, int kind, PyObject *keep, PyObject *outputs, PyObject *eng, PyObject *post) {
    Call *c = PyObject_New(Call, &CallType);
    if (!c)
        return NULL;
    memset((char *)c + offsetof(Call, g), 0, sizeof(Call) - offsetof(Call, g));
    Py_INCREF(g);
    c->g = g;
    Py_INCREF(keep);
    c->keep = keep;
    Py_INCREF(outputs);
    c->outputs = outputs;
    Py_INCREF(eng);
    c->eng = eng;
    if (post != Py_None) {
        Py_INCREF(post);
        c->post = post;
    }
    c->ck = ck;
    c->kind = kind;
    c->compare = 8;
    c->dt = MPI_DATATYPE_NULL;
    c->op = MPI_OP_NULL;
    return c;
}

#define ARG_LL(i) PyLong_AsLongLong(args[i])
#define ARG_PTR(i) ((char *)PyLong_AsVoidPtr(args[i]))

static int nargs_is(Py_ssize_t nargs, Py_ssize_t want, const char *sig) {
    if (nargs == want)
        return 1;
    PyErr_Format(PyExc_TypeError, "accl core: %s", sig);
    return 0;
}

/* a factory's first step: the argument count, then a Call of ``ck`` from (kind, keep, outputs, eng, post) */
static Call *begin(Group *g, int ck, PyObject *const *args, Py_ssize_t nargs, Py_ssize_t want, const char *sig) {
    if (!nargs_is(nargs, want, sig))
        return NULL;
    return new_call(g, ck, (int)ARG_LL(0), args[1], args[2], args[3], args[4]);
}

/* header and big as given (a bool each), or by the group's rule for ``total`` bytes where None */
static void flags_of(Call *c, PyObject *header, PyObject *big, long long total) {
    int h, b;
    rule(c->g, total, &h, &b);
    c->header = header == Py_None ? h : PyObject_IsTrue(header);
    c->big = big == Py_None ? b : PyObject_IsTrue(big);
}

/* a factory's last step: header sizes from count and esz, whether ``riding`` bytes fit the slot, errors */
static PyObject *done(Call *c, long long riding) {
    c->f[3] = c->count * c->esz;
    c->f[4] = c->count;
    c->fused = c->header && riding <= c->g->pay;
    if (PyErr_Occurred()) {
        Py_DECREF(c);
        return NULL;
    }
    return (PyObject *)c;
}

/* a reduction's core tuple (torchhpc.accl.header.Reduction.core): (esz, dcode, ocode, type_h, op_h) */
static int parse_red(Call *c, PyObject *red) {
    if (!PyTuple_Check(red) || PyTuple_GET_SIZE(red) != 5) {
        PyErr_SetString(PyExc_TypeError, "accl core: a reduction is (esz, dcode, ocode, type_h, op_h)");
        return -1;
    }
    c->esz = PyLong_AsLongLong(PyTuple_GET_ITEM(red, 0));
    c->f[0] = PyLong_AsLongLong(PyTuple_GET_ITEM(red, 1));
    c->f[1] = PyLong_AsLongLong(PyTuple_GET_ITEM(red, 2));
    c->dt = (MPI_Datatype)(uintptr_t)PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(red, 3));
    c->op = (MPI_Op)(uintptr_t)PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(red, 4));
    return PyErr_Occurred() ? -1 : 0;
}

/* The factories below make one Call each; ``header`` and ``big`` are bools, or None for the group's rule
 * (rule() above) on the bytes the call moves. */

/* all_reduce(kind, keep, outputs, eng, post, addr, count, red, header, big) */
static PyObject *Group_all_reduce(Group *g, PyObject *const *args, Py_ssize_t nargs) {
    Call *c = begin(g, C_ALLREDUCE, args, nargs, 10, "all_reduce(kind, keep, outputs, eng, post, addr, count, red, "
                                                     "header, big)");
    if (!c)
        return NULL;
    c->src = c->dst = ARG_PTR(5);
    c->count = ARG_LL(6);
    if (parse_red(c, args[7]) < 0) {
        Py_DECREF(c);
        return NULL;
    }
    flags_of(c, args[8], args[9], c->count * c->esz);
    return done(c, c->count * c->esz);
}

/* broadcast(kind, keep, outputs, eng, post, addr, count, esz, dcode, root, header, big) */
static PyObject *Group_broadcast(Group *g, PyObject *const *args, Py_ssize_t nargs) {
    Call *c = begin(g, C_BCAST, args, nargs, 12, "broadcast(kind, keep, outputs, eng, post, addr, count, esz, dcode, "
                                                 "root, header, big)");
    if (!c)
        return NULL;
    c->src = c->dst = ARG_PTR(5);
    c->count = ARG_LL(6);
    c->esz = ARG_LL(7);
    c->f[0] = ARG_LL(8);
    c->root = (int)ARG_LL(9);
    c->f[2] = c->root;
    flags_of(c, args[10], args[11], c->count * c->esz);
    return done(c, c->count * c->esz);
}

/* all_gather(kind, keep, outputs, eng, post, src, dst, count, esz, dcode, header, big) and
 * reduce_scatter(kind, keep, outputs, eng, post, src, dst, count, red, header, big): ``count`` elements per
 * rank; all_gather's dst and reduce_scatter's src hold p blocks */
static PyObject *two_buffer(Group *g, int ck, PyObject *const *args, Py_ssize_t nargs) {
    int ag = ck == C_ALLGATHER, n = ag ? 12 : 11;
    Call *c = begin(g, ck, args, nargs, n,
                    ag ? "all_gather(kind, keep, outputs, eng, post, src, dst, count, esz, dcode, header, big)"
                       : "reduce_scatter(kind, keep, outputs, eng, post, src, dst, count, red, header, big)");
    if (!c)
        return NULL;
    c->src = ARG_PTR(5);
    c->dst = ARG_PTR(6);
    c->count = ARG_LL(7);
    if (ag) {
        c->esz = ARG_LL(8);
        c->f[0] = ARG_LL(9);
    } else if (parse_red(c, args[8]) < 0) {
        Py_DECREF(c);
        return NULL;
    }
    flags_of(c, args[n - 2], args[n - 1], c->count * c->esz * g->size);
    /* all_gather: one rank's block rides; reduce_scatter: the whole input (p blocks) rides */
    return done(c, c->count * c->esz * (ag ? 1 : g->size));
}

static PyObject *Group_all_gather(Group *g, PyObject *const *args, Py_ssize_t nargs) {
    return two_buffer(g, C_ALLGATHER, args, nargs);
}

static PyObject *Group_reduce_scatter(Group *g, PyObject *const *args, Py_ssize_t nargs) {
    return two_buffer(g, C_REDSCAT, args, nargs);
}

/* per-rank byte counts: a sequence of ``p`` ints, or one int for every rank */
static int counts_of(PyObject *seq, long long *out, int p, const char *what) {
    if (PyLong_Check(seq)) {
        long long v = PyLong_AsLongLong(seq);
        for (int i = 0; i < p; i++)
            out[i] = v;
        return PyErr_Occurred() ? -1 : 0;
    }
    PyObject *fast = PySequence_Fast(seq, what);
    if (!fast)
        return -1;
    if (PySequence_Fast_GET_SIZE(fast) != p) {
        Py_DECREF(fast);
        PyErr_Format(PyExc_ValueError, "accl core: %s needs %d entries", what, p);
        return -1;
    }
    PyObject **items = PySequence_Fast_ITEMS(fast);
    for (int i = 0; i < p; i++)
        out[i] = PyLong_AsLongLong(items[i]);
    Py_DECREF(fast);
    return PyErr_Occurred() ? -1 : 0;
}

/* all_to_all(kind, keep, outputs, eng, post, src, dst, dcode, send_bytes, recv_bytes, big): byte counts to
 * and from each rank (a sequence each, or one int for even blocks); the header is always exchanged */
static PyObject *Group_all_to_all(Group *g, PyObject *const *args, Py_ssize_t nargs) {
    Call *c = begin(g, C_ALLTOALL, args, nargs, 11, "all_to_all(kind, keep, outputs, eng, post, src, dst, dcode, "
                                                    "send_bytes, recv_bytes, big)");
    if (!c)
        return NULL;
    int p = g->size;
    c->src = ARG_PTR(5);
    c->dst = ARG_PTR(6);
    c->f[0] = ARG_LL(7);
    c->f[5] = p;
    c->compare = 4;  /* sizes are checked on the byte matrix */
    c->esz = 1;
    c->sb = PyMem_Malloc(sizeof(long long) * 2 * (size_t)p);
    if (!c->sb) {
        Py_DECREF(c);
        return PyErr_NoMemory();
    }
    c->rb = c->sb + p;
    if (PyErr_Occurred() || counts_of(args[8], c->sb, p, "send_bytes") < 0 ||
        counts_of(args[9], c->rb, p, "recv_bytes") < 0) {
        Py_DECREF(c);
        return NULL;
    }
    long long sent = 0, got = 0;
    for (int i = 0; i < p; i++) {
        sent += c->sb[i];
        got += c->rb[i];
    }
    flags_of(c, Py_True, args[10], sent > got ? sent : got);
    c->in_slot = 16LL * p <= g->pay;
    c->packs_data = c->in_slot && sent <= g->pay - 16LL * p;
    c->rounds = 1;
    return (PyObject *)c;
}

/* barrier(kind, keep, outputs, eng, post, header) */
static PyObject *Group_barrier(Group *g, PyObject *const *args, Py_ssize_t nargs) {
    Call *c = begin(g, C_BARRIER, args, nargs, 6, "barrier(kind, keep, outputs, eng, post, header)");
    if (!c)
        return NULL;
    c->header = PyObject_IsTrue(args[5]);
    return (PyObject *)c;
}

/* ---- the plan protocol */

static void put_payload(Group *g, const char *src, long long nbytes, long long offset) {
    if (nbytes > 0)
        memcpy(g->mine + g->hdr + offset, src, (size_t)nbytes);
}

static const unsigned char *payload_of(Group *g, int rank) {
    return g->all + (size_t)rank * (size_t)g->slot + g->hdr;
}

static int call_pack(Call *c, long long seq) {
    Group *g = c->g;
    hx_pack(g, c->kind, seq, c->f);
    if (c->ck == C_ALLTOALL) {
        if (c->in_slot) {
            memcpy(g->mine + g->hdr, c->sb, sizeof(long long) * 2 * (size_t)g->size);
            if (c->packs_data) {
                long long sent = 0;
                for (int i = 0; i < g->size; i++)
                    sent += c->sb[i];
                put_payload(g, c->src, sent, 16LL * g->size);
            }
        }
        return 0;
    }
    if (!c->fused)
        return 0;
    switch (c->ck) {
    case C_ALLREDUCE: case C_ALLGATHER:
        put_payload(g, c->src, c->f[3], 0);
        break;
    case C_BCAST:
        if (g->rank == c->root)
            put_payload(g, c->src, c->f[3], 0);
        break;
    case C_REDSCAT:
        put_payload(g, c->src, c->f[3] * g->size, 0);
        break;
    }
    return 0;
}

/* the agreed send matrix of all_to_all: send[i][j] = what rank i sends to rank j; check it against the
 * receive side, set rounds and uniform */
static int a2a_rounds(Call *c, const long long *rows, Py_ssize_t stride) {
    int p = c->g->size;
    long long bad = 0, bi = 0, bj = 0, maxs = 0, first = rows[0];
    int uniform = 1;
    for (int i = 0; i < p; i++)
        for (int j = 0; j < p; j++) {
            long long s = rows[i * stride + j], r = rows[j * stride + p + i];
            if (s != r && bad++ == 0) {
                bi = i;
                bj = j;
            }
            if (s > maxs)
                maxs = s;
            if (s != first)
                uniform = 0;
        }
    if (bad) {
        PyErr_Format(MismatchError,
                     "accl: all_to_all split sizes do not match across ranks: rank %lld sends %lld bytes to rank "
                     "%lld, which expects %lld bytes from it (%lld mismatched pairs)",
                     bi, rows[bi * stride + bj], bj, rows[bj * stride + p + bi], bad);
        return -1;
    }
    long long per = c->g->seg / p > 1 ? c->g->seg / p : 1;
    long long rounds = (maxs + per - 1) / per;
    c->rounds = rounds > 1 ? (int)rounds : 1;
    c->uniform = uniform;
    return 0;
}

/* this rank's blocks from every rank's slot, after the matrix */
static void a2a_unpack(Call *c, const long long *rows, Py_ssize_t stride) {
    Group *g = c->g;
    int p = g->size, me = g->rank;
    char *at = c->dst;
    for (int r = 0; r < p; r++) {
        const long long *row = rows + r * stride;
        long long off = 16LL * p;
        for (int j = 0; j < me; j++)
            off += row[j];
        memcpy(at, payload_of(g, r) + off, (size_t)row[me]);
        at += row[me];
    }
    c->fused = 1;
}

static int call_verified(Call *c) {
    Group *g = c->g;
    int p = g->size;
    if (c->ck == C_ALLTOALL) {
        if (!c->in_slot)
            return 0;
        Py_ssize_t stride = g->slot / 8;
        const long long *rows = (const long long *)(const void *)(g->all + g->hdr);
        if (a2a_rounds(c, rows, stride) < 0)
            return -1;
        /* the sends rode after the matrix when every rank's fit (each rank packed by the same rule) */
        long long room = g->pay - 16LL * p;
        for (int i = 0; i < p; i++) {
            long long s = 0;
            for (int j = 0; j < p; j++)
                s += rows[i * stride + j];
            if (s > room)
                return 0;
        }
        a2a_unpack(c, rows, stride);
        return 0;
    }
    if (!c->fused)
        return 0;
    long long n = c->f[3];
    switch (c->ck) {
    case C_ALLREDUCE:
        return n ? reduce_rows(g, c->dt, c->op, (int)c->count, (Py_ssize_t)n, c->dst, 0) : 0;
    case C_BCAST:
        if (g->rank != c->root && n)
            memcpy(c->dst, payload_of(g, c->root), (size_t)n);
        return 0;
    case C_ALLGATHER:
        for (int r = 0; r < p; r++)
            memcpy(c->dst + (size_t)r * (size_t)n, payload_of(g, r), (size_t)n);
        return 0;
    case C_REDSCAT:
        return n ? reduce_rows(g, c->dt, c->op, (int)c->count, (Py_ssize_t)n, c->dst, (Py_ssize_t)(g->rank * n)) : 0;
    }
    return 0;
}

static int too_big(long long n, const char *what) {
    if (n <= INT_MAX)
        return 0;
    PyErr_Format(PyExc_OverflowError, "accl core: one %s call of %lld elements exceeds MPI's int count; lower "
                 "max_segment_bytes", what, n);
    return 1;
}

static int add_req(Call *c, MPI_Request r, int cap) {
    if (c->nreq >= c->capreq) {
        int want = cap > c->nreq ? cap : 2 * c->nreq + 1;
        MPI_Request *more = PyMem_Realloc(c->reqs, sizeof(MPI_Request) * (size_t)want);
        if (!more) {
            PyErr_NoMemory();
            return -1;
        }
        c->reqs = more;
        c->capreq = want;
    }
    c->reqs[c->nreq++] = r;
    return 0;
}

static int *ints(Call *c, size_t n) {
    PyMem_Free(c->ints);
    c->ints = PyMem_Malloc(sizeof(int) * (n ? n : 1));
    if (!c->ints)
        PyErr_NoMemory();
    return c->ints;
}

/* One MPI data call, blocking (GIL released) or started nonblocking into c->reqs. */
#define DATA_CALL(blocking_call, nonblocking_call)                                                          \
    do {                                                                                                      \
        int rc_;                                                                                              \
        if (blocking) {                                                                                       \
            Py_BEGIN_ALLOW_THREADS rc_ = blocking_call;                                                       \
            Py_END_ALLOW_THREADS                                                                              \
        } else {                                                                                              \
            MPI_Request r_ = MPI_REQUEST_NULL;                                                                \
            rc_ = nonblocking_call;                                                                           \
            if (rc_ == MPI_SUCCESS && add_req(c, r_, cap) < 0)                                                \
                return -1;                                                                                    \
        }                                                                                                     \
        if (rc_ != MPI_SUCCESS)                                                                               \
            return PyErr_Occurred() ? -1 : mpi_error(rc_);                                                    \
        if (PyErr_Occurred())                                                                                 \
            return -1;                                                                                        \
    } while (0)

/* The data phase of ``c`` (after the header, when there is one): blocking or nonblocking. */
static int call_data(Call *c, int blocking) {
    Group *g = c->g;
    MPI_Comm comm = g->coll;
    int p = g->size;
    long long esz = c->esz, n = c->count;
    c->nreq = 0;
    switch (c->ck) {
    case C_BARRIER: {
        int cap = 1;
        if (count_call(g, 0) < 0)
            return -1;
        DATA_CALL(MPI_Barrier(comm), MPI_Ibarrier(comm, &r_));
        return 0;
    }
    case C_ALLREDUCE: case C_BCAST: {
        long long per = g->seg / esz > 1 ? g->seg / esz : 1;
        int cap = (int)((n + per - 1) / per);
        for (long long a = 0; a < n; a += per) {
            long long k = n - a < per ? n - a : per;
            char *at = c->dst + a * esz;
            if (count_call(g, k * esz) < 0)
                return -1;
            if (c->ck == C_ALLREDUCE) {
                if (too_big(k, "all_reduce"))
                    return -1;
                DATA_CALL(MPI_Allreduce(MPI_IN_PLACE, at, (int)k, c->dt, c->op, comm),
                          MPI_Iallreduce(MPI_IN_PLACE, at, (int)k, c->dt, c->op, comm, &r_));
            } else {
                if (too_big(k * esz, "broadcast"))
                    return -1;
                DATA_CALL(MPI_Bcast(at, (int)(k * esz), MPI_BYTE, c->root, comm),
                          MPI_Ibcast(at, (int)(k * esz), MPI_BYTE, c->root, comm, &r_));
            }
        }
        return 0;
    }
    case C_ALLGATHER: {
        long long per = g->seg / (esz * p) > 1 ? g->seg / (esz * p) : 1;
        if (n <= per) {
            int cap = 1;
            if (count_call(g, n * esz * p) < 0 || too_big(n * esz, "all_gather"))
                return -1;
            DATA_CALL(MPI_Allgather(c->src, (int)(n * esz), MPI_BYTE, c->dst, (int)(n * esz), MPI_BYTE, comm),
                      MPI_Iallgather(c->src, (int)(n * esz), MPI_BYTE, c->dst, (int)(n * esz), MPI_BYTE, comm, &r_));
            return 0;
        }
        /* segment [a, b) of every rank's block: strided rows of the destination */
        int cap = (int)((n + per - 1) / per);
        int *arr = ints(c, (size_t)cap * 2 * (size_t)p);
        if (!arr)
            return -1;
        int s = 0;
        for (long long a = 0; a < n; a += per, s++) {
            long long k = n - a < per ? n - a : per;
            int *counts = arr + (size_t)s * 2 * (size_t)p, *displs = counts + p;
            for (int r = 0; r < p; r++) {
                counts[r] = (int)(k * esz);
                displs[r] = (int)((r * n + a) * esz);
            }
            if (count_call(g, k * esz * p) < 0 || too_big(n * esz * p, "all_gather"))
                return -1;
            DATA_CALL(MPI_Allgatherv(c->src + a * esz, (int)(k * esz), MPI_BYTE, c->dst, counts, displs, MPI_BYTE, comm),
                      MPI_Iallgatherv(c->src + a * esz, (int)(k * esz), MPI_BYTE, c->dst, counts, displs, MPI_BYTE,
                                      comm, &r_));
        }
        return 0;
    }
    case C_REDSCAT: {
        long long per = g->seg / (esz * p) > 1 ? g->seg / (esz * p) : 1;
        if (n == 0)
            return 0;
        if (n <= per) {
            int cap = 1;
            if (count_call(g, n * esz * p) < 0 || too_big(n, "reduce_scatter"))
                return -1;
            DATA_CALL(MPI_Reduce_scatter_block(c->src, c->dst, (int)n, c->dt, c->op, comm),
                      MPI_Ireduce_scatter_block(c->src, c->dst, (int)n, c->dt, c->op, comm, &r_));
            return 0;
        }
        /* segment [a, b) of every rank's block, gathered into contiguous rows first */
        int cap = (int)((n + per - 1) / per);
        PyMem_Free(c->tmp);
        c->tmp = PyMem_Malloc((size_t)(n * esz * p));
        if (!c->tmp) {
            PyErr_NoMemory();
            return -1;
        }
        unsigned char *rows = c->tmp;
        for (long long a = 0; a < n; a += per) {
            long long k = n - a < per ? n - a : per;
            for (int r = 0; r < p; r++)
                memcpy(rows + (size_t)(r * k * esz), c->src + (r * n + a) * esz, (size_t)(k * esz));
            if (count_call(g, k * esz * p) < 0)
                return -1;
            DATA_CALL(MPI_Reduce_scatter_block(rows, c->dst + a * esz, (int)k, c->dt, c->op, comm),
                      MPI_Ireduce_scatter_block(rows, c->dst + a * esz, (int)k, c->dt, c->op, comm, &r_));
            rows += k * esz * p;
        }
        return 0;
    }
    case C_ALLTOALL: {
        long long *sb = c->sb, *rb = c->rb;
        if (c->uniform && c->rounds == 1) {
            int cap = 1;
            if (count_call(g, sb[0] * p) < 0 || too_big(sb[0], "all_to_all"))
                return -1;
            DATA_CALL(MPI_Alltoall(c->src, (int)sb[0], MPI_BYTE, c->dst, (int)sb[0], MPI_BYTE, comm),
                      MPI_Ialltoall(c->src, (int)sb[0], MPI_BYTE, c->dst, (int)sb[0], MPI_BYTE, comm, &r_));
            return 0;
        }
        long long per = g->seg / p > 1 ? g->seg / p : 1;
        int cap = c->rounds;
        int *arr = ints(c, (size_t)cap * 4 * (size_t)p);
        if (!arr)
            return -1;
        long long sdis = 0, rdis = 0;
        for (int i = 0; i < p; i++) {
            sdis += sb[i];
            rdis += rb[i];
        }
        if (too_big(sdis, "all_to_all") || too_big(rdis, "all_to_all"))
            return -1;
        for (int round = 0; round < c->rounds; round++) {
            long long lo = (long long)round * per, ssum = 0, rsum = 0, sd = 0, rd = 0;
            int *sc = arr + (size_t)round * 4 * (size_t)p, *sdp = sc + p, *rc = sdp + p, *rdp = rc + p;
            for (int i = 0; i < p; i++) {
                long long s = sb[i] - lo, r = rb[i] - lo;
                sc[i] = (int)(s <= 0 ? 0 : s < per ? s : per);
                rc[i] = (int)(r <= 0 ? 0 : r < per ? r : per);
                sdp[i] = (int)(sd + lo);
                rdp[i] = (int)(rd + lo);
                sd += sb[i];
                rd += rb[i];
                ssum += sc[i];
                rsum += rc[i];
            }
            if (count_call(g, ssum > rsum ? ssum : rsum) < 0)
                return -1;
            DATA_CALL(MPI_Alltoallv(c->src, sc, sdp, MPI_BYTE, c->dst, rc, rdp, MPI_BYTE, comm),
                      MPI_Ialltoallv(c->src, sc, sdp, MPI_BYTE, c->dst, rc, rdp, MPI_BYTE, comm, &r_));
        }
        return 0;
    }
    }
    return 0;
}

/* A Call's nonblocking requests, as an engine request (``test()``). */
typedef struct {
    PyObject_HEAD
    Call *c;
    int done;
} Reqs;

static void Reqs_dealloc(Reqs *self) {
    Py_XDECREF(self->c);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* 1 when every request completed, 0 not yet, -1 error (each tested on its own, so that an error keeps its
 * own code: a dead peer's ULFM class must reach the executor) */
static int reqs_test(Call *c) {
    int all = 1;
    for (int i = 0; i < c->nreq; i++) {
        if (c->reqs[i] == MPI_REQUEST_NULL)
            continue;
        int flag = 0;
        int rc = MPI_Test(&c->reqs[i], &flag, MPI_STATUS_IGNORE);
        if (rc != MPI_SUCCESS)
            return PyErr_Occurred() ? -1 : mpi_error(rc);
        if (PyErr_Occurred())
            return -1;
        if (!flag)
            all = 0;
    }
    if (all)
        c->nreq = 0;
    return all;
}

static int reqs_test_v(void *c) {
    return reqs_test((Call *)c);
}

static PyObject *Reqs_test(Reqs *self, PyObject *unused) {
    (void)unused;
    if (self->done)
        Py_RETURN_TRUE;
    int r = reqs_test(self->c);
    if (r < 0)
        return NULL;
    self->done = r;
    return PyBool_FromLong(r);
}

static PyObject *Reqs_minus_one(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return PyLong_FromLong(-1);
}

static PyMethodDef Reqs_methods[] = {
    {"test", (PyCFunction)Reqs_test, METH_NOARGS, "True once every request completed (never blocks)"},
    {"source", Reqs_minus_one, METH_NOARGS, "-1: not a receive"},
    {"nbytes", Reqs_minus_one, METH_NOARGS, "-1: not a receive"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject ReqsType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "torchhpc.accl.core.Requests",
    .tp_basicsize = sizeof(Reqs),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_dealloc = (destructor)Reqs_dealloc,
    .tp_methods = Reqs_methods,
    .tp_doc = "a compiled call's nonblocking MPI requests",
};

static PyObject *Call_pack(Call *self, PyObject *const *args, Py_ssize_t nargs) {
    if (!nargs_is(nargs, 2, "pack(hx, seq)"))
        return NULL;
    long long seq = PyLong_AsLongLong(args[1]);
    if (seq == -1 && PyErr_Occurred())
        return NULL;
    call_pack(self, seq);
    Py_RETURN_NONE;
}

static PyObject *Call_verified(Call *self, PyObject *hx) {
    (void)hx;
    if (call_verified(self) < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* the data phase as one blocking run (the worker thread's job in Mode.WORKER) */
static PyObject *Call_run_blocking(Call *self, PyObject *unused) {
    (void)unused;
    if (call_data(self, 1) < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* the call's started requests as the executor's request list: [Requests], or [] when none is pending */
static PyObject *requests_of(Call *c) {
    if (!c->nreq)
        return PyList_New(0);
    Reqs *r = PyObject_New(Reqs, &ReqsType);
    if (!r)
        return NULL;
    Py_INCREF(c);
    r->c = c;
    r->done = 0;
    PyObject *out = PyList_New(1);
    if (!out) {
        Py_DECREF(r);
        return NULL;
    }
    PyList_SET_ITEM(out, 0, (PyObject *)r);
    return out;
}

static PyObject *data_stage(Call *c, PyObject *ctx, int mode) {
    if (mode == WORKER) {
        /* the blocking calls on the engine's worker thread: ctx.mpi.in_worker(run) */
        PyObject *mpi = PyObject_GetAttrString(ctx, "mpi");
        if (!mpi)
            return NULL;
        PyObject *run = PyObject_GetAttrString((PyObject *)c, "run_blocking");
        PyObject *req = run ? PyObject_CallMethod(mpi, "in_worker", "O", run) : NULL;
        Py_XDECREF(run);
        Py_DECREF(mpi);
        if (!req)
            return NULL;
        PyObject *out = PyList_New(1);
        if (!out) {
            Py_DECREF(req);
            return NULL;
        }
        PyList_SET_ITEM(out, 0, req);
        return out;
    }
    if (call_data(c, mode == BLOCKING) < 0)
        return NULL;
    return requests_of(c);
}

/* all_to_all above the slot's matrix size: start the all-gather of every rank's byte-matrix row */
static int matrix_start(Call *c) {
    Group *g = c->g;
    int p = g->size;
    PyMem_Free(c->mat);
    c->mat = PyMem_Malloc(sizeof(long long) * 2 * (size_t)p * (size_t)p);
    if (!c->mat) {
        PyErr_NoMemory();
        return -1;
    }
    c->nreq = 0;
    MPI_Request r = MPI_REQUEST_NULL;
    int rc = MPI_Iallgather(c->sb, 2 * p, MPI_LONG_LONG, c->mat, 2 * p, MPI_LONG_LONG, g->ctl, &r);
    if (rc != MPI_SUCCESS)
        return mpi_error(rc);
    return add_req(c, r, 1);
}

/* stage(k, ctx, mode): start stage k's MPI calls and return their requests; None ends the data phase.
 * all_to_all above the slot's matrix size gathers the byte matrix first (stage 0), then checks it. */
static PyObject *Call_stage(Call *self, PyObject *const *args, Py_ssize_t nargs) {
    if (!nargs_is(nargs, 3, "stage(k, ctx, mode)"))
        return NULL;
    long k = PyLong_AsLong(args[0]);
    long mode = PyLong_AsLong(args[2]);
    if (PyErr_Occurred())
        return NULL;
    if (self->fused || (self->ck == C_BARRIER && self->header))
        Py_RETURN_NONE;
    if (self->ck == C_ALLTOALL && !self->in_slot) {
        Group *g = self->g;
        int p = g->size;
        if (k == 0)
            return matrix_start(self) < 0 ? NULL : requests_of(self);
        if (k == 1) {
            if (a2a_rounds(self, self->mat, 2 * p) < 0)
                return NULL;
            return data_stage(self, args[1], (int)mode);
        }
        Py_RETURN_NONE;
    }
    if (k)
        Py_RETURN_NONE;
    return data_stage(self, args[1], (int)mode);
}

static PyObject *Call_finish(Call *self, PyObject *unused) {
    (void)unused;
    if (self->post)
        return PyObject_CallNoArgs(self->post);
    Py_RETURN_NONE;
}

static PyObject *Call_describe(Call *self, PyObject *seq) {
    if (!Describe) {
        PyErr_SetString(PyExc_RuntimeError, "accl core: set_hooks() was not called");
        return NULL;
    }
    return PyObject_CallFunction(Describe, "iLLLLLLO", self->kind, (long long)self->f[0], (long long)self->f[1],
                                 (long long)self->f[2], (long long)self->f[3], (long long)self->f[4],
                                 (long long)self->f[5], seq);
}

static PyObject *Call_get_minus_one(Call *self, void *closure) {
    (void)self;
    (void)closure;
    return PyLong_FromLong(-1);
}

/* How the caller's thread makes a call's data calls inline: torchhpc.accl.executor.mode_for(call, owner=True)
 * (tested equal): blocking after a header; without one, nonblocking unless big (then blocking: the queued
 * path's worker makes the same blocking call). */
static int inline_mode(const Call *c) {
    return c->header ? BLOCKING : c->big ? WORKER : NONBLOCKING;
}

static PyObject *Call_get_inline_mode(Call *self, void *closure) {
    (void)closure;
    return PyLong_FromLong(inline_mode(self));
}

static PyGetSetDef Call_getset[] = {
    {"inline_mode", (getter)Call_get_inline_mode, NULL, "the mode of its data calls when run inline", NULL},
    {"source_rank", (getter)Call_get_minus_one, NULL, "-1: not a receive", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMemberDef Call_members[] = {
    {"header", T_INT, offsetof(Call, header), READONLY, "exchanges the consistency header"},
    {"fused", T_INT, offsetof(Call, fused), READONLY, "the data rode in the header slots"},
    {"big", T_INT, offsetof(Call, big), READONLY, "large enough for blocking MPI on the worker when async"},
    {"compare", T_INT, offsetof(Call, compare), READONLY, "header fields every rank must agree on"},
    {"in_slot", T_INT, offsetof(Call, in_slot), READONLY, "all_to_all: the byte matrix rides in the header slot"},
    {"outputs", T_OBJECT_EX, offsetof(Call, outputs), READONLY, "what the call's future yields"},
    {"eng", T_OBJECT_EX, offsetof(Call, eng), READONLY, "the engine object (MPI)"},
    {NULL, 0, 0, 0, NULL},
};

static PyMethodDef Call_methods[] = {
    {"pack", (PyCFunction)(void (*)(void))Call_pack, METH_FASTCALL, "write the header (and payload) into the slot"},
    {"verified", (PyCFunction)Call_verified, METH_O, "every rank agreed: take what the slots carried"},
    {"stage", (PyCFunction)(void (*)(void))Call_stage, METH_FASTCALL, "start stage k; its requests, or None"},
    {"finish", (PyCFunction)Call_finish, METH_NOARGS, "deliver the results"},
    {"run_blocking", (PyCFunction)Call_run_blocking, METH_NOARGS, "the data phase as blocking MPI calls"},
    {"describe", (PyCFunction)Call_describe, METH_O, "the call in words, for errors"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject CallType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "torchhpc.accl.core.Call",
    .tp_basicsize = sizeof(Call),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_dealloc = (destructor)Call_dealloc,
    .tp_methods = Call_methods,
    .tp_members = Call_members,
    .tp_getset = Call_getset,
    .tp_doc = "one collective call on the MPI engine (the plan protocol of torchhpc.accl.plans)",
};

/* Run ``c`` inline as call ``seq``: pack and exchange the header (when it has one), verified, its data calls
 * (as inline_mode says: nonblocking calls are started and waited for), finish.  1, or 0 when the headers
 * disagree (the slots hold every rank's; the caller raises the mismatch), or -1 with Expired set past the
 * timeout, MPI's exception on an MPI error. */
static int run_inline(Group *g, Call *c, long long seq, double timeout) {
    int mode = inline_mode(c);
    double deadline = -1.0;
    if (c->header) {
        call_pack(c, seq);
        if (hx_start(g) < 0)
            return -1;
        int done = hx_test(g);
        if (done < 0 || (!done && wait_for(g, hx_test_v, g, deadline = now() + timeout) < 0))
            return -1;
        if (!hx_agrees(g, c->compare))
            return 0;
        if (call_verified(c) < 0)
            return -1;
    }
    if (deadline < 0)
        deadline = now() + timeout;
    if (c->ck == C_ALLTOALL && !c->in_slot) {  /* the byte matrix by a second all-gather, then its check */
        int done;
        if (matrix_start(c) < 0 || (done = reqs_test(c)) < 0 || (!done && wait_for(g, reqs_test_v, c, deadline) < 0))
            return -1;
        if (a2a_rounds(c, c->mat, 2 * (Py_ssize_t)g->size) < 0)
            return -1;
    }
    if (!c->fused && !(c->ck == C_BARRIER && c->header)) {
        if (call_data(c, mode != NONBLOCKING) < 0)
            return -1;
        if (c->nreq) {
            int done = reqs_test(c);
            if (done < 0 || (!done && wait_for(g, reqs_test_v, c, deadline) < 0))
                return -1;
        }
    }
    if (c->post) {
        PyObject *r = PyObject_CallNoArgs(c->post);
        if (!r)
            return -1;
        Py_DECREF(r);
    }
    return 1;
}

static Call *as_call(PyObject *obj) {
    if (PyObject_TypeCheck(obj, &CallType))
        return (Call *)obj;
    PyErr_SetString(PyExc_TypeError, "accl core: run() takes a core Call");
    return NULL;
}

/* run(call, seq, timeout_s): run_inline() for tests and diagnostics; True, or False when the headers disagree */
static PyObject *Group_run(Group *g, PyObject *const *args, Py_ssize_t nargs) {
    Call *c;
    if (!nargs_is(nargs, 3, "run(call, seq, timeout_s)") || !(c = as_call(args[0])))
        return NULL;
    long long seq = PyLong_AsLongLong(args[1]);
    double timeout = PyFloat_AsDouble(args[2]);
    if (PyErr_Occurred())
        return NULL;
    int r = run_inline(g, c, seq, timeout);
    return r < 0 ? NULL : PyBool_FromLong(r);
}

static PyObject *S_lock, *S_acquire, *S_release, *S_queue, *S_p2p, *S_aborted, *S_timeout_s, *S_hx,
    *S_inline_failed;

/* The raised exception as one object, cleared (NULL when none), and back (stolen): Python 3.12's API, and
 * the type/value/traceback triple before it. */
static PyObject *take_exception(void) {
#if PY_VERSION_HEX >= 0x030C0000
    return PyErr_GetRaisedException();
#else
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (value && tb)
        PyException_SetTraceback(value, tb);
    Py_XDECREF(type);
    Py_XDECREF(tb);
    return value;
#endif
}

static void give_exception(PyObject *exc) {
#if PY_VERSION_HEX >= 0x030C0000
    PyErr_SetRaisedException(exc);
#else
    PyErr_Restore(Py_NewRef((PyObject *)Py_TYPE(exc)), exc, PyException_GetTraceback(exc));
#endif
}

/* 1 when ``ex``'s queue and point-to-point list are empty and it is not aborted, 0 if not, -1 on error */
static int idle(PyObject *ex) {
    PyObject *v = PyObject_GetAttr(ex, S_aborted);
    if (!v)
        return -1;
    int ok = v == Py_None;
    Py_DECREF(v);
    for (int i = 0; ok && i < 2; i++) {
        v = PyObject_GetAttr(ex, i ? S_p2p : S_queue);
        if (!v)
            return -1;
        Py_ssize_t n = PyObject_Length(v);
        Py_DECREF(v);
        if (n < 0)
            return -1;
        ok = n == 0;
    }
    return ok;
}

/* run_idle(call, executor): the executor's inline path (torchhpc.accl.executor.Executor.run_core), whole.
 * Under the executor's lock, when it is idle (nothing queued or in flight, point-to-point included, since
 * an inline wait cannot progress them; not aborted): takes the next call number and runs ``call``.
 * Returns None when it completed, NotImplemented when the group is busy (queue the call instead), or the
 * Work of the failed call from ``executor.inline_failed(call, seq, exc)``, which the lock still covers
 * (mismatches are raised by ``executor.hx.check(call.compare)``). */
static PyObject *Group_run_idle(Group *g, PyObject *const *args, Py_ssize_t nargs) {
    Call *c;
    if (!nargs_is(nargs, 2, "run_idle(call, executor)") || !(c = as_call(args[0])))
        return NULL;
    PyObject *ex = args[1], *res = NULL;
    PyObject *lock = PyObject_GetAttr(ex, S_lock);
    if (!lock)
        return NULL;
    PyObject *got = PyObject_CallMethodNoArgs(lock, S_acquire);  /* blocks with the GIL released */
    if (!got) {
        Py_DECREF(lock);
        return NULL;
    }
    Py_DECREF(got);
    int ok = idle(ex);
    if (ok <= 0) {
        res = ok < 0 ? NULL : Py_NewRef(Py_NotImplemented);
        goto out;
    }
    long long seq = g->seq++;
    PyObject *t = PyObject_GetAttr(ex, S_timeout_s);
    double timeout = t ? PyFloat_AsDouble(t) : -1.0;
    Py_XDECREF(t);
    int r = PyErr_Occurred() ? -1 : run_inline(g, c, seq, timeout);
    if (r == 0) {  /* the headers disagree: the exchange raises the mismatch, naming the fields */
        PyObject *hx = PyObject_GetAttr(ex, S_hx);
        PyObject *chk = hx ? PyObject_CallMethod(hx, "check", "i", c->compare) : NULL;
        Py_XDECREF(hx);
        if (chk) {  /* (it found them equal after all: nothing failed) */
            Py_DECREF(chk);
            r = 1;
        }
    }
    if (r == 1) {
        res = Py_NewRef(Py_None);
        goto out;
    }
    /* the failure, as torch expects it: the Work of the failed call, whose wait() raises */
    PyObject *exc = take_exception();
    PyObject *seqo = exc ? PyLong_FromLongLong(seq) : NULL;
    if (seqo)
        res = PyObject_CallMethodObjArgs(ex, S_inline_failed, (PyObject *)c, seqo, exc, NULL);
    Py_XDECREF(seqo);
    Py_XDECREF(exc);
out:;
    /* release even with an exception set: keep it across the call */
    PyObject *pending = PyErr_Occurred() ? take_exception() : NULL;
    PyObject *rel = PyObject_CallMethodNoArgs(lock, S_release);
    Py_DECREF(lock);
    if (!rel) {
        Py_XDECREF(pending);
        Py_XDECREF(res);
        return NULL;
    }
    Py_DECREF(rel);
    if (pending)
        give_exception(pending);
    return res;
}

static PyMethodDef Group_methods[] = {
    {"start", (PyCFunction)Group_start, METH_NOARGS, "start the all-gather of the packed slot"},
    {"test", (PyCFunction)Group_test, METH_NOARGS, "whether the header exchange completed"},
    {"agrees", (PyCFunction)Group_agrees, METH_O, "whether every rank's leading fields equal this rank's"},
    {"drop_persistent", (PyCFunction)Group_drop, METH_NOARGS, "free the persistent request; use Iallgather"},
    {"all_reduce", (PyCFunction)(void (*)(void))Group_all_reduce, METH_FASTCALL, "an all_reduce Call"},
    {"broadcast", (PyCFunction)(void (*)(void))Group_broadcast, METH_FASTCALL, "a broadcast Call"},
    {"all_gather", (PyCFunction)(void (*)(void))Group_all_gather, METH_FASTCALL, "an all_gather Call"},
    {"reduce_scatter", (PyCFunction)(void (*)(void))Group_reduce_scatter, METH_FASTCALL, "a reduce_scatter Call"},
    {"all_to_all", (PyCFunction)(void (*)(void))Group_all_to_all, METH_FASTCALL, "an all_to_all Call"},
    {"barrier", (PyCFunction)(void (*)(void))Group_barrier, METH_FASTCALL, "a barrier Call"},
    {"run", (PyCFunction)(void (*)(void))Group_run, METH_FASTCALL, "run a Call inline as call number seq"},
    {"run_idle", (PyCFunction)(void (*)(void))Group_run_idle, METH_FASTCALL, "the executor's inline path"},
    {"flags", (PyCFunction)Group_flags, METH_O, "(header, big) of a collective moving this many bytes"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject GroupType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "torchhpc.accl.core.Group",
    .tp_basicsize = sizeof(Group),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Group_init,
    .tp_dealloc = (destructor)Group_dealloc,
    .tp_methods = Group_methods,
    .tp_members = Group_members,
    .tp_doc = "one process group's header exchange and MPI-engine calls",
};

/* set_hooks(mpi_exception, mismatch_error, expired, describe) */
static PyObject *set_hooks(PyObject *mod, PyObject *args) {
    PyObject *a, *b, *c, *d;
    (void)mod;
    if (!PyArg_ParseTuple(args, "OOOO", &a, &b, &c, &d))
        return NULL;
    Py_XSETREF(MpiException, Py_NewRef(a));
    Py_XSETREF(MismatchError, Py_NewRef(b));
    Py_XSETREF(Expired, Py_NewRef(c));
    Py_XSETREF(Describe, Py_NewRef(d));
    Py_RETURN_NONE;
}

static PyObject *library_version(PyObject *mod, PyObject *unused) {
    char buf[MPI_MAX_LIBRARY_VERSION_STRING];
    int n = 0;
    (void)mod;
    (void)unused;
    MPI_Get_library_version(buf, &n);
    return PyUnicode_DecodeUTF8(buf, n, "replace");
}

static PyMethodDef module_methods[] = {
    {"set_hooks", set_hooks, METH_VARARGS, "set_hooks(mpi_exception, mismatch_error, expired, describe)"},
    {"library_version", library_version, METH_NOARGS, "MPI_Get_library_version of the MPI this module links"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, STR(CORE_NAME), "torchhpc.accl's compiled core (one MPI family)", -1, module_methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC CAT(PyInit_, CORE_NAME)(void) {
    if (PyType_Ready(&GroupType) < 0 || PyType_Ready(&CallType) < 0 || PyType_Ready(&ReqsType) < 0)
        return NULL;
    S_engine_calls = PyUnicode_InternFromString("engine_calls");
    S_sidestep_calls = PyUnicode_InternFromString("sidestep_calls");
    S_max_call_bytes = PyUnicode_InternFromString("max_call_bytes");
    if (!S_engine_calls || !S_sidestep_calls || !S_max_call_bytes)
        return NULL;
    struct { PyObject **s; const char *v; } names[] = {
        {&S_lock, "lock"}, {&S_acquire, "acquire"}, {&S_release, "release"}, {&S_queue, "queue"}, {&S_p2p, "p2p"},
        {&S_aborted, "aborted"}, {&S_timeout_s, "timeout_s"}, {&S_hx, "hx"},
        {&S_inline_failed, "inline_failed"},
    };
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (!(*names[i].s = PyUnicode_InternFromString(names[i].v)))
            return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m)
        return NULL;
    if (PyModule_AddObjectRef(m, "Group", (PyObject *)&GroupType) < 0 ||
        PyModule_AddObjectRef(m, "Call", (PyObject *)&CallType) < 0 ||
        PyModule_AddIntConstant(m, "MPI_VERSION", MPI_VERSION) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
