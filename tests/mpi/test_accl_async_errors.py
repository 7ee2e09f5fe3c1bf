"""async_op semantics, issue-order completion, timeouts, and clear errors (never hangs) of "accl"."""

from __future__ import annotations

import gc
import time
import weakref
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from mpi4py import MPI

import torchhpc.accl as accl
from torchhpc.runtime.errors import MismatchError, PeerTimeoutError

MPI_RANKS = (2, 4)
MPI_TIMEOUT = 240
R = dist.ReduceOp


@pytest.fixture(scope="module", autouse=True)
def world():
    dist.init_process_group("accl", timeout=timedelta(seconds=60))
    yield
    dist.destroy_process_group()


def test_async_ops_complete_in_issue_order() -> None:
    p = dist.get_world_size()
    t = torch.ones(1000, dtype=torch.float64)
    works = [dist.all_reduce(t, async_op=True) for _ in range(6)]
    works.append(dist.broadcast(t, src=0, async_op=True))
    works.append(dist.all_reduce(t, op=R.MAX, async_op=True))
    assert all(isinstance(w, accl.AcclWork) for w in works)
    works[-1].wait()
    # the last one finished, so every earlier collective did too, and each consumed the previous result
    assert all(w.is_completed() and w.is_success() for w in works)
    assert torch.all(t == float(p) ** 6)
    assert works[0].get_future().done()
    assert works[0].get_future().value()[0] is t


def test_async_progresses_without_anyone_waiting() -> None:
    p = dist.get_world_size()
    t = torch.ones(200_000)
    work = dist.all_reduce(t, async_op=True)
    fut = work.get_future()
    limit = time.monotonic() + 30
    while not fut.done() and time.monotonic() < limit:
        time.sleep(0.01)  # no MPI or accl call here: only the progress thread can finish the op
    assert fut.done(), "async all_reduce did not progress without wait()"
    assert torch.all(t == p)
    work.wait()


def test_future_chaining_and_result() -> None:
    p = dist.get_world_size()
    t = torch.full((4,), 2.0)
    fut = dist.all_reduce(t, async_op=True).get_future()
    doubled = fut.then(lambda f: f.value()[0] * 2)
    assert torch.all(doubled.wait() == 4.0 * p)
    w = dist.all_reduce(torch.ones(3), async_op=True)
    assert torch.all(w.result()[0] == p)


def _rank_dependent(rank: int) -> int:
    return 4 + (rank == 1)


@pytest.mark.parametrize("what", ["numel", "dtype", "op", "kind", "root"])
def test_mismatch_raises_on_every_rank_and_group_survives(what: str) -> None:
    rank, p = dist.get_rank(), dist.get_world_size()
    with pytest.raises(MismatchError, match="ranks disagree"):
        if what == "numel":
            dist.all_reduce(torch.ones(_rank_dependent(rank) * 100))
        elif what == "dtype":
            dist.all_reduce(torch.ones(8, dtype=torch.float32 if rank else torch.float64))
        elif what == "op":
            dist.all_reduce(torch.ones(8), op=R.MAX if rank == 1 else R.SUM)
        elif what == "kind":
            if rank == 0:
                dist.broadcast(torch.ones(8), src=0)
            else:
                dist.all_reduce(torch.ones(8))
        else:
            dist.broadcast(torch.ones(8), src=min(rank, 1))
    t = torch.ones(5)
    dist.all_reduce(t)  # the group is still usable
    assert torch.all(t == p)


def test_all_to_all_split_mismatch_is_reported() -> None:
    rank, p = dist.get_rank(), dist.get_world_size()
    inp = torch.ones(p)
    out_splits = [1] * p
    if rank == 0:
        out_splits = [2] + [1] * (p - 2) + [0]
    with pytest.raises(MismatchError, match="split sizes do not match"):
        dist.all_to_all_single(torch.empty(p), inp, out_splits, [1] * p)


def test_bad_arguments_raise_before_communicating() -> None:
    p = dist.get_world_size()
    with pytest.raises(TypeError, match="BAND is only defined for integer"):
        dist.all_reduce(torch.ones(3), op=R.BAND)
    with pytest.raises(TypeError, match="AVG needs a floating-point"):
        dist.all_reduce(torch.ones(3, dtype=torch.int32), op=R.AVG)
    with pytest.raises(TypeError, match="cannot reduce dtype"):
        dist.all_reduce(torch.ones(3, dtype=torch.complex64).real.to(torch.uint16))
    with pytest.raises(ValueError, match="tag"):
        dist.isend(torch.ones(1), (dist.get_rank() + 1) % p, tag=-5)
    with pytest.raises(ValueError, match="world_size"):
        dist.all_gather([torch.empty(2)] * (p + 1), torch.ones(2))
    with pytest.raises(ValueError, match="needs world_size"):
        dist.all_gather_into_tensor(torch.empty(p * 2 + 1), torch.ones(2))
    with pytest.raises(ValueError, match="divisible"):
        dist.all_to_all_single(torch.empty(p + 1), torch.empty(p + 1))
    with pytest.raises(TypeError, match="dtypes differ"):
        dist.reduce_scatter_tensor(torch.empty(2), torch.empty(2 * p, dtype=torch.float64))
    pg = dist.group.WORLD
    with pytest.raises(ValueError, match="root"):
        opts = dist.BroadcastOptions()
        opts.rootRank = p + 3
        pg.broadcast([torch.ones(1)], opts)
    # nothing was sent: the next collective lines up on every rank
    t = torch.ones(2)
    dist.all_reduce(t)
    assert torch.all(t == p)


