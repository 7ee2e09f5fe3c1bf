"""The PBS targets end to end on a real OpenPBS across a 3-node virtual cluster (`make cluster-up SCHEDULER=pbs`).

OpenPBS is built once from the pinned commit (utils/vcluster/build_openpbs.sh; the vendor archive in CI); node1
runs the server, scheduler, comm and a mom, node2 and node3 a mom each (node3: the spare of 2-node jobs); output
comes back through the moms' `$usecp` to the shared file system, as on a site.  Every job goes through the real
`qsub`, is deleted with the real `qdel`, and its exit status comes from PBS's own job record (`qstat -x`).  The
module skips, saying why, where the cluster or OpenPBS cannot be built or started here.
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
from _upstream import PG_MPI, tagged_upstream
from _vcluster import (
    DIGEST,
    RANK_ENV,
    RESUME_EVERY,
    RESUME_STEPS,
    ROOT,
    Cluster,
    check_rehearsal_jobs,
    check_submit,
    check_thread_budget,
    cluster_up,
    readme_knobs,
    site_env_over,
    start_openpbs_build,
    train_command,
    wait_for_line,
)
from test_readme import readme_cluster_lines

from torchhpc.runtime.mpirun import side_mpich

USER = pwd.getpwuid(os.geteuid()).pw_name  # job scripts and logs go to <prefix>/jobs/<user>

SUBMIT = "bash utils/submit_job.sh --scheduler pbs --shape build --select 1:ncpus=1"


# node1 and node2 run the jobs; node3 is the spare of the 2-node jobs that restart in place
NODES = 3
pytestmark = pytest.mark.full("the virtual cluster under OpenPBS")


def start_in_background(items: list[pytest.Item]) -> None:
    """OpenPBS is built beside the tests that run before these (tests/_background.py)."""
    start_openpbs_build()


@pytest.fixture(scope="module")
def pbs() -> Iterator[Cluster]:
    # the first bring-up in a fresh checkout builds OpenPBS (about 2-3 minutes on 2 cores)
    with cluster_up(NODES, "pbs", timeout=900) as up:
        yield up


@pytest.fixture()
def prefix(pbs: Cluster, request: pytest.FixtureRequest) -> Path:
    """A TORCHHPC_PREFIX of the test's own on the shared file system (job scripts and logs land there)."""
    path = pbs.shared / request.node.name
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def _log(jobs: Path, name: str) -> str:
    """The log of the one job named ``name`` under ``jobs``: ``<user>/<name>-<PBS job id>.log``."""
    found = sorted((jobs / USER).glob(f"{name}-*.log"))
    assert len(found) == 1, f"logs of {name} in {jobs / USER}: {found}"
    return found[0].read_text()


def submit(pbs: Cluster, prefix: Path, command: str, name: str = "t", timeout: float = 120,
           **env: str) -> tuple[int, str]:
    """`utils/submit_job.sh` on node1 for a build-shaped job running ``command``: exit status and console."""
    proc = pbs.run(f"{SUBMIT} --name {name} --walltime {env.pop('WALLTIME', '00:05:00')} -- {command}",
                   timeout=timeout, env={"SITE": "generic", "TORCHHPC_NO_ENV": "1",
                                         "TORCHHPC_PREFIX": str(prefix), **env})
    return proc.returncode, proc.stdout


def job_id(console: str) -> str:
    return console.split(" as PBS job ")[1].split()[0]


def qstat_x(pbs: Cluster, job: str) -> dict[str, str]:
    """PBS's record of a job (job history is on): its attributes by name."""
    out = pbs.ok(f"qstat -x -f -F json {job}")
    return json.loads(out)["Jobs"][job]


# ---- the server and its nodes --------------------------------------------------------------------------------


