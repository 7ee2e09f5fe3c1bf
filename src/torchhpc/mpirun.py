"""Build ``mpiexec`` command lines that work with the MPI that mpi4py uses.

Open MPI and MPICH (Hydra) spell oversubscription and binding differently; tests,
benchmarks and ``torchhpc doctor`` start small local jobs through this module so
that each of them does not have to know.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

__all__ = ["find_mpiexec", "mpi_flavor", "mpiexec_argv", "fault_tolerant_args", "local_job_env"]


def find_mpiexec() -> str:
    """Return the ``mpiexec`` beside this interpreter (venv with an MPI wheel), else the one on PATH."""
    beside = Path(sys.executable).with_name("mpiexec")
    if beside.exists():
        return str(beside)
    found = shutil.which("mpiexec") or shutil.which("mpirun")
    if found is None:
        raise FileNotFoundError(
            "no mpiexec found beside the Python interpreter or on PATH; "
            "run `make env` (MPI wheels) or load your site's MPI module"
        )
    return found


@functools.cache
def mpi_flavor(mpiexec: str | None = None) -> str:
    """Return ``"openmpi"``, ``"mpich"`` or ``"unknown"`` from ``mpiexec --version``."""
    exe = mpiexec or find_mpiexec()
    try:
        out = subprocess.run(
            [exe, "--version"], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    text = (out.stdout + out.stderr).lower()
    if "open mpi" in text or "openrte" in text or "prte" in text:
        return "openmpi"
    if "hydra" in text or "mpich" in text or "intel" in text:
        return "mpich"
    return "unknown"


def fault_tolerant_args(flavor: str, detector_s: float | None = None) -> list[str]:
    """mpiexec options under which the survivors of a dead rank keep running and see MPI errors
    (``MPI_ERR_PROC_FAILED``) instead of being killed by the launcher.

    Open MPI: ULFM (``--with-ft ulfm``); the runtime reports ranks killed by a signal within
    milliseconds.  ``detector_s`` also switches on ULFM's heartbeat detector, which declares a rank
    dead after that many silent seconds (ranks that hang, or exit without a signal); it is off by
    default because in Open MPI 5.0.11 its thread crashed 2 of 10 oversubscribed 4-rank jobs here.
    MPICH: ``-disable-auto-cleanup``.  Other launchers: ``ValueError``.
    """
    if flavor == "openmpi":
        args = ["--with-ft", "ulfm"]
        if detector_s is not None:
            args += ["--mca", "mpi_ft_detector", "true", "--mca", "mpi_ft_detector_thread", "true",
                     "--mca", "mpi_ft_detector_period", f"{detector_s / 4:g}",
                     "--mca", "mpi_ft_detector_timeout", f"{detector_s:g}"]
        return args
    if flavor == "mpich":
        return ["-disable-auto-cleanup"]
    raise ValueError(f"no known fault-tolerance options for an mpiexec of flavor {flavor!r}")


def mpiexec_argv(
    nprocs: int, command: Sequence[str], *, oversubscribe: bool = True, mpiexec: str | None = None,
    fault_tolerant: bool = False,
) -> list[str]:
    """Argument vector running ``command`` on ``nprocs`` local ranks.

    With ``oversubscribe`` the job may use more ranks than cores and ranks are not
    pinned (pinning oversubscribed ranks to cores makes them fight for one core).
    With ``fault_tolerant`` a rank's death does not kill the others (:func:`fault_tolerant_args`).
    """
    if nprocs < 1:
        raise ValueError(f"nprocs must be >= 1, got {nprocs}")
    exe = mpiexec or find_mpiexec()
    argv = [exe, "-n", str(nprocs)]
    flavor = mpi_flavor(exe)
    if oversubscribe and flavor == "openmpi":
        argv += ["--oversubscribe", "--bind-to", "none"]
    elif oversubscribe and flavor == "mpich":
        argv += ["-bind-to", "none"]
    if fault_tolerant:
        argv += fault_tolerant_args(flavor)
    return argv + list(command)


def local_job_env(base: dict[str, str] | None = None, *, oversubscribed: bool = True) -> dict[str, str]:
    """Environment for a small local job: one thread per rank, yielding MPI progress when oversubscribed."""
    env = dict(os.environ if base is None else base)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("PYTHONUNBUFFERED", "1")
    # The PyPI Open MPI's UCX one-sided component prints a harmless error on every window creation
    # ("OSC UCX component priority set inside component query failed"); local jobs use osc/sm instead.
    env.setdefault("OMPI_MCA_osc", "^ucx")
    if oversubscribed:
        # Busy-polling ranks sharing a core starve each other; let them yield.
        env.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")
    return env
