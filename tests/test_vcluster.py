"""Every runtime path across nodes, on a 4-node virtual cluster (utils/vcluster/vcluster.sh, `make cluster-up`).

Each node is a network + UTS + mount namespace of this host (its own hostname, /tmp, /dev/shm, an address on a
veth behind a bridge) with a real Slurm across them.  Jobs are launched as users launch: `mpiexec --host ...`
or `--hostfile` (the cluster's `ssh` enters the node), `srun --mpi=pmix` and `mpiexec` inside `sbatch -N 2`.
Ranks on different nodes share no memory, so everything between them crosses the bridge over TCP.  The
module skips, saying why, where the cluster cannot be built (not root, no Slurm, no network namespaces).
"""

from __future__ import annotations

import json
import os
import pwd
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from _mpijob import STACKS_MARGIN, inner_pytest_argv
from _upstream import tagged_upstream
from _vcluster import (
    RANK_ENV,
    RESUME_EVERY,
    RESUME_STEPS,
    ROOT,
    VCLUSTER,
    Cluster,
    check_rehearsal_jobs,
    check_submit,
    check_thread_budget,
    cluster_up,
    readme_knobs,
    restart_trial,
    site_env_over,
    uninterrupted_digest,
)
from test_readme import readme_cluster_lines

from torchhpc.runtime.mpirun import side_mpich

USER = pwd.getpwuid(os.geteuid()).pw_name  # job scripts and logs go to build/jobs/<user>

NODES = 4
pytestmark = pytest.mark.full("the virtual cluster under Slurm")
PYTHON = "python"  # the venv's, first on the nodes' PATH


def launch(cluster: Cluster, how: str, layout: list[int], argv: list[str], mpi: str = "openmpi",
           extra_env: dict[str, str] | None = None, rank_env: dict[str, str] = RANK_ENV) -> str:
    """The shell command that starts ``argv`` with ``layout[i]`` ranks on node i+1, as a user types it.
    Host files and job scripts are written to the shared file system, as a user would."""
    n = sum(layout)
    placed = [(f"node{i + 1}", k) for i, k in enumerate(layout) if k]
    cmd = shlex.join(argv)
    forward = " ".join(f"-x {v}" for v in sorted({*rank_env, *(extra_env or {})}))  # Open MPI forwards only these
    tag = f"{how}-{os.getpid()}-{time.monotonic_ns()}"
    if how == "mpiexec":
        spec = ",".join(f"{h}:{k}" for h, k in placed)
        if mpi == "openmpi":
            return f"mpiexec --host {spec} -n {n} {forward} {cmd}"
        return f"{side_mpich_exe()} -hosts {spec} -n {n} {cmd}"
    if how == "hostfile":  # a PBS-style node file: one line per MPI process
        nodefile = cluster.shared / f"{tag}.nodes"
        nodefile.write_text("".join(f"{h}\n" * k for h, k in placed))
        if mpi == "openmpi":
            return f"mpiexec --hostfile {nodefile} -n {n} {forward} {cmd}"
        return f"{side_mpich_exe()} -f {nodefile} -n {n} {cmd}"
    if how == "srun":
        if len({k for _, k in placed}) == 1:
            return f"srun --mpi=pmix -N {len(placed)} --ntasks-per-node={placed[0][1]} -O {cmd}"
        nodelist = ",".join(h for h, k in placed for _ in range(k))
        return f"srun --mpi=pmix -n {n} -m arbitrary -w {nodelist} -O {cmd}"
    if how == "sbatch":  # mpiexec inside a batch job: it reads the allocation, nothing else
        script = cluster.shared / f"{tag}.sh"
        script.write_text(f"#!/bin/bash\nmpiexec -n {n} {forward} {cmd}\n")
        out = cluster.shared / f"{tag}.out"
        return (f"sbatch -W -N {len(placed)} --ntasks-per-node={placed[0][1]} -O -o {out} {script}; "
                f"rc=$?; cat {out}; exit $rc")
    raise ValueError(f"unknown launch {how!r}")


def side_mpich_exe() -> str:
    root = side_mpich()
    if root is None:
        pytest.skip("no MPICH: `make env` puts the pinned mpich wheel's files in $VENV/mpich")
    return f"env MPI4PY_LIBMPI={root}/lib/libmpi.so.12 {root}/bin/mpiexec"


def mpi_suite(cluster: Cluster, how: str, layout: list[int], target: str, timeout: float = 300,
              mpi: str = "openmpi", extra: tuple[str, ...] = (), env: dict[str, str] | None = None) -> str:
    """Run a tests/mpi pytest target on every rank across the cluster; every rank's tests must pass."""
    argv = [PYTHON, *inner_pytest_argv(str(ROOT / "tests" / "mpi" / target))[1:], *extra]
    stacks_at = time.time() + timeout - min(STACKS_MARGIN, 0.3 * timeout)
    job_env = {**RANK_ENV, "TORCHHPC_TEST_STACKS_AT": f"{stacks_at:.1f}",
               "TORCHHPC_TEST_SHARED_DIR": str(cluster.shared), **(env or {})}
    out = cluster.ok(launch(cluster, how, layout, argv, mpi, job_env), timeout=timeout, env=job_env)
    assert re.search(r"\d+ passed", out), out[-5000:]
    placed = Counter(re.findall(r"TORCHHPC-RANK-MAP rank=\d+ .*host=(\S+)", out))
    assert placed == Counter({f"node{i + 1}": k for i, k in enumerate(layout) if k}), placed
    return out


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with cluster_up(NODES, "slurm") as up:
        yield up


