"""Waiting on peers with a deadline: nothing in chunkstore blocks forever on a rank that never comes.

MPI's blocking collectives have no timeout.  Each collective entry point of a ChunkTensor therefore
starts with a non-blocking barrier polled against a deadline (:func:`rendezvous`); once every rank
has arrived, the blocking steps that follow complete.  A timed-out request is kept (the ranks no
longer agree on the communicator's collective sequence, so the job should stop) and the caller
gets a :class:`~torchhpc.errors.PeerTimeoutError` (a ``TimeoutError``) saying what it waited for.
Polling is :func:`torchhpc.waiting.wait_requests`, the package's one wait.
"""

from __future__ import annotations

from mpi4py import MPI

from torchhpc.waiting import ABANDONED, wait_requests

__all__ = ["wait", "rendezvous", "ABANDONED"]


def wait(req: MPI.Request, timeout: float, what: str) -> None:
    """Complete ``req`` or raise :class:`~torchhpc.errors.PeerTimeoutError` naming ``what`` after ``timeout`` s."""
    wait_requests([req], timeout, what, message=lambda: f"{what}: peers did not join within {timeout:g} s")


def rendezvous(comm: MPI.Comm, timeout: float, what: str) -> None:
    """Collective: return once every rank of ``comm`` has called it, or raise PeerTimeoutError."""
    if comm.Get_size() > 1:
        wait(comm.Ibarrier(), timeout,
             f"{what} is collective over {comm.Get_size()} ranks and every rank must call it")
