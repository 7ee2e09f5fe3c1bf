"""A group's header exchange, as the Python side sees it: the compiled core's slots (layout: :mod:`.wire`),
the agreement check with its error text, and the per-(dtype, op) reduction facts the calls need."""

from __future__ import annotations

import torch

from ..errors import MismatchError
from . import wire
from .reduction import RedOp, check_reduction, mpi_reduction

__all__ = ["HeaderExchange", "Reduction"]

_SLOT = wire.SLOT_BYTES


class Reduction:
    """What a (dtype, op) reduction needs on the hot path, computed once per group and pair."""

    __slots__ = ("dtype", "dcode", "ocode", "esz", "mpi_type", "mpi_op", "avg", "op", "engine_op", "core")

    def __init__(self, dtype: torch.dtype, op: RedOp, what: str):
        check_reduction(dtype, op, what)  # raises a clear error for a bad pair
        self.dtype = dtype
        self.op = op
        self.dcode = wire.dtype_code(dtype)
        self.ocode = wire.op_code(op)
        self.esz = dtype.itemsize
        self.avg = op == RedOp.AVG
        self.engine_op = RedOp.SUM if self.avg else op  # AVG runs as SUM; the call divides afterwards
        self.mpi_type, self.mpi_op = mpi_reduction(dtype, self.engine_op)
        #: what the compiled core's calls take: (esz, dcode, ocode, MPI datatype handle, MPI op handle)
        self.core = (self.esz, self.dcode, self.ocode, self.mpi_type.handle, self.mpi_op.handle)


class _Persistent:
    """The exchange's persistent request, as a handle whose ``Free()`` makes it fall back to Iallgather."""

    def __init__(self, core) -> None:  # noqa: ANN001 - the core's Group
        self._core = core

    def Free(self) -> None:  # noqa: N802 - MPI's name
        self._core.drop_persistent()


class HeaderExchange:
    """One slot per rank, all-gathered on the group's control communicator by the compiled core (one
    exchange at a time: collectives run in order, so two buffers serve the group)."""

    def __init__(self, core, group: str = "") -> None:  # noqa: ANN001 - the core's Group
        self.core = core
        self.rank, self.size = core.rank, core.size
        self.group = group
        self.mine, self.all = core.mine, core.all  # bytearrays the core owns
        self.start = core.start
        self.test = core.test

    @property
    def persistent(self) -> _Persistent | None:
        """The MPI-4 persistent all-gather in use, or None where the library lacks it (or it was freed)."""
        return _Persistent(self.core) if self.core.persistent else None

    @persistent.setter
    def persistent(self, value: object) -> None:
        if value is None:
            self.core.drop_persistent()

    def check(self, compare: int = wire.COMPARE_ALL) -> None:
        """Raise :class:`MismatchError` naming the differing fields unless every rank agrees."""
        if not self.core.agrees(compare):
            heads = [wire.unpack_header(self.all, r * _SLOT) for r in range(self.size)]
            raise MismatchError(wire.describe_mismatch(heads, compare, self.group))

    def free(self) -> None:
        """Release the persistent request."""
        self.core.drop_persistent()
