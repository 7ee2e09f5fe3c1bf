"""A rank-local error in any collective entry point is an error on every rank (issue 11, reproduction 3),
and the helper behind it, ``torchhpc.runtime.waiting.agreed``, across ranks.

One rank gets a bad argument (or a bad launch environment); it raises its own error and every other
rank raises :class:`~torchhpc.runtime.errors.RemoteError` naming that rank and the error, within seconds,
instead of waiting in the entry point's first collective.  (accl group creation: test_accl_groups.py.)

After construction too (issue 25): a rank that fails inside a later collective step makes the others
raise RemoteError at once, and a rank that never makes the call makes them raise PeerTimeoutError within
the object's deadline, never wait for ever.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable

import numpy as np
import pytest
import torch
from mpi4py import MPI
from torch import nn

from torchhpc.chunkstore import ChunkTensor
from torchhpc.runtime import errors, waiting

MPI_RANKS = (2, 3)
MPI_VARIANTS = ("mpich",)


def one_rank_fails(comm: MPI.Comm, make: Callable[[bool], object], own: type[BaseException], text: str) -> None:
    """Call ``make(bad)`` on every rank, ``bad`` true on the last rank only; check what each rank raises."""
    bad_rank = comm.Get_size() - 1
    bad = comm.Get_rank() == bad_rank
    t0 = time.monotonic()
    if bad:
        with pytest.raises(own, match=text):
            make(True)
    else:
        with pytest.raises(errors.RemoteError, match=rf"rank {bad_rank}\b.*{own.__name__}: .*{text}") as info:
            make(False)
        assert info.value.rank == bad_rank
    assert time.monotonic() - t0 < 30, "the error took the whole deadline to arrive"
    comm.Barrier()  # the ranks are in step again


def test_rehearsal_buffer_bad_argument(comm: MPI.Comm) -> None:
    from torchhpc.rehearsal import RehearsalBuffer

    one_rank_fails(comm, lambda bad: RehearsalBuffer(0 if bad else 4, 8, 4, 2, (3,), timeout=60),
                   ValueError, "num_classes must be an integer >= 1")


def test_rehearsal_buffer_launcher_contradiction(comm: MPI.Comm, monkeypatch: pytest.MonkeyPatch) -> None:
    """The issue's cascade: the launcher check failing on one rank left the others in Split_type."""
    from torchhpc.rehearsal import RehearsalBuffer

    def make(bad: bool) -> object:
        if bad:  # a stale variable naming another rank: a real contradiction, refused
            monkeypatch.setenv("OMPI_COMM_WORLD_RANK", str((comm.Get_rank() + 1) % comm.Get_size()))
            monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", str(comm.Get_size()))
            monkeypatch.setenv("PMI_RANK", str((comm.Get_rank() + 1) % comm.Get_size()))
            monkeypatch.setenv("PMI_SIZE", str(comm.Get_size()))
        return RehearsalBuffer(4, 8, 4, 2, (3,), timeout=60)

    bad_rank = comm.Get_size() - 1
    t0 = time.monotonic()
    if comm.Get_rank() == bad_rank:
        with pytest.raises((RuntimeError, errors.LauncherError), match="rank"):
            make(True)
    else:
        with pytest.raises(errors.RemoteError, match=rf"rank {bad_rank}\b"):
            make(False)
    assert time.monotonic() - t0 < 30
    comm.Barrier()


def test_chunk_tensor_bad_dtype(comm: MPI.Comm) -> None:
    one_rank_fails(comm, lambda bad: ChunkTensor((40, 2), torch.complex64 if bad else torch.float32, 0, timeout=60),
                   TypeError, "ChunkTensor dtype must be one of")


def test_layer_parallel_bad_final_time(comm: MPI.Comm) -> None:
    from torchhpc.braid import LayerParallel

    blocks = [lambda: nn.Linear(3, 3, dtype=torch.float64)]
    one_rank_fails(comm, lambda bad: LayerParallel(comm, blocks, [6], Tf=-1.0 if bad else 1.0, timeout=60),
                   ValueError, "final time Tf must be positive")


def test_gru_parallel_bad_cfactor(comm: MPI.Comm) -> None:
    from torchhpc.braid import GRUParallel

    one_rank_fails(comm, lambda bad: GRUParallel(comm, 3, 4, cfactor=1 if bad else 2, timeout=60),
                   ValueError, "cfactor must be >= 2")


def test_mgrit_solve_bad_time_points(comm: MPI.Comm) -> None:
    from torchhpc.braid import solve

    def make(bad: bool) -> object:
        t = [0.0, 0.5, 0.25, 1.0] if bad else [0.0, 0.25, 0.5, 1.0]
        return solve(lambda u, t0, t1: u, torch.ones(2, dtype=torch.float64), t, comm, timeout=60)

    one_rank_fails(comm, make, ValueError, "time points must be strictly increasing")