# ---- the nodes ---------------------------------------------------------------------------------------------


def test_nodes_are_separate_hosts_on_one_network(cluster: Cluster) -> None:
    out = cluster.ok("sinfo -h -N -o '%N %T'; for n in node1 node2 node3 node4; do ssh $n 'echo $(hostname) "
                     "$(ip -4 -br addr show eth0) $(stat -c %d /dev/shm)'; done")
    assert sorted(re.findall(r"^(node\d) idle$", out, re.MULTILINE)) == [f"node{i}" for i in range(1, 5)], out
    seen = re.findall(r"^(node\d) eth0(?:@\w+)? +UP +10\.212\.0\.(\d)/24 (\d+)$", out, re.MULTILINE)
    assert [(h, int(a)) for h, a, _ in seen] == [(f"node{i}", i) for i in range(1, 5)], out
    assert len({dev for _, _, dev in seen}) == 4, "each node has a /dev/shm of its own"
    # node-local memory is private; the project's file system is shared
    cluster.ok("echo one > /dev/shm/torchhpc-vc-probe && echo shared > $TORCHHPC_VCLUSTER/shared/probe")
    out = cluster.ok("ssh node2 'ls /dev/shm; cat $TORCHHPC_VCLUSTER/shared/probe'; rm /dev/shm/torchhpc-vc-probe")
    assert "torchhpc-vc-probe" not in out and "shared" in out
    # a node reaches the others over the bridge, by name: node4's slurmd listens on node4's own address
    probe = "import socket; s = socket.create_connection(('node4', 6818), 5); print('PEER', s.getpeername()[0])"
    assert "PEER 10.212.0.4" in cluster.ok(f'python -c "{probe}"')


@pytest.mark.parametrize("mpi", ["openmpi", "mpich"])
def test_no_path_between_nodes_beats_the_shaped_link(cluster: Cluster, mpi: str) -> None:
    """At 200 Mbit/s (tc's token bucket on every node's veth), two-sided and one-sided MPI between two nodes
    move at most the link's rate: nothing reaches another node's memory except through the network."""
    limit = 200e6 / 8 / 1e9  # GB/s
    shaped = subprocess.run(["bash", str(VCLUSTER), "link", "200mbit"], capture_output=True, text=True)
    assert shaped.returncode == 0, shaped.stderr
    try:
        out = cluster.ok(launch(cluster, "mpiexec", [1, 1], [PYTHON, str(ROOT / "tests/vcluster/link_rates.py")],
                                mpi), env=RANK_ENV)
    finally:
        subprocess.run(["bash", str(VCLUSTER), "link", "none"], capture_output=True, check=True)
    rates = {k: float(v) for k, v in re.findall(r"(\w+)=([\d.]+)", out.split("RATES ", 1)[1])}
    assert set(rates) == {"sendrecv", "get", "put"}, out
    for path, gbs in rates.items():
        assert gbs <= 1.1 * limit, f"{mpi} {path} at {gbs:.4f} GB/s beats the {limit:.4f} GB/s link: a bypass"
    assert rates["sendrecv"] >= 0.5 * limit, f"shaping or the link is broken: {rates}"


# ---- launcher facts: every rank's local rank / local size / node count, under each launcher ----------------

LAUNCHES = [
    ("mpiexec", [2, 2], "openmpi", "openmpi"),
    ("mpiexec", [1, 1, 1, 1], "openmpi", "openmpi"),
    ("mpiexec", [3, 1], "openmpi", "openmpi"),
    ("hostfile", [2, 2], "openmpi", "openmpi"),
    ("mpiexec", [2, 2], "mpich", "mpich"),
    ("hostfile", [3, 1], "mpich", "mpich"),
    ("srun", [2, 2], "openmpi", None),
    ("srun", [3, 1], "openmpi", None),
    ("sbatch", [2, 2], "openmpi", "openmpi"),
]


# what a user's shell has: no OMP_NUM_THREADS, so the launcher's binding and torchhpc's budget decide
USER_ENV = {"PYTHONPATH": str(ROOT / "tests")}
_WHOAMI: dict[tuple[str, str, str], list[dict]] = {}


def whoami(cluster: Cluster, how: str, layout: list[int], mpi: str) -> list[dict]:
    """Every rank's record (tests/vcluster/whoami.py) of one launch from a user's shell, by rank; launched once and
    shared by the launcher-facts and thread-budget tests, which read the same job."""
    key = (how, "+".join(map(str, layout)), mpi)
    if key not in _WHOAMI:
        out = cluster.ok(launch(cluster, how, layout, [PYTHON, str(ROOT / "tests/vcluster/whoami.py")], mpi,
                                rank_env=USER_ENV), env=USER_ENV)
        ranks = [json.loads(line[len("WHOAMI "):]) for line in out.splitlines() if line.startswith("WHOAMI ")]
        assert len(ranks) == sum(layout), out
        _WHOAMI[key] = sorted(ranks, key=lambda r: r["rank"])
    return _WHOAMI[key]


