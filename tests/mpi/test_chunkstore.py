"""ChunkTensor under mpiexec: gathers equal t[idx] across every tier split, on one and several "nodes".

Several nodes are emulated on one machine with ``ranks_per_node`` (each group of ranks gets its
own host segment and rows of other groups travel through torch.distributed all-to-all, gloo); on the
virtual cluster (tests/test_vcluster.py) the nodes are real.
"""

import os

import numpy as np
import pytest
import torch
import torch.distributed as dist

from torchhpc.chunkstore import ChunkTensor, hot_order_by_degree, node_topology
from torchhpc.launcher import init_distributed

MPI_RANKS = (1, 2, 4)
MPI_TIMEOUT = 120


@pytest.fixture(scope="module", autouse=True)
def gloo(comm):
    init_distributed(backend="gloo", timeout=60)
    yield
    dist.destroy_process_group()


def _two_nodes(comm):
    """ranks_per_node for two nodes: simulated on one real node, the real ones across nodes."""
    return comm.size // 2 if node_topology(comm).num_nodes == 1 else None


def _node_splits(comm):
    """ranks_per_node settings worth testing at this world size: one node, and several when possible.
    Across real nodes (the virtual cluster) only MPI's own grouping is real: ranks of a simulated node
    must share a /dev/shm."""
    out = [None]
    if node_topology(comm).num_nodes > 1:
        return out
    if comm.size >= 2:
        out.append(comm.size // 2)  # two nodes
    if comm.size == 4:
        out.append(3)  # uneven nodes: 3 + 1 ranks
    return out


def _boundary_ids(ct):
    """Row ids at every tier and node boundary (first and last row of each piece)."""
    lay = ct.layout
    pos = []
    for n in range(lay.num_nodes):
        base = lay.node_starts[n]
        for s in lay.segment_starts(n) + [lay.node_rows(n)]:
            pos += [base + s - 1, base + s]
    pos = torch.tensor([p for p in pos if 0 <= p < lay.num_rows], dtype=torch.int64)
    return ct._id_at[pos] if ct._id_at is not None else pos


def _data(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-(2**30), 2**30, shape, generator=g, dtype=torch.int64).to(dtype)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.float16, torch.bfloat16, torch.float32,
                                   torch.float64])
def test_gather_matches_every_dtype_and_tier_split(comm, dtype):
    rows, cols = 203, 5
    t = _data((rows, cols), dtype, 1)
    rb = cols * t.element_size()
    g = torch.Generator().manual_seed(comm.rank)
    for rpn in _node_splits(comm):
        for cap in (0, 7 * rb, 10**9):  # host only, mixed, device only (capacity beyond the tensor)
            with ChunkTensor(t.shape, dtype, cap, ranks_per_node=rpn) as ct:
                ct.load_from_tensor(t if comm.rank == 0 else None, src=0)
                idx = torch.randint(0, rows, (500,), generator=g)
                idx = torch.cat([idx, idx[:50], _boundary_ids(ct)])  # duplicates and boundaries
                for it in (torch.int64, torch.int32):
                    assert torch.equal(ct.index(idx.to(it)), t[idx]), (rpn, cap, it)


