"""Cross-node row fetches: ids over MPI, rows over MPI (or torch.distributed), one exchange of each.

A gather of rows held by other nodes is collective over the job and takes three all-to-all steps:

1. counts: how many rows each rank asks of each peer, one int64 per peer (``MPI_Ialltoall``,
   polled against a deadline so that a rank that never joins raises :class:`~torchhpc.runtime.errors.PeerTimeoutError`
   instead of hanging its peers).  A negative count tells the peers that this rank's gather
   failed (bad index, ...): every rank then raises, nobody is left waiting.
2. ids: the requested storage positions (``MPI_Ialltoallv`` of int64, waited on with the same deadline).
3. rows: the serving ranks gather the rows into a reused buffer, which moves as raw bytes (every dtype alike).
   Host rows go by ``MPI_Ialltoallv`` over the same communicator, in whole rows (a contiguous datatype, so no
   count overflows), waited on with the deadline; with ``row_transport="group"``, and always with an NCCL
   group, by one ``torch.distributed.all_to_all_single`` over the group (GPU to GPU with NCCL).  When the
   caller's output is contiguous, on the transport's device, and the rows arrive in its order, they are
   received straight into it.  MPI rather than the group's gloo for host rows: across a 10 Gbit/s link
   gathers of 1-8 MB per call ran at 1.0 GB/s with MPI and 0.58-0.70 with gloo (docs/vcluster.md).

Counts and ids are small host-side metadata: MPI moves them in microseconds (shared memory on a
node, the fabric's eager protocol across nodes), where a gloo collective costs hundreds.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist
from mpi4py import MPI

from ..runtime.errors import PeerTimeoutError
from ..runtime.waiting import wait_requests

__all__ = ["RowExchange"]

# Negative counts sent in step 1 by a rank whose gather failed before the exchange: the error type.
_FAIL_CODES: dict[int, type[Exception]] = {-1: RuntimeError, -2: IndexError, -3: TypeError, -4: ValueError}


def _fail_code(error: BaseException) -> int:
    for code, typ in _FAIL_CODES.items():
        if code != -1 and isinstance(error, typ):
            return code
    return -1


def _peer_error(codes: np.ndarray) -> Exception:
    """The error every rank raises when ranks sent failure codes: the first failing rank's error type."""
    bad = [int(r) for r in np.flatnonzero(codes < 0)]
    typ = _FAIL_CODES.get(int(codes[bad[0]]), RuntimeError)
    return typ(f"on rank(s) {bad}: the collective ChunkTensor gather was refused there (bad index or "
               f"arguments; see that rank's error)")


