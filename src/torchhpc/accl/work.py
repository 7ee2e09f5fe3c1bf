"""Operations in flight and the ``Work`` objects torch sees.

An :class:`Op` is one torch-level call (one ``all_reduce``, one ``send``...).  Collective ops run
one after another in issue order: an op first (optionally) exchanges a consistency header, then
starts all its segments at once on the engine, then runs its ``finish`` step (copy-back,
division for AVG...).  Point-to-point ops start when issued.  Whoever polls (a thread in
``Work.wait()``, or the group's progress thread for ``async_op=True`` work nobody waits on)
advances them; see :class:`~.process_group.ProcessGroupACCL`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.futures import Future

from ..errors import PeerFailedError, PeerTimeoutError
from .engine import Request

if TYPE_CHECKING:
    from .process_group import ProcessGroupACCL

__all__ = ["Op", "AcclWork", "AcclTimeoutError", "AcclPeerFailedError"]


# Old names of torchhpc.errors' classes, kept importable from here: an operation did not complete within
# the group's timeout; MPI reported that peer processes of the group died (the group is aborted).
AcclTimeoutError = PeerTimeoutError
AcclPeerFailedError = PeerFailedError


class Op:
    """State of one operation; only the owning group touches it, under the group's lock."""

    __slots__ = (
        "name", "seq", "outputs", "check", "stages", "finish", "reqs", "stage", "done", "error",
        "deadline", "started", "_future", "p2p", "big", "inline_in", "source_rank", "timeout_s", "_desc",
    )

    def __init__(self, name: str, outputs: list[torch.Tensor], timeout_s: float, p2p: bool = False):
        self.name = name
        self.seq = -1
        self.outputs = outputs
        # check: () -> Request | None, verified by finish-of-check callback (set by the group)
        self.check: tuple[Callable[[], Request], Callable[[], None]] | None = None
        # stages: list of lists of request starters; stage k starts when stage k-1 completed
        self.stages: list[Callable[[], list[Request]]] = []
        self.finish: Callable[[], None] | None = None
        self.reqs: list[Request] = []
        self.stage = -2  # -2 not started, -1 checking, k running stage k
        self.done = False
        self.error: BaseException | None = None
        self.deadline = float("inf")
        self.started = False
        self._future: Future | None = None  # made on demand: most callers only wait()
        self.p2p = p2p
        self.big = False  # large enough for the blocking (tuned) MPI algorithms on the worker thread
        self.inline_in = 0  # thread id that may run those blocking calls itself (synchronous callers)
        self.source_rank = -1
        self.timeout_s = timeout_s
        self._desc: str | Callable[[], str] = name

    @property
    def describe(self) -> str:
        """Human description for errors (built lazily: formatting costs more than a small collective)."""
        return self._desc() if callable(self._desc) else self._desc

    @describe.setter
    def describe(self, value: str | Callable[[], str]) -> None:
        self._desc = value

    @property
    def future(self) -> Future:
        """The torch future of this op, completed now if the op already finished."""
        with _future_lock:
            if self._future is None:
                self._future = Future()
            fut = self._future
            if self.done and not fut.done():
                _settle(fut, self)
        return fut

    def settle(self) -> None:
        """Complete the future, if anyone asked for it (called once the op is done)."""
        if self._future is None:
            return
        with _future_lock:
            if not self._future.done():
                _settle(self._future, self)

    def release(self) -> None:
        """Drop the closures (they refer back to this op): the op is then freed by reference counting
        instead of piling up as cyclic garbage for the (slow, with torch loaded) cycle collector."""
        self.check = None
        self.stages = []
        self.finish = None
        self._desc = self.name
        self.reqs = []

    def fail(self, error: BaseException) -> None:
        if not self.done:
            self.error = error
            self.done = True
            self.reqs = []


_future_lock = threading.Lock()


def _settle(fut: Future, op: Op) -> None:
    if op.error is not None:
        fut.set_exception(op.error)
    else:
        fut.set_result(op.outputs)


def _seconds(timeout: object) -> float | None:
    """A wait timeout from torch (timedelta, milliseconds or None); None/zero/negative means unset."""
    if timeout is None:
        return None
    if isinstance(timeout, timedelta):
        secs = timeout.total_seconds()
    else:
        secs = float(timeout) / 1000.0
    return secs if secs > 0 else None


class AcclWork(dist._Work):
    """Handle of one operation, as returned to torch (``dist.all_reduce(..., async_op=True)``)."""

    def __init__(self, pg: ProcessGroupACCL, op: Op):
        super().__init__()
        self._pg = pg
        self._op = op

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Block until this operation (and every collective issued before it) completed; raise its error."""
        self._pg._wait(self._op, _seconds(timeout))
        return True

    def is_completed(self) -> bool:
        """Non-blocking: True once finished (successfully or not); also advances pending operations."""
        if not self._op.done:
            self._pg._poll()
        return self._op.done

    def is_success(self) -> bool:
        if not self._op.done:
            self._pg._poll()
        return self._op.done and self._op.error is None

    def exception(self):
        return self._op.error

    def source_rank(self) -> int:
        if self._op.source_rank < 0:
            raise ValueError("accl: source_rank() is only defined for a completed recv from any source")
        return self._op.source_rank

    _source_rank = source_rank  # what dist.recv(src=None) calls

    def result(self) -> list[torch.Tensor]:
        self.wait()
        return self._op.outputs

    def synchronize(self) -> None:
        """CPU work has nothing to synchronize with a stream; waiting is done by ``wait()``."""

    def get_future(self) -> Future:
        """A future completed (by whoever polls, or the progress thread) with the output tensors."""
        return self._op.future

    def __repr__(self) -> str:
        state = "done" if self._op.done else "pending"
        return f"AcclWork({self._op.describe}, {state})"


def now() -> float:
    return time.monotonic()