@pytest.mark.parametrize("ordered", [False, True])
def test_gather_1d_and_hot_order(comm, ordered):
    n = 301
    t = _data((n,), torch.int64, 2)
    indptr = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(torch.arange(n) % 17, 0)])
    order = hot_order_by_degree(indptr) if ordered else None
    for rpn in _node_splits(comm):
        with ChunkTensor(n, torch.int64, 40 * 8, hot_order=order, ranks_per_node=rpn) as ct:
            ct.load_from_tensor(t, src=None)
            idx = torch.arange(n).flip(0)
            assert torch.equal(ct[idx], t[idx])
            assert torch.equal(ct[_boundary_ids(ct)], t[_boundary_ids(ct)])
            assert ct[5].item() == t[5].item()
            assert torch.equal(ct[10:20], t[10:20])
            two_d = torch.tensor([[3, 4], [300, 0]])
            assert torch.equal(ct[two_d], t[two_d])
            assert ct.index(torch.empty(0, dtype=torch.int32)).shape == (0,)
            buf = torch.empty(n, dtype=torch.int64)
            assert ct.index(idx, out=buf).data_ptr() == buf.data_ptr() and torch.equal(buf, t[idx])
            with pytest.raises(ValueError, match="out must be"):
                ct.index(idx, out=torch.empty(n - 1, dtype=torch.int64))
            # the per-tier gather used when tiers are separate memories (GPU chunks + host tier),
            # exercised here on CPU views of the same data
            ct._node_view, ct._fast = None, False
            mixed = torch.cat([idx, _boundary_ids(ct), idx[::3]])
            assert torch.equal(ct[mixed], t[mixed])
            assert torch.equal(ct[_boundary_ids(ct)[:2]], t[_boundary_ids(ct)[:2]])
            # views hold exactly the rows their ids say
            assert torch.equal(ct.host_view(), t[ct.host_ids()])
            assert torch.equal(ct.device_view(), t[ct.device_ids()])
            if ordered:
                # on every node the device tiers hold hotter rows than its host tier, and the
                # hottest rows are dealt over all nodes
                rank_of = torch.empty(n, dtype=torch.int64)
                rank_of[order] = torch.arange(n)
                node_dev = ct.topo.node_comm.allgather(ct.device_ids())
                assert rank_of[torch.cat(node_dev)].max() < rank_of[ct.host_ids()].min()
                assert rank_of[torch.cat(node_dev)].min() == ct.topo.node


def test_split_index_and_tier_gathers(comm):
    t = _data((120, 3), torch.float32, 3)
    for rpn in _node_splits(comm):
        with ChunkTensor(t.shape, t.dtype, 10 * 12, ranks_per_node=rpn) as ct:
            ct.load_from_tensor(t)
            idx = torch.arange(120).repeat(2)
            sp = ct.split_index(idx)
            allpos = torch.sort(torch.cat([p.order for p in sp])).values
            assert torch.equal(allpos, torch.arange(240))
            for part in sp:
                assert torch.equal(idx[part.order], part.ids)
            assert torch.equal(sp.local.ids.unique(), ct.device_ids().unique())
            assert torch.equal(sp.host.ids.unique(), ct.host_ids().unique())
            if sp.local.ids.numel():
                assert torch.equal(ct.local_index(sp.local.ids), t[sp.local.ids])
            if sp.device.ids.numel():
                assert torch.equal(ct.device_index(sp.device.ids), t[sp.device.ids])
            assert torch.equal(ct.host_index(sp.host.ids), t[sp.host.ids])
            with pytest.raises(ValueError, match="host tier"):
                ct.host_index(idx)
            if ct.topo.num_nodes > 1:
                assert sp.remote.ids.numel() > 0
                assert torch.equal(ct.remote_index(sp.remote.ids), t[sp.remote.ids])
                with pytest.raises(ValueError, match="remote_index"):
                    ct.remote_index(sp.host.ids)
            else:
                assert sp.remote.ids.numel() == 0


@pytest.mark.parametrize("rows_by", ["mpi", "group"])
def test_remote_gathers_with_uneven_requests(comm, rows_by):
    """Some ranks ask for nothing, others for many remote rows: the exchange stays collective and exact, whether
    the rows travel by MPI or over the torch.distributed group."""
    if comm.size < 2:
        pytest.skip("not at this layout: needs two nodes")
    t = _data((97, 4), torch.float64, 4)
    with ChunkTensor(t.shape, t.dtype, 0, ranks_per_node=1, row_transport=rows_by) as ct:
        assert ct._exchange.by_mpi == (rows_by == "mpi")
        ct.load_from_tensor(t)
        idx = torch.arange(97) if comm.rank % 2 else torch.empty(0, dtype=torch.int64)
        for _ in range(3):
            assert torch.equal(ct[idx], t[idx])
        # rows from several nodes in random order (rows come back grouped by server, then scattered),
        # only remote rows in request order (received straight into out), and mixed local + remote
        g = torch.Generator().manual_seed(comm.rank)
        mine = ct.host_ids()
        remote = torch.tensor([i for i in range(97) if i not in set(mine.tolist())])
        for idx in (torch.randint(0, 97, (300,), generator=g), remote, remote.flip(0),
                    torch.cat([mine[:3], remote[:5], mine[3:4]])):
            buf = torch.empty(len(idx), 4, dtype=torch.float64)
            assert ct.index(idx, out=buf).data_ptr() == buf.data_ptr() and torch.equal(buf, t[idx])
            assert torch.equal(ct.index(idx.int()), t[idx])
        rep = ct.memory_report()
        assert all(r["exchange_buffer_bytes"] > 0 for r in rep.per_rank)  # kept for the next gather
    with ChunkTensor((9, 0), torch.float32, 0, ranks_per_node=1) as ct:  # rows of zero width
        assert ct[torch.tensor([8, 0, 4])].shape == (3, 0)