LAUNCH_IDS = [f"{h}-{m}-{'+'.join(map(str, lay))}" for h, lay, m, _ in LAUNCHES]


@pytest.mark.parametrize(("how", "layout", "mpi", "launcher"), LAUNCHES, ids=LAUNCH_IDS)
def test_launcher_facts_across_nodes(cluster: Cluster, how: str, layout: list[int], mpi: str,
                                     launcher: str | None) -> None:
    ranks = whoami(cluster, how, layout, mpi)
    n = sum(layout)
    assert [r["rank"] for r in ranks] == list(range(n)), ranks
    per_host = Counter(r["host"] for r in ranks)
    assert sorted(per_host.values(), reverse=True) == sorted((k for k in layout if k), reverse=True), per_host
    for r in ranks:
        mates = sorted(x["rank"] for x in ranks if x["host"] == r["host"])
        assert (r["info_rank"], r["info_size"]) == (r["rank"], n), r
        assert r["local_size"] == len(mates) == r["mpi_local_size"], (r, mates)
        assert r["mpi_nodes"] == len(per_host), r
        if launcher is not None:
            assert r["launcher"] == launcher, r
    for host in per_host:  # local ranks on each node are 0..k-1, each once
        assert sorted(r["local_rank"] for r in ranks if r["host"] == host) == list(range(per_host[host]))
        assert len({r["shm_dev"] for r in ranks if r["host"] == host}) == 1
    assert len({r["shm_dev"] for r in ranks}) == len(per_host), "nodes must not share /dev/shm"
    assert {r["mpi"].split()[0] for r in ranks} == {"MPICH" if mpi == "mpich" else "Open"}


@pytest.mark.parametrize(("how", "layout", "mpi", "launcher"), LAUNCHES, ids=LAUNCH_IDS)
def test_one_thread_budget_per_rank_under_every_launcher(cluster: Cluster, how: str, layout: list[int], mpi: str,
                                                         launcher: str | None) -> None:
    """Without OMP_NUM_THREADS, whatever the launcher binds: no node runs more torch threads than it has CPUs
    (one per rank at least), a rank alone with CPUs of its own uses them all, and the ranks say why."""
    check_thread_budget(whoami(cluster, how, layout, mpi))


EXAMPLES = {"rehearsal": ["examples/continual_digits.py"],
            "chunkstore": ["examples/graphsage_chunkstore.py", "--nodes", "20000"]}


@pytest.mark.parametrize("example", sorted(EXAMPLES))
def test_examples_take_about_as_long_under_srun_as_under_mpiexec(cluster: Cluster, example: str) -> None:
    """Two ranks on one node, from a user's shell (no OMP_NUM_THREADS): under srun (each rank bound to its core by
    Slurm's task/affinity, whose step overcommitted with -O would put both on one core) the examples are no slower
    than under mpiexec beyond noise (before the thread budget, when srun left every rank the whole node: 93-100 s
    against 6.6 s for the rehearsal example)."""
    argv = shlex.join([PYTHON, *(str(ROOT / a) if a.endswith(".py") else a for a in EXAMPLES[example])])
    took = {}
    for how, cmd in (("mpiexec", f"mpiexec --host node1:2 -n 2 -x PYTHONPATH {argv}"),
                     ("srun", f"srun --mpi=pmix -N 1 --ntasks-per-node=2 -w node1 {argv}")):
        start = time.monotonic()
        cluster.ok(cmd, env=USER_ENV, timeout=300)
        took[how] = time.monotonic() - start
    assert took["srun"] <= 1.5 * took["mpiexec"] + 3, took


# ---- accl across nodes --------------------------------------------------------------------------------------


def test_accl_conformance_across_two_nodes(cluster: Cluster) -> None:
    mpi_suite(cluster, "mpiexec", [2, 2], "test_accl_conformance.py", timeout=300)


def test_accl_conformance_subset_across_four_nodes(cluster: Cluster) -> None:
    mpi_suite(cluster, "mpiexec", [1, 1, 1, 1], "test_accl_conformance.py", timeout=300,
              extra=("-k", "all_reduce or all_gather or reduce_scatter or all_to_all"))


def test_accl_conformance_subset_under_mpich_across_four_nodes(cluster: Cluster) -> None:
    mpi_suite(cluster, "mpiexec", [1, 1, 1, 1], "test_accl_conformance.py", mpi="mpich", timeout=300,
              extra=("-k", "all_reduce or broadcast or all_to_all or send"))


def test_accl_errors_and_monitored_barrier_across_two_nodes(cluster: Cluster) -> None:
    """Mismatches, timeouts and the monitored barrier with the missing rank on the other node."""
    mpi_suite(cluster, "mpiexec", [1, 1], "test_accl_async_errors.py", timeout=300)


