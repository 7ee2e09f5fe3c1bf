"""The one executor of accl plans: ordering, header exchange, engine calls, completion, failures.

A plan (:mod:`.plans`, :mod:`.p2p`, or one of the compiled core's calls, :mod:`.calls`) runs one of two
ways, always through the same plan methods:

- **inline** (:meth:`Executor.run_core`): a synchronous core call on an idle group runs entirely in the
  caller's thread, in the core (no ``Op``, no queue, no ``Work``: torch's wrappers take ``None`` as "the
  backend synchronised the call"), which drives the call's plan methods itself and polls the header
  exchange and nonblocking calls against the group timeout;
- **queued** (:meth:`Executor.submit`): collectives run one after another in issue order (so an op
  may consume the previous op's output, as on a CUDA stream), point-to-point ops start at once;
  whoever polls (``Work.wait()``, ``is_completed()`` or the progress thread) advances them.

The engine is told its :class:`~.engine.Mode` per call by :func:`mode_for`, from the call alone, so
every rank makes the same kind of MPI call whichever path it took: after a header exchange, which
proves that every rank is in the call, data move by MPI's blocking (tuned) collectives (on the worker
thread for large async work); without a header, small calls run nonblocking.  A timeout aborts the
group (MPI cannot cancel a collective): later calls raise at once.  A dead peer (ULFM) aborts it too,
after revoking its communicators so every survivor learns at once.
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from collections import deque
from collections.abc import Sequence

import torch.distributed as dist
from mpi4py import MPI
from mpi4py.run import set_abort_status

from ..errors import PeerFailedError, PeerTimeoutError
from ..waiting import ABANDONED, Backoff, wait_until
from . import core, wire
from .engine import CollectiveEngine, Mode, Request
from .header import HeaderExchange
from .mpi_engine import MpiEngine
from .options import AcclOptions
from .plans import Plan
from .work import AcclWork, Op

__all__ = ["Executor", "mode_for", "FALLBACK"]

#: what :meth:`Executor.run_core` returns when the group is busy: queue the call instead (the core's
#: ``run_idle`` says so with Python's own "not handled here")
FALLBACK = NotImplemented

# MPI error classes meaning "a peer process died" (ULFM, standard in MPI 5; absent names are skipped)
_PEER_FAILED = frozenset(getattr(MPI, n) for n in ("ERR_PROC_FAILED", "ERR_PROC_FAILED_PENDING", "ERR_REVOKED")
                         if hasattr(MPI, n))


def mode_for(plan: Plan, owner: bool) -> Mode:
    """How the engine carries out ``plan``'s data calls.  Blocking or not depends on the call alone
    (blocking and nonblocking MPI collectives never match); ``owner`` (the advancing thread is the
    synchronous caller) only picks the thread of a blocking call.  The core's inline run applies the same
    rule (its calls' ``inline_mode``, tested equal to this with ``owner``)."""
    if plan.header:
        return Mode.WORKER if plan.big and not owner else Mode.BLOCKING
    return Mode.WORKER if plan.big else Mode.NONBLOCKING


class Executor:
    """Runs one group's plans (see the module docstring)."""

    def __init__(self, comm: MPI.Comm, options: AcclOptions, timeout_s: float, name: str) -> None:
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.options = options
        self.timeout_s = timeout_s
        self.name = name
        self.mpi = MpiEngine(comm)
        self.ctl = comm.Dup()
        self.engine: CollectiveEngine = self.mpi
        if options.engine == "accl":
            from .accl_engine import AcclEngine

            self.engine = AcclEngine(self.mpi.coll, options)
        self.seg = options.max_segment_bytes
        self.big = options.threaded_min_bytes
        self.check = options.check  # exchange the consistency header before every collective
        #: engine calls made, calls sidestepped to MPI, the largest bytes of one call (the core counts its own)
        self.stats = {"engine_calls": 0, "sidestep_calls": 0, "max_call_bytes": 0}
        mod = core.load()
        #: the compiled core: this group's header exchange and its MPI-engine calls (:mod:`.calls`)
        self.core = mod.Group(self.mpi.coll.handle, self.ctl.handle, wire.HEADER_BYTES, wire.PAYLOAD_BYTES, wire.MAGIC,
                              self.seg, self.stats, Backoff.SPINS, Backoff.YIELD_S, Backoff.SLEEP_S, Backoff.CAP_S)
        self.core.sidestep = int(self.engine is not self.mpi)
        self.core.check, self.core.big = int(self.check), self.big
        self.core.unchecked = min(self.seg, self.big - 1)  # unchecked: no header up to this size (one call)
        self.core_call = mod.Call  #: the type of the core's calls
        self.hx = HeaderExchange(self.core, name)
        self.lock = threading.Lock()
        self.queue: deque[Op] = deque()  # collectives, issue order
        self.p2p: list[Op] = []  # point-to-point ops in flight, issue order
        self.aborted: BaseException | None = None
        self.closed = False
        self._thread: threading.Thread | None = None
        self._wake = threading.Event()

    # ------------------------------------------------------------------ what plans call
    def call(self, eng: CollectiveEngine, fn: str, nbytes: int, mode: Mode | None, *args) -> Request:
        """One engine call, accounted in ``stats`` (``mode`` None: point-to-point, always nonblocking)."""
        st = self.stats
        st["engine_calls"] += 1
        if eng is not self.engine:
            st["sidestep_calls"] += 1
        if nbytes > st["max_call_bytes"]:
            st["max_call_bytes"] = nbytes
        if mode is None:
            return getattr(eng, fn)(*args)
        return getattr(eng, fn)(*args, mode)

    def _verified(self, plan: Plan) -> None:
        """The header exchange completed: check agreement, let ``plan`` take what the slots carried.  A
        call whose data rode in the slots, on a group whose engine is not MPI, was sidestepped to MPI."""
        self.hx.check(plan.compare)
        plan.verified(self.hx)
        if plan.fused and plan.eng is not self.engine:
            self.stats["sidestep_calls"] += 1

    def per(self, elem: int, parts: int = 1) -> int:
        """Elements per segment so that ``parts`` blocks of them fit one segment."""
        return max(1, self.seg // (elem * parts))

    def header_needed(self, eng: CollectiveEngine, total_bytes: int) -> bool:
        """Whether a collective moving ``total_bytes`` exchanges the header: always when checked; on an
        unchecked MPI group by the core's rule (when it does not fit one nonblocking call: the header then
        proves that every rank arrived before the blocking calls)."""
        return self.core.flags(total_bytes)[0] if eng is self.mpi else self.check

    # ------------------------------------------------------------------ inline
    def run_core(self, call: Plan) -> AcclWork | None | object:
        """Run the compiled core's synchronous ``call`` (:mod:`.calls`) in the caller's thread, all of it in
        the core (``Group.run_idle``), if the group is idle (else FALLBACK: nothing queued or in flight,
        point-to-point included, since the core's wait cannot progress them).  Returns None on success, else
        the failed call's Work (its ``wait()`` raises), made by :meth:`inline_failed`."""
        return self.core.run_idle(call, self)

    def inline_failed(self, call: Plan, seq: int, exc: BaseException) -> AcclWork:
        """The Work of inline call ``seq`` that raised ``exc`` (called by the core, under the lock): a
        timeout aborts the group, keeping the call's buffers alive (MPI may still complete its requests
        into them); any other error fails the call as a queued one would."""
        op = Op(call, self.timeout_s, seq=seq)
        if isinstance(exc, core.Expired):
            ABANDONED.append(([call], None))
            self._abort_locked(op)
        else:
            self._fail(op, exc)
        return AcclWork(self, op)

    # ------------------------------------------------------------------ queued
    def submit(self, plan: Plan, async_op: bool = True, p2p: bool = False) -> AcclWork:
        """Queue ``plan`` (collectives in issue order; point-to-point at once) and return its Work."""
        op = Op(plan, self.timeout_s, p2p=p2p)
        work = AcclWork(self, op)
        with self.lock:
            if self.aborted is not None:
                raise dist.DistBackendError(f"accl: process group is aborted ({self.aborted}); create a new "
                                            f"one (or restart) to communicate again")
            if p2p:
                self.p2p.append(op)
                self._start(op)
            else:
                if not async_op:
                    op.inline_in = threading.get_ident()
                op.seq = self.core.seq  # (the core numbers inline calls too)
                self.core.seq = op.seq + 1
                self.queue.append(op)
                if len(self.queue) == 1:
                    self._start(op)
            done = self._progress_locked()
        self._complete(done)
        if async_op and not op.done:
            self._kick()
        return work

    def check_open(self) -> None:
        """Raise at once when the group was aborted (a call would never complete)."""
        if self.aborted is not None:
            raise dist.DistBackendError(f"accl: process group is aborted ({self.aborted}); create a new "
                                        f"one (or restart) to communicate again")

    def _start(self, op: Op) -> None:
        """Begin ``op`` (caller holds the lock); errors fail the op, never escape."""
        op.started = True
        op.deadline = time.monotonic() + op.timeout_s
        try:
            if op.plan.header:
                op.stage = -1
                op.plan.pack(self.hx, op.seq)
                self.hx.start()
                op.reqs = [_Started(self.hx)]
            else:
                self._next_stage(op, 0)
        except BaseException as exc:  # noqa: BLE001 - reported through the Work
            self._fail(op, exc)

    def _next_stage(self, op: Op, k: int) -> None:
        plan = op.plan
        mode = mode_for(plan, op.inline_in == threading.get_ident())
        while (reqs := plan.stage(k, self, mode)) is not None:
            op.stage = k
            op.reqs = reqs
            for r in reqs:
                if not r.test():
                    return
            k += 1
        op.reqs = []
        plan.finish()
        op.done = True

    def _advance(self, op: Op) -> None:
        """Test ``op``'s current requests; move it on when they completed."""
        try:
            for r in op.reqs:
                if not r.test():
                    return
            if op.stage == -1:
                self._verified(op.plan)
                self._next_stage(op, 0)
            else:
                self._next_stage(op, op.stage + 1)
        except BaseException as exc:  # noqa: BLE001
            self._fail(op, exc)

    def _progress_locked(self) -> list[Op]:
        """Advance everything in flight; return ops that finished (futures are set outside the lock)."""
        finished: list[Op] = []
        q = self.queue
        while q:
            if self.aborted is not None:  # a peer died: nothing queued can complete
                finished.extend(self._drain_locked())
                return finished
            head = q[0]
            if not head.started:
                self._start(head)
            if not head.done:
                self._advance(head)
            if not head.done:
                if time.monotonic() > head.deadline:
                    self._abort_locked(head)
                    finished.extend(self._drain_locked())
                break
            finished.append(q.popleft())
        if self.p2p:
            keep = []
            for op in self.p2p:
                if not op.done:
                    self._advance(op)
                if op.done:
                    finished.append(op)
                elif time.monotonic() > op.deadline:
                    self._abort_locked(op)
                    finished.extend(self._drain_locked())
                    return finished
                else:
                    keep.append(op)
            self.p2p = keep
            if self.aborted is not None and keep:
                finished.extend(self._drain_locked())
        return finished

    # ------------------------------------------------------------------ failures
    def _fail(self, op: Op, exc: BaseException) -> None:
        """Fail ``op`` with ``exc`` (caller holds the lock).  A dead peer also aborts the group: its
        collectives can never complete, so the pending ones are failed by the next drain."""
        if isinstance(exc, MPI.Exception) and exc.Get_error_class() in _PEER_FAILED:
            err = self._peer_failure(op, exc)
            if self.aborted is None:
                self.aborted = err
            op.fail(err)
            return
        if isinstance(exc, MPI.Exception):
            exc = dist.DistBackendError(f"accl: MPI error during {op.describe}: {exc.Get_error_string()}")
        op.fail(exc)

    def _peer_failure(self, op: Op, exc: MPI.Exception) -> PeerFailedError:
        """The error for a peer death that MPI reported during ``op``; revokes the group's communicators
        so that every survivor's pending and next calls on them fail at once instead of waiting."""
        comms = (self.mpi.coll, self.ctl, *self.mpi.p2p)
        for comm in comms:
            with contextlib.suppress(MPI.Exception, NotImplementedError):
                comm.Revoke()
        # A rank told only by a revocation may learn who died from the runtime's notice a moment later.
        ranks: tuple[int, ...] = ()
        if exc.Get_error_class() == getattr(MPI, "ERR_REVOKED", None):
            found: list[tuple[int, ...]] = []

            def known() -> bool:
                found.append(failed_ranks(comms))
                return bool(found[-1])

            with contextlib.suppress(PeerTimeoutError):
                wait_until(known, 0.25, "the failed ranks' names")
            ranks = found[-1] if found else ()
        else:
            ranks = failed_ranks(comms)
        # MPI_Finalize would wait for the dead rank forever: end this process with MPI_Abort at exit instead.
        set_abort_status(1)
        who = (f"peer rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}" if ranks
               else "a peer rank (a survivor revoked the group after seeing it die)")
        return PeerFailedError(
            f"accl: {who} of group '{self.name}' died during {op.describe} on rank {self.rank} of "
            f"{self.size} (MPI: {exc.Get_error_string()}). The group is aborted; later calls on it raise "
            f"at once. Restart the job (e.g. from a checkpoint) or rebuild the group from the survivors.",
            ranks)

    def _abort_locked(self, op: Op) -> None:
        err = PeerTimeoutError(
            f"accl: {op.describe} in group '{self.name}' (rank {self.rank} of {self.size}) did not "
            f"complete within the group timeout of {op.timeout_s:g} s: a peer rank died, hung, or did "
            f"not make the matching call. The group is aborted; later calls on it raise at once.")
        self.aborted = err
        op.fail(err)

    def _drain_locked(self) -> list[Op]:
        out = []
        for op in list(self.queue) + self.p2p:
            op.fail(self.aborted if op.error is None else op.error)
            out.append(op)
        self.queue.clear()
        self.p2p = []
        return out

    @staticmethod
    def _complete(ops: list[Op]) -> None:
        for op in ops:
            op.release()
            op.settle()

    # ------------------------------------------------------------------ completion
    def poll(self) -> None:
        """One non-blocking round of progress (from ``is_completed`` or the progress thread)."""
        if not self.lock.acquire(blocking=False):
            return
        try:
            done = self._progress_locked()
        finally:
            self.lock.release()
        self._complete(done)

    def wait(self, op: Op, timeout_s: float | None) -> None:
        """Advance work until ``op`` is done (raise its error), or ``timeout_s`` passed."""
        limit = time.monotonic() + timeout_s if timeout_s is not None else float("inf")
        pause = Backoff().pause  # spin hot first (MPI progresses inside our Test calls), then back off
        while not op.done:
            with self.lock:
                done = self._progress_locked()
            self._complete(done)
            if op.done:
                break
            t = time.monotonic()
            if t > limit:
                raise PeerTimeoutError(f"accl: Work.wait({timeout_s:g} s) expired before {op.describe} "
                                       f"completed in group '{self.name}'")
            head = self.queue[0] if self.queue else None
            blocker = next((r for r in head.reqs if hasattr(r, "block")), None) if head is not None else None
            if blocker is not None:  # a blocking MPI call on the worker: sleep on it (GIL released)
                blocker.block(min(0.005, max(0.0, limit - t)))
                continue
            pause()
        if op.error is not None:
            raise op.error
        # "complete in issue order": every earlier collective is done once this one is.

    def _kick(self) -> None:
        """Make sure the progress thread runs while async work is pending."""
        if self._thread is None:
            self._thread = threading.Thread(target=_progress_loop, args=(weakref.ref(self), self._wake),
                                            name=f"accl-progress-{self.name}", daemon=True)
            self._thread.start()
        self._wake.set()

    def idle(self) -> bool:
        """Nothing queued or in flight."""
        return not (self.queue or self.p2p)

    # ------------------------------------------------------------------ lifecycle
    def shutdown(self) -> None:
        """Stop the progress thread and free communicators (pending work is failed)."""
        if self.closed:
            return
        self.closed = True
        with self.lock:
            if self.queue or self.p2p:
                if self.aborted is None:
                    self.aborted = dist.DistBackendError("accl: process group shut down")
                self._drain_locked()
        self._wake.set()
        if self.aborted is None:
            self.hx.free()
            self.engine.close()
            if self.engine is not self.mpi:
                self.mpi.close()
            with contextlib.suppress(MPI.Exception):
                self.ctl.Free()

    def __del__(self) -> None:
        self.closed = True
        wake = getattr(self, "_wake", None)  # absent when __init__ failed
        if wake is not None:
            wake.set()


class _Started:
    """The header exchange in flight as an engine :class:`~.engine.Request`."""

    __slots__ = ("_hx",)

    def __init__(self, hx: HeaderExchange) -> None:
        self._hx = hx

    def test(self) -> bool:
        return self._hx.test()

    def source(self) -> int:
        return -1

    def nbytes(self) -> int:
        return -1


def failed_ranks(comms: Sequence[MPI.Comm]) -> tuple[int, ...]:
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


def _progress_loop(ex_ref: weakref.ref, wake: threading.Event) -> None:
    """Drive async work of one group while nobody waits on it; exits with the group."""
    while True:
        wake.wait()
        ex = ex_ref()
        if ex is None or ex.closed:
            return
        interval = ex.options.progress_interval_us * 1e-6
        if ex.idle():
            wake.clear()
            if not ex.idle():  # raced with a submit
                wake.set()
            del ex
            continue
        del ex
        time.sleep(interval)
        ex = ex_ref()
        if ex is None or ex.closed:
            return
        ex.poll()
        del ex
