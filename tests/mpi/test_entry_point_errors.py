"""A rank-local error in any collective entry point is an error on every rank (issue 11, reproduction 3),
and the helper behind it, ``torchhpc.waiting.agreed``, across ranks.

One rank gets a bad argument (or a bad launch environment); it raises its own error and every other
rank raises :class:`~torchhpc.errors.RemoteError` naming that rank and the error, within seconds,
instead of waiting in the entry point's first collective.  (accl group creation: test_accl_groups.py.)
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import pytest
import torch
from mpi4py import MPI
from torch import nn

from torchhpc import errors, waiting

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
    from torchhpc.chunkstore import ChunkTensor

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


# ---------------------------------------------------------------- torchhpc.waiting.agreed itself
def test_all_ok_passes(comm: MPI.Comm) -> None:
    with waiting.agreed(comm, 10.0, "nothing"):
        pass


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
        if comm.Get_size() > 1 and notes:
            assert f"rank {1 - me}: KeyError" in notes[0]
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
