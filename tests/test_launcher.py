"""torchhpc.runtime.world (the facts torchhpc.launcher starts from): every launcher's variables, malformed and
contradictory environments."""

from __future__ import annotations

import pytest

from torchhpc.runtime.errors import LauncherError
from torchhpc.runtime.world import WorldInfo, _slurm_first_host, _slurm_tasks_on_node, world_info


def info(env: dict[str, str]) -> WorldInfo:
    return world_info(env, use_mpi=False)


def test_no_launcher_is_a_single_process() -> None:
    assert info({}) == WorldInfo(0, 0, 1, 1, "single")


def test_torchrun() -> None:
    env = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "TORCHELASTIC_RUN_ID": "x"}
    assert info(env) == WorldInfo(5, 1, 8, 4, "torchrun")


def test_torchrun_single_process_without_local_variables() -> None:
    assert info({"RANK": "0", "WORLD_SIZE": "1"}) == WorldInfo(0, 0, 1, 1, "torchrun")


def test_open_mpi() -> None:
    env = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4",
           "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    assert info(env) == WorldInfo(3, 1, 4, 2, "openmpi")


def test_mpich_hydra() -> None:
    env = {"PMI_RANK": "6", "PMI_SIZE": "8", "MPI_LOCALRANKID": "2", "MPI_LOCALNRANKS": "4"}
    assert info(env) == WorldInfo(6, 2, 8, 4, "mpich")


def test_cray_pals_also_sets_pmi() -> None:
    env = {"PALS_RANKID": "7", "PALS_LOCAL_RANKID": "3", "PALS_NODEID": "1", "PMI_RANK": "7", "PMI_SIZE": "8",
           "PMI_LOCAL_RANK": "3", "PMI_LOCAL_SIZE": "4"}
    assert info(env) == WorldInfo(7, 3, 8, 4, "pals")


def test_mvapich() -> None:
    env = {"MV2_COMM_WORLD_RANK": "1", "MV2_COMM_WORLD_SIZE": "2",
           "MV2_COMM_WORLD_LOCAL_RANK": "1", "MV2_COMM_WORLD_LOCAL_SIZE": "2"}
    assert info(env) == WorldInfo(1, 1, 2, 2, "mvapich")


def test_slurm_srun_step() -> None:
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "7", "SLURM_LOCALID": "1", "SLURM_NODEID": "2",
           "SLURM_STEP_ID": "0", "SLURM_STEP_TASKS_PER_NODE": "2(x2),3"}
    assert info(env) == WorldInfo(5, 1, 7, 3, "slurm")


def test_slurm_batch_script_is_not_a_launch() -> None:
    # sbatch's batch step: SLURM_PROCID=0 and SLURM_NTASKS=N, but only one process runs the script.
    assert info({"SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_LOCALID": "0"}).launcher == "single"


def test_mpi_launcher_wins_over_inherited_slurm_variables() -> None:
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_STEP_ID": "1", "SLURM_LOCALID": "0",
           "OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4",
           "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    assert info(env) == WorldInfo(3, 1, 4, 2, "openmpi")


def test_torchrun_variables_consistent_with_mpi_are_accepted() -> None:
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
           "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"}
    assert info(env) == WorldInfo(1, 1, 2, 2, "torchrun")


def test_local_rank_filled_from_a_second_launcher() -> None:
    env = {"RANK": "1", "WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2",
           "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "1"}
    assert info(env) == WorldInfo(1, 0, 2, 1, "torchrun")


def test_torchrun_under_mpiexec_is_refused() -> None:
    env = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "j",
           "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4"}
    with pytest.raises(LauncherError, match="torchrun is running under openmpi mpiexec with 4 MPI ranks"):
        info(env)


def test_torchrun_single_mpi_rank_is_allowed() -> None:
    # `mpiexec -n 1 torchrun ...` on one node is legitimate: torchrun owns the ranks.
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "4", "TORCHELASTIC_RUN_ID": "j",
           "OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "1"}
    assert info(env).launcher == "torchrun"


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"RANK": "4", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}, "rank 4 >= world size 4"),
        ({"RANK": "0", "WORLD_SIZE": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}, "world size is 0"),
        ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK='x' is not an integer"),
        ({"RANK": "-1", "WORLD_SIZE": "2"}, "RANK=-1 is negative"),
        ({"RANK": "0"}, "WORLD_SIZE not set"),
        ({"WORLD_SIZE": "2"}, "RANK not set"),
        ({"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"}, "local rank 2 >= local size 2"),
        ({"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "8"}, "local size 8 is not in"),
        ({"RANK": "1", "WORLD_SIZE": "4"}, "local rank/size not in the environment"),
        ({"OMPI_COMM_WORLD_RANK": "0"}, "OMPI_COMM_WORLD_SIZE is not"),
        ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
          "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "PMI_RANK": "1", "PMI_SIZE": "2"}, "launchers disagree"),
        ({"RANK": "0", "WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"},
         "RANK/WORLD_SIZE say rank 0 of 2 but openmpi says rank 1 of 2"),
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0", "SLURM_LOCALID": "0",
          "SLURM_STEP_TASKS_PER_NODE": "two"}, "cannot parse Slurm tasks-per-node"),
    ],
)
def test_bad_and_contradictory_environments(env: dict[str, str], message: str) -> None:
    with pytest.raises(LauncherError, match=message):
        info(env)


def test_slurm_helpers() -> None:
    assert _slurm_tasks_on_node("4(x2),1", 1) == 4
    assert _slurm_tasks_on_node("4(x2),1", 2) == 1
    with pytest.raises(LauncherError, match="lists 3 nodes"):
        _slurm_tasks_on_node("4(x2),1", 3)
    assert _slurm_first_host("nid[001-004,010],login1") == "nid001"
    assert _slurm_first_host("node7") == "node7"


