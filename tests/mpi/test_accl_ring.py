"""accl's pipelined ring for large reductions (forced with ``ring_min_bytes=0`` where it would otherwise run only
across nodes): exact results against values each rank computes, for every op and the dtypes with their own
reduction, sizes that do and do not divide into blocks and chunks, inputs left as given; and the choice itself."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import torchhpc.accl as accl

MPI_RANKS = (2, 3, 4)
MPI_TIMEOUT = 240
R = dist.ReduceOp

# elements: past the carry limit (16 KiB on a node, 64 KiB across); not a multiple of the ranks; several
# 512 KiB chunks per block
SIZES = (20_000, 131_071, 1_000_003)


@pytest.fixture(scope="module")
def ring():
    dist.init_process_group("accl")
    g = dist.new_group(backend="accl", pg_options=accl.AcclOptions(ring_min_bytes=0))
    yield g
    dist.destroy_process_group()


def _values(rank: int, n: int) -> torch.Tensor:
    return torch.arange(n, dtype=torch.float64) % 11 - 5 + rank


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int64, torch.bfloat16])
def test_all_reduce_by_ring_exact(ring, n: int, dtype: torch.dtype) -> None:
    rank, p = dist.get_rank(), dist.get_world_size()
    ops = [(R.SUM, sum(_values(r, n) for r in range(p))), (R.MAX, _values(p - 1, n)), (R.MIN, _values(0, n))]
    if dtype.is_floating_point:
        ops.append((R.AVG, sum(_values(r, n) for r in range(p)) / p))
    for op, expect in ops:
        t = _values(rank, n).to(dtype)
        dist.all_reduce(t, op=op, group=ring)
        want = expect.to(dtype)
        if dtype == torch.bfloat16 and op in (R.SUM, R.AVG):
            assert torch.allclose(t.double(), want.double(), atol=0.1), op
        else:
            assert torch.equal(t, want), op


@pytest.mark.parametrize("n", SIZES)
def test_reduce_scatter_by_ring_exact(ring, n: int) -> None:
    rank, p = dist.get_rank(), dist.get_world_size()
    per = n // p
    inp = _values(rank, p * per)
    before = inp.clone()
    out = torch.empty(per, dtype=torch.float64)
    dist.reduce_scatter_tensor(out, inp, group=ring)
    assert torch.equal(out, sum(_values(r, p * per) for r in range(p))[rank * per:(rank + 1) * per])
    assert torch.equal(inp, before)  # the input is left as given
    dist.reduce_scatter_tensor(out, inp, op=R.MAX, group=ring)
    assert torch.equal(out, _values(p - 1, p * per)[rank * per:(rank + 1) * per])


def test_ring_and_mpi_agree_bitwise_where_sums_commute(ring) -> None:
    """Two ranks add two terms, which IEEE addition does the same way round: the ring's float sums equal MPI's."""
    rank, p = dist.get_rank(), dist.get_world_size()
    x = torch.randn(300_000, generator=torch.Generator().manual_seed(rank))
    a, b = x.clone(), x.clone()
    dist.all_reduce(a, group=ring)
    dist.all_reduce(b)  # one node: MPI's algorithm
    if p == 2:
        assert torch.equal(a, b)
    else:
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-5)


def test_the_ring_runs_where_chosen(ring) -> None:
    """Forced, a large all_reduce moves the ring's chunks: no call touches more than one rank's share of the
    tensor.  On one node accl's choice for all_reduce is MPI's call per segment (the documented 4 MiB default),
    and for reduce_scatter the ring (Open MPI's faults in a buffer of the whole input per call): seen by the
    largest call each made, whatever the ring's chunk size is tuned to."""
    default = dist.group.WORLD
    p = dist.get_world_size()
    nbytes = 8 << 20
    ring.stats["max_call_bytes"] = default.stats["max_call_bytes"] = 0
    for g in (ring, default):
        t = torch.ones(nbytes // 8, dtype=torch.float64)
        dist.all_reduce(t, group=g)
        assert torch.all(t == p)
    assert 0 < ring.stats["max_call_bytes"] <= nbytes // p, "the ring moves pieces of a rank's share"
    assert default.stats["max_call_bytes"] == 4 << 20, "MPI's call per 4 MiB segment"
    default.stats["max_call_bytes"] = 0
    dist.reduce_scatter_tensor(torch.empty(1 << 18, dtype=torch.float64), torch.ones(p << 18, dtype=torch.float64))
    assert 0 < default.stats["max_call_bytes"] <= (1 << 18) * 8, "not one MPI call over the whole input"
