"""Run every ``tests/mpi/test_*.py`` file under ``mpiexec`` at its rank counts.

Each file there is an ordinary pytest module executed by every rank (they call
collectives, so every rank runs the same tests in the same order).  A file names
its rank counts with a line ``MPI_RANKS = (2, 4)`` (the default) and may raise its
time limit with ``MPI_TIMEOUT = 240`` (seconds, default 180).  A hung job is
killed at the limit and reported as a failure, never left running.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from torchhpc.mpirun import local_job_env, mpiexec_argv

MPI_DIR = Path(__file__).parent / "mpi"
DEFAULT_RANKS = (2, 4)
DEFAULT_TIMEOUT = 180.0


def _setting(text: str, name: str) -> str | None:
    match = re.search(rf"^{name}\s*=\s*(.+)$", text, re.MULTILINE)
    return match.group(1).split("#")[0].strip() if match else None


def _cases() -> list:
    cases = []
    for path in sorted(MPI_DIR.glob("test_*.py")):
        text = path.read_text()
        ranks_src = _setting(text, "MPI_RANKS")
        ranks = tuple(int(n) for n in re.findall(r"\d+", ranks_src)) if ranks_src else DEFAULT_RANKS
        timeout_src = _setting(text, "MPI_TIMEOUT")
        timeout = float(timeout_src) if timeout_src else DEFAULT_TIMEOUT
        for n in ranks:
            cases.append(pytest.param(path, n, timeout, id=f"{path.stem}-np{n}"))
    return cases


def run_mpi(nprocs: int, argv: list[str], timeout: float) -> subprocess.CompletedProcess:
    """Run ``argv`` under mpiexec with ``nprocs`` ranks; kill the whole job at ``timeout``."""
    env = local_job_env()
    # Open MPI refuses to start as root unless told; CI containers run as root.
    env["OMPI_ALLOW_RUN_AS_ROOT"] = "1"
    env["OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"] = "1"
    src = str(Path(__file__).resolve().parents[1] / "src")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    cmd = mpiexec_argv(nprocs, argv)
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


@pytest.mark.parametrize(("path", "nprocs", "timeout"), _cases())
def test_mpi_suite(path: Path, nprocs: int, timeout: float) -> None:
    argv = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
            "--rootdir", str(MPI_DIR), str(path)]
    res = run_mpi(nprocs, argv, timeout)
    if res.returncode != 0:
        pytest.fail(f"{path.name} failed at {nprocs} ranks (exit {res.returncode}):\n{res.stdout[-20000:]}")
    assert re.search(r"\d+ passed", res.stdout), f"no test passed in {path.name}:\n{res.stdout[-5000:]}"
