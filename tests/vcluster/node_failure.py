"""All-reduces on accl until a peer's node fails; every survivor must raise the package's error in time.

tests/test_vcluster.py runs it as a 2-node Slurm job and tears one node down while the loop runs.  Each
rank prints ``LOOPING`` once it has done a few calls, and on the failure one ``SURVIVOR`` line: how long
after its last completed call the error came, the CPU time the process (every thread) used in that wait, and
which error it was.  A rank still inside one call three
timeouts later prints every thread's stack (to tell a stuck survivor from a slow one)."""

import faulthandler
import os
import signal
import socket
import sys
import time

import torch
import torch.distributed as dist

from torchhpc.errors import TorchhpcError
from torchhpc.launcher import init_distributed

TIMEOUT_S = float(sys.argv[1]) if len(sys.argv) > 1 else 5.0
STOP_RANK = int(sys.argv[2]) if len(sys.argv) > 2 else -1  # this rank SIGSTOPs itself (a stand-alone test)
info = init_distributed(backend="accl", timeout=TIMEOUT_S)
host = socket.gethostname()
x = torch.ones(4096)
last_ok, cpu_ok = time.monotonic(), time.process_time()
calls = 0
try:
    while True:
        faulthandler.dump_traceback_later(3 * TIMEOUT_S)  # re-armed for every call
        dist.all_reduce(x)
        x.fill_(1.0)
        calls += 1
        last_ok, cpu_ok = time.monotonic(), time.process_time()
        if calls == 20:
            print(f"LOOPING rank={info.rank} host={host}", flush=True)
            if info.rank == STOP_RANK:
                os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(0.005)
except Exception as exc:  # noqa: BLE001 - the test reads which error it was
    faulthandler.cancel_dump_traceback_later()
    waited, cpu = time.monotonic() - last_ok, time.process_time() - cpu_ok
    family = "torchhpc" if isinstance(exc, TorchhpcError) else "other"
    print(f"SURVIVOR rank={info.rank} host={host} after={waited:.1f}s cpu={cpu:.1f}s family={family} "
          f"error={type(exc).__name__}: {str(exc).splitlines()[0][:400]}", flush=True)
    sys.exit(3)