ACCL_ROUND = ("import torch, torch.distributed as dist; from torchhpc.launcher import init_distributed; "
              "i = init_distributed(backend='accl', timeout=30); x = torch.full((1 << 16,), float(i.rank)); "
              "dist.all_reduce(x); assert x[0].item() == sum(range(i.world_size)); print('ACCL-OK', i.rank)")


def test_accl_traffic_between_nodes_is_tcp(cluster: Cluster) -> None:
    """Open MPI with shared memory disabled still passes; with TCP disabled the nodes cannot reach each other."""
    argv = [PYTHON, "-c", ACCL_ROUND]
    out = cluster.ok(launch(cluster, "mpiexec", [2, 2], argv, extra_env={"OMPI_MCA_btl": "self,tcp"}),
                     env={**RANK_ENV, "OMPI_MCA_btl": "self,tcp"})
    assert out.count("ACCL-OK") == 4, out
    proc = cluster.run(launch(cluster, "mpiexec", [1, 1], argv, extra_env={"OMPI_MCA_btl": "self,sm"}),
                       env={**RANK_ENV, "OMPI_MCA_btl": "self,sm"}, timeout=120)
    assert proc.returncode != 0 and "ACCL-OK" not in proc.stdout, proc.stdout
    assert "unable to reach each other" in proc.stdout or "unreachable" in proc.stdout.lower(), proc.stdout[-3000:]


def test_ddp_and_fsdp2_equal_gloo_and_serial_across_nodes(cluster: Cluster) -> None:
    mpi_suite(cluster, "mpiexec", [1, 1], "test_workloads_ddp.py", timeout=300)  # bitwise equal to gloo
    mpi_suite(cluster, "mpiexec", [2, 2], "test_workloads_mesh.py", timeout=300, extra=("-k", "fsdp2 or hsdp"))
    mpi_suite(cluster, "mpiexec", [2, 2], "test_accl_training.py", timeout=300)


# ---- chunkstore, rehearsal, braid -------------------------------------------------------------------------


def test_chunkstore_across_nodes(cluster: Cluster) -> None:
    """One host segment per node (each node's ranks share theirs), remote rows from the other node, GraphSAGE;
    under mpiexec --host and srun."""
    mpi_suite(cluster, "mpiexec", [2, 2], "test_chunkstore.py", timeout=300)
    mpi_suite(cluster, "mpiexec", [1, 1, 1, 1], "test_chunkstore.py", timeout=300)
    mpi_suite(cluster, "srun", [1, 1], "test_chunkstore.py", timeout=300)  # as a Slurm job's ranks start


def test_rehearsal_across_nodes_over_mpi_rma_and_thallium_tcp(cluster: Cluster) -> None:
    out = mpi_suite(cluster, "mpiexec", [2, 2], "test_rehearsal.py", timeout=300, extra=("-rs",))
    assert "SKIPPED" not in out, "both transports must run (thallium: `make native-mochi`)"
    probe = ("from mpi4py import MPI; from torchhpc.rehearsal.thallium import default_protocol; "
             "print('PROTOCOL', default_protocol(MPI.COMM_WORLD))")
    out = cluster.ok(launch(cluster, "mpiexec", [1, 1], [PYTHON, "-c", probe]), env=RANK_ENV)
    assert out.count("PROTOCOL ofi+tcp") == 2, out


def test_braid_across_nodes_equals_serial(cluster: Cluster) -> None:
    mpi_suite(cluster, "mpiexec", [1, 1, 1, 1], "test_braid.py", timeout=300)
    mpi_suite(cluster, "mpiexec", [2, 2], "test_braid.py", timeout=300, extra=("-k", "layer_parallel"))


# ---- the scheduler's view ----------------------------------------------------------------------------------


def test_make_test_slurm_prints_the_table_with_ranks_on_both_nodes(cluster: Cluster) -> None:
    env = {"SITE": "generic", "TORCHHPC_NO_ENV": "1", "SLURM_NODES_TEST": "2", "GPUS_PER_NODE": "2",
           "SLURM_CPUS_TEST": "1", "SLURM_GPUS_TEST": "0", "ALL_REDUCE_ARGS": "-e 64K -n 3 -w 1",
           "TORCHHPC_PREFIX": str(cluster.shared / "prefix"), "OMP_NUM_THREADS": "1"}
    out = cluster.ok("make --no-print-directory test-slurm BACKENDS=accl", timeout=300, env=env)
    log = Path(out.split("; log: ")[1].split()[0]).read_text() if "; log: " in out else out
    placed = re.findall(r"#  Rank +(\d) Pid +\d+ on +(node\d) device cpu", log)
    assert sorted(placed) == [("0", "node1"), ("1", "node1"), ("2", "node2"), ("3", "node2")], log
    assert "# Out of bounds values : 0 OK" in log, log


JOB_ENV = {"SITE": "generic", "TORCHHPC_NO_ENV": "1", "GPUS_PER_NODE": "2"}