def test_host_tier_is_one_shared_segment_per_node(comm):
    for rpn in _node_splits(comm):
        with ChunkTensor((64, 8), torch.float32, 0, ranks_per_node=rpn) as ct:
            topo = ct.topo
            inodes = comm.allgather((topo.node, ct._host_seg.inode))
            assert len({i for n, i in inodes if n == topo.node}) == 1
            assert len({i for _, i in inodes}) == topo.num_nodes
            # a write by the node's first rank is seen by its peers without any copy
            if topo.local_rank == 0:
                ct.host_view().fill_(float(topo.node + 1))
            comm.Barrier()
            assert bool((ct.host_view() == topo.node + 1).all())
            # nothing of it is left as a name in /dev/shm once set-up is done
            assert not [p for p in os.listdir("/dev/shm") if p.startswith(f"torchhpc-cs.{os.geteuid()}.{os.getpid()}.")]


def test_memory_report_counts_host_tier_once_per_node(comm):
    rpn = _two_nodes(comm) if comm.size >= 2 else None
    rb = 16 * 4
    with ChunkTensor((100, 16), torch.float32, 5 * rb, ranks_per_node=rpn) as ct:
        rep = ct.memory_report()
        assert sum(n["total_bytes"] for n in rep.per_node) == 100 * rb
        assert sum(r["device_bytes"] for r in rep.per_rank) == sum(n["device_bytes"] for n in rep.per_node)
        for r in rep.per_rank:
            assert r["device_bytes"] == 5 * rb
        assert len(rep.per_rank) == comm.size
        assert "host_bytes" in str(rep)


def test_load_from_file_npy_and_raw(comm, shared_tmp):
    t = _data((150, 6), torch.bfloat16, 5)
    f = _data((150, 6), torch.float32, 6)
    path = None
    if comm.rank == 0:
        d = shared_tmp
        np.save(d / "f.npy", f.numpy())
        t.view(torch.uint16).numpy().tofile(d / "t.bin") if hasattr(torch, "uint16") else \
            t.view(torch.int16).numpy().tofile(d / "t.bin")
        path = str(d)
    path = comm.bcast(path, root=0)
    order = torch.randperm(150, generator=torch.Generator().manual_seed(0))
    for rpn in _node_splits(comm):
        with ChunkTensor(f.shape, torch.float32, 20 * 24, hot_order=order, ranks_per_node=rpn) as ct:
            ct.load_from_file(f"{path}/f.npy")
            assert torch.equal(ct[torch.arange(150)], f)
        with ChunkTensor(t.shape, torch.bfloat16, 20 * 12, ranks_per_node=rpn) as ct:
            ct.load_from_file(f"{path}/t.bin")
            assert torch.equal(ct[torch.arange(150)], t)