@pytest.mark.parametrize("n_recv", [3, 5000])
def test_p2p_size_mismatch_is_reported_and_nothing_is_corrupted(n_recv: int) -> None:
    rank = dist.get_rank()
    tiny = dist.new_group(backend="accl", pg_options=accl.AcclOptions(max_segment_bytes=1024))
    n_send = 2 * n_recv
    if rank == 0:
        dist.send(torch.arange(n_send, dtype=torch.float32), 1, group=tiny)
        dist.send(torch.full((7,), 42.0), 1, group=tiny)
    elif rank == 1:
        got = torch.zeros(n_recv)
        with pytest.raises(MismatchError, match="expects"):
            dist.recv(got, 0, group=tiny)
        assert torch.all(got == 0)
        nxt = torch.zeros(7)
        dist.recv(nxt, 0, group=tiny)
        assert torch.all(nxt == 42.0), "the extra segments of the bad message leaked into the next one"
    dist.barrier()


def test_wait_timeout_then_completion() -> None:
    rank = dist.get_rank()
    if rank == 1:
        got = torch.zeros(3)
        w = dist.irecv(got, 0)
        with pytest.raises(PeerTimeoutError, match="expired"):
            w.wait(timeout=timedelta(milliseconds=300))
        MPI.COMM_WORLD.Barrier()
        w.wait()
        assert torch.all(got == 9.0)
    else:
        MPI.COMM_WORLD.Barrier()
        if rank == 0:
            dist.send(torch.full((3,), 9.0), 1)
    dist.barrier()


def test_group_timeout_when_a_peer_never_joins() -> None:
    rank, p = dist.get_rank(), dist.get_world_size()
    g = dist.new_group(backend="accl", timeout=timedelta(seconds=2))
    if rank == 0:
        start = time.monotonic()
        # named: the peer it waits on (its partner in the header exchange's first round)
        with pytest.raises(PeerTimeoutError, match=r"did not complete within the group timeout of 2 s: "
                                                        r"rank 1 \(this rank was waiting on it\) died, hung"):
            dist.all_reduce(torch.ones(4), group=g)
        assert time.monotonic() - start < 20
        with pytest.raises(dist.DistBackendError, match="aborted"):
            dist.all_reduce(torch.ones(4), group=g)
    MPI.COMM_WORLD.Barrier()
    if rank != 0:
        # the late ranks now join the abandoned collective so that nothing stays pending at exit; rank 0 sent its
        # first message of the header exchange before it gave up, so the ranks that need a later one from it (its
        # partners after the first round, powers of two: rank 2 at 4 ranks) time out as it did, the others complete
        try:
            dist.all_reduce(torch.ones(4), group=g)
            outcome = "done"
        except PeerTimeoutError as e:
            assert "rank 0 (this rank was waiting on it)" in str(e), e
            outcome = "timed out"
    else:
        outcome = "gave up"
    dist.barrier()
    expected = ["gave up"] + ["timed out" if r >= 2 and r & (r - 1) == 0 else "done" for r in range(1, p)]
    assert MPI.COMM_WORLD.allgather(outcome) == expected


def test_a_recv_whose_peer_never_sends_times_out_and_its_buffers_are_kept() -> None:
    """Rank 1 receives from rank 0, which sends only after rank 1's group timeout: the receive fails at the
    deadline naming rank 0 and the group is aborted, but the given-up receive stays posted in MPI, so its buffers
    (its envelope's, the tensor it would fill) are kept as long as the group: the late message lands there, never
    in freed memory."""
    rank = dist.get_rank()
    g = dist.new_group(backend="accl", timeout=timedelta(seconds=2))
    if rank == 1:
        start = time.monotonic()
        target = torch.zeros(3)
        kept = weakref.ref(target)
        with pytest.raises(PeerTimeoutError, match=r"recv\(from rank 0, tag 3\) in group .* did not complete within "
                                                   r"the group timeout of 2 s: rank 0 \(this rank was waiting on it\)"):
            dist.recv(target, 0, group=g, tag=3)
        assert time.monotonic() - start < 20
        del target
        gc.collect()
        assert kept() is not None, "the given-up receive's tensor was let go while MPI may still write it"
        with pytest.raises(dist.DistBackendError, match="aborted"):
            dist.recv(torch.zeros(3), 0, group=g, tag=3)
    MPI.COMM_WORLD.Barrier()
    if rank == 0:
        dist.send(torch.full((3,), 9.0), 1, group=g, tag=3)  # small: complete once sent, received or not
    MPI.COMM_WORLD.Barrier()
    dist.barrier()


