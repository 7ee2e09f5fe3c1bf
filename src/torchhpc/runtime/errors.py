"""The one error hierarchy of torchhpc: every subpackage raises these (or subclasses of them).

``TorchhpcError`` is the base.  A wait on peers that passed its deadline is a :class:`PeerTimeoutError`,
which is also a ``torch.distributed.DistBackendError`` (what torch code catches from a backend) and a
builtin ``TimeoutError``; dead peers are a :class:`PeerFailedError`; ranks that called a collective with
different arguments get a :class:`MismatchError` (also a ``ValueError``); a rank told that another rank
raised gets a :class:`RemoteError` naming that rank.

The two that are also torch's ``DistBackendError`` are made when first asked for (PEP 562), so that importing the
family, and ``torchhpc.launcher`` with it, does not import torch (``import torchhpc`` reads the launcher's
variables before the user's script imports torch).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

__all__ = ["TorchhpcError", "PeerTimeoutError", "PeerFailedError", "MismatchError", "RemoteError",  # noqa: F822
           "LauncherError", "EngineUnavailableError"]


class TorchhpcError(RuntimeError):
    """Base of every error torchhpc raises on purpose."""


class MismatchError(TorchhpcError, ValueError):
    """Ranks called the same collective with different arguments (kinds, dtypes, sizes, ops, roots)."""


class RemoteError(TorchhpcError):
    """Another rank raised inside a collective call this rank was also in.

    ``rank`` is the (first) failing rank, ``remote_message`` its error as text, and ``failures`` maps
    every failing rank to its error text."""

    def __init__(self, message: str, rank: int, remote_message: str,
                 failures: dict[int, str] | None = None) -> None:
        super().__init__(message)
        self.rank = rank
        self.remote_message = remote_message
        self.failures = dict(failures) if failures else {rank: remote_message}


class LauncherError(TorchhpcError):
    """The job's launch environment is missing, malformed or contradictory."""


class EngineUnavailableError(TorchhpcError):
    """A backend or native engine is not built or not present; the message says what and how to get it."""


def _torch_errors() -> None:
    """Define the errors that are also torch's ``DistBackendError`` (imports torch)."""
    from torch.distributed import DistBackendError

    class PeerTimeoutError(TorchhpcError, DistBackendError, TimeoutError):
        """A wait on peer ranks passed its deadline (a peer died, hung, or did not make the matching call).

        ``requests`` holds the operations still pending (MPI requests, kept alive by
        :mod:`torchhpc.runtime.waiting`)."""

        def __init__(self, message: str, requests: Sequence[Any] = ()) -> None:
            super().__init__(message)
            self.requests = list(requests)

    class PeerFailedError(TorchhpcError, DistBackendError):
        """Peer processes died (MPI reported it, e.g. ULFM's ``MPI_ERR_PROC_FAILED``).

        ``failed_ranks`` holds their ranks in the group concerned (empty when MPI could not say)."""

        def __init__(self, message: str, failed_ranks: Sequence[int] = ()) -> None:
            super().__init__(message)
            self.failed_ranks = tuple(failed_ranks)

    for cls in (PeerTimeoutError, PeerFailedError):
        cls.__qualname__ = cls.__name__  # pickled and printed as torchhpc.runtime.errors.<name>
        globals()[cls.__name__] = cls


_made = threading.Lock()


def __getattr__(name: str) -> type:
    if name in ("PeerTimeoutError", "PeerFailedError"):
        with _made:  # one class each, whichever thread asks first: isinstance must hold across threads
            if name not in globals():
                _torch_errors()
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