def test_errors_are_clear_and_agreed(comm):
    t = torch.arange(40, dtype=torch.float32).reshape(20, 2)
    with ChunkTensor(t.shape, t.dtype, 0) as ct:
        ct.load_from_tensor(t)
        with pytest.raises(IndexError, match="out of range"):
            ct[torch.tensor([0, 20])]
        with pytest.raises(IndexError, match="out of range"):
            ct[torch.tensor([-1])]
        with pytest.raises(TypeError, match="int32 or int64"):
            ct[torch.tensor([1.0])]
        # a bad input on rank 0 only must fail on every rank, not hang the others
        bad = torch.zeros(21, 2) if comm.rank == 0 else None
        with pytest.raises((ValueError, RuntimeError), match="shape|rank 0"):
            ct.load_from_tensor(bad, src=0)
        bad = t.double() if comm.rank == 0 else None
        with pytest.raises((TypeError, RuntimeError), match="dtype|rank 0"):
            ct.load_from_tensor(bad, src=0)
        assert torch.equal(ct[torch.arange(20)], t)  # a refused load leaves the tensor as it was
    with pytest.raises(ValueError, match="smaller than one row"):
        ChunkTensor((10, 4), torch.float32, 3)
    with pytest.raises(ValueError, match="1-D or 2-D"):
        ChunkTensor((2, 3, 4), torch.float32, 0)
    with pytest.raises(TypeError, match="dtype"):
        ChunkTensor((2, 3), torch.uint8, 0)
    with pytest.raises(ValueError, match="permutation"):
        ChunkTensor(5, torch.float32, 0, hot_order=torch.tensor([0, 0, 1, 2, 3]))
    if comm.size >= 2:
        # arguments that differ between ranks are refused on every rank
        with pytest.raises(ValueError, match="differ between ranks"):
            ChunkTensor((10, 4), torch.float32, 16 * (comm.rank + 1))
        with pytest.raises(ValueError, match="differ between ranks"):
            ChunkTensor((10 + comm.rank, 4), torch.float32, 0)


def test_sampling_over_chunk_tensors_matches_plain_tensors(comm):
    """Multi-layer sampling with indptr/indices/probs in ChunkTensors (remote rows included) gives
    exactly the minibatches of the same sampler on ordinary tensors; ranks may have no seeds."""
    from torchhpc.chunkstore import NeighborSampler

    g = torch.Generator().manual_seed(9)
    n = 300
    deg = torch.randint(0, 20, (n,), generator=g)
    indptr = torch.cat([torch.zeros(1, dtype=torch.int64), deg.cumsum(0)])
    indices = torch.randint(0, n, (int(indptr[-1]),), generator=g)
    probs = torch.rand(len(indices), generator=g)
    seeds = torch.arange(comm.rank, n, 11) if comm.rank != 1 else torch.empty(0, dtype=torch.int64)
    for rpn in _node_splits(comm)[-1:]:
        with ChunkTensor(len(indptr), torch.int64, 30 * 8, ranks_per_node=rpn) as cp, \
                ChunkTensor(len(indices), torch.int64, 200 * 8, ranks_per_node=rpn) as ci, \
                ChunkTensor(len(probs), torch.float32, 0, ranks_per_node=rpn) as cw:
            cp.load_from_tensor(indptr)
            ci.load_from_tensor(indices)
            cw.load_from_tensor(probs)
            for replace in (False, True):
                for pr_plain, pr_chunk in ((None, None), (probs, cw)):
                    a = NeighborSampler(indptr, indices, [5, 3], replace, pr_plain, seed=comm.rank)(seeds)
                    b = NeighborSampler(cp, ci, [5, 3], replace, pr_chunk, seed=comm.rank)(seeds)
                    assert torch.equal(a.n_id, b.n_id)
                    for x, y in zip(a.blocks, b.blocks, strict=True):
                        assert torch.equal(x.edge_index, y.edge_index) and torch.equal(x.e_id, y.e_id)


def test_graphsage_example_data_parallel(comm):
    """The example trains data-parallel on 2 ranks sharing the host tier, and learns from the graph."""
    if comm.size != 2:
        pytest.skip("not at this rank count: the example is checked at 2 ranks")
    from _scripts import load_script  # tests/ is on the path of every harness job

    mod = load_script("examples/graphsage_chunkstore.py")
    out = mod.main(["--nodes", "2000", "--avg-degree", "10", "--epochs", "2", "--batch-size", "128",
                    "--batches-per-epoch", "4", "--fanouts", "5,5", "--eval-nodes", "400", "--hidden", "32"])
    hist = out["history"]
    accs = comm.allgather(hist[1]["test_acc"])
    assert accs[0] == accs[1]  # evaluated jointly: every rank reports the same accuracy
    if comm.rank == 0:
        assert hist[1]["test_acc"] > hist[-1]["features_only_acc"] + 0.15, hist


