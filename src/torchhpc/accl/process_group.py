"""``ProcessGroupACCL``: the torch.distributed process group behind the ``"accl"`` backend.

Responsibilities, in order of a call's life:

1. **Arguments** are checked on the calling rank (tensor counts, dtypes, sizes, roots, tags,
   op/dtype pairs) and raise ``ValueError``/``TypeError`` naming the problem.
2. **Ordering**: collectives are queued and run one after another in issue order (so an op may
   safely consume the previous op's output, as on a CUDA stream); point-to-point ops start at once.
3. **Consistency**: unless ``AcclOptions.check`` is off, each collective first all-gathers a
   fixed-size header (kind, call number, dtype, op, root, sizes); a mismatch raises the same clear
   error on every rank and leaves the group usable.  Small all-reduces carry their payload inside
   that header exchange and are reduced locally in rank order, so checking them costs nothing extra.
4. **Segmentation**: data move in segments of at most ``max_segment_bytes`` per buffer and per
   engine call, all started at once (nonblocking), whatever the tensor's shape.
5. **Completion**: ``Work.wait()`` polls with a deadline (the group timeout); async work nobody
   waits on is driven by a progress thread.  A timeout aborts the group (MPI cannot cancel a
   collective): later calls raise at once.
"""

from __future__ import annotations

import math
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from mpi4py import MPI

from .engine import CollectiveEngine, Request
from .mpi_engine import MpiEngine, MpiRequest
from .options import AcclOptions
from .reduction import RedOp, check_reduction, op_name, red_op_of
from .work import AcclTimeoutError, AcclWork, Op, now

__all__ = ["ProcessGroupACCL", "AcclMismatchError"]

_R = RedOp
_MAGIC = 0x4ACC1
_HDR_WORDS = 16
_SMALL_BYTES = 256  # all-reduces up to this size ride inside the checking header exchange
_SLOT_WORDS = _HDR_WORDS + _SMALL_BYTES // 8

_KINDS = ("all_reduce", "broadcast", "reduce", "all_gather", "gather", "scatter", "reduce_scatter",
          "all_to_all", "barrier", "all_reduce_coalesced")
_KIND = {k: i + 1 for i, k in enumerate(_KINDS)}
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.int16,
           torch.int32, torch.int64, torch.uint8, torch.bool, torch.complex64, torch.complex128,
           torch.uint16, torch.uint32, torch.uint64)
_DTYPE_CODE = {d: i + 1 for i, d in enumerate(_DTYPES)}
_OPS = (_R.SUM, _R.AVG, _R.PRODUCT, _R.MIN, _R.MAX, _R.BAND, _R.BOR, _R.BXOR)
_OP_CODE = {o: i + 1 for i, o in enumerate(_OPS)}
# header fields: 0 magic, 1 kind, 2 seq, 3 dtype, 4 op, 5 root, 6 bytes per rank, 7 numel, 8 extra
_F_KIND, _F_SEQ, _F_DTYPE, _F_OP, _F_ROOT, _F_BYTES, _F_NUMEL = 1, 2, 3, 4, 5, 6, 7
_NUMPY_DTYPE = {torch.float32: np.float32, torch.float64: np.float64, torch.float16: np.float16,
                torch.int8: np.int8, torch.int16: np.int16, torch.int32: np.int32, torch.int64: np.int64,
                torch.uint8: np.uint8}
_NP_REDUCE = {_R.SUM: np.add.reduce, _R.AVG: np.add.reduce, _R.PRODUCT: np.multiply.reduce,
              _R.MIN: np.minimum.reduce, _R.MAX: np.maximum.reduce, _R.BAND: np.bitwise_and.reduce,
              _R.BOR: np.bitwise_or.reduce, _R.BXOR: np.bitwise_xor.reduce}


class AcclMismatchError(ValueError):
    """Ranks called a collective with different kinds, dtypes, sizes, ops or roots."""


def _dtype_name(code: int) -> str:
    return str(_DTYPES[code - 1]).replace("torch.", "") if 0 < code <= len(_DTYPES) else f"dtype#{code}"


def _describe(h: Sequence[int]) -> str:
    kind = _KINDS[h[_F_KIND] - 1] if 0 < h[_F_KIND] <= len(_KINDS) else f"op#{h[_F_KIND]}"
    parts = [_dtype_name(h[_F_DTYPE]), f"{h[_F_NUMEL]} elements"]
    if h[_F_OP]:
        parts.append(op_name(_OPS[h[_F_OP] - 1]))
    if kind in ("broadcast", "reduce", "gather", "scatter"):
        parts.append(f"root {h[_F_ROOT]}")
    return f"{kind}({', '.join(parts)}) as call #{h[_F_SEQ]}"


def _flat(t: torch.Tensor) -> torch.Tensor:
    """A contiguous 1-D view of ``t`` (a copy when ``t`` is not contiguous)."""
    return t.contiguous().view(-1) if t.dim() != 1 or not t.is_contiguous() else t


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8, device=t.device)


def _ranges(n: int, per: int) -> list[tuple[int, int]]:
    """[a, b) element ranges of at most ``per`` elements covering ``n`` (one empty range for n == 0)."""
    if n == 0:
        return [(0, 0)]
    return [(a, min(n, a + per)) for a in range(0, n, per)]


class _Tensorish:
    """Checks shared by every entry point."""

    @staticmethod
    def one(tensors: Sequence[torch.Tensor], what: str) -> torch.Tensor:
        if not isinstance(tensors, (list, tuple)) or len(tensors) != 1:
            raise ValueError(f"accl: {what} takes exactly one tensor per call, got {len(tensors)}")
        t = tensors[0]
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"accl: {what} expects a torch.Tensor, got {type(t).__name__}")
        if t.is_sparse:
            raise TypeError(f"accl: {what} does not support sparse tensors")
        return t


