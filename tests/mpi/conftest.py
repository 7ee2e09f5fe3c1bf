"""pytest set-up for tests run by every rank under mpiexec (see tests/test_mpi_suites.py).

A failure on one rank would leave the others blocked in a collective, so a failing
rank prints its report and aborts the whole job: the harness sees a non-zero exit
at once instead of waiting for its time limit.
"""

from __future__ import annotations

import sys

import pytest
from mpi4py import MPI


@pytest.fixture(scope="session")
def comm() -> MPI.Comm:
    """The job's world communicator."""
    return MPI.COMM_WORLD


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed and MPI.COMM_WORLD.Get_size() > 1:
        rank = MPI.COMM_WORLD.Get_rank()
        sys.stderr.write(f"\n[rank {rank}] FAILED {item.nodeid} ({report.when})\n{report.longreprtext}\n")
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(1)
