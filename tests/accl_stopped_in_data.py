"""Rank 2 SIGSTOPs itself 30 ms into a 512 MiB all_reduce: past the header exchange, inside MPI's blocking data
phase, where its peers wait in a call MPI cannot interrupt.  tests/test_accl.py checks that accl's watchdog ends
the job a second past the group timeout (2 s) instead of leaving it hanging."""

import os
import signal
import threading

import torch
import torch.distributed as dist

from torchhpc.launcher import init_distributed

info = init_distributed(backend="accl", timeout=2.0)
x = torch.ones(128 << 20)
dist.all_reduce(x)
dist.barrier()  # every rank starts the next call within a moment of the others: the header passes at once
if info.rank == 2:
    threading.Timer(0.03, os.kill, (os.getpid(), signal.SIGSTOP)).start()
dist.all_reduce(x)
print(f"COMPLETED rank={info.rank}", flush=True)
