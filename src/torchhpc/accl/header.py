"""A group's header exchange: the slot buffers, one all-gather of them per checked collective, the
agreement check and the local reduction of payloads that rode in the slots (layout: :mod:`.wire`)."""

from __future__ import annotations

import contextlib

import numpy as np
import torch
from mpi4py import MPI

from ..errors import MismatchError
from . import wire
from .reduction import RedOp, check_reduction, mpi_reduction

__all__ = ["HeaderExchange", "Reduction"]

_fromaddress = MPI.buffer.fromaddress
_SLOT = wire.SLOT_BYTES
_PAYLOAD = wire.HEADER_BYTES


class Reduction:
    """What a (dtype, op) reduction needs on the hot path, computed once per group and pair."""

    __slots__ = ("dtype", "dcode", "ocode", "esz", "mpi_type", "mpi_op", "avg", "op", "engine_op")

    def __init__(self, dtype: torch.dtype, op: RedOp, what: str):
        check_reduction(dtype, op, what)  # raises a clear error for a bad pair
        self.dtype = dtype
        self.op = op
        self.dcode = wire.dtype_code(dtype)
        self.ocode = wire.op_code(op)
        self.esz = dtype.itemsize
        self.avg = op == RedOp.AVG
        self.engine_op = RedOp.SUM if self.avg else op  # AVG runs as SUM; the plan divides afterwards
        self.mpi_type, self.mpi_op = mpi_reduction(dtype, self.engine_op)


class HeaderExchange:
    """One slot per rank, all-gathered on the group's control communicator (one exchange at a time:
    collectives run in order, so two buffers serve the group)."""

    def __init__(self, ctl: MPI.Comm, group: str = ""):
        self.rank, self.size = ctl.Get_rank(), ctl.Get_size()
        self.group = group
        p = self.size
        self.mine = bytearray(_SLOT)
        self.all = bytearray(_SLOT * p)
        self.mine_mb = MPI.buffer(self.mine)  # slice-assignable from another MPI.buffer
        self.all_mb = MPI.buffer(self.all)
        self._all_np = np.frombuffer(self.all, dtype=np.int64).reshape(p, _SLOT // 8)
        self._peer_offsets = [r * _SLOT for r in range(p) if r != self.rank]
        self._specs = ([self.mine, _SLOT, MPI.BYTE], [self.all, _SLOT, MPI.BYTE])
        self._ctl = ctl
        #: MPI-4 persistent all-gather, the cheapest to start; None where the MPI library lacks it
        self.persistent: MPI.Prequest | None
        try:
            self.persistent = ctl.Allgather_init(*self._specs)
        except (NotImplementedError, MPI.Exception):
            self.persistent = None
        self._row_specs: dict[int, tuple[list, list[list], MPI.buffer]] = {}
        self._matrix: dict[int, object] = {}

    def start(self) -> MPI.Request:
        """Start the all-gather of the packed slot ``mine`` (complete it before the next start)."""
        req = self.persistent
        if req is not None:
            req.Start()
            return req
        return self._ctl.Iallgather(*self._specs)

    def agrees(self, compare: int = wire.COMPARE_ALL) -> bool:
        """Whether every rank's leading ``compare`` header fields equal this rank's (byte compare)."""
        if len(self._peer_offsets) > 8:  # many ranks: one vectorised compare
            h = self._all_np[:, :compare]
            return bool((h == h[self.rank]).all())
        n = compare * 8
        key = self.mine[:n]
        allb = self.all
        for off in self._peer_offsets:  # noqa: SIM110 - a plain loop is the cheapest for few ranks
            if allb[off: off + n] != key:
                return False
        return True

    def check(self, compare: int = wire.COMPARE_ALL) -> None:
        """Raise :class:`MismatchError` naming the differing fields unless every rank agrees."""
        if not self.agrees(compare):
            heads = [wire.unpack_header(self.all, r * _SLOT) for r in range(self.size)]
            raise MismatchError(wire.describe_mismatch(heads, compare, self.group))

    # ------------------------------------------------------------------ payloads
    def put_payload(self, addr: int, nbytes: int, offset: int = 0) -> None:
        """Copy ``nbytes`` at address ``addr`` into this rank's payload area, from byte ``offset`` on."""
        if nbytes:
            at = _PAYLOAD + offset
            self.mine_mb[at: at + nbytes] = _fromaddress(addr, nbytes)

    def reduce_payloads(self, red: Reduction, nbytes: int, addr: int, offset: int = 0) -> None:
        """Reduce every rank's ``nbytes`` of payload from byte ``offset`` on, in rank order, with MPI's own
        op (as the large path does, so results do not depend on the message size), and write the result
        to ``addr``."""
        if not nbytes:
            return
        key = (red.dcode << 16 | nbytes) << 16 | offset  # nbytes, offset < PAYLOAD_BYTES < 2**16
        cached = self._row_specs.get(key)
        if cached is None:
            cached = self._row_specs[key] = self._rows_of(red, nbytes, offset)
        acc, rest, result = cached
        mop = red.mpi_op
        for spec in rest:
            mop.Reduce_local(spec, acc)
        _fromaddress(addr, nbytes)[:] = result

    def _rows_of(self, red: Reduction, nbytes: int, offset: int) -> tuple[list, list[list], MPI.buffer]:
        """Buffer specs of every rank's payload row (the first accumulates) and the result's bytes."""
        if len(self._row_specs) >= 256:  # bounded: one entry per (dtype, size, offset) seen
            self._row_specs.clear()
        count = nbytes // red.esz
        base = self.all_mb.address + _PAYLOAD + offset
        specs = [[_fromaddress(base + r * _SLOT, nbytes), count, red.mpi_type] for r in range(self.size)]
        return specs[0], specs[1:], self.all_mb[_PAYLOAD + offset: _PAYLOAD + offset + nbytes]

    def get_payload(self, rank: int, addr: int, nbytes: int, offset: int = 0) -> None:
        """Copy ``nbytes`` of ``rank``'s gathered payload, from byte ``offset`` on, to address ``addr``."""
        if nbytes:
            at = rank * _SLOT + _PAYLOAD + offset
            _fromaddress(addr, nbytes)[:] = self.all_mb[at: at + nbytes]

    def put_words(self, words: list[int]) -> None:
        """Write int64 ``words`` into this rank's payload area (all_to_all's byte-matrix row)."""
        st = self._matrix.get(len(words))
        if st is None:
            import struct

            st = self._matrix[len(words)] = struct.Struct(f"={len(words)}q")
        st.pack_into(self.mine, _PAYLOAD, *words)  # type: ignore[attr-defined]

    def payload_equal(self, nbytes: int) -> bool:
        """Whether every rank's first ``nbytes`` of payload equal this rank's."""
        mine = self.mine[_PAYLOAD: _PAYLOAD + nbytes]
        allb = self.all
        return all(allb[o + _PAYLOAD: o + _PAYLOAD + nbytes] == mine for o in self._peer_offsets)

    def payload_words(self, n: int) -> list[list[int]]:
        """Every rank's first ``n`` int64 payload words."""
        return self._all_np[:, _PAYLOAD // 8: _PAYLOAD // 8 + n].tolist()

    def free(self) -> None:
        """Release the persistent request."""
        if self.persistent is not None:
            with contextlib.suppress(MPI.Exception):
                self.persistent.Free()
            self.persistent = None
