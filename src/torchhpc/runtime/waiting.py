"""The one way torchhpc waits on peers: poll with a deadline under one back-off policy, and agree on errors.

MPI's blocking calls have no timeout, so every wait on other ranks in the package is a nonblocking
operation polled here against a deadline; past it a :class:`~torchhpc.runtime.errors.PeerTimeoutError` says
what was waited for.  The back-off (:class:`Backoff`) spins a few polls (a peer is often about to
arrive), then yields the core (ranks are often oversubscribed), then sleeps with a growing interval,
capped, so that a long wait does not burn a core.

:func:`agreed` makes a collective entry point fail on every rank when it fails on one: each rank
contributes "ok" or its exception; if any failed, the others raise :class:`~torchhpc.runtime.errors.RemoteError`
naming the rank and its error (the failing rank re-raises its own), all within a deadline.
:func:`barrier` is the one deadline barrier: a collective step that must know every rank has arrived
(before blocking MPI calls, or before freeing shared memory) starts with it.
"""

from __future__ import annotations

import builtins
import datetime
import functools
import os
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from .errors import PeerTimeoutError, RemoteError, TorchhpcError

__all__ = ["Backoff", "wait_until", "wait_requests", "barrier", "allgather_bytes", "allgather_object", "agree",
           "agreed", "ABANDONED", "wait_works"]

# Requests given up at a deadline, with their buffers.  MPI may still complete them (a late peer writes
# into a receive buffer; a nonblocking collective must never be freed or cancelled), so both stay
# referenced for the life of the process.
ABANDONED: list[tuple[list[Any], Any]] = []

_yield = getattr(os, "sched_yield", lambda: time.sleep(0))


class Backoff:
    """Pause between polls: ``SPINS`` polls back to back, then yield the core until ``YIELD_S`` has
    passed, then sleep from ``SLEEP_S`` doubling up to ``CAP_S``.  One object per wait.  The one policy: accl's
    C++ waits are compiled with these numbers (``torchhpc.accl.corebuild``), spinning longer where asked."""

    SPINS = 64
    YIELD_S = 0.02
    SLEEP_S = 50e-6
    CAP_S = 1e-3
    __slots__ = ("_n", "_t0", "_sleep")

    def __init__(self) -> None:
        self._n = 0
        self._t0 = 0.0
        self._sleep = self.SLEEP_S

    def pause(self) -> float:
        """Pause once; returns 0.0 while still spinning, else the monotonic time read (for deadline checks)."""
        self._n += 1
        if self._n <= self.SPINS:
            return 0.0
        t = time.monotonic()
        if not self._t0:
            self._t0 = t
        if t - self._t0 < self.YIELD_S:
            _yield()
        else:
            time.sleep(self._sleep)
            self._sleep = min(self._sleep * 2, self.CAP_S)
        return t


def _timeout_message(what: str | Callable[[], str], timeout: float) -> str:
    text = what() if callable(what) else what
    return (f"{text} did not complete within {timeout:g} s: a peer rank died, is stuck, or did not make "
            "the same call")


def wait_until(test: Callable[[], bool], timeout: float, what: str | Callable[[], str]) -> None:
    """Poll ``test`` until it returns true; past ``timeout`` seconds raise :class:`PeerTimeoutError`.

    ``what`` names the operation in the error (a callable is evaluated only on timeout)."""
    if test():
        return
    deadline = time.monotonic() + timeout
    backoff = Backoff()
    while not test():
        t = backoff.pause()
        if t and t > deadline:
            raise PeerTimeoutError(_timeout_message(what, timeout))


def wait_requests(requests: Sequence[Any], timeout: float, what: str | Callable[[], str], *,
                  keep: Any = None, cancel: bool = False, message: Callable[[], str] | None = None) -> None:
    """Complete MPI ``requests`` or raise :class:`PeerTimeoutError` after ``timeout`` s.

    Given-up requests stay alive in :data:`ABANDONED` with ``keep`` (their buffers); ``cancel`` cancels
    them first (point-to-point receives only: MPI forbids cancelling collectives).  ``message``, if
    given, builds the whole error text instead of the default built from ``what``."""
    from mpi4py import MPI

    reqs = list(requests)
    if not reqs or MPI.Request.Testall(reqs):
        return
    deadline = time.monotonic() + timeout
    backoff = Backoff()
    while not MPI.Request.Testall(reqs):
        t = backoff.pause()
        if t and t > deadline:
            text = message() if message is not None else _timeout_message(what, timeout)  # before Cancel
            pending = [r for r in reqs if r != MPI.REQUEST_NULL]
            if cancel:
                for req in pending:
                    req.Cancel()
            ABANDONED.append((pending, keep))
            raise PeerTimeoutError(text, pending)


def wait_works(works: Sequence[Any], timeout: float, what: str) -> None:
    """Complete torch.distributed ``works`` within ``timeout`` s in all, else :class:`PeerTimeoutError`.

    Each waits through the backend's own deadline (gloo's send and receive requests report completion only
    to it); given-up works stay alive in :data:`ABANDONED`."""
    deadline = time.monotonic() + timeout
    for i, work in enumerate(works):
        left = max(deadline - time.monotonic(), 0.001)
        try:
            work.wait(timeout=datetime.timedelta(seconds=left))
        except RuntimeError as exc:
            if isinstance(exc, TorchhpcError) or time.monotonic() < deadline:
                raise
            ABANDONED.append((list(works[i:]), None))
            raise PeerTimeoutError(f"{what} did not complete within {timeout:g} s: the peer rank died, is stuck, "
                                   f"or did not make the same call ({exc})", list(works[i:])) from None


