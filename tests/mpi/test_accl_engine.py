"""The ACCL engine path: a clear error without pyaccl or a device, and, through a test double of the
``pyaccl`` driver (the one boundary we cannot run here: an Alveo card or ACCL's emulator), the real
engine code: device buffers, driver calls, segmentation, and the per-collective MPI "sidestep"."""

from __future__ import annotations

import sys
import types
from enum import IntEnum

import numpy as np
import pytest
import torch
import torch.distributed as dist
from mpi4py import MPI

import torchhpc.accl as accl

MPI_RANKS = (2, 4)
MPI_TIMEOUT = 180
R = dist.ReduceOp


# --------------------------------------------------------------------------- pyaccl test double
class ACCLReduceFunctions(IntEnum):
    SUM = 0


class SimBuffer:
    """Like pyaccl's SimBuffer: host array ``data`` plus a separate "device" copy synced explicitly."""

    def __init__(self, data: np.ndarray, socket: object):
        self.data = data
        self.socket = socket
        self.device = np.zeros_like(data)

    def sync_to_device(self) -> None:
        self.device[:] = self.data

    def sync_from_device(self) -> None:
        self.data[:] = self.device


class FakeAcclDriver:
    """Implements pyaccl's ``accl`` driver calls used by the engine, over MPI, with ACCL's limits:
    SUM only, and only the dtypes of ACCL's default arithmetic configurations."""

    ARITH = {np.dtype(d) for d in (np.float16, np.float32, np.float64, np.int32, np.int64)}
    calls: list[tuple[str, int]] = []

    def __init__(self, ranks, local_rank, protocol="TCP", nbufs=16, bufsize=1024, mem=None, overlay=None,
                 cclo_ip=None, hostctrl_ip=None, sim_sock=None):
        assert sim_sock is not None and "{" not in sim_sock, sim_sock
        assert len(ranks) == MPI.COMM_WORLD.Get_size() and ranks[local_rank]["session_id"] == local_rank
        self.sim_mode = True
        self.cclo = types.SimpleNamespace(socket=sim_sock)
        self._comms = [MPI.COMM_WORLD.Dup()]
        self.communicators = [list(range(len(ranks)))]

    def split_communicator(self, indices) -> None:
        base = self._comms[0]
        grp = base.Get_group().Incl(sorted(indices))
        self._comms.append(base.Create_group(grp, 77))
        self.communicators.append(sorted(indices))

    def _check(self, name: str, *bufs: SimBuffer, count: int) -> None:
        for b in bufs:
            assert isinstance(b, SimBuffer), f"{name}: not a device buffer"
            assert b.data.dtype in self.ARITH, f"{name}: ACCL has no arithmetic config for {b.data.dtype}"
        FakeAcclDriver.calls.append((name, count * bufs[0].data.itemsize))

    def allreduce(self, comm_id, sbuf, rbuf, count, func, run_async=False):
        assert func == ACCLReduceFunctions.SUM
        self._check("allreduce", sbuf, rbuf, count=count)
        sbuf.sync_to_device()
        self._comms[comm_id].Allreduce(sbuf.device[:count], rbuf.device[:count])
        rbuf.sync_from_device()

    def reduce(self, comm_id, sbuf, rbuf, count, root, func, run_async=False):
        assert func == ACCLReduceFunctions.SUM
        self._check("reduce", sbuf, rbuf, count=count)
        sbuf.sync_to_device()
        self._comms[comm_id].Reduce(sbuf.device[:count], rbuf.device[:count], root=root)
        rbuf.sync_from_device()

    def reduce_scatter(self, comm_id, sbuf, rbuf, count, func, run_async=False):
        assert func == ACCLReduceFunctions.SUM
        self._check("reduce_scatter", sbuf, rbuf, count=count)
        comm = self._comms[comm_id]
        sbuf.sync_to_device()
        comm.Reduce_scatter_block(sbuf.device[: count * comm.Get_size()], rbuf.device[:count])
        rbuf.sync_from_device()

    def bcast(self, comm_id, buf, count, root, run_async=False):
        self._check("bcast", buf, count=count)
        comm = self._comms[comm_id]
        if comm.Get_rank() == root:
            buf.sync_to_device()
        comm.Bcast(buf.device[:count], root=root)
        buf.sync_from_device()

    def allgather(self, comm_id, sbuf, rbuf, count, run_async=False):
        self._check("allgather", sbuf, rbuf, count=count)
        comm = self._comms[comm_id]
        sbuf.sync_to_device()
        comm.Allgather(sbuf.device[:count], rbuf.device[: count * comm.Get_size()])
        rbuf.sync_from_device()

    def gather(self, comm_id, sbuf, rbuf, count, root, run_async=False):
        self._check("gather", sbuf, rbuf, count=count)
        comm = self._comms[comm_id]
        sbuf.sync_to_device()
        comm.Gather(sbuf.device[:count], rbuf.device[: count * comm.Get_size()], root=root)
        rbuf.sync_from_device()

    def scatter(self, comm_id, sbuf, rbuf, count, root, run_async=False):
        self._check("scatter", sbuf, rbuf, count=count)
        comm = self._comms[comm_id]
        sbuf.sync_to_device()
        comm.Scatter(sbuf.device[: count * comm.Get_size()], rbuf.device[:count], root=root)
        rbuf.sync_from_device()

    def send(self, comm_id, srcbuf, count, dst, tag=0, run_async=False):
        self._check("send", srcbuf, count=count)
        srcbuf.sync_to_device()
        self._comms[comm_id].Send(srcbuf.device[:count], dst, tag)

    def recv(self, comm_id, dstbuf, count, src, tag=0, run_async=False):
        self._check("recv", dstbuf, count=count)
        self._comms[comm_id].Recv(dstbuf.device[:count], src, tag)
        dstbuf.sync_from_device()


