"""One thread budget per rank (torchhpc.runtime.threads): the rule on made-up launcher facts and CPU masks, and in fresh
processes that ``import torchhpc`` applies it under an srun-like environment whether torch came first or not, and
leaves a user's OMP_NUM_THREADS alone.  Across nodes under each real launcher: tests/test_vcluster.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from torchhpc.launcher import MPI_LAUNCHER_VARS
from torchhpc.runtime import threads

ROOT = Path(__file__).resolve().parents[1]


def _slurm(local: int, nodes: int = 2) -> dict[str, str]:
    """An srun step's variables: rank 0 of local x nodes tasks, ``local`` on each node."""
    return {"SLURM_PROCID": "0", "SLURM_STEP_ID": "0", "SLURM_NTASKS": str(local * nodes), "SLURM_NODEID": "0",
            "SLURM_LOCALID": "0", "SLURM_STEP_TASKS_PER_NODE": f"{local}(x{nodes})"}


@pytest.mark.parametrize(("cpus", "node", "env", "want", "why"), [
    (2, 2, _slurm(2), 1, "shared"),          # srun, unbound: 2 ranks on 2 cores
    (2, 2, _slurm(3), 1, "shared"),          # more ranks than cores: one each
    (64, 64, _slurm(4), 16, "shared"),       # 4 unbound ranks on a 64-core node
    (32, 64, _slurm(2), 32, "one per core"),  # bound to a socket each
    (1, 2, _slurm(2), 1, "one per core"),    # mpiexec's binding to a core
    (8, 8, _slurm(1), 8, "one per core"),    # alone on its node
    (8, 8, {}, 8, "one per core"),           # no launcher: a plain process
    (8, 8, {**_slurm(4), "OMP_NUM_THREADS": "3"}, 3, "OMP_NUM_THREADS"),
    (2, 2, {**_slurm(2), "PBS_JOBID": "7.pbs", "NCPUS": "2", "OMP_NUM_THREADS": "2"}, 1, "shared"),  # PBS's own
    (2, 2, {**_slurm(2), "PBS_JOBID": "7.pbs", "NCPUS": "2", "OMP_NUM_THREADS": "1"}, 1, "OMP_NUM_THREADS"),
    (8, 8, {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"}, 2, "shared"),  # torchrun
    (8, 8, {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, 4, "shared"),  # mpiexec without binding (--bind-to none)
])
def test_budget_rule(monkeypatch, cpus: int, node: int, env: dict[str, str], want: int, why: str) -> None:
    monkeypatch.setattr(threads, "_cpus", lambda: cpus)
    monkeypatch.setattr(threads, "_node_cpus", lambda: node)
    b = threads.thread_budget(env)
    assert b.threads == want and why in b.reason, b
    assert (b.cpus, b.node_cpus) == (cpus, node)


def test_a_budget_torchhpc_set_is_not_taken_for_the_users(monkeypatch) -> None:
    monkeypatch.setattr(threads, "_cpus", lambda: 4)
    monkeypatch.setattr(threads, "_node_cpus", lambda: 4)
    env = {**_slurm(2), "OMP_NUM_THREADS": "2", threads.MARKER: "2"}  # inherited from a rank's parent
    assert threads.thread_budget(env).reason.endswith("split among 2 ranks")
    env = _slurm(4)
    assert threads.set_default(env).threads == 1 and env["OMP_NUM_THREADS"] == env[threads.MARKER] == "1"
    env = _slurm(1)
    assert threads.set_default(env).threads == 4 and env["OMP_NUM_THREADS"] == "4"  # alone: every core
    env = {}
    assert threads.set_default(env) is None and not env  # no launcher: torch's own default


def test_cores_count_hyperthreads_once(monkeypatch) -> None:
    monkeypatch.setattr(threads, "_core_of", lambda cpu: ("0", str(cpu // 2)))  # cpu 2k and 2k+1: one core
    assert threads._cores({0, 1, 2}) == 2
    assert threads._cores({5}) == 1
    assert threads._core_of(0) != ("cpu", "0") or not os.path.exists("/sys/devices/system/cpu/cpu0/topology")


def _run(code: str, env: dict[str, str]) -> str:
    clean = {k: v for k, v in os.environ.items()
             if k not in MPI_LAUNCHER_VARS and not k.startswith(("SLURM_", "OMP_", "TORCHHPC_THREADS"))}
    res = subprocess.run([sys.executable, "-c", code], env={**clean, "PYTHONPATH": str(ROOT / "src"), **env},
                         capture_output=True, text=True, timeout=120, check=False)
    assert res.returncode == 0, res.stderr[-2000:]
    return res.stdout.split()[-1]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs to share")
@pytest.mark.parametrize("torch_first", [False, True])
def test_import_torchhpc_applies_it(torch_first: bool) -> None:
    """Two srun-style ranks on this node's CPUs: torch runs one thread each after ``import torchhpc``, whether
    torch was imported before (torch.set_num_threads) or after (OMP_NUM_THREADS)."""
    cpus = len(os.sched_getaffinity(0))
    first = "import torch; import torchhpc" if torch_first else "import torchhpc; import torch"
    got = _run(f"{first}; print(torch.get_num_threads())", _slurm(cpus))
    assert got == "1"
    assert _run(f"{first}; print(torch.get_num_threads())", {**_slurm(cpus), "OMP_NUM_THREADS": "2"}) == "2"
    alone = _run("import torchhpc, torch; print(torch.get_num_threads())", _slurm(1))
    assert alone == str(threads._cpus())  # alone on the node: one per core it may use
    mpiexec = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "1", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
               "OMPI_COMM_WORLD_LOCAL_SIZE": "1"}
    assert _run("import torch; print(torch.get_num_threads())", mpiexec) == "1"  # MKL's own rule under mpiexec
    assert _run(f"{first}; print(torch.get_num_threads())", mpiexec) == str(threads._cpus())


@pytest.mark.parametrize("nproc", [1, 2])
def test_under_torchrun(tmp_path: Path, nproc: int) -> None:
    """torchrun sets OMP_NUM_THREADS=1 itself when it starts several ranks (kept); one rank gets every core."""
    script = tmp_path / "threads.py"
    # one write per line: the ranks share the pipe, and under PYTHONUNBUFFERED print() writes piece by piece
    # (a run saw "THREADSTHREADS 0 1\n 1 1")
    script.write_text("import torchhpc, torch, os\n"
                      "os.write(1, f\"THREADS {os.environ['LOCAL_RANK']} {torch.get_num_threads()}\\n\".encode())\n")
    clean = {k: v for k, v in os.environ.items()
             if k not in MPI_LAUNCHER_VARS and not k.startswith(("SLURM_", "OMP_", "TORCHHPC_THREADS"))}
    torchrun = Path(sys.executable).with_name("torchrun")
    res = subprocess.run([str(torchrun), "--standalone", f"--nproc-per-node={nproc}", str(script)],
                         env={**clean, "PYTHONPATH": str(ROOT / "src")}, capture_output=True, text=True, timeout=180,
                         check=False)
    assert res.returncode == 0, res.stderr[-2000:]
    got = sorted(line.split()[1:] for line in res.stdout.splitlines() if line.startswith("THREADS"))
    want = "1" if nproc > 1 else str(threads._cpus())
    assert got == [[str(r), want] for r in range(nproc)], res.stdout


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2 or len(os.sched_getaffinity(0)) < (os.cpu_count() or 1),
                    reason="needs 2 CPUs and an unbound test process")
def test_a_rank_left_on_every_core_binds_itself_to_its_share() -> None:
    """Two srun-style ranks the launcher left unbound, with TORCHHPC_BIND=1: each binds itself to its own block of
    the node's cores (disjoint, together all of them), and its thread budget follows; by default it stays unbound;
    a rank the launcher bound (taskset here) stays where it is."""
    code = "import torchhpc, torch, os; print(sorted(os.sched_getaffinity(0)), torch.get_num_threads(), sep='|')"
    every = sorted(os.sched_getaffinity(0))
    got = []
    for local_rank in range(2):
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                             env={**{k: v for k, v in os.environ.items() if k not in MPI_LAUNCHER_VARS and not
                                     k.startswith(("SLURM_", "OMP_", "TORCHHPC_"))},
                                  "PYTHONPATH": str(ROOT / "src"), **_slurm(2), "SLURM_LOCALID": str(local_rank),
                                  "SLURM_PROCID": str(local_rank), "TORCHHPC_BIND": "1"})
        assert res.returncode == 0, res.stderr[-2000:]
        cpus, nthreads = res.stdout.strip().splitlines()[-1].split("|")
        got.append(eval(cpus))  # noqa: S307  (a list of ints printed by the child)
        assert int(nthreads) == threads._cores(set(got[-1])), res.stdout
    assert got[0] and got[1] and not set(got[0]) & set(got[1]) and sorted(got[0] + got[1]) == every, got
    unbound = _run("import torchhpc, os; print(len(os.sched_getaffinity(0)))", _slurm(2))
    assert unbound == str(len(every))
    res = subprocess.run(["taskset", "-c", str(every[-1]), sys.executable, "-c",
                          "import torchhpc, os; print(sorted(os.sched_getaffinity(0)))"], capture_output=True,
                         text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT / "src"), **_slurm(2),
                                                      "TORCHHPC_BIND": "1"})
    assert res.stdout.split("\n")[-2] == f"[{every[-1]}]", res.stdout + res.stderr


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2 or len(os.sched_getaffinity(0)) < (os.cpu_count() or 1),
                    reason="needs 2 CPUs and an unbound test process")
