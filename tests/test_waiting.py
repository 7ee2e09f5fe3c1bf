"""The one error hierarchy (torchhpc.runtime.errors) and the one wait (torchhpc.runtime.waiting), without MPI jobs."""

from __future__ import annotations

import time

import pytest
import torch.distributed as dist

from torchhpc.runtime import errors, waiting


def test_peer_timeout_is_dist_backend_error_and_timeout_error() -> None:
    err = errors.PeerTimeoutError("late", ["req"])
    assert isinstance(err, errors.TorchhpcError)
    assert isinstance(err, dist.DistBackendError)
    assert isinstance(err, TimeoutError)
    assert isinstance(err, RuntimeError)
    assert err.requests == ["req"]
    assert isinstance(errors.MismatchError("x"), ValueError)
    failed = errors.PeerFailedError("dead", [3])
    assert isinstance(failed, dist.DistBackendError) and failed.failed_ranks == (3,)
    remote = errors.RemoteError("rank 2 failed", 2, "ValueError: bad")
    assert (remote.rank, remote.failures) == (2, {2: "ValueError: bad"})


def test_each_error_has_one_class_wherever_it_is_imported() -> None:
    from torchhpc import accl, launcher
    from torchhpc.braid import transport
    from torchhpc.rehearsal import buffer  # noqa: F401  (imports errors the same way)

    assert not any(name.startswith("Accl") and name.endswith("Error") for name in dir(accl))
    assert accl.EngineUnavailableError is errors.EngineUnavailableError
    assert transport.PeerTimeoutError is errors.PeerTimeoutError
    assert launcher.LauncherError is errors.LauncherError


def test_wait_until_returns_when_true_and_times_out_naming_what() -> None:
    t_end = time.monotonic() + 0.05
    waiting.wait_until(lambda: time.monotonic() > t_end, 5.0, "soon")
    t0 = time.monotonic()
    with pytest.raises(errors.PeerTimeoutError, match="the thing did not complete within 0.1 s"):
        waiting.wait_until(lambda: False, 0.1, lambda: "the thing")
    assert 0.1 <= time.monotonic() - t0 < 2.0


def test_backoff_spins_then_yields_then_sleeps_capped() -> None:
    b = waiting.Backoff()
    assert all(b.pause() == 0.0 for _ in range(b.SPINS))  # spinning: no clock read, no pause
    assert b.pause() > 0.0
    b._t0 -= 1.0  # pretend the yield phase is over
    for _ in range(20):
        b.pause()
    assert b._sleep == b.CAP_S


def test_agreed_single_rank_reraises_own_error() -> None:
    from mpi4py import MPI

    with pytest.raises(ValueError, match="mine"), waiting.agreed(MPI.COMM_SELF, 1.0, "thing"):
        raise ValueError("mine")
    with waiting.agreed(MPI.COMM_SELF, 1.0, "thing"):
        pass


def test_barrier_and_allgather_on_one_rank() -> None:
    from mpi4py import MPI

    waiting.barrier(MPI.COMM_SELF, 1.0, "nothing")
    assert waiting.allgather_object(MPI.COMM_SELF, {"a": 1}, 1.0, "thing") == [{"a": 1}]
    assert waiting.allgather_bytes(MPI.COMM_SELF, b"", 1.0, "thing") == [b""]


def test_remote_error_may_keep_the_failing_rank_type() -> None:
    """agree(keep_type=True): the others' RemoteError is also the failing rank's builtin exception type."""
    cls = waiting._remote_error_class("ValueError")
    err = cls("Thing() failed on 1 of 2 ranks", 1, "ValueError: bad")
    assert isinstance(err, errors.RemoteError) and isinstance(err, ValueError) and err.rank == 1
    assert waiting._remote_error_class("NoSuchError") is errors.RemoteError
    assert waiting._remote_error_class("RuntimeError") is errors.RemoteError
