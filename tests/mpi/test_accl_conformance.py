"""Conformance of the "accl" backend: every collective x dtype x op against independently computed
values (each rank rebuilds every rank's input from a seed) and against gloo where gloo has it."""

from __future__ import annotations

import itertools
import os

import pytest
import torch
import torch.distributed as dist

import torchhpc.accl as accl
from torchhpc.accl.options import plan

MPI_RANKS = (2, 4)
MPI_TIMEOUT = 240

R = dist.ReduceOp
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.int16,
          torch.int32, torch.int64, torch.uint8, torch.bool]
OPS = [R.SUM, R.AVG, R.PRODUCT, R.MIN, R.MAX, R.BAND, R.BOR, R.BXOR]
GLOO_LACKS = (torch.int16,)  # gloo: "Invalid scalar type"
FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def rank_data(rank: int, n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Small integers (exact in every dtype, products included) that any rank can rebuild."""
    g = torch.Generator().manual_seed(seed * 7919 + rank)
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g).bool()
    lo = 0 if dtype == torch.uint8 else -3
    x = torch.randint(lo, 4, (n,), generator=g)
    return x.to(dtype)


def reference(vals: list[torch.Tensor], op) -> torch.Tensor:
    """Reduce the ranks' inputs with torch in int64/float64 (independent of MPI)."""
    dtype = vals[0].dtype
    if dtype == torch.bool:
        v = torch.stack(vals)
        if op in (R.SUM, R.MAX, R.BOR):
            return v.any(0)
        if op in (R.PRODUCT, R.MIN, R.BAND):
            return v.all(0)
        return v.to(torch.int64).sum(0).remainder(2).bool()
    wide = torch.float64 if dtype in FLOATS else torch.int64
    v = torch.stack([x.to(wide) for x in vals])
    if op == R.SUM:
        out = v.sum(0)
    elif op == R.AVG:
        out = v.sum(0) / len(vals)
    elif op == R.PRODUCT:
        out = v.prod(0)
    elif op == R.MIN:
        out = v.min(0).values
    elif op == R.MAX:
        out = v.max(0).values
    else:
        out = v[0].clone()
        for x in v[1:]:
            fn = {R.BAND: torch.bitwise_and, R.BOR: torch.bitwise_or, R.BXOR: torch.bitwise_xor}[op]
            out = fn(out, x)
    return out.to(dtype)


def valid(dtype: torch.dtype, op) -> bool:
    if op in (R.BAND, R.BOR, R.BXOR):
        return dtype not in FLOATS
    if op == R.AVG:
        return dtype in FLOATS
    return True


_LAUNCH_ENV = {k: os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT")}  # as launched, before any init


@pytest.fixture(scope="module")
def groups():
    dist.init_process_group("accl")  # no MASTER_ADDR/MASTER_PORT: filled from MPI
    world = dist.group.WORLD
    gloo = dist.new_group(backend="gloo")
    tiny = dist.new_group(backend="accl", pg_options=accl.AcclOptions(max_segment_bytes=64))
    ring = dist.new_group(backend="accl", pg_options=accl.AcclOptions(ring_min_bytes=0, max_segment_bytes=256))
    yield {"world": world, "gloo": gloo, "tiny": tiny, "ring": ring}
    dist.destroy_process_group()


def test_init_without_master_addr(groups) -> None:
    from mpi4py import MPI

    assert _LAUNCH_ENV == {"MASTER_ADDR": None, "MASTER_PORT": None}, "the harness launches without them"
    assert dist.get_backend() == "accl"
    assert dist.get_rank() == MPI.COMM_WORLD.Get_rank()
    assert dist.get_world_size() == MPI.COMM_WORLD.Get_size()
    assert "MASTER_ADDR" not in os.environ and "MASTER_PORT" not in os.environ, "the rendezvous wrote into environ"
    assert isinstance(groups["world"], accl.ProcessGroupACCL)


@pytest.mark.parametrize("group_name", ["world", "tiny", "ring"])
@pytest.mark.parametrize("n", [3, 129])
def test_all_reduce_every_dtype_and_op(groups, group_name: str, n: int) -> None:
    g = groups[group_name]
    rank, p = dist.get_rank(), dist.get_world_size()
    for seed, (dtype, op) in enumerate(itertools.product(DTYPES, OPS)):
        mine = rank_data(rank, n, dtype, seed)
        t = mine.clone()
        if not valid(dtype, op):
            with pytest.raises(TypeError, match="accl"):
                dist.all_reduce(t, op=op, group=g)
            assert torch.equal(t, mine)
            continue
        dist.all_reduce(t, op=op, group=g)
        expect = reference([rank_data(r, n, dtype, seed) for r in range(p)], op)
        assert torch.equal(t, expect), (dtype, op, t, expect)


def test_all_reduce_matches_gloo(groups) -> None:
    rank = dist.get_rank()
    for seed, (dtype, op) in enumerate(itertools.product(DTYPES, OPS)):
        if not valid(dtype, op):
            continue
        a = rank_data(rank, 50, dtype, seed)
        b = a.clone()
        dist.all_reduce(a, op=op)
        if dtype in GLOO_LACKS:
            continue
        dist.all_reduce(b, op=op, group=groups["gloo"])
        assert torch.equal(a, b), (dtype, op)


def test_all_reduce_non_contiguous_and_large(groups) -> None:
    rank, p = dist.get_rank(), dist.get_world_size()
    base = torch.arange(40 * 30, dtype=torch.float32).view(40, 30) * (rank + 1)
    t = base.t()  # non-contiguous view
    assert not t.is_contiguous()
    dist.all_reduce(t, group=groups["tiny"])
    assert torch.equal(base, torch.arange(1200, dtype=torch.float32).view(40, 30) * (p * (p + 1) // 2))
    big = torch.ones(30_000, dtype=torch.float64) * (rank + 1)  # 3750 segments of 64 B on "tiny"
    dist.all_reduce(big, op=R.MAX, group=groups["tiny"])
    assert torch.all(big == p)
    # 16-bit floats above the header slot go through MPI with the user-defined op: blocking inline
    # (synchronous) and on the worker thread (async, >= blocking_min_bytes)
    for dtype, n in itertools.product((torch.float16, torch.bfloat16), (3000, 70_000)):
        for op in (R.SUM, R.MIN, R.PRODUCT):
            seed = n + OPS.index(op)
            x = rank_data(rank, n, dtype, seed)
            w = dist.all_reduce(x, op=op, async_op=n > 10_000)
            if w is not None:
                w.wait()
            assert torch.equal(x, reference([rank_data(r, n, dtype, seed) for r in range(p)], op))


@pytest.mark.parametrize("group_name", ["world", "tiny"])
def test_reduce_every_root(groups, group_name: str) -> None:
    g = groups[group_name]
    rank, p = dist.get_rank(), dist.get_world_size()
    dtypes = [torch.float32, torch.bfloat16, torch.int64, torch.bool]
    for root, dtype, op in itertools.product(range(p), dtypes, [R.SUM, R.MAX, R.PRODUCT, R.AVG]):
        if not valid(dtype, op):
            continue
        seed = root * 100 + DTYPES.index(dtype) * 10 + OPS.index(op)
        mine = rank_data(rank, 77, dtype, seed)
        t = mine.clone()
        dist.reduce(t, dst=root, op=op, group=g)
        if rank == root:
            assert torch.equal(t, reference([rank_data(r, 77, dtype, seed) for r in range(p)], op))
        else:
            assert torch.equal(t, mine), "non-root input must be left untouched"


@pytest.mark.parametrize("group_name", ["world", "tiny", "ring"])
def test_broadcast_every_dtype_and_root(groups, group_name: str) -> None:
    g = groups[group_name]
    rank, p = dist.get_rank(), dist.get_world_size()
    for root, dtype in itertools.product(range(p), DTYPES):
        t = rank_data(rank, 33, dtype, root)
        dist.broadcast(t, src=root, group=g)
        assert torch.equal(t, rank_data(root, 33, dtype, root))
    # rows larger than a segment, non-contiguous destination
    base = torch.full((20, 6), float(rank))
    view = base[:, ::2]
    dist.broadcast(view, src=p - 1, group=g)
    assert torch.all(base[:, ::2] == p - 1) and torch.all(base[:, 1::2] == rank)


@pytest.mark.parametrize("group_name", ["world", "tiny"])
def test_all_gather_list_and_into_tensor(groups, group_name: str) -> None:
    g = groups[group_name]
    rank, p = dist.get_rank(), dist.get_world_size()
    for dtype in DTYPES:
        mine = rank_data(rank, 45, dtype, 5).view(9, 5)
        outs = [torch.empty_like(mine) for _ in range(p)]
        dist.all_gather(outs, mine, group=g)
        for r in range(p):
            assert torch.equal(outs[r], rank_data(r, 45, dtype, 5).view(9, 5))
        flat = torch.empty(p * 45, dtype=dtype)
        dist.all_gather_into_tensor(flat, mine, group=g)
        assert torch.equal(flat, torch.cat([rank_data(r, 45, dtype, 5) for r in range(p)]))
        stacked = torch.empty(p, 9, 5, dtype=dtype)
        dist.all_gather_into_tensor(stacked, mine.t().contiguous().t(), group=g)
        assert torch.equal(stacked[rank], mine)
        if hasattr(dist, "all_gather_single"):  # torch >= 2.13's name for all_gather_into_tensor
            single = torch.empty(p * 45, dtype=dtype)
            dist.all_gather_single(single, mine, group=g)
            assert torch.equal(single, flat)


@pytest.mark.parametrize("group_name", ["world", "tiny"])
def test_gather_and_scatter(groups, group_name: str) -> None:
    g = groups[group_name]
    rank, p = dist.get_rank(), dist.get_world_size()
    dtypes = [torch.float16, torch.int32, torch.bool, torch.float64]
    for root, dtype in itertools.product(range(p), dtypes):
        mine = rank_data(rank, 40, dtype, root)
        lst = [torch.empty_like(mine) for _ in range(p)] if rank == root else None
        dist.gather(mine, lst, dst=root, group=g)
        if rank == root:
            for r in range(p):
                assert torch.equal(lst[r], rank_data(r, 40, dtype, root))
        out = torch.empty(40, dtype=dtype)
        src = [rank_data(100 + r, 40, dtype, root) for r in range(p)] if rank == root else None
        dist.scatter(out, src, src=root, group=g)
        assert torch.equal(out, rank_data(100 + rank, 40, dtype, root))


@pytest.mark.parametrize("group_name", ["world", "tiny", "ring"])
def test_reduce_scatter_list_and_tensor(groups, group_name: str) -> None:
    g = groups[group_name]
    rank, p = dist.get_rank(), dist.get_world_size()
    for seed, (dtype, op) in enumerate(itertools.product(DTYPES, OPS)):
        if not valid(dtype, op):
            with pytest.raises(TypeError, match="accl"):
                dist.reduce_scatter_tensor(torch.zeros(4, dtype=dtype), torch.zeros(4 * p, dtype=dtype),
                                           op=op, group=g)
            continue
        full = [rank_data(r, 24 * p, dtype, seed) for r in range(p)]
        expect = reference(full, op).view(p, 24)[rank]
        out = torch.empty(24, dtype=dtype)
        dist.reduce_scatter_tensor(out, full[rank], op=op, group=g)
        assert torch.equal(out, expect), (dtype, op)
        out2 = torch.empty(4, 6, dtype=dtype)
        dist.reduce_scatter(out2, [c.view(4, 6) for c in full[rank].chunk(p)], op=op, group=g)
        assert torch.equal(out2.view(-1), expect), (dtype, op)
        if hasattr(dist, "reduce_scatter_single"):  # torch >= 2.13's name for reduce_scatter_tensor
            out3 = torch.empty(24, dtype=dtype)
            dist.reduce_scatter_single(out3, full[rank], op=op, group=g)
            assert torch.equal(out3, expect), (dtype, op)


@pytest.mark.parametrize("segment", [None, 4096])
def test_reduce_scatter_on_mpis_own_call(groups, segment: int | None) -> None:
    """Above the carried size, on a group whose reductions never take accl's ring (ring_min_bytes set huge, as a
    user whose MPI reduces faster would): MPI's reduce_scatter, in one call or, under max_segment_bytes, in
    segments of every rank's block at once, for every dtype and op."""
    options = accl.AcclOptions(ring_min_bytes=1 << 62, max_segment_bytes=segment)
    g = dist.new_group(backend="accl", pg_options=options)
    rank, p = dist.get_rank(), dist.get_world_size()
    n = 9000  # elements per rank's block: above the carried 16 KiB in all at every dtype from 2 ranks
    for seed, (dtype, op) in enumerate(itertools.product(DTYPES, OPS)):
        if not valid(dtype, op):
            continue
        assert plan("reduce_scatter", n * p * torch.tensor([], dtype=dtype).element_size(), p, False,
                    options) == "mpi"
        full = [rank_data(r, n * p, dtype, seed) for r in range(p)]
        out = torch.empty(n, dtype=dtype)
        RS(out, full[rank], op=op, group=g)
        assert torch.equal(out, reference(full, op).view(p, n)[rank]), (dtype, op)
    if segment:
        assert 0 < g.stats["max_call_bytes"] <= segment
    dist.destroy_process_group(g)


@pytest.mark.parametrize("group_name", ["world", "tiny"])
def test_all_to_all_single_even_and_uneven(groups, group_name: str) -> None:
    g = groups[group_name]
    rank, p = dist.get_rank(), dist.get_world_size()
    # even
    inp = torch.arange(p * 6, dtype=torch.int64) + 1000 * rank
    out = torch.empty_like(inp)
    dist.all_to_all_single(out, inp, group=g)
    assert torch.equal(out, torch.cat([torch.arange(rank * 6, rank * 6 + 6) + 1000 * r for r in range(p)]))

    # uneven: rank i sends (i + j + 1) rows of width 3 to rank j
    def rows(i: int, j: int) -> int:
        return i + j + 1

    def block(i: int, j: int, dtype) -> torch.Tensor:
        return (torch.arange(rows(i, j) * 3) + 100 * i + 10 * j).view(rows(i, j), 3).to(dtype)

    for dtype in (torch.float32, torch.bfloat16, torch.int8, torch.bool):
        send = torch.cat([block(rank, j, dtype) for j in range(p)])
        recv = torch.empty(sum(rows(i, rank) for i in range(p)), 3, dtype=dtype)
        dist.all_to_all_single(recv, send, [rows(i, rank) for i in range(p)],
                               [rows(rank, j) for j in range(p)], group=g)
        assert torch.equal(recv, torch.cat([block(i, rank, dtype) for i in range(p)]))


def test_all_to_all_single_even_on_some_ranks_only(groups) -> None:
    """Rank 0's splits are all equal, the others' are not: accl decides MPI_Alltoall against MPI_Alltoallv from the
    agreed byte matrix, so every rank makes the same call (a rank deciding alone would hang its peers)."""
    rank, p = dist.get_rank(), dist.get_world_size()
    c = 1000  # int64 elements: past the exchange's payload slot, so the data moves by MPI's call

    def n(i: int, j: int) -> int:  # what rank i sends rank j: c, but ranks above 0 send themselves more
        return c + i if i == j and i > 0 else c

    send = torch.cat([torch.full((n(rank, j),), 100 * rank + j, dtype=torch.int64) for j in range(p)])
    recv = torch.empty(sum(n(i, rank) for i in range(p)), dtype=torch.int64)
    dist.all_to_all_single(recv, send, [n(i, rank) for i in range(p)], [n(rank, j) for j in range(p)])
    assert torch.equal(recv, torch.cat([torch.full((n(i, rank),), 100 * i + rank, dtype=torch.int64)
                                        for i in range(p)]))


def test_all_to_all_list_uneven(groups) -> None:
    rank, p = dist.get_rank(), dist.get_world_size()
    ins = [torch.full((rank + j + 1,), float(10 * rank + j)) for j in range(p)]
    outs = [torch.empty(i + rank + 1) for i in range(p)]
    dist.all_to_all(outs, ins)
    for i in range(p):
        assert torch.all(outs[i] == 10 * i + rank)


@pytest.mark.parametrize("group_name", ["world", "tiny"])
def test_send_recv_isend_irecv_and_batch(groups, group_name: str) -> None:
    g = groups[group_name]
    rank, p = dist.get_rank(), dist.get_world_size()
    nxt, prv = (rank + 1) % p, (rank - 1) % p
    for dtype, n in itertools.product([torch.float32, torch.bfloat16, torch.int64, torch.bool], [0, 5, 1000]):
        mine = rank_data(rank, n, dtype, n)
        got = torch.empty(n, dtype=dtype)
        if rank % 2 == 0:
            dist.send(mine, nxt, group=g)
            dist.recv(got, prv, group=g)
        else:
            dist.recv(got, prv, group=g)
            dist.send(mine, nxt, group=g)
        assert torch.equal(got, rank_data(prv, n, dtype, n))
    # isend/irecv with tags, received in the opposite order of sending
    a, b = torch.full((300,), float(rank)), torch.full((7,), float(-rank))
    s1 = dist.isend(a, nxt, group=g, tag=1)
    s2 = dist.isend(b, nxt, group=g, tag=2)
    rb, ra = torch.empty(7), torch.empty(300)
    r2 = dist.irecv(rb, prv, group=g, tag=2)
    r1 = dist.irecv(ra, prv, group=g, tag=1)
    for w in (r2, r1, s1, s2):
        w.wait()
    assert torch.all(ra == prv) and torch.all(rb == -prv)
    # batch_isend_irecv ring, non-contiguous source
    src = torch.arange(60, dtype=torch.float32).view(6, 10).t() + rank
    dst = torch.empty(10, 6)
    ops = [dist.P2POp(dist.irecv, dst, prv, group=g), dist.P2POp(dist.isend, src, nxt, group=g)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    assert torch.equal(dst, torch.arange(60, dtype=torch.float32).view(6, 10).t() + prv)


def test_recv_any_source(groups) -> None:
    rank, p = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        seen = set()
        for _ in range(p - 1):
            t = torch.empty(2, dtype=torch.int64)
            src = dist.recv(t)
            assert t[0].item() == src
            seen.add(src)
        assert seen == set(range(1, p))
    else:
        dist.send(torch.tensor([rank, 0]), 0)


def test_barrier_and_subgroups(groups) -> None:
    rank, p = dist.get_rank(), dist.get_world_size()
    dist.barrier()
    dist.barrier(group=groups["ring"])
    evens = dist.new_group(ranks=list(range(0, p, 2)), backend="accl")
    odds = dist.new_group(ranks=list(range(1, p, 2)), backend="accl")
    mine = evens if rank % 2 == 0 else odds
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=mine)
    assert t.item() == sum(r for r in range(p) if r % 2 == rank % 2)
    members = [r for r in range(p) if r % 2 == rank % 2]
    b = torch.tensor([float(rank)])
    dist.broadcast(b, src=members[-1], group=mine)
    assert b.item() == members[-1]
    dist.barrier(group=mine)
    sub, _ = dist.new_subgroups(group_size=2, backend="accl")
    s = torch.tensor([1.0])
    dist.all_reduce(s, group=sub)
    assert s.item() == 2.0


def test_split_group_needs_accelerator_in_this_torch(groups) -> None:
    """torch 2.13 only splits groups through an accelerator backend; on CPU it says so."""
    if torch.accelerator.is_available():
        pytest.skip("an accelerator is present")
    with pytest.raises(RuntimeError, match="split"):
        dist.split_group(split_ranks=[[r] for r in range(dist.get_world_size())])


def test_object_collectives(groups) -> None:
    rank, p = dist.get_rank(), dist.get_world_size()
    objs = [None] * p
    dist.all_gather_object(objs, {"rank": rank, "data": list(range(rank))})
    assert objs == [{"rank": r, "data": list(range(r))} for r in range(p)]
    lst = [f"hello {rank}", rank * 3] if rank == 1 else [None, None]
    dist.broadcast_object_list(lst, src=1)
    assert lst == ["hello 1", 3]
    gathered = [None] * p if rank == 0 else None
    dist.gather_object(("x", rank), gathered, dst=0)
    if rank == 0:
        assert gathered == [("x", r) for r in range(p)]
    out = [None]
    dist.scatter_object_list(out, [{"to": r} for r in range(p)] if rank == 0 else None, src=0)
    assert out == [{"to": rank}]
    if rank == 0:
        dist.send_object_list([{"k": "v"}, 7], dst=1)
    elif rank == 1:
        got = [None, None]
        dist.recv_object_list(got, src=0)
        assert got == [{"k": "v"}, 7]


def test_segments_never_exceed_max_segment_bytes(groups) -> None:
    g = groups["tiny"]
    g.stats["max_call_bytes"] = 0
    rank, p = dist.get_rank(), dist.get_world_size()
    rows = torch.ones(3, 100) * rank  # each row (400 B) exceeds the 64 B segment
    calls = g.stats["engine_calls"]
    dist.all_reduce(rows, group=g)
    assert torch.all(rows == sum(range(p)))
    out = torch.empty(p * 3, 100)
    dist.all_gather_into_tensor(out, rows, group=g)
    dist.reduce_scatter_tensor(rows, out, group=g)
    inp = torch.ones(p * 50) * rank
    dist.all_to_all_single(torch.empty_like(inp), inp, group=g)
    assert g.stats["max_call_bytes"] <= 64
    assert g.stats["engine_calls"] - calls >= 1200 * 4 // 64


# --------------------------------------------------------------------- synchronous fast paths

AG = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)  # torch >= 2.13's names
RS = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


class _Submits:
    """Counts the group's calls that went to the queue since it was made (the backend's ``queued_calls``
    counter): zero means the fast path ran in the caller's thread."""

    def __init__(self, g, monkeypatch) -> None:
        self._g, self._start = g, g.stats["queued_calls"]

    @property
    def n(self) -> int:
        return self._g.stats["queued_calls"] - self._start


def _run_five(g, dtype: torch.dtype, n: int, seed: int, contiguous: bool = True) -> None:
    """all_reduce, broadcast, all_gather, reduce_scatter and all_to_all of ``n`` elements per rank
    block, each checked against values every rank rebuilds independently."""
    rank, p = dist.get_rank(), dist.get_world_size()

    def lay(x: torch.Tensor) -> torch.Tensor:  # same values, contiguous or a strided view
        if contiguous:
            return x
        holder = torch.zeros(x.numel(), 2, dtype=x.dtype)
        holder[:, 0] = x
        return holder[:, 0]

    everyone = [rank_data(r, n, dtype, seed) for r in range(p)]
    op = R.MAX if dtype == torch.bool else R.SUM
    t = lay(everyone[rank].clone())
    dist.all_reduce(t, op=op, group=g)
    assert torch.equal(t, reference(everyone, op)), ("all_reduce", dtype, n)
    root = (seed + 1) % p
    t = lay(everyone[rank].clone())
    dist.broadcast(t, src=root, group=g)
    assert torch.equal(t, everyone[root]), ("broadcast", dtype, n)
    out = lay(torch.empty(p * n, dtype=dtype))
    AG(out, lay(everyone[rank].clone()), group=g)
    assert torch.equal(out, torch.cat(everyone)), ("all_gather", dtype, n)
    full = [rank_data(r + 10, p * n, dtype, seed) for r in range(p)]
    red = lay(torch.empty(n, dtype=dtype))
    RS(red, lay(full[rank].clone()), op=op, group=g)
    assert torch.equal(red, reference(full, op).view(p, n)[rank]), ("reduce_scatter", dtype, n)
    got = lay(torch.empty(p * n, dtype=dtype))
    dist.all_to_all_single(got, lay(full[rank].clone()), group=g)
    assert torch.equal(got, torch.cat([f.view(p, n)[rank] for f in full])), ("all_to_all", dtype, n)


@pytest.mark.parametrize("group_name", ["world", "tiny", "ring"])
def test_sync_fast_paths_every_dtype(groups, group_name: str, monkeypatch) -> None:
    """Synchronous calls on contiguous CPU tensors skip the queue and give the independently computed values for
    every dtype, carried, above that (header + blocking MPI or, on "ring", accl's ring for every reduction) and, on
    "tiny", in many segments."""
    g = groups[group_name]
    g.stats["max_call_bytes"] = 0
    for n in (3, 300):
        spy = _Submits(g, monkeypatch)
        for seed, dtype in enumerate(DTYPES):
            _run_five(g, dtype, n, seed)
        assert spy.n == 0, f"{spy.n} synchronous calls were queued on an idle group"
        monkeypatch.undo()
    if group_name == "tiny":
        assert 0 < g.stats["max_call_bytes"] <= 64


def test_non_contiguous_inputs_are_staged_in_the_callers_thread_and_are_right(groups, monkeypatch) -> None:
    """Strided inputs and outputs are staged through contiguous copies by the synchronous call itself (the
    C++ backend has no reason to hand them to its worker thread), with the same results."""
    for name in ("world", "tiny"):
        g = groups[name]
        spy = _Submits(g, monkeypatch)
        for seed, dtype in enumerate((torch.float32, torch.bfloat16, torch.int64, torch.bool)):
            _run_five(g, dtype, 40, seed, contiguous=False)
        assert spy.n == 0
        monkeypatch.undo()


def test_fast_path_segments_stay_within_max_segment_bytes(groups) -> None:
    """Several segments per call on the fast path: results right, no engine call above 64 B."""
    g = groups["tiny"]
    rank, p = dist.get_rank(), dist.get_world_size()
    g.stats["max_call_bytes"] = 0
    calls = g.stats["engine_calls"]
    t = torch.arange(500, dtype=torch.float64) + rank  # 4000 B: 63 segments of 8 doubles
    dist.broadcast(t, src=p - 1, group=g)
    assert torch.equal(t, torch.arange(500, dtype=torch.float64) + p - 1)
    out = torch.empty(p * 500, dtype=torch.float64)
    AG(out, t, group=g)
    assert torch.equal(out, (torch.arange(500, dtype=torch.float64) + p - 1).repeat(p))
    rows = torch.arange(p * 100, dtype=torch.int32) * (rank + 1)
    part = torch.empty(100, dtype=torch.int32)
    RS(part, rows, group=g)
    assert torch.equal(part, torch.arange(rank * 100, rank * 100 + 100, dtype=torch.int32) * (p * (p + 1) // 2))
    # uneven all_to_all: rank i sends 40 * (i + j + 1) bytes (int32) to rank j
    send = torch.cat([torch.full((10 * (rank + j + 1),), 100 * rank + j, dtype=torch.int32) for j in range(p)])
    recv = torch.empty(sum(10 * (i + rank + 1) for i in range(p)), dtype=torch.int32)
    dist.all_to_all_single(recv, send, [10 * (i + rank + 1) for i in range(p)],
                           [10 * (rank + j + 1) for j in range(p)], group=g)
    assert torch.equal(recv, torch.cat([torch.full((10 * (i + rank + 1),), 100 * i + rank, dtype=torch.int32)
                                        for i in range(p)]))
    assert g.stats["max_call_bytes"] <= 64
    assert g.stats["engine_calls"] - calls >= 4000 // 64


def test_sync_call_behind_async_work_keeps_issue_order(groups, monkeypatch) -> None:
    """A synchronous call while async collectives are pending is queued behind them and sees
    their results (the fast path needs an idle group)."""
    import time

    g = groups["world"]
    rank, p = dist.get_rank(), dist.get_world_size()
    for sync in ("all_reduce", "broadcast", "all_gather", "reduce_scatter", "all_to_all"):
        t = torch.ones(3000)
        if rank == p - 1:
            time.sleep(0.02)  # the others' async work cannot finish before this rank joins it
        works = [dist.all_reduce(t, async_op=True, group=g) for _ in range(3)]
        spy = _Submits(g, monkeypatch)
        if sync == "all_reduce":
            dist.all_reduce(t, group=g)
            assert torch.all(t == float(p) ** 4)
        elif sync == "broadcast":
            dist.broadcast(t, src=p - 1, group=g)
            assert torch.all(t == float(p) ** 3)
        elif sync == "all_gather":
            out = torch.empty(p * 3000)
            AG(out, t, group=g)
            assert torch.all(out == float(p) ** 3)
        elif sync == "reduce_scatter":
            out = torch.empty(3000 // p)
            RS(out, t[: (3000 // p) * p], group=g)
            assert torch.all(out == float(p) ** 4)
        else:
            out = torch.empty(3000)
            dist.all_to_all_single(out, t, group=g)
            assert torch.all(out == float(p) ** 3)
        assert spy.n == 1 or rank == p - 1, sync
        monkeypatch.undo()
        assert all(w.is_completed() for w in works)


@pytest.mark.parametrize("n", [4, 600, 20_000])
def test_sync_and_async_ranks_make_matching_calls(groups, n: int) -> None:
    """Rank 0 issues every call async (queued path), the others synchronously (fast path): both
    paths must make the same MPI calls, carried, above that, and on accl's ring."""
    rank, p = dist.get_rank(), dist.get_world_size()
    for name in ("world", "tiny", "ring"):
        g = groups[name]
        if name != "world" and n > 600:
            continue  # hundreds of 64/256 B segments per call: the small groups are covered at 600
        a = rank == 0

        def done(w) -> None:
            if w is not None:
                w.wait()

        t = torch.full((n,), float(rank + 1))
        done(dist.all_reduce(t, group=g, async_op=a))
        assert torch.all(t == p * (p + 1) / 2), name
        t = torch.full((n,), float(rank))
        done(dist.broadcast(t, src=p - 1, group=g, async_op=a))
        assert torch.all(t == p - 1), name
        out = torch.empty(p * n)
        done(AG(out, torch.full((n,), float(rank)), group=g, async_op=a))
        assert torch.equal(out, torch.arange(p, dtype=torch.float32).repeat_interleave(n)), name
        part = torch.empty(n)
        done(RS(part, torch.full((p * n,), 1.0), group=g, async_op=a))
        assert torch.all(part == p), name
        got = torch.empty(p * n)
        done(dist.all_to_all_single(got, torch.full((p * n,), float(rank)), group=g, async_op=a))
        assert torch.equal(got, torch.arange(p, dtype=torch.float32).repeat_interleave(n)), name


def test_fast_path_float_overflow_is_inf_without_warnings(groups) -> None:
    """As torch: float overflow in the locally reduced header-slot payloads gives inf, silently."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for dtype, big in ((torch.float32, 3e38), (torch.float64, 1.7e308), (torch.float16, 60000.0),
                           (torch.bfloat16, 3e38)):
            t = torch.full((4,), big, dtype=dtype)
            dist.all_reduce(t, group=groups["world"])
            assert torch.all(torch.isinf(t)), dtype


@pytest.mark.parametrize("n", [1, 5, 100, 700])
def test_fused_and_staged_paths_agree_when_ranks_take_different_ones(groups, n: int) -> None:
    """Small broadcast, all_gather and reduce_scatter ride in the header slot (the exchange is the whole
    collective); a rank that queues the call (async) or stages a non-contiguous output must make the same
    MPI calls as one that runs it inline, inside the slot (n <= 64 at 4 ranks) and above it."""
    g = groups["world"]
    rank, p = dist.get_rank(), dist.get_world_size()
    asynchronous = rank % 2 == 1
    everyone = [rank_data(r, n, torch.float32, n) for r in range(p)]

    def done(work) -> None:
        if asynchronous:
            work.wait()

    t = everyone[rank].clone() if rank == 1 % p else torch.zeros(n)
    done(dist.broadcast(t, 1 % p, group=g, async_op=asynchronous))
    assert torch.equal(t, everyone[1 % p])
    out = torch.empty(n, p).t() if rank == 0 else torch.empty(p, n)  # rank 0: strided, staged
    done(dist.all_gather_into_tensor(out, everyone[rank].clone(), group=g, async_op=asynchronous))
    assert torch.equal(out.reshape(-1), torch.cat(everyone))
    full = [rank_data(r + 10, p * n, torch.float32, n) for r in range(p)]
    red = torch.empty(n)
    done(dist.reduce_scatter_tensor(red, full[rank].clone(), group=g, async_op=asynchronous))
    assert torch.equal(red, reference(full, R.SUM).view(p, n)[rank].to(torch.float32))


@pytest.mark.parametrize("m", [1, 4, 40, 400, 4000])
def test_all_to_all_uneven_empty_and_even_splits_with_mixed_paths(groups, m: int) -> None:
    """all_to_all_single with uneven (and empty) splits, then even ones (MPI's all-to-all without counts): ranks
    that queue the call (async) or stage a strided output must agree, the same shape twice in a row too."""
    g = groups["world"]
    rank, p = dist.get_rank(), dist.get_world_size()
    asynchronous = rank % 2 == 1

    def count(i: int, j: int) -> int:  # elements rank i sends to rank j
        return (i + 2 * j) % 3 * m

    def data(i: int) -> torch.Tensor:  # rank i's send buffer, blocks in rank order
        return torch.cat([torch.full((count(i, j),), float(100 * i + j)) for j in range(p)])

    want = torch.cat([torch.full((count(i, rank),), float(100 * i + rank)) for i in range(p)])
    for _ in range(2):
        out = torch.empty(want.numel())
        work = dist.all_to_all_single(out, data(rank), [count(i, rank) for i in range(p)],
                                      [count(rank, j) for j in range(p)], group=g, async_op=asynchronous)
        if asynchronous:
            work.wait()
        assert torch.equal(out, want)
    even = torch.arange(p * m, dtype=torch.float64) + 1000 * rank
    got = torch.empty(2 * p * m, dtype=torch.float64)[::2] if rank == 0 else torch.empty(p * m, dtype=torch.float64)
    work = dist.all_to_all_single(got, even, group=g, async_op=asynchronous)
    if asynchronous:
        work.wait()
    assert torch.equal(got.reshape(-1), torch.cat([torch.arange(rank * m, rank * m + m, dtype=torch.float64)
                                                   + 1000 * i for i in range(p)]))
