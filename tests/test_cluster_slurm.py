"""The Slurm targets end to end on a real Slurm: munged + slurmctld + slurmd started on this host.

A session fixture writes a munge key and a minimal slurm.conf (this host as the only node, cons_tres,
linuxproc, task/none, one OverSubscribe=FORCE partition, state in a temporary directory), starts the three
daemons as root, waits for the node to be idle, and stops them at the end.  Where Slurm cannot be started
(not root, `slurm-wlm`/`munge` not installed, daemons failing) the tests skip and say why.  Every job goes
through the real `sbatch`, and its state and exit code come back through the real `scontrol`.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from _upstream import PG_MPI, tagged_upstream

pytestmark = pytest.mark.full("a Slurm started on this host")

ROOT = Path(__file__).resolve().parents[1]
USER = pwd.getpwuid(os.geteuid()).pw_name  # job scripts and logs go to build/jobs/<user>
DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "scontrol", "squeue", "scancel", "sinfo", "srun")
# A small, quick all-reduce table: up to 64 KiB, 3 timed iterations.
QUICK = "-e 64K -n 3 -w 1"


@dataclass
class Slurm:
    """A running single-node Slurm and the environment that reaches it."""

    root: Path
    env: dict[str, str]

    def logs(self) -> str:
        out = []
        for name in ("munged.log", "slurmctld.log", "slurmd.log"):
            path = self.root / name
            if path.exists():
                out.append(f"--- {name}\n" + "\n".join(path.read_text(errors="replace").splitlines()[-20:]))
        return "\n".join(out)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for(what: str, check, deadline_s: float) -> bool:
    """Poll ``check`` (growing interval, capped) until it is true or ``deadline_s`` passes."""
    end, interval = time.monotonic() + deadline_s, 0.05
    while time.monotonic() < end:
        if check():
            return True
        time.sleep(interval)
        interval = min(interval * 2, 1.0)
    return False


def _slurm_conf(root: Path, host: str, munge_socket: Path) -> str:
    cpus = os.cpu_count() or 1
    return f"""\
