"""torchhpc.launcher under a real mpiexec: detection, and init_distributed with no MASTER_ADDR/PORT."""

import os

import torch
import torch.distributed as dist
from mpi4py import MPI

from torchhpc.launcher import init_distributed, world_info

MPI_RANKS = (1, 2, 4)


def test_world_info_matches_mpi(comm: MPI.Comm) -> None:
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    info = world_info()
    assert (info.rank, info.world_size) == (comm.Get_rank(), comm.Get_size())
    assert (info.local_rank, info.local_size) == (node.Get_rank(), node.Get_size())
    assert info.launcher in ("openmpi", "mpich", "pals")
    # With no launcher variables at all, MPI itself answers (plain mpi4py).
    bare = world_info({}, use_mpi=True)
    assert (bare.rank, bare.local_rank, bare.world_size, bare.local_size, bare.launcher) == (
        info.rank, info.local_rank, info.world_size, info.local_size, "mpi4py")
    node.Free()


def test_init_distributed_agrees_on_master_through_mpi(comm: MPI.Comm) -> None:
    for var in ("MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(var, None)
    info = init_distributed(backend="gloo", timeout=60)
    try:
        assert dist.get_rank() == info.rank == comm.Get_rank()
        assert dist.get_world_size() == comm.Get_size()
        addrs = comm.allgather((os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]))
        assert len(set(addrs)) == 1
        t = torch.tensor([float(info.rank + 1)])
        dist.all_reduce(t)
        n = comm.Get_size()
        assert t.item() == n * (n + 1) / 2
        assert init_distributed(backend="gloo") == info  # idempotent
    finally:
        dist.destroy_process_group()