def install_fake_pyaccl() -> None:
    pkg = types.ModuleType("pyaccl")
    mod = types.ModuleType("pyaccl.accl")
    mod.accl = FakeAcclDriver
    mod.SimBuffer = SimBuffer
    mod.ACCLReduceFunctions = ACCLReduceFunctions
    pkg.accl = mod
    sys.modules["pyaccl"] = pkg
    sys.modules["pyaccl.accl"] = mod


# --------------------------------------------------------------------------- tests
@pytest.fixture(scope="module", autouse=True)
def world():
    dist.init_process_group("accl")
    yield
    dist.destroy_process_group()


def test_clear_error_without_pyaccl(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "pyaccl", None)  # import pyaccl -> ImportError
    with pytest.raises(accl.EngineUnavailableError, match="'pyaccl' package .* is not installed"):
        dist.new_group(backend="accl", pg_options=accl.AcclOptions(engine="accl"))


def test_clear_error_without_device(monkeypatch) -> None:
    install_fake_pyaccl()
    monkeypatch.delenv("TORCHHPC_ACCL_SIM_SOCK", raising=False)
    monkeypatch.delenv("TORCHHPC_ACCL_XCLBIN", raising=False)
    with pytest.raises(accl.EngineUnavailableError, match="no ACCL device given"):
        dist.new_group(backend="accl", pg_options=accl.AcclOptions(engine="accl"))


@pytest.fixture(scope="module")
def accl_group():
    install_fake_pyaccl()
    opts = accl.AcclOptions(engine="accl", accl_sim_sock="tcp://localhost:{port}", max_segment_bytes=256)
    g = dist.new_group(backend="accl", pg_options=opts)
    assert g.engine_name == "accl"
    return g


def _calls() -> list[str]:
    out = [name for name, _ in FakeAcclDriver.calls]
    FakeAcclDriver.calls.clear()
    return out


