"""``ProcessGroupACCL``: the torch.distributed process group behind the ``"accl"`` backend.

Responsibilities, in order of a call's life:

1. **Arguments** are checked on the calling rank (tensor counts, dtypes, sizes, roots, tags,
   op/dtype pairs) and raise ``ValueError``/``TypeError`` naming the problem.
2. **Ordering**: collectives are queued and run one after another in issue order (so an op may
   safely consume the previous op's output, as on a CUDA stream); point-to-point ops start at once.
   A synchronous call on an idle group skips the queue and runs in the caller's thread
   (:mod:`.fastpath`), with the same MPI calls, so ranks taking either path still match.
3. **Consistency**: unless ``AcclOptions.check`` is off, each collective first all-gathers a
   fixed-size header slot (kind, call number, dtype, op, root, sizes) with one persistent request;
   a mismatch raises the same clear error on every rank and leaves the group usable.  Small
   all-reduces carry their payload inside that header exchange and are reduced locally in rank
   order, so checking them costs nothing extra.  After a header, data move by MPI's blocking
   (tuned) collectives: the header proved that every rank is in the call.
4. **Segmentation**: data move in segments of at most ``max_segment_bytes`` per buffer and per
   engine call, whatever the tensor's shape.
5. **Completion**: ``Work.wait()`` polls with a deadline (the group timeout); async work nobody
   waits on is driven by a progress thread.  A timeout aborts the group (MPI cannot cancel a
   collective): later calls raise at once.
"""


from __future__ import annotations

import contextlib
import threading
import time
import weakref
from collections import deque
from collections.abc import Sequence
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from mpi4py import MPI
from mpi4py.run import set_abort_status

from ..waiting import Backoff
from .collectives import CollectivesMixin
from .common import (
    _DTYPE_CODE,
    _HDR_WORDS,
    _KIND,
    _MAGIC,
    _OP_CODE,
    _SLOT_WORDS,
    _flat,
    _tag_ub,
    _wrap,
)
from .engine import CollectiveEngine, Request
from .fastpath import FastPathMixin
from .mpi_engine import MpiEngine
from .options import AcclOptions
from .p2p import PointToPointMixin
from .reduction import RedOp, op_name
from .work import AcclPeerFailedError, AcclTimeoutError, AcclWork, Op, now

__all__ = ["ProcessGroupACCL"]

# MPI error classes meaning "a peer process died" (ULFM, standard in MPI 5; absent names are skipped)
_PEER_FAILED = frozenset(getattr(MPI, n) for n in ("ERR_PROC_FAILED", "ERR_PROC_FAILED_PENDING", "ERR_REVOKED")
                         if hasattr(MPI, n))


