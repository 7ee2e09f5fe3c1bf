"""Operations in flight and the ``Work`` objects torch sees.

An :class:`Op` is the progress of one queued plan (one ``all_reduce``, one ``send``...): its call
number, current stage, requests, deadline, outcome and future.  The executor (:mod:`.executor`)
advances it; :class:`AcclWork` is the handle torch gets.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.futures import Future

from ..errors import MismatchError, PeerFailedError, PeerTimeoutError
from .engine import Request

if TYPE_CHECKING:
    from .executor import Executor
    from .plans import Plan

__all__ = ["Op", "AcclWork", "AcclTimeoutError", "AcclPeerFailedError", "AcclMismatchError"]

# Old names of torchhpc.errors' classes, kept importable from here: an operation did not complete within
# the group's timeout; MPI reported that peer processes of the group died (the group is aborted); ranks
# called a collective with different arguments.
AcclTimeoutError = PeerTimeoutError
AcclPeerFailedError = PeerFailedError
AcclMismatchError = MismatchError


class Op:
    """A queued (or failed inline) plan's progress; only the owning executor touches it, under its lock."""

    __slots__ = ("plan", "seq", "reqs", "stage", "done", "error", "deadline", "started", "_future", "p2p",
                 "inline_in", "timeout_s")

    def __init__(self, plan: Plan, timeout_s: float, p2p: bool = False, seq: int = -1):
        self.plan = plan
        self.seq = seq
        self.reqs: list[Request] = []
        self.stage = -2  # -2 not started, -1 header exchange, k running stage k
        self.done = False
        self.error: BaseException | None = None
        self.deadline = float("inf")
        self.started = False
        self._future: Future | None = None  # made on demand: most callers only wait()
        self.p2p = p2p
        self.inline_in = 0  # thread id of the synchronous caller (it may make blocking calls itself)
        self.timeout_s = timeout_s

    @property
    def describe(self) -> str:
        """Human description for errors (built lazily: formatting costs more than a small collective)."""
        return self.plan.describe(self.seq)

    @property
    def outputs(self) -> list:
        return self.plan.outputs

    @property
    def source_rank(self) -> int:
        return self.plan.source_rank

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
        """Drop the finished op's requests (and the buffers they keep alive)."""
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

    def __init__(self, ex: Executor, op: Op):
        super().__init__()
        self._ex = ex
        self._op = op

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Block until this operation (and every collective issued before it) completed; raise its error."""
        self._ex.wait(self._op, _seconds(timeout))
        return True

    def is_completed(self) -> bool:
        """Non-blocking: True once finished (successfully or not); also advances pending operations."""
        if not self._op.done:
            self._ex.poll()
        return self._op.done

    def is_success(self) -> bool:
        if not self._op.done:
            self._ex.poll()
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


