"""Run every ``tests/mpi/test_*.py`` file under ``mpiexec`` at its rank counts.

Each file there is an ordinary pytest module executed by every rank (they call
collectives, so every rank runs the same tests in the same order).  A file names
its rank counts with a line ``MPI_RANKS = (2, 4)`` (the default) and may raise its
time limit with ``MPI_TIMEOUT = 240`` (seconds, default 180).  A hung job is
killed at the limit and reported as a failure, never left running.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from _mpijob import run_mpi

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


@pytest.mark.parametrize(("path", "nprocs", "timeout"), _cases())
def test_mpi_suite(path: Path, nprocs: int, timeout: float) -> None:
    argv = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
            "--rootdir", str(MPI_DIR), str(path)]
    res = run_mpi(nprocs, argv, timeout)
    if res.returncode != 0:
        pytest.fail(f"{path.name} failed at {nprocs} ranks (exit {res.returncode}):\n{res.stdout[-20000:]}")
    assert re.search(r"\d+ passed", res.stdout), f"no test passed in {path.name}:\n{res.stdout[-5000:]}"