def test_init_distributed_single_process_leaves_environment_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    import torch.distributed as dist

    from torchhpc.launcher import init_distributed

    for key in [k for k in os.environ if k.startswith(("OMPI_", "PMI_", "SLURM_", "PALS_", "MASTER_"))]:
        monkeypatch.delenv(key)
    port = _free_port()
    info = init_distributed("gloo", timeout=30, env={"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    try:
        assert info == WorldInfo(0, 0, 1, 1, "single") and dist.get_world_size() == 1
        assert "MASTER_ADDR" not in os.environ and "MASTER_PORT" not in os.environ
        with pytest.raises(ValueError, match="timeout must be positive"):
            init_distributed("gloo", timeout=0)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        # plain `mpiexec --oversubscribe -n 4` with the Open MPI wheel: rank 1 gets local rank 2
        ({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "2",
          "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}, WorldInfo(1, 2, 4, 4, "openmpi")),
        # `--map-by node` on 2 nodes with `--rank-by` reversed within the node: rank 0 is local rank 1
        ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
          "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, WorldInfo(0, 1, 4, 2, "openmpi")),
        # Cray PALS with a custom placement (--cpu-bind list / depth): rank 2 is local rank 3
        ({"PALS_RANKID": "2", "PMI_SIZE": "8", "PALS_LOCAL_RANKID": "3", "PALS_LOCAL_SIZE": "4"},
         WorldInfo(2, 3, 8, 4, "pals")),
        # Slurm `srun --distribution=arbitrary` (SLURM_HOSTFILE): rank 1 on node 0 after rank 3
        ({"SLURM_PROCID": "1", "SLURM_NTASKS": "4", "SLURM_STEP_ID": "0", "SLURM_LOCALID": "2",
          "SLURM_NODEID": "0", "SLURM_STEP_TASKS_PER_NODE": "3,1"}, WorldInfo(1, 2, 4, 3, "slurm")),
        # MPICH Hydra with a machinefile that interleaves hosts
        ({"PMI_RANK": "0", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"},
         WorldInfo(0, 1, 2, 2, "mpich")),
    ],
)
def test_every_mapping_mpi_allows_is_accepted(env: dict[str, str], expected: WorldInfo) -> None:
    """Issue 11, reproduction 2: nothing in MPI promises local rank <= rank."""
    assert info(env) == expected


def test_one_launcher_detector() -> None:
    from torchhpc.accl import rendezvous
    from torchhpc.launcher import mpi_launcher

    assert mpi_launcher({}) is None
    assert mpi_launcher({"OMPI_COMM_WORLD_SIZE": "2"}) == "openmpi"
    assert mpi_launcher({"PALS_RANKID": "0"}) == "pals"
    assert mpi_launcher({"HYDRA_CONTROL_FD": "7"}) == "mpich"
    assert mpi_launcher({"SLURM_PROCID": "0"}) is None  # srun is not an MPI launcher; its variables are inherited
    assert rendezvous.under_mpi_launcher.__module__ == "torchhpc.accl.rendezvous"
    assert "mpi_launcher" in rendezvous.under_mpi_launcher.__code__.co_names


_GLOO_EXIT = """
import os, sys
import torch
import torch.distributed as dist
from torchhpc.launcher import init_distributed

torch.set_num_threads(1)
def threads() -> int:
    return len(os.listdir("/proc/self/task"))
torch.nn.Linear(4, 4)(torch.ones(2, 4)).sum().backward()  # autograd's and torch's own threads exist already
before = threads()
init_distributed("gloo", timeout=30, env={"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": sys.argv[1]})
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))  # imports torch._dynamo now
model(torch.ones(2, 4)).sum().backward()
stats = torch.ones(3)
dist.all_reduce(stats)
del model
dist.destroy_process_group()
print(before, threads())
"""


def test_destroying_the_default_gloo_group_after_ddp_stops_its_workers() -> None:
    """The default group is not pinned by a module imported after init (DDP imports torch._dynamo, whose
    torch.distributed.nn.functional takes group.WORLD as a default argument): destroying it joins gloo's
    workers, so none is left to drop a tensor, and take the GIL, while the interpreter exits."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMI_", "SLURM_", "PALS_", "MASTER_"))}
    out = subprocess.run([sys.executable, "-c", _GLOO_EXIT, str(_free_port())], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    before, after = map(int, out.stdout.split())
    assert after == before, f"{after - before} thread(s) of the destroyed gloo group still running"


def test_oversubscription_is_judged_per_host_when_ranks_are_spread(monkeypatch: pytest.MonkeyPatch) -> None:
    """4 ranks over 4 hosts from a 2-core login node: no ``--oversubscribe`` (given it, Open MPI 5 piles every
    rank onto the first host, seen on the virtual cluster); 4 ranks here, or 2 per host on 1-core hosts: it is."""
    from torchhpc.runtime import mpirun

    monkeypatch.setattr(mpirun, "available_cores", lambda: 2)
    monkeypatch.setattr(mpirun, "mpi_flavor", lambda exe=None: "openmpi")
    spread = ["--host", "node1:1,node2:1,node3:1,node4:1"]
    assert "--oversubscribe" not in mpirun.mpiexec_argv(4, ["python"], mpiexec="mpiexec", extra=spread)
    assert "--oversubscribe" in mpirun.mpiexec_argv(4, ["python"], mpiexec="mpiexec")
    monkeypatch.setattr(mpirun, "available_cores", lambda: 1)
    assert "--oversubscribe" in mpirun.mpiexec_argv(4, ["python"], mpiexec="mpiexec",
                                                    extra=["--host", "node1:2,node2:2"])


def _free_port() -> int:
    """A port free on this host now (for a test's own MASTER_PORT)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