def test_a_rank_left_unbound_takes_its_cores_and_gpu_from_the_job_layers_plan() -> None:
    """The job layer's plan (TORCHHPC_CPU_MAP, TORCHHPC_GPU_MAP) read by ranks the launcher left unbound (Open MPI
    with --bind-to none, PALS without GPU words): each binds itself to its own CPUs in the map (in reverse order
    here, so no block rule could give it) and takes its GPU as CUDA_VISIBLE_DEVICES unless the launcher set one; a
    malformed map is an error naming the variable."""
    every = sorted(os.sched_getaffinity(0))[:2]
    code = ("import torchhpc, os; print(sorted(os.sched_getaffinity(0)), os.environ.get('CUDA_VISIBLE_DEVICES'), "
            "sep='|')")
    base = {k: v for k, v in os.environ.items() if k not in MPI_LAUNCHER_VARS and
            not k.startswith(("SLURM_", "OMP_", "TORCHHPC_", "CUDA_VISIBLE"))}
    plan = {"TORCHHPC_CPU_MAP": f"{every[1]}:{every[0]}", "TORCHHPC_GPU_MAP": "3,2"}
    for local_rank in range(2):
        env = {**base, "PYTHONPATH": str(ROOT / "src"), **_slurm(2), "SLURM_LOCALID": str(local_rank),
               "SLURM_PROCID": str(local_rank), **plan}
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
        assert res.returncode == 0, res.stderr[-2000:]
        assert res.stdout.strip().splitlines()[-1] == f"[{every[1 - local_rank]}]|{3 - local_rank}", res.stdout
    set_by_launcher = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                                     env={**env, "CUDA_VISIBLE_DEVICES": "0"})
    assert set_by_launcher.stdout.strip().endswith("|0"), set_by_launcher.stdout
    bad = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**env, "TORCHHPC_CPU_MAP": "0-x:x-1"})
    assert bad.returncode != 0 and "TORCHHPC_CPU_MAP='0-x:x-1'" in bad.stderr, bad.stderr[-2000:]