def test_init_distributed_backend_missing_on_one_rank(comm: MPI.Comm) -> None:
    import torch.distributed as dist

    from torchhpc.launcher import init_distributed

    assert not dist.is_initialized()
    os.environ.pop("MASTER_ADDR", None)
    one_rank_fails(comm, lambda bad: init_distributed("nccl" if bad else "gloo", timeout=60),
                   errors.LauncherError, "backend 'nccl' requested but this PyTorch has no NCCL")
    assert not dist.is_initialized()


# ---------------------------------------------------------------- after construction
DEADLINE = 3.0  # seconds: the objects' timeout in the tests of a rank that never joins
SLACK = 15.0  # an oversubscribed, loaded machine: ranks may start their wait late


def others_time_out(comm: MPI.Comm, call: Callable[[], object], text: str) -> None:
    """Every rank but the last runs ``call`` and must raise PeerTimeoutError matching ``text`` within the deadline
    (plus slack); the last rank never joins.  Whatever ``call`` abandons is never used again."""
    if comm.Get_rank() != comm.Get_size() - 1:
        t0 = time.monotonic()
        with pytest.raises(errors.PeerTimeoutError, match=text):
            call()
        elapsed = time.monotonic() - t0
        assert DEADLINE <= elapsed < DEADLINE + SLACK, elapsed
    comm.Barrier()  # the late rank waits here until the others have given up


def test_rehearsal_close_without_one_rank_times_out_then_completes(comm: MPI.Comm) -> None:
    """close() frees memory peers read, so it waits for them: once with a deadline, not for ever (it hung in
    MPI_Win_free); a later close(), once the late rank has closed, frees the buffer."""
    from torchhpc.rehearsal import RehearsalBuffer

    sub = comm.Dup()
    buf = RehearsalBuffer(4, 8, 4, 2, (3,), comm=sub, timeout=DEADLINE)
    others_time_out(comm, buf.close, r"RehearsalBuffer.close\(\) is collective over")
    if comm.Get_rank() != comm.Get_size() - 1:
        with pytest.raises(RuntimeError, match="closed"):
            buf.accumulate(torch.zeros(2, 3), torch.zeros(2, dtype=torch.int64))
    buf.close()  # the late rank closes; the others complete the close they gave up
    buf.close()  # closed: nothing more
    sub.Free()


@pytest.mark.parametrize("method", ["load_from_tensor", "load_from_file", "memory_report"])
def test_chunk_tensor_method_without_one_rank_times_out(comm: MPI.Comm, method: str) -> None:
    sub = comm.Dup()  # abandoned to the late rank's missing step, never used again
    t = torch.arange(80, dtype=torch.float32).reshape(40, 2)
    ct = ChunkTensor(t.shape, t.dtype, 0, comm=sub, timeout=DEADLINE)
    calls = {"load_from_tensor": lambda: ct.load_from_tensor(t), "load_from_file": lambda: ct.load_from_file(t.numpy()),
             "memory_report": ct.memory_report}
    others_time_out(comm, calls[method], rf"ChunkTensor.{method}\(\) is collective over {comm.Get_size()} ranks")
    ct.close()


class _Unreadable(np.ndarray):
    """An array whose rows cannot be read (a file system gone away under a memory map)."""

    def __getitem__(self, key: object) -> object:
        raise OSError("read error: the file system went away")


def test_chunk_tensor_load_failing_on_one_rank_mid_copy(comm: MPI.Comm) -> None:
    """A rank that fails while writing its rows (after the input checks passed) left the others in the load's
    final barrier; now they raise RemoteError naming it (also an OSError, its type), at once."""
    t = np.arange(80, dtype=np.float32).reshape(40, 2)
    with ChunkTensor((40, 2), torch.float32, 0, timeout=60) as ct:
        one_rank_fails(comm, lambda bad: ct.load_from_file(t.view(_Unreadable) if bad else t), OSError,
                       "read error: the file system went away")
        ct.load_from_file(t)  # the tensor is usable again
        assert torch.equal(ct[torch.arange(40)], torch.from_numpy(t))