def barrier(comm: Any, timeout: float, what: str, message: Callable[[], str] | None = None) -> None:
    """Collective over ``comm``: return once every rank has called it, else :class:`PeerTimeoutError` after
    ``timeout`` s naming ``what`` (``message``, if given, builds the whole text: a subpackage's own wording)."""
    size = comm.Get_size()
    if size > 1:
        wait_requests([comm.Ibarrier()], timeout,
                      f"{what} is collective over {size} ranks and every rank must call it", message=message)


def _rank_label(comm: Any) -> str:
    from mpi4py import MPI

    rank, world = comm.Get_rank(), MPI.COMM_WORLD
    if comm.Get_size() == world.Get_size() and rank == world.Get_rank():
        return f"rank {rank}"
    return f"rank {rank} (world rank {world.Get_rank()})"


def allgather_bytes(comm: Any, payload: bytes, timeout: float, what: str,
                    message: Callable[[], str] | None = None) -> list[bytes]:
    """Collective over ``comm``: every rank's ``payload``, in rank order, or :class:`PeerTimeoutError` after
    ``timeout`` s naming ``what`` (``message``, if given, builds the whole text).  When every payload is
    empty this is one small exchange."""
    import numpy as np
    from mpi4py import MPI

    size = comm.Get_size()
    lengths = np.zeros(size, dtype=np.int64)
    mine = np.array([len(payload)], dtype=np.int64)
    wait_requests([comm.Iallgather([mine, MPI.INT64_T], [lengths, MPI.INT64_T])], timeout, what,
                  keep=(mine, lengths), message=message)
    if not lengths.any():
        return [b""] * size
    displs = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    texts = bytearray(int(lengths.sum()))
    send = bytearray(payload)
    wait_requests([comm.Iallgatherv([send, MPI.BYTE], [texts, (lengths, displs), MPI.BYTE])], timeout, what,
                  keep=(send, texts), message=message)
    return [bytes(texts[d:d + n]) for d, n in zip(displs.tolist(), lengths.tolist(), strict=True)]


def allgather_object(comm: Any, obj: Any, timeout: float, what: str) -> list[Any]:
    """Collective over ``comm``: every rank's picklable ``obj``, in rank order, within ``timeout`` s."""
    import pickle

    hint = f"{what} is collective over {comm.Get_size()} ranks and every rank must call it"
    parts = allgather_bytes(comm, pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), timeout, hint)
    return [pickle.loads(p) for p in parts]


@functools.cache
def _remote_error_class(type_name: str) -> type[RemoteError]:
    """:class:`RemoteError` that is also the builtin exception class ``type_name`` (when one exists and mixes)."""
    base = getattr(builtins, type_name, None)
    if not (isinstance(base, type) and issubclass(base, Exception)) or issubclass(RemoteError, base):
        return RemoteError
    try:
        return type(f"Remote{type_name}", (RemoteError, base), {"__module__": __name__})
    except TypeError:  # an incompatible layout (e.g. OSError's): the plain family error
        return RemoteError


def agree(comm: Any, error: BaseException | None, timeout: float, what: str,
          message: Callable[[], str] | None = None, *, keep_type: bool = False) -> None:
    """Collective over ``comm``: each rank passes ``None`` (ok) or its exception.

    If another rank failed, raise :class:`RemoteError` naming it and its error (with ``keep_type``, one
    that is also an instance of the first failing rank's exception class when that is a builtin one, so
    that ``except ValueError`` catches it on every rank).  A rank that failed itself returns (its caller
    re-raises its own error, with a note naming any other failing ranks).  Raises
    :class:`PeerTimeoutError` (only on ranks that did not fail) if the ranks do not all arrive within
    ``timeout`` s; ``message``, if given, builds its text (a subpackage's own wording)."""
    size = comm.Get_size()
    if size == 1:
        return
    payload = b"" if error is None else (
        f"{_rank_label(comm)}\0{type(error).__name__}: {error}".encode(errors="replace")[:4000])
    hint = (f"{what} is collective over {size} ranks: every rank must call it; "
            f"rank {comm.Get_rank()} waited for the others to report success or failure")
    try:
        texts = allgather_bytes(comm, payload, timeout, hint, message)
    except PeerTimeoutError:
        if error is not None:
            return  # the caller's own error says more than the missing peers
        raise
    failures: dict[int, str] = {}
    for r, raw in enumerate(texts):
        if raw:
            label, _, text = raw.decode(errors="replace").partition("\0")
            failures[r] = f"{label}: {text}"
    if not failures:
        return
    me = comm.Get_rank()
    others = {r: t for r, t in failures.items() if r != me}
    if error is not None:
        if others and hasattr(error, "add_note"):
            error.add_note(f"{what}: other ranks failed too: " + "; ".join(others.values()))
        return
    first = min(others)
    listing = "; ".join(others.values())
    cls = _remote_error_class(others[first].split(": ", 2)[1]) if keep_type else RemoteError
    raise cls(f"{what} failed on {len(others)} of {size} ranks ({listing}); "
                      f"{_rank_label(comm)} stops too", first, others[first], others)


@contextmanager
def agreed(comm: Any, timeout: float, what: str, message: Callable[[], str] | None = None, *,
           keep_type: bool = False) -> Iterator[None]:
    """Run the ``with`` body, then :func:`agree` over ``comm``: an exception on any rank becomes one on all."""
    try:
        yield
    except Exception as exc:
        agree(comm, exc, timeout, what, message, keep_type=keep_type)
        raise
    agree(comm, None, timeout, what, message, keep_type=keep_type)
