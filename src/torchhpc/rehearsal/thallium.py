"""Slot storage whose peers read it over Thallium (Mochi RPC + bulk RDMA) instead of MPI RMA.

The record block is the same host tensor :class:`SlotStorage` uses; the ``_torchhpc_thallium``
extension (``make native-mochi``) exposes it as a bulk region of a Thallium engine whose Argobots
progress stream serves peers without this rank's Python threads.  A draw sends each owner one
RPC naming the wanted records; the owner pushes their fields (bulk transfers from the exposed block)
straight into the reader's output rows while holding its block lock shared.  The owner's updates hold the same lock
exclusively, so a record is never read half-written: the guarantee the MPI transport gets from its
exclusive/shared window locks.  Engine addresses are exchanged through MPI at construction, and so is the job's
secret (32 random bytes from rank 0) that every request carries: an engine serves the job's ranks only, and
anyone else who reaches its port is refused.
"""

from __future__ import annotations

import json
import os
import secrets
import socket

import numpy as np
from mpi4py import MPI

from torchhpc.runtime import native
from torchhpc.runtime.errors import PeerFailedError, PeerTimeoutError, TorchhpcError
from torchhpc.runtime.waiting import agreed, barrier, wait_requests

from .layout import RecordLayout
from .options import PROTOCOLS
from .storage import SlotStorage

__all__ = ["PROTOCOLS", "ThalliumSlotStorage", "default_protocol", "spans_nodes"]

_ADDR_BYTES = 256
# Margo: a progress execution stream of its own (never the training thread) that also runs the RPC
# handlers (rpc_thread_count -1), and blocks in Mercury's progress rather than spinning after each operation
# (progress_spindown_msec 0; Margo's default spins 10 ms).  Measured here (2 cores, 2 ranks, na+sm, 16 records
# of 12 kB): a separate handler stream cost 10-30 ms per request (its idle stream sleeps); spinning progress
# threads of ranks fetching at once starved each other to 20 ms per request; this configuration ~0.3 ms.
MARGO_CONFIG = json.dumps({"use_progress_thread": True, "rpc_thread_count": -1, "progress_spindown_msec": 0})


def margo_config() -> str:
    """:data:`MARGO_CONFIG`, updated by the JSON object in ``TORCHHPC_MARGO_CONFIG`` if set (Margo's keys)."""
    extra = os.environ.get("TORCHHPC_MARGO_CONFIG", "").strip()
    if not extra:
        return MARGO_CONFIG
    try:
        update = json.loads(extra)
    except json.JSONDecodeError as exc:
        raise ValueError(f"TORCHHPC_MARGO_CONFIG is not JSON ({exc}): {extra!r}") from None
    if not isinstance(update, dict):
        raise ValueError(f"TORCHHPC_MARGO_CONFIG must be a JSON object, got {extra!r}")
    return json.dumps({**json.loads(MARGO_CONFIG), **update})
_WHAT = "RehearsalBuffer(transport='thallium')"


def spans_nodes(comm: MPI.Comm) -> bool:
    """Whether the ranks of ``comm`` are on more than one node (collective)."""
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    one_node = node.Get_size() == comm.Get_size()
    node.Free()
    return not one_node


def tcp_listen_address(hosts: list[str], rank: int) -> str:
    """The IPv4 address rank ``rank`` of ``hosts`` (each rank's host name) listens on over ``ofi+tcp``: the one its
    kernel sends the first other host's traffic from; loopback when every rank is on this host.

    Named because Mercury, given none, takes one of the host's TCP domains round-robin by the first CPU the
    creating thread may run on, loopback among them: a rank bound to CPU 1 of a node with one network interface
    listened on 127.0.0.1, and no rank of another node could reach it."""
    others = [h for h in hosts if h != hosts[rank]]
    if not others:
        return "127.0.0.1"
    try:
        peer = socket.getaddrinfo(others[0], None, socket.AF_INET, socket.SOCK_DGRAM)[0][4][0]
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((peer, 9))  # a datagram socket's connect only asks the routing table: nothing is sent
            return probe.getsockname()[0]
    except OSError as exc:
        raise TorchhpcError(
            f"{_WHAT}: cannot tell which address of {hosts[rank]} reaches {others[0]} over TCP ({exc}); "
            "the ranks' host names (MPI_Get_processor_name) must resolve to IPv4 addresses"
        ) from None


def default_protocol(comm: MPI.Comm) -> str:
    """``na+sm`` when every rank of ``comm`` shares this node, else ``ofi+tcp`` (collective)."""
    return "ofi+tcp" if spans_nodes(comm) else "na+sm"


