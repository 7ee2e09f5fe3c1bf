"""Bytes between two nodes per second, by every path MPI offers: two-sided and one-sided (rank 0 prints GB/s).

tests/test_vcluster.py shapes the link first: no rate may beat it, or some path bypasses the network (a
shared-memory or cross-memory-attach transport reaching the other node), and the emulation is not faithful."""

import time

import numpy as np
from mpi4py import MPI

comm = MPI.COMM_WORLD
nbytes, reps = 4 << 20, 3
buf = np.ones(nbytes, dtype=np.uint8)
rates = {}
for _ in range(2):  # the first round warms up connections
    comm.Barrier()
    t0 = time.perf_counter()
    for _ in range(reps):
        if comm.rank == 0:
            comm.Recv(buf, source=1)
        else:
            comm.Send(buf, dest=0)
    comm.Barrier()
    rates["sendrecv"] = reps * nbytes / (time.perf_counter() - t0)
win = MPI.Win.Allocate(nbytes, comm=comm)
for what in ("get", "put"):
    for _ in range(2):
        comm.Barrier()
        t0 = time.perf_counter()
        if comm.rank == 0:
            win.Lock(1, MPI.LOCK_SHARED)
            for _ in range(reps):
                (win.Get if what == "get" else win.Put)(buf, 1)
                win.Flush(1)
            win.Unlock(1)
        comm.Barrier()
        rates[what] = reps * nbytes / (time.perf_counter() - t0)
win.Free()
if comm.rank == 0:
    print("RATES " + " ".join(f"{k}={v / 1e9:.4f}" for k, v in rates.items()), flush=True)
