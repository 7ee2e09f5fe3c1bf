"""The collective-engine interface under the ``"accl"`` process group.

The process group (``process_group.py``) owns everything torch-facing: argument checks,
cross-rank consistency checks, segmentation, staging, ordering, timeouts.  An engine only
moves bytes for one *segment* at a time, on flat CPU (or, where it says so, device) tensors,
and returns a :class:`Request` right away.  Two engines exist: :class:`~.mpi_engine.MpiEngine`
(mpi4py, always available) and :class:`~.accl_engine.AcclEngine` (pyaccl).

Shapes every engine receives (``p`` = group size, tensors 1-D unless noted):

- ``allreduce(buf, op)``, ``reduce(buf, op, root)``: in place (``reduce``: result on ``root``).
- ``broadcast(buf, root)``.
- ``allgather(send, recv)``, ``gather(send, recv, root)``: ``recv`` is 2-D ``[p, len(send)]`` whose
  rows may be strided (a column slice of a bigger buffer), or any contiguous tensor of
  ``p * len(send)`` elements; ``gather``'s ``recv`` is None off-root.
- ``scatter(send, recv, root)``: ``send`` 2-D ``[p, len(recv)]`` (None off-root), rows may be strided.
- ``reduce_scatter(send, recv, op)``: ``send`` contiguous, ``p * len(recv)`` elements.
- ``alltoall(send, recv)``: both 2-D ``[p, c]``, rows may be strided.
- ``alltoallv(send, scounts, sdispls, recv, rcounts, rdispls)``: uint8 tensors, byte counts/offsets.
- ``send(buf, dst, tag, channel)``/``recv(buf, src, tag, channel)``: ``channel`` 0 or 1 are two
  independent matching spaces (the group uses 0 for headers, 1 for payload segments);
  ``src`` may be ``-1`` for any source.
- ``barrier()``.

Every call takes ``mode`` (:class:`Mode`), chosen by the executor per call: start nonblocking, make the
blocking call in the calling thread, or make it on the engine's worker thread.  Engines keep no
mode state between calls.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from typing import Protocol

import torch

from .. import errors
from .reduction import RedOp

__all__ = ["Request", "CollectiveEngine", "EngineUnavailableError", "Mode"]

EngineUnavailableError = errors.EngineUnavailableError  # old name, kept importable from here


class Mode(enum.IntEnum):
    """How an engine carries out one call (blocking and nonblocking MPI collectives never match, so
    every rank must pick the same kind for the same call: the executor decides from the call alone)."""

    NONBLOCKING = 0  # start an MPI-3 ``I*`` operation and return its request
    BLOCKING = 1  # make MPI's blocking (tuned) call in the calling thread; return a completed request
    WORKER = 2  # make the blocking call on the engine's worker thread; return a request to poll


class Request(Protocol):
    """A started engine operation."""

    def test(self) -> bool:
        """Return True once complete (never blocks); raise the engine's error if it failed."""
        ...

    def source(self) -> int:
        """For a receive: the rank the message came from (meaningful once complete)."""
        ...

    def nbytes(self) -> int:
        """For a receive: how many bytes arrived (meaningful once complete)."""
        ...


class CollectiveEngine(ABC):
    """Moves one segment of a collective; see the module docstring for buffer shapes."""

    name: str = "engine"

    @abstractmethod
    def supports(self, collective: str, dtype: torch.dtype | None = None, op: RedOp | None = None) -> bool:
        """Whether this engine carries out ``collective`` for ``dtype``/``op`` itself."""

    def accepts(self, device: torch.device) -> bool:
        """Whether tensors on ``device`` may be handed over directly (else they are staged on the host)."""
        return device.type == "cpu"

    @abstractmethod
    def allreduce(self, buf: torch.Tensor, op: RedOp, mode: Mode = Mode.NONBLOCKING) -> Request: ...

    @abstractmethod
    def broadcast(self, buf: torch.Tensor, root: int, mode: Mode = Mode.NONBLOCKING) -> Request: ...

    @abstractmethod
    def reduce(self, buf: torch.Tensor, op: RedOp, root: int, mode: Mode = Mode.NONBLOCKING) -> Request: ...

    @abstractmethod
    def allgather(self, send: torch.Tensor, recv: torch.Tensor, mode: Mode = Mode.NONBLOCKING) -> Request: ...

    @abstractmethod
    def gather(self, send: torch.Tensor, recv: torch.Tensor | None, root: int,
               mode: Mode = Mode.NONBLOCKING) -> Request: ...

    @abstractmethod
    def scatter(self, send: torch.Tensor | None, recv: torch.Tensor, root: int,
                mode: Mode = Mode.NONBLOCKING) -> Request: ...

    @abstractmethod
    def reduce_scatter(self, send: torch.Tensor, recv: torch.Tensor, op: RedOp,
                       mode: Mode = Mode.NONBLOCKING) -> Request: ...

    @abstractmethod
    def alltoall(self, send: torch.Tensor, recv: torch.Tensor, mode: Mode = Mode.NONBLOCKING) -> Request: ...

    @abstractmethod
    def alltoallv(self, send: torch.Tensor, scounts: list[int], sdispls: list[int],
                  recv: torch.Tensor, rcounts: list[int], rdispls: list[int],
                  mode: Mode = Mode.NONBLOCKING) -> Request: ...

    @abstractmethod
    def send(self, buf: torch.Tensor, dst: int, tag: int, channel: int = 1) -> Request: ...

    @abstractmethod
    def recv(self, buf: torch.Tensor, src: int, tag: int, channel: int = 1) -> Request: ...

    @abstractmethod
    def barrier(self, mode: Mode = Mode.NONBLOCKING) -> Request: ...

    def close(self) -> None:  # noqa: B027 - optional hook, nothing to release by default
        """Release the engine's resources (communicators, device handles)."""