def test_monitored_barrier_method() -> None:
    pg = dist.group.WORLD
    pg.monitored_barrier(timedelta(seconds=30))
    if dist.get_rank() == 0:
        with pytest.raises(PeerTimeoutError, match=r"ranks \[1"):
            pg.monitored_barrier(timedelta(milliseconds=300))
    MPI.COMM_WORLD.Barrier()
    pg.monitored_barrier(timedelta(seconds=30))  # the cancelled receives did not swallow these tokens


def test_monitored_barrier_cannot_match_a_users_message() -> None:
    """User messages are in flight on the tags the barrier uses or once used (0x7FFF0000 % MPI_TAG_UB and the next
    one, on the envelope communicator; 1 and 2) while every rank passes the barrier: the barrier takes none of
    them, and each user receive afterwards gets its own data."""
    pg = dist.group.WORLD
    rank, p = dist.get_rank(), dist.get_world_size()
    ub = MPI.COMM_WORLD.Get_attr(MPI.TAG_UB)
    tags = [0x7FFF0000 % ub, (0x7FFF0000 % ub + 1) % ub, 1, 2]
    sends = [dist.isend(torch.full((3,), 10 * rank + k, dtype=torch.int64), dst=0, tag=t)
             for k, t in enumerate(tags)] if rank else []
    pg.monitored_barrier(timedelta(seconds=30))
    for r in range(1, p) if rank == 0 else ():
        for k, t in enumerate(tags):
            got = torch.empty(3, dtype=torch.int64)
            dist.recv(got, src=r, tag=t)
            assert torch.all(got == 10 * r + k), (r, t, got)
    for w in sends:
        w.wait()
    pg.monitored_barrier(timedelta(seconds=30))


@pytest.mark.parametrize("wait_all_ranks", [False, True])
def test_monitored_barrier_names_missing_ranks_as_gloo(wait_all_ranks: bool) -> None:
    """Odd ranks skip the barrier: rank 0 names the first missing rank, or every one with
    wait_all_ranks=True, in gloo's words; even ranks that arrived are told to look at rank 0."""
    pg = dist.group.WORLD
    rank, p = dist.get_rank(), dist.get_world_size()
    odd = list(range(1, p, 2))
    if rank == 0:
        if wait_all_ranks:
            want = rf"\[Rank 0\]: Ranks {', '.join(map(str, odd))} failed to pass monitoredBarrier in 400 ms"
        else:
            want = r"\[Rank 0\]: Rank 1 failed to pass monitoredBarrier in 400 ms"
        with pytest.raises(PeerTimeoutError, match=want) as info:
            pg.monitored_barrier(timedelta(milliseconds=400), wait_all_ranks=wait_all_ranks)
        assert f"ranks {odd}" in str(info.value)
    elif rank % 2 == 0:
        with pytest.raises(PeerTimeoutError, match="successfully reached monitoredBarrier"):
            pg.monitored_barrier(timedelta(milliseconds=400), wait_all_ranks=wait_all_ranks)
    MPI.COMM_WORLD.Barrier()
    pg.monitored_barrier(timedelta(seconds=30), wait_all_ranks=wait_all_ranks)  # still usable


@pytest.mark.parametrize("what", ["all_reduce_fused_vs_not", "broadcast", "all_gather", "reduce_scatter",
                                  "all_to_all"])
def test_fast_path_size_mismatch_raises_on_every_rank(what: str) -> None:
    """Synchronous calls with sizes that differ across ranks: MismatchError on every rank from
    the fast path's header check, and the group stays usable."""
    rank, p = dist.get_rank(), dist.get_world_size()
    n = 8 if rank == 0 else 20_000  # rank 0 rides whole in the header exchange, the others past its carry limit
    with pytest.raises(MismatchError, match="ranks disagree|split sizes do not match"):
        if what == "all_reduce_fused_vs_not":
            dist.all_reduce(torch.ones(n))
        elif what == "broadcast":
            dist.broadcast(torch.ones(n), src=0)
        elif what == "all_gather":
            dist.all_gather_into_tensor(torch.empty(p * n), torch.ones(n))
        elif what == "reduce_scatter":
            dist.reduce_scatter_tensor(torch.empty(n), torch.ones(p * n))
        else:
            dist.all_to_all_single(torch.empty(p * n), torch.ones(p * n))
    t = torch.ones(5)
    dist.all_reduce(t)
    assert torch.all(t == p)
    out = torch.empty(p * 700)
    dist.all_gather_into_tensor(out, torch.full((700,), float(rank)))
    assert torch.equal(out, torch.arange(p, dtype=torch.float32).repeat_interleave(700))
