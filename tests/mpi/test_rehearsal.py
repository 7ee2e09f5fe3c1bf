"""torchhpc.rehearsal under mpiexec: global one-sided sampling, integrity under concurrency, state."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from mpi4py import MPI

from torchhpc.rehearsal import RehearsalBuffer, RehearsalLoader
from torchhpc.runtime.errors import EngineUnavailableError, PeerTimeoutError
from torchhpc.runtime.native import load

MPI_RANKS = (1, 2, 4)
MPI_TIMEOUT = 150

K = 3
SHAPE = (4, 8)


def encode(labels: torch.Tensor, ids: torch.Tensor, rank: int, shape=SHAPE) -> torch.Tensor:
    """Every element holds ``label + 10 * rank + 100 * id``: label, origin rank and identity in one value."""
    v = (labels + 10 * rank + 100 * ids).double()
    return v.view(-1, *([1] * len(shape))).expand(-1, *shape).contiguous()


def decode(samples: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Check each sample is whole and carries its own label; return (origin ranks, ids)."""
    flat = samples.reshape(samples.shape[0], -1)
    assert (flat == flat[:, :1]).all(), "a sample was torn (mixes two stored samples)"
    v = flat[:, 0].long()
    assert torch.equal(v % 10, targets), "a representative is paired with another sample's label"
    return (v // 10) % 10, v // 100


@pytest.fixture(params=["mpi", "thallium"])
def transport(request: pytest.FixtureRequest) -> str:
    """Both transports for the tests of remote reads; thallium skips (on every rank) where it is not built."""
    if request.param == "thallium":
        try:
            load("thallium")
        except EngineUnavailableError as exc:
            pytest.skip(str(exc))
    return request.param


def make(comm: MPI.Comm, **kw) -> RehearsalBuffer:
    args = dict(num_classes=K, slots_per_class=6, num_candidates=4, num_representatives=5,
                sample_shapes=SHAPE, sample_dtypes=torch.float64, seed=11, comm=comm)
    args.update(kw)
    return RehearsalBuffer(**args)


def test_the_default_transport_is_thallium_across_nodes_where_built(comm: MPI.Comm) -> None:
    """``transport="auto"``: Thallium when the ranks span hosts and it is built everywhere, else one-sided MPI."""
    hosts = set(comm.allgather(socket.gethostname()))
    try:
        load("thallium")
        built = True
    except EngineUnavailableError:
        built = False
    expected = "thallium" if len(hosts) > 1 and all(comm.allgather(built)) else "mpi"
    with make(comm) as buf:
        assert buf.transport == expected, (hosts, built)
        y = torch.arange(6) % K
        buf.accumulate(encode(y, torch.arange(6), comm.Get_rank()), y)
        buf.wait()
        comm.Barrier()
    with make(comm, global_sampling=False) as buf:
        assert buf.transport == "mpi"


def test_global_sampling_reaches_every_rank(comm: MPI.Comm, transport: str) -> None:
    rank, size = comm.Get_rank(), comm.Get_size()
    with make(comm, num_representatives=8, transport=transport) as buf:
        for step in range(4):  # fill phase, then everyone's buffer is visible
            y = torch.arange(6) % K
            buf.accumulate(encode(y, torch.arange(6) + 6 * step, rank), y)
            buf.wait()
        comm.Barrier()
        origins = set()
        for step in range(4, 12):
            y = torch.arange(6) % K
            buf.accumulate(encode(y, torch.arange(6) + 6 * step, rank), y)
            out = buf.wait()
            src, ids = decode(out.samples, out.targets)
            assert (src[:6] == rank).all()
            origins.update(src[6:].tolist())
            assert out.samples.shape[0] == 6 + 8
        assert origins == set(range(size)), f"rank {rank} only ever drew from ranks {sorted(origins)}"
        if size > 1:
            assert buf.stats()["remote_bytes"] > 0
        comm.Barrier()


def test_concurrent_updates_and_reads_never_mismatch(comm: MPI.Comm, transport: str) -> None:
    """Every rank keeps rewriting its only two slots while the others read them.

    512 KiB records make updates and reads overlap in time; with the update lock removed
    this check does catch torn samples (rarely on 2 cores: about one in a few hundred reads).
    """
    rank = comm.Get_rank()
    shape = (128, 512)
    with make(comm, num_classes=2, slots_per_class=1, num_candidates=6, num_representatives=2,
              sample_shapes=shape, task="rehearsal+kd", activation_shape=(7,), transport=transport) as buf:
        gen = torch.Generator().manual_seed(rank)
        checked = 0
        for step in range(60):
            y = torch.randint(0, 2, (6,), generator=gen)
            ids = torch.arange(6) + 6 * step
            buf.accumulate(encode(y, ids, rank, shape), y, encode(y, ids, rank, (7,)).float())
            out = buf.wait()
            src, got = decode(out.samples, out.targets)
            asrc, agot = decode(out.activations.double(), out.targets)
            assert torch.equal(src, asrc) and torch.equal(got, agot), "activation paired with another sample"
            checked += out.samples.shape[0] - 6
        assert checked > 0
        comm.Barrier()


def test_owner_need_not_call_mpi_for_its_data_to_be_read(comm: MPI.Comm, transport: str, shared_tmp: Path) -> None:
    """Ranks > 0 stay out of MPI until rank 0 has drawn 10 times from them: checked by order, not by time.  They
    wait for rank 0's "done" file (a file, no MPI call), at most 60 s; had rank 0's reads needed them, it could
    not have finished first, and they would have woken by the cap instead."""
    rank, size = comm.Get_rank(), comm.Get_size()
    polling = {"progress_interval": 0.002} if transport == "mpi" else {}  # also runs the idle worker's polling
    done = shared_tmp / "rank0-done"
    with make(comm, transport=transport, **polling) as buf:
        y = torch.arange(6) % K
        buf.accumulate(encode(y, torch.arange(6), rank), y)
        buf.wait()
        comm.Barrier()
        woke_by = "rank 0"
        if rank == 0:
            origins = set()
            for step in range(1, 11):
                buf.accumulate(encode(y, torch.arange(6) + 6 * step, rank), y)
                src, _ = decode(*buf.wait()[:2])
                origins.update(src[6:].tolist())
            done.touch()
            assert size == 1 or len(origins - {0}) > 0, "no record came from a sleeping owner"
        else:
            cap = time.monotonic() + 60
            while not done.exists():  # no MPI call here: the peers' reads must not need us
                if time.monotonic() > cap:
                    woke_by = "the 60 s cap"
                    break
                time.sleep(0.01)
        comm.Barrier()
        assert comm.allgather(woke_by) == ["rank 0"] * size, "rank 0's reads waited for the sleeping owners"


def run(buf: RehearsalBuffer, comm: MPI.Comm, start: int, steps: int) -> list[torch.Tensor]:
    """Ranks take turns (barrier after each), so every global draw sees the same peer states every run."""
    rank = comm.Get_rank()
    outs = []
    for step in range(start, start + steps):
        for turn in range(comm.Get_size()):
            if turn == rank:
                y = torch.tensor([step % K, (step + rank) % K, 1, 2])
                buf.accumulate(encode(y, torch.arange(4) + 4 * step, rank), y)
                outs.append(buf.wait().samples.clone())
            comm.Barrier()
    return outs


def test_state_round_trip_under_mpi(comm: MPI.Comm, transport: str) -> None:
    a = make(comm, seed=3, transport=transport)
    run(a, comm, 0, 8)
    state = a.state_dict()
    expected = run(a, comm, 8, 6)
    a.close()
    b = make(comm, seed=4, transport=transport)
    b.load_state_dict(state)
    comm.Barrier()  # every rank restored before anyone reads a peer
    got = run(b, comm, 8, 6)
    assert all(torch.equal(x, y) for x, y in zip(expected, got, strict=True))
    b.close()


def test_loader_wrapper_global(comm: MPI.Comm, transport: str) -> None:
    rank = comm.Get_rank()
    data = []
    for step in range(10):
        y = torch.tensor([step % K, 1, 2])
        data.append((encode(y, torch.arange(3) + 3 * step, rank), y))
    with make(comm, num_representatives=3, transport=transport) as buf:
        n = 0
        for i, batch in enumerate(RehearsalLoader(data, buf)):
            src, ids = decode(batch.samples, batch.targets)
            assert torch.equal(ids[:3], torch.arange(3) + 3 * i) and (src[:3] == rank).all()
            n += 1
        assert n == 10 and buf.stats()["iterations"] == 10
        comm.Barrier()


def test_local_sampling_stays_local(comm: MPI.Comm) -> None:
    rank = comm.Get_rank()
    with make(comm, global_sampling=False) as buf:
        for step in range(6):
            y = torch.arange(6) % K
            buf.accumulate(encode(y, torch.arange(6) + 6 * step, rank), y)
            src, _ = decode(*buf.wait()[:2])
            assert (src == rank).all()
    assert np.isfinite(buf.stats()["timings_ms"]["update"])


def test_a_stuck_thallium_owner_is_each_readers_timeout_not_an_abort(comm: MPI.Comm) -> None:
    """Rank 1's engine stops answering (its block lock held, so its handlers wait): every other rank's next draw
    raises torchhpc's PeerTimeoutError naming rank 1 within the transport's deadline, and no process aborts."""
    if comm.Get_size() < 2:
        pytest.skip("not at this rank count: needs a peer to be stuck")
    try:
        load("thallium")
    except EngineUnavailableError as exc:
        pytest.skip(str(exc))
    rank = comm.Get_rank()
    buf = make(comm, transport="thallium", timeout=3.0)
    try:
        for step in range(2):
            y = torch.arange(6) % K
            buf.accumulate(encode(y, torch.arange(6) + 6 * step, rank), y)
            buf.wait()
        comm.Barrier()
        if rank == 1:
            buf.storage.transport.lock_exclusive()
        comm.Barrier()
        if rank != 1:
            y = torch.arange(6) % K
            buf.accumulate(encode(y, torch.arange(6) + 12, rank), y)
            started = time.monotonic()
            with pytest.raises(RuntimeError, match="the rehearsal worker failed") as failed:
                buf.wait(timeout=60)  # the worker's own deadline (3 s) ends it, not this one
            assert time.monotonic() - started < 15
            cause = failed.value.__cause__
            assert isinstance(cause, PeerTimeoutError), repr(cause)
            assert "rank 1 did not answer a fill-count request within the 3 s deadline" in str(cause), cause
        comm.Barrier()
        if rank == 1:
            buf.storage.transport.unlock_exclusive()
    finally:
        buf.close()
