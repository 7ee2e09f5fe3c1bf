"""Launch a command under mpiexec for a test, as users launch: ``mpiexec -n N`` (+ ``--oversubscribe``
when cores are short), with a hard time limit.  Before the limit every rank dumps its Python stacks
(see tests/mpi/conftest.py), so the failure report of a hung job shows where each rank was.

Variants: ``plain`` (the default), ``rank-order`` (Open MPI with a non-default ``--map-by``/``--rank-by``
that gives local rank > rank), ``mpich`` (the MPICH that ``make env`` puts in ``$VENV/mpich``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from torchhpc.runtime.mpirun import local_job_env, mpi_flavor, mpiexec_argv, side_mpich, side_mpich_env
from torchhpc.runtime.waiting import wait_until

VARIANTS = ("plain", "rank-order", "mpich")
# Open MPI: map by core and rank round-robin over the mapped objects ("fill"): on one node ranks 1 and 2
# get local ranks 2 and 1.  The harness checks the printed mapping really has a local rank > rank.
RANK_ORDER_ARGS = ("--map-by", "core", "--rank-by", "fill")
STACKS_MARGIN = 15.0  # seconds before the kill at which every rank dumps its stacks
# the second tier's (`make test-all`) jobs that kill, stop or hang ranks on purpose and wait out the deadlines
FAULT_INJECTION = pytest.mark.full("fault injection: ranks killed, stopped or hung and waited out")


def inner_pytest_argv(target: str, rootdir: str | None = None) -> list[str]:
    """The command every rank runs for the pytest ``target`` (a file, or ``file::test``).

    ``--capture=sys`` leaves fd 2 alone, so the stack dumps of a hung job reach the job's output; ``-rs`` lists
    each skip with its reason, which the harness reports."""
    root = rootdir or str(Path(__file__).resolve().parent / "mpi")
    return [sys.executable, "-m", "pytest", "-q", "-x", "-rs", "-p", "no:cacheprovider", "--capture=sys",
            "--rootdir", root, target]


def variant_unavailable(variant: str) -> str | None:
    """Why ``variant`` cannot run here, or None."""
    if variant == "rank-order" and mpi_flavor() != "openmpi":
        return f"the rank-order variant uses Open MPI's --map-by/--rank-by; this mpiexec is {mpi_flavor()}"
    if variant == "mpich" and mpi_flavor() != "mpich" and side_mpich() is None:
        return "no MPICH: `make env` (MPI=openmpi) puts the pinned mpich wheel's files in $VENV/mpich"
    return None


def _session_pids(sid: int) -> list[int]:
    """Live (not yet zombie) processes of session ``sid``."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":  # after "pid (comm)": state ppid pgrp session
            pids.append(int(stat.parent.name))
    return pids


def kill_session(sid: int, grace: float = 30.0) -> None:
    """SIGKILL every process of session ``sid`` (mpiexec's, started with ``start_new_session``) and wait, up to
    ``grace`` seconds, until none is left: Open MPI puts each rank in a process group of its own, so killing
    mpiexec's group would leave hung ranks alive, and a killed process lingers until the kernel runs it."""

    def all_gone() -> bool:
        pids = _session_pids(sid)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(sid, signal.SIGKILL)
        return not pids

    wait_until(all_gone, grace, f"SIGKILL of mpiexec's session {sid}")


def run_mpi(nprocs: int, argv: list[str], timeout: float, fault_tolerant: bool = False,
            variant: str = "plain") -> subprocess.CompletedProcess:
    """Run ``argv`` under mpiexec with ``nprocs`` ranks; kill the whole job at ``timeout``.
    ``fault_tolerant``: a dying rank leaves the others running (ULFM; see ``mpiexec_argv``)."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    why = variant_unavailable(variant)
    if why:
        pytest.skip(why)
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
    # wall-clock time at which every rank dumps its stacks: shortly before the kill, whenever the ranks started
    env["TORCHHPC_TEST_STACKS_AT"] = f"{time.time() + timeout - min(STACKS_MARGIN, 0.3 * timeout):.1f}"
    mpiexec = None
    extra: tuple[str, ...] = ()
    if variant == "mpich" and mpi_flavor() != "mpich":
        root = side_mpich()
        assert root is not None
        env = side_mpich_env(root, env)
        mpiexec = str(root / "bin" / "mpiexec")
    elif variant == "rank-order":
        extra = RANK_ORDER_ARGS
    cmd = mpiexec_argv(nprocs, argv, fault_tolerant=fault_tolerant, mpiexec=mpiexec, extra=extra)
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_session(proc.pid)
        out, _ = proc.communicate()
        pytest.fail(f"{' '.join(cmd)} did not finish in {timeout:.0f}s (hung?); every rank's Python stacks "
                    "were dumped shortly before the kill (search 'most recent call first'); "
                    f"output:\n{out[-40000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, None)


def main(args: list[str] | None = None) -> int:
    """``python tests/_mpijob.py -n 3 [--variant mpich] tests/mpi/test_x.py[::test_y]``: one MPI test, alone."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("-n", "--nprocs", type=int, default=2)
    parser.add_argument("--variant", choices=VARIANTS, default="plain")
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("target")
    opts = parser.parse_args(args)
    try:
        res = run_mpi(opts.nprocs, inner_pytest_argv(opts.target), opts.timeout, variant=opts.variant)
    except BaseException as exc:  # pytest.fail / pytest.skip outside pytest
        print(exc)
        return 1
    print(f"$ {' '.join(res.args)}\n{res.stdout}")
    return res.returncode


if __name__ == "__main__":
    sys.exit(main())