@pytest.mark.parametrize("launcher", ["mpiexec", "srun"])
def test_jobscript_binds_each_rank_to_its_own_cores(cluster: Cluster, launcher: str) -> None:
    """2 nodes x 2 ranks through `torchhpc jobscript`: the launcher's binding flags put each rank of a node on its
    own core, as `torchhpc doctor --bindings --strict` reads them from Linux inside the job."""
    work = cluster.shared / f"bind-{launcher}"
    work.mkdir(exist_ok=True)
    out = cluster.ok(f"cd {work} && torchhpc jobscript --nodes 2 --ranks-per-node 2 --cpus 1 --walltime 00:05:00 "
                     f"--launcher {launcher} --name bind --submit -- python -m torchhpc doctor --bindings --strict",
                     timeout=300, env={"SITE": "generic", "TORCHHPC_PREFIX": str(work / "prefix")})
    assert "finished: COMPLETED, exit status 0" in out and "4 rank(s), each placed apart" in out, out
    placed = re.findall(r"rank (\d) +(node\d) +cores (\S+)", out)
    assert sorted(placed) == [("0", "node1", "0"), ("1", "node1", "1"), ("2", "node2", "0"), ("3", "node2", "1")], out
    log = Path(out.split("; log: ")[1].split()[0]).read_text()
    assert "bound: from the node's topology (sysfs): cores 0 | 1" in log, log


@pytest.mark.parametrize("launcher", ["mpiexec", "srun"])
def test_jobscript_runs_a_training_example_with_its_ranks_where_asked(cluster: Cluster, launcher: str) -> None:
    """`torchhpc jobscript --submit` from a user's directory: 2 nodes x 2 ranks of the rehearsal example under
    Slurm, started by the site's launcher (or srun), each node holding two ranks; the job's log is shown."""
    work = cluster.shared / f"jobscript-{launcher}"
    work.mkdir(exist_ok=True)
    # as a user with the README's .venv active: no site environment, no GPU count given
    env = {"SITE": "generic", "TORCHHPC_PREFIX": str(work / "prefix")}
    shutil.rmtree(work / "ckpt", ignore_errors=True)
    out = cluster.ok(f"cd {work} && torchhpc jobscript --nodes 2 --ranks-per-node 2 --cpus 1 "
                     f"--walltime 00:10:00 --launcher {launcher} --submit -- "
                     f"python {ROOT}/examples/train.py --steps 40 --every 20 --ckpt {work}/ckpt", timeout=300, env=env)
    assert "done: 40 steps" in out and "finished: COMPLETED, exit status 0" in out, out
    assert (work / "ckpt" / "step-00000040").is_dir(), sorted(p.name for p in (work / "ckpt").iterdir())
    log = Path(out.split("; log: ")[1].split()[0]).read_text()
    assert "ranks on hosts: 0:node1 1:node1 2:node2 3:node2" in log, log
    assert f"2 node(s) x 2 rank(s) with {launcher} in {work}" in log, log


def test_rehearsal_example_jobs_in_the_shapes_users_run(cluster: Cluster) -> None:
    """The rehearsal example as Slurm jobs: 2 nodes x 2 ranks bound to a core each over Thallium and over MPI,
    and 2 x 1 x 2 cores on the default transport."""
    check_rehearsal_jobs(cluster)


def test_submit_runs_python_functions_on_slurm(cluster: Cluster) -> None:
    """torchhpc.submit from a Python session on the login node: training on 2 nodes, an error re-raised with its
    rank's traceback, cancel, a walltime hit that checkpoints and requeues, 20 calls through map_array."""
    check_submit(cluster, array=20, walltime_kill=True)


def test_the_readme_cluster_lines_run_as_typed(cluster: Cluster) -> None:
    """README's block with its Slurm lines, in one login shell: build (stopped after the patches), install,
    activate, the all-reduce table on both nodes, and a training job through `torchhpc jobscript`."""
    prefix = cluster.shared / "readme"
    shutil.rmtree(prefix, ignore_errors=True)
    upstream = tagged_upstream(prefix / "upstream", "v2.13.0")
    env_prefix = site_env_over(Path(sys.prefix), prefix / "site-env")
    lines = readme_cluster_lines("slurm", {"account": "acct1", "gpus": "vc", "scratch": str(prefix / "scratch")})
    knobs = {**readme_knobs(prefix / "build", upstream, env_prefix), "SLURM_CPUS_BUILD": "1",
             "SLURM_CPUS_TEST": "1", "SLURM_GPUS_TEST": "0", "SLURM_TIME_BUILD": "00:10:00"}
    out = cluster.ok("set -e; " + "; ".join(lines), timeout=600, env=knobs)
    assert "STOP_AFTER=patches: stopping here" in out and "installed in editable mode already; kept" in out, out
    assert out.count("finished: COMPLETED, exit status 0") == 3, out
    logs = {path.name: path.read_text() for path in (prefix / "build/jobs" / USER).glob("*.log")}
    table = next(text for name, text in logs.items() if name.startswith("torchhpc-test-all-reduce"))
    placed = re.findall(r"#  Rank +(\d) Pid +\d+ on +(node\d) device cpu", table)
    assert sorted(placed) == [("0", "node1"), ("1", "node1"), ("2", "node2"), ("3", "node2")], table
    training = next(text for name, text in logs.items() if name.startswith("train-"))
    assert "ranks on hosts: 0:node1 1:node1 2:node2 3:node2" in training, training
    assert "backend accl, device cpu" in training and "done: 200 steps" in training, training
    assert "#SBATCH --account=acct1" in (prefix / "build/jobs" / USER / "train.slurm").read_text()