def test_bad_input_on_one_rank_fails_every_rank_of_a_collective_gather(comm):
    """A rank whose gather (or sampling) input is bad tells its peers in the same collective step:
    everyone raises at once, nobody waits for a timeout, and the next gather works."""
    from torchhpc.chunkstore import NeighborSampler, sample_neighbors

    if comm.size < 2:
        pytest.skip("not at this layout: needs two nodes")
    t = _data((40, 3), torch.float32, 7)
    good = torch.tensor([1, 39, 20])
    with ChunkTensor(t.shape, t.dtype, 0, ranks_per_node=_two_nodes(comm)) as ct:
        ct.load_from_tensor(t)
        cases = [(lambda: ct[torch.tensor([40])], IndexError, "out of range"),
                 (lambda: ct[torch.tensor([1.0])], TypeError, "int32 or int64"),
                 (lambda: ct.index(good, out=torch.empty(2, 3)), ValueError, "out must be"),
                 (lambda: ct.remote_index(ct.host_ids()[:1]), ValueError, "holds itself")]
        for bad_call, typ, msg in cases:
            with pytest.raises(typ, match=msg if comm.rank == 0 else r"on rank\(s\) \[0\]"):
                bad_call() if comm.rank == 0 else ct[good]
            assert torch.equal(ct[good], t[good])  # the exchange is still in step on every rank
    indptr = torch.tensor([0, 2, 3, 5])
    indices = torch.tensor([1, 2, 0, 0, 1])
    with ChunkTensor(4, torch.int64, 0, ranks_per_node=_two_nodes(comm)) as cp, \
            ChunkTensor(5, torch.int64, 0, ranks_per_node=_two_nodes(comm)) as ci, \
            ChunkTensor(5, torch.float32, 0, ranks_per_node=_two_nodes(comm)) as cw:
        cp.load_from_tensor(indptr)
        ci.load_from_tensor(indices)
        cw.load_from_tensor(torch.tensor([1.0, -1.0, 1.0, 1.0, 1.0]))
        seeds = torch.tensor([3]) if comm.rank == 0 else torch.tensor([0, 2])
        with pytest.raises(IndexError, match="seed ids" if comm.rank == 0 else r"on rank\(s\) \[0\]"):
            sample_neighbors(seeds, cp, ci, 2, seed=0)
        # rank 0 meets a negative edge weight (node 0's edges); the others sample node 2 only
        seeds = torch.tensor([0]) if comm.rank == 0 else torch.tensor([2])
        with pytest.raises(ValueError, match="finite and >= 0" if comm.rank == 0 else r"on rank\(s\) \[0\]"):
            NeighborSampler(cp, ci, [2], probs=cw, seed=0)(seeds)
        row, col = sample_neighbors(torch.tensor([2]), cp, ci, 5, seed=0)
        assert sorted(row.tolist()) == [0, 1] and col.tolist() == [2, 2]


def test_a_gather_peers_never_join_times_out(comm):
    """A rank left alone in a cross-node gather raises TimeoutError after ``timeout`` instead of hanging."""
    if comm.size < 2:
        pytest.skip("not at this layout: needs two nodes")
    side = comm.Dup()  # synchronises the test without touching the ChunkTensor's communicator
    try:
        with ChunkTensor((40, 2), torch.float32, 0, ranks_per_node=_two_nodes(comm), timeout=0.5) as ct:
            if comm.rank == 0:
                with pytest.raises(TimeoutError, match="same number of times"):
                    ct[torch.tensor([39])]
                with pytest.raises(RuntimeError, match="timed out"):
                    ct[torch.tensor([39])]  # refused: the ranks no longer agree on the exchange
            side.Barrier()
            if comm.rank == 0:
                ct._exchange._abandoned[0].Wait()  # the late peers complete the abandoned step
            else:
                ct._exchange.fail(RuntimeError("late"))
        # construction (and every other collective entry point) waits for the peers with the same deadline
        from torchhpc.runtime import waiting

        if comm.rank == 0:
            with pytest.raises(TimeoutError, match=r"ChunkTensor\(\) is collective"):
                ChunkTensor((40, 2), torch.float32, 0, timeout=0.5)
        side.Barrier()
        if comm.rank == 0:
            waiting.ABANDONED.pop()[0][0].Wait()  # (requests, buffers) given up at the deadline
        else:
            waiting.agree(comm, None, 10.0, "ChunkTensor()")  # what the late peers' constructors start with
    finally:
        side.Free()
