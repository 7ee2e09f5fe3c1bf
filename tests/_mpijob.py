"""Launch a command under mpiexec for a test, with a hard time limit (the whole job is killed on expiry)."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from torchhpc.mpirun import local_job_env, mpiexec_argv


def run_mpi(nprocs: int, argv: list[str], timeout: float, fault_tolerant: bool = False
            ) -> subprocess.CompletedProcess:
    """Run ``argv`` under mpiexec with ``nprocs`` ranks; kill the whole job at ``timeout``.
    ``fault_tolerant``: a dying rank leaves the others running (ULFM; see ``mpiexec_argv``)."""
    env = local_job_env()
    # Open MPI refuses to start as root unless told; CI containers run as root.
    env["OMPI_ALLOW_RUN_AS_ROOT"] = "1"
    env["OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"] = "1"
    # Each job agrees on its own rendezvous; never reuse an address inherited from the test process.
    for var in ("MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    here = Path(__file__).resolve().parent
    paths = (str(here.parent / "src"), str(here), env.get("PYTHONPATH"))  # torchhpc, and tests/ helpers
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    cmd = mpiexec_argv(nprocs, argv, fault_tolerant=fault_tolerant)
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{' '.join(cmd)} did not finish in {timeout:.0f}s (hung?); output:\n{out[-20000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, None)