NINJA_JOB = "for i in 1 2 3 4; do echo \"[$i/4] Building CXX object part$i.o\"; sleep 2; done; echo built"


def test_the_wait_shows_a_live_jobs_state_and_build_progress(cluster: Cluster) -> None:
    """A job printing ninja's lines: while it runs, the wait prints its state and the latest [N/M] as a %."""
    env = {**JOB_ENV, "TORCHHPC_PREFIX": str(cluster.shared / "progress"), "JOB_PROGRESS_EVERY": "0"}
    out = cluster.ok(f"bash utils/submit_job.sh --scheduler slurm --name ninja --shape build --cpus 1 -- "
                     f"bash -c {shlex.quote(NINJA_JOB)}", timeout=120, env=env)
    shown = re.findall(r"^\[\d+ RUNNING, ran \d\d:\d\d:\d\d\] (\d+)% \[\d/4\] Building", out, re.M)
    assert len(set(shown)) >= 2, out  # seen growing while the job ran, not only at its end
    assert "Ctrl-C deletes it" in out and "finished: COMPLETED, exit status 0" in out, out


def test_a_detached_job_is_followed_later_with_its_exit_status(cluster: Cluster) -> None:
    env = {**JOB_ENV, "TORCHHPC_PREFIX": str(cluster.shared / "detach")}
    start = time.monotonic()
    out = cluster.ok("DETACH=1 bash utils/submit_job.sh --scheduler slurm --name later --shape build --cpus 1 "
                     "-- bash -c 'sleep 4; echo the-end; exit 3'", timeout=60, env=env)
    assert time.monotonic() - start < 4 and "make job-wait JOB=later" in out, out
    proc = cluster.run("make --no-print-directory job-wait JOB=later", timeout=120, env=env)
    assert "the-end" in proc.stdout and "finished: FAILED, exit status 3" in proc.stdout, proc.stdout
    assert proc.returncode != 0 and "job-wait] Error 3" in proc.stdout, "make passes the job's status on"
    unknown = cluster.run("make --no-print-directory job-wait JOB=never", timeout=60, env=env)
    assert unknown.returncode != 0 and "no job named 'never' was submitted from here" in unknown.stdout


FAULT_TIMEOUT_S = 5.0


def records(cluster: Cluster, name: str) -> Path:
    """Where the survivors of the failure job ``name`` write their lines: files on the shared file system,
    which a scheduler ending the job cannot lose on the way (stdout passes through the launcher)."""
    return cluster.shared / f"{name}-survivors"


def start_failure_job(cluster: Cluster, name: str) -> tuple[str, Path]:
    """tests/vcluster/node_failure.py as a Slurm job, 2 ranks on each of node1 and node2, once every rank loops."""
    script = cluster.shared / f"{name}.sh"
    dumps = cluster.shared / f"{name}-fr"  # every rank's flight record, on the shared file system
    for d in (dumps, records(cluster, name)):
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir()
    script.write_text(f"#!/bin/bash\nexport TORCH_FR_DUMP_TEMP_FILE={dumps}/rank_\n"
                      f"mpiexec -n 4 -x PYTHONPATH -x OMP_NUM_THREADS -x TORCH_FR_DUMP_TEMP_FILE {PYTHON} "
                      f"{ROOT}/tests/vcluster/node_failure.py {FAULT_TIMEOUT_S} --record {records(cluster, name)}\n")
    out_file = cluster.shared / f"{name}.out"
    out_file.unlink(missing_ok=True)
    job = cluster.ok(f"sbatch --parsable -N 2 -w node1,node2 --ntasks-per-node=2 -O -o {out_file} {script}",
                     env=RANK_ENV).strip().splitlines()[-1]
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and (not out_file.exists() or out_file.read_text().count("LOOPING") < 4):
        time.sleep(0.5)
    assert out_file.exists() and out_file.read_text().count("LOOPING") == 4, cluster.logs()
    return job, out_file


def check_survivors(cluster: Cluster, job: str, out_file: Path, ended: tuple[str, ...]) -> list[tuple[str, ...]]:
    """After the fault on node2: both ranks of node1 raise torchhpc's error within the group timeout, without
    spinning through the wait, and the job ends in one of the states ``ended``.  Returns their records."""
    state = ""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        state = cluster.ok(f"scontrol show job {job} | grep -o 'JobState=[A-Z_]*'").strip()
        if state not in ("JobState=RUNNING", "JobState=COMPLETING", "JobState=PENDING"):
            break
        time.sleep(1)
    text = out_file.read_text()
    print(text)  # the job's output, for the record (pytest -s)
    lines = "".join(p.read_text() for p in sorted(records(cluster, out_file.stem).iterdir()))
    survivors = re.findall(r"SURVIVOR rank=(\d) host=(node1) after=([\d.]+)s cpu=([\d.]+)s family=(\w+) error=(.*)",
                           lines)
    assert sorted(r for r, *_ in survivors) == ["0", "1"], f"{state}\n{lines}\n{text}\n{cluster.logs()}"
    for _, _, after, cpu, family, error in survivors:
        assert family == "torchhpc", error
        assert float(after) <= FAULT_TIMEOUT_S + 5, f"took {after}s against a {FAULT_TIMEOUT_S}s timeout: {error}"
        assert float(cpu) <= 0.5 * float(after) + 0.5, f"spun: {cpu}s of CPU in a {after}s wait: {error}"
    assert state in ended, f"{state}\n{text}\n{cluster.logs()}"
    return survivors