ClusterName=torchhpc-ci
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={munge_socket}
CredType=cred/munge
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
ReturnToService=2
MinJobAge=600
KillWait=5
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=ci Nodes={host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE
"""


@pytest.fixture(scope="session")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Slurm]:
    """munged + slurmctld + slurmd on this host for the whole session; skipped where that cannot be done."""
    if os.geteuid() != 0:
        pytest.skip("a private Slurm needs root (slurmd runs jobs as their users)")
    missing = [b for b in (*DAEMONS, *CLIENTS) if shutil.which(b, path="/usr/sbin:/usr/bin:/sbin:/bin") is None]
    if missing:
        pytest.skip(f"Slurm not installed (missing {', '.join(missing)}): apt-get install slurm-wlm munge")
    root = tmp_path_factory.mktemp("slurm")
    for sub in ("state", "spool", "munge"):
        (root / sub).mkdir()
    (root / "munge").chmod(0o700)
    key = root / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    munge_socket = root / "munge" / "munge.socket"
    host = socket.gethostname().split(".")[0]
    conf = root / "slurm.conf"
    conf.write_text(_slurm_conf(root, host, munge_socket))
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": str(root),
           "LANG": "C", "SLURM_CONF": str(conf), "OMPI_ALLOW_RUN_AS_ROOT": "1",
           "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", "OMPI_MCA_rmaps_base_oversubscribe": "1"}
    cluster = Slurm(root, env)
    procs: list[subprocess.Popen[bytes]] = []

    def start(*cmd: str) -> None:
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                      start_new_session=True))

    def node_idle() -> bool:
        out = subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True, text=True, timeout=10)
        return out.stdout.strip() == "idle"

    try:
        start("munged", "-F", "--force", f"--key-file={key}", f"--socket={munge_socket}",
              f"--pid-file={root}/munge/munged.pid", f"--log-file={root}/munged.log", f"--seed-file={root}/munge/seed")
        if not _wait_for("munged", munge_socket.exists, 15):
            pytest.fail(f"munged did not start (root, munge installed):\n{cluster.logs()}")
        start("slurmctld", "-D", "-i", "-f", str(conf))
        start("slurmd", "-D", "-f", str(conf))
        if not _wait_for("node idle", node_idle, 60):
            pytest.fail(f"Slurm did not come up (node not idle within 60 s):\n{cluster.logs()}")
        yield cluster
    finally:
        for proc in reversed(procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in reversed(procs):
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)


def run(slurm: Slurm, tmp_path: Path, cmd: list[str], timeout: float = 300, **extra: str
        ) -> subprocess.CompletedProcess[str]:
    """Run a make target or script from the repository root against the private Slurm."""
    env = {**slurm.env, "TORCHHPC_PREFIX": str(tmp_path / "build"), "SITE": "generic", **extra}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    return proc


def submit(slurm: Slurm, tmp_path: Path, *command: str, **extra: str) -> subprocess.CompletedProcess[str]:
    return run(slurm, tmp_path, ["bash", "utils/submit_job.sh", "--scheduler", "slurm", "--name", "t",
                                 "--shape", "build", "--cpus", "1", "--", *command], **extra)


def test_generic_site_detects_slurm_on_path(slurm: Slurm, tmp_path: Path) -> None:
    proc = run(slurm, tmp_path, ["bash", "-c", "TORCHHPC_NO_ENV=1 TORCHHPC_QUIET=1 source ./config_env.sh && "
                                               "echo $TORCHHPC_SCHEDULER"])
    assert proc.stdout.strip() == "slurm", proc.stderr


def test_job_that_succeeds(slurm: Slurm, tmp_path: Path) -> None:
    proc = submit(slurm, tmp_path, "bash", "-c", "echo hello from $SLURM_JOB_ID on $(hostname)")
    assert proc.returncode == 0, proc.stdout + proc.stderr + slurm.logs()
    assert "finished: COMPLETED, exit status 0" in proc.stderr
    job_id = proc.stderr.split("as Slurm job ")[1].split()[0]
    log = tmp_path / f"build/jobs/{USER}/t-{job_id}.log"
    assert f"hello from {job_id}" in log.read_text()
    assert f"hello from {job_id}" in proc.stdout, "the log is shown"
    script = (tmp_path / f"build/jobs/{USER}/t.slurm").read_text().splitlines()
    assert script[0] == "#!/bin/bash" and "#SBATCH --cpus-per-task=1" in script


def test_job_that_fails_returns_its_status_and_shows_its_log(slurm: Slurm, tmp_path: Path) -> None:
    proc = submit(slurm, tmp_path, "bash", "-c", "echo about to fail >&2; exit 3")
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "failed: exit code 3" in proc.stderr and "about to fail" in proc.stdout


def _job_id_when_running(slurm: Slurm) -> str:
    out = subprocess.run(["squeue", "-h", "-n", "t", "-o", "%i %T"], env=slurm.env, capture_output=True,
                         text=True, timeout=10).stdout.split()
    return out[0] if out[1:2] == ["RUNNING"] else ""


def test_cancelled_job_says_so(slurm: Slurm, tmp_path: Path) -> None:
    env = {**slurm.env, "TORCHHPC_PREFIX": str(tmp_path / "build"), "SITE": "generic"}
    proc = subprocess.Popen(["bash", "utils/submit_job.sh", "--scheduler", "slurm", "--name", "t", "--shape",
                             "build", "--cpus", "1", "--", "sleep", "300"], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        seen: dict[str, str] = {}

        def running() -> bool:
            seen["job"] = _job_id_when_running(slurm)
            return bool(seen["job"])

        assert _wait_for("running", running, 30), "the job never started"
        job = seen["job"]
        subprocess.run(["scancel", job], env=slurm.env, check=True, timeout=10)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, out + err
    assert f"Slurm job {job} was cancelled" in err


def test_wait_deadline_cancels_the_job(slurm: Slurm, tmp_path: Path) -> None:
    proc = submit(slurm, tmp_path, "sleep", "300", JOB_WAIT_TIMEOUT="2")
    assert proc.returncode != 0 and "gave up on Slurm job" in proc.stderr and "it was cancelled" in proc.stderr
    job = proc.stderr.split("as Slurm job ")[1].split()[0]
    state = subprocess.run(["scontrol", "show", "job", "-o", job], env=slurm.env, capture_output=True, text=True,
                           timeout=10).stdout
    assert "JobState=CANCELLED" in state or "JobState=COMPLETING" in state, state


def test_bad_slurm_resources_are_rejected_before_submitting(slurm: Slurm, tmp_path: Path) -> None:
    for extra, message in (({"SLURM_NODES_TEST": "two"}, "--nodes 'two' is not a positive whole number"),
                           ({"SLURM_TIME_TEST": "15min"}, "is not HH:MM:SS"),
                           ({"SLURM_PARTITION": "a b"}, "is not a Slurm partition name")):
        proc = run(slurm, tmp_path, ["make", "--no-print-directory", "test-slurm"], **extra)
        assert proc.returncode != 0 and message in proc.stderr, (extra, proc.stderr)


def job_log(proc: subprocess.CompletedProcess[str]) -> str:
    """The whole log of the job a submission reported (the console shows only its last lines)."""
    path = proc.stderr.split("; log: ")[1].split()[0]
    return Path(path).read_text()


WHOLE_NODE = (os.cpu_count() or 1) == 2  # the test's 2 ranks of a core each hold every CPU of the host


def _all_reduce(slurm: Slurm, tmp_path: Path, backends: str, **extra: str) -> subprocess.CompletedProcess[str]:
    return run(slurm, tmp_path, ["make", "--no-print-directory", "test-slurm", f"BACKENDS={backends}"],
               SLURM_NODES_TEST="1", GPUS_PER_NODE="2", SLURM_CPUS_TEST="1", SLURM_GPUS_TEST="0",
               TORCHHPC_NO_ENV="1", ALL_REDUCE_ARGS=QUICK, **extra)


def test_test_slurm_runs_the_all_reduce_table_with_mpiexec(slurm: Slurm, tmp_path: Path) -> None:
    proc = _all_reduce(slurm, tmp_path, "accl", LAUNCHER="mpiexec")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    log = job_log(proc)
    assert log.count("# Out of bounds values : 0 OK") == 1
    assert "# torchhpc all_reduce_test: backend accl, 2 ranks, device cpu, launcher openmpi" in log
    # a core each: from the node's topology where the job holds the node whole (2 ranks of a core on 2 cores)
    maps = " -x TORCHHPC_CPU_MAP -x TORCHHPC_GPU_MAP" if WHOLE_NODE else ""
    assert f"+ mpiexec -n 2 --map-by ppr:2:node:PE=1 --bind-to core --mca mpi_yield_when_idle 1{maps} python" in log


def test_test_slurm_with_srun_pmix(slurm: Slurm, tmp_path: Path) -> None:
    proc = _all_reduce(slurm, tmp_path, "accl", LAUNCHER="srun", SRUN_MPI="pmix")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    log = job_log(proc)
    bind = "--cpu-bind=mask_cpu:0x1\\,0x2" if WHOLE_NODE else "--cpu-bind=cores"  # the log quotes as bash does
    assert (f"+ srun --mpi=pmix --nodes 1 --ntasks-per-node 2 -n 2 --cpus-per-task 1 {bind} "
            "--export=ALL\\,OMPI_MCA_mpi_yield_when_idle=1 python") in log
    assert log.count("# Out of bounds values : 0 OK") == 1


def test_srun_pmi2_with_open_mpi_5_fails_clearly(slurm: Slurm, tmp_path: Path) -> None:
    """Open MPI 5 has no PMI-2 client: under `srun --mpi=pmi2` every rank is a singleton; the launcher says so."""
    proc = _all_reduce(slurm, tmp_path, "accl", LAUNCHER="srun", SRUN_MPI="pmi2")
    assert proc.returncode != 0
    assert "says rank 1 of 2 but MPI_COMM_WORLD is rank 0 of 1" in job_log(proc)


def test_failing_test_job_returns_nonzero_and_shows_why(slurm: Slurm, tmp_path: Path) -> None:
    # The pip torch has no MPI backend: the job must fail, and its log must say so.
    proc = _all_reduce(slurm, tmp_path, "mpi", LAUNCHER="mpiexec")
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert "backend 'mpi' needs a PyTorch built with MPI" in job_log(proc)
    assert "finished: FAILED, exit status 1" in proc.stderr


@pytest.mark.skipif(shutil.which("git") is None, reason="git not installed")
def test_build_target_runs_under_sbatch(slurm: Slurm, tmp_path: Path) -> None:
    """`make build-pytorch-v2.5.1-slurm`: the real build target in a Slurm job, stopped after the patches."""
    upstream = tagged_upstream(tmp_path / "upstream", "v2.5.1")
    proc = run(slurm, tmp_path, ["make", "--no-print-directory", "build-pytorch-v2.5.1-slurm"],
               PYTORCH_GIT=f"file://{upstream}", CUDA_HOME=str(tmp_path / "nocuda"), ENV_KIND="venv",
               TORCHHPC_VENV_ARGS="--without-pip", STOP_AFTER="patches", SLURM_CPUS_BUILD="1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "STOP_AFTER=patches: stopping here" in proc.stdout, "the job's log is shown"
    patched = (tmp_path / "build/src/pytorch-v2.5.1" / PG_MPI).read_text()
    assert "MPIX_GPU_query_support(MPIX_GPU_SUPPORT_CUDA" in patched
    script = (tmp_path / f"build/jobs/{USER}/torchhpc-build-v2.5.1.slurm").read_text()
    assert "#SBATCH --time=04:00:00" in script and "\nmake build-pytorch-v2.5.1 SITE=generic" in script
