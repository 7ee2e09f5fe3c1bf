"""Checks that the mpiexec harness itself gives every rank a consistent world."""

import torch
from mpi4py import MPI

MPI_RANKS = (1, 2, 4)


def test_world_is_consistent(comm: MPI.Comm) -> None:
    ranks = comm.allgather(comm.Get_rank())
    assert ranks == list(range(comm.Get_size()))


def test_torch_tensor_allreduce_through_mpi4py(comm: MPI.Comm) -> None:
    t = torch.full((1000,), float(comm.Get_rank() + 1), dtype=torch.float64)
    out = torch.empty_like(t)
    comm.Allreduce(t.numpy(), out.numpy(), op=MPI.SUM)
    n = comm.Get_size()
    assert torch.all(out == n * (n + 1) / 2)