def check_flight_records(dumps: Path, stopped: bool) -> None:
    """torch's analyzer (``torchhpc frtrace``) on the job's flight records.  Stopped ranks write nothing (no
    thread of theirs runs), and the analyzer names them; behind a cut link every rank lives and writes.  The entries
    show each rank inside one all_reduce, and no two ranks in different kinds of call: no rank diverged."""
    def frtrace(*args: str) -> str:
        proc = subprocess.run([sys.executable, "-m", "torchhpc", "frtrace", *args, str(dumps)], capture_output=True,
                              text=True, timeout=120)
        return proc.stdout + proc.stderr

    written = sorted(p.name for p in dumps.iterdir())
    if stopped:
        # Slurm ends a job by SIGCONT then SIGTERM (SIGKILL after KillWait): a stopped rank it wakes may write its own
        # record as it dies, after the survivors wrote theirs.  The analysis is of what the job held when it failed.
        assert {"rank_0", "rank_1"} <= set(written) <= {"rank_0", "rank_1", "rank_2", "rank_3"}, written
        survivors_done = max((dumps / r).stat().st_mtime for r in ("rank_0", "rank_1"))
        assert all((dumps / r).stat().st_mtime >= survivors_done for r in written if r in ("rank_2", "rank_3"))
        at_failure = dumps.with_name(dumps.name + "-at-failure")
        shutil.rmtree(at_failure, ignore_errors=True)
        at_failure.mkdir()
        for r in ("rank_0", "rank_1"):
            shutil.copy2(dumps / r, at_failure / r)
        dumps, written = at_failure, ["rank_0", "rank_1"]
    else:
        assert written == [f"rank_{r}" for r in range(4)], written
    analysis = frtrace()
    if stopped:
        assert "Missing dump files from ranks {2, 3}" in analysis, analysis
    else:
        # a call whose messages crossed before the cut may have completed on one side of it: the analyzer then
        # reports states ('started' against 'completed'), never different calls: no rank diverged
        assert set(re.findall(r"Error type: (\w+)", analysis)) <= {"COLLECTIVE_STATE_MISMATCH"}, analysis
    # every rank is inside exactly one all_reduce, not always the same one: a survivor may have finished the call
    # its peer still waits in (its share arrived before the fault) and be waiting in the next
    table = frtrace("-j", "--allow-incomplete-ranks")
    assert table.count("state=started") == len(written), table[-3000:]


