"""pytest set-up for tests run by every rank under mpiexec (see tests/test_mpi_suites.py).

A failure on one rank would leave the others blocked in a collective, so a failing
rank prints its report and aborts the whole job: the harness sees a non-zero exit
at once instead of waiting for its time limit.  A job that hangs anyway: shortly before
the harness kills it (at ``TORCHHPC_TEST_STACKS_AT``, a wall-clock time), every rank dumps the
Python stacks of all its threads to the job's output (faulthandler), and SIGUSR1 does
the same on demand.  Each rank prints its place (rank, the launcher's local rank) once at the start.
"""

from __future__ import annotations

import faulthandler
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from _skips import make_strict
from mpi4py import MPI

from torchhpc.launcher import world_info


def pytest_sessionstart(session: pytest.Session) -> None:
    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    stream = sys.__stderr__  # fd 2 itself: the harness runs pytest with --capture=sys, so it is not captured
    at = os.environ.get("TORCHHPC_TEST_STACKS_AT")  # wall-clock time, set by the harness before its kill
    if at:
        faulthandler.dump_traceback_later(max(1.0, float(at) - time.time()), exit=False, file=stream)
    faulthandler.register(signal.SIGUSR1, file=stream, all_threads=True)
    info = world_info()  # the launcher's local rank (e.g. OMPI_COMM_WORLD_LOCAL_RANK), not MPI's split order
    stream.write(f"TORCHHPC-RANK-MAP rank={rank} local_rank={info.local_rank} size={world.Get_size()} "
                 f"host={socket.gethostname()} "
                 f"launcher={info.launcher} mpi={MPI.Get_library_version().split(chr(10))[0].strip()[:40]!r}\n")
    stream.flush()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    faulthandler.cancel_dump_traceback_later()



@pytest.fixture(scope="session")
def comm() -> MPI.Comm:
    """The job's world communicator."""
    return MPI.COMM_WORLD


@pytest.fixture
def shared_tmp(comm: MPI.Comm) -> Iterator[Path]:
    """A fresh directory every rank sees: under ``$TORCHHPC_TEST_SHARED_DIR`` (a file system the job's nodes
    share; the multi-node harness sets it, since each node's /tmp is its own), else in the system's /tmp."""
    path = tempfile.mkdtemp(prefix="torchhpc-test-", dir=os.environ.get("TORCHHPC_TEST_SHARED_DIR")) \
        if comm.Get_rank() == 0 else None
    path = comm.bcast(path, root=0)
    yield Path(path)
    comm.Barrier()
    if comm.Get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    make_strict(report)  # in CI a skip of something CI provides is a failure (tests/_skips.py)
    if report.failed and MPI.COMM_WORLD.Get_size() > 1:
        rank = MPI.COMM_WORLD.Get_rank()
        sys.stderr.write(f"\n[rank {rank}] FAILED {item.nodeid} ({report.when})\n{report.longreprtext}\n")
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(1)