class ProcessGroupACCL(dist.ProcessGroup):
    """A process group whose collectives run on an MPI communicator (or an ACCL engine)."""

    def __init__(self, comm: MPI.Comm, rank: int, size: int, timeout: timedelta,
                 options: AcclOptions | None = None, group_name: str = ""):
        super().__init__(rank, size)
        if comm.Get_rank() != rank or comm.Get_size() != size:
            raise RuntimeError(f"accl: MPI communicator is rank {comm.Get_rank()} of {comm.Get_size()} "
                               f"but torch expects rank {rank} of {size}")
        self.options = options if options is not None else AcclOptions()
        self._rank = rank
        self._size = size
        self._timeout_s = timeout.total_seconds() if timeout is not None else 1800.0
        self._mpi = MpiEngine(comm)
        self._ctl = comm.Dup()
        self._engine: CollectiveEngine = self._mpi
        if self.options.engine == "accl":
            from .accl_engine import AcclEngine

            self._engine = AcclEngine(self._mpi.coll, self.options)
        self._lock = threading.Lock()
        self._queue: deque[Op] = deque()  # collectives, issue order
        self._p2p: list[Op] = []  # point-to-point ops in flight, issue order
        self._seq = 0
        self._aborted: BaseException | None = None
        self._name = group_name
        self._thread: threading.Thread | None = None
        self._wake = threading.Event()
        self._closed = False
        self._seg = self.options.max_segment_bytes
        self.stats = {"engine_calls": 0, "sidestep_calls": 0, "max_call_bytes": 0}
        # one header exchange runs at a time (collectives run in order), so two buffers serve all
        self._hdr_mine = torch.zeros(_SLOT_WORDS, dtype=torch.int64)
        self._hdr_all = torch.zeros((size, _SLOT_WORDS), dtype=torch.int64)
        self._hdr_np = self._hdr_mine.numpy()
        self._hdr_bytes = self._hdr_mine[_HDR_WORDS:].view(torch.uint8)
        self._hdr_all_bytes = self._hdr_all[:, _HDR_WORDS:].view(torch.uint8)
        self._hdr_all_np = self._hdr_all.numpy()
        self._hdr_u8 = self._hdr_np[_HDR_WORDS:].view(np.uint8)
        self._hdr_all_u8 = self._hdr_all_np[:, _HDR_WORDS:].view(np.uint8)
        n = _SLOT_WORDS * 8
        self._hdr_req_args = ([MPI.buffer.fromaddress(self._hdr_mine.data_ptr(), n), n, MPI.BYTE],
                              [MPI.buffer.fromaddress(self._hdr_all.data_ptr(), n * size), n, MPI.BYTE])

    # ----------------------------------------------------------------- identity
    def getBackendName(self) -> str:  # noqa: N802 (torch's name)
        return "accl"

    def setGroupName(self, name: str) -> None:  # noqa: N802 (torch's name; a Python PG keeps its own)
        self._name = name

    def getGroupName(self) -> str:  # noqa: N802
        return self._name

    def setGroupDesc(self, desc: str) -> None:  # noqa: N802
        self._desc = desc

    def getGroupDesc(self) -> str:  # noqa: N802
        return getattr(self, "_desc", "undefined")

    def __repr__(self) -> str:
        return f"ProcessGroupACCL(rank={self._rank}, size={self._size}, engine={self._engine.name})"

    @property
    def engine(self) -> CollectiveEngine:
        """The engine carrying out this group's collectives (``mpi`` or ``accl``)."""
        return self._engine

    # ----------------------------------------------------------------- engine choice
    def _engine_for(self, coll: str, dtype: torch.dtype | None = None, op: RedOp | None = None
                    ) -> CollectiveEngine:
        eng = self._engine
        if eng is self._mpi or eng.supports(coll, dtype, op):
            return eng
        if coll in self.options.sidestep:
            return self._mpi
        what = coll + (f" of {dtype}" if dtype is not None else "") + (f" with {op_name(op)}" if op else "")
        raise NotImplementedError(
            f"accl: the {eng.name} engine cannot do {what} and sidestep to MPI is disabled for "
            f"'{coll}' (AcclOptions.sidestep / TORCHHPC_ACCL_SIDESTEP)")

    def _call(self, eng: CollectiveEngine, fn: str, nbytes: int, *args) -> Request:
        st = self.stats
        st["engine_calls"] += 1
        if eng is not self._engine:
            st["sidestep_calls"] += 1
        if nbytes > st["max_call_bytes"]:
            st["max_call_bytes"] = nbytes
        return getattr(eng, fn)(*args)

    def _per(self, elem: int, parts: int = 1) -> int:
        """Elements per segment so that ``parts`` blocks of them fit one segment."""
        return max(1, self._seg // (elem * parts))

    # ----------------------------------------------------------------- staging
    def _stage_in(self, t: torch.Tensor, eng: CollectiveEngine, copy: bool = True) -> torch.Tensor:
        """A contiguous 1-D tensor the engine can touch: ``t`` itself when possible."""
        if t.device.type != "cpu" and not eng.accepts(t.device):
            host = torch.empty(t.numel(), dtype=t.dtype, pin_memory=torch.cuda.is_available())
            if copy:
                host.copy_(t.reshape(-1))
            return host
        return _flat(t) if copy else (t.view(-1) if t.is_contiguous() else torch.empty(
            t.numel(), dtype=t.dtype, device=t.device))

    @staticmethod
    def _stage_out(flat: torch.Tensor, t: torch.Tensor) -> None:
        if flat.data_ptr() != t.data_ptr() or flat.device != t.device or not t.is_contiguous():
            t.copy_(flat.view(t.shape))

    # ----------------------------------------------------------------- op construction
    def _new_op(self, name: str, outputs: list[torch.Tensor], p2p: bool = False) -> Op:
        if self._aborted is not None:
            raise dist.DistBackendError(f"accl: process group is aborted ({self._aborted}); "
                                        f"create a new one (or restart) to communicate again")
        op = Op(name, outputs, self._timeout_s, p2p)
        return op

    def _header(self, kind: str, dtype: torch.dtype | None, numel: int, nbytes: int,
                op: RedOp | None = None, root: int = 0, extra: int = 0) -> list[int]:
        return [_MAGIC, _KIND[kind], self._seq, _DTYPE_CODE.get(dtype, 99) if dtype is not None else 0,
                _OP_CODE.get(op, 0) if op is not None else 0, root, nbytes, numel, extra]

    def _mpi_ctl_allgather(self, mine: torch.Tensor, allh: torch.Tensor) -> Request:
        n = mine.numel() * 8
        sb = [MPI.buffer.fromaddress(mine.data_ptr(), n), n, MPI.BYTE]
        rb = [MPI.buffer.fromaddress(allh.data_ptr(), n * self._size), n, MPI.BYTE]
        return MpiRequest([self._ctl.Iallgather(sb, rb)], keep=(mine, allh))

    def _submit(self, op: Op, async_op: bool = True) -> AcclWork:
        work = AcclWork(self, op)
        done: list[Op] = []
        with self._lock:
            if self._aborted is not None:
                raise dist.DistBackendError(f"accl: process group is aborted ({self._aborted})")
            if op.p2p:
                self._p2p.append(op)
                self._start(op)
            else:
                op.seq = self._seq
                self._seq += 1
                self._queue.append(op)
                if len(self._queue) == 1:
                    self._start(op)
            done = self._progress_locked()
        self._complete(done)
        if async_op and not op.done:
            self._kick()
        return work

    # ----------------------------------------------------------------- progress
    def _start(self, op: Op) -> None:
        """Begin ``op`` (caller holds the lock); errors fail the op, never escape."""
        op.started = True
        op.deadline = now() + op.timeout_s
        try:
            if op.check is not None:
                op.stage = -1
                op.reqs = [op.check[0]()]
            else:
                self._next_stage(op, 0)
        except BaseException as exc:  # noqa: BLE001 - reported through the Work
            op.fail(_wrap(exc, op))

    def _next_stage(self, op: Op, k: int) -> None:
        while k < len(op.stages):
            op.stage = k
            op.reqs = op.stages[k]()
            if op.reqs:
                return
            k += 1
        op.stage = len(op.stages)
        op.reqs = []
        if op.finish is not None:
            op.finish()
        op.done = True

    def _advance(self, op: Op) -> None:
        """Test ``op``'s current requests; move it on when they completed."""
        try:
            reqs = op.reqs
            for r in reqs:
                if not r.test():
                    return
            if op.stage == -1:
                op.check[1]()
                self._next_stage(op, 0)
            else:
                self._next_stage(op, op.stage + 1)
        except BaseException as exc:  # noqa: BLE001
            op.fail(_wrap(exc, op))

    def _progress_locked(self) -> list[Op]:
        """Advance everything in flight; return ops that finished (futures are set outside the lock)."""
        finished: list[Op] = []
        q = self._queue
        while q:
            head = q[0]
            if not head.started:
                self._start(head)
            if not head.done:
                self._advance(head)
            if not head.done:
                if now() > head.deadline:
                    self._abort_locked(head)
                    finished.extend(self._drain_locked())
                break
            finished.append(q.popleft())
        if self._p2p:
            keep = []
            for op in self._p2p:
                if not op.done:
                    self._advance(op)
                if op.done:
                    finished.append(op)
                elif now() > op.deadline:
                    self._abort_locked(op)
                    finished.extend(self._drain_locked())
                    return finished
                else:
                    keep.append(op)
            self._p2p = keep
        return finished

    def _abort_locked(self, op: Op) -> None:
        err = AcclTimeoutError(
            f"accl: {op.describe} in group '{self._name}' (rank {self._rank} of {self._size}) did not "
            f"complete within the group timeout of {op.timeout_s:g} s: a peer rank died, hung, or did "
            f"not make the matching call. The group is aborted; later calls on it raise at once.")
        self._aborted = err
        op.fail(err)

    def _drain_locked(self) -> list[Op]:
        out = []
        for op in list(self._queue) + self._p2p:
            op.fail(self._aborted if op.error is None else op.error)
            out.append(op)
        self._queue.clear()
        self._p2p = []
        return out

    @staticmethod
    def _complete(ops: list[Op]) -> None:
        for op in ops:
            op.release()
            fut = op.future
            if fut.done():
                continue
            if op.error is not None:
                fut.set_exception(op.error)
            else:
                fut.set_result(op.outputs)

    def _poll(self) -> None:
        """One non-blocking round of progress (from ``is_completed`` or the progress thread)."""
        if not self._lock.acquire(blocking=False):
            return
        try:
            done = self._progress_locked()
        finally:
            self._lock.release()
        self._complete(done)

    def _wait(self, op: Op, timeout_s: float | None) -> None:
        limit = now() + timeout_s if timeout_s is not None else float("inf")
        spins = 0
        t_spin = None
        while not op.done:
            with self._lock:
                done = self._progress_locked()
            self._complete(done)
            if op.done:
                break
            t = now()
            if t > limit:
                raise AcclTimeoutError(f"accl: Work.wait({timeout_s:g} s) expired before {op.describe} "
                                       f"completed in group '{self._name}'")
            spins += 1
            if spins > 64:
                if t_spin is None:
                    t_spin = t
                # spin hot for a while (MPI progress happens in our Test calls), then back off
                time.sleep(0 if t - t_spin < 0.005 else 50e-6)
        if op.error is not None:
            raise op.error
        # "complete in issue order": every earlier collective is done once this one is.

    def _kick(self) -> None:
        """Make sure the progress thread runs while async work is pending."""
        if self._thread is None:
            self._thread = threading.Thread(target=_progress_loop, args=(weakref.ref(self), self._wake),
                                            name=f"accl-progress-{self._name}", daemon=True)
            self._thread.start()
        self._wake.set()

    # ----------------------------------------------------------------- lifecycle
    def shutdown(self) -> None:
        """Stop the progress thread and free communicators (pending work is failed)."""
        if self._closed:
            return
        self._closed = True
        with self._lock:
            if self._queue or self._p2p:
                if self._aborted is None:
                    self._aborted = dist.DistBackendError("accl: process group shut down")
                self._drain_locked()
        self._wake.set()
        if self._aborted is None:
            self._engine.close()
            if self._engine is not self._mpi:
                self._mpi.close()
            try:
                self._ctl.Free()
            except MPI.Exception:
                pass

    def abort(self) -> None:
        self.shutdown()

    def __del__(self) -> None:
        self._closed = True
        wake = getattr(self, "_wake", None)  # absent when __init__ failed
        if wake is not None:
            wake.set()

    # ================================================================= collectives
    def allreduce(self, tensors: list[torch.Tensor], opts=None) -> AcclWork:
        t = _Tensorish.one(tensors, "all_reduce")
        op_t = red_op_of(opts.reduceOp) if opts is not None else _R.SUM
        return self._allreduce([t], op_t, "all_reduce", _async(opts))

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts=None) -> AcclWork:
        op_t = red_op_of(opts.reduceOp) if opts is not None else _R.SUM
        if not tensors:
            raise ValueError("accl: all_reduce_coalesced needs at least one tensor")
        return self._allreduce(list(tensors), op_t, "all_reduce_coalesced", _async(opts))

    def _allreduce(self, ts: list[torch.Tensor], op_t: RedOp, kind: str, async_op: bool) -> AcclWork:
        dtype = ts[0].dtype
        for t in ts:
            if t.dtype != dtype:
                raise TypeError(f"accl: {kind} needs tensors of one dtype, got {dtype} and {t.dtype}")
            if t.device != ts[0].device:
                raise ValueError(f"accl: {kind} needs tensors on one device")
        check_reduction(dtype, op_t, kind)
        eng = self._engine_for("allreduce", dtype, op_t)
        op = self._new_op(kind, ts)
        numel = sum(t.numel() for t in ts)
        esz = ts[0].element_size()
        nbytes = numel * esz
        op.describe = lambda: f"{kind}({dtype}, {numel} elements, {op_name(op_t)}) #{op.seq}"
        p = self._size
        state: dict[str, torch.Tensor] = {}

        def gather_flat() -> torch.Tensor:
            if len(ts) == 1:
                return self._stage_in(ts[0], eng)
            return torch.cat([t.reshape(-1) for t in ts]).to("cpu" if not eng.accepts(ts[0].device)
                                                               else ts[0].device)

        def scatter_back(flat: torch.Tensor) -> None:
            if len(ts) == 1:
                self._stage_out(flat, ts[0])
                return
            off = 0
            for t in ts:
                t.copy_(flat[off: off + t.numel()].view(t.shape))
                off += t.numel()

        if self.options.check and nbytes <= _SMALL_BYTES:
            # the payload rides in the header exchange; every rank reduces the p slots itself
            single = len(ts) == 1 and ts[0].is_contiguous() and ts[0].device.type == "cpu"
            npdt = _NUMPY_DTYPE.get(dtype) if single and op_t in _NP_REDUCE else None

            def start_check() -> Request:
                flat = ts[0].view(-1) if single else gather_flat()
                state["flat"] = flat
                header = self._header(kind, dtype, numel, nbytes, op_t)
                header[_F_SEQ] = op.seq
                if npdt is not None:  # numpy: a few times cheaper than torch for tiny buffers
                    return self._fused_start_np(header, flat.numpy().view(np.uint8))
                return self._fused_start(header, flat, allh_holder=state)

            def verify() -> None:
                self._verify_rows(self._hdr_all)
                if npdt is not None:
                    vals = self._hdr_all_u8[:, :nbytes].view(npdt)
                    _NP_REDUCE[op_t](vals, axis=0, out=state["flat"].numpy())
                    if op_t == _R.AVG:
                        state["flat"].div_(p)
                    return
                vals = self._hdr_all_bytes[:, :nbytes].view(dtype) if nbytes else self._hdr_all_bytes[:, :0]
                flat = state["flat"]
                flat.copy_(_local_reduce(vals, op_t, p).view(-1))
                if not single:
                    scatter_back(flat)

            op.check = (start_check, verify)
            return self._submit(op, async_op)

        if self.options.check:
            self._add_check_lazy(op, kind, dtype, numel, nbytes, op_t)

        def stage0() -> list[Request]:
            flat = gather_flat()
            state["flat"] = flat
            per = self._per(esz)
            return [self._call(eng, "allreduce", (b - a) * esz, flat[a:b], _mpi_op(op_t))
                    for a, b in _ranges(numel, per) if b > a]

        def finish() -> None:
            flat = state["flat"]
            if op_t == _R.AVG:
                flat.div_(p)
            scatter_back(flat)

        op.stages = [stage0]
        op.finish = finish
        return self._submit(op, async_op)

    def _fused_start_np(self, header: list[int], payload: np.ndarray) -> Request:
        mine = self._hdr_np
        mine[:] = 0
        mine[: len(header)] = header
        if payload.size:
            self._hdr_u8[: payload.size] = payload
        sb, rb = self._hdr_req_args
        return MpiRequest([self._ctl.Iallgather(sb, rb)])

    def _fused_start(self, header: list[int], flat: torch.Tensor, allh_holder: dict) -> Request:
        mine = self._hdr_np
        mine[:] = 0
        mine[: len(header)] = header
        nbytes = flat.numel() * flat.element_size()
        if nbytes:
            self._hdr_bytes[:nbytes] = _as_bytes(flat if flat.device.type == "cpu" else flat.cpu())
        allh_holder["allh"] = self._hdr_all
        sb, rb = self._hdr_req_args
        return MpiRequest([self._ctl.Iallgather(sb, rb)])

    def _verify_rows(self, allh: torch.Tensor, fused: bool = False, vary_bytes: bool = False) -> None:
        h = (self._hdr_all_np if allh is self._hdr_all else allh.numpy())[:, :_HDR_WORDS]
        sub = h[:, :3] if vary_bytes else h[:, :8]  # magic, kind, seq (+ dtype, op, root, bytes, numel)
        if not (sub == sub[0]).all():
            groups: dict[str, list[int]] = {}
            for r, row in enumerate(h.tolist()):
                groups.setdefault(_describe(row), []).append(r)
            detail = "; ".join(f"rank{'s' if len(rs) > 1 else ''} {','.join(map(str, rs))}: {d}"
                               for d, rs in groups.items())
            raise AcclMismatchError(f"accl: ranks disagree on a collective in group '{self._name}' ({detail})")

    def _add_check_lazy(self, op: Op, kind: str, dtype: torch.dtype | None, numel: int, nbytes: int,
                        op_t: RedOp | None = None, root: int = 0, vary_bytes: bool = False,
                        on_verified: Callable[[torch.Tensor], None] | None = None) -> None:
        """Header exchange started when ``op`` reaches the head of the queue (its seq is known then)."""
        holder: dict[str, torch.Tensor] = {}

        def start() -> Request:
            header = self._header(kind, dtype, numel, nbytes, op_t, root)
            header[_F_SEQ] = op.seq
            return self._fused_start(header, torch.empty(0, dtype=torch.uint8), holder)

        def verify() -> None:
            self._verify_rows(holder["allh"], vary_bytes=vary_bytes)
            if on_verified is not None:
                on_verified(holder["allh"])

        op.check = (start, verify)

    # ----------------------------------------------------------------- broadcast / reduce
    def broadcast(self, tensors: list[torch.Tensor], opts=None) -> AcclWork:
        t = _Tensorish.one(tensors, "broadcast")
        root = opts.rootRank if opts is not None else 0
        self._check_root(root, "broadcast")
        if opts is not None and opts.rootTensor != 0:
            raise ValueError(f"accl: broadcast rootTensor must be 0, got {opts.rootTensor}")
        eng = self._engine_for("broadcast", t.dtype)
        op = self._new_op("broadcast", [t])
        esz, numel = t.element_size(), t.numel()
        op.describe = lambda: f"broadcast({t.dtype}, {numel} elements, root {root}) #{op.seq}"
        if self.options.check:
            self._add_check_lazy(op, "broadcast", t.dtype, numel, numel * esz, None, root)
        state: dict[str, torch.Tensor] = {}

        def stage0() -> list[Request]:
            flat = self._stage_in(t, eng, copy=(self._rank == root))
            state["flat"] = flat
            per = self._per(esz)
            return [self._call(eng, "broadcast", (b - a) * esz, flat[a:b], root)
                    for a, b in _ranges(numel, per) if b > a]

        def finish() -> None:
            if self._rank != root:
                self._stage_out(state["flat"], t)

        op.stages, op.finish = [stage0], finish
        return self._submit(op, _async(opts))

    def reduce(self, tensors: list[torch.Tensor], opts=None) -> AcclWork:
        t = _Tensorish.one(tensors, "reduce")
        root = opts.rootRank if opts is not None else 0
        op_t = red_op_of(opts.reduceOp) if opts is not None else _R.SUM
        self._check_root(root, "reduce")
        check_reduction(t.dtype, op_t, "reduce")
        eng = self._engine_for("reduce", t.dtype, op_t)
        op = self._new_op("reduce", [t])
        esz, numel = t.element_size(), t.numel()
        op.describe = lambda: f"reduce({t.dtype}, {numel} elements, {op_name(op_t)}, root {root}) #{op.seq}"
        if self.options.check:
            self._add_check_lazy(op, "reduce", t.dtype, numel, numel * esz, op_t, root)
        state: dict[str, torch.Tensor] = {}

        def stage0() -> list[Request]:
            flat = self._stage_in(t, eng)
            if flat.data_ptr() == t.data_ptr() and self._rank != root:
                flat = flat.clone()  # MPI may use non-root send buffers as scratch? keep input intact
            state["flat"] = flat
            per = self._per(esz)
            return [self._call(eng, "reduce", (b - a) * esz, flat[a:b], _mpi_op(op_t), root)
                    for a, b in _ranges(numel, per) if b > a]

        def finish() -> None:
            if self._rank == root:
                flat = state["flat"]
                if op_t == _R.AVG:
                    flat.div_(self._size)
                self._stage_out(flat, t)

        op.stages, op.finish = [stage0], finish
        return self._submit(op, _async(opts))

    # ----------------------------------------------------------------- gathers
    def _gather_like(self, kind: str, inp: torch.Tensor, out_rows: Callable[[], torch.Tensor | None],
                     deliver: Callable[[torch.Tensor], None] | None, root: int, outputs: list,
                     async_op: bool) -> AcclWork:
        """all_gather / gather: ``out_rows()`` gives the [p, n] destination (None off-root for gather)."""
        coll = "allgather" if kind == "all_gather" else "gather"
        eng = self._engine_for(coll, inp.dtype)
        op = self._new_op(kind, outputs)
        esz, numel, p = inp.element_size(), inp.numel(), self._size
        op.describe = lambda: f"{kind}({inp.dtype}, {numel} elements per rank) #{op.seq}"
        if self.options.check:
            self._add_check_lazy(op, kind, inp.dtype, numel, numel * esz, None, root)
        state: dict = {}

        def stage0() -> list[Request]:
            src = self._stage_in(inp, eng)
            dst = out_rows()
            state["dst"] = dst
            per = self._per(esz, p)
            reqs = []
            for a, b in _ranges(numel, per):
                if b == a and numel:
                    continue
                seg_dst = dst[:, a:b] if dst is not None else None
                if kind == "all_gather":
                    reqs.append(self._call(eng, "allgather", (b - a) * esz * p, src[a:b], seg_dst))
                else:
                    reqs.append(self._call(eng, "gather", (b - a) * esz * p, src[a:b], seg_dst, root))
            return reqs

        def finish() -> None:
            if deliver is not None and state["dst"] is not None:
                deliver(state["dst"])

        op.stages, op.finish = [stage0], finish
        return self._submit(op, async_op)

    def allgather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor],
                  opts=None) -> AcclWork:
        inp = _Tensorish.one(input_tensors, "all_gather")
        if len(output_tensors) != 1:
            raise ValueError(f"accl: all_gather takes one output list, got {len(output_tensors)}")
        outs = output_tensors[0]
        self._check_list(outs, inp, "all_gather", "output_tensor_list")
        p, numel = self._size, inp.numel()

        def rows() -> torch.Tensor:
            return torch.empty((p, numel), dtype=inp.dtype, device="cpu" if inp.device.type == "cpu"
                               or not self._mpi.accepts(inp.device) else inp.device)

        def deliver(dst: torch.Tensor) -> None:
            for r, o in enumerate(outs):
                o.copy_(dst[r].view(o.shape))

        return self._gather_like("all_gather", inp, rows, deliver, 0, [outs], _async(opts))

    def allgather_coalesced(self, output_lists: list[list[torch.Tensor]], input_list: list[torch.Tensor],
                            opts=None) -> AcclWork:
        if len(output_lists) != len(input_list):
            raise ValueError("accl: all_gather_coalesced needs one output list per input tensor")
        works = [self.allgather([o], [i], opts) for o, i in zip(output_lists, input_list, strict=True)]
        return works[-1]  # collectives complete in issue order: the last one covers all

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts=None) -> AcclWork:  # noqa: A002
        p = self._size
        for name, t in (("output", output), ("input", input)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"accl: all_gather_into_tensor {name} must be a tensor")
        if output.dtype != input.dtype:
            raise TypeError(f"accl: all_gather_into_tensor dtypes differ: output {output.dtype}, "
                            f"input {input.dtype}")
        if output.numel() != p * input.numel():
            raise ValueError(f"accl: all_gather_into_tensor output has {output.numel()} elements, needs "
                             f"world_size * input = {p} * {input.numel()} = {p * input.numel()}")
        numel = input.numel()
        direct = output.is_contiguous() and (output.device.type == "cpu" or self._mpi.accepts(output.device))

        def rows() -> torch.Tensor:
            if direct:
                return output.view(p, numel)
            return torch.empty((p, numel), dtype=input.dtype)

        def deliver(dst: torch.Tensor) -> None:
            if not direct:
                output.copy_(dst.view(output.shape))

        return self._gather_like("all_gather", input, rows, deliver, 0, [output], _async(opts))

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                    opts=None) -> AcclWork:
        if len(outputs) != len(inputs) or not inputs:
            raise ValueError("accl: all_gather_into_tensor_coalesced needs matching, non-empty lists")
        works = [self.all_gather_single(o, i, opts) for o, i in zip(outputs, inputs, strict=True)]
        return works[-1]

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def gather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor],
               opts=None) -> AcclWork:
        inp = _Tensorish.one(input_tensors, "gather")
        root = opts.rootRank if opts is not None else 0
        self._check_root(root, "gather")
        p, numel = self._size, inp.numel()
        if self._rank == root:
            if len(output_tensors) != 1:
                raise ValueError("accl: gather on the root takes one gather_list")
            outs = output_tensors[0]
            self._check_list(outs, inp, "gather", "gather_list")
        else:
            if output_tensors and any(len(x) for x in output_tensors):
                raise ValueError("accl: gather_list must be empty/None on non-root ranks")
            outs = []

        def rows() -> torch.Tensor | None:
            return torch.empty((p, numel), dtype=inp.dtype) if self._rank == root else None

        def deliver(dst: torch.Tensor) -> None:
            for r, o in enumerate(outs):
                o.copy_(dst[r].view(o.shape))

        return self._gather_like("gather", inp, rows, deliver, root, [outs] if outs else [],
                                 _async(opts))

    def scatter(self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]],
                opts=None) -> AcclWork:
        out = _Tensorish.one(output_tensors, "scatter")
        root = opts.rootRank if opts is not None else 0
        self._check_root(root, "scatter")
        p, numel, esz = self._size, out.numel(), out.element_size()
        if self._rank == root:
            if len(input_tensors) != 1:
                raise ValueError("accl: scatter on the root takes one scatter_list")
            ins = input_tensors[0]
            self._check_list(ins, out, "scatter", "scatter_list")
        else:
            if input_tensors and any(len(x) for x in input_tensors):
                raise ValueError("accl: scatter_list must be empty/None on non-root ranks")
            ins = []
        eng = self._engine_for("scatter", out.dtype)
        op = self._new_op("scatter", [out])
        op.describe = lambda: f"scatter({out.dtype}, {numel} elements per rank, root {root}) #{op.seq}"
        if self.options.check:
            self._add_check_lazy(op, "scatter", out.dtype, numel, numel * esz, None, root)
        state: dict = {}

        def stage0() -> list[Request]:
            src = torch.stack([i.reshape(-1) for i in ins]).cpu() if ins else None
            dst = self._stage_in(out, eng, copy=False)
            state["src"], state["dst"] = src, dst
            per = self._per(esz, p)
            return [self._call(eng, "scatter", (b - a) * esz * p,
                               src[:, a:b] if src is not None else None, dst[a:b], root)
                    for a, b in _ranges(numel, per) if b > a]

        def finish() -> None:
            self._stage_out(state["dst"], out)

        op.stages, op.finish = [stage0], finish
        return self._submit(op, _async(opts))

    # ----------------------------------------------------------------- reduce_scatter
    def _reduce_scatter(self, out: torch.Tensor, src_rows: Callable[[], torch.Tensor], op_t: RedOp,
                        outputs: list, async_op: bool) -> AcclWork:
        check_reduction(out.dtype, op_t, "reduce_scatter")
        eng = self._engine_for("reduce_scatter", out.dtype, op_t)
        op = self._new_op("reduce_scatter", outputs)
        p, numel, esz = self._size, out.numel(), out.element_size()
        op.describe = lambda: f"reduce_scatter({out.dtype}, {numel} elements per rank, {op_name(op_t)}) #{op.seq}"
        if self.options.check:
            self._add_check_lazy(op, "reduce_scatter", out.dtype, numel, numel * esz, op_t)
        state: dict = {}

        def stage0() -> list[Request]:
            src = src_rows()
            dst = self._stage_in(out, eng, copy=False)
            state["dst"] = dst
            per = self._per(esz, p)
            reqs = []
            for a, b in _ranges(numel, per):
                if b == a:
                    continue
                block = src[:, a:b].contiguous() if (b - a) != numel else src
                reqs.append(self._call(eng, "reduce_scatter", (b - a) * esz * p, block, dst[a:b],
                                       _mpi_op(op_t)))
            return reqs

        def finish() -> None:
            dst = state["dst"]
            if op_t == _R.AVG:
                dst.div_(p)
            self._stage_out(dst, out)

        op.stages, op.finish = [stage0], finish
        return self._submit(op, async_op)

    def reduce_scatter(self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]],
                       opts=None) -> AcclWork:
        out = _Tensorish.one(output_tensors, "reduce_scatter")
        if len(input_tensors) != 1:
            raise ValueError("accl: reduce_scatter takes one input list")
        ins = input_tensors[0]
        self._check_list(ins, out, "reduce_scatter", "input_list")
        op_t = red_op_of(opts.reduceOp) if opts is not None else _R.SUM
        return self._reduce_scatter(out, lambda: torch.stack([i.reshape(-1).cpu() for i in ins]),
                                    op_t, [out], _async(opts))

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts=None) -> AcclWork:  # noqa: A002
        p = self._size
        if output.dtype != input.dtype:
            raise TypeError(f"accl: reduce_scatter_tensor dtypes differ: output {output.dtype}, "
                            f"input {input.dtype}")
        if input.numel() != p * output.numel():
            raise ValueError(f"accl: reduce_scatter_tensor input has {input.numel()} elements, needs "
                             f"world_size * output = {p} * {output.numel()} = {p * output.numel()}")
        op_t = red_op_of(opts.reduceOp) if opts is not None else _R.SUM

        def rows() -> torch.Tensor:
            return input.reshape(p, output.numel()).contiguous().cpu()

        return self._reduce_scatter(output, rows, op_t, [output], _async(opts))

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts=None) -> AcclWork:
        if len(outputs) != len(inputs) or not inputs:
            raise ValueError("accl: reduce_scatter_tensor_coalesced needs matching, non-empty lists")
        works = [self.reduce_scatter_single(o, i, opts) for o, i in zip(outputs, inputs, strict=True)]
        return works[-1]

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    # ----------------------------------------------------------------- all_to_all
    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor,  # noqa: A002
                          output_split_sizes: list[int], input_split_sizes: list[int], opts=None) -> AcclWork:
        p = self._size
        if output.dtype != input.dtype:
            raise TypeError(f"accl: all_to_all_single dtypes differ: output {output.dtype}, input {input.dtype}")
        row_in = input[0].numel() if input.dim() > 0 and input.shape[0] else 0
        row_out = output[0].numel() if output.dim() > 0 and output.shape[0] else 0
        row = max(row_in, row_out, 1) if input.dim() > 1 or output.dim() > 1 else 1

        def splits(sizes: list[int], t: torch.Tensor, name: str) -> list[int]:
            if not sizes:
                if t.dim() == 0 or t.shape[0] % p:
                    raise ValueError(f"accl: all_to_all_single {name} dim 0 ({tuple(t.shape)}) is not "
                                     f"divisible by world_size {p}; pass split sizes")
                return [t.shape[0] // p] * p
            if len(sizes) != p:
                raise ValueError(f"accl: all_to_all_single {name}_split_sizes has {len(sizes)} entries, "
                                 f"world_size is {p}")
            if any(s < 0 for s in sizes):
                raise ValueError(f"accl: all_to_all_single {name}_split_sizes must be >= 0, got {sizes}")
            if sum(sizes) != (t.shape[0] if t.dim() else 1):
                raise ValueError(f"accl: all_to_all_single {name}_split_sizes sum to {sum(sizes)} but "
                                 f"{name} has {t.shape[0] if t.dim() else 1} rows")
            return list(sizes)

        s_in = splits(list(input_split_sizes), input, "input")
        s_out = splits(list(output_split_sizes), output, "output")
        esz = input.element_size()
        sb = [s * row * esz for s in s_in]
        rb = [s * row * esz for s in s_out]
        return self._alltoallv("all_to_all", input, output, sb, rb, [output], _async(opts))

    alltoall_base = all_to_all_single

    def alltoall(self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor],
                 opts=None) -> AcclWork:
        p = self._size
        if len(output_tensors) != p or len(input_tensors) != p:
            raise ValueError(f"accl: all_to_all needs {p} input and {p} output tensors, got "
                             f"{len(input_tensors)} and {len(output_tensors)}")
        dtype = input_tensors[0].dtype
        if any(t.dtype != dtype for t in list(input_tensors) + list(output_tensors)):
            raise TypeError("accl: all_to_all needs every tensor of one dtype")
        esz = input_tensors[0].element_size()
        send = torch.cat([t.reshape(-1).cpu() for t in input_tensors]) if p else torch.empty(0, dtype=dtype)
        recv = torch.empty(sum(t.numel() for t in output_tensors), dtype=dtype)
        sb = [t.numel() * esz for t in input_tensors]
        rb = [t.numel() * esz for t in output_tensors]

        def deliver() -> None:
            off = 0
            for t in output_tensors:
                t.copy_(recv[off: off + t.numel()].view(t.shape))
                off += t.numel()

        return self._alltoallv("all_to_all", send, recv, sb, rb, list(output_tensors), _async(opts),
                               deliver=deliver)

    def _alltoallv(self, kind: str, inp: torch.Tensor, out: torch.Tensor, sb: list[int], rb: list[int],
                   outputs: list, async_op: bool, deliver: Callable[[], None] | None = None) -> AcclWork:
        p = self._size
        eng = self._engine_for("alltoallv", inp.dtype)
        op = self._new_op(kind, outputs)
        op.describe = lambda: f"{kind}({inp.dtype}, send bytes {sb}, recv bytes {rb}) #{op.seq}"
        state: dict = {}
        seg = self._seg

        # the byte matrix (what every rank sends to every other) is always exchanged: it fixes the
        # number of segment rounds, and lets every rank check that sends match receives.
        def start_matrix() -> Request:
            mine = torch.tensor([_MAGIC, _KIND[kind], op.seq] + sb + rb, dtype=torch.int64)
            allm = torch.empty((p, 3 + 2 * p), dtype=torch.int64)
            state["allm"] = allm
            n = mine.numel() * 8
            return MpiRequest([self._ctl.Iallgather([MPI.buffer.fromaddress(mine.data_ptr(), n), n, MPI.BYTE],
                                                    [MPI.buffer.fromaddress(allm.data_ptr(), n * p), n, MPI.BYTE])], keep=(mine, allm))

        def verify_matrix() -> None:
            m = state["allm"].tolist()
            heads = {tuple(row[:3]) for row in m}
            if len(heads) != 1:
                raise AcclMismatchError(f"accl: ranks disagree on a collective in group '{self._name}': "
                                        f"rank {self._rank} called {kind} as call #{op.seq}, others "
                                        f"called something else (headers {sorted(heads)})")
            send = [row[3: 3 + p] for row in m]
            recv = [row[3 + p:] for row in m]
            bad = [(i, j) for i in range(p) for j in range(p) if send[i][j] != recv[j][i]]
            if bad:
                i, j = bad[0]
                raise AcclMismatchError(
                    f"accl: {kind} split sizes do not match across ranks: rank {i} sends {send[i][j]} bytes "
                    f"to rank {j}, which expects {recv[j][i]} bytes from it ({len(bad)} mismatched pairs)")
            state["rounds"] = max(1, math.ceil(max(max(r) for r in send) / max(1, seg // p)))

        op.check = (start_matrix, verify_matrix)
        per_pair = max(1, seg // p)

        def stage0() -> list[Request]:
            src = _as_bytes(self._stage_in(inp, eng))
            dst = _as_bytes(out) if out.is_contiguous() and out.device.type == "cpu" else torch.empty(
                out.numel() * out.element_size(), dtype=torch.uint8)
            state["dst"] = dst
            sdis = [sum(sb[:j]) for j in range(p)]
            rdis = [sum(rb[:j]) for j in range(p)]
            reqs = []
            for k in range(state["rounds"]):
                lo = k * per_pair
                sc = [max(0, min(per_pair, s - lo)) for s in sb]
                rc = [max(0, min(per_pair, r - lo)) for r in rb]
                reqs.append(self._call(eng, "alltoallv", max(sum(sc), sum(rc)), src, sc,
                                       [d + lo for d in sdis], dst, rc, [d + lo for d in rdis]))
            return reqs

        def finish() -> None:
            dst = state["dst"]
            if deliver is not None:
                deliver()
            elif dst.data_ptr() != (out.data_ptr() if out.numel() else dst.data_ptr()):
                out.copy_(dst.view(out.dtype).view(out.shape))

        op.stages, op.finish = [stage0], finish
        return self._submit(op, async_op)

    # ----------------------------------------------------------------- barrier
    def barrier(self, opts=None) -> AcclWork:
        eng = self._engine_for("barrier")
        op = self._new_op("barrier", [])
        op.describe = lambda: f"barrier #{op.seq}"
        if self.options.check:
            self._add_check_lazy(op, "barrier", None, 0, 0)
            # the header exchange is itself a full synchronisation
            op.stages = []
        else:
            op.stages = [lambda: [self._call(eng, "barrier", 0)]]
        return self._submit(op, _async(opts))

    def monitored_barrier(self, timeout: timedelta | None = None, wait_all_ranks: bool = False) -> None:
        """Barrier that names the ranks that did not arrive within ``timeout`` (rank 0 reports).

        ``dist.monitored_barrier`` itself accepts only gloo groups; call this method on the group.
        """
        secs = timeout.total_seconds() if timeout is not None else self._timeout_s
        tag = 0x7FFF0000 % (self._mpi.p2p[0].Get_attr(MPI.TAG_UB) or 32767)
        token = torch.zeros(1, dtype=torch.int64)
        p2p = self._mpi.p2p[0]
        if self._rank != 0:
            p2p.Isend([token.numpy(), MPI.INT64_T], 0, tag)
            ack = torch.zeros(1, dtype=torch.int64)
            req = p2p.Irecv([ack.numpy(), MPI.INT64_T], 0, tag + 1)
            _poll_until(req, secs, f"accl: monitored_barrier: rank {self._rank} got no release from rank 0 "
                                   f"within {secs:g} s")
            return
        bufs = {r: torch.zeros(1, dtype=torch.int64) for r in range(1, self._size)}
        reqs = {r: p2p.Irecv([bufs[r].numpy(), MPI.INT64_T], r, tag) for r in bufs}
        limit = now() + secs
        missing = set(reqs)
        while missing and now() < limit:
            for r in list(missing):
                if reqs[r].Test():
                    missing.discard(r)
            if missing and not wait_all_ranks and now() >= limit:
                break
            time.sleep(0)
        if missing:
            for r in missing:  # withdraw the receives so that no later message matches them
                reqs[r].Cancel()
                reqs[r].Wait()
            raise AcclTimeoutError(f"accl: monitored_barrier: ranks {sorted(missing)} did not reach the "
                                   f"barrier within {secs:g} s")
        for r in bufs:
            p2p.Send([token.numpy(), MPI.INT64_T], r, tag + 1)

    # ----------------------------------------------------------------- point to point
    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> AcclWork:
        t = _Tensorish.one(tensors, "send")
        self._check_peer(dst, "send", "dst")
        self._check_tag(tag)
        eng = self._engine_for("send", t.dtype)
        op = self._new_op("send", [t], p2p=True)
        esz, numel = t.element_size(), t.numel()
        nbytes = numel * esz
        op.describe = lambda: f"send({t.dtype}, {numel} elements, to {dst}, tag {tag})"
        hdr = torch.zeros(_SLOT_WORDS, dtype=torch.int64)
        hdr[:6] = torch.tensor([_MAGIC, 1, _DTYPE_CODE.get(t.dtype, 99), nbytes, numel, 0])

        def stage0() -> list[Request]:
            flat = self._stage_in(t, eng)
            if nbytes <= _SMALL_BYTES:  # header and payload in one message
                if nbytes:
                    hdr[_HDR_WORDS:].view(torch.uint8)[:nbytes] = _as_bytes(flat)
                return [self._call(self._mpi, "send", nbytes, hdr, dst, tag, 0)]
            reqs = [self._call(self._mpi, "send", 0, hdr, dst, tag, 0)]
            per = self._per(esz)
            reqs += [self._call(eng, "send", (b - a) * esz, flat[a:b], dst, tag, 1)
                     for a, b in _ranges(numel, per) if b > a]
            state_keep.append(flat)
            return reqs

        state_keep: list[torch.Tensor] = []
        op.stages = [stage0]
        return self._submit(op, True)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> AcclWork:
        t = _Tensorish.one(tensors, "recv")
        self._check_peer(src, "recv", "src")
        return self._recv(t, src, tag)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int) -> AcclWork:
        t = _Tensorish.one(tensors, "recv")
        return self._recv(t, -1, tag)

    def _recv(self, t: torch.Tensor, src: int, tag: int) -> AcclWork:
        self._check_tag(tag)
        eng = self._engine_for("recv", t.dtype)
        op = self._new_op("recv", [t], p2p=True)
        esz, numel = t.element_size(), t.numel()
        nbytes = numel * esz
        frm = "any source" if src < 0 else f"from {src}"
        op.describe = lambda: f"recv({t.dtype}, {numel} elements, {frm}, tag {tag})"
        hdr = torch.zeros(_SLOT_WORDS, dtype=torch.int64)
        state: dict = {}

        def stage_header() -> list[Request]:
            req = self._call(self._mpi, "recv", 0, hdr, src, tag, 0)
            state["hreq"] = req
            return [req]

        def stage_payload() -> list[Request]:
            peer = state["hreq"].source()
            op.source_rank = peer
            magic, _, dcode, sbytes, snumel = hdr[:5].tolist()
            if magic != _MAGIC:
                raise AcclMismatchError(f"accl: recv from rank {peer} tag {tag}: garbled message header")
            mismatch = None
            if sbytes != nbytes or dcode != _DTYPE_CODE.get(t.dtype, 99):
                mismatch = (f"accl: recv {frm} tag {tag} expects {numel} x {t.dtype} ({nbytes} bytes) but rank "
                            f"{peer} sent {snumel} x {_dtype_name(dcode)} ({sbytes} bytes)")
            state["mismatch"] = mismatch
            if sbytes <= _SMALL_BYTES:
                state["small"] = sbytes
                return []
            # receive the sender's segments, in the sender's dtype, on the engine the sender used
            # (into a scratch buffer on mismatch, so that nothing of the bad message is lost or leaks)
            sdtype = _DTYPES[dcode - 1] if 0 < dcode <= len(_DTYPES) else torch.uint8
            if mismatch:
                dst = torch.empty(sbytes // sdtype.itemsize if sdtype.itemsize else sbytes, dtype=sdtype)
                peng = self._engine_for("send", sdtype)
            else:
                dst = self._stage_in(t, eng, copy=False)
                peng = eng
            state["dst"] = dst
            per = self._per(dst.element_size())
            return [self._call(peng, "recv", (b - a) * dst.element_size(), dst[a:b], peer, tag, 1)
                    for a, b in _ranges(dst.numel(), per) if b > a]

        def finish() -> None:
            if state["mismatch"]:
                raise AcclMismatchError(state["mismatch"])
            if "small" in state:
                if nbytes:
                    flat = torch.empty(numel, dtype=t.dtype)
                    _as_bytes(flat).copy_(hdr[_HDR_WORDS:].view(torch.uint8)[:nbytes])
                    t.copy_(flat.view(t.shape))
                return
            self._stage_out(state["dst"], t)

        op.stages, op.finish = [stage_header, stage_payload], finish
        return self._submit(op, True)

    # ----------------------------------------------------------------- argument checks
    def _check_root(self, root: int, what: str) -> None:
        if not isinstance(root, int) or not 0 <= root < self._size:
            raise ValueError(f"accl: {what} root {root} is not a rank of this group (size {self._size})")

    def _check_peer(self, peer: int, what: str, name: str) -> None:
        if not isinstance(peer, int) or not 0 <= peer < self._size:
            raise ValueError(f"accl: {what} {name}={peer} is not a rank of this group (size {self._size})")

    def _check_tag(self, tag: int) -> None:
        ub = _tag_ub()
        if not isinstance(tag, int) or not 0 <= tag <= ub:
            raise ValueError(f"accl: tag {tag} out of range [0, {ub}] (MPI_TAG_UB)")

    def _check_list(self, lst: Sequence[torch.Tensor], ref: torch.Tensor, what: str, name: str) -> None:
        if len(lst) != self._size:
            raise ValueError(f"accl: {what} {name} has {len(lst)} tensors, world_size is {self._size}")
        for i, x in enumerate(lst):
            if x.dtype != ref.dtype:
                raise TypeError(f"accl: {what} {name}[{i}] is {x.dtype}, expected {ref.dtype}")
            if x.numel() != ref.numel():
                raise ValueError(f"accl: {what} {name}[{i}] has {x.numel()} elements, expected {ref.numel()} "
                                 f"(all ranks' tensors must have the same size)")


# --------------------------------------------------------------------- helpers
def _async(opts: object) -> bool:
    return bool(getattr(opts, "asyncOp", True)) if opts is not None else True


def _mpi_op(op_t: RedOp) -> RedOp:
    """AVG runs as SUM on the engine; the group divides afterwards."""
    return _R.SUM if op_t == _R.AVG else op_t


def _local_reduce(vals: torch.Tensor, op_t: RedOp, p: int) -> torch.Tensor:
    """Reduce a [p, n] block over ranks; every rank runs the same kernel on the same data, so all
    ranks get the same bits."""
    if vals.dtype == torch.bool:
        if op_t in (_R.SUM, _R.MAX, _R.BOR):
            return vals.any(0)
        if op_t in (_R.PRODUCT, _R.MIN, _R.BAND):
            return vals.all(0)
        return vals.sum(0, dtype=torch.int64).remainder_(2).bool()
    if op_t == _R.SUM:
        return vals.sum(0, dtype=vals.dtype)
    if op_t == _R.AVG:
        return vals.sum(0, dtype=vals.dtype).div_(p)
    if op_t == _R.PRODUCT:
        return vals.prod(0, dtype=vals.dtype)
    if op_t == _R.MIN:
        return vals.amin(0)
    if op_t == _R.MAX:
        return vals.amax(0)
    fn = {_R.BAND: torch.bitwise_and, _R.BOR: torch.bitwise_or}.get(op_t, torch.bitwise_xor)
    acc = vals[0]
    for r in range(1, p):
        acc = fn(acc, vals[r])
    return acc


def _tag_ub() -> int:
    ub = MPI.COMM_WORLD.Get_attr(MPI.TAG_UB)
    return int(ub) if ub else 32767


def _wrap(exc: BaseException, op: Op) -> BaseException:
    if isinstance(exc, MPI.Exception):
        return dist.DistBackendError(f"accl: MPI error during {op.describe}: {exc.Get_error_string()}")
    return exc


def _poll_until(req: MPI.Request, secs: float, message: str) -> None:
    limit = now() + secs
    while not req.Test():
        if now() > limit:
            raise AcclTimeoutError(message)
        time.sleep(0)


def _progress_loop(pg_ref: weakref.ref, wake: threading.Event) -> None:
    """Drive async work of one group while nobody waits on it; exits with the group."""
    while True:
        wake.wait()
        pg = pg_ref()
        if pg is None or pg._closed:
            return
        interval = pg.options.progress_interval_us * 1e-6
        idle = not (pg._queue or pg._p2p)
        if idle:
            wake.clear()
            if pg._queue or pg._p2p:  # raced with a submit
                wake.set()
            del pg
            continue
        del pg
        time.sleep(interval)
        pg = pg_ref()
        if pg is None or pg._closed:
            return
        pg._poll()
        del pg

