"""accl under mpiexec: "accl" is the C++ class, and what gloo has that accl lacked, sparse all_reduce, alone
(against the dense sum every rank computes) and in DDP with sparse embeddings (against gloo, in the same
job)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _backend_compare import assert_same, run_both

import torchhpc.accl as accl

MPI_RANKS = (2, 3)
MPI_TIMEOUT = 240


def _sparse(rank: int, seed: int, dtype: torch.dtype, dense_dims: tuple[int, ...] = ()) -> torch.Tensor:
    """A rank's sparse COO tensor (8 x 5 sparse dims, then ``dense_dims``) with duplicate indices, rebuilt by any
    rank from (rank, seed)."""
    g = torch.Generator().manual_seed(1000 * seed + rank)
    nnz = 3 + rank
    idx = torch.stack([torch.randint(0, 8, (nnz,), generator=g), torch.randint(0, 5, (nnz,), generator=g)])
    vals = torch.randint(-4, 5, (nnz, *dense_dims), generator=g).to(dtype)
    return torch.sparse_coo_tensor(idx, vals, (8, 5, *dense_dims))


def test_ddp_with_sparse_embeddings_matches_gloo() -> None:
    """DDP reduces the sparse gradients of ``nn.Embedding(sparse=True)`` with sparse all_reduce: the same
    parameters on accl as on gloo after a few SGD steps (float64, to tolerance).  First in the file: it makes
    its own default groups, before the module's ``world`` fixture holds one."""

    def workload() -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Embedding(50, 6, sparse=True), torch.nn.Flatten(),
                                    torch.nn.Linear(18, 1)).double()
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(100 + dist.get_rank())
        for _ in range(3):
            ids = torch.randint(0, 50, (4, 3), generator=g)
            opt.zero_grad()
            ddp(ids).pow(2).sum().backward()
            opt.step()
        return [q.detach().clone() for q in model.parameters()]

    got = run_both(workload)
    assert_same(got["accl"], got["gloo"], bitwise=False, what="parameters")


@pytest.fixture(scope="module")
def world():
    dist.init_process_group("accl")
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_accl_is_the_cpp_backend(world) -> None:
    assert type(world).__module__ == "torchhpc.accl.group" and isinstance(world, accl.ProcessGroupACCL)
    work = dist.all_reduce(torch.ones(3), async_op=True)
    assert isinstance(work, accl.AcclWork)
    work.wait()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int64])
@pytest.mark.parametrize("dense_dims", [(), (3,)])
def test_sparse_all_reduce_is_the_dense_sum(world, dtype: torch.dtype, dense_dims: tuple[int, ...]) -> None:
    rank, p = dist.get_rank(), dist.get_world_size()
    for seed in range(3):
        t = _sparse(rank, seed, dtype, dense_dims)
        dist.all_reduce(t)
        want = sum(_sparse(r, seed, dtype, dense_dims).to_dense() for r in range(p))
        assert t.is_sparse and torch.equal(t.to_dense(), want), (seed, t, want)


def test_sparse_all_reduce_async_and_its_future(world) -> None:
    rank, p = dist.get_rank(), dist.get_world_size()
    t = _sparse(rank, 7, torch.float32)
    work = dist.all_reduce(t, async_op=True)
    fut = work.get_future()
    work.wait()
    want = sum(_sparse(r, 7, torch.float32).to_dense() for r in range(p))
    assert torch.equal(fut.value()[0].to_dense(), want)


def test_sparse_all_reduce_needs_sum(world) -> None:
    with pytest.raises(ValueError, match="SUM only"):
        dist.all_reduce(_sparse(dist.get_rank(), 1, torch.float32), op=dist.ReduceOp.MAX)
    dist.all_reduce(torch.ones(2))  # the group is still usable
