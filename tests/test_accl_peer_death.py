"""A rank of an ``accl`` job is SIGKILLed; every survivor must raise ``PeerFailedError`` naming it,
fast (not by the 120 s group timeout), refuse later calls at once, and be able to go on among the
survivors (ULFM shrink).  Runs ``tests/accl_peer_death.py`` under a fault-tolerant mpiexec."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from _mpijob import FAULT_INJECTION, run_mpi

from torchhpc.runtime.mpirun import fault_tolerant_args, find_mpiexec, mpi_flavor, mpiexec_argv

SCRIPT = Path(__file__).with_name("accl_peer_death.py")
VICTIM = 1
GROUP_TIMEOUT_S = 120.0


def _ulfm_available() -> str | None:
    """Why the test cannot run here, or None."""
    if mpi_flavor() != "openmpi":
        return f"peer-death detection is tested with Open MPI's ULFM; mpiexec is {mpi_flavor()}"
    info = shutil.which("ompi_info", path=str(Path(find_mpiexec()).parent)) or shutil.which("ompi_info")
    if info is None:
        return "ompi_info not found"
    out = subprocess.run([info], capture_output=True, text=True, timeout=60, check=False).stdout
    if not re.search(r"FT MPI support:\s*yes", out):
        return "this Open MPI was built without ULFM (ompi_info: FT MPI support: no)"
    return None


@FAULT_INJECTION
@pytest.mark.parametrize(("mode", "nprocs"), [("sync", 2), ("sync", 4), ("async", 3), ("queued", 4),
                                               ("recv", 3)])
def test_survivors_fail_fast_naming_the_dead_rank(mode: str, nprocs: int) -> None:
    why = _ulfm_available()
    if why:
        pytest.skip(why)
    proc = run_mpi(nprocs, [sys.executable, str(SCRIPT), "--mode", mode, "--victim", str(VICTIM),
                            "--timeout", str(GROUP_TIMEOUT_S)], timeout=90, fault_tolerant=True)
    out = proc.stdout
    survivors = [r for r in range(nprocs) if r != VICTIM]
    named = 0
    for r in survivors:
        m = re.search(rf"^SURVIVOR {r} PeerFailedError failed_ranks=([\d,]*) took=([\d.]+)s "
                      rf"later_call=(\w+) in ([\d.]+)s :: (.*)$", out, re.M)
        assert m, f"rank {r} did not report the peer failure:\n{out[-6000:]}"
        failed, took, later, later_s, msg = m.groups()
        assert failed in ("", str(VICTIM)), f"rank {r} blamed ranks {failed}: {msg}"
        named += failed == str(VICTIM)
        assert float(took) < GROUP_TIMEOUT_S / 4, f"rank {r} took {took}s: detection came from the timeout?"
        assert later == "refused" and float(later_s) < 1.0, f"rank {r}: the aborted group {later} a later call"
        assert "died during" in msg and "The group is aborted" in msg
        assert re.search(rf"^SURVIVOR {r} shrunk world of {nprocs - 1}$", out, re.M), \
            f"rank {r} could not go on with the survivors:\n{out[-6000:]}"
    assert named, f"no survivor named rank {VICTIM} as the dead one:\n{out[-6000:]}"
    assert "NO-ERROR" not in out and "WRONG-ERROR" not in out, out[-6000:]


def test_fault_tolerant_launch_options() -> None:
    assert fault_tolerant_args("openmpi") == ["--with-ft", "ulfm"]
    ompi = fault_tolerant_args("openmpi", detector_s=2.0)
    assert ompi[:2] == ["--with-ft", "ulfm"]
    mca = dict(zip(ompi[3::3], ompi[4::3], strict=True))
    # Open MPI requires the detector timeout to exceed three heartbeat periods
    assert float(mca["mpi_ft_detector_timeout"]) > 3 * float(mca["mpi_ft_detector_period"])
    assert fault_tolerant_args("mpich") == ["-disable-auto-cleanup"]
    with pytest.raises(ValueError, match="no known fault-tolerance options"):
        fault_tolerant_args("unknown")
    argv = mpiexec_argv(3, ["python", "x.py"], fault_tolerant=True)
    assert argv[-2:] == ["python", "x.py"]
    if mpi_flavor() in ("openmpi", "mpich"):
        assert fault_tolerant_args(mpi_flavor()) == argv[-2 - len(fault_tolerant_args(mpi_flavor())):-2]
