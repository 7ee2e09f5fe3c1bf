"""torchhpc.waiting across ranks: an error on one rank inside ``agreed`` becomes an error on every rank."""

import time

import pytest
from mpi4py import MPI

from torchhpc import errors, waiting

MPI_RANKS = (2, 3)
MPI_VARIANTS = ("mpich",)


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