def test_supported_collectives_run_on_the_accl_driver(accl_group) -> None:
    g = accl_group
    rank, p = dist.get_rank(), dist.get_world_size()
    _calls()
    t = torch.arange(300, dtype=torch.float32) * (rank + 1)  # 1200 B: 5 segments of <= 256 B
    dist.all_reduce(t, group=g)
    assert torch.equal(t, torch.arange(300, dtype=torch.float32) * (p * (p + 1) // 2))
    sizes = [nb for _, nb in FakeAcclDriver.calls]  # bytes each driver call touched, before _calls() clears them
    assert _calls() == ["allreduce"] * 5
    assert max(sizes) <= 256 and sum(sizes) == 1200, sizes  # every segment within the bound, all of it sent

    b = torch.full((10,), rank, dtype=torch.int64)
    dist.broadcast(b, src=p - 1, group=g)
    assert torch.all(b == p - 1) and _calls() == ["bcast"]

    out = torch.empty(p, 7, dtype=torch.float64)
    dist.all_gather_into_tensor(out, torch.full((7,), float(rank), dtype=torch.float64), group=g)
    assert torch.equal(out, torch.arange(p, dtype=torch.float64)[:, None].expand(p, 7))
    assert _calls() == ["allgather"]

    rs = torch.empty(5, dtype=torch.float16)
    dist.reduce_scatter_tensor(rs, torch.ones(5 * p, dtype=torch.float16), group=g)
    assert torch.all(rs == p) and _calls() == ["reduce_scatter"]

    r = torch.ones(4, dtype=torch.int32) * rank
    dist.reduce(r, dst=0, group=g)
    if rank == 0:
        assert torch.all(r == sum(range(p)))
    assert _calls() == ["reduce"]

    lst = [torch.empty(3) for _ in range(p)] if rank == 1 else None
    dist.gather(torch.full((3,), float(rank)), lst, dst=1, group=g)
    if rank == 1:
        assert [x[0].item() for x in lst] == list(range(p))
    sc = torch.empty(3)
    dist.scatter(sc, [torch.full((3,), 10.0 + i) for i in range(p)] if rank == 0 else None, src=0, group=g)
    assert torch.all(sc == 10.0 + rank)
    assert _calls() == ["gather", "scatter"]

    # point to point: header on MPI, payload segments on the driver
    nxt, prv = (rank + 1) % p, (rank - 1) % p
    big = torch.arange(600, dtype=torch.float32) + rank  # larger than a header slot: payload on the driver
    got = torch.empty(600)
    for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, big, nxt, group=g),
                                     dist.P2POp(dist.irecv, got, prv, group=g)]):
        w.wait()
    assert torch.equal(got, torch.arange(600, dtype=torch.float32) + prv)
    assert sorted(set(_calls())) == ["recv", "send"]


def test_what_accl_lacks_sidesteps_to_mpi(accl_group) -> None:
    g = accl_group
    rank, p = dist.get_rank(), dist.get_world_size()
    _calls()
    before = g.stats["sidestep_calls"]
    t = torch.tensor([float(rank)] * 80)
    dist.all_reduce(t, op=R.MAX, group=g)  # ACCL: SUM only
    assert torch.all(t == p - 1)
    h = torch.ones(100, dtype=torch.bfloat16)  # no bf16 arithmetic config
    dist.all_reduce(h, group=g)
    assert torch.all(h == p)
    inp = torch.arange(p * 2, dtype=torch.float32) + 100 * rank
    out = torch.empty_like(inp)
    dist.all_to_all_single(out, inp, group=g)  # no all-to-all in ACCL
    assert torch.equal(out, torch.cat([torch.arange(2 * rank, 2 * rank + 2) + 100.0 * r for r in range(p)]))
    dist.barrier(group=g)
    assert _calls() == [], "these must not reach the ACCL driver"
    assert g.stats["sidestep_calls"] > before


def test_sidestep_can_be_disabled_per_collective() -> None:
    install_fake_pyaccl()
    opts = accl.AcclOptions(engine="accl", accl_sim_sock="tcp://localhost:{port}",
                            sidestep=frozenset({"broadcast"}))
    g = dist.new_group(backend="accl", pg_options=opts)
    with pytest.raises(NotImplementedError, match="sidestep to MPI is disabled for 'all_reduce'"):
        dist.all_reduce(torch.ones(3), op=R.MIN, group=g)
    t = torch.ones(3, dtype=torch.int8)
    dist.broadcast(t, src=0, group=g)  # int8: not in ACCL, but broadcast may sidestep
    s = torch.ones(3)
    dist.all_reduce(s, group=g)  # float32 SUM: ACCL itself
    assert torch.all(s == dist.get_world_size())


def test_subgroup_on_the_accl_engine(accl_group) -> None:
    rank, p = dist.get_rank(), dist.get_world_size()
    ranks = list(range(0, p, 2)) if p > 2 else [0, 1]
    opts = accl.AcclOptions(engine="accl", accl_sim_sock="tcp://localhost:{port}")
    sub = dist.new_group(ranks=ranks, backend="accl", pg_options=opts)
    if rank in ranks:
        t = torch.ones(6) * rank
        dist.all_reduce(t, group=sub)
        assert torch.all(t == sum(ranks))
    dist.barrier()


def test_engine_selected_by_environment(monkeypatch) -> None:
    monkeypatch.setenv("TORCHHPC_ACCL_ENGINE", "accl")
    assert accl.AcclOptions().engine == "accl"
    monkeypatch.setenv("TORCHHPC_ACCL_ENGINE", "fpga")
    with pytest.raises(ValueError, match="TORCHHPC_ACCL_ENGINE='fpga': .* takes one of mpi, accl"):
        accl.AcclOptions()