class ProcessGroupACCL(FastPathMixin, CollectivesMixin, PointToPointMixin, dist.ProcessGroup):
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
        self._big = self.options.threaded_min_bytes
        self.stats = {"engine_calls": 0, "sidestep_calls": 0, "max_call_bytes": 0}
        self._unchecked_one_call = min(self._seg, self._big - 1)  # unchecked: no header up to this size
        # one header exchange runs at a time (collectives run in order), so two buffers serve all
        self._init_header()
        self._hdr_np = np.frombuffer(self._hdr_buf, dtype=np.int64)
        self._hdr_all_np = np.frombuffer(self._hdr_all_buf, dtype=np.int64).reshape(size, _SLOT_WORDS)
        self._hdr_mine = torch.frombuffer(self._hdr_buf, dtype=torch.int64)
        self._hdr_all = torch.frombuffer(self._hdr_all_buf, dtype=torch.int64).view(size, _SLOT_WORDS)
        self._hdr_bytes = self._hdr_mine[_HDR_WORDS:].view(torch.uint8)
        self._hdr_all_bytes = self._hdr_all[:, _HDR_WORDS:].view(torch.uint8)

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
                if not async_op:
                    op.inline_in = threading.get_ident()
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
            self._fail(op, exc)

    def _next_stage(self, op: Op, k: int) -> None:
        while k < len(op.stages):
            op.stage = k
            # MPI's blocking (tuned) algorithms beat the nonblocking ones, and once the header exchange
            # proved that every rank is in this call they cannot wait on a missing peer: after a header
            # the data moves by blocking calls (big async ones on the worker thread, the rest by whoever
            # advances the op), exactly as on the synchronous fast path, so that ranks taking either
            # path make matching MPI calls. Without a header, small ops run nonblocking.
            if op.check is not None:
                self._mpi.threaded = ("worker" if op.big and op.inline_in != threading.get_ident()
                                      else "inline")
            elif op.big:
                self._mpi.threaded = "worker"
            try:
                op.reqs = op.stages[k]()
            finally:
                self._mpi.threaded = False
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
            self._fail(op, exc)

    def _fail(self, op: Op, exc: BaseException) -> None:
        """Fail ``op`` with ``exc`` (caller holds the lock).  A dead peer also aborts the group: its
        collectives can never complete, so the pending ones are failed by the caller's next drain."""
        if isinstance(exc, MPI.Exception) and exc.Get_error_class() in _PEER_FAILED:
            err = self._peer_failure(op, exc)
            if self._aborted is None:
                self._aborted = err
            op.fail(err)
            return
        op.fail(_wrap(exc, op))

    def _peer_failure(self, op: Op, exc: MPI.Exception) -> AcclPeerFailedError:
        """The error for a peer death that MPI reported during ``op``; revokes the group's communicators
        so that every survivor's pending and next calls on them fail at once instead of waiting."""
        comms = (self._mpi.coll, self._ctl, *self._mpi.p2p)
        for comm in comms:
            with contextlib.suppress(MPI.Exception, NotImplementedError):
                comm.Revoke()
        # A rank told only by a revocation may learn who died from the runtime's notice a moment later.
        limit = now() + (0.25 if exc.Get_error_class() == getattr(MPI, "ERR_REVOKED", None) else 0.0)
        pause = Backoff().pause
        while not (ranks := _failed_ranks(comms)) and now() < limit:
            pause()
        # MPI_Finalize would wait for the dead rank forever: end this process with MPI_Abort at exit instead.
        set_abort_status(1)
        who = (f"peer rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}" if ranks
               else "a peer rank (a survivor revoked the group after seeing it die)")
        return AcclPeerFailedError(
            f"accl: {who} of group '{self._name}' died during {op.describe} on rank {self._rank} of "
            f"{self._size} (MPI: {exc.Get_error_string()}). The group is aborted; later calls on it raise "
            f"at once. Restart the job (e.g. from a checkpoint) or rebuild the group from the survivors.",
            ranks)

    def _progress_locked(self) -> list[Op]:
        """Advance everything in flight; return ops that finished (futures are set outside the lock)."""
        finished: list[Op] = []
        q = self._queue
        while q:
            if self._aborted is not None:  # a peer died: nothing queued can complete
                finished.extend(self._drain_locked())
                return finished
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
            if self._aborted is not None and keep:
                finished.extend(self._drain_locked())
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
            op.settle()

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
        pause = Backoff().pause  # spin hot first (MPI progresses inside our Test calls), then back off
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
            head = self._head()
            blocker = next((r for r in head.reqs if hasattr(r, "block")), None) if head is not None else None
            if blocker is not None:  # a blocking MPI call on the worker: sleep on it (GIL released)
                blocker.block(min(0.005, max(0.0, limit - t)))
                continue
            pause()
        if op.error is not None:
            raise op.error
        # "complete in issue order": every earlier collective is done once this one is.

    def _head(self) -> Op | None:
        q = self._queue
        return q[0] if q else None

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
            if self._hdr_preq is not None:
                with contextlib.suppress(MPI.Exception):
                    self._hdr_preq.Free()
            self._engine.close()
            if self._engine is not self._mpi:
                self._mpi.close()
            with contextlib.suppress(MPI.Exception):
                self._ctl.Free()

    def abort(self) -> None:
        self.shutdown()

    def __del__(self) -> None:
        self._closed = True
        wake = getattr(self, "_wake", None)  # absent when __init__ failed
        if wake is not None:
            wake.set()

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


def _failed_ranks(comms: Sequence[MPI.Comm]) -> tuple[int, ...]:
    """Ranks (in these communicators' common group) that MPI knows to have died; () if none or unknown."""
    failed: set[int] = set()
    for comm in comms:
        with contextlib.suppress(MPI.Exception, NotImplementedError):
            grp, mine = comm.Get_failed(), comm.Get_group()
            failed.update(r for r in MPI.Group.Translate_ranks(grp, list(range(grp.Get_size())), mine)
                          if r >= 0)
            grp.Free()
            mine.Free()
    return tuple(sorted(failed))


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