class ThalliumSlotStorage(SlotStorage):
    """One rank's slot storage, served to and read from the other ranks of ``comm`` over Thallium."""

    def __init__(
        self, layout: RecordLayout, comm: MPI.Comm, pin: bool, protocol: str, timeout: float
    ) -> None:
        if protocol not in PROTOCOLS:
            raise ValueError(f"protocol must be one of {PROTOCOLS}, got {protocol!r}")
        super().__init__(layout, None, pin)  # a plain host block; the engine exposes it
        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.protocol = protocol
        self.timeout = float(timeout)
        self.transport = None
        secret = np.frombuffer(secrets.token_bytes(32), dtype=np.uint8).copy() if self.rank == 0 else \
            np.zeros(32, dtype=np.uint8)
        wait_requests([comm.Ibcast([secret, MPI.BYTE], root=0)], self.timeout, f"{_WHAT}: agreeing the job's secret",
                      keep=(secret,))
        listen = protocol
        if protocol == "ofi+tcp":  # the same on every rank: the host names are exchanged only where they are used
            name = MPI.Get_processor_name().encode()[: _ADDR_BYTES - 1]  # MPI_MAX_PROCESSOR_NAME: 256 in both
            hosts = [h.decode() for h in self._allgather(name, "host names")]
        with agreed(comm, self.timeout, _WHAT):  # a rank that cannot start its engine stops every rank
            if protocol == "ofi+tcp":
                listen = f"ofi+tcp://{tcp_listen_address(hosts, self.rank)}"
            ext = native.load("thallium")
            self._errors = (ext.PeerTimeout, ext.PeerError, ext.PeerUnreachable)
            self.transport = ext.Transport(
                listen, self.bytes.data_ptr(), layout.total_bytes, layout.header_bytes, layout.record_bytes,
                layout.num_classes, margo_config(), secret.tobytes(),
            )
            mine = self.transport.address().encode()
            if len(mine) >= _ADDR_BYTES:
                raise TorchhpcError(f"Thallium address {mine!r} is longer than {_ADDR_BYTES - 1} bytes")
        addresses = [a.decode() for a in self._allgather(mine, "engine addresses")]
        with agreed(comm, self.timeout, _WHAT):
            self.transport.connect(addresses, self.rank)
        self.addresses = addresses

    def _allgather(self, mine: bytes, what: str) -> list[bytes]:
        """Every rank's ``mine`` (checked by the caller to be under :data:`_ADDR_BYTES` bytes, on every rank) in
        rank order, within the deadline."""
        send = np.zeros(_ADDR_BYTES, dtype=np.uint8)
        send[: len(mine)] = np.frombuffer(mine, dtype=np.uint8)
        table = np.zeros((self.size, _ADDR_BYTES), dtype=np.uint8)
        hint = f"{_WHAT}: exchanging {what} over {self.size} ranks"
        wait_requests([self.comm.Iallgather([send, MPI.BYTE], [table, MPI.BYTE])], self.timeout, hint,
                      keep=(send, table))
        return [bytes(row).rstrip(b"\0") for row in table]

    @property
    def remote(self) -> bool:
        return self.transport is not None

    def _lock_exclusive(self) -> None:
        if self.transport is not None:
            self.transport.lock_exclusive()

    def _unlock_exclusive(self) -> None:
        if self.transport is not None:
            self.transport.unlock_exclusive()

    def begin_remote(self) -> None:
        """Nothing to open: each owner serves a read under its own lock."""

    def end_remote(self) -> None:
        """Nothing to close (see :meth:`begin_remote`)."""

    def flush(self) -> None:
        """Reads complete before :meth:`remote_read` returns."""

    def _call(self, fn, *args):  # noqa: ANN001, ANN202 -- the extension's methods, translated errors
        peer_timeout, peer_error, peer_unreachable = self._errors
        try:
            return fn(*args, self.timeout)
        except peer_timeout as exc:
            raise PeerTimeoutError(f"{_WHAT}: {exc}") from None
        except peer_unreachable as exc:
            rank = int(str(exc).split()[1])  # the message starts "rank <r> "
            raise PeerFailedError(f"{_WHAT}: {exc}", [rank]) from None
        except peer_error as exc:
            raise TorchhpcError(f"{_WHAT}: {exc}") from None

    def remote_fills(self, ranks: list[int]) -> np.ndarray:
        """Fill counts of ``ranks`` (one RPC each, concurrently); shape ``(len(ranks), K)``."""
        return self._call(self.transport.fills, list(ranks))

    def remote_read(self, ranks: np.ndarray, flat_slots: np.ndarray, out: dict[str, np.ndarray]) -> int:
        """Fetch record ``flat_slots[i]`` of rank ``ranks[i]`` into row ``i`` of ``out``, for every ``i`` not ours."""
        fields = [(out[name], offset) for name, offset, _ in self._field_spans if name in out]
        return self._call(
            self.transport.read, np.ascontiguousarray(ranks, dtype=np.int64),
            np.ascontiguousarray(flat_slots, dtype=np.int64), fields,
        )

    def free(self) -> None:
        """Wait until no rank can still read (collective, with a deadline), then stop the engine."""
        if self.transport is not None:
            try:
                barrier(self.comm, self.timeout, f"{_WHAT}.close()")
            finally:
                self.transport.close()
                self.transport = None
        super().free()
