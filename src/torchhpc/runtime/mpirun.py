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
from collections.abc import Mapping, Sequence
from pathlib import Path

from .mpi_info import family_of_text

__all__ = ["find_mpiexec", "mpi_flavor", "mpiexec_argv", "fault_tolerant_args", "local_job_env", "available_cores",
           "side_mpich", "side_mpich_env", "across_hosts"]


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
    return family_of_text(out.stdout + out.stderr) or "unknown"


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


def available_cores() -> int:
    """Cores this process may run on (its CPU affinity), the count mpiexec's default slots come from."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def mpiexec_argv(
    nprocs: int, command: Sequence[str], *, oversubscribe: bool | None = None, mpiexec: str | None = None,
    fault_tolerant: bool = False, extra: Sequence[str] = (),
) -> list[str]:
    """Argument vector running ``command`` on ``nprocs`` local ranks, launched as users launch:
    ``mpiexec -n N`` and nothing else, except ``--oversubscribe`` (Open MPI) when there are more ranks
    than cores on a host (``oversubscribe=None``: decided from :func:`available_cores`, against the most ranks
    ``extra``'s ``--host h:k,...`` puts on one host: Open MPI 5 given ``--oversubscribe`` fills the first
    listed host past its ``k`` instead of spreading).  No binding or mapping flags: Open MPI's default mapping,
    and the local-rank order it gives, are part of what is tested.
    ``fault_tolerant``: a rank's death does not kill the others (:func:`fault_tolerant_args`);
    ``extra``: further mpiexec options (e.g. a non-default ``--map-by``/``--rank-by``).
    """
    if nprocs < 1:
        raise ValueError(f"nprocs must be >= 1, got {nprocs}")
    exe = mpiexec or find_mpiexec()
    argv = [exe, "-n", str(nprocs)]
    flavor = mpi_flavor(exe)
    if oversubscribe is None:
        oversubscribe = _ranks_per_host(nprocs, extra) > available_cores()
    if oversubscribe and flavor == "openmpi":  # Hydra (MPICH) starts any number of ranks unasked
        argv.append("--oversubscribe")
    if fault_tolerant:
        argv += fault_tolerant_args(flavor)
    return argv + list(extra) + list(command)


def _ranks_per_host(nprocs: int, extra: Sequence[str]) -> int:
    """The most ranks one host gets: from Open MPI's ``--host h1:k1,h2:k2`` in ``extra``, else all ``nprocs``."""
    args = list(extra)
    if "--host" not in args or args.index("--host") + 1 >= len(args):
        return nprocs
    slots = [int(h.rsplit(":", 1)[1]) if ":" in h else 1 for h in args[args.index("--host") + 1].split(",") if h]
    return min(nprocs, max(slots, default=nprocs))


def across_hosts(hosts: str | None, nprocs: int, env: Mapping[str, str] | None = None, mpiexec: str | None = None,
                 forward: Sequence[str] = ("OMP_NUM_THREADS", "PYTHONPATH")) -> list[str]:
    """mpiexec options that spread ``nprocs`` ranks evenly over the comma list ``hosts`` (none for None).

    Open MPI: ``--host h1:k,h2:k`` plus ``-x`` for each of ``forward`` that is set (it forwards only its own
    ``OMPI_*`` variables to other nodes) set in ``env`` (default: this process's); MPICH's Hydra:
    ``-hosts h1:k,h2:k`` (it forwards the whole environment)."""
    if not hosts:
        return []
    names = [h for h in hosts.split(",") if h]
    if not names:
        raise ValueError(f"hosts must be a comma list of host names, got {hosts!r}")
    per = -(-nprocs // len(names))
    spec = ",".join(f"{h}:{per}" for h in names)
    if mpi_flavor(mpiexec) == "openmpi":
        present = os.environ if env is None else env
        return ["--host", spec] + [x for var in forward if var in present for x in ("-x", var)]
    return ["-hosts", spec]


def side_mpich(prefix: str | Path | None = None) -> Path | None:
    """The MPICH that ``make env`` places beside an Open MPI environment (``$VENV/mpich``), if there.

    mpi4py's binary wheel carries extension modules for both ABIs and loads the MPI library named by
    ``MPI4PY_LIBMPI`` (mpi4py/_mpiabi.py); :func:`side_mpich_env` sets it for jobs started with this
    MPICH's ``bin/mpiexec``."""
    root = Path(prefix) if prefix is not None else Path(sys.prefix) / "mpich"
    ok = (root / "bin" / "mpiexec").exists() and (root / "lib" / "libmpi.so.12").exists()
    return root if ok else None


def side_mpich_env(root: Path, env: dict[str, str]) -> dict[str, str]:
    """``env`` for a job run by the side MPICH at ``root``: mpi4py loads its libmpi, PATH finds its tools."""
    out = dict(env)
    out["MPI4PY_LIBMPI"] = str(root / "lib" / "libmpi.so.12")
    out["PATH"] = os.pathsep.join(p for p in (str(root / "bin"), env.get("PATH", "")) if p)
    return out


def local_job_env(base: dict[str, str] | None = None, *, oversubscribed: bool = True) -> dict[str, str]:
    """Environment for a small local job: one thread per rank, yielding MPI progress when oversubscribed,
    huge pages for torch's CPU tensors (``THP_MEM_ALLOC_ENABLE=1`` unless set; :mod:`torchhpc.runtime.hugepages`)."""
    from .hugepages import set_default

    env = dict(os.environ if base is None else base)
    env.setdefault("OMP_NUM_THREADS", "1")
    set_default(env)
    env.setdefault("PYTHONUNBUFFERED", "1")
    # The PyPI Open MPI's UCX one-sided component prints a harmless error on every window creation
    # ("OSC UCX component priority set inside component query failed"); local jobs use osc/sm instead.
    env.setdefault("OMPI_MCA_osc", "^ucx")
    if oversubscribed:
        # Busy-polling ranks sharing a core starve each other; let them yield.
        env.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")
    return env