class _LostTensor(torch.Tensor):
    """A tensor whose rows cannot be read any more (a device lost after the load's checks)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN206
        if func is torch.Tensor.index_select:
            raise RuntimeError("device lost while reading rows")
        return super().__torch_function__(func, types, args, kwargs or {})


def test_chunk_tensor_load_from_tensor_failing_on_the_source_rank(comm: MPI.Comm) -> None:
    t = torch.arange(80, dtype=torch.float32).reshape(40, 2)
    with ChunkTensor((40, 2), torch.float32, 0, timeout=60) as ct:
        t0 = time.monotonic()
        if comm.Get_rank() == 0:
            with pytest.raises(RuntimeError, match="device lost"):
                ct.load_from_tensor(t.as_subclass(_LostTensor), src=0)
        else:
            with pytest.raises(errors.RemoteError, match=r"rank 0\b.*RuntimeError: device lost"):
                ct.load_from_tensor(None, src=0)
        assert time.monotonic() - t0 < 30
        ct.load_from_tensor(t if comm.Get_rank() == 0 else None, src=0)
        assert torch.equal(ct[torch.arange(40)], t)


def _linear() -> nn.Module:
    return nn.Linear(4, 4, dtype=torch.float64)


def test_layer_parallel_backward_without_one_rank_times_out(comm: MPI.Comm) -> None:
    from torchhpc.braid import LayerParallel

    lp = LayerParallel(comm, [_linear], [2 * comm.Get_size()], Tf=1.0, timeout=DEADLINE)
    y = lp(torch.ones(2, 4, dtype=torch.float64))
    others_time_out(comm, lambda: y.sum().backward(), r"did not complete within 3 s")


def test_layer_parallel_serial_twin_without_one_rank_times_out(comm: MPI.Comm) -> None:
    from torchhpc.braid import LayerParallel

    lp = LayerParallel(comm, [_linear], [2 * comm.Get_size()], Tf=1.0, timeout=DEADLINE)
    if comm.Get_rank() == 0:  # only the root waits for everyone's weights
        t0 = time.monotonic()
        with pytest.raises(errors.PeerTimeoutError, match=r"build_sequential_on_root: weights"):
            lp.build_sequential_on_root()
        assert DEADLINE <= time.monotonic() - t0 < DEADLINE + SLACK
    comm.Barrier()


def test_gru_parallel_forward_without_one_rank_times_out(comm: MPI.Comm) -> None:
    from torchhpc.braid import GRUParallel

    gru = GRUParallel(comm, 3, 4, dtype=torch.float64, timeout=DEADLINE)
    x = torch.ones(2, 4 * comm.Get_size(), 3, dtype=torch.float64)
    others_time_out(comm, lambda: gru(x), r"did not complete within 3 s")


# ---------------------------------------------------------------- torchhpc.runtime.waiting.agreed itself
def test_all_ok_passes(comm: MPI.Comm) -> None:
    ran = []
    with waiting.agreed(comm, 10.0, "nothing"):
        ran.append(comm.Get_rank())
    assert comm.allgather(ran) == [[r] for r in range(comm.Get_size())]  # every body ran, nothing was raised


def test_one_rank_fails_every_rank_raises_naming_it(comm: MPI.Comm) -> None:
    bad = comm.Get_size() - 1
    if comm.Get_rank() == bad:
        with pytest.raises(ValueError, match="broken input"), waiting.agreed(comm, 10.0, "Thing()"):
            raise ValueError("broken input")
    else:
        expected = rf"Thing\(\) failed on 1 of {comm.Get_size()} ranks \(rank {bad}: ValueError: broken input\)"
        with pytest.raises(errors.RemoteError, match=expected) as info, waiting.agreed(comm, 10.0, "Thing()"):
            pass
        assert info.value.rank == bad and "broken input" in info.value.remote_message


def test_two_ranks_fail_each_keeps_its_own_and_hears_of_the_other(comm: MPI.Comm) -> None:
    me = comm.Get_rank()
    if me < 2:
        with pytest.raises(KeyError) as info, waiting.agreed(comm, 10.0, "Two()"):
            raise KeyError(f"k{me}")
        notes = getattr(info.value, "__notes__", [])
        if sys.version_info >= (3, 11):  # add_note: Python 3.10 has no notes to carry it
            assert notes and f"rank {1 - me}: KeyError" in notes[0], notes
    else:
        with pytest.raises(errors.RemoteError) as info, waiting.agreed(comm, 10.0, "Two()"):
            pass
        assert sorted(info.value.failures) == [0, 1] and info.value.rank == 0


def test_missing_rank_gives_peer_timeout(comm: MPI.Comm) -> None:
    side = comm.Dup()
    try:
        if side.Get_rank() == 0:
            t0 = time.monotonic()
            with pytest.raises(errors.PeerTimeoutError, match="every rank must call it"):
                waiting.agree(side, None, 0.3, "Lonely()")
            assert time.monotonic() - t0 < 5.0
            comm.Barrier()
            waiting.ABANDONED.pop()[0][0].Wait()  # the late peers complete the abandoned step
        else:
            comm.Barrier()
            waiting.agree(side, None, 10.0, "Lonely()")  # joins late: all ok
    finally:
        side.Free()
