"""accl's header exchange, which is the whole of a small collective: exact results at every size class of the data
that rides with it (in the prefix's message, in eager pieces, past the carry limit) and at rank counts that fold
into a power of two; and a mismatch refused with the same error on every rank, whatever each rank called."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from mpi4py import MPI

import torchhpc.accl as accl
from torchhpc.runtime.errors import MismatchError

MPI_RANKS = (2, 3, 5)  # 3 and 5: ranks folded into a power of two before the rounds
MPI_TIMEOUT = 240
R = dist.ReduceOp

# elements of float64: inline with the prefix, one eager piece more, several pieces, the carry limit, past it
SIZES = (1, 100, 480, 481, 2000, 8192, 8193)


@pytest.fixture(scope="module", autouse=True)
def world():
    dist.init_process_group("accl")
    yield
    dist.destroy_process_group()


def _values(rank: int, n: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    return (torch.arange(n, dtype=torch.float64) % 7 + rank * 3).to(dtype)


@pytest.mark.parametrize("n", SIZES)
def test_all_reduce_exact(n: int) -> None:
    rank, p = dist.get_rank(), dist.get_world_size()
    for op, expect in ((R.SUM, sum(_values(r, n) for r in range(p))), (R.MAX, _values(p - 1, n)),
                       (R.MIN, _values(0, n))):
        t = _values(rank, n)
        dist.all_reduce(t, op=op)
        assert torch.equal(t, expect), op
    t = _values(rank, n, torch.int32)
    dist.all_reduce(t)
    assert torch.equal(t, sum(_values(r, n) for r in range(p)).to(torch.int32))
    t = torch.ones(n, dtype=torch.float16)
    dist.all_reduce(t, op=R.AVG)
    assert torch.equal(t, torch.ones(n, dtype=torch.float16))


@pytest.mark.parametrize("n", SIZES)
def test_broadcast_from_every_root(n: int) -> None:
    rank, p = dist.get_rank(), dist.get_world_size()
    for root in range(p):
        t = _values(rank, n)
        dist.broadcast(t, src=root)
        assert torch.equal(t, _values(root, n)), root


@pytest.mark.parametrize("n", SIZES)
def test_all_gather_and_reduce_scatter_exact(n: int) -> None:
    rank, p = dist.get_rank(), dist.get_world_size()
    per = max(1, n // p)
    out = torch.empty(p * per, dtype=torch.float64)
    dist.all_gather_into_tensor(out, _values(rank, per))
    assert torch.equal(out, torch.cat([_values(r, per) for r in range(p)]))
    inp = _values(rank, p * per)
    before = inp.clone()
    mine = torch.empty(per, dtype=torch.float64)
    dist.reduce_scatter_tensor(mine, inp)
    assert torch.equal(mine, sum(_values(r, p * per) for r in range(p))[rank * per:(rank + 1) * per])
    assert torch.equal(inp, before)  # the input is left as given


def _refusals(call) -> list[str]:  # noqa: ANN001
    with pytest.raises(MismatchError, match="ranks disagree") as info:
        call()
    return MPI.COMM_WORLD.allgather(str(info.value))


@pytest.mark.parametrize("n", SIZES)
def test_size_mismatch_same_error_everywhere(n: int) -> None:
    rank, p = dist.get_rank(), dist.get_world_size()
    odd = p - 1  # the last rank: a folded rank's partner at 3 and 5 ranks
    texts = _refusals(lambda: dist.all_reduce(torch.ones(n + (rank == odd), dtype=torch.float64)))
    assert len(set(texts)) == 1, texts
    others = f"ranks {','.join(map(str, range(odd)))}" if odd > 1 else "rank 0"
    assert f"numel: {others} {n}, rank {odd} {n + 1}" in texts[0]
    t = torch.ones(n, dtype=torch.float64)
    dist.all_reduce(t)  # the group goes on
    assert torch.all(t == p)


@pytest.mark.parametrize("other", ["broadcast", "barrier", "large_all_gather"])
@pytest.mark.parametrize("culprit", ["rank 0", "last rank"])
def test_kind_mismatch_same_error_everywhere(other: str, culprit: str) -> None:
    """One rank calls another collective (rank 0 is folded into rank 1 at 3 and 5 ranks)."""
    rank, p = dist.get_rank(), dist.get_world_size()
    odd = 0 if culprit == "rank 0" else p - 1

    def call() -> None:
        if rank != odd:
            dist.all_reduce(torch.ones(300, dtype=torch.float64))
        elif other == "broadcast":
            dist.broadcast(torch.ones(300, dtype=torch.float64), src=0)
        elif other == "barrier":
            dist.barrier()
        else:
            dist.all_gather_into_tensor(torch.empty(p * 40_000), torch.ones(40_000))  # past the carry limit

    texts = _refusals(call)
    assert len(set(texts)) == 1, texts
    assert "kind: " in texts[0]
    t = torch.ones(3)
    dist.all_reduce(t)
    assert torch.all(t == p)


@pytest.mark.parametrize("delta", [8, -16, 1 << 40])
def test_a_garbled_size_from_a_peer_is_an_error_on_every_rank(delta: int) -> None:
    """A rank whose header-exchange message says a size no rank could have sent (corruption, made here by the
    backend's test hook): the rank that receives it uses nothing of it and raises at once, naming the sender, and
    leaves the group; every other rank has the package's error by its next call on the group, at the deadline."""
    if not hasattr(accl.core.load_backend(), "wire"):
        pytest.skip("accl was built without its test hooks (make env builds them: corebuild --test-hooks)")
    rank, p = dist.get_rank(), dist.get_world_size()
    g = dist.new_group(backend="accl", timeout=timedelta(seconds=3))
    if rank == p - 1:
        accl.core.load_backend().wire.garble_next(delta)
    error = ""
    start = time.monotonic()
    for _ in range(2):  # the garbled call, then the next
        t = _values(rank, 4)
        try:
            dist.all_reduce(t, group=g)
        except dist.DistBackendError as e:  # accl's errors are torch's DistBackendError too
            error = str(e)
            break
    errors = MPI.COMM_WORLD.allgather((error, time.monotonic() - start))
    assert all(text for text, _ in errors), errors
    assert any(f"garbled header-exchange message from rank {p - 1}" in text for text, _ in errors), errors
    assert max(seconds for _, seconds in errors) < 30, errors
    MPI.COMM_WORLD.Barrier()
