#!/usr/bin/env python
"""One rank of an ``accl`` job dies mid-run; the survivors must fail fast with ``PeerFailedError``.

Run under a fault-tolerant mpiexec (``torchhpc.runtime.mpirun.mpiexec_argv(..., fault_tolerant=True)``:
Open MPI's ULFM), otherwise the launcher kills the whole job when the rank
dies.  Every survivor prints one ``SURVIVOR`` line that ``tests/test_accl_peer_death.py`` checks:
the error class, the rank it names, how long detection took (well under the group timeout), and
that the aborted group then refuses calls at once.

    mpiexec --with-ft ulfm -n 3 python tests/accl_peer_death.py --mode sync
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from mpi4py import MPI

import torchhpc.accl  # noqa: F401  (registers "accl")
from torchhpc.runtime.errors import PeerFailedError

MODES = ("sync", "sync-large", "async", "queued", "recv")


def _calls(mode: str, rank: int, victim: int):
    """One call of the given kind per iteration (what a training loop would keep issuing)."""
    small, large = torch.ones(4), torch.ones(1 << 20)  # 16 B: fused header path; 4 MiB: blocking data path
    if mode == "sync":
        return lambda: dist.all_reduce(small)
    if mode == "sync-large":
        return lambda: dist.all_reduce(large)
    if mode == "async":
        return lambda: dist.all_reduce(large, async_op=True).wait()
    if mode == "queued":  # several async collectives in flight, then one wait: all must fail, none hang
        def queued() -> None:
            works = [dist.broadcast(large, 0, async_op=True) for _ in range(3)]
            works[-1].wait()
        return queued
    if mode == "recv":  # a survivor waits for a message the dead rank would have sent
        buf = torch.empty(4)
        return lambda: dist.recv(buf, src=victim)
    raise ValueError(mode)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=MODES, default="sync")
    ap.add_argument("--victim", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=120.0, help="group timeout (s); detection must beat it")
    args = ap.parse_args(argv)
    dist.init_process_group("accl", timeout=timedelta(seconds=args.timeout))
    rank, size = dist.get_rank(), dist.get_world_size()
    call = _calls(args.mode, rank, args.victim)
    warm = torch.ones(8)
    dist.all_reduce(warm)  # everybody is alive here
    assert warm[0].item() == size
    if rank == args.victim:
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGKILL)  # dies abruptly: no finalize, no goodbye
    t0 = time.monotonic()
    try:
        for _ in range(1_000_000):
            call()
        print(f"SURVIVOR {rank} NO-ERROR", flush=True)
        return 1
    except PeerFailedError as exc:
        took = time.monotonic() - t0
        failed = ",".join(map(str, exc.failed_ranks))
        msg = str(exc).replace("\n", " ")
    except Exception as exc:  # noqa: BLE001 - reported for the test to show
        print(f"SURVIVOR {rank} WRONG-ERROR {type(exc).__name__}: {exc}", flush=True)
        return 1
    t1 = time.monotonic()
    try:
        dist.all_reduce(warm)
        later = "accepted"
    except dist.DistBackendError:
        later = "refused"
    print(f"SURVIVOR {rank} PeerFailedError failed_ranks={failed} took={took:.2f}s "
          f"later_call={later} in {time.monotonic() - t1:.3f}s :: {msg}", flush=True)
    # The survivors can go on among themselves (ULFM's shrink): they wait for each other's report here,
    # then leave; accl ends each process with MPI_Abort at exit since MPI_Finalize would wait for the dead.
    survivors = MPI.COMM_WORLD.Shrink()
    survivors.Barrier()
    print(f"SURVIVOR {rank} shrunk world of {survivors.Get_size()}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
