"""Foundation under a real mpiexec: the harness's world, launcher detection, init_distributed without
MASTER_ADDR/PORT, and torchhpc doctor printing once (one file, so the suite pays for one job start per size)."""

import os

import torch
import torch.distributed as dist
from mpi4py import MPI

from torchhpc import doctor
from torchhpc.launcher import init_distributed, world_info

MPI_RANKS = (1, 2, 4)
MPI_VARIANTS = ("rank-order", "mpich")


def test_world_is_consistent(comm: MPI.Comm) -> None:
    ranks = comm.allgather(comm.Get_rank())
    assert ranks == list(range(comm.Get_size()))


def test_torch_tensor_allreduce_through_mpi4py(comm: MPI.Comm) -> None:
    t = torch.full((1000,), float(comm.Get_rank() + 1), dtype=torch.float64)
    out = torch.empty_like(t)
    comm.Allreduce(t.numpy(), out.numpy(), op=MPI.SUM)
    n = comm.Get_size()
    assert torch.all(out == n * (n + 1) / 2)


def test_world_info_matches_mpi(comm: MPI.Comm) -> None:
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    info = world_info()
    assert (info.rank, info.world_size) == (comm.Get_rank(), comm.Get_size())
    # The launcher's local ranks number the node's ranks in its own order (Open MPI's default mapping
    # gives rank 1 local rank 2 at 4 ranks): a permutation of the node's ranks, not their rank order.
    assert info.local_size == node.Get_size()
    assert sorted(node.allgather(info.local_rank)) == list(range(node.Get_size()))
    assert info.launcher in ("openmpi", "mpich", "pals")
    # With no launcher variables at all, MPI itself answers (plain mpi4py).
    bare = world_info({}, use_mpi=True)
    assert (bare.rank, bare.local_rank, bare.world_size, bare.local_size, bare.launcher) == (
        info.rank, node.Get_rank(), info.world_size, info.local_size, "mpi4py")
    node.Free()


def test_init_distributed_agrees_on_master_through_mpi(comm: MPI.Comm) -> None:
    for var in ("MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(var, None)
    info = init_distributed(backend="gloo", timeout=60)
    try:
        assert dist.get_rank() == info.rank == comm.Get_rank()
        assert dist.get_world_size() == comm.Get_size()
        assert "MASTER_ADDR" not in os.environ and "MASTER_PORT" not in os.environ  # no side effects
        t = torch.tensor([float(info.rank + 1)])
        dist.all_reduce(t)
        n = comm.Get_size()
        assert t.item() == n * (n + 1) / 2
        assert init_distributed(backend="gloo") == info  # idempotent
    finally:
        dist.destroy_process_group()


def test_doctor_under_mpiexec(comm: MPI.Comm, capsys) -> None:
    status = doctor.main(["--json"])
    out = capsys.readouterr().out
    assert comm.allgather(status) == [status] * comm.Get_size()
    if comm.Get_rank() == 0:
        assert f"rank 0/{comm.Get_size()}" in out
    else:
        assert out == ""
