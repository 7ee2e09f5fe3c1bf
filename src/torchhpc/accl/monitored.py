"""``monitored_barrier`` with gloo's protocol and reports: rank 0 names the ranks that did not arrive.

Every other rank sends a token to rank 0 and waits for its release; rank 0 waits for every token
until the deadline, then releases everyone.  As with gloo (``ProcessGroupGloo::monitoredBarrier``),
rank 0 raises ``[Rank 0]: Rank R failed to pass monitoredBarrier in T ms`` for the first missing rank,
or, with ``wait_all_ranks=True``, ``[Rank 0]: Ranks R1, R2 failed ...`` naming every missing rank;
the other ranks raise when rank 0 does not release them in time.
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from ..errors import PeerTimeoutError
from ..waiting import wait_until

__all__ = ["monitored_barrier"]


def monitored_barrier(comm: MPI.Comm, timeout_s: float, wait_all_ranks: bool = False) -> None:
    """Barrier over ``comm`` (a communicator used for nothing else with this tag) that reports
    missing ranks on rank 0 after ``timeout_s`` seconds; see the module docstring."""
    rank, size = comm.Get_rank(), comm.Get_size()
    ub = comm.Get_attr(MPI.TAG_UB) or 32767
    tag = 0x7FFF0000 % ub
    release_tag = (tag + 1) % ub
    token = np.zeros(1, dtype=np.int64)
    if rank != 0:
        comm.Isend([token, MPI.INT64_T], 0, tag)
        ack = np.zeros(1, dtype=np.int64)
        req = comm.Irecv([ack, MPI.INT64_T], 0, release_tag)
        try:
            wait_until(req.Test, timeout_s, f"accl: monitored_barrier: rank {rank} waiting for the release "
                                            f"from rank 0")
        except PeerTimeoutError as exc:
            req.Cancel()
            req.Wait()
            raise PeerTimeoutError(f"accl: Rank {rank} successfully reached monitoredBarrier, but got no "
                                   f"release from rank 0 within {timeout_s:g} s. Please check rank 0's "
                                   f"error for the faulty ranks.") from exc
        return
    bufs = {r: np.zeros(1, dtype=np.int64) for r in range(1, size)}
    pending = {r: comm.Irecv([bufs[r], MPI.INT64_T], r, tag) for r in bufs}

    def arrived() -> bool:
        for r in list(pending):
            if pending[r].Test():
                del pending[r]
        return not pending

    try:
        wait_until(arrived, timeout_s, "accl: monitored_barrier")
    except PeerTimeoutError:
        missing = sorted(pending)
        for r in missing:  # withdraw the receives so that no later message matches them
            pending[r].Cancel()
            pending[r].Wait()
        ms = round(timeout_s * 1000)
        if wait_all_ranks:
            head = f"[Rank 0]: Ranks {', '.join(map(str, missing))} failed to pass monitoredBarrier in {ms} ms"
        elif timeout_s <= 0:  # gloo checks the time left before each rank's wait: none was left for any
            head = (f"Rank 0 timed out in monitoredBarrier after {ms} ms. No ranks successfully processed in "
                    f"monitoredBarrier. Failing rank: {missing[0]}")
        else:
            head = f"[Rank 0]: Rank {missing[0]} failed to pass monitoredBarrier in {ms} ms"
        raise PeerTimeoutError(f"accl: {head} (missing: ranks {missing})") from None
    for r in bufs:
        comm.Send([token, MPI.INT64_T], r, release_tag)