@pytest.mark.parametrize("fault", ["stop", "cut"])
def test_a_silent_node_fails_every_survivor_in_time_and_the_job(cluster: Cluster, fault: str) -> None:
    """Node 2 goes silent while everything in it lives: its ranks are SIGSTOPped, or its link is cut.  Both
    ranks of node 1 raise torchhpc's error within the group timeout, one naming a silent rank, the job ends,
    and once node 2 answers again (SIGCONT, link up) a job across both nodes runs."""
    job, out_file = start_failure_job(cluster, f"silent-{fault}")
    vcluster = ["bash", str(VCLUSTER)]
    action, undo = {"stop": (["signal-node", "node2", "STOP", "node_failure.py"],
                             ["signal-node", "node2", "CONT", "node_failure.py"]),
                    "cut": (["cut-link", "node2"], ["restore-link", "node2"])}[fault]
    done = subprocess.run([*vcluster, *action], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    try:
        survivors = check_survivors(cluster, job, out_file,
                                    ("JobState=FAILED", "JobState=NODE_FAIL", "JobState=CANCELLED"))
    finally:
        subprocess.run([*vcluster, *undo], capture_output=True, text=True)
    # each survivor names the peer it was waiting on; that peer may be the other survivor, itself waiting (a
    # reduction's chain of waits), but the chain among the living ends at a silent rank: one survivor names it
    waited = [re.search(r"rank (\d) \(this rank was waiting on it\)", error) for *_, error in survivors]
    assert all(waited), f"a survivor names no peer: {survivors}"
    assert {m.group(1) for m in waited} & {"2", "3"}, f"no silent rank named: {survivors}"
    check_flight_records(cluster.shared / f"silent-{fault}-fr", stopped=fault == "stop")
    deadline = time.monotonic() + 90  # ReturnToService=2: node2 is back once its slurmd registers again
    while "idle" not in cluster.ok("sinfo -h -n node2 -o %T"):
        assert time.monotonic() < deadline, cluster.ok("sinfo -N") + cluster.logs()
        time.sleep(1)
    hosts = cluster.ok("srun -N 2 -w node1,node2 hostname", timeout=60).split()
    assert sorted(hosts) == ["node1", "node2"], hosts


def test_a_failed_node_fails_every_survivor_in_time_and_the_job(cluster: Cluster) -> None:
    """Node 2 is torn down in the middle of all-reduces (link cut, every process killed): both ranks of node 1
    raise torchhpc's error within the group timeout, and Slurm reports the job failed.  Then the node boots
    again (`vcluster.sh revive-node`): back in service, it runs a job across every node."""
    job, out_file = start_failure_job(cluster, "failure")
    killed = subprocess.run(["bash", str(VCLUSTER), "kill-node", "node2"], capture_output=True, text=True)
    assert killed.returncode == 0, killed.stderr
    check_survivors(cluster, job, out_file, ("JobState=FAILED", "JobState=NODE_FAIL"))
    revived = subprocess.run(["bash", str(VCLUSTER), "revive-node", "node2"], capture_output=True, text=True,
                             timeout=120)
    assert revived.returncode == 0, revived.stderr + cluster.logs()
    hosts = cluster.ok(f"srun -N {NODES} hostname", timeout=60).split()
    assert sorted(hosts) == [f"node{i + 1}" for i in range(NODES)], hosts


@pytest.fixture(scope="module")
def uninterrupted(cluster: Cluster) -> str:
    """The SHA-256 of the final parameters of examples/resumable_training.py on 2 nodes, never stopped."""
    return uninterrupted_digest(cluster)


def test_a_lost_node_is_replaced_by_a_spare_in_place(cluster: Cluster, uninterrupted: str) -> None:
    """`torchhpc jobscript --nodes 2 --spare-nodes 1`: 3 nodes, the training on 2.  One of the step's nodes is
    torn down after the second checkpoint; the job lives on (--no-kill), the supervisor finds the node silent and
    starts the step again at once on the spare, which resumes from the checkpoint and ends with the parameters of
    a run never stopped, bit for bit; the job completes without the scheduler's requeue."""
    trial = restart_trial(cluster, "in-place", "spare-test")
    text, victim = trial["log"], trial["victim"]
    print(f"RECOVERY in place: {trial['recovery_s']:.1f} s from the fault to the resumed step")
    assert trial["state"] == "COMPLETED", f"{trial['state']}\n{text[-5000:]}\n{cluster.logs()}"
    assert f"node(s) {victim} stopped answering" in text and "restarting in place without them" in text, text
    second = re.findall(r"on (node\d) (node\d) \(spare: 0; lost: (node\d)\)", text)
    assert len(second) == 1 and victim not in second[0][:2] and second[0][2] == victim, text[-5000:]
    assert 2 * RESUME_EVERY <= trial["resumed_at"] < RESUME_STEPS, text[-5000:]
    assert trial["digest"] == uninterrupted, text[-5000:]


def test_a_requeued_job_resumes_from_its_checkpoint_bitwise_equal(cluster: Cluster, uninterrupted: str) -> None:
    """examples/resumable_training.py under `sbatch --requeue` on 2 nodes: its second node is torn down (link cut,
    every process killed) after the second checkpoint; Slurm ends the run NODE_FAIL and requeues it on the nodes
    left, where it resumes from its newest finished checkpoint and ends with the parameters of a run never stopped,
    bit for bit.  Takes down one of the job's nodes."""
    trial = restart_trial(cluster, "requeue", "requeue-test", revive=False)
    text = trial["log"]
    print(f"RECOVERY by requeue: {trial['recovery_s']:.1f} s from the fault to the resumed step")
    assert trial["state"] == "COMPLETED", f"{trial['state']}\n{text[-5000:]}\n{cluster.logs()}"
    assert "(SLURM_RESTART_COUNT=1)" in text and 2 * RESUME_EVERY <= trial["resumed_at"] < RESUME_STEPS, text
    assert trial["digest"] == uninterrupted, text[-5000:]


def test_cluster_up_is_idempotent_repairs_and_cleans_up_after_a_failed_start(cluster: Cluster) -> None:
    """Runs after the node failure: `up` rebuilds the broken cluster, keeps a healthy one, and a bring-up that
    fails removes everything it made; `make cluster-exec` runs on node1 as a login shell."""
    env = {**os.environ, "VENV": sys.prefix}

    def up(n: int, **extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["bash", str(VCLUSTER), "up", str(n)], capture_output=True, text=True, timeout=180,
                              env={**env, **extra})

    repaired = up(2)
    assert repaired.returncode == 0 and "up: 2 nodes" in repaired.stderr, repaired.stderr
    kept = up(2)
    assert kept.returncode == 0 and "already up: 2 nodes" in kept.stderr, kept.stderr
    out = subprocess.run(["make", "--no-print-directory", "cluster-exec", "CMD=hostname; pwd; sinfo -h -o %D"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60).stdout.split()
    assert out == ["node1", str(ROOT), "2"], out
    subprocess.run(["bash", str(VCLUSTER), "down"], check=True, capture_output=True, timeout=120)
    bad = up(2, VCLUSTER_SUBNET="999.1.1")  # no such address: the bring-up fails part-way, at the first node
    assert bad.returncode != 0 and "bring-up failed" in bad.stderr, bad.stderr
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "torchhpc-" not in left and not cluster.state.exists(), left
    assert up(0).returncode != 0 and "NODES must be a whole number" in up(0).stderr