class RowExchange:
    """Reusable state of one ChunkTensor's cross-node gathers: peers, deadline and buffers.

    ``comm`` and ``group`` hold the same ranks in the same order.  The send and receive buffers
    grow to the largest gather seen and are kept (``buffer_bytes``), so repeated minibatch
    gathers neither allocate nor fault in fresh pages; :meth:`close` drops them.
    """

    def __init__(self, comm: MPI.Comm, group: dist.ProcessGroup | None, comm_device: torch.device,
                 row_bytes: int, timeout: float, row_transport: str = "mpi"):
        self.comm = comm
        self.group = group
        self.comm_device = comm_device
        self.row_bytes = row_bytes
        self.timeout = float(timeout)
        self.size = comm.Get_size()
        self._send_counts = np.zeros(self.size, dtype=np.int64)
        self._recv_counts = np.zeros(self.size, dtype=np.int64)
        self._bufs: dict[str, torch.Tensor] = {}
        self._abandoned: list[MPI.Request] = []  # a timed-out step: the exchange is unusable after it
        self.by_mpi = comm_device.type == "cpu" and row_transport == "mpi"  # else over the group
        self._row = MPI.BYTE.Create_contiguous(row_bytes).Commit() if row_bytes and self.by_mpi else None

    # ------------------------------------------------------------------ helpers
    @property
    def buffer_bytes(self) -> int:
        return sum(b.numel() for b in self._bufs.values())

    def _buffer(self, name: str, rows: int) -> torch.Tensor:
        """``rows`` x ``row_bytes`` uint8 rows of a kept buffer, grown by at least a quarter when short."""
        buf = self._bufs.get(name)
        if buf is None or buf.shape[0] < rows:
            have = 0 if buf is None else buf.shape[0]
            self._bufs.pop(name, None)
            buf = torch.empty((max(rows, have + have // 4), self.row_bytes), dtype=torch.uint8,
                              device=self.comm_device)
            self._bufs[name] = buf
        return buf[:rows]

    def _exchange_counts(self, what: str) -> np.ndarray:
        if self._abandoned:
            raise RuntimeError("an earlier cross-node gather of this ChunkTensor timed out waiting for its "
                               "peers; the ranks no longer agree on the exchange, so it cannot be used again")
        req = self.comm.Ialltoall([self._send_counts, MPI.INT64_T], [self._recv_counts, MPI.INT64_T])
        self._wait(req, what, (self._send_counts, self._recv_counts))
        return self._recv_counts

    def _wait(self, req: MPI.Request, what: str, keep: tuple) -> None:
        """One step's collective within the deadline; a step given up leaves the exchange unusable (the ranks no
        longer agree on which step is which), as :meth:`_exchange_counts` then says."""
        try:
            wait_requests([req], self.timeout, what, keep=keep)
        except PeerTimeoutError as e:
            self._abandoned.append(req)
            raise PeerTimeoutError(f"{e}. A ChunkTensor spanning several nodes gathers collectively: every rank "
                                   f"must call index() (or the sampler) the same number of times, with any "
                                   f"number of ids (also none)", e.requests) from None

    # ------------------------------------------------------------------ the collective steps
    def fail(self, error: BaseException) -> None:
        """Join step 1 of the gather the peers are in, telling them it failed here (then re-raise ``error``)."""
        self._send_counts.fill(_fail_code(error))
        try:
            self._exchange_counts("collective gather (reporting a local error)")
        finally:
            self._send_counts.fill(0)

    def fetch(self, positions: torch.Tensor, dest: torch.Tensor,
              serve: Callable[[torch.Tensor, torch.Tensor], None],
              out_bytes: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Ask rank ``dest[i]`` for storage position ``positions[i]``; answer the peers' requests.

        ``serve(pos, into)`` writes the rows at this node's storage positions ``pos`` into the
        ``(len(pos), row_bytes)`` uint8 tensor ``into``.  Returns ``(got, order)``: ``got`` holds
        the rows as bytes, grouped by serving rank, and row ``i`` answers ``positions[order[i]]``;
        ``order`` is None when the rows arrived in request order.  Then, if ``out_bytes`` (a
        ``(len(positions), row_bytes)`` uint8 view of the caller's output on ``comm_device``) was
        given, ``got`` is ``out_bytes``, already filled.
        """
        n = positions.numel()
        order = None
        sc = self._send_counts
        if n:
            dest = dest.to(torch.int64)
            sc[:] = torch.bincount(dest, minlength=self.size).numpy()
            if n > 1 and not bool((dest[1:] >= dest[:-1]).all()):
                order = torch.argsort(dest, stable=True)
                positions = positions.index_select(0, order)
        else:
            sc.fill(0)
        rc = self._exchange_counts("collective gather")
        if (rc < 0).any():
            raise _peer_error(rc)
        m = int(rc.sum())
        send_pos = positions.to(torch.int64).contiguous().numpy()
        req_pos = np.empty(m, dtype=np.int64)
        sd = np.zeros(self.size, dtype=np.int64)
        rd = np.zeros(self.size, dtype=np.int64)
        np.cumsum(sc[:-1], out=sd[1:])
        np.cumsum(rc[:-1], out=rd[1:])
        # nonblocking, waited on with the deadline and backoff: a blocking Alltoallv spins without a deadline,
        # and with more ranks than cores the spinning ranks hold the cores their peers need (measured: 4 nodes'
        # ranks on 2 cores, 1,024-row gathers 4x slower)
        req = self.comm.Ialltoallv([send_pos, (sc, sd), MPI.INT64_T], [req_pos, (rc, rd), MPI.INT64_T])
        self._wait(req, "collective gather: the requested ids", (send_pos, req_pos, sd, rd))
        send = self._buffer("send", m)
        if m:
            serve(torch.from_numpy(req_pos), send)
        if out_bytes is not None and order is None:
            got = out_bytes
        else:
            got = self._buffer("recv", n)
        self._move_rows(send, (rc, rd), got, (sc, sd))  # each rank's ids come back as rows, the other way round
        return got, order

    def _move_rows(self, send: torch.Tensor, sends: tuple[np.ndarray, np.ndarray], got: torch.Tensor,
                   gets: tuple[np.ndarray, np.ndarray]) -> None:
        """Step 3: ``sends`` = (rows, first row) of ``send`` for each rank, ``gets`` likewise into ``got``."""
        (send_rows, sd), (got_rows, rd) = sends, gets
        if not self.by_mpi:
            dist.all_to_all_single(got, send, output_split_sizes=got_rows.tolist(),
                                   input_split_sizes=send_rows.tolist(), group=self.group)
            return
        if not self.row_bytes:  # rows of zero bytes: nothing moves
            return
        if self._row is None:
            raise RuntimeError("this ChunkTensor's row exchange is closed")
        out, into = send.detach().numpy(), got.detach().numpy()
        req = self.comm.Ialltoallv([out, (send_rows, sd), self._row], [into, (got_rows, rd), self._row])
        self._wait(req, "collective gather: the rows", (out, into, send_rows, got_rows, sd, rd))

    def close(self) -> None:
        self._bufs.clear()
        if self._row is not None:
            self._row.Free()
            self._row = None