def test_every_mom_is_free_and_cluster_up_is_idempotent(pbs: Cluster) -> None:
    count = NODES
    nodes = json.loads(pbs.ok("pbsnodes -a -F json"))["nodes"]
    assert sorted(nodes) == [f"node{i + 1}" for i in range(count)], nodes
    assert {n["state"] for n in nodes.values()} == {"free"}, nodes
    assert "acl_roots = root" in pbs.ok("qmgr -c 'list server'")
    kept = subprocess.run(["make", "--no-print-directory", "cluster-up", "SCHEDULER=pbs", f"NODES={count}",
                           f"VENV={sys.prefix}"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert kept.returncode == 0 and f"already up: {count} nodes, pbs" in kept.stderr, kept.stderr


# ---- submit_job.sh through the real qsub --------------------------------------------------------------------


def test_job_that_succeeds_comes_back_with_its_log(pbs: Cluster, prefix: Path) -> None:
    rc, out = submit(pbs, prefix, "bash -c 'echo hello from $PBS_JOBID on $(hostname) pyenv=${PYENV_ROOT:-unset}'")
    assert rc == 0, out
    job = job_id(out)
    log = _log(prefix / "jobs", "t")
    assert f"hello from {job} on node1" in log, log
    # The job's login shell read the cluster's profile, not this host's ~/.bashrc (whose pyenv init takes a
    # lock that a job deleted mid-login leaves behind, stalling every later login).
    assert "pyenv=unset" in log, log
    assert f"hello from {job}" in out, "the log is shown"
    assert f"(PBS job {job}) finished: exit status 0" in out
    script = (prefix / "jobs" / USER / "t.pbs").read_text().splitlines()
    assert script[0] == "#!/bin/bash -l" and "#PBS -l select=1:ncpus=1" in script, script
    assert qstat_x(pbs, job)["Exit_status"] == 0


def test_job_that_fails_returns_its_status_and_shows_its_log(pbs: Cluster, prefix: Path) -> None:
    rc, out = submit(pbs, prefix, "bash -c 'echo about to fail >&2; exit 3'")
    assert rc == 3, out
    assert "failed: exit status 3" in out and "about to fail" in out, out


def test_qdel_of_a_running_job_says_so(pbs: Cluster, prefix: Path) -> None:
    """The job is deleted from another shell while it runs: the submission ends with 130 and says why."""
    script = (f"{SUBMIT} --name t --walltime 00:05:00 -- sleep 300 & "
              "for _ in $(seq 100); do j=$(qselect -N t -s R); [ -n \"$j\" ] && break; sleep 0.2; done; "
              "qdel $j; wait $!")
    proc = pbs.run(script, timeout=120, env={"SITE": "generic", "TORCHHPC_NO_ENV": "1",
                                             "TORCHHPC_PREFIX": str(prefix)})
    assert proc.returncode == 130, proc.stdout
    job = job_id(proc.stdout)
    assert f"PBS job {job} was deleted (qdel" in proc.stdout, proc.stdout
    assert qstat_x(pbs, job)["job_state"] == "F"


def test_wait_deadline_deletes_the_job(pbs: Cluster, prefix: Path) -> None:
    t0 = time.monotonic()
    rc, out = submit(pbs, prefix, "sleep 300", JOB_WAIT_TIMEOUT="2")
    assert rc != 0 and "gave up on PBS job" in out and "it was deleted (qdel)" in out, out
    assert time.monotonic() - t0 < 60
    assert qstat_x(pbs, job_id(out))["job_state"] in ("E", "F")


def test_walltime_kill_says_so(pbs: Cluster, prefix: Path) -> None:
    rc, out = submit(pbs, prefix, "sleep 300", WALLTIME="00:00:03")
    assert rc == 124, out
    assert "hit its walltime (00:00:03) and was killed" in out and "job killed: walltime" in out, out


def test_knobs_reach_the_job(pbs: Cluster, prefix: Path) -> None:
    """PBS starts jobs in a fresh login shell: the variables a user sets for make must still reach the job."""
    rc, out = submit(pbs, prefix, "bash -c 'echo knob=$STOP_AFTER python=$(command -v python)'",
                     STOP_AFTER="patches")
    assert rc == 0, out
    log = _log(prefix / "jobs", "t")
    assert "knob=patches" in log and f"python={sys.prefix}/bin/python" in log, log


NINJA_JOB = "for i in 1 2 3 4; do echo \"[$i/4] Building CXX object part$i.o\"; sleep 2; done; echo built"


def test_the_wait_shows_a_live_jobs_state_and_build_progress(pbs: Cluster, prefix: Path) -> None:
    """PBS copies a job's output back only at its end: the job writes its log itself, so the wait can show
    the job's state and the latest ninja [N/M] as a percentage while it runs."""
    rc, out = submit(pbs, prefix, f"bash -c {shlex.quote(NINJA_JOB)}", JOB_PROGRESS_EVERY="0")
    assert rc == 0, out
    shown = re.findall(r"^\[\S+ R, ran \d\d:\d\d:\d\d\] (\d+)% \[\d/4\] Building", out, re.M)
    assert len(set(shown)) >= 2, out  # seen growing while the job ran, not only at its end
    assert "Ctrl-C deletes it" in out and "finished: exit status 0" in out, out


def test_a_detached_job_is_followed_later_with_its_exit_status(pbs: Cluster, prefix: Path) -> None:
    start = time.monotonic()
    rc, out = submit(pbs, prefix, "bash -c 'sleep 4; echo the-end; exit 3'", name="later", DETACH="1")
    assert rc == 0 and time.monotonic() - start < 4 and "make job-wait JOB=later" in out, out
    env = {"SITE": "generic", "TORCHHPC_NO_ENV": "1", "TORCHHPC_PREFIX": str(prefix)}
    proc = pbs.run("bash utils/submit_job.sh --attach later", timeout=120, env=env)
    assert proc.returncode == 3 and "the-end" in proc.stdout, proc.stdout
    assert "PBS job" in proc.stdout and "failed: exit status 3" in proc.stdout, proc.stdout


def test_jobscript_binds_each_rank_to_its_own_cores(pbs: Cluster, prefix: Path) -> None:
    """2 nodes x 2 ranks under qsub: mpiexec's binding flags put each rank of a node on its own core, as
    `torchhpc doctor --bindings --strict` reads them from Linux inside the job."""
    out = pbs.ok(f"cd {prefix} && torchhpc jobscript --scheduler pbs --nodes 2 --ranks-per-node 2 --cpus 1 "
                 "--walltime 00:05:00 --name bind --submit -- python -m torchhpc doctor --bindings --strict",
                 timeout=300, env={"SITE": "generic", "TORCHHPC_PREFIX": str(prefix)})
    assert "finished: exit status 0" in out and "4 rank(s), each placed apart" in out, out
    placed = re.findall(r"rank (\d) +(node\d) +cores (\S+)", out)
    assert sorted(placed) == [("0", "node1", "0"), ("1", "node1", "1"), ("2", "node2", "0"), ("3", "node2", "1")], out
    assert "bound: from the node's topology (sysfs): cores 0 | 1" in _log(prefix / "jobs", "bind")


def test_jobscript_runs_a_training_example_with_its_ranks_where_asked(pbs: Cluster, prefix: Path) -> None:
    """`torchhpc jobscript --submit` from a user's directory with the README's .venv active and nothing else
    said: the training template on 2 nodes x 2 ranks under PBS (select, place=scatter), started by mpiexec from the
    job's node file, in the user's environment (no site environment is built here) and asking for no GPUs (the
    server has none); the job's log is shown."""
    env = {"SITE": "generic", "TORCHHPC_PREFIX": str(prefix)}
    out = pbs.ok(f"cd {prefix} && torchhpc jobscript --scheduler pbs --nodes 2 --ranks-per-node 2 --cpus 1 "
                 f"--walltime 00:10:00 --submit -- python {ROOT}/examples/train.py --steps 40 --ckpt {prefix}/ckpt",
                 timeout=300, env=env)
    assert "done: 40 steps" in out and "finished: exit status 0" in out, out
    assert "does not hold torch and torchhpc yet: the job runs in this one" in out, out
    assert "the scheduler reports no GPUs on its nodes: asking for none" in out, out
    log = _log(prefix / "jobs", "train")
    assert "ranks on hosts: 0:node1 1:node1 2:node2 3:node2" in log, log
    assert f"2 node(s) x 2 rank(s) with mpiexec in {prefix}" in log, log
    assert "#PBS -l select=2:ncpus=2:mpiprocs=2" in (prefix / "jobs" / USER / "train.pbs").read_text()


# ---- mpiexec inside a PBS job, both MPIs, as users write the job script --------------------------------------


@pytest.mark.parametrize("mpi", ["openmpi", "mpich"])
def test_mpiexec_in_a_job_places_ranks_from_the_allocation(pbs: Cluster, prefix: Path, mpi: str) -> None:
    """`mpiexec` with no host list inside `select=2:ncpus=2:mpiprocs=2` puts 2 ranks on each node: both wheels'
    mpiexecs read $PBS_NODEFILE themselves; the launcher's facts agree with where each rank runs."""
    if mpi == "mpich":
        root = side_mpich()
        if root is None:
            pytest.skip("no MPICH: `make env` puts the pinned mpich wheel's files in $VENV/mpich")
        launch = f"export MPI4PY_LIBMPI={root}/lib/libmpi.so.12\n{root}/bin/mpiexec -n 4 -ppn 2"
    else:
        launch = "mpiexec -n 4 --map-by ppr:2:node"
    script = prefix / "whoami.pbs"
    script.write_text("#!/bin/bash -l\n#PBS -l select=2:ncpus=2:mpiprocs=2\n#PBS -l place=scatter\n"
                      f"#PBS -l walltime=00:05:00\n#PBS -j oe\n#PBS -o {prefix}/whoami.out\n"
                      f"source {shlex.quote(sys.prefix + '/bin/activate')}\n"
                      f"{launch} python {ROOT}/tests/vcluster/whoami.py\n")
    out = pbs.ok(f"qsub -W block=true {script}", timeout=180)
    deadline = time.monotonic() + 30  # the mom copies the output back after the job ends
    while time.monotonic() < deadline and not (prefix / "whoami.out").exists():
        time.sleep(0.2)
    text = (prefix / "whoami.out").read_text()
    ranks = [json.loads(line.split("WHOAMI ", 1)[1]) for line in text.splitlines() if "WHOAMI " in line]
    assert Counter(r["host"] for r in ranks) == Counter({"node1": 2, "node2": 2}), out + text
    for r in ranks:
        assert r["info_size"] == 4 and r["local_size"] == 2 and r["mpi_local_size"] == 2, r
        assert r["mpi_nodes"] == 2 and r["info_rank"] == r["rank"], r
    check_thread_budget(ranks)  # the job script sets no OMP_NUM_THREADS


def test_make_test_pbs_prints_the_table_with_ranks_on_both_nodes(pbs: Cluster, prefix: Path) -> None:
    env = {"SITE": "generic", "TORCHHPC_NO_ENV": "1", "TORCHHPC_PREFIX": str(prefix),
           "PBS_SELECT_TEST": "2:ncpus=2:mpiprocs=2", "PBS_WALLTIME_TEST": "00:05:00",
           "ALL_REDUCE_ARGS": "-e 64K -n 3 -w 1"}
    out = pbs.ok("make --no-print-directory test-pbs BACKENDS=accl", timeout=300, env=env)
    log = _log(prefix / "jobs", "torchhpc-test-all-reduce")
    placed = re.findall(r"#  Rank +(\d) Pid +\d+ on +(node\d) device cpu", log)
    assert sorted(placed) == [("0", "node1"), ("1", "node1"), ("2", "node2"), ("3", "node2")], log
    assert "# Out of bounds values : 0 OK" in log, log
    # a core each; from the node's topology where ncpus=2 is every CPU of the (shared) host
    maps = " -x TORCHHPC_CPU_MAP -x TORCHHPC_GPU_MAP" if os.cpu_count() == 2 else ""
    launch = f"+ mpiexec -n 4 --map-by ppr:2:node:PE=1 --bind-to core --mca mpi_yield_when_idle 1{maps} python"
    assert launch in log, log
    assert "# Out of bounds values : 0 OK" in out, "the table is shown"
    script = (prefix / "jobs" / USER / "torchhpc-test-all-reduce.pbs").read_text()
    assert "#PBS -l place=scatter:excl" in script, script


@pytest.mark.skipif(shutil.which("git") is None, reason="git not installed")
def test_build_target_runs_under_qsub(pbs: Cluster, prefix: Path) -> None:
    """`make build-pytorch-v2.5.1-pbs`: the real build target in a PBS job, stopped after the patches."""
    upstream = tagged_upstream(prefix / "upstream", "v2.5.1")
    env = {"SITE": "generic", "TORCHHPC_PREFIX": str(prefix / "build"), "PYTORCH_GIT": f"file://{upstream}",
           "CUDA_HOME": str(prefix / "nocuda"), "ENV_KIND": "venv", "TORCHHPC_VENV_ARGS": "--without-pip",
           "STOP_AFTER": "patches", "PBS_SELECT_BUILD": "1:ncpus=1", "PBS_WALLTIME_BUILD": "00:10:00"}
    out = pbs.ok("make --no-print-directory build-pytorch-v2.5.1-pbs", timeout=300, env=env)
    assert "STOP_AFTER=patches: stopping here" in out, "the job's log is shown"
    patched = (prefix / "build/src/pytorch-v2.5.1" / PG_MPI).read_text()
    assert "MPIX_GPU_query_support(MPIX_GPU_SUPPORT_CUDA" in patched
    script = (prefix / "build/jobs" / USER / "torchhpc-build-v2.5.1.pbs").read_text()
    assert "#PBS -l walltime=00:10:00" in script and "\nmake build-pytorch-v2.5.1 SITE=generic" in script


def test_the_readme_cluster_lines_run_as_typed(pbs: Cluster, prefix: Path) -> None:
    """README's PBS block, line by line in one login shell: build (stopped after the patches), install,
    activate, the all-reduce table on both nodes, and a training job through `torchhpc jobscript`."""
    upstream = tagged_upstream(prefix / "upstream", "v2.13.0")
    env_prefix = site_env_over(Path(sys.prefix), prefix / "site-env")
    lines = readme_cluster_lines("pbs", {"project": "UABC0001", "scratch": str(prefix / "scratch")})
    knobs = {**readme_knobs(prefix / "build", upstream, env_prefix), "SCHEDULER": "pbs",
             "PBS_SELECT_BUILD": "1:ncpus=1", "PBS_WALLTIME_BUILD": "00:10:00",
             "PBS_SELECT_TEST": "2:ncpus=2:mpiprocs=2", "PBS_WALLTIME_TEST": "00:10:00"}
    out = pbs.ok("set -e; " + "; ".join(lines), timeout=600, env=knobs)
    assert "STOP_AFTER=patches: stopping here" in out, out
    assert "installed in editable mode already; kept" in out, out  # not replaced by a copy
    assert "# Out of bounds values : 0 OK" in out, out
    log = _log(prefix / "build/jobs", "train")
    assert "ranks on hosts: 0:node1 1:node1 2:node2 3:node2" in log and f"python={env_prefix}" not in log, log
    assert "done: 200 steps" in log, log
    assert "#PBS -A UABC0001" in (prefix / "build/jobs" / USER / "train.pbs").read_text()


# ---- the site profiles' directives against the real server ---------------------------------------------------


def site_script(pbs: Cluster, prefix: Path, site: str, shape: str) -> Path:
    """The job script `make` would submit for ``site`` and ``shape`` (from its dry run), on the shared disk."""
    proc = pbs.run(f"bash utils/submit_job.sh --scheduler pbs --name {site}-{shape} --shape {shape} -- true",
                   env={"SITE": site, "DRY_RUN": "1", "PBS_ACCOUNT": "UABC0001", "TORCHHPC_PREFIX": str(prefix)})
    assert proc.returncode == 0, proc.stdout
    text = proc.stdout.split(":\n", 1)[1].split("# submit command:")[0]
    assert text.startswith("#!/bin/bash -l\n#PBS "), text
    path = prefix / f"{site}-{shape}.pbs"
    path.write_text(text)
    return path


def test_rehearsal_example_jobs_in_the_shapes_users_run(pbs: Cluster) -> None:
    """The rehearsal example as OpenPBS jobs: 2 nodes x 2 ranks bound to a core each over Thallium and over MPI,
    and 2 x 1 x 2 cores on the default transport."""
    check_rehearsal_jobs(pbs)


def test_submit_runs_python_functions_on_pbs(pbs: Cluster) -> None:
    """torchhpc.submit under OpenPBS: the calls made under Slurm (tests/_vcluster.py's check_submit), 6 through
    map_array; the requeue goes through qsub from the job's first node, the time left from qstat's start time and
    walltime.  (PBS's walltime kill: test_walltime_kill_says_so; its state word: tests/test_submit.py.)"""
    check_submit(pbs, array=6, walltime_kill=False)


def test_site_profiles_directives_are_accepted_by_qsub(pbs: Cluster, prefix: Path) -> None:
    """Every SITE_PBS_* value of the derecho, polaris and generic profiles reaches a real qsub and is accepted.
    What OpenPBS does not define (the `ngpus`, `job_priority`, `system` and `filesystems` resources, Derecho's
    `main` and Polaris' `preemptable` queues) is refused until created with qmgr, as a site's admin would; jobs
    are held (qsub -h) and deleted: they could never fit here."""
    queues = {"derecho": "main", "polaris": "preemptable", "generic": "workq"}
    for site in ("derecho", "polaris"):
        refused = pbs.run(f"qsub -h {site_script(pbs, prefix, site, 'test')}")
        assert refused.returncode != 0 and re.search(r"Unknown resource|Unknown queue", refused.stdout), refused.stdout
        pbs.ok(f"qmgr -c 'list queue {queues[site]}' >/dev/null 2>&1 || "
               f"qmgr -c 'create queue {queues[site]} queue_type=execution,enabled=true,started=true'")
    # GPUs per host, consumable (flag=nh: the scheduler counts them per node); Derecho's priority class; Polaris'
    # machine name (a host's resource, chosen in a chunk) and the file systems a job reads
    for name, how in (("ngpus", "type=long,flag=nh"), ("job_priority", "type=string"),
                      ("system", "type=string,flag=h"), ("filesystems", "type=string")):
        pbs.ok(f"qmgr -c 'list resource {name}' >/dev/null 2>&1 || qmgr -c 'create resource {name} {how}'")
    for site in ("derecho", "polaris", "generic"):
        for shape in ("build", "test"):
            script = site_script(pbs, prefix, site, shape)
            job = pbs.ok(f"qsub -h {script}").strip().splitlines()[-1]
            try:
                rec = qstat_x(pbs, job)
                asked = [line.split()[2].split("=", 1) for line in script.read_text().splitlines()
                         if line.startswith("#PBS -l ")]
                assert len(asked) >= 2, script.read_text()
                for key, value in asked:
                    assert str(rec["Resource_List"][key]) == value, (site, shape, key, rec["Resource_List"])
                assert rec["queue"] == queues[site], rec["queue"]
                assert rec.get("Account_Name") == "UABC0001", rec
            finally:
                pbs.ok(f"qdel {job}")


# ---- a node lost, a spare in its place (revives its node) -----------------------------------------------------


@pytest.fixture(scope="module")
def uninterrupted(pbs: Cluster) -> str:
    """The SHA-256 of the final parameters of examples/resumable_training.py on 2 ranks, never stopped."""
    work = pbs.shared / "resume-ref"
    shutil.rmtree(work, ignore_errors=True)
    ref = pbs.ok(f"mpiexec --host node1:1,node2:1 -n 2 -x OMP_NUM_THREADS {train_command(work)}", env=RANK_ENV,
                 timeout=300)
    want = DIGEST.findall(ref)
    assert len(want) == 1, ref
    return want[0]


def test_a_lost_node_is_replaced_by_a_spare_in_place(pbs: Cluster, prefix: Path, uninterrupted: str) -> None:
    """`torchhpc jobscript --scheduler pbs --nodes 2 --spare-nodes 1`: 3 nodes (tolerate_node_failures=all), the
    training on 2 with mpiexec.  The step's node other than the mother superior is torn down after the second
    checkpoint; the supervisor restarts the step on the spare, which resumes and ends bitwise equal to a run never
    stopped, and the job ends with exit status 0 without a rerun."""
    env = {**RANK_ENV, "SITE": "generic", "TORCHHPC_PREFIX": str(prefix), "TORCHHPC_PROBE_S": "10"}
    out = pbs.ok(f"cd {prefix} && torchhpc jobscript --scheduler pbs --nodes 2 --spare-nodes 1 --ranks-per-node 1 "
                 f"--cpus 1 --walltime 00:10:00 --name spare --detach -- "
                 f"{train_command(prefix / 'ckpt', '--timeout 20')}", env=env)
    job = re.search(r"detached from PBS job (\S+);", out).group(1)
    log = Path(re.search(r"its log as it grows: (\S+)", out).group(1))
    first, _ = wait_for_line(log, r"on (node\d) (node\d) \(spare: 1; lost: none\)", 180)
    mother = qstat_x(pbs, job)["exec_host"].split("/")[0]
    victim = next(n for n in first.groups() if n != mother)
    deadline = time.monotonic() + 120
    while not (prefix / "ckpt" / f"step-{2 * RESUME_EVERY:08d}").is_dir():
        assert time.monotonic() < deadline, f"no second checkpoint\n{log.read_text()[-3000:]}"
        time.sleep(0.1)
    offset = len(log.read_text())
    killed = subprocess.run(["bash", str(ROOT / "utils/vcluster/vcluster.sh"), "kill-node", victim],
                            capture_output=True, text=True)
    assert killed.returncode == 0, killed.stderr
    fault = time.monotonic()
    try:
        resumed, seen = wait_for_line(log, r"RESUMED at step (\d+) of \d+ on 2 ranks", 240, offset)
        print(f"RECOVERY in place under PBS: {seen - fault:.1f} s from the fault to the resumed step")
        deadline = time.monotonic() + 240
        rec = qstat_x(pbs, job)
        while time.monotonic() < deadline and rec["job_state"] != "F":
            time.sleep(2)
            rec = qstat_x(pbs, job)
        text = log.read_text()
        assert rec["job_state"] == "F" and rec.get("Exit_status") == 0, f"{rec}\n{text[-5000:]}\n{pbs.logs()}"
        assert rec.get("run_count", 1) == 1, rec
        assert f"node(s) {victim} stopped answering" in text and f"lost: {victim})" in text, text[-5000:]
        assert 2 * RESUME_EVERY <= int(resumed.group(1)) < RESUME_STEPS, text[-5000:]
        assert DIGEST.findall(text) == [uninterrupted], text[-5000:]
    finally:
        subprocess.run(["bash", str(ROOT / "utils/vcluster/vcluster.sh"), "revive-node", victim],
                       capture_output=True, text=True, timeout=120)


# ---- a rerunnable job survives its node (runs last: it takes node2 down) -------------------------------------


def test_a_rerunnable_job_resumes_from_its_checkpoint_bitwise_equal(pbs: Cluster, prefix: Path,
                                                                    uninterrupted: str) -> None:
    """examples/resumable_training.py in a rerunnable job (`qsub -r y`, 2 ranks on one node) placed on node2,
    which is torn down (link cut, every process killed) after the second checkpoint: the server requeues the
    job once the mom is silent past node_fail_requeue, it runs again on another node, resumes from its newest finished
    checkpoint and ends with the parameters of a run never stopped, bit for bit."""
    steps, every = RESUME_STEPS, RESUME_EVERY

    def job(name: str, ckpt: Path, rerun: str) -> Path:
        script = prefix / f"{name}.pbs"
        script.write_text(f"#!/bin/bash\n#PBS -N {name}\n#PBS -r {rerun}\n#PBS -l select=1:ncpus=2:mpiprocs=2\n"
                          f"#PBS -l walltime=00:10:00\n#PBS -j oe\n#PBS -o {prefix}/{name}.out\n"
                          f"source {shlex.quote(sys.prefix + '/bin/activate')}\nexport OMP_NUM_THREADS=1\n"
                          f"mpiexec -n 2 -x OMP_NUM_THREADS python {ROOT}/examples/resumable_training.py "
                          f"--dir {ckpt} --steps {steps} --every {every}\n")
        return script

    def output(name: str) -> str:
        deadline = time.monotonic() + 30  # the mom copies the output back after the job ends
        while time.monotonic() < deadline and not (prefix / f"{name}.out").exists():
            time.sleep(0.2)
        return (prefix / f"{name}.out").read_text()

    digest = re.compile(rf"FINAL step {steps} sha256 ([0-9a-f]{{64}})")
    want = [uninterrupted]
    ckpt = prefix / "ckpt"
    others = " ".join(n for n in json.loads(pbs.ok("pbsnodes -a -F json"))["nodes"] if n != "node2")
    pbs.ok(f"pbsnodes -o {others}")  # the job must start on node2, the node that fails
    try:
        jid = pbs.ok(f"qsub {job('resume', ckpt, 'y')}").strip().splitlines()[-1]
        deadline = time.monotonic() + 120
        while not (ckpt / f"step-{2 * every:08d}").is_dir():
            assert time.monotonic() < deadline, f"no second checkpoint: {qstat_x(pbs, jid)}\n{pbs.logs()}"
            time.sleep(0.1)
    finally:
        pbs.ok(f"pbsnodes -r {others}")
    assert qstat_x(pbs, jid)["exec_host"].startswith("node2"), qstat_x(pbs, jid)
    killed = subprocess.run(["bash", str(ROOT / "utils/vcluster/vcluster.sh"), "kill-node", "node2"],
                            capture_output=True, text=True)
    assert killed.returncode == 0, killed.stderr
    deadline = time.monotonic() + 240  # the mom found silent, node_fail_requeue, the rest of the run
    rec = qstat_x(pbs, jid)
    while time.monotonic() < deadline and rec["job_state"] != "F":
        time.sleep(2)
        rec = qstat_x(pbs, jid)
    text = output("resume")
    assert rec["job_state"] == "F" and rec.get("Exit_status") == 0, f"{rec}\n{text[-5000:]}\n{pbs.logs()}"
    assert rec["run_count"] == 2 and not rec["exec_host"].startswith("node2"), rec
    resumed = [int(s) for s in re.findall(r"RESUMED at step (\d+) of \d+ on 2 ranks", text)]
    assert len(resumed) == 1 and 2 * every <= resumed[0] < steps, text[-5000:]
    assert digest.findall(text) == want, text[-5000:]

