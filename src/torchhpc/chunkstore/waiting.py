"""Waiting on peers with a deadline: nothing in chunkstore blocks forever on a rank that never comes.

MPI's blocking collectives have no timeout.  Each collective entry point of a ChunkTensor therefore
starts with a non-blocking barrier polled against a deadline (:func:`rendezvous`); once every rank
has arrived, the blocking steps that follow complete.  A timed-out request is kept (the ranks no
longer agree on the communicator's collective sequence, so the job should stop) and the caller
gets a :class:`TimeoutError` saying what it waited for.
"""

from __future__ import annotations

import os
import time

from mpi4py import MPI

__all__ = ["wait", "rendezvous", "ABANDONED"]

ABANDONED: list[MPI.Request] = []  # requests given up on after their deadline (kept alive, never reused)
_SPIN_S = 2e-3  # poll without sleeping this long, then back off (peers may be computing)


def wait(req: MPI.Request, timeout: float, what: str) -> None:
    """Complete ``req`` or raise TimeoutError naming ``what`` after ``timeout`` seconds."""
    if req.Test():
        return
    start = time.monotonic()
    while not req.Test():
        waited = time.monotonic() - start
        if waited > timeout:
            ABANDONED.append(req)
            raise TimeoutError(f"{what}: peers did not join within {timeout:g} s")
        if waited < _SPIN_S:
            os.sched_yield()
        else:
            time.sleep(min(1e-3, waited / 10))


def rendezvous(comm: MPI.Comm, timeout: float, what: str) -> None:
    """Collective: return once every rank of ``comm`` has called it, or raise TimeoutError."""
    if comm.Get_size() > 1:
        wait(comm.Ibarrier(), timeout,
             f"{what} is collective over {comm.Get_size()} ranks and every rank must call it")
